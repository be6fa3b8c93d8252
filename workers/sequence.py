"""One request's state inside a worker: its tokens, how many have KV, and how it ends."""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field, fields


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: no top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None         # also return this many top logprobs per token
    prompt_logprobs: int | None = None  # also return each prompt token's logprob, and this many top ones
    # What shapes the logits before sampling (OpenAI's and vLLM's meanings; workers/sampler.py):
    presence_penalty: float = 0.0       # [-2, 2]: subtracted from a token's logit once it is in the output
    frequency_penalty: float = 0.0      # [-2, 2]: subtracted per time a token is in the output
    repetition_penalty: float = 1.0     # > 0: a seen token's (prompt or output) logit divided by it if > 0, else times it
    logit_bias: dict[str, float] = field(default_factory=dict)   # token id (JSON's string key) -> [-100, 100], added
    min_p: float = 0.0                  # [0, 1]: tokens less likely than min_p x the likeliest are dropped
    min_tokens: int = 0                 # no EOS, stop token or stop string before this many output tokens
    include_stop_str_in_output: bool = False   # the text ends after the stop string, not before it
    structured: dict | None = None      # a grammar the output must follow (workers/grammar.py), e.g. {"regex": "..."}
    # vLLM's bad_words as token sequences (the router tokenizes the words): a sequence's last
    # token is banned wherever the output so far ends with the tokens before it.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self):
        # Bounds keep every value within what the wire (msgpack: 64-bit ints, UTF-8 strings)
        # and the sampler take; a request is refused here, never failed on a worker.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # max_tokens=0 computes the prompt only (its logprobs: a log-likelihood request).
        _check(_is_int(self.max_tokens) and 0 <= self.max_tokens <= MAX_INT32,
               f"max_tokens must be an integer in [0, {MAX_INT32}], got {show(self.max_tokens)}")
        _check(_is_finite(self.temperature) and self.temperature >= 0,
               f"temperature must be a finite number >= 0, got {show(self.temperature)}")
        # Below 1e-5 the logits / temperature overflow to inf (NaN probabilities): that is greedy.
        self.temperature = float(self.temperature) if self.temperature >= 1e-5 else 0.0
        _check(_is_finite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {show(self.top_p)}")
        self.top_p = float(self.top_p)
        _check(_is_int(self.top_k) and -1 <= self.top_k <= MAX_INT32,
               f"top_k must be -1, 0 (off) or a positive count up to {MAX_INT32}, got {show(self.top_k)}")
        _check(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**63),
               f"seed must be a 64-bit signed integer, got {show(self.seed)}")
        _check(isinstance(self.stop, list) and all(isinstance(x, str) and x for x in self.stop),
               f"stop must be a non-empty string or a list of them, got {show(self.stop)}")
        _check(len(self.stop) <= MAX_STOP, f"stop holds {len(self.stop)} strings; at most {MAX_STOP}")
        _check(all(len(x) <= MAX_STOP_LEN for x in self.stop),
               f"stop strings must be at most {MAX_STOP_LEN} characters each, got one of "
               f"{max(map(len, self.stop), default=0)}")
        _check(isinstance(self.stop_token_ids, list)
               and all(_is_int(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids),
               f"stop_token_ids must be a list of token ids (integers >= 0), got {show(self.stop_token_ids)}")
        _check(isinstance(self.ignore_eos, bool), f"ignore_eos must be true or false, got {show(self.ignore_eos)}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               f"logprobs must be an integer between 0 and 20, got {show(self.logprobs)}")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
               f"prompt_logprobs must be an integer between 0 and 20, got {show(self.prompt_logprobs)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_finite(value) and -2 <= value <= 2, f"{name} must be a number in [-2, 2], got {show(value)}")
            setattr(self, name, float(value))
        _check(_is_finite(self.repetition_penalty) and 0 < self.repetition_penalty <= 100,
               f"repetition_penalty must be a number in (0, 100] (1: none), got {show(self.repetition_penalty)}")
        self.repetition_penalty = float(self.repetition_penalty)
        _check(_is_finite(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be a number in [0, 1], got {show(self.min_p)}")
        self.min_p = float(self.min_p)
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {show(self.min_tokens)}")
        _check(isinstance(self.include_stop_str_in_output, bool),
               f"include_stop_str_in_output must be true or false, got {show(self.include_stop_str_in_output)}")
        self.logit_bias = _logit_bias(self.logit_bias)
        _check(isinstance(self.bad_words_token_ids, list) and len(self.bad_words_token_ids) <= 2 * MAX_BAD_WORDS
               and all(isinstance(w, list) and 0 < len(w) <= MAX_BAD_WORD_TOKENS
                       and all(_is_int(t) and 0 <= t <= MAX_INT32 for t in w) for w in self.bad_words_token_ids),
               f"bad_words_token_ids must be at most {2 * MAX_BAD_WORDS} lists of 1-{MAX_BAD_WORD_TOKENS} token ids")
        if self.structured is not None:
            check_structured(self.structured)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether the sampler changes its logits before temperature (penalties, bias, min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.structured or self.bad_words_token_ids)


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))     # the request fields that sample


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for draw number `position` of a request seeded with `seed` (splitmix64's
    finalizer: neighbouring positions and seeds give unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample `index` of a request asking for several (`n`, `best_of`) with `seed`:
    sample 0 keeps it (so it equals the same request with n=1), the others get streams of their
    own, unrelated to it and to each other. None stays None (unseeded)."""
    if seed is None or index == 0:
        return seed
    return position_seed(seed, -1 - index)


MAX_INT32 = 2**31 - 1               # max_tokens, top_k, token ids: far past any real value
MAX_STOP = 32                       # stop strings per request
MAX_STOP_LEN = 512                  # characters per stop string
MAX_BAD_WORDS = 128                 # bad_words of one request (each tokenized twice: with a leading space too)
MAX_BAD_WORD_TOKENS = 1024          # tokens of one bad word (at most 512 characters, as a stop string)
MAX_LOGIT_BIAS = 1024               # entries of logit_bias (OpenAI's own limit is lower)
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_STRUCTURED_CHARS = 64 * 1024    # a schema, pattern, grammar, or the choices together
MAX_CHOICES = 256


def check_structured(spec) -> None:
    """The shape of a `structured` value: one of {"json": <schema as JSON text>},
    {"json_object": ""}, {"regex": <pattern>}, {"choice": [<string>, ...]}, {"grammar": <Lark>}.
    Whether its grammar compiles is workers/grammar.py's to say."""
    _check(isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in STRUCTURED_KINDS,
           f"structured must be an object with one key of {list(STRUCTURED_KINDS)}, got {show(spec)}")
    (kind, value), = spec.items()
    if kind == "choice":
        _check(isinstance(value, list) and 0 < len(value) <= MAX_CHOICES and all(isinstance(c, str) and c for c in value),
               f"structured choice must be a list of 1 to {MAX_CHOICES} non-empty strings, got {show(value)}")
        size = sum(map(len, value))
    else:
        _check(isinstance(value, str), f"structured {kind} must be a string, got {show(value)}")
        size = len(value)
    _check(size <= MAX_STRUCTURED_CHARS, f"structured {kind} holds {size} characters; at most {MAX_STRUCTURED_CHARS}")


def _logit_bias(bias) -> dict[str, float]:
    """OpenAI's logit_bias: {token id: bias in [-100, 100]}, the id a JSON object's string key
    (an integer key is taken too), kept with canonical string keys (what the wire carries)."""
    _check(isinstance(bias, dict), f"logit_bias must be an object of token id -> bias, got {show(bias)}")
    _check(len(bias) <= MAX_LOGIT_BIAS, f"logit_bias holds {len(bias)} entries; at most {MAX_LOGIT_BIAS}")
    out = {}
    for key, value in bias.items():
        token = key if _is_int(key) else (int(key) if isinstance(key, str) and key.isascii() and key.isdigit()
                                           and len(key) <= 10 else None)
        _check(token is not None and 0 <= token <= MAX_INT32,
               f"logit_bias keys must be token ids (integers >= 0), got {show(key)}")
        _check(_is_finite(value) and -100 <= value <= 100,
               f"logit_bias values must be numbers in [-100, 100], got {show(value)} for token {token}")
        out[str(token)] = float(value)
    return out


def show(x, limit: int = 60) -> str:
    """A value as an error message quotes it: repr, cut to `limit` characters."""
    r = repr(x)
    return r if len(r) <= limit else r[:limit] + f"... ({len(r)} characters)"


def _is_finite(x) -> bool:
    """A real number (not a bool) that converts to a finite float (10**400 does not)."""
    try:
        return _is_number(x) and math.isfinite(x)
    except OverflowError:
        return False


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    HELD = "held"                  # prefill done; blocks kept under a lease for the KV handoff
    RECEIVING = "receiving"        # blocks reserved; KV arriving from a prefill worker
    FINISHED = "finished"


class Sequence:
    """`num_computed_tokens` chases `num_tokens`; there is no prefill or decode phase as such.

    A sequence is "prefilling" while more than one token lacks KV, "decoding" when exactly one
    (its last sampled token) does. Preemption by recompute resets `num_computed_tokens` to 0.
    """
    __slots__ = ("seq_id", "token_ids", "num_prompt_tokens", "params", "priority", "arrival_time",
                 "status", "num_computed_tokens", "finish_reason", "stop_reason", "output_logprobs",
                 "num_cached_tokens", "num_preemptions", "text", "first_token_time", "generator",
                 "block_hashes", "prefill_only", "forks", "prompt_logprobs", "ttft_deadline", "tpot_s", "grammar")

    def __init__(self, seq_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, arrival_time: float | None = None):
        self.seq_id = seq_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority               # lower value = served first (as vLLM)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: str | int | None = None
        self.output_logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.num_cached_tokens = 0             # prompt tokens served by the prefix cache
        self.num_preemptions = 0
        self.text = ""
        self.first_token_time: float | None = None
        self.generator = None                  # per-request torch.Generator when seeded
        self.block_hashes: list[bytes] = []    # chained hashes of its full blocks, as known
        self.prefill_only = False              # stop after the first token and hold the KV
        # Asked for (params.prompt_logprobs): per prompt position from 1, {"logprob", "top"} of
        # its token given those before, as computed; None once sent (or not asked for).
        self.prompt_logprobs: list[dict] | None = [] if params.prompt_logprobs is not None else None
        self.forks: list | None = None         # a carrier: the samples (workers/messages.py Fork) that
        #                                        fork from its prompt's KV, then it ends (n > 1)
        self.ttft_deadline: float | None = None   # when its first token is due, on this worker's clock
        self.tpot_s: float | None = None          # its time-per-output-token target
        self.grammar = None                       # its structured output's matcher (workers/grammar.py GrammarState)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
