"""Worker faults lose nothing and change nothing. Worker processes are killed (SIGKILL) or
frozen (SIGSTOP) while streams run; every stream must equal the fault-free output of the same
request (the oracle: the offline single engine, greedy or seeded), none may fail, the pools
come back to their size, and every KV block comes back.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal

import httpx
import openai
import pytest
import ray

from cluster.loadtest import promtext
from cluster.run.launcher import ClusterSpec
from cluster.offline import generate
from cluster.run.serve import ServingCluster
from common import free_port, wait_for, wait_pools_clean
from router.config import RouterConfig
from router.pools import ACTIVE
from router.protocol import bad_words_tokens
from workers.sequence import sample_seed
from workers.tokenizer import byte_level_tokenizer

NUM_STREAMS, MAX_TOKENS = 40, 80
WORDS = "the a KV cache block prefill decode token stream worker router lease pool".split()


def word_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 120))) for _ in range(n)]


@pytest.fixture(scope="module")
def chaos(ray_session):
    spec = ClusterSpec(model="tiny", num_prefill=2, num_decode=2, num_cpus_per_worker=0.5,
                       engine={"cache": {"num_blocks": 1024}, "scheduler": {"max_num_batched_tokens": 1024}},
                       lease_s=20, transfer_timeout_s=10)
    # Every request admitted (no SLO shedding while pools are down): each stream is compared.
    # The hang timeout is short for the SIGSTOP test, but not so short that a starved box's
    # pauses read as hangs (at 3 s, beside a busy process, three workers silent together for
    # 30 s were taken for hung, and requests resumed through them and then the killed worker ran
    # out of retries: a pause that long no timeout here waits out; 8 s takes the shorter ones).
    with ServingCluster(spec, RouterConfig(port=free_port(), worker_hang_timeout_s=8, admission="queue")) as c:
        yield c


def worker_pids(c: ServingCluster) -> dict[str, int]:
    """The process of each worker that answers now (one being restarted does not)."""
    return {w: info.pid for w, info in c.answering(timeout_s=30).items()}


def pools(c: ServingCluster) -> dict:
    return httpx.get(f"http://{c.host}:{c.port}/health", timeout=10).json()["workers"]


def metric(c: ServingCluster, name: str, **labels) -> float:
    return promtext.total(promtext.scrape(f"http://{c.host}:{c.port}/metrics"), name, **labels)


async def stream_all(c: ServingCluster, prompts: list[str], params: list[dict], faults: list,
                     n: int = 1) -> list[list[int]]:
    """Stream every prompt at once (each with its sampling parameters, `n` samples each: the
    outputs prompt by prompt, sample by sample); `faults` are (after this many chunks received in
    all, a callable), run from the event loop as the traffic passes."""
    client = openai.AsyncOpenAI(base_url=c.base_url, api_key="x", max_retries=0, timeout=300)
    received = 0
    pending = sorted(faults, key=lambda f: f[0])

    async def one(prompt: str, p: dict) -> list[list[int]]:
        nonlocal received
        ids: list[list[int]] = [[] for _ in range(n)]
        p = dict(p)
        extra = {"ignore_eos": True, **p.pop("extra_body", {})}
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                                                 n=n, extra_body=extra, **p)
        async for chunk in stream:
            if chunk.choices:
                ids[chunk.choices[0].index] += chunk.choices[0].token_ids or []
            received += 1
            while pending and received >= pending[0][0]:
                pending.pop(0)[1]()
        return ids

    try:
        return [ids for each in await asyncio.gather(*(one(p, q) for p, q in zip(prompts, params))) for ids in each]
    finally:
        await client.close()


def kill(c: ServingCluster, rng: random.Random, sig: int, killed: list, role: str = "") -> callable:
    """A callable that signals a random answering worker (of `role`, when given) that the router
    counts as active: a process Ray has restarted but the router has not taken back yet is
    already counted as lost once."""
    def do():
        pids = worker_pids(c)
        victim = rng.choice(sorted(w for w in pids if w.startswith(role) and c.pools[w].state == ACTIVE))
        os.kill(pids[victim], sig)
        killed.append(victim)
    return do


def offline(prompts: list[str], params: list[dict]) -> list[list[int]]:
    """The offline engine's outputs (`extra_body`'s fields as the router maps them: vLLM's
    guided_regex and guided_json as the engine's `structured`, bad_words as token sequences)."""
    tok = byte_level_tokenizer()
    reqs = []
    for p, q in zip(prompts, params):
        extra = dict(q.get("extra_body", {}))
        if "guided_regex" in extra:
            extra["structured"] = {"regex": extra.pop("guided_regex")}
        if "guided_json" in extra:
            extra["structured"] = {"json": json.dumps(extra.pop("guided_json"))}
        if "bad_words" in extra:
            extra["bad_words_token_ids"] = bad_words_tokens(extra.pop("bad_words"),
                                                            lambda t: tok.encode(t, add_special_tokens=False))
        reqs.append({"prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                     **{k: v for k, v in q.items() if k != "extra_body"}, **extra})
    return [r["token_ids"] for r in generate(reqs, model="tiny")]


def recovered(c: ServingCluster) -> None:
    """Pools back to 2 + 2 (the killed workers restarted and rejoined), and no block in use."""
    wait_for(lambda: pools(c), lambda p: p == {"prefill": 2, "decode": 2, "colocated": 0}, 120)
    wait_pools_clean(c, 60)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_killed_workers_change_no_stream(chaos, seeded):
    """40 streams at once on 2 prefill + 2 decode workers; a random decode worker process is
    killed (SIGKILL) when a tenth of the tokens have arrived (by then every prompt may be
    prefilled, so a prefill worker may hold nothing), and a random worker of either pool at half.
    Five in six of the streams ask for a sampling feature (penalties and a logit bias; a regex;
    min_p and min_tokens; bad_words; a JSON schema): their state (the output's token counts, the
    grammar's matcher, the banned words' prefixes) crosses the handoff and every resume, rebuilt
    from the tokens delivered."""
    rng = random.Random(int(seeded))
    prompts = word_prompts(NUM_STREAMS, seed=int(seeded))
    params = [{"temperature": 1.0, "top_p": 0.9, "seed": 1000 + i} if seeded else {"temperature": 0}
              for i in range(NUM_STREAMS)]
    # (the grammars allow more than MAX_TOKENS tokens: every stream runs to it)
    features = [{}, {"presence_penalty": 0.8, "frequency_penalty": 0.6, "logit_bias": {"101": 2.0, "32": -3.0}},
                {"extra_body": {"guided_regex": "([a-z]+ ){40}"}},
                {"extra_body": {"min_p": 0.2, "min_tokens": 20}},
                {"extra_body": {"bad_words": ["e", "the", "ab c"]}},
                {"extra_body": {"guided_json": {"type": "array", "minItems": 60, "items": {"type": "integer"}}}}]
    for i in range(NUM_STREAMS):
        params[i] |= features[i % len(features)]
    want = offline(prompts, params)
    resumed0 = metric(chaos, "pdcluster:requests_resumed_total")
    died0 = metric(chaos, "pdcluster:workers_lost_total", cause="died")
    killed: list[str] = []
    total = NUM_STREAMS * MAX_TOKENS
    got = asyncio.run(stream_all(chaos, prompts, params, [(total // 10, kill(chaos, rng, signal.SIGKILL, killed,
                                                                            "decode")),
                                                          (total // 2, kill(chaos, rng, signal.SIGKILL, killed))]))
    assert len(killed) == 2, killed
    assert all(len(g) == MAX_TOKENS for g in got), [len(g) for g in got]
    changed = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    assert not changed, f"{len(changed)} of {NUM_STREAMS} streams differ from the fault-free output, e.g. {changed[:5]}"
    assert metric(chaos, "pdcluster:requests_resumed_total") > resumed0      # the kills hit live requests
    recovered(chaos)
    assert metric(chaos, "pdcluster:workers_lost_total", cause="died") == died0 + 2


def test_samples_on_a_killed_decode_worker_resume_unchanged(chaos):
    """8 prompts x 3 seeded samples (n=3: each prompt's samples share one prefill and one
    handoff); a decode worker is killed when a quarter of the tokens have arrived: every sample
    on it resumes alone and equals sample j run alone with its own seed (`sample_seed`)."""
    recovered(chaos)
    rng = random.Random(5)
    prompts = word_prompts(8, seed=5)
    params = [{"temperature": 1.0, "seed": 500 + i} for i in range(len(prompts))]
    want = offline([p for p in prompts for _ in range(3)],
                   [{**q, "seed": sample_seed(q["seed"], j)} for q in params for j in range(3)])
    resumed0 = metric(chaos, "pdcluster:requests_resumed_total", cause="worker_died")
    killed: list[str] = []
    got = asyncio.run(stream_all(chaos, prompts, params,
                                 [(len(want) * MAX_TOKENS // 4, kill(chaos, rng, signal.SIGKILL, killed, "decode"))], n=3))
    assert killed and got == want
    assert metric(chaos, "pdcluster:requests_resumed_total", cause="worker_died") > resumed0
    recovered(chaos)


def test_a_hung_worker_is_restarted_and_its_requests_resume(chaos):
    """SIGSTOP freezes a decode worker mid-stream: no poll answers, so after the hang timeout
    the router takes it as lost, resumes its requests on the other decode worker, and has Ray
    restart it (its process is killed); the pool comes back to 2 + 2."""
    recovered(chaos)
    prompts = word_prompts(8, seed=7)
    want = offline(prompts, [{"temperature": 0}] * len(prompts))
    hung0 = metric(chaos, "pdcluster:workers_lost_total", cause="hung")
    frozen: list[int] = []

    victim: list[str] = []

    def freeze():
        # A decode worker that runs streams now (asked of the worker): one that ran none would
        # leave the streams to finish before its hang is noticed, and resume nothing.
        pids = worker_pids(chaos)
        running = [w.worker_id for w in chaos.workers if w.role == "decode" and w.worker_id in pids
                   and ray.get(w.handle.stats.remote(), timeout=10).running > 0]
        victim.append(running[0] if running else "decode-0")
        frozen.append(pids[victim[0]])
        os.kill(frozen[0], signal.SIGSTOP)

    resumed0 = metric(chaos, "pdcluster:requests_resumed_total")
    got = asyncio.run(stream_all(chaos, prompts, [{"temperature": 0}] * len(prompts), [(8 * 10, freeze)]))
    try:
        assert got == want
        wait_for(lambda: metric(chaos, "pdcluster:workers_lost_total", cause="hung"), lambda n: n == hung0 + 1, 60)
        assert metric(chaos, "pdcluster:requests_resumed_total") > resumed0         # its streams moved
        recovered(chaos)
        assert worker_pids(chaos)[victim[0]] != frozen[0]                  # a new process
    finally:
        for pid in frozen:                       # never leave a stopped process behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_pool_of_one_waits_for_its_restarted_worker(ray_session):
    """1 prefill + 1 decode: the only decode worker is killed mid-stream. The requests cannot
    resume elsewhere; they wait for Ray to bring it back, then continue, equal to the offline
    engine (before, with no live decode worker the request failed at once)."""
    spec = ClusterSpec(model="tiny", num_prefill=1, num_decode=1, num_cpus_per_worker=0.5,
                       engine={"cache": {"num_blocks": 512}}, transfer_timeout_s=10)
    with ServingCluster(spec, RouterConfig(port=free_port(), admission="queue")) as c:
        prompts = word_prompts(4, seed=11)
        params = [{"temperature": 0}] * len(prompts)
        killed: list[str] = []

        def kill_decode():
            pids = worker_pids(c)
            os.kill(pids["decode-0"], signal.SIGKILL)
            killed.append("decode-0")

        got = asyncio.run(stream_all(c, prompts, params, [(4 * 20, kill_decode)]))
        assert killed == ["decode-0"]
        assert got == offline(prompts, params)
        wait_for(lambda: pools(c), lambda p: p == {"prefill": 1, "decode": 1, "colocated": 0}, 120)
        wait_pools_clean(c, 60)
