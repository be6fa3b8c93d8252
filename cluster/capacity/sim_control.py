"""The pool-ratio controller inside the simulator: every `interval_s` it gathers the signals the
serving loop does, read the same way (`cluster.run.controller.observe` on a request log kept on the
simulated clock: arrivals with their prompt lengths and the output they ask for, SLO
attainment of the requests sent since the last change took effect; queued prefill work and
handoffs waiting for decode room; the pools' capacities from the cost model; a trace's
requests ask for the output they get), asks `cluster.run.controller.decide`, and carries
the change out the way a live cluster does: the `count` least loaded workers of the donor pool
leave it at once (no new work), drain (a decode worker finishes its sequences, a prefill worker
its prompts and the handoffs of its held KV), flip their role without reloading anything, and
rejoin the other pool (or, removed, leave the cluster); added workers join at once. Plain
Python, like the simulator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.run.controller import (ADD_DECODE, ADD_PREFILL, NONE, REMOVE_DECODE, REMOVE_PREFILL, TO_DECODE, TO_PREFILL,
                                ControllerConfig, Decision, Signals, decide, observe)
from cluster.capacity.simulate import SimCluster, SimEngine, Simulator, SimWorker
from router.slo import RequestLog
from workers.names import DECODE, DISAGGREGATED, PREFILL


@dataclass(frozen=True, slots=True)
class SimControl:
    """The controller's settings in the simulator (from `simulate`'s flags, which are `serve`'s)."""
    config: ControllerConfig
    interval_s: float
    window_s: float
    slo_ttft_s: float
    slo_tpot_s: float


class ControlledSimulator(Simulator):
    def __init__(self, cluster: SimCluster, control: SimControl, **kw):
        if cluster.mode != DISAGGREGATED:
            raise ValueError("the pool-ratio controller needs --mode disaggregated")
        if cluster.prefill_cost != cluster.decode_cost:
            raise ValueError("the controller moves workers between pools: both pools need the same costs "
                             "(one tensor-parallel degree)")
        if cluster.num_prefill + cluster.num_decode > control.config.max_workers:
            raise ValueError(f"{cluster.num_prefill + cluster.num_decode} workers start above the budget of "
                             f"{control.config.max_workers}")
        super().__init__(cluster, **kw)
        self.control = control
        self.requests = RequestLog(control.window_s, clock=lambda: self.now)
        self.decisions: list[dict] = []
        self.role_changes = 0
        self.removed = 0
        self.last_change = -math.inf                    # when the last change was decided
        self.settled = -math.inf                        # when its last worker rejoined (or left)
        self.last_decision: Decision | None = None
        self.shift_at = -math.inf                       # where the load last shifted (the window starts there)
        self.draining: dict[str, str | None] = {}       # worker id -> the pool it moves to (None: it leaves)
        self._vocab, self._max_len = kw.get("vocab_size", 32000), kw.get("max_model_len", 1 << 30)
        self._pending_arrivals = 0
        self._added = 0

    def run(self, requests):
        self._pending_arrivals = len(requests)
        self._at(self.control.interval_s, self._control)
        return super().run(requests)

    # -- signals ----------------------------------------------------------------------------------
    def _arrive(self, rid, r) -> None:
        self._pending_arrivals -= 1
        self.requests.arrived(r.prompt_len, r.output_len)
        super()._arrive(rid, r)

    def _finished(self, tr) -> None:
        tpot = (tr.end_s - tr.first_s) / (tr.count - 1) if tr.count > 1 else 0.0
        c = self.control
        self.requests.finished(tr.sent_s, tr.count, tr.request.output_len, tr.first_s - tr.sent_s <= c.slo_ttft_s,
                               tpot <= c.slo_tpot_s)

    def signals(self) -> Signals:
        c, now = self.control, self.now
        o = observe(self.requests, now, c.interval_s, c.window_s, max(self.shift_at, 0.0), self.settled)
        if o.shifted:
            self.shift_at = o.start
        prompt, output = o.mean_prompt_tokens, o.mean_output_tokens
        cost, sched = self.c.prefill_cost, self.c.engine.scheduler
        decode = [x.engine.load_report(x.worker_id, x.role, 0) for x in self.pools[DECODE]]
        return Signals(
            now=now, num_prefill=len(self.pools[PREFILL]), num_decode=len(self.pools[DECODE]),
            arrival_rate=o.arrival_rate, mean_prompt_tokens=prompt, mean_output_tokens=output,
            prefill_tokens_per_s=cost.prefill_tokens_per_s(prompt or 1, sched.max_num_batched_tokens),
            decode_tokens_per_s=cost.decode_tokens_per_s(prompt + output / 2 or 1, c.slo_tpot_s, sched.max_num_seqs),
            queued_prefill_tokens=sum(x.engine.load_report(x.worker_id, x.role, 0).queued_prefill_tokens
                                      for x in self.pools[PREFILL]),
            ttft_attainment=o.ttft_attainment, tpot_attainment=o.tpot_attainment,
            draining=len(self.draining),
            waiting_handoffs=sum(len(x.waiting_room) for x in self.workers.values() if x.role == DECODE),
            decode_kv_usage=sum(r.kv_blocks_used for r in decode) / max(1, sum(r.kv_blocks_total for r in decode)))

    # -- the loop ---------------------------------------------------------------------------------
    def _control(self) -> None:
        s = self.signals()
        d = decide(s, self.control.config, self.last_change, self.last_decision)
        if d.action != NONE:
            self.last_change = self.settled = self.now
            self.last_decision = d
            self.decisions.append({"t": self.now, "action": d.action, "count": d.count, "reason": d.reason,
                                   "prefill": s.num_prefill, "decode": s.num_decode})
            if d.action in (TO_PREFILL, TO_DECODE, REMOVE_PREFILL, REMOVE_DECODE):
                donor = DECODE if d.action in (TO_PREFILL, REMOVE_DECODE) else PREFILL
                to = {TO_PREFILL: PREFILL, TO_DECODE: DECODE}.get(d.action)
                # the least loaded leave; one always stays
                pool = sorted(self.pools[donor], key=lambda x: len(x.engine._seqs) + len(x.waiting_room) + x.receiving)
                for w in pool[:max(0, min(d.count, len(pool) - 1))]:
                    self._move(w, to)
            elif d.action in (ADD_PREFILL, ADD_DECODE):
                for _ in range(d.count):
                    self._add(PREFILL if d.action == ADD_PREFILL else DECODE)
        if self._pending_arrivals or self.in_flight:
            self._at(self.now + self.control.interval_s, self._control)

    def _move(self, w: SimWorker, to: str | None) -> None:
        """Out of its pool now; into the other (or out of the cluster) once drained."""
        self.pools[w.role].remove(w)
        self.pool_ids[w.role].remove(w.worker_id)
        self.draining[w.worker_id] = to
        if not w.busy:
            self._idle(w)

    def _add(self, role: str) -> None:
        self._added += 1
        wid = f"{role}-added-{self._added}"
        cost = self.c.prefill_cost
        w = SimWorker(wid, role, SimEngine(self.c.engine, cost, lambda: self.now, self._vocab, self._max_len), cost)
        self.workers[wid] = w
        self.pools[role].append(w)
        self.pool_ids[role].append(wid)

    def _idle(self, w: SimWorker) -> None:
        if w.worker_id not in self.draining or w.engine._seqs or w.inbox or w.waiting_room or w.receiving:
            return
        to = self.draining.pop(w.worker_id)
        if not self.draining:
            self.settled = self.now
            if self.decisions:
                self.decisions[-1]["settled"] = self.now
        if to is None:
            del self.workers[w.worker_id]
            self.removed += 1
            return
        w.role = to
        self.pools[to].append(w)
        self.pool_ids[to].append(w.worker_id)
        self.role_changes += 1
