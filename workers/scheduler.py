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

The policy orders the queues:
  fcfs      arrival;
  priority  (priority, arrival), lower first. With priority inheritance (the default), the
            prefill work (running sequences' chunks and waiting prompts to admit) is ordered by
            effective priority as one queue, so a waiting request is not held behind the chunks
            of lower-priority prompts already running; and a waiting prompt whose next uncached
            full blocks a running sequence is computing (the same block hashes) waits for them
            instead of computing them twice, lending that sequence its priority until they are
            computed (`Priority`): the inversion is bounded by that shared prefill;
  deadline  running sequences with output first (one token each per step; the tightest TPOT
            first), then the prefill work as one queue by least slack = TTFT deadline - now -
            remaining prompt tokens x seconds per token (measured: `observe_step`), those that
            can still meet their deadline before those that cannot (negative slack).
Victims of preemption are the last in the running order: the lowest (effective) priority, or the
prefill work that can no longer meet its deadline, then the one with the most slack.
"""
from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.config import SchedulerConfig
from workers.cost_model import DecodeStepFit
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
                 cost_model: PreemptionCostModel | None = None, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.kv = kv
        self.cost_model = cost_model
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []        # ordered by the policy's key: victims at the end
        self.swapped: deque[Sequence] = deque()
        self.stats = SchedulerStats()
        self.watermark_blocks = int(cfg.watermark * kv.pool.num_blocks)
        self.prefill_s_per_token = cfg.prefill_s_per_token     # deadline: measured from full steps
        self.decode_steps = DecodeStepFit()                     # a decode worker's admission by TPOT
        self.policy: QueuePolicy = POLICIES[cfg.policy](self)
        # Chunked: one queue of prefill work (running chunks and waiting prompts) in the policy's order.
        self.merged = cfg.chunked_prefill and self.policy.merged

    # -- queue management --------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._insert(self.waiting, seq)

    def observe_step(self, num_tokens: int, seconds: float, num_seqs: int = 0) -> None:
        """A step's measured time: steps of at least half the budget (where the per-token cost,
        not the step's fixed cost, dominates) update the seconds-per-prefill-token estimate;
        decode-only steps (a token per sequence) fit the decode step's cost by its rows."""
        if 2 * num_tokens >= self.cfg.max_num_batched_tokens and seconds > 0:
            self.prefill_s_per_token += 0.2 * (seconds / num_tokens - self.prefill_s_per_token)
        if num_seqs and num_tokens == num_seqs and seconds > 0:
            self.decode_steps.observe(num_seqs, seconds)

    def decode_room(self, rows: int, tpot_s: float | None) -> bool:
        """Whether a decode step of `rows` sequences (those running and one more) would stay
        within the tightest TPOT target among the running ones and `tpot_s` (the newcomer's):
        True with no target, nothing running (one sequence always runs) or no fit yet."""
        targets = [s.tpot_s for s in self.running if s.tpot_s] + ([tpot_s] if tpot_s else [])
        if not targets or not self.running:
            return True
        predicted = self.decode_steps.predict(rows)
        return predicted is None or predicted <= min(targets)

    def _insert(self, queue, seq: Sequence) -> None:
        """Keep a queue ordered by the policy's key; appending is the common, O(1) case."""
        key = self.policy.key(seq)
        if not queue or self.policy.key(queue[-1]) <= key:
            queue.append(seq)
        else:
            keys = [self.policy.key(s) for s in queue]
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
        self.policy.forget(seq)

    # -- the step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        whole = not self.cfg.chunked_prefill
        self.policy.before_step()
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
            n = seq.num_tokens - seq.num_computed_tokens
            if self.merged and (n > 1 or not seq.num_output_tokens):   # prefill work: waiting
                key = self.policy.key(seq)                                    # prompts before it go first
                while budget > 0 and (admitted := self._admit(out, budget, before=(key, i))):
                    budget -= admitted
                    i += 1
                if budget == 0:
                    break
            n = min(n, budget)
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
        while budget > 0 and (admitted := self._admit(out, budget, whole)):
            budget -= admitted
        return max(0, budget)

    def _admit(self, out: SchedulerOutput, budget: int, whole: bool = False,
               before: tuple[tuple, int] | None = None) -> int:
        """Admit the first waiting sequence that may start (with inheritance: not one waiting for
        a holder's blocks); the tokens it got, 0 when none can start now. `before` (key, index):
        only one ordered before that running sequence's key, placed at that index."""
        if not self.waiting or len(self.running) >= self.cfg.max_num_seqs:
            return 0
        if before is not None and (out.preempted or self.swapped):   # as after the running batch
            return 0
        for seq in self.waiting:
            if before is not None and not self.policy.key(seq) < before[0]:
                return 0
            computed, num_cached = self.kv.get_computed_blocks(seq)
            if self.policy.holder(seq, num_cached) is None:
                break
        else:
            return 0
        n = seq.num_tokens - num_cached
        if whole and n > budget and out.scheduled:
            return 0
        n = n if whole else min(n, budget)
        # With nothing running, admit regardless of the watermark: nothing else could free room.
        watermark = self.watermark_blocks if self.running else 0
        if not self.kv.can_allocate(seq, n, computed, num_cached, watermark):
            return 0
        self.waiting.remove(seq)
        self.kv.allocate(seq, n, computed, num_cached)
        if seq.num_preemptions == 0:
            self.stats.prefix_cache_queries += seq.num_tokens
            self.stats.prefix_cache_hits += num_cached
            seq.num_cached_tokens = num_cached
        seq.num_computed_tokens = num_cached
        if before is None:
            self.add_running(seq)
        else:                                    # ahead of the running sequence it outranks
            seq.status = SequenceStatus.RUNNING
            self.running.insert(before[1], seq)
        out.scheduled.append((seq, n))
        return n

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


# -- the queue policies (--scheduling-policy) ------------------------------------------------------
class QueuePolicy:
    """How a scheduler orders its queues: `key` sorts the running, waiting and swapped sequences
    (victims of preemption last); `before_step` reorders what the order depends on at each step;
    `holder` is the running sequence a waiting prompt waits for instead of starting (None: it may
    start); `forget` drops what the policy keeps of a finished sequence. `merged`: with chunked
    prefill, the running prompts' chunks and the waiting prompts form one queue of prefill work
    in this order (else running sequences go first)."""
    merged = False

    def __init__(self, scheduler: Scheduler):
        self.s = scheduler

    def key(self, seq: Sequence) -> tuple:
        return (seq.arrival_time,)

    def before_step(self) -> None:
        pass

    def holder(self, seq: Sequence, num_cached: int) -> Sequence | None:
        return None

    def forget(self, seq: Sequence) -> None:
        pass


class FCFS(QueuePolicy):
    """Arrival order."""


class Priority(QueuePolicy):
    """(priority, arrival), lower first; with inheritance (`priority_inheritance`), a waiting
    prompt waits for the running sequence computing its next uncached blocks and lends it its
    priority, and the prefill work is one queue by effective priority."""

    def __init__(self, scheduler: Scheduler):
        super().__init__(scheduler)
        self.inherit = self.merged = scheduler.cfg.priority_inheritance
        self.boosts: dict[str, int] = {}          # holder id -> the priority it inherits
        self.computing: dict[bytes, Sequence] = {}   # block hash -> the running sequence computing it

    def key(self, seq: Sequence) -> tuple:
        return (min(seq.priority, self.boosts.get(seq.seq_id, seq.priority)), seq.arrival_time)

    def before_step(self) -> None:
        if self.inherit:
            self._inherit()

    def _inherit(self) -> None:
        """Find, for each waiting prompt, the running sequence computing its next uncached full
        block (`holder`), lend each holder the best priority waiting on it, and order the running
        batch by the priorities in effect. Rebuilt every step, so a boost ends when the shared
        blocks are computed (they are cached, so nobody waits on them) and when its holder
        finishes, is aborted or preempted (it computes nothing): its waiters then compute the
        blocks themselves. A chain (a waiter whose prefix runs on past a holder's prompt, into
        blocks another running sequence computes) resolves link by link: only running sequences
        compute blocks, so each wait is on one."""
        s, kv = self.s, self.s.kv
        bs = kv.block_size
        self.computing = {h: r for r in s.running if r.num_computed_tokens < r.num_prompt_tokens
                          for h in r.block_hashes[r.num_computed_tokens // bs:r.num_prompt_tokens // bs]}
        boosts: dict[str, int] = {}
        if self.computing:
            for seq in s.waiting:
                holder = self.holder(seq, kv.get_computed_blocks(seq)[1])
                if holder is not None:
                    boosts[holder.seq_id] = min(boosts.get(holder.seq_id, holder.priority), seq.priority)
        if boosts or self.boosts:
            self.boosts = boosts
            s.running.sort(key=self.key)

    def holder(self, seq: Sequence, num_cached: int) -> Sequence | None:
        """The running sequence computing `seq`'s next uncached full block (hashes chain, so the
        same hash is the same prefix), if that block is one `seq` would take from the cache."""
        if not self.computing:
            return None
        kv = self.s.kv
        m = num_cached // kv.block_size
        if not kv.pool.enable_caching or m >= (seq.num_tokens - 1) // kv.block_size:
            return None
        if seq.prompt_logprobs is not None:      # computes its whole prompt itself
            return None
        return self.computing.get(seq.block_hashes[m])


class Deadline(QueuePolicy):
    """Sequences with output first (one token each per step; the tightest TPOT first), then the
    prefill work as one queue by least slack (TTFT deadline - now - remaining prompt tokens x the
    scheduler's measured seconds per token), the hopeless last."""
    merged = True

    def __init__(self, scheduler: Scheduler):
        super().__init__(scheduler)
        self.now = 0.0                       # the clock at this step's start
        self.order: dict[str, float] = {}    # each sequence's ordering slack, fixed
        self.late: set[str] = set()          # sequences that can no longer meet theirs

    def before_step(self) -> None:
        s = self.s
        self.now = s.clock()
        s.running.sort(key=self.key)
        if len(s.waiting) > 1:
            s.waiting = deque(sorted(s.waiting, key=self.key))

    def key(self, seq: Sequence) -> tuple:
        """Sequences with output first (decoding, or back after a preemption: their TPOT is
        running), tightest TPOT first; then first-token work by least slack, the hopeless
        (negative slack now) last; no deadline: after those that have one and can meet it.

        The order must not follow progress: preemption takes the last in order, so a key that
        grew as a prefill advanced would let two prefills that do not fit together preempt each
        other in turn for ever (each recompute undoing the other's progress). So the slack that
        orders is taken once, at the first look (deadline - all the prompt's work: `now` is the
        same for all), and hopelessness, judged on the work left, is final once reached: each
        sequence changes class at most once, and within a class the order is fixed."""
        if seq.num_output_tokens:
            return (0, seq.tpot_s or math.inf, seq.arrival_time)
        if seq.ttft_deadline is None:
            return (1, False, math.inf, seq.arrival_time)
        rid, per_token = seq.seq_id, self.s.prefill_s_per_token
        order = self.order.get(rid)
        if order is None:
            order = self.order[rid] = seq.ttft_deadline - seq.num_tokens * per_token
        late = rid in self.late
        if not late and seq.ttft_deadline - self.now - (seq.num_tokens - seq.num_computed_tokens) * per_token < 0:
            self.late.add(rid)
            late = True
        return (1, late, order, seq.arrival_time)

    def forget(self, seq: Sequence) -> None:
        self.order.pop(seq.seq_id, None)
        self.late.discard(seq.seq_id)


POLICIES: dict[str, type[QueuePolicy]] = {"fcfs": FCFS, "priority": Priority, "deadline": Deadline}
