"""Workloads for `pdcluster bench`: the datasets `vllm bench serve` users know.

Every sampler returns `BenchRequest`s: the prompt text, its length in the client's tokenizer,
and how many tokens to ask for. A timed trace (`load_trace`: CSV or JSONL) and the load phases
(`phase_rows`) also say when to send each. Prompts are text (both endpoints take text; token-id prompts
are a completions-only extension), and lengths are re-measured after decoding, because
random ids seldom round-trip through a tokenizer to the same count.
"""
from __future__ import annotations

import csv
import io
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
    phase: str | None = None   # the load phase it is sent in (phases, or a trace's "phase" field)


def random_lens(rng: random.Random, n: int, mean: int, range_ratio: float) -> list[int]:
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
    ins, outs = random_lens(rng, num, input_len, range_ratio), random_lens(rng, num, output_len, range_ratio)
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
        text = Path(path).read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"--dataset-path {path}: no such file") from None
    for lineno, row in json_lines(path, text):
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
TRACES_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "traces"
TRACES = {"azure-conv": "azure_conv_2023.csv", "azure-code": "azure_code_2023.csv"}
TRACE_COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
# JSONL traces: one object per line; of each tuple, the first field present is used. vLLM's
# `timed_trace` shape (Mooncake's traces) is {"timestamp", "input_length", "output_length", "hash_ids"}.
JSONL_TIME = ("arrival_s", "timestamp")                 # arrival_s: seconds; timestamp: --trace-timestamp-unit
JSONL_PROMPT_LEN = ("prompt_len", "input_length")        # tokens, when there is no "prompt" text
JSONL_OUTPUT_LEN = ("output_len", "output_length", "output_tokens")
TIMESTAMP_UNITS = {"s": 1.0, "ms": 0.001}


@dataclass(frozen=True, slots=True)
class TraceRow:
    arrival_s: float       # seconds from the first request of the trace (scaled)
    prompt_len: int        # tokens (of `prompt`, in the tokenizer, when the trace gives the text)
    output_len: int        # tokens
    prompt: str | None = None      # the prompt's text, when the trace gives it rather than a length
    phase: str | None = None       # the load phase it belongs to (phase_rows, or a JSONL "phase" field)


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


# (arrival, prompt tokens or None for a text prompt, output tokens, prompt text, phase, line)
_Raw = tuple[float, "float | None", float, "str | None", "str | None", int]


def _trace_rows(file: Path, reader: csv.DictReader) -> list[_Raw]:
    header = reader.fieldnames or []
    missing = [c for c in TRACE_COLUMNS if c not in header]
    if missing:
        raise ValueError(f"{file}:1: expected a CSV header with the columns {','.join(TRACE_COLUMNS)}; "
                         f"missing {', '.join(missing)} (got {','.join(header) or 'an empty file'})")
    # DictReader skips blank lines; line_num is the line a row ends on.
    return [(*(_trace_number(file, reader.line_num, c, row.get(c), c != "arrived_at") for c in TRACE_COLUMNS),
             None, None, reader.line_num) for row in reader]


def _json_number(file: Path, lineno: int, field: str, value, tokens: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{file}:{lineno}: '{field}' must be a number, got {json.dumps(value)}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{file}:{lineno}: '{field}' must be a non-negative number, got {value}")
    if tokens and (value < 1 or not float(value).is_integer()):
        raise ValueError(f"{file}:{lineno}: '{field}' must be a whole number of tokens, at least 1, got {value}")
    return value


def _first(row: dict, fields: tuple[str, ...]) -> tuple[str | None, object]:
    for f in fields:
        if row.get(f) is not None:
            return f, row[f]
    return None, None


def json_lines(name, text: str):
    """(line number, parsed value) of each non-blank line of a JSONL text; a line that is not
    JSON raises ValueError naming `name` and the line."""
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}:{lineno}: not JSON ({e.msg})") from None


def _jsonl_rows(file: Path, text: str, timestamp_unit: str) -> list[_Raw]:
    out = []
    for lineno, row in json_lines(file, text):
        if not isinstance(row, dict):
            raise ValueError(f"{file}:{lineno}: expected one JSON object per line, got {type(row).__name__}")
        field, value = _first(row, JSONL_TIME)
        if field is None:
            raise ValueError(f"{file}:{lineno}: no arrival time: give 'arrival_s' (seconds) or 'timestamp' "
                             "(in --trace-timestamp-unit, default s)")
        t = _json_number(file, lineno, field, value, False) * (TIMESTAMP_UNITS[timestamp_unit]
                                                               if field == "timestamp" else 1.0)
        prompt, n_in = row.get("prompt"), None
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{file}:{lineno}: 'prompt' must be a non-empty string (or give its length "
                                 "as 'prompt_len')")
        else:
            field, value = _first(row, JSONL_PROMPT_LEN)
            if field is None:
                raise ValueError(f"{file}:{lineno}: no prompt: give 'prompt' (text) or its length in tokens as "
                                 "'prompt_len' or 'input_length'")
            n_in = _json_number(file, lineno, field, value, True)
        field, value = _first(row, JSONL_OUTPUT_LEN)
        if field is None:
            raise ValueError(f"{file}:{lineno}: no output length: give 'output_len', 'output_length' or "
                             "'output_tokens' (tokens)")
        n_out = _json_number(file, lineno, field, value, True)
        phase = row.get("phase")
        if phase is not None and (isinstance(phase, bool) or not isinstance(phase, (str, int))):
            raise ValueError(f"{file}:{lineno}: 'phase' must be a string or an integer, got {json.dumps(phase)}")
        out.append((t, n_in, n_out, prompt, None if phase is None else str(phase), lineno))
    return out


def _fit_text(tokenizer: Tokenizer, text: str, limit: int | None) -> tuple[str, int]:
    """(text, its tokens), the text cut to at most `limit` tokens (None: as it is)."""
    ids = tokenizer.encode(text)
    n, keep = len(ids), limit
    for _ in range(8):
        if limit is None or n <= limit or keep < 1:
            break
        text = tokenizer.decode(ids[:keep])
        n = len(tokenizer.encode(text))
        keep -= max(1, n - limit)
    return text, n


def load_trace(path: str, num: int | None = None, time_scale: float = 1.0, length_scale: float = 1.0,
               max_len: int | None = None, tokenizer=None, timestamp_unit: str = "s") -> list[TraceRow]:
    """The first `num` requests (None: all) of a timed trace, in order of arrival (a file out of
    order is sorted, ties keeping the file's order). `path` is a built-in name (TRACES) or a file:
    CSV with the columns arrived_at (seconds), num_prefill_tokens, num_decode_tokens; or JSONL
    (a .jsonl name, or a first character `{`), one object per line with an arrival time
    (JSONL_TIME), the prompt as text ("prompt") or a length (JSONL_PROMPT_LEN), an output length
    (JSONL_OUTPUT_LEN) and optionally a "phase"; other fields (vLLM's hash_ids) are ignored.
    Times are made relative to the first request and divided by `time_scale` (2: twice the
    rate); lengths given as numbers are multiplied by `length_scale` (rounded, at least 1; a text
    prompt is sent as written); with `max_len`, the prompt is cut so that prompt + output <=
    max_len (each at least 1; an output of max_len or more is cut to max_len - 1). Text prompts
    are measured with `tokenizer` (a Tokenizer, or a function that loads one when first needed)."""
    if not time_scale > 0 or not math.isfinite(time_scale):
        raise ValueError(f"--trace-time-scale must be positive, got {time_scale}")
    if not length_scale > 0 or not math.isfinite(length_scale):
        raise ValueError(f"--trace-length-scale must be positive, got {length_scale}")
    if max_len is not None and max_len < 2:
        raise ValueError(f"--trace-max-len must be at least 2 (a 1-token prompt and output), got {max_len}")
    if num is not None and num < 1:
        raise ValueError(f"the number of trace requests must be at least 1, got {num}")
    if timestamp_unit not in TIMESTAMP_UNITS:
        raise ValueError(f"--trace-timestamp-unit must be one of {', '.join(TIMESTAMP_UNITS)}, got {timestamp_unit!r}")
    file = resolve_trace(path)
    try:
        text = file.read_text(encoding="utf-8-sig")     # -sig: a BOM is no header
    except FileNotFoundError:
        if path in TRACES:
            raise FileNotFoundError(f"built-in trace {path}: {file} is missing (it ships in the checkout's "
                                    "benchmarks/traces)") from None
        raise FileNotFoundError(f"--dataset-path {path}: no such file (built-in traces: "
                                f"{', '.join(TRACES)})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not a UTF-8 text file ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"--dataset-path {path}: cannot read it ({e.strerror or e})") from None
    if file.suffix.lower() in (".jsonl", ".ndjson") or text.lstrip().startswith("{"):
        raw = _jsonl_rows(file, text, timestamp_unit)
    else:
        try:
            raw = _trace_rows(file, csv.DictReader(io.StringIO(text)))
        except csv.Error as e:
            raise ValueError(f"{file}: not a CSV text file ({e})") from None
    if not raw:
        raise ValueError(f"{file}: no requests in the trace")
    raw.sort(key=lambda r: r[0])                                 # stable: ties keep the file's order
    raw = raw[:num] if num is not None else raw
    t0 = raw[0][0]
    out = []
    for t, n_in, n_out, prompt, phase, lineno in raw:
        n_out = max(1, round(n_out * length_scale))                                          # an int
        if max_len is not None:
            n_out = min(n_out, max_len - 1)
        if prompt is None:
            n_in = max(1, round(n_in * length_scale))
            if max_len is not None:
                n_in = min(n_in, max_len - n_out)
        else:
            if tokenizer is not None and not hasattr(tokenizer, "encode"):
                tokenizer = tokenizer()                          # loaded when first needed
            if tokenizer is None:
                raise ValueError(f"{file}:{lineno}: a text 'prompt' needs a tokenizer to count its tokens: "
                                 "pass --tokenizer (a built-in model name or a directory with tokenizer.json)")
            prompt, n_in = _fit_text(tokenizer, prompt, None if max_len is None else max_len - n_out)
        out.append(TraceRow((t - t0) / time_scale, n_in, n_out, prompt, phase))
    return out


def save_trace(rows: list[TraceRow], path: str) -> Path:
    """`rows` as a JSONL timed trace that load_trace reads back as they are: one
    {"arrival_s", "prompt_len" (or "prompt": text), "output_len", "phase" (if any)} per line."""
    lines = []
    for r in rows:
        d: dict = {"arrival_s": round(r.arrival_s, 6)}
        d.update({"prompt": r.prompt} if r.prompt is not None else {"prompt_len": r.prompt_len})
        d["output_len"] = r.output_len
        if r.phase is not None:
            d["phase"] = r.phase
        lines.append(json.dumps(d))
    out = Path(path)
    try:
        out.write_text("".join(line + "\n" for line in lines))
    except OSError as e:
        raise ValueError(f"--save-trace {path}: cannot write it ({e.strerror or e})") from None
    return out


def sample_trace(tokenizer: Tokenizer, rows: list[TraceRow], seed: int = 0) -> list[BenchRequest]:
    """One request per trace row: its text prompt, or random text of the row's prompt length
    (as sample_random makes it), asking for the row's output length, in the row's phase."""
    gen = None
    out = []
    for row in rows:
        if row.prompt is not None:
            out.append(BenchRequest(row.prompt, row.prompt_len, row.output_len, row.phase))
            continue
        if gen is None:
            gen = RandomText(tokenizer, random.Random(seed))
        text, n = gen.text(row.prompt_len)
        out.append(BenchRequest(text, n, row.output_len, row.phase))
    return out


# -- load phases: alternating prefill-heavy and decode-heavy load ---------------------------------
PREFILL_HEAVY, DECODE_HEAVY = "prefill-heavy", "decode-heavy"


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    input_len: int         # mean prompt tokens
    output_len: int        # mean output tokens
    rate: float            # requests/s


def alternate(num: int, first: Phase, second: Phase) -> list[Phase]:
    """`num` phases: first, second, first, ..."""
    return [first if k % 2 == 0 else second for k in range(num)]


def phase_rows(phases: list[Phase], phase_s: float, burstiness: float = 1.0, range_ratio: float = 0.0,
               seed: int = 0) -> list[TraceRow]:
    """Timed rows for consecutive load phases of `phase_s` seconds: phase k spans
    [k * phase_s, (k + 1) * phase_s); its first request is sent at its start, the next ones after
    gamma gaps at its rate (shape `burstiness`, mean 1/rate: 1 is Poisson, as loadgen's
    arrival_gaps); prompt and output lengths are uniform within +-range_ratio of its means (as
    --random-range-ratio). Each row carries its phase's name. Seeded: same arguments, same rows."""
    if not phases:
        raise ValueError("--phases must be at least 1")
    if not (phase_s > 0 and math.isfinite(phase_s)):
        raise ValueError(f"--phase-s must be positive, got {phase_s}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    for ph in phases:
        kind = ph.name.split("-")[0]
        if not (ph.rate > 0 and math.isfinite(ph.rate)):
            raise ValueError(f"--{kind}-phase-rate must be a positive number of requests/s, got {ph.rate}")
        if ph.input_len < 1 or ph.output_len < 1:
            raise ValueError(f"--{kind}-phase-input-len and --{kind}-phase-output-len must be at least 1")
    rng = random.Random(seed)
    rows = []
    for k, ph in enumerate(phases):
        t, end, times = k * phase_s, (k + 1) * phase_s, []
        while t < end:
            times.append(t)
            t += rng.gammavariate(burstiness, 1.0 / (ph.rate * burstiness))
        ins = random_lens(rng, len(times), ph.input_len, range_ratio)
        outs = random_lens(rng, len(times), ph.output_len, range_ratio)
        rows += [TraceRow(t, n_in, n_out, None, ph.name) for t, n_in, n_out in zip(times, ins, outs)]
    return rows


# -- an hour-scale rise and fall, over a real trace's arrivals ----------------------------------------
def rise_and_fall(rows: list[TraceRow], low_rate: float, peak_rate: float, period_s: float,
                  duration_s: float) -> list[TraceRow]:
    """A trace replayed with its own burst structure under a slow swell: its rows in order (from
    the first again when they run out), each gap between two of them the trace's own gap in
    units of its mean gap, divided by the rate at that moment,

        rate(t) = low + (peak - low) x (1 - cos(2 pi t / period)) / 2

    (low at 0, peak at period / 2, low again at period). The requests keep the trace's prompt and
    output lengths. Deterministic: the same rows and arguments give the same result."""
    if len(rows) < 2:
        raise ValueError("a rise and fall needs a trace of at least 2 requests")
    if not (0 < low_rate <= peak_rate and period_s > 0 and duration_s > 0):
        raise ValueError(f"a rise and fall needs 0 < low <= peak rate and positive period and duration, "
                         f"got {low_rate}, {peak_rate}, {period_s}, {duration_s}")
    span = rows[-1].arrival_s - rows[0].arrival_s
    mean_gap = span / (len(rows) - 1) if span > 0 else 1.0
    out, t, i = [], 0.0, 0
    while t < duration_s:
        r = rows[i % len(rows)]
        out.append(TraceRow(t, r.prompt_len, r.output_len, r.prompt, r.phase))
        nxt = rows[(i + 1) % len(rows)]
        gap = (nxt.arrival_s - r.arrival_s) / mean_gap if (i + 1) % len(rows) else 1.0
        rate = low_rate + (peak_rate - low_rate) * (1 - math.cos(2 * math.pi * t / period_s)) / 2
        t += max(0.0, gap) / rate
        i += 1
    return out
