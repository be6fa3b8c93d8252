"""The C++ kernel's build is cached by content, not by checkout: another copy of the source tree
(a second clone, a moved checkout) loads the same build without recompiling."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from workers import cpu_kernels

ROOT = Path(__file__).resolve().parent.parent
LOAD = "from workers import cpu_kernels; m = cpu_kernels.load(); print(m.__file__ if m else '')"


def test_another_checkout_reuses_the_build(tmp_path):
    if cpu_kernels.load() is None:
        pytest.fail("the CPU kernel does not build on this machine (make setup builds it)")
    so = Path(cpu_kernels.load().__file__)
    built_at = so.stat().st_mtime_ns
    copy = tmp_path / "elsewhere"
    shutil.copytree(ROOT / "workers", copy / "workers", ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-c", LOAD], cwd=copy, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == so, out.stdout + out.stderr
    assert so.stat().st_mtime_ns == built_at, "the other checkout rebuilt the kernel"
    assert "building the C++ CPU kernels" not in out.stderr
