"""The kernel build wrapper: a stale torch lock left by a killed build must not hang later
loads, and a build is never shared across CPUs with different feature flags."""
from pathlib import Path

import torch.utils.cpp_extension

from tokenmill import cpu_extension


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "k.cpp"
    src.write_text("// kernel\n")
    return src


def test_stale_torch_lock_is_removed_before_building(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_KERNEL_CACHE", str(tmp_path / "cache"))
    src = _source(tmp_path)
    folder = cpu_extension.build_directory("k", src)
    folder.mkdir(parents=True)
    (folder / "lock").touch()            # what a build killed mid-way leaves behind
    seen = {}

    def fake_load(name, sources, build_directory, **kwargs):
        seen["lock_present"] = (Path(build_directory) / "lock").exists()
        seen["folder"] = build_directory
        return "module"

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    assert cpu_extension.load_cpu_extension("k", src) == "module"
    assert seen == {"lock_present": False, "folder": str(folder)}


def test_build_folder_depends_on_cpu_flags_and_source(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_KERNEL_CACHE", str(tmp_path))
    src = _source(tmp_path)
    monkeypatch.setattr(cpu_extension, "cpu_flags", lambda: "flags : avx2")
    avx2 = cpu_extension.build_directory("k", src)
    monkeypatch.setattr(cpu_extension, "cpu_flags", lambda: "flags : avx2 avx512f")
    avx512 = cpu_extension.build_directory("k", src)
    assert avx2 != avx512
    src.write_text("// changed\n")
    assert cpu_extension.build_directory("k", src) != avx512


def test_build_failure_falls_back_to_none(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_KERNEL_CACHE", str(tmp_path))

    def failing_load(**kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda *a, **k: failing_load())
    assert cpu_extension.load_cpu_extension("k", _source(tmp_path)) is None
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    assert cpu_extension.load_cpu_extension("k", _source(tmp_path)) is None
