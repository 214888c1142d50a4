"""Benchmark workloads as `Request`s (prompt text, its token ids, requested output length).

- sharegpt:      first human turn / first answer of ShareGPT conversations (see sharegpt.py).
- random:        prompts of random word tokens with given input/output lengths.
- prefix-shared: one long system prompt + short distinct questions (prefix-cache workload).
- multiturn:     ShareGPT conversations replayed turn by turn; each turn's prompt is the chat
                 template of the whole history so far (recorded answers), so turn k shares its
                 prefix with turn k-1. Conversations are interleaved round-robin by turn.
Every builder is deterministic in its seed. Prompt lengths are measured by re-tokenizing the
final text, because decoded random ids need not re-tokenize to the same ids.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from tokenmill.bench.sharegpt import Conversation, Request, load_sharegpt, sample_requests

DATASETS = ("sharegpt", "random", "prefix-shared", "multiturn")
_WORD = re.compile(r"^(Ġ|▁)?[A-Za-z]{2,}$")


@dataclass(slots=True)
class DatasetConfig:
    name: str = "sharegpt"
    num_prompts: int = 200
    seed: int = 0
    max_prompt_tokens: int = 512         # sharegpt / multiturn
    max_output_tokens: int = 256         # sharegpt / multiturn cap
    input_len: int = 128                 # random: prompt tokens; prefix-shared: question tokens
    output_len: int = 64                 # random / prefix-shared
    range_ratio: float = 0.0             # random: lengths uniform in [len*(1-r), len*(1+r)]
    prefix_len: int = 512                # prefix-shared: system prompt tokens
    max_turns: int = 4                   # multiturn: turns per conversation


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])


def word_token_ids(tokenizer: Any) -> list[int]:
    """Ids of plain alphabetic word pieces: random prompts made of them decode to clean text."""
    special = set(tokenizer.all_special_ids)
    toks = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return [i for i, t in enumerate(toks) if t and i not in special and _WORD.match(t)]


def _random_text(tokenizer: Any, rng: random.Random, pool: list[int], n: int) -> str:
    """About n tokens of random words (adjacent pieces can merge when re-tokenized; clip to n)."""
    text = tokenizer.decode([rng.choice(pool) for _ in range(n)])
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return tokenizer.decode(ids[:n]) if len(ids) > n else text


def _scaled(rng: random.Random, n: int, ratio: float) -> int:
    return max(1, rng.randint(int(n * (1 - ratio)), int(n * (1 + ratio)))) if ratio else n


def random_requests(tokenizer: Any, cfg: DatasetConfig) -> list[Request]:
    rng = random.Random(cfg.seed)
    pool = word_token_ids(tokenizer)
    out = []
    for _ in range(cfg.num_prompts):
        text = _random_text(tokenizer, rng, pool, _scaled(rng, cfg.input_len, cfg.range_ratio))
        out.append(Request(text, _encode(tokenizer, text), _scaled(rng, cfg.output_len, cfg.range_ratio)))
    return out


def prefix_shared_requests(tokenizer: Any, cfg: DatasetConfig) -> list[Request]:
    rng = random.Random(cfg.seed)
    pool = word_token_ids(tokenizer)
    system = "You are a helpful assistant. Reference text: " + _random_text(tokenizer, rng, pool, cfg.prefix_len)
    out = []
    for i in range(cfg.num_prompts):
        text = f"{system}\n\nQuestion {i}: {_random_text(tokenizer, rng, pool, cfg.input_len)}?\nAnswer:"
        out.append(Request(text, _encode(tokenizer, text), cfg.output_len))
    return out


def _turn_prompts(tokenizer: Any, conv: Conversation, cfg: DatasetConfig) -> list[Request]:
    """Requests for turns 1..k of one conversation while the history fits max_prompt_tokens."""
    roles = {"human": "user", "gpt": "assistant"}
    history: list[dict[str, str]] = []
    out: list[Request] = []
    turns = conv.turns
    for i in range(0, len(turns) - 1, 2):
        (r_user, user), (r_bot, answer) = turns[i], turns[i + 1]
        if roles.get(r_user) != "user" or roles.get(r_bot) != "assistant" or len(out) >= cfg.max_turns:
            break
        history.append({"role": "user", "content": user})
        text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        out_len = min(len(tokenizer(answer, add_special_tokens=False)["input_ids"]), cfg.max_output_tokens)
        if len(ids) > cfg.max_prompt_tokens or out_len < 4:
            break
        out.append(Request(text, ids, out_len))
        history.append({"role": "assistant", "content": answer})
    return out


def multiturn_requests(tokenizer: Any, cfg: DatasetConfig,
                       conversations: list[Conversation] | None = None) -> list[Request]:
    convs = load_sharegpt() if conversations is None else conversations
    order = list(range(len(convs)))
    random.Random(cfg.seed).shuffle(order)
    chains: list[list[Request]] = []
    total = 0
    for idx in order:
        if total >= cfg.num_prompts:
            break
        chain = _turn_prompts(tokenizer, convs[idx], cfg)
        if len(chain) >= 2:  # a single turn has no history to share
            chains.append(chain)
            total += len(chain)
    out = [c[t] for t in range(cfg.max_turns) for c in chains if t < len(c)]  # round-robin by turn
    if len(out) < cfg.num_prompts:
        raise ValueError(f"only {len(out)} of {cfg.num_prompts} multi-turn requests fit the limits")
    return out[:cfg.num_prompts]


@dataclass(slots=True)
class Dialogue:
    """A conversation to replay closed-loop: the user turns and each answer's token budget."""

    user_turns: list[str]
    output_lens: list[int]


def multiturn_dialogues(tokenizer: Any, cfg: DatasetConfig, num_conversations: int,
                        conversations: list[Conversation] | None = None) -> list[Dialogue]:
    """`num_conversations` ShareGPT conversations (seeded sample) with at least 2 turns that fit
    the limits when answered at the recorded lengths."""
    convs = load_sharegpt() if conversations is None else conversations
    order = list(range(len(convs)))
    random.Random(cfg.seed).shuffle(order)
    out: list[Dialogue] = []
    for idx in order:
        if len(out) >= num_conversations:
            break
        chain = _turn_prompts(tokenizer, convs[idx], cfg)
        if len(chain) >= 2:
            users = [convs[idx].turns[2 * k][1] for k in range(len(chain))]
            out.append(Dialogue(users, [r.output_len for r in chain]))
    if len(out) < num_conversations:
        raise ValueError(f"only {len(out)} of {num_conversations} conversations fit the limits")
    return out


def build_requests(tokenizer: Any, cfg: DatasetConfig,
                   conversations: list[Conversation] | None = None) -> list[Request]:
    if cfg.name == "sharegpt":
        return sample_requests(tokenizer, cfg.num_prompts, cfg.max_prompt_tokens, cfg.max_output_tokens,
                               seed=cfg.seed, conversations=conversations)
    if cfg.name == "random":
        return random_requests(tokenizer, cfg)
    if cfg.name == "prefix-shared":
        return prefix_shared_requests(tokenizer, cfg)
    if cfg.name == "multiturn":
        return multiturn_requests(tokenizer, cfg, conversations)
    raise ValueError(f"unknown dataset {cfg.name!r}; choose from {DATASETS}")
