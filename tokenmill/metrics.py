"""Serving metrics: Prometheus series (vLLM's names, `tokenmill:` prefix) and a periodic log line.

Every update comes from the engine thread (AsyncLLMEngine) right after a step or an abort;
prometheus-client guards each series with its own lock, so a /metrics scrape on the server
thread is safe. This module never imports the engine: the engine thread hands it plain
snapshots (`EngineSnapshot`) and the `RequestOutput`s of each step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenmill.outputs import RequestOutput

log = logging.getLogger("tokenmill")

PREFIX = "tokenmill:"

# Bucket edges follow vLLM's, so dashboards built for vLLM read these the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(slots=True, frozen=True)
class EngineSnapshot:
    """Engine state right after a step. Counters are cumulative since engine start."""

    num_running: int          # requests with at least one sequence holding KV blocks
    num_waiting: int          # requests queued (new or preempted)
    kv_cache_usage: float     # 0..1, fraction of KV blocks in use
    num_preemptions: int
    prefix_queries: int       # prompt tokens looked up in the prefix cache
    prefix_hits: int          # of those, tokens served from the cache
    spec_drafts: int = 0      # speculative verification rounds (0 without speculation)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()


@dataclass(slots=True)
class _Progress:
    """Per in-flight request: what is needed to derive ITL and to count tokens once."""

    last_token_time: float | None = None
    tokens: int = 0


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 log_interval: float | None = 5.0) -> None:
        self.registry = registry or CollectorRegistry()
        self.log_interval = log_interval
        labels = ["model_name"]
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, registry=r, buckets=buckets).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (arrival -> first token).", TTFT_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Mean time per output token after the first, per request.",
                         TOKEN_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive token deliveries of a request.",
                        TOKEN_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival -> finish, per finished request.", E2E_BUCKETS)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests holding KV blocks.", labels,
                             registry=r).labels(model_name)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.", labels,
                             registry=r).labels(model_name)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc", "KV-cache block usage, 0..1 (1 = full).", labels,
                              registry=r).labels(model_name)
        self.preemptions = Counter(PREFIX + "num_preemptions", "Sequences preempted (blocks freed, recomputed).",
                                   labels, registry=r).labels(model_name)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests that finished prefill.",
                                     labels, registry=r).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", labels,
                                         registry=r).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self._model_name = model_name
        self.prefix_queries = Counter(PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      labels, registry=r).labels(model_name)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                                   labels, registry=r).labels(model_name)
        self.spec_drafts = Counter(PREFIX + "spec_decode_num_drafts", "Speculative verification rounds.",
                                   labels, registry=r).labels(model_name)
        self.spec_draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                                         labels, registry=r).labels(model_name)
        self.spec_accepted_tokens = Counter(PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                            labels, registry=r).labels(model_name)
        self._spec_per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft.", labels + ["position"], registry=r)
        self.history_truncated = Counter(PREFIX + "chat_history_truncated_requests",
                                         "Chat requests whose oldest turns --chat-history-window dropped.",
                                         labels, registry=r).labels(model_name)
        self.history_dropped = Counter(PREFIX + "chat_history_dropped_messages",
                                       "Chat messages --chat-history-window dropped.", labels, registry=r).labels(model_name)
        self._progress: dict[str, _Progress] = {}
        self._last: EngineSnapshot | None = None
        # interval accumulators for the log line
        self._log_time = time.monotonic()
        self._log_prompt = 0
        self._log_gen = 0
        self._log_busy = False

    # ---- per step --------------------------------------------------------------------------
    def on_outputs(self, outputs: list[RequestOutput], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for out in outputs:
            prog = self._progress.setdefault(out.request_id, _Progress())
            new = sum(o.num_delta_tokens for o in out.outputs)
            if new:
                if prog.last_token_time is None:      # prefill done: first token(s) out
                    m = out.metrics
                    if m is not None and m.first_token_time is not None:
                        self.ttft.observe(max(m.first_token_time - m.arrival_time, 0.0))
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                    self._log_prompt += len(out.prompt_token_ids)
                else:
                    self.itl.observe(now - prog.last_token_time)
                prog.last_token_time = now
                prog.tokens += new
                self.generation_tokens.inc(new)
                self._log_gen += new
            if out.finished:
                self._progress.pop(out.request_id, None)
                self._observe_finished(out)

    def _observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        first = out.outputs[0] if out.outputs else None
        reason = (first.finish_reason if first else None) or "stop"
        self._success.labels(self._model_name, reason).inc()
        if m is None:
            return
        if m.finished_time is not None:
            self.e2e.observe(max(m.finished_time - m.arrival_time, 0.0))
        if first is not None and len(first.token_ids) > 1 and m.first_token_time is not None \
                and m.last_token_time is not None:
            self.tpot.observe((m.last_token_time - m.first_token_time) / (len(first.token_ids) - 1))

    def on_aborted(self, request_ids: list[str]) -> None:
        """Requests that ended without finishing (client gone, engine error, shutdown)."""
        for rid in request_ids:
            self._progress.pop(rid, None)
            self._success.labels(self._model_name, "abort").inc()

    def on_snapshot(self, snap: EngineSnapshot) -> None:
        self.running.set(snap.num_running)
        self.waiting.set(snap.num_waiting)
        self.kv_usage.set(snap.kv_cache_usage)
        # counters only go up: feed them the deltas of the engine's totals
        last = self._last or EngineSnapshot(0, 0, 0.0, 0, 0, 0)
        for counter, now, before in ((self.preemptions, snap.num_preemptions, last.num_preemptions),
                                     (self.prefix_queries, snap.prefix_queries, last.prefix_queries),
                                     (self.prefix_hits, snap.prefix_hits, last.prefix_hits),
                                     (self.spec_drafts, snap.spec_drafts, last.spec_drafts),
                                     (self.spec_draft_tokens, snap.spec_draft_tokens, last.spec_draft_tokens),
                                     (self.spec_accepted_tokens, snap.spec_accepted_tokens, last.spec_accepted_tokens)):
            counter.inc(max(now - before, 0))
        for pos, count in enumerate(snap.spec_accepted_per_position):
            before = last.spec_accepted_per_position[pos] if pos < len(last.spec_accepted_per_position) else 0
            self._spec_per_pos.labels(self._model_name, str(pos)).inc(max(count - before, 0))
        self._last = snap
        if snap.num_running or snap.num_waiting:
            self._log_busy = True

    # ---- log line --------------------------------------------------------------------------
    def maybe_log(self, now: float | None = None) -> str | None:
        """Every `log_interval` seconds, if anything happened, log one line of engine stats.
        Returns the line (for tests)."""
        now = time.monotonic() if now is None else now
        if self.log_interval is None or now - self._log_time < self.log_interval:
            return None
        elapsed = now - self._log_time
        busy = self._log_busy or self._log_prompt or self._log_gen
        snap = self._last
        line = None
        if busy and snap is not None:
            hit = 100.0 * snap.prefix_hits / snap.prefix_queries if snap.prefix_queries else 0.0
            line = (f"engine: running {snap.num_running} reqs, waiting {snap.num_waiting} reqs, "
                    f"KV cache usage {100 * snap.kv_cache_usage:.1f}%, "
                    f"prompt throughput {self._log_prompt / elapsed:.1f} tok/s, "
                    f"generation throughput {self._log_gen / elapsed:.1f} tok/s, "
                    f"prefix cache hit rate {hit:.1f}%")
            if snap.spec_drafts:
                line += (f", spec acceptance rate {100 * snap.spec_accepted_tokens / snap.spec_draft_tokens:.1f}%, "
                         f"mean acceptance length {1 + snap.spec_accepted_tokens / snap.spec_drafts:.2f}")
            log.info(line)
        self._log_time, self._log_prompt, self._log_gen = now, 0, 0
        self._log_busy = bool(snap and (snap.num_running or snap.num_waiting))
        return line

    def render(self) -> bytes:
        """Prometheus text exposition format."""
        return generate_latest(self.registry)
