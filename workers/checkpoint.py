"""Model sources: the built-in models and Hugging Face checkpoints (config.json + safetensors).

Built-ins (`tiny`, `small`) are Llama-architecture models with fixed-seed random weights and a
byte-level tokenizer, so everything runs offline; `export_builtin` writes one as a standard HF
checkpoint that transformers' AutoModelForCausalLM / AutoTokenizer load.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from workers.config import ModelConfig
from workers.model import LlamaForCausalLM, RotaryEmbedding, Shard
from workers.tokenizer import Tokenizer, byte_level_tokenizer

BUILTIN_MODELS = {
    # ~3.2M parameters: runs anywhere in a blink; tied embeddings, GQA 8:4.
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=True),
    # ~100M parameters: for benchmarks; untied embeddings, GQA 12:4.
    "small": dict(hidden_size=768, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=False),
}
_WEIGHT_SEED = 1234


def is_builtin(name: str) -> bool:
    return name in BUILTIN_MODELS


def builtin_config(name: str) -> ModelConfig:
    tok = byte_level_tokenizer()
    return ModelConfig(vocab_size=tok.vocab_size, rope_theta=10000.0, rms_norm_eps=1e-6,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       **BUILTIN_MODELS[name])


def _builtin_weights(model: LlamaForCausalLM) -> None:
    """Fixed-seed random weights, drawn per HF parameter name in sorted order. Embeddings are
    small and the blocks' output projections large, so the residual stream is dominated by
    attention and MLP: greedy outputs depend on the whole context (not just the last token),
    which is what makes KV-cache tests bite."""
    gen = torch.Generator().manual_seed(_WEIGHT_SEED)

    def draw(name, shape):
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        if "embed_tokens" in name or name == "lm_head.weight":
            return torch.randn(shape, generator=gen) * 0.1
        gain = 4.0 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
        return torch.randn(shape, generator=gen) * gain / shape[-1] ** 0.5

    model.load_hf_weights((name, draw(name, shape)) for name, shape in sorted(model.hf_shapes().items()))


def load_tokenizer(source: str) -> Tokenizer | None:
    """The tokenizer alone (the router needs no weights)."""
    if is_builtin(source):
        return byte_level_tokenizer()
    path = checkpoint_dir(source)
    return Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None


def model_config(source: str) -> ModelConfig:
    """The model's shape alone (no weights read)."""
    if is_builtin(source):
        return builtin_config(source)
    return ModelConfig.from_dir(checkpoint_dir(source))


def checkpoint_dir(source: str) -> Path:
    """A checkpoint directory's path; FileNotFoundError naming the choices when it is not one."""
    path = Path(source)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {source!r} is neither a built-in ({', '.join(BUILTIN_MODELS)}) nor a directory "
            "with a Hugging Face config.json")
    return path


def load_model(source: str, dtype: torch.dtype, device: torch.device, shard: Shard | None = None
               ) -> tuple[LlamaForCausalLM, Tokenizer | None]:
    """Built-in name or checkpoint directory -> (model on device in dtype, tokenizer or None);
    with a shard, that tensor-parallel rank's slice of the model."""
    if is_builtin(source):
        cfg = builtin_config(source)
        model = LlamaForCausalLM(cfg, shard)
        _builtin_weights(model)
        tokenizer = byte_level_tokenizer()
    else:
        path = checkpoint_dir(source)
        cfg = ModelConfig.from_dir(path)
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, shard)
        model.to_empty(device="cpu")
        model.tie_weights()                      # to_empty gives each module its own tensors
        # Buffers are computed, not loaded: rebuild them off the meta device.
        model.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        _load_safetensors(model, path)
        tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def _load_safetensors(model: LlamaForCausalLM, path: Path) -> None:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    loaded = set()
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            try:
                loaded |= model.load_hf_weights((key, st.get_tensor(key)) for key in st.keys())
            except ValueError as e:
                raise ValueError(f"{f.name}: {e}") from None
    missing = sorted(set(model.hf_shapes()) - loaded)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} weights, e.g. {missing[:3]}")


def export_builtin(name: str, out_dir: str | Path) -> Path:
    """Write a built-in model as a Hugging Face checkpoint directory."""
    if not is_builtin(name):
        raise ValueError(f"unknown built-in model {name!r}; choose one of {', '.join(BUILTIN_MODELS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(name, torch.float32, torch.device("cpu"))
    # Tied embeddings have no lm_head entry (safetensors stores no aliases; HF re-ties them).
    state = {k: v.contiguous() for k, v in model.hf_state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": model.config.bos_token_id, "eos_token_id": model.config.eos_token_id}, indent=2))
    tokenizer.save(out)
    return out
