#!/usr/bin/env python
"""The same-node handoff's copy beside a thread that runs Python (as a decode worker's engine
loop does): one C++ call that lets go of Python's lock (workers/kv_shm.copy_blocks) against a
torch `copy_` per tensor and run from Python, each of which takes the lock back after its copy.

    .venv/bin/python benchmarks/bench_kv_copy.py [--blocks 188] [--repeats 7]

`small`'s layout (12 layers, 4 KV heads of 64, blocks of 16 tokens), one torch thread as in a
worker; prints best and median milliseconds of each, alone and beside the busy thread.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from workers.kv_shm import copy_blocks  # noqa: E402


def per_tensor(src, src_ids, dst, dst_ids) -> None:
    """The copy as Python drives it: a copy_ per tensor and run (the runs are one here)."""
    s0, d0, n = src_ids[0], dst_ids[0], len(src_ids)
    for (sk, sv), (dk, dv) in zip(src, dst):
        dk[d0:d0 + n].copy_(sk[s0:s0 + n])
        dv[d0:d0 + n].copy_(sv[s0:s0 + n])


def timed(fn, repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times), 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=188)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    torch.set_num_threads(1)
    shape = (2 * a.blocks + 16, 16, 4, 64)
    src = [(torch.randn(shape), torch.randn(shape)) for _ in range(12)]
    dst = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(12)]
    src_ids, dst_ids = list(range(a.blocks)), list(range(a.blocks, 2 * a.blocks))
    ways = {"one C++ call": lambda: copy_blocks(src, src_ids, dst, dst_ids),
            "copy_ per tensor": lambda: per_tensor(src, src_ids, dst, dst_ids)}
    for name, fn in ways.items():
        best, median = timed(fn, a.repeats)
        print(f"{name:18s} alone:            best {best:7.1f} ms, median {median:7.1f} ms")
    stop = threading.Event()

    def busy() -> None:
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i
    t = threading.Thread(target=busy, daemon=True)
    t.start()
    try:
        for name, fn in ways.items():
            best, median = timed(fn, a.repeats)
            print(f"{name:18s} beside Python:    best {best:7.1f} ms, median {median:7.1f} ms")
    finally:
        stop.set()
        t.join()


if __name__ == "__main__":
    main()
