"""Block tables per sequence over the block pool, prefix-cache lookups, and swap space.

The scheduler speaks to memory only through these verbs: `get_computed_blocks`,
`can_allocate` / `allocate` (a new sequence), `append_slots` (a running one; False when it
does not fit), `free`, and `can_swap_out` / `swap_out` / `can_swap_in` / `swap_in`. Swap verbs return copy
lists (device block, host block) that the model runner executes before the step's forward.
The engine forks a sample from a carrier's prompt with `fork` (shared blocks, a copied tail).
"""
from __future__ import annotations

from workers.block_pool import BlockPool, KVBlock, hash_block_tokens
from workers.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class HostSwapSpace:
    """Host-memory block ids for swapped-out sequences (the runner owns the tensors)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free)
        return [self._free.pop() for _ in range(n)]

    def free(self, ids: list[int]) -> None:
        self._free.extend(ids)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.host = HostSwapSpace(num_host_blocks)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}    # the block table, kept beside the blocks
        self._host_blocks: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}   # how many of a seq's blocks are indexed

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_ids(self, seq: Sequence) -> list[int]:
        """The sequence's block table (live: do not mutate). While the sequence keeps its
        blocks the list only grows; allocation and swap-in make a new one (the model runner's
        block-table buffer relies on both)."""
        return self._block_ids[seq.seq_id]

    def num_blocks_of(self, seq: Sequence) -> int:
        return len(self._blocks.get(seq.seq_id, ()))

    # -- prefix cache ----------------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full blocks, leaving at least the last token to compute
        (its logits are needed). Returns the blocks and how many tokens they cover. A sequence
        that wants its prompt's logprobs gets none: they need every prompt position's logits."""
        if not self.pool.enable_caching or seq.prompt_logprobs is not None:
            return [], 0
        self._extend_hashes(seq, seq.num_tokens)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits = []
        for h in seq.block_hashes[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    def _extend_hashes(self, seq: Sequence, num_tokens: int) -> None:
        bs, hashes = self.block_size, seq.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                            seq.token_ids[i * bs:(i + 1) * bs]))

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Index the blocks that `num_tokens` known tokens fill (their KV is written this step,
        before any later reader in the same step attends: see attention.py)."""
        if not self.pool.enable_caching:
            return
        start = self._num_cached_blocks.get(seq.seq_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        self._extend_hashes(seq, num_tokens)
        blocks = self._blocks[seq.seq_id]
        for i in range(start, end):
            self.pool.cache_block(blocks[i], seq.block_hashes[i])
        self._num_cached_blocks[seq.seq_id] = end

    # -- new sequences ---------------------------------------------------------------------
    def _num_needed(self, computed: list[KVBlock], total_tokens: int) -> int:
        # Hits sitting on the free list stop being free once touched.
        reviving = sum(1 for b in computed if b.ref_cnt == 0)
        return cdiv(total_tokens, self.block_size) - len(computed) + reviving

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed: list[KVBlock],
                     num_computed_tokens: int, watermark_blocks: int = 0) -> bool:
        need = self._num_needed(computed, num_computed_tokens + num_new_tokens)
        return self.pool.num_free - need >= watermark_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, computed: list[KVBlock],
                 num_computed_tokens: int, index: bool = True) -> None:
        """Blocks for `num_computed_tokens + num_new_tokens`. With index=False the new full
        blocks stay out of the prefix cache until `commit` (their KV arrives later)."""
        assert seq.seq_id not in self._blocks, seq
        total = num_computed_tokens + num_new_tokens
        self.pool.touch(computed)
        blocks = computed + self.pool.allocate(cdiv(total, self.block_size) - len(computed))
        self._blocks[seq.seq_id] = blocks
        self._block_ids[seq.seq_id] = [b.block_id for b in blocks]
        self._num_cached_blocks[seq.seq_id] = len(computed)
        if index:
            self._cache_full_blocks(seq, total)

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """The KV of the first `num_tokens` tokens is in place: index their full blocks."""
        self._cache_full_blocks(seq, num_tokens)

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int, watermark_blocks: int = 0
             ) -> tuple[int, int] | None | bool:
        """Give `child` the KV of `parent`'s first `num_tokens` tokens: their full blocks shared
        (a reference each), the last partial one copied into a block of its own, since the
        child writes its next tokens there (copy-on-write, done at the fork). Returns the
        (source, destination) block copy the runner must make before the next forward, None
        when nothing needs copying, or False, with nothing changed, when there is no room."""
        assert child.seq_id not in self._blocks, child
        bs = self.block_size
        full, partial = divmod(num_tokens, bs)
        if self.pool.num_free - (1 if partial else 0) < watermark_blocks:
            return False
        shared = self._blocks[parent.seq_id][:full]
        self.pool.touch(shared)
        blocks = shared + (self.pool.allocate(1) if partial else [])
        self._blocks[child.seq_id] = blocks
        self._block_ids[child.seq_id] = [b.block_id for b in blocks]
        self._num_cached_blocks[child.seq_id] = full
        child.block_hashes = parent.block_hashes[:full]
        return (self._blocks[parent.seq_id][full].block_id, blocks[-1].block_id) if partial else None

    # -- running sequences -----------------------------------------------------------------
    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Slots for a running sequence's next tokens. False, with nothing changed, when the
        pool lacks the blocks (the scheduler then preempts and tries again): one verb, not a
        check and an append, because it runs for every running sequence every step."""
        blocks = self._blocks[seq.seq_id]
        total = seq.num_computed_tokens + num_new_tokens
        need = -(-total // self.block_size) - len(blocks)
        pool = self.pool
        if need > 0:
            if need > pool.num_free:
                return False
            new = pool.allocate(need)
            blocks += new
            self._block_ids[seq.seq_id] += [b.block_id for b in new]
        if pool.enable_caching:
            self._cache_full_blocks(seq, total)
        return True

    def free(self, seq: Sequence) -> None:
        blocks = self._blocks.pop(seq.seq_id, None)
        self._block_ids.pop(seq.seq_id, None)
        self._num_cached_blocks.pop(seq.seq_id, None)
        if blocks:
            self.pool.free(reversed(blocks))
        host = self._host_blocks.pop(seq.seq_id, None)
        if host:
            self.host.free(host)

    # -- swapping --------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return self.num_blocks_of(seq) <= self.host.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move a sequence's blocks to host memory; returns (device, host) copies to run."""
        blocks = self._blocks.pop(seq.seq_id)
        self._block_ids.pop(seq.seq_id)
        self._num_cached_blocks.pop(seq.seq_id, None)
        host = self.host.allocate(len(blocks))
        self._host_blocks[seq.seq_id] = host
        mapping = [(b.block_id, h) for b, h in zip(blocks, host)]
        # Freed, but their contents stay valid until reused: full blocks remain prefix hits.
        self.pool.free(reversed(blocks))
        return mapping

    def can_swap_in(self, seq: Sequence, watermark_blocks: int = 0) -> bool:
        return self.pool.num_free - len(self._host_blocks[seq.seq_id]) >= watermark_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped sequence back; returns (host, device) copies to run."""
        host = self._host_blocks.pop(seq.seq_id)
        blocks = self.pool.allocate(len(host))
        self._blocks[seq.seq_id] = blocks
        self._block_ids[seq.seq_id] = [b.block_id for b in blocks]
        self._num_cached_blocks[seq.seq_id] = 0
        self._cache_full_blocks(seq, seq.num_computed_tokens)
        self.host.free(host)
        return [(h, b.block_id) for h, b in zip(host, blocks)]
