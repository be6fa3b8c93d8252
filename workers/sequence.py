"""One request's state inside a worker: its tokens, how many have KV, and how it ends."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


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
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive count, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
