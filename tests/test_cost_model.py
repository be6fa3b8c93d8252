"""The cost model against hand-computed oracles and DistServe's published profile."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest

from workers.config import ModelConfig
from workers.cost_model import (DISTSERVE_OPT13B_A100, HARDWARE, LINKS, MODELS, BatchShape, CostModel,
                                LinearStepModel, Link, ModelShape, RooflineStepModel, batch_shape, hardware,
                                StepFit, kv_capacity_tokens, link, local_prefill_limit, model_shape, roofline)
from workers.sequence import SamplingParams, Sequence

LLAMA3_8B_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
                    "tie_word_embeddings": False, "rope_theta": 500000.0}
OPT_13B_CONFIG = {"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 5120,
                  "ffn_dim": 20480, "num_hidden_layers": 40, "num_attention_heads": 40, "vocab_size": 50272,
                  "max_position_embeddings": 2048, "word_embed_proj_dim": 5120, "do_layer_norm_before": True}


def prefill(*chunks: tuple[int, int]) -> BatchShape:
    """Chunks as (l, c) pairs."""
    return sum((BatchShape(1, n, n * n, n * c) for n, c in chunks), BatchShape())


def decode(*contexts: int) -> BatchShape:
    return BatchShape(num_decode=len(contexts), decode_context=sum(contexts))


# -- DistServe's profile -------------------------------------------------------------------------
def test_distserve_opt13b_a100_reproduces_the_published_step_times():
    assert DISTSERVE_OPT13B_A100.step_s(BatchShape(num_prefill=1, prefill_tokens=512, prefill_sq=512**2)) \
        == pytest.approx(72.15e-3, abs=0.1e-3)
    assert DISTSERVE_OPT13B_A100.step_s(BatchShape(num_decode=94, decode_context=94 * 956)) \
        == pytest.approx(79.9e-3, abs=0.1e-3)


def test_linear_step_model_mixed_and_empty_steps():
    m = LinearStepModel(p0=0.01, p1=1e-4, p2=1e-8, d0=0.02, d1=1e-6, d2=1e-4)
    assert m.step_s(BatchShape()) == 0.0
    p, d = prefill((100, 50)), decode(200, 300)
    assert m.step_s(p) == pytest.approx(0.01 + 1e-4 * 100 + 1e-8 * (100**2 + 2 * 100 * 50))
    assert m.step_s(d) == pytest.approx(0.02 + 1e-6 * 500 + 1e-4 * 2)
    # one fixed cost for a mixed step, the larger
    assert m.step_s(p + d) == pytest.approx(m.step_s(p) + m.step_s(d) - 0.01)


# -- batch_shape ---------------------------------------------------------------------------------
def seq(prompt_len: int, outputs: int = 0, computed: int = 0) -> Sequence:
    s = Sequence("s", list(range(prompt_len)), SamplingParams())
    s.token_ids.extend(range(outputs))
    s.num_computed_tokens = computed
    return s


def test_batch_shape_classifies_chunks_cached_context_and_decode_rows():
    fresh = seq(10)                         # first chunk of a prompt
    cached = seq(20, computed=16)           # prefix cache served 16 tokens
    later_chunk = seq(30, computed=12)      # second chunk
    last_prompt_token = seq(10, computed=9)  # one prompt token left: still prefill
    decoding = seq(5, outputs=3, computed=7)
    handed_off = seq(8, outputs=1, computed=8)  # KV arrived from a prefill worker
    recompute = seq(5, outputs=3)           # preempted by recompute: prompt and outputs again
    shape = batch_shape([(fresh, 6), (cached, 4), (later_chunk, 18), (last_prompt_token, 1),
                         (decoding, 1), (handed_off, 1), (recompute, 8)])
    assert shape == BatchShape(num_prefill=5, prefill_tokens=6 + 4 + 18 + 1 + 8,
                               prefill_sq=36 + 16 + 324 + 1 + 64, prefill_ctx=4 * 16 + 18 * 12 + 1 * 9,
                               num_decode=2, decode_context=8 + 9)
    assert shape.batch_size == 7 and shape.num_tokens == 37 + 2
    assert batch_shape([]) == BatchShape()


# -- fit -----------------------------------------------------------------------------------------
TRUE = LinearStepModel(p0=15e-3, p1=0.1e-3, p2=7e-9, d0=20e-3, d1=6e-7, d2=4e-5)


def samples(model: LinearStepModel, noise: float = 0.0, seed: int = 0) -> list[tuple[BatchShape, float]]:
    rng = random.Random(seed)
    shapes = [prefill((n, c)) for n in (64, 256, 512, 1024, 2048) for c in (0, 512, 1024)]
    shapes += [prefill((128, 0), (300, 100)), prefill((700, 0), (90, 2000), (1000, 0))]
    shapes += [decode(*[ctx] * n) for n in (1, 8, 32, 64, 128) for ctx in (100, 900, 2000)]
    return [(s, model.step_s(s) * (1 + rng.gauss(0, noise))) for s in shapes]


def test_fit_recovers_known_coefficients_without_noise():
    mixed = [(prefill((512, 0)) + decode(100, 100), 99.0)]      # ignored by the fit
    fit = LinearStepModel.fit(samples(TRUE) + mixed)
    for name in ("p0", "p1", "p2", "d0", "d1", "d2"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name


def test_fit_with_noise_predicts_within_tolerance():
    fit = LinearStepModel.fit(samples(TRUE, noise=0.01, seed=1))
    assert fit.p1 == pytest.approx(TRUE.p1, rel=0.05) and fit.d1 == pytest.approx(TRUE.d1, rel=0.05)
    for s in (prefill((1500, 300)), prefill((200, 0), (200, 0)), decode(*[1500] * 50), decode(3000)):
        assert fit.step_s(s) == pytest.approx(TRUE.step_s(s), rel=0.02)


def test_fit_keeps_coefficients_non_negative():
    # a slightly concave prefill curve would give p2 < 0 by plain least squares
    data = [(prefill((n, 0)), 0.01 + 1e-4 * n - 1e-9 * n * n) for n in (100, 500, 1000, 2000, 4000)]
    data += [(decode(*[ctx] * n), 0.02 + 1e-4 * n) for n in (1, 4, 16, 64) for ctx in (500, 1000)]
    fit = LinearStepModel.fit(data)
    assert min(v for v in dataclasses.astuple(fit) if v is not None) >= 0.0 and fit.p2 == 0.0
    assert fit.d2 == pytest.approx(1e-4, rel=1e-6) and fit.d1 == pytest.approx(0.0, abs=1e-12)


def test_fit_rejects_too_few_samples():
    dec = [(decode(*[100] * n), 0.02 + n * 1e-4) for n in (1, 2, 3)]
    with pytest.raises(ValueError, match="3 distinct prefill"):
        LinearStepModel.fit([(prefill((100, 0)), 0.02), (prefill((200, 0)), 0.03)] + dec)
    with pytest.raises(ValueError, match="3 distinct prefill"):      # repeats are not distinct
        LinearStepModel.fit([(prefill((100, 0)), 0.02)] * 5 + dec)
    with pytest.raises(ValueError, match="3 distinct decode"):
        LinearStepModel.fit(samples(TRUE)[:17] + dec[:2])
    with pytest.raises(ValueError, match="collinear"):     # every row at one context: Σcontext ∝ rows
        LinearStepModel.fit(samples(TRUE)[:17] + dec)



def test_a_reduced_fit_on_one_prompt_length_prices_that_length_and_refuses_without_reduce():
    """Served steps of one prompt length (a load test's fixed lengths) cannot tell Σl² from Σl:
    without `reduce` that is an error; with it the quadratic term is priced per token, and the
    model gives the true step times of batches of that length (what admission and local
    prefill ask it)."""
    batches = [(prefill(*[(128, 0)] * k), TRUE.step_s(prefill(*[(128, 0)] * k))) for k in (1, 2, 4, 8, 16)]
    dec = [(decode(*[ctx] * n), TRUE.step_s(decode(*[ctx] * n))) for n in (1, 8, 32) for ctx in (100, 900)]
    with pytest.raises(ValueError, match="collinear"):
        LinearStepModel.fit(batches + dec)
    fit = LinearStepModel.fit(batches + dec, reduce=True)
    assert fit.p2 == 0.0
    for k in (1, 3, 16, 32):
        shape = prefill(*[(128, 0)] * k)
        assert fit.step_s(shape) == pytest.approx(TRUE.step_s(shape), rel=1e-6), k
    assert fit.d1 == pytest.approx(TRUE.d1, rel=1e-6)          # the decode terms are untouched
    with pytest.raises(ValueError, match="distinct prefill"):  # one batch shape pins nothing down
        LinearStepModel.fit([batches[0]] * 4 + dec, reduce=True)


def test_step_fit_on_served_steps_of_one_prompt_length_has_a_model():
    fit = StepFit(kv_bytes_per_token=1024, kv_capacity_tokens=10_000)
    shapes = [prefill(*[(128, 0)] * k) for k in (1, 2, 4, 8, 16)] + [decode(*[300 + n] * n) for n in (1, 8, 32)]
    fit.add([[TRUE.step_s(s), *dataclasses.astuple(s)] for s in shapes])
    model = fit.current()
    assert model is not None
    assert model.prefill_tokens_per_s(128, 2048) == pytest.approx(
        16 * 128 / TRUE.step_s(prefill(*[(128, 0)] * 16)), rel=1e-6)

def test_the_prefill_model_prices_prompts_from_a_profile_of_prefill_shapes_alone():
    """SLO admission's model of prefill steps (StepFit.prefill_model): a profile of prefill
    shapes alone prices prompts from the start, where the model of both step kinds waits for
    decode steps; served steps where prefill-only ones are a few cached prompts' tails (a
    colocated pool) then move it little, where a fit on those few alone is far off."""
    grid = [prefill(*[(n, 0)] * k) for k, n in ((1, 16), (1, 128), (1, 512), (4, 128), (8, 64), (2, 512), (1, 1024))]
    grid += [prefill((256, c)) for c in (256, 512, 768)]            # chunks on cached context
    profile = [[TRUE.step_s(s), *dataclasses.astuple(s)] for s in grid]
    fit = StepFit(1024, 10_000, profile)
    assert fit.current() is None                                      # no decode step yet
    model = fit.prefill_model()
    for k in (1, 4, 16):
        shape = prefill(*[(128, 0)] * k)
        assert model.step_s(shape) == pytest.approx(TRUE.step_s(shape), rel=1e-6), k
    # Served: decode steps by the hundred, and three prefill-only steps, tails of cached prompts
    # on 112 tokens of context, each 3x its true cost (a contended box).
    tails = [prefill((16, 112)), prefill((1, 127)), prefill((16, 112), (16, 112))]
    served = [decode(*[300 + i % 50] * (1 + i % 32)) for i in range(300)]
    fit.add([[TRUE.step_s(s), *dataclasses.astuple(s)] for s in served]
            + [[3 * TRUE.step_s(s), *dataclasses.astuple(s)] for s in tails])
    fit.clock = lambda: 1e9                                           # past the refit interval
    batch = prefill(*[(128, 0)] * 16)
    alone = StepFit(1024, 10_000)
    alone.add([[TRUE.step_s(s), *dataclasses.astuple(s)] for s in served]
              + [[3 * TRUE.step_s(s), *dataclasses.astuple(s)] for s in tails])
    assert fit.prefill_model().step_s(batch) == pytest.approx(TRUE.step_s(batch), rel=0.25)
    assert not 0.5 < alone.current().step_s(batch) / TRUE.step_s(batch) < 2


# -- roofline ------------------------------------------------------------------------------------
LLAMA3_8B_BLOCK_PARAMS = 32 * (4096 * (4096 + 2 * 8 * 128) + 4096 * 4096 + 3 * 4096 * 14336)
LLAMA3_8B_PARAMS = LLAMA3_8B_BLOCK_PARAMS + 2 * 128256 * 4096


def test_kv_bytes_per_token():
    assert MODELS["llama-3-8b"].kv_bytes_per_token() == 131072
    assert MODELS["opt-13b"].kv_bytes_per_token() == 819200
    assert MODELS["llama-3-8b"].num_params() == LLAMA3_8B_PARAMS
    assert MODELS["llama-3-8b"].num_params() == pytest.approx(8.03e9, rel=0.01)
    assert MODELS["opt-13b"].num_params() == pytest.approx(12.85e9, rel=0.01)


def test_decode_at_batch_one_is_bandwidth_bound():
    step = RooflineStepModel(MODELS["llama-3-8b"], HARDWARE["h100-sxm"])
    s = decode(1000)
    oracle = (LLAMA3_8B_PARAMS * 2 + 1001 * 131072) / (3.35e12 * 0.8) + 2e-3
    assert step.step_s(s) == pytest.approx(oracle, rel=1e-9)
    assert step.step_s(s) == pytest.approx(LLAMA3_8B_PARAMS * 2 / (3.35e12 * 0.8) + 2e-3, rel=0.01)
    assert dataclasses.replace(step, compute_eff=0.3).step_s(s) == step.step_s(s)


def test_big_prefill_is_compute_bound():
    step = RooflineStepModel(MODELS["llama-3-8b"], HARDWARE["h100-sxm"])
    n = 8192
    flops = 2 * LLAMA3_8B_BLOCK_PARAMS * n + 4 * 32 * 32 * 128 * n * n / 2 + 2 * 4096 * 128256
    assert step.step_s(prefill((n, 0))) == pytest.approx(flops / (989e12 * 0.6) + 2e-3, rel=1e-9)
    assert dataclasses.replace(step, bandwidth_eff=0.4).step_s(prefill((n, 0))) == step.step_s(prefill((n, 0)))
    # a chunk on cached context pays for the pairs it attends to
    assert step.step_s(prefill((n, 4096))) - step.step_s(prefill((n, 0))) \
        == pytest.approx(4 * 32 * 32 * 128 * n * 4096 / (989e12 * 0.6), rel=1e-9)


def test_tensor_parallel_roughly_halves_the_work():
    one = RooflineStepModel(MODELS["llama-3-8b"], HARDWARE["h100-sxm"])
    two = dataclasses.replace(one, tp=2)
    assert 0.45 < two.step_s(prefill((8192, 0))) / one.step_s(prefill((8192, 0))) < 0.6
    # decode: the weight read halves; two all-reduces per layer (ring: 2(tp-1)/tp of the bytes) are added
    nvl = LINKS["nvlink-h100"]
    allreduce = 2 * 32 * (1 * 64 * 4096 * 2 / nvl.bandwidth + nvl.latency_s)
    s = decode(*[1000] * 64)
    assert two.step_s(s) - 2e-3 - allreduce == pytest.approx((one.step_s(s) - 2e-3) / 2, rel=1e-9)
    assert one.step_s(BatchShape()) == 0.0
    with pytest.raises(ValueError, match="tp"):
        dataclasses.replace(one, tp=0)


def test_kv_capacity():
    cap = kv_capacity_tokens(MODELS["opt-13b"], HARDWARE["a100-80g"], tp=1)
    oracle = (81920 * 2**20 * 0.9 - 2 * 2**30 - MODELS["opt-13b"].num_params() * 2) // 819200
    assert cap == oracle
    assert cap == pytest.approx(66144, rel=0.15)     # DistServe's measured max_num_tokens on this setup
    with pytest.raises(ValueError, match="does not fit"):
        kv_capacity_tokens(MODELS["opt-175b"], HARDWARE["a100-80g"], tp=1)
    assert kv_capacity_tokens(MODELS["opt-175b"], HARDWARE["a100-80g"], tp=8) == pytest.approx(59520, rel=0.15)


# -- model shapes and names ----------------------------------------------------------------------
def test_from_hf_config_llama_and_opt():
    assert ModelShape.from_hf_config(LLAMA3_8B_CONFIG, "llama-3-8b") == MODELS["llama-3-8b"]
    assert ModelShape.from_hf_config(OPT_13B_CONFIG, "opt-13b") == MODELS["opt-13b"]
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_hf_config({"n_embd": 768, "num_hidden_layers": 12, "num_attention_heads": 12})


def test_from_model_config_matches_from_hf_config():
    cfg = ModelConfig.from_hf_dict(LLAMA3_8B_CONFIG)
    assert ModelShape.from_model_config(cfg, "llama-3-8b") == MODELS["llama-3-8b"]


def test_model_shape_from_directory_and_names(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(OPT_13B_CONFIG))
    shape = model_shape(str(tmp_path))
    assert dataclasses.replace(shape, name="opt-13b") == MODELS["opt-13b"]
    assert model_shape("LLaMA-3-8B") is MODELS["llama-3-8b"]
    assert hardware("H200").mem_bytes == 143771 * 2**20 and link("ib-200").bandwidth == 25e9
    for lookup, bad, choice in ((model_shape, "gpt-5", "opt-66b"), (hardware, "b200", "h100-sxm"),
                                (link, "ethernet", "pcie5")):
        with pytest.raises(ValueError, match=choice):
            lookup(bad)


# -- CostModel -----------------------------------------------------------------------------------
def test_cost_model_json_round_trip_for_both_step_kinds():
    linear = CostModel(DISTSERVE_OPT13B_A100, 819200, 66144, LINKS["ib-200"], 1, "profile distserve")
    for cm in (linear, roofline("opt-66b", "a100-80g", tp=4, link="ib-400", compute_eff=0.5)):
        d = json.loads(json.dumps(cm.to_json()))
        assert d["version"] == 1 and d["kind"] in ("linear", "roofline")
        back = CostModel.from_json(d)
        assert back == cm
        assert back.step_s(prefill((300, 20)) + decode(500)) == cm.step_s(prefill((300, 20)) + decode(500))
    with pytest.raises(ValueError, match="version"):
        CostModel.from_json({**linear.to_json(), "version": 2})


def test_handoff_and_batch_room():
    cm = roofline("opt-13b", "a100-80g", link="ib-200")
    assert cm.source == "roofline a100-80g opt-13b tp1" and cm.link is LINKS["ib-200"]
    assert cm.handoff_s(1000) == pytest.approx(5e-6 + 1000 * 819200 / 25e9)
    assert cm.handoff_s(0) == cm.link.latency_s
    assert roofline("llama-3-8b", "h200").link.bandwidth == 450e9     # NVLink per direction
    small = dataclasses.replace(cm, kv_capacity_tokens=16 * 100)
    assert small.max_batch_at(160) == 10 and small.max_batch_at(161) == 9 and small.max_batch_at(1) == 100


@pytest.mark.parametrize("model", [DISTSERVE_OPT13B_A100, roofline("llama-3-8b", "h100-sxm", 2).step,
                                   roofline("opt-13b", "a100-80g", 1).step])
def test_a_decode_run_costs_its_steps(model):
    """The simulator takes a steady decode run whole: its per-step times are step_s of each step,
    across the roofline's turn from bandwidth- to compute-bound too."""
    for n, ctx, k in [(1, 100, 5), (32, 32 * 900, 300), (256, 256 * 3000, 200)]:
        run = model.decode_run_s(n, ctx, k)
        steps = [model.step_s(BatchShape(num_decode=n, decode_context=ctx + j * n)) for j in range(k)]
        assert run == pytest.approx(steps, rel=1e-12)


@pytest.mark.parametrize("num_decode,context,remote_s", [(0, 0, 0.0), (1, 500, 0.001), (8, 4000, 0.02),
                                                          (64, 64000, 0.05), (32, 10000, 0.0), (4, 800, 1.0)])
def test_local_prefill_limit_is_the_largest_prompt_whose_delay_to_the_batch_costs_less_than_remote(
        num_decode, context, remote_s):
    """Oracle: every n checked one by one (the delay grows with n)."""
    cost = CostModel(LinearStepModel(p0=0.004, p1=2e-5, p2=1e-9, d0=0.003, d1=2e-7, d2=1e-4), 4096, 65536,
                     Link("m", 1e9, 0.01))
    decode = BatchShape(num_decode=num_decode, decode_context=context)

    def delay(n: int) -> float:
        return num_decode * (cost.step_s(decode + BatchShape(1, n, n * n, 0)) - cost.step_s(decode))
    most = 3000
    want = max((n for n in range(most + 1) if delay(n) <= remote_s), default=0)
    got = local_prefill_limit(cost, num_decode, context, remote_s, most)
    assert got == want
    if num_decode == 0:
        assert got == most                               # nobody decoding: nobody waits for it
    assert local_prefill_limit(cost, num_decode, context, remote_s * 2 + 0.01, most) >= got
    assert local_prefill_limit(cost, num_decode + 8, context, remote_s, most) <= got


def test_the_decode_step_fit_finds_its_line_and_falls_back_to_proportional():
    from workers.cost_model import DecodeStepFit
    fit = DecodeStepFit(min_steps=20)
    for i in range(19):
        fit.observe(10 + i % 7, 0.004 + 0.0005 * (10 + i % 7))
    assert fit.predict(40) is None                          # too few steps yet
    fit.observe(12, 0.004 + 0.0005 * 12)
    assert fit.predict(40) == pytest.approx(0.004 + 0.0005 * 40, rel=1e-6)
    flat = DecodeStepFit(min_steps=5)
    for _ in range(10):
        flat.observe(50, 0.05)                              # one batch size: no slope to fit
    assert flat.predict(60) == pytest.approx(0.06)          # proportional: errs high past the data
