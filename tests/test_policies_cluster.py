"""The deadline and priority scheduling policies served (1 prefill + 1 decode, `tiny`): requests
with their own deadlines or priorities give the offline engine's greedy output, the fields are
validated, and a high-priority request sharing a prefix with a queue of low-priority ones gets its
first token before that queue's tail."""
from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest

from common import nothing_left_running, random_prompts, sse_events, wait_for
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sequence import SamplingParams

MODEL = "tiny"
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
PREFIX = random_prompts(5, [64])[0]                    # 4 full blocks every prompt below shares


@contextlib.contextmanager
def serving(policy: str):
    from cluster.run.launcher import ClusterSpec
    from cluster.run.serve import ServingCluster
    from common import free_port
    spec = ClusterSpec(model=MODEL, num_prefill=1, num_decode=1, num_cpus_per_worker=0.5,
                       engine={"cache": {"num_blocks": 256},
                               "scheduler": {"max_num_batched_tokens": 64, "policy": policy}})
    with ServingCluster(spec, port=free_port(), admission="queue") as c:
        yield c


@pytest.fixture
def deadline_cluster(ray_session):
    with serving("deadline") as c:
        yield c


@pytest.fixture
def priority_cluster(ray_session):
    with serving("priority") as c:
        yield c


def offline(prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=MODEL))
    return [r.token_ids for r in engine.generate([{"prompt_token_ids": p} for p in prompts],
                                                 SamplingParams(**GREEDY))]


class Stream(threading.Thread):
    """One streamed completion: its tokens and when its first one arrived (time.monotonic). Its
    client is made before the thread starts, so that streams started together send together."""

    def __init__(self, base_url: str, prompt: list[int], start: bool = True, **fields):
        super().__init__(daemon=True)
        self.url, self.body = base_url + "/completions", {"model": MODEL, "prompt": prompt, "stream": True,
                                                          **GREEDY, **fields}
        self.client = httpx.Client(timeout=120)
        self.tokens: list[int] = []
        self.first_s: float | None = None
        self.error: str | None = None
        if start:
            self.start()

    def run(self):
        try:
            with self.client as c, c.stream("POST", self.url, json=self.body) as r:
                for line in r.iter_lines():
                    for ev in sse_events(line + "\n\n") if line else ():
                        if ev != "[DONE]" and ev["choices"][0].get("token_ids"):
                            self.first_s = self.first_s or time.monotonic()
                            self.tokens += ev["choices"][0]["token_ids"]
        except Exception as e:                        # reported by the test
            self.error = repr(e)


def test_requests_with_their_own_deadlines_give_the_offline_greedy_output(deadline_cluster):
    cluster = deadline_cluster
    prompts = [PREFIX + p for p in random_prompts(6, [30, 200, 5, 120, 64, 250])]
    slos = [{"ttft_slo_ms": 50}, {}, {"ttft_slo_ms": 3_600_000, "tpot_slo_ms": 1}, {"tpot_slo_ms": 20},
            {"ttft_slo_ms": 1}, {"ttft_slo_ms": 200, "tpot_slo_ms": 500}]
    streams = [Stream(cluster.base_url, p, **s) for p, s in zip(prompts, slos)]
    for s in streams:
        s.join(120)
    assert [s.error for s in streams] == [None] * len(streams)
    assert [s.tokens for s in streams] == offline(prompts)
    for name in ("ttft_slo_ms", "tpot_slo_ms"):
        for bad in (0, 3_600_001, 1.5, "10", True):
            r = httpx.post(cluster.base_url + "/completions", json={"model": MODEL, "prompt": [1, 2], name: bad},
                           timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, bad, r.text)
    nothing_left_running(cluster)


def test_a_high_priority_request_goes_before_the_low_priority_queue(priority_cluster):
    cluster = priority_cluster
    lows = [PREFIX + p for p in random_prompts(7, [400] * 8)]
    high = PREFIX + random_prompts(8, [20])[0]
    low_streams = [Stream(cluster.base_url, lows[0], priority=5)]
    wait_for(lambda: low_streams[0].first_s or low_streams[0].error, bool, deadline_s=60)
    queue = [Stream(cluster.base_url, p, start=False, priority=5) for p in lows[1:]]
    for s in queue:                  # (clients made first: on a busy box a stream that made its
        s.start()                    # own could start after the first ones' prompts were done)
    low_streams += queue
    # The others are queued on the prefill worker (the router sends at once; 7 x 400 tokens in
    # 64-token chunks, 44 steps) before the high one. The first may already be done: count it
    # while its client still reads (the router lets a request go before its client sees the
    # end, never after).
    wait_for(lambda: cluster.server.pending - low_streams[0].is_alive(), lambda n: n == len(lows) - 1,
             deadline_s=30)
    high_stream = Stream(cluster.base_url, high, priority=-1)
    for s in low_streams + [high_stream]:
        s.join(120)
    assert [s.error for s in low_streams + [high_stream]] == [None] * (len(lows) + 1)
    assert [s.tokens for s in low_streams + [high_stream]] == offline(lows + [high])
    assert high_stream.first_s < max(s.first_s for s in low_streams)
    nothing_left_running(cluster)
