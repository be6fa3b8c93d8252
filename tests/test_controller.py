"""The pool-ratio controller's policy on synthetic signals: each rule, the budget, the cooldown,
and no flip that the next decision would undo."""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from cluster.controller import (ADD_DECODE, ADD_PREFILL, NONE, TO_DECODE, TO_PREFILL, ControllerConfig, Signals,
                                decide, loads)

CFG = ControllerConfig(max_workers=4, cooldown_s=30)


def signals(num_prefill=2, num_decode=2, rate=1.0, prompt=1000, output=100, **kw) -> Signals:
    # One prefill worker clears 1,000 prompt tokens/s, one decode worker 100 output tokens/s: at
    # 1 req/s each pool needs exactly one worker.
    return Signals(now=100.0, num_prefill=num_prefill, num_decode=num_decode, arrival_rate=rate,
                   mean_prompt_tokens=prompt, mean_output_tokens=output, prefill_tokens_per_s=1000.0,
                   decode_tokens_per_s=100.0, **kw)


def test_loads_are_demand_over_capacity():
    assert loads(signals(rate=1.0)) == pytest.approx((0.5, 0.5))
    assert loads(signals(rate=1.0, queued_prefill_tokens=1000)) == pytest.approx((1.0, 0.5))


def test_prefill_heavy_moves_a_decode_worker_over_at_the_budget():
    d = decide(signals(rate=1.0, prompt=3000, output=50), CFG)
    assert d.action == TO_PREFILL and "prefill short" in d.reason


def test_decode_heavy_moves_a_prefill_worker_over_at_the_budget():
    d = decide(signals(rate=1.0, prompt=300, output=300), CFG)
    assert d.action == TO_DECODE


def test_under_the_budget_a_short_pool_grows_instead():
    cfg = dataclasses.replace(CFG, max_workers=6)
    assert decide(signals(rate=1.0, prompt=3000, output=50), cfg).action == ADD_PREFILL
    assert decide(signals(rate=1.0, prompt=300, output=300), cfg).action == ADD_DECODE


def test_never_below_one_worker_per_pool():
    d = decide(signals(num_prefill=3, num_decode=1, rate=1.0, prompt=300, output=300), CFG)
    assert d.action == TO_DECODE                              # prefill (3) can spare one
    d = decide(signals(num_prefill=1, num_decode=3, rate=1.0, prompt=3000, output=10), CFG)
    assert d.action == TO_PREFILL
    # Both needed more than they have, nothing to spare: no move, no growth past the budget.
    d = decide(signals(num_prefill=1, num_decode=1, rate=1.0, prompt=3000, output=300),
               dataclasses.replace(CFG, max_workers=2))
    assert d.action == NONE and "budget" in d.reason


def test_a_missed_slo_marks_its_pool_short():
    d = decide(signals(rate=0.5, ttft_attainment=0.5), CFG)          # loads are low, TTFT is missed
    assert d.action == TO_PREFILL
    d = decide(signals(rate=0.5, tpot_attainment=0.5), CFG)
    assert d.action == TO_DECODE


def test_cooldown_and_draining_hold_every_change():
    s = signals(rate=1.0, prompt=3000, output=50)
    assert decide(s, CFG, last_change_at=s.now - 10).action == NONE
    assert decide(s, CFG, last_change_at=s.now - 10).reason == "cooldown"
    assert decide(s, CFG, last_change_at=s.now - 31).action == TO_PREFILL
    assert decide(dataclasses.replace(s, draining=1), CFG).action == NONE


def test_balanced_load_changes_nothing():
    for rate in (0.2, 0.5, 1.0, 1.5):
        assert decide(signals(rate=rate), CFG).action == NONE


@pytest.mark.parametrize("rate,prompt,output", list(itertools.product((0.3, 0.8, 1.2, 2.0), (300, 1000, 3000),
                                                                        (30, 100, 300))))
def test_no_flip_is_undone_by_the_next_decision(rate, prompt, output):
    """Hysteresis: after any move, the same signals (now with the new pool sizes) never ask for
    the move back; with a fixed load, the pools settle."""
    s = signals(rate=rate, prompt=prompt, output=output)
    seen = []
    for _ in range(6):
        d = decide(s, CFG)
        seen.append(d.action)
        if d.action == TO_PREFILL:
            s = dataclasses.replace(s, num_prefill=s.num_prefill + 1, num_decode=s.num_decode - 1)
        elif d.action == TO_DECODE:
            s = dataclasses.replace(s, num_prefill=s.num_prefill - 1, num_decode=s.num_decode + 1)
        else:
            break
    assert not ({TO_PREFILL, TO_DECODE} <= set(seen)), seen
    assert seen[-1] == NONE
    assert s.num_prefill >= 1 and s.num_decode >= 1 and s.num_prefill + s.num_decode == 4


# -- in the simulator: the pools follow the load --------------------------------------------------
def test_simulated_pools_follow_a_phase_shift():
    """2 prefill + 6 decode H100 workers (Llama-3-8B roofline): a prefill-heavy phase moves
    workers to prefill, the decode-heavy phase after it moves them back; nothing is lost and
    every block comes back."""
    import random

    from cluster.sim_control import ControlledSimulator, SimControl
    from cluster.simulate import SimCluster, SimRequest
    from tests.test_simulator import assert_pools_clean, engine
    from workers.cost_model import roofline

    cost = roofline("llama-3-8b", "h100-sxm", 1)
    rng = random.Random(0)
    requests, t = [], 0.0
    for until, rate, prompt, output in ((200.0, 30.0, 4000, 16), (400.0, 30.0, 200, 2000)):
        while t < until:
            t += rng.expovariate(rate)
            requests.append(SimRequest.synthetic(t, rng.randint(prompt // 2, prompt * 3 // 2),
                                                 rng.randint(output // 2, output * 3 // 2), len(requests)))
    cluster = SimCluster(num_prefill=2, num_decode=6, prefill_cost=cost, decode_cost=cost, engine=engine(),
                         max_pending=4096)
    sim = ControlledSimulator(cluster, SimControl(ControllerConfig(8, cooldown_s=20), interval_s=10, window_s=30,
                                                  slo_ttft_s=1.0, slo_tpot_s=0.05), record_itl=False)
    results, _ = sim.run(requests)
    assert all(r.success for r in results)
    moves = [(d["t"], d["action"]) for d in sim.decisions]
    assert any(a == TO_PREFILL for t, a in moves if t < 200), moves
    assert any(a == TO_DECODE for t, a in moves if t > 200), moves
    sizes = [(d["prefill"], d["decode"]) for d in sim.decisions]
    assert all(p >= 1 and d >= 1 and p + d <= 8 for p, d in sizes)
    assert sim.role_changes == len(moves)
    assert not sim.draining
    assert_pools_clean(sim)


def test_simulated_stationary_load_changes_nothing():
    """Ten simulated minutes of one steady load on a ratio that serves it: no decision at all."""
    import random

    from cluster.sim_control import ControlledSimulator, SimControl
    from cluster.simulate import SimCluster, SimRequest
    from tests.test_simulator import engine
    from workers.cost_model import roofline

    cost = roofline("llama-3-8b", "h100-sxm", 1)
    rng = random.Random(1)
    requests, t = [], 0.0
    while t < 600:
        t += rng.expovariate(8.0)
        requests.append(SimRequest.synthetic(t, rng.randint(500, 1500), rng.randint(100, 300), len(requests)))
    cluster = SimCluster(num_prefill=2, num_decode=2, prefill_cost=cost, decode_cost=cost, engine=engine())
    sim = ControlledSimulator(cluster, SimControl(ControllerConfig(4), interval_s=10, slo_ttft_s=1.0, slo_tpot_s=0.05),
                              record_itl=False)
    results, _ = sim.run(requests)
    assert all(r.success for r in results)
    assert sim.decisions == [] and sim.role_changes == 0
