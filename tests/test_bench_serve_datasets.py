"""Dataset builders on a toy word tokenizer (no model needed)."""
from __future__ import annotations

from typing import Any

import pytest

from tokenmill.bench.datasets import DatasetConfig, build_requests, word_token_ids
from tokenmill.bench.sharegpt import Conversation

WORDS = ["<s>", "<|im_start|>", "<|im_end|>"] + [f"w{i}" for i in range(3, 200)]


class WordTokenizer:
    """One token per whitespace-separated word; unknown words map to id 3."""

    all_special_ids = [0, 1, 2]

    def __len__(self) -> int:
        return len(WORDS)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [WORDS.index(w) if w in WORDS else 3 for w in text.split()]
        return {"input_ids": ids}

    def decode(self, ids: list[int]) -> str:
        return " ".join(WORDS[i] for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return ["Ġ" + ("word" if i > 2 else "<x>") for i in ids]

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = True) -> str:
        body = " ".join(f"<|im_start|> {m['role']} {m['content']} <|im_end|>" for m in messages)
        return body + (" <|im_start|> assistant" if add_generation_prompt else "")


def _conv(i: int, turns: int) -> Conversation:
    out: list[tuple[str, str]] = []
    for t in range(turns):
        out += [("human", f"q{i} turn{t} " + "w5 " * 5), ("gpt", "w7 " * (10 + t))]
    return Conversation(f"c{i}", out)


@pytest.fixture
def tok() -> Any:
    return WordTokenizer()


def test_word_pool_excludes_special(tok: Any) -> None:
    pool = word_token_ids(tok)
    assert 0 not in pool and 1 not in pool and len(pool) == len(WORDS) - 3


def test_random_lengths_and_determinism(tok: Any) -> None:
    cfg = DatasetConfig(name="random", num_prompts=20, input_len=16, output_len=8, seed=3)
    a, b = build_requests(tok, cfg), build_requests(tok, cfg)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert all(len(r.prompt_token_ids) == 16 and r.output_len == 8 for r in a)
    assert len({r.prompt for r in a}) == 20
    c = build_requests(tok, DatasetConfig(name="random", num_prompts=50, input_len=20, range_ratio=0.5, seed=1))
    lens = [len(r.prompt_token_ids) for r in c]
    assert min(lens) >= 10 and max(lens) <= 30 and len(set(lens)) > 3


def test_prefix_shared(tok: Any) -> None:
    cfg = DatasetConfig(name="prefix-shared", num_prompts=6, prefix_len=64, input_len=8, output_len=5)
    reqs = build_requests(tok, cfg)
    system = reqs[0].prompt.split("\n\n")[0]
    assert all(r.prompt.startswith(system + "\n\n") for r in reqs)
    assert len({r.prompt for r in reqs}) == 6
    assert all(r.prompt_token_ids[:60] == reqs[0].prompt_token_ids[:60] for r in reqs)
    assert all(r.output_len == 5 for r in reqs)


def test_multiturn_history_and_order(tok: Any) -> None:
    convs = [_conv(i, 3) for i in range(5)] + [_conv(9, 1)]  # the 1-turn conversation is skipped
    cfg = DatasetConfig(name="multiturn", num_prompts=9, max_turns=3, seed=0)
    reqs = build_requests(tok, cfg, conversations=convs)
    assert len(reqs) == 9
    first, second = reqs[0], reqs[3]           # round robin: three turn-1 prompts, then turn 2
    assert "turn0" in first.prompt and "turn1" not in first.prompt
    conv_id = first.prompt.split()[2]
    later = [r for r in reqs if r.prompt.split()[2] == conv_id]
    assert [r.prompt.count("<|im_start|> user") for r in later] == list(range(1, len(later) + 1))
    # each turn's prompt contains the previous turn's prompt (minus the generation cue) + answer
    prev_body = later[0].prompt.rsplit(" <|im_start|> assistant", 1)[0]
    assert later[1].prompt.startswith(prev_body) and "w7 " * 10 in later[1].prompt
    assert second.output_len == 11 and "turn1" in second.prompt
    with pytest.raises(ValueError):
        build_requests(tok, DatasetConfig(name="multiturn", num_prompts=100), conversations=convs)


def test_sharegpt_and_unknown(tok: Any) -> None:
    convs = [_conv(i, 1) for i in range(10)]
    reqs = build_requests(tok, DatasetConfig(name="sharegpt", num_prompts=4), conversations=convs)
    assert len(reqs) == 4 and all(r.output_len == 10 for r in reqs)
    with pytest.raises(ValueError):
        build_requests(tok, DatasetConfig(name="nope"))
