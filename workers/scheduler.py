"""The step scheduler: one token budget, running sequences first, then swapped, then waiting.

Plain Python over plain state (no torch, no Ray): the cluster, the tests and the simulator
run this same code.

Each step:
  1. running sequences, in order, get their next tokens (1 when decoding, a budget-capped
     chunk when prefilling); when blocks run out, the lowest-priority running sequence is
     preempted (possibly the one being scheduled) until the append fits;
  2. if nothing was preempted, swapped-out sequences come back (host -> device copies);
  3. if nothing was preempted and nothing waits in swap, waiting sequences are admitted while
     the budget, the running cap and the free-block watermark allow.
Swap-outs therefore never meet swap-ins in one step, so their copies cannot overlap.

Without chunked prefill (vLLM's v0 default, DistServe's baseline), a step that can admit
waiting prompts admits them whole and runs nothing else (decoding pauses for it); a prompt
longer than the budget runs alone. Otherwise the step decodes.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from workers.config import SchedulerConfig
from workers.kv_cache_manager import KVCacheManager
from workers.names import PREEMPTION_KINDS
from workers.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class PreemptionCostModel:
    """Chooses swap or recompute for a victim by estimated seconds of each.

    swap:      copy_ops * overhead + 2 * kv_bytes_per_token * n / copy_bytes_per_s
               (out now and in later: per layer a K and a V copy each way, each with a fixed cost)
    recompute: (2 * num_params * n + attn_flops_per_token_pair * n^2 / 2) / flops_per_s
    Swap pays a fixed cost, so the shortest victims recompute; recompute grows faster
    (the quadratic attention term), so long victims swap. With no host room, recompute.
    """
    kv_bytes_per_token: int
    num_params: int
    attn_flops_per_token_pair: int      # 4 * layers * num_heads * head_dim
    num_layers: int
    copy_bytes_per_s: float = 5e9
    flops_per_s: float = 5e10
    copy_overhead_s: float = 20e-6      # dispatch / launch cost of one indexed copy

    def prefers_swap(self, num_tokens: int) -> bool:
        swap_s = (4 * self.num_layers * self.copy_overhead_s
                  + 2 * self.kv_bytes_per_token * num_tokens / self.copy_bytes_per_s)
        recompute_s = (2 * self.num_params * num_tokens
                       + self.attn_flops_per_token_pair * num_tokens * num_tokens / 2) / self.flops_per_s
        return swap_s < recompute_s


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)   # (seq, num_new_tokens)
    swap_out: list[tuple[int, int]] = field(default_factory=list)         # (device, host) blocks
    swap_in: list[tuple[int, int]] = field(default_factory=list)          # (host, device) blocks
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    copies: list[tuple[int, int]] = field(default_factory=list)           # (source, destination) blocks

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.swap_out and not self.swap_in


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: dict = field(default_factory=lambda: dict.fromkeys(PREEMPTION_KINDS, 0))
    prefix_cache_queries: int = 0     # prompt tokens looked up
    prefix_cache_hits: int = 0        # of those, served from the cache


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager,
                 cost_model: PreemptionCostModel | None = None):
        self.cfg = cfg
        self.kv = kv
        self.cost_model = cost_model
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []        # ordered by (priority, arrival): victims at the end
        self.swapped: deque[Sequence] = deque()
        self.stats = SchedulerStats()
        self.watermark_blocks = int(cfg.watermark * kv.pool.num_blocks)

    # -- queue management --------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._insert(self.waiting, seq)

    def _key(self, seq: Sequence) -> tuple:
        if self.cfg.policy == "priority":
            return (seq.priority, seq.arrival_time)
        return (seq.arrival_time,)

    def _insert(self, queue, seq: Sequence) -> None:
        """Keep a queue ordered by the policy's key; appending is the common, O(1) case."""
        key = self._key(seq)
        if not queue or self._key(queue[-1]) <= key:
            queue.append(seq)
        else:
            keys = [self._key(s) for s in queue]
            queue.insert(bisect.bisect_right(keys, key), seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV arrived from elsewhere joins the batch, next token to compute."""
        seq.status = SequenceStatus.RUNNING
        self._insert(self.running, seq)

    def hold(self, seq: Sequence) -> None:
        """Stop scheduling a sequence but keep its blocks (the KV handoff's lease)."""
        self.running.remove(seq)
        seq.status = SequenceStatus.HELD

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence wherever it is and return its blocks."""
        queue = {SequenceStatus.RUNNING: self.running, SequenceStatus.WAITING: self.waiting,
                 SequenceStatus.SWAPPED: self.swapped}.get(seq.status)
        if queue is not None:                    # held or receiving ones sit in no queue
            queue.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # -- the step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        whole = not self.cfg.chunked_prefill
        if whole and self.waiting and not self.swapped:
            self._schedule_waiting(out, budget, whole=True)
            if out.scheduled:
                out.num_batched_tokens = sum(n for _, n in out.scheduled)
                return out
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            budget = self._schedule_swapped(out, budget)
            if not self.swapped and not whole:
                budget = self._schedule_waiting(out, budget)
        out.num_batched_tokens = self.cfg.max_num_batched_tokens - budget
        assert budget >= 0
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.append_slots(seq, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            break                                # seq itself was preempted: nothing after it
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.swapped[0]
            watermark = self.watermark_blocks if self.running else 0
            if not self.kv.can_swap_in(seq, watermark):
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            self.swapped.popleft()
            out.swap_in.extend(self.kv.swap_in(seq))
            self.add_running(seq)
            if not self.kv.append_slots(seq, n):   # came back, but its next tokens must wait
                break
            out.scheduled.append((seq, n))
            budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, whole: bool = False) -> int:
        """Admit waiting sequences; `whole`: each with all its uncomputed tokens, as many as the
        budget holds (the first one even when it alone exceeds it)."""
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            computed, num_cached = self.kv.get_computed_blocks(seq)
            n = seq.num_tokens - num_cached
            if whole and n > budget and out.scheduled:
                break
            n = n if whole else min(n, budget)
            # With nothing running, admit regardless of the watermark: nothing else could free room.
            watermark = self.watermark_blocks if self.running else 0
            if not self.kv.can_allocate(seq, n, computed, num_cached, watermark):
                break
            self.waiting.popleft()
            self.kv.allocate(seq, n, computed, num_cached)
            if seq.num_preemptions == 0:
                self.stats.prefix_cache_queries += seq.num_tokens
                self.stats.prefix_cache_hits += num_cached
                seq.num_cached_tokens = num_cached
            seq.num_computed_tokens = num_cached
            self.add_running(seq)
            out.scheduled.append((seq, n))
            budget -= n
        return max(0, budget)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        out.preempted.append(seq)
        if self._choose_swap(seq):
            out.swap_out.extend(self.kv.swap_out(seq))
            seq.status = SequenceStatus.SWAPPED
            self._insert(self.swapped, seq)
            self.stats.num_preemptions["swap"] += 1
        else:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self._insert(self.waiting, seq)   # by its key: ahead of later arrivals
            self.stats.num_preemptions["recompute"] += 1

    def _choose_swap(self, seq: Sequence) -> bool:
        mode = self.cfg.preemption_mode
        if mode == "recompute" or not self.kv.can_swap_out(seq) or seq.num_computed_tokens == 0:
            return False
        if mode == "swap":
            return True
        return self.cost_model is not None and self.cost_model.prefers_swap(seq.num_computed_tokens)
