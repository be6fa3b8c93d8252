"""Which torch device and dtype a config names (`auto` resolved on this machine)."""
from __future__ import annotations

import torch

from workers.config import canonical_dtype


def resolve_device(name: str) -> torch.device:
    """`auto`: CUDA when torch sees a GPU, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "no GPU is visible"
        raise ValueError(f"--device {name}: {why}; use --device auto or cpu")
    return device


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """`auto`: bf16 on CUDA, fp32 on CPU (bf16 matmul on CPU is 50-100x slower than fp32)."""
    if name == "auto":
        return torch.bfloat16 if resolve_device(device).type == "cuda" else torch.float32
    return getattr(torch, canonical_dtype(name))
