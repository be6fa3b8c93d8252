"""The cluster end to end on a local Ray: pools, KV handoff, router, OpenAI API.

The oracle is the offline single-engine path on the same prompts (itself checked against
transformers in test_hf_parity); the official `openai` client sends the requests.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest
import ray

from cluster.loadtest import promtext
from cluster.run.launcher import ClusterSpec
from cluster.offline import generate
from common import free_port, wait_for, wait_pools_clean
from cluster.run.serve import ServingCluster
from workers.checkpoint import builtin_config
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.kv_transfer import KVLayout
from workers.sequence import SamplingParams

MAX_TOKENS = 24
API_KEY = "test-key"
RETRY_S = 120.0        # a 429 is sent again after its Retry-After until this long has passed (`send_all`)


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
    """All requests at once; even ones stream, odd ones do not. A 429 (SLO admission: a burst of
    64 to a cold cluster sits near the TTFT target on a slow minute of a shared box, a fresh
    clone's run refused one at a predicted 1.13 s) is sent again after its Retry-After, as the
    openai client does by default, until RETRY_S has passed (a fresh clone's run beside another
    busy process saw one refused six times over 12 s: the predictions' errors learned in the
    burst, 2.32 s at their 95th percentile, price the next seconds too); any other error fails.
    What these tests check is the tokens; admission has its own (tests/test_admission*.py)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=120)

    async def one(i, p):
        deadline = time.monotonic() + RETRY_S
        while True:
            try:
                return await tokens_of(i, p)
            except openai.RateLimitError as e:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(float(e.response.headers.get("retry-after", 1)))

    async def tokens_of(i, p):
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
    assert {s.role for s in stats} == {"prefill", "decode"}
    # Both pools did work (power-of-two-choices spreads 64 requests over both workers of each).
    assert all(s.steps > 0 for s in stats)


def test_a_long_prompts_kv_streams_to_its_decode_worker_while_it_is_prefilled(disaggregated):
    """Prompts of several chunks (1,200 tokens, 512 per step): the router picks the decode
    worker at the first chunk's word and the KV streams to it (counted once per request); the
    tokens are the single engine's with the same chunks, streamed or whole; every block comes back."""
    rng = random.Random(11)
    long_prompts = [[rng.randrange(256) for _ in range(1200)] for _ in range(2)]
    engine = LLMEngine(EngineConfig.from_dict({"model": "tiny", **engine_cfg()}))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [r.token_ids for r in engine.generate([{"prompt_token_ids": p} for p in long_prompts], params)]
    streamed = disaggregated.server.metrics.kv_streamed
    before = streamed._value.get()
    assert asyncio.run(send_all(disaggregated.base_url, long_prompts)) == want
    assert streamed._value.get() == before + 2
    wait_pools_clean(disaggregated)


def test_colocated_matches_single_engine(colocated, prompts, offline_reference):
    got = asyncio.run(send_all(colocated.base_url, prompts))
    assert got == offline_reference
    wait_pools_clean(colocated)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_seeded_sampling_equals_the_offline_engine(mode, request, ray_session):
    """Temperature 1, top-p 0.9 and a seed per request: the same tokens offline, colocated and
    disaggregated (the draw at each position depends on the seed and the position, not on which
    worker makes it: the decode worker continues the prefill worker's stream)."""
    cluster = request.getfixturevalue(mode)
    prompts = mixed_prompts(8, seed=5)
    params = [{"temperature": 1.0, "top_p": 0.9, "seed": 4242 + i, "max_tokens": MAX_TOKENS, "ignore_eos": True}
              for i in range(len(prompts))]
    want = [r["token_ids"] for r in generate([{"prompt_token_ids": p, **q} for p, q in zip(prompts, params)],
                                             model="tiny")]
    assert len({tuple(w) for w in want}) == len(want) and any(w[0] != w[1] for w in want)   # really sampled
    client = openai.OpenAI(base_url=cluster.base_url, api_key=API_KEY, max_retries=0, timeout=120)
    got = [client.completions.create(model="tiny", prompt=p, **{k: v for k, v in q.items() if k != "ignore_eos"},
                                     extra_body={"ignore_eos": True}).choices[0].token_ids
           for p, q in zip(prompts, params)]
    client.close()
    assert got == want


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
    # The traced requests' phases are behind the key too (this server does not trace).
    phases = disaggregated.base_url.removesuffix("/v1") + "/debug/phases"
    assert httpx.get(phases, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(phases, headers={"Authorization": f"Bearer {API_KEY}"}).json() == {"tracing": False,
                                                                                      "requests": {}}


def assert_openai_error(r: httpx.Response, status: int, param: str | None, type_: str = "invalid_request_error"):
    """OpenAI's error JSON, exactly: {"error": {"message", "type", "param", "code"}}."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["type"] == type_, err
    assert err["param"] == param, err
    return err


USER_HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, status, param", [
    ({"model": "tiny"}, 400, "messages"),                                            # no messages
    ({"model": "tiny", "messages": []}, 400, "messages"),                            # empty
    ({"model": "tiny", "messages": "hi"}, 400, "messages"),                          # not a list
    ({"model": "tiny", "messages": [{"content": "hi"}]}, 400, "messages"),           # no role
    ({"model": "tiny", "messages": [{"role": 3, "content": "hi"}]}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "user"}]}, 400, "messages"),            # no content
    ({"model": "tiny", "messages": ["hi"]}, 400, "messages"),                        # not an object
    ({"model": "tiny", "messages": USER_HI, "temperature": "hot"}, 400, "temperature"),
    ({"model": "tiny", "messages": USER_HI, "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "messages": USER_HI, "top_p": 1.5}, 400, "top_p"),
    ({"model": "tiny", "messages": USER_HI, "top_k": "many"}, 400, "top_k"),
    ({"model": "tiny", "messages": USER_HI, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "messages": USER_HI, "max_tokens": 10**6}, 400, "max_tokens"),
    ({"model": "tiny", "messages": USER_HI, "stop": [1, 2]}, 400, "stop"),
    ({"model": "tiny", "messages": USER_HI, "stream": "yes"}, 400, "stream"),
    ({"model": "tiny", "messages": USER_HI, "n": 65}, 400, "n"),
    ({"messages": USER_HI}, 400, "model"),
    ({"model": "gpt-9", "messages": USER_HI}, 404, "model"),
], ids=["missing", "empty", "not-list", "no-role", "role-not-str", "content-not-str", "no-content",
        "message-not-object", "temperature-type", "temperature-negative", "top_p-range", "top_k-type",
        "max_tokens-zero", "max_tokens-too-long", "stop-type", "stream-type", "n", "no-model", "unknown-model"])
def test_bad_chat_requests_get_openai_errors(disaggregated, body, status, param):
    r = httpx.post(f"{disaggregated.base_url}/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    err = assert_openai_error(r, status, param)
    if status == 404:
        assert err["code"] == "model_not_found"
    # ... and the server keeps serving chat.
    ok = httpx.post(f"{disaggregated.base_url}/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                    json={"model": "tiny", "messages": USER_HI, "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
    ("POST", "/chat/completions", {"model": "tiny", "messages": USER_HI, "max_tokens": 2}),
    ("GET", "/models", None),
])
@pytest.mark.parametrize("auth", [None, "Bearer", "test-key", "Basic test-key"],
                         ids=["no-header", "bearer-without-key", "no-scheme", "basic"])
def test_missing_or_malformed_authorization_gets_401(disaggregated, method, path, body, auth):
    """Under --api-key, a request without `Authorization: Bearer <key>` (the header missing,
    or present without the bearer key) is refused with 401 and OpenAI's error JSON."""
    headers = {} if auth is None else {"Authorization": auth}
    r = httpx.request(method, disaggregated.base_url + path, json=body, headers=headers)
    err = assert_openai_error(r, 401, None, "authentication_error")
    assert err["code"] == "invalid_api_key"
    # The right key still works.
    ok = httpx.request(method, disaggregated.base_url + path, json=body,
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200, ok.text


def test_disconnect_mid_stream_frees_blocks(disaggregated):
    def steps():
        return sum(s.steps for s in ray.get([w.handle.stats.remote() for w in disaggregated.workers]))
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
            wait_for(lambda: ray.get(c.workers[1].handle.stats.remote()), lambda st: st.running == 1)
            body = {"model": "tiny", "prompt": list(range(100)), "max_tokens": 50, "stream": True,
                    "ignore_eos": True}
            with client.stream("POST", url, json=body) as r:
                b_lines = r.iter_lines()        # kept referenced: a dropped iterator closes the stream
                first = next(line for line in b_lines if line.startswith("data: {"))
                assert json.loads(first[6:])["choices"][0]["token_ids"]    # the prefill's token
                wait_for(lambda: [ray.get(w.handle.stats.remote()) for w in c.workers],
                         lambda st: st[0].held == 1 and st[1].pending == 1)   # stuck between the two
            # The second client is gone; the occupant keeps streaming.
            assert next(line for line in lines if line.startswith("data: {"))
        wait_pools_clean(c)


def test_metrics_count_prefix_hits_and_handoffs(disaggregated):
    """Known requests, one at a time; after each, the router's counters grew by exactly what it
    did: its prompt tokens, the tokens the client received, one success, one KV handoff of
    ceil(prompt / block_size) blocks, and the prefix-cache hits that follow from what the
    prefill worker that served it had cached.

    The fixture has two prefill workers, idle between requests, so power-of-two-choices picks
    one at random and the hits depend on the route. The test reads the route from the
    per-worker query counter (only the serving worker's grows) and models each worker's cache:
    a prompt's full blocks are cached once it is prefilled; a lookup reuses the longest run of
    cached full blocks from the start, but never the block holding the last prompt token when
    the prompt ends on a block boundary (that token is recomputed: its logits are needed)."""
    c = disaggregated
    url = f"{c.base_url.removesuffix('/v1')}/metrics"
    block_size = ray.get(c.workers[0].handle.ready.remote()).block_size
    tiny = builtin_config("tiny")
    bytes_per_block = KVLayout(tiny.num_hidden_layers, block_size, tiny.num_key_value_heads, tiny.head_dim,
                               "float32").bytes_per_block
    prefill = [w.worker_id for w in c.workers if w.role == "prefill"]
    assert len(prefill) == 2

    idle_gauges = {f"pdcluster:{n}" for n in ("num_requests_running", "num_requests_waiting",
                                              "kv_cache_usage_perc", "kv_transfers_in_flight",
                                              "router_requests_running", "router_requests_waiting")}

    def idle(m: dict[str, float]) -> bool:
        """Every worker's latest load report (and the router) shows nothing in flight: the
        counters in those reports cover all the work done so far."""
        gauges = {s: v for s, v in m.items() if promtext.split(s)[0] in idle_gauges}
        reported = {promtext.split(s)[1]["worker"] for s in gauges if "worker=" in s}
        return len(reported) == len(c.workers) and all(v == 0 for v in gauges.values())

    def settled(grown=lambda m: True) -> dict[str, float]:
        return wait_for(lambda: promtext.scrape(url), lambda m: idle(m) and grown(m), 30)

    rng = random.Random("test_metrics")            # a prefix no other test sends
    prefix = [rng.randrange(256) for _ in range(4 * block_size)]
    more = [rng.randrange(256) for _ in range(block_size)]
    prompts = [prefix, prefix + [1, 2, 3], prefix + [4, 5, 6], prefix + more, prefix + more,
               prefix + more + [7], prefix]
    cached: dict[str, set[tuple[int, ...]]] = {w: set() for w in prefill}   # full-block prefixes
    client = openai.OpenAI(base_url=c.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    # A load report can lag the events it comes with (a prefill worker's first token may
    # travel with the report from before it took the request); the next poll brings a fresh
    # one within a second. So: idle, and (after a request) the serving worker's counters grew.
    before = settled()
    total_hits = 0
    for i, p in enumerate(prompts):
        kw = dict(model="tiny", prompt=p, max_tokens=3 + i, temperature=0, extra_body={"ignore_eos": True})
        if i % 2:
            received, usage = 0, None
            for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
                if chunk.choices:
                    received += len(chunk.choices[0].token_ids)
                else:
                    usage = chunk.usage
        else:
            r = client.completions.create(**kw)
            received, usage = len(r.choices[0].token_ids), r.usage
        assert received == usage.completion_tokens == 3 + i and usage.prompt_tokens == len(p)

        def grew(name: str, now: dict | None = None, **labels) -> float:
            return promtext.total(after if now is None else now, f"pdcluster:{name}", **labels) - \
                promtext.total(before, f"pdcluster:{name}", **labels)

        # The pull's bytes and reused blocks ride on the decode worker's load report, which is
        # rebuilt at most every REPORT_EVERY_S: a poll can bring the pull's timing sample with a
        # report from before it (a fresh clone's CI run saw bytes 0 after the count grew).
        after = settled(lambda m: grew("prefix_cache_queries_total", m) >= len(p)
                        and grew("kv_transfer_seconds_count", m) >= 1
                        and grew("kv_transfer_bytes_total", m) / bytes_per_block
                        + grew("kv_blocks_reused_total", m) >= -(-len(p) // block_size))

        served = [w for w in prefill if grew("prefix_cache_queries_total", worker=w)]
        assert len(served) == 1 and grew("prefix_cache_queries_total") == len(p), (i, served)
        cache = cached[served[0]]
        n = 0
        while n < (len(p) - 1) // block_size and tuple(p[:(n + 1) * block_size]) in cache:
            n += 1
        cache.update(tuple(p[:k * block_size]) for k in range(1, len(p) // block_size + 1))
        total_hits += n * block_size
        assert grew("prefix_cache_hits_total") == grew("prefix_cache_hits_total", worker=served[0]) \
            == n * block_size, (i, served)
        assert grew("prompt_tokens_total") == len(p)
        assert grew("generation_tokens_total") == received
        assert grew("request_success_total") == grew("request_success_total", finished_reason="length") == 1
        assert grew("request_errors_total") == 0
        assert grew("time_to_first_token_seconds_count") == grew("e2e_request_latency_seconds_count") == 1
        # The engine thread's CPU in its steps: some wherever steps ran, never more than their
        # wall time (each step's CPU read inside its wall time; two clocks: 1 % and 10 us spare).
        for w in c.workers:
            cpu = grew("engine_step_cpu_seconds_total", worker=w.worker_id)
            wall = grew("engine_step_duration_seconds_sum", worker=w.worker_id)
            assert (cpu > 0) == (wall > 0) and cpu <= wall * 1.01 + 1e-5, (i, w.worker_id, cpu, wall)
        assert grew("inter_token_latency_seconds_count") == received - 1
        assert grew("kv_transfer_seconds_count") == 1 and grew("kv_transfer_failures_total") == 0
        # Each of the prompt's blocks crossed, or the decode worker's prefix cache held it
        # (a prefix an earlier handoff brought): never more than its leading full blocks.
        reused = grew("kv_blocks_reused_total")
        assert 0 <= reused <= len(p) // block_size
        assert grew("kv_transfer_bytes_total") == (-(-len(p) // block_size) - reused) * bytes_per_block
        before = after
    # Whatever the routes: every worker's first request missed, each later one hit >= 3 blocks.
    assert total_hits >= (len(prompts) - len(prefill)) * 3 * block_size
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "pool_workers"):
        assert any(promtext.split(s)[0] == f"pdcluster:{name}" for s in after), name


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


# -- issue 10: no FastAPI-shaped errors, no empty chat deltas ----------------------------------------
ENDPOINTS = ["POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health", "GET /metrics"]


@pytest.mark.parametrize("method, path, status, code, allow", [
    ("GET", "/v1/nope", 404, "not_found", None),
    ("POST", "/v1/nope", 404, "not_found", None),
    ("GET", "/", 404, "not_found", None),
    ("GET", "/v1/completions", 405, "method_not_allowed", "POST"),
    ("GET", "/v1/chat/completions", 405, "method_not_allowed", "POST"),
    ("POST", "/v1/models", 405, "method_not_allowed", "GET"),
], ids=["get-unknown", "post-unknown", "root", "get-completions", "get-chat", "post-models"])
def test_unknown_route_and_wrong_method_get_openai_errors(disaggregated, method, path, status, code, allow):
    """FastAPI's own 404/405 ({"detail": "Not Found"}) come out as OpenAI's error JSON, naming
    the path or method and listing the endpoints that exist."""
    root = disaggregated.base_url.removesuffix("/v1")
    r = httpx.request(method, root + path, json={"model": "tiny", "prompt": "hi"} if method == "POST" else None,
                      headers={"Authorization": f"Bearer {API_KEY}"})
    err = assert_openai_error(r, status, None)
    assert err["code"] == code, err
    assert path in err["message"] and all(e in err["message"] for e in ENDPOINTS), err["message"]
    if allow is not None:
        assert method in err["message"], err["message"]
        assert allow in r.headers["allow"].split(", "), r.headers
    # The openai client sees the same status as its own error class.
    client = openai.OpenAI(base_url=disaggregated.base_url, api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.get("/nope", cast_to=object)
    assert info.value.body["code"] == "not_found"


def _raw_chat_stream(base_url: str, body: dict) -> list[dict]:
    """The SSE events of one streamed chat, parsed, up to [DONE] (which must come)."""
    events = []
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", f"{base_url}/chat/completions", json={**body, "stream": True},
            headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return events
            events.append(json.loads(line[len("data: "):]))
    raise AssertionError(f"the stream ended without [DONE] after {len(events)} events")


# A stop string of several characters keeps a holdback of 5 characters active, and the tiny
# model's random byte-level tokens often form incomplete UTF-8 sequences: both make tokens that
# yield no text yet.
@pytest.mark.parametrize("stop", [None, ["\x00\x01\x02\x03\x04\x05"]], ids=["utf8-holdback", "stop-holdback"])
def test_chat_stream_has_no_empty_deltas(disaggregated, stop):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story about caf\u00e9s."}],
            "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if stop:
        body["stop"] = stop
    whole = httpx.post(f"{disaggregated.base_url}/chat/completions", json=body,
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert whole.status_code == 200, whole.text
    whole = whole.json()
    expected = whole["choices"][0]["message"]["content"]
    assert whole["usage"]["completion_tokens"] == 48 and whole["choices"][0]["finish_reason"] == "length"

    events = _raw_chat_stream(disaggregated.base_url, body)
    *chunks, usage = events
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 48, usage
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}, chunks[0]
    *middle, last = chunks[1:]
    assert last["choices"][0]["finish_reason"] == "length", last
    empty = [c["choices"][0] for c in middle if not c["choices"][0]["delta"].get("content")]
    assert not empty, f"{len(empty)} of {len(chunks)} chunks carry no content, e.g. {empty[:3]}"
    assert all(c["choices"][0]["finish_reason"] is None for c in middle)
    assert set(last["choices"][0]["delta"]) <= {"content"}, last
    # Fewer content chunks than tokens: some tokens yielded no text on their own (the case under test).
    n_content = len(middle) + bool(last["choices"][0]["delta"].get("content"))
    assert 0 < n_content < 48, n_content
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == expected

    # The official client: same text, every chunk but the finish one carries a role or content.
    client = openai.OpenAI(base_url=disaggregated.base_url, api_key=API_KEY, max_retries=0, timeout=120)
    kw = {k: v for k, v in body.items() if k in ("model", "messages", "max_tokens", "temperature", "stop")}
    got = list(client.chat.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}))
    for c in got:
        ch = c.choices[0]
        assert ch.finish_reason is not None or ch.delta.role or ch.delta.content, c
    assert got[-1].choices[0].finish_reason == "length"
    assert sum(bool(c.choices[0].delta.content) for c in got) > 0
    assert "".join(c.choices[0].delta.content or "" for c in got) == expected
    wait_pools_clean(disaggregated)


def test_fastapi_validation_errors_get_openai_shape():
    """The handlers read their bodies themselves, but a route with typed parameters must not
    leak FastAPI's {"detail": [...]}: 400 in OpenAI's shape, naming the parameter."""
    from starlette.testclient import TestClient
    from router.app import build_app
    app = build_app(server=None)

    @app.get("/typed")
    async def typed(n: int):
        return {"n": n}

    with TestClient(app) as client:
        assert client.get("/typed?n=3").json() == {"n": 3}
        for url in ("/typed?n=abc", "/typed"):
            assert_openai_error(client.get(url), 400, "n")
