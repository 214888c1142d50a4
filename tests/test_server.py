"""OpenAI-compatible server against a live `tokenmill serve` (SmolLM2) with the official client:
completions and chat, streaming and not, n=2, stop strings, usage = tokenizer counts,
logprobs, vLLM's extra fields, info routes, metrics and the stats log line."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.server_fixtures import SERVED_NAME, ServerProcess, get_server, load_tokenizer

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return get_server("main")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def greedy(**kw):
    return dict(model=SERVED_NAME, temperature=0, **kw)


# ---- completions --------------------------------------------------------------------------------
def test_completion_usage_matches_tokenizer(client, tokenizer):
    r = client.completions.create(prompt=PROMPT, max_tokens=12, extra_body={"ignore_eos": True}, **greedy())
    assert r.object == "text_completion" and r.model == SERVED_NAME
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert r.usage.prompt_tokens == len(tokenizer(PROMPT)["input_ids"])
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(prompt=PROMPT, max_tokens=16, **greedy())
    chunks = list(client.completions.create(prompt=PROMPT, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}, **greedy()))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_logprobs_and_token_prompt(client, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    r = client.completions.create(prompt=ids, max_tokens=6, logprobs=3, extra_body={"ignore_eos": True}, **greedy())
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    assert r.usage.prompt_tokens == len(ids)


def test_completion_echo_and_batch_prompts(client):
    r = client.completions.create(prompt=["Hello", "One, two,"], max_tokens=3, echo=True, n=2, **greedy())
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    assert by_index[0].startswith("Hello") and by_index[2].startswith("One, two,")


# ---- chat ---------------------------------------------------------------------------------------
def test_chat_usage_matches_template(client, tokenizer):
    r = client.chat.completions.create(messages=CHAT, max_completion_tokens=10, **greedy())
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    ids = tokenizer.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert r.usage.prompt_tokens == len(ids)
    assert 1 <= r.usage.completion_tokens <= 10


def test_chat_stream_equals_non_stream(client):
    full = client.chat.completions.create(messages=CHAT, max_tokens=20, **greedy())
    chunks = list(client.chat.completions.create(messages=CHAT, max_tokens=20, stream=True,
                                                 stream_options={"include_usage": True}, **greedy()))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert usage.prompt_tokens == full.usage.prompt_tokens and usage.completion_tokens == full.usage.completion_tokens


def test_chat_logprobs(client):
    r = client.chat.completions.create(messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=2, **greedy())
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    # greedy: the sampled token is the most likely one
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4) for t in content)


# ---- n, stop, seed, extras -------------------------------------------------------------------------
def test_n2_non_stream_and_stream(client):
    r = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, n=2, max_tokens=8, temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    stream = client.completions.create(model=SERVED_NAME, prompt=PROMPT, n=2, max_tokens=8, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts, finished = {0: "", 1: ""}, {}
    usage = None
    for c in stream:
        if c.usage:
            usage = c.usage
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished[ch.index] = ch.finish_reason
    assert finished == {0: "length", 1: "length"}
    assert usage.completion_tokens == 16          # 8 per choice, both counted


def test_stop_string(client):
    base = client.completions.create(prompt=PROMPT, max_tokens=16, extra_body={"ignore_eos": True}, **greedy())
    text = base.choices[0].text
    words = [w for w in text.split() if len(w) >= 3]
    assert words, text
    stop = words[len(words) // 2]
    cut = client.completions.create(prompt=PROMPT, max_tokens=16, stop=[stop], **greedy())
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        prompt=PROMPT, max_tokens=16, stop=stop, stream=True, **greedy()))
    assert streamed == cut.choices[0].text


def test_seed_is_reproducible(client):
    kw = dict(model=SERVED_NAME, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=1234)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text


def test_vllm_extra_fields_and_penalties(client):
    r = client.completions.create(
        prompt=PROMPT, max_tokens=6, presence_penalty=0.5, frequency_penalty=0.5, **greedy(),
        extra_body={"top_k": 5, "min_p": 0.05, "min_tokens": 6, "ignore_eos": True, "repetition_penalty": 1.1,
                    "priority": 0, "cache_salt": "tenant-a", "stop_token_ids": [2]})
    assert r.usage.completion_tokens == 6


def test_concurrent_requests(server):
    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
            return await asyncio.gather(*[
                c.completions.create(model=SERVED_NAME, prompt=f"Count to {i}:", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}) for i in range(8)])
    results = asyncio.run(run())
    assert all(r.usage.completion_tokens == 8 for r in results)


# ---- info routes, metrics, log ------------------------------------------------------------------------
def test_info_routes(server, client):
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    assert "/v1/chat/completions" in httpx.get(server.url + "/openapi.json").json()["paths"]


def test_metrics_and_stats_log(server, client):
    client.completions.create(prompt=PROMPT, max_tokens=4, **greedy())
    text = httpx.get(server.url + "/metrics").text
    for name in ["time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage_perc", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "request_success_total", "prefix_cache_queries_total", "prefix_cache_hits_total"]:
        assert f"tokenmill:{name}" in text, name
    assert 'finished_reason="length"' in text
    assert server.metric("tokenmill:generation_tokens_total") >= 4
    assert server.metric("tokenmill:time_to_first_token_seconds_count") >= 1
    # the same prompt twice: the second finds its full blocks in the prefix cache
    long_prompt = "The history of the city " * 12
    for _ in range(2):
        client.completions.create(prompt=long_prompt, max_tokens=1, **greedy())
    assert server.metric("tokenmill:prefix_cache_hits_total") >= 32
    deadline = time.monotonic() + 10
    while "engine: running" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "generation throughput" in server.log()
