"""Power-of-two-choices against random placement on balls-into-bins (plain Python)."""
from __future__ import annotations

import dataclasses

import pytest

from router.picker import Picker, WorkerLoad, decode_load, prefill_load, slot_ends
from router.placement import Placement
from test_priority_inheritance import StepEngine
from workers.config import SchedulerConfig
from workers.engine_core import KVCacheLayout
from workers.messages import LoadReport
from workers.sequence import SamplingParams


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
        self.slots: dict[str, list[int]] = {}       # colocated: each worker's `slot_ends`

    def active(self, role):
        return self.pools.get(role, [])

    def prefill_load(self, w):
        return self.queued.get(w, 0)

    def decode_load(self, w):
        return self.decoding_load.get(w, 0)

    def decoding(self, w):
        return (0, 0)

    def slot_ends(self, w):
        return self.slots.get(w, [])


def test_with_no_prefill_worker_a_decode_worker_serves_the_request_whole():
    """The mixed role: disaggregated with no active prefill worker, every request goes whole to a
    decode worker (least queued prompt tokens, then least decode load); with one, it hands off."""
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


def test_slot_ends_are_the_steps_until_a_prompt_queued_past_the_limit_is_scheduled():
    """The oracle is the engine: three slots running sequences with 9, 4 and 6 tokens to make,
    two long prompts queued; a prompt sent now is scheduled once the three have ended, in the
    step after the third end, which its report's ends say before it is sent. With another
    prompt sent since the report (`unreported`), one slot more: past the three running, at the
    spacing they end at."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=3, watermark=0.0)
    e = StepEngine(cfg, KVCacheLayout(1, 16, 512, 0), 4096, 256)

    def add(rid: str, max_tokens: int) -> None:
        e.add_request(prompt_token_ids=[1 + len(e._seqs)] * 8, request_id=rid,
                      params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    for i, n in enumerate((10, 5, 7)):
        add(f"run{i}", n)
    e.step()                                         # the three prompts, a token each
    add("q0", 50)
    add("q1", 50)
    r = e.load_report("c0", "colocated", 1)
    assert (r.max_seqs, r.running, r.waiting, r.ends_in) == (3, 3, 2, [4, 6, 9])
    ends = slot_ends(r)
    assert ends == [4, 6, 9]
    assert slot_ends(r, unreported=1) == [4, 6, 9, 12]
    add("new", 4)
    steps = 0
    while not any(q.seq_id == "new" for q in e.scheduler.running):
        e.step()
        steps += 1
    assert steps == ends[-1] + 1
    assert slot_ends(dataclasses.replace(r, running=2, waiting=0)) == []     # a slot free
    assert slot_ends(dataclasses.replace(r, max_seqs=0)) == []                # its limit untold


def test_a_colocated_prompt_goes_where_a_sequence_slot_frees_first():
    """Colocated p2c: by the steps until a slot frees for it (`slot_ends`), then by the prompt
    tokens queued; past the slots of both sampled workers, the pool's soonest (what admission
    prices)."""
    p = Placement("colocated", "p2c", seed=0, block_size=16)
    view = _View({"colocated": ["c0", "c1"]}, queued={"c0": 0, "c1": 900}, decoding={})
    view.slots = {"c0": [40, 50], "c1": [30]}
    assert {p.first(p.start([1, 2, 3]), view)[0] for _ in range(20)} == {"c1"}   # its slot frees first
    view.slots["c0"] = []
    assert {p.first(p.start([1, 2, 3]), view)[0] for _ in range(20)} == {"c0"}   # a slot free now
    view.slots["c1"] = []
    view.queued["c0"] = 1000
    assert {p.first(p.start([1, 2, 3]), view)[0] for _ in range(20)} == {"c1"}   # both free: the shorter queue
    ids = [f"c{i}" for i in range(6)]
    view = _View({"colocated": ids}, queued={}, decoding={})
    view.slots = {w: [100 + i] for i, w in enumerate(ids)}
    view.slots["c4"] = [7]
    assert {p.first(p.start([1, 2, 3]), view)[0] for _ in range(40)} == {"c4"}
    view.slots["c2"] = []                                                        # a slot free at c2
    assert {p.first(p.start([1, 2, 3]), view)[0] for _ in range(40)} == {"c2"}
