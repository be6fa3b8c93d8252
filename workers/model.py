"""A Llama-architecture decoder (Llama, Qwen2, Mistral) over the paged KV cache.

Parameter names follow Hugging Face's, so a checkpoint's state dict loads as it is.
The forward pass takes a flattened batch of tokens (no padding) and returns hidden states;
the runner picks the rows it needs logits for.

Tensor parallelism (`Shard`): rank r of N holds a 1/N slice of each layer, Megatron's way. The
q/k/v and gate/up projections are split by output rows (heads, and the MLP's inner width), so
attention and the activation run on local heads and columns with no communication; o_proj and
down_proj are split by input columns, and their partial sums are added over the ranks
(`Shard.all_reduce`, two per layer). Embeddings, norms and lm_head are whole on every rank,
so every rank ends a step with the same hidden states. A checkpoint loads as it is: each HF
tensor is sliced on the way in (`_hf_slots`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.attention import AttentionMetadata, TorchAttention
from workers.config import ModelConfig

# Up to this many rows (the tokens of a decode step of a few sequences), the C++ kernel runs a
# linear layer at least as fast as torch's MKL: at 1 row it streams the weights at ~1.8x MKL's
# GEMV, and MKL's GEMM for 2-16 rows is slower still (on the 2-core box, `small`'s layers: 2.2x
# faster at 1 row, 2-3.5x at 2-16 rows; on `tiny` with one thread, MKL catches up past 16 rows).
SMALL_BATCH_ROWS = 16


class Linear(nn.Linear):
    """nn.Linear that hands inputs of few rows to the C++ kernels when the runner set them
    (`LlamaForCausalLM.set_cpu_kernels`)."""
    kernels = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.shape[0] <= SMALL_BATCH_ROWS:
            return self.kernels.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class Shard:
    """Which slice of the model this process holds: rank `rank` of `size`, and how partial sums
    are added over the ranks (`reduce`, in place; None with one rank)."""

    def __init__(self, rank: int = 0, size: int = 1, reduce=None):
        if not 0 <= rank < size:
            raise ValueError(f"tensor parallel rank {rank} outside 0..{size - 1}")
        self.rank, self.size, self.reduce = rank, size, reduce

    def split(self, n: int, what: str) -> int:
        """This rank's share of `n` (heads, rows); a size that does not divide it is a ValueError."""
        if n % self.size:
            raise ValueError(f"--tensor-parallel-size {self.size} does not divide {what}={n}")
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.reduce(x)
        return x


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Raise the ValueError a model that cannot be split `size` ways would raise, before any
    process is started for it."""
    shard = Shard(0, size)
    shard.split(cfg.num_attention_heads, "num_attention_heads")
    shard.split(cfg.num_key_value_heads, "num_key_value_heads")
    shard.split(cfg.intermediate_size, "intermediate_size")


class RMSNorm(nn.Module):
    """HF's formula in torch ops, or the same in one call of the C++ kernels when the runner set
    them: on a decode's single row, torch's ops cost more in dispatch than in arithmetic."""
    kernels = None

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype                        # normalize in fp32, cast, then the weight
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Non-interleaved RoPE ("rotate half"), cos/sin precomputed for every position.

    HF rotates x as x * cos + cat(-x2, x1) * sin. The sin table here carries that minus sign
    in its first half, so `apply_rope` skips the negation: -(a * b) == a * -b, bit for bit.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        half = head_dim // 2
        self.register_buffer("sin", torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], dim=-1),
                             persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Looked up once per step; every layer reuses the pair. Shapes [T, 1, D]."""
        return (self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype))


def apply_rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, signed_sin = cos_sin
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


class Attention(nn.Module):
    kernels = None                  # the C++ kernels' rope_and_cache when the runner set them

    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        self.shard = shard                  # this rank's heads: num_heads of them, from rank * num_heads
        self.num_heads = shard.split(cfg.num_attention_heads, "num_attention_heads")
        self.num_kv_heads = shard.split(cfg.num_key_value_heads, "num_key_value_heads")
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one matmul (HF's q_proj/k_proj/v_proj are its row blocks).
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.backend: TorchAttention | None = None      # set by the runner

    def forward(self, x, cos_sin, k_cache, v_cache, meta: AttentionMetadata):
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        # q's and k's heads are adjacent in a row: one rotation for both.
        qk_size = self.q_size + self.kv_size
        fused = self.kernels is not None and qkv.is_contiguous() and k_cache.is_contiguous() and \
            v_cache.is_contiguous() and meta.slot_mapping.dtype == torch.int64
        if fused:        # one C++ call rotates q and k in place and stores k and v at their slots
            cos, sin = cos_sin
            self.kernels.rope_and_cache(qkv, cos.view(T, self.head_dim), sin.view(T, self.head_dim), k_cache,
                                        v_cache, meta.slot_mapping, self.num_heads, self.num_kv_heads)
            qk = qkv[:, :qk_size].view(T, -1, self.head_dim)
        else:
            qk = apply_rope(qkv[:, :qk_size].view(T, -1, self.head_dim), cos_sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, qk_size:].view(T, self.num_kv_heads, self.head_dim)
        o = self.backend.forward(q, k, v, k_cache, v_cache, meta, kv_written=fused)
        return self.shard.all_reduce(self.o_proj(o.view(T, self.q_size)))


class MLP(nn.Module):
    kernels = None                  # the C++ kernels' silu_and_mul when the runner set them

    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        self.shard = shard
        self.intermediate_size = shard.split(cfg.intermediate_size, "intermediate_size")
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = Linear(self.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None:
            return self.shard.all_reduce(self.down_proj(self.kernels.silu_and_mul(gate_up)))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.shard.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard)

    def forward(self, x, cos_sin, k_cache, v_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, shard) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard | None = None):
        super().__init__()
        self.config = cfg
        self.shard = shard = shard or Shard()
        self.model = LlamaModel(cfg, shard)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_attention_backend(self, backend: TorchAttention) -> None:
        for layer in self.model.layers:
            layer.self_attn.backend = backend

    def set_cpu_kernels(self, kernels) -> None:
        """The C++ module (`workers.cpu_kernels.for_model`) for the linear layers' few-row inputs,
        the norms, the MLP's activation and the rotary embedding with the KV store; None:
        torch's own ops."""
        for module in self.modules():
            if isinstance(module, (Linear, RMSNorm, MLP, Attention)):
                module.kernels = kernels

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rope(positions, x.dtype)
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches):
            x = layer(x, cos_sin, k_cache, v_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # -- Hugging Face names ----------------------------------------------------------------
    # Each HF tensor's place: name -> (our param, row offset, rows, HF shape, split dim, start).
    # The HF tensor's slice along `dim` from `start`, as long as our part, goes to our param's
    # rows [off, off + rows): fused parameters hold HF's separate ones as row
    # blocks, and a shard holds a slice (rows of q/k/v and gate/up, columns of o and down).
    def _hf_slots(self) -> dict[str, tuple[nn.Parameter, int, int, tuple[int, ...], int, int]]:
        cfg, slots, r = self.config, {}, self.shard.rank
        for i, layer in enumerate(self.model.layers):
            pre, attn, mlp = f"model.layers.{i}.", layer.self_attn, layer.mlp
            q, kv, h, inter = attn.q_size, attn.kv_size, cfg.hidden_size, mlp.intermediate_size
            rows = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}
            for name, (off, n) in rows.items():
                full = n * self.shard.size
                slots[f"{pre}self_attn.{name}.weight"] = (attn.qkv_proj.weight, off, n, (full, h), 0, r * n)
                if cfg.attention_bias:
                    slots[f"{pre}self_attn.{name}.bias"] = (attn.qkv_proj.bias, off, n, (full,), 0, r * n)
            full_i = inter * self.shard.size
            slots[f"{pre}mlp.gate_proj.weight"] = (mlp.gate_up_proj.weight, 0, inter, (full_i, h), 0, r * inter)
            slots[f"{pre}mlp.up_proj.weight"] = (mlp.gate_up_proj.weight, inter, inter, (full_i, h), 0, r * inter)
            slots[f"{pre}self_attn.o_proj.weight"] = (attn.o_proj.weight, 0, h, (h, q * self.shard.size), 1, r * q)
            slots[f"{pre}mlp.down_proj.weight"] = (mlp.down_proj.weight, 0, h, (h, full_i), 1, r * inter)
            for name, p in [("input_layernorm.weight", layer.input_layernorm.weight),
                            ("post_attention_layernorm.weight", layer.post_attention_layernorm.weight)]:
                slots[pre + name] = (p, 0, p.shape[0], tuple(p.shape), 0, 0)
        whole = [("model.embed_tokens.weight", self.model.embed_tokens.weight), ("model.norm.weight", self.model.norm.weight)]
        if not cfg.tie_word_embeddings:
            whole.append(("lm_head.weight", self.lm_head.weight))
        for name, p in whole:
            slots[name] = (p, 0, p.shape[0], tuple(p.shape), 0, 0)
        return slots

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint's tensors and their (whole, unsharded) shapes."""
        return {name: shape for name, (_, _, _, shape, _, _) in self._hf_slots().items()}

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        if self.shard.size > 1:
            raise ValueError("a tensor-parallel shard holds a slice of the model, not a checkpoint")
        return {name: p.detach()[off:off + rows] for name, (p, off, rows, _, _, _) in self._hf_slots().items()}

    @torch.no_grad()
    def load_hf_weights(self, tensors) -> set[str]:
        """Copy (HF name, tensor) pairs into place (this shard's slice of each); returns the
        names it took."""
        slots, taken = self._hf_slots(), set()
        for name, t in tensors:
            if name not in slots:
                continue                         # e.g. rotary_emb.inv_freq in old checkpoints
            p, off, rows, shape, dim, start = slots[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, the config implies {shape}")
            part = p[off:off + rows]
            part.copy_(t.narrow(dim, start, part.shape[dim]))
            taken.add(name)
        return taken
