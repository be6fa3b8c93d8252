"""The pool-ratio controller's policy on synthetic signals: each rule, the count of a change, the
budget, the cooldown, hysteresis, and no flip that the next decision would undo; then, in the
simulator, pools that follow a phase shift and stay put under a steady load with realistic
noise (bursty arrivals, real length mixes)."""
from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from cluster.run.forecast import Forecast, Holt, LongScale, floor_sizes, interval_summary
from cluster.run.controller import (ADD_DECODE, ADD_PREFILL, CODES, NONE, REMOVE_DECODE, REMOVE_PREFILL, TO_DECODE,
                                TO_PREFILL, ControllerConfig, Decision, Signals, decide, loads, mixed_tpot, needs,
                                observe, prefill_rate, window_start)

CFG = ControllerConfig(max_workers=4, cooldown_s=30)
MOVES = {TO_PREFILL: (1, -1), TO_DECODE: (-1, 1), ADD_PREFILL: (1, 0), ADD_DECODE: (0, 1), REMOVE_PREFILL: (-1, 0),
         REMOVE_DECODE: (0, -1), NONE: (0, 0)}


def signals(num_prefill=2, num_decode=2, rate=1.0, prompt=1000, output=100, **kw) -> Signals:
    # One prefill worker clears 1,000 prompt tokens/s, one decode worker 100 output tokens/s: at
    # 1 req/s each pool needs exactly one worker's worth.
    return Signals(now=kw.pop("now", 1000.0), num_prefill=num_prefill, num_decode=num_decode, arrival_rate=rate,
                   mean_prompt_tokens=prompt, mean_output_tokens=output, prefill_tokens_per_s=1000.0,
                   decode_tokens_per_s=100.0, **kw)


def apply(s: Signals, d: Decision) -> Signals:
    dp, dd = MOVES[d.action]
    return dataclasses.replace(s, num_prefill=s.num_prefill + dp * d.count, num_decode=s.num_decode + dd * d.count)


def test_loads_are_demand_over_capacity_with_backlogs_to_clear():
    assert loads(signals(rate=1.0)) == pytest.approx((0.5, 0.5))
    # 30,000 queued prompt tokens to clear within backlog_s (30 s): 1,000 tokens/s more.
    assert loads(signals(rate=1.0, queued_prefill_tokens=30_000)) == pytest.approx((1.0, 0.5))
    # 30 requests waiting for decode room, 100 output tokens each, within 30 s: 100 tokens/s more.
    assert loads(signals(rate=1.0, waiting_handoffs=30)) == pytest.approx((0.5, 1.0))
    assert needs(signals(rate=3.0, prompt=2000, output=50)) == pytest.approx((6.0, 1.5))
    # Decode's need is at least the KV its sequences hold: 2 workers 90 % full hold 1.8 workers'
    # worth, whatever the arrivals ask (0.5 here); backlog comes on top.
    assert needs(signals(rate=1.0, decode_kv_usage=0.9))[1] == pytest.approx(1.8)
    assert needs(signals(rate=1.0, decode_kv_usage=0.9, waiting_handoffs=30))[1] == pytest.approx(2.8)


# -- each rule ----------------------------------------------------------------------------------
def test_prefill_heavy_moves_a_decode_worker_over_at_the_budget():
    d = decide(signals(rate=1.0, prompt=3000, output=50), CFG)
    assert (d.action, d.count, d.code) == (TO_PREFILL, 1, "prefill_short_load") and "prefill short" in d.reason


def test_decode_heavy_moves_a_prefill_worker_over_at_the_budget():
    d = decide(signals(rate=1.0, prompt=300, output=300), CFG)
    assert (d.action, d.count, d.code) == (TO_DECODE, 1, "decode_short_load")


def test_one_change_moves_as_many_workers_as_the_short_pool_needs():
    """Dynamo's sizing in one step: prefill needs 13 workers' worth; at its target load (0.65)
    that is 20 workers, so 8 of the 20 decode workers (which need one) move at once."""
    cfg = ControllerConfig(max_workers=32)
    s = signals(12, 20, rate=6.5, prompt=2000, output=100 / 6.5)
    d = decide(s, cfg)
    assert (d.action, d.count) == (TO_PREFILL, 8)
    after = apply(s, d)
    assert (after.num_prefill, after.num_decode) == (20, 12)
    assert loads(after)[0] == pytest.approx(0.65)
    assert decide(after, cfg, last_change_at=s.now - 1000, last=d).action == NONE


def test_the_donor_keeps_its_own_target():
    """Decode needs 10 workers' worth (13 at its 0.8 target, 9 more than its 4); prefill needs
    13 and gives only down to its 0.65 target (20 of 28): 8 move, not 9."""
    s = signals(28, 4, rate=6.5, prompt=2000, output=1000 / 6.5)
    d = decide(s, ControllerConfig(max_workers=32))
    assert (d.action, d.count) == (TO_DECODE, 8)
    assert loads(apply(s, d))[0] <= 0.65 + 1e-9


def test_past_both_targets_the_donor_gives_only_to_even_the_pools_out_and_stays_under_80_percent():
    """Decode is short (load 1.25); prefill (11 workers' worth on 16, 0.69) is past its target
    already: it gives as long as it stays under 0.8 and no further past its target than decode
    would be past its own: 2 workers (11/14 = 0.79), not a third (11/13 = 0.85)."""
    s = signals(16, 16, rate=5.5, prompt=2000, output=2000 / 5.5)
    d = decide(s, ControllerConfig(max_workers=32))
    assert (d.action, d.count) == (TO_DECODE, 2)
    p, dl = loads(apply(s, d))
    assert p < 0.8 and p / 0.65 <= dl / 0.8


def test_a_decode_pool_full_of_kv_gives_no_worker_and_grows_when_past_capacity():
    """Prefill is short (3 workers' worth on 2), decode's arrivals need one worker of its 2 but
    its KV is 70 % full: one survivor would hold 1.4 workers' worth, so decode gives nothing;
    at 95 % with sequences waiting for room, decode is the short pool."""
    d = decide(signals(rate=1.0, prompt=3000, output=50, decode_kv_usage=0.7), CFG)
    assert (d.action, d.code) == (NONE, "no_spare"), d
    d = decide(signals(rate=1.0, prompt=500, output=50, decode_kv_usage=0.95, waiting_handoffs=10), CFG)
    assert (d.action, d.code) == (TO_DECODE, "decode_short_load"), d


def test_under_the_budget_a_short_pool_grows_instead_within_the_budget():
    cfg = dataclasses.replace(CFG, max_workers=6)
    d = decide(signals(rate=1.0, prompt=3000, output=50), cfg)       # needs 5 prefill (3 / 0.65): 3 more,
    assert (d.action, d.count) == (ADD_PREFILL, 2)                    # but the budget leaves 2
    d = decide(signals(rate=1.0, prompt=300, output=300), cfg)
    assert (d.action, d.count) == (ADD_DECODE, 2)
    d = decide(signals(rate=1.0, prompt=2100, output=50), dataclasses.replace(CFG, max_workers=10))
    assert (d.action, d.count) == (ADD_PREFILL, 2)                    # 2.1 / 0.65: 4 workers, 2 more


def test_never_below_one_worker_per_pool():
    d = decide(signals(num_prefill=3, num_decode=1, rate=1.0, prompt=300, output=300), CFG)
    assert d.action == TO_DECODE                              # prefill (3) can spare one
    d = decide(signals(num_prefill=1, num_decode=3, rate=1.0, prompt=3000, output=10), CFG)
    assert (d.action, d.count) == (TO_PREFILL, 2)             # decode keeps one
    # Both needed more than they have, nothing to spare: no move, no growth past the budget.
    d = decide(signals(num_prefill=1, num_decode=1, rate=1.0, prompt=3000, output=300),
               dataclasses.replace(CFG, max_workers=2))
    assert d.action == NONE and d.code == "both_short" and "budget" in d.reason


def test_a_missed_slo_marks_its_pool_short_when_it_is_busy():
    cfg = ControllerConfig(max_workers=8)
    s = signals(4, 4, rate=3.0, prompt=1000, output=50)           # loads 0.75 / 0.375
    d = decide(dataclasses.replace(s, ttft_attainment=0.5), cfg)
    assert (d.action, d.count, d.code) == (TO_PREFILL, 1, "prefill_short_slo")
    s = signals(4, 4, rate=3.0, prompt=500, output=100)           # loads 0.375 / 0.75
    d = decide(dataclasses.replace(s, tpot_attainment=0.5), cfg)
    assert (d.action, d.count, d.code) == (TO_DECODE, 1, "decode_short_slo")


def test_a_missed_slo_at_a_low_load_or_with_a_backlog_or_just_after_a_change_is_not_acted_on():
    """The first run's later moves came from TTFT misses at prefill loads of 0.25-0.44: the code
    trace's bursts (hundreds of arrivals in one second), which a worker more does not stop."""
    cfg = ControllerConfig(max_workers=8)
    d = decide(signals(4, 4, rate=2.2, ttft_attainment=0.5), cfg)            # load 0.55, under 0.9 x 0.65
    assert (d.action, d.code) == (NONE, "slo_not_capacity")
    busy = signals(4, 4, rate=3.0, prompt=1000, output=50, ttft_attainment=0.5)
    # A backlog (23 % of the need here) explains the misses; it counts in the load already.
    d = decide(dataclasses.replace(busy, queued_prefill_tokens=27_000), cfg)
    assert (d.action, d.code) == (NONE, "slo_not_capacity")
    # Just after a change (past the cooldown, within slo_hold_s) the pools have not settled.
    held = dataclasses.replace(cfg, slo_hold_s=60)
    assert decide(busy, held, last_change_at=busy.now - 45).action == NONE
    assert decide(busy, held, last_change_at=busy.now - 61).action == TO_PREFILL


def test_nan_attainment_is_no_evidence():
    d = decide(signals(4, 4, rate=3.0), ControllerConfig(max_workers=8))
    assert d.action == NONE and d.code == "balanced"


def test_cooldown_and_draining_hold_every_change():
    s = signals(rate=1.0, prompt=3000, output=50)
    assert decide(s, CFG, last_change_at=s.now - 10).action == NONE
    assert decide(s, CFG, last_change_at=s.now - 10).code == "cooldown"
    assert decide(s, CFG, last_change_at=s.now - 31).action == TO_PREFILL
    d = decide(dataclasses.replace(s, draining=1), CFG)
    assert (d.action, d.code, d.count) == (NONE, "changing_roles", 0)


def test_balanced_load_changes_nothing():
    for rate in (0.2, 0.5, 1.0, 1.5):
        d = decide(signals(rate=rate), CFG)
        assert d.action == NONE and d.count == 0


# -- hysteresis: no undo -------------------------------------------------------------------------
def test_between_target_and_capacity_a_pool_neither_grows_nor_gives():
    cfg = ControllerConfig(max_workers=16)
    # prefill at 0.9 (past its 0.65 target, under capacity), decode at 0.9: nothing moves
    assert decide(signals(8, 8, rate=7.2, prompt=1000, output=100), cfg).action == NONE
    # decode short (1.2): prefill at 0.71 is past its target and 8 -> 7 would take it to 0.81: none
    d = decide(signals(8, 8, rate=5.7, prompt=1000, output=9.6 / 5.7 * 100), cfg)
    assert (d.action, d.code) == (NONE, "no_spare")


def test_attainment_never_undoes_attainment():
    cfg = ControllerConfig(max_workers=8)
    s = signals(4, 4, rate=3.0, prompt=1000, output=50, ttft_attainment=0.5)   # prefill short on TTFT
    back_slo = Decision(TO_DECODE, "decode short (TPOT ...)", count=1, code="decode_short_slo")
    d = decide(s, cfg, last=back_slo)
    assert (d.action, d.code) == (NONE, "no_undo")
    # a move made on the predicted loads may be corrected on attainment (once: see above) ...
    back_load = Decision(TO_DECODE, "decode short (load ...)", count=1, code="decode_short_load")
    assert decide(s, cfg, last=back_load).action == TO_PREFILL
    # ... and a load above capacity moves workers back whatever came before
    short = signals(4, 4, rate=4.4, prompt=1000, output=30)
    assert decide(short, cfg, last=back_slo).action == TO_PREFILL


@pytest.mark.parametrize("size", [4, 32])
@pytest.mark.parametrize("rate,prompt,output", list(itertools.product((0.3, 0.8, 1.2, 2.0), (300, 1000, 3000),
                                                                        (30, 100, 300))))
def test_no_flip_is_undone_by_the_next_decision(size, rate, prompt, output):
    """Hysteresis: after any move, the same signals (now with the new pool sizes) never ask for
    the move back; with a fixed load the pools settle, and stay in the budget, one worker each
    at least, the donor under 80 %."""
    scale = size / 4
    s = signals(size // 2, size // 2, rate=rate * scale, prompt=prompt, output=output)
    cfg = ControllerConfig(max_workers=size)
    seen, last = [], None
    for _ in range(8):
        d = decide(s, cfg, last_change_at=s.now - 100, last=last)
        seen.append(d.action)
        if d.action == NONE:
            break
        donor = "decode" if d.action == TO_PREFILL else "prefill"
        s, last = apply(s, d), d
        assert loads(s)[donor == "decode"] < cfg.shrink_below
        assert s.num_prefill >= 1 and s.num_decode >= 1 and s.num_prefill + s.num_decode == size
    assert not ({TO_PREFILL, TO_DECODE} <= set(seen)), seen
    assert seen[-1] == NONE and len(seen) <= 2, seen                   # one change, sized, at most


def test_steady_loads_with_noisy_attainment_settle():
    """Under fixed loads and attainments drawn at random each interval (noise, nan: too few
    judged), the moves change direction at most once (attainment may correct a move made on
    the loads, never its own correction) and stop."""
    rng = random.Random(3)
    cfg = ControllerConfig(max_workers=32)
    for trial in range(300):
        n_p = rng.randint(1, 31)
        s = signals(n_p, 32 - n_p, rate=rng.uniform(1, 12), prompt=rng.choice((500, 1000, 2000, 4000)),
                    output=rng.choice((20, 100, 300)), now=0.0)
        last, last_at, directions = None, -math.inf, []
        for step in range(60):
            s = dataclasses.replace(s, now=step * 10.0, ttft_attainment=rng.choice((math.nan, 0.5, 0.85, 0.95, 1.0)),
                                    tpot_attainment=rng.choice((math.nan, 0.5, 0.85, 0.95, 1.0)))
            d = decide(s, cfg, last_at, last)
            assert d.code in CODES and (d.count == 0) == (d.action == NONE)
            if d.action != NONE:
                assert d.action in (TO_PREFILL, TO_DECODE)
                if not directions or directions[-1] != d.action:
                    directions.append(d.action)
                s, last, last_at = apply(s, d), d, s.now
                assert s.num_prefill >= 1 and s.num_decode >= 1 and s.num_prefill + s.num_decode == 32
        assert len(directions) <= 2, (trial, directions)
        assert last_at < 45 * 10.0, (trial, last_at)                       # quiet for the last 15 intervals


# -- the budget -----------------------------------------------------------------------------------
def test_over_the_budget_sheds_what_a_pool_can_spare():
    cfg = ControllerConfig(max_workers=4)
    d = decide(signals(4, 2, rate=1.0), cfg)                          # prefill needs 1 of its 4
    assert (d.action, d.count, d.code) == (REMOVE_PREFILL, 2, "over_budget")
    d = decide(signals(2, 4, rate=1.0), cfg)
    assert (d.action, d.count) == (REMOVE_DECODE, 2)
    d = decide(signals(3, 3, rate=2.5), cfg)                          # both need all they have
    assert (d.action, d.code) == (NONE, "over_budget")


@pytest.mark.parametrize("budget", [2, 4, 8, 32])
@pytest.mark.parametrize("elastic", [False, True])
@pytest.mark.parametrize("mixed", [False, True])
def test_no_decision_ever_leaves_the_budget_or_an_empty_pool(budget, elastic, mixed):
    rng = random.Random(budget)
    cfg = ControllerConfig(max_workers=budget, min_workers=max(2, budget // 2) if elastic else None, mixed=mixed)
    for _ in range(2000):
        n_p = rng.randint(0 if mixed else 1, budget + 2)
        n_d = rng.randint(1, budget + 3 - n_p) if budget + 3 - n_p >= 1 else 1
        s = signals(n_p, n_d, rate=rng.uniform(0, 3 * budget), prompt=rng.choice((100, 1000, 3000)),
                    output=rng.choice((10, 100, 500)), queued_prefill_tokens=rng.choice((0, 0, 5000, 50_000)),
                    waiting_handoffs=rng.choice((0, 0, 10, 100)),
                    ttft_attainment=rng.choice((math.nan, 0.5, 0.95)), tpot_attainment=rng.choice((math.nan, 0.5, 0.95)),
                    floor_prefill=rng.choice((0, 1, budget // 2, budget)), floor_decode=rng.choice((0, 1, budget)),
                    keep_prefill=rng.choice((0, 2, budget)), keep_decode=rng.choice((0, 1, budget // 2)),
                    prefill_grew_at=rng.choice((-math.inf, 900.0)), decode_grew_at=rng.choice((-math.inf, 900.0)),
                    mixed_tpot=rng.choice((math.inf, 0.2, 0.7, 1.5)),
                    prefill_shrank_at=rng.choice((-math.inf, 990.0)), decode_shrank_at=rng.choice((-math.inf, 990.0)))
        d = decide(s, cfg)
        after = apply(s, d)
        assert d.code in CODES and (d.count == 0) == (d.action == NONE), d
        # the prefill pool empties only by the mixed move, and only under a load the rest carries
        assert after.num_decode >= 1 and (after.num_prefill >= 1 or s.num_prefill == 0 or d.code == "mixed"), (s, d)
        if d.code == "mixed":
            assert mixed and after.num_prefill == 0 and sum(needs(s)) / (s.num_prefill + s.num_decode) <= 0.75
        if s.num_prefill == 0:
            continue                                 # mixed: one pool (the rules' own test above)
        total, new_total = s.num_prefill + s.num_decode, after.num_prefill + after.num_decode
        assert new_total <= max(budget, total) and (total <= budget or new_total < total or d.action == NONE), (s, d)
        if d.action in (TO_PREFILL, TO_DECODE, REMOVE_PREFILL, REMOVE_DECODE) and d.code != "mixed":
            donor = 0 if d.action in (TO_DECODE, REMOVE_PREFILL) else 1
            assert loads(after)[donor] < cfg.shrink_below, (s, d)
        if d.code == "shrink":                      # never below the minimum, a floor, or a recent growth
            assert elastic and new_total >= cfg.min_workers, (s, d)
            pool = "prefill" if d.action == REMOVE_PREFILL else "decode"
            size = after.num_prefill if pool == "prefill" else after.num_decode
            assert size >= max(getattr(s, f"floor_{pool}"), getattr(s, f"keep_{pool}"))
            assert getattr(s, f"{pool}_grew_at") <= s.now - cfg.shrink_hold_s


def test_config_keeps_its_hysteresis():
    with pytest.raises(ValueError):
        ControllerConfig(max_workers=1)
    with pytest.raises(ValueError):
        ControllerConfig(max_workers=4, prefill_target_load=0.9)       # above shrink_below
    with pytest.raises(ValueError):
        ControllerConfig(max_workers=4, shrink_below=1.0)              # not under grow_at


# -- the mixed role --------------------------------------------------------------------------------
MIXED = ControllerConfig(max_workers=4, cooldown_s=30, mixed=True)


def test_a_light_load_of_short_prompts_goes_mixed_and_long_prompts_split_it_again():
    s = signals(1, 1, rate=0.3, mixed_tpot=0.1)            # the whole load is 0.3 of the two workers
    d = decide(s, MIXED)
    assert (d.action, d.count, d.code) == (TO_DECODE, 1, "mixed"), d
    mixed = apply(s, d)
    assert (mixed.num_prefill, mixed.num_decode) == (0, 2)
    assert (decide(mixed, MIXED).action, decide(mixed, MIXED).code) == (NONE, "balanced")
    # Long prompts: the TPOT predicted mixed is 1.5x the target. One prefill
    # worker carries the prompts (0.3 of one at 1 req/s x 1,000 tokens / 1,000 per s x 0.3).
    d = decide(dataclasses.replace(mixed, mixed_tpot=1.5), MIXED)
    assert (d.action, d.count, d.code) == (TO_PREFILL, 1, "split_tpot"), d
    # Prompts that need three prefill workers at their target split three of four off.
    many = signals(0, 4, rate=1.6, mixed_tpot=1.5)
    d = decide(many, MIXED)
    assert (d.action, d.count) == (TO_PREFILL, 3), d


def test_between_its_two_stalls_neither_shape_changes():
    for stall in (0.8, 0.95):                           # above mixed_ok, not past split_at
        assert decide(signals(1, 1, rate=0.3, mixed_tpot=stall), MIXED).action == NONE
        assert decide(signals(0, 2, rate=0.3, mixed_tpot=stall), MIXED).action == NONE


def test_mixed_only_when_the_whole_load_fits_attainment_holds_demand_is_not_rising_and_asked_for():
    assert decide(signals(1, 1, rate=0.3, mixed_tpot=0.1), CFG).action == NONE                # not asked for
    assert decide(signals(1, 1, rate=0.3), MIXED).action == NONE                # not priced (inf stall)
    # 0.7 req/s: each pool at 0.7 of one worker; the whole load 1.4 over 2 = 0.7 <= 0.75 goes, 0.8 does not
    assert decide(signals(1, 1, rate=0.7, mixed_tpot=0.1), MIXED).code == "mixed"
    assert decide(signals(1, 1, rate=0.8, mixed_tpot=0.1), MIXED).action == NONE
    assert decide(signals(1, 1, rate=0.3, mixed_tpot=0.1, tpot_attainment=0.5), MIXED).action == NONE
    s = signals(1, 1, rate=0.3, mixed_tpot=0.1)      # demand rising: the last change grew the prefill pool,
    grew = Decision(ADD_PREFILL, "floor", count=1, code="forecast_floor")
    assert decide(s, MIXED, last_change_at=s.now - 200, last=grew).action == NONE
    assert decide(dataclasses.replace(s, floor_prefill=2), MIXED).action == NONE          # or the forecast wants more
    assert decide(dataclasses.replace(s, floor_prefill=1), MIXED, last_change_at=s.now - 400, last=grew).code == "mixed"
    shrank = Decision(REMOVE_DECODE, "shrink", count=1, code="shrink")
    assert decide(s, MIXED, last_change_at=s.now - 200, last=shrank).code == "mixed"
    # mixed workers split at a whole need of 0.7 workers' worth: 0.6 now is not a fifth under it; under 0.76, it is
    assert decide(dataclasses.replace(s, split_need=0.7), MIXED).action == NONE
    assert decide(dataclasses.replace(s, split_need=0.76), MIXED).code == "mixed"


def test_mixed_attainment_short_under_load_splits_and_at_low_load_does_not():
    busy = signals(0, 2, rate=0.7, mixed_tpot=0.3, tpot_attainment=0.6)     # mixed load 0.7 >= 0.9 x 0.75
    d = decide(busy, MIXED)
    assert (d.action, d.code) == (TO_PREFILL, "split_slo"), d
    idle = signals(0, 2, rate=0.2, mixed_tpot=0.3, tpot_attainment=0.6)
    assert decide(idle, MIXED).code == "slo_not_capacity"
    assert decide(busy, MIXED, last_change_at=busy.now - 31).action == TO_PREFILL
    assert decide(busy, MIXED, last_change_at=busy.now - 29).code == "cooldown"


def test_mixed_workers_grow_shrink_and_keep_the_floor_as_one_pool():
    cfg = ControllerConfig(max_workers=8, cooldown_s=30, min_workers=2, mixed=True, shrink_hold_s=300)
    d = decide(signals(0, 2, rate=1.0, mixed_tpot=0.2), cfg)                 # mixed load 1.0 > 0.85
    # the whole need is 2 workers' worth; at the decode target (0.75 elastic: 0.85 from sized) -> 3
    assert (d.action, d.code, d.count) == (ADD_DECODE, "mixed_short", 1), d
    d = decide(signals(0, 8, rate=0.5, mixed_tpot=0.2), cfg)                 # 1.0 over 8: a quarter leave
    assert (d.action, d.code, d.count) == (REMOVE_DECODE, "shrink", 2), d
    d = decide(signals(0, 8, rate=0.5, mixed_tpot=0.2, decode_grew_at=900.0), cfg)
    assert d.action == NONE                                                    # grew 100 s ago
    d = decide(signals(0, 3, rate=0.1, mixed_tpot=0.2, floor_prefill=2, floor_decode=3), cfg)
    assert (d.action, d.code, d.count) == (ADD_DECODE, "forecast_floor", 2), d
    d = decide(signals(0, 4, rate=0.1, mixed_tpot=0.2, keep_prefill=2, keep_decode=1), cfg)
    assert (d.action, d.count) == (REMOVE_DECODE, 1), d                        # keeps 3 for the recent peak


def test_mixed_tpot_is_the_decode_step_stretched_by_the_prompts_plus_a_long_stall_per_reply():
    from workers.cost_model import CostModel, LinearStepModel, Link
    step = LinearStepModel(p0=0.01, p1=1e-5, p2=0.0, d0=0.004, d1=1e-6, d2=1e-4)
    cost = CostModel(step, kv_bytes_per_token=1, kv_capacity_tokens=10**6, link=Link("test", 1e9, 1e-6))
    # 4 req/s over 2 workers, 500-token prompts at 10,000 tokens/s: the prompts take 0.1 of each
    # worker's time. 100 output tokens at 0.05 s: 2 x 100 x 0.05 = 10 rows of 500 + 50 context,
    # a decode step of 0.004 + 10 x 550e-6 + 10 x 1e-4. The long prompt, 3,000 tokens in chunks of
    # 2,048 and 952, adds (0.01 - 0.004) + 2048e-5 to one step and 0.006 + 952e-5 to the next
    # (no attention price: p2 = 0), spread over 99 tokens.
    s = dataclasses.replace(signals(1, 1, rate=4.0, prompt=500, output=100, long_prompt_tokens=3000),
                            prefill_tokens_per_s=10_000.0)
    decode = 0.004 + 10 * 550e-6 + 10 * 1e-4
    want = (decode / 0.9 + (0.006 + 2048e-5 + 0.006 + 952e-5) / 99) / 0.05
    assert mixed_tpot(cost, s, 0.05, 2048) == pytest.approx(want)
    assert mixed_tpot(cost, dataclasses.replace(s, arrival_rate=40.0), 0.05, 2048) == math.inf   # prompts fill it
    short = dataclasses.replace(s, short_output_tokens=10.0)      # a short reply's 9 tokens take the stall
    assert mixed_tpot(cost, short, 0.05, 2048) == pytest.approx((decode / 0.9 + (0.006 + 2048e-5 + 0.006 + 952e-5) / 9)
                                                                / 0.05)


def test_a_mixed_pool_short_of_workers_grows_and_splits_only_where_growing_would_not_do():
    """The mixed TPOT is priced at the size the pool would grow to: short prompts at 1.15 of two
    mixed workers' capacity predict a TPOT past the target on two (1.15) but not on the three
    that carry it at the decode target (0.78), so the pool grows; at a budget of two it splits."""
    from cluster.run.controller import mixed_size
    from workers.cost_model import CostModel, LinearStepModel, Link
    step = LinearStepModel(p0=0.01, p1=1e-5, p2=0.0, d0=0.004, d1=1e-6, d2=1e-4)
    cost = CostModel(step, kv_bytes_per_token=1, kv_capacity_tokens=10**6, link=Link("test", 1e9, 1e-6))
    # 100-token prompts, 100-token replies, 50 ms TPOT: a decode step of n rows at 150 tokens of
    # context takes 0.004 + n x 2.5e-4 s, so 184 rows fit the target, 3,680 tokens/s; prompts
    # go 20 to a 2,048-token step (0.01 + 2,000e-5 s), 66,667 tokens/s. At 80 req/s the whole
    # need is 80 x (100 / 3,680 + 100 / 66,667) = 2.29 workers: 1.15 on two, 3 at 0.85 each.
    s = dataclasses.replace(signals(0, 2, rate=80.0, prompt=100, output=100, long_prompt_tokens=100),
                            prefill_tokens_per_s=cost.prefill_tokens_per_s(100, 2048),
                            decode_tokens_per_s=cost.decode_tokens_per_s(150, 0.05, 256))
    assert (s.prefill_tokens_per_s, s.decode_tokens_per_s) == pytest.approx((66_666.67, 3_680.0))
    assert sum(needs(s)) == pytest.approx(2.294, abs=1e-3)
    elastic = ControllerConfig.sized(8, 30, min_workers=2, mixed=True)
    assert mixed_size(s, elastic) == 3
    # Two workers: 200 rows (80 / 2 x 100 x 0.05), a 0.054 s step, prompts 0.06 of the time;
    # three: 134 rows, 0.0375 s, 0.04. The 100-token prompt's one chunk adds 0.006 + 0.001 to
    # a step, spread over 99 tokens.
    stall = (0.006 + 0.001) / 99
    assert mixed_tpot(cost, s, 0.05, 2048) == pytest.approx((0.054 / 0.94 + stall) / 0.05)               # 1.15
    assert mixed_tpot(cost, s, 0.05, 2048, 3) == pytest.approx((0.0375 / 0.96 + stall) / 0.05)           # 0.78
    d = decide(dataclasses.replace(s, mixed_tpot=mixed_tpot(cost, s, 0.05, 2048, mixed_size(s, elastic))), elastic)
    assert (d.action, d.code, d.count) == (ADD_DECODE, "mixed_short", 1), d
    at_budget = ControllerConfig.sized(2, 30, min_workers=2, mixed=True)
    assert mixed_size(s, at_budget) == 2
    d = decide(dataclasses.replace(s, mixed_tpot=mixed_tpot(cost, s, 0.05, 2048, mixed_size(s, at_budget))), at_budget)
    assert (d.action, d.code, d.count) == (TO_PREFILL, "split_tpot", 1), d
    # over the budget (it went down), the price stays at the workers there are
    assert mixed_size(dataclasses.replace(s, num_decode=4), at_budget) == 4


def test_observe_reads_the_90th_percentile_prompt():
    from router.slo import RequestLog
    log = RequestLog(60.0, clock=lambda: 100.0)
    for n in range(1, 101):
        log.arrivals.append((90.0, n * 10, 50))
    o = observe(log, 100.0, 10.0, 30.0)
    assert o.mean_prompt_tokens == pytest.approx(505.0)
    assert o.short_output_tokens == 50                       # every request asks 50 (none finished: all used)
    assert o.long_prompt_tokens == 910                       # the 91st of 100 sorted, 0-based 90


def test_prefill_capacity_prices_the_lengths_as_they_come_not_their_mean():
    """Half the prompts 100 tokens, half 4,000: one worker's capacity is their tokens over their
    time, each length in steps full of it (budget 8,192: 81 of 100 tokens a step, 2 of 4,000),
    by hand from the step model's coefficients; the mean's rate (2,050 tokens) overstates it."""
    from workers.cost_model import CostModel, LinearStepModel, Link
    p0, p1, p2 = 0.01, 5e-5, 2e-8
    cost = CostModel(LinearStepModel(p0=p0, p1=p1, p2=p2, d0=0.004, d1=1e-6, d2=1e-4), kv_bytes_per_token=1,
                     kv_capacity_tokens=10**6, link=Link("test", 1e9, 1e-6))

    def by_hand(n: int) -> float:                    # tokens per second in steps of k prompts of n
        k = 8192 // n
        return k * n / (p0 + p1 * k * n + p2 * k * n * n)
    want = 4100 / (100 / by_hand(100) + 4000 / by_hand(4000))
    rate = prefill_rate(cost, (100,) * 10 + (4000,) * 10, 2050, 8192)
    assert rate == pytest.approx(want)
    assert rate < 0.8 * by_hand(2050)
    assert prefill_rate(cost, (), 2050, 8192) == pytest.approx(by_hand(2050))     # no lengths: the mean's
    from router.slo import RequestLog                                              # observe gives the quantiles
    log = RequestLog(60.0, clock=lambda: 100.0)
    for n in (100, 4000) * 50:
        log.arrivals.append((90.0, n, 50))
    assert sorted(observe(log, 100.0, 10.0, 30.0).prompt_quantiles) == [100] * 10 + [4000] * 10


def test_the_decode_context_is_what_the_engines_decode_steps_carry_not_the_means(monkeypatch):
    """Prompts of 100 tokens, half the replies 10 tokens and half 1,000: the engine's scheduler,
    stepping a decode worker of the simulator one step at a time, carries rows at a mean context
    (the sum of its decode steps' contexts over their rows, in the run's steady middle) of about
    what `decode_context` computes from the arrivals, 595 tokens; the means' prompt plus half
    the mean reply (353) is a long reply's context early in its life, not the batch's. A decode
    worker's capacity priced at the means overstates what it serves at the TPOT target."""
    import cluster.capacity.simulate as S
    from cluster.run.controller import decode_context
    from router.slo import RequestLog
    from workers.config import CacheConfig, EngineConfig, SchedulerConfig
    from workers.cost_model import BatchShape, CostModel, LinearStepModel, Link
    rng = random.Random(7)
    step = LinearStepModel(p0=0.002, p1=1e-5, p2=0.0, d0=0.005, d1=1e-7, d2=1e-4)
    cost = CostModel(step, kv_bytes_per_token=1, kv_capacity_tokens=10**7, link=Link("test", 1e9, 1e-6))
    rows, t = [], 0.0
    for _ in range(1200):
        t += rng.expovariate(4.0)
        rows.append((t, 100, rng.choice((10, 1000))))
    requests = [S.SimRequest(t, [i % 50 + 1, 7] + [0] * (p - 2), o) for i, (t, p, o) in enumerate(rows)]
    carried = [0, 0]                                     # context, rows of the decode steps in the steady middle

    class Carried:
        """The step model, adding up the decode steps' shapes in the run's steady middle."""
        def __getattr__(self, name):
            return getattr(step, name)

        def step_s(self, shape: BatchShape) -> float:
            if shape.num_decode and not shape.num_prefill and 30.0 <= sim.now <= rows[-1][0] - 30.0:
                carried[0] += shape.decode_context
                carried[1] += shape.num_decode
            return step.step_s(shape)
    monkeypatch.setattr(S, "MAX_RUN", 1)                 # every step through the scheduler
    c = S.SimCluster(num_prefill=1, num_decode=1, prefill_cost=cost,
                     decode_cost=dataclasses.replace(cost, step=Carried()),
                     engine=EngineConfig(cache=CacheConfig(enable_prefix_caching=False),
                                         scheduler=SchedulerConfig(max_num_seqs=1024)))
    sim = S.Simulator(c)
    results, _ = sim.run(requests)
    assert all(r.success for r in results) and carried[1] > 10_000, ({r.error for r in results if not r.success}, carried)
    measured = carried[0] / carried[1]
    expected = decode_context(((p, o) for _, p, o in rows), 1.0)
    assert expected == pytest.approx(100 + (500 * 10 * 5 + 500 * 1000 * 500) / (500 * 1010), rel=0.05)
    assert measured == pytest.approx(expected, rel=0.1)
    means = 100 + sum(o for *_, o in rows) / len(rows) / 2
    assert measured > 1.4 * means
    log = RequestLog(60.0, clock=lambda: 100.0)                                    # observe gives it
    for _, p, o in rows[:100]:
        log.arrivals.append((90.0, p, o))
    assert observe(log, 100.0, 10.0, 30.0).decode_context == pytest.approx(decode_context(
        ((p, o) for _, p, o in rows[:100]), 1.0))
    assert decode_context([(100, 50)] * 4, 1.0) == 125 and decode_context([], 1.0) == 0.0   # one length: the means'
    assert cost.decode_tokens_per_s(expected, 0.05, 1024) < 0.9 * cost.decode_tokens_per_s(means, 0.05, 1024)


def test_mixed_config_keeps_its_hysteresis():
    with pytest.raises(ValueError):
        ControllerConfig(max_workers=4, mixed=True, mixed_ok=1.0, split_at=1.0)


# -- elastic size ---------------------------------------------------------------------------------
ELASTIC = ControllerConfig(max_workers=8, cooldown_s=30, min_workers=2)


def test_fixed_size_never_shrinks_what_it_has():
    d = decide(signals(4, 4, rate=0.2), CFG_8 := ControllerConfig(max_workers=8))
    assert d.action == NONE and d.code == "balanced", d
    assert CFG_8.min_workers is None


def test_a_pool_below_the_forecasts_floor_grows_to_it_ahead_of_demand():
    # loads 0.25 / 0.25 now, but the forecast wants 4 prefill workers: 2 more, within the budget
    d = decide(signals(2, 2, rate=0.5, floor_prefill=4, floor_decode=2), ELASTIC)
    assert (d.action, d.count, d.code) == (ADD_PREFILL, 2, "forecast_floor")
    d = decide(signals(2, 5, rate=0.5, floor_prefill=4), ELASTIC)       # only 1 more fits the budget of 8
    assert (d.action, d.count) == (ADD_PREFILL, 1)
    d = decide(signals(2, 6, rate=0.5, floor_prefill=4), ELASTIC)       # at the budget: nothing to add
    assert d.action != ADD_PREFILL


def test_the_floor_does_not_undo_a_recent_shrink_of_a_pool_under_its_target():
    """The code trace's two changes undone: a prefill worker removed at load 0.55, then the
    forecast's floor, recomputed at the next long interval, one above the pool: added back."""
    shrank = dict(prefill_shrank_at=990.0, floor_prefill=4)                   # 10 s ago
    d = decide(signals(3, 3, rate=1.5, **shrank), ELASTIC)                     # prefill load 0.5 < 0.65
    assert d.code != "forecast_floor", d
    d = decide(signals(3, 3, rate=2.1, **shrank), ELASTIC)                     # 0.7: past its target
    assert (d.action, d.code) == (ADD_PREFILL, "forecast_floor"), d
    d = decide(signals(3, 3, rate=1.5, floor_prefill=4, prefill_shrank_at=600.0), ELASTIC)   # 400 s ago
    assert (d.action, d.code) == (ADD_PREFILL, "forecast_floor"), d
    d = decide(signals(3, 3, rate=1.5, floor_prefill=4, decode_shrank_at=990.0), ELASTIC)    # the other pool
    assert (d.action, d.code) == (ADD_PREFILL, "forecast_floor"), d
    mixed = ControllerConfig(max_workers=8, cooldown_s=30, min_workers=2, mixed=True)
    d = decide(signals(0, 4, rate=1.0, mixed_tpot=0.3, floor_prefill=3, floor_decode=3, decode_shrank_at=990.0), mixed)
    assert d.code != "forecast_floor", d                                       # mixed load 0.5 < 0.85
    d = decide(signals(0, 4, rate=1.0, mixed_tpot=0.3, floor_prefill=3, floor_decode=3), mixed)
    assert (d.action, d.code, d.count) == (ADD_DECODE, "forecast_floor", 2), d


def test_a_pool_that_demand_no_longer_needs_shrinks_gradually_to_what_its_survivors_carry():
    """8 + 8 workers, budget 16. At 1 req/s each pool needs 1.0 worker (0.125 each); the pool
    furthest under its target (decode: 0.125 / 0.75 against prefill's 0.125 / 0.65) gives, a
    quarter of it at most at once: 2. At 5 req/s (5.0 workers' worth each) decode gives only
    what leaves the rest at its target: 5 / 7 = 0.71 <= 0.75, 5 / 6 > 0.75: 1; prefill none
    (5 / 7 > 0.65)."""
    cfg = ControllerConfig(max_workers=16, cooldown_s=30, min_workers=2)
    d = decide(signals(8, 8, rate=1.0), cfg)
    assert (d.action, d.count, d.code) == (REMOVE_DECODE, 2, "shrink"), d
    d = decide(signals(8, 8, rate=5.0), cfg)
    assert (d.action, d.count, d.code) == (REMOVE_DECODE, 1, "shrink"), d
    assert decide(signals(8, 7, rate=5.0), cfg).action == NONE
    # never below what the forecast needs over the next minutes: decode keeps 7, then 8 (prefill gives)
    d = decide(signals(8, 8, rate=1.0, keep_decode=7), cfg)
    assert (d.action, d.count) == (REMOVE_DECODE, 1), d
    d = decide(signals(8, 8, rate=1.0, keep_decode=8), cfg)
    assert (d.action, d.count) == (REMOVE_PREFILL, 2), d
    # a backlog counts in what the survivors carry
    d = decide(signals(2, 2, rate=0.5, queued_prefill_tokens=45_000), ELASTIC)    # prefill +1.5 workers' worth
    assert d.action != REMOVE_PREFILL, d


def test_no_shrink_while_arrivals_rise_and_a_pool_that_shrank_takes_a_worker_back_only_past_its_capacity():
    """The 70B rows' changes undone (bench_planner_sim.py): a prefill worker removed in a dip
    halfway up the hour's rise, added back 190-240 s later; and one removed on the fall, added
    back 30 s later for a burst at load 0.93, past the elastic headroom (0.9) but under the
    pool's capacity. While arrivals rise (`Signals.rising`) nothing shrinks; within the shrink
    hold of its shrink a pool (split or mixed) grows only past `grow_at` (1.0), elsewhere past
    the headroom."""
    cfg = ControllerConfig(max_workers=16, cooldown_s=30, min_workers=2)
    d = decide(signals(8, 8, rate=1.0), cfg)
    assert (d.action, d.code) == (REMOVE_DECODE, "shrink"), d
    d = decide(signals(8, 8, rate=1.0, rising=True), cfg)
    assert (d.action, d.code) == (NONE, "rising"), d
    mixed = ControllerConfig(max_workers=16, cooldown_s=30, min_workers=2, mixed=True)
    assert decide(signals(0, 8, rate=0.5, mixed_tpot=0.2), mixed).code == "shrink"
    assert decide(signals(0, 8, rate=0.5, mixed_tpot=0.2, rising=True), mixed).code == "rising"
    sized = ControllerConfig.sized(16, min_workers=2)              # grows past 0.9 under the budget
    for rate, shrank_at, grows in ((4.6, -math.inf, True), (4.6, 990.0, False), (5.2, 990.0, True),
                                   (4.6, 1000.0 - sized.shrink_hold_s - 1, True)):
        d = decide(signals(5, 8, rate=rate, output=10, prefill_shrank_at=shrank_at), sized)   # prefill load rate / 5
        assert (d.action == ADD_PREFILL) == grows, (rate, shrank_at, d)
    d = decide(signals(5, 8, rate=4.6, output=10, decode_shrank_at=990.0), sized)   # the other pool shrank
    assert d.action == ADD_PREFILL, d
    mixed_sized = ControllerConfig.sized(16, min_workers=2, mixed=True)     # mixed: one pool, the decode pool
    for shrank_at, grows in ((-math.inf, True), (990.0, False)):
        d = decide(signals(0, 5, rate=4.2, output=10, mixed_tpot=0.2, decode_shrank_at=shrank_at), mixed_sized)
        assert (d.action == ADD_DECODE) == grows, (shrank_at, d)                # mixed load 4.2 x 1.1 / 5 = 0.92


def test_arrivals_rise_by_the_minutes_of_a_shrink_hold_not_by_one_minutes_swing():
    """LongScale.rising: the mean rate of the last five one-minute intervals (the 300 s a
    shrink keeps) against the five before, more than a tenth up. An hour-scale rise with the
    trace's minute-to-minute swings (a dip of a third in its last minute) rises; a level with
    the same swings does not; nor anything before ten intervals are seen."""
    def fed(rates) -> LongScale:
        long = LongScale(60.0, 0.0, ahead=2, keep_s=300.0)
        arrivals = [(i * 60.0 + k / r, 100, 10) for i, r in enumerate(rates) for k in range(round(60 * r))]
        long.floors(60.0 * len(rates), arrivals, 1000.0, 100.0, 0.8, 0.8)
        return long
    swings = (1.0, 1.3, 0.8, 1.2, 0.7)
    assert fed([10 * x for x in swings] + [12 * x for x in swings]).rising()
    assert not fed([10 * x for x in swings] * 2).rising()
    assert not fed([10 * x for x in swings] + [10.5 * x for x in swings]).rising()
    assert not fed([5.0] * 4 + [20.0] * 5).rising()                 # nine intervals: not yet


def test_a_shrink_waits_for_its_pools_growth_to_age_and_keeps_the_floor_and_the_minimum():
    grew = dict(now=1000.0, prefill_grew_at=900.0)                       # prefill grew 100 s ago
    d = decide(signals(4, 4, rate=1.0, **grew), ELASTIC)
    assert d.action == REMOVE_DECODE, d                                  # decode did not grow: it may give
    d = decide(signals(4, 4, rate=1.0, decode_grew_at=800.0, **grew), ELASTIC)
    assert d.action == NONE, d
    d = decide(signals(4, 4, rate=1.0, now=1000.0, prefill_grew_at=700.0, decode_grew_at=900.0), ELASTIC)
    assert d.action == REMOVE_PREFILL, d                                 # grown 300 s ago: it may give
    d = decide(signals(4, 4, rate=1.0, floor_prefill=3, floor_decode=4), ELASTIC)
    assert (d.action, d.count) == (REMOVE_PREFILL, 1), d                # not below the floor
    small = ControllerConfig(max_workers=8, min_workers=7)
    d = decide(signals(4, 4, rate=1.0), small)
    assert (d.action, d.count) == (REMOVE_DECODE, 1), d                 # not below min_workers
    assert decide(signals(4, 3, rate=1.0), small).action == NONE


def test_elastic_below_the_budget_a_pool_grows_before_its_capacity():
    # prefill at load 0.9 (1.8 workers' worth over 2): past elastic_grow_at (0.85), under grow_at
    s = signals(2, 2, rate=1.8, output=50)
    d = decide(s, ELASTIC)
    assert (d.action, d.code) == (ADD_PREFILL, "prefill_short_load") and d.count == 1, d   # 1.8 / 0.65 -> 3
    assert decide(s, ControllerConfig(max_workers=8)).action == NONE     # fixed size: between target and capacity
    assert decide(signals(2, 2, rate=1.8, output=50), ControllerConfig(max_workers=4, min_workers=2)).action == NONE


def test_elastic_config_is_checked():
    with pytest.raises(ValueError, match="min_workers"):
        ControllerConfig(max_workers=4, min_workers=5)
    with pytest.raises(ValueError, match="min_workers"):
        ControllerConfig(max_workers=4, min_workers=1)
    with pytest.raises(ValueError, match="elastic_grow_at"):
        ControllerConfig(max_workers=4, min_workers=2, elastic_grow_at=0.7)


# -- the forecast -------------------------------------------------------------------------------
def test_holt_follows_the_hand_computed_recursion():
    """alpha 0.5, beta 0.3, phi 0.9: 10, then 20: level 0.5 x 20 + 0.5 x 10 = 15, trend
    0.3 x 5 = 1.5; forecast 1 ahead 15 + 0.9 x 1.5, 2 ahead 15 + (0.9 + 0.81) x 1.5."""
    h = Holt()
    assert h.forecast() == 0.0
    h.add(10)
    assert h.forecast() == 10
    h.add(20)
    assert (h.level, h.trend) == (pytest.approx(15.0), pytest.approx(1.5))
    assert h.forecast(1) == pytest.approx(15 + 0.9 * 1.5)
    assert h.forecast(2) == pytest.approx(15 + 1.71 * 1.5)
    for _ in range(200):
        h.add(0)
    assert h.forecast(3) == pytest.approx(0.0, abs=1e-6)                 # never below 0
    with pytest.raises(ValueError):
        Holt(alpha=0)


def test_the_floor_covers_the_forecast_at_target_and_its_bursts_at_full_load():
    f = Forecast()
    f.observe(10.0, 1000, 100, peak_rate=20.0)
    assert f.outlook() is None                                           # one interval: no outlook yet
    f.observe(10.0, 1000, 100, peak_rate=20.0)
    o = f.outlook()
    assert (o.arrival_rate, o.mean_prompt_tokens, o.peak_rate) == (pytest.approx(10.0), pytest.approx(1000),
                                                                   pytest.approx(20.0))
    # mean: 10 x 1,000 / 5,000 = 2 workers' worth, at 0.65 -> 4; bursts: 20 x 1,000 / 5,000 = 4 -> 4.
    # decode: 10 x 100 / 1,000 = 1 at 0.75 -> 2; bursts 2 -> 2
    assert floor_sizes(o, 5000, 1000, 0.65, 0.75) == (4, 2)
    assert floor_sizes(dataclasses.replace(o, peak_rate=30.0), 5000, 1000, 0.65, 0.75) == (6, 3)
    assert floor_sizes(None, 5000, 1000, 0.65, 0.75) == (0, 0)
    rising = Forecast()
    for k in range(6):
        rising.observe(10.0 + 5 * k, 1000, 100)
    assert rising.outlook(ahead=2).arrival_rate > rising.outlook(ahead=1).arrival_rate > 35


def test_a_long_intervals_bursts_are_its_busiest_ttft_long_part_of_prompt_work():
    """60 s of 10 req/s of 1,000-token prompts, and in second 30 forty more of 250 tokens:
    610,000 tokens in 640 requests (953 each on average); the busiest second holds 20,000
    tokens, the rate of 21 mean prompts. The floor's burst term clears it within the second plus
    the TTFT target (1 s): half of that rate."""
    arrivals = [(k / 10, 1000, 50) for k in range(600)] + [(30.0 + k / 100, 250, 50) for k in range(40)]
    rate, prompt, output, peak = interval_summary(arrivals, 0.0, 60.0, burst_s=1.0)
    assert (rate, output) == (pytest.approx(640 / 60), 50)
    assert prompt == pytest.approx(610_000 / 640)
    assert peak == pytest.approx((10 * 1000 + 40 * 250) / prompt)
    long = LongScale(60.0, 0.0, ahead=1, keep_s=60.0, ttft_s=1.0)
    for k in range(3):                                        # three such minutes
        shifted = [(t + 60 * k, a, b) for t, a, b in arrivals]
        floor, keep = long.floors(60.0 * (k + 1), shifted, 1000.0, 100.0, 0.8, 0.85)
    o = long.forecast.outlook()
    assert o.peak_rate == pytest.approx(peak, rel=0.01)
    # prefill: the mean's 10.67 x 953 / 1,000 = 10.2 workers' worth at 0.8, against the burst's 10
    assert floor[0] == math.ceil(max(rate * prompt / 1000 / 0.8, peak / 2 * prompt / 1000) - 1e-9)


# -- the window of signals ----------------------------------------------------------------------
def test_the_window_restarts_where_the_load_shifts():
    steady = [(t / 10, 1000 + 300 * (t % 3)) for t in range(300)]      # 30 s of ~1,300-token prompts
    assert window_start(steady, [], 30.0, 10.0, 30.0) == 0.0
    shifted = [(t, 3000 if t >= 20 else x) for t, x in steady]           # the last 10 s: 3,000 tokens
    assert window_start(shifted, [], 30.0, 10.0, 30.0) == 20.0
    outputs = [(t, 30 if t < 20 else 200) for t, _ in steady]            # output lengths shift alike
    assert window_start(steady, outputs, 30.0, 10.0, 30.0) == 20.0
    assert window_start(steady, [], 30.0, 10.0, 30.0, since=12.0) == 12.0
    assert window_start(shifted[:5] + shifted[-5:], [], 30.0, 10.0, 30.0) == 0.0   # too few to tell


# -- in the simulator ---------------------------------------------------------------------------
def _stationary(name: str, rate: float, seconds: float, seed: int = 0, burstiness: float = 0.5):
    """A stationary load with realistic noise: gamma-distributed gaps (`burstiness` is the
    shape, as vLLM's benchmark takes it: 0.5 is burstier than Poisson) at a fixed mean `rate`,
    each request's prompt and output lengths drawn from the real trace's rows."""
    from cluster.loadtest.bench_data import load_trace
    from cluster.capacity.simulate import SimRequest
    rows = load_trace(name, max_len=8192)
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        if t >= seconds:
            return out
        r = rng.choice(rows)
        out.append(SimRequest.synthetic(t, max(2, r.prompt_len), max(1, r.output_len), len(out)))


def _phased(seed: int, phases) -> list:
    """Poisson arrivals in phases of (until, rate, prompt, output): each request's lengths
    uniform from half to one and a half times the phase's."""
    from cluster.capacity.simulate import SimRequest
    rng = random.Random(seed)
    requests, t = [], 0.0
    for until, rate, prompt, output in phases:
        while t < until:
            t += rng.expovariate(rate)
            requests.append(SimRequest.synthetic(t, rng.randint(prompt // 2, prompt * 3 // 2),
                                                 rng.randint(output // 2, output * 3 // 2), len(requests)))
    return requests


def _controlled(num_prefill, num_decode, budget, **control):
    from cluster.capacity.sim_control import ControlledSimulator, SimControl
    from cluster.capacity.simulate import SimCluster
    from tests.test_simulator import engine
    from workers.cost_model import roofline

    cost = roofline("llama-3-8b", "h100-sxm", 1)
    cluster = SimCluster(num_prefill=num_prefill, num_decode=num_decode, prefill_cost=cost, decode_cost=cost,
                         engine=engine(), max_pending=4096)
    cfg = ControllerConfig(budget, cooldown_s=control.pop("cooldown_s", 30), mixed=control.pop("mixed", False))
    return ControlledSimulator(cluster, SimControl(cfg, **{"interval_s": 10, "window_s": 30, "slo_ttft_s": 1.0,
                                                           "slo_tpot_s": 0.025, **control}), record_itl=False)


def test_simulated_pools_follow_a_phase_shift():
    """2 prefill + 6 decode H100 workers (Llama-3-8B roofline): a prefill-heavy phase moves
    workers to prefill, the decode-heavy phase after it moves them back; nothing is lost, every
    block comes back, and a change of several workers counts each."""
    from tests.test_simulator import assert_pools_clean

    requests = _phased(0, ((200.0, 30.0, 4000, 16), (400.0, 30.0, 200, 2000)))
    sim = _controlled(2, 6, 8, cooldown_s=20, slo_tpot_s=0.05)
    results, _ = sim.run(requests)
    assert all(r.success for r in results)
    moves = [(d["t"], d["action"]) for d in sim.decisions]
    assert any(a == TO_PREFILL for t, a in moves if t < 200), moves
    assert any(a == TO_DECODE for t, a in moves if t > 200), moves
    assert any(d["count"] > 1 for d in sim.decisions), sim.decisions
    sizes = [(d["prefill"], d["decode"]) for d in sim.decisions]
    assert all(p >= 1 and d >= 1 and p + d <= 8 for p, d in sizes)
    assert sim.role_changes == sum(d["count"] for d in sim.decisions)
    assert not sim.draining
    assert_pools_clean(sim)


# One seed per trace, a different one each (every pair took 80 s more of the CI budget).
@pytest.mark.parametrize("trace,rate,split,seed", [("azure-conv", 85.0, (4, 4), 0), ("azure-code", 75.0, (6, 2), 1)])
def test_simulated_stationary_load_changes_nothing_for_ten_minutes(trace, rate, split, seed):
    """Ten simulated minutes of a steady load with realistic noise (bursty arrivals, the real
    trace's mix of lengths) that runs 8 H100s at about their targets (prefill ~0.63, the pool
    the trace leans on), starting from a split that serves it: no role change at all (no
    oscillation), every request served."""
    sim = _controlled(*split, 8)
    results, _ = sim.run(_stationary(trace, rate, 600.0, seed))
    assert all(r.success for r in results)
    assert sim.decisions == [] and sim.role_changes == 0, sim.decisions


def test_simulated_stationary_load_from_a_wrong_split_settles_then_stays():
    """The same conversation load from a split far off (7 prefill + 1 decode): the controller
    moves in one direction within the first two minutes, then changes nothing for ten."""
    sim = _controlled(7, 1, 8)
    results, _ = sim.run(_stationary("azure-conv", 85.0, 720.0))
    assert all(r.success for r in results)
    assert sim.decisions and all(d["t"] <= 120 for d in sim.decisions), sim.decisions
    assert len({d["action"] for d in sim.decisions}) == 1, sim.decisions


def test_simulated_short_prompts_run_mixed_and_long_prompts_split_again():
    """1 prefill + 1 decode H100 worker (Llama-3-8B roofline), the mixed role allowed: a light
    load of short prompts empties the prefill pool (both workers serve whole requests, the
    router's placement code as served), long prompts with replies of a few tokens (whose TPOT
    a long prompt's steps would break) after it split the pools again; every
    request served, every block back, and the mixed minutes' TPOT within the target."""
    from tests.test_simulator import assert_pools_clean

    requests = _phased(1, ((240.0, 4.0, 200, 100), (480.0, 2.0, 6000, 4)))
    sim = _controlled(1, 1, 2, mixed=True, cooldown_s=20)
    results, _ = sim.run(requests)
    assert all(r.success for r in results)
    moves = [(d["t"], d["action"], d["prefill"], d["decode"]) for d in sim.decisions]
    mixed_at = next(t for t, a, p, d in moves if a == TO_DECODE and p == 1)
    split_at = next(t for t, a, p, d in moves if a == TO_PREFILL and p == 0)
    assert mixed_at < 240 < split_at < 300, moves
    assert any(p == 0 and d == 2 for t, p, d, _ in sim.sizes if mixed_at <= t < split_at), sim.sizes
    whole = [r for q, r in zip(requests, results) if mixed_at + 5 < q.arrival_s < 240]
    assert whole and all(r.tpot <= 0.025 for r in whole if r.output_len > 1)
    assert not sim.draining
    assert_pools_clean(sim)
