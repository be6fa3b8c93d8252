"""The KV handoff through shared memory, for a prefill and a decode worker on one node: the decode
worker copies the held blocks straight out of the prefill worker's cache into its own, one copy,
with no staging buffer, socket or process group.

    prefill worker                                decode worker
    KV cache in a memfd (SharedKVCache) ◀─mmap─── PeerCaches: its cache, mapped read-only once
    held event: HeldKV(block ids, counts) ─router─▶ DecodeOp.kv
                                                  copy_blocks(its cache → reserved blocks),
                                                  then the blocks' allocation counts: unchanged?
    release_kv(rid) ◀──────────────────────────── done (or gave up)

No call reaches the prefill worker before the copy: the held event says where the blocks are,
with each block's allocation count (the pool counts every time it hands a block out, before
any KV is written into it). A count that is the same after the copy proves the block was not
given to other KV since the request was held: the bytes copied are that request's, even if it
was aborted or its lease expired meanwhile (freed blocks keep their bytes until reallocated).
This leans on the CPU keeping stores in order and loads in order (x86's TSO: the count is
written before the new KV, and read after the copy): elsewhere (`ORDERED` false) the prefill
worker sends no HeldKV and the decode worker borrows the blocks instead:

    lend_kv(rid) ─▶ (block ids, deadline)  ─────▶ copy_blocks, then the deadline not passed?
    release_kv(rid) ◀──────────────────────────── done (or gave up): the loan ends

A CPU worker's cache lives in one memfd: anonymous shared memory with no name to leak (freed
when the last process that holds or maps it exits), outside /dev/shm's size limit (64 MiB in a
default container). A peer maps it through /proc/<pid>/fd/<fd>, which works for processes of
the same user on the same node; `PeerCaches.open` fails otherwise and the worker uses Gloo.

A mapping stays valid after its owner dies: the blocks a loan names were written before the
loan, so a copy finishes with the right bytes even then. A loan that outlives its deadline is
freed by its owner (workers/handoff.py); the reader checks the deadline (CLOCK_MONOTONIC is
one clock for the whole node) after its copy and drops the copy when it is past.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import platform
import secrets
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from workers import cpu_kernels
from workers.kv_transfer import KVCaches, KVLayout, KVLayoutMismatch


# Stores become visible in program order and loads are not reordered with loads (see above).
ORDERED = platform.machine().lower() in ("x86_64", "amd64")


@dataclass(frozen=True, slots=True)
class KVSegment:
    """Where a worker's KV cache lives, as its same-node peers need it to map it."""
    node: str                   # Ray's node id: peers compare it with their own
    pid: int
    fd: int
    num_blocks: int
    layout: dict                # KVLayout's fields
    nonce: int                  # this cache's, at random: a HeldKV names the cache it is in
    first_head: int = 0         # a tensor-parallel rank's cache holds layout's heads from this one

    def to_dict(self) -> dict:
        return {"node": self.node, "pid": self.pid, "fd": self.fd, "num_blocks": self.num_blocks,
                "layout": self.layout, "nonce": self.nonce, "first_head": self.first_head}

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * KVLayout(**self.layout).bytes_per_block

    @property
    def size(self) -> int:      # the KV, then one int64 allocation count per block
        return self.kv_bytes + 8 * self.num_blocks


def _views(buffer, layout: KVLayout, num_blocks: int, writable: bool) -> tuple[KVCaches, np.ndarray]:
    """(k, v) per layer over the segment's KV bytes, layer-major, and its allocation counts."""
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    per = num_blocks * layout.block_size * layout.num_kv_heads * layout.head_dim
    with warnings.catch_warnings():     # a peer's is read-only on purpose: torch warns it cannot write
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buffer, dtype=layout.torch_dtype, count=2 * layout.num_layers * per)
    caches = [(flat[2 * i * per:(2 * i + 1) * per].view(shape), flat[(2 * i + 1) * per:(2 * i + 2) * per].view(shape))
              for i in range(layout.num_layers)]
    kv_bytes = 2 * layout.num_layers * per * layout.torch_dtype.itemsize
    generations = np.frombuffer(buffer, dtype=np.int64, count=num_blocks, offset=kv_bytes)
    if writable:
        generations.flags.writeable = True
    return caches, generations


class SharedKVCache:
    """A worker's own KV cache in a memfd, zeroed and touched now like torch.zeros's (a page
    first touched in a copy would cost that copy a page fault), with a count per block of the
    times the block pool handed it out (`bump`, the pool's on_allocate): KV is written into a
    block only after an allocation, so a block whose count is unchanged holds the same KV."""

    def __init__(self, num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, first_head: int = 0):
        num_blocks, block_size, heads, head_dim = shape
        layout = KVLayout(num_layers, block_size, heads, head_dim, str(dtype).removeprefix("torch."))
        self._segment = KVSegment("", os.getpid(), -1, num_blocks,
                                  {f: getattr(layout, f) for f in KVLayout.__dataclass_fields__},
                                  secrets.randbits(63), first_head)
        self.fd = os.memfd_create("pdcluster-kv", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self._segment.size)
        self._map = mmap.mmap(self.fd, self._segment.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.kv_caches, self.generations = _views(self._map, layout, num_blocks, writable=True)
        for k, v in self.kv_caches:
            k.zero_()
            v.zero_()

    @property
    def nonce(self) -> int:
        return self._segment.nonce

    def bump(self, blocks) -> None:
        """Count an allocation of each block (before the engine writes KV into them)."""
        self.generations[[b.block_id for b in blocks]] += 1

    def segment(self, node: str) -> KVSegment:
        return dataclasses.replace(self._segment, node=node, fd=self.fd)


class PeerCaches:
    """The same-node peers' caches this worker has mapped, read-only, by peer id."""

    def __init__(self):
        self._maps: dict[str, tuple[KVSegment, mmap.mmap, KVCaches, np.ndarray]] = {}

    def open(self, peer: str, segment: KVSegment, mine: KVCaches, writable: bool = False
             ) -> tuple[KVCaches, np.ndarray]:
        """The peer's cache and allocation counts (mapped on first use, again when its process
        changed). Raises OSError when it cannot be mapped from here, ValueError when its layout
        differs from `mine` (but for the number of heads: tensor-parallel ranks hold a share).
        `writable`: mapped for writing too (the other ranks of this worker's own cache)."""
        known = self._maps.get(peer)
        if known is not None and known[0] == segment:
            return known[2], known[3]
        theirs = KVLayout(**segment.layout)
        here = KVLayout.of(mine)
        dataclasses.replace(here, num_kv_heads=theirs.num_kv_heads).check_compatible(theirs, peer)
        with open(f"/proc/{segment.pid}/fd/{segment.fd}", "r+b" if writable else "rb") as f:
            if os.fstat(f.fileno()).st_size != segment.size:
                raise OSError(f"{peer}'s KV segment is not the size it says ({segment.size} bytes)")
            # MAP_POPULATE: its page table entries now, not one page fault per 4 KiB in each copy.
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mapped = mmap.mmap(f.fileno(), segment.size, mmap.MAP_SHARED | mmap.MAP_POPULATE, prot)
        caches, generations = _views(mapped, theirs, segment.num_blocks, writable=writable)
        self.close(peer)
        self._maps[peer] = (segment, mapped, caches, generations)
        return caches, generations

    def close(self, peer: str) -> None:
        """Forget a peer's mappings (it died or restarted; `peer#r`: its rank r's cache); its
        memory goes once nothing maps it."""
        for key in [k for k in self._maps if k == peer or k.startswith(peer + "#")]:
            self._unmap(key)

    def _unmap(self, key: str) -> None:
        known = self._maps.pop(key, None)
        if known is not None:
            try:
                known[1].close()
            except BufferError:             # a view is still in use somewhere: the GC unmaps it
                pass

    def close_all(self) -> None:
        for peer in list(self._maps):
            self.close(peer)


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the stretches where both block lists step by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            s0, d0, n = runs[-1]
            runs[-1] = (s0, d0, n + 1)
        else:
            runs.append((s, d, 1))
    return runs


# A worker's KV cache by KV heads: (first head, caches holding the heads from it) per
# tensor-parallel rank, in rank order; one part without tensor parallelism.
HeadParts = list[tuple[int, KVCaches]]


def whole_heads(parts: HeadParts, num_blocks: int) -> KVCaches:
    """An empty cache of `num_blocks` blocks with every head of `parts` (a tensor-parallel
    worker's KV as it travels between nodes: gathered from its ranks, or scattered to them)."""
    k = parts[0][1][0][0]
    shape = (num_blocks, k.shape[1], sum(c[0][0].shape[2] for _, c in parts), k.shape[3])
    return [(torch.empty(shape, dtype=k.dtype), torch.empty(shape, dtype=k.dtype)) for _ in parts[0][1]]


def copy_blocks(src: KVCaches, src_ids: list[int], dst: KVCaches, dst_ids: list[int], midway=None) -> int:
    """Copy blocks src_ids of `src` into blocks dst_ids of `dst` (both caches hold every head)."""
    return copy_heads([(0, src)], src_ids, [(0, dst)], dst_ids, midway)


def copy_heads(src: HeadParts, src_ids: list[int], dst: HeadParts, dst_ids: list[int], midway=None) -> int:
    """Copy blocks src_ids of a cache split by KV heads into blocks dst_ids of another, split
    alike or not (tensor-parallel workers of different sizes): each destination part gets its
    heads from the source parts that hold them. Layer by layer, one copy per stretch of
    consecutive blocks on both sides and per pair of parts that share heads. Returns bytes.
    `midway()` runs once about half the copies are done (a fault point: the blocks then hold
    part of the payload)."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} blocks to copy into {len(dst_ids)}")
    pairs = []                              # (source caches, their heads, destination caches, theirs)
    for d0, dc in dst:
        dn, covered = dc[0][0].shape[2], 0
        for s0, sc in src:
            lo, hi = max(s0, d0), min(s0 + sc[0][0].shape[2], d0 + dn)
            if lo < hi:
                pairs.append((sc, slice(lo - s0, hi - s0), dc, slice(lo - d0, hi - d0)))
                covered += hi - lo
        if covered != dn:
            raise KVLayoutMismatch(f"the source's KV heads cover {covered} of the {dn} from head {d0} here: "
                                   "both workers must serve the same model")
    runs = _runs(src_ids, dst_ids)
    copies = [(s[:, :, sh], d[:, :, dh]) if s.shape[2] != sh.stop - sh.start or d.shape[2] != dh.stop - dh.start
              else (s, d)
              for sc, sh, dc, dh in pairs for (sk, sv), (dk, dv) in zip(sc, dc) for s, d in ((sk, dk), (sv, dv))]
    if not runs:
        return 0
    half = len(copies) // 2
    if midway is None:
        return _copy_runs(copies, runs)
    nbytes = _copy_runs(copies[:half], runs)
    midway()
    return nbytes + _copy_runs(copies[half:], runs)


def _copy_runs(copies: list[tuple[torch.Tensor, torch.Tensor]], runs: list[tuple[int, int, int]]) -> int:
    """Each run of blocks from each source into its destination: in one C++ call that lets go of
    Python's lock throughout (workers/csrc/kv_copy.cpp), else a torch copy_ per tensor and run
    (each of which takes the lock back, and waits for it while another thread runs Python)."""
    if not copies:
        return 0
    kernels = cpu_kernels.load() if copies[0][0].device.type == "cpu" else None
    if kernels is not None:
        return kernels.copy_block_runs([s for s, _ in copies], [d for _, d in copies],
                                       [x for run in runs for x in run])
    nbytes = 0
    for s, d in copies:
        for s0, d0, n in runs:
            d[d0:d0 + n].copy_(s[s0:s0 + n])
            nbytes += n * s[0].numel() * s.element_size()
    return nbytes
