"""Dynamo's planner as a baseline (cluster/capacity/dynamo_baseline.py) against decisions
computed by hand from its documented formulas, and the elastic simulator that runs it and
pdcluster's controller: workers that start late, GPU-hours held, changes that undo others."""
from __future__ import annotations

import math
import random

import pytest

from cluster.capacity import dynamo_baseline as db
from cluster.capacity.sim_control import ElasticSimulator, PlannedSimulator
from cluster.capacity.simulate import SimCluster, SimRequest
from cluster.run.controller import ADD_DECODE, ADD_PREFILL, REMOVE_DECODE, REMOVE_PREFILL, TO_DECODE, TO_PREFILL
from tests.test_simulator import assert_pools_clean, cost, engine


# -- predictors -------------------------------------------------------------------------------------
def test_the_constant_predictor_is_the_last_interval_and_skips_leading_zeros():
    p = db.ConstantPredictor()
    assert p.predict() == 0.0
    for x in (0, 0, 120, 80):
        p.add(x)
    assert p.predict() == 80


def test_the_kalman_predictor_follows_the_hand_computed_filter():
    """Level and trend, q = (1, 0.1), r = 10. After 100 (level 100, trend 0, P = 10 I), 110:
    predicted P = [[21, 10], [10, 10.1]], gain (21/31, 10/31) on the error 10: level
    100 + 210/31, trend 100/31, so the next level is 110 exactly."""
    k = db.KalmanPredictor()
    k.add(0)                                         # a leading zero: skipped
    k.add(100)
    assert k.predict() == pytest.approx(100)
    k.add(110)
    assert k.x == pytest.approx([100 + 210 / 31, 100 / 31])
    assert k.predict() == pytest.approx(110)
    assert k.p[0][0] == pytest.approx((1 - 21 / 31) * 21)
    for _ in range(50):                              # a steady series: the prediction is it
        k.add(110)
    assert k.predict() == pytest.approx(110, abs=0.5)
    ramp = db.KalmanPredictor()
    for t in range(30):                              # a ramp: it predicts the next step of it
        ramp.add(100 + 10 * t)
    assert ramp.predict() == pytest.approx(100 + 10 * 30, rel=0.02)


# -- the throughput planner ---------------------------------------------------------------------------
class Profile:
    """An engine whose prefill clears 10,000 tokens/s, whose decode makes 2,000 tokens/s at a
    25 ms ITL (in proportion to the ITL allowed), one 1,000-token prompt alone in 0.1 s and a
    decode step in 20 ms."""

    def prefill_tokens_per_s(self, isl):
        return 10_000.0

    def decode_tokens_per_s(self, context, itl_s):
        return 2_000.0 * itl_s / 0.025

    def ttft_s(self, isl):
        return 0.1

    def itl_s(self, concurrency, context):
        return 0.02


def planner(**kw) -> db.ThroughputPlanner:
    return db.ThroughputPlanner(db.PlannerConfig(ttft_s=1.0, itl_s=0.025, max_gpu_budget=-1, **kw), Profile())


def test_replicas_are_next_demand_over_a_profiled_engine():
    """100 req/s (18,000 in 180 s) of 1,000 -> 200 tokens, observed as the profile says (TTFT
    0.1 s, ITL 20 ms: both corrections 1): prefill 100 x 1,000 / 10,000 = 10; decode
    100 x 200 / 2,000 = 10."""
    p = planner()
    assert p.observe(db.Interval(18_000, 1000, 200, 0.1, 0.02, 5.0, 10))
    assert (p.p_correction, p.d_correction) == (1.0, 1.0)
    assert p.plan() == (10, 10)


def test_the_corrections_lower_prefill_only_and_tighten_decode():
    """TTFT 3x the profile's: prefill's correction is capped at 1 (queueing never raises it), so
    still 10. ITL twice the profile's (0.04 s): the target becomes 12.5 ms, where an engine makes
    1,000 tokens/s: decode 20. TTFT half the profile's: prefill 5."""
    p = planner()
    p.observe(db.Interval(18_000, 1000, 200, 0.3, 0.04, 5.0, 10))
    assert (p.p_correction, p.d_correction) == (pytest.approx(3.0), pytest.approx(2.0))
    assert p.plan() == (10, 20)
    p.observe(db.Interval(18_000, 1000, 200, 0.05, 0.02, 5.0, 10))
    assert p.plan() == (5, 10)
    off = planner(correction=False)
    off.observe(db.Interval(18_000, 1000, 200, 0.05, 0.04, 5.0, 10))
    assert off.plan() == (10, 10)


def test_an_interval_without_traffic_is_skipped_and_the_floor_is_min_endpoint():
    p = planner(min_endpoint=2)
    assert not p.observe(db.Interval(0, math.nan, math.nan, math.nan, math.nan, math.nan, 1))
    assert p.plan() == (2, 2)
    p.observe(db.Interval(18, 1000, 200, 0.1, 0.02, 5.0, 1))      # 0.1 req/s: a worker's sliver
    assert p.plan() == (2, 2)


def test_over_the_budget_prefill_is_scaled_down_in_proportion_and_decode_gets_the_rest():
    """(10, 20) over 16 GPUs: scale 16/30, prefill floor(5.33) = 5, decode 16 - 5 = 11; with
    2-GPU engines over 16 GPUs: scale 16/60, prefill max(1, floor(2.67)) = 2, decode 6; a budget
    below one engine per pool: nothing."""
    cfg = db.PlannerConfig(ttft_s=1, itl_s=0.025, max_gpu_budget=16)
    assert db.within_budget(10, 20, cfg) == (5, 11)
    assert db.within_budget(4, 4, cfg) == (4, 4)
    two = db.PlannerConfig(ttft_s=1, itl_s=0.025, max_gpu_budget=16, gpus_per_engine=2)
    assert db.within_budget(10, 20, two) == (2, 6)
    assert db.within_budget(3, 3, db.PlannerConfig(ttft_s=1, itl_s=0.025, max_gpu_budget=1)) == (0, 0)


def test_the_kalman_planner_plans_ahead_of_a_rising_load():
    """Requests rising 1,800 an interval: the constant predictor plans for the last interval,
    the Kalman one for about the next."""
    const, kalman = planner(), planner(predictor="kalman")
    for k in range(20):
        for p in (const, kalman):
            p.observe(db.Interval(18_000 + 1_800 * k, 1000, 200, 0.1, 0.02, 5.0, 10))
    # last: 52,200 requests = 290 req/s -> 29 prefill; next: 54,000 = 300 req/s -> 30 (31 when
    # the filter's estimate is a hair above it)
    assert const.plan()[0] == 29
    assert kalman.requests.predict() == pytest.approx(54_000, rel=0.01)
    assert kalman.plan()[0] in (30, 31)
    with pytest.raises(ValueError, match="unknown predictor"):
        planner(predictor="arima")


# -- the load-based planner ---------------------------------------------------------------------------
def test_a_fit_inverted_at_the_slo_gives_the_load_a_worker_carries():
    f = db.Fit(window=50)
    for x in range(0, 1000, 100):
        f.add(x, 0.1 + 0.001 * x)                    # TTFT 0.1 s + 1 ms per queued token
    assert f.at_target(0.5) == pytest.approx(400)
    flat = db.Fit(window=50)
    for x, y in ((100, 0.2), (300, 0.2), (200, 0.9)):   # no upward slope: the least load that met it
        flat.add(x, y)
    assert flat.at_target(0.5) == 100
    assert db.Fit(window=50).at_target(0.5) is None


def test_a_pool_steps_by_one_when_every_worker_is_past_its_carry():
    assert db.load_step([500, 600], 400, 0.8) == 1
    assert db.load_step([500, 300], 400, 0.8) == 0      # not every worker over
    # shrink: every worker under 400 x (2 - 1) / 2 x 0.8 = 160
    assert db.load_step([100, 200], 400, 0.8) == 0
    assert db.load_step([100, 150], 400, 0.8) == -1
    assert db.load_step([10], 400, 0.8) == 0            # one worker never goes
    assert db.load_step([10, 10], None, 0.8) == 0


def test_the_load_planner_grows_either_pool_and_shrinks_only_when_both_would():
    cfg = db.PlannerConfig(ttft_s=0.5, itl_s=0.025, max_gpu_budget=-1)
    lp = db.LoadPlanner(cfg)
    for x in range(0, 1000, 100):
        lp.observe_prefill(x, 0, 0.1 + 0.001 * x)      # carries 400 tokens within 0.5 s
        lp.observe_decode(x, 0.005 + 0.0001 * x)        # carries 200 blocks within 25 ms
    assert lp.plan(2, 2, [500, 600], 0, [10, 10]) == (3, 2)        # prefill over; decode low but alone
    assert lp.plan(2, 2, [10, 10], 0, [10, 10]) == (1, 1)          # both low: both shrink
    assert lp.plan(2, 2, [10, 10], 0, [300, 300]) == (2, 3)
    # the mean ISL counts in a worker's load: 100 queued + 350 ISL is over 400
    assert lp.plan(2, 2, [100, 100], 350, [100, 100]) == (3, 2)
    assert db.LoadPlanner(cfg).plan(2, 2, [5000, 5000], 0, [10, 10]) == (2, 2)   # no fit yet: nothing


# -- the elastic simulator ---------------------------------------------------------------------------
class Scripted(ElasticSimulator):
    """Changes at given times (t, action, count)."""

    def __init__(self, script, num_prefill=1, num_decode=1, **kw):
        c = SimCluster(num_prefill=num_prefill, num_decode=num_decode, prefill_cost=cost(), decode_cost=cost(),
                       engine=engine())
        super().__init__(c, interval_s=1.0, **kw)
        self.script = list(script)

    def tick(self):
        while self.script and self.script[0][0] <= self.now + 1e-9:
            _, action, count = self.script.pop(0)
            self.change(action, count, "scripted")


def steady(rate: float, seconds: float, prompt: int = 100, output: int = 20, seed: int = 0) -> list[SimRequest]:
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append(SimRequest.synthetic(t, prompt, output, len(out)))


def test_an_added_worker_holds_its_gpu_from_the_ask_and_serves_after_its_start_up():
    sim = Scripted([(10, ADD_PREFILL, 1), (30, REMOVE_PREFILL, 1)], startup_s=15.0)
    results, end = sim.run(steady(5, 60))
    assert all(r.success for r in results)
    assert sim.sizes[0] == (0.0, 1, 1, 2)                     # (t, prefill, decode, workers held)
    joined = [t for t, p, d, _ in sim.sizes if p == 2]
    assert joined and joined[0] == pytest.approx(25.0)        # asked at 10, started 15 s later
    # Two workers all along, the third from 10 s until it drained out after 30 s (its idle
    # drain ends at once: a prefill step of this load is a few ms).
    left = [t for t, p, d, held in sim.sizes if held == 2 and t >= 30]
    assert left and left[0] == pytest.approx(30.0, abs=0.1)
    assert sim.gpu_hours() == pytest.approx((2 * end + (left[0] - 10.0)) / 3600)
    assert sim.added == 1 and sim.removed == 1
    assert [d["undoes"] for d in sim.decisions] == [None, 10.0] and sim.undone == 1
    assert_pools_clean(sim)


def test_a_change_undoes_an_earlier_one_only_against_it_and_within_the_window():
    """2P+2D. 10 s: a decode worker to prefill; 20 s: a decode worker added (against the move
    at 10 s); 400 s: a prefill worker to decode (the earlier ones are past the window); 500 s:
    a decode worker added (the same way as 400 s); 600 s: a decode worker removed (against both,
    the latest named)."""
    sim = Scripted([(10, TO_PREFILL, 1), (20, ADD_DECODE, 1), (400, TO_DECODE, 1), (500, ADD_DECODE, 1),
                    (600, REMOVE_DECODE, 1)], num_prefill=2, num_decode=2)
    results, _ = sim.run(steady(2, 800))
    assert all(r.success for r in results)
    assert [(d["t"], d["action"], d["undoes"]) for d in sim.decisions] == [
        (10, TO_PREFILL, None), (20, ADD_DECODE, 10), (400, TO_DECODE, None), (500, ADD_DECODE, None),
        (600, REMOVE_DECODE, 500)]
    assert sim.undone == 2
    assert (len(sim.pools["prefill"]), len(sim.pools["decode"])) == (2, 3)
    assert sim.role_changes == 2 and sim.added == 2 and sim.removed == 1
    assert_pools_clean(sim)


def test_the_throughput_planner_follows_a_rising_load_and_pays_for_its_gpus():
    """A load that triples over ten minutes, 1,000 -> 100 tokens on the test engine (prefill
    10 ms + 0.1 ms a token; decode 5 ms + 1 ms a row): the planner adds workers as it rises,
    each holding its GPU from the ask; every request is served and every block comes back."""
    rng, t, reqs = random.Random(1), 0.0, []
    while t < 600:
        t += rng.expovariate(20 + 40 * t / 600)
        reqs.append(SimRequest.synthetic(t, 1000, 100, len(reqs)))
    c = SimCluster(num_prefill=1, num_decode=1, prefill_cost=cost(), decode_cost=cost(), engine=engine(),
                   max_pending=100_000)
    cfg = db.PlannerConfig(ttft_s=1.0, itl_s=0.05, max_gpu_budget=16, interval_s=60.0)
    sim = PlannedSimulator(c, cfg, db.THROUGHPUT, startup_s=20.0, record_itl=False)
    results, end = sim.run(reqs)
    assert all(r.success for r in results)
    grew = [d for d in sim.decisions if d["action"] in (ADD_PREFILL, ADD_DECODE)]
    assert grew and all(d["t"] % 60 == 0 and d["t"] >= 60 for d in grew)      # on its interval only
    assert max(p + d for _, p, d, _ in sim.sizes) >= 6
    # each decision planned on the interval before it: the first, at 60 s, for ~20-24 req/s
    first = {d["action"]: d["count"] for d in sim.decisions if d["t"] == 60}
    assert first[ADD_PREFILL] >= 1 and first[ADD_DECODE] >= 1
    assert 2 * end / 3600 < sim.gpu_hours() <= 16 * end / 3600
    assert_pools_clean(sim)
