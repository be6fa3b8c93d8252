"""Attention over the paged KV cache.

KV layout, per layer, allocated once by the model runner:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset       (flat index of one token's K/V)

A step's tokens are flattened into one batch, decode tokens first:

    tokens:   [ d0 d1 d2 | c0 c0 c0 | p0 p0 p0 p0 ]    d = one query per decoding sequence
    seq:        decodes    on context  fresh prefill   c = a prompt chunk after cached tokens
              '------ paged rows ------'                   (chunked prefill, prefix-cache hit)

Every layer first writes the new K/V at `slot_mapping`, then attends. Paged rows read their
keys through the block table; a fresh prefill has all its keys in hand and runs plain causal
attention. Writing before reading lets a sequence use blocks another sequence of the same
step is filling (a prefix-cache hit in the same step).

Backends: `torch` (reference, any device: gathers the blocks, then SDPA), `cpu` (a C++ kernel
that reads blocks in place, fp32), `flash` (vllm-flash-attn / flash-attn on CUDA sm80+).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.names import ATTENTION_BACKENDS


@dataclass(slots=True)
class PrefillChunk:
    start: int                 # first row of the chunk in the flattened batch
    end: int
    num_context: int           # tokens already in the cache before this chunk
    block_table: torch.Tensor | None  # [max_blocks] int64 when num_context > 0


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor            # [num_tokens] int64
    num_decodes: int                      # the first rows: one per decoding sequence
    decode_max_context: int
    num_paged_rows: int                   # decodes + chunks on context
    paged_block_tables: torch.Tensor | None   # [num_paged_seqs, max_blocks] int64
    paged_context_lens: torch.Tensor | None   # [num_paged_seqs] int64, keys incl. this step's
    paged_cu_seqlens_q: torch.Tensor | None   # [num_paged_seqs + 1] int64
    prefills: list[PrefillChunk]          # every multi-token chunk, on context or fresh
    # Cached across layers: the decode key mask is the same for every layer.
    decode_mask: torch.Tensor | None = None
    flash: dict | None = None             # varlen arguments, built only for the flash backend


class TorchAttention:
    """Reference backend: plain torch ops over the paged layout; runs on any device."""
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping: torch.Tensor) -> None:
        """Store this step's keys and values at their slots (before anyone attends)."""
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, v)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                kv_written: bool = False) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]. Returns [T, Hq, D]. `kv_written`: k and v are in
        the cache already (the C++ rotary kernel stores them as it rotates)."""
        if not kv_written:
            self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
        for c in meta.prefills:
            out[c.start:c.end] = self._prefill(q[c.start:c.end], k[c.start:c.end], v[c.start:c.end],
                                               k_cache, v_cache, c)
        return out

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        nd, L = meta.num_decodes, meta.decode_max_context
        bt = meta.paged_block_tables[:nd, :-(-L // k_cache.shape[1])]
        # index_select (not advanced indexing: several times faster on CPU) gathers
        # [nd * max_blocks, bs, Hkv, D]; viewed as [nd, Hkv, L, D] without another copy.
        flat = bt.reshape(-1)
        keys = k_cache.index_select(0, flat).view(nd, -1, self.num_kv_heads, self.head_dim)[:, :L].transpose(1, 2)
        values = v_cache.index_select(0, flat).view(nd, -1, self.num_kv_heads, self.head_dim)[:, :L].transpose(1, 2)
        if meta.decode_mask is None:
            pos = torch.arange(L, device=q.device)
            meta.decode_mask = (pos[None, :] < meta.paged_context_lens[:nd, None])[:, None, None, :]
        # GQA without repeating K/V: queries of one KV head form a group of rows.
        qg = q.view(nd, self.num_kv_heads, self.group, self.head_dim)
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=meta.decode_mask, scale=self.scale)
        return o.reshape(nd, self.num_heads, self.head_dim)

    def _prefill(self, q, k, v, k_cache, v_cache, c: PrefillChunk) -> torch.Tensor:
        n = q.shape[0]
        qh = q.transpose(0, 1)                                          # [Hq, n, D]
        if c.num_context == 0:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)         # [Hkv, n, D]
            # With a batch dimension torch picks its fused (flash) CPU kernel, GQA included;
            # 3-D inputs fall back to the unfused math path at about twice the time.
            o = F.scaled_dot_product_attention(qh[None], keys[None], values[None], is_causal=True,
                                               scale=self.scale, enable_gqa=self.group > 1)[0]
        else:
            total = c.num_context + n
            keys = k_cache.index_select(0, c.block_table).flatten(0, 1)[:total].transpose(0, 1)
            values = v_cache.index_select(0, c.block_table).flatten(0, 1)[:total].transpose(0, 1)
            q_pos = torch.arange(c.num_context, total, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=self.scale,
                                               enable_gqa=self.group > 1)
        return o.transpose(0, 1)


class CpuPagedAttention(TorchAttention):
    """The C++ kernel for paged rows (no gather, no padding); SDPA for fresh prefills."""
    name = "cpu"

    def __init__(self, num_heads, num_kv_heads, head_dim, kernel):
        super().__init__(num_heads, num_kv_heads, head_dim)
        self._kernel = kernel

    def forward(self, q, k, v, k_cache, v_cache, meta, kv_written=False):
        if not kv_written:
            self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        npr = meta.num_paged_rows
        if npr == q.shape[0]:        # all rows paged (a decode step): the kernel's output is all
            return self._kernel.paged_attention(q, k_cache, v_cache, meta.paged_cu_seqlens_q,
                                                meta.paged_context_lens, meta.paged_block_tables, self.scale)
        out = torch.empty_like(q)
        if npr:
            out[:npr] = self._kernel.paged_attention(
                q[:npr], k_cache, v_cache, meta.paged_cu_seqlens_q, meta.paged_context_lens,
                meta.paged_block_tables, self.scale)
        for c in meta.prefills:
            if c.num_context == 0:
                out[c.start:c.end] = self._prefill(q[c.start:c.end], k[c.start:c.end], v[c.start:c.end],
                                                   k_cache, v_cache, c)
        return out


class FlashAttention(TorchAttention):
    """CUDA sm80+ backend over vllm-flash-attn / flash-attn's paged varlen kernel.

    One kernel call covers decodes and prefill chunks alike: cu_seqlens_q delimits each
    sequence's queries, seqused_k its context, block_table its pages.
    """
    name = "flash"

    def __init__(self, num_heads, num_kv_heads, head_dim, varlen_fn):
        super().__init__(num_heads, num_kv_heads, head_dim)
        self._varlen = varlen_fn

    def forward(self, q, k, v, k_cache, v_cache, meta, kv_written=False):
        if not kv_written:
            self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        fa = meta.flash
        return self._varlen(q=q, k=k_cache, v=v_cache, cu_seqlens_q=fa["cu_seqlens_q"],
                            max_seqlen_q=fa["max_seqlen_q"], seqused_k=fa["seqused_k"],
                            max_seqlen_k=fa["max_seqlen_k"], softmax_scale=self.scale,
                            causal=True, block_table=fa["block_table"])


def select_backend(requested: str, device: torch.device, dtype: torch.dtype, num_heads: int,
                   num_kv_heads: int, head_dim: int) -> TorchAttention:
    """`auto`: flash on CUDA sm80+ when a flash-attn build imports; the C++ kernel on CPU in
    fp32 when it builds; else the torch reference."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {requested!r}")
    args = (num_heads, num_kv_heads, head_dim)
    if requested == "torch":
        return TorchAttention(*args)
    if device.type == "cpu":
        if requested == "flash":
            raise ValueError("the flash attention backend needs a CUDA device")
        from workers import cpu_kernels
        kernel = cpu_kernels.load() if dtype == torch.float32 else None
        if kernel is not None:
            return CpuPagedAttention(*args, kernel)
        if requested == "cpu":
            raise ValueError("the cpu attention backend needs float32 and a C++ compiler to build its kernel")
        return TorchAttention(*args)
    if requested == "cpu":
        raise ValueError("the cpu attention backend runs on the CPU device only")
    varlen = _import_flash_varlen() if torch.cuda.get_device_capability(device)[0] >= 8 else None
    if varlen is None:
        if requested == "flash":
            raise ValueError("flash attention requested but neither vllm_flash_attn nor flash_attn "
                             "imports (or the GPU is older than sm80); install the 'flash' extra")
        return TorchAttention(*args)
    return FlashAttention(*args, varlen)


def _import_flash_varlen():
    try:
        from vllm_flash_attn import flash_attn_varlen_func
        return flash_attn_varlen_func
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_varlen_func
        return flash_attn_varlen_func
    except ImportError:
        return None
