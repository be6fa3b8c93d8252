#!/usr/bin/env python
"""What a leader's death costs the requests of another router (issue 17), on a Ray cluster.

    .venv/bin/python benchmarks/bench_failover.py [--rate 3] [--duration-s 60] [--kill-at-s 20]
        [--router-lease-s 10] [--json OUT]

A one-node Ray cluster of its own (`ray start --head`, in a temp dir, on free ports), `pdcluster
serve --address` on it (router r0: it launches 1 prefill + 1 decode `tiny` worker and leads),
and `pdcluster router` r1 attached to the pools, as a user runs them. Open-loop Poisson load
(`cluster/loadtest/loadgen.py`, the seeded random dataset: prompts of 64-192 tokens, 32-96 output tokens,
ignore_eos) goes to r1 only. At --kill-at-s, r0 is SIGKILLed; the script watches r1's
/metrics until r1 exports `pdcluster:router_leader` 1 (it took the lead).

Reported, per phase of send time (before the kill; from the kill until r1 leads; after):
requests, failures, TTFT and TPOT p50/p99, each as a ratio to the phase before the kill (the
reference, in the same run); the failover time (kill to r1 leading); and r1's resumed requests
(0: its requests were untouched by the leader's death).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from benchmarks.bench_routers import pdcluster, wait_healthy  # noqa: E402
from benchmarks.common import write_json  # noqa: E402
from cluster.loadtest import promtext  # noqa: E402
from cluster.loadtest.bench_data import sample_random  # noqa: E402
from cluster.loadtest.loadgen import Target, run_load  # noqa: E402
from cluster.run.ports import free_ports  # noqa: E402
from workers.checkpoint import load_tokenizer  # noqa: E402

BIN = Path(sys.executable).parent
CLUSTER_ID = "bench-failover"


class Head:
    """`ray start --head --block` in a session of its own; SIGTERM stops its node's processes."""

    def __init__(self, root: Path, env: dict):
        gcs, client, agent = free_ports(3)
        self.address = f"127.0.0.1:{gcs}"
        self.log = root / "head.log"
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(
                [str(BIN / "ray"), "start", "--block", "--head", "--port", str(gcs), "--num-cpus", "4",
                 "--node-ip-address", "127.0.0.1", "--include-dashboard", "false", "--disable-usage-stats",
                 "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent),
                 "--temp-dir", str(root / "ray")],
                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True)
        end = time.monotonic() + 90
        while "Ray runtime started" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"ray start failed:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start(cmd: list[str], log: Path, env: dict, url: str) -> subprocess.Popen:
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    wait_healthy(url, proc, log)
    return proc


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def phase_stats(results) -> dict:
    ok = [r for r in results if r.success]
    ttft = [r.ttft for r in ok]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    return {"requests": len(results), "failed": len(results) - len(ok),
            "ttft_p50_s": quantile(ttft, 0.5), "ttft_p99_s": quantile(ttft, 0.99),
            "tpot_p50_s": quantile(tpot, 0.5), "tpot_p99_s": quantile(tpot, 0.99)}


async def load_and_kill(url: str, requests, rate: float, kill_at_s: float, serve: subprocess.Popen, seed: int):
    """The load through r1; r0 SIGKILLed at `kill_at_s`; (results, t0, kill time, r1-leads time)."""
    marks: dict[str, float] = {}

    async def killer():
        await asyncio.sleep(kill_at_s)
        serve.kill()
        marks["kill"] = time.perf_counter()
        async with httpx.AsyncClient() as c:
            while True:
                m = promtext.parse((await c.get(f"{url}/metrics", timeout=10)).text)
                if promtext.total(m, "pdcluster:router_leader") == 1:
                    marks["lead"] = time.perf_counter()
                    return
                await asyncio.sleep(0.1)
    t0 = time.perf_counter()
    kill = asyncio.ensure_future(killer())
    results, _ = await run_load(Target(url, model="tiny", ignore_eos=True), requests, rate=rate, seed=seed)
    await kill
    return results, t0, marks["kill"], marks["lead"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=3.0, help="requests per second, to r1")
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--kill-at-s", type=float, default=20.0, help="when r0 (the leader) is SIGKILLed")
    p.add_argument("--router-lease-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if not 0 < a.kill_at_s < a.duration_s:
        p.error("--kill-at-s must fall within --duration-s")
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    num = max(1, round(a.rate * a.duration_s))
    requests = sample_random(load_tokenizer("tiny"), num, 128, 64, range_ratio=0.5, seed=a.seed)
    with tempfile.TemporaryDirectory(prefix="bench-failover-", dir="/tmp") as tmp:
        root = Path(tmp)
        head = Head(root, env)
        procs = []
        try:
            p0, p1 = free_ports(2)
            r0, r1 = f"http://127.0.0.1:{p0}", f"http://127.0.0.1:{p1}"
            common = ["--address", head.address, "--cluster-id", CLUSTER_ID, "--admission", "queue"]
            procs.append(start(pdcluster("serve", *common, "--router-id", "r0", "--port", str(p0), "--prefill", "1",
                                         "--decode", "1", "--cpus-per-worker", "0.5", "--kv-cache-memory-mib", "64",
                                         "--swap-space-mib", "0", "--router-lease-s", str(a.router_lease_s)),
                               root / "r0.log", env, r0))
            procs.append(start(pdcluster("router", *common, "--router-id", "r1", "--port", str(p1)),
                               root / "r1.log", env, r1))
            print(f"r0 (leads) {r0}, r1 {r1}; {num} requests to r1 at {a.rate:g}/s, r0 SIGKILLed at "
                  f"{a.kill_at_s:g} s", flush=True)
            results, t0, kill, lead = asyncio.run(load_and_kill(r1, requests, a.rate, a.kill_at_s, procs[0], a.seed))
            m = promtext.scrape(f"{r1}/metrics")
            phases = {"before": [], "failover": [], "after": []}
            for r in results:
                phases["before" if r.start < kill else "failover" if r.start < lead else "after"].append(r)
            out = {"failover_s": lead - kill, "kill_at_s": kill - t0,
                   "resumed": promtext.total(m, "pdcluster:requests_resumed_total"),
                   "phases": {k: phase_stats(v) for k, v in phases.items()}}
            print(f"\nr0 killed at {kill - t0:.1f} s; r1 led {lead - kill:.2f} s later (lease {a.router_lease_s:g} s); "
                  f"r1's resumed requests: {out['resumed']:g}")
            ref = out["phases"]["before"]
            print(f"{'phase':>9} {'requests':>8} {'failed':>6} {'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} {'p99':>7}"
                  "   (ratios to before)")
            for name, s in out["phases"].items():
                ratio = " ".join(f"{s[k] / ref[k]:.2f}x" if ref[k] else "-" for k in
                                 ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"))
                print(f"{name:>9} {s['requests']:>8} {s['failed']:>6} {1000 * s['ttft_p50_s']:>7.1f}ms "
                      f"{1000 * s['ttft_p99_s']:>5.0f}ms {1000 * s['tpot_p50_s']:>7.1f}ms {1000 * s['tpot_p99_s']:>5.0f}ms"
                      f"   {ratio}")
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
                    try:
                        proc.wait(60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
            if procs:                                    # r0 died: the pools outlived it
                subprocess.run(pdcluster("down", "--address", head.address, "--cluster-id", CLUSTER_ID), env=env,
                               cwd=ROOT, capture_output=True, timeout=120)
            head.stop()
    write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
