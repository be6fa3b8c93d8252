"""Priority with inheritance as plain logic: a high-priority prompt waits for the shared prefix a
lower-priority one is computing instead of computing it twice, lends it its priority until the
prefix is computed, and is not held behind lower-priority prefills; each checked in steps against
the same run with inheritance off, or against the work the prompts need."""
from __future__ import annotations

from test_scheduler import FakeModel, step
from workers.config import SchedulerConfig
from workers.engine_core import EngineCore, KVCacheLayout
from workers.kv_cache_manager import KVCacheManager
from workers.scheduler import Scheduler
from workers.sequence import SamplingParams, Sequence

BS, BUDGET = 16, 32


def prompt(tag: int, n: int) -> list[int]:
    """n tokens of their own: `tag` first, so no two prompts share a block unless built to."""
    return [tag] + [(tag * 7 + i) % 250 for i in range(1, n)]


P = prompt(1, 256)                  # the shared prefix: 16 full blocks


class StepEngine(EngineCore):
    """The engine's bookkeeping with a fake model (as the simulator's): every sampled token is 0."""

    def _execute(self, out):
        seqs = [s for s, n in out.scheduled if s.num_computed_tokens + n == s.num_tokens]
        return seqs, [0] * len(seqs), None


def engine(inheritance: bool = True, num_blocks: int = 512) -> StepEngine:
    cfg = SchedulerConfig(max_num_batched_tokens=BUDGET, policy="priority", priority_inheritance=inheritance,
                          watermark=0.0)
    return StepEngine(cfg, KVCacheLayout(1, BS, num_blocks, 0), 4096, 256)


def add(e: StepEngine, rid: str, ids: list[int], priority: int, max_tokens: int = 4):
    return e.add_request(prompt_token_ids=ids, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                         request_id=rid, priority=priority, arrival_time=float(len(e._seqs)))


def run_high_behind_low(inheritance: bool, medium: bool = False):
    """A long low-priority request (the shared prefix P, then 512 tokens of its own) computes its
    prompt; other low-priority requests queue; after 3 steps a high-priority request with the same
    prefix and 16 tokens of its own arrives (and, with `medium`, medium-priority work first).
    Returns (the high one's first token, in steps after it arrived; the engine; the high one)."""
    e = engine(inheritance)
    add(e, "low", P + prompt(2, 512), priority=2)
    for i in range(6):
        add(e, f"queue-{i}", prompt(10 + i, 200), priority=2)
    for _ in range(3):
        e.step()
    if medium:
        add(e, "medium", prompt(30, 400), priority=1)
    high = add(e, "high", P + prompt(3, 16), priority=0)
    for k in range(1, 200):
        e.step()
        if high.num_output_tokens:
            return k, e, high
    raise AssertionError("the high-priority request never got its first token")


def test_a_high_priority_prompt_waits_only_for_the_shared_prefill():
    done_before = 3 * BUDGET                                  # of P, when the high one arrives
    bound = -(-(len(P) - done_before) // BUDGET) + 1          # the rest of P, then its own 16 tokens
    steps, e, high = run_high_behind_low(inheritance=True)
    assert steps <= bound
    assert high.num_cached_tokens == len(P)                   # P was computed once, by the low one
    # Off: the low one's running prefill keeps the budget; the high one waits for all of it.
    off, _, _ = run_high_behind_low(inheritance=False)
    assert off > bound + (512 // BUDGET) - 2, (steps, off)


def test_the_holder_goes_ahead_of_medium_work_until_the_prefix_is_done():
    """With medium-priority work waiting, the low holder would get no budget (it would hold up the
    high one, an inversion); it inherits the high priority instead, and gives it back after."""
    e = engine()
    low = add(e, "low", P + prompt(2, 512), priority=2)
    e.step()
    medium = add(e, "medium", prompt(30, 400), priority=1)
    high = add(e, "high", P + prompt(3, 16), priority=0)
    firsts = []
    while not high.num_output_tokens:
        out = e.scheduler.schedule()
        firsts.append(out.scheduled[0][0])
        e.finish_step(out, *e._execute(out))
    assert all(s is low for s in firsts[:-1]) and firsts[-1] is high, [s.seq_id for s in firsts]
    assert high.num_cached_tokens == len(P)
    assert low.num_computed_tokens < low.num_prompt_tokens   # its own part still to come
    out = e.scheduler.schedule()
    assert [s for s, _ in out.scheduled] == [high, medium]  # the boost is over: low is behind medium again


def test_several_waiters_and_a_chain_compute_each_block_once():
    """Two waiters on one holder; then the second waits on the first for the next prefix part."""
    e = engine()
    p2 = prompt(4, 128)
    low = add(e, "low", P + prompt(2, 64), priority=2)
    e.step()
    w0 = add(e, "w0", P + p2 + prompt(5, 8), priority=0)
    w1 = add(e, "w1", P + p2 + prompt(6, 8), priority=1)
    while e.has_unfinished():
        e.step()
    assert low.num_cached_tokens == 0 and w0.num_cached_tokens == len(P)
    assert w1.num_cached_tokens == len(P) + len(p2)          # waited on low, then on w0
    assert [s.finish_reason for s in (low, w0, w1)] == ["length"] * 3


def test_an_aborted_holder_leaves_the_waiter_to_compute():
    e = engine()
    add(e, "low", P + prompt(2, 64), priority=2)
    e.step()
    e.step()
    high = add(e, "high", P + prompt(3, 16), priority=0)
    e.step()
    assert high in e.scheduler.waiting                        # waiting for low's blocks
    done = e.scheduler.running[0].num_computed_tokens
    e.abort("low")
    e.step()
    assert high in e.scheduler.running and high.num_cached_tokens == done // BS * BS
    while e.has_unfinished():
        e.step()
    assert high.finish_reason == "length"


def make_sched(inheritance=True, num_blocks=64):
    kv = KVCacheManager(num_blocks, 4, True, 0)
    cfg = SchedulerConfig(max_num_batched_tokens=16, policy="priority", priority_inheritance=inheritance,
                          watermark=0.0, preemption_mode="recompute")
    return Scheduler(cfg, kv), FakeModel(kv)


def seq(i, ids, priority, max_tokens=40):
    return Sequence(f"s{i}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority,
                    arrival_time=float(i))


def test_lower_priorities_are_preempted_first_and_the_holder_last():
    """Blocks run out while a decode grows: the victim is the lowest effective priority. The
    holder's own priority is the lowest of all, but it lends a waiter's (and without inheritance
    it is the victim)."""
    shared = prompt(1, 96)                                    # 24 blocks: more than the pool has left
    for inheritance, victim in ((True, "s1"), (False, "s2")):
        sched, model = make_sched(inheritance, num_blocks=20)
        top = seq(0, prompt(9, 4), priority=0, max_tokens=200)
        mid = seq(1, prompt(8, 4), priority=2, max_tokens=200)
        holder = seq(2, shared + prompt(7, 40), priority=3)
        for s in (top, mid, holder):
            sched.add(s)
        step(sched, model)
        sched.add(seq(3, shared + prompt(6, 8), priority=1))  # waits on the holder
        preempted = []
        while not preempted:
            preempted = step(sched, model).preempted
        assert preempted[0].seq_id == victim, inheritance


def test_a_preempted_holder_does_not_leave_its_waiter_waiting():
    """The holder loses its blocks mid-prefix (top-priority decodes need them): the waiter must
    not wait on it any more; everything finishes and every block comes back."""
    sched, model = make_sched(num_blocks=30)
    shared = prompt(1, 96)
    tops = [seq(i, prompt(20 + i, 4), priority=0, max_tokens=20) for i in range(4)]
    holder = seq(4, shared + prompt(7, 8), priority=3, max_tokens=4)
    sched.add(holder)
    step(sched, model)
    waiter = seq(5, shared + prompt(6, 8), priority=1, max_tokens=4)
    for s in tops + [waiter]:
        sched.add(s)
    preempted = False
    for _ in range(400):
        out = step(sched, model)
        preempted |= holder in out.preempted and not waiter.num_output_tokens
        if not sched.has_unfinished():
            break
    assert preempted                                          # the case this test is about happened
    assert all(s.is_finished and s.finish_reason == "length" for s in tops + [holder, waiter])
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
