"""The pool of KV blocks: reference counts, an O(1) LRU free list, and the prefix-cache index.

A block is free when its refcount is 0. A free block may still hold a cached prefix (its
`block_hash` is set): it stays findable until the free list hands it out again, which evicts
the oldest first. Free blocks form an intrusive doubly linked list:

    head <-> b7 <-> b2 <-> b9 <-> tail        take from the head (least recently freed),
                                              free onto the tail, unlink a cache hit in O(1)
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from array import array


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int, ref_cnt: int = 0):
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        self.block_hash: bytes | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks themselves; sentinels at both ends."""

    def __init__(self, blocks: list[KVBlock]):
        self._head, self._tail = KVBlock(-1), KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVBlock:
        b = self._head.next
        if b is self._tail:
            raise RuntimeError("no free KV block")   # callers check num_free first
        self.remove(b)
        return b

    def append(self, b: KVBlock) -> None:
        last = self._tail.prev
        last.next, b.prev, b.next, self._tail.prev = b, last, self._tail, b
        self.num_free += 1

    def push_front(self, blocks: list[KVBlock]) -> None:
        """Put blocks, in order, ahead of the whole list (the next ones taken)."""
        first = self._head.next
        prev = self._head
        for b in blocks:
            prev.next, b.prev = b, prev
            prev = b
        prev.next, first.prev = first, prev
        self.num_free += len(blocks)

    def remove(self, b: KVBlock) -> None:
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.num_free -= 1

    def __iter__(self):
        b = self._head.next
        while b is not self._tail:
            yield b
            b = b.next


def hash_block_tokens(parent_hash: bytes | None, token_ids) -> bytes:
    """Chained block hash: the same prefix gives the same hash in every process (no `hash()`)."""
    h = hashlib.blake2b(parent_hash or b"pdcluster", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    """Blocks are made on first use: ids never handed out sit, in id order, ahead of the free
    list (they are its least recently used end), so a big pool costs nothing until it fills.
    `blocks` makes the rest at once (for tests and invariant checks).

    Without prefix caching no freed block is worth more than another: they go on a plain stack,
    reused most recent first and before any new block is made (so a pool makes only as many
    blocks as it ever holds at once), and taking or returning many is one slice."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._made: list[KVBlock] = []
        self.free_queue = FreeBlockQueue([])          # with caching: LRU order
        self._stack: list[KVBlock] = []               # without: the top is taken first
        self.cached: dict[bytes, KVBlock] = {}
        self.num_free = num_blocks                      # kept, not counted: it is asked every step
        self._stored: list[bytes] | None = None        # recording cache events: hashes indexed,
        self._evicted: list[bytes] | None = None       # and hashes evicted, since the last take
        # Told of every block allocate hands out, before anything writes it (the shared-memory
        # cache counts allocations per block: workers/kv_shm.py).
        self.on_allocate: Callable[[list[KVBlock]], None] | None = None

    def record_events(self) -> None:
        """From now on, note each hash the cache indexes or evicts (`take_events`): the router's
        prefix-aware picking follows the caches through them."""
        if self._stored is None:
            self._stored, self._evicted = [], []

    def take_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, evicted) since the last call, as they stand now: a hash stored then evicted
        is only evicted, one evicted then stored again only stored. Empty unless recording."""
        if not self._stored and not self._evicted:
            return [], []
        cached = self.cached
        stored = [h for h in self._stored if h in cached]
        evicted = [h for h in self._evicted if h not in cached]
        self._stored, self._evicted = [], []
        return stored, evicted

    @property
    def blocks(self) -> list[KVBlock]:
        made = self._made
        if len(made) < self.num_blocks:
            fresh = [KVBlock(i) for i in range(len(made), self.num_blocks)]
            if self.enable_caching:
                self.free_queue.push_front(fresh)     # never made: the least recently used
            else:
                self._stack[:0] = fresh[::-1]          # taken after the freed ones, in id order
            made.extend(fresh)
        return made

    def free_blocks(self) -> list[KVBlock]:
        """The free blocks made so far, in the order they would be taken."""
        return list(self.free_queue) if self.enable_caching else self._stack[::-1]

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take n blocks: with caching from the LRU end (never-made ones first), evicting
        whatever prefix they cached; without, freed ones first."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free} free")
        made = self._made
        self.num_free -= n
        if not self.enable_caching:
            stack = self._stack
            k = min(n, len(stack))
            taken = stack[-k:][::-1] if k else []
            if k:
                del stack[-k:]
                for b in taken:
                    b.ref_cnt = 1
            if k < n:
                taken += [KVBlock(i, 1) for i in range(len(made), len(made) + n - k)]
                made.extend(taken[k:])
            if self.on_allocate is not None:
                self.on_allocate(taken)
            return taken
        queue = self.free_queue
        from_queue = max(0, n - (self.num_blocks - len(made)))
        taken = [KVBlock(i, 1) for i in range(len(made), len(made) + n - from_queue)]
        made.extend(taken)
        if from_queue:                    # FreeBlockQueue.popleft, inline: this runs per block
            cached, head, evicted = self.cached, queue._head, self._evicted
            b = head.next
            for _ in range(from_queue):
                if b.block_hash is not None:
                    del cached[b.block_hash]
                    if evicted is not None:
                        evicted.append(b.block_hash)
                    b.block_hash = None
                b.ref_cnt = 1
                taken.append(b)
                b = b.next
            head.next, b.prev = b, head
            queue.num_free -= from_queue
        if self.on_allocate is not None:
            self.on_allocate(taken)
        return taken

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cache hits; a hit that was free leaves the free list."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
                self.num_free -= 1
            b.ref_cnt += 1

    def free(self, blocks) -> None:
        """Drop one reference each. Pass a sequence's blocks tail first, so that its last
        blocks (the least shareable) are evicted before its prefix."""
        if not self.enable_caching:
            freed = []
            keep = freed.append
            for b in blocks:
                c = b.ref_cnt - 1
                b.ref_cnt = c
                if not c:
                    keep(b)
                elif c < 0:
                    raise AssertionError(f"{b} freed more often than taken")
            self._stack += freed
            self.num_free += len(freed)
            return
        queue = self.free_queue
        tail, freed = queue._tail, 0
        for b in blocks:                  # FreeBlockQueue.append, inline: this runs per block
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, b
            if b.ref_cnt == 0:
                last = tail.prev
                last.next, b.prev, b.next, tail.prev = b, last, tail, b
                freed += 1
        queue.num_free += freed
        self.num_free += freed

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Index a full block under its hash (first writer wins; duplicates stay unindexed)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self._stored is not None:
            self._stored.append(block_hash)

    def reset_prefix_cache(self) -> None:
        for b in self.cached.values():
            b.block_hash = None
        if self._evicted is not None:
            self._evicted.extend(self.cached)
        self.cached.clear()
