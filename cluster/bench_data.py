"""Workloads for `pdcluster bench`: the datasets `vllm bench serve` users know.

Every sampler returns `BenchRequest`s: the prompt text, its length in the client's tokenizer,
and how many tokens to ask for. Prompts are text (both endpoints take text; token-id prompts
are a completions-only extension), and lengths are re-measured after decoding, because
random ids seldom round-trip through a tokenizer to the same count.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from workers.tokenizer import Tokenizer


@dataclass(slots=True)
class BenchRequest:
    prompt: str
    prompt_len: int        # tokens, by the client's tokenizer (the server's usage wins when reported)
    output_len: int        # max_tokens to ask for


def _lens(rng: random.Random, n: int, mean: int, range_ratio: float) -> list[int]:
    """n lengths uniform in [mean * (1 - r), mean * (1 + r)], at least 1."""
    lo, hi = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


class RandomText:
    """Random text of a requested token length in a given tokenizer.

    Draws ids from those that decode to printable text and re-encode to themselves, decodes,
    then trims or tops up until the re-encoded length is the target (merges at the seams make
    the first guess drift by a few tokens).
    """

    def __init__(self, tokenizer: Tokenizer, rng: random.Random):
        self.tok, self.rng = tokenizer, rng
        ids = range(tokenizer.vocab_size)
        if len(ids) > 32768:                   # big vocabularies: a sample is plenty
            ids = sorted(rng.sample(ids, 32768))
        self.pool = [i for i in ids if (s := tokenizer.decode([i])) and s.isprintable()
                     and tokenizer.encode(s) == [i]]
        if not self.pool:
            raise ValueError("the tokenizer has no ids that round-trip as printable text")

    def ids(self, n: int) -> list[int]:
        return [self.rng.choice(self.pool) for _ in range(n)]

    def text(self, n: int, prefix: str = "") -> tuple[str, int]:
        """(text, tokens): prefix + random text measuring n tokens (or as close as seams allow)."""
        body = self.ids(max(0, n - (len(self.tok.encode(prefix)) if prefix else 0)))
        for attempt in range(8):
            text = prefix + self.tok.decode(body)
            got = len(self.tok.encode(text))
            if got == n or attempt == 7 or (got > n and not body):
                break
            body = body[: len(body) - (got - n)] if got > n else body + self.ids(n - got)
        return text, got


def sample_random(tokenizer: Tokenizer, num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                  prefix_len: int = 0, seed: int = 0) -> list[BenchRequest]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be at least 1")
    rng = random.Random(seed)
    gen = RandomText(tokenizer, rng)
    prefix = gen.text(prefix_len)[0] if prefix_len > 0 else ""
    ins, outs = _lens(rng, num, input_len, range_ratio), _lens(rng, num, output_len, range_ratio)
    out = []
    for n_in, n_out in zip(ins, outs):
        text, n = gen.text(prefix_len + n_in, prefix)
        out.append(BenchRequest(text, n, n_out))
    return out


def sample_prefix_repetition(tokenizer: Tokenizer, num: int, prefix_len: int, suffix_len: int,
                             num_prefixes: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    """`num_prefixes` shared prefixes, each followed by distinct random suffixes; shuffled."""
    if num_prefixes < 1:
        raise ValueError("--prefix-repetition-num-prefixes must be at least 1")
    rng = random.Random(seed)
    gen = RandomText(tokenizer, rng)
    prefixes = [gen.text(prefix_len)[0] for _ in range(num_prefixes)]
    out = []
    for i in range(num):
        text, n = gen.text(prefix_len + suffix_len, prefixes[i % num_prefixes])
        out.append(BenchRequest(text, n, output_len))
    rng.shuffle(out)
    return out


def sample_sharegpt(path: str, tokenizer: Tokenizer, num: int, output_len: int | None = None,
                    seed: int = 0) -> list[BenchRequest]:
    """First human turn as the prompt; the reply's length (or `output_len`) as max_tokens.
    Filters as vLLM does: prompt or reply under 4 tokens, prompt over 1024, both over 2048."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"--dataset-path {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--dataset-path {path}: not JSON ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: expected a JSON list of conversations (ShareGPT format)")
    convs = [d.get("conversations") or d.get("conversation") for d in data if isinstance(d, dict)]
    convs = [c for c in convs if isinstance(c, list) and len(c) >= 2]
    random.Random(seed).shuffle(convs)
    out = []
    for c in convs:
        if len(out) == num:
            break
        prompt, reply = c[0].get("value"), c[1].get("value")
        if not isinstance(prompt, str) or not isinstance(reply, str):
            continue
        n_in = len(tokenizer.encode(prompt))
        n_out = output_len or len(tokenizer.encode(reply))
        if n_in < 4 or n_out < 4 or n_in > 1024 or n_in + n_out > 2048:
            continue
        out.append(BenchRequest(prompt, n_in, n_out))
    if len(out) < num:
        raise ValueError(f"--dataset-path {path}: only {len(out)} usable conversations, --num-prompts is {num}")
    return out


def load_custom(path: str, tokenizer: Tokenizer | None, num: int, output_len: int) -> list[BenchRequest]:
    """JSONL, one `{"prompt": "...", "output_tokens": N}` per line (output_tokens optional)."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(f"--dataset-path {path}: no such file") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}:{lineno}: needs a non-empty string 'prompt'")
        n_out = row.get("output_tokens", output_len)
        if not isinstance(n_out, int) or isinstance(n_out, bool) or n_out < 1:
            raise ValueError(f"{path}:{lineno}: 'output_tokens' must be a positive integer")
        n_in = len(tokenizer.encode(prompt)) if tokenizer is not None else 0
        out.append(BenchRequest(prompt, n_in, n_out))
        if len(out) == num:
            break
    if not out:
        raise ValueError(f"--dataset-path {path}: no requests")
    return out
