"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""
from __future__ import annotations

from typing import NamedTuple

import torch

from workers.sequence import Sequence, position_seed


class SampledTokens(NamedTuple):
    """One step's draws, row by row: a batch rather than an object per token (it runs every step)."""
    token_ids: list[int]
    logprobs: list[dict | None] | None = None   # per row {"logprob": float, "top": {token_id: logprob}}
    #                                              (None for a row that did not ask); None if none did


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> SampledTokens:
    """logits: [len(seqs), vocab] float32, one row per sequence that needs a token."""
    if all(s.params.greedy for s in seqs):
        token_ids = logits.argmax(dim=-1)
    else:
        token_ids = _sample_random(logits, seqs)
    ids = token_ids.tolist()
    if all(s.params.logprobs is None for s in seqs):
        return SampledTokens(ids)
    logprobs = torch.log_softmax(logits, dim=-1)
    out = []
    for row, (s, t) in enumerate(zip(seqs, ids)):
        if s.params.logprobs is None:
            out.append(None)
            continue
        top = {}
        if s.params.logprobs:
            vals, idx = logprobs[row].topk(s.params.logprobs)
            top = dict(zip(idx.tolist(), vals.tolist()))
        out.append({"logprob": logprobs[row, t].item(), "top": top})
    return SampledTokens(ids, out)


def _sample_random(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    greedy = logits.argmax(dim=-1)
    temps = torch.tensor([s.params.temperature or 1.0 for s in seqs], device=logits.device)
    scaled = logits / temps[:, None]
    if any(s.params.top_k > 0 for s in seqs):
        scaled = _apply_top_k(scaled, [s.params.top_k for s in seqs])
    if any(s.params.top_p < 1.0 for s in seqs):
        scaled = _apply_top_p(scaled, torch.tensor([s.params.top_p for s in seqs], device=logits.device))
    probs = torch.softmax(scaled, dim=-1)
    # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race); one draw per row.
    noise = torch.empty_like(probs).exponential_()
    for row, s in enumerate(seqs):
        if s.params.seed is not None:
            # The stream of a seeded request is a function of (seed, output position) alone, so
            # a request continues the same on another worker (a handoff, a resume after a fault).
            if s.generator is None:
                s.generator = torch.Generator(device=logits.device)
            s.generator.manual_seed(position_seed(s.params.seed, s.num_output_tokens))
            noise[row].exponential_(generator=s.generator)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([s.params.greedy for s in seqs], device=logits.device)
    return torch.where(is_greedy, greedy, sampled)


def _apply_top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = torch.tensor([k if 0 < k < vocab else vocab for k in ks], device=logits.device)
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop a token when the mass before it already reaches p (the top token always stays).
    drop = (cum - sorted_logits.softmax(dim=-1)) >= ps[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
