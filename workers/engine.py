"""One worker's engine: scheduler + KV cache manager + model runner, stepped in a loop.

    engine = LLMEngine(EngineConfig(model="tiny"))
    results = engine.generate([{"prompt": "Hello"}], SamplingParams(temperature=0, max_tokens=8))
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from workers.checkpoint import load_model
from workers.config import EngineConfig, canonical_dtype
from workers.kv_cache_manager import KVCacheManager
from workers.model_runner import ModelRunner
from workers.scheduler import PreemptionCostModel, Scheduler
from workers.sequence import SamplingParams, Sequence, SequenceStatus

log = logging.getLogger("pdcluster.engine")


def resolve_device(name: str) -> torch.device:
    """`auto`: CUDA when torch sees a GPU, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "no GPU is visible"
        raise ValueError(f"--device {name}: {why}; use --device auto or cpu")
    return device


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """`auto`: bf16 on CUDA, fp32 on CPU (bf16 matmul on CPU is 50-100x slower than fp32)."""
    if name == "auto":
        return torch.bfloat16 if resolve_device(device).type == "cuda" else torch.float32
    return getattr(torch, canonical_dtype(name))


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


class LLMEngine:
    def __init__(self, cfg: EngineConfig | None = None):
        self.cfg = cfg = cfg or EngineConfig()
        torch.manual_seed(cfg.seed)
        self.device, self.dtype = resolve_device(cfg.device), resolve_dtype(cfg.dtype, cfg.device)
        self.model, self.tokenizer = load_model(cfg.model, self.dtype, self.device)
        mcfg = self.model_config = self.model.config
        cc = cfg.cache
        bytes_per_token = mcfg.kv_bytes_per_token(str(self.dtype).removeprefix("torch."))
        block_bytes = bytes_per_token * cc.block_size
        num_blocks = cc.num_blocks or max(1, cc.kv_cache_memory_bytes // block_bytes)
        num_host = cc.swap_space_bytes // block_bytes
        self.layout = KVCacheLayout(bytes_per_token, cc.block_size, num_blocks, num_host)
        limit = cfg.max_model_len or mcfg.max_position_embeddings
        if limit > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len={limit} exceeds the model's max_position_embeddings="
                             f"{mcfg.max_position_embeddings}")
        # One sequence must always fit on its own, or it could never be scheduled.
        self.max_model_len = min(limit, self.layout.max_resident_tokens)
        if self.max_model_len < limit:
            log.warning("max_model_len lowered from %d to %d: the KV cache holds no more", limit,
                        self.max_model_len)
        self.kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching, num_host)
        cost = PreemptionCostModel(
            kv_bytes_per_token=bytes_per_token, num_params=mcfg.num_params(),
            attn_flops_per_token_pair=4 * mcfg.num_hidden_layers * mcfg.num_attention_heads * mcfg.head_dim,
            num_layers=mcfg.num_hidden_layers)
        self.scheduler = Scheduler(cfg.scheduler, self.kv, cost)
        self.runner = ModelRunner(self.model, num_blocks, cc.block_size, num_host, self.device, self.dtype,
                                  cfg.attention_backend)
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.last_step = StepStats(0, 0, ())
        self.eos_token_ids = set(mcfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        log.info("model %s: %.1fM params, %s on %s, attention backend %s", cfg.model,
                 mcfg.num_params() / 1e6, str(self.dtype).removeprefix("torch."), self.device,
                 self.runner.backend.name)
        log.info(self.layout.describe(min(1024, self.max_model_len)))

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | None = None, params: SamplingParams | None = None, *,
                    prompt_token_ids: list[int] | None = None, request_id: str | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    prefill_only: bool = False, output_token_ids: list[int] = ()) -> Sequence:
        """Queue a request. With prefill_only, it stops after its next token and its blocks
        are held (see `held_block_ids` / `release`) for a decode worker to pull. With
        `output_token_ids` it resumes: those tokens were generated already (elsewhere); they are
        computed with the prompt, count against max_tokens and stop strings, and sampling
        continues after them."""
        seq = self._new_seq(prompt, prompt_token_ids, params, request_id, priority, arrival_time, output_token_ids)
        seq.prefill_only = prefill_only
        self.scheduler.add(seq)
        return seq

    def _new_seq(self, prompt, prompt_token_ids, params, request_id, priority, arrival_time,
                 output_token_ids=()) -> Sequence:
        ids = self.tokenize(prompt, prompt_token_ids)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise ValueError(f"request id {rid!r} is already in use")
        seq = Sequence(rid, ids, params or SamplingParams(), priority, arrival_time)
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

    def release(self, request_id: str) -> bool:
        """The decode side has the KV (or gave up): free the held blocks; full ones stay cached."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, seq.finish_reason or "transferred")
        return True

    def reserve(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                params: SamplingParams, priority: int = 0, arrival_time: float | None = None,
                num_receiving: int = 0) -> list[int] | None:
        """Reserve blocks for KV that will arrive from a prefill worker: every token of prompt +
        output but the last (the last was sampled there and is computed here, by the first
        decode step). Returns the block ids to receive into, or None when there is no room now
        (backpressure: call again later); `num_receiving` counts the sequences already reserved
        (they will join the batch)."""
        seq = self._new_seq(None, prompt_token_ids, params, request_id, priority, arrival_time, output_token_ids)
        num_kv = seq.num_tokens - 1
        sched = self.scheduler
        fits = (num_receiving + len(sched.running) < self.cfg.scheduler.max_num_seqs and
                self.kv.can_allocate(seq, num_kv, [], 0, sched.watermark_blocks if sched.running else 0))
        if not fits:
            del self._seqs[request_id]
            return None
        self.kv.allocate(seq, num_kv, [], 0, index=False)
        seq.status = SequenceStatus.RECEIVING
        return list(self.kv.block_ids(seq))

    def commit_received(self, request_id: str) -> None:
        """The reserved blocks now hold the prompt's KV: the sequence joins the running batch."""
        seq = self._seqs[request_id]
        assert seq.status is SequenceStatus.RECEIVING, seq
        seq.num_computed_tokens = seq.num_tokens - 1
        self.kv.commit(seq, seq.num_computed_tokens)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        self.scheduler.add_running(seq)

    def tokenize(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError(f"model {self.cfg.model!r} has no tokenizer.json: send prompt_token_ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt_token_ids)
            self._check_ids(ids, "prompt_token_ids")
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             "(prompt plus at least one generated token)")
        return ids

    def _check_ids(self, ids, name: str) -> None:
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"{name} must be integers in [0, {vocab})")

    def abort(self, request_id: str) -> bool:
        """End a request wherever it is (queued, running, swapped, held, receiving)."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        # A sequence's first chunk starts where the prefix cache left it, before any output
        # (later chunks, decode rows and received sequences all start further on).
        t = time.monotonic()
        self.last_step = StepStats(len(out.scheduled), out.num_batched_tokens, tuple(
            t - s.arrival_time for s, _ in out.scheduled
            if s.num_computed_tokens == s.num_cached_tokens and not s.num_preemptions and not s.num_output_tokens))
        if out.is_empty:
            return []
        seqs, sampled = self.runner.execute(out, [self.kv.block_ids(s) for s, _ in out.scheduled])
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
        # Per sampled sequence, every step: kept flat (no helper call, no object per token),
        # since it is a good part of the step's Python time.
        outputs = []
        now = time.monotonic()
        for seq, token_id, logprobs in zip(seqs, sampled.token_ids, sampled.logprobs or [None] * len(seqs)):
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.token_ids.append(token_id)
            if seq.output_logprobs is not None:
                seq.output_logprobs.append(logprobs)
            reason = self._check_stop(seq, token_id)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self._seqs.pop(seq.seq_id, None)
            elif seq.prefill_only:
                self.scheduler.hold(seq)
            outputs.append(RequestOutput(
                seq.seq_id, [token_id], seq.num_output_tokens, reason is not None, reason,
                None if logprobs is None else [logprobs], reason is None and seq.prefill_only))
        return outputs

    def _check_stop(self, seq: Sequence, token_id: int) -> str | None:
        p = seq.params
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
            tail = self.tokenizer.decode(seq.output_token_ids[-(4 * longest + 4):])
            hit = next((s for s in p.stop if s in tail), None)
            if hit is not None:
                text = self.tokenizer.decode(seq.output_token_ids)
                seq.stop_reason = hit
                seq.text = text[:text.find(hit)]
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
