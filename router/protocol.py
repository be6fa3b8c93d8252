"""OpenAI request validation: JSON bodies in, a typed request or an `APIError` out.

Every refusal is a 4xx naming the field (`param`). The limits, so that no body, however
hostile, reaches code that could fail on it (a 5xx) or hold the server up:
  - the body's size (`--max-body-mib`, checked while reading, in app.py): 413;
  - JSON nesting: at most MAX_JSON_DEPTH levels, and at most MAX_JSON_VALUES values (fewer keys
    and floats: the dear ones), checked before parsing in passes linear in the body (no regex
    that could backtrack, no recursion), so json.loads never runs long;
  - strings: no unpaired UTF-16 surrogate (JSON's "\\ud800" escape; no tokenizer takes one);
  - integers within ranges the workers' wire format (msgpack, 64 bits) carries; floats finite;
  - list lengths (stop strings, stop_token_ids, logit_bias) and token ids within the vocabulary;
  - fields asking for behaviour this server does not implement (functions, suffix, ...) are
    refused by name rather than silently ignored; their neutral values pass;
  - tools and tool_choice (router/tools.py); an earlier tool call's arguments, JSON text inside
    the body, are held to the body's own limits before they are parsed;
  - structured outputs (response_format, guided_*, structured_outputs): one field at most, its
    grammar compiled for this model's tokenizer (`structured_spec`, workers/grammar.py);
  - samples: `n` and `best_of` within MAX_SAMPLES, and at most MAX_TOTAL_SAMPLES per request.
Unknown fields are ignored (OpenAI's clients send new ones); the body limit bounds their size.
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING

from router.admission import Pledge
from router.tools import MAX_TOOLS, ToolUse
from workers.sequence import (MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_INT32, MAX_LOGIT_BIAS, MAX_STOP, MAX_STOP_LEN,
                              SAMPLING_FIELDS, SamplingParams, check_structured, show)

if TYPE_CHECKING:
    from router.tracing import RequestTrace

MAX_JSON_DEPTH = 32                    # nesting levels of objects and arrays in a request body
PRIORITY_RANGE = (-2**31, 2**31 - 1)   # lower is served first (as vLLM)
MAX_STOP_TOKEN_IDS = 256
MAX_PROMPTS = 256                      # prompts in one completions request (a batch)
MAX_SAMPLES = 64                       # n or best_of: samples of one prompt
MAX_TOTAL_SAMPLES = 256                # samples of one request, over its prompts
SLO_MS_RANGE = (1, 3_600_000)          # a request's own TTFT / TPOT target, in ms (up to an hour)


class APIError(Exception):
    """Rendered as OpenAI's error JSON with the HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def too_large(limit: int, size: int | None = None) -> APIError:
    got = f"is {size} bytes" if size is not None else "is larger than that"
    return APIError(413, f"the request body {got}; this server accepts at most {limit} bytes "
                    f"({limit / 2**20:g} MiB, its --max-body-mib)", code="request_too_large")


@dataclass(slots=True)
class GenerationRequest:
    kind: str                                  # "completion" | "chat"
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    predicted_ttft_s: float = math.nan         # SLO admission's prediction, checked against the measured TTFT
    probe: str = ""                            # SLO admission let it in although predicted to miss this target
    ttft_limit_s: float = math.nan             # the TTFT SLO admission let it in against
    seat_s: float = 0.0                        # its prediction's floor (the wait for a decode seat; 0: none)
    pledge: Pledge | None = None               # SLO admission's count of it until its run starts
    # Told where its prompt goes (SLO admission's counts): the tokens that worker's prefill computes
    # (the rest in its prefix cache), and whether it is its decode worker, past the prefill pool's line.
    on_placed: Callable[[int, bool], None] | None = None
    echo: bool = False                         # completions: the answer starts with the prompt
    n: int = 1                                 # samples answered
    best_of: int = 1                           # samples generated (>= n): the n likeliest are answered
    ttft_due: float | None = None              # time.monotonic() when its first token is due (None: no target)
    tpot_s: float | None = None                # its TPOT target
    deadline: float | None = None              # time.monotonic() past which it ends (--request-timeout-s)
    request_id: str = ""                       # the response's id: in the log lines about it
    tools: ToolUse | None = None               # chat: what is asked of its tools (router/tools.py)
    trace: RequestTrace | None = None          # traced: its request's spans (router/tracing.py)

    def ttft_left_s(self, delivered) -> float | None:
        """What an attempt's op carries: seconds until its next token is due (negative when
        late); for an attempt that resumes after `delivered` tokens, one TPOT."""
        if delivered:
            return self.tpot_s
        return None if self.ttft_due is None else self.ttft_due - time.monotonic()


# -- the body as JSON -------------------------------------------------------------------------
# What one body may hold, so that json.loads takes at most a few tens of ms (measured on one core:
# 2**18 integers 10 ms, 2**16 distinct keys 17 ms, 2**16 floats 35 ms) and little memory.
MAX_JSON_VALUES = 2**18                # values and keys: a prompt of token ids up to this long fits
MAX_JSON_KEYS = 2**16                  # object keys (each a str and a dict insertion: the dear part)
MAX_JSON_FLOATS = 2**16                # numbers with a fraction or an exponent (each a strtod)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_TO_SQUARE = bytes.maketrans(b"{}", b"[]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")     # maybe an escaped UTF-16 surrogate


_PIECE_BYTES = 2**20                   # the passes go a piece at a time: the GIL passes between pieces
_NOT_BACKSLASH = re.compile(rb"[^\\]")


def _pieces(raw: bytes):
    """`raw` in pieces of about _PIECE_BYTES, never cut inside a run of backslashes nor between
    a backslash and the byte it escapes (each piece ends on a byte that is not a backslash)."""
    start, n = 0, len(raw)
    while start < n:
        end = min(start + _PIECE_BYTES, n)
        if end < n and raw[end - 1] == 0x5C:
            found = _NOT_BACKSLASH.search(raw, end)
            end = n if found is None else found.end()
        yield raw[start:end]
        start = end


def _structure(raw: bytes) -> bytes:
    """The body with its strings cut out: only what lies between them, in C-speed bytes methods,
    each linear in the body (no pattern that could backtrack), a piece at a time so that the
    event loop's thread gets the GIL between pieces. In valid JSON a backslash only starts an
    escape, so dropping escaped backslashes first and then escaped quotes leaves exactly the
    quotes that open and close strings; splitting on them, every other part is outside a string
    (which parts, by the parity of the quotes before). On invalid JSON the result is still
    bounded and linear; json.loads then names the error. Refuses bodies with too many strings
    as it goes, so the splits make a bounded number of parts."""
    outside, inside, quotes = [], False, 0
    for piece in _pieces(raw):
        piece = piece.replace(b"\\\\", b"").replace(b'\\"', b"")
        quotes += piece.count(b'"')
        if quotes > 2 * MAX_JSON_VALUES:
            raise too_many_values(quotes // 2, "strings")
        parts = piece.split(b'"')
        outside += parts[1::2] if inside else parts[::2]
        if len(parts) % 2 == 0:           # an odd number of quotes: the next piece starts on the other side
            inside = not inside
    return b"".join(outside)


def too_many_values(count: int, what: str = "values", limit: int = MAX_JSON_VALUES) -> APIError:
    return bad_request(f"the request body holds about {count} JSON {what}; this server takes at most {limit} "
                       "in one body")


def check_json_shape(raw: bytes) -> None:
    """Refuses, before any parsing and in time linear in the body, a body whose objects and
    arrays nest deeper than MAX_JSON_DEPTH or do not balance, or that holds more than
    MAX_JSON_VALUES values: what would make json.loads recurse or run long. The depth check
    deletes the innermost bracket pairs once per level, so it makes at most MAX_JSON_DEPTH
    passes over the brackets."""
    outside = _structure(raw)
    keys = outside.count(b":")
    values = outside.count(b",") + keys
    floats = outside.count(b".") + outside.count(b"e") + outside.count(b"E")   # true/false count too: a bound
    for count, what, limit in ((values, "values", MAX_JSON_VALUES), (keys, "object keys", MAX_JSON_KEYS),
                               (floats, "numbers with a fraction or exponent", MAX_JSON_FLOATS)):
        if count > limit:
            raise too_many_values(count, what, limit)
    brackets = outside.translate(_TO_SQUARE, _NOT_BRACKET)
    for _ in range(MAX_JSON_DEPTH):
        if not brackets:
            return
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            break
        brackets = shorter
    if brackets:
        raise _too_deep()


def _too_deep() -> APIError:
    return bad_request(f"the request body is not valid JSON: its objects and arrays nest deeper than "
                       f"{MAX_JSON_DEPTH} levels, or its brackets do not balance")


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 (never a RecursionError: the shape is checked first).
    Linear in the body; app.py runs it off the event loop for all but small bodies."""
    check_json_shape(raw)
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as e:          # JSONDecodeError, UnicodeDecodeError, an int of > 4300 digits
        raise bad_request(f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        _check_surrogates(body)
    return body


def json_value(raw: bytes):
    """Any JSON value (not only an object), with parse_json's limits."""
    check_json_shape(raw)
    try:
        value = json.loads(raw)
    except (RecursionError, ValueError) as e:
        raise bad_request(f"not valid JSON: {str(e)[:200]}") from None
    if _SURROGATE_ESCAPE.search(raw):
        _check_surrogates({"the value": value})
    return value


def _check_surrogates(body: dict) -> None:
    """An unpaired surrogate decodes to a str that no tokenizer or UTF-8 codec takes."""
    for key, value in body.items():
        todo = [key, value]
        while todo:                   # depth is bounded already; a stack, not recursion, anyway
            x = todo.pop()
            if isinstance(x, str):
                try:
                    x.encode("utf-8")
                except UnicodeEncodeError:
                    raise bad_request(f"{show(key, 40)} holds a string with an unpaired UTF-16 surrogate "
                                      "(a \\ud800-\\udfff escape without its pair)", key) from None
            elif isinstance(x, dict):
                todo += x.keys()
                todo += x.values()
            elif isinstance(x, list):
                todo += x


# -- fields ---------------------------------------------------------------------------------
def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x) -> float | None:
    try:
        return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None
    except OverflowError:
        return None


# Fields that ask for behaviour this server does not implement: (field, accepted neutral values,
# what to say). Absent or null always passes.
UNSUPPORTED = (
    ("suffix", ("",), "suffix (insertion) is not supported"),
    ("use_beam_search", (False,), "beam search is not supported"),
    ("prompt_logprobs", (), "prompt_logprobs is not supported"),
    ("functions", ([],), "functions (the deprecated form of tools) are not supported; send tools"),
    ("function_call", ("none", "auto"), "function_call (the deprecated form of tool_choice) is not supported; "
                                        "send tool_choice"),
)


def _neutral(value, allowed: tuple) -> bool:
    # Exact types: true == 1 and 1.0 == 1 in Python; JSON's true is not best_of=1 (0 and 0.0 are alike).
    for a in allowed:
        if isinstance(a, bool) or isinstance(value, bool):
            if value is a:
                return True
        elif isinstance(a, (int, float)):
            if _number(value) is not None and value == a:
                return True
        elif type(value) is type(a) and value == a:
            return True
    return False


def check_unsupported(body: dict) -> None:
    for name, allowed, why in UNSUPPORTED:
        value = body.get(name)
        if value is not None and not _neutral(value, allowed):
            raise bad_request(f"{why} (got {name}={show(value)})", name)


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"'{param}' holds the token id {show(bad)}; token ids must be in [0, {vocab_size})", param)


# Where a request may ask for structured output (workers/grammar.py), and what each asks: OpenAI's
# response_format, vLLM's guided_* fields and its newer structured_outputs object.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_FIELDS = ("response_format", *GUIDED, "structured_outputs")


def structured_spec(body: dict) -> tuple[str, dict] | None:
    """(the field that asks, the request's structured output as `SamplingParams.structured`), or
    None; a 400 naming the field when it is malformed or more than one field asks."""
    asked = []
    rf = body.get("response_format")
    if rf is not None:
        if not (isinstance(rf, dict) and rf.get("type") in ("text", "json_object", "json_schema")):
            raise bad_request("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                              f"{{\"type\": \"json_schema\", \"json_schema\": {{...}}}}, got {show(rf)}", "response_format")
        if rf["type"] == "json_object":
            asked.append(("response_format", {"json_object": ""}))
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not (isinstance(js, dict) and isinstance(js.get("schema"), dict)):
                raise bad_request("response_format json_schema must be an object with a 'schema' object, got "
                                  f"{show(js)}", "response_format")
            asked.append(("response_format", {"json": json.dumps(js["schema"])}))
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            asked.append((name, _spec(kind, body[name])))
    so = body.get("structured_outputs")
    if so is not None:
        keys = [k for k in ("json", "regex", "choice", "grammar", "json_object") if (so or {}).get(k) not in (None, False)] \
            if isinstance(so, dict) else []
        if len(keys) != 1:
            raise bad_request("structured_outputs must be an object with one of json, regex, choice, grammar, "
                              f"json_object, got {show(so)}", "structured_outputs")
        asked.append(("structured_outputs", _spec(keys[0], so[keys[0]])))
    if len(asked) > 1:
        raise bad_request(f"{asked[1][0]} and {asked[0][0]} both ask for structured output; send one", asked[1][0])
    if not asked:
        return None
    name, spec = asked[0]
    try:
        check_structured(spec)
    except ValueError as e:
        raise bad_request(f"{name}: {e}", name) from None
    return name, spec


def _spec(kind: str, value) -> dict:
    """One field's ask as `SamplingParams.structured`: a schema given as an object travels as
    its JSON text; json_object carries nothing."""
    if kind == "json_object":
        return {kind: ""}
    if kind == "json" and isinstance(value, (dict, bool)):
        value = json.dumps(value)
    return {kind: value}


def sampling_params(body: dict, default_max_tokens: int, vocab_size: int | None = None,
                    check_grammar=None, forced: tuple[str, dict] | None = None, tokenize=None) -> SamplingParams:
    """The request's sampling fields (SamplingParams' own names, plus OpenAI's spellings:
    max_completion_tokens, chat's logprobs=true + top_logprobs, and the structured-output
    fields: `structured_spec`); SamplingParams validates them, the vocabulary (which it does not
    know) is checked here, and the grammar by `check_grammar(spec)` (an error message or None).
    `forced`: (the field that asks, its structured output): a tool_choice that forces calls;
    `tokenize(text)`: the tokens of a bad word (without special tokens)."""
    check_unsupported(body)
    kw = {name: body[name] for name in SAMPLING_FIELDS
          if body.get(name) is not None and name not in ("structured", "bad_words_token_ids")}
    if body.get("bad_words") is not None:
        kw["bad_words_token_ids"] = bad_words_tokens(body["bad_words"], tokenize)
    asked = structured_spec(body)
    if forced is not None:
        if asked is not None:
            raise bad_request(f"{asked[0]} and tool_choice both shape the output (tool_choice \"required\" or a "
                              "named function forces tool calls); send one", asked[0])
        try:
            check_structured(forced[1])
        except ValueError as e:
            raise bad_request(f"{forced[0]}: {e}", forced[0]) from None
        asked = forced
    if asked is not None:
        name, kw["structured"] = asked
        error = check_grammar(kw["structured"]) if check_grammar is not None else None
        if error:
            raise bad_request(f"{name}: {error}", name)
    if "max_tokens" not in kw and body.get("max_completion_tokens") is not None:
        kw["max_tokens"] = body["max_completion_tokens"]
    kw.setdefault("max_tokens", default_max_tokens)
    logprobs = kw.pop("logprobs", None)
    top = body.get("top_logprobs")
    if top is not None:                            # chat: logprobs=true, top_logprobs=N
        if not (_is_int(top) and 0 <= top <= 20):
            raise bad_request(f"top_logprobs must be an integer between 0 and 20, got {show(top)}", "top_logprobs")
        logprobs = top if logprobs else None
    elif logprobs is True:
        logprobs = 0
    elif logprobs is False:
        logprobs = None
    if logprobs is not None:
        kw["logprobs"] = logprobs
    try:
        params = SamplingParams(**kw)
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        raise bad_request(str(e), param if param in kw else None) from None
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"stop_token_ids holds {len(params.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}",
                          "stop_token_ids")
    if vocab_size is not None:
        check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
        check_token_ids([int(t) for t in params.logit_bias], vocab_size, "logit_bias")
    return params


def bad_words_tokens(words, tokenize) -> list[list[int]]:
    """vLLM's bad_words as token sequences: each word as written and after a space (how it is
    tokenized mid-sentence by most tokenizers), the two kept when they differ."""
    if not (isinstance(words, list) and len(words) <= MAX_BAD_WORDS
            and all(isinstance(w, str) and w.strip() and len(w) <= MAX_STOP_LEN for w in words)):
        raise bad_request(f"bad_words must be a list of at most {MAX_BAD_WORDS} non-blank strings of at most "
                          f"{MAX_STOP_LEN} characters, got {show(words)}", "bad_words")
    out: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenize(text) if tokenize is not None else []
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise bad_request(f"bad_words: {show(word, 40)} is {len(ids)} tokens; at most {MAX_BAD_WORD_TOKENS}",
                                  "bad_words")
            if ids and ids not in out:
                out.append(ids)
    return out


def request_options(body: dict) -> tuple[bool, bool, int]:
    """(stream, include_usage, priority)."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"'stream' must be true or false, got {show(stream)}", "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request(f"'stream_options' must be an object, got {show(opts)}", "stream_options")
    usage = (opts or {}).get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise bad_request(f"'stream_options.include_usage' must be true or false, got {show(usage)}",
                          "stream_options")
    priority = body.get("priority")
    lo, hi = PRIORITY_RANGE
    if priority is not None and not (_is_int(priority) and lo <= priority <= hi):
        raise bad_request(f"'priority' must be an integer in [{lo}, {hi}], got {show(priority)}", "priority")
    return bool(stream), bool(usage), priority or 0


def slo_targets(body: dict, default_ttft_s: float | None, default_tpot_s: float | None
                ) -> tuple[float | None, float | None]:
    """(ttft_s, tpot_s): the request's own targets (`ttft_slo_ms`, `tpot_slo_ms`), else the
    server's (--slo-ttft-ms, --slo-tpot-ms). `--scheduling-policy deadline` orders work by them."""
    out = []
    lo, hi = SLO_MS_RANGE
    for name, default in (("ttft_slo_ms", default_ttft_s), ("tpot_slo_ms", default_tpot_s)):
        value = body.get(name)
        if value is not None and not (_is_int(value) and lo <= value <= hi):
            raise bad_request(f"'{name}' must be an integer number of milliseconds in [{lo}, {hi}], "
                              f"got {show(value)}", name)
        out.append(default if value is None else value / 1000)
    return out[0], out[1]


def echo_of(body: dict, kind: str, params: SamplingParams) -> bool:
    """`echo` (completions): the answer starts with the prompt, and with `logprobs` k the
    prompt's tokens carry their logprobs too (the first one none: nothing predicts it), which
    is what evaluation harnesses' log-likelihood requests ask (`max_tokens` 0: the prompt only).
    Sets `params.prompt_logprobs`. max_tokens 0 is refused without echo: it would answer nothing."""
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise bad_request(f"'echo' must be true or false, got {show(echo)}", "echo")
    if echo and kind != "completion":
        raise bad_request("echo is a completions field; chat completions do not echo", "echo")
    if params.max_tokens == 0 and not echo:
        raise bad_request("max_tokens 0 generates nothing: it is accepted only with echo (the prompt's "
                          "logprobs); send at least 1", "max_tokens")
    if echo and params.logprobs is not None:
        params.prompt_logprobs = params.logprobs
    return bool(echo)


def sample_counts(body: dict, stream: bool, num_prompts: int = 1) -> tuple[int, int]:
    """(n, best_of): n samples answered per prompt, each with its own random stream, out of
    best_of generated (the n with the highest cumulative logprob), as OpenAI and vLLM define
    them. best_of > n needs the whole answer to rank, so it cannot stream."""
    counts = {}
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is not None and not (_is_int(value) and 1 <= value <= MAX_SAMPLES):
            raise bad_request(f"'{name}' must be an integer in [1, {MAX_SAMPLES}], got {show(value)}", name)
        counts[name] = value
    n = counts["n"] or 1
    best_of = counts["best_of"] or n
    if best_of < n:
        raise bad_request(f"best_of ({best_of}) must be at least n ({n})", "best_of")
    if stream and best_of > n:
        raise bad_request(f"best_of ({best_of}) above n ({n}) ranks whole samples, so it cannot stream; "
                          "send stream=false or best_of=n", "best_of")
    if best_of * num_prompts > MAX_TOTAL_SAMPLES:
        raise bad_request(f"{num_prompts} prompt(s) x {best_of} samples is {best_of * num_prompts} sequences; "
                          f"at most {MAX_TOTAL_SAMPLES} per request", "best_of" if best_of > n else "n")
    return n, best_of


def completion_prompts(body: dict) -> tuple[list, bool]:
    """(the prompts of a completions request in order, whether they came as a batch). A string
    or a list of token ids is one prompt; a list of strings or of token-id lists is a batch of
    at most MAX_PROMPTS (as OpenAI and vLLM take it). Each prompt's shape is checked here, its
    tokens by the server; an empty list is one empty prompt, refused there."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(_is_int(t) for t in prompt)):
        return [prompt], False
    if not isinstance(prompt, list):
        raise bad_request(f"'prompt' must be a string, a list of token ids, or a list of those (a batch), "
                          f"got {show(prompt)}", "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"'prompt' is a batch of {len(prompt)} prompts; at most {MAX_PROMPTS} per request",
                          "prompt")
    for i, p in enumerate(prompt):
        if not (isinstance(p, str) or (isinstance(p, list) and all(_is_int(t) for t in p))):
            raise bad_request(f"prompt[{i}] must be a string or a list of token ids, got {show(p)}", "prompt")
    return prompt, True


MAX_MESSAGE_TOOL_CALLS = 128           # tool calls in one assistant message


def chat_messages(body: dict) -> list[dict]:
    """The messages as the chat template sees them (as HF transformers passes them): "role",
    "content" as text (text parts joined; images and audio are refused: this server is text
    only), and where sent a "name", an assistant turn's "tool_calls" (each call's arguments
    parsed from their JSON text into an object, as templates print them) and a tool turn's
    "tool_call_id". An assistant turn with tool calls may have no content."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    flat = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise bad_request(f"messages[{i}] must be an object with a 'role' string", "messages")
        out = {"role": m["role"], "content": _message_text(m.get("content"), i)}
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad_request(f"messages[{i}].{key} must be a string, got {show(m[key])}", "messages")
                out[key] = m[key]
        calls = m.get("tool_calls")
        if calls is not None and calls != []:
            if m["role"] != "assistant":
                raise bad_request(f"messages[{i}]: only an assistant turn has tool_calls", "messages")
            out["tool_calls"] = _message_tool_calls(calls, i)
        if out["content"] is None:
            if "tool_calls" not in out:
                raise bad_request(f"messages[{i}].content must be a string or a list of text parts "
                                  "(it may be null only in an assistant turn with tool_calls)", "messages")
            out["content"] = ""
        flat.append(out)
    return flat


def _message_text(c, i: int) -> str | None:
    if isinstance(c, list):                      # [{"type": "text", "text": ...}, ...]
        texts = []
        for j, part in enumerate(c):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"messages[{i}].content[{j}] must be {{\"type\": \"text\", \"text\": "
                                  f"<string>}} (this server takes text only), got {show(part)}", "messages")
            texts.append(part["text"])
        return "".join(texts)
    if c is not None and not isinstance(c, str):
        raise bad_request(f"messages[{i}].content must be a string or a list of text parts, got {show(c)}",
                          "messages")
    return c


def _message_tool_calls(calls, i: int) -> list[dict]:
    """An assistant turn's tool calls with their arguments as objects. The arguments' JSON text
    is a string inside the body, so its shape is checked as the body's was before it is parsed."""
    if not isinstance(calls, list) or len(calls) > MAX_MESSAGE_TOOL_CALLS:
        raise bad_request(f"messages[{i}].tool_calls must be a list of at most {MAX_MESSAGE_TOOL_CALLS} calls",
                          "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)
                and isinstance(call.get("id", ""), str)):
            raise bad_request(f"messages[{i}].tool_calls[{j}] must be {{\"id\": ..., \"type\": \"function\", "
                              f"\"function\": {{\"name\": <string>, \"arguments\": <JSON text>}}}}, got {show(call)}",
                              "messages")
        try:
            args = json_value(fn["arguments"].encode())
        except APIError as e:
            raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments: {e.message}", "messages") from None
        out.append({"id": call.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


# -- the request bodies as OpenAPI documents them (/openapi.json) ------------------------------
def _int(lo: int, hi: int, about: str) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi, "description": about}


_INT64 = (-2**63, 2**63 - 1)
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_SHARED = {
    "model": {"type": "string", "description": "the served model's name (GET /v1/models)"},
    "max_tokens": _int(0, MAX_INT32, "tokens to generate (0: only with echo, the prompt's logprobs)"),
    "max_completion_tokens": _int(1, MAX_INT32, "max_tokens' newer name"),
    "temperature": {"type": "number", "minimum": 0, "description": "0 (or under 1e-5): greedy"},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": _int(-1, MAX_INT32, "-1 or 0: off"),
    "seed": _int(*_INT64, "the sampling stream: the same seed gives the same output"),
    "stop": {"oneOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN},
                       {"type": "array", "maxItems": MAX_STOP,
                        "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN}}]},
    "stop_token_ids": {**_TOKEN_IDS, "maxItems": MAX_STOP_TOKEN_IDS},
    "ignore_eos": {"type": "boolean"},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2,
                         "description": "subtracted from a token's logit once it is in the output"},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2,
                          "description": "subtracted from a token's logit per time it is in the output"},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 100,
                           "description": "a token seen in the prompt or output: its logit divided by this "
                                          "if positive, multiplied if negative (1: none)"},
    "logit_bias": {"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                   "description": "token id -> a bias added to its logit"},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1,
              "description": "drop tokens less likely than this times the likeliest"},
    "min_tokens": _int(0, MAX_INT32, "no EOS, stop token or stop string before this many tokens (<= max_tokens)"),
    "include_stop_str_in_output": {"type": "boolean", "description": "the text ends after the stop string"},
    "bad_words": {"type": "array", "maxItems": MAX_BAD_WORDS, "items": {"type": "string", "maxLength": MAX_STOP_LEN},
                  "description": "vLLM's: words the output never contains (each word's last token is banned after "
                                 "the tokens before it)"},
    "response_format": {"type": "object", "description": "{\"type\": \"text\" | \"json_object\" | \"json_schema\"}; "
                        "json_schema: {\"name\": ..., \"schema\": {...}}: the output follows it"},
    "guided_json": {"oneOf": [{"type": "object"}, {"type": "string"}], "description": "a JSON schema the output follows"},
    "guided_regex": {"type": "string", "description": "a regex the output matches"},
    "guided_choice": {"type": "array", "items": {"type": "string"}, "description": "the output is one of these"},
    "guided_grammar": {"type": "string", "description": "a Lark grammar (llguidance's dialect) the output follows"},
    "structured_outputs": {"type": "object", "description": "vLLM's: one of json, regex, choice, grammar, "
                           "json_object"},
    "n": _int(1, MAX_SAMPLES, "samples answered per prompt"),
    "best_of": _int(1, MAX_SAMPLES, "samples generated per prompt (>= n); the n likeliest are answered; "
                                   "above n it cannot stream"),
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "priority": _int(*PRIORITY_RANGE, "lower is served first"),
    "ttft_slo_ms": _int(*SLO_MS_RANGE, "this request's TTFT target (default: the server's --slo-ttft-ms); "
                        "--scheduling-policy deadline orders prefill work by it"),
    "tpot_slo_ms": _int(*SLO_MS_RANGE, "this request's TPOT target (default: the server's --slo-tpot-ms)"),
    "user": {"type": "string", "description": "informational"},
}
_REFUSED_NOTE = ("Fields asking for what this server does not do (" + ", ".join(name for name, _, _ in UNSUPPORTED)
                 + ") are refused with 400 unless neutral; unknown fields are ignored.")
COMPLETION_BODY = {
    "type": "object", "required": ["model", "prompt"], "description": _REFUSED_NOTE,
    "properties": {
        "prompt": {"oneOf": [{"type": "string"}, _TOKEN_IDS,
                             {"type": "array", "maxItems": MAX_PROMPTS, "items": {"type": "string"}},
                             {"type": "array", "maxItems": MAX_PROMPTS, "items": _TOKEN_IDS}],
                   "description": "a prompt (text or token ids), or a batch of them"},
        **_SHARED,
        "logprobs": _int(0, 20, "each token's logprob and this many top ones"),
        "echo": {"type": "boolean", "description": "answer the prompt first (with logprobs: its tokens' too)"},
    }}
_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"type": "string"}, "arguments": {"type": "string", "description": "the arguments' JSON text"}}}}}
CHAT_BODY = {
    "type": "object", "required": ["model", "messages"], "description": _REFUSED_NOTE,
    "properties": {
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role"],
            "properties": {"role": {"type": "string"}, "content": {"oneOf": [
                {"type": "string"}, {"type": "null", "description": "only in an assistant turn with tool_calls"},
                {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
                    "type": {"const": "text"}, "text": {"type": "string"}}}}]},
                "name": {"type": "string"},
                "tool_calls": {"type": "array", "maxItems": MAX_MESSAGE_TOOL_CALLS, "items": _TOOL_CALL},
                "tool_call_id": {"type": "string", "description": "a tool turn: the call it answers"}}}},
        **_SHARED,
        "logprobs": {"type": "boolean"},
        "top_logprobs": _int(0, 20, "with logprobs: this many top ones per token"),
        "tools": {"type": "array", "maxItems": MAX_TOOLS, "description": "functions the model may call, "
                  "rendered by its chat template", "items": {
                      "type": "object", "required": ["type", "function"], "properties": {
                          "type": {"const": "function"},
                          "function": {"type": "object", "required": ["name"], "properties": {
                              "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                              "description": {"type": "string"},
                              "parameters": {"type": "object", "description": "a JSON schema"},
                              "strict": {"type": "boolean"}}}}}},
        "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {
            "type": "object", "required": ["type", "function"], "properties": {
                "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                            "properties": {"name": {"type": "string"}}}}}],
            "description": "auto (the default with tools): calls parsed from the answer; required or a named "
                           "function: forced by structured output"},
        "parallel_tool_calls": {"type": "boolean", "description": "false: at most one call"},
    }}
