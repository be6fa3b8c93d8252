"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs;
before them the logits are shaped (`shape_logits`): a structured output's grammar mask, min_tokens,
bad_words, logit_bias, then the repetition, frequency and presence penalties, in vLLM's order and with
OpenAI's and vLLM's meanings.
Logprobs are of the model's own logits (vLLM's default, raw logprobs).

Everything a penalty needs is in the sequence's tokens (prompt and output), so it holds on any
worker: the prefill worker's first token, the decode worker's next ones after a handoff, and a
request resumed elsewhere with the tokens already delivered (they are its output tokens there)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from workers.sequence import Sequence, position_seed


class SampledTokens(NamedTuple):
    """One step's draws, row by row: a batch rather than an object per token (it runs every step)."""
    token_ids: list[int]
    logprobs: list[dict | None] | None = None   # per row {"logprob": float, "top": {token_id: logprob}}
    #                                              (None for a row that did not ask); None if none did


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids=()) -> SampledTokens:
    """logits: [len(seqs), vocab] float32, one row per sequence that needs a token;
    `eos_token_ids`: the model's, which min_tokens holds back."""
    shaped = logits
    if any(s.params.shapes_logits for s in seqs):     # (in place, unless logprobs need the model's own)
        shaped = shape_logits(logits, seqs, eos_token_ids, inplace=all(s.params.logprobs is None for s in seqs))
    if all(s.params.greedy for s in seqs):
        token_ids = shaped.argmax(dim=-1)
    else:
        token_ids = _sample_random(shaped, seqs)
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


def shape_logits(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids=(), inplace: bool = False) -> torch.Tensor:
    """The logits as the requests' parameters shape them (a new tensor unless `inplace`),
    batched and sparse: each kind is one set of tensor operations on the (row, token) pairs it
    touches (the token lists flattened once, not looped over per row), never on the whole
    [rows, vocab] tensor, and applied only when a row asks for it."""
    rows, vocab = logits.shape
    dev = logits.device
    params = [s.params for s in seqs]
    out = logits if inplace and logits.is_contiguous() else logits.contiguous().clone()
    flat = out.view(-1)
    guided = [r for r, s in enumerate(seqs) if s.grammar is not None]
    if guided:
        _apply_grammars(out, [seqs[r] for r in guided], guided, eos_token_ids)
    # min_tokens: no EOS (unless ignored) and no stop token id until that many output tokens.
    early = [(r, s) for r, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens]
    if early:
        keys = [r * vocab + t for r, s in early for t in _ends(s, eos_token_ids) if t < vocab]
        if keys:
            flat[torch.tensor(keys, device=dev)] = float("-inf")
    if any(p.bad_words_token_ids for p in params):
        # vLLM's bad_words: a word's last token, where the output ends with the tokens before it.
        keys = [r * vocab + w[-1] for r, s in enumerate(seqs) for w in s.params.bad_words_token_ids
                if w[-1] < vocab and _ends_with(s.output_token_ids, w)]
        if keys:
            flat[torch.tensor(keys, device=dev)] = float("-inf")
    if any(p.logit_bias for p in params):
        keys = [r * vocab + int(t) for r, p in enumerate(params) for t in p.logit_bias if int(t) < vocab]
        bias = [b for p in params for t, b in p.logit_bias.items() if int(t) < vocab]
        flat.index_add_(0, torch.tensor(keys, device=dev), torch.tensor(bias, device=dev, dtype=out.dtype))
    repeat = any(p.repetition_penalty != 1.0 for p in params)
    counted = any(p.presence_penalty or p.frequency_penalty for p in params)
    if not (repeat or counted):
        return out
    outputs, counts = _pairs([s.output_token_ids for s in seqs], vocab, dev)
    if repeat:
        # CTRL's penalty as HF and vLLM apply it: every token seen, in the prompt or the output.
        prompts, _ = _pairs([s.prompt_token_ids if p.repetition_penalty != 1.0 else [] for s, p in zip(seqs, params)],
                            vocab, dev)
        seen = torch.unique(torch.cat([prompts, outputs]))
        penalty = torch.tensor([p.repetition_penalty for p in params], device=dev, dtype=out.dtype)[seen // vocab]
        x = flat[seen]
        flat[seen] = torch.where(x > 0, x / penalty, x * penalty)
    if counted:
        # OpenAI's: mu[j] - c[j] * frequency - (c[j] > 0) * presence, over the output only.
        row = outputs // vocab
        frequency = torch.tensor([p.frequency_penalty for p in params], device=dev, dtype=out.dtype)[row]
        presence = torch.tensor([p.presence_penalty for p in params], device=dev, dtype=out.dtype)[row]
        flat[outputs] -= counts.to(out.dtype) * frequency + presence
    return out


def _apply_grammars(out: torch.Tensor, seqs: list[Sequence], rows: list[int], eos_token_ids) -> None:
    """Each structured row may sample only what its grammar allows next (llguidance's bitmask,
    one bit per token, after its matcher has followed the output so far: rebuilt there after a
    handoff or a resume). A matcher in error (the output no longer fits, which the masks make
    impossible) allows only EOS, so the request ends rather than wanders."""
    vocab = out.shape[1]
    words = (vocab + 31) // 32
    grammar_words = (seqs[0].grammar.vocab_size + 31) // 32      # the tokenizer's (a model may pad past it)
    masks = torch.zeros(len(seqs), max(words, grammar_words), dtype=torch.int32)
    for i, s in enumerate(seqs):
        if s.grammar.follow(s.output_token_ids):      # straight into the row (4 bytes a word)
            s.grammar.matcher.unsafe_compute_mask_ptr(masks[i].data_ptr(), 4 * grammar_words)
        else:
            for t in eos_token_ids:
                if t < vocab:
                    masks[i, t // 32] |= (1 << (t % 32)) if t % 32 < 31 else -(1 << 31)
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((masks[:, :words].unsqueeze(-1) >> shifts) & 1).bool().view(len(seqs), -1)[:, :vocab].to(out.device)
    index = torch.tensor(rows, device=out.device)
    out[index] = out[index].masked_fill(~allowed, float("-inf"))


def _ends_with(output: list[int], word: list[int]) -> bool:
    """Whether `output` ends with all of `word` but its last token (always, for one token)."""
    k = len(word) - 1
    return k == 0 or (len(output) >= k and output[-k:] == word[:-1])


def _ends(seq: Sequence, eos_token_ids) -> list[int]:
    """The tokens that would end `seq` (what min_tokens holds back)."""
    p = seq.params
    return list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))


def _pairs(token_lists: list[list[int]], vocab: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs of the rows' lists, as row x vocab + token, and how often
    each occurs (ids past the vocabulary ignored)."""
    lengths = torch.tensor([len(ids) for ids in token_lists], device=dev)
    tokens = torch.tensor([t for ids in token_lists for t in ids], device=dev, dtype=torch.long)
    keys = torch.repeat_interleave(torch.arange(len(token_lists), device=dev) * vocab, lengths) + tokens
    return torch.unique(keys[tokens < vocab], return_counts=True)


def _sample_random(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    greedy = logits.argmax(dim=-1)
    temps = torch.tensor([s.params.temperature or 1.0 for s in seqs], device=logits.device)
    scaled = logits / temps[:, None]
    if any(s.params.min_p > 0 for s in seqs):
        scaled = _apply_min_p(scaled, torch.tensor([s.params.min_p for s in seqs], device=logits.device))
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


def _apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Drop a token less likely than min_p x the likeliest one's probability (after temperature)."""
    probs = logits.softmax(dim=-1)
    floor = min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < floor, float("-inf"))


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
