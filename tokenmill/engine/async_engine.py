"""Asynchronous front of the engine: one thread owns `LLMEngine`, requests get async streams.

Threading model (the why): `LLMEngine` is not thread-safe and `step()` blocks for a whole
forward pass, so exactly one thread — the engine thread — ever touches it. The asyncio side
never calls the engine; it posts *operations* (add, abort) to a queue that the engine thread
applies between steps, so a mutation can never race a step. Outputs travel back with
`loop.call_soon_threadsafe`, and only the event-loop thread touches the per-request streams.

Failure isolation: an exception while adding one request fails only that request. An
exception inside `step()` fails every in-flight request (their sequences were all in the
batch), aborts them so their KV blocks return to the pool, and the loop keeps running.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.lora.request import LoRARequest
from tokenmill.metrics import EngineMetrics, EngineSnapshot
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import SequenceStatus

if TYPE_CHECKING:
    from tokenmill.engine.llm_engine import LLMEngine

log = logging.getLogger("tokenmill")


class QueueFullError(RuntimeError):
    """More requests are waiting than `max_queue_len` allows; the client should retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread is gone (or shutting down); no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed while serving this request (e.g. an exception in step())."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    cache_salt: str | None
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(eq=False)
class RequestStream:
    """Async iterator over one request's `RequestOutput`s; ends after the finished one.

    Iterating raises the error that ended the request (ValueError for a prompt the engine
    rejected, RequestFailedError / EngineDeadError otherwise). `abort()` is idempotent and
    a no-op once the request finished; callers put it in a `finally`."""

    request_id: str
    _engine: "AsyncLLMEngine"
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False      # final output or error delivered, or aborted (loop thread)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def abort(self) -> None:
        self._engine.abort(self.request_id)

    # called by the engine, on the loop thread
    def _put(self, item: RequestOutput | BaseException) -> None:
        if self.finished:
            return
        if isinstance(item, BaseException) or item.finished:
            self.finished = True
        self._queue.put_nowait(item)


class AsyncLLMEngine:
    def __init__(self, engine: "LLMEngine", metrics: EngineMetrics | None = None,
                 max_queue_len: int | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queue_len = max_queue_len
        self._ops: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}      # loop thread only
        self._queued: set[str] = set()                     # submitted, no output yet (loop thread only)
        self.dead: BaseException | None = None
        self.num_step_errors = 0

    # ---- lifecycle (loop thread) -------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from inside the running event loop."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Fail whatever is still in flight and stop the engine thread."""
        self.abort_all("server shutting down")
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        if not self._thread or not self._thread.is_alive():
            await asyncio.to_thread(self.engine.close)      # tensor-parallel workers, if any

    @property
    def is_alive(self) -> bool:
        return (self.dead is None and self.engine.failure is None and self._thread is not None
                and self._thread.is_alive())

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests (loop thread) --------------------------------------------------------------
    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
               arrival_time: float | None = None, cache_salt: str | None = None,
               lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request and return its stream. Raises QueueFullError / EngineDeadError now;
        prompt errors the engine finds (ValueError) come out of the stream."""
        if not self.is_alive:
            raise EngineDeadError("engine is not running")
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        if self.max_queue_len is not None and len(self._queued) >= self.max_queue_len:
            raise QueueFullError(f"{len(self._queued)} requests are already queued (max_queue_len="
                                 f"{self.max_queue_len}); retry later")
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        self._queued.add(request_id)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._post(_Add(request_id, prompt, params, priority, arrival, cache_salt, lora_request))
        return stream

    def abort(self, request_id: str) -> None:
        """Drop a request (client gone). Its blocks are freed before the next step runs."""
        # a stream is in _streams exactly while the engine may still hold its request:
        # finished and failed ones were removed when their last item was delivered
        stream = self._streams.pop(request_id, None)
        self._queued.discard(request_id)
        if stream is not None:
            stream.finished = True
            self._post(_Abort(request_id))

    def abort_all(self, reason: str) -> None:
        for rid, stream in list(self._streams.items()):
            stream._put(EngineDeadError(reason))
            self.abort(rid)

    def _post(self, op: _Add | _Abort) -> None:
        self._ops.put(op)
        self._wake.set()

    # ---- delivery (loop thread, via call_soon_threadsafe) ------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:       # aborted meanwhile
                continue
            self._queued.discard(out.request_id)
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail(self, errors: dict[str, BaseException]) -> None:
        for rid, exc in errors.items():
            self._queued.discard(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._put(exc)

    def _to_loop(self, fn: Any, arg: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, arg)
            except RuntimeError:     # loop closed between the check and the call
                pass

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()
                self._apply_ops()
                if not self.engine.has_unfinished_requests():
                    self._publish_snapshot()
                    # idle: sleep until an op arrives (or the next log tick)
                    interval = self.metrics.log_interval if self.metrics and self.metrics.log_interval else 5.0
                    self._wake.wait(timeout=interval)
                    continue
                self._step()
        except BaseException as exc:   # a bug in this loop itself: report it, fail everyone
            log.exception("engine thread died")
            self.dead = exc
            self._to_loop(self._fail, {rid: EngineDeadError(f"engine thread died: {exc!r}")
                                       for rid in list(self._streams)})

    def _apply_ops(self) -> None:
        errors: dict[str, BaseException] = {}
        aborted: list[str] = []
        while True:
            try:
                op = self._ops.get_nowait()
            except queue.Empty:
                break
            if isinstance(op, _Abort):
                if op.request_id in self.engine.requests:
                    self.engine.abort_request(op.request_id)
                    aborted.append(op.request_id)
                errors.pop(op.request_id, None)
                continue
            try:
                self.engine.add_request(op.request_id, op.prompt, op.params, priority=op.priority,
                                        arrival_time=op.arrival_time, cache_salt=op.cache_salt,
                                        lora_request=op.lora_request)
            except Exception as exc:     # bad prompt for this request only
                errors[op.request_id] = exc if isinstance(exc, ValueError) else RequestFailedError(str(exc))
        if errors:
            self._to_loop(self._fail, errors)
        if aborted and self.metrics is not None:
            self.metrics.on_aborted(aborted)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.num_step_errors += 1
            log.exception("engine step failed; failing %d in-flight requests", len(self.engine.requests))
            failed = self._abort_everything()
            if self.metrics is not None:
                self.metrics.on_aborted(failed)
            err = RequestFailedError(f"engine step failed: {type(exc).__name__}: {exc}")
            self._to_loop(self._fail, {rid: err for rid in failed})
            self._publish_snapshot()
            return
        if self.metrics is not None:
            self.metrics.on_outputs(outputs)
        if outputs:
            self._to_loop(self._deliver, outputs)
        self._publish_snapshot()

    def _abort_everything(self) -> list[str]:
        """After a failed step: abort every request and make sure no sequence keeps blocks,
        even if the failure left the scheduler inconsistent."""
        rids = list(self.engine.requests)
        for rid in rids:
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
        sched = self.engine.scheduler
        for seq in list(sched.running) + list(sched.waiting):
            try:
                sched.finish(seq)
            except Exception:
                log.exception("could not free sequence %s", seq.seq_id)
        return rids

    def snapshot(self) -> EngineSnapshot:
        reqs = list(self.engine.requests.values())
        running = sum(1 for r in reqs if any(s.status is SequenceStatus.RUNNING for s in r.seqs))
        bm = self.engine.block_manager
        spec = self.engine.spec.stats if self.engine.spec is not None else None
        return EngineSnapshot(num_running=running, num_waiting=len(reqs) - running, kv_cache_usage=bm.usage,
                              num_preemptions=self.engine.scheduler.num_preemptions,
                              prefix_queries=bm.prefix_queries, prefix_hits=bm.prefix_hits,
                              **({} if spec is None else dict(
                                  spec_drafts=spec.num_drafts, spec_draft_tokens=spec.num_draft_tokens,
                                  spec_accepted_tokens=spec.num_accepted_tokens,
                                  spec_accepted_per_position=tuple(spec.accepted_per_position))))

    def _publish_snapshot(self) -> None:
        if self.metrics is None:
            return
        self.metrics.on_snapshot(self.snapshot())
        self.metrics.maybe_log()
