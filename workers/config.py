"""Configuration of one worker engine: the model's shape, the KV cache and the scheduler."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workers.names import ATTENTION_BACKENDS, PREEMPTION_MODES, SCHEDULING_POLICIES

# dtype name (and its short alias) -> (canonical name, bytes per element). Plain names here:
# the torch dtype is resolved where torch lives (workers/engine.py).
DTYPES = {"float32": ("float32", 4), "fp32": ("float32", 4), "float16": ("float16", 2),
          "fp16": ("float16", 2), "bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2)}


def canonical_dtype(name: str) -> str:
    """'bf16' -> 'bfloat16'; an unknown name is a ValueError naming the choices."""
    try:
        return DTYPES[name][0]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use auto or one of {sorted(DTYPES)}") from None


@dataclass(slots=True)
class ModelConfig:
    """The subset of a Hugging Face Llama/Qwen2/Mistral config.json the engine needs."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False        # Qwen2 has biases on q/k/v
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    model_type: str = "llama"

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        if eos is None:
            return []
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]

    def num_params(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return L * per_layer + emb + h

    def kv_bytes_per_token(self, dtype: str) -> int:
        """K and V of one token over all layers, in the cache dtype (a DTYPES name)."""
        elem = DTYPES[dtype][1]
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elem

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        arch = d.get("model_type", "llama")
        if arch not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"unsupported model_type {arch!r}: pdcluster serves llama, qwen2 and mistral")
        rope_theta = d.get("rope_theta")
        if rope_theta is None:
            rope_theta = (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        scaling = d.get("rope_scaling") or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        if rope_type not in ("default", None):
            raise ValueError(f"rope scaling {rope_type!r} is not supported yet")
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or 0, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", arch == "qwen2"),
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
            model_type=arch)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf_dict(json.loads((Path(path) / "config.json").read_text()))

    def to_hf_dict(self) -> dict:
        d = asdict(self)
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        d["architectures"] = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                               "mistral": "MistralForCausalLM"}[self.model_type]]
        d["hidden_act"] = "silu"
        d["torch_dtype"] = "float32"
        return d


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache: fixed-size blocks, their number set by a memory budget or given."""
    block_size: int = 16
    kv_cache_memory_bytes: int = 256 * 2**20
    num_blocks: int | None = None            # overrides the memory budget when set
    swap_space_bytes: int = 256 * 2**20      # host memory for swapped-out blocks
    enable_prefix_caching: bool = True
    shared_memory: bool = False              # CPU: the cache in a memfd, so same-node peers copy out of it

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048       # the per-step token budget
    max_num_seqs: int = 128                  # cap on running sequences
    watermark: float = 0.01                  # fraction of blocks kept free at admission
    preemption_mode: str = "auto"            # one of PREEMPTION_MODES
    policy: str = "fcfs"                     # one of SCHEDULING_POLICIES
    chunked_prefill: bool = True             # False: prompts whole, in steps of their own
    priority_inheritance: bool = True        # priority: see workers/scheduler.py
    prefill_s_per_token: float = 1e-4        # deadline: the first estimate, then measured

    def __post_init__(self):
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        if not self.prefill_s_per_token > 0:
            raise ValueError(f"prefill_s_per_token must be > 0, got {self.prefill_s_per_token}")


@dataclass(slots=True)
class EngineConfig:
    model: str = "tiny"                      # built-in name or a checkpoint directory
    dtype: str = "auto"                      # auto: fp32 on CPU, bf16 on CUDA
    device: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    attention_backend: str = "auto"          # one of ATTENTION_BACKENDS
    tensor_parallel_size: int = 1            # ranks the model is split over (workers/tensor_parallel.py)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_dict(cls, d: dict) -> EngineConfig:
        """Fields as keyword values, `cache` and `scheduler` as dicts of theirs; the rest default."""
        d = dict(d)
        return cls(cache=CacheConfig(**d.pop("cache", {})), scheduler=SchedulerConfig(**d.pop("scheduler", {})), **d)

    def __post_init__(self):
        if self.dtype != "auto":
            canonical_dtype(self.dtype)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
