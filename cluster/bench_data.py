"""Workloads for `pdcluster bench`: the datasets `vllm bench serve` users know.

Every sampler returns `BenchRequest`s: the prompt text, its length in the client's tokenizer,
and how many tokens to ask for. A timed trace (`load_trace`) also says when to send each. Prompts are text (both endpoints take text; token-id prompts
are a completions-only extension), and lengths are re-measured after decoding, because
random ids seldom round-trip through a tokenizer to the same count.
"""
from __future__ import annotations

import csv
import json
import math
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


def read_json(path: str, flag: str, missing: str = "no such file"):
    """A JSON file a flag names; errors say which flag and what is wrong."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag} {path}: {missing}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {path}: not JSON ({e})") from None


def sample_sharegpt(path: str, tokenizer: Tokenizer, num: int, output_len: int | None = None,
                    seed: int = 0) -> list[BenchRequest]:
    """First human turn as the prompt; the reply's length (or `output_len`) as max_tokens.
    Filters as vLLM does: prompt or reply under 4 tokens, prompt over 1024, both over 2048."""
    data = read_json(path, "--dataset-path")
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


# -- timed traces: when each request arrives, how long its prompt and output are ----------------
TRACES_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "traces"
TRACES = {"azure-conv": "azure_conv_2023.csv", "azure-code": "azure_code_2023.csv"}
TRACE_COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")


@dataclass(frozen=True, slots=True)
class TraceRow:
    arrival_s: float       # seconds from the first request of the trace (scaled)
    prompt_len: int        # tokens
    output_len: int        # tokens


def resolve_trace(path: str) -> Path:
    """A built-in trace name (azure-conv, azure-code: benchmarks/traces in this checkout) or a file."""
    return TRACES_DIR / TRACES[path] if path in TRACES else Path(path)


def _trace_number(path, lineno: int, column: str, text: str | None, integer: bool) -> float:
    if text is None or not text.strip():
        raise ValueError(f"{path}:{lineno}: no value for {column}")
    try:
        x = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{path}:{lineno}: {column} must be a number, got {text!r}") from None
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{path}:{lineno}: {column} must be a non-negative number, got {text!r}")
    if integer and not x.is_integer():
        raise ValueError(f"{path}:{lineno}: {column} must be a whole number of tokens, got {text!r}")
    return x


def _trace_rows(file: Path, reader: csv.DictReader) -> list[tuple[float, float, float]]:
    header = reader.fieldnames or []
    missing = [c for c in TRACE_COLUMNS if c not in header]
    if missing:
        raise ValueError(f"{file}:1: expected a CSV header with the columns {','.join(TRACE_COLUMNS)}; "
                         f"missing {', '.join(missing)} (got {','.join(header) or 'an empty file'})")
    # DictReader skips blank lines; line_num is the line a row ends on.
    return [tuple(_trace_number(file, reader.line_num, c, row.get(c), c != "arrived_at") for c in TRACE_COLUMNS)
            for row in reader]


def load_trace(path: str, num: int | None = None, time_scale: float = 1.0, length_scale: float = 1.0,
               max_len: int | None = None) -> list[TraceRow]:
    """The first `num` requests (None: all) of a CSV trace with the columns arrived_at (seconds),
    num_prefill_tokens, num_decode_tokens, in order of arrival. `path` is a file or a built-in
    name (TRACES). Times are made relative to the first request and divided by `time_scale`
    (2: twice the rate); lengths are multiplied by `length_scale` (rounded, at least 1); with
    `max_len`, the prompt is cut so that prompt + output <= max_len (each at least 1; an output
    of max_len or more is cut to max_len - 1)."""
    if not time_scale > 0 or not math.isfinite(time_scale):
        raise ValueError(f"--trace-time-scale must be positive, got {time_scale}")
    if not length_scale > 0 or not math.isfinite(length_scale):
        raise ValueError(f"--trace-length-scale must be positive, got {length_scale}")
    if max_len is not None and max_len < 2:
        raise ValueError(f"--trace-max-len must be at least 2 (a 1-token prompt and output), got {max_len}")
    if num is not None and num < 1:
        raise ValueError(f"the number of trace requests must be at least 1, got {num}")
    file = resolve_trace(path)
    try:
        f = file.open(newline="", encoding="utf-8-sig")     # -sig: a BOM is no header
    except FileNotFoundError:
        if path in TRACES:
            raise FileNotFoundError(f"built-in trace {path}: {file} is missing (it ships in the checkout's "
                                    "benchmarks/traces)") from None
        raise FileNotFoundError(f"--dataset-path {path}: no such file (built-in traces: "
                                f"{', '.join(TRACES)})") from None
    except OSError as e:
        raise ValueError(f"--dataset-path {path}: cannot read it ({e.strerror or e})") from None
    with f:
        try:
            raw = _trace_rows(file, csv.DictReader(f))
        except (UnicodeDecodeError, csv.Error) as e:
            raise ValueError(f"{file}: not a CSV text file ({e})") from None
    if not raw:
        raise ValueError(f"{file}: no requests in the trace")
    raw.sort(key=lambda r: r[0])                                 # stable: ties keep the file's order
    raw = raw[:num] if num is not None else raw
    t0 = raw[0][0]
    out = []
    for t, n_in, n_out in raw:
        n_in, n_out = max(1, round(n_in * length_scale)), max(1, round(n_out * length_scale))     # ints
        if max_len is not None:
            n_out = min(n_out, max_len - 1)
            n_in = min(n_in, max_len - n_out)
        out.append(TraceRow((t - t0) / time_scale, n_in, n_out))
    return out


def sample_trace(tokenizer: Tokenizer, rows: list[TraceRow], seed: int = 0) -> list[BenchRequest]:
    """One request per trace row: random text of the row's prompt length (as sample_random makes
    it), asking for the row's output length."""
    gen = RandomText(tokenizer, random.Random(seed))
    out = []
    for row in rows:
        text, n = gen.text(row.prompt_len)
        out.append(BenchRequest(text, n, row.output_len))
    return out
