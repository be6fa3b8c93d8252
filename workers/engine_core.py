"""The engine's bookkeeping without a model: requests, the handoff verbs, and the step around an
`_execute` that computes the scheduled tokens.

`LLMEngine` (workers/engine.py) executes with the model runner; the simulator
(cluster/capacity/simulate.py) executes with the cost model on a virtual clock. Both run this code, the
real scheduler and the real KV cache manager, so a simulated worker chunks, caches prefixes,
holds back at the watermark and preempts as a served one does. Plain Python: no torch, no Ray.

A step is `schedule_step()` (what runs, and its shape) then `finish_step()` (the sampled tokens
appended, stops checked); `step()` does both around `_execute`. The simulator calls the halves
itself, at the start and the end of the step's modelled time.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from workers.config import SchedulerConfig
from workers.cost_model import BatchShape, batch_shape
from workers.kv_cache_manager import KVCacheManager
from workers.messages import ENDS_REPORTED, LoadReport, TransferTotals
from workers.scheduler import PreemptionCostModel, Scheduler, SchedulerOutput
from workers.sequence import SamplingParams, Sequence, SequenceStatus

log = logging.getLogger(__name__)


def held_tokens_fit(had: list[int], held: list[int]) -> bool:
    """Whether the output tokens a streamed handoff's held word brings continue its reservation's:
    the ones it had, then the one it awaited."""
    return len(held) == len(had) + 1 and list(held[:len(had)]) == list(had)


class RequestOutput(NamedTuple):
    """What one step produced for one request (new tokens), and whether it has ended.
    (A NamedTuple: one is built per sequence per step, and it builds several times faster
    than a frozen dataclass.)"""
    request_id: str
    new_token_ids: list[int]
    num_output_tokens: int
    finished: bool
    finish_reason: str | None = None
    new_logprobs: list[dict] | None = None
    held: bool = False              # prefill-only: its KV is held for a decode worker to pull
    prompt_logprobs: list[dict] | None = None   # asked for: with the first output (see Sequence)


class StepStats(NamedTuple):
    """The shape of the last step, for the worker's metrics."""
    num_seqs: int                       # sequences in the batch
    num_tokens: int                     # tokens computed (prefill chunks + one per decoding row)
    queue_times_s: tuple[float, ...]    # arrival -> first scheduled, for sequences starting now


@dataclass(frozen=True, slots=True)
class CompletionResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int = 0
    logprobs: list[dict] | None = None

    def to_json(self) -> dict:
        d = {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason}
        if self.logprobs is not None:
            d["logprobs"] = [{"logprob": lp["logprob"], "top": {str(k): v for k, v in lp["top"].items()}}
                             for lp in self.logprobs]
        return d


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """The arithmetic behind the cache size, logged at start-up."""
    bytes_per_token: int
    block_size: int
    num_blocks: int
    num_host_blocks: int

    @property
    def max_resident_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def max_batch_at(self, context_len: int) -> int:
        return self.num_blocks // -(-context_len // self.block_size)

    def describe(self, context_len: int) -> str:
        mib = self.bytes_per_token * self.block_size * self.num_blocks / 2**20
        return (f"KV cache: {self.bytes_per_token} B/token x {self.block_size} tokens/block = "
                f"{self.bytes_per_token * self.block_size} B/block; {self.num_blocks} blocks "
                f"({mib:.1f} MiB) hold {self.max_resident_tokens} tokens; max batch at "
                f"{context_len}-token context: {self.max_batch_at(context_len)}; "
                f"{self.num_host_blocks} host swap blocks")


class EngineCore:
    def __init__(self, scheduler_cfg: SchedulerConfig, layout: KVCacheLayout, max_model_len: int,
                 vocab_size: int, enable_prefix_caching: bool = True, eos_token_ids=(), tokenizer=None,
                 preemption_cost: PreemptionCostModel | None = None, clock: Callable[[], float] = time.monotonic):
        self.layout = layout
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.clock = clock
        self.kv = KVCacheManager(layout.num_blocks, layout.block_size, enable_prefix_caching, layout.num_host_blocks)
        self.scheduler = Scheduler(scheduler_cfg, self.kv, preemption_cost, clock)
        self._seqs: dict[str, Sequence] = {}
        self._forking: dict[str, Sequence] = {}        # a fork not started yet -> its carrier
        self._copies: list[tuple[int, int]] = []       # forks' block copies for the next step
        self._ids = itertools.count()
        self.last_step = StepStats(0, 0, ())
        self.last_scheduled: list = []          # the last step's (sequence, tokens) pairs
        self.last_shape = BatchShape()
        self.prefilling: list[Sequence] = []           # prefill-only sequences the last step left mid-prompt
        self._step_start = 0.0
        self.eos_token_ids = set(eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self._grammars = None                          # workers/grammar.py Grammars, made on first use

    def grammar(self, params: SamplingParams):
        """A fresh matcher for a request's structured output (None without one), compiled here,
        outside the step (then cached by its text). ValueError: no tokenizer, or it does not compile."""
        if params.structured is None:
            return None
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer")
            from workers.grammar import Grammars
            self._grammars = Grammars(self.tokenizer)
        return self._grammars.state(params.structured)

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | None = None, params: SamplingParams | None = None, *,
                    prompt_token_ids: list[int] | None = None, request_id: str | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    prefill_only: bool = False, output_token_ids: list[int] = (), forks=(),
                    ttft_left_s: float | None = None, tpot_s: float | None = None) -> Sequence:
        """Queue a request. With prefill_only, it stops after its next token and its blocks
        are held (see `held_block_ids` / `release`) for a decode worker to pull. With
        `output_token_ids` it resumes: those tokens were generated already (elsewhere); they are
        computed with the prompt, count against max_tokens and stop strings, and sampling
        continues after them. With `forks` (workers/messages.py Fork: an id and sampling
        parameters each) it is a carrier: once its prompt is computed, each fork starts from
        its KV as a request of its own, and the carrier ends (`_fork`). Its next token is due
        `ttft_left_s` after `arrival_time` (now by default) and its TPOT target is `tpot_s`: the
        deadline policy orders by them (workers/scheduler.py)."""
        if forks and (prefill_only or output_token_ids):
            raise ValueError("a carrier of forks computes a prompt and nothing else")
        self._check_forks(forks)
        seq = self._new_seq(prompt, prompt_token_ids, params, request_id, priority, arrival_time, output_token_ids)
        seq.prefill_only = prefill_only
        if ttft_left_s is not None:
            seq.ttft_deadline = seq.arrival_time + ttft_left_s
        seq.tpot_s = tpot_s
        self._carry(seq, forks)
        self.scheduler.add(seq)
        return seq

    # -- samples of one prompt (n > 1): a carrier computes or receives the prompt, forks start ---
    def _check_forks(self, forks) -> None:
        ids = [f.rid for f in forks]
        if len(set(ids)) < len(ids) or any(i in self._seqs or i in self._forking for i in ids):
            raise ValueError(f"fork ids must be new and distinct, got {ids}")
        for f in forks:                    # their grammars compiled now, not in the step that forks them
            self.grammar(f.params)

    def _carry(self, seq: Sequence, forks) -> None:
        if forks:
            seq.forks = list(forks)
            for f in forks:
                self._forking[f.rid] = seq

    def _fork(self, carrier: Sequence) -> RequestOutput:
        """The carrier has the KV of its prompt (computed, or received): each fork becomes a
        sequence of the prompt with the KV of all its tokens but the last (full blocks shared,
        the partial one copied), so that its first decode step computes the last prompt token
        and samples its first token with its own parameters. A fork that finds no seat or block
        free waits as a new request instead (the prefix cache serves it the shared blocks).
        Then the carrier ends; its own sampled token is nobody's."""
        sched, kv = self.scheduler, self.kv
        num_kv = carrier.num_prompt_tokens - 1
        for f in carrier.forks:
            del self._forking[f.rid]
            child = Sequence(f.rid, carrier.prompt_token_ids, f.params, carrier.priority, carrier.arrival_time)
            child.grammar = self.grammar(f.params)     # (compiled when the forks came: a copy now)
            child.prompt_logprobs = None               # its prompt was the carrier's to compute
            child.ttft_deadline, child.tpot_s = carrier.ttft_deadline, carrier.tpot_s
            self._seqs[f.rid] = child
            copy = False
            if len(sched.running) < sched.cfg.max_num_seqs:
                copy = kv.fork(carrier, child, num_kv, sched.watermark_blocks)
            if copy is False:
                sched.add(child)
                continue
            if copy is not None:
                self._copies.append(copy)
            child.num_computed_tokens = num_kv
            sched.add_running(child)
        carrier.forks = None
        self._seqs.pop(carrier.seq_id, None)
        sched.finish(carrier, "forked")
        return RequestOutput(carrier.seq_id, [], 0, True, "forked")

    def _new_seq(self, prompt, prompt_token_ids, params, request_id, priority, arrival_time,
                 output_token_ids=()) -> Sequence:
        ids = self.tokenize(prompt, prompt_token_ids)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise ValueError(f"request id {rid!r} is already in use")
        seq = Sequence(rid, ids, params or SamplingParams(), priority,
                       self.clock() if arrival_time is None else arrival_time)
        seq.grammar = self.grammar(seq.params)
        if output_token_ids:
            self._check_ids(output_token_ids, "output_token_ids")
            seq.token_ids.extend(output_token_ids)
            if seq.num_tokens >= self.max_model_len or seq.num_output_tokens >= seq.params.max_tokens:
                raise ValueError(f"nothing left to generate: {seq.num_output_tokens} tokens already out of "
                                 f"max_tokens={seq.params.max_tokens}, max_model_len={self.max_model_len}")
        self._seqs[rid] = seq
        return seq

    # -- KV handoff: the prefill side holds, the decode side reserves then commits --------------
    def held_block_ids(self, request_id: str) -> list[int]:
        """Blocks holding a held request's prompt KV, in token order."""
        seq = self._seqs[request_id]
        assert seq.status is SequenceStatus.HELD, seq
        return self.kv.block_ids(seq)[:-(-seq.num_computed_tokens // self.kv.block_size)]

    def computed_block_ids(self, seq: Sequence) -> list[int]:
        """The full blocks of a sequence's KV computed so far, in token order."""
        return self.kv.block_ids(seq)[:seq.num_computed_tokens // self.kv.block_size]

    def release(self, request_id: str) -> bool:
        """The decode side has the KV (or gave up): free the held blocks; full ones stay cached."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, seq.finish_reason or "transferred")
        return True

    def reserve(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                params: SamplingParams, priority: int = 0, arrival_time: float | None = None,
                num_receiving: int = 0, forks=(), tpot_s: float | None = None,
                token_to_come: bool = False) -> list[int] | None:
        """Reserve blocks for KV that will arrive from a prefill worker: every token of prompt +
        output but the last (the last was sampled there and is computed here, by the first
        decode step). The leading full blocks this worker's prefix cache already holds are taken
        from it, not received. Returns the block ids to receive into (the blocks after those:
        the sender skips as many of its own), or None when there is no room now (backpressure:
        call again later): no seat, no blocks, or, by the decode steps this worker timed, one
        more sequence would make its steps longer than the tightest TPOT target among the
        running sequences and this one. `num_receiving` counts the sequences already reserved
        (they will join the batch). With `forks`, a carrier (see `add_request`): room is kept for the
        forks' seats and their copied blocks too. `tpot_s`: its TPOT target (see
        `add_request`). `token_to_come`: reserved while the prefill worker still computes the
        prompt (a streamed handoff): the KV is that of every token of prompt + output, and the
        token it samples comes with the last of it (`receive_token`)."""
        self._check_forks(forks)
        seq = self._new_seq(None, prompt_token_ids, params, request_id, priority, arrival_time, output_token_ids)
        seq.prompt_logprobs = None                     # the prefill side computed and sent them
        num_kv = seq.num_tokens - 1 + token_to_come
        computed, num_cached = self.kv.get_computed_blocks(seq)
        sched = self.scheduler
        extra = max(0, len(forks) - 1)
        rows = num_receiving + extra + len(sched.running) + 1
        fits = (rows <= sched.cfg.max_num_seqs and sched.decode_room(rows, tpot_s) and
                self.kv.can_allocate(seq, num_kv - num_cached + extra * self.kv.block_size, computed, num_cached,
                                     sched.watermark_blocks if sched.running else 0))
        if not fits:
            del self._seqs[request_id]
            return None
        self.kv.allocate(seq, num_kv - num_cached, computed, num_cached, index=False)
        seq.status = SequenceStatus.RECEIVING
        seq.tpot_s = tpot_s
        self._carry(seq, forks)
        return self.kv.block_ids(seq)[len(computed):]

    def receive_token(self, request_id: str, output_token_ids: list[int]) -> None:
        """A sequence reserved with `token_to_come`: its output tokens now, the one sampled by
        the prefill worker last (the others it had at its reservation)."""
        seq = self._seqs[request_id]
        assert seq.status is SequenceStatus.RECEIVING, seq
        have = seq.num_output_tokens
        if not held_tokens_fit(seq.output_token_ids, output_token_ids):
            raise ValueError(f"request {request_id}: {len(output_token_ids)} output tokens arrived for a "
                             f"reservation that had {have} and awaited one more")
        seq.token_ids.append(output_token_ids[-1])

    def commit_received(self, request_id: str) -> RequestOutput | None:
        """The reserved blocks now hold the prompt's KV: the sequence joins the running batch,
        or, a carrier, its forks start from it (their carrier's end is returned)."""
        seq = self._seqs[request_id]
        assert seq.status is SequenceStatus.RECEIVING, seq
        seq.num_computed_tokens = seq.num_tokens - 1
        self.kv.commit(seq, seq.num_computed_tokens)
        if seq.forks is not None:
            return self._fork(seq)
        if seq.first_token_time is None:
            seq.first_token_time = self.clock()
        self.scheduler.add_running(seq)
        return None

    def tokenize(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: send prompt_token_ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = prompt_token_ids if isinstance(prompt_token_ids, list) else list(prompt_token_ids)  # Sequence copies
            self._check_ids(ids, "prompt_token_ids")
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             "(prompt plus at least one generated token)")
        return ids

    def _check_ids(self, ids, name: str) -> None:
        vocab = self.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"{name} must be integers in [0, {vocab})")

    def abort(self, request_id: str) -> bool:
        """End a request wherever it is (queued, running, swapped, held, receiving; a fork not
        started yet never starts; a carrier's forks not started with it)."""
        carrier = self._forking.pop(request_id, None)
        if carrier is not None:
            carrier.forks = [f for f in carrier.forks if f.rid != request_id]
            return True
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        for f in seq.forks or ():
            del self._forking[f.rid]
        seq.forks = None
        self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def request_ids(self) -> list[str]:
        """Every request this engine knows: queued, running, swapped, held, receiving, and forks
        not started yet."""
        return [*self._seqs, *self._forking]

    def ends_in(self, count: int = ENDS_REPORTED) -> list[int]:
        """Output tokens left to the `count` running sequences that end soonest (at most
        ENDS_REPORTED), fewest first: by max_tokens (an end of sequence may come sooner)."""
        return heapq.nsmallest(min(count, ENDS_REPORTED),
                               (q.params.max_tokens - q.num_output_tokens for q in self.scheduler.running))

    def load_report(self, worker_id: str, role: str, steps: int, held: int = 0, pending: int = 0,
                    receiving: int = 0, kv_transfer: TransferTotals | None = None, ends: bool = True) -> LoadReport:
        """A LoadReport (workers/messages.py): the engine's queues, KV use and counters, with
        what its caller (the worker, or the simulator) knows of the handoff; `ends`: with
        `ends_in` (the simulator asks for them apart, only when a slot is wanted)."""
        s, kv = self.scheduler, self.kv
        stats, num_blocks = s.stats, kv.pool.num_blocks
        return LoadReport(worker_id, role, len(s.waiting), len(s.running), len(s.swapped),
                          sum(q.num_tokens - q.num_computed_tokens for q in s.waiting),
                          num_blocks - kv.num_free_blocks, num_blocks, steps, held, pending, receiving,
                          stats.prefix_cache_queries, stats.prefix_cache_hits, dict(stats.num_preemptions),
                          kv_transfer or TransferTotals(), max_seqs=s.cfg.max_num_seqs,
                          ends_in=self.ends_in() if ends else [])

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.schedule_step()
        if out.is_empty:
            return []
        seqs, token_ids, logprobs = self._execute(out)
        return self.finish_step(out, seqs, token_ids, logprobs)

    def _execute(self, out: SchedulerOutput) -> tuple[list[Sequence], list[int], list | None]:
        """Compute the scheduled tokens: the sequences whose chunk reaches their last token,
        and a sampled token (and its logprobs, or None) for each."""
        raise NotImplementedError

    def schedule_step(self) -> SchedulerOutput:
        """The first half of a step: what runs, recorded in `last_step` and `last_shape`."""
        out = self.scheduler.schedule()
        if self._copies and not out.is_empty:          # forks' tails, copied before the forward
            out.copies, self._copies = self._copies, []
        # A sequence's first chunk starts where the prefix cache left it, before any output
        # (later chunks, decode rows and received sequences all start further on).
        t = self._step_start = self.clock()
        self.last_scheduled = out.scheduled
        self.last_step = StepStats(len(out.scheduled), out.num_batched_tokens, tuple(
            t - s.arrival_time for s, _ in out.scheduled
            if s.num_computed_tokens == s.num_cached_tokens and not s.num_preemptions and not s.num_output_tokens))
        self.last_shape = batch_shape(out.scheduled)
        return out

    def finish_step(self, out: SchedulerOutput, seqs: list[Sequence], token_ids: list[int],
                    logprobs: list | None) -> list[RequestOutput]:
        """The second half: the scheduled tokens have KV; append the sampled ones, check stops."""
        self.prefilling = []
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            if seq.prefill_only and seq.num_computed_tokens < seq.num_tokens:
                self.prefilling.append(seq)
        # Per sampled sequence, every step: kept flat (no helper call, no object per token),
        # since it is a good part of the step's Python time.
        outputs = []
        now = self.clock()
        self.scheduler.observe_step(out.num_batched_tokens, now - self._step_start, len(out.scheduled))
        for seq, token_id, lps in zip(seqs, token_ids, logprobs or [None] * len(seqs)):
            if seq.forks is not None:                  # a carrier: its prompt is computed
                outputs.append(self._fork(seq))
                continue
            plp = None
            if seq.first_token_time is None:           # its prompt is computed (here)
                seq.first_token_time = now
                plp, seq.prompt_logprobs = seq.prompt_logprobs, None
                if seq.params.max_tokens == 0:         # the prompt only: no token
                    self.scheduler.finish(seq, "length")
                    self._seqs.pop(seq.seq_id, None)
                    outputs.append(RequestOutput(seq.seq_id, [], 0, True, "length", prompt_logprobs=plp))
                    continue
            seq.token_ids.append(token_id)
            if seq.output_logprobs is not None:
                seq.output_logprobs.append(lps)
            reason = self._check_stop(seq, token_id)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self._seqs.pop(seq.seq_id, None)
            elif seq.prefill_only:
                self.scheduler.hold(seq)
            outputs.append(RequestOutput(
                seq.seq_id, [token_id], seq.num_output_tokens, reason is not None, reason,
                None if lps is None else [lps], reason is None and seq.prefill_only, plp))
        return outputs

    def _check_stop(self, seq: Sequence, token_id: int) -> str | None:
        p = seq.params
        if seq.grammar is not None:
            if not seq.grammar.follow(seq.output_token_ids):   # (the masks make it impossible; past a
                log.warning("request %s: its output left its grammar: %s", seq.seq_id, seq.grammar.error())
                return "abort"                                 # parser limit it could happen): said, not hidden
            if seq.grammar.done():             # its grammar is complete (the mask then allowed only EOS)
                seq.stop_reason = token_id
                return "stop"
        if seq.num_output_tokens < p.min_tokens:        # (the sampler held EOS and stop ids back)
            return None
        if not p.ignore_eos and token_id in self.eos_token_ids:
            seq.stop_reason = token_id
            return "stop"
        if token_id in p.stop_token_ids:
            seq.stop_reason = token_id
            return "stop"
        if p.stop and self.tokenizer is not None:
            # Only the tail can hold a new match: decode a window of recent tokens (a stop
            # string of n characters spans at most 4n byte-level tokens), not the whole output
            # every step; the full text is decoded once, on a match.
            longest = max(len(s) for s in p.stop)
            window = seq.output_token_ids[-(4 * longest + 4):]
            tail = self.tokenizer.decode(window)
            hit = next((s for s in p.stop if s in tail), None)
            if hit is not None and p.min_tokens:         # one that ended before min_tokens counts no more:
                before = len(self.tokenizer.decode(window[:-1]))   # only one that ends in this token's text
                hit = next((s for s in p.stop if tail.find(s, max(0, before - len(s) + 1)) >= 0), None)
            if hit is not None:
                text = self.tokenizer.decode(seq.output_token_ids)
                seq.stop_reason = hit
                at = text.rfind(hit) if p.min_tokens else text.find(hit)
                seq.text = text[:at + (len(hit) if p.include_stop_str_in_output else 0)]
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def result(self, seq: Sequence) -> CompletionResult:
        self._seqs.pop(seq.seq_id, None)
        text = seq.text
        if not text and self.tokenizer is not None and not isinstance(seq.stop_reason, str):
            text = self.tokenizer.decode(seq.output_token_ids)
        return CompletionResult(seq.seq_id, seq.prompt_token_ids, seq.output_token_ids, text,
                                seq.finish_reason, seq.num_cached_tokens, seq.output_logprobs)

    def generate(self, requests: list[dict | str], params: SamplingParams | None = None) -> list[CompletionResult]:
        """Run requests to completion; results in input order. A request is a prompt string or
        a dict with `prompt` or `prompt_token_ids` and optional sampling fields."""
        seqs = []
        for i, r in enumerate(requests):
            if isinstance(r, str):
                r = {"prompt": r}
            try:
                seqs.append(self.add_request(r.get("prompt"), r.get("params", params),
                                             prompt_token_ids=r.get("prompt_token_ids"),
                                             priority=r.get("priority", 0)))
            except ValueError as e:
                for s in seqs:                   # all or nothing: no half-submitted batch
                    self.abort(s.seq_id)
                raise ValueError(f"{r.get('where', f'request {i}')}: {e}") from None
        while self.has_unfinished():
            self.step()
        return [self.result(s) for s in seqs]
