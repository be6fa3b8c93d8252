"""Power-of-two-choices against random placement on balls-into-bins (plain Python)."""
from __future__ import annotations

import dataclasses

import pytest

from router.picker import Picker, WorkerLoad, decode_load, prefill_load
from workers.messages import LoadReport


def max_bin(policy: str, n_bins: int, n_balls: int, seed: int) -> int:
    picker = Picker(policy, seed)
    bins = [0] * n_bins
    for _ in range(n_balls):
        w = picker.pick([WorkerLoad(str(i), load) for i, load in enumerate(bins)])
        bins[int(w)] += 1
    return max(bins)


def test_two_choices_beats_random_on_the_max_queue():
    n = 1000
    trials = range(3)
    p2c = [max_bin("p2c", n, n, s) for s in trials]
    rnd = [max_bin("random", n, n, s) for s in trials]
    print(f"\n{n} balls into {n} bins, max bin over {len(trials)} seeds: p2c {p2c}, random {rnd}")
    # Theory: ~log n / log log n (about 5-7 here) for random, ~log log n / log 2 + O(1) (about 3-4)
    # for two choices.
    assert max(p2c) <= 4
    assert min(rnd) >= 5
    assert sum(p2c) < 0.7 * sum(rnd)


def test_round_robin_cycles_and_single_candidate():
    picker = Picker("round-robin")
    ws = [WorkerLoad(str(i), 0) for i in range(3)]
    assert [picker.pick(ws) for _ in range(6)] == ["0", "1", "2", "0", "1", "2"]
    assert Picker("p2c").pick([WorkerLoad("only", 9)]) == "only"


def test_p2c_never_picks_the_strictly_most_loaded_of_two():
    picker = Picker("p2c", seed=3)
    ws = [WorkerLoad("idle", 0), WorkerLoad("busy", 100)]
    assert {picker.pick(ws) for _ in range(50)} == {"idle"}


def test_bad_policy_and_empty_pool():
    with pytest.raises(ValueError, match="picking policy"):
        Picker("fastest")
    with pytest.raises(LookupError):
        Picker().pick([])


def test_load_signals_count_unreported_work():
    report = LoadReport("p-0", "prefill", waiting=1, running=2, swapped=0, queued_prefill_tokens=100,
                        kv_blocks_used=10, kv_blocks_total=100, steps=5)
    assert prefill_load(report, 50) == 150
    assert prefill_load(None, 50) == 50                  # before the first report: only what was sent
    assert decode_load(report, 1) > decode_load(report, 0) > decode_load(None, 0)
    busier = dataclasses.replace(report, pending=3)     # waiting for KV room counts as load
    assert decode_load(busier, 0) > decode_load(report, 0)


class _View:
    """Pools as router/placement.py's PoolView: members by role, loads by worker."""

    def __init__(self, pools: dict[str, list[str]], queued: dict[str, float], decoding: dict[str, float]):
        self.pools, self.queued, self.decoding_load = pools, queued, decoding

    def active(self, role):
        return self.pools.get(role, [])

    def prefill_load(self, w):
        return self.queued.get(w, 0)

    def decode_load(self, w):
        return self.decoding_load.get(w, 0)

    def decoding(self, w):
        return (0, 0)


def test_with_no_prefill_worker_a_decode_worker_serves_the_request_whole():
    """The mixed role: disaggregated with no active prefill worker, every request goes whole to a
    decode worker (least queued prompt tokens, then least decode load); with one, it hands off."""
    from router.placement import Placement
    for local in (0, 64):
        p = Placement("disaggregated", "p2c", seed=0, block_size=16, local_prefill_max_tokens=local)
        assert p.roles_needed() == ("decode",)
        view = _View({"decode": ["d0", "d1"]}, queued={"d0": 0, "d1": 0}, decoding={"d0": 0.5, "d1": 0.1})
        for _ in range(20):
            assert p.first(p.start(list(range(500))), view) == ("d1", True)
        view.queued["d1"] = 300
        assert p.first(p.start(list(range(500))), view) == ("d0", True)
        view.pools["prefill"] = ["p0"]
        fresh = list(range(1000, 1500))             # 500 tokens cached nowhere: past any local limit
        assert p.first(p.start(fresh), view) == ("p0", False)
    with pytest.raises(LookupError):
        p.first(p.start([1, 2]), _View({}, {}, {}))
