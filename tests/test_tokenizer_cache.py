"""The GGUF tokenizer cache beside the models survives two processes starting at once."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tokenmill.model import loader


class FakeTokenizer:
    chat_template = "{{ messages }}"

    def save_pretrained(self, path: Path) -> None:
        Path(path).mkdir(parents=True)
        (Path(path) / "tokenizer_config.json").write_text("{}")


def test_concurrent_first_start_does_not_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: FakeTokenizer())
    real_replace = os.replace

    def other_process_wins(src, dst) -> None:
        # the other process published its copy after our exists() check, before our rename
        FakeTokenizer().save_pretrained(dst)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", other_process_wins)
    tok = loader.load_tokenizer(gguf)
    assert isinstance(tok, FakeTokenizer)
    cache_root = tmp_path / "home" / "tokenizers"
    assert [p.name for p in cache_root.iterdir()] == [f"m-1-{int(gguf.stat().st_mtime)}"]  # no tmp left
