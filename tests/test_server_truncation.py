"""Prompt truncation (`truncate_prompt_tokens`) and the chat history window
(`--chat-history-window`): an over-long request is trimmed as specified and answered; without
the option it is still a clear 400."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import save_tiny_model_dir
from tests.tiny_server import BASE, make_client
from tokenmill.server.inputs import _fit_history

WINDOW = 120


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return Path(save_tiny_model_dir(tmp_path_factory.mktemp("trunc") / "model"))


@pytest.fixture(scope="module")
def clients(model):
    with make_client(model) as plain, make_client(model, chat_history_window=WINDOW) as windowed:
        yield plain, windowed


def long_chat(turns: int = 8) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "be brief"}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"question {i}: " + "the quick brown fox " * 4})
        msgs.append({"role": "assistant", "content": f"answer {i}: " + "the lazy dog " * 4})
    msgs.append({"role": "user", "content": "last question, hello world"})
    return msgs


def chat(client, messages, **kw):
    return client.post("/v1/chat/completions", json={"model": BASE, "messages": messages, "max_tokens": 4,
                                                     "temperature": 0, **kw})


def test_over_long_chat_is_rejected_without_the_window(clients):
    plain, _ = clients
    r = chat(plain, long_chat())
    assert r.status_code == 400
    assert "maximum context length is 256 tokens" in r.json()["error"]["message"]


def test_history_window_drops_oldest_turns_and_answers(clients):
    plain, windowed = clients
    r = chat(windowed, long_chat())
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] <= WINDOW and usage["dropped_messages"] >= 2
    kept = long_chat()
    del kept[1:1 + usage["dropped_messages"]]            # the oldest turns, system prompt kept
    same = chat(plain, kept)                              # what the window sent, sent whole
    assert same.json()["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    assert same.json()["choices"][0]["message"] == r.json()["choices"][0]["message"]
    metrics = windowed.get("/metrics").text
    assert 'tokenmill:chat_history_dropped_messages_total{model_name="tiny"}' in metrics
    short = chat(windowed, long_chat(0))                  # fits: nothing dropped, nothing reported
    assert short.status_code == 200 and "dropped_messages" not in short.json()["usage"]


def test_fit_history_keeps_system_and_last_user_turn():
    msgs = [{"role": "system", "content": "s" * 10}, {"role": "user", "content": "u" * 30},
            {"role": "assistant", "content": "a" * 30}, {"role": "user", "content": "v" * 30},
            {"role": "assistant", "content": "b" * 30}, {"role": "user", "content": "w" * 30}]
    render = lambda ms: [0] * sum(len(m["content"]) for m in ms)   # noqa: E731  one token per character
    ids, dropped = _fit_history(msgs, render, 100, render(msgs))
    assert (len(ids), dropped) == (100, 2)                # the oldest whole turn (user + its reply) out
    ids, dropped = _fit_history(msgs, render, 75, render(msgs))
    assert (len(ids), dropped) == (40, 4)                 # two turns out; system + last user stay
    ids, dropped = _fit_history(msgs, render, 5, render(msgs))
    assert (len(ids), dropped) == (40, 4)                 # cannot shrink further: the context check decides


def test_truncate_prompt_tokens_keeps_the_last_tokens(clients):
    plain, _ = clients
    prompt = [(7 * i) % 250 + 3 for i in range(300)]      # longer than max_model_len 256
    body = {"model": BASE, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    assert plain.post("/v1/completions", json=body).status_code == 400
    cut = plain.post("/v1/completions", json=body | {"truncate_prompt_tokens": 100}).json()
    tail = plain.post("/v1/completions", json=body | {"prompt": prompt[-100:]}).json()
    assert cut["usage"]["prompt_tokens"] == 100 and cut["choices"][0]["text"] == tail["choices"][0]["text"]
    bad = plain.post("/v1/completions", json=body | {"truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"
    chat_cut = chat(plain, long_chat(), truncate_prompt_tokens=-1)
    assert chat_cut.status_code == 400                    # all 256 kept: no room left for output
    assert chat(plain, long_chat(), truncate_prompt_tokens=200).json()["usage"]["prompt_tokens"] == 200
