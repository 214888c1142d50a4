"""Server pieces that need no model: the async engine loop (with a fake engine), metrics,
SSE and error formatting, request validation. Fast; run on every `make test`."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from tokenmill.engine.async_engine import AsyncLLMEngine, QueueFullError, RequestFailedError
from tokenmill.metrics import EngineMetrics, EngineSnapshot
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import SequenceStatus
from tokenmill.server.errors import OpenAIError, _describe_validation, error_body
from tokenmill.server.guards import authorized
from tokenmill.server.inputs import ModelLimits, chat_input, completion_inputs
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.sse import DONE, sse_event

POISON = 666      # a prompt token that makes the fake engine's step() raise


# ---- a fake LLMEngine: each step emits one token per running request ---------------------------------
@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    seqs: list = field(default_factory=lambda: [SimpleNamespace(status=SequenceStatus.RUNNING)])


class FakeEngine:
    def __init__(self, num_blocks: int = 10) -> None:
        self.requests: dict[str, _Req] = {}
        self.blocks_used = 0
        self.num_blocks = num_blocks
        self.scheduler = SimpleNamespace(running=[], waiting=[], num_preemptions=0, finish=lambda seq: None)
        self.block_manager = SimpleNamespace(usage=0.0, prefix_queries=0, prefix_hits=0)
        self.spec = None               # no speculative decoding
        self.failure = None            # no tensor-parallel worker died
        self.steps = 0
        self.log: list[str] = []

    def close(self) -> None:
        pass

    def _sync(self) -> None:
        self.blocks_used = len(self.requests)
        self.block_manager.usage = self.blocks_used / self.num_blocks

    def add_request(self, request_id, prompt, params, priority=0, arrival_time=None, cache_salt=None,
                    lora_request=None):
        if not prompt:
            raise ValueError("prompt is empty")
        self.requests[request_id] = _Req(request_id, list(prompt), params)
        self.log.append(f"add {request_id}")
        self._sync()

    def abort_request(self, request_id):
        self.requests.pop(request_id, None)
        self.log.append(f"abort {request_id}")
        self._sync()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if any(POISON in r.prompt for r in self.requests.values()):
            raise RuntimeError("boom")
        outs = []
        for r in list(self.requests.values()):
            r.tokens.append(7)
            done = len(r.tokens) >= r.params.max_tokens
            o = CompletionOutput(0, "x" * len(r.tokens), list(r.tokens), "length" if done else None,
                                 delta_text="x", num_delta_tokens=1)
            m = RequestMetrics(0.0, 0.0, 0.01, 0.01 * len(r.tokens), 0.02 * len(r.tokens) if done else None)
            outs.append(RequestOutput(r.rid, None, r.prompt, [o], done, m))
            if done:
                del self.requests[r.rid]
        self._sync()
        return outs


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


async def _collect(stream):
    return [out async for out in stream]


def test_async_engine_streams_outputs_and_counts_metrics():
    async def main():
        metrics = EngineMetrics("fake", log_interval=None)
        eng = AsyncLLMEngine(FakeEngine(), metrics)
        eng.start()
        s1 = eng.submit("a", [1, 2], SamplingParams(max_tokens=3))
        s2 = eng.submit("b", [3], SamplingParams(max_tokens=5))
        o1, o2 = await asyncio.gather(_collect(s1), _collect(s2))
        await eng.shutdown()
        return o1, o2, metrics

    o1, o2, metrics = run(main())
    assert [o.finished for o in o1] == [False, False, True] and len(o2) == 5
    text = metrics.render().decode()
    assert 'tokenmill:generation_tokens_total{model_name="fake"} 8.0' in text
    assert 'tokenmill:prompt_tokens_total{model_name="fake"} 3.0' in text
    assert 'tokenmill:request_success_total{finished_reason="length",model_name="fake"} 2.0' in text


def test_step_exception_fails_in_flight_requests_but_not_the_loop():
    async def main():
        fake = FakeEngine()
        eng = AsyncLLMEngine(fake, EngineMetrics("fake", log_interval=None))
        eng.start()
        good = eng.submit("good", [1], SamplingParams(max_tokens=1000))
        bad = eng.submit("bad", [POISON], SamplingParams(max_tokens=3))
        with pytest.raises(RequestFailedError):
            await _collect(bad)
        with pytest.raises(RequestFailedError):     # it shared the failed batch
            await _collect(good)
        assert fake.requests == {} and fake.blocks_used == 0     # everything was aborted / freed
        after = await _collect(eng.submit("after", [1], SamplingParams(max_tokens=2)))
        alive = eng.is_alive
        await eng.shutdown()
        return after, alive, eng.num_step_errors

    after, alive, errors = run(main())
    assert after[-1].finished and alive and errors >= 1


def test_bad_prompt_fails_only_its_request():
    async def main():
        eng = AsyncLLMEngine(FakeEngine())
        eng.start()
        ok = eng.submit("ok", [1], SamplingParams(max_tokens=3))
        bad = eng.submit("bad", [], SamplingParams(max_tokens=3))
        with pytest.raises(ValueError, match="empty"):
            await _collect(bad)
        outs = await _collect(ok)
        await eng.shutdown()
        return outs

    assert run(main())[-1].finished


def test_abort_reaches_engine_and_frees_blocks():
    async def main():
        fake = FakeEngine()
        eng = AsyncLLMEngine(fake, EngineMetrics("fake", log_interval=None))
        eng.start()
        stream = eng.submit("long", [1], SamplingParams(max_tokens=10 ** 6))
        await stream.__anext__()
        stream.abort()
        stream.abort()                        # idempotent
        for _ in range(200):
            if not fake.requests:
                break
            await asyncio.sleep(0.01)
        snap = eng.snapshot()
        await eng.shutdown()
        return fake, snap, eng.metrics.render().decode()

    fake, snap, text = run(main())
    assert "abort long" in fake.log and fake.blocks_used == 0
    assert snap.num_running == 0 and snap.kv_cache_usage == 0
    assert 'finished_reason="abort"' in text


def test_queue_limit():
    async def main():
        eng = AsyncLLMEngine(FakeEngine(), max_queue_len=2)
        eng.start()
        a = eng.submit("a", [1], SamplingParams(max_tokens=1))
        eng.submit("b", [1], SamplingParams(max_tokens=1))
        with pytest.raises(QueueFullError):     # neither has produced output yet
            eng.submit("c", [1], SamplingParams(max_tokens=1))
        await _collect(a)
        await asyncio.sleep(0.05)
        eng.submit("d", [1], SamplingParams(max_tokens=1))       # room again
        await eng.shutdown()

    run(main())


# ---- metrics ----------------------------------------------------------------------------------------
def test_metrics_snapshot_counters_and_log_line():
    m = EngineMetrics("m", log_interval=1.0)
    m.on_snapshot(EngineSnapshot(2, 1, 0.5, num_preemptions=3, prefix_queries=100, prefix_hits=40))
    m.on_snapshot(EngineSnapshot(1, 0, 0.25, num_preemptions=4, prefix_queries=150, prefix_hits=60))
    text = m.render().decode()
    assert 'tokenmill:num_preemptions_total{model_name="m"} 4.0' in text
    assert 'tokenmill:prefix_cache_hits_total{model_name="m"} 60.0' in text
    assert 'tokenmill:kv_cache_usage_perc{model_name="m"} 0.25' in text
    line = m.maybe_log(now=m._log_time + 2.0)
    assert line is not None and "running 1 reqs" in line and "KV cache usage 25.0%" in line
    assert "prefix cache hit rate 40.0%" in line
    m.on_snapshot(EngineSnapshot(0, 0, 0.0, 4, 150, 60))
    m.maybe_log(now=m._log_time + 2.0)
    assert m.maybe_log(now=m._log_time + 2.0) is None       # idle: no line


def test_metrics_speculative_counters_and_log_line():
    m = EngineMetrics("m", log_interval=1.0)
    m.on_snapshot(EngineSnapshot(1, 0, 0.5, 0, 0, 0, spec_drafts=4, spec_draft_tokens=16, spec_accepted_tokens=6,
                                 spec_accepted_per_position=(3, 2, 1, 0)))
    m.on_snapshot(EngineSnapshot(1, 0, 0.5, 0, 0, 0, spec_drafts=10, spec_draft_tokens=40, spec_accepted_tokens=20,
                                 spec_accepted_per_position=(8, 6, 4, 2)))
    text = m.render().decode()
    assert 'tokenmill:spec_decode_num_drafts_total{model_name="m"} 10.0' in text
    assert 'tokenmill:spec_decode_num_draft_tokens_total{model_name="m"} 40.0' in text
    assert 'tokenmill:spec_decode_num_accepted_tokens_total{model_name="m"} 20.0' in text
    assert 'tokenmill:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 6.0' in text
    line = m.maybe_log(now=m._log_time + 2.0)
    assert "spec acceptance rate 50.0%" in line and "mean acceptance length 3.00" in line


# ---- formatting --------------------------------------------------------------------------------------
def test_sse_and_error_body():
    ev = sse_event({"a": "é"})
    assert ev.startswith(b"data: ") and ev.endswith(b"\n\n")
    assert json.loads(ev[6:].decode()) == {"a": "é"}
    assert DONE == b"data: [DONE]\n\n"
    assert error_body(400, "bad", "top_k") == {"error": {"message": "bad", "type": "invalid_request_error",
                                                         "param": "top_k", "code": 400}}
    assert error_body(503, "busy")["error"]["type"] == "server_error"


def _validation_error(model, body) -> RequestValidationError:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.value.errors()])


@pytest.mark.parametrize("model,body,param", [
    (CompletionRequest, {"prompt": "x", "top_k": 1.5}, "top_k"),
    (CompletionRequest, {"prompt": "x", "stop": ""}, "stop"),
    (CompletionRequest, {"prompt": "x", "temperature": float("nan")}, "temperature"),
    (ChatCompletionRequest, {"messages": [{"role": "bot", "content": "x"}]}, "messages.0.role"),
])
def test_validation_errors_name_the_param(model, body, param):
    msg, p = _describe_validation(_validation_error(model, body))
    assert p == param and msg


def test_strict_types():
    assert CompletionRequest.model_validate({"prompt": "x", "temperature": 1}).temperature == 1.0
    for bad in ({"top_k": 2.0}, {"n": "2"}, {"max_tokens": True}, {"seed": 1.0}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"prompt": "x", **bad})


# ---- model-dependent validation ----------------------------------------------------------------------
class FakeTokenizer:
    chat_template = "{{ messages }}"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1] + [ord(c) % 100 for c in text]}

    def apply_chat_template(self, messages, **kw):
        return [1] * (2 + sum(len(m["content"]) for m in messages))


LIMITS = ModelLimits(max_model_len=32, vocab_size=100, max_n=4)


def test_max_tokens_against_context():
    (inp,) = completion_inputs(CompletionRequest(prompt="abc"), FakeTokenizer(), LIMITS)
    assert inp.prompt_token_ids == [1, 97, 98, 99] and inp.params.max_tokens == 16     # default 16
    (inp,) = completion_inputs(CompletionRequest(prompt="a" * 20), FakeTokenizer(), LIMITS)
    assert inp.params.max_tokens == 11                                                  # default clamped
    (inp,) = completion_inputs(CompletionRequest(prompt="abc", max_tokens=None), FakeTokenizer(), LIMITS)
    assert inp.params.max_tokens == 28                                                  # null: all that fits
    with pytest.raises(OpenAIError) as e:
        completion_inputs(CompletionRequest(prompt="abc", max_tokens=29), FakeTokenizer(), LIMITS)
    assert e.value.status == 400 and e.value.param == "max_tokens"
    with pytest.raises(OpenAIError) as e:
        completion_inputs(CompletionRequest(prompt="a" * 31), FakeTokenizer(), LIMITS)
    assert e.value.param == "prompt"
    chat = chat_input(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), FakeTokenizer(), LIMITS)
    assert chat.params.max_tokens == 32 - 4


def test_model_dependent_rejections():
    tok = FakeTokenizer()
    for req, param in [
        (CompletionRequest(prompt=[5, 100]), "prompt"),
        (CompletionRequest(prompt="x", n=5), "n"),
        (CompletionRequest(prompt="x", stop_token_ids=[100]), "stop_token_ids"),
        (CompletionRequest(prompt="x", max_tokens=2, min_tokens=3), "min_tokens"),
        (CompletionRequest(prompt=["x", ""]), "prompt"),
    ]:
        with pytest.raises(OpenAIError) as e:
            completion_inputs(req, tok, LIMITS)
        assert e.value.status == 400 and e.value.param == param


def test_batch_prompts_and_sampling_fields():
    reqs = completion_inputs(CompletionRequest(prompt=[[5], [3, 4]], n=2, temperature=0.5, top_k=0, seed=3,
                                               priority=-1, cache_salt="s"), FakeTokenizer(), LIMITS)
    assert [r.prompt_token_ids for r in reqs] == [[5], [3, 4]]
    texts = completion_inputs(CompletionRequest(prompt=["ab", "c"]), FakeTokenizer(), LIMITS)
    assert [r.prompt_token_ids for r in texts] == [[1, 97, 98], [1, 99]]
    p = reqs[0].params
    assert (p.n, p.temperature, p.top_k, p.seed) == (2, 0.5, -1, 3)
    assert reqs[1].priority == -1 and reqs[1].cache_salt == "s"


def test_auth_header():
    scope = lambda v: {"headers": [(b"authorization", v)]}   # noqa: E731
    assert authorized(scope(b"Bearer k1"), "k1")
    assert authorized(scope(b"bearer k1"), "k1")
    assert not authorized(scope(b"Bearer k2"), "k1")
    assert not authorized(scope(b"k1"), "k1")
    assert not authorized({"headers": []}, "k1")
