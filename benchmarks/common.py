"""What the benchmark scripts share: the machine's memory bandwidth (the memcpy probe) and a
meter of how many cores *other* processes keep busy while a part of a benchmark runs.

Import it as `from benchmarks.common import ...` with the repository root on sys.path (each
script puts it there).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import torch


def memory_bandwidth(mib: int = 256, tries: int = 7, device: str = "cpu") -> dict[str, float]:
    """Best-of-`tries` rates over a `mib` MiB fp32 tensor on `device` (a GPU's too: each op is
    then timed to its completion), in bytes of the tensor per second (each op timed once untimed
    first, with the torch thread count of the caller):
    copy  = dst.copy_(src) into a preallocated, already-touched tensor: memcpy, the bound for
            anything that copies between buffers it keeps (a KV handoff's staging buffers);
    clone = src.clone(): fresh memory each time, so it also pays a page fault per new 4 KiB
            page (on the 2-core box about 4x slower), which reused buffers never do;
    read  = src.sum(): bytes read (a decode step mostly reads weights).
    A copy moves each byte twice (read + write): STREAM's "copy" convention is 2 * copy."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    dst = src.clone()
    nbytes = src.numel() * src.element_size()
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)

    def best(fn) -> float:
        fn()
        sync()
        times = []
        for _ in range(tries):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return min(times)
    return {"copy": nbytes / best(lambda: dst.copy_(src)),
            "clone": nbytes / best(lambda: src.clone()),
            "read": nbytes / best(lambda: src.sum())}


# -- the rest of the machine -------------------------------------------------------------------
def proc_stats():
    """(pid, the fields of /proc/PID/stat after the command name) of every live process."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:                     # exited meanwhile
            continue
        yield int(name), fields


def process_cpu_seconds(root: int) -> tuple[float, float]:
    """(CPU-seconds of process `root` alone, of it and all its live descendants: Ray's raylet
    and workers, subprocesses, each with the reaped children it waited for), from one pass
    over /proc (Linux); (0, 0) once it is gone."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    own: dict[int, int] = {}
    cpu: dict[int, int] = {}
    for pid, fields in proc_stats():
        children.setdefault(int(fields[1]), []).append(pid)        # ppid
        own[pid] = int(fields[11]) + int(fields[12])               # utime stime
        cpu[pid] = own[pid] + int(fields[13]) + int(fields[14])    # + cutime cstime
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0)
        todo += children.get(pid, [])
    return own.get(root, 0) / tick, total / tick


def cpu_seconds() -> tuple[float, float, float]:
    """(monotonic time, busy CPU-seconds of the whole machine, CPU-seconds of this process and
    its descendants). Busy machine time comes from /proc/stat (Linux)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")   # minus idle, iowait
    return time.monotonic(), busy, process_cpu_seconds(os.getpid())[1]


def others_cores(a: tuple, b: tuple) -> float:
    """Cores kept busy by other processes between two cpu_seconds() readings."""
    return max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / (b[0] - a[0])) if b[0] > a[0] else 0.0


class Meter:
    """Wall time of each part of the run, and how many cores *other* processes kept busy meanwhile."""

    def __init__(self):
        self.parts: dict[str, dict] = {}

    @staticmethod
    def others_cores(window_s: float = 1.0) -> float:
        a = cpu_seconds()
        time.sleep(window_s)
        return others_cores(a, cpu_seconds())

    @staticmethod
    def wait_idle(limit_s: float, threshold: float = 0.3) -> float:
        """Wait up to limit_s for other processes to use under `threshold` cores; returns the
        last reading."""
        deadline = time.monotonic() + limit_s
        load = Meter.others_cores()
        while load >= threshold and time.monotonic() < deadline:
            load = Meter.others_cores()
        return load

    @contextlib.contextmanager
    def part(self, name: str):
        a = cpu_seconds()
        try:
            yield
        finally:
            b = cpu_seconds()
            self.parts[name] = {"wall_s": b[0] - a[0], "other_procs_cores": others_cores(a, b)}

    def busy(self, threshold: float = 0.3) -> list[str]:
        """The parts during which other processes kept more than `threshold` cores busy."""
        return [k for k, v in self.parts.items() if v["other_procs_cores"] > threshold]


# -- the flags and the output every benchmark here shares --------------------------------------
def add_common_args(p: argparse.ArgumentParser, wait_before: str) -> None:
    """--wait-idle S (wait up to S s for quiet before `wait_before`) and --json OUT."""
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help=f"before {wait_before} wait up to S seconds for other processes to go idle")
    p.add_argument("--json", default=None, help="also write all numbers to this JSON file")


def write_json(path: str | None, obj) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=2))
        print(f"\nwrote {path}")
