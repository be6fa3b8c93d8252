"""Several routers on one worker: each reads its own requests' events (and everyone's load,
samples and cache changes) from an outbox of its own, and holds a lease there; when a router
stops renewing it, the worker ends that router's requests and frees their blocks, and leaves
the other routers' requests as they were."""
from __future__ import annotations

import contextlib

import pytest
import zmq

from common import Clock, wait_for
from router.events import client_keys, curve_client
from workers import messages as msg
from workers.config import CacheConfig, EngineConfig
from workers.engine import LLMEngine
from workers.leases import RouterLeases
from workers.names import check_name, owner_of, owner_tag
from workers.sequence import SamplingParams

# A worker's stream binds on Ray's view of this node's address (workers/node.py node_ip), which starts
# a Ray in this process when none runs: the session's, so that later modules can use it.
pytestmark = pytest.mark.usefixtures("ray_session")


def test_a_lease_lapses_without_renewal_and_says_so_once_renewed():
    clock = Clock()
    leases = RouterLeases(lease_s=2.0, forget_after_s=10.0, clock=clock)
    assert leases.renew("a~1") and leases.renew("b~1")          # new owners: nothing was lost
    clock.t += 1.5
    assert leases.renew("b~1") and leases.lapsed() == []
    clock.t += 1.0                                            # a: 2.5 s silent; b: 1.0 s
    assert leases.lapsed() == ["a~1"] and leases.lapsed() == [] and leases.num_live == 1
    assert leases.renew("a~1") is False                         # its requests were ended: it hears so
    assert leases.renew("a~1") is True and leases.num_live == 2
    clock.t += 3.0
    assert sorted(leases.lapsed()) == ["a~1", "b~1"]
    clock.t += 9.0
    assert leases.forgotten() == []
    clock.t += 1.0
    assert sorted(leases.forgotten()) == ["a~1", "b~1"] and leases.forgotten() == []
    with pytest.raises(ValueError):
        RouterLeases(lease_s=0)


def test_owner_tags():
    tag = owner_tag("edge-1")
    assert tag.startswith("edge-1~") and tag != owner_tag("edge-1")       # a new incarnation each time
    assert owner_of(f"{tag}/r7.0") == tag and owner_of(f"{tag}/r7-1.0") == tag and owner_of("r7.0") == ""
    for bad in ("", "a/b", "a~b", "x" * 65, "é"):
        with pytest.raises(ValueError, match="--router-id"):
            check_name(bad)


class Reader:
    """A router's end of one worker stream (a ZeroMQ PULL socket), collecting every frame."""

    def __init__(self, stream: tuple[str, str]):
        address, server_key = stream          # what stream_events answers
        self.sock = zmq.Context.instance().socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        curve_client(self.sock, server_key)
        self.sock.connect(address)
        self.events: list = []
        self.frames: list[msg.PollReply] = []

    def read(self) -> int:
        """Every frame that has arrived (waiting up to 0.2 s for the first); how many."""
        n = 0
        while self.sock.poll(200 if n == 0 else 0):
            reply = msg.decode(self.sock.recv(), msg.PollReply)
            self.frames.append(reply)
            self.events.extend(reply.events)
            n += 1
        return n

    def tokens(self, rid: str) -> list[int]:
        return [t for e in self.events if isinstance(e, msg.TokenEvent) and e.rid == rid for t in e.tokens]

    def finished(self, rid: str) -> bool:
        return any(isinstance(e, msg.TokenEvent) and e.rid == rid and e.finished for e in self.events)

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def local_worker(**kw):
    """A colocated Worker object in this process (no actor) on `tiny`, 160 blocks of 16 tokens."""
    from workers.worker import Worker, WorkerSettings
    w = Worker("colocated-0", "colocated", EngineConfig(model="tiny", cache=CacheConfig(num_blocks=160)),
               WorkerSettings(**kw))
    try:
        yield w
    finally:
        w.shutdown()


KEY = client_keys()[0].decode()         # this process's CURVE public key, as a router gives it
PROMPT_A, PROMPT_B = list(range(3, 40)), list(range(50, 90))
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def offline(prompt: list[int], params: SamplingParams) -> list[int]:
    engine = LLMEngine(EngineConfig(model="tiny", cache=CacheConfig(num_blocks=32)))
    try:
        return engine.generate([{"prompt_token_ids": prompt, "params": params}])[0].token_ids
    finally:
        engine.close()


def test_each_router_reads_its_own_requests_and_everyones_load():
    """Two owners' requests on one worker: each stream carries only its owner's events (the
    same tokens as the offline engine), and both carry the load reports and step samples."""
    a, b = owner_tag("a"), owner_tag("b")
    with local_worker() as w:
        ra, rb = Reader(w.stream_events(a, KEY)), Reader(w.stream_events(b, KEY))
        assert w.stream_events(a, KEY) == w.stream_events(a, KEY) != w.stream_events(b, KEY)    # one stream per owner
        try:
            w.submit(msg.encode(msg.GenerateOp(f"{a}/r0.0", PROMPT_A, GREEDY)))
            w.submit(msg.encode(msg.GenerateOp(f"{b}/r0.0", PROMPT_B, GREEDY)))
            wait_for(lambda: (ra.read(), rb.read()), lambda _: ra.finished(f"{a}/r0.0") and rb.finished(f"{b}/r0.0"),
                     60)
            assert {e.rid for e in ra.events} == {f"{a}/r0.0"} and {e.rid for e in rb.events} == {f"{b}/r0.0"}
            assert ra.tokens(f"{a}/r0.0") == offline(PROMPT_A, GREEDY)
            assert rb.tokens(f"{b}/r0.0") == offline(PROMPT_B, GREEDY)
            for r in (ra, rb):              # each saw the steps, and a report counting both leases
                assert sum(len(f.samples["step_s"]) for f in r.frames) > 0
                assert max(f.load.routers for f in r.frames) == 2
        finally:
            ra.close()
            rb.close()


def test_a_lapsed_router_loses_only_its_own_requests():
    """Router a stops renewing its lease mid-request; b renews. The worker ends a's requests
    (one running, one prefilled and held for a handoff), frees their blocks and tells a's
    outbox; b's request finishes with the offline engine's tokens."""
    a, b = owner_tag("a"), owner_tag("b")
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)     # seconds of decoding
    want_b = offline(PROMPT_B, GREEDY)            # (before: b's lease must not lapse meanwhile)
    with local_worker(router_lease_s=1.0) as w:
        ra, rb = Reader(w.stream_events(a, KEY)), Reader(w.stream_events(b, KEY))
        try:
            w.submit(msg.encode(msg.GenerateOp(f"{a}/r0.0", PROMPT_A, long)))
            w.submit(msg.encode(msg.PrefillOp(f"{a}/r1.0", PROMPT_B, GREEDY)))
            w.submit(msg.encode(msg.GenerateOp(f"{b}/r0.0", PROMPT_B, GREEDY)))

            def beat():                     # b is alive; a is silent from here on
                assert w.heartbeat(b)
                return ra.read(), rb.read()
            wait_for(beat, lambda _: ra.tokens(f"{a}/r0.0") and any(
                isinstance(e, msg.TokenEvent) and e.held for e in ra.events), 30)
            wait_for(beat, lambda _: {e.rid for e in ra.events if isinstance(e, msg.ErrorEvent)}
                     == {f"{a}/r0.0", f"{a}/r1.0"}, 30)
            errors = [e for e in ra.events if isinstance(e, msg.ErrorEvent)]
            assert all(e.retryable and e.cause == "lease_expired" for e in errors)
            assert not ra.finished(f"{a}/r0.0") and len(ra.tokens(f"{a}/r0.0")) < long.max_tokens
            wait_for(beat, lambda _: rb.finished(f"{b}/r0.0"), 60)
            assert rb.tokens(f"{b}/r0.0") == want_b
            assert not [e for e in rb.events if isinstance(e, msg.ErrorEvent)]
            assert w.heartbeat(b)
            stats = w.stats()
            assert (stats.kv_blocks_used, stats.running, stats.waiting, stats.held) == (0, 0, 0, 0)
            assert stats.lease_expiries == 1 and stats.lease_aborts == 2 and stats.routers == 1
            assert w.heartbeat(a) is False and w.heartbeat(a) is True     # a, back: told once
        finally:
            ra.close()
            rb.close()


def test_a_router_that_leaves_ends_its_requests_without_a_lapse():
    """A router that stops cleanly says so (`leave`): its requests end at once and their blocks
    come back; no lease lapses, so none is counted."""
    a = owner_tag("a")
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    with local_worker(router_lease_s=30.0) as w:
        ra = Reader(w.stream_events(a, KEY))
        try:
            w.submit(msg.encode(msg.GenerateOp(f"{a}/r0.0", PROMPT_A, long)))
            wait_for(lambda: ra.read(), lambda _: ra.tokens(f"{a}/r0.0"), 30)
            w.leave(a)
            stats = wait_for(w.stats, lambda s: s.running == 0 and s.kv_blocks_used == 0, 10)
            assert (stats.routers, stats.lease_expiries, stats.lease_aborts) == (0, 0, 0)
            assert len(ra.tokens(f"{a}/r0.0")) < long.max_tokens
        finally:
            ra.close()


def test_a_draining_worker_refuses_new_requests_for_a_retry_elsewhere():
    """The leading router drains a worker (`set_accepting(False)`): a request from any router
    that arrives then is refused with a retryable error (its router resumes it on another
    worker), while what runs finishes; the reports say so; taken back, it accepts again."""
    a = owner_tag("a")
    with local_worker() as w:
        ra = Reader(w.stream_events(a, KEY))
        try:
            w.submit(msg.encode(msg.GenerateOp(f"{a}/r0.0", PROMPT_A, GREEDY)))
            wait_for(lambda: ra.read(), lambda _: ra.tokens(f"{a}/r0.0"), 30)
            w.set_accepting(False)
            assert w.stats().accepting is False
            w.submit(msg.encode(msg.GenerateOp(f"{a}/r1.0", PROMPT_B, GREEDY)))
            wait_for(lambda: ra.read(), lambda _: ra.finished(f"{a}/r0.0") and any(
                isinstance(e, msg.ErrorEvent) and e.rid == f"{a}/r1.0" for e in ra.events), 30)
            refused = next(e for e in ra.events if isinstance(e, msg.ErrorEvent))
            assert refused.retryable and refused.cause == "worker_draining" and not ra.tokens(f"{a}/r1.0")
            assert ra.tokens(f"{a}/r0.0") == offline(PROMPT_A, GREEDY)          # what ran, finished
            w.set_accepting(True)
            w.submit(msg.encode(msg.GenerateOp(f"{a}/r2.0", PROMPT_B, GREEDY)))
            wait_for(lambda: ra.read(), lambda _: ra.finished(f"{a}/r2.0"), 30)
            assert ra.tokens(f"{a}/r2.0") == offline(PROMPT_B, GREEDY) and w.stats().accepting
        finally:
            ra.close()


def test_a_worker_takes_at_most_max_routers():
    """Each router holds a stream (a socket and a thread) and a pending call on a worker: past
    MAX_ROUTERS live ones, another is refused clearly; a lapsed one's place frees."""
    from workers.worker import MAX_ROUTERS
    clock = Clock()
    with local_worker() as w:
        w.leases.clock = clock
        owners = [owner_tag(f"r{i}") for i in range(MAX_ROUTERS)]
        addresses = {w.stream_events(o, KEY) for o in owners}
        assert len(addresses) == MAX_ROUTERS and w.ready().routers == MAX_ROUTERS
        with pytest.raises(RuntimeError, match="the most it takes"):
            w.stream_events(owner_tag("one-more"), KEY)
        assert w.stream_events(owners[0], KEY) in addresses                  # one already in: its stream again
        clock.t += w.leases.lease_s + 1
        for o in owners[1:]:
            w.heartbeat(o)
        wait_for(lambda: w.ready().routers, lambda n: n == MAX_ROUTERS - 1, 10)   # owners[0] lapsed
        w.stream_events(owner_tag("one-more"), KEY)
