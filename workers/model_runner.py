"""Tensors for one worker: the preallocated KV cache, batch preparation, forward, sampling."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from workers import cpu_kernels
from workers.attention import AttentionMetadata, PrefillChunk, select_backend
from workers.kv_shm import SharedKVCache
from workers.model import LlamaForCausalLM
from workers.sampler import SampledTokens, sample
from workers.scheduler import SchedulerOutput
from workers.sequence import Sequence

log = logging.getLogger("pdcluster.runner")


@dataclass(slots=True)
class StepInputs:
    """What every rank needs to run one step on its slice: the cache operations first, then the
    forward pass (input ids, positions, attention metadata); rank 0 broadcasts it to the others
    (workers/tensor_parallel.py)."""
    copies: list
    swap_out: list
    swap_in: list
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: object


@dataclass(slots=True)
class StepTimes:
    prepare_s: float = 0.0
    model_s: float = 0.0
    sample_s: float = 0.0


class BlockTableBuffer:
    """The paged rows' block tables, in one host array kept from step to step.

    Rebuilding a [rows, max_blocks] table from Python lists every step is slow (torch.tensor
    over 64 x 16 ids: ~0.14 ms on the 2-core box, a seventh of the whole per-step budget). But
    a running sequence mostly keeps its row from one step to the next, and its table only grows
    (a block every `block_size` tokens), so only what changed is written. A row remembers the list it was copied from: the KV cache
    manager's live table, which only grows while the sequence holds its blocks (allocation and
    swap-in give it a new list). The same list, no shorter than what was copied: only the tail
    is new; anything else: the row is rewritten. Past its table's end a row holds zeros.
    """

    def __init__(self):
        self._rows = np.zeros((0, 0), dtype=np.int64)
        self._sources: list[list[int] | None] = []   # the list each row was copied from
        self._lens: list[int] = []                   # how much of it

    def update(self, tables: list[list[int]]) -> np.ndarray:
        """The tables as the buffer's first len(tables) rows, [n, width >= longest table]
        (a view: valid until the next update)."""
        n = len(tables)
        width = max(map(len, tables))
        if n > self._rows.shape[0] or width > self._rows.shape[1]:
            self._grow(n, width)
        rows, sources, lens = self._rows, self._sources, self._lens
        for i, table in enumerate(tables):
            done = lens[i]
            if sources[i] is not table or len(table) < done:
                rows[i, :len(table)] = table
                rows[i, len(table):done] = 0
                sources[i], lens[i] = table, len(table)
            elif done < len(table):
                rows[i, done:len(table)] = table[done:]
                lens[i] = len(table)
        return rows[:n]

    def _grow(self, n: int, width: int) -> None:
        old = self._rows
        self._rows = np.zeros((max(n, 2 * old.shape[0]), max(width, 2 * old.shape[1])), dtype=np.int64)
        self._rows[:old.shape[0], :old.shape[1]] = old
        extra = self._rows.shape[0] - old.shape[0]
        self._sources += [None] * extra
        self._lens += [0] * extra


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, num_host_blocks: int,
                 device: torch.device, dtype: torch.dtype, attention_backend: str = "auto",
                 shared_memory: bool = False):
        cfg, attn = model.config, model.model.layers[0].self_attn
        self.model, self.device, self.dtype = model, device, dtype
        self.eos_token_ids: tuple[int, ...] = ()     # the model's (the engine sets them): min_tokens holds them back
        self.block_size = block_size
        self.tp = None          # rank 0 of a tensor-parallel worker: its TPGroup (the others run `run`)
        # This rank's heads (all of them without tensor parallelism).
        self.backend = select_backend(attention_backend, device, dtype, attn.num_heads, attn.num_kv_heads, cfg.head_dim)
        model.set_attention_backend(self.backend)
        model.set_cpu_kernels(cpu_kernels.for_model(device, dtype))
        shape = (num_blocks, block_size, attn.num_kv_heads, cfg.head_dim)
        # Allocated once; the hot path only indexes into these. In shared memory when asked (CPU):
        # a same-node peer then copies handed-off blocks straight out of it (workers/kv_shm.py).
        self.shared_kv = SharedKVCache(cfg.num_hidden_layers, shape, dtype, attn.shard.rank * attn.num_kv_heads) \
            if shared_memory and device.type == "cpu" else None
        self.kv_caches = self.shared_kv.kv_caches if self.shared_kv else [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_hidden_layers)]
        host_shape = (num_host_blocks, *shape[1:])
        pin = device.type == "cuda"
        self.host_caches = [(torch.zeros(host_shape, dtype=dtype, pin_memory=pin),
                             torch.zeros(host_shape, dtype=dtype, pin_memory=pin))
                            for _ in range(cfg.num_hidden_layers)] if num_host_blocks else []
        self.last_times = StepTimes()
        self._block_tables = BlockTableBuffer()
        # The last step's prompt logprobs: (sequence, first prompt position, [{"logprob", "top"}]).
        self.last_prompt_logprobs: list[tuple[Sequence, int, list[dict]]] = []

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

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy blocks' KV within the device cache ((source, destination) pairs): a fork's tail."""
        src = torch.tensor([a for a, _ in pairs], device=self.device)
        dst = torch.tensor([b for _, b in pairs], device=self.device)
        for k, v in self.kv_caches:
            k[dst] = k[src]
            v[dst] = v[src]

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: list[list[int]]) -> tuple[list[Sequence], SampledTokens]:
        """Run the scheduled tokens (`block_tables[i]` is the table of `out.scheduled[i]`).
        Returns the sequences whose scheduled chunk reaches their last token (partial prefill
        chunks sample nothing), decoding rows first, and a token for each."""
        t0 = time.perf_counter()
        input_ids, positions, meta, sample_rows, sample_seqs, prompt_rows = self._prepare(out, block_tables)
        step = StepInputs(out.copies, out.swap_out, out.swap_in, input_ids, positions, meta)
        if self.tp is not None:      # the other ranks run the same step on their slices
            self.tp.send(step)
        t1 = time.perf_counter()
        hidden = self.run(step)
        logits = self.model.compute_logits(hidden[sample_rows]) if sample_seqs else None
        self.last_prompt_logprobs = self._prompt_logprobs(prompt_rows, hidden) if prompt_rows else []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        sampled = sample(logits, sample_seqs, self.eos_token_ids) if sample_seqs else SampledTokens([])
        t3 = time.perf_counter()
        self.last_times = StepTimes(t1 - t0, t2 - t1, t3 - t2)
        return sample_seqs, sampled

    def run(self, step: StepInputs) -> torch.Tensor:
        """The step's cache operations, then the forward pass: hidden states, a row per token."""
        if step.copies:              # first: a swap may reuse a copy's source block this step
            self.copy_blocks(step.copies)
        self.swap(step.swap_out, step.swap_in)
        return self.model(step.input_ids, step.positions, self.kv_caches, step.meta)

    PROMPT_LOGITS_ROWS = 256        # rows of prompt logits at a time (rows x vocabulary floats)

    def _prompt_logprobs(self, rows: list[tuple[Sequence, int, int, int]], hidden: torch.Tensor
                         ) -> list[tuple[Sequence, int, list[dict]]]:
        """For each sequence that asked for its prompt's logprobs, those of the prompt tokens this
        step's rows predict (`rows`, found by `_prepare`: sequence, first row, its position,
        count): the row at position p gives token p + 1's logprob (and the top ones)."""
        result = []
        for s, row0, start, count in rows:
            k = s.params.prompt_logprobs
            targets = torch.tensor(s.token_ids[start + 1:start + 1 + count], device=hidden.device)
            got: list[dict] = []
            for a in range(0, count, self.PROMPT_LOGITS_ROWS):
                b = min(count, a + self.PROMPT_LOGITS_ROWS)
                lps = torch.log_softmax(self.model.compute_logits(hidden[row0 + a:row0 + b]), dim=-1)
                own = lps.gather(1, targets[a:b, None])[:, 0].tolist()
                if k:
                    vals, idx = lps.topk(k, dim=-1)
                    tops = [dict(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
                else:
                    tops = [{} for _ in own]
                got += [{"logprob": lp, "top": top} for lp, top in zip(own, tops)]
            result.append((s, start, got))
        return result

    def _prepare(self, out: SchedulerOutput, block_tables: list[list[int]]):
        """Flatten the step into rows: decodes, then chunks on cached context (together the
        paged rows), then fresh prefills. See attention.py for the layout."""
        bs = self.block_size
        seqs, paged_tables = [], []                  # decoding rows, and their tables
        on_context, fresh = [], []                   # (seq, n, table) of multi-token chunks
        prompt_rows = []                             # (seq, row, first position, count): see _prompt_logprobs
        for (s, n), table in zip(out.scheduled, block_tables):
            if n == 1:
                if s.prompt_logprobs is not None and s.num_computed_tokens + 1 < s.num_prompt_tokens:
                    prompt_rows.append((s, len(seqs), s.num_computed_tokens, 1))
                seqs.append(s)
                paged_tables.append(table)
            else:
                (on_context if s.num_computed_tokens else fresh).append((s, n, table))
        # Decodes (the common rows) in comprehensions: one token each at position num_computed.
        positions = [s.num_computed_tokens for s in seqs]
        input_ids = [s.token_ids[p] for s, p in zip(seqs, positions)]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(paged_tables, positions)]
        context_lens = [p + 1 for p in positions]
        cu_q = list(range(len(seqs) + 1))
        sample_rows = [i for i, (s, p) in enumerate(zip(seqs, context_lens)) if p == s.num_tokens]
        sample_seqs = [seqs[i] for i in sample_rows]
        chunks: list[tuple[int, int, int, int]] = []       # (row0, n, num_context, paged index)
        for s, n, table in on_context + fresh:
            start = s.num_computed_tokens
            row0 = len(input_ids)
            input_ids.extend(s.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            chunks.append((row0, n, start, len(paged_tables) if start else -1))
            if s.prompt_logprobs is not None and start + 1 < s.num_prompt_tokens:
                prompt_rows.append((s, row0, start, min(start + n, s.num_prompt_tokens - 1) - start))
            if start:
                paged_tables.append(table)
                context_lens.append(start + n)
                cu_q.append(cu_q[-1] + n)
            if start + n == s.num_tokens:
                sample_rows.append(row0 + n - 1)
                sample_seqs.append(s)

        nd = len(seqs)
        input_ids, positions, slots, lens, cu, sample_rows = self._int64_tensors(
            input_ids, positions, slots, context_lens, cu_q, sample_rows)
        bt = None
        if paged_tables:
            bt = torch.from_numpy(self._block_tables.update(paged_tables)).to(self.device)
        else:
            lens = cu = None
        meta = AttentionMetadata(
            slot_mapping=slots, num_decodes=nd, decode_max_context=max(context_lens[:nd], default=0),
            num_paged_rows=cu_q[-1], paged_block_tables=bt, paged_context_lens=lens, paged_cu_seqlens_q=cu,
            prefills=[PrefillChunk(r, r + n, c, bt[i, :-(-(c + n) // bs)] if i >= 0 else None)
                      for r, n, c, i in chunks])
        if self.backend.name == "flash":
            meta.flash = self._flash_args([(s, 1, t) for s, t in zip(seqs, paged_tables)] + on_context + fresh)
        return input_ids, positions, meta, sample_rows, sample_seqs, prompt_rows

    def _int64_tensors(self, *lists: list[int]) -> tuple[torch.Tensor, ...]:
        """The lists as int64 tensors on the device, through one host array and one copy:
        torch.tensor on a Python list is slow (six of 64 ints: ~0.1 ms on the 2-core box; one
        fromiter over all of them and views: ~0.03 ms), and on a GPU each tensor would be a
        transfer of its own."""
        flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=sum(map(len, lists)))
        return torch.from_numpy(flat).to(self.device).split_with_sizes([len(x) for x in lists])

    def _flash_args(self, rows: list[tuple[Sequence, int, list[int]]]) -> dict:
        """Varlen arguments over all rows ((seq, num_tokens, block table) in row order)."""
        q_lens = [n for _, n, _ in rows]
        k_lens = [s.num_computed_tokens + n for s, n, _ in rows]
        width = max(len(t) for _, _, t in rows)
        bt = [t + [0] * (width - len(t)) for _, _, t in rows]
        cu_q = [0]
        for n in q_lens:
            cu_q.append(cu_q[-1] + n)
        dev = self.device
        return {"cu_seqlens_q": torch.tensor(cu_q, dtype=torch.int32, device=dev),
                "max_seqlen_q": max(q_lens),
                "seqused_k": torch.tensor(k_lens, dtype=torch.int32, device=dev),
                "max_seqlen_k": max(k_lens),
                "block_table": torch.tensor(bt, dtype=torch.int32, device=dev)}
