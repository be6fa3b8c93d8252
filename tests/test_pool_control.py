"""The serving process's controller loop (cluster/run/pool_control.py) on plain state: the cost
model it fits from step samples, the signals it reads from the router, and how it carries a
decision out through the pool registry. No Ray: workers are registry members with reports."""
from __future__ import annotations

import asyncio
import dataclasses
import math
import random

import pytest

from common import Clock
from cluster.run.controller import ControllerConfig
from cluster.run.pool_control import LiveControl, PoolController
from router.dispatch import Dispatcher, DispatchSettings
from router.placement import PACE_SHARE, PACE_STEPS
from router.leadership import Leadership
from router.metrics import Metrics
from router.pools import ACTIVE, DRAINING, Member, PoolRegistry
from router.slo import RequestLog, SLOTargets, judge
from router.supervisor import Supervisor
from workers.cost_model import BatchShape, LinearStepModel, StepFit
from workers.messages import LoadReport, PollReply, TransferTotals
from workers.names import AUTO, DECODE, DISAGGREGATED, PREFILL

TRUE = LinearStepModel(p0=0.004, p1=2e-5, p2=1e-9, d0=0.003, d1=2e-7, d2=1e-4)


def timed(shapes, noise=0.0, seed=0) -> list[list[float]]:
    rng = random.Random(seed)
    return [[TRUE.step_s(s) * (1 + rng.uniform(-noise, noise)), *dataclasses.astuple(s)] for s in shapes]


PROFILE = timed([BatchShape(1, n, n * n) for n in (16, 64, 256, 512, 1024)] + [BatchShape(4, 512, 4 * 128 * 128)]
                + [BatchShape(num_decode=k, decode_context=k * c) for k, c in ((1, 64), (8, 256), (32, 128),
                                                                             (64, 512), (128, 64))])


def test_the_fit_recovers_the_step_costs_and_follows_what_is_served():
    clock = Clock()
    fit = StepFit(kv_bytes_per_token=1024, kv_capacity_tokens=65536, profiled=PROFILE, clock=clock)
    model = fit.current()
    for s in (BatchShape(2, 800, 2 * 400 * 400), BatchShape(num_decode=50, decode_context=50 * 300)):
        assert model.step_s(s) == pytest.approx(TRUE.step_s(s), rel=0.02)
    # Served steps twice as slow (a busy machine): the fit follows them once they outnumber the profile.
    slow = [[2 * x[0], *x[1:]] for x in timed([BatchShape(1, n, n * n) for n in range(100, 1100, 10)] +
                                              [BatchShape(num_decode=k, decode_context=k * 200) for k in range(1, 101)],
                                              noise=0.05)]
    fit.add(slow)
    fit.add([[0.5, 1, 100, 10000, 0, 3, 600]])                    # a mixed step: left out
    s = BatchShape(1, 500, 500 * 500)
    assert fit.current() is model                                  # refit at most every refit_every_s
    clock.t += fit.refit_every_s
    assert fit.current().step_s(s) == pytest.approx(2 * TRUE.step_s(s), rel=0.15)


def test_a_new_workers_warm_up_steps_never_feed_the_fit():
    """Each worker's first steps (fifty times slower: lazy kernels, the allocator) are left out,
    per worker; the same steps fed without naming the worker pull the fit off."""
    shapes = [BatchShape(1, n, n * n) for n in range(100, 1100, 25)] + \
             [BatchShape(num_decode=k, decode_context=k * 200) for k in range(1, 60)]
    warm = [[50 * x[0], *x[1:]] for x in timed(shapes[:StepFit.WARMUP_STEPS])]
    s = BatchShape(1, 500, 500 * 500)

    def fitted(named: bool) -> tuple[float, float]:
        clock = Clock()
        fit = StepFit(1024, 65536, profiled=PROFILE, clock=clock)
        for worker in ("decode-7", "prefill-3"):                 # each new worker's own warm-up
            fit.add(warm[:5], worker if named else None)
            fit.add(warm[5:], worker if named else None)
            fit.add(timed(shapes), worker if named else None)
        clock.t += fit.refit_every_s
        return fit.current().step_s(s), fit.prefill_throughput()
    served = [x for x in timed(shapes) if x[2]]                  # the prefill steps after the warm-up
    throughput = sum(x[2] for x in served) / sum(x[0] for x in served)
    step, tokens_per_s = fitted(True)
    assert step == pytest.approx(TRUE.step_s(s), rel=0.02) and tokens_per_s == pytest.approx(throughput)
    step, tokens_per_s = fitted(False)
    assert tokens_per_s < 0.5 * throughput                       # the warm-up's steps would have priced it


def test_too_few_shapes_give_no_model_rather_than_a_guess():
    fit = StepFit(1024, 65536, profiled=PROFILE[:2])
    assert fit.current() is None
    fit.add(PROFILE[2:])
    assert fit.current() is not None


def report(worker_id, role, queued=0, running=0) -> LoadReport:
    return LoadReport(worker_id, role, 0, running, 0, queued, 0, 64, 1, kv_transfer=TransferTotals())


def test_auto_local_prefill_takes_a_queued_burst_on_an_idle_decode_worker_and_otherwise_hands_off():
    """--local-prefill-max-tokens auto (serve's default): with no prefill queue a prompt is handed
    off (disaggregated); while the prefill pool has a queue (a closed loop's clients come back
    together when a batch ends), an idle decode worker prefills it itself; one whose batch the
    chunk would delay, summed over its sequences, more than the queue costs the request (by the
    true step costs the fit was made from) hands it off."""
    p, d = Member("prefill-0", PREFILL, "hp0", ACTIVE), Member("decode-0", DECODE, "hd0", ACTIVE)
    p.report, d.report = report(p.worker_id, PREFILL), report(d.worker_id, DECODE)
    disp = Dispatcher(PoolRegistry.of([p, d]), DISAGGREGATED, Metrics(workers=False),
                      DispatchSettings(local_prefill_max_tokens=AUTO))
    disp.price_local_prefill(StepFit(1024, 65536, PROFILE), 2048)
    assert not disp.placement.prefill_locally(d.worker_id, 128, disp.view)
    p.report = report(p.worker_id, PREFILL, queued=4096)
    assert disp.placement.prefill_locally(d.worker_id, 128, disp.view)
    busy = 128
    d.report = report(d.worker_id, DECODE, running=busy)
    decode = BatchShape(num_decode=busy, decode_context=0)
    delay = busy * (TRUE.step_s(decode + BatchShape(1, 128, 128 * 128, 0)) - TRUE.step_s(decode))
    queue_s = 4096 / (2048 / TRUE.step_s(BatchShape(16, 2048, 16 * 128 * 128)))
    assert delay > 4 * queue_s
    assert not disp.placement.prefill_locally(d.worker_id, 128, disp.view)


def test_auto_local_prefill_joins_the_shorter_line():
    """A prompt goes to its decode worker only while the prompts queued there are no more than
    the prefill pool's queue: the shorter line for its first token, and the line SLO admission
    priced (before, any queue at the pool was reason enough, and a wave the decode gate let
    through went to the decode worker all but the first). A wave of 100 to an idle decode
    worker is shared about evenly (the pool a little more: the prompts sent to the decode worker
    count as sequences its next chunk delays). No reports during the wave: what each was sent
    counts, as the router's own count does between reports."""
    p, d = Member("prefill-0", PREFILL, "hp0", ACTIVE), Member("decode-0", DECODE, "hd0", ACTIVE)
    p.report = report(p.worker_id, PREFILL, queued=2048)
    d.report = report(d.worker_id, DECODE, queued=4096)
    disp = Dispatcher(PoolRegistry.of([p, d]), DISAGGREGATED, Metrics(workers=False),
                      DispatchSettings(local_prefill_max_tokens=AUTO))
    disp.price_local_prefill(StepFit(1024, 65536, PROFILE), 2048)
    placement = disp.placement
    assert not placement.prefill_locally(d.worker_id, 128, disp.view)    # a longer line there
    d.report = report(d.worker_id, DECODE, queued=2048)
    assert placement.prefill_locally(d.worker_id, 128, disp.view)
    p.report, d.report = report(p.worker_id, PREFILL), report(d.worker_id, DECODE)
    taken = {p.worker_id: 0, d.worker_id: 0}
    for i in range(100):
        worker_id, local = placement.first(placement.start(list(range(i * 128, (i + 1) * 128))), disp.view)
        assert local == (worker_id == d.worker_id)
        disp.pools[worker_id].sent(f"r{i}", 128)
        taken[worker_id] += 1
    assert 40 <= taken[d.worker_id] <= 50, taken


def test_auto_local_prefill_keeps_the_decode_workers_pace_within_its_share_of_the_tpot_target():
    """With a TPOT target, a decode worker whose batch the chunk would be worth delaying takes
    the prompt only while its pace, as its steps report it, plus the chunk's extra step time
    spread over PACE_STEPS steps stays within PACE_SHARE of the target; a worker with nothing
    decoding delays nobody; the pace of a worker that leaves is forgotten."""
    p, d = Member("prefill-0", PREFILL, "hp0", ACTIVE), Member("decode-0", DECODE, "hd0", ACTIVE)
    p.report, d.report = report(p.worker_id, PREFILL, queued=1 << 20), report(d.worker_id, DECODE, running=4)
    pools = PoolRegistry.of([p, d])
    disp = Dispatcher(pools, DISAGGREGATED, Metrics(workers=False), DispatchSettings(local_prefill_max_tokens=AUTO))
    tpot_s = 0.1
    disp.price_local_prefill(StepFit(1024, 65536, PROFILE), 2048, tpot_s)
    placement = disp.placement
    decode = BatchShape(num_decode=4, decode_context=0)
    added = TRUE.step_s(decode + BatchShape(1, 128, 128 * 128, 0)) - TRUE.step_s(decode)
    edge = PACE_SHARE * tpot_s - added / PACE_STEPS          # the fastest pace at which the prompt stays
    assert 0 < edge < PACE_SHARE * tpot_s
    placement.observe_decode_steps(d.worker_id, 0.9 * edge)
    assert placement.prefill_locally(d.worker_id, 128, disp.view)
    _take_steps(disp, d, 1.1 * edge, PACE_STEPS * 8)         # reported as served: the pace settles there
    assert placement.paces[d.worker_id] == pytest.approx(1.1 * edge, rel=0.01)
    assert not placement.prefill_locally(d.worker_id, 128, disp.view)
    d.report = report(d.worker_id, DECODE, running=0)
    assert placement.prefill_locally(d.worker_id, 128, disp.view)      # nobody to delay
    pools.lost(d.worker_id)
    assert d.worker_id not in placement.paces


def _take_steps(disp: Dispatcher, w: Member, step_s: float, n: int) -> None:
    """`n` decode steps of `step_s` seconds in `w`'s frame, as its poll reply brings them."""
    shape = [step_s, 0, 0, 0, 0, 4, 4 * 64]                 # four decoding rows
    prefill = [step_s, 1, 64, 64 * 64, 0, 0, 0]             # a step without one: not its pace
    reply = PollReply([], w.report, {"step_shape": [shape] * n + [[10.0, *prefill[1:]]]})
    disp.take_frame(w, reply)


def controller(clock, num_prefill=1, num_decode=2, live: dict | None = None, **cfg):
    members = [Member(f"prefill-{i}", PREFILL, f"hp{i}", ACTIVE) for i in range(num_prefill)] + \
              [Member(f"decode-{i}", DECODE, f"hd{i}", ACTIVE) for i in range(num_decode)]
    for m in members:
        m.report = report(m.worker_id, m.role)
    metrics = Metrics(SLOTargets(ttft_s=1.0, tpot_s=0.05))
    metrics.requests = RequestLog(clock=clock)
    d = Dispatcher(PoolRegistry.of(members), DISAGGREGATED, metrics)
    fit = StepFit(1024, 65536, PROFILE)
    ctl = PoolController(d, LiveControl(ControllerConfig(cfg.pop("max_workers", num_prefill + num_decode), **cfg),
                                        1.0, 10.0, **(live or {})), fit, 1.0, 0.05, 2048, 128, clock=clock)
    return ctl, d, metrics


def serve_window(clock, metrics, rate, prompt, output, seconds, ttft_s=0.1, tpot_s=0.01, max_tokens=None):
    """Arrivals at `rate` for `seconds` (asking for `max_tokens`, by default `output`), each
    finishing at once with these latencies."""
    asked = max_tokens or output
    for _ in range(int(rate * seconds)):
        clock.t += 1 / rate
        metrics.requests.arrived(prompt, asked)
        e2e = ttft_s + tpot_s * (output - 1)
        v = judge(metrics.slo, ttft_s, e2e, output)
        metrics.requests.finished(clock.t - e2e, output, asked, v.ttft, v.tpot)


def test_signals_are_what_the_router_measured():
    clock = Clock(1000.0)
    ctl, d, metrics = controller(clock)
    ctl.started_at = clock.t
    serve_window(clock, metrics, rate=4, prompt=800, output=20, seconds=30, ttft_s=2.0)   # TTFT missed
    pool = d.pools
    pool["prefill-0"].report = report("prefill-0", PREFILL, queued=3000)
    pool["prefill-0"].sent("r-new", 500)                         # sent, not yet in a report
    s = ctl.signals()
    assert s.arrival_rate == pytest.approx(4, rel=0.05)          # the last 10 s of arrivals
    assert s.mean_prompt_tokens == 800 and s.mean_output_tokens == 20
    assert s.queued_prefill_tokens == 3500
    assert s.ttft_attainment == 0.0 and s.tpot_attainment == 1.0
    assert (s.num_prefill, s.num_decode, s.draining) == (1, 2, 0)
    # The fitted model prices the pools: one prefill worker clears a full step of such prompts.
    full = TRUE.step_s(BatchShape(2, 1600, 2 * 800 * 800))
    assert s.prefill_tokens_per_s == pytest.approx(1600 / full, rel=0.05)
    # Attainment judges only requests sent since the last change took effect (and needs enough).
    ctl.settled = clock.t
    serve_window(clock, metrics, rate=1, prompt=800, output=20, seconds=5)
    assert math.isnan(ctl.signals().ttft_attainment)


def test_output_lengths_are_what_arrivals_ask_for_times_the_share_replies_use():
    clock = Clock(1000.0)
    ctl, d, metrics = controller(clock)
    ctl.started_at = clock.t
    # Replies stop at 20 of the 100 tokens asked: 20 expected.
    serve_window(clock, metrics, rate=4, prompt=100, output=20, seconds=30, max_tokens=100)
    assert ctl.signals().mean_output_tokens == pytest.approx(20)
    # Requests asking for 1,000 start arriving: the estimate follows at the next tick, before
    # any of them has finished (their share is the replies' so far).
    for _ in range(40):
        clock.t += 0.025
        metrics.requests.arrived(100, 1000)
    s = ctl.signals()
    assert s.mean_output_tokens == pytest.approx(0.2 * 1000, rel=0.01)


def test_a_decision_drains_the_least_loaded_worker_of_the_donor_pool():
    clock = Clock(1000.0)
    ctl, d, metrics = controller(clock, cooldown_s=5)
    ctl.started_at = clock.t - 30
    d.pools["decode-0"].report = report("decode-0", DECODE, running=5)
    serve_window(clock, metrics, rate=25, prompt=3000, output=2, seconds=30)   # more prompt work than 1 worker does
    decision = asyncio.run(ctl.tick())
    assert decision.action == "to_prefill", decision
    assert d.pools["decode-1"].state == DRAINING and d.pools["decode-1"].to_role == PREFILL
    assert d.pools["decode-0"].state == ACTIVE                    # the busier one keeps serving
    assert ctl.decisions[-1]["action"] == "to_prefill"
    assert metrics.registry.get_sample_value("pdcluster:controller_decisions_total",
                                             {"action": "to_prefill", "reason": decision.code}) == 1
    # While it drains, and within the cooldown after, nothing else changes.
    assert asyncio.run(ctl.tick()).action == "none"
    clock.t += 0.5
    d.pools.finish_drain("decode-1")
    assert ctl.settled == clock.t                                 # attainment is judged from here on
    clock.t += 0.5
    assert asyncio.run(ctl.tick()).reason == "cooldown"


def test_advisory_mode_reports_what_it_would_do_and_changes_nothing():
    clock = Clock(1000.0)
    ctl, d, metrics = controller(clock, cooldown_s=5, live={"advise": True})
    ctl.started_at = clock.t - 30
    serve_window(clock, metrics, rate=25, prompt=3000, output=2, seconds=30)   # prefill-heavy: it would move
    for _ in range(3):                                   # every tick says so again: nothing took effect
        decision = asyncio.run(ctl.tick())
        assert decision.action == "to_prefill", decision
        clock.t += 1
    assert all(m.state == ACTIVE and m.role == r for m, r in zip(d.pools, (PREFILL, DECODE, DECODE)))
    assert [x["action"] for x in ctl.decisions] == ["to_prefill"] * 3 and ctl.last_decision is None
    rec = {role: metrics.registry.get_sample_value("pdcluster:controller_recommended_workers", {"role": role})
           for role in (PREFILL, DECODE)}
    assert rec == {PREFILL: 1 + decision.count, DECODE: 2 - decision.count}
    assert metrics.registry.get_sample_value("pdcluster:controller_decisions_total",
                                             {"action": "to_prefill", "reason": decision.code}) == 3


def test_elastic_a_pool_demand_left_shrinks_and_the_forecast_keeps_what_the_next_minutes_need():
    """1 prefill + 4 decode, elastic down to 2: a light load leaves decode far under its target,
    so decode workers leave (drained, then retired), one at a time (a quarter of the pool), once
    its growth (the start) is old enough; with a forecast that has seen a heavier load lately,
    the shrink stops at what the next minutes need."""
    def run(forecast_s):
        clock = Clock(1000.0)
        ctl, d, metrics = controller(clock, 1, 4, max_workers=6, min_workers=2, cooldown_s=5,
                                     live={"forecast_s": forecast_s})
        ctl.started_at = ctl.grew_at[PREFILL] = ctl.grew_at[DECODE] = clock.t
        if ctl.long is not None:
            ctl.long.until = clock.t + forecast_s
        serve_window(clock, metrics, rate=150, prompt=200, output=200, seconds=240)   # busier minutes first
        for _ in range(6):
            ctl.signals()                                   # the long intervals fed as they pass
            serve_window(clock, metrics, rate=0.5, prompt=200, output=200, seconds=15)
        removed, first = [], ctl.signals()
        for _ in range(3):
            decision = asyncio.run(ctl.tick())
            if decision.action == "remove_decode":
                leaving = [m for m in d.pools if m.state == DRAINING]
                assert decision.count == len(leaving) == 1 and leaving[0].to_role is None
                d.pools.finish_drain(leaving[0].worker_id)
                removed.append(decision)
            serve_window(clock, metrics, rate=0.5, prompt=200, output=200, seconds=10)
        return removed, first
    removed, _ = run(0.0)
    assert [x.code for x in removed] == ["shrink"] * 3                    # down to 1 decode worker
    kept, s = run(60.0)
    assert s.keep_decode >= 2 and len(kept) == 4 - s.keep_decode, (kept, s)   # down to what is coming


def test_a_new_leader_calls_off_another_leaders_drains_and_restarts_what_it_saw_hang():
    """The supervisor when its router comes to lead, on plain state: a drain the last leader left
    half done is called off (nobody would finish it), unless this router led last and only lost
    touch with the book (its own drain goes on); and a worker it saw hang while it followed is
    restarted. The metrics export the workers' series while it leads."""
    handles = {w: object() for w in ("prefill-0", "decode-0", "decode-1")}
    pools = PoolRegistry.of([Member(w, w.rsplit("-", 1)[0], h, ACTIVE) for w, h in handles.items()])
    restarted = []
    lead = Leadership()
    metrics = Metrics(workers=False)
    metrics.follow(lead)
    sup = Supervisor(Dispatcher(pools, DISAGGREGATED, metrics), lead, restart=restarted.append)
    lead.take()
    pools.drain("decode-1", PREFILL)                       # this router's own drain, towards prefill
    asyncio.run(lead.give_up())                            # it lost touch with the book a while
    assert not metrics.exporting_workers
    lead.take(resume=True)                                 # ... and nobody else led meanwhile
    assert (pools["decode-1"].state, pools["decode-1"].to_role) == (DRAINING, PREFILL)
    asyncio.run(lead.give_up())
    sup._hung.add("decode-0")                              # it saw decode-0 hang while it followed
    lead.take(resume=False)                                # another led in between
    assert (pools["decode-1"].state, pools["decode-1"].role, pools["decode-1"].to_role) == (ACTIVE, DECODE, None)
    assert restarted == [handles["decode-0"]] and not sup._hung
    assert metrics.exporting_workers and metrics.registry.get_sample_value("pdcluster:router_leader") == 1
