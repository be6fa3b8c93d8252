"""Tensors for one worker: the preallocated KV cache, batch preparation, forward, sampling."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from workers.attention import AttentionMetadata, PrefillChunk, select_backend
from workers.model import LlamaForCausalLM
from workers.sampler import SampledToken, sample
from workers.scheduler import SchedulerOutput
from workers.sequence import Sequence

log = logging.getLogger("pdcluster.runner")


@dataclass(slots=True)
class StepTimes:
    prepare_s: float = 0.0
    model_s: float = 0.0
    sample_s: float = 0.0


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, num_host_blocks: int,
                 device: torch.device, dtype: torch.dtype, attention_backend: str = "auto"):
        cfg = model.config
        self.model, self.device, self.dtype = model, device, dtype
        self.block_size = block_size
        self.backend = select_backend(attention_backend, device, dtype, cfg.num_attention_heads,
                                      cfg.num_key_value_heads, cfg.head_dim)
        model.set_attention_backend(self.backend)
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # Allocated once; the hot path only indexes into these.
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(cfg.num_hidden_layers)]
        host_shape = (num_host_blocks, *shape[1:])
        pin = device.type == "cuda"
        self.host_caches = [(torch.zeros(host_shape, dtype=dtype, pin_memory=pin),
                             torch.zeros(host_shape, dtype=dtype, pin_memory=pin))
                            for _ in range(cfg.num_hidden_layers)] if num_host_blocks else []
        self.last_times = StepTimes()

    # -- swapping ------------------------------------------------------------------------------
    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        if swap_out:
            dev = torch.tensor([d for d, _ in swap_out], device=self.device)
            host = torch.tensor([h for _, h in swap_out])
            for (k, v), (hk, hv) in zip(self.kv_caches, self.host_caches):
                hk[host] = k[dev].to("cpu")
                hv[host] = v[dev].to("cpu")
        if swap_in:
            host = torch.tensor([h for h, _ in swap_in])
            dev = torch.tensor([d for _, d in swap_in], device=self.device)
            for (k, v), (hk, hv) in zip(self.kv_caches, self.host_caches):
                k[dev] = hk[host].to(self.device, non_blocking=True)
                v[dev] = hv[host].to(self.device, non_blocking=True)

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> dict[str, SampledToken]:
        """Run the scheduled tokens; returns a sampled token for each sequence whose scheduled
        chunk reaches its last token (partial prefill chunks sample nothing)."""
        t0 = time.perf_counter()
        self.swap(out.swap_out, out.swap_in)
        input_ids, positions, meta, sample_rows, sample_seqs = self._prepare(out, block_tables)
        t1 = time.perf_counter()
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        logits = self.model.compute_logits(hidden[sample_rows]) if sample_seqs else None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        tokens = sample(logits, sample_seqs) if sample_seqs else []
        t3 = time.perf_counter()
        self.last_times = StepTimes(t1 - t0, t2 - t1, t3 - t2)
        return {s.seq_id: t for s, t in zip(sample_seqs, tokens)}

    def _prepare(self, out: SchedulerOutput, block_tables: dict[str, list[int]]):
        """Flatten the step into rows: decodes, then chunks on cached context (together the
        paged rows), then fresh prefills. See attention.py for the layout."""
        bs = self.block_size
        decodes, on_context, fresh = [], [], []
        for s, n in out.scheduled:
            (decodes if n == 1 else on_context if s.num_computed_tokens else fresh).append((s, n))
        seqs = [s for s, _ in decodes]
        # Decodes (the common rows) in comprehensions: one token each at position num_computed.
        positions = [s.num_computed_tokens for s in seqs]
        paged_tables = [block_tables[s.seq_id] for s in seqs]
        input_ids = [s.token_ids[p] for s, p in zip(seqs, positions)]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(paged_tables, positions)]
        context_lens = [p + 1 for p in positions]
        cu_q = list(range(len(seqs) + 1))
        sample_rows = [i for i, (s, p) in enumerate(zip(seqs, context_lens)) if p == s.num_tokens]
        sample_seqs = [seqs[i] for i in sample_rows]
        chunks: list[tuple[int, int, int, int]] = []       # (row0, n, num_context, paged index)
        for s, n in on_context + fresh:
            start = s.num_computed_tokens
            table = block_tables[s.seq_id]
            row0 = len(input_ids)
            input_ids.extend(s.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            chunks.append((row0, n, start, len(paged_tables) if start else -1))
            if start:
                paged_tables.append(table)
                context_lens.append(start + n)
                cu_q.append(cu_q[-1] + n)
            if start + n == s.num_tokens:
                sample_rows.append(row0 + n - 1)
                sample_seqs.append(s)

        dev = self.device
        nd = len(decodes)
        bt = lens = cu = None
        if paged_tables:
            width = max(map(len, paged_tables))
            flat: list[int] = []                  # one flat list: torch.tensor on nested lists is slow
            pad = [0] * width
            for t in paged_tables:
                flat += t
                flat += pad[:width - len(t)]
            bt = torch.tensor(flat, dtype=torch.long, device=dev).view(len(paged_tables), width)
            lens = torch.tensor(context_lens, dtype=torch.long, device=dev)
            cu = torch.tensor(cu_q, dtype=torch.long, device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=nd, decode_max_context=max(context_lens[:nd], default=0),
            num_paged_rows=cu_q[-1], paged_block_tables=bt, paged_context_lens=lens, paged_cu_seqlens_q=cu,
            prefills=[PrefillChunk(r, r + n, c, bt[i] if i >= 0 else None) for r, n, c, i in chunks])
        if self.backend.name == "flash":
            meta.flash = self._flash_args(block_tables, decodes + on_context + fresh)
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev),
                meta, torch.tensor(sample_rows, dtype=torch.long, device=dev), sample_seqs)

    def _flash_args(self, block_tables, seqs) -> dict:
        """Varlen arguments over all rows (seqs in row order)."""
        q_lens = [n for _, n in seqs]
        k_lens = [s.num_computed_tokens + n for s, n in seqs]
        width = max(len(block_tables[s.seq_id]) for s, _ in seqs)
        bt = [block_tables[s.seq_id] + [0] * (width - len(block_tables[s.seq_id])) for s, _ in seqs]
        cu_q = [0]
        for n in q_lens:
            cu_q.append(cu_q[-1] + n)
        dev = self.device
        return {"cu_seqlens_q": torch.tensor(cu_q, dtype=torch.int32, device=dev),
                "max_seqlen_q": max(q_lens),
                "seqused_k": torch.tensor(k_lens, dtype=torch.int32, device=dev),
                "max_seqlen_k": max(k_lens),
                "block_table": torch.tensor(bt, dtype=torch.int32, device=dev)}
