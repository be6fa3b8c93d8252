"""One worker's engine: scheduler + KV cache manager + model runner, stepped in a loop.

    engine = LLMEngine(EngineConfig(model="tiny"))
    results = engine.generate([{"prompt": "Hello"}], SamplingParams(temperature=0, max_tokens=8))
"""
from __future__ import annotations

import logging

import torch

from workers.checkpoint import load_model, model_config
from workers.config import EngineConfig
from workers.device import resolve_device, resolve_dtype
from workers.engine_core import EngineCore, KVCacheLayout
from workers.model import Shard, check_shardable
from workers.model_runner import ModelRunner
from workers.scheduler import PreemptionCostModel, SchedulerOutput
from workers.sequence import Sequence

log = logging.getLogger("pdcluster.engine")


class LLMEngine(EngineCore):
    """EngineCore executing on the model: loads the weights, sizes the KV cache, runs the runner."""

    def __init__(self, cfg: EngineConfig | None = None, placement=None):
        """`placement`: a tensor-parallel worker's Ray placement group (this rank in bundle 0,
        the others in the next ones); None: the other ranks get a group of their own."""
        self.cfg = cfg = cfg or EngineConfig()
        torch.manual_seed(cfg.seed)
        self.device, self.dtype = resolve_device(cfg.device), resolve_dtype(cfg.dtype, cfg.device)
        mcfg = self.model_config = model_config(cfg.model)
        tp = cfg.tensor_parallel_size
        check_shardable(mcfg, tp)
        cc = cfg.cache
        bytes_per_token = mcfg.kv_bytes_per_token(str(self.dtype).removeprefix("torch."))
        block_bytes = bytes_per_token * cc.block_size
        # The memory budget is each rank's: a rank holds 1/tp of every block.
        num_blocks = cc.num_blocks or max(1, cc.kv_cache_memory_bytes * tp // block_bytes)
        num_host = cc.swap_space_bytes * tp // block_bytes
        layout = KVCacheLayout(bytes_per_token, cc.block_size, num_blocks, num_host)
        limit = cfg.max_model_len or mcfg.max_position_embeddings
        if limit > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len={limit} exceeds the model's max_position_embeddings="
                             f"{mcfg.max_position_embeddings}")
        # One sequence must always fit on its own, or it could never be scheduled.
        max_model_len = min(limit, layout.max_resident_tokens)
        if max_model_len < limit:
            log.warning("max_model_len lowered from %d to %d: the KV cache holds no more", limit, max_model_len)
        self.ranks = None
        if tp > 1:                     # the other ranks load their slices while this one loads its own
            from workers.tensor_parallel import RankGroup
            self.ranks = RankGroup(cfg, tp, num_blocks, num_host, placement)
        try:
            self._load(cfg, tp, num_blocks, num_host, layout, max_model_len)
        except BaseException:
            self.close()
            raise

    def _load(self, cfg: EngineConfig, tp: int, num_blocks: int, num_host: int, layout: KVCacheLayout,
              max_model_len: int) -> None:
        mcfg, cc = self.model_config, cfg.cache
        self.model, tokenizer = load_model(cfg.model, self.dtype, self.device,
                                           Shard(0, tp, self.ranks.all_reduce if self.ranks else None))
        cost = PreemptionCostModel(
            kv_bytes_per_token=layout.bytes_per_token, num_params=mcfg.num_params(),
            attn_flops_per_token_pair=4 * mcfg.num_hidden_layers * mcfg.num_attention_heads * mcfg.head_dim,
            num_layers=mcfg.num_hidden_layers)
        super().__init__(cfg.scheduler, layout, max_model_len, mcfg.vocab_size, cc.enable_prefix_caching,
                         mcfg.eos_token_ids, tokenizer, cost)
        self.runner = ModelRunner(self.model, num_blocks, cc.block_size, num_host, self.device, self.dtype,
                                  cfg.attention_backend, cc.shared_memory)
        self.runner.tp = self.ranks.join() if self.ranks else None
        self.runner.eos_token_ids = tuple(sorted(self.eos_token_ids))   # what min_tokens holds back
        if self.runner.shared_kv is not None:       # same-node peers check blocks by allocation count
            self.kv.pool.on_allocate = self.runner.shared_kv.bump
        log.info("model %s: %.1fM params, %s on %s, attention backend %s", cfg.model,
                 mcfg.num_params() / 1e6, str(self.dtype).removeprefix("torch."), self.device,
                 self.runner.backend.name)
        log.info(self.layout.describe(min(1024, self.max_model_len)))

    def close(self) -> None:
        """End the other tensor-parallel ranks (nothing to do without them)."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    def _execute(self, out: SchedulerOutput) -> tuple[list[Sequence], list[int], list | None]:
        seqs, sampled = self.runner.execute(out, [self.kv.block_ids(s) for s, _ in out.scheduled])
        for seq, start, lps in self.runner.last_prompt_logprobs:
            have = seq.prompt_logprobs              # a recomputed prompt (a preemption) adds nothing new
            have += lps[len(have) - start:] if start <= len(have) else []
        return seqs, sampled.token_ids, sampled.logprobs

    def tokenize(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        if prompt is not None and self.tokenizer is None:
            raise ValueError(f"model {self.cfg.model!r} has no tokenizer.json: send prompt_token_ids")
        return super().tokenize(prompt, prompt_token_ids)
