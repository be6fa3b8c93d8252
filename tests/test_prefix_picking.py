"""Prefix-aware picking on plain state: the router's index of the workers' prefix caches
(router/prefix_index.py), the choice (router/picker.py `choose_prefix`), and the cache events
the block pool records for it (workers/block_pool.py). Oracles: a worker's own prefix cache
(KVCacheManager.get_computed_blocks on the same tokens), and brute-force cost minimisation."""
from __future__ import annotations

import random

import pytest

from router.picker import NEW_TOKEN_WEIGHT, Picker
from router.prefix_index import PrefixIndex
from workers.kv_cache_manager import KVCacheManager
from workers.sequence import SamplingParams, Sequence

BS = 4


def test_hashes_are_the_worker_cache_hashes_and_a_served_prompt_matches_what_the_worker_would_hit():
    kv = KVCacheManager(64, BS)
    kv.pool.record_events()
    index = PrefixIndex(BS)
    rng = random.Random(0)
    shared = [rng.randrange(1000) for _ in range(4 * BS + 2)]
    first = Sequence("a", shared + [1, 2, 3], SamplingParams())
    kv.allocate(first, first.num_tokens, [], 0)            # computed: its full blocks are indexed
    stored, evicted = kv.pool.take_events()
    assert evicted == [] and stored == first.block_hashes
    index.add("w0", stored)
    for tail in ([7], [7, 8, 9, 10, 11], list(range(20))):
        tokens = shared + tail
        cached = kv.get_computed_blocks(Sequence("q", tokens, SamplingParams()))[1]
        assert index.matches(index.hashes(tokens)).get("w0", 0) * BS == cached


def test_matches_count_leading_blocks_per_worker_and_stop_at_the_first_gap():
    index = PrefixIndex(BS)
    h = index.hashes(list(range(6 * BS + 1)))                 # 6 full blocks before the last token
    assert len(h) == 6
    index.add("a", h[:4])
    index.add("b", h[:2] + h[3:])                             # a gap at block 2
    index.add("c", h[1:])                                     # lacks the first block: nothing usable
    assert index.matches(h) == {"a": 4, "b": 2}
    assert index.matches([]) == {}


def test_eviction_events_forget_and_capacity_bound_each_worker_lru_first():
    index = PrefixIndex(BS)
    h = index.hashes(list(range(8 * BS + 1)))
    index.add("a", h)
    index.remove("a", [h[5]])
    assert index.matches(h) == {"a": 5}
    index.remove("zzz", h)                                    # unknown worker: nothing happens
    index.set_capacity("a", 3)
    index.add("a", h[:2])                                     # touched: the most recent
    assert index.num_held("a") == 3                           # the oldest others aged out
    assert index.matches(h) == {"a": 2}
    index.forget("a")
    assert index.matches(h) == {} and index.num_held("a") == 0


def test_block_pool_events_name_what_the_cache_holds_now():
    kv = KVCacheManager(4, BS)
    kv.pool.record_events()
    a = Sequence("a", list(range(2 * BS)), SamplingParams())
    kv.allocate(a, a.num_tokens, [], 0)
    kv.free(a)
    b = Sequence("b", list(range(100, 100 + 3 * BS)), SamplingParams())
    kv.allocate(b, b.num_tokens, [], 0)                       # 3 of 4 blocks: evicts one of a's
    stored, evicted = kv.pool.take_events()
    assert set(stored) == set(kv.pool.cached)                 # a's evicted one is not "stored"
    assert len(evicted) == 1 and evicted[0] not in kv.pool.cached and evicted[0] in a.block_hashes
    assert kv.pool.take_events() == ([], [])
    kv.pool.reset_prefix_cache()
    assert set(kv.pool.take_events()[1]) == set(stored)


def cost(load: dict, matched: dict, w: str, n: int) -> float:
    return load[w] + NEW_TOKEN_WEIGHT * (n - min(matched.get(w, 0) * BS, n - 1))


@pytest.mark.parametrize("seed", range(200))
def test_choose_prefix_picks_the_cheapest_of_the_two_sampled_and_the_best_matched(seed):
    rng = random.Random(seed)
    ids = [f"w{i}" for i in range(rng.randint(1, 6))]
    load = {w: rng.choice([0, 10, 50, 200, 1000]) for w in ids}
    n = rng.randint(1, 40 * BS)
    matched = {w: rng.randint(0, n // BS) for w in ids if rng.random() < 0.5}
    sampler = Picker("prefix", seed)
    two = set(Picker("prefix", seed)._two(ids)) if len(ids) > 1 else set(ids)
    got = sampler.choose_prefix(ids, load.__getitem__, matched, n, BS)
    best_matched = max(matched, key=lambda w: (matched[w], -load[w]), default=None)
    candidates = two | ({best_matched} if best_matched else set())
    assert got in candidates
    assert cost(load, matched, got, n) == min(cost(load, matched, w, n) for w in candidates)


def test_a_match_is_followed_while_the_queue_difference_is_less_than_it_saves():
    p = Picker("prefix", 0)
    n = 100 * BS
    # b holds 80 of the 100 blocks: 320 tokens saved, worth 640 tokens of queue.
    assert p.choose_prefix(["a", "b"], {"a": 0, "b": 600}.__getitem__, {"b": 80}, n, BS) == "b"
    assert p.choose_prefix(["a", "b"], {"a": 0, "b": 680}.__getitem__, {"b": 80}, n, BS) == "a"
    # Among many workers the matched one is a candidate even when the two sampled are others.
    ids = [f"w{i}" for i in range(50)]
    assert all(p.choose_prefix(ids, lambda w: 5, {"w7": 90}, n, BS) == "w7" for _ in range(50))
    # A matched worker no longer in the pool (gone since) is never picked.
    assert p.choose_prefix(["a", "b"], lambda w: 0, {"gone": 90}, n, BS) in ("a", "b")
