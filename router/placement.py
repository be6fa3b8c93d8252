"""Where a request computes its prompt and where it decodes: one piece of code for the router's
dispatcher (router/dispatch.py) and the simulator (cluster/capacity/simulate.py), each on its own
view of the pools (`PoolView`), so that what the simulator predicts is what the router does.

    start:   a prompt's blocks, and which workers hold how many of them (the prefix index)
    first:   the worker that computes it: a prefill (or colocated) worker by the picking policy,
             or, disaggregated, the decode worker picked for it when it computes few enough
             tokens there (local prefill: no handoff), or, disaggregated with no active prefill
             worker (the controller's mixed role: splitting did not pay; or the prefill pool
             lost), a decode worker, which serves the request whole
    decode:  the decode worker a prefilled request goes to

Plain Python (no torch, no Ray): tests/test_policy_imports.py guards it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from router.picker import Picker
from router.prefix_index import PrefixIndex
from workers.cost_model import BatchShape, CostModel, local_prefill_limit
from workers.names import AUTO, COLOCATED, DECODE, P2C, PREFILL, PREFIX, first_role

# Local prefill AUTO keeps a decode worker's pace (its steps with decoding rows, a moving
# average over about PACE_STEPS of them: the seconds per token of the sequences it runs) within
# PACE_SHARE of the TPOT target, counting the prompt tokens it would take on.
PACE_STEPS = 8
PACE_SHARE = 0.7


class PoolView(Protocol):
    """The pools as a caller sees them, by worker id."""

    def active(self, role: str) -> list[str]:
        """The workers a request of this role may go to now."""

    def prefill_load(self, worker_id: str) -> float:
        """Prompt tokens it has queued (reported, and sent since its report)."""

    def decode_load(self, worker_id: str) -> float:
        """router/picker.py `decode_load` of its report and what was sent since."""

    def decoding(self, worker_id: str) -> tuple[int, int]:
        """(sequences it decodes, their context tokens): what a local prefill there delays."""

    def slot_ends(self, worker_id: str) -> list[int]:
        """Colocated: router/picker.py `slot_ends` of its report and what was sent since."""


class Start:
    """A prompt about to start: its length and block hashes, and which workers hold how many of
    its leading blocks (none known without a prefix index)."""
    __slots__ = ("num_tokens", "hashes", "matched", "block_size")

    def __init__(self, index: PrefixIndex | None, token_ids: list[int]):
        self.num_tokens = len(token_ids)
        self.hashes = index.hashes(token_ids) if index is not None else []
        self.matched = index.matches(self.hashes) if index is not None else {}
        self.block_size = index.block_size if index is not None else 0

    def uncached_on(self, worker_id: str) -> int:
        """Tokens the worker would compute: all but its cached leading blocks (and always the last)."""
        return self.num_tokens - min(self.matched.get(worker_id, 0) * self.block_size, self.num_tokens - 1)


class Placement:
    def __init__(self, mode: str, policy: str, seed: int | None, block_size: int,
                 local_prefill_max_tokens: int | str = 0):
        """`local_prefill_max_tokens` (disaggregated): a request with at most this many prompt
        tokens to compute on its decode worker is prefilled there; AUTO: as the cost model says
        (`price_local_prefill`), request by request; 0: never."""
        self.mode = mode
        self.prefill_picker = Picker(policy, seed)
        self.decode_picker = Picker(policy, None if seed is None else seed + 1)
        self.local_prefill_max_tokens = local_prefill_max_tokens if mode != COLOCATED else 0
        self._local_cost: tuple[Callable[[], CostModel | None], int] | None = None   # auto: the model, a chunk
        self.tpot_s: float | None = None         # auto: the TPOT target local prefills keep to
        self.paces: dict[str, float] = {}        # decode (colocated) worker -> its seconds per decoding step, lately
        self.handoff_s: float | None = None      # a handoff as seen (held -> first decode token), smoothed
        # The workers' prefix caches as the caller sees them, kept when picking uses them:
        # prefix-aware picking, or local prefills counting cached tokens.
        self.prefix_index = (PrefixIndex(block_size) if policy == PREFIX or self.local_prefill_max_tokens
                             else None)

    def price_local_prefill(self, cost: Callable[[], CostModel | None], max_chunk: int,
                            tpot_s: float | None = None) -> None:
        """With local prefill AUTO: decide with the step cost model `cost()` (None while there is
        none) for prompt chunks of at most `max_chunk` tokens (the scheduler's budget), keeping
        each decode worker's pace within PACE_SHARE of `tpot_s` (None: no TPOT target)."""
        self._local_cost = (cost, max_chunk)
        self.tpot_s = tpot_s

    def paces_role(self, role: str) -> bool:
        """Whether the steps of a worker of `role` feed `paces`: decode workers' under AUTO local
        prefill with a TPOT target, colocated workers' always (SLO admission prices a wait for
        a sequence slot at it, router/admission.py `_slot_wait`)."""
        return role == COLOCATED or (role == DECODE and self.tpot_s is not None)

    def observe_decode_steps(self, worker_id: str, step_s: float, count: int = 1) -> None:
        """`count` steps of `step_s` seconds each that decoding rows took on `worker_id`."""
        old = self.paces.get(worker_id)
        keep = (1 - 1 / PACE_STEPS) ** count
        self.paces[worker_id] = step_s if old is None else step_s + (old - step_s) * keep

    def forget(self, worker_id: str) -> None:
        self.paces.pop(worker_id, None)

    def observe_handoff(self, seconds: float) -> None:
        self.handoff_s = seconds if self.handoff_s is None else self.handoff_s + 0.1 * (seconds - self.handoff_s)

    def start(self, token_ids: list[int]) -> Start:
        return Start(self.prefix_index, token_ids)

    def roles_needed(self) -> tuple[str, ...]:
        """The pools a caller waits for while none of their workers is active but one is coming
        (`first` picks from them). Disaggregated, only the decode pool: its workers serve whole
        requests while the prefill pool has no active worker."""
        role = first_role(self.mode)
        return (DECODE,) if role == PREFILL else (role,)

    def first(self, start: Start, view: PoolView) -> tuple[str, bool]:
        """(the worker that computes the prompt, whether it is a decode worker computing it
        itself). The prefix index then holds the prompt's blocks there. Raises LookupError when
        a pool it needs has no active worker."""
        role = first_role(self.mode)
        chosen, local = None, False
        if role == PREFILL and not view.active(PREFILL) and view.active(DECODE):
            chosen, local = self._whole(start, view), True
        elif self.local_prefill_max_tokens and role == PREFILL:
            d = self.decode(view)
            if self.prefill_locally(d, start.uncached_on(d), view):
                chosen, local = d, True
        if chosen is None:
            chosen = self._prefill(role, start, view)
        if self.prefix_index is not None:
            self.prefix_index.add(chosen, start.hashes)
        return chosen, local

    def decode(self, view: PoolView) -> str:
        ids = view.active(DECODE)
        if not ids:
            raise LookupError(f"no live {DECODE} worker")
        return self.decode_picker.choose(ids, view.decode_load)

    def _whole(self, start: Start, view: PoolView) -> str:
        """The decode worker that serves a request whole (no prefill pool): by the picking policy
        on its queued prompt tokens, then, on a tie (the common case at light load, nothing
        queued), its decode load."""
        ids = view.active(DECODE)
        if self.prefill_picker.policy == PREFIX:
            return self.prefill_picker.choose_prefix(ids, view.prefill_load, start.matched, start.num_tokens,
                                                     self.prefix_index.block_size)
        return self.prefill_picker.choose(ids, lambda w: (view.prefill_load(w), view.decode_load(w)))

    def _prefill(self, role: str, start: Start, view: PoolView) -> str:
        ids = view.active(role)
        if not ids:
            raise LookupError(f"no live {role} worker")
        if self.prefill_picker.policy == PREFIX:
            return self.prefill_picker.choose_prefix(ids, view.prefill_load, start.matched, start.num_tokens,
                                                     self.prefix_index.block_size)
        if role == COLOCATED and self.prefill_picker.policy == P2C:
            return self._colocated(ids, view)
        return self.prefill_picker.choose(ids, view.prefill_load)

    def _colocated(self, ids: list[str], view: PoolView) -> str:
        """A colocated worker by when a prompt sent now would start there: the decode steps until
        a sequence slot frees for it (`slot_ends`; steps, not seconds: a pool's workers step
        alike, and the simulator, which runs this code, takes a worker's steady steps as one
        run, whose times the pick would otherwise see only as the run ends), then the prompt
        tokens queued ahead of it.
        Power-of-two-choices while one of the two has a slot free; past every slot of those two,
        the soonest of the pool (what SLO admission prices, router/admission.py `seat_wait`).
        By queued tokens alone, at 3x load (vLLM's client, two workers of 128 slots, both full)
        the queues were alike and the batches not: one worker's had filled later, so its slots
        freed later, and the prompts sent there started 0.84-1.06 s after arriving against
        0.05-0.56 s at the other; admission, pricing the slots soonest to free in the pool, let
        them in at 0.2-0.6 s and they missed the TTFT target."""
        steps: dict[str, int] = {}
        loads: dict[str, float] = {}

        def slot(w: str) -> int:
            if w not in steps:
                ends = view.slot_ends(w)
                steps[w] = ends[-1] if ends else 0
            return steps[w]

        def when(w: str) -> tuple[int, float]:
            if w not in loads:
                loads[w] = view.prefill_load(w)
            return slot(w), loads[w]
        chosen = self.prefill_picker.choose(ids, when)
        if len(ids) <= 2 or not slot(chosen):
            return chosen
        soonest = min(slot(w) for w in ids)         # the queued tokens only where that ties
        return min((w for w in ids if steps[w] == soonest), key=when)

    def prefill_locally(self, d: str, uncached: int, view: PoolView) -> bool:
        """Whether decode worker `d` should compute `uncached` prompt tokens itself. A number:
        up to it. AUTO (workers/cost_model.py `local_prefill_limit`): while the prefill pool has
        a queue (a burst: a closed loop's clients all come back when a batch ends together), when
        the prompts queued on `d` itself are no more than that queue (the shorter line for the
        first token, and the line SLO admission prices), when what it delays the sequences `d`
        decodes costs less than that queue plus the handoff as measured would cost the request,
        and (with a TPOT target) while the worker's pace with
        the prompt tokens queued there and these stays within PACE_SHARE of the target (`paced`);
        never beyond one chunk, and not before there is a cost model. With no queue the prefill
        pool computes it at once, and the decode batch's steps stay undisturbed: disaggregated.
        With any queue at the pool reason enough, each wave the decode gate let through went to
        the decode worker all but its first, and at a sustained overload (vLLM's client, Poisson
        at 3x) it prefilled 516 of 693 prompts beside its batch (TTFT p50 0.40 s, 53 past the
        target) while the prefill worker's 177 came at 0.18 s (1 past). The handoff, which comes
        after the first token, is left out of the comparison: counted in, the decode worker's
        line ran about 0.2 s longer than the pool's, and its prompts made most misses still."""
        limit = self.local_prefill_max_tokens
        if limit != AUTO:
            return uncached <= limit
        cost = self._local_cost[0]() if self._local_cost is not None else None
        if cost is None or uncached > self._local_cost[1]:
            return False
        queued = min((view.prefill_load(p) for p in view.active(PREFILL)), default=0)
        if not queued:
            return False
        here = view.prefill_load(d)
        if here > queued:
            return False
        num_decode, context = view.decoding(d)
        remote_s = (self.handoff_s or 0.0) + queued / cost.prefill_tokens_per_s(uncached, self._local_cost[1])
        return (local_prefill_limit(cost, num_decode, context, remote_s, uncached) >= uncached
                and self.paced(cost, d, num_decode, context, here + uncached))

    def paced(self, cost: CostModel, d: str, num_decode: int, context: int, tokens: int) -> bool:
        """Whether decode worker `d` keeps its sequences' pace within PACE_SHARE of the TPOT
        target with `tokens` more prompt tokens to compute: its pace lately plus what they add to
        a step, spread over PACE_STEPS steps. A sustained overload keeps the prefill pool's queue
        long, and without this bound the decode worker would take a prompt every step and its
        sequences miss their TPOT (0.1-0.15 s a token at a 0.1 s target, here); a closed loop's
        wave to a worker whose steps are fast still goes there. Nobody decoding: nobody delayed."""
        if self.tpot_s is None or num_decode == 0:
            return True
        decode = BatchShape(num_decode=num_decode, decode_context=context)
        added = cost.step_s(decode + BatchShape(1, tokens, tokens * tokens, 0)) - cost.step_s(decode)
        return self.paces.get(d, 0.0) + added / PACE_STEPS <= PACE_SHARE * self.tpot_s
