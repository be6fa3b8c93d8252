"""The cluster end to end on a local Ray: pools, KV handoff, router, OpenAI API.

The oracle is the offline single-engine path on the same prompts (itself checked against
transformers in test_hf_parity); the official `openai` client sends the requests.
"""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import openai
import pytest
import ray

from cluster.launcher import ClusterSpec
from common import wait_for
from cluster.serve import ServingCluster, free_port
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sequence import SamplingParams

MAX_TOKENS = 24
API_KEY = "test-key"


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Lengths from 1 to ~300; a third share one of two long prefixes (prefix-cache hits)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(96)], [rng.randrange(256) for _ in range(40)]]
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(prefixes[i % 2] + [rng.randrange(256) for _ in range(rng.randint(0, 60))])
        else:
            out.append([rng.randrange(256) for _ in range(rng.choice([1, 5, 17, 64, 130, 300]))])
    return out


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(64)


@pytest.fixture(scope="module")
def offline_reference(prompts):
    engine = LLMEngine(EngineConfig(model="tiny"))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [r.token_ids for r in engine.generate([{"prompt_token_ids": p} for p in prompts], params)]


def engine_cfg(**scheduler) -> dict:
    return {"cache": {"num_blocks": 512}, "scheduler": {"max_num_batched_tokens": 512, **scheduler}}


async def send_all(base_url: str, prompts: list[list[int]]) -> list[list[int]]:
    """All requests at once; even ones stream, odd ones do not."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=120)

    async def one(i, p):
        kw = dict(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        if i % 2:
            r = await client.completions.create(**kw)
            return r.choices[0].token_ids
        ids = []
        async for chunk in await client.completions.create(**kw, stream=True,
                                                           stream_options={"include_usage": True}):
            if chunk.choices:
                ids += chunk.choices[0].token_ids
            else:
                assert chunk.usage.completion_tokens == MAX_TOKENS
        return ids

    try:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await client.close()


def wait_pools_clean(cluster: ServingCluster, deadline_s: float = 30.0) -> list[dict]:
    """Every worker: no referenced block, nothing held, queued or running (within a deadline:
    aborts and releases travel asynchronously)."""
    return wait_for(lambda: ray.get([w.handle.stats.remote() for w in cluster.workers]),
                    lambda stats: all(s["kv_blocks_used"] == 0 and s["held"] == 0 and s["running"] == 0
                                      and s["waiting"] == 0 and s["pending"] == 0 and s["receiving"] == 0
                                      for s in stats), deadline_s)


@pytest.fixture(scope="module")
def disaggregated(ray_session):
    spec = ClusterSpec(model="tiny", mode="disaggregated", num_prefill=2, num_decode=2, engine=engine_cfg(),
                       num_cpus_per_worker=0.5, lease_s=10, transfer_timeout_s=20)
    with ServingCluster(spec, port=free_port(), api_key=API_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def colocated(ray_session):
    spec = ClusterSpec(model="tiny", mode="colocated", num_colocated=2, engine=engine_cfg(),
                       num_cpus_per_worker=0.5)
    with ServingCluster(spec, port=free_port(), api_key=API_KEY) as c:
        yield c


def test_disaggregated_matches_single_engine(disaggregated, prompts, offline_reference):
    got = asyncio.run(send_all(disaggregated.base_url, prompts))
    mismatches = [i for i, (a, b) in enumerate(zip(got, offline_reference)) if a != b]
    assert not mismatches, f"{len(mismatches)} of {len(prompts)} differ, e.g. request {mismatches[:3]}"
    stats = wait_pools_clean(disaggregated)
    assert {s["role"] for s in stats} == {"prefill", "decode"}
    # Both pools did work (power-of-two-choices spreads 64 requests over both workers of each).
    assert all(s["steps"] > 0 for s in stats)


def test_colocated_matches_single_engine(colocated, prompts, offline_reference):
    got = asyncio.run(send_all(colocated.base_url, prompts))
    assert got == offline_reference
    wait_pools_clean(colocated)


def test_chat_and_models(disaggregated):
    client = openai.OpenAI(base_url=disaggregated.base_url, api_key=API_KEY, max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == r.choices[0].message.content
    wait_pools_clean(disaggregated)


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (json.dumps({"model": "tiny"}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "hi"}).encode(), 400, "model"),
    (json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x" * 5000}).encode(), 400, "prompt"),
    (json.dumps({"model": "gpt-9", "prompt": "hi"}).encode(), 404, "model"),
    (json.dumps({"model": "tiny", "prompt": "hi", "temperature": "hot"}).encode(), 400, "temperature"),
])
def test_bad_requests_get_openai_errors(disaggregated, body, status, param):
    r = httpx.post(f"{disaggregated.base_url}/completions", content=body,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    # ... and the server keeps serving.
    ok = httpx.post(f"{disaggregated.base_url}/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                    headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200


def test_wrong_api_key(disaggregated):
    client = openai.OpenAI(base_url=disaggregated.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2)


def test_disconnect_mid_stream_frees_blocks(disaggregated):
    steps = lambda: sum(s["steps"] for s in ray.get([w.handle.stats.remote() for w in disaggregated.workers]))
    before = steps()
    body = {"model": "tiny", "prompt": list(range(200)), "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{disaggregated.base_url}/completions", json=body,
                           headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            lines = r.iter_lines()
            seen = 0
            for line in lines:
                seen += line.startswith("data: {")
                if seen >= 5:            # decoding on a decode worker by now
                    break
    wait_pools_clean(disaggregated)
    # Freed by the abort, not by running to the end: far fewer steps than 3000 tokens take.
    assert steps() - before < 1500


def test_disconnect_between_prefill_and_decode_frees_blocks(ray_session):
    """The decode worker has one seat, taken by a long request: the second request's KV waits
    on the prefill worker (held under its lease) while the decode side applies backpressure.
    Its client leaves right after the first token; both workers must drop it."""
    spec = ClusterSpec(model="tiny", mode="disaggregated", num_prefill=1, num_decode=1,
                       engine=engine_cfg(max_num_seqs=1), num_cpus_per_worker=0.5, lease_s=60)
    with ServingCluster(spec, port=free_port()) as c:
        url = f"{c.base_url}/completions"
        long_body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as client, \
                client.stream("POST", url, json=long_body) as occupant:
            lines = occupant.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            wait_for(lambda: ray.get(c.workers[1].handle.stats.remote()), lambda st: st["running"] == 1)
            body = {"model": "tiny", "prompt": list(range(100)), "max_tokens": 50, "stream": True,
                    "ignore_eos": True}
            with client.stream("POST", url, json=body) as r:
                b_lines = r.iter_lines()        # kept referenced: a dropped iterator closes the stream
                first = next(line for line in b_lines if line.startswith("data: {"))
                assert json.loads(first[6:])["choices"][0]["token_ids"]    # the prefill's token
                wait_for(lambda: [ray.get(w.handle.stats.remote()) for w in c.workers],
                         lambda st: st[0]["held"] == 1 and st[1]["pending"] == 1)   # stuck between the two
            # The second client is gone; the occupant keeps streaming.
            assert next(line for line in lines if line.startswith("data: {"))
        wait_pools_clean(c)


def test_metrics_count_prefix_hits_and_handoffs(disaggregated):
    prefix = list(range(10, 74))                      # 4 full blocks, shared by both requests
    for tail in ([1, 2, 3], [4, 5, 6]):
        r = httpx.post(f"{disaggregated.base_url}/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": "tiny", "prompt": prefix + tail, "max_tokens": 4})
        assert r.status_code == 200

    def scrape() -> dict[str, float]:
        text = httpx.get(f"{disaggregated.base_url.removesuffix('/v1')}/metrics").text
        totals: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("pdcluster:"):
                name, value = line.rsplit(" ", 1)
                base = name.split("{", 1)[0]
                totals[base] = totals.get(base, 0.0) + float(value)
        return totals

    m = wait_for(scrape, lambda m: m.get("pdcluster:prefix_cache_hits_total", 0) >= 64
                 and m.get("pdcluster:kv_transfer_bytes_total", 0) > 0)
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage_perc", "prefix_cache_queries_total", "generation_tokens_total",
                 "request_success_total", "pool_workers"):
        assert f"pdcluster:{name}" in m, name
    assert m["pdcluster:prefix_cache_queries_total"] >= m["pdcluster:prefix_cache_hits_total"]


def test_admission_queue_full_gives_429_with_retry_after(ray_session):
    spec = ClusterSpec(model="tiny", mode="colocated", num_colocated=1, engine=engine_cfg(),
                       num_cpus_per_worker=0.5)
    with ServingCluster(spec, port=free_port(), max_pending=1) as c:
        url = f"{c.base_url}/completions"
        long_body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as client, client.stream("POST", url, json=long_body) as busy:
            lines = busy.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            r = client.post(url, json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 429
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "overloaded"
        # The slot frees when the first client leaves.
        ok = wait_for(lambda: httpx.post(url, json={"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code,
                      lambda status: status == 200)
        assert ok == 200
        wait_pools_clean(c)
