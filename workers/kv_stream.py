"""A long prompt's KV copied to its decode worker while it is still being prefilled (plain
Python, no torch or Ray: the decode worker's pull thread and loop thread use it).

    prefill worker: chunk 1 ─ chunk 2 ─ chunk 3 ─ held
    events:             ╰ blocks so far ╰ blocks so far ╰ held KV + first token
    decode worker:   DecodeOp(streaming) ─ reserve ─ copy ─ KVMoreOp ─ copy ─ KVMoreOp(final) ─ copy the rest ─ decode

Every word names all the full blocks computed so far, each with its allocation count
(workers/kv_shm.py), so a word lost or overtaken costs nothing but a later, bigger copy. A block
counts as copied when its count read after the copy is the one the word gave; the held KV's
word decides: each of its blocks is copied again unless it was copied with the same id and
count (a block the prefill worker freed and allocated again meanwhile, e.g. preempted by
recompute, comes again), and the whole is checked after the last copy as an unstreamed pull is.
"""
from __future__ import annotations

import threading
import time


class StreamEnded(Exception):
    """The streamed pull ends without the KV: the request was aborted (`aborted`), or its words
    stopped coming or contradicted it."""

    def __init__(self, message: str, aborted: bool = False):
        super().__init__(message)
        self.aborted = aborted


def newer(kv, final: bool, old_kv, old_final: bool) -> bool:
    """Whether a word (`kv`, `final`) says more than an earlier one: the held KV's word says the
    most, then the word naming more blocks."""
    return not old_final and (final or len(kv.block_ids) > len(old_kv.block_ids))


class KVFeed:
    """What the router has said of one streamed request's KV so far: the latest word (a HeldKV),
    whether it is the held KV itself (`final`), and when that came. The loop thread tells; the
    pull thread waits. Words only move forward: one naming fewer blocks than the last, or any
    after the final one, is stale (they may arrive out of order) and ignored."""

    def __init__(self, kv, clock=time.monotonic):
        self._cv = threading.Condition()
        self.kv, self.final, self.final_at = kv, False, None
        self._ended: StreamEnded | None = None
        self._clock = clock

    def tell(self, kv, final: bool) -> None:
        with self._cv:
            if not newer(kv, final, self.kv, self.final):
                return
            self.kv, self.final = kv, final
            if final:
                self.final_at = self._clock()
            self._cv.notify_all()

    def end(self, reason: str, aborted: bool = False) -> None:
        """No more words: the request was aborted, or the stream cannot go on."""
        with self._cv:
            if self._ended is None:
                self._ended = StreamEnded(reason, aborted)
            self._cv.notify_all()

    def wait(self, seen, timeout_s: float):
        """(kv, final): the first word newer than `seen`. Raises StreamEnded when the stream
        ended or no newer word came within `timeout_s`."""
        deadline = self._clock() + timeout_s
        with self._cv:
            while self._ended is None and self.kv is seen and not self.final:
                left = deadline - self._clock()
                if left <= 0:
                    raise StreamEnded(f"no word of the prompt's KV for {timeout_s:g}s")
                self._cv.wait(left)
            if self._ended is not None:
                raise self._ended
            return self.kv, self.final


class CopyPlan:
    """Which of a streamed pull's reserved blocks hold their KV already: destination block
    `dst[i]` receives source block `kv.block_ids[skip + i]`."""

    def __init__(self, dst: list[int], skip: int):
        self.dst, self.skip = dst, skip
        self._have: dict[int, tuple[int, int]] = {}     # i -> (source block, its count) copied and checked

    def needed(self, kv) -> tuple[list[int], list[int], list[int]]:
        """(source blocks, destination blocks, their expected counts) of the word's blocks not
        yet copied with the same source block and count. A word naming more blocks than are
        reserved is refused (ValueError): the prompt is not the one reserved for."""
        ids, gens = kv.block_ids[self.skip:], kv.generations[self.skip:]
        if len(ids) > len(self.dst):
            raise ValueError(f"the prefill worker names {len(ids)} blocks after the first {self.skip}; "
                             f"{len(self.dst)} are reserved here")
        need = [i for i in range(len(ids)) if self._have.get(i) != (ids[i], gens[i])]
        return [ids[i] for i in need], [self.dst[i] for i in need], [gens[i] for i in need]

    def copied(self, kv, src: list[int], counts_after: list[int]) -> int:
        """The blocks `src` of word `kv` were copied and their counts read after: the ones that
        kept their count hold their KV (the others come again). Returns how many kept it."""
        where = {b: i for i, b in enumerate(kv.block_ids[self.skip:])}
        gens = kv.generations[self.skip:]
        kept = 0
        for b, g in zip(src, counts_after):
            i = where[b]
            if g == gens[i]:
                self._have[i] = (b, g)
                kept += 1
            else:
                self._have.pop(i, None)
        return kept

    def complete(self, kv) -> bool:
        """Every reserved block holds the word's KV (the word names them all, as the held one does)."""
        ids, gens = kv.block_ids[self.skip:], kv.generations[self.skip:]
        return len(ids) == len(self.dst) and all(self._have.get(i) == (ids[i], gens[i]) for i in range(len(ids)))
