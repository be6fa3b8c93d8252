"""Choosing a worker: power-of-two-choices on a load signal, or random / round-robin.

Plain Python over plain numbers (no Ray), so the router, the tests and the simulator share it.

Power-of-two-choices: sample two distinct workers uniformly, send to the less loaded. With n
balls into n bins the fullest bin holds ~log n / log log n balls under random placement, but
only ~log log n / log 2 with two choices (Azar, Broder, Karlin, Upfal 1994); it needs no
global view, so a stale or partial load report hurts it little.

Prefix-aware (`prefix`, prefill only): a worker that holds the prompt's first blocks in its
prefix cache computes only the rest. The candidates are the two sampled workers and the one
holding the longest prefix (router/prefix_index.py); each costs its queued prefill tokens plus
NEW_TOKEN_WEIGHT x the prompt tokens it would compute, and the cheapest wins. A token computed
again costs twice: the request waits for it, and so does everything queued behind it on that
worker (capacity spent twice on one prefix). So the match is followed while the queues differ
by less than twice what it saves, and a hot prefix spills onto a second worker only once its
first one's queue is that much longer (then both hold it).
"""
from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

from workers.messages import LoadReport
from workers.names import AUTO, P2C, RANDOM, ROUND_ROBIN
from workers.names import PICKING_POLICIES as POLICIES

NEW_TOKEN_WEIGHT = 2.0      # prefix-aware picking: a prompt token to compute, against one queued


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    worker_id: str
    load: float           # prefill: queued prefill tokens; decode: KV blocks in use + running


class Picker:
    def __init__(self, policy: str = P2C, seed: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"picking policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self._rng = random.Random(seed)
        self._rr = itertools.count()

    def pick(self, candidates: list[WorkerLoad]) -> str:
        loads = {c.worker_id: c.load for c in candidates}
        return self.choose(list(loads), loads.__getitem__)

    def choose(self, worker_ids: list[str], load_of: Callable[[str], float]) -> str:
        """Pick from `worker_ids`, asking `load_of` only for the loads it compares (two under
        p2c, none otherwise), so a pick costs the same for 4 workers or 400."""
        if not worker_ids:
            raise LookupError("no worker to pick from")
        if len(worker_ids) == 1:
            return worker_ids[0]
        if self.policy == RANDOM:
            return self._rng.choice(worker_ids)
        if self.policy == ROUND_ROBIN:
            return worker_ids[next(self._rr) % len(worker_ids)]
        a, b = self._two(worker_ids)
        return a if load_of(a) <= load_of(b) else b

    def choose_prefix(self, worker_ids: list[str], load_of: Callable[[str], float], matched: dict[str, int],
                      num_tokens: int, block_size: int) -> str:
        """Prefix-aware: of the two sampled workers and the best-matched one, the one with the
        least queued plus weighted new prefill tokens (`matched`: leading blocks each worker
        holds)."""
        if not worker_ids:
            raise LookupError("no worker to pick from")
        candidates = set(self._two(worker_ids)) if len(worker_ids) > 1 else {worker_ids[0]}
        pool = set(worker_ids)
        live = [w for w in matched if w in pool]
        if live:
            candidates.add(max(live, key=lambda w: (matched[w], -load_of(w))))

        def cost(w: str) -> tuple[float, int]:
            cached = min(matched.get(w, 0) * block_size, num_tokens - 1)
            return load_of(w) + NEW_TOKEN_WEIGHT * (num_tokens - cached), -cached
        return min(sorted(candidates), key=cost)

    def _two(self, worker_ids: list[str]) -> tuple[str, str]:
        n = len(worker_ids)                      # two distinct, uniformly (random.sample, cheaper)
        i = self._rng.randrange(n)
        j = self._rng.randrange(n - 1)
        return worker_ids[i], worker_ids[j + (j >= i)]


def prefill_load(report: LoadReport | None, inflight_tokens: int = 0) -> float:
    """Queued prefill tokens: reported by the worker, plus those sent since its last report
    (before its first report, only those)."""
    return (report.queued_prefill_tokens if report else 0) + inflight_tokens


def decode_load(report: LoadReport | None, inflight: int = 0) -> float:
    """KV blocks in use (as a fraction) plus running sequences (as a fraction of a small
    batch); requests sent since the last report count as running."""
    if report is None:
        return inflight / 64
    running = report.running + report.pending + report.receiving + inflight
    return report.kv_blocks_used / max(1, report.kv_blocks_total) + running / 64


def slot_ends(report: LoadReport | None, unreported: int = 0) -> list[int]:
    """Colocated: the decode steps until each of a worker's sequence slots that must free before
    a prompt sent there now runs frees, soonest first; its own slot last (empty: one is free, or
    the worker has not said its limit). Past the limit by the sequences it runs and queues, the
    `unreported` prompts sent since its report, and this one; each slot frees when a running
    sequence ends (LoadReport.ends_in); past those reported, at the spacing they end at."""
    if report is None or not report.max_seqs:
        return []
    return slots_past(report.running + report.waiting + unreported + 1 - report.max_seqs, report.ends_in)


def slots_past(need: int, ends: list[int]) -> list[int]:
    """`slot_ends` of a worker `need` sequences past its limit whose running sequences end in
    `ends` tokens (soonest first; the first ENDS_REPORTED, or all)."""
    if need <= 0:
        return []
    ends = ends[:need]
    if not ends:                       # none running yet (a burst in its queue): no end known
        return [0] * need
    spacing = max(1.0, ends[-1] / len(ends))
    return ends + [round(ends[-1] + spacing * i) for i in range(1, need - len(ends) + 1)]


def check_local_prefill(value: int | str) -> None:
    """--local-prefill-max-tokens: a count of tokens (0: always hand off), or "auto"."""
    if value != AUTO and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise ValueError(f"--local-prefill-max-tokens must be an integer >= 0 or 'auto', got {value!r}")
