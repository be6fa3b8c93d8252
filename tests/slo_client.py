"""The live admission test's clients (tests/test_admission_live.py), run as a process of their
own, as a user's clients are: in the test's process they shared the interpreter with the router,
and at three times capacity sending and reading some 150 requests a second took the router's
turns (a cost no deployment has; CI failed the overload goal on it twice).

    python tests/slo_client.py BASE_URL drive    # warm-up, closed loops, capacity, 1x and 3x
    python tests/slo_client.py BASE_URL burst N  # N requests at once, each on its own connection

Prints one JSON object: each phase's results, each result [status, Retry-After, TTFT, TPOT,
tokens, why] (a refused request's TTFT is the time its answer took; `why` its body's start).
Needs only aiohttp."""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import aiohttp

PROMPT, OUTPUT = 512, 8
CLOSED_CLIENTS = 8          # with 128-token prompts: a load the cluster meets, even on a busy box
PHASE_S = 15.0


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
        """Poisson arrivals for `seconds`, as many as the rate makes on average (a Poisson
        process's arrival times, given how many, are that many uniform draws, sorted): the count's
        own spread, 5 % either way over a phase of the capacity's, moved the goodput at capacity
        that the overload is judged against by as much. Their bodies are made before the first is
        sent (at 3x this box's capacity, making them as they went took much of a core from the
        workers)."""
        times = sorted(self.rng.uniform(0, seconds) for _ in range(round(rate * seconds)))
        arrivals = [(t, self.body()) for t in times]
        tasks, start = [], time.perf_counter()
        for at, body in arrivals:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.ensure_future(self.one(body=body)))
        return await asyncio.gather(*tasks)


async def drive(base_url: str) -> dict:
    """A few requests one at a time (the first steps are slow), a closed loop of CLOSED_CLIENTS
    with 128-token prompts, capacity (a closed loop of 32: completions per second), then Poisson
    arrivals at that rate and at three times it, PHASE_S each."""
    client = Client(base_url)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as client.session:
        for _ in range(8):
            await client.one()
        _, closed = await client.closed_loop(CLOSED_CLIENTS, 8.0, prompt=128)
        capacity, _ = await client.closed_loop(32, 8.0)
        at_capacity = await client.open_loop(capacity, PHASE_S)
        overload = await client.open_loop(3 * capacity, PHASE_S)
    return {"closed": closed, "capacity": capacity, "at_capacity": at_capacity, "overload": overload}


async def burst(base_url: str, size: int) -> dict:
    """`size` requests at once, each on its own connection (vLLM's closed loop of 256 clients
    starts so)."""
    client = Client(base_url, seed=1)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as client.session:
        return {"burst": await asyncio.gather(*(client.one() for _ in range(size)))}


def _jsonable(results):
    if isinstance(results, dict):
        return {k: _jsonable(v) for k, v in results.items()}
    if isinstance(results, list):
        return [[x.decode(errors="replace") if isinstance(x, bytes) else x for x in r] for r in results]
    return results


if __name__ == "__main__":
    url, phase = sys.argv[1], sys.argv[2]
    run = drive(url) if phase == "drive" else burst(url, int(sys.argv[3]))
    print(json.dumps(_jsonable(asyncio.run(asyncio.wait_for(run, 300)))))
