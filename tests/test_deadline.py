"""The deadline policy as plain logic: prefill work by least slack, the hopeless last, decodes
first, victims with the most slack; each checked against FCFS on the same input or against the
slack worked out here from the definition."""
from __future__ import annotations

from common import Clock
from hypothesis import HealthCheck, given, settings

from test_scheduler import FakeModel, Workload, check_step, workloads
from test_scheduler import step as scheduler_step
from workers.config import SchedulerConfig
from workers.kv_cache_manager import KVCacheManager
from workers.scheduler import Scheduler
from workers.sequence import SamplingParams, Sequence

SPT = 0.01                          # seconds per prefill token the tests' schedulers assume


def make(policy="deadline", num_blocks=256, block_size=4, budget=64, chunked=True, **kw):
    clock = Clock(0.0)
    kv = KVCacheManager(num_blocks, block_size, True, 0)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, policy=policy, chunked_prefill=chunked,
                          prefill_s_per_token=SPT, watermark=0.0, preemption_mode="recompute", **kw)
    return Scheduler(cfg, kv, clock=clock), FakeModel(kv), clock


def seq(i, n, deadline=None, max_tokens=4, arrival=None, tpot=None):
    s = Sequence(f"s{i}", [i % 200 + 1] + [7] * (n - 1), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                 arrival_time=float(i if arrival is None else arrival))
    s.ttft_deadline, s.tpot_s = deadline, tpot
    return s


def step(sched, model, clock, dt=0.1):
    out = scheduler_step(sched, model)
    clock.t += dt
    return out


def first_token_steps(sched, model, clock, seqs, max_steps=500) -> dict[str, int]:
    for s in seqs:
        sched.add(s)
    first = {}
    for k in range(max_steps):
        step(sched, model, clock)
        for s in seqs:
            if s.num_output_tokens and s.seq_id not in first:
                first[s.seq_id] = k
        if not sched.has_unfinished():
            return first
    raise AssertionError("no progress")


def test_waiting_prompts_start_by_least_slack_not_arrival():
    def inputs():
        return [seq(0, 20, deadline=10.0), seq(1, 20, deadline=2.0), seq(2, 60, deadline=1.5),
                seq(3, 40)]                                      # no deadline: after the others
    # The oracle: slack = deadline - now - remaining x SPT at the first step.
    want = sorted(range(3), key=lambda i: inputs()[i].ttft_deadline - inputs()[i].num_tokens * SPT) + [3]
    for policy, order in (("deadline", want), ("fcfs", [0, 1, 2, 3])):
        sched, model, clock = make(policy, max_num_seqs=1)       # one at a time: the start order shows
        first = first_token_steps(sched, model, clock, inputs())
        assert sorted(first, key=first.get) == [f"s{i}" for i in order], policy


def test_requests_that_can_still_meet_their_deadline_go_before_the_hopeless():
    sched, model, clock = make(max_num_seqs=1)
    late = seq(0, 100, deadline=0.5)         # slack 0.5 - 1.0 < 0: cannot make it
    ok = seq(1, 20, deadline=5.0)            # slack 4.8
    none = seq(2, 20)                        # no deadline: can always meet it
    first = first_token_steps(sched, model, clock, [late, ok, none])
    assert sorted(first, key=first.get) == ["s1", "s2", "s0"]
    # Least slack alone (no hopeless rule) would have started the late one first.
    assert late.ttft_deadline - 100 * SPT < ok.ttft_deadline - 20 * SPT


def test_a_tight_prompt_takes_the_budget_from_a_loose_running_prefill():
    """Chunked: the running prefill of a long, loose prompt and a tight prompt arriving later
    are one queue; the tight one gets the budget first. Under FCFS it waits for the long one."""
    got = {}
    for policy in ("deadline", "fcfs"):
        sched, model, clock = make(policy, budget=32)
        long = seq(0, 640, deadline=100.0)
        sched.add(long)
        for _ in range(3):
            step(sched, model, clock)
        tight = seq(1, 48, deadline=clock.t + 1.0)
        sched.add(tight)
        steps = 0
        while not tight.num_output_tokens:
            out = step(sched, model, clock)
            steps += 1
            if policy == "deadline":
                assert out.scheduled[0][0] is tight and out.num_batched_tokens == 32
        got[policy] = steps
    assert got["deadline"] == 2                              # 48 tokens at 32 a step
    assert got["fcfs"] > 600 // 32


def test_decodes_keep_their_token_first_tightest_tpot_first():
    sched, model, clock = make(budget=16)
    loose, tight = seq(0, 4, max_tokens=50, tpot=1.0), seq(1, 4, max_tokens=50, tpot=0.01)
    sched.add(loose)
    sched.add(tight)
    step(sched, model, clock)                                # both prompts, both now decode
    sched.add(seq(2, 400, deadline=0.01))                    # urgent prefill work
    out = step(sched, model, clock)
    assert [(s.seq_id, n) for s, n in out.scheduled] == [("s1", 1), ("s0", 1), ("s2", 14)]


def test_without_chunked_prefill_prompts_run_whole_by_least_slack():
    sched, model, clock = make(chunked=False, budget=64)
    a, b, c = seq(0, 40, deadline=9.0), seq(1, 40, deadline=1.0), seq(2, 40, deadline=3.0)
    for s in (a, b, c):
        sched.add(s)
    assert [s for s, _ in step(sched, model, clock).scheduled] == [b]     # whole: one fits the budget
    assert [s for s, _ in step(sched, model, clock).scheduled] == [c]
    assert [s for s, _ in step(sched, model, clock).scheduled] == [a]


def test_preemption_takes_the_prefill_with_the_most_slack():
    """Two prompts prefill in chunks until blocks run out: the victim is the one with the most
    slack (under FCFS, the later arrival, here the tight one)."""
    for policy, victim in (("deadline", "s0"), ("fcfs", "s1")):
        sched, model, clock = make(policy, num_blocks=20, block_size=4, budget=16)
        loose, tight = seq(0, 60, deadline=50.0, arrival=0.0), seq(1, 60, deadline=1.0, arrival=1.0)
        sched.add(loose)
        sched.add(tight)
        preempted = []
        while not preempted:
            preempted = step(sched, model, clock).preempted
        assert [s.seq_id for s in preempted] == [victim], policy


def test_measured_full_steps_update_the_estimate():
    sched, _, _ = make(budget=100)
    sched.observe_step(10, 5.0)                              # a small step: its fixed cost dominates
    assert sched.prefill_s_per_token == SPT
    for _ in range(50):
        sched.observe_step(100, 0.5)
    assert abs(sched.prefill_s_per_token - 0.005) < 1e-4


def run_with_deadlines(w: Workload, policy: str, inheritance: bool = True, max_steps: int = 3000):
    """test_scheduler's random workloads under another policy, each sequence with a deadline."""
    clock = Clock(0.0)
    kv = KVCacheManager(w.num_blocks, w.block_size, w.caching, w.num_host_blocks)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=w.budget, max_num_seqs=w.max_num_seqs,
                                      watermark=w.watermark, preemption_mode=w.mode, policy=policy,
                                      chunked_prefill=w.chunked, priority_inheritance=inheritance,
                                      prefill_s_per_token=0.05), kv, clock=clock)
    model = FakeModel(kv)
    seqs: list[Sequence | None] = [None] * len(w.seqs)
    for k in range(max_steps):
        for i, (arrival, prompt, max_tokens, priority) in enumerate(w.seqs):
            if seqs[i] is None and arrival <= k:
                s = seqs[i] = Sequence(f"s{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                       priority=priority, arrival_time=clock.t)
                s.ttft_deadline, s.tpot_s = (clock.t + (i % 4), 0.1 * (i % 3)) if i % 5 else (None, None)
                sched.add(s)
        out = sched.schedule()
        check_step(sched, out)
        model.execute(out, lambda s: (int(s.seq_id[1:]) + s.num_tokens) % 3)
        for s, _ in out.scheduled:
            if s.num_output_tokens >= s.params.max_tokens:
                sched.finish(s, "length")
        clock.t += 0.25
        if all(s is not None for s in seqs) and not sched.has_unfinished():
            break
    else:
        raise AssertionError(f"no progress: {sched.running} {sched.waiting} {sched.swapped}")
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert kv.num_free_blocks == kv.pool.num_blocks and kv.host.num_free == kv.host.num_blocks


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants_under_deadlines(w):
    run_with_deadlines(w, "deadline")


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants_without_inheritance(w):
    run_with_deadlines(w, "priority", inheritance=False)
