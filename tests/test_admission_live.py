"""SLO admission on the real local cluster (1 prefill + 1 decode `tiny` workers, `serve` with its
default `--admission slo`): offered three times what the cluster measurably serves, it answers
only 200 or 429 (with Retry-After), and the requests it admits keep their SLOs: goodput stays
at least 90 % of the goodput at capacity.

Capacity is measured first, in the same run: a closed loop of clients (each sends its next
request when its last one ends), completions per second. Then open-loop Poisson arrivals at
that rate, then at three times it, 15 s each."""
from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp

from cluster.launcher import ClusterSpec
from cluster.serve import ServingCluster, free_port
from router.slo import SLOTargets

PROMPT, OUTPUT = 512, 8
SLO = SLOTargets(ttft_s=1.0, tpot_s=0.1)
PHASE_S = 15.0


class Client:
    """Streaming greedy completions; each result: (status, Retry-After, TTFT, TPOT, tokens)."""

    def __init__(self, base_url: str, seed: int = 0):
        self.url, self.rng = base_url + "/completions", random.Random(seed)
        self.session: aiohttp.ClientSession | None = None

    async def one(self) -> tuple:
        body = {"model": "tiny", "prompt": [self.rng.randrange(256) for _ in range(PROMPT)], "max_tokens": OUTPUT,
                "temperature": 0, "ignore_eos": True, "stream": True}
        t0 = time.perf_counter()
        first, n = None, 0
        async with self.session.post(self.url, json=body) as resp:
            if resp.status != 200:
                await resp.read()
                return resp.status, resp.headers.get("Retry-After"), None, None, 0
            async for line in resp.content:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"] is not None:
                    n += 1
                    first = first or time.perf_counter()
        end = time.perf_counter()
        ttft = (first or end) - t0
        return 200, None, ttft, (end - first) / (n - 1) if n > 1 else 0.0, n

    async def closed_loop(self, clients: int, seconds: float) -> float:
        """Completions per second with `clients` each keeping one request in flight."""
        done, stop = 0, time.perf_counter() + seconds

        async def loop():
            nonlocal done
            while time.perf_counter() < stop:
                status, *_ = await self.one()
                done += status == 200
        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(clients)))
        return done / (time.perf_counter() - t0)

    async def open_loop(self, rate: float, seconds: float) -> list[tuple]:
        tasks, t = [], time.perf_counter()
        end = t + seconds
        while True:
            t += self.rng.expovariate(rate)
            if t >= end:
                break
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            tasks.append(asyncio.ensure_future(self.one()))
        return await asyncio.gather(*tasks)


def goodput(results: list[tuple], seconds: float) -> float:
    return sum(s == 200 and ttft <= SLO.ttft_s and tpot <= SLO.tpot_s for s, _, ttft, tpot, _ in results) / seconds


def test_three_times_capacity_gets_200s_and_429s_and_keeps_the_goodput(ray_session):
    spec = ClusterSpec(model="tiny", num_prefill=1, num_decode=1, num_cpus_per_worker=0.5)
    with ServingCluster(spec, port=free_port(), slo=SLO) as c:
        assert c.server.admission is not None                       # the default

        async def drive():
            client = Client(c.base_url)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as client.session:
                capacity = await client.closed_loop(32, 8.0)
                at_capacity = await client.open_loop(capacity, PHASE_S)
                overload = await client.open_loop(3 * capacity, PHASE_S)
            return capacity, at_capacity, overload
        capacity, at_capacity, overload = asyncio.run_coroutine_threadsafe(drive(), c.loop).result(timeout=300)
        shed = c.server.metrics.registry.get_sample_value("pdcluster:request_errors_total",
                                                          {"reason": "slo_unattainable"})
    statuses = {r[0] for r in at_capacity + overload}
    assert statuses <= {200, 429}, statuses
    refused = [r for r in overload if r[0] == 429]
    assert refused, (capacity, len(overload), sorted(r[2] for r in overload)[-5:])
    assert all(r[1] is not None and int(r[1]) >= 1 for r in refused)
    assert shed >= len(refused) - sum(r[0] == 429 for r in at_capacity) > 0
    served = [r for r in at_capacity + overload if r[0] == 200]
    assert all(r[4] == OUTPUT for r in served)                      # nothing admitted was cut short
    g1, g3 = goodput(at_capacity, PHASE_S), goodput(overload, PHASE_S)
    assert g3 >= 0.9 * g1, (f"capacity {capacity:.1f} req/s: goodput {g1:.2f} at it, {g3:.2f} at 3x "
                            f"({len(refused)} of {len(overload)} refused); served at 3x (TTFT, TPOT): "
                            + ", ".join(f"({r[2]:.2f}, {r[3]:.3f})" for r in overload if r[0] == 200))
