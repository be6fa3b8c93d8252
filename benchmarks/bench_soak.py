#!/usr/bin/env python
"""A soak (issue 26, part 8): 20+ minutes of mixed load on a local cluster with a worker killed
every few minutes; does anything grow, fail, or stay held?

    .venv/bin/python benchmarks/bench_soak.py [--duration-s 1320] [--warmup-s 300] [--kill-every-s 240]
        [--sample-every-s 10] [--rate 4] [--concurrency 8] [--port P] [--out out/soak/]

The cluster is `pdcluster serve` as a user starts it, with its defaults (1 prefill + 1 decode
worker on `tiny`, SLO admission, --request-timeout-s 600, ...), in a session of its own. The
only flag given is `--port`, a free port unless --port names one (8000, the default, may be
held by another serve on the machine). It is stopped at the end by its process group
(SIGTERM: drain, then the workers and its Ray stop; SIGKILL to the group after 90 s), and any
of its processes still there afterwards are SIGKILLed by pid.

Load: Poisson arrivals at --rate, at most --concurrency in flight (each a client coroutine; an
arrival waits for a free one), a mix of: completions and chat, streamed and not, through
aiohttp, httpx and the official `openai` client (max_retries=0: a 429 is seen, not retried);
n=3; cancellations (a streamed completion whose client closes the connection after 1-4
chunks); hostile bodies (an unclosed string of 200k escaped quotes, 100k-deep `[`, 100k keys, a
5000-digit integer seed), each of which must get a 4xx; plain bad requests (an unknown model
-> 404, temperature "hot" -> 400). Prompts are short (random bytes, some sharing a prefix),
max_tokens 16-64, ignore_eos: every answered choice must end with finish_reason "length" and
exactly max_tokens tokens (completions: the `token_ids` of each choice; chat: its logprobs'
entries, or a stream's usage over its choices). 429 (admission) is counted apart from
failures; anything else (5xx, another status, a transport error, a stream's error event or a
missing [DONE], a truncated answer, a hostile body accepted) is a failure, listed with the
time since the last kill.

Kills: every --kill-every-s one worker process gets SIGKILL, prefill and decode alternately
(`ray::Worker` processes under the serve process; which is which from Ray's actor table),
once both pools are whole. The router must resume their requests (no failure, no truncation);
`pdcluster:requests_resumed_total` says how many it resumed.

Samples, every --sample-every-s, from /proc: the resident memory (VmRSS) of the serve process
(the router) and of the worker processes (summed per role, over the current pids: a
replacement is a new process; judged without the pages of the KV caches' memfds, which are
fixed in size and counted on their own: see QUANTITIES), open fds and threads of the serve
process, fds of the workers, /dev/shm (files and bytes: machine-wide, so other users' files
count too), the KV caches' memfds (`memfd:pdcluster-kv`, distinct ones mapped or held by the
serve's processes: a dead worker's cache must not stay mapped in its peer), and Ray's objects
from a driver attached to the serve's Ray (its address from serve's banner): `memory_summary`
gives the objects in the object store, their bytes, and the object references held
cluster-wide (at the quiet points also which process holds which, on which actor's call).

Growth is judged between two quiet points, at the end of the warm-up and at the end: new
arrivals stop, the requests in flight end, the clients close their connections (the router
keeps idle ones for 75 s), the router must show nothing running or waiting and every worker's
KV usage at 0 (within --idle-timeout-s), then three samples 2 s apart are taken, and their
median is the value. The load then resumes (after the warm-up) or the run ends. Exit status 0
only if every quantity grew less than --max-growth-pct (5 %), nothing failed but the intended
4xx, and every KV block came back at both quiet points.

Written to --out: soak.json (every sample, the quiet points, the counts, every failure, the
kills), soak.png (one panel per quantity over time, kills marked) and serve.log.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import httpx  # noqa: E402
import openai  # noqa: E402

from benchmarks.common import proc_stats  # noqa: E402
from cluster.loadtest import promtext  # noqa: E402
from cluster.run.ports import free_port  # noqa: E402

BIN = Path(sys.executable).parent
MODEL = "tiny"
ROLES = ("prefill", "decode")
CLIENT_TIMEOUT_S = 300.0            # per request, on the client (the router's own deadline is 600 s)

# The sampled quantities: key, label, what the panel's y axis is in, and whether its growth is
# judged. A worker's VmRSS includes the pages it has touched of the KV caches in memfds (its own,
# touched whole at start, and a decode worker's read-only mapping of each prefill worker's, whose
# pages become resident as it copies blocks out: up to that cache's size, and from zero again after
# that prefill worker is replaced). Those caches are fixed in size and counted on their own (the KV
# memfd rows), so the workers' growth is judged on their RSS outside them; VmRSS is shown beside it.
QUANTITIES = (
    ("router_rss_mib", "router RSS", "MiB", True),
    ("prefill_rss_mib", "prefill workers VmRSS", "MiB", False),
    ("prefill_rss_nokv_mib", "prefill RSS outside KV memfds", "MiB", True),
    ("decode_rss_mib", "decode workers VmRSS", "MiB", False),
    ("decode_rss_nokv_mib", "decode RSS outside KV memfds", "MiB", True),
    ("router_fds", "router open fds", "fds", True),
    ("router_threads", "router threads", "threads", True),
    ("worker_fds", "workers open fds", "fds", True),
    ("shm_files", "/dev/shm files", "files", True),
    ("shm_mib", "/dev/shm bytes", "MiB", True),
    ("kv_memfds", "KV memfds mapped", "memfds", True),
    ("kv_memfd_mib", "KV memfd bytes", "MiB", True),
    ("ray_objects", "Ray objects in store", "objects", True),
    ("ray_object_mib", "Ray object store use", "MiB", True),
    ("ray_refs", "Ray object references", "refs", True),
)
# Sums over the workers: a sample taken while a killed one is being replaced has no point for them.
PER_WORKER = ("prefill_rss_mib", "prefill_rss_nokv_mib", "decode_rss_mib", "decode_rss_nokv_mib", "worker_fds",
              "kv_memfds", "kv_memfd_mib")


# -- /proc ---------------------------------------------------------------------------------------
def proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every live process."""
    return {pid: (int(fields[1]), fields[19]) for pid, fields in proc_stats()}


def start_time(pid: int, running: bool = False) -> str | None:
    """A process's start time (tells it from a later one with its pid); None once it is gone
    (with `running`, also once it has exited and is a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if running and fields[0] == "Z" else fields[19]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live process under `root` (not `root`)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in proc_table().items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out[child] = cmdline(child)
                todo.append(child)
    return out


def status(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except OSError:
        return {}


def rss_mib(pid: int) -> float:
    v = status(pid).get("VmRSS", "0 kB").split()[0]
    return int(v) / 1024


def kv_resident_mib(pid: int) -> float:
    """Resident pages of a process's `memfd:pdcluster-kv` mappings (/proc/PID/smaps)."""
    total, in_kv = 0, False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if _SMAPS_HEAD.match(line):
                    in_kv = "memfd:pdcluster-kv" in line
                elif in_kv and line.startswith("Rss:"):
                    total += int(line.split()[1])
    except OSError:
        pass
    return total / 1024


_SMAPS_HEAD = re.compile(r"[0-9a-f]+-[0-9a-f]+ ")


def fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def kv_memfds(pids) -> tuple[int, float]:
    """Distinct `memfd:pdcluster-kv` files mapped or held open by `pids`: (count, MiB), each
    sized by its largest mapping (or its size, when only held open)."""
    sizes: dict[int, int] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if "memfd:pdcluster-kv" not in line:
                        continue
                    parts = line.split()
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    ino = int(parts[4])
                    sizes[ino] = max(sizes.get(ino, 0), hi - lo)
        except OSError:
            pass
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if "memfd:pdcluster-kv" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    sizes[st.st_ino] = max(sizes.get(st.st_ino, 0), st.st_size)
            except OSError:
                pass
    return len(sizes), sum(sizes.values()) / 2**20


def dev_shm() -> tuple[int, float, list[str]]:
    """Files in /dev/shm (machine-wide): count, MiB, names."""
    names, total = [], 0
    for dirpath, _, files in os.walk("/dev/shm"):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                total += os.lstat(path).st_size
            except OSError:
                continue
            names.append(os.path.relpath(path, "/dev/shm"))
    return len(names), total / 2**20, sorted(names)


# -- the serve's Ray, from a driver of our own ------------------------------------------------------
_SUMMARY_COUNTS = ("Local References", "Pinned", "Used by task", "Captured in Objects", "Actor Handles")
_ROLE = re.compile(r"-(prefill|decode|colocated)-\d+$")


class RayProbe:
    """A driver attached to the serve's Ray (namespace "pdcluster"): the workers' pids and roles
    from the actor table, and the object store's use from `memory_summary` (no dashboard needed).
    Calls are serialized: the sampler and the killer threads share it."""

    def __init__(self, address: str):
        import ray
        import ray._private.ray_constants as constants
        # A local serve's Ray listens on 127.0.0.1 only; with this switch on, Ray rewrites a
        # loopback address to the machine's own address, where nothing listens (launcher.py's
        # start_local_ray turns it off for the same reason).
        constants.ENABLE_RAY_CLUSTER = False
        self.ray, self.address = ray, address
        self.lock = threading.Lock()
        ray.init(address=address, namespace="pdcluster", log_to_driver=False, logging_level=logging.ERROR)

    def actors(self) -> dict:
        from ray._private import state
        with self.lock:
            return state.actors()

    def actor_names(self) -> dict[str, str]:
        """actor id (hex) -> its name (a restarted actor keeps its id)."""
        return {a["ActorID"]: a.get("Name") or a.get("ActorClassName", "?") for a in self.actors().values()}

    def workers(self) -> dict[int, tuple[str, str]]:
        """pid -> (role, actor name) of every worker actor Ray has ALIVE."""
        actors = self.actors()
        out = {}
        for a in actors.values():
            m = _ROLE.search(a.get("Name") or "")
            if a.get("ActorClassName") == "Worker" and a.get("State") == "ALIVE" and m and a.get("Pid"):
                out[int(a["Pid"])] = (m.group(1), a["Name"])
        return out

    def objects(self) -> tuple[dict[str, float], str]:
        """Objects in the object store, their MiB, and object references held cluster-wide; and
        the summary's text (which process holds which reference)."""
        from ray._private.internal_api import memory_summary
        with self.lock:
            text = memory_summary(address=self.address, units="B")
        return parse_memory_summary(text), text

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ray.shutdown()


def parse_memory_summary(text: str) -> dict[str, float]:
    """Ray 2.60's memory summary: per node a header row ("Mem Used by Objects  Local References
    ...") and a row of values ("0.0 B  2, (0.0 B)  ..."), and an aggregate line "Plasma memory
    usage N MiB, M objects, ..."."""
    lines = text.splitlines()
    used, refs = 0.0, 0
    for i, line in enumerate(lines[:-1]):
        if line.startswith("Mem Used by Objects"):
            row = lines[i + 1]
            m = re.match(r"\s*([\d.]+)\s*B", row)
            if m:
                used += float(m.group(1))
            refs += sum(int(x) for x in re.findall(r"(\d+),\s*\(", row))
    m = re.search(r"Plasma memory usage (\d+) MiB, (\d+) objects", text)
    if m is None:
        raise RuntimeError(f"memory_summary's text has no 'Plasma memory usage' line:\n{text[-1500:]}")
    return {"ray_objects": int(m.group(2)), "ray_object_mib": used / 2**20, "ray_refs": refs}


def reference_rows(text: str, actors: dict[str, str]) -> list[str]:
    """The memory summary's reference table, one line per reference: pid | type | status |
    reference type | object ref, and the actor whose call (or handle) it is (an actor task's
    object id is 8 bytes of its own, the actor's 16-byte id, a 4-byte index; call sites are not
    recorded)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) >= 9 and re.fullmatch(r"[0-9a-f]{56}", cells[-1]):
            actor = actors.get(cells[-1][16:48], "not an actor call")
            rows.append(" | ".join([cells[1], cells[2], cells[4], cells[7], cells[8]]) + f"  ({actor})")
    return rows


# -- the serve process ----------------------------------------------------------------------------
class Serve:
    """`pdcluster serve --port P` in a session of its own; its log in `log`."""

    def __init__(self, port: int, log: Path):
        self.port, self.log = port, log
        self.url = f"http://127.0.0.1:{port}"
        exe = BIN / "pdcluster"
        self.cmd = (([str(exe)] if exe.exists() else [sys.executable, "-m", "cluster.cli"])
                    + ["serve", "--port", str(port)])
        env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
        env.pop("RAY_ADDRESS", None)          # a local Ray of its own, never one the caller points at
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.pgid = self.proc.pid                 # its own session: pgid == pid
        self.seen: dict[int, str] = {}            # every descendant seen (pid -> start time), for cleanup

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, deadline_s: float = 300) -> str:
        """Wait for /health ok and the banner; the Ray GCS address from it."""
        end = time.monotonic() + deadline_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited ({self.proc.returncode}):\n{self.text()[-3000:]}")
            m = re.search(r"another router: pdcluster router --address (\S+)", self.text())
            try:
                ok = httpx.get(f"{self.url}/health", timeout=5, trust_env=False).json().get("status") == "ok"
            except (httpx.HTTPError, ValueError):
                ok = False
            if ok and m:
                return m.group(1)
            if time.monotonic() > end:
                raise RuntimeError(f"serve was not ready within {deadline_s:g}s:\n{self.text()[-3000:]}")
            time.sleep(0.5)

    def tree(self) -> dict[int, str]:
        d = descendants(self.proc.pid)
        for pid in d:
            if (st := start_time(pid)) is not None:
                self.seen.setdefault(pid, st)
        return d

    def stop(self, timeout_s: float = 90) -> int | None:
        """SIGTERM to its process group (it drains and stops its workers and Ray), SIGKILL to the
        group after `timeout_s`; then whatever it started that still runs is SIGKILLed by pid."""
        with contextlib.suppress(Exception):
            self.tree()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pgid, signal.SIGKILL)
                self.proc.wait(30)
        left = []
        end = time.monotonic() + 30
        while True:
            left = [pid for pid, st in self.seen.items() if start_time(pid, running=True) == st]
            if not left or time.monotonic() > end:
                break
            time.sleep(0.5)
        for pid in left:                                  # only processes this serve started
            if start_time(pid, running=True) == self.seen[pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if left:
            print(f"  ({len(left)} process(es) of the serve outlived it and were SIGKILLed: "
                  + ", ".join(cmdline(p)[:40] or str(p) for p in left) + ")", flush=True)
        return self.proc.returncode


def metrics(url: str) -> dict[str, float]:
    return promtext.scrape(f"{url}/metrics")


def health(url: str) -> dict:
    try:
        r = httpx.get(f"{url}/health", timeout=5, trust_env=False)
        return r.json()
    except (httpx.HTTPError, ValueError):
        return {}


def worker_series(m: dict[str, float], name: str) -> dict[str, float]:
    """worker -> value of a per-worker gauge."""
    out = {}
    for series, v in m.items():
        n, labels = promtext.split(series)
        if n == name and "worker" in labels:
            out[labels["worker"]] = v
    return out


def idle_state(m: dict[str, float]) -> dict:
    """What must be 0 once the load has stopped: the router's own gauges, and per worker its
    running and waiting sequences and KV usage."""
    return {"router_requests_running": promtext.total(m, "pdcluster:router_requests_running"),
            "router_requests_waiting": promtext.total(m, "pdcluster:router_requests_waiting"),
            "router_requests_gated": promtext.total(m, "pdcluster:router_requests_gated"),
            "num_requests_running": worker_series(m, "pdcluster:num_requests_running"),
            "num_requests_waiting": worker_series(m, "pdcluster:num_requests_waiting"),
            "kv_cache_usage_perc": worker_series(m, "pdcluster:kv_cache_usage_perc")}


def is_idle(s: dict, workers: int) -> bool:
    per_worker = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    return (s["router_requests_running"] == 0 and s["router_requests_waiting"] == 0 and s["router_requests_gated"] == 0
            and all(len(s[k]) == workers and not any(s[k].values()) for k in per_worker))


# -- sampling ---------------------------------------------------------------------------------------
class Monitor:
    """Samples (a thread, every `every_s`), pool state from /health, and the kills (a thread)."""

    def __init__(self, serve: Serve, probe: RayProbe, every_s: float, t0: float):
        self.serve, self.probe, self.every_s, self.t0 = serve, probe, every_s, t0
        self.samples: list[dict] = []
        self.kills: list[dict] = []
        self.errors: list[str] = []
        h = health(serve.url)
        self.full = {r: h.get("workers", {}).get(r, 0) for r in ROLES}
        self.shm_start = set(dev_shm()[2])
        self.shm_new: set[str] = set()
        self.stop_event = threading.Event()
        self.quiet = threading.Event()          # set while the load is paused for a quiet point
        self.threads: list[threading.Thread] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def sample(self, tag: str = "") -> dict:
        tree = self.serve.tree()
        workers = self.probe.workers()
        pids = {r: [p for p, (role, _) in workers.items() if role == r and p in tree
                    and tree[p].startswith("ray::Worker")] for r in ROLES}
        router = self.serve.proc.pid
        st = status(router)
        shm_n, shm_mib, shm_names = dev_shm()
        self.shm_new |= set(shm_names) - self.shm_start
        memfd_n, memfd_mib = kv_memfds([router, *tree])
        objects, text = self.probe.objects()
        rss = {p: rss_mib(p) for r in ROLES for p in pids[r]}
        kv = {p: kv_resident_mib(p) for p in rss}
        s = {"t": self.now(), "tag": tag,
             "router_rss_mib": rss_mib(router),
             **{f"{r}_rss_mib": sum(rss[p] for p in pids[r]) for r in ROLES},
             **{f"{r}_rss_nokv_mib": sum(rss[p] - kv[p] for p in pids[r]) for r in ROLES},
             "router_fds": fd_count(router),
             "router_threads": int(st.get("Threads", 0)),
             "worker_fds": sum(fd_count(p) for r in ROLES for p in pids[r]),
             "shm_files": shm_n, "shm_mib": shm_mib,
             "kv_memfds": memfd_n, "kv_memfd_mib": memfd_mib,
             **objects,
             "worker_pids": {r: sorted(pids[r]) for r in ROLES}}
        s["whole"] = all(len(pids[r]) == self.full[r] for r in ROLES)
        if tag:                                   # a quiet point's: who holds which Ray reference
            s["ray_references"] = reference_rows(text, self.probe.actor_names())
        return s

    def whole(self) -> bool:
        """Both pools at full size, per the router's /health and Ray's actor table."""
        h = health(self.serve.url)
        if any(h.get("workers", {}).get(r, -1) != self.full[r] for r in ROLES):
            return False
        roles = [role for role, _ in self.probe.workers().values()]
        return all(roles.count(r) == self.full[r] for r in ROLES)

    def start(self, kill_every_s: float, end_t: float) -> None:
        self.threads = [threading.Thread(target=self._sampler, name="sampler", daemon=True),
                        threading.Thread(target=self._killer, args=(kill_every_s, end_t), name="killer", daemon=True)]
        for t in self.threads:
            t.start()

    def close(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=60)

    def _sampler(self) -> None:
        n = 0
        while not self.stop_event.wait(max(0.0, self.t0 + n * self.every_s - time.monotonic())):
            n += 1
            try:
                self.samples.append(self.sample())
            except Exception as e:           # noqa: BLE001 -- reported, the soak goes on
                self.errors.append(f"{self.now():.0f}s sample: {type(e).__name__}: {e}")

    def _killer(self, every_s: float, end_t: float) -> None:
        """SIGKILL a worker every `every_s` (prefill first, then decode, ...), once both pools
        are whole and the load is not paused; none within every_s / 4 of the end of the load."""
        n = 1
        while n * every_s < end_t - every_s / 4:
            if self.stop_event.wait(max(0.0, self.t0 + n * every_s - time.monotonic())):
                return
            role = ROLES[(n - 1) % 2]
            while (self.quiet.is_set() or not self.whole()) and not self.stop_event.wait(0.5):
                pass
            if self.stop_event.is_set():
                return
            try:
                self._kill(role)
            except Exception as e:           # noqa: BLE001
                self.errors.append(f"{self.now():.0f}s kill {role}: {type(e).__name__}: {e}")
            n += 1

    def _kill(self, role: str) -> None:
        tree = self.serve.tree()
        victims = [(p, name) for p, (r, name) in self.probe.workers().items()
                   if r == role and tree.get(p, "").startswith("ray::Worker")]
        if not victims:
            raise RuntimeError(f"no {role} worker among the serve's processes: "
                               + ", ".join(sorted({c[:30] for c in tree.values()})))
        pid, name = victims[0]
        before = promtext.total(metrics(self.serve.url), "pdcluster:requests_resumed_total")
        st = start_time(pid)
        os.kill(pid, signal.SIGKILL)
        k = {"t": self.now(), "role": role, "worker": name, "pid": pid, "cmdline": tree[pid][:60],
             "start_time": st, "resumed_before": before}
        self.kills.append(k)
        print(f"  {k['t']:6.0f}s  SIGKILL {role} worker {name} (pid {pid})", flush=True)
        # Wait for its replacement (a new pid ALIVE in Ray, the pool whole at the router).
        end = time.monotonic() + 300
        while not self.stop_event.wait(0.5):
            new = [p for p, (r, nm) in self.probe.workers().items() if nm == name and p != pid]
            if new and self.whole():
                k["new_pid"], k["replaced_after_s"] = new[0], round(self.now() - k["t"], 1)
                break
            if time.monotonic() > end:
                self.errors.append(f"{self.now():.0f}s: {role} worker {name} not replaced within 300 s")
                break
        time.sleep(2)
        k["resumed"] = promtext.total(metrics(self.serve.url), "pdcluster:requests_resumed_total") - before
        print(f"  {self.now():6.0f}s  {role} worker back after {k.get('replaced_after_s', '?')} s "
              f"(new pid {k.get('new_pid', '?')}); requests resumed meanwhile: {k['resumed']:g}", flush=True)


# -- the load ---------------------------------------------------------------------------------------
def hostile_bodies() -> dict[str, bytes]:
    head = b'{"model":"' + MODEL.encode() + b'",'
    keys = ",".join(f'"k{i}":0' for i in range(100_000))
    return {"unclosed_string": head + b'"prompt":"' + b'\\"' * 200_000,
            "deep_nesting": head + b'"prompt":' + b"[" * 100_000,
            "many_keys": head + b'"prompt":"hi","max_tokens":4,"extra":{' + keys.encode() + b"}}",
            "huge_int_seed": head + b'"prompt":"hi","max_tokens":4,"seed":' + b"7" * 5000 + b"}"}


BAD_REQUESTS = {  # kind -> (path, body, the status it must get)
    "unknown_model": ("/v1/completions", {"model": "no-such-model", "prompt": "hi", "max_tokens": 4}, 404),
    "temperature_hot": ("/v1/completions",
                        {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": "hot"}, 400),
}

# kind -> weight in the mix
MIX = {"completion": 18, "completion_stream": 16, "chat": 10, "chat_stream": 10, "completion_n3": 5,
       "chat_stream_n3": 5, "openai_completion": 5, "openai_completion_stream": 4, "openai_chat": 5,
       "openai_chat_stream": 4, "cancel": 10, "hostile": 4, "bad": 4}


class Check(Exception):
    """A request answered, but not as it must be: (category, detail)."""

    def __init__(self, category: str, detail: str):
        super().__init__(f"{category}: {detail}")
        self.category, self.detail = category, detail


class Status(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}")
        self.status, self.body = status, body


def check_choices(counts: dict[int, int], reasons: dict[int, str | None], want_n: int, max_tokens: int) -> None:
    if sorted(reasons) != list(range(want_n)):
        raise Check("truncated", f"choices {sorted(reasons)}, want 0..{want_n - 1}")
    for i in range(want_n):
        if reasons[i] != "length" or counts.get(i, 0) != max_tokens:
            raise Check("truncated", f"choice {i}: finish_reason {reasons[i]!r}, {counts.get(i, 0)} tokens, "
                        f"want 'length' and {max_tokens}")


@dataclass
class Counts:
    ok: dict[str, int] = field(default_factory=dict)
    cancelled: int = 0
    intended_4xx: dict[str, int] = field(default_factory=dict)
    overloaded_429: dict[str, int] = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)
    sent: int = 0


class Load:
    """Poisson arrivals at `rate`, at most `concurrency` in flight, a weighted mix of kinds."""

    def __init__(self, url: str, rate: float, concurrency: int, seed: int, monitor: Monitor):
        self.url, self.rate, self.concurrency, self.monitor = url, rate, concurrency, monitor
        self.rng = random.Random(seed)
        self.counts = Counts()
        self.hostile = hostile_bodies()
        self.prefixes = [bytes(self.rng.randrange(32, 127) for _ in range(n)).decode() for n in (48, 96)]
        self.inflight: set[asyncio.Task] = set()
        self.sem = asyncio.Semaphore(concurrency)
        self.running = asyncio.Event()
        self.running.set()
        self.clients_open = False

    # clients: opened at start and after each quiet point, closed for quiet points
    async def open_clients(self) -> None:
        self.aio = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S), trust_env=False,
                                         connector=aiohttp.TCPConnector(limit=0))
        self.hx = httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, trust_env=False,
                                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        self.oai = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                                      timeout=CLIENT_TIMEOUT_S,
                                      http_client=httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, trust_env=False))
        self.clients_open = True

    async def close_clients(self) -> None:
        if self.clients_open:
            await self.aio.close()
            await self.hx.aclose()
            await self.oai.close()
            self.clients_open = False

    async def drain(self) -> None:
        """Stop new arrivals and wait for the requests in flight."""
        self.running.clear()
        while self.inflight:
            await asyncio.gather(*list(self.inflight), return_exceptions=True)

    # the arrival loop
    async def run(self, end_t: float) -> None:
        kinds, weights = zip(*MIX.items())
        while self.monitor.now() < end_t:
            await self.running.wait()
            await asyncio.sleep(self.rng.expovariate(self.rate))
            if not self.running.is_set() or self.monitor.now() >= end_t:
                continue
            await self.sem.acquire()
            if not self.running.is_set():            # paused while waiting for a free client
                self.sem.release()
                continue
            kind = self.rng.choices(kinds, weights)[0]
            task = asyncio.ensure_future(self.one(kind))
            self.inflight.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.inflight.discard(task)
        self.sem.release()

    def prompt(self) -> str:
        body = bytes(self.rng.randrange(32, 127) for _ in range(self.rng.randint(4, 120))).decode()
        return (self.rng.choice(self.prefixes) + body) if self.rng.random() < 0.3 else body

    def params(self, n: int = 1) -> dict:
        p = {"model": MODEL, "max_tokens": self.rng.randint(16, 64), "ignore_eos": True,
             "temperature": self.rng.choice((0.0, 0.7, 1.0))}
        if n > 1:
            p["n"] = n
        if self.rng.random() < 0.3:
            p["seed"] = self.rng.randrange(2**31)
        return p

    def messages(self) -> list[dict]:
        msgs = [{"role": "user", "content": self.prompt()}]
        if self.rng.random() < 0.5:
            msgs.insert(0, {"role": "system", "content": self.prefixes[0]})
        return msgs

    async def one(self, kind: str) -> None:
        c = self.counts
        c.sent += 1
        t = self.monitor.now()
        label, want = kind, None
        try:
            if kind == "hostile":
                label = "hostile_" + self.rng.choice(sorted(self.hostile))
                await self.intended(label, self.hostile[label.removeprefix("hostile_")], "/v1/completions", None)
            elif kind == "bad":
                label = self.rng.choice(sorted(BAD_REQUESTS))
                path, body, want = BAD_REQUESTS[label]
                await self.intended(label, json.dumps(body).encode(), path, want)
            elif kind == "cancel":
                if await self.cancel():
                    c.cancelled += 1
                else:
                    c.ok[kind] = c.ok.get(kind, 0) + 1
            else:
                await getattr(self, kind)()
                c.ok[kind] = c.ok.get(kind, 0) + 1
        except Status as e:
            if e.status == 429:
                c.overloaded_429[label] = c.overloaded_429.get(label, 0) + 1
            else:
                self.fail(t, label, "5xx" if e.status >= 500 else "status", f"HTTP {e.status}: {e.body[:300]}")
        except Check as e:
            self.fail(t, label, e.category, e.detail)
        except openai.APIStatusError as e:
            if e.status_code == 429:
                c.overloaded_429[label] = c.overloaded_429.get(label, 0) + 1
            else:
                self.fail(t, label, "5xx" if e.status_code >= 500 else "status",
                          f"HTTP {e.status_code}: {str(e.body)[:300]}")
        except openai.APIConnectionError as e:
            self.fail(t, label, "transport", f"{type(e).__name__}: {e.__cause__ or e}")
        except openai.APIError as e:                      # an error event in a stream
            self.fail(t, label, "stream_error", f"{type(e).__name__}: {e}")
        except (TimeoutError, aiohttp.ClientError, httpx.HTTPError, OSError) as e:
            self.fail(t, label, "transport", f"{type(e).__name__}: {e}")
        except Exception as e:                            # noqa: BLE001 -- a failure, listed
            self.fail(t, label, "client_error", f"{type(e).__name__}: {e}")

    def fail(self, t: float, kind: str, category: str, detail: str) -> None:
        kills = [k["t"] for k in self.monitor.kills if k["t"] <= self.monitor.now()]
        f = {"t": round(t, 1), "ended_t": round(self.monitor.now(), 1), "kind": kind, "category": category,
             "detail": detail, "since_last_kill_s": round(t - kills[-1], 1) if kills else None}
        self.counts.failures.append(f)
        print(f"  FAILED {f['t']:6.0f}s {kind}: {category}: {detail[:200]}", flush=True)

    # -- intended 4xx (raw bytes through aiohttp)
    async def intended(self, label: str, body: bytes, path: str, want: int | None) -> None:
        async with self.aio.post(self.url + path, data=body, headers={"Content-Type": "application/json"}) as r:
            text = await r.text(errors="replace")
            if r.status == 429:
                raise Status(429, text)
            ok = (400 <= r.status < 500) if want is None else r.status == want
            if not ok:
                what = "5xx" if r.status >= 500 else "accepted" if r.status < 300 else "status"
                raise Check(what, f"HTTP {r.status} (want {want or '4xx'}): {text[:200]}")
            self.counts.intended_4xx[label] = self.counts.intended_4xx.get(label, 0) + 1

    # -- aiohttp
    async def _aio_post(self, path: str, body: dict):
        r = await self.aio.post(self.url + path, json=body)
        if r.status != 200:
            text = await r.text(errors="replace")
            r.release()
            raise Status(r.status, text)
        return r

    async def completion(self, n: int = 1) -> None:
        p = self.params(n)
        r = await self._aio_post("/v1/completions", {**p, "prompt": self.prompt()})
        async with r:
            d = await r.json()
        ch = d["choices"]
        check_choices({c["index"]: len(c["token_ids"]) for c in ch}, {c["index"]: c["finish_reason"] for c in ch},
                      n, p["max_tokens"])
        if d["usage"]["completion_tokens"] != n * p["max_tokens"]:
            raise Check("truncated", f"usage {d['usage']}, want {n * p['max_tokens']} completion tokens")

    async def completion_n3(self) -> None:
        await self.completion(3)

    async def _aio_events(self, r):
        """The data of each SSE event (parsed JSON, or "[DONE]")."""
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data:"):
                data = line[5:].strip()
                yield data if data == "[DONE]" else json.loads(data)

    async def completion_stream(self) -> None:
        p = self.params()
        r = await self._aio_post("/v1/completions", {**p, "prompt": self.prompt(), "stream": True})
        async with r:
            counts, reasons = await self._collect_stream(self._aio_events(r), completion=True)
        check_choices(counts, reasons, 1, p["max_tokens"])

    async def _collect_stream(self, events, completion: bool, usage: list | None = None):
        counts: dict[int, int] = {}
        reasons: dict[int, str | None] = {}
        done = False
        async for e in events:
            if e == "[DONE]":
                done = True
                break
            if "error" in e:
                raise Check("stream_error", json.dumps(e["error"])[:300])
            if e.get("usage") and usage is not None:
                usage.append(e["usage"])
            for c in e.get("choices") or ():
                i = c["index"]
                reasons.setdefault(i, None)
                if completion:
                    counts[i] = counts.get(i, 0) + len(c.get("token_ids") or ())
                if c.get("finish_reason"):
                    reasons[i] = c["finish_reason"]
        if not done:
            raise Check("no_done", f"the stream ended without [DONE] (choices so far: {reasons})")
        return counts, reasons

    async def cancel(self) -> bool:
        """A streamed completion whose client closes the connection after 1-4 chunks; True when
        it did (False: the stream ended first, checked as any other)."""
        p = self.params()
        p["max_tokens"] = 64
        after = self.rng.randint(1, 4)
        r = await self._aio_post("/v1/completions", {**p, "prompt": self.prompt(), "stream": True})
        chunks, counts, reasons = 0, {}, {}
        async for e in self._aio_events(r):
            if e == "[DONE]":
                r.release()
                check_choices(counts, reasons, 1, p["max_tokens"])
                return False
            if "error" in e:
                r.close()
                raise Check("stream_error", json.dumps(e["error"])[:300])
            for c in e.get("choices") or ():
                counts[c["index"]] = counts.get(c["index"], 0) + len(c.get("token_ids") or ())
                reasons[c["index"]] = c.get("finish_reason")
            chunks += 1
            if chunks >= after:
                r.close()                 # the connection goes: the router must abort the request
                return True
        r.close()
        raise Check("no_done", f"the stream ended after {chunks} chunks without [DONE]")

    # -- httpx
    async def chat(self) -> None:
        p = self.params()
        r = await self.hx.post(self.url + "/v1/chat/completions",
                               json={**p, "messages": self.messages(), "logprobs": True})
        if r.status_code != 200:
            raise Status(r.status_code, r.text)
        d = r.json()
        ch = d["choices"]
        check_choices({c["index"]: len(c["logprobs"]["content"]) for c in ch},
                      {c["index"]: c["finish_reason"] for c in ch}, 1, p["max_tokens"])

    async def chat_stream(self, n: int = 1) -> None:
        p = self.params(n)
        body = {**p, "messages": self.messages(), "stream": True, "stream_options": {"include_usage": True}}
        async with self.hx.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise Status(r.status_code, (await r.aread()).decode(errors="replace"))

            async def events():
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        data = line[5:].strip()
                        yield data if data == "[DONE]" else json.loads(data)
            usage: list = []
            _, reasons = await self._collect_stream(events(), completion=False, usage=usage)
        want = n * p["max_tokens"]
        if not usage or usage[-1]["completion_tokens"] != want:
            raise Check("truncated", f"usage {usage[-1] if usage else None}, want {want} completion tokens")
        check_choices({i: p["max_tokens"] for i in reasons}, reasons, n, p["max_tokens"])

    async def chat_stream_n3(self) -> None:
        await self.chat_stream(3)

    # -- the openai client
    async def openai_completion(self) -> None:
        p = self.params()
        mt = p.pop("max_tokens")
        extra = {"ignore_eos": p.pop("ignore_eos")}
        p.pop("model")
        r = await self.oai.completions.create(model=MODEL, prompt=self.prompt(), max_tokens=mt, extra_body=extra, **p)
        ch = [c.model_dump() for c in r.choices]
        check_choices({c["index"]: len(c.get("token_ids") or ()) for c in ch},
                      {c["index"]: c["finish_reason"] for c in ch}, 1, mt)

    async def openai_completion_stream(self) -> None:
        p = self.params()
        mt = p.pop("max_tokens")
        extra = {"ignore_eos": p.pop("ignore_eos")}
        p.pop("model")
        stream = await self.oai.completions.create(model=MODEL, prompt=self.prompt(), max_tokens=mt, stream=True,
                                                   extra_body=extra, **p)
        counts: dict[int, int] = {}
        reasons: dict[int, str | None] = {}
        async for chunk in stream:
            for c in chunk.choices:
                d = c.model_dump()
                counts[c.index] = counts.get(c.index, 0) + len(d.get("token_ids") or ())
                reasons[c.index] = c.finish_reason or reasons.get(c.index)
        check_choices(counts, reasons, 1, mt)

    async def openai_chat(self) -> None:
        p = self.params()
        mt = p.pop("max_tokens")
        extra = {"ignore_eos": p.pop("ignore_eos")}
        p.pop("model")
        r = await self.oai.chat.completions.create(model=MODEL, messages=self.messages(), max_tokens=mt,
                                                   logprobs=True, extra_body=extra, **p)
        check_choices({c.index: len(c.logprobs.content or ()) if c.logprobs else 0 for c in r.choices},
                      {c.index: c.finish_reason for c in r.choices}, 1, mt)

    async def openai_chat_stream(self) -> None:
        p = self.params()
        mt = p.pop("max_tokens")
        extra = {"ignore_eos": p.pop("ignore_eos")}
        p.pop("model")
        stream = await self.oai.chat.completions.create(model=MODEL, messages=self.messages(), max_tokens=mt,
                                                        stream=True, stream_options={"include_usage": True},
                                                        extra_body=extra, **p)
        reasons: dict[int, str | None] = {}
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                reasons[c.index] = c.finish_reason or reasons.get(c.index)
        if usage is None or usage.completion_tokens != mt:
            raise Check("truncated", f"usage {usage}, want {mt} completion tokens")
        check_choices({i: mt for i in reasons}, reasons, 1, mt)


# -- quiet points, the run ---------------------------------------------------------------------------
def quiet_point(monitor: Monitor, name: str, idle_timeout_s: float) -> dict:
    """With no load: wait (polling, within `idle_timeout_s`) for the pools to be whole and the
    router idle with every KV block back; then three samples 2 s apart, their median per quantity."""
    url = monitor.serve.url
    workers = sum(monitor.full.values())
    end = time.monotonic() + idle_timeout_s
    state, whole, t_wait = None, False, monitor.now()
    while True:
        try:
            whole = monitor.whole()
            state = idle_state(metrics(url))
            if whole and is_idle(state, workers):
                break
        except (httpx.HTTPError, ValueError) as e:
            state = {"error": f"{type(e).__name__}: {e}"}
        if time.monotonic() > end:
            break
        time.sleep(0.5)
    idle = bool(state) and "error" not in state and whole and is_idle(state, workers)
    waited = monitor.now() - t_wait
    print(f"  {monitor.now():6.0f}s  quiet point '{name}': "
          + (f"idle, every KV block back, after {waited:.1f} s" if idle else
             f"NOT idle within {idle_timeout_s:g} s: pools whole {whole}, {json.dumps(state)}"), flush=True)
    samples = []
    for i in range(3):
        if i:
            time.sleep(2)
        samples.append(monitor.sample(tag=name))
    monitor.samples += samples
    value = {k: statistics.median(s[k] for s in samples) for k, *_ in QUANTITIES}
    return {"name": name, "t": samples[-1]["t"], "idle": idle, "waited_s": round(waited, 1), "state": state,
            "whole": whole, "value": value, "samples": samples}


async def soak(args, serve: Serve, monitor: Monitor) -> tuple[Load, dict, dict]:
    load = Load(serve.url, args.rate, args.concurrency, args.seed, monitor)
    await load.open_clients()
    runner = asyncio.ensure_future(load.run(args.duration_s))
    try:
        await asyncio.sleep(max(0.0, args.warmup_s - monitor.now()))
        monitor.quiet.set()
        await load.drain()
        await load.close_clients()
        warm = await asyncio.to_thread(quiet_point, monitor, "warm-up", args.idle_timeout_s)
        await load.open_clients()
        monitor.quiet.clear()
        load.running.set()
        await runner
        monitor.quiet.set()
        await load.drain()
        await load.close_clients()
        end = await asyncio.to_thread(quiet_point, monitor, "end", args.idle_timeout_s)
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        for t in list(load.inflight):
            t.cancel()
        await asyncio.gather(*list(load.inflight), return_exceptions=True)
        await load.close_clients()
    return load, warm, end


def growth(a: float, b: float) -> float:
    if a == b:
        return 0.0
    return math.inf if a == 0 else (b - a) / abs(a) * 100


def plot(path: Path, samples: list[dict], kills: list[dict], quiet: list[dict], warmup_s: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = 3
    rows = math.ceil(len(QUANTITIES) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 2.8 * rows), squeeze=False)
    load_samples = sorted((s for s in samples if not s["tag"]), key=lambda s: s["t"])
    for ax, (key, label, unit, _) in zip(axes.flat, QUANTITIES):
        # While a killed worker is being replaced its pool is short: no point for the workers' sums.
        ys = [s[key] if s["whole"] or key not in PER_WORKER else math.nan for s in load_samples]
        ax.plot([s["t"] / 60 for s in load_samples], ys, lw=1, color="k")
        for q in quiet:
            ax.plot([q["t"] / 60], [q["value"][key]], "o", color="tab:green", ms=5)
        for k in kills:
            ax.axvline(k["t"] / 60, color="tab:red" if k["role"] == "prefill" else "tab:blue", ls="--", lw=0.8)
        ax.axvspan(0, warmup_s / 60, color="0.9", zorder=0)
        ax.set_title(label, fontsize=9)
        ax.set_ylabel(unit, fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(QUANTITIES):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("minutes since the load started", fontsize=8)
    fig.suptitle("soak: grey = warm-up, dashed = SIGKILL (red prefill, blue decode), green = quiet points "
                 "(the growth check)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=1320.0, help="seconds of load (the quiet point after the "
                   "warm-up comes on top)")
    p.add_argument("--warmup-s", type=float, default=300.0, help="the growth is measured from here")
    p.add_argument("--kill-every-s", type=float, default=240.0,
                   help="SIGKILL a worker this often (prefill, decode, ...)")
    p.add_argument("--sample-every-s", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second offered (Poisson)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at most (client coroutines)")
    p.add_argument("--port", type=int, default=0, help="serve's port (default: a free one)")
    p.add_argument("--out", default="out/soak/", help="directory for soak.json, soak.png, serve.log")
    p.add_argument("--idle-timeout-s", type=float, default=120.0,
                   help="how long a quiet point waits for the router to be idle and every block back")
    p.add_argument("--max-growth-pct", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if not 0 < a.warmup_s < a.duration_s:
        p.error("need 0 < --warmup-s < --duration-s")
    if a.rate <= 0 or a.concurrency < 1 or a.sample_every_s <= 0 or a.kill_every_s <= 0:
        p.error("--rate, --concurrency, --sample-every-s and --kill-every-s must be positive")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    port = a.port or free_port()
    serve = Serve(port, out / "serve.log")
    print(f"serve: {' '.join(Path(serve.cmd[0]).name if i == 0 else x for i, x in enumerate(serve.cmd))} "
          f"(pid {serve.proc.pid}, its own session); log: {serve.log}", flush=True)
    probe = monitor = None
    t_start = time.monotonic()
    try:
        address = serve.wait_ready()
        probe = RayProbe(address)
        tree = serve.tree()
        print(f"  ready in {time.monotonic() - t_start:.0f} s; Ray at {address}; its processes: "
              + ", ".join(sorted({c.split()[0].rsplit('/', 1)[-1][:24] for c in tree.values() if c})), flush=True)
        monitor = Monitor(serve, probe, a.sample_every_s, time.monotonic())
        print(f"load: {a.rate:g} req/s offered, <= {a.concurrency} in flight, for {a.duration_s:g} s "
              f"(warm-up {a.warmup_s:g} s); a worker SIGKILLed every {a.kill_every_s:g} s; samples every "
              f"{a.sample_every_s:g} s", flush=True)
        monitor.start(a.kill_every_s, a.duration_s)
        m0 = metrics(serve.url)
        load, warm, end = asyncio.run(soak(a, serve, monitor))
        monitor.close()
        m1 = metrics(serve.url)
        alive = serve.proc.poll() is None
    finally:
        if monitor is not None:
            monitor.close()
        if probe is not None:
            probe.close()
        rc = serve.stop()
        print(f"serve stopped (exit {rc})", flush=True)
    return report(a, serve, monitor, load, warm, end, m0, m1, alive, out)


def report(a, serve: Serve, monitor: Monitor, load: Load, warm: dict, end: dict, m0: dict, m1: dict, alive: bool,
           out: Path) -> int:
    c = load.counts
    rows = []
    print(f"\n{'quantity':36s} {'warm-up':>9s} {'end':>9s} {'growth':>8s}   (quiet points at "
          f"{warm['t']:.0f} s and {end['t']:.0f} s; median of 3 samples)")
    for key, label, unit, judged in QUANTITIES:
        x, y = warm["value"][key], end["value"][key]
        g = growth(x, y)
        rows.append({"quantity": key, "label": label, "unit": unit, "warmup": x, "end": y, "growth_pct": g,
                     "judged": judged})
        fmt = "{:9.1f}" if "mib" in key else "{:9.0f}"
        flag = ("   <-- grew" if g >= a.max_growth_pct else "") if judged else "   (shown, not judged)"
        print(f"{label + ', ' + unit:36s} {fmt.format(x)} {fmt.format(y)} {g:+7.1f}%{flag}")
    new_refs = sorted(set(end["samples"][-1].get("ray_references", ()))
                      - set(warm["samples"][-1].get("ray_references", ())))
    if new_refs:
        print(f"  Ray references at the end that the warm-up quiet point did not have (serve pid {serve.proc.pid}; "
              "pid | type | status | reference type | object ref):")
        for row in new_refs[:20]:
            print(f"    {row}")
    if monitor.shm_new:
        print(f"  (/dev/shm is machine-wide; files that appeared during the run: {sorted(monitor.shm_new)[:10]})")

    def delta(name: str, **labels) -> float:
        return promtext.total(m1, name, **labels) - promtext.total(m0, name, **labels)
    resumed = {cause: delta("pdcluster:requests_resumed_total", cause=cause)
               for cause in ("worker_died", "worker_hung", "handoff_failed", "lease_expired", "worker_draining")}
    errors = {}
    for series in m1:
        n, labels = promtext.split(series)
        if n == "pdcluster:request_errors_total":
            errors[labels["reason"]] = delta(n, reason=labels["reason"])
    ok = sum(c.ok.values())
    print(f"\nrequests sent: {c.sent}; ok {ok} ("
          + ", ".join(f"{k} {v}" for k, v in sorted(c.ok.items())) + f"); cancelled {c.cancelled}")
    print("intended 4xx: " + (", ".join(f"{k} {v}" for k, v in sorted(c.intended_4xx.items())) or "none"))
    print(f"429 (admission): {sum(c.overloaded_429.values())}"
          + (" (" + ", ".join(f"{k} {v}" for k, v in sorted(c.overloaded_429.items())) + ")"
             if c.overloaded_429 else ""))
    cats: dict[str, int] = {}
    for f in c.failures:
        cats[f["category"]] = cats.get(f["category"], 0) + 1
    print(f"failures: {len(c.failures)}" + (" (" + ", ".join(f"{k} {v}" for k, v in sorted(cats.items())) + ")"
                                           if cats else ""))
    for f in c.failures[:50]:
        since = f"{f['since_last_kill_s']:.0f} s after a kill" if f["since_last_kill_s"] is not None else "no kill yet"
        print(f"  {f['t']:6.0f}s {f['kind']}: {f['category']} ({since}): {f['detail'][:240]}")
    print(f"\nkills: {len(monitor.kills)} (" + ", ".join(
        f"{k['role']} at {k['t']:.0f} s, back in {k.get('replaced_after_s', '?')} s, {k.get('resumed', 0):g} resumed"
        for k in monitor.kills) + ")")
    print("requests resumed (router's requests_resumed_total): "
          + ", ".join(f"{k} {v:g}" for k, v in resumed.items() if v) + f" (total {sum(resumed.values()):g})")
    print("router's request_errors_total during the run: "
          + ", ".join(f"{k} {v:g}" for k, v in sorted(errors.items()) if v))
    for e in monitor.errors:
        print(f"  monitor: {e}")
    for q in (warm, end):
        if not q["idle"]:
            print(f"quiet point '{q['name']}': NOT idle / blocks not back: {json.dumps(q['state'])}")

    grew = [r["label"] for r in rows if r["judged"] and r["growth_pct"] >= a.max_growth_pct]
    reasons = []
    if grew:
        reasons.append(f"grew >= {a.max_growth_pct:g} %: " + ", ".join(grew))
    if c.failures:
        reasons.append(f"{len(c.failures)} request(s) failed")
    if not (warm["idle"] and end["idle"]):
        reasons.append("the router was not idle with every block back at a quiet point")
    if not alive:
        reasons.append("serve exited during the run")
    if monitor.errors:
        reasons.append(f"{len(monitor.errors)} monitor error(s)")
    verdict = "PASS" if not reasons else "FAIL: " + "; ".join(reasons)
    print(f"\n{verdict}")

    result = {"args": vars(a), "serve_cmd": ["pdcluster", *serve.cmd[serve.cmd.index("serve"):]],
              "cpus": os.cpu_count(),
              "table": rows, "quiet_points": [{k: v for k, v in q.items() if k != "samples"} for q in (warm, end)],
              "requests": {"sent": c.sent, "ok": c.ok, "cancelled": c.cancelled, "intended_4xx": c.intended_4xx,
                           "overloaded_429": c.overloaded_429, "failures": c.failures},
              "kills": monitor.kills, "resumed": resumed, "router_errors": errors,
              "shm_new_files": sorted(monitor.shm_new), "monitor_errors": monitor.errors,
              "samples": monitor.samples, "verdict": verdict}
    (out / "soak.json").write_text(json.dumps(result, indent=1, default=str))
    plot(out / "soak.png", monitor.samples, monitor.kills, [warm, end], a.warmup_s)
    print(f"wrote {out / 'soak.json'}, {out / 'soak.png'}, {serve.log}")
    return 0 if not reasons else 1


if __name__ == "__main__":
    sys.exit(main())
