"""The scheduler and KV cache manager as plain logic, driven by a fake model.

The fake model does what LLMEngine.step does with the scheduler's output (apply swaps, compute
the scheduled tokens, append a token to each sequence whose chunk reaches its end) and also
keeps a shadow of the KV cache: every slot records which token prefix its K/V was computed
from. Each step checks that a sequence's attention would read exactly its own prefix, so a
wrong prefix-cache hit, a lost swap copy or a reused live block shows up as a wrong read.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from workers.block_pool import hash_block_tokens
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.kv_cache_manager import KVCacheManager
from workers.scheduler import PreemptionCostModel, Scheduler
from workers.sequence import SamplingParams, Sequence, SequenceStatus

# Swap is cheaper than recompute from ~20 tokens on: "auto" exercises both choices.
CROSSOVER_COST_MODEL = PreemptionCostModel(kv_bytes_per_token=1_000_000, num_params=1_000_000,
                                           attn_flops_per_token_pair=1_800_000, num_layers=1,
                                           copy_overhead_s=0.0)


class FakeModel:
    """Shadow KV memory: slot -> the token prefix whose last token's K/V it holds."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.bs = kv.block_size
        self.device = [[None] * self.bs for _ in range(kv.pool.num_blocks)]
        self.host = [[None] * self.bs for _ in range(kv.host.num_blocks)]

    def execute(self, out, next_token) -> None:
        for dev, host in out.swap_out:
            self.host[host] = list(self.device[dev])
        for host, dev in out.swap_in:
            self.device[dev] = list(self.host[host])
        written = set()
        for seq, n in out.scheduled:                  # every write of the step, then every read
            table = self.kv.block_ids(seq)
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                slot = (table[pos // self.bs], pos % self.bs)
                assert slot not in written, f"{seq} writes a slot another sequence writes this step"
                written.add(slot)
                self.device[slot[0]][slot[1]] = tuple(seq.token_ids[:pos + 1])
        for seq, n in out.scheduled:
            table = self.kv.block_ids(seq)
            for pos in range(seq.num_computed_tokens + n):
                got = self.device[table[pos // self.bs]][pos % self.bs]
                assert got == tuple(seq.token_ids[:pos + 1]), f"{seq} reads wrong K/V at position {pos}"
        for seq, n in out.scheduled:                  # as LLMEngine.step
            seq.num_computed_tokens += n
        for seq, _ in out.scheduled:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(next_token(seq))


def check_step(sched: Scheduler, out) -> None:
    """Invariants right after one schedule() call."""
    cfg, kv = sched.cfg, sched.kv
    ids = [s.seq_id for s, _ in out.scheduled]
    assert len(ids) == len(set(ids)), "a sequence scheduled twice in one step"
    assert out.num_batched_tokens == sum(n for _, n in out.scheduled)
    if cfg.chunked_prefill or len(out.scheduled) != 1:   # (a whole prompt over the budget runs alone)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    for seq, n in out.scheduled:
        assert n >= 1
        assert seq.num_computed_tokens + n <= seq.num_tokens
        assert seq.status is SequenceStatus.RUNNING and seq in sched.running
        assert kv.num_blocks_of(seq) * kv.block_size >= seq.num_computed_tokens + n
    assert not {s.seq_id for s in out.preempted} & set(ids)
    assert len(sched.running) <= cfg.max_num_seqs

    pool = kv.pool
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    free = {b.block_id for b in pool.free_blocks()}
    assert len(free) == pool.num_free
    assert all((b.block_id in free) == (b.ref_cnt == 0) for b in pool.blocks)
    held: dict[int, int] = {}
    for queue, status in ((sched.running, SequenceStatus.RUNNING), (sched.waiting, SequenceStatus.WAITING),
                          (sched.swapped, SequenceStatus.SWAPPED)):
        for seq in queue:
            assert seq.status is status, seq
    for seq in sched.running:
        table = kv.block_ids(seq)
        assert len(table) * kv.block_size >= seq.num_computed_tokens
        for i, bid in enumerate(table):
            held[bid] = held.get(bid, 0) + 1
            h = pool.blocks[bid].block_hash
            assert h is None or h == seq.block_hashes[i], "indexed block's hash is not its content"
    for seq in list(sched.waiting) + list(sched.swapped):
        assert kv.num_blocks_of(seq) == 0, f"{seq} holds device blocks outside running"
    for seq in sched.waiting:
        assert seq.num_computed_tokens == 0, seq
    for b in pool.blocks:                             # only running sequences hold device blocks
        assert b.ref_cnt == held.get(b.block_id, 0), b
    assert sched.stats.prefix_cache_hits <= sched.stats.prefix_cache_queries


@dataclass
class Workload:
    block_size: int
    num_blocks: int
    num_host_blocks: int
    budget: int
    max_num_seqs: int
    watermark: float
    mode: str
    policy: str
    caching: bool
    seqs: list[tuple[int, list[int], int, int]]       # (arrival step, prompt, max_tokens, priority)
    aborts: list[tuple[int, int]]                      # (step, which unfinished sequence)
    chunked: bool = True                               # chunked prefill (else whole prompts, steps apart)


@st.composite
def workloads(draw) -> Workload:
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.sampled_from([4, 8, 12, 20, 2, 3]))
    capacity = num_blocks * bs
    # Few token values and long shared prefixes make prefix-cache hits (and hash chains)
    # common; several sequences arriving together with demand above capacity make
    # preemption common.
    bases = [draw(st.lists(st.integers(0, 2), min_size=48, max_size=48)) for _ in range(2)]
    seqs = []
    for _ in range(draw(st.sampled_from([6, 3, 8, 1, 2]))):
        prompt_len = draw(st.integers(1, min(48, capacity - 1)))
        shared = draw(st.sampled_from([prompt_len, prompt_len - 1, prompt_len // 2, 0]))
        prompt = bases[draw(st.sampled_from([0, 1]))][:shared] + draw(
            st.lists(st.integers(0, 2), min_size=prompt_len - shared, max_size=prompt_len - shared))
        # One sequence must fit alone (the engine caps max_model_len at the cache's capacity).
        max_tokens = min(draw(st.sampled_from([24, 12, 5, 1])), capacity - prompt_len)
        arrival = draw(st.sampled_from([0, 0, 1, 3, 6]))
        seqs.append((arrival, prompt, max_tokens, draw(st.sampled_from([0, 1, 2]))))
    return Workload(
        block_size=bs, num_blocks=num_blocks, num_host_blocks=draw(st.sampled_from([64, 16, 4, 0])),
        budget=draw(st.sampled_from([512, 64, 16, 8, 3, 1])), max_num_seqs=draw(st.sampled_from([8, 4, 2, 1])),
        watermark=draw(st.sampled_from([0.0, 0.05, 0.2])),
        mode=draw(st.sampled_from(["recompute", "swap", "auto"])),
        policy=draw(st.sampled_from(["fcfs", "priority"])), caching=draw(st.sampled_from([True, False])),
        chunked=draw(st.sampled_from([True, False])),
        seqs=seqs, aborts=draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 7)), max_size=3)))


def run_workload(w: Workload, max_steps: int = 3000) -> tuple[Scheduler, list[Sequence], set[str]]:
    kv = KVCacheManager(w.num_blocks, w.block_size, w.caching, w.num_host_blocks)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=w.budget, max_num_seqs=w.max_num_seqs,
                                      watermark=w.watermark, preemption_mode=w.mode, policy=w.policy,
                                      chunked_prefill=w.chunked),
                      kv, CROSSOVER_COST_MODEL)
    model = FakeModel(kv)
    order = sorted(range(len(w.seqs)), key=lambda i: w.seqs[i][0])
    seqs: list[Sequence | None] = [None] * len(w.seqs)
    aborted: set[str] = set()

    def next_token(seq: Sequence) -> int:        # never an EOS: outputs end by max_tokens only
        return (int(seq.seq_id[1:]) + seq.num_tokens) % 3

    step = 0
    while step == 0 or sched.has_unfinished() or any(s is None for s in seqs):
        assert step < max_steps, f"no progress after {max_steps} steps: {sched.running} {sched.waiting} {sched.swapped}"
        for rank, i in enumerate(order):
            arrival, prompt, max_tokens, priority = w.seqs[i]
            if seqs[i] is None and arrival <= step:
                seqs[i] = Sequence(f"s{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                   priority=priority, arrival_time=float(rank))
                sched.add(seqs[i])
        for at, which in w.aborts:
            # Swapped ones first: aborting them is the rarest path, and the one with host blocks.
            live = list(sched.swapped) + list(sched.waiting) + list(sched.running)
            if at == step and live:
                victim = live[which % len(live)]
                sched.finish(victim, "abort")
                aborted.add(victim.seq_id)
        out = sched.schedule()
        check_step(sched, out)
        model.execute(out, next_token)
        for seq, _ in out.scheduled:
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
        step += 1
    return sched, seqs, aborted


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants(w):
    sched, seqs, aborted = run_workload(w)
    stats = sched.stats
    for what, happened in [("swap", stats.num_preemptions["swap"]), ("recompute", stats.num_preemptions["recompute"]),
                           ("prefix hit", stats.prefix_cache_hits), ("abort", aborted)]:
        event(f"{what}: {'yes' if happened else 'no'}")
    kv = sched.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.host.num_free == kv.host.num_blocks
    assert sorted(kv.host._free) == list(range(kv.host.num_blocks)), "a host block freed twice or lost"
    for seq in seqs:
        assert seq.is_finished
        if seq.seq_id in aborted:
            assert seq.finish_reason == "abort"
        else:
            assert seq.finish_reason == "length"
            assert seq.num_output_tokens == seq.params.max_tokens


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_a_tight_pool_preempts_and_finishes(mode):
    """A fixed heavy workload: preemption must actually happen, by the configured means."""
    w = Workload(block_size=2, num_blocks=12, num_host_blocks=40, budget=16, max_num_seqs=8, watermark=0.0,
                 mode=mode, policy="fcfs", caching=True,
                 seqs=[(0, [i % 3] * 12 + [i], 10, 0) for i in range(6)], aborts=[])
    sched, seqs, _ = run_workload(w)
    n = sched.stats.num_preemptions
    assert all(s.finish_reason == "length" and s.num_output_tokens == 10 for s in seqs)
    if mode == "recompute":
        assert n["recompute"] > 0 and n["swap"] == 0
    elif mode == "swap":
        assert n["swap"] > 0
    else:
        assert n["swap"] + n["recompute"] > 0


# -- plain unit tests ------------------------------------------------------------------------

def make(num_blocks=64, block_size=16, caching=True, host=0, **sched_kwargs):
    kv = KVCacheManager(num_blocks, block_size, caching, host)
    return Scheduler(SchedulerConfig(**sched_kwargs), kv, CROSSOVER_COST_MODEL), FakeModel(kv)


def seq(i, prompt_len_or_ids, max_tokens=100, priority=0):
    ids = prompt_len_or_ids if isinstance(prompt_len_or_ids, list) else [7] * prompt_len_or_ids
    return Sequence(f"s{i}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    priority=priority, arrival_time=float(i))


def step(sched, model):
    out = sched.schedule()
    check_step(sched, out)
    model.execute(out, lambda s: 1)
    for s, _ in out.scheduled:
        if s.num_output_tokens >= s.params.max_tokens:
            sched.finish(s, "length")
    return out


def test_decode_not_starved_by_long_prefill():
    sched, model = make(num_blocks=64, block_size=16, max_num_batched_tokens=32, caching=False)
    a = seq(0, 10)
    sched.add(a)
    assert step(sched, model).scheduled == [(a, 10)]
    assert a.num_output_tokens == 1                      # a is now decoding
    b = seq(1, 500)
    sched.add(b)
    for _ in range(5):                                   # b's prefill takes many steps...
        out = step(sched, model)
        assert (a, 1) in out.scheduled                   # ...and a decodes in every one of them
        assert (b, 31) in out.scheduled
        assert out.num_batched_tokens == 32


def test_without_chunked_prefill_prompts_run_whole_in_steps_of_their_own():
    """vLLM v0's schedule: waiting prompts are admitted whole, as many as the budget holds,
    and decoding pauses for that step; a prompt over the budget runs alone."""
    sched, model = make(num_blocks=128, block_size=16, max_num_batched_tokens=64, caching=False,
                        chunked_prefill=False)
    a = seq(0, 10)
    sched.add(a)
    assert step(sched, model).scheduled == [(a, 10)]
    b, c, d = seq(1, 30), seq(2, 30), seq(3, 30)
    for x in (b, c, d):
        sched.add(x)
    assert step(sched, model).scheduled == [(b, 30), (c, 30)]         # a pauses; d does not fit too
    assert step(sched, model).scheduled == [(d, 30)]
    assert step(sched, model).scheduled == [(a, 1), (b, 1), (c, 1), (d, 1)]
    e = seq(4, 200)                                                    # over the budget: alone, whole
    sched.add(e)
    out = step(sched, model)
    assert out.scheduled == [(e, 200)] and out.num_batched_tokens == 200


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_admission_order_follows_policy(policy):
    sched, model = make(max_num_seqs=1, policy=policy)
    priorities = [2, 0, 1, 0, 2]
    seqs = [seq(i, 5, max_tokens=2, priority=p) for i, p in enumerate(priorities)]
    for s in reversed(seqs):                             # insertion order must not matter
        sched.add(s)
    started = []
    while sched.has_unfinished():
        for s, _ in step(sched, model).scheduled:
            if s.seq_id not in started:
                started.append(s.seq_id)
    if policy == "priority":
        expected = sorted(range(5), key=lambda i: (priorities[i], i))
    else:
        expected = list(range(5))
    assert started == [f"s{i}" for i in expected]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_victim_follows_policy(policy):
    # 6 blocks of 2 tokens; two 4-token prompts; decoding grows both until one must go.
    sched, model = make(num_blocks=6, block_size=2, caching=False, policy=policy, preemption_mode="recompute",
                     watermark=0.0)
    low = seq(0, [1, 2, 3, 4], priority=1)              # arrived first, lower priority
    high = seq(1, [5, 6, 7, 8], priority=0)
    sched.add(low)
    sched.add(high)
    preempted = []
    for _ in range(6):
        preempted += step(sched, model).preempted
        if preempted:
            break
    assert preempted == ([low] if policy == "priority" else [high])


@pytest.mark.parametrize("where", ["swapped", "waiting", "running"])
def test_abort_returns_blocks_wherever_the_sequence_is(where):
    sched, model = make(num_blocks=6, block_size=2, caching=True, host=16, preemption_mode="swap",
                        watermark=0.0)
    a, b = seq(0, [1, 2, 3, 4], max_tokens=6), seq(1, [5, 6, 7, 8], max_tokens=6)
    sched.add(a)
    sched.add(b)
    for _ in range(10):                                 # b is swapped out to make room for a
        step(sched, model)
        if sched.swapped:
            break
    assert list(sched.swapped) == [b] and sched.kv.host.num_free < 16
    c = seq(2, [9] * 3, max_tokens=2)
    sched.add(c)
    target = {"swapped": b, "waiting": c, "running": a}[where]
    sched.finish(target, "abort")
    assert target.finish_reason == "abort" and target.is_finished
    assert target not in sched.running and target not in sched.waiting and target not in sched.swapped
    while sched.has_unfinished():
        step(sched, model)
    kv = sched.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    assert kv.host.num_free == kv.host.num_blocks
    for s in (a, b, c):
        assert s.finish_reason == ("abort" if s is target else "length")


@pytest.mark.parametrize("watermark, admitted", [(0.25, False), (0.0, True)])
def test_watermark_blocks_admission(watermark, admitted):
    sched, model = make(num_blocks=20, block_size=4, caching=False, watermark=watermark)
    assert sched.watermark_blocks == int(watermark * 20)
    a = seq(0, 20)
    sched.add(a)
    step(sched, model)                                      # a holds 5 blocks, 15 free
    b = seq(1, 40)                                       # needs 10: would leave 4 < 5 after a's 6th
    sched.add(b)
    out = step(sched, model)
    assert (a, 1) in out.scheduled
    assert any(s is b for s, _ in out.scheduled) == admitted
    assert (b in sched.waiting) != admitted


def test_watermark_ignored_when_nothing_runs():
    sched, model = make(num_blocks=20, block_size=4, caching=False, watermark=0.5)
    a = seq(0, 76)                                       # 19 of 20 blocks, far past the watermark
    sched.add(a)
    assert step(sched, model).scheduled == [(a, 76)]


@pytest.mark.parametrize("prompt_len", list(range(1, 34)))
def test_last_prompt_token_always_recomputed(prompt_len):
    sched, model = make(num_blocks=64, block_size=4)
    prompt = [(i * 5) % 11 for i in range(prompt_len)]
    first = seq(0, list(prompt), max_tokens=1)
    sched.add(first)
    while sched.has_unfinished():
        step(sched, model)
    again = seq(1, list(prompt), max_tokens=1)
    sched.add(again)
    out = step(sched, model)
    cached = again.num_cached_tokens
    assert cached <= prompt_len - 1
    assert cached == (prompt_len - 1) // 4 * 4           # every full block but the last token's
    assert out.scheduled == [(again, prompt_len - cached)]
    assert again.output_token_ids == [1]                 # it got logits for its last prompt token


_HASH_SCRIPT = """
import sys
from workers.block_pool import hash_block_tokens
h = None
out = []
for block in [[1, 2, 3, 4], [5, 6, 7, 8], [0, 0, 0, 0], [2**40, 257, 3, 9]]:
    h = hash_block_tokens(h, block)
    out.append(h.hex())
print(",".join(out))
"""


def test_block_hash_is_chained_and_stable_across_processes():
    here, h = [], None
    for block in [[1, 2, 3, 4], [5, 6, 7, 8], [0, 0, 0, 0], [2**40, 257, 3, 9]]:
        h = hash_block_tokens(h, block)
        here.append(h.hex())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for seed in ("0", "12345"):                          # Python's own hash() differs between these
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=root)
        res = subprocess.run([sys.executable, "-c", _HASH_SCRIPT], capture_output=True, text=True,
                             env=env, cwd=root, check=True)
        assert res.stdout.strip().split(",") == here
    # Chained: the same tokens under another parent hash to something else.
    assert hash_block_tokens(None, [5, 6, 7, 8]) != hash_block_tokens(bytes.fromhex(here[0]), [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [1, 2, 3, 5])


def test_cost_model_prefers_swap_for_long_and_recompute_for_short():
    m = CROSSOVER_COST_MODEL
    assert not m.prefers_swap(1)
    assert not m.prefers_swap(10)
    assert m.prefers_swap(100)
    assert m.prefers_swap(10_000)


@settings(max_examples=200, deadline=None, database=None)
@given(kv=st.integers(1, 10**7), params=st.integers(1, 10**10), attn=st.integers(1, 10**7),
       layers=st.integers(1, 128), n=st.integers(1, 100_000), more=st.integers(1, 100_000))
def test_cost_model_is_monotone(kv, params, attn, layers, n, more):
    """Once swap wins at some length it wins at every longer one: no flip-flopping."""
    m = PreemptionCostModel(kv_bytes_per_token=kv, num_params=params, attn_flops_per_token_pair=attn,
                            num_layers=layers)
    if m.prefers_swap(n):
        assert m.prefers_swap(n + more)


def test_engine_cost_model_recomputes_short_sequences():
    """The cost model the engine actually builds for its built-in model must make "auto"
    mean something: recompute a one-token victim (a swap's fixed copy costs dominate), swap
    a long one (recompute's quadratic attention dominates)."""
    from workers.engine import LLMEngine
    engine = LLMEngine(EngineConfig(model="tiny", cache=CacheConfig(num_blocks=4, swap_space_bytes=0)))
    m = engine.scheduler.cost_model
    assert m.prefers_swap(4000)
    assert not m.prefers_swap(1)
