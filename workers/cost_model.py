"""The cost model: seconds of an engine step from its batch shape, of a KV handoff, and KV room.

One model serves the cluster simulator, admission control and the pool controller, so a
decision tested in simulation is taken on the same numbers in the cluster. Two step models
speak one protocol, `step_s(shape) -> seconds`: a profiled linear fit (DistServe's form) and a
roofline from hardware and model shape for what nobody has profiled yet. Plain Python: numpy
is imported only inside `LinearStepModel.fit`.
"""
from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path

GiB = 2**30


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What one engine step computes."""
    num_prefill: int = 0        # prefill chunks in the step
    prefill_tokens: int = 0     # Σ l, l = chunk length
    prefill_sq: int = 0         # Σ l² (attention inside the chunk grows with it)
    prefill_ctx: int = 0        # Σ l·c, c = tokens of that sequence with KV before the chunk
    num_decode: int = 0         # decoding rows, one token each
    decode_context: int = 0     # Σ context over decoding rows, the new token included

    @property
    def batch_size(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.num_decode

    def __add__(self, other: BatchShape) -> BatchShape:
        return BatchShape(*(a + b for a, b in zip(astuple(self), astuple(other))))


def batch_shape(scheduled) -> BatchShape:
    """The shape of a SchedulerOutput.scheduled list of (seq, n), read before the step advances
    `num_computed_tokens`. A row is decode when it computes the one missing token and that token
    is an output; anything else (including a recompute) is a prefill chunk. Runs every simulated
    step, hence one plain loop over locals."""
    n_pre = pre_tok = pre_sq = pre_ctx = n_dec = dec_ctx = 0
    for seq, n in scheduled:
        c = seq.num_computed_tokens
        if n == 1 and c == seq.num_tokens - 1 and c >= seq.num_prompt_tokens:
            n_dec += 1
            dec_ctx += c + 1
        else:
            n_pre += 1
            pre_tok += n
            pre_sq += n * n
            pre_ctx += n * c
    return BatchShape(n_pre, pre_tok, pre_sq, pre_ctx, n_dec, dec_ctx)


@dataclass(frozen=True, slots=True)
class LinearStepModel:
    """DistServe's profiled form, in seconds:
        prefill part: p0 + p1·Σl + p2·Σl² + pc·Σl·c + p3·chunks   (c = 0, p3 = 0: DistServe's
                                                                 a + b·Σl + c·Σl²)
        decode part:  d0 + d1·Σcontext + d2·num_decode
    Σl² + 2·Σl·c is twice the attended token pairs, so with pc = 2·p2 (the default, None) a
    chunk on cached context pays for the pairs it really computes; a fit may give the pairs on
    cached context their own price (on CPU they go through the paged kernel, slower per pair
    than a fresh prompt's). A mixed step pays one fixed cost, max(p0, d0), since both parts
    share the launch and weight read; an empty step costs 0. `p3`, a cost per prefill chunk
    (its sampled row, its metadata), is 0 in DistServe's form; fitted on small models, where
    per-sequence work is a visible share of a step.
    """
    p0: float
    p1: float
    p2: float
    d0: float
    d1: float
    d2: float
    p3: float = 0.0
    pc: float | None = None

    def step_s(self, shape: BatchShape) -> float:
        t = base = 0.0
        if shape.num_prefill:
            base = self.p0
            pc = 2 * self.p2 if self.pc is None else self.pc
            t += (self.p1 * shape.prefill_tokens + self.p2 * shape.prefill_sq + pc * shape.prefill_ctx
                  + self.p3 * shape.num_prefill)
        if shape.num_decode:
            base = max(base, self.d0)
            t += self.d1 * shape.decode_context + self.d2 * shape.num_decode
        return base + t

    def decode_run_s(self, num_decode: int, context: int, k: int) -> list[float]:
        """Seconds of each of k decode steps of one batch whose summed context starts at
        `context` and grows by `num_decode` a step (a steady run, which the simulator takes whole)."""
        t0 = self.d0 + self.d1 * context + self.d2 * num_decode
        dt = self.d1 * num_decode
        return [t0 + j * dt for j in range(k)]

    @classmethod
    def fit(cls, samples: list[tuple[BatchShape, float]], per_chunk: bool = False,
            reduce: bool = False) -> LinearStepModel:
        """Least squares on prefill-only and decode-only (shape, seconds) samples; mixed steps are
        left out because they cannot tell the two fixed costs apart. Coefficients stay >= 0: a
        negative one is dropped and the rest refit, as a small active-set NNLS; rows are weighted
        by 1 / time, so the fit minimizes relative error. `per_chunk`
        also fits p3 and pc (the samples must include chunks on cached context).

        Samples that cannot tell the terms apart raise ValueError, unless `reduce`: then the
        terms the samples do not pin down are priced 0 and the rest fitted, the higher-order
        term first (prompts all of one length make Σl² a multiple of Σl: the attention's pairs
        are priced per token, as they are at that length; decode rows all at one context make
        Σcontext a multiple of the rows: priced per row). What serving fits on is whatever
        came (a load test of one prompt length is common), and a model right at the lengths it
        has seen prices the line and local prefills, where none would turn both off."""
        dec = [((1, s.decode_context, s.num_decode), t)
               for s, t in samples if s.num_decode and not s.num_prefill]
        p0, p1, p2, *rest = _prefill_terms(samples, per_chunk, reduce)
        return cls(p0, p1, p2, *_solve(dec, "decode", "1, Σcontext, rows", [1], reduce), *rest)

    @classmethod
    def fit_prefill(cls, samples: list[tuple[BatchShape, float]], reduce: bool = False) -> LinearStepModel:
        """`fit`'s prefill part alone, on the prefill-only samples: a model of prefill steps
        whose decode terms are 0 (not fitted; do not price decode steps with it). Where decode
        steps are many and prefill-only ones few (a colocated pool runs prompts beside its
        decode rows: 3 of 1,669 steps in a closed loop), a fit of both waits on the few, and
        those few priced 128-token prompts at 1 ms a token, 15 times what they cost."""
        p0, p1, p2 = _prefill_terms(samples, False, reduce)
        return cls(p0, p1, p2, 0.0, 0.0, 0.0)


def _solve(rows, kind: str, names: str, drop: list[int], reduce: bool) -> list[float]:
    """Nonnegative least squares of seconds on the rows' terms, relative error (LinearStepModel.fit);
    with `reduce`, the terms in `drop` go first, in order, where the rows cannot tell them apart."""
    import numpy as np

    k = len(rows[0][0]) if rows else 3
    a = np.array([x for x, _ in rows], dtype=float).reshape(len(rows), k)
    keep = list(range(k))
    while True:
        if len({tuple(x[keep]) for x in a}) < len(keep):
            if reduce and len(keep) > 1 and drop:
                keep.remove(drop.pop(0))
                continue
            raise ValueError(f"need at least {k} distinct {kind}-only samples to fit, got {len(rows)}")
        b = a[:, keep]
        scale = np.abs(b).max(axis=0)   # columns span 1 to ~1e7: scale them to one range
        scale[scale == 0] = 1.0
        if np.linalg.matrix_rank(b / scale) == len(keep):
            break
        if not (reduce and drop):
            raise ValueError(f"{kind} samples are collinear in ({names}): vary them independently")
        keep.remove(drop.pop(0))
    b = b / scale
    y = np.array([t for _, t in rows], dtype=float)
    # Relative error is what matters (a 4 ms step off by 2 ms is as wrong as a 100 ms
    # one off by 50): weight each row by 1 / its time.
    w = 1.0 / np.maximum(y, 1e-9)
    b, y = b * w[:, None], y * w
    active = list(range(len(keep)))
    while True:
        coef = np.zeros(len(keep))
        coef[active] = np.linalg.lstsq(b[:, active], y, rcond=None)[0]
        if coef.min() >= 0:
            out = [0.0] * k
            for j, v in zip(keep, coef / scale):
                out[j] = float(v)
            return out
        active.remove(int(coef.argmin()))


def _prefill_terms(samples, per_chunk: bool, reduce: bool) -> list[float]:
    """The prefill part's coefficients fitted on the prefill-only samples (LinearStepModel.fit):
    p0, p1, p2, and with `per_chunk` p3 and pc."""
    if per_chunk:
        pre = [((1, s.prefill_tokens, s.prefill_sq, s.num_prefill, s.prefill_ctx), t)
               for s, t in samples if s.num_prefill and not s.num_decode]
    else:
        pre = [((1, s.prefill_tokens, s.prefill_sq + 2 * s.prefill_ctx), t)
               for s, t in samples if s.num_prefill and not s.num_decode]
    return _solve(pre, "prefill", "1, Σl, Σl², chunks, Σlc" if per_chunk else "1, Σl, Σl²+2Σlc",
                  [] if per_chunk else [2], reduce)


# DistServe's simulator profile for OPT-13B, TP1, A100-80GB (LLMServe/DistServe,
# simdistserve/estimators/profile_data/profiler-a100-80g.distserve.json; milliseconds there).
# Their decode has two fits split at batch 95; this is the small-batch one (batch < 95). The
# large-batch fit is d0=7.1662 ms, d1=5.798e-4 ms/token, d2=0.15831 ms/row. Their simulator
# also adds 1 ms to every prefill step (a pipeline-overhead placeholder), left out here.
DISTSERVE_OPT13B_A100 = LinearStepModel(
    p0=18.10254647486372e-3, p1=0.1019122572698738e-3, p2=7.122264314252114e-09,
    d0=19.934702624895458e-3, d1=0.0006269356524350583e-3, d2=0.03850697740828398e-3)

# DistServe's profile of 2023's vLLM on the same model and GPU (profiler-a100-80g.vllm.json, TP1 only):
# the colocated baseline its paper compares against.
VLLM2023_OPT13B_A100_TP1 = LinearStepModel(p0=22.052e-3, p1=0.14051e-3, p2=8.0766e-09,
                                           d0=23.475e-3, d1=0.00059293e-3, d2=0.060727e-3)

# The same profile at every degree it has (small-batch decode fits), with the KV capacity in
# tokens DistServe measured per instance (its max_num_tokens table), for `pdcluster plan
# --step-costs distserve`.
DISTSERVE_OPT13B_A100_TP = {
    1: (DISTSERVE_OPT13B_A100, 66144),
    2: (LinearStepModel(p0=14.742973695171262e-3, p1=0.06857720739764e-3, p2=2.4495727400243586e-09,
                        d0=13.294796350285385e-3, d1=0.00034109219700723494e-3, d2=0.06296393225243659e-3), 163008),
    4: (LinearStepModel(p0=12.062297033449054e-3, p1=0.03808140082550695e-3, p2=5.226249731787869e-10,
                        d0=10.256231678259395e-3, d1=0.00018786702316166354e-3, d2=0.03269273629225551e-3), 356736),
}


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    flops: float        # dense bf16 FLOP/s
    mem_bw: float       # HBM B/s
    mem_bytes: int      # HBM as nvidia-smi reports it: the "80 GB" parts hold 80 GiB
    nvlink_bw: float    # B/s per direction per GPU: half NVIDIA's bidirectional figure


# NVIDIA's NVLink numbers (A100 600 GB/s, H100/H200 900 GB/s) add both directions; a ring
# all-reduce or a one-way KV copy moves data at the per-direction half.
HARDWARE = {h.name: h for h in (
    Hardware("a100-80g", 312e12, 2.039e12, 81920 * 2**20, 300e9),
    Hardware("h100-sxm", 989e12, 3.35e12, 81559 * 2**20, 450e9),
    Hardware("h200", 989e12, 4.8e12, 143771 * 2**20, 450e9),
)}


@dataclass(frozen=True, slots=True)
class Link:
    name: str
    bandwidth: float    # B/s one way, as achieved rather than signalled
    latency_s: float


LINKS = {k.name: k for k in (
    Link("nvlink-a100", 300e9, 5e-6),
    Link("nvlink-h100", 450e9, 5e-6),
    Link("pcie4", 25e9, 10e-6),     # x16: 32 GB/s signalled, ~25 achieved
    Link("pcie5", 50e9, 10e-6),
    Link("ib-200", 25e9, 5e-6),     # 200 Gb/s HDR
    Link("ib-400", 50e9, 5e-6),     # 400 Gb/s NDR
)}


def nvlink(gpu: Hardware) -> Link:
    """The NVLink between two GPUs of one node of this type."""
    return Link(f"nvlink-{gpu.name}", gpu.nvlink_bw, 5e-6)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A decoder's sizes, enough to count its FLOPs, weights and KV bytes."""
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool = True          # Llama: gate, up and down; OPT: fc1 and fc2
    max_len: int = 2048
    tied_embeddings: bool = False   # OPT ties the LM head to the token embedding

    def num_block_params(self) -> int:
        """Weights every token multiplies: the blocks' matrices (norms and biases left out, <0.1%)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = self.hidden * (q + 2 * kv) + q * self.hidden
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return self.num_layers * (attn + mlp)

    def num_params(self) -> int:
        return self.num_block_params() + self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_config(cls, d: dict, name: str = "") -> ModelShape:
        """Llama/Qwen2/Mistral keys, or OPT's (model_type "opt": ffn_dim, plain MLP, tied head)."""
        opt = d.get("model_type") == "opt"
        try:
            heads = d["num_attention_heads"]
            return cls(name=name or d.get("_name_or_path", "") or d.get("model_type", ""),
                       num_layers=d["num_hidden_layers"], hidden=d["hidden_size"], num_heads=heads,
                       num_kv_heads=heads if opt else d.get("num_key_value_heads") or heads,
                       head_dim=(None if opt else d.get("head_dim")) or d["hidden_size"] // heads,
                       intermediate=d["ffn_dim"] if opt else d["intermediate_size"], vocab=d["vocab_size"],
                       gated_mlp=not opt, max_len=d.get("max_position_embeddings", 2048),
                       tied_embeddings=d.get("tie_word_embeddings", opt))
        except KeyError as e:
            raise ValueError(f"config has no {e.args[0]!r}: expected a Llama/Qwen2/Mistral or OPT "
                             f"config.json") from None

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelShape:
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()), name=str(path))

    @classmethod
    def from_model_config(cls, cfg, name: str = "") -> ModelShape:
        """From the engine's workers.config.ModelConfig (always a gated Llama-family MLP)."""
        return cls(name or cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                   cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, True,
                   cfg.max_position_embeddings, cfg.tie_word_embeddings)


# From the models' config.json (OPT-175B from the OPT paper: it has no public HF config).
# pdcluster's tiny/small live in workers/checkpoint.py, which imports torch: use
# ModelShape.from_model_config(builtin_config(name)) where torch is at hand.
MODELS = {m.name: m for m in (
    ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, True, 8192),
    ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, True, 8192),
    ModelShape("opt-13b", 40, 5120, 40, 40, 128, 20480, 50272, False, 2048, True),
    ModelShape("opt-66b", 64, 9216, 72, 72, 128, 36864, 50272, False, 2048, True),
    ModelShape("opt-175b", 96, 12288, 96, 96, 128, 49152, 50272, False, 2048, True),
)}


def _pick(table: dict, name: str, what: str):
    try:
        return table[name.lower()]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(table)}") from None


def model_shape(name_or_dir: str) -> ModelShape:
    if name_or_dir.lower() not in MODELS and (Path(name_or_dir) / "config.json").is_file():
        return ModelShape.from_hf_dir(name_or_dir)
    return _pick(MODELS, name_or_dir, "model (or a directory with a config.json)")


def hardware(name: str) -> Hardware:
    return _pick(HARDWARE, name, "GPU")


def link(name: str) -> Link:
    return _pick(LINKS, name, "link")


@dataclass(frozen=True, slots=True)
class RooflineStepModel:
    """A step costs the slower of its FLOPs and its HBM bytes, plus tensor-parallel all-reduces
    (they wait on the link, not on compute) and a fixed overhead. The efficiencies are what real
    kernels reach of the datasheet; the 2 ms overhead is the scheduler, input preparation,
    kernel launches and sampling of a real engine step, which no FLOP count sees."""
    model: ModelShape
    gpu: Hardware
    tp: int = 1
    dtype_bytes: int = 2
    compute_eff: float = 0.6
    bandwidth_eff: float = 0.8
    step_overhead_s: float = 2e-3
    allreduce_link: Link | None = None      # None: the GPU's NVLink
    # Per-unit seconds, worked out once (a simulation prices millions of steps): compute per
    # FLOP, HBM per byte, and the FLOPs of a token through the blocks, of an attended pair and
    # of a sampled row, the weight and KV bytes.
    _rates: tuple = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.allreduce_link is None:
            object.__setattr__(self, "allreduce_link", nvlink(self.gpu))
        m = self.model
        object.__setattr__(self, "_rates", (
            1 / (self.tp * self.gpu.flops * self.compute_eff), 1 / (self.tp * self.gpu.mem_bw * self.bandwidth_eff),
            2 * m.num_block_params(), 4 * m.num_layers * m.num_heads * m.head_dim, 2 * m.hidden * m.vocab,
            m.num_params() * self.dtype_bytes, m.kv_bytes_per_token(self.dtype_bytes)))

    def step_s(self, shape: BatchShape) -> float:
        if not shape.num_prefill and not shape.num_decode:
            return 0.0
        return self._bound_s(shape) + self._fixed_s(shape.num_tokens)

    def _fixed_s(self, tokens: int) -> float:
        """What does not scale with FLOPs or bytes: two ring all-reduces per layer (after
        attention, after the MLP) on the link, and the step's overhead."""
        t = self.step_overhead_s
        if self.tp > 1:
            ring = 2 * (self.tp - 1) / self.tp * tokens * self.model.hidden * self.dtype_bytes
            t += 2 * self.model.num_layers * (ring / self.allreduce_link.bandwidth + self.allreduce_link.latency_s)
        return t

    def decode_run_s(self, num_decode: int, context: int, k: int) -> list[float]:
        """`step_s` of k steady decode steps (see LinearStepModel.decode_run_s): FLOPs and bytes
        grow linearly with the context, so each step is one max of two affine terms."""
        per_flop, per_byte, _, per_pair, _, _, kv_bytes = self._rates
        f0, h0 = self._bound_parts(BatchShape(num_decode=num_decode, decode_context=context))
        fixed = self._fixed_s(num_decode)
        df, dh = per_pair * num_decode * per_flop, kv_bytes * num_decode * per_byte
        f0, h0 = f0 + fixed, h0 + fixed
        if h0 + (k - 1) * dh >= f0 + (k - 1) * df and h0 >= f0:        # bandwidth-bound all along
            return [h0 + j * dh for j in range(k)]
        return [max(f0 + j * df, h0 + j * dh) for j in range(k)]

    def _bound_parts(self, shape: BatchShape) -> tuple[float, float]:
        """(compute-bound seconds, bandwidth-bound seconds) of a step."""
        per_flop, per_byte, per_token, per_pair, per_row, weights, kv_bytes = self._rates
        tokens = shape.num_tokens
        pairs = shape.prefill_sq / 2 + shape.prefill_ctx + shape.decode_context
        flops = per_token * tokens + per_pair * pairs + per_row * shape.batch_size
        # KV of earlier tokens is read once per chunk: Σl·c / mean l is Σc when chunks are equal.
        ctx_read = shape.decode_context
        if shape.num_prefill:
            ctx_read += shape.prefill_ctx * shape.num_prefill / shape.prefill_tokens
        return flops * per_flop, (weights + (ctx_read + tokens) * kv_bytes) * per_byte

    def _bound_s(self, shape: BatchShape) -> float:
        return max(self._bound_parts(shape))


def kv_capacity_tokens(model: ModelShape, gpu: Hardware, tp: int, dtype_bytes: int = 2,
                       gpu_memory_utilization: float = 0.9, activation_reserve_bytes: int = 2 * GiB) -> int:
    """Tokens of KV one worker of `tp` GPUs holds. The reserve is per GPU: each shard keeps its
    own activations, workspace and CUDA graphs."""
    free = tp * (gpu.mem_bytes * gpu_memory_utilization - activation_reserve_bytes)
    weights = model.num_params() * dtype_bytes
    if weights >= free:
        raise ValueError(f"{model.name} ({weights / 1e9:.0f} GB of weights) does not fit on {tp} x {gpu.name} "
                         f"({free / 1e9:.0f} GB usable): raise tp")
    return int((free - weights) // model.kv_bytes_per_token(dtype_bytes))


@dataclass(frozen=True, slots=True)
class CostModel:
    """One worker's costs (a worker = tp GPUs)."""
    step: LinearStepModel | RooflineStepModel
    kv_bytes_per_token: int
    kv_capacity_tokens: int         # tokens of KV one worker holds
    link: Link                      # the KV handoff link between a prefill and a decode worker
    tp: int = 1
    source: str = ""                # "roofline a100-80g opt-13b tp2", "profile FILE"

    def step_s(self, shape: BatchShape) -> float:
        return self.step.step_s(shape)

    def decode_run_s(self, num_decode: int, context: int, k: int) -> list[float]:
        """Seconds of each step of a steady decode run (see LinearStepModel.decode_run_s)."""
        return self.step.decode_run_s(num_decode, context, k)

    def handoff_s(self, num_tokens: int) -> float:
        return self.link.latency_s + num_tokens * self.kv_bytes_per_token / self.link.bandwidth

    def max_batch_at(self, context_len: int, block_size: int = 16) -> int:
        """Sequences of this context that fit, each holding whole blocks."""
        blocks_per_seq = -(-context_len // block_size)
        return (self.kv_capacity_tokens // block_size) // max(1, blocks_per_seq)

    def prefill_tokens_per_s(self, prompt_tokens: float, budget: int) -> float:
        """Prompt tokens per second one worker clears: steps full of such prompts (`budget`:
        the scheduler's max_num_batched_tokens)."""
        n = max(1, round(prompt_tokens))
        k = max(1, budget // n)
        return k * n / self.step_s(BatchShape(k, k * n, k * n * n))

    def decode_batch_at(self, context: float, tpot_s: float, max_seqs: int) -> int:
        """The largest decode batch of this context whose step stays within `tpot_s` and whose
        KV fits (at least 1)."""
        ctx = max(1, round(context))
        lo, hi = 1, max(1, min(max_seqs, self.max_batch_at(ctx)))

        def within(n: int) -> bool:
            return self.step_s(BatchShape(num_decode=n, decode_context=n * ctx)) <= tpot_s
        if within(hi):
            return hi
        while hi - lo > 1:                      # within(lo) (or lo = 1), not within(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if within(mid) else (lo, mid)
        return lo

    def decode_tokens_per_s(self, context: float, tpot_s: float, max_seqs: int) -> float:
        """Tokens per second one decode worker produces at the largest batch within the TPOT target."""
        n, ctx = self.decode_batch_at(context, tpot_s, max_seqs), max(1, round(context))
        return n / self.step_s(BatchShape(num_decode=n, decode_context=n * ctx))

    def to_json(self) -> dict:
        kind = "linear" if isinstance(self.step, LinearStepModel) else "roofline"
        step = {k: v for k, v in asdict(self.step).items() if not k.startswith("_")}
        return {"version": 1, "kind": kind, "step": step, "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_capacity_tokens": self.kv_capacity_tokens, "link": asdict(self.link), "tp": self.tp,
                "source": self.source}

    @classmethod
    def from_json(cls, d: dict) -> CostModel:
        if d.get("version") != 1:
            raise ValueError(f"cost model version {d.get('version')!r} is not supported (expected 1)")
        s = dict(d["step"])
        if d["kind"] == "linear":
            step = LinearStepModel(**s)
        elif d["kind"] == "roofline":
            step = RooflineStepModel(**{**s, "model": ModelShape(**s["model"]), "gpu": Hardware(**s["gpu"]),
                                        "allreduce_link": Link(**s["allreduce_link"])})
        else:
            raise ValueError(f"unknown step model kind {d['kind']!r}; expected 'linear' or 'roofline'")
        return cls(step, d["kv_bytes_per_token"], d["kv_capacity_tokens"], Link(**d["link"]), d["tp"],
                   d.get("source", ""))


def local_prefill_limit(cost: CostModel, num_decode: int, decode_context: int, remote_s: float,
                        most: int) -> int:
    """The most prompt tokens worth prefilling on a decode worker rather than handing off
    (conditional disaggregation). Prefilling n tokens there lengthens one step of each of the
    `num_decode` sequences it runs by d(n) = step(their decode + the n-token chunk) - step(their
    decode); handing off costs the request itself `remote_s` (the prefill queue and the handoff).
    The answer is the largest n, up to `most`, with num_decode x d(n) <= remote_s: an idle decode
    worker prefills anything (nobody waits), a busy one only what delays its batch less than the
    handoff would delay the request."""
    decode = BatchShape(num_decode=num_decode, decode_context=decode_context)
    base = cost.step_s(decode)

    def worth(n: int) -> bool:
        return num_decode * (cost.step_s(decode + BatchShape(1, n, n * n, 0)) - base) <= remote_s
    if worth(most):
        return most
    lo, hi = 0, most                          # worth(lo) (or lo = 0), not worth(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if worth(mid) else (lo, mid)
    return lo


def roofline(model: str | ModelShape, gpu: str | Hardware, tp: int = 1, link: str | Link | None = None,
             dtype_bytes: int = 2, gpu_memory_utilization: float = 0.9, **efficiencies) -> CostModel:
    """A worker's costs from first principles. The handoff link defaults to the GPU's NVLink
    (prefill and decode workers in one node); pass "ib-200" and the like across nodes."""
    m = model_shape(model) if isinstance(model, str) else model
    g = hardware(gpu) if isinstance(gpu, str) else gpu
    lk = nvlink(g) if link is None else _pick(LINKS, link, "link") if isinstance(link, str) else link
    step = RooflineStepModel(m, g, tp, dtype_bytes, **efficiencies)
    return CostModel(step, m.kv_bytes_per_token(dtype_bytes),
                     kv_capacity_tokens(m, g, tp, dtype_bytes, gpu_memory_utilization), lk, tp,
                     f"roofline {g.name} {m.name} tp{tp}")


class StepFit:
    """The step cost model fitted on timed steps: a grid a worker timed before serving
    (Worker.profile), if any, plus the workers' recent steps while serving ("step_shape"
    samples), which soon outweigh it, so the model follows what the pools see now (contention, a
    slower node). The pool controller and SLO admission price the pools with it."""

    WARMUP_STEPS = 16       # a worker's first steps (allocator, lazy kernels, graph capture) are not its speed

    def __init__(self, kv_bytes_per_token: int, kv_capacity_tokens: int, profiled: list = (),
                 max_samples: int = 2000, refit_every_s: float = 2.0, clock=time.monotonic):
        self.kv_bytes_per_token, self.kv_capacity_tokens = kv_bytes_per_token, kv_capacity_tokens
        self._seen: dict[str, int] = {}              # worker -> its steps seen (the warm-up ones left out)
        self.refit_every_s, self.clock = refit_every_s, clock
        self._throughput: tuple[float, float | None] = (-math.inf, None)   # (when, prefill_throughput then)
        self._profiled = [s for s in map(_fit_sample, profiled) if s is not None]
        self._recent: deque = deque(maxlen=max_samples)
        self._added = 0                           # samples added so far (a model refits when it moved)
        self._fits: dict[str, tuple[float, CostModel | None, int]] = {}   # kind -> (when fitted, model, _added then)

    def add(self, samples, worker: str | None = None) -> None:
        """Timed steps (of `worker`: its first WARMUP_STEPS never feed the fit, so a worker just
        added does not make the pools look slower than they are)."""
        if worker is not None:
            seen = self._seen.get(worker, 0)
            self._seen[worker] = seen + len(samples)
            samples = samples[max(0, self.WARMUP_STEPS - seen):]
        for raw in samples:
            s = _fit_sample(raw)
            if s is not None:
                self._recent.append(s)
                self._added += 1

    def prefill_throughput(self, min_samples: int = 5) -> float | None:
        """Prompt tokens per second over the recent prefill-only steps, as they were batched:
        what a fit cannot give while the steps all have one shape (one prompt length), or None
        with fewer than `min_samples` of them. Computed again at most every `refit_every_s`."""
        at, value = self._throughput
        if self.clock() - at < self.refit_every_s:
            return value
        rows = [(s.prefill_tokens, t) for s, t in self._recent if s.num_prefill]
        value = None if len(rows) < min_samples else sum(n for n, _ in rows) / max(1e-9, sum(t for _, t in rows))
        self._throughput = (self.clock(), value)
        return value

    def prefill_model(self) -> CostModel | None:
        """A model of prefill steps alone (LinearStepModel.fit_prefill; its decode terms are 0)
        over the profile and the recent prefill-only steps, refit as `current` is: what SLO
        admission prices a line of prompts with. It needs no decode steps, and with a profile
        of prefill shapes (serve times one before serving when admission is by SLO) it prices
        prompts from the first request; None while the samples do not pin it down."""
        return self._refit("prefill", LinearStepModel.fit_prefill, "prefill fitted while serving")

    def current(self) -> CostModel | None:
        """The fit over the profile and the recent steps (refit when new ones came, at most every
        `refit_every_s` once there is a model: it is asked for on every request, and a fit over
        2,000 steps costs about 10 ms); None while they do not pin the model down."""
        return self._refit("both", LinearStepModel.fit, "fitted while serving")

    def _refit(self, kind: str, fit, source: str) -> CostModel | None:
        """The `kind` model, fitted again by `fit` when samples came since it last was and there
        is none yet or `refit_every_s` has passed; a fit the samples cannot pin down keeps the
        last model."""
        at, model, seen = self._fits.get(kind, (-math.inf, None, -1))
        if seen != self._added and (model is None or self.clock() - at >= self.refit_every_s):
            try:
                model = CostModel(fit(self._profiled + list(self._recent), reduce=True), self.kv_bytes_per_token,
                                  self.kv_capacity_tokens, Link("unmeasured", math.inf, 0.0), source=source)
            except ValueError:                    # too few distinct shapes: keep the last fit
                pass
            self._fits[kind] = (self.clock(), model, self._added)
        return model


class DecodeStepFit:
    """Seconds of a decode-only step against its rows (a + b·rows), fitted on a worker's own
    recent steps (least squares, each step's weight decaying by `decay`), so a decode worker can
    tell whether one more sequence would push its steps past its sequences' TPOT targets. Rows
    that barely varied give no slope: then the step is taken as proportional to its rows (it
    overprices growth when the fixed cost is large, so it errs toward admitting less)."""

    def __init__(self, decay: float = 0.99, min_steps: int = 20):
        self.decay, self.min_steps = decay, min_steps
        self.steps = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        self._w, self._x, self._y = d * self._w + 1, d * self._x + rows, d * self._y + seconds
        self._xx, self._xy = d * self._xx + rows * rows, d * self._xy + rows * seconds
        self.steps += 1

    def predict(self, rows: int) -> float | None:
        """Seconds of a step of `rows` decoding sequences; None before `min_steps` steps."""
        if self.steps < self.min_steps:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        slope = (self._xy / self._w - mx * my) / var if var >= 1.0 else -1.0
        if slope <= 0 or my - slope * mx < 0:      # no usable slope: proportional to the rows
            return my / mx * rows
        return my + slope * (rows - mx)


def _fit_sample(raw) -> tuple[BatchShape, float] | None:
    """A [seconds, *BatchShape] sample the fit can use: prefill-only or decode-only (a mixed step
    cannot tell the two fixed costs apart)."""
    shape = BatchShape(*(int(x) for x in raw[1:]))
    if bool(shape.num_prefill) == bool(shape.num_decode):
        return None
    return shape, float(raw[0])
