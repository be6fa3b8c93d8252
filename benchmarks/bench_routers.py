#!/usr/bin/env python
"""Several routers over the same pools (issue 17): how balanced power-of-two-choices keeps the
workers when 1, 2 or 4 routers pick on what each knows, and what one router costs per request.

    .venv/bin/python benchmarks/bench_routers.py [--routers 1,2,4] [--prefill 2] [--decode 2] [--rate 12]
        [--duration-s 40] [--seeds 2] [--concurrency 32] [--ceiling-s 20] [--json OUT]

One `pdcluster serve` (router r0: it launches --prefill + --decode `tiny` workers, a quarter
core each) and 3 `pdcluster router` processes attached to it (r1..r3), all as a user runs them. All 4
routers run through every measurement; a run with N routers sends its requests round-robin to
the first N, so the background (each router reads every worker's stream) is the same for all N.

Balance: open-loop Poisson arrivals at --rate for --duration-s per seed (the same seeded
requests for every N: prompts of 32-256 random tokens, 16-64 output tokens, ignore_eos), sent
round-robin over N routers (after a 5 s warm-up; the order of N alternates from seed to seed).
Every 100 ms r0's /metrics gives each worker's sequences running +
waiting (its load reports); per run and pool (prefill workers are picked by queued prompt
tokens, decode workers by KV use and sequences): the mean over samples of the most loaded
worker's load (and its p95), the mean load over workers, and the imbalance (the most loaded
worker over the mean, sample by sample). The goal: max load with 2 and 4 routers within
10 % of one router's.

Ceiling: 1-token requests (8-token prompts, max_tokens 1), --concurrency closed-loop clients for
--ceiling-s, round-robin over N routers: completed requests per second, and each router's
CPU-seconds per request it served (/proc utime + stime of its process).

On a shared 2-core machine the routers, the workers and this client compete for the same
cores: read aggregate rates as what this box allows, and CPU per request as the number that
says how many requests one router core carries.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import httpx  # noqa: E402

from benchmarks.common import write_json  # noqa: E402
from cluster.loadtest import promtext  # noqa: E402
from cluster.run.ports import free_ports  # noqa: E402

BIN = Path(sys.executable).parent
CLUSTER_ID = "bench-routers"


def pdcluster(*args: str) -> list[str]:
    exe = BIN / "pdcluster"
    return ([str(exe)] if exe.exists() else [sys.executable, "-m", "cluster.cli"]) + list(args)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, deadline_s: float = 300) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[1]} exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).json().get("status") == "ok":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not healthy within {deadline_s:g}s:\n{log.read_text()[-3000:]}")


class Routers:
    """serve (r0) and routers r1..r{n-1}, in sessions of their own; stopped on exit."""

    def __init__(self, workdir: Path, num_routers: int, num_prefill: int, num_decode: int, plain: bool = False,
                 tree: Path = ROOT):
        self.workdir, self.procs, self.urls, self.tree = workdir, [], [], tree
        ports = free_ports(num_routers)
        env = dict(os.environ, OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
        env.pop("RAY_ADDRESS", None)
        if tree != ROOT:       # its code first, in these processes and in the Ray workers they start
            env["PYTHONPATH"] = str(tree)
        self.env = env
        common = ["--admission", "queue", "--max-pending", "100000"]
        log = workdir / "r0.log"
        self._start(pdcluster("serve", "--prefill", str(num_prefill), "--decode", str(num_decode), "--cpus-per-worker",
                              "0.25", "--kv-cache-memory-mib", "64", "--swap-space-mib", "0",
                              *([] if plain else ["--cluster-id", CLUSTER_ID, "--router-id", "r0"]),
                              "--port", str(ports[0]), *common), log, ports[0])
        if num_routers == 1:
            return
        address = re.search(r"router --address (\S+)", log.read_text())
        if address is None:
            raise RuntimeError(f"serve printed no Ray address:\n{log.read_text()[-3000:]}")
        for i in range(1, num_routers):
            self._start(pdcluster("router", "--address", address[1], "--cluster-id", CLUSTER_ID, "--router-id",
                                  f"r{i}", "--port", str(ports[i]), *common), workdir / f"r{i}.log", ports[i])

    def _start(self, cmd: list[str], log: Path, port: int) -> None:
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=self.tree, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        self.urls.append(f"http://127.0.0.1:{port}")
        wait_healthy(self.urls[-1], proc, log)

    def cpu_s(self) -> list[float]:
        """Each router process's own CPU-seconds so far (its threads; not Ray's daemons)."""
        tick = os.sysconf("SC_CLK_TCK")
        out = []
        for p in self.procs:
            fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            out.append((int(fields[11]) + int(fields[12])) / tick)
        return out

    def close(self) -> None:
        for p in reversed(self.procs):               # the attached routers first, serve last
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def worker_loads(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """role -> worker -> sequences running + waiting (decode: + waiting for room), from r0's
    /metrics."""
    out: dict[str, dict[str, float]] = {}
    for series, value in metrics.items():
        name, labels = promtext.split(series)
        if name in ("pdcluster:num_requests_running", "pdcluster:num_requests_waiting"):
            pool = out.setdefault(labels["role"], {})
            pool[labels["worker"]] = pool.get(labels["worker"], 0.0) + value
    return out


async def sample_loads(url: str, samples: list[dict], stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            async with s.get(f"{url}/metrics") as r:
                samples.append(worker_loads(promtext.parse(await r.text())))
            try:
                await asyncio.wait_for(stop.wait(), 0.1)
            except TimeoutError:
                pass


async def post(s: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> bool:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    async with s.post(f"{url}/v1/completions", json=body) as r:
        await r.read()
        return r.status == 200


async def balance_run(urls: list[str], leader: str, rate: float, duration_s: float, seed: int) -> dict:
    rng = random.Random(seed)
    t, plan = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t > duration_s:
            break
        plan.append((t, [rng.randrange(3, 250) for _ in range(rng.randint(32, 256))], rng.randint(16, 64)))
    samples: list[dict] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        sampler = asyncio.ensure_future(sample_loads(leader, samples, stop))
        t0 = time.monotonic()

        async def one(i: int, at: float, prompt: list[int], max_tokens: int) -> bool:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            return await post(s, urls[i % len(urls)], prompt, max_tokens)
        ok = await asyncio.gather(*(one(i, *p) for i, p in enumerate(plan)))
        stop.set()
        await sampler
    out = {"requests": len(plan), "failed": len(plan) - sum(ok)}
    for role in sorted({r for x in samples for r in x}):
        busy = [x[role] for x in samples if sum(x.get(role, {}).values()) > 0]
        maxima = [max(x.values()) for x in busy]
        out[role] = {
            "samples": len(busy), "mean_max_load": statistics.fmean(maxima) if maxima else 0.0,
            "p95_max_load": sorted(maxima)[int(0.95 * (len(maxima) - 1))] if maxima else 0.0,
            "mean_load": statistics.fmean(statistics.fmean(x.values()) for x in busy) if busy else 0.0,
            # the most loaded worker over the mean worker, sample by sample: 1.0 is perfect balance
            "imbalance": statistics.fmean(max(x.values()) / statistics.fmean(x.values()) for x in busy) if busy else 0.0}
    return out


async def ceiling_run(urls: list[str], concurrency: int, duration_s: float) -> tuple[int, list[int], float]:
    counts = [0] * len(urls)
    failed = 0
    prompt = list(range(10, 18))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        end = time.monotonic() + duration_s

        async def client(k: int) -> None:
            nonlocal failed
            i = k
            while time.monotonic() < end:
                j = i % len(urls)
                if await post(s, urls[j], prompt, 1):
                    counts[j] += 1
                else:
                    failed += 1
                i += 1
        t0 = time.monotonic()
        await asyncio.gather(*(client(k) for k in range(concurrency)))
        return failed, counts, time.monotonic() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--routers", default="1,2,4", help="router counts to compare (at most 4)")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--rate", type=float, default=12.0, help="balance: requests per second")
    p.add_argument("--duration-s", type=float, default=40.0)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=32, help="ceiling: closed-loop clients")
    p.add_argument("--ceiling-s", type=float, default=20.0)
    p.add_argument("--parts", default="balance,ceiling", help="what to measure")
    p.add_argument("--plain-serve", action="store_true", help="one router, started without the flags of "
                   "several (--cluster-id, --router-id): the same run on a tree from before them, for an A/B")
    p.add_argument("--tree", type=Path, default=ROOT, help="run the servers from this checkout (its code; this "
                   "venv): an older commit's, for an A/B")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    parts = set(a.parts.split(","))
    counts = [int(x) for x in a.routers.split(",")]
    if not counts or min(counts) < 1 or max(counts) > 4:
        p.error("--routers: counts between 1 and 4")
    out: dict = {"balance": {}, "ceiling": {}}
    with tempfile.TemporaryDirectory(prefix="bench-routers-") as tmp:
        if a.plain_serve and counts != [1]:
            p.error("--plain-serve runs one router: --routers 1")
        routers = Routers(Path(tmp), max(counts), a.prefill, a.decode, a.plain_serve, a.tree.resolve())
        try:
            print(f"{len(routers.urls)} routers up: {', '.join(routers.urls)}", flush=True)
            asyncio.run(balance_run(routers.urls, routers.urls[0], a.rate, 5.0, 99))      # warm-up, not counted
            if "balance" in parts:
                print("\nbalance (P2C): per pool, the most loaded worker's sequences (running + waiting), every 100 ms")
                print(f"{'routers':>7} {'seed':>4} {'requests':>8} {'failed':>6} {'pool':>7} {'mean max':>8} "
                      f"{'p95 max':>7} {'mean':>6} {'max/mean':>8}")
            for seed in range(a.seeds if "balance" in parts else 0):
                for n in (counts if seed % 2 == 0 else counts[::-1]):      # each order in turn: drift cancels
                    r = asyncio.run(balance_run(routers.urls[:n], routers.urls[0], a.rate, a.duration_s, seed))
                    out["balance"].setdefault(str(n), []).append(r)
                    for role in ("prefill", "decode"):
                        q = r[role]
                        print(f"{n:>7} {seed:>4} {r['requests']:>8} {r['failed']:>6} {role:>7} {q['mean_max_load']:>8.2f} "
                              f"{q['p95_max_load']:>7.1f} {q['mean_load']:>6.2f} {q['imbalance']:>8.3f}", flush=True)
            for role in ("prefill", "decode") if "balance" in parts else ():
                def avg(n: int, key: str) -> float:
                    return statistics.fmean(r[role][key] for r in out["balance"][str(n)])
                if avg(counts[0], "mean_max_load") == 0:
                    print(f"{role}: never busy when sampled (its work is shorter than the 100 ms between samples)")
                    continue
                for n in counts[1:]:
                    ratio = avg(n, "mean_max_load") / avg(counts[0], "mean_max_load")
                    print(f"{role}: {n} routers against {counts[0]}: max load {ratio:.3f}x (goal <= 1.10); max/mean "
                          f"{avg(n, 'imbalance'):.3f} against {avg(counts[0], 'imbalance'):.3f}; mean load "
                          f"{avg(n, 'mean_load'):.2f} against {avg(counts[0], 'mean_load'):.2f}")
                    out["balance"][f"{role}_ratio_{n}"] = ratio

            if "ceiling" in parts:
                print(f"\nceiling: 1-token requests, {a.concurrency} closed-loop clients, {a.ceiling_s:g} s")
                print(f"{'routers':>7} {'req/s':>7} {'failed':>6}  router CPU ms per request (r0..)")
            for n in counts if "ceiling" in parts else ():
                before = routers.cpu_s()
                failed, served, wall = asyncio.run(ceiling_run(routers.urls[:n], a.concurrency, a.ceiling_s))
                after = routers.cpu_s()
                per = [1000 * (after[i] - before[i]) / served[i] for i in range(n) if served[i]]
                out["ceiling"][str(n)] = {"req_s": sum(served) / wall, "failed": failed, "served": served,
                                          "cpu_ms_per_request": per}
                print(f"{n:>7} {sum(served) / wall:>7.1f} {failed:>6}  " + " ".join(f"{x:.2f}" for x in per),
                      flush=True)
        finally:
            routers.close()
    write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
