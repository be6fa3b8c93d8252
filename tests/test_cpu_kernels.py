"""The model's C++ CPU kernels (workers/csrc/linear.cpp, rms_norm.cpp, activation.cpp,
paged_attention.cpp) vs torch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers import cpu_kernels
from workers.model import RMSNorm

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the CPU kernels do not build here (make setup builds them)")


# Row counts that 8 does not divide and a K that 8 does not divide (the tails).
@pytest.mark.parametrize("n, k", [(1280, 768), (259, 768), (768, 2816), (17, 37), (3, 5)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16])
def test_linear_equals_torch(n, k, rows):
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    x, w, b = (torch.randn(shape, generator=gen) for shape in [(rows, k), (n, k), (n,)])
    w /= k ** 0.5                      # outputs of order 1, as in a model
    # Another summation order than MKL's: equal up to fp32 rounding over k terms.
    torch.testing.assert_close(KERNELS.linear(x, w), F.linear(x, w), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(KERNELS.linear(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-5)


def test_linear_row_does_not_depend_on_the_others():
    """A sequence's decode gives the same bits whatever else is in its step."""
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(259, 100, generator=gen), torch.randn(7, 100, generator=gen)
    together = KERNELS.linear(x, w)
    for i in range(7):
        assert torch.equal(together[i], KERNELS.linear(x[i:i + 1], w)[0])


@pytest.mark.parametrize("rows", [1, 3, 2048])        # 2048: the rows split between threads
def test_rms_norm_equals_the_torch_formula(rows):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(768, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(768, generator=gen))
        x = 3 * torch.randn(rows, 768, generator=gen)
        want = norm(x)                                 # no kernel set: HF's formula in torch ops
    got = KERNELS.rms_norm(x, norm.weight, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for i in (0, rows - 1):
        assert torch.equal(got[i], KERNELS.rms_norm(x[i:i + 1], norm.weight, 1e-6)[0])


@pytest.mark.parametrize("rows", [1, 3, 300])
def test_silu_and_mul_equals_torch(rows):
    gate_up = 4 * torch.randn(rows, 2 * 2816, generator=torch.Generator().manual_seed(rows))
    gate, up = gate_up.split(2816, dim=-1)
    torch.testing.assert_close(KERNELS.silu_and_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def reference_attention(q, k_cache, v_cache, cu, lens, tables):
    """Each sequence's rows attend causally to their keys, gathered from the blocks and run
    through torch's SDPA (heads of a group sharing their KV head)."""
    hkv = k_cache.shape[2]
    g = q.shape[1] // hkv
    out = torch.empty_like(q)
    for s in range(len(lens)):
        a, b, n = int(cu[s]), int(cu[s + 1]), int(lens[s])
        keys = k_cache[tables[s]].reshape(-1, hkv, k_cache.shape[3])[:n].repeat_interleave(g, 1)
        vals = v_cache[tables[s]].reshape(-1, hkv, v_cache.shape[3])[:n].repeat_interleave(g, 1)
        rows = b - a                       # the last `rows` positions of the n: causal within them
        mask = torch.ones(rows, n, dtype=torch.bool).tril(n - rows)
        out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), keys.transpose(0, 1),
                                                  vals.transpose(0, 1), attn_mask=mask).transpose(0, 1)
    return out


# Head sizes the kernel has compiled-in loops for (32, 64, 128) and one it runs generically (48);
# decode rows (one query) and chunks on cached context (several, causal), GQA groups of 1 and 4.
@pytest.mark.parametrize("head_dim", [32, 48, 64, 128])
@pytest.mark.parametrize("q_heads, kv_heads", [(8, 4), (4, 4), (8, 2)])
def test_paged_attention_equals_sdpa_over_the_gathered_blocks(head_dim, q_heads, kv_heads):
    gen = torch.Generator().manual_seed(head_dim * 100 + q_heads * 10 + kv_heads)
    bs, num_blocks = 16, 64
    k_cache, v_cache = (torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen) for _ in range(2))
    lens = torch.tensor([1, 17, 160, 33, 48])            # keys of each sequence
    q_lens = [1, 1, 1, 5, 16]                            # decodes, then chunks on cached context
    width = max(-(-int(n) // bs) for n in lens)
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)))
    q = torch.randn(int(cu[-1]), q_heads, head_dim, generator=gen)
    got = KERNELS.paged_attention(q, k_cache, v_cache, cu, lens, tables, head_dim ** -0.5)
    torch.testing.assert_close(got, reference_attention(q, k_cache, v_cache, cu, lens, tables), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(8, 4, 32), (12, 4, 64), (4, 4, 128)])
def test_rope_and_cache_equals_the_torch_rotation_and_index_copies(rows, q_heads, kv_heads, head_dim):
    from workers.attention import TorchAttention
    from workers.model import RotaryEmbedding, apply_rope
    gen = torch.Generator().manual_seed(rows * 1000 + q_heads * 10 + head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    cos_sin = rope(positions, torch.float32)
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * head_dim, generator=gen)
    slots = torch.randperm(32 * 16, generator=gen)[:rows]
    caches = [torch.zeros(32, 16, kv_heads, head_dim) for _ in range(4)]   # torch's k, v; the kernel's k, v
    # torch: the model's rotation of q and k together, then the backend's index copies
    qk = apply_rope(qkv[:, :(q_heads + kv_heads) * head_dim].view(rows, -1, head_dim), cos_sin)
    v = qkv[:, (q_heads + kv_heads) * head_dim:].view(rows, kv_heads, head_dim)
    TorchAttention(q_heads, kv_heads, head_dim).write_kv(qk[:, q_heads:], v, caches[0], caches[1], slots)
    fused = qkv.clone()
    KERNELS.rope_and_cache(fused, cos_sin[0].view(rows, -1), cos_sin[1].view(rows, -1), caches[2], caches[3],
                           slots, q_heads, kv_heads)
    torch.testing.assert_close(fused[:, :(q_heads + kv_heads) * head_dim].view(rows, -1, head_dim), qk,
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused[:, (q_heads + kv_heads) * head_dim:], qkv[:, (q_heads + kv_heads) * head_dim:],
                               rtol=0, atol=0)                             # v untouched
    torch.testing.assert_close(caches[2], caches[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(caches[3], caches[1], rtol=0, atol=0)
    assert caches[2].abs().sum() > 0                                          # something was stored


def test_rope_and_cache_refuses_a_slot_outside_the_cache_and_writes_nothing():
    qkv, cos, sin = torch.randn(2, 4 * 32), torch.ones(2, 32), torch.zeros(2, 32)
    k_cache, v_cache = torch.zeros(2, 16, 1, 32), torch.zeros(2, 16, 1, 32)
    with pytest.raises(RuntimeError, match="outside the cache"):
        KERNELS.rope_and_cache(qkv, cos, sin, k_cache, v_cache, torch.tensor([0, 32]), 2, 1)
    assert k_cache.abs().sum() == 0 and v_cache.abs().sum() == 0
