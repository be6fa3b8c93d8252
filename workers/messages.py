"""The contract between the router and the workers: typed messages, one msgpack codec.

    router ──encode(GenerateOp | PrefillOp | DecodeOp | AbortOp)──▶ worker.submit
    router ◀──decode(PollReply{events: [TokenEvent | ErrorEvent], load: LoadReport, samples})── worker.poll
    decode worker ──KVSendRequest──▶ prefill worker.send_kv;  both sides exchange a TransferHeader

Every message is a dataclass registered here; `encode` writes it as a msgpack map tagged with
its type, `decode` rebuilds the dataclass (nested ones included). A field renamed or added on
one side only fails loudly (`ContractError`), never reads as a default. Plain Python: the
simulator and the tests use the same types without Ray or torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

import msgpack

from workers.sequence import SamplingParams

_TAG = "__t"
_TYPES: dict[str, type] = {}        # tag -> class


class ContractError(ValueError):
    """A message that does not match this side's types (a renamed, missing or unknown field)."""


def message(cls):
    """Register a dataclass as a wire message (its class name is its tag)."""
    _TYPES[cls.__name__] = cls
    return cls


message(SamplingParams)             # the sampling parameters travel as they are declared


# -- router -> worker: operations -----------------------------------------------------------
@message
@dataclass(slots=True)
class HeldKV:
    """Where a held prompt's KV lies in its prefill worker's shared-memory cache: its blocks in
    token order and each block's allocation count then (workers/kv_shm.py). A decode worker on
    the same node copies them itself; the counts, unchanged after its copy, prove that no block
    was given to other KV meanwhile."""
    block_ids: list[int]
    generations: list[int]
    segment: int                      # which cache: its KVSegment.nonce (a restarted worker has a new one)


@message
@dataclass(slots=True)
class Fork:
    """One of a request's samples (`n` > 1): a sequence of its own, with its own id and seed,
    that starts from the prompt's KV its carrier computed or received (the full blocks shared,
    the last partial one copied) and samples its first token itself."""
    rid: str
    params: SamplingParams


@message
@dataclass(slots=True)
class GenerateOp:
    """Colocated: run the whole request. `output_token_ids`: tokens the client already has (a
    resumed request): they are recomputed with the prompt, and generation continues after them.
    With `forks`, this request is a carrier: once its prompt is computed the forks start from
    its KV and it ends (a TokenEvent finished with reason "forked"); its own token is not sent.
    `ttft_left_s`: its next token is due this long after it arrives (the router's deadline less
    the time already spent: router and worker clocks differ, so what is left travels);
    `tpot_s`: its TPOT target. None: no deadline (see the scheduler's deadline policy)."""
    rid: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)
    ttft_left_s: float | None = None
    tpot_s: float | None = None
    trace: str = ""                   # traced: the W3C traceparent of the router's span for this attempt


@message
@dataclass(slots=True)
class PrefillOp(GenerateOp):
    """Run the prompt to its first token, then hold its KV for a decode worker to pull."""


@message
@dataclass(slots=True)
class DecodeOp:
    """Reserve blocks when there is room, pull the KV from `prefill_id`, decode on. The prefill
    worker holds the KV of every token but the last of prompt + output_token_ids. With `forks`,
    a carrier (as GenerateOp's): the forks start from the received KV, and it ends."""
    rid: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int]       # already sent to the client; the last one sampled by prefill
    prefill_id: str
    priority: int = 0
    forks: list[Fork] = field(default_factory=list)
    tpot_s: float | None = None       # its TPOT target (its first token is out already)
    kv: HeldKV | None = None          # the held event's: copied straight out of a same-node prefill worker
    # Sent while the prompt is still being prefilled (`kv`: its blocks computed so far): blocks
    # are reserved for the KV of prompt + output_token_ids and the token to come, the copy
    # follows the prefill chunk by chunk (KVMoreOp), and the last KVMoreOp brings that token.
    streaming: bool = False
    trace: str = ""                   # as GenerateOp's


@message
@dataclass(slots=True)
class KVMoreOp:
    """A streaming DecodeOp's next word from the router: more of the prompt's blocks computed
    (`kv` names every block so far, in token order), or, with `output_token_ids` (every output
    token, the one the prefill worker just sampled last), the held KV itself: the copy ends
    with it and the sequence decodes on."""
    rid: str
    kv: HeldKV
    output_token_ids: list[int] | None = None


@message
@dataclass(slots=True)
class AbortOp:
    """End the request wherever it is and free its blocks (idempotent)."""
    rid: str


Op = GenerateOp | PrefillOp | DecodeOp | KVMoreOp | AbortOp


# -- worker -> router: events, load, samples ------------------------------------------------
@message
@dataclass(slots=True)
class TraceRecord:
    """What a worker timed of a traced request (an op with a `trace`), for the router to turn
    into spans under `parent`, the op's traceparent. Times are seconds since the epoch on this
    worker's own clock. `part`: "prefill" (to the first token: `marks` arrived, first_step,
    first_token), "decode" (from the handoff to the end: arrived, reserved, pull_start,
    pull_end, committed, finished; a colocated request's decode part starts at first_token);
    `steps`: [start, end, tokens computed] of the engine steps that ran it (at most
    MAX_TRACED_STEPS: `attrs["steps_left_out"]` counts the rest); `attrs`: the handoff's bytes,
    blocks skipped (the prefix cache held them) and transport."""
    parent: str
    worker_id: str
    part: str
    marks: dict[str, float] = field(default_factory=dict)
    steps: list[list[float]] = field(default_factory=list)
    attrs: dict = field(default_factory=dict)


MAX_TRACED_STEPS = 512


@message
@dataclass(slots=True)
class TokenEvent:
    """New tokens of a request; `held`: prefill done, its KV is held under a lease. No tokens
    and `kv` but not held: a long prompt's prefill got further (`kv`: its full blocks computed
    so far), for a decode worker to copy while the rest is computed."""
    rid: str
    tokens: list[int]
    finished: bool = False
    reason: str | None = None         # "stop" | "length" when finished ("forked": a carrier's forks started)
    logprobs: list | None = None
    held: bool = False
    prompt_logprobs: list | None = None   # asked for: each prompt token's from the second, with the first output
    kv: HeldKV | None = None          # held, by a worker whose cache is in shared memory: where its KV is
    trace: TraceRecord | None = None  # traced: a part of the request this worker has finished


@message
@dataclass(slots=True)
class ErrorEvent:
    """The request ended in an error. Retryable ones (a failed handoff, a dead peer) are run
    again from prefill by the router; the others reach the client as a 4xx."""
    rid: str
    error: str
    retryable: bool = False
    cause: str = ""                   # retryable: "handoff_failed", "worker_died", "worker_hung"


Event = TokenEvent | ErrorEvent


@message
@dataclass(slots=True)
class TransferTotals:
    """A decode worker's cumulative KV pulls."""
    bytes: int = 0
    count: int = 0
    seconds: float = 0.0
    failures: int = 0
    failures_by_point: dict[str, int] = field(default_factory=dict)    # workers/faults.py's FAILURE_POINTS
    blocks_reused: int = 0            # blocks not pulled: the receiver's prefix cache held them


@message
@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker's answer to `ready()` (through Ray, also a message here): who it is, its engine's
    shape, where it runs, and how many routers it streams to."""
    worker_id: str
    role: str
    max_model_len: int
    num_blocks: int
    block_size: int
    bytes_per_block: int
    attention_backend: str
    device: str
    node: str                          # the address other nodes reach it at
    pid: int
    tensor_parallel_size: int
    rank_pids: list[int]               # its other tensor-parallel ranks' processes
    router_lease_s: float
    cluster_id: str
    engine: dict                       # its EngineConfig, as a dict
    routers: int                       # routers it streams to now
    max_routers: int


@message
@dataclass(slots=True)
class LoadReport:
    """A worker's state at one poll: gauges and cumulative counters (the router turns their
    growth into Prometheus counters)."""
    worker_id: str
    role: str
    waiting: int                      # sequences queued for their first scheduling
    running: int                      # sequences in the running batch
    swapped: int
    queued_prefill_tokens: int        # prompt tokens not yet computed, over the waiting queue
    kv_blocks_used: int
    kv_blocks_total: int
    steps: int                        # engine steps so far
    held: int = 0                     # prefill: requests whose KV waits for a pull
    pending: int = 0                  # decode: requests waiting for room to reserve blocks
    receiving: int = 0                # decode: reserved, KV arriving
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: dict[str, int] = field(default_factory=dict)      # mode -> count
    kv_transfer: TransferTotals = field(default_factory=TransferTotals)
    routers: int = 0                  # routers holding a live lease here (workers/leases.py)
    accepting: bool = True            # False: draining (the leading router's word); new requests are refused
    lease_expiries: int = 0           # routers' leases that lapsed here, and the requests that ended with them
    lease_aborts: int = 0
    max_seqs: int = 0                 # its sequence limit (the scheduler's max_num_seqs; 0: not told)
    # Output tokens left to the running sequences that end soonest, fewest first (at most
    # ENDS_REPORTED, a bound from max_tokens: an end of sequence comes sooner): when its sequence
    # slots free, which a colocated prompt past the limit waits for (router/picker.py `slot_ends`).
    ends_in: list[int] = field(default_factory=list)


ENDS_REPORTED = 64


SAMPLE_KINDS = ("step_s", "step_cpu_s", "batch_size", "step_tokens", "queue_s", "kv_transfer_s", "kv_tail_s", "step_shape")
# "step_cpu_s": the CPU the engine's thread spent in that step (its wall time, "step_s", less the
# time it waited for a core, or slept waiting for the device). "kv_tail_s": what a pull had left
# to do once the prompt was held (all of it, unless it was streamed during the prefill). A
# "step_shape" sample is one step's seconds followed by its BatchShape's fields, in order
# (workers/cost_model.py): the controller fits the cost model on them while serving.


@message
@dataclass(slots=True)
class PollReply:
    events: list                      # TokenEvent | ErrorEvent, in order
    load: LoadReport
    samples: dict[str, list]          # SAMPLE_KINDS -> values since the last poll
    cache_stored: list[bytes] = field(default_factory=list)    # block hashes the prefix cache indexed,
    cache_evicted: list[bytes] = field(default_factory=list)   # and evicted, since the last poll, in order


# -- the KV handoff ---------------------------------------------------------------------------
@message
@dataclass(slots=True)
class KVSendRequest:
    """A decode worker asks the prefill worker holding `rid` to send its prompt KV."""
    rid: str
    peer_id: str                      # the receiving worker
    store_addr: str                   # "host:port" of its rendezvous store
    transfer_id: int                  # both sides check it: a reordering fails, never swaps KV
    skip: int = 0                     # leading blocks the receiver's prefix cache holds: not sent
    secret: str = ""                  # the receiver's secret for this pair (workers/kv_transfer.py): only via Ray


@dataclass(frozen=True, slots=True)
class TransferHeader:
    """What both sides of one transfer exchange before the payload (as two int64s on the
    transport's own channel, not msgpack: it travels through the collective library)."""
    num_blocks: int                   # REFUSED: the sender has nothing for this transfer
    transfer_id: int

    REFUSED: ClassVar[int] = -1

    def as_ints(self) -> list[int]:
        return [self.num_blocks, self.transfer_id]

    @classmethod
    def from_ints(cls, ints: list[int]) -> TransferHeader:
        return cls(*ints)


# -- tensor parallelism: rank 0's step broadcast to the other ranks (workers/tensor_parallel.py) --
@message
@dataclass(slots=True)
class TPTensor:
    """A tensor as bytes: its dtype's name, its shape and its contiguous bytes."""
    dtype: str
    shape: list[int]
    data: bytes


@message
@dataclass(slots=True)
class TPChunk:
    """workers/attention.py's PrefillChunk."""
    start: int
    end: int
    num_context: int
    block_table: TPTensor | None


@message
@dataclass(slots=True)
class TPMeta:
    """workers/attention.py's AttentionMetadata, without its per-rank caches (built where used)."""
    slot_mapping: TPTensor
    num_decodes: int
    decode_max_context: int
    num_paged_rows: int
    paged_block_tables: TPTensor | None
    paged_context_lens: TPTensor | None
    paged_cu_seqlens_q: TPTensor | None
    prefills: list[TPChunk]


@message
@dataclass(slots=True)
class TPStep:
    """One step for ranks 1..N-1 (tensor_parallel.StepInputs); `stop`: none follows, leave."""
    copies: list[list[int]] = field(default_factory=list)
    swap_out: list[list[int]] = field(default_factory=list)
    swap_in: list[list[int]] = field(default_factory=list)
    input_ids: TPTensor | None = None
    positions: TPTensor | None = None
    meta: TPMeta | None = None
    stop: bool = False


# -- the codec ----------------------------------------------------------------------------------
def _to_wire(obj):
    if _TYPES.get(type(obj).__name__) is type(obj):
        d = {f.name: _to_wire(getattr(obj, f.name)) for f in fields(obj)}
        d[_TAG] = type(obj).__name__
        return d
    if isinstance(obj, (list, tuple)):
        return [_to_wire(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_wire(v) for k, v in obj.items()}
    return obj


def _from_wire(d: dict):
    tag = d.get(_TAG)
    if tag is None:
        return d
    cls = _TYPES.get(tag)
    if cls is None:
        raise ContractError(f"unknown message type {tag!r}")
    kw = {k: v for k, v in d.items() if k != _TAG}
    try:
        return cls(**kw)
    except TypeError as e:              # a renamed, missing or unknown field
        raise ContractError(f"{tag}: {e}") from None


def encode(msg) -> bytes:
    return msgpack.packb(_to_wire(msg))


def decode(payload: bytes, expect: type | tuple[type, ...] | None = None):
    """bytes -> the message; with `expect`, a message of another type is a ContractError."""
    msg = msgpack.unpackb(payload, strict_map_key=False, object_hook=_from_wire)
    if expect is not None and not isinstance(msg, expect):
        raise ContractError(f"expected {expect}, got {type(msg).__name__}")
    return msg
