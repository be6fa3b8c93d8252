"""The engine on a CUDA GPU against Hugging Face transformers, and the flash-attention backend
against a plain-torch model of the kernel it calls.

The oracle is transformers (tests/conftest.py's `hf_model`: the exported `tiny` checkpoint in
fp32 on the CPU), teacher-forced: for each request the engine generates greedily with its
logprobs, then transformers runs once over prompt + generated tokens, and at every generated
position (i) the engine's logprob of its token must be transformers' logprob of it, and (ii) the
token must be transformers' argmax (within a near-tie margin). A request whose output drifts from
transformers' free-running greedy output in bf16 is still checked token by token on its own path.

- fp32 with the torch backend on CUDA: tight tolerances, over the scheduler's paths (chunked
  prefill reading paged context, small blocks, swap preemption through pinned host memory,
  prefix-cache hits).
- bf16 (the engine's default dtype on CUDA) with the torch backend, then with `flash`: flash
  must be as close to transformers as the torch backend is on the same requests.
- The flash kernel alone: vllm_flash_attn's / flash_attn's varlen call as FlashAttention makes
  it, against `reference_varlen`, on random paged inputs (decodes, a chunk on cached context, a
  fresh prefill, GQA).
- `reference_varlen` is also run as the flash backend's kernel, on any device: the metadata the
  model runner builds for flash (cu_seqlens_q, seqused_k, block tables) is checked against
  transformers even where no flash build exists (this one test runs on the CPU too).

Everything else is skipped without CUDA; the flash tests also without a flash-attn build
(`pip install -e '.[flash]'` or vllm-flash-attn). `make gpu-check` runs this file.
"""
from __future__ import annotations

import pytest
import torch

from common import PROMPTS, SHARED_PREFIX_PROMPTS, assert_all_blocks_free
from workers.attention import FlashAttention, _import_flash_varlen, select_backend
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.engine import LLMEngine
from workers.sequence import SamplingParams

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (make gpu-check runs it on one)")


def _flash_missing() -> str | None:
    if not HAS_CUDA:
        return "needs a CUDA GPU (make gpu-check runs it on one)"
    if torch.cuda.get_device_capability()[0] < 8:
        return f"flash attention needs sm80+; this GPU is sm{''.join(map(str, torch.cuda.get_device_capability()))}"
    if _import_flash_varlen() is None:
        return "neither vllm_flash_attn nor flash_attn imports (pip install -e '.[flash]')"
    return None


needs_flash = pytest.mark.skipif(_flash_missing() is not None, reason=_flash_missing() or "")

NEW_TOKENS = 24
SMALL_KV = dict(kv_cache_memory_bytes=32 * 2**20, swap_space_bytes=0)
FP32_TOL = 1e-3             # logprob difference, and argmax margin, allowed in fp32
BF16_SANITY = 0.25          # bf16: no logprob may be further than this from transformers'


# -- the oracle ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_logprobs(hf_model):
    """hf_logprobs(ids) -> [len(ids), vocab] log-softmax of transformers' logits (fp32, CPU)."""
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def run(ids: list[int]) -> torch.Tensor:
        if tuple(ids) not in cache:
            with torch.inference_mode():
                logits = hf_model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits
            cache[tuple(ids)] = torch.log_softmax(logits[0].float(), dim=-1)
        return cache[tuple(ids)]
    return run


def generate(engine: LLMEngine, prompts: list[list[int]], n: int = NEW_TOKENS):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    results = engine.generate([{"prompt_token_ids": p} for p in prompts], params)
    for r in results:
        assert r.finish_reason == "length" and len(r.token_ids) == n and len(r.logprobs) == n
    return results


def against_hf(results, prompts: list[list[int]], hf_logprobs) -> tuple[float, float, str]:
    """(largest |engine logprob - transformers logprob| of a generated token, largest argmax
    margin: transformers' best logprob minus its logprob of the engine's token, where)."""
    worst_lp, worst_margin, where = 0.0, 0.0, ""
    for i, (p, r) in enumerate(zip(prompts, results)):
        want = hf_logprobs(p + r.token_ids)
        rows = torch.arange(len(p) - 1, len(p) - 1 + len(r.token_ids))
        chosen = want[rows, torch.tensor(r.token_ids)]
        lp_err = (torch.tensor([lp["logprob"] for lp in r.logprobs]) - chosen).abs()
        margin = want[rows].max(dim=-1).values - chosen
        if lp_err.max().item() > worst_lp:
            worst_lp = lp_err.max().item()
            where = f"prompt {i} (len {len(p)}), output {lp_err.argmax().item()}"
        worst_margin = max(worst_margin, margin.max().item())
    return worst_lp, worst_margin, where


def assert_close_to_hf(results, prompts, hf_logprobs, tol: float) -> tuple[float, float]:
    lp, margin, where = against_hf(results, prompts, hf_logprobs)
    assert lp <= tol, f"a logprob differs from transformers' by {lp:.2e} (> {tol:g}) at {where}"
    assert margin <= tol, f"a greedy token is {margin:.2e} below transformers' argmax (> {tol:g})"
    return lp, margin


@pytest.fixture
def no_tf32():
    """fp32 matmuls in full precision while a test runs (TF32 would cost ~1e-3 relative)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# -- fp32 on CUDA, torch backend: the scheduler's paths -------------------------------------------------
FP32_CONFIGS = {
    "defaults": lambda: dict(cache=CacheConfig(**SMALL_KV)),
    "chunked-16-bs8": lambda: dict(cache=CacheConfig(block_size=8, **SMALL_KV),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=16)),
    # 24 blocks x 16 tokens for 8 prompts of up to 300 + 24 tokens: swaps through pinned memory.
    "swap": lambda: dict(cache=CacheConfig(num_blocks=24, swap_space_bytes=16 * 2**20),
                         scheduler=SchedulerConfig(preemption_mode="swap")),
}


@needs_cuda
@pytest.mark.parametrize("name", list(FP32_CONFIGS))
def test_fp32_on_cuda_matches_transformers(name, tiny_dir, hf_logprobs, no_tf32):
    engine = LLMEngine(EngineConfig(model=tiny_dir, device="cuda", dtype="float32", attention_backend="torch",
                                    **FP32_CONFIGS[name]()))
    assert engine.device.type == "cuda" and engine.runner.backend.name == "torch"
    prompts = PROMPTS[:8]
    results = generate(engine, prompts)
    if name == "swap":
        assert engine.scheduler.stats.num_preemptions["swap"] > 0, engine.scheduler.stats
    assert_close_to_hf(results, prompts, hf_logprobs, FP32_TOL)
    assert_all_blocks_free(engine)


@needs_cuda
def test_fp32_on_cuda_prefix_cache_hits_match_transformers(tiny_dir, hf_logprobs, no_tf32):
    engine = LLMEngine(EngineConfig(model=tiny_dir, device="cuda", dtype="float32", attention_backend="torch",
                                    cache=CacheConfig(block_size=4, **SMALL_KV),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    prompts = SHARED_PREFIX_PROMPTS
    assert_close_to_hf(generate(engine, prompts), prompts, hf_logprobs, FP32_TOL)
    hits = engine.scheduler.stats.prefix_cache_hits
    assert hits > 0
    again = list(reversed(prompts))                       # the first batch's blocks, cached
    assert_close_to_hf(generate(engine, again), again, hf_logprobs, FP32_TOL)
    assert engine.scheduler.stats.prefix_cache_hits > hits
    assert_all_blocks_free(engine)


# -- bf16: torch backend, then flash ---------------------------------------------------------------
def bf16_engine(tiny_dir: str, backend: str, **over) -> LLMEngine:
    cfg = dict(cache=CacheConfig(block_size=16, **SMALL_KV), scheduler=SchedulerConfig(max_num_batched_tokens=64))
    cfg.update(over)
    return LLMEngine(EngineConfig(model=tiny_dir, device="cuda", dtype="bfloat16", attention_backend=backend, **cfg))


@pytest.fixture(scope="module")
def bf16_torch_error(tiny_dir, hf_logprobs):
    """How far the torch backend in bf16 is from transformers (fp32) on PROMPTS[:8]."""
    engine = bf16_engine(tiny_dir, "torch")
    prompts = PROMPTS[:8]
    lp, margin = assert_close_to_hf(generate(engine, prompts), prompts, hf_logprobs, BF16_SANITY)
    return lp, margin


@needs_cuda
def test_bf16_torch_backend_is_close_to_transformers(bf16_torch_error):
    lp, margin = bf16_torch_error
    print(f"bf16 torch backend: largest logprob error {lp:.3e}, largest argmax margin {margin:.3e}")


@needs_cuda
def test_auto_backend_on_this_gpu_is_flash_exactly_when_a_build_imports():
    chosen = select_backend("auto", torch.device("cuda"), torch.bfloat16, 8, 4, 32).name
    assert chosen == ("torch" if _flash_missing() else "flash"), _flash_missing()


@needs_flash
def test_flash_backend_is_as_close_to_transformers_as_the_torch_backend(tiny_dir, hf_logprobs, bf16_torch_error):
    torch_lp, torch_margin = bf16_torch_error
    engine = bf16_engine(tiny_dir, "flash")
    assert engine.runner.backend.name == "flash"
    prompts = PROMPTS[:8]
    lp, margin, where = against_hf(generate(engine, prompts), prompts, hf_logprobs)
    print(f"bf16 flash: logprob error {lp:.3e} (torch backend {torch_lp:.3e}), margin {margin:.3e} "
          f"(torch backend {torch_margin:.3e})")
    assert lp <= max(2 * torch_lp, 0.02), f"flash logprob error {lp:.3e} at {where}; torch backend {torch_lp:.3e}"
    assert margin <= max(2 * torch_margin, 2 * lp, 0.02), (margin, torch_margin)
    assert_all_blocks_free(engine)


@needs_flash
def test_flash_backend_with_chunks_on_cached_context_and_prefix_hits(tiny_dir, hf_logprobs, bf16_torch_error):
    torch_lp, _ = bf16_torch_error
    engine = bf16_engine(tiny_dir, "flash", scheduler=SchedulerConfig(max_num_batched_tokens=16))
    prompts = SHARED_PREFIX_PROMPTS
    lp, _, where = against_hf(generate(engine, prompts), prompts, hf_logprobs)
    assert engine.scheduler.stats.prefix_cache_hits > 0
    assert lp <= max(2 * torch_lp, 0.02), f"flash logprob error {lp:.3e} at {where}; torch backend {torch_lp:.3e}"
    assert_all_blocks_free(engine)


# -- the kernel alone, against a plain-torch model of it ------------------------------------------
def reference_varlen(*, q, k, v, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal,
                     block_table):
    """What FlashAttention asks of flash_attn_varlen_func, in plain torch (fp32 math): sequence i
    has queries q[cu_seqlens_q[i]:cu_seqlens_q[i+1]] and the first seqused_k[i] keys of its pages
    (block_table[i]); causal is aligned bottom-right (query j of n sees keys 0..L-n+j); query head
    h reads KV head h // (Hq / Hkv)."""
    out = torch.empty_like(q)
    block_size, group = k.shape[1], q.shape[1] // k.shape[2]
    cu, used, tables = cu_seqlens_q.tolist(), seqused_k.tolist(), block_table.tolist()
    for i, keys_len in enumerate(used):
        a, b = cu[i], cu[i + 1]
        n = b - a
        pages = torch.tensor(tables[i][:-(-keys_len // block_size)], dtype=torch.long, device=k.device)
        keys = k.index_select(0, pages).flatten(0, 1)[:keys_len].float().repeat_interleave(group, dim=1)
        values = v.index_select(0, pages).flatten(0, 1)[:keys_len].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), keys) * softmax_scale
        if causal:
            visible = torch.arange(keys_len, device=q.device)[None, :] <= (keys_len - n + torch.arange(n, device=q.device))[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values).to(q.dtype)
    return out


@needs_flash
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_flash_kernel_matches_the_reference_on_paged_inputs(head_dim):
    torch.manual_seed(head_dim)
    dev, dt = torch.device("cuda"), torch.bfloat16
    num_blocks, block_size, hq, hkv = 64, 16, 8, 4
    k_cache = torch.randn(num_blocks, block_size, hkv, head_dim, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    # (queries, keys) per sequence, in the runner's row order: decodes, a chunk on context, a fresh prefill.
    shapes = [(1, 1), (1, 17), (1, 100), (20, 60), (33, 33)]
    perm = torch.randperm(num_blocks).tolist()
    tables, at = [], 0
    for _, keys in shapes:
        need = -(-keys // block_size)
        tables.append(perm[at:at + need])
        at += need
    width = max(map(len, tables))
    cu = [0]
    for n, _ in shapes:
        cu.append(cu[-1] + n)
    args = dict(q=torch.randn(cu[-1], hq, head_dim, device=dev, dtype=dt), k=k_cache, v=v_cache,
                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev), max_seqlen_q=max(n for n, _ in shapes),
                seqused_k=torch.tensor([kl for _, kl in shapes], dtype=torch.int32, device=dev),
                max_seqlen_k=max(kl for _, kl in shapes), softmax_scale=head_dim ** -0.5, causal=True,
                block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev))
    got = _import_flash_varlen()(**args)
    want = reference_varlen(**args)
    err = (got.float() - want.float()).abs().max().item()
    assert err < 2e-2, f"flash varlen differs from the reference by {err:.3e} (head_dim {head_dim})"


# -- the flash path's metadata, with the reference as its kernel (any device) --------------------------
def test_flash_metadata_with_the_reference_kernel_matches_transformers(tiny_dir, hf_logprobs):
    device = "cuda" if HAS_CUDA else "cpu"
    engine = LLMEngine(EngineConfig(model=tiny_dir, device=device, dtype="float32", attention_backend="torch",
                                    cache=CacheConfig(block_size=8, **SMALL_KV),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=48)))
    cfg = engine.model_config
    backend = FlashAttention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, reference_varlen)
    engine.runner.backend = backend               # the runner now builds meta.flash for every step
    engine.model.set_attention_backend(backend)
    prompts = [PROMPTS[i] for i in (0, 1, 4, 7)] + SHARED_PREFIX_PROMPTS[:4]   # 1 to 300 tokens: chunked
    assert_close_to_hf(generate(engine, prompts, 12), prompts, hf_logprobs, FP32_TOL)
    hits = engine.scheduler.stats.prefix_cache_hits
    again = SHARED_PREFIX_PROMPTS[:4]                  # their blocks cached by the first batch
    assert_close_to_hf(generate(engine, again, 12), again, hf_logprobs, FP32_TOL)
    assert engine.scheduler.stats.prefix_cache_hits > hits
    assert_all_blocks_free(engine)
