"""The OpenMP spin default is set on import, before torch loads, and never overrides the user."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _spin_after_import(env: dict[str, str]) -> str:
    code = "import os, tokenmill, torch; print(os.environ.get('GOMP_SPINCOUNT', '-'))"
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.mark.parametrize("env,expected", [({}, "50000"), ({"GOMP_SPINCOUNT": "7"}, "7"),
                                          ({"OMP_WAIT_POLICY": "PASSIVE"}, "-")])
def test_spin_default_respects_the_user(env, expected):
    assert _spin_after_import(env) == expected
