"""SLO admission on the real local cluster (1 prefill + 1 decode `tiny` workers, `serve` with its
default `--admission slo`): a closed loop of clients that the cluster serves within its SLOs
gets no 429 (vLLM's benchmark client counts each as a failure); offered three times what the
cluster measurably serves, it answers only 200 or 429 (with Retry-After, at once: faster than
the served requests' first tokens), and the requests it admits keep their SLOs: goodput stays
at least 90 % of the goodput at capacity.

First, after a few requests one at a time, a closed loop of 8 clients with 128-token prompts
(each sends its next request when its last one ends; vLLM's benchmark's shape), then
capacity, measured in the same run: a closed loop of 32, completions per second. Then open-loop
Poisson arrivals at that rate, then at three times it, 15 s each. Last, a burst of eight times
what the cluster serves within the TTFT target, all at once.

The clients run on the test's own thread and event loop, not on the router's loop: there, at
3x, sending some 100 requests a second and reading their answers took the router's own thread,
and the requests served at 3x fell below those served at capacity (436-535 against 523-589) for
a cost no deployment has. They still share this process's interpreter with the router, which a
user's client does not (served so, `bench --launch` read TPOT about twice what a client in its
own process reads: BENCHMARKS.md, simulator fidelity)."""
from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp

from cluster.run.launcher import ClusterSpec
from cluster.run.serve import ServingCluster
from common import free_port, wait_for
from router.slo import SLOTargets

PROMPT, OUTPUT = 512, 8
SLO = SLOTargets(ttft_s=1.0, tpot_s=0.1)
PHASE_S = 15.0
CLOSED_CLIENTS = 8          # with 128-token prompts: a load the cluster meets, even on a busy box


class Client:
    """Streaming greedy completions; each result: (status, Retry-After, TTFT, TPOT, tokens); a
    refused request's TTFT is the time its answer took."""

    def __init__(self, base_url: str, seed: int = 0):
        self.url, self.rng = base_url + "/completions", random.Random(seed)
        self.session: aiohttp.ClientSession | None = None

    def body(self, prompt: int = PROMPT) -> bytes:
        """A request's JSON: `prompt` random token ids (distinct prompts: no prefix cache hits)."""
        return json.dumps({"model": "tiny", "prompt": list(self.rng.randbytes(prompt)), "max_tokens": OUTPUT,
                           "temperature": 0, "ignore_eos": True, "stream": True}).encode()

    async def one(self, prompt: int = PROMPT, body: bytes | None = None) -> tuple:
        body = body or self.body(prompt)
        t0 = time.perf_counter()
        first, n = None, 0
        async with self.session.post(self.url, data=body, headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                why = (await resp.read())[:300]
                return resp.status, resp.headers.get("Retry-After"), time.perf_counter() - t0, None, 0, why
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
        return 200, None, ttft, (end - first) / (n - 1) if n > 1 else 0.0, n, b""

    async def closed_loop(self, clients: int, seconds: float, prompt: int = PROMPT) -> tuple[float, list[tuple]]:
        """Completions per second with `clients` each keeping one request in flight, and every result."""
        results, stop = [], time.perf_counter() + seconds

        async def loop():
            while time.perf_counter() < stop:
                results.append(await self.one(prompt))
        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(clients)))
        return sum(r[0] == 200 for r in results) / (time.perf_counter() - t0), results

    async def open_loop(self, rate: float, seconds: float) -> list[tuple]:
        """Poisson arrivals for `seconds`, their bodies made before the first is sent (at 3x this
        box's capacity, making them as they went took much of a core from the workers)."""
        arrivals, t = [], self.rng.expovariate(rate)
        while t < seconds:
            arrivals.append((t, self.body()))
            t += self.rng.expovariate(rate)
        tasks, start = [], time.perf_counter()
        for at, body in arrivals:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.ensure_future(self.one(body=body)))
        return await asyncio.gather(*tasks)


def goodput(results: list[tuple], seconds: float) -> float:
    return sum(s == 200 and ttft <= SLO.ttft_s and tpot <= SLO.tpot_s for s, _, ttft, tpot, *_ in results) / seconds


def test_three_times_capacity_gets_200s_and_429s_and_keeps_the_goodput(ray_session, alone):
    spec = ClusterSpec(model="tiny", num_prefill=1, num_decode=1, num_cpus_per_worker=0.5)
    with ServingCluster(spec, port=free_port(), slo=SLO) as c:
        assert c.server.admission is not None                       # the default

        async def drive():
            client = Client(c.base_url)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as client.session:
                for _ in range(8):                                  # warm: the first steps are slow
                    await client.one()
                _, closed = await client.closed_loop(CLOSED_CLIENTS, 8.0, prompt=128)
                capacity, _ = await client.closed_loop(32, 8.0)
                at_capacity = await client.open_loop(capacity, PHASE_S)
                overload = await client.open_loop(3 * capacity, PHASE_S)
            return closed, capacity, at_capacity, overload
        closed, capacity, at_capacity, overload = asyncio.run(asyncio.wait_for(drive(), 300))
        wait_for(lambda: c.server.pending, lambda n: n == 0, deadline_s=60)
        burst_size = min(400, max(256, round(8 * capacity * SLO.ttft_s)))

        async def send_burst():
            """`burst_size` requests at once, each on its own connection (vLLM's closed loop of
            256 clients starts so): eight times what the cluster serves in the TTFT target."""
            client = Client(c.base_url, seed=1)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=120)) as client.session:
                return await asyncio.gather(*(client.one() for _ in range(burst_size)))
        burst = asyncio.run(asyncio.wait_for(send_burst(), 300))
        shed = c.server.metrics.registry.get_sample_value("pdcluster:request_errors_total",
                                                          {"reason": "slo_unattainable"})
    # The closed loop well within capacity: served within the SLOs, and so nothing refused.
    assert [r[0] for r in closed] == [200] * len(closed), (
        [r[5] for r in closed if r[0] != 200][:3], sorted(r[2] for r in closed if r[0] == 200)[-5:])
    assert goodput(closed, 1.0) >= 0.9 * len(closed), sorted((r[2], r[3]) for r in closed)[-5:]
    statuses = {r[0] for r in at_capacity + overload}
    assert statuses <= {200, 429}, statuses
    refused = [r for r in overload if r[0] == 429]
    assert refused, (capacity, len(overload), sorted(r[2] for r in overload)[-5:])
    assert all(r[1] is not None and int(r[1]) >= 1 for r in refused)
    served_ttft = sorted(r[2] for r in overload if r[0] == 200)
    assert sorted(r[2] for r in refused)[len(refused) // 2] < served_ttft[len(served_ttft) // 2]   # refused at once
    # Every refusal is counted (the capacity loop's too, whose results are not kept). Not judged:
    # how the refusals split between the phases, which follows the box's load (a CI run refused
    # 18 at capacity and 9 at 3x when the capacity loop had left the box busier than it measured).
    assert shed >= len(refused) + sum(r[0] == 429 for r in at_capacity), (
        shed, len(refused), sum(r[0] == 429 for r in at_capacity), {r[5][:120] for r in refused})
    # A burst is checked request by request against the line of the burst's requests let in
    # before it, counted from their admission, not from when their responses begin (which let
    # in 65 of 256 here, to first tokens of 2.5 s, where the cluster served 19.6 a second; with
    # the pledges, 13 of 256 at 16.5 a second, within 0.9 s).
    let_in = sum(r[0] == 200 for r in burst)
    assert {r[0] for r in burst} <= {200, 429} and 0 < let_in <= 2 * capacity * SLO.ttft_s, (
        let_in, burst_size, capacity, sorted(r[2] for r in burst if r[0] == 200)[-5:])
    served = [r for r in at_capacity + overload if r[0] == 200]
    assert all(r[4] == OUTPUT for r in served)                      # nothing admitted was cut short
    g1, g3 = goodput(at_capacity, PHASE_S), goodput(overload, PHASE_S)
    assert g3 >= 0.9 * g1, (f"capacity {capacity:.1f} req/s: goodput {g1:.2f} at it, {g3:.2f} at 3x "
                            f"({len(refused)} of {len(overload)} refused); served at 3x (TTFT, TPOT): "
                            + ", ".join(f"({r[2]:.2f}, {r[3]:.3f})" for r in overload if r[0] == 200))
