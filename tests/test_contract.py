"""The router<->worker contract: every message survives the codec with its types; a field
renamed on one side fails loudly instead of reading as a default; and a real worker (no Ray)
speaks it: ops in, a PollReply with typed events and load out."""
from __future__ import annotations

import contextlib
import dataclasses

import msgpack
import pytest

from common import wait_for
from workers import messages as msg
from workers.sequence import SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, stop=["\n"], stop_token_ids=[7], logprobs=2)
LOAD = msg.LoadReport("decode-0", "decode", waiting=1, running=3, swapped=0, queued_prefill_tokens=0,
                      kv_blocks_used=12, kv_blocks_total=64, steps=9, pending=2, receiving=1,
                      preemptions={"recompute": 1, "swap": 0}, kv_transfer=msg.TransferTotals(4096, 2, 0.5, 1, {"mid_payload": 1}))

EXAMPLES = [
    msg.GenerateOp("r1.0", [1, 2, 3], PARAMS, priority=-1, output_token_ids=[7, 8],
                   forks=[msg.Fork("r1-0.0", PARAMS), msg.Fork("r1-1.0", SamplingParams(seed=5))]),
    msg.PrefillOp("r2.0", [5], PARAMS),
    msg.DecodeOp("r3.1", [1, 2], PARAMS, output_token_ids=[9], prefill_id="prefill-0",
                 forks=[msg.Fork("r3-0.0", PARAMS)]),
    msg.AbortOp("r4.0"),
    msg.TokenEvent("r1.0", [11], finished=True, reason="length", logprobs=[{"logprob": -0.5, "top": {11: -0.5}}]),
    msg.ErrorEvent("r2.0", "KV transfer failed", retryable=True),
    LOAD,
    msg.PollReply([msg.TokenEvent("a", [1], held=True), msg.ErrorEvent("b", "bad")], LOAD, {"step_s": [0.01]}),
    msg.KVSendRequest("r3.1", "decode-0", "10.0.0.2:4711", 17),
    msg.WorkerInfo("decode-0", "decode", 4096, 256, 16, 8192, "torch", "cpu", "127.0.0.1", 4242, 1, [], 10.0, "c1",
                   {"model": "tiny", "cache": {"block_size": 16}}, 1, 64),
]


@pytest.mark.parametrize("m", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_survives_the_codec(m):
    back = msg.decode(msg.encode(m))
    assert type(back) is type(m) and back == m
    for f in dataclasses.fields(m):                    # nested dataclasses come back typed too
        assert type(getattr(back, f.name)) is type(getattr(m, f.name))


def _rewire(payload: bytes, edit) -> bytes:
    d = msgpack.unpackb(payload, strict_map_key=False)
    edit(d)
    return msgpack.packb(d)


def test_a_renamed_field_fails_loudly():
    payload = msg.encode(LOAD)
    renamed = _rewire(payload, lambda d: d.__setitem__("num_running", d.pop("running")))
    with pytest.raises(msg.ContractError, match="LoadReport"):
        msg.decode(renamed)
    extra = _rewire(msg.encode(msg.AbortOp("x")), lambda d: d.__setitem__("reason", "user"))
    with pytest.raises(msg.ContractError, match="AbortOp"):
        msg.decode(extra)
    nested = _rewire(msg.encode(msg.PrefillOp("r", [1], PARAMS)),
                     lambda d: d["params"].__setitem__("max_new_tokens", d["params"].pop("max_tokens")))
    with pytest.raises(msg.ContractError, match="SamplingParams"):
        msg.decode(nested)


def test_unknown_or_unexpected_types_are_refused():
    with pytest.raises(msg.ContractError, match="unknown message type"):
        msg.decode(_rewire(msg.encode(msg.AbortOp("x")), lambda d: d.__setitem__("__t", "KillOp")))
    with pytest.raises(msg.ContractError, match="expected"):
        msg.decode(msg.encode(msg.AbortOp("x")), msg.PollReply)


@contextlib.contextmanager
def local_worker(worker_id: str, role: str, **kw):
    """A Worker object in this process (no actor) on `tiny` with 32 blocks; yields it, drain()
    (one poll: its PollReply, the events appended to `events`) and the events seen so far."""
    from workers.config import CacheConfig, EngineConfig
    from workers.worker import Worker, WorkerSettings
    w = Worker(worker_id, role, EngineConfig(model="tiny", cache=CacheConfig(num_blocks=32)), WorkerSettings(**kw))
    events: list = []

    def drain() -> msg.PollReply:
        reply = msg.decode(w.poll(0.2), msg.PollReply)
        events.extend(reply.events)
        return reply
    try:
        yield w, drain, events
    finally:
        w.shutdown()


def test_a_worker_speaks_the_contract_without_ray(spawns):
    """The worker class itself (not an actor): a PrefillOp runs to its first token and holds the
    KV; an AbortOp frees it; a bad op comes back as an ErrorEvent; the LoadReport says so."""
    with local_worker("prefill-0", "prefill") as (w, drain, events):
        w.submit(msg.encode(msg.PrefillOp("r1", list(range(40)), SamplingParams(temperature=0, max_tokens=8))))
        reply = wait_for(drain, lambda r: r.load.held == 1 and any(isinstance(e, msg.TokenEvent) for e in events))
        first = next(e for e in events if isinstance(e, msg.TokenEvent))
        assert first.rid == "r1" and first.held and len(first.tokens) == 1 and not first.finished
        assert reply.load.kv_blocks_used == 3                        # ceil(40 / 16) blocks held
        w.submit(msg.encode(msg.AbortOp("r1")))
        wait_for(drain, lambda r: r.load.held == 0 and r.load.kv_blocks_used == 0)
        w.submit(msg.encode(msg.PrefillOp("r2", [10**6], SamplingParams())))         # not a token id
        wait_for(drain, lambda r: any(isinstance(e, msg.ErrorEvent) and e.rid == "r2" for e in events))
        with pytest.raises(msg.ContractError):
            w.submit(msg.encode(LOAD))                               # not an operation


def test_a_failed_pull_frees_the_reserved_blocks_and_asks_for_a_retry(spawns):
    """A decode worker whose prefill peer cannot be reached (no such actor): the pull fails, the
    reserved blocks come back, the failure is counted, and the router gets a retryable error
    (the dispatcher then re-runs the request from prefill)."""
    with local_worker("decode-0", "decode", transfer_timeout_s=5, cluster_id="no-such-cluster") as (w, drain, events):
        op = msg.DecodeOp("r1.0", list(range(40)), SamplingParams(temperature=0, max_tokens=8), output_token_ids=[3],
                          prefill_id="prefill-gone")
        w.submit(msg.encode(op))
        reply = wait_for(drain, lambda r: any(isinstance(e, msg.ErrorEvent) for e in events), 30)
        error = next(e for e in events if isinstance(e, msg.ErrorEvent))
        assert error.rid == "r1.0" and error.retryable and "KV transfer failed" in error.error
        assert not [e for e in events if isinstance(e, msg.TokenEvent)]       # nothing decoded from no KV
        reply = wait_for(drain, lambda r: r.load.receiving == 0 and r.load.pending == 0)
        assert reply.load.kv_blocks_used == 0 and reply.load.running == 0
        assert reply.load.kv_transfer.failures == 1 and reply.load.kv_transfer.count == 0
