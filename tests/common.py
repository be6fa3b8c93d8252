"""Constants and checks shared by the test modules (plain Python, importable from tests)."""
from __future__ import annotations

import contextlib
import json

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

VOCAB = 258                 # the byte-level tokenizer: 256 bytes + <s> + </s>
MAX_NEW_TOKENS = 64


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


# >= 16 prompts with lengths spread over 1..300, both ends included.
PROMPT_LENGTHS = [1, 300, 2, 17, 64, 100, 150, 255, 5, 33, 16, 31, 200, 8, 127, 48]
PROMPTS = random_prompts(0, PROMPT_LENGTHS)


def _shared_prefix_prompts() -> list[list[int]]:
    """Three prefixes (48, 100, 200 tokens) each followed by several suffixes; includes exact
    duplicates and a prompt that is exactly a prefix, so full-block hits and the
    last-token-recomputed rule are both exercised."""
    rng = random.Random(1)
    prefixes = [[rng.randrange(VOCAB) for _ in range(n)] for n in (48, 100, 200)]
    prompts = []
    for i, prefix in enumerate(prefixes):
        for suffix_len in (0, 1, 7, 16, 40, 100 - 30 * i):
            prompts.append(prefix + [rng.randrange(VOCAB) for _ in range(suffix_len)])
    prompts.append(list(prompts[3]))          # an exact duplicate
    return prompts


SHARED_PREFIX_PROMPTS = _shared_prefix_prompts()


def assert_all_blocks_free(engine) -> None:
    """After a run: nothing unfinished, every device block back on the free list with
    refcount 0, and the host swap space empty."""
    kv = engine.kv
    assert not engine.scheduler.has_unfinished()
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert len(kv.pool.free_blocks()) == kv.pool.num_blocks
    assert kv.host.num_free == kv.host.num_blocks


def wait_pools_clean(cluster, deadline_s: float = 30.0) -> list:
    """Every worker of a ServingCluster: no referenced block, nothing held, queued or running
    (within a deadline: aborts and releases travel asynchronously); their LoadReports."""
    import ray

    def probe():
        try:
            return ray.get([w.handle.stats.remote() for w in cluster.workers], timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return None                     # one is being restarted: ask again
    return wait_for(probe, lambda stats: stats is not None and all(
        s.kv_blocks_used == 0 and s.held == 0 and s.running == 0 and s.waiting == 0 and s.pending == 0
        and s.receiving == 0 for s in stats), deadline_s)


class Clock:
    """A clock for policy code under test: it stands still until the test moves `t`."""

    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def wait_for(probe, ok, deadline_s: float = 20.0, describe=None, poll_s: float = 0.02):
    """probe() until ok(value), then the value; past the deadline an AssertionError naming
    the last value (and describe(), if given). Conditions with deadlines, never bare sleeps."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = probe()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {deadline_s}s: "
                                 f"{describe() if describe else ''} (last: {value})")
        time.sleep(poll_s)


# -- ports for the servers a test starts ---------------------------------------------------------
def _port_range() -> range:
    """This test process's own ports. `make test` runs two pytest processes (xdist) beside Ray's
    clusters, and a port the kernel hands out (bind to 0) is free only until the server binds
    it: meanwhile any outgoing connection or Ray component of the other process may get it. So
    each test process picks from its own slice of the ports between Ray's worker ports (10002 to
    19999) and the kernel's ephemeral range, which nobody else takes."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    if low < 20_000 + 1_000:
        return range(0)                        # no such gap: the kernel's ports
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    size = (low - 20_000) // count
    return range(20_000 + index * size, 20_000 + (index + 1) * size)


def free_ports(n: int) -> list[int]:
    """n distinct ports free now, from this test process's slice (bound all at once to check)."""
    import socket

    from cluster.run.ports import free_ports as kernel_ports
    span = _port_range()
    if len(span) < 10 * n:
        return kernel_ports(n)
    for _ in range(100):
        ports = random.sample(span, n)
        with contextlib.ExitStack() as stack:
            try:
                for port in ports:
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return ports
    raise RuntimeError(f"no {n} free ports in {span}")


def free_port() -> int:
    return free_ports(1)[0]


# -- processes a test started (Ray daemons, actors), read from /proc ------------------------------
def _proc_stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, start time, state) of a process, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), fields[19], fields[0]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(*roots: int) -> dict[tuple[int, str], str]:
    """{(pid, start time): command line} of every live process under `roots` (not the roots).
    The start time tells a process from a later one that reuses its pid."""
    parent, started = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _proc_stat(int(entry.name))) is not None:
            parent[int(entry.name)], started[int(entry.name)] = st[0], st[1]
    found, frontier = {}, list(roots)
    while frontier:
        p = frontier.pop()
        for child, pp in parent.items():
            if pp == p and (child, started[child]) not in found:
                found[(child, started[child])] = _cmdline(child)
                frontier.append(child)
    return found


def still_running(procs: dict[tuple[int, str], str]) -> list[str]:
    """The command lines of those processes that still run (a zombie has ended)."""
    return [cmd for (pid, start), cmd in procs.items()
            if (st := _proc_stat(pid)) is not None and st[1] == start and st[2] != "Z"]


def kill_all(procs: dict[tuple[int, str], str]) -> None:
    """SIGKILL whichever of these processes still runs (cleanup after a failure)."""
    for (pid, start), _ in procs.items():
        if (st := _proc_stat(pid)) is not None and st[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- `pdcluster serve` as a user runs it: the console script in a subprocess ---------------------
ROOT = Path(__file__).resolve().parent.parent
PDCLUSTER = ROOT / ".venv" / "bin" / "pdcluster"
SMALL_KV = ["--kv-cache-memory-mib", "16", "--swap-space-mib", "0"]


def pdcluster_cmd(*args: str) -> list[str]:
    exe = [str(PDCLUSTER)] if PDCLUSTER.exists() else [sys.executable, "-m", "cluster.cli"]
    return exe + list(args)


def subprocess_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)          # a local Ray of its own, never the session's
    return env


class ServeProcess:
    """`pdcluster serve ARGS --port P` in its own session; `with` waits until it answers and its
    workers run, and afterwards kills whatever it started that is still there (a failed test)."""

    def __init__(self, log: Path, *args: str, port: int, num_workers: int = 2, env: dict | None = None):
        self.log, self.port, self.num_workers, self.env = log, port, num_workers, env or {}
        self.cmd = pdcluster_cmd("serve", "--model", "tiny", "--port", str(port), *args)
        self.tree: dict = {}
        self.proc: subprocess.Popen | None = None

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def __enter__(self) -> ServeProcess:
        import httpx
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env={**subprocess_env(), **self.env}, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            def health():
                if self.proc.poll() is not None:
                    return "exited"
                try:
                    return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).json().get("status")
                except (httpx.HTTPError, ValueError):
                    return None
            status = wait_for(health, lambda s: s in ("ok", "exited"), deadline_s=240, poll_s=0.2,
                              describe=lambda: self.output[-3000:])
            assert status == "ok", self.output[-3000:]
            # Its workers are actor processes of its own Ray, under the serve process.
            self.tree = wait_for(lambda: descendants(self.proc.pid),
                                 lambda d: sum("ray::Worker" in c for c in d.values()) >= self.num_workers, 60,
                                 lambda: self.output[-3000:])
        except BaseException:
            self.__exit__()
            raise
        return self

    def signal(self, sig: int) -> None:
        self.tree = descendants(self.proc.pid) | self.tree          # anything started since
        self.proc.send_signal(sig)

    def wait_exit(self, timeout_s: float = 90) -> int:
        """Its exit code; by then everything it started must be gone too."""
        rc = self.proc.wait(timeout=timeout_s)
        wait_for(lambda: still_running(self.tree), lambda alive: not alive, deadline_s=60)
        return rc

    def stop(self, sig: int, timeout_s: float = 90) -> int:
        self.signal(sig)
        return self.wait_exit(timeout_s)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        kill_all(self.tree)


# -- the tiers (conftest.py): whether the running test may start processes -------------------------
live_allowed = True          # set by conftest before each test's fixtures


def require_live(what: str) -> None:
    """For helpers that start processes without subprocess (multiprocessing's spawn)."""
    if not live_allowed:
        raise RuntimeError(f"this test starts {what}: ask for the `spawns` fixture, so that it is marked and "
                           "`make test-fast` leaves it out")


# -- a second process for transport tests: it runs the `_op_<name>` functions of a test module ----
CHILD_START_S = 90          # spawning imports torch: slow on two busy cores
CHILD_REPLY_S = 20


def _child_main(conn, module: str) -> None:
    import importlib

    import torch
    torch.set_num_threads(1)
    ops = importlib.import_module(module)
    while (msg := conn.recv()) is not None:
        op, args = msg
        t0 = time.monotonic()
        try:
            conn.send(("ok", getattr(ops, f"_op_{op}")(*args), time.monotonic() - t0))
        except Exception as e:          # reported to the test, which decides
            cause = type(e.__cause__).__name__ if e.__cause__ is not None else None
            conn.send(("err", (type(e).__name__, str(e), getattr(e, "point", None), cause),
                       time.monotonic() - t0))


class Child:
    """A spawned process that runs `module`'s `_op_NAME(*args)` on request; an error comes back
    as ("err", (type name, message, transfer point, cause type name), seconds)."""

    def __init__(self, module: str):
        import multiprocessing as mp
        require_live(f"a process running {module}'s ops")
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(child_conn, module), daemon=True)
        self.proc.start()

    def start(self, op: str, *args) -> None:
        self.conn.send((op, args))

    def result(self, deadline_s: float = CHILD_REPLY_S):
        """(status, value, elapsed_s) of the started op."""
        assert self.conn.poll(deadline_s), f"child did not answer within {deadline_s}s"
        return self.conn.recv()

    def call_raw(self, op: str, *args, deadline_s: float = CHILD_REPLY_S):
        self.start(op, *args)
        return self.result(deadline_s)

    def call(self, op: str, *args, deadline_s: float = CHILD_REPLY_S):
        status, value, _ = self.call_raw(op, *args, deadline_s=deadline_s)
        assert status == "ok", f"child {op} failed: {value}"
        return value

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


@contextlib.contextmanager
def api_cluster(mode: str = "disaggregated"):
    """A 1 prefill + 1 decode `tiny` cluster (or one colocated worker) for the API's tests (a
    small cache and batch). Its admission is the queue bound: SLO admission may refuse a long
    batch on a busy box, which is its own tests' subject (test_admission*.py), not these."""
    from cluster.run.launcher import ClusterSpec
    from cluster.run.serve import ServingCluster
    spec = ClusterSpec(model="tiny", mode=mode, num_prefill=1, num_decode=1, num_colocated=1, num_cpus_per_worker=0.5,
                       engine={"cache": {"num_blocks": 256}, "scheduler": {"max_num_batched_tokens": 512}})
    with ServingCluster(spec, port=free_port(), admission="queue") as c:
        yield c


def sse_events(text: str) -> list:
    """The data of each SSE event: parsed JSON, or the string "[DONE]"."""
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def nothing_left_running(cluster) -> None:
    """No request in flight at the router (SLO admission's counts back to zero too), and no
    sequence, block or hold on any worker."""
    wait_for(lambda: cluster.server.pending, lambda n: n == 0, deadline_s=30)
    admission = cluster.server.admission
    if admission is not None:
        wait_for(lambda: (admission.waiting, admission.waiting_tokens, admission.waiting_work, admission.in_handoff),
                 lambda counts: counts == (0, 0, 0, 0), deadline_s=30)
    wait_pools_clean(cluster)


def metric_sum(cluster, name: str, **labels) -> float:
    """The sum of a ServingCluster's router metric samples named `name` whose labels include
    `labels`."""
    total = 0.0
    for family in cluster.server.metrics.registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total
