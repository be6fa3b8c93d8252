"""Which worker holds which prompt blocks: the router's approximate view of the prefix caches.

Plain Python (no Ray), shared by the dispatcher, the tests and the simulator.

A block is named by its chained hash (workers/block_pool.py `hash_block_tokens`: the same
prefix hashes alike in every process), so the router hashes a prompt the way a worker's prefix
cache does and asks, per worker, how many of its leading blocks that worker holds. The view is
kept from two sources:

- the router's own choices: a prompt sent to a worker is entered at once (the burst that
  follows it finds it there before the worker has computed a token);
- the workers' cache events (stored and evicted hashes, with each poll), which confirm what was
  computed, add what arrived by handoff, and take out what the worker evicted.

Per worker the hashes sit in LRU order, bounded by the worker's block count: an entry the
router made that never materialised (its request was aborted first) ages out. A worker that
lost its cache (restarted) is forgotten whole.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from workers.block_pool import hash_block_tokens


class PrefixIndex:
    def __init__(self, block_size: int, default_capacity: int = 1 << 16):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.default_capacity = default_capacity
        self._where: dict[bytes, set[str]] = {}             # block hash -> workers holding it
        self._held: dict[str, OrderedDict] = {}             # worker -> its hashes, oldest first
        self._capacity: dict[str, int] = {}

    def hashes(self, token_ids: list[int]) -> list[bytes]:
        """The chained hashes of the blocks a worker could serve from its cache: the full
        blocks before the last token (whose logits are always computed)."""
        bs, out, h = self.block_size, [], None
        for i in range((len(token_ids) - 1) // bs):
            h = hash_block_tokens(h, token_ids[i * bs:(i + 1) * bs])
            out.append(h)
        return out

    def matches(self, hashes: list[bytes]) -> dict[str, int]:
        """Per worker holding the first block: how many leading blocks it holds."""
        if not hashes:
            return {}
        where = self._where
        alive = set(where.get(hashes[0], ()))
        counts = dict.fromkeys(alive, 1)
        for h in hashes[1:]:
            alive &= where.get(h, set())
            if not alive:
                break
            for w in alive:
                counts[w] += 1
        return counts

    def add(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        """`worker_id` holds these blocks (now, or once it has computed them): the most recent."""
        held = self._held.setdefault(worker_id, OrderedDict())
        where = self._where
        for h in hashes:
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
                where.setdefault(h, set()).add(worker_id)
        over = len(held) - self._capacity.get(worker_id, self.default_capacity)
        for _ in range(max(0, over)):
            self._drop(worker_id, held.popitem(last=False)[0])

    def remove(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        """The worker evicted these blocks."""
        held = self._held.get(worker_id)
        if held is None:
            return
        for h in hashes:
            if h in held:
                del held[h]
                self._drop(worker_id, h)

    def set_capacity(self, worker_id: str, num_blocks: int) -> None:
        """The most blocks the worker can hold (its report's KV block count)."""
        self._capacity[worker_id] = max(1, num_blocks)

    def forget(self, worker_id: str) -> None:
        """The worker's cache is gone (it died, or left): nothing of it is held any more."""
        for h in self._held.pop(worker_id, ()):
            self._drop(worker_id, h)
        self._capacity.pop(worker_id, None)

    def num_held(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))

    def _drop(self, worker_id: str, h: bytes) -> None:
        ws = self._where.get(h)
        if ws is not None:
            ws.discard(worker_id)
            if not ws:
                del self._where[h]
