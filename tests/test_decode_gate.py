"""The decode gate (router/admission.py DecodeGate): a new request waits before its prefill, not
after its first token, while the decode pool is full.

The policy on its own (plain Python, a fake clock); the simulator with the gate against the
simulator without it; then a served cluster whose decode worker has 4 seats under 26
concurrent streams: the gate holds requests, every stream equals the offline engine's greedy
output, clients that leave while held cost nothing, and the gate and the pools end empty.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from cluster.run.launcher import ClusterSpec
from cluster.offline import generate
from cluster.run.serve import ServingCluster
from common import Clock, free_port, random_prompts, wait_for, wait_pools_clean
from router.admission import DecodeGate
from router.config import RouterConfig
from workers.messages import LoadReport


def report(running: int, pending: int = 0, receiving: int = 0, routers: int = 1) -> LoadReport:
    return LoadReport("d0", "decode", waiting=0, running=running, swapped=0, queued_prefill_tokens=0,
                      kv_blocks_used=0, kv_blocks_total=100, steps=1, pending=pending, receiving=receiving,
                      routers=routers)


def fill(gate: DecodeGate, decode: dict, num_prefill: int = 1, prefix: str = "r") -> int:
    """Let requests in while the gate opens; how many it let in."""
    n = 0
    while gate.opens(decode, num_prefill):
        gate.enter(f"{prefix}{n}")
        n += 1
        assert n < 10_000, "the gate never closed"
    return n


def test_never_full_holds_nothing():
    gate = DecodeGate(per_worker=2)
    for i in range(500):                       # a prefill-bound pool: its queue is its own
        assert gate.opens({"d0": report(running=3)}, 1)
        gate.enter(f"r{i}")
    assert gate.opens({}, 1)                   # no decode worker: the dispatcher decides
    assert gate.opens({"d0": None}, 1)         # not reported yet


def test_the_sequence_limit_is_the_capacity_until_seen_full():
    gate = DecodeGate(seats=6, per_worker=1)
    assert fill(gate, {"d0": report(running=2)}) == 4 + 2           # 4 seats free, 2 of pipeline
    gate.observe("d0", report(running=3, pending=1))                # full at 3 (the TPOT target)
    assert gate.opens({"d0": report(running=1)}, 1) is False        # 6 ahead >= 2 free + 2
    with pytest.raises(ValueError):
        DecodeGate(seats=0)


def test_routers_share_the_free_seats():
    """Two routers send to one decode worker (its report counts their leases): each lets
    through half its free seats, plus its own pipeline; together, no more than one alone."""
    alone, shared = DecodeGate(seats=10, per_worker=1), [DecodeGate(seats=10, per_worker=1) for _ in range(2)]
    assert fill(alone, {"d0": report(running=2)}) == 8 + 2
    assert [fill(g, {"d0": report(running=2, routers=2)}) for g in shared] == [4 + 2, 4 + 2]


def test_full_pool_lets_through_the_pipeline_only():
    clock = Clock()
    gate = DecodeGate(window_s=0.25, per_worker=2, clock=clock)
    full = report(running=8, pending=3)
    gate.observe("d0", full)
    assert gate.capacity == {"d0": 8}
    # Seats all taken: only the pipeline passes, per_worker x (1 decode + 1 prefill) = 4.
    assert fill(gate, {"d0": full}) == 4
    # A cohort ends: 6 seats free, so 6 more pass (the 4 ahead are the pipeline).
    assert fill(gate, {"d0": report(running=2)}, prefix="s") == 6
    # Each request that reaches decode makes room for one more.
    assert gate.leave("r0", reached_decode=True)
    assert not gate.leave("r0", reached_decode=True)        # idempotent
    assert not gate.leave("never-entered")
    assert gate.opens({"d0": report(running=2)}, 1)


def test_the_seats_to_free_are_what_a_request_arriving_now_waits_for():
    """As `opens` decides, counted: a request arriving now passes once as many requests as are
    held before it, and itself, have room; each seat that frees makes room for one. Against
    `fill`, which lets them in one by one (one decode and one prefill worker)."""
    clock = Clock()
    gate = DecodeGate(window_s=0.25, per_worker=2, clock=clock)
    full = report(running=8, pending=3)
    gate.observe("d0", full)
    assert gate.seats_to_free({"d0": report(running=2)}, 1) == 0          # room: it passes at once
    assert fill(gate, {"d0": full}) == 4                               # the pipeline
    assert gate.seats_to_free({"d0": full}, 1) == 1
    for i in range(3):
        gate.hold(f"h{i}", None)
    assert gate.seats_to_free({"d0": full}, 1) == 4                       # three held before it
    assert gate.seats_to_free({"d0": report(running=6)}, 1) == 2          # two seats freed
    assert gate.seats_to_free({}, 1) == 0                                 # no decode worker: not held


def test_requests_let_in_that_have_not_reached_the_gate_yet_are_before_one_arriving_now():
    """A burst's handlers let requests in before their runs reach the gate: the router's count
    of them (`let_in`, the requests let in without a decode seat) stands for them, so a request
    arriving now waits for the same seats as it would once they are here. The oracle: the same
    gate after they arrive (entering while it opens, then held)."""
    clock = Clock()
    gate = DecodeGate(window_s=0.25, per_worker=2, clock=clock)
    gate.observe("d0", report(running=8, pending=3))
    decode = {"d0": report(running=2)}                     # 6 seats free and the pipeline of 4
    assert fill(gate, decode, prefix="a") == 10
    for i in range(3):
        gate.hold(f"h{i}", None)
    here = len(gate.ahead) + len(gate.line)
    counted = [gate.seats_to_free(decode, 1, let_in=here + coming) for coming in (0, 5)]
    assert counted[0] == gate.seats_to_free(decode, 1) == 4
    for i in range(5):                                     # the five let in reach the gate
        gate.hold(f"c{i}", None)
    assert counted[1] == gate.seats_to_free(decode, 1, let_in=here + 5) == gate.seats_to_free(decode, 1) == 9
    fresh = DecodeGate(window_s=0.25, per_worker=2, clock=clock)
    fresh.observe("d0", report(running=8, pending=3))
    before = [fresh.seats_to_free(decode, 1, let_in=n) for n in (0, 9, 10, 12)]
    assert before == [0, 0, 1, 3] and fill(fresh, decode) == 10  # room for 10: the 11th waits for a seat


def test_pipeline_follows_the_rate_requests_reach_decode():
    clock = Clock()
    gate = DecodeGate(window_s=0.5, per_worker=1, rate_window_s=5.0, clock=clock)
    for i in range(400):                      # 80 requests/s reached decode over the last 5 s
        gate.enter(f"a{i}")
        gate.leave(f"a{i}", reached_decode=True)
        clock.t += 5.0 / 400
    assert gate.limit(2) == 40                # 80/s x 0.5 s
    clock.t += 10.0                           # quiet since: the floor, per_worker x workers
    assert gate.limit(2) == 2
    ended = DecodeGate(clock=clock)
    ended.enter("x")
    ended.leave("x")                          # ended before decode: not an arrival
    assert ended.limit(3) == 3                # per_worker (1) x workers


def test_capacity_rises_when_a_worker_holds_more_without_refusing():
    gate = DecodeGate(per_worker=1)
    gate.observe("d0", report(running=4, pending=2))
    gate.observe("d0", report(running=3))
    assert gate.capacity["d0"] == 4
    gate.observe("d0", report(running=6, receiving=1))    # shorter contexts: more seats than thought
    assert gate.capacity["d0"] == 7
    gate.observe("d0", report(running=5, pending=1))      # full again, at fewer
    assert gate.capacity["d0"] == 5
    gate.forget("d0")                                      # restarted: unknown again
    assert gate.capacity == {}
    with pytest.raises(ValueError):
        DecodeGate(per_worker=0)


# -- the simulator: the same gate, on a virtual clock ---------------------------------------------
def test_simulated_gate_moves_the_wait_before_the_first_token():
    """Requests at 3x what 4 decode seats finish: with the gate, once it has seen the seats full,
    a request's second token follows its first by about a handoff and a step; without it, by
    seconds of waiting for a seat. The same tokens either way, and every block comes back."""
    import cluster.capacity.simulate as S
    from workers.config import EngineConfig, SchedulerConfig
    from workers.cost_model import CostModel, LinearStepModel, Link
    step = LinearStepModel(p0=0.010, p1=1e-4, p2=0.0, d0=0.005, d1=0.0, d2=0.001)
    cost = CostModel(step, kv_bytes_per_token=1000, kv_capacity_tokens=100_000, link=Link("test", 1e9, 0.002))
    # 4 seats of 40-token requests at ~9 ms a step: ~11 requests/s; they come at 30/s.
    requests = [S.SimRequest(i / 30, [i % 250 + 1, 7] + [0] * 48, 40) for i in range(300)]
    gaps = {}
    for gate in (True, False):
        c = S.SimCluster(prefill_cost=cost, decode_cost=cost, decode_gate=gate, max_pending=10_000,
                         engine=EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4)))
        sim = S.Simulator(c)
        results, _ = sim.run(requests)
        assert all(r.success and r.output_len == 40 for r in results)
        for w in sim.workers.values():
            assert w.engine.kv.num_free_blocks == w.engine.kv.pool.num_blocks and not w.waiting_room
        assert sim.gate is None or not sim.gate.ahead and not sim.gate.line
        gaps[gate] = sorted(r.itl[0] for r in results[100:])      # after the first seconds
    median = len(gaps[True]) // 2
    assert gaps[True][median] < 0.5, gaps[True][median]           # the pipeline: window_s and a few steps
    assert gaps[False][median] > 2.0, gaps[False][median]         # waiting for one of 4 seats


# -- served ----------------------------------------------------------------------------------------
PROMPTS = random_prompts(7, [5, 40, 90, 17, 64, 3, 120, 33, 8, 77, 50, 21, 99, 12, 60, 30, 45, 70, 9, 110])
LONG, SHORT = 160, 24                          # tokens: the streams that fill the seats, the rest


@pytest.fixture(scope="module")
def gated_cluster(ray_session):
    # 4 decode seats for 26 streams: the gate must hold most of them. Every prompt is prefilled on
    # the prefill worker and handed off (no local prefill: the gate learns the seats from the
    # handoffs that wait for room).
    spec = ClusterSpec(model="tiny", num_prefill=1, num_decode=1, num_cpus_per_worker=0.5,
                       engine={"scheduler": {"max_num_seqs": 4}})
    with ServingCluster(spec, RouterConfig(port=free_port(), max_pending=1000, admission="queue",
                                           local_prefill_max_tokens=0)) as c:
        yield c


def offline(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return [o["token_ids"] for o in generate([{"prompt_token_ids": p, "max_tokens": max_tokens, "temperature": 0}
                                              for p in prompts], model="tiny")]


async def until(probe, deadline_s: float):
    """Await the condition (the router runs in its own thread), within a deadline."""
    end = asyncio.get_running_loop().time() + deadline_s
    while not probe():
        assert asyncio.get_running_loop().time() < end, "condition not met within the deadline"
        await asyncio.sleep(0.005)


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    ids = []
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
    return ids


async def hold_some(client, url: str, d) -> tuple[list[asyncio.Future], list[asyncio.Future], int]:
    """Six long streams on the 4 seats, then, once the gate has seen the decode worker full, 20
    short ones; returns both lots of tasks once the gate holds 5 or more, and how many it held."""
    long = [asyncio.ensure_future(stream(client, url, p, LONG)) for p in PROMPTS[:6]]
    await until(lambda: d.gate.capacity.get("decode-0") == 4, 60)
    short = [asyncio.ensure_future(stream(client, url, p, SHORT)) for p in PROMPTS[6:]]
    await until(lambda: len(d.gate.line) >= 5, 30)
    return long, short, len(d.gate.line)


def assert_drained(c) -> None:
    """Nothing ahead of or held by the gate, and the workers hold nothing."""
    d = c.server.dispatcher
    wait_for(lambda: (len(d.gate.ahead), len(d.gate.line)), lambda v: v == (0, 0), 10)
    wait_pools_clean(c, 30)
    assert c.server.metrics.gated._value.get() == 0


def test_gate_holds_before_prefill_and_streams_stay_exact(gated_cluster):
    c = gated_cluster
    url = f"http://{c.host}:{c.port}/v1/completions"

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            long, short, held = await hold_some(client, url, c.server.dispatcher)
            return await asyncio.gather(*long), await asyncio.gather(*short), held
    long, short, held = asyncio.run(run())
    assert held >= 5
    # Held or not, every stream is whole and exact.
    assert long == offline(PROMPTS[:6], LONG)
    assert short == offline(PROMPTS[6:], SHORT)
    assert_drained(c)


def test_clients_that_leave_while_held_cost_nothing(gated_cluster):
    c = gated_cluster
    url = f"http://{c.host}:{c.port}/v1/completions"

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            long, leaving, held = await hold_some(client, url, c.server.dispatcher)
            for t in leaving:                  # their clients leave, most of them while held
                t.cancel()
            await asyncio.gather(*leaving, return_exceptions=True)
            return await asyncio.gather(*long), held
    long, held = asyncio.run(run())
    assert held >= 5
    assert long == offline(PROMPTS[:6], LONG)
    # The left requests are out of the gate, and whatever got past it is freed on the workers.
    assert_drained(c)


def test_the_line_releases_in_order_and_skips_the_dropped():
    gate = DecodeGate(seats=4, per_worker=1)
    gate.observe("d0", report(running=4, pending=1))
    for i in range(5):
        gate.hold(f"h{i}", i)
    assert gate.release({"d0": report(running=4)}, 1) == [0, 1]        # the pipeline: 2 workers
    assert gate.release({"d0": report(running=2)}, 1, dropped=lambda i: i == 2) == [3, 4]   # 2 seats free
    assert not gate.line and gate.ahead == {"h0", "h1", "h3", "h4"}
