"""Prefix-aware picking and local prefill (issue 15, items 1 and 2) on a real cluster: 2 prefill
workers and 1 decode worker (`tiny`), `--policy prefix`, `--local-prefill-max-tokens 128`.

Oracles: the offline engine's greedy output on the same prompts; the workers' own counters
(prefix-cache tokens looked up and hit, KV pulls); for the hit rate, what one cache that forgets
nothing would serve (each prefix computed once, counted by hand).
"""
from __future__ import annotations

import random

import httpx
import pytest

from common import metric_sum, nothing_left_running, sse_events, wait_for
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.names import DECODE, PREFILL, PREFIX
from workers.sequence import SamplingParams

MODEL = "tiny"
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
LOCAL_MAX = 128


@pytest.fixture(scope="module")
def cluster(ray_session):
    from cluster.run.launcher import ClusterSpec
    from cluster.run.serve import ServingCluster
    from common import free_port
    spec = ClusterSpec(model=MODEL, num_prefill=2, num_decode=1, num_cpus_per_worker=0.5,
                       engine={"cache": {"num_blocks": 512}, "scheduler": {"max_num_batched_tokens": 512}})
    with ServingCluster(spec, port=free_port(), admission="queue", policy=PREFIX,
                        local_prefill_max_tokens=LOCAL_MAX) as c:
        yield c


def counts(cluster) -> dict[str, float]:
    """Worker counters, fresh: each worker's load report taken now (not the last poll's)."""
    import ray
    reports = ray.get([m.handle.stats.remote() for m in cluster.workers])
    out = {"prefill_queries": 0, "prefill_hits": 0, "decode_queries": 0, "pulls": 0}
    for r in reports:
        role = "prefill" if r.role == PREFILL else "decode"
        out[f"{role}_queries"] += r.prefix_cache_queries
        if role == "prefill":
            out["prefill_hits"] += r.prefix_cache_hits
        out["pulls"] += r.kv_transfer.count
    out["local"] = metric_sum(cluster, "pdcluster:local_prefills_total")
    return out


def offline(prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=MODEL))
    return [r.token_ids for r in engine.generate([{"prompt_token_ids": p} for p in prompts],
                                                  SamplingParams(**GREEDY))]


def complete(client, prompt: list[int]) -> list[int]:
    r = client.post("completions", json={"model": MODEL, "prompt": prompt, **GREEDY})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_repeated_prefixes_go_where_they_are_cached(cluster, client):
    """Two 320-token prefixes (20 blocks), 3 prompts each, interleaved, sent one at a time, local
    prefill off: every repeat finds its prefix on the worker that computed it."""
    cluster.server.dispatcher.placement.local_prefill_max_tokens = 0
    try:
        rng = random.Random(3)
        prefixes = [[rng.randrange(1, 250) for _ in range(320)] for _ in range(2)]
        prompts = [prefixes[i % 2] + [rng.randrange(1, 250) for _ in range(20)] for i in range(6)]
        before = counts(cluster)
        got = [complete(client, p) for p in prompts]
        after = counts(cluster)
    finally:
        cluster.server.dispatcher.placement.local_prefill_max_tokens = LOCAL_MAX
    assert got == offline(prompts)
    assert after["prefill_queries"] - before["prefill_queries"] == 6 * 340
    assert after["prefill_hits"] - before["prefill_hits"] == 4 * 320      # what one cache would serve
    assert after["local"] == before["local"]
    nothing_left_running(cluster)


def test_short_prompts_prefill_on_the_decode_worker_with_no_handoff(cluster, client):
    rng = random.Random(4)
    short = [[rng.randrange(1, 250) for _ in range(40)] for _ in range(4)]
    before = counts(cluster)
    got = [complete(client, p) for p in short]
    after = counts(cluster)
    assert got == offline(short)
    assert after["pulls"] == before["pulls"]                              # no KV handoff
    assert after["prefill_queries"] == before["prefill_queries"]         # the prefill pool saw none
    assert after["decode_queries"] - before["decode_queries"] == 4 * 40
    assert after["local"] - before["local"] == 4

    # A long prompt is handed off as ever; sent again, the decode worker holds all but its last
    # 8 tokens (received by the handoff, learnt from its cache events): prefilled there.
    long = [rng.randrange(1, 250) for _ in range(200)]
    first = complete(client, long)
    mid = counts(cluster)
    assert mid["pulls"] == after["pulls"] + 1 and mid["local"] == after["local"]
    wait_for(lambda: cluster.server.dispatcher.prefix_index.matches(
        cluster.server.dispatcher.prefix_index.hashes(long)).get(
            next(m.worker_id for m in cluster.workers if m.role == DECODE), 0),
        lambda n: n == 12, describe="the decode worker's received blocks in the router's index")
    again = complete(client, long)
    end = counts(cluster)
    assert first == again == offline([long])[0]
    assert end["pulls"] == mid["pulls"] and end["local"] == mid["local"] + 1
    nothing_left_running(cluster)


def test_a_client_leaving_a_locally_prefilled_stream_frees_everything(cluster):
    prompt = [random.Random(5).randrange(1, 250) for _ in range(30)]
    before = counts(cluster)
    with httpx.Client(base_url=cluster.base_url, timeout=60) as c:
        with c.stream("POST", "completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 400,
                                                    "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    assert sse_events(line + "\n\n")[0]["choices"]
                    break                                                # leave after the first chunk
    assert counts(cluster)["local"] == before["local"] + 1
    nothing_left_running(cluster)


def test_a_killed_prefill_worker_is_forgotten_and_its_prefix_served_unchanged(cluster, client):
    """The worker holding a prefix dies (SIGKILL): the index drops everything it held, and the
    prefix's next request is served (elsewhere, or by the restarted worker) with the offline
    output; once back, the worker is picked again only for what it computes anew."""
    import os
    import signal
    from router.pools import ACTIVE
    d = cluster.server.dispatcher
    d.placement.local_prefill_max_tokens = 0
    try:
        rng = random.Random(6)
        prefix = [rng.randrange(1, 250) for _ in range(160)]
        prompts = [prefix + [rng.randrange(1, 250) for _ in range(10)] for _ in range(2)]
        assert complete(client, prompts[0]) == offline(prompts[:1])[0]
        holder = max(d.prefix_index.matches(d.prefix_index.hashes(prompts[1])).items(), key=lambda kv: kv[1])[0]
        pid = cluster.answering(timeout_s=30)[holder].pid
        os.kill(pid, signal.SIGKILL)
        # The router notices (it may restart the worker before a poll here sees it away): it
        # forgets what the worker held.
        wait_for(lambda: d.prefix_index.num_held(holder), lambda n: n == 0, deadline_s=30,
                 describe=lambda: "the router noticing the killed worker")
        assert holder not in d.prefix_index.matches(d.prefix_index.hashes(prompts[1]))
        assert complete(client, prompts[1]) == offline(prompts[1:])[0]
        wait_for(lambda: cluster.pools[holder].state, lambda s: s == ACTIVE, deadline_s=120,
                 describe=lambda: "the killed worker restarted and back in its pool")
    finally:
        d.placement.local_prefill_max_tokens = LOCAL_MAX
    nothing_left_running(cluster)
