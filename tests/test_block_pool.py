"""BlockPool against a plain model of it: who holds which block, the expected LRU free order,
and the expected prefix-cache index, under random allocate / touch / free / cache_block."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from workers.block_pool import BlockPool, FreeBlockQueue, KVBlock

HASHES = [bytes([i]) * 4 for i in range(12)]    # few values: duplicates and re-caching happen


class BlockPoolMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 12), caching=st.booleans())
    def setup(self, num_blocks, caching):
        self.pool = BlockPool(num_blocks, enable_caching=caching)
        self.holders: list[list[int]] = []        # one list of block ids per holder (a "sequence")
        self.free_order = list(range(num_blocks))  # expected free list, head first
        self.made: set[int] = set()                 # blocks handed out at least once
        self.index: dict[bytes, int] = {}          # expected prefix-cache index: hash -> block id
        self.block_hash: dict[int, bytes] = {}     # expected hash of each indexed block

    def take_order(self) -> list[int]:
        if self.pool.enable_caching:
            return self.free_order
        # Without caching: freed blocks most recent first, then never-made ones in id order.
        return [b for b in reversed(self.free_order) if b in self.made] + sorted(
            b for b in self.free_order if b not in self.made)

    def ref_cnt(self, block_id: int) -> int:
        return sum(h.count(block_id) for h in self.holders)

    def _take_ref(self, block_id: int) -> None:
        if self.ref_cnt(block_id) == 0:
            self.free_order.remove(block_id)

    @rule(n=st.integers(0, 5))
    def allocate(self, n):
        if n > self.pool.num_free:
            with pytest.raises(RuntimeError):
                self.pool.allocate(n)
            return
        got = [b.block_id for b in self.pool.allocate(n)]
        # Taken from the head of the free list: the least recently freed first. Without prefix
        # caching, blocks made before come before never-made ones.
        order = self.take_order()
        assert got == order[:n]
        self.made.update(got)
        self.free_order = [b for b in self.free_order if b not in got]
        for b in got:
            h = self.block_hash.pop(b, None)
            if h is not None:                     # reuse evicts the cached prefix
                del self.index[h]
        self.holders.append(got)

    @rule(data=st.data())
    def touch_cache_hits(self, data):
        """A new holder takes references on blocks found by hash (a prefix-cache hit)."""
        wanted = data.draw(st.lists(st.sampled_from(HASHES), max_size=4, unique=True))
        hits = []
        for h in wanted:
            b = self.pool.lookup(h)
            assert (b is not None) == (h in self.index)
            if b is not None:
                assert b.block_hash == h and b.block_id == self.index[h]
                hits.append(b)
        self.pool.touch(hits)
        for b in hits:
            self._take_ref(b.block_id)
        self.holders.append([b.block_id for b in hits])

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free(self, data):
        i = data.draw(st.integers(0, len(self.holders) - 1))
        held = self.holders.pop(i)
        order = data.draw(st.sampled_from(["as-held", "reversed"]))
        blocks = held if order == "as-held" else held[::-1]
        self.pool.free([self.pool._made[b] for b in blocks])      # held blocks are made; look, don't make
        for b in blocks:
            if self.ref_cnt(b) == 0 and b not in self.free_order:
                self.free_order.append(b)          # freed blocks go to the tail: taken last

    @precondition(lambda self: any(self.holders))
    @rule(data=st.data())
    def cache_block(self, data):
        held = [b for h in self.holders for b in h]
        b = data.draw(st.sampled_from(held))
        h = data.draw(st.sampled_from(HASHES))
        self.pool.cache_block(self.pool._made[b], h)
        if self.pool.enable_caching and b not in self.block_hash and h not in self.index:
            self.index[h] = b
            self.block_hash[b] = h

    @rule()
    def reset_prefix_cache(self):
        self.pool.reset_prefix_cache()
        self.index.clear()
        self.block_hash.clear()

    # -- invariants (on the blocks made so far, so the lazy path is what runs) ---------------
    def free_ids(self) -> list[int]:
        """The order blocks would be taken in: never-made ids (in id order) then the free list,
        or without prefix caching the other way round."""
        made = len(self.pool._made)
        assert [b.block_id for b in self.pool._made] == list(range(made))
        fresh, listed = list(range(made, self.pool.num_blocks)), [b.block_id for b in self.pool.free_blocks()]
        return fresh + listed if self.pool.enable_caching else listed + fresh

    @invariant()
    def refcounts_match_holders(self):
        for b in self.pool._made:
            assert b.ref_cnt >= 0
            assert b.ref_cnt == self.ref_cnt(b.block_id), b

    @invariant()
    def blocks_conserved(self):
        free = self.free_ids()
        assert len(free) == len(set(free)) == self.pool.num_free
        referenced = [b for b in self.pool._made if b.ref_cnt > 0]
        assert self.pool.num_free + len(referenced) == self.pool.num_blocks
        for b in self.pool._made:                 # on the free list xor referenced
            assert (b.block_id in free) != (b.ref_cnt > 0), b

    @invariant()
    def free_list_in_lru_order(self):
        assert self.free_ids() == self.take_order()

    @invariant()
    def index_matches_model(self):
        assert {h: b.block_id for h, b in self.pool.cached.items()} == self.index
        for h, b in self.pool.cached.items():
            assert b.block_hash == h
        for b in self.pool._made:
            assert b.block_hash == self.block_hash.get(b.block_id)

    @rule()
    def make_all(self):
        """Asking for every block makes the rest, ahead of the free list, in id order."""
        before = self.free_ids()
        assert [b.block_id for b in self.pool.blocks] == list(range(self.pool.num_blocks))
        assert [b.block_id for b in self.pool.free_blocks()] == before
        self.made.update(range(self.pool.num_blocks))     # all made now: the free list's order rules
        self.free_order = before if self.pool.enable_caching else before[::-1]


BlockPoolMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow])
TestBlockPool = BlockPoolMachine.TestCase


def test_free_queue_links_in_o1_order():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.append(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2]
    assert q.popleft().block_id == 0
    assert q.num_free == 4
    for _ in range(4):
        q.popleft()
    with pytest.raises(RuntimeError):
        q.popleft()


def test_evicted_block_is_no_longer_found():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, HASHES[0])
    pool.cache_block(b, HASHES[1])
    pool.free([b, a])                  # tail first: b is evicted before a
    (c,) = pool.allocate(1)
    assert c is b and pool.lookup(HASHES[1]) is None and c.block_hash is None
    assert pool.lookup(HASHES[0]) is a  # still cached while free
    pool.touch([a])
    assert pool.num_free == 0 and a.ref_cnt == 1
