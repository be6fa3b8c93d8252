"""One request's state inside a worker: its tokens, how many have KV, and how it ends."""
from __future__ import annotations

import enum
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

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
               and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0,
               f"temperature must be a number >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= -1,
               f"top_k must be -1, 0 (off) or a positive count, got {self.top_k!r}")
        _check(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        _check(isinstance(self.stop, list) and all(isinstance(x, str) and x for x in self.stop),
               f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        _check(isinstance(self.stop_token_ids, list) and all(_is_int(t) for t in self.stop_token_ids),
               f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        _check(isinstance(self.ignore_eos, bool), f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               f"logprobs must be an integer between 0 and 20, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))     # the request fields that sample


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
                 "block_hashes", "prefill_only")

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
