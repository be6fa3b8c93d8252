"""The simulator against oracles: hand-computed timelines of one or two requests, the plain
step-by-step path (steady decode runs must change nothing), the block pool's invariants (every
block comes back), and the arithmetic of a rate search."""
from __future__ import annotations

import dataclasses
import random
import statistics

import pytest

import cluster.capacity.simulate as S
from cluster.capacity.plan import Placement, at_rate, placements, search
from router.slo import SLOTargets
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.cost_model import BatchShape, CostModel, LinearStepModel, Link, roofline

LINK = Link("test", 1e9, 0.002)
# Step costs easy to add up by hand: prefill 10 ms + 0.1 ms/token; decode 5 ms + 1 ms/row.
STEP = LinearStepModel(p0=0.010, p1=1e-4, p2=0.0, d0=0.005, d1=0.0, d2=0.001)


def cost(capacity_tokens: int = 100_000, step=STEP) -> CostModel:
    return CostModel(step, kv_bytes_per_token=1000, kv_capacity_tokens=capacity_tokens, link=LINK)


def engine(caching: bool = False, **sched) -> EngineConfig:
    return EngineConfig(cache=CacheConfig(enable_prefix_caching=caching), scheduler=SchedulerConfig(**sched))


def run(requests, mode="disaggregated", capacity=100_000, step=STEP, **kw):
    c = S.SimCluster(mode=mode, prefill_cost=cost(capacity, step), decode_cost=cost(capacity, step),
                     engine=kw.pop("engine", engine()), **kw)
    sim = S.Simulator(c)
    results, duration = sim.run(requests)
    return sim, results, duration


def req(t: float, n: int, out: int, first: int = 1) -> S.SimRequest:
    return S.SimRequest(t, [first, 7] + [0] * (n - 2), out)


def assert_pools_clean(sim: S.Simulator) -> None:
    """Every block back in its pool, no sequence left anywhere, nothing in flight."""
    for w in sim.workers.values():
        e = w.engine
        assert not e._seqs and not e.has_unfinished(), (w.worker_id, e._seqs)
        assert e.kv.num_free_blocks == e.kv.pool.num_blocks, w.worker_id
        assert all(b.ref_cnt == 0 for b in e.kv.pool.blocks)
        assert not w.waiting_room and w.receiving == 0 and not w.busy
    assert sim.in_flight == 0


def test_one_request_follows_the_hand_computed_timeline():
    """100-token prompt, 4 output tokens, 1 prefill + 1 decode, 3 ms of router overhead:
    arrive 0 -> prefill starts 3 ms, takes 10 + 10 = 20 ms (first token at 23 ms) -> handoff
    of the prompt's 100 tokens of KV (the first output token is computed on the decode side):
    2 ms + 100 x 1000 B / 1 GB/s = 2.1 ms -> three decode steps of 6 ms."""
    sim, (r,), _ = run([req(0.0, 100, 4)], request_overhead_s=0.003)
    assert r.success and r.output_len == 4
    assert r.ttft == pytest.approx(0.023)
    handoff = 0.002 + 100 * 1000 / 1e9
    assert r.latency == pytest.approx(0.023 + handoff + 3 * 0.006)
    assert r.itl == pytest.approx([handoff + 0.006, 0.006, 0.006])
    assert_pools_clean(sim)


def test_two_prompts_arriving_together_share_one_prefill_step():
    """Both are in the inbox when the step starts, so one step computes both (200 tokens:
    10 + 20 ms); the decode worker then batches them (rows 2: 7 ms a step)."""
    sim, (a, b), _ = run([req(0.0, 100, 3, first=1), req(0.0, 100, 3, first=2)])
    assert a.ttft == pytest.approx(0.030) and b.ttft == pytest.approx(0.030)
    handoff = 0.002 + 100 * 1000 / 1e9
    # b's transfer queues behind a's on the decode worker's link; a decodes alone for one step.
    assert a.itl[0] == pytest.approx(handoff + 0.006)
    assert b.latency > a.latency
    assert_pools_clean(sim)


def test_colocated_request_decodes_where_it_prefilled():
    sim, (r,), _ = run([req(0.0, 50, 3)], mode="colocated", num_colocated=1)
    assert r.ttft == pytest.approx(0.015)                       # 10 ms + 50 x 0.1 ms
    assert r.itl == pytest.approx([0.006, 0.006])               # no handoff
    assert_pools_clean(sim)


@pytest.mark.parametrize("per_request,per_token,ttft,itl", [
    (0.0, 0.05, 0.015, [0.006 / 0.9, 0.006 / 0.8, 0.006 / 0.7]),   # the background: 0.1, 0.2, 0.3 (2, 3, 4 tokens)
    (0.0, 1.0, 0.015, [0.012, 0.012, 0.012]),                       # at most half the cores
    (0.05, 0.0, 0.015 / 0.9, [0.006 / 0.9] * 3)])                   # the request's own arrival: 0.05 x 1 / 0.5 s
def test_the_background_leaves_the_workers_what_it_does_not_take_of_shared_cores(monkeypatch, per_request, per_token,
                                                                                   ttft, itl):
    """One colocated worker on one shared core; the background (router, client) pays
    `per_request` CPU-seconds per arriving request and `per_token` per streamed token, and takes
    the requests and tokens of the last half second (STREAM_WINDOW_S) times those, at most half
    the cores: each step (15 ms prefill, 6 ms decode alone) runs on the rest of the core, 1 /
    (1 - background) slower. A second request two seconds later finds the first's arrival and
    tokens aged out."""
    monkeypatch.setattr(S, "MAX_RUN", 1)                 # step by step: each step priced as it starts
    assert S.STREAM_WINDOW_S == 0.5
    sim, (a, b), _ = run([req(0.0, 50, 4), req(2.0, 50, 1, first=2)], mode="colocated", num_colocated=1,
                         shared_cores=1, background_cpu_per_request_s=per_request, background_cpu_per_token_s=per_token)
    assert a.ttft == pytest.approx(ttft) and a.itl == pytest.approx(itl)
    assert b.ttft == pytest.approx(ttft)
    assert_pools_clean(sim)


@pytest.mark.parametrize("share", [0.5, 0.75])
def test_the_cores_the_busy_workers_go_without_fall_on_them_by_role(share):
    """1 prefill + 1 decode on two shared cores, the background 50 ms of CPU per arriving
    request. The first request (0 s) decodes 400 tokens in steady runs, priced with the prefill
    worker idle (no slowdown); the second arrives at 0.3 s, both arrivals in the last half
    second: the background takes 0.05 x 2 / 0.5 = 0.2 of a core, the two busy workers go 0.2
    short, and the prefill step's part of it is `share` (prefill_wait_share): its 15 ms take
    15 / (1 - 0.2 x share)."""
    sim, (a, b), _ = run([req(0.0, 50, 400), req(0.3, 50, 1, first=2)], shared_cores=2,
                         background_cpu_per_request_s=0.05, prefill_wait_share=share)
    assert a.success and a.itl[1:] == pytest.approx([0.006] * 398)
    assert b.ttft == pytest.approx(0.015 / (1 - 0.2 * share))
    assert_pools_clean(sim)


def test_a_steady_decode_runs_tokens_count_toward_the_background_while_it_runs():
    """1 prefill + 1 decode on two shared cores, the background 1 ms of CPU per streamed token.
    The first request decodes alone in steady runs (6 ms steps: about 83 tokens in any half
    second); a prompt sent at 1.0 s finds both workers busy, so its prefill (15 ms alone) runs
    1 / (1 - background / 2) slower, the background 0.001 x the tokens of the last 0.5 s / 0.5 s:
    the run's tokens count as its chunks end (RUN_CHUNK steps, 0.38 s: at least those up to
    0.79 s, 47 steps), not only once the run ends (a run that only counted then left the
    prefill at 15 ms)."""
    assert S.RUN_CHUNK == 64 and S.STREAM_WINDOW_S == 0.5
    sim, (a, b), _ = run([req(0.0, 50, 400), req(1.0, 50, 1, first=2)], shared_cores=2,
                         background_cpu_per_token_s=0.001)
    assert a.success and b.success
    assert 0.015 / (1 - 0.002 * 47 / 2) <= b.ttft <= 0.015 / (1 - 0.002 * 84 / 2)
    assert_pools_clean(sim)


def test_the_routers_view_of_a_prefill_worker_keeps_a_prompt_until_the_second_frame_after_it():
    """router/events.py: a frame's report covers the sends before the frame ahead of it arrived.
    A prompt sent at 0.1 s to an idle worker is computed by 0.12 s (that step's frame), yet counts
    until the next frame (0.2 s: another step); one sent at 1.0 s, after a quiet spell, counts
    until the wait's frame at 1.52 s (FRAME_WAIT_S after the 1.02 s step). Each frame's report
    (what truly waits then) counts as well."""
    assert S.FRAME_WAIT_S == 0.5
    v = S._RouterView()
    v.send(0.1, 100, lambda: 0)
    v.frame(0.12, 0)
    assert v.queued(0.15, lambda: 0) == 100             # computed, still counted
    v.frame(0.2, 30)                                    # another step; its report: 30 tokens wait
    assert v.queued(0.25, lambda: 30) == 30
    v.send(1.0, 50, lambda: 0)                          # quiet since 0.2: a frame at 0.7 (reporting 0)
    v.frame(1.02, 0)
    assert v.queued(1.5, lambda: 0) == 50
    assert v.queued(1.6, lambda: 0) == 0                # the wait's frame at 1.52 covered it
    # After a long quiet (frames at 2.02, 2.52, ... 9.52), one sent at 10.0 counts until the
    # frame at 10.52 (the one at 10.02 covers only what came before 9.52).
    v.send(10.0, 20, lambda: 0)
    assert v.queued(10.4, lambda: 0) == 20
    assert v.queued(10.6, lambda: 0) == 0


def workload(n=400, rate=40.0, seed=3):
    import random
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        out.append(S.SimRequest(t, [1 + i % 30000, 1 + i // 30000] + [0] * rng.randint(20, 600),
                                rng.randint(1, 120)))
    return out


@pytest.mark.parametrize("mode,kw", [("colocated", {"num_colocated": 2}),
                                      ("disaggregated", {"num_prefill": 1, "num_decode": 1})])
def test_steady_decode_runs_change_nothing(monkeypatch, mode, kw):
    """Taking a steady decode run whole gives every request the same token times as stepping
    one step at a time (with one decode pool member, nothing can pick differently), under
    memory pressure and a per-step context cost too."""
    step = dataclasses.replace(STEP, d1=2e-6)
    requests = workload()
    fast = run(requests, mode, capacity=40_000, step=step, **kw)
    monkeypatch.setattr(S, "MAX_RUN", 1)                 # runs need 2 steps: every step is single
    slow = run(requests, mode, capacity=40_000, step=step, **kw)
    assert sum(w.steps for w in fast[0].workers.values()) == sum(w.steps for w in slow[0].workers.values())
    for x, y in zip(fast[1], slow[1]):
        assert (x.success, x.output_len) == (y.success, y.output_len)
        assert x.ttft == pytest.approx(y.ttft, abs=1e-9) and x.latency == pytest.approx(y.latency, abs=1e-9)
        assert x.itl == pytest.approx(y.itl, abs=1e-9)
    assert fast[0].num_runs > 10 and slow[0].num_runs == 0          # the fast path did run
    assert_pools_clean(fast[0])
    assert_pools_clean(slow[0])


def test_local_prefill_of_every_prompt_serves_as_a_colocated_worker_would():
    """Disaggregated with every prompt prefilled on its decode worker (router/placement.py, the
    router's own choice code) is one colocated worker with the same costs: every request's token
    times equal the colocated run's, no handoff happens, and the prefill worker never steps."""
    requests = workload(n=200)
    local = run(requests, num_prefill=1, num_decode=1, local_prefill_max_tokens=10**6, decode_gate=False,
                capacity=40_000)
    colocated = run(requests, "colocated", num_colocated=1, capacity=40_000)
    for x, y in zip(local[1], colocated[1]):
        assert (x.success, x.output_len) == (y.success, y.output_len)
        assert x.ttft == pytest.approx(y.ttft, abs=1e-9) and x.latency == pytest.approx(y.latency, abs=1e-9)
    assert local[0].workers["prefill-0"].steps == 0 and local[0].placement.handoff_s is None
    assert_pools_clean(local[0])


@pytest.mark.parametrize("limit", [0, 200])
def test_local_prefill_takes_exactly_the_prompts_within_its_limit(limit):
    """With a token limit, the prompts with at most that many tokens to compute (no prefix
    cache: all of them) are prefilled on their decode worker and the rest are handed off: the
    handoffs equal the longer prompts (but for one-token outputs, which end where they are
    prefilled), and all requests complete with every block back."""
    requests = workload(n=200)
    sim, results, _ = run(requests, num_prefill=1, num_decode=2, local_prefill_max_tokens=limit, capacity=40_000)
    assert all(r.success for r in results)
    assert sim.num_handoffs == sum(r.prompt_len > limit and r.output_len > 1 for r in requests) > 0
    assert_pools_clean(sim)


def test_auto_local_prefill_under_a_sustained_overload_keeps_every_tpot_within_the_target():
    """Twice what the prefill worker serves, sustained: the prefill pool's queue never empties, so
    local prefill "auto" would give the decode worker a prompt nearly every step (its sequences'
    TPOT then several times the target: the run without a TPOT target shows it); with the
    target, the router's pace bound keeps every request's TPOT within it."""
    rng = random.Random(0)
    t, requests = 0.0, []
    for i in range(400):
        t += rng.expovariate(40.0)
        requests.append(req(t, 512, 32, first=i + 2))
    tpot_s = 0.03

    def tpots(target: float) -> list[float]:
        sim, results, _ = run(requests, num_prefill=1, num_decode=1, local_prefill_max_tokens="auto",
                              slo=SLOTargets(ttft_s=1e6, tpot_s=target))
        assert all(r.success and r.output_len == 32 for r in results)
        assert_pools_clean(sim)
        return sorted((r.latency - r.ttft) / (r.output_len - 1) for r in results)
    assert tpots(tpot_s)[-1] <= tpot_s
    assert statistics.median(tpots(1e6)) > 2 * tpot_s


def test_every_request_completes_and_every_block_returns_under_memory_pressure():
    """A decode pool that holds a handful of sequences: handoffs wait for room, decode steps
    preempt; still every request gets exactly its tokens and the pools end clean."""
    requests = workload(n=300, rate=80.0)
    sim, results, _ = run(requests, num_prefill=2, num_decode=2, capacity=3000,
                          engine=engine(caching=True, max_num_seqs=16))
    assert all(r.success for r in results)
    assert [r.output_len for r in results] == [q.output_len for q in requests]
    assert sum(w.engine.scheduler.stats.num_preemptions["recompute"] for w in sim.workers.values()) > 0
    assert_pools_clean(sim)


def test_prefix_sharing_hits_the_cache():
    """Prompts sharing a 256-token prefix prefill it once per prefill worker."""
    prefix = [5, 5] + [0] * 254
    requests = [S.SimRequest(i * 0.5, prefix + [100 + i, 9] + [0] * 30, 2) for i in range(10)]
    sim, results, _ = run(requests, engine=engine(caching=True))
    stats = sim.workers["prefill-0"].engine.scheduler.stats
    assert all(r.success for r in results)
    assert stats.prefix_cache_hits == 9 * 256
    assert_pools_clean(sim)


@pytest.mark.parametrize("rate", [4.0, 1000.0])
def test_prefix_aware_picking_reaches_what_one_cache_would_serve(rate):
    """4 prefill workers, 4 prefixes of 800 tokens x 10 requests of 32 tokens of their own,
    shuffled: with --policy prefix every prefix is computed about once (one cache that forgets
    nothing would serve 36 x 800 tokens); power-of-two-choices spreads each over the pool."""
    import random
    rng = random.Random(0)
    prefixes = [[p + 1] + [0] * 799 for p in range(4)]
    order = [i % 4 for i in range(40)]
    rng.shuffle(order)
    requests = [S.SimRequest.synthetic(k / rate, 832, 4, uid=k, prefix=prefixes[p]) for k, p in enumerate(order)]
    ideal = 36 * 800 / (40 * 832)

    def hit_rate(policy: str) -> float:
        sim, results, _ = run(requests, engine=engine(caching=True), num_prefill=4, policy=policy)
        assert all(r.success for r in results)
        assert_pools_clean(sim)
        stats = [w.engine.scheduler.stats for w in sim.pools["prefill"]]
        return sum(s.prefix_cache_hits for s in stats) / sum(s.prefix_cache_queries for s in stats)
    prefix, p2c = hit_rate("prefix"), hit_rate("p2c")
    assert prefix >= 0.9 * ideal and prefix > p2c + 0.15, (prefix, p2c, ideal)


def test_admission_turns_away_past_max_pending():
    requests = [req(0.0, 100, 50, first=i + 1) for i in range(5)]
    sim, results, _ = run(requests, max_pending=3)
    assert [r.success for r in results] == [True, True, True, False, False]
    assert "429" in results[3].error
    assert_pools_clean(sim)


def test_a_prompt_longer_than_the_model_fails_like_a_400():
    c = S.SimCluster(prefill_cost=cost(), decode_cost=cost(), engine=engine())
    sim = S.Simulator(c, max_model_len=64)
    (r,), _ = sim.run([req(0.0, 100, 4)])
    assert not r.success and "400" in r.error
    assert_pools_clean(sim)


def test_roofline_cluster_runs_at_scale_quickly():
    """A 64-GPU shape on a roofline runs the real code end to end (the hour-long run is a
    benchmark; this is its smoke)."""
    c = roofline("llama-3-8b", "h100-sxm", 1)
    cluster = S.SimCluster(num_prefill=16, num_decode=48, prefill_cost=c, decode_cost=c, engine=engine())
    sim = S.Simulator(cluster, record_itl=False)
    results, _ = sim.run(workload(n=2000, rate=100.0))
    assert all(r.success for r in results)
    assert_pools_clean(sim)


# -- the planner's pieces ------------------------------------------------------------------------
def test_placements_fit_the_gpus():
    ps = placements(4)
    assert all(p.num_gpus <= 4 for p in ps)
    assert Placement("disaggregated", 1, 1, 2, 1) in ps                # DistServe's OPT-13B choice
    assert Placement("disaggregated", 1, 3, 1, 1) in ps and Placement("disaggregated", 3, 1, 1, 1) in ps
    assert {p.tp for p in ps if p.mode == "colocated"} == {1, 2, 4}
    assert not any(p.num_prefill == 0 or p.num_decode == 0 for p in ps if p.mode == "disaggregated")


def test_rate_search_brackets_the_threshold():
    """A monotone attainment curve with its 90 % point at 3.3: the search returns the highest
    probed rate at or under it, within the bisection's resolution."""
    def probe(rate):
        return 1.0 if rate <= 3.3 else 0.5
    rate, probes = search(probe, 1.0, 8, 0.9)
    assert 3.3 - 4.0 / 2**8 <= rate <= 3.3
    assert all((att >= 0.9) == (r <= 3.3) for r, att in probes)
    assert search(lambda r: 0.0, 1.0, 4, 0.9)[0] == 0.0


def test_at_rate_keeps_the_arrival_pattern():
    base = [S.SimRequest(t, [1, 2], 1) for t in (5.0, 6.0, 8.0, 9.0)]     # 3 gaps over 4 s: 0.75 req/s
    scaled = at_rate(base, 1.5)
    assert [r.arrival_s for r in scaled] == pytest.approx([0.0, 0.5, 1.5, 2.0])


def test_each_step_is_priced_by_its_recorded_shape():
    """A 40-token prompt, 2 tokens, one colocated worker: a prefill step (10 + 40 x 0.1 ms) and
    one decode step (5 + 1 ms), priced from the shapes the engine recorded, and nothing else."""
    sim, (r,), _ = run([req(0.0, 40, 2)], mode="colocated", num_colocated=1)
    w = sim.workers["colocated-0"]
    assert w.steps == 2
    assert w.engine.last_shape == BatchShape(num_decode=1, decode_context=41)
    assert w.busy_s == pytest.approx(STEP.step_s(BatchShape(1, 40, 1600)) + 0.006)
    assert r.latency == pytest.approx(w.busy_s)
