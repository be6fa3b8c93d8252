#!/usr/bin/env python
"""Several routers over the same pools (issue 17): how balanced power-of-two-choices keeps the
workers when 1, 2 or 4 routers pick on what each knows, and what one router costs per request.

    .venv/bin/python benchmarks/bench_routers.py [--routers 1,2,4] [--workers 4] [--rate 12]
        [--duration-s 40] [--seeds 2] [--concurrency 32] [--ceiling-s 20] [--json OUT]

One `pdcluster serve` (router r0: it launches --workers colocated `tiny` workers, a quarter core
each) and 3 `pdcluster router` processes attached to it (r1..r3), all as a user runs them. All 4
routers run through every measurement; a run with N routers sends its requests round-robin to
the first N, so the background (each router reads every worker's stream) is the same for all N.

Balance: open-loop Poisson arrivals at --rate for --duration-s per seed (the same seeded
requests for every N: prompts of 32-256 random tokens, 16-64 output tokens, ignore_eos), sent
round-robin over N routers (after a 5 s warm-up; the order of N alternates from seed to seed).
Every 100 ms r0's /metrics gives each worker's sequences running +
waiting (its load reports); per run: the mean over samples of the most loaded worker's load
(and its p95), the mean load over workers, and the imbalance (the most loaded worker over the
mean, sample by sample). The goal: max load with 2 and 4 routers within
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
from cluster import promtext  # noqa: E402
from cluster.ports import free_ports  # noqa: E402

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

    def __init__(self, workdir: Path, num_routers: int, num_workers: int):
        self.workdir, self.procs, self.urls = workdir, [], []
        ports = free_ports(num_routers)
        env = dict(os.environ, OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
        env.pop("RAY_ADDRESS", None)
        self.env = env
        common = ["--admission", "queue", "--max-pending", "100000"]
        log = workdir / "r0.log"
        self._start(pdcluster("serve", "--mode", "colocated", "--workers", str(num_workers), "--cpus-per-worker",
                              "0.25", "--kv-cache-memory-mib", "64", "--swap-space-mib", "0", "--cluster-id",
                              CLUSTER_ID, "--router-id", "r0", "--port", str(ports[0]), *common), log, ports[0])
        address = re.search(r"router --address (\S+)", log.read_text())
        if address is None:
            raise RuntimeError(f"serve printed no Ray address:\n{log.read_text()[-3000:]}")
        for i in range(1, num_routers):
            self._start(pdcluster("router", "--address", address[1], "--cluster-id", CLUSTER_ID, "--router-id",
                                  f"r{i}", "--port", str(ports[i]), *common), workdir / f"r{i}.log", ports[i])

    def _start(self, cmd: list[str], log: Path, port: int) -> None:
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
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


def worker_loads(metrics: dict[str, float]) -> dict[str, float]:
    """worker -> sequences running + waiting, from r0's /metrics."""
    out: dict[str, float] = {}
    for series, value in metrics.items():
        name, labels = promtext.split(series)
        if name in ("pdcluster:num_requests_running", "pdcluster:num_requests_waiting"):
            out[labels["worker"]] = out.get(labels["worker"], 0.0) + value
    return out


async def sample_loads(url: str, samples: list[dict[str, float]], stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            async with s.get(f"{url}/metrics") as r:
                samples.append(worker_loads(promtext.parse(await r.text())))
            try:
                await asyncio.wait_for(stop.wait(), 0.1)
            except asyncio.TimeoutError:
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
    samples: list[dict[str, float]] = []
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
    busy = [x for x in samples if x and sum(x.values()) > 0]
    maxima = [max(x.values()) for x in busy]
    return {"requests": len(plan), "failed": len(plan) - sum(ok), "samples": len(busy),
            "mean_max_load": statistics.fmean(maxima) if maxima else 0.0,
            "p95_max_load": sorted(maxima)[int(0.95 * (len(maxima) - 1))] if maxima else 0.0,
            "mean_load": statistics.fmean(statistics.fmean(x.values()) for x in busy) if busy else 0.0,
            # the most loaded worker over the mean worker, sample by sample: 1.0 is perfect balance
            "imbalance": statistics.fmean(max(x.values()) / statistics.fmean(x.values()) for x in busy) if busy else 0.0}


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
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rate", type=float, default=12.0, help="balance: requests per second")
    p.add_argument("--duration-s", type=float, default=40.0)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=32, help="ceiling: closed-loop clients")
    p.add_argument("--ceiling-s", type=float, default=20.0)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    counts = [int(x) for x in a.routers.split(",")]
    if not counts or min(counts) < 1 or max(counts) > 4:
        p.error("--routers: counts between 1 and 4")
    out: dict = {"balance": {}, "ceiling": {}}
    with tempfile.TemporaryDirectory(prefix="bench-routers-") as tmp:
        routers = Routers(Path(tmp), max(counts), a.workers)
        try:
            print(f"{len(routers.urls)} routers up: {', '.join(routers.urls)}", flush=True)
            print("\nbalance (P2C): the most loaded worker's sequences (running + waiting), sampled every 100 ms")
            print(f"{'routers':>7} {'seed':>4} {'requests':>8} {'failed':>6} {'mean max':>8} {'p95 max':>7} "
                  f"{'mean':>6} {'max/mean':>8}")
            asyncio.run(balance_run(routers.urls, routers.urls[0], a.rate, 5.0, 99))      # warm-up, not counted
            for seed in range(a.seeds):
                for n in (counts if seed % 2 == 0 else counts[::-1]):      # each order in turn: drift cancels
                    r = asyncio.run(balance_run(routers.urls[:n], routers.urls[0], a.rate, a.duration_s, seed))
                    out["balance"].setdefault(str(n), []).append(r)
                    print(f"{n:>7} {seed:>4} {r['requests']:>8} {r['failed']:>6} {r['mean_max_load']:>8.2f} "
                          f"{r['p95_max_load']:>7.1f} {r['mean_load']:>6.2f} {r['imbalance']:>8.3f}", flush=True)
            base = statistics.fmean(r["mean_max_load"] for r in out["balance"][str(counts[0])])
            for n in counts[1:]:
                mean = statistics.fmean(r["mean_max_load"] for r in out["balance"][str(n)])
                skew = [statistics.fmean(r["imbalance"] for r in out["balance"][str(k)]) for k in (counts[0], n)]
                print(f"{n} routers against {counts[0]}: max load {mean / base:.3f}x (goal <= 1.10), "
                      f"max/mean {skew[1]:.3f} against {skew[0]:.3f}")
                out["balance"][f"ratio_{n}"] = mean / base

            print(f"\nceiling: 1-token requests, {a.concurrency} closed-loop clients, {a.ceiling_s:g} s")
            print(f"{'routers':>7} {'req/s':>7} {'failed':>6}  router CPU ms per request (r0..)")
            for n in counts:
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
