"""SLO admission on plain state (router/admission.py): pools with load reports, a step cost model
fitted on timed steps of a known model, and the verdicts for new requests."""
from __future__ import annotations

import dataclasses

import pytest

from common import Clock
from router.admission import SLOAdmission
from router.pools import ACTIVE, Member, PoolRegistry
from router.slo import SLOTargets
from workers.cost_model import BatchShape, LinearStepModel, StepFit
from workers.messages import LoadReport, TransferTotals
from workers.names import COLOCATED, DECODE, DISAGGREGATED, PREFILL

TRUE = LinearStepModel(p0=0.004, p1=2e-5, p2=1e-9, d0=0.003, d1=2e-7, d2=1e-4)
SHAPES = ([BatchShape(1, n, n * n) for n in (16, 64, 256, 512, 1024)] + [BatchShape(4, 512, 4 * 128 * 128)]
          + [BatchShape(num_decode=k, decode_context=k * c) for k, c in ((1, 64), (8, 256), (32, 128), (64, 512))])
BUDGET, MAX_SEQS = 2048, 128
SLO = SLOTargets(ttft_s=1.0, tpot_s=0.02)


def fitted() -> StepFit:
    return StepFit(1024, 1 << 20, [[TRUE.step_s(s), *dataclasses.astuple(s)] for s in SHAPES])


def report(worker_id, role, waiting=0, queued=0, running=0) -> LoadReport:
    return LoadReport(worker_id, role, waiting, running, 0, queued, 0, 64, 1, kv_transfer=TransferTotals())


def cluster(prefill=2, decode=(0,), mode=DISAGGREGATED, fit=None, clock=None) -> SLOAdmission:
    """`prefill` prefill (or colocated) workers; decode workers reporting these running counts."""
    first = PREFILL if mode == DISAGGREGATED else COLOCATED
    members = [Member(f"p{i}", first, None, ACTIVE) for i in range(prefill)]
    if mode == DISAGGREGATED:
        for i, r in enumerate(decode):
            m = Member(f"d{i}", DECODE, None, ACTIVE)
            m.report = report(m.worker_id, DECODE, running=r)
            members.append(m)
    return SLOAdmission(PoolRegistry.of(members), mode, fit or fitted(), SLO, BUDGET, MAX_SEQS,
                        clock=clock or Clock())


def admitted(a: SLOAdmission, n: int, prompt: int) -> list:
    return [a.started(prompt) for _ in range(n)]


def prefill_rate(n: int) -> float:
    """Prompt tokens/s of full steps of n-token prompts under the true costs."""
    k = BUDGET // n
    return k * n / TRUE.step_s(BatchShape(k, k * n, k * n * n))


def test_without_a_cost_model_only_the_queue_bound_applies():
    a = cluster(fit=StepFit(1024, 1 << 20))
    admitted(a, 200, 512)
    assert a.check(500, 16).admit


def test_an_idle_pool_admits_even_a_prompt_that_misses_on_its_own():
    a = cluster()
    v = a.check(200_000, 16)                      # its own prefill alone takes seconds
    assert v.admit and v.predicted_ttft_s > SLO.ttft_s


def test_the_prompts_ahead_predict_ttft_and_refuse_past_the_target():
    # 40 admitted prompts of 512 tokens without a first token, over two workers: 10,240 tokens each.
    a = cluster(prefill=2)
    tickets = admitted(a, 40, 512)
    expected = 10_240 / prefill_rate(512) + 256 / prefill_rate(256)
    ttft, ahead = a.predict_ttft(256)
    assert ttft == pytest.approx(expected, rel=0.02) and ahead == pytest.approx(10_240 / prefill_rate(512), rel=0.02)
    assert expected < SLO.ttft_s
    assert a.check(256, 16).admit
    # Ten times as many: past the target, refused with when it would fit.
    more = admitted(a, 360, 512)
    v = a.check(256, 16)
    assert not v.admit and v.code == "ttft" and "time to first token" in v.reason
    assert v.retry_after_s == pytest.approx(v.predicted_ttft_s - SLO.ttft_s)
    # They leave the queue at their first token, or when they end without one.
    for t in more[:180]:
        a.progress(t, 1)
    for t in more[180:]:
        a.ended(t)
    assert a.predict_ttft(256)[0] == pytest.approx(expected, rel=0.02)
    for t in tickets:
        a.ended(t)
    assert (a.waiting, a.waiting_tokens) == (0, 0)


def test_prompts_other_routers_queued_count_ahead_too():
    """Another router's prompts reach the prefill workers' reports, never this router's own
    count: the larger of the two is what is ahead (this router's own sends are in its count
    before any report has them)."""
    a = cluster(prefill=2)
    admitted(a, 4, 512)                                             # ours: 2,048 tokens
    mine = a.predict_ttft(256)
    for m in a.pools.active(PREFILL):                               # the workers: 10,240 each, queued
        m.report = report(m.worker_id, PREFILL, queued=10_240)
    ttft, ahead = a.predict_ttft(256)
    assert ahead == pytest.approx(10_240 / prefill_rate(512), rel=0.02) and ttft > mine[0]
    for m in a.pools.active(PREFILL):                               # reports behind our own sends
        m.report = report(m.worker_id, PREFILL, queued=100)
    assert a.predict_ttft(256) == pytest.approx(mine)


def test_lower_priorities_are_shed_first():
    # Prompts ahead that predict about 0.8 s: within the target, past 0.75 of it.
    a = cluster(prefill=1)
    n = round((0.8 - 256 / prefill_rate(256)) * prefill_rate(512) / 512)
    admitted(a, n, 512)
    assert a.predict_ttft(256)[0] == pytest.approx(0.8, rel=0.05)
    assert a.check(256, 16, priority=0).admit
    assert a.check(256, 16, priority=-3).admit
    v = a.check(256, 16, priority=1)
    assert not v.admit and "priority 1" in v.reason


def test_a_decode_pool_at_its_tpot_batch_refuses_more():
    a = cluster()
    cost = a.fit.current()
    full = cost.decode_batch_at(256 + 8, SLO.tpot_s, MAX_SEQS)
    assert 1 < full < MAX_SEQS
    # Its step at that batch is within TPOT, one more sequence is not.
    assert TRUE.step_s(BatchShape(num_decode=full, decode_context=full * 264)) <= SLO.tpot_s
    assert TRUE.step_s(BatchShape(num_decode=full + 1, decode_context=(full + 1) * 264)) > SLO.tpot_s
    assert cluster(decode=(full - 1, full - 1)).check(256, 16).admit
    v = cluster(decode=(full, full)).check(256, 16)
    assert not v.admit and v.code == "tpot" and v.retry_after_s > 0


def test_handoffs_piling_up_refuse_what_would_miss_its_tpot():
    clock = Clock()
    a = cluster(clock=clock)
    # 10 handoffs completed over the last 5 s: 2 per second.
    for _ in range(10):
        t = a.started(256)
        a.progress(t, 1)
        clock.t += 0.5
        a.progress(t, 2)
    assert a.handoff_wait() == 0.0                 # none waiting
    waiting = admitted(a, 6, 256)
    for t in waiting:
        a.progress(t, 1)                           # 6 first tokens out, their handoffs waiting: 3 s
    assert a.handoff_wait() == pytest.approx(3.0)
    v = a.check(256, 16)                           # 15 tokens after the first at 20 ms: 0.15 s for its handoff
    assert not v.admit and v.code == "tpot" and v.retry_after_s == pytest.approx(3.0 - 0.15)
    assert a.check(256, 1).admit                   # one token: no TPOT to miss
    assert a.check(256, 400).admit                 # 4 s of budget: the wait fits in its half
    for t in waiting:
        a.ended(t)
    assert a.in_handoff == 0 and a.check(256, 16).admit


def test_a_burst_of_handoffs_has_its_own_rate_not_the_windows():
    """Handoffs that all completed in the last 0.4 s after a quiet spell (a server's first
    requests) clear at their own pace: the wait is not stretched over the 5 s window."""
    clock = Clock()
    a = cluster(clock=clock)
    clock.t += 100.0
    for _ in range(9):                             # 9 completions 50 ms apart: 20 per second
        t = a.started(64)
        a.progress(t, 1)
        clock.t += 0.05
        a.progress(t, 2)
    waiting = admitted(a, 2, 64)
    for t in waiting:
        a.progress(t, 1)
    assert a.handoff_wait() == pytest.approx(2 / 20, rel=0.2)
    assert a.check(64, 14).admit                   # 0.13 s of budget at 20 ms TPOT: the 0.1 s fits


def test_measured_ttft_corrects_the_predictions():
    a = cluster(prefill=1)
    admitted(a, 20, 512)
    before, _ = a.predict_ttft(256)
    for _ in range(100):                           # every first token comes twice as late as predicted
        predicted, _ = a.predict_ttft(256)
        t = a.started(256, predicted)
        a.progress(t, 1, ttft_s=2 * predicted / a.correction)
        a.ended(t)
    assert a.predict_ttft(256)[0] == pytest.approx(2 * before, rel=0.02)
    t = a.started(256)                             # no prediction: nothing learnt
    a.progress(t, 1, ttft_s=100.0)
    assert a.predict_ttft(256)[0] == pytest.approx(2 * before, rel=0.02)


def test_colocated_pools_are_priced_alike():
    a = cluster(prefill=1, mode=COLOCATED)
    assert a.check(256, 16).admit
    admitted(a, 200, 512)
    assert not a.check(256, 16).admit
