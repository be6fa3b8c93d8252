"""The C++ kernels for CPU (paged attention; for the model: linear layers of few rows, RMSNorm,
the MLP's activation, the rotary embedding with the step's KV store; the same-node handoff's
copies of KV block runs), built on first use and
cached (`cache_dir()`): one module from the sources in csrc/.

A build failure is not fatal: `load()` returns None and the engine keeps torch's own ops.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
from functools import lru_cache
from pathlib import Path

log = logging.getLogger("pdcluster.kernels")
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("paged_attention.cpp", "linear.cpp", "rms_norm.cpp", "activation.cpp",
                                      "rope_cache.cpp", "kv_copy.cpp", "bindings.cpp")]
# -ffast-math lets exp vectorize (libmvec); attention never relies on inf/NaN (the running
# max starts from a real score), so finite-math assumptions hold.


@lru_cache(maxsize=1)
def load():
    if os.environ.get("PDCLUSTER_NO_CPU_KERNEL"):
        return None
    # -fopenmp makes at::parallel_for real (without it the header runs the loop serially); the
    # extension then links libgomp.so.1, which resolves to the copy torch already loaded, so
    # it shares torch's thread pool and obeys torch.set_num_threads.
    flags = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
    ldflags = ["-fopenmp"]
    # Named by content and built from a copy inside its own build directory: every checkout
    # of the same source shares one build (the build files name no checkout path), and a
    # changed source never finds a stale one.
    import torch
    key = (b"".join(src.read_bytes() for src in _SOURCES) + " ".join(flags + ldflags).encode()
           + _cpu_model().encode()                                                            # -march=native
           + torch.__version__.encode())                                                      # the ABI
    digest = hashlib.sha256(key).hexdigest()[:12]
    name = f"pdcluster_cpu_kernels_{digest}"
    build_dir = cache_dir() / name
    so, built = build_dir / f"{name}.so", build_dir / "built"
    if so.exists() and built.exists():
        # Built before (by any checkout or venv with this torch): load it as it is. Going through
        # torch's loader would run ninja, whose build file names the venv that built it, and so
        # rebuild whenever two venvs take turns.
        return _load_extension(name, so)
    _prefer_our_ninja()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        copies = [_copy_into(src, build_dir) for src in _SOURCES]
        if not (build_dir / f"{name}.so").exists():
            log.warning("building the C++ CPU kernels for this CPU in %s (once per source version, "
                        "about a minute)", build_dir)
        from torch.utils.cpp_extension import load as build
        module = build(name=name, sources=[str(c) for c in copies], build_directory=str(build_dir),
                       extra_cflags=flags, extra_ldflags=ldflags, verbose=False)
        built.write_text(torch.__version__)          # last: a half-built .so is never loaded as is
        return module
    except Exception as e:   # no compiler, no headers, no ninja: fall back, say why
        log.warning("C++ CPU kernels unavailable (%s); using torch's attention and linear layers", e)
        return None


def for_model(device, dtype):
    """The module for the model's layers (`LlamaForCausalLM.set_cpu_kernels`) where it applies
    (fp32 on CPU) and builds; else None, and the model keeps torch's ops."""
    import torch
    return load() if device.type == "cpu" and dtype == torch.float32 else None


def _copy_into(src: Path, build_dir: Path) -> Path:
    """`src` copied into the build directory (unless the same bytes are there already)."""
    dst = build_dir / src.name
    if not dst.exists() or dst.read_bytes() != src.read_bytes():
        tmp = build_dir / f".{src.name}.{os.getpid()}"       # atomic: workers may start together
        tmp.write_bytes(src.read_bytes())
        os.replace(tmp, dst)
    return dst


def _load_extension(name: str, path: Path):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cache_dir() -> Path:
    """Where built kernels live: $PDCLUSTER_CACHE_DIR, else ~/.cache/pdcluster/kernels."""
    return Path(os.environ.get("PDCLUSTER_CACHE_DIR") or Path.home() / ".cache" / "pdcluster" / "kernels")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def _prefer_our_ninja() -> None:
    """Build with the ninja pinned beside this interpreter (pyproject), not whichever is first on
    PATH: two ninja versions take each other's build logs for stale and rebuild every time."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "").split(os.pathsep)
    if (Path(bin_dir) / "ninja").exists() and path[:1] != [bin_dir]:
        os.environ["PATH"] = os.pathsep.join([bin_dir] + [p for p in path if p != bin_dir])
