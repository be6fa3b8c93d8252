"""A cancellation storm leaks nothing: 1,000 requests whose clients leave at random moments
(queued, prefilling, held on a prefill worker, waiting for room or pulling on a decode worker,
decoding, mid-stream) leave every worker with 0 KV blocks in use and 0 leases, by the workers'
own accounting and by /metrics, and the cluster then serves the offline engine's output.
"""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from cluster.loadtest import promtext
from cluster.run.launcher import ClusterSpec
from cluster.offline import generate
from cluster.run.serve import ServingCluster
from common import free_port, wait_for, wait_pools_clean
from router.config import RouterConfig

NUM_REQUESTS, CONCURRENCY = 1000, 64


@pytest.fixture(scope="module")
def storm_cluster(ray_session):
    # Few decode seats: requests pile up held on the prefill side and waiting for room on the
    # decode side, so cancellations land in those phases too.
    spec = ClusterSpec(model="tiny", num_prefill=2, num_decode=2, num_cpus_per_worker=0.5,
                       engine={"cache": {"num_blocks": 256}, "scheduler": {"max_num_batched_tokens": 256,
                                                                          "max_num_seqs": 6}},
                       lease_s=30, transfer_timeout_s=10)
    # Every request admitted (no SLO shedding): the cancellations are what the test is about.
    with ServingCluster(spec, RouterConfig(port=free_port(), max_pending=4096, admission="queue")) as c:
        yield c


async def one(client: httpx.AsyncClient, url: str, rng: random.Random, phase_counts: dict) -> None:
    body = {"model": "tiny", "prompt": [rng.randrange(256) for _ in range(rng.choice([3, 20, 70, 150]))],
            "max_tokens": rng.choice([4, 30, 200]), "ignore_eos": True, "stream": True}
    leave_after = rng.choice([0, 0, 1, 2, 5, 1000])          # chunks; 0: before the first token
    deadline = rng.uniform(0.0, 0.25)       # under the storm's TTFTs: most of these leave before a token
    try:
        async with asyncio.timeout(deadline if leave_after == 0 else 60):
            async with client.stream("POST", url, json=body) as r:
                chunks = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
                        if chunks >= leave_after:
                            break
        phase_counts["after_tokens" if leave_after else "completed"] += 1
    except TimeoutError:
        phase_counts["before_first_token"] += 1


def test_a_thousand_cancellations_leak_nothing(storm_cluster):
    c = storm_cluster
    base = f"http://{c.host}:{c.port}"
    rng = random.Random(0)
    counts = {"before_first_token": 0, "after_tokens": 0, "completed": 0}

    async def storm():
        sem = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(timeout=60) as client:
            async def limited():
                async with sem:
                    await one(client, f"{base}/v1/completions", rng, counts)
            await asyncio.gather(*(limited() for _ in range(NUM_REQUESTS)))

    asyncio.run(storm())
    assert sum(counts.values()) == NUM_REQUESTS
    assert counts["before_first_token"] > 100 and counts["after_tokens"] > 100, counts
    # The workers' own accounting: no block referenced, nothing held, reserved, queued or running.
    reports = wait_pools_clean(c, 60)
    assert all(r.held == 0 and r.kv_blocks_used == 0 for r in reports)
    # ... and what an operator sees, once the router's next polls carried those reports.
    gauges = ("pdcluster:kv_cache_usage_perc", "pdcluster:num_requests_running", "pdcluster:num_requests_waiting",
              "pdcluster:kv_transfers_in_flight", "pdcluster:router_requests_running",
              "pdcluster:router_requests_waiting")
    m = wait_for(lambda: promtext.scrape(f"{base}/metrics"),
                 lambda m: all(promtext.total(m, g) == 0 for g in gauges), 30,
                 lambda: {g: promtext.total(promtext.scrape(f"{base}/metrics"), g) for g in gauges})
    disconnects = promtext.total(m, "pdcluster:request_errors_total", reason="client_disconnect")
    assert disconnects >= counts["before_first_token"]
    # The cluster still serves the right output.
    prompt = "after the storm"
    r = httpx.post(f"{base}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    want = generate([{"prompt": prompt, "max_tokens": 16, "temperature": 0}], model="tiny")[0]
    assert r.json()["choices"][0]["token_ids"] == want["token_ids"]
