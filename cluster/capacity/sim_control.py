"""Controllers inside the simulator. `ElasticSimulator` carries out changes of the pools the way
a live cluster does: the `count` least loaded workers of the donor pool leave it at once (no new
work), drain (a decode worker finishes its sequences, a prefill worker its prompts and the
handoffs of its held KV), flip their role without reloading anything, and rejoin the other pool
(or, removed, leave the cluster); an added worker holds its GPUs from the moment it is asked for
and joins its pool only `startup_s` later (weights loaded, kernels warmed). It keeps what an
operator pays for and what a controller's steadiness shows: GPU-seconds held (every worker from
its request to its exit, starting and draining included), and each change with the changes it
undoes (a change of a pool's size the other way within `undo_window_s` of an earlier one).

`ControlledSimulator` is pdcluster's controller on it: every `interval_s` it gathers the signals
the serving loop does, read the same way (`cluster.run.controller.observe` on a request log kept
on the simulated clock: arrivals with their prompt lengths and the output they ask for, SLO
attainment of the requests sent since the last change took effect; queued prefill work and
handoffs waiting for decode room; the pools' capacities from the cost model; a trace's requests
ask for the output they get) and asks `cluster.run.controller.decide`. Plain Python, like the
simulator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.capacity import dynamo_baseline as db
from cluster.run.controller import (ADD_DECODE, ADD_PREFILL, NONE, REMOVE_DECODE, REMOVE_PREFILL, SIZE_CHANGE, TO_DECODE,
                                TO_PREFILL, ControllerConfig, Decision, PeakNeeds, Signals, decide,
                                observe, prefill_rate, steady_need, with_mixed_tpot, with_peaks)
from cluster.capacity.simulate import SimCluster, SimEngine, Simulator, SimWorker
from cluster.run.forecast import LongScale
from router.slo import RequestLog
from workers.cost_model import BatchShape
from workers.names import DECODE, DISAGGREGATED, PREFILL

UNDO_WINDOW_S = 300.0       # a change of a pool's size the other way within this long undoes an earlier one


@dataclass(frozen=True, slots=True)
class SimControl:
    """The controller's settings in the simulator (from `simulate`'s flags, which are `serve`'s)."""
    config: ControllerConfig
    interval_s: float
    window_s: float
    slo_ttft_s: float
    slo_tpot_s: float
    startup_s: float = 0.0              # an added worker's time from its request to its first work
    forecast_interval_s: float = 0.0    # the long time scale (cluster/run/forecast.py); 0: no forecast


class ElasticSimulator(Simulator):
    """A simulator whose pools change while it runs (see the module's docstring). A subclass
    calls `change` from events it schedules; `tick` runs every `interval_s` while there is work."""

    def __init__(self, cluster: SimCluster, interval_s: float, startup_s: float = 0.0,
                 undo_window_s: float = UNDO_WINDOW_S, **kw):
        if cluster.mode != DISAGGREGATED:
            raise ValueError("a controller of the pools needs --mode disaggregated")
        if cluster.prefill_cost != cluster.decode_cost:
            raise ValueError("a controller moves workers between pools: both pools need the same costs "
                             "(one tensor-parallel degree)")
        if startup_s < 0 or interval_s <= 0:
            raise ValueError(f"startup_s must be >= 0 and interval_s > 0, got {startup_s} and {interval_s}")
        super().__init__(cluster, **kw)
        self.interval_s, self.startup_s, self.undo_window_s = interval_s, startup_s, undo_window_s
        self.gpus_per_worker = cluster.prefill_cost.tp
        self.decisions: list[dict] = []
        self.role_changes = 0
        self.removed = 0
        self.added = 0
        self.undone = 0                                 # changes that undid an earlier one (see `change`)
        self.settled = -math.inf                        # when the last change's last worker joined (or left)
        self.draining: dict[str, str | None] = {}       # worker id -> the pool it moves to (None: it leaves)
        self.starting: dict[str, float] = {}            # worker id -> when it joins its pool
        self.sizes: list[tuple[float, int, int, int]] = [(0.0, len(self.pools[PREFILL]), len(self.pools[DECODE]),
                                                           len(self.workers))]   # (t, prefill, decode, held)
        self._gpu_s, self._held, self._held_since = 0.0, len(self.workers), 0.0
        self._vocab, self._max_len = kw.get("vocab_size", 32000), kw.get("max_model_len", 1 << 30)
        self._pending_arrivals = 0

    def run(self, requests):
        self._pending_arrivals = len(requests)
        self._at(self.interval_s, self._tick)
        results, end = super().run(requests)
        self._hold(0)
        return results, end

    def _arrive(self, rid, r) -> None:
        self._pending_arrivals -= 1
        super()._arrive(rid, r)

    def _tick(self) -> None:
        self.tick()
        if self._pending_arrivals or self.in_flight:
            self._at(self.now + self.interval_s, self._tick)

    def tick(self) -> None:
        """One decision (the subclass's)."""

    # -- what it costs --------------------------------------------------------------------------
    def gpu_hours(self) -> float:
        """GPU-hours held so far: every worker from its request to its exit."""
        return (self._gpu_s + self._held * (self.now - self._held_since)) * self.gpus_per_worker / 3600

    def _hold(self, delta: int) -> None:
        self._gpu_s += self._held * (self.now - self._held_since)
        self._held += delta
        self._held_since = self.now

    def _record_sizes(self) -> None:
        self.sizes.append((self.now, len(self.pools[PREFILL]), len(self.pools[DECODE]), self._held))

    # -- carrying a change out ------------------------------------------------------------------
    def change(self, action: str, count: int, reason: str = "", keep: int = 1, **extra) -> int:
        """Carry out `action` (controller's verbs) on `count` workers, leaving at least `keep` in
        the donor pool (0: the mixed role empties the prefill pool); returns how many it
        changed. A change of a pool's size the other way within `undo_window_s` of an earlier
        change of it counts as undoing that one."""
        if action == NONE or count <= 0:
            return 0
        n = {PREFILL: len(self.pools[PREFILL]), DECODE: len(self.pools[DECODE])}
        leaving, role = [], None
        if action in (TO_PREFILL, TO_DECODE, REMOVE_PREFILL, REMOVE_DECODE):
            donor = DECODE if action in (TO_PREFILL, REMOVE_DECODE) else PREFILL
            to = {TO_PREFILL: PREFILL, TO_DECODE: DECODE}.get(action)
            # the least loaded leave
            pool = sorted(self.pools[donor], key=lambda x: len(x.engine._seqs) + len(x.waiting_room) + x.receiving)
            leaving = pool[:max(0, min(count, len(pool) - keep))]
            count = len(leaving)
            delta = {donor: -count, **({to: count} if to else {})}
        else:
            role = PREFILL if action == ADD_PREFILL else DECODE
            delta = {role: count}
        if not count:
            return 0
        undoes = [d["t"] for d in self.decisions if self.now - d["t"] < self.undo_window_s
                  and any(d["delta"].get(pool, 0) * k < 0 for pool, k in delta.items())]
        self.undone += bool(undoes)
        self.settled = self.now
        self.decisions.append({"t": self.now, "action": action, "count": count, "reason": reason,
                               "prefill": n[PREFILL], "decode": n[DECODE], "delta": delta,
                               "undoes": undoes[-1] if undoes else None, **extra})
        for w in leaving:
            self._move(w, to)
        for _ in range(count if role else 0):
            self._add(role)
        self._settle_check()
        return count

    def _move(self, w: SimWorker, to: str | None) -> None:
        """Out of its pool now; into the other (or out of the cluster) once drained."""
        self.pools[w.role].remove(w)
        self.pool_ids[w.role].remove(w.worker_id)
        self.draining[w.worker_id] = to
        self._record_sizes()
        if not w.busy:
            self._idle(w)

    def _add(self, role: str) -> None:
        self.added += 1
        wid = f"{role}-added-{self.added}"
        cost = self.c.prefill_cost
        w = SimWorker(wid, role, SimEngine(self.c.engine, cost, lambda: self.now, self._vocab, self._max_len), cost)
        self.workers[wid] = w
        self._hold(+1)
        self.starting[wid] = self.now + self.startup_s
        if self.startup_s:
            self._at(self.now + self.startup_s, self._join, w)
        else:
            self._join(w)

    def _join(self, w: SimWorker) -> None:
        """An added worker has started: into its pool."""
        del self.starting[w.worker_id]
        self.pools[w.role].append(w)
        self.pool_ids[w.role].append(w.worker_id)
        self._record_sizes()
        self._settle_check()
        if self.gate is not None and w.role == DECODE:
            self._open_gate()                          # room for the held requests

    def _settle_check(self) -> None:
        if not self.draining and not self.starting and self.decisions and "settled" not in self.decisions[-1]:
            self.settled = self.now
            self.decisions[-1]["settled"] = self.now

    def _idle(self, w: SimWorker) -> None:
        if w.worker_id not in self.draining or w.engine._seqs or w.inbox or w.waiting_room or w.receiving:
            return
        to = self.draining.pop(w.worker_id)
        if to is None:
            del self.workers[w.worker_id]
            self.removed += 1
            self._hold(-1)
        else:
            w.role = to
            self.pools[to].append(w)
            self.pool_ids[to].append(w.worker_id)
            self.role_changes += 1
        self._record_sizes()
        self._settle_check()


class ControlledSimulator(ElasticSimulator):
    """pdcluster's controller (`cluster.run.controller.decide`) on the elastic simulator."""

    def __init__(self, cluster: SimCluster, control: SimControl, **kw):
        if cluster.num_prefill + cluster.num_decode > control.config.max_workers:
            raise ValueError(f"{cluster.num_prefill + cluster.num_decode} workers start above the budget of "
                             f"{control.config.max_workers}")
        super().__init__(cluster, control.interval_s, control.startup_s, **kw)
        self.control = control
        self.requests = RequestLog(max(control.window_s, 2 * control.forecast_interval_s), clock=lambda: self.now)
        self.last_change = -math.inf                    # when the last change was decided
        self.last_decision: Decision | None = None
        self.shift_at = -math.inf                       # where the load last shifted (the window starts there)
        self.grew_at = {PREFILL: 0.0, DECODE: 0.0}      # when each pool last grew (the start counts)
        self.shrank_at = {PREFILL: -math.inf, DECODE: -math.inf}   # and last shrank
        self.split_need = math.inf                      # the whole need when mixed workers last split
        self.peaks = PeakNeeds(control.config.shrink_hold_s)   # each pool's recent peak need (a shrink keeps it)
        # the long time scale: far enough ahead that a worker asked for now has started by then
        f = control.forecast_interval_s
        self.long = (LongScale(f, 0.0, 1 + math.ceil(self.startup_s / f), control.config.shrink_hold_s,
                               control.slo_ttft_s) if f > 0
                     else None)

    # -- signals ----------------------------------------------------------------------------------
    def _arrive(self, rid, r) -> None:
        self.requests.arrived(r.prompt_len, r.output_len)
        super()._arrive(rid, r)

    def _floors(self, prefill_tokens_per_s: float, decode_tokens_per_s: float) -> tuple:
        """The forecast's floor under each pool, and what a shrink keeps (LongScale.floors; its
        series fed from the request log's arrivals)."""
        if self.long is None:
            return (0, 0), (0, 0)
        cfg = self.control.config
        return self.long.floors(self.now, self.requests.arrivals, prefill_tokens_per_s, decode_tokens_per_s,
                               cfg.prefill_target_load, cfg.decode_target_load)

    def signals(self) -> Signals:
        c, now = self.control, self.now
        o = observe(self.requests, now, c.interval_s, c.window_s, max(self.shift_at, 0.0), self.settled)
        if o.shifted:
            self.shift_at = o.start
        prompt, output = o.mean_prompt_tokens, o.mean_output_tokens
        cost, sched = self.c.prefill_cost, self.c.engine.scheduler
        decode = [x.engine.load_report(x.worker_id, x.role, 0) for x in self.pools[DECODE]]
        prefill_tps = prefill_rate(cost, o.prompt_quantiles, prompt, sched.max_num_batched_tokens)
        decode_tps = cost.decode_tokens_per_s(o.decode_context or 1, c.slo_tpot_s, sched.max_num_seqs)
        floor, keep = self._floors(prefill_tps, decode_tps)
        s = Signals(
            now=now, num_prefill=len(self.pools[PREFILL]), num_decode=len(self.pools[DECODE]),
            arrival_rate=o.arrival_rate, mean_prompt_tokens=prompt, mean_output_tokens=output,
            decode_context=o.decode_context,
            prefill_tokens_per_s=prefill_tps, decode_tokens_per_s=decode_tps,
            queued_prefill_tokens=sum(x.engine.load_report(x.worker_id, x.role, 0).queued_prefill_tokens
                                      for x in self.pools[PREFILL] or self.pools[DECODE]),
            ttft_attainment=o.ttft_attainment, tpot_attainment=o.tpot_attainment,
            draining=len(self.draining) + len(self.starting),
            waiting_handoffs=sum(len(x.waiting_room) for x in self.workers.values() if x.role == DECODE),
            decode_kv_usage=sum(r.kv_blocks_used for r in decode) / max(1, sum(r.kv_blocks_total for r in decode)),
            floor_prefill=floor[0], floor_decode=floor[1], keep_prefill=keep[0], keep_decode=keep[1],
            prefill_grew_at=self.grew_at[PREFILL],
            decode_grew_at=self.grew_at[DECODE], prefill_shrank_at=self.shrank_at[PREFILL],
            decode_shrank_at=self.shrank_at[DECODE], long_prompt_tokens=o.long_prompt_tokens, short_output_tokens=o.short_output_tokens,
            split_need=self.split_need, rising=self.long is not None and self.long.rising())
        return with_mixed_tpot(cost, s, c.config, c.slo_tpot_s, sched.max_num_batched_tokens)

    def tick(self) -> None:
        s = with_peaks(self.signals(), self.peaks, self.control.config)
        d = decide(s, self.control.config, self.last_change, self.last_decision)
        if d.action != NONE:
            self.last_change = self.now
            self.last_decision = d
            if d.code.startswith("split_"):
                self.split_need = steady_need(s, self.control.config.backlog_s)
            if self.change(d.action, d.count, d.reason, keep=0 if d.code == "mixed" else 1):
                for pool, k in zip((PREFILL, DECODE), SIZE_CHANGE[d.action]):
                    if k:
                        (self.grew_at if k > 0 else self.shrank_at)[pool] = self.now


class PlannedSimulator(ElasticSimulator):
    """Dynamo's planner (cluster/capacity/dynamo_baseline.py) on the elastic simulator: the
    throughput planner every `interval_s` or the load-based one every `load_interval_s`, its
    replica counts reached by adding and removing workers (Dynamo scales deployments; it does
    not flip roles). A removed worker drains here (Dynamo's scale-down kills what its pod runs,
    a known issue of its own, so this baseline is the kinder one). Decisions made while a
    change is under way are dropped, as Dynamo drops them while its deployment is not ready."""

    def __init__(self, cluster: SimCluster, planner_cfg, mode: str, startup_s: float = 0.0, **kw):
        self.mode = mode
        interval = planner_cfg.interval_s if mode == db.THROUGHPUT else planner_cfg.load_interval_s
        super().__init__(cluster, interval, startup_s, **kw)
        sched = cluster.engine.scheduler
        self.planner = (db.ThroughputPlanner(planner_cfg, _Profile(cluster.prefill_cost, sched))
                        if mode == db.THROUGHPUT else db.LoadPlanner(planner_cfg))
        self._arrived: list[tuple[int, int]] = []                  # this interval's (prompt, output)
        self._done: list[tuple[float, float, float]] = []          # this interval's (ttft, itl, duration)

    def _arrive(self, rid, r) -> None:
        self._arrived.append((r.prompt_len, r.output_len))
        super()._arrive(rid, r)

    def _finished(self, tr) -> None:
        itl = (tr.end_s - tr.first_s) / (tr.count - 1) if tr.count > 1 else math.nan
        self._done.append((tr.first_s - tr.sent_s, itl, tr.end_s - tr.sent_s))

    def tick(self) -> None:
        arrived, done, self._arrived, self._done = self._arrived, self._done, [], []
        n = len(arrived)
        isl = sum(a for a, _ in arrived) / n if n else math.nan
        osl = sum(b for _, b in arrived) / n if n else math.nan
        itls = [d[1] for d in done if not math.isnan(d[1])]
        ttft = sum(d[0] for d in done) / len(done) if done else math.nan
        itl = sum(itls) / len(itls) if itls else math.nan
        num_p, num_d = len(self.pools[PREFILL]), len(self.pools[DECODE])
        if self.mode == db.THROUGHPUT:
            seen = self.planner.observe(db.Interval(n, isl, osl, ttft, itl,
                                                    sum(d[2] for d in done) / len(done) if done else math.nan, num_d))
            if not seen or self.draining or self.starting:
                return
            want = self.planner.plan()
        else:
            active = [x.engine.load_report(x.worker_id, x.role, 0).queued_prefill_tokens + x.inbox_tokens
                      for x in self.pools[PREFILL]]
            blocks = [x.engine.load_report(x.worker_id, x.role, 0).kv_blocks_used for x in self.pools[DECODE]]
            # TTFT and ITL as its frontend measures them: the requests' own, over the interval
            # (ITL: the gaps after the first token, the wait for a decode seat included)
            if n and not math.isnan(ttft) and active:
                self.planner.observe_prefill(sum(active) / len(active), isl, ttft)
            if not math.isnan(itl) and blocks:
                self.planner.observe_decode(sum(blocks) / len(blocks), itl)
            if self.draining or self.starting or not n:
                return
            want = self.planner.plan(num_p, num_d, active, isl, blocks)
        for pool, have, n_want, up, down in ((PREFILL, num_p, want[0], ADD_PREFILL, REMOVE_PREFILL),
                                             (DECODE, num_d, want[1], ADD_DECODE, REMOVE_DECODE)):
            if n_want != have:
                self.change(up if n_want > have else down, abs(n_want - have),
                            f"{self.mode} planner: {pool} {have} -> {n_want}")


class _Profile:
    """What Dynamo's profiler would have measured of one engine, from the simulator's cost model
    (per engine: a worker is one engine of `tp` GPUs)."""

    def __init__(self, cost, sched):
        self.cost, self.sched = cost, sched

    def prefill_tokens_per_s(self, isl: float) -> float:
        return self.cost.prefill_tokens_per_s(isl, self.sched.max_num_batched_tokens)

    def decode_tokens_per_s(self, context: float, itl_s: float) -> float:
        return self.cost.decode_tokens_per_s(context, itl_s, self.sched.max_num_seqs)

    def ttft_s(self, isl: float) -> float:
        n = max(1, round(isl))
        return self.cost.step_s(BatchShape(1, n, n * n))

    def itl_s(self, concurrency: float, context: float) -> float:
        k = max(1, round(concurrency))
        return self.cost.step_s(BatchShape(num_decode=k, decode_context=round(k * context)))
