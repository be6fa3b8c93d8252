"""The pool-ratio controller in the serving process: every `interval_s` it reads what the router
measured, asks `cluster.run.controller.decide` (the same function `pdcluster simulate --controller`
runs), logs and counts the decision, and carries it out through the pool registry:

    move  a worker between pools: the least loaded of the donor pool drains (takes no new work;
          what it runs finishes), flips its role on its own loop with weights and cache kept, and
          rejoins (router/pools.py, router/dispatch.py finish the drain);
    add   a worker actor (the launcher starts it; it joins its pool once it has loaded);
    remove  a worker: it drains, then leaves the cluster.

The signals: arrivals, their prompt lengths and the output they ask for over `window_s`, SLO
attainment of the requests sent since the last change (the router's request log, read by
`cluster.run.controller.observe` as the simulator reads its own), queued prefill tokens from the
workers' load reports, and each pool's capacity from the cost model (workers/cost_model.py)
fitted on a worker's timed step grid before serving and on the workers' own steps while
serving. Plain Python and asyncio: no Ray, no torch (the launcher's hooks are passed in).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from cluster.run.controller import (ADD_DECODE, ADD_PREFILL, NONE, REMOVE_DECODE, REMOVE_PREFILL, SIZE_CHANGE, TO_DECODE,
                                TO_PREFILL, CODES, ControllerConfig, Decision, PeakNeeds, Signals, decide,
                                observe, prefill_rate, steady_need, with_mixed_tpot, with_peaks)
from cluster.run.forecast import LongScale
from router.dispatch import Dispatcher
from router.pools import ACTIVE, DRAINING, STARTING, Member
from workers.cost_model import StepFit
from workers.names import DECODE, PREFILL

log = logging.getLogger("pdcluster.controller")
FORECAST_AHEAD = 2          # long intervals the floor looks ahead (a new worker starts within one)


@dataclass(frozen=True, slots=True)
class LiveControl:
    """The controller's settings in the serving process (from ClusterSpec's controller fields)."""
    config: ControllerConfig
    interval_s: float
    window_s: float
    forecast_s: float = 0.0               # the long interval (cluster/run/forecast.py); 0: no forecast
    advise: bool = False                  # report what it would do (log, metrics); change nothing


class PoolController:
    def __init__(self, dispatcher: Dispatcher, control: LiveControl, fit: StepFit, slo_ttft_s: float,
                 slo_tpot_s: float, max_num_batched_tokens: int, max_num_seqs: int,
                 add_worker: Callable[[str], Awaitable[Member | None]] | None = None,
                 shrunk: Callable[[int], Awaitable[None]] | None = None, clock=time.monotonic):
        self.d, self.pools, self.control, self.fit = dispatcher, dispatcher.pools, control, fit
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.add_worker = add_worker          # launches one worker of a role (None: the budget is the pools)
        self.shrunk = shrunk                  # told the workers left after a removal (the autoscaler's request)
        self.clock = clock
        self.started_at = clock()
        self.last_change = -math.inf          # when the last change was decided
        self.settled = -math.inf              # when its last worker rejoined, started or left
        self.last_decision: Decision | None = None
        self.last_reason = ""                 # the latest tick's reason, whatever it decided
        self.shift_at = -math.inf             # where the load last shifted (the window starts there)
        self.decisions: deque[dict] = deque(maxlen=10_000)   # the latest actions taken (or advised), with why
        self.grew_at = {PREFILL: clock(), DECODE: clock()}   # when each pool last grew (the start counts)
        self.shrank_at = {PREFILL: -math.inf, DECODE: -math.inf}   # and last shrank
        self.split_need = math.inf            # the whole need when mixed workers last split (Signals.split_need)
        self.peaks = PeakNeeds(control.config.shrink_hold_s)   # each pool's recent peak need (a shrink keeps it)
        self.long = (LongScale(control.forecast_s, self.started_at, FORECAST_AHEAD, control.config.shrink_hold_s,
                               slo_ttft_s)
                     if control.forecast_s > 0 else None)
        self._task: asyncio.Task | None = None
        self.pools.listen(self._pool_changed)
        for code in CODES:                    # every "why not" series exists from the start
            dispatcher.metrics.controller_decisions.labels(NONE, code)

    def _pool_changed(self, m: Member, old_state: str, old_role: str) -> None:
        if old_state in (DRAINING, STARTING) and not any(x.state in (DRAINING, STARTING) for x in self.pools):
            self.settled = self.clock()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.control.interval_s)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:                     # a bad tick must not end the loop
                log.exception("controller: a decision failed")

    # -- signals ------------------------------------------------------------------------------------
    def signals(self) -> Signals | None:
        """What decide() reads; None while there is no cost model to price the pools with."""
        cost = self.fit.current()
        if cost is None:
            return None
        now, c = self.clock(), self.control
        o = observe(self.d.metrics.requests, now, c.interval_s, c.window_s, max(self.shift_at, self.started_at),
                    self.settled)
        if o.shifted:
            self.shift_at = o.start
        prompt, output = o.mean_prompt_tokens, o.mean_output_tokens
        prefill = [m for m in self.pools if m.role == PREFILL and m.state in (ACTIVE, DRAINING)]
        decode = [m.report for m in self.pools.active(DECODE) if m.report]
        # the prompts waiting: on the prefill pool, or, with none (mixed), on the decode workers
        queued = sum(m.queued_prefill_tokens() for m in prefill or self.pools.active(DECODE))
        prefill_tps = prefill_rate(cost, o.prompt_quantiles, prompt, self.max_num_batched_tokens)
        decode_tps = cost.decode_tokens_per_s(o.decode_context or 1, self.slo_tpot_s, self.max_num_seqs)
        floor, keep = self._floors(now, prefill_tps, decode_tps)
        s = Signals(
            now=now, num_prefill=self.pools.count(PREFILL), num_decode=self.pools.count(DECODE),
            arrival_rate=o.arrival_rate, mean_prompt_tokens=prompt, mean_output_tokens=output,
            decode_context=o.decode_context,
            prefill_tokens_per_s=prefill_tps, decode_tokens_per_s=decode_tps,
            queued_prefill_tokens=queued, floor_prefill=floor[0], floor_decode=floor[1],
            keep_prefill=keep[0], keep_decode=keep[1],
            prefill_grew_at=self.grew_at[PREFILL], decode_grew_at=self.grew_at[DECODE],
            prefill_shrank_at=self.shrank_at[PREFILL], decode_shrank_at=self.shrank_at[DECODE],
            split_need=self.split_need, rising=self.long is not None and self.long.rising(),
            ttft_attainment=o.ttft_attainment, tpot_attainment=o.tpot_attainment,
            draining=len(self.pools.draining()) + sum(m.state == STARTING for m in self.pools),
            waiting_handoffs=sum(m.report.pending for m in self.pools if m.role == DECODE and m.report),
            decode_kv_usage=sum(r.kv_blocks_used for r in decode) / max(1, sum(r.kv_blocks_total for r in decode)),
            long_prompt_tokens=o.long_prompt_tokens, short_output_tokens=o.short_output_tokens)
        return with_mixed_tpot(cost, s, c.config, self.slo_tpot_s, self.max_num_batched_tokens)

    def _floors(self, now: float, prefill_tokens_per_s: float, decode_tokens_per_s: float) -> tuple:
        """The forecast's floor under each pool, and what a shrink keeps (LongScale.floors; its
        series fed from the request log's arrivals)."""
        if self.long is None:
            return (0, 0), (0, 0)
        cfg = self.control.config
        return self.long.floors(now, self.d.metrics.requests.arrivals, prefill_tokens_per_s, decode_tokens_per_s,
                               cfg.prefill_target_load, cfg.decode_target_load)

    # -- one decision -------------------------------------------------------------------------------
    async def tick(self) -> Decision | None:
        s = self.signals()
        if s is None:
            self.d.metrics.controller_decisions.labels(NONE, "no_cost_model").inc()
            self.last_reason = "no cost model yet"
            return None
        s = with_peaks(s, self.peaks, self.control.config)
        d = decide(s, self.control.config, self.last_change, self.last_decision)
        self.last_reason = d.reason
        self.d.metrics.controller_decisions.labels(d.action, d.code).inc()
        dp, dd = SIZE_CHANGE[d.action]
        recommended = self.d.metrics.controller_recommended
        recommended.labels(PREFILL).set(s.num_prefill + dp * d.count)
        recommended.labels(DECODE).set(s.num_decode + dd * d.count)
        if d.action == NONE:
            log.debug("controller: %s", d.reason)
            return d
        count = d.count
        self.decisions.append({"t": s.now - self.started_at, "action": d.action, "count": count, "reason": d.reason,
                               "code": d.code, "prefill": s.num_prefill, "decode": s.num_decode})
        if self.control.advise:
            log.warning("controller (advisory, nothing changed): would %s x%d at %d prefill + %d decode -> %d + %d: %s",
                        d.action, count, s.num_prefill, s.num_decode, s.num_prefill + dp * count,
                        s.num_decode + dd * count, d.reason)
            return d
        self.last_change = self.settled = s.now
        self.last_decision = d
        if d.code.startswith("split_"):
            self.split_need = steady_need(s, self.control.config.backlog_s)
        for pool, k in ((PREFILL, dp), (DECODE, dd)):
            if k:
                (self.grew_at if k > 0 else self.shrank_at)[pool] = s.now
        log.warning("controller: %s x%d at %d prefill + %d decode: %s", d.action, count, s.num_prefill,
                    s.num_decode, d.reason)
        if d.action in (TO_PREFILL, TO_DECODE, REMOVE_PREFILL, REMOVE_DECODE):
            donor = DECODE if d.action in (TO_PREFILL, REMOVE_DECODE) else PREFILL
            to = {TO_PREFILL: PREFILL, TO_DECODE: DECODE}.get(d.action)
            # the mixed role empties the prefill pool; any other change leaves each pool a worker
            leaving = self._least_loaded(donor, count, keep=0 if d.code == "mixed" else 1)
            for m in leaving:
                self.pools.drain(m.worker_id, to)
            if to is None and leaving and self.shrunk is not None:
                await self.shrunk(s.num_prefill + s.num_decode - len(leaving))
        elif d.action in (ADD_PREFILL, ADD_DECODE) and self.add_worker is not None:
            role = PREFILL if d.action == ADD_PREFILL else DECODE
            for _ in range(count):
                if await self.add_worker(role) is None:
                    break
        return d

    def _least_loaded(self, role: str, count: int, keep: int = 1) -> list[Member]:
        """Up to `count` active workers of the pool, least loaded first; `keep` always stay."""
        pool = self.pools.active(role)

        def load(m: Member) -> float:
            r = m.report
            return len(m.assigned) + (r.running + r.waiting + r.held + r.pending + r.receiving if r else 0)
        return sorted(pool, key=load)[:max(0, min(count, len(pool) - keep))]
