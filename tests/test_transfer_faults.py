"""Injected KV-transfer faults (workers/faults.py): a handoff failed or stalled at each point,
on either side, breaks cleanly and recovers.

- The plan: parsing, counts, clear refusals.
- Transport (a spawned child process sends, this process receives, over Gloo): a fault at each
  point fails the side it hits and, where the bytes had not all crossed, the other side at
  once (not at its deadline); the next transfer on the same pair rebuilds it and moves exactly
  the sender's blocks; a stall only slows a transfer, or times it out past its deadline. A `mid_payload` fault on the receiver leaves half the layers written (the partly
  received blocks of vLLM's issue #21570), which the worker tests show are never computed on.
- Workers (real actors on Ray; the decode side also as a Worker object in this process, to look
  at its engine): the pull fails with a retryable error, the blocks come back on both sides,
  the failure is counted under its point, and the request completes when run again.
- Lease expiry on the prefill side, on an injected clock.
"""
from __future__ import annotations

import pickle
import time

import pytest
import torch

from common import CHILD_START_S, Child, wait_for
from workers.faults import ENV_VAR, FAILURE_POINTS, FaultPlan, FaultSpecError, InjectedFault
from workers.kv_transfer import GlooTransport, KVLayout, KVTransferError, KVTransferTimeout

LAYOUT = {"num_layers": 4, "block_size": 16, "num_kv_heads": 2, "head_dim": 16}
HOST = "127.0.0.1"
TIMEOUT_S = 3.0             # one transfer's timeout in the transport tests


# -- the plan -------------------------------------------------------------------------------------
def test_a_plan_parses_acts_at_its_points_and_counts():
    plan = FaultPlan.parse(" recv:mid_payload:fail*1 , send:before_header:delay=0.05*2,recv:before_commit:fail")
    assert str(plan) == "recv:mid_payload:fail*1,send:before_header:delay=0.05*2,recv:before_commit:fail"
    assert str(FaultPlan.parse(str(plan))) == str(plan)
    with pytest.raises(InjectedFault, match="recv:mid_payload") as e:
        plan.hit("recv", "mid_payload")
    assert (e.value.side, e.value.point) == ("recv", "mid_payload")
    back = pickle.loads(pickle.dumps(e.value))                 # it crosses processes (Ray) whole
    assert (type(back), back.side, back.point, str(back)) == (InjectedFault, "recv", "mid_payload", str(e.value))
    assert plan.hit("recv", "mid_payload") == 0.0               # *1: used up, a retry gets through
    t0 = time.monotonic()
    assert plan.hit("send", "before_header") == 0.05 and plan.hit("send", "before_header") == 0.05
    assert time.monotonic() - t0 >= 0.1
    assert plan.hit("send", "before_header") == 0.0
    assert plan.hit("recv", "before_header") == 0.0             # another side or point: no rule
    for _ in range(3):                                         # no count: every time
        with pytest.raises(InjectedFault):
            plan.hit("recv", "before_commit")
    assert plan.hits == {"recv:mid_payload": 1, "send:before_header": 2, "recv:before_commit": 3}
    assert not FaultPlan.parse("") and not FaultPlan.parse(None) and plan


@pytest.mark.parametrize("spec,words", [
    ("recv:mid_payload", "side:point:action"),
    ("prefill:mid_payload:fail", "side must be one of"),
    ("recv:middle:fail", "point must be one of"),
    ("send:before_commit:fail", "before_commit is a recv point"),
    ("recv:before_header:crash", "action must be fail or delay=SECONDS"),
    ("recv:before_header:delay=soon", "delay must be a number"),
    ("recv:before_header:delay=-1", "delay must be a number"),
    ("recv:before_header:fail*0", "whole number >= 1"),
    ("recv:before_header:fail*x", "whole number >= 1"),
])
def test_a_malformed_plan_is_refused_naming_the_rule(spec, words):
    with pytest.raises(FaultSpecError, match=words) as e:
        FaultPlan.parse(f"recv:after_payload:fail,{spec}")
    assert repr(spec) in str(e.value)


def test_the_plan_comes_from_the_environment(monkeypatch):
    assert not FaultPlan.from_env({})
    assert str(FaultPlan.from_env({ENV_VAR: "send:mid_payload:fail*1"})) == "send:mid_payload:fail*1"
    with pytest.raises(FaultSpecError, match=ENV_VAR):
        FaultPlan.from_env({ENV_VAR: "send:mid_payload"})
    # A worker reads it when it starts, and refuses a malformed one before loading its model.
    from workers.config import EngineConfig
    from workers.worker import Worker
    monkeypatch.setenv(ENV_VAR, "recv:mid_payload:explode")
    with pytest.raises(FaultSpecError, match=f"{ENV_VAR}.*recv:mid_payload:explode"):
        Worker("decode-env", "decode", EngineConfig(model="no-such-model"))


# -- transport: a child process sends --------------------------------------------------------------
def make_caches(num_blocks: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, LAYOUT["block_size"], LAYOUT["num_kv_heads"], LAYOUT["head_dim"])
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(LAYOUT["num_layers"])]


def clone(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


_SENDERS: dict[str, tuple[GlooTransport, list]] = {}


def _op_setup(worker_id, num_blocks, seed):
    _SENDERS[worker_id] = (GlooTransport(worker_id, "cpu", HOST), make_caches(num_blocks, seed))
    return True


def _op_send(worker_id, peer_id, peer, block_ids, timeout_s, transfer_id, faults):
    """`peer`: the receiver's KVPeer for this sender (its address and the pair's secret)."""
    t, caches = _SENDERS[worker_id]
    assert peer.worker_id == peer_id
    return t.send_blocks(peer, caches, block_ids, timeout_s, transfer_id,
                         FaultPlan.parse(faults))


def _op_caches(worker_id):
    return _SENDERS[worker_id][1]


def _op_num_connects(worker_id):
    return _SENDERS[worker_id][0].num_connects


@pytest.fixture(scope="module")
def child(spawns):
    c = Child("test_transfer_faults")
    try:
        c.start("num_connects", "nobody")                  # any answer: the child is up
        assert c.conn.poll(CHILD_START_S), "the child process did not start"
        c.conn.recv()
        yield c
    finally:
        c.close()


class Pair:
    """The child's sender `p` and this process's receiver `d`, with their caches."""

    def __init__(self, child: Child, name: str):
        self.child, self.p, self.tid = child, f"p-{name}", 0
        child.call("setup", self.p, 32, 1)
        self.d = GlooTransport(f"d-{name}", "cpu", HOST)
        self.caches = make_caches(24, 2)

    def transfer(self, src, dst, send_faults="", recv_faults="", timeout_s=TIMEOUT_S):
        """Both sides at once: (receiver's bytes or exception, receiver's seconds), child's result."""
        self.tid += 1
        self.child.start("send", self.p, self.d.worker_id, self.d.peer_for(self.p), src, timeout_s, self.tid, send_faults)
        t0 = time.monotonic()
        try:
            got = self.d.recv_blocks(self.p, self.caches, dst, timeout_s, self.tid, FaultPlan.parse(recv_faults))
        except Exception as e:
            got = e
        return (got, time.monotonic() - t0), self.child.result()

    def assert_exact(self, src, dst):
        """A clean transfer moves exactly the sender's src blocks into dst, nothing else."""
        before = clone(self.caches)
        (got, _), (status, sent, _) = self.transfer(src, dst)
        assert status == "ok", sent
        assert got == sent == len(src) * KVLayout.of(self.caches).bytes_per_block
        theirs = self.child.call("caches", self.p)
        others = torch.ones(self.caches[0][0].shape[0], dtype=torch.bool)
        others[dst] = False
        for (sk, sv), (rk, rv), (bk, bv) in zip(theirs, self.caches, before):
            assert torch.equal(rk[dst], sk[src]) and torch.equal(rv[dst], sv[src])
            assert torch.equal(rk[others], bk[others]) and torch.equal(rv[others], bv[others])


SRC, DST = [3, 30, 7], [11, 2, 20]
# side:point -> does the other side fail too? (after_payload: the bytes are all across already;
# the worker learns of a sender failing there from its send_kv call, tested below)
TRANSPORT_FAULTS = {"send:before_header": True, "send:mid_payload": True, "send:after_payload": False,
                    "recv:before_header": True, "recv:mid_payload": False, "recv:after_payload": False}


@pytest.mark.parametrize("where", TRANSPORT_FAULTS)
def test_a_failed_transfer_breaks_cleanly_and_the_pair_recovers(child, where):
    """On a pair whose group is cached: the faulty side raises (an InjectedFault under a
    KVTransferError naming the point); the other side fails too unless every byte had crossed;
    the receiver's blocks hold exactly what crossed; the next transfer rebuilds the group on
    both sides (one connect each) and is exact, and the one after reuses it."""
    side, point = where.split(":")
    pair = Pair(child, where.replace(":", "-").replace("_", "-"))
    pair.assert_exact([0, 1], [5, 6])                              # the pair's group is built and cached
    before = clone(pair.caches)
    (got, recv_s), (status, value, send_s) = pair.transfer(
        SRC, DST, send_faults=f"{where}:fail" if side == "send" else "",
        recv_faults=f"{where}:fail" if side == "recv" else "")

    if side == "send":
        assert status == "err" and value[0] == "KVTransferError" and value[3] == "InjectedFault", value
        assert value[2] == point and f"send:{point}" in value[1]
    else:
        assert isinstance(got, KVTransferError) and not isinstance(got, KVTransferTimeout), got
        assert isinstance(got.__cause__, InjectedFault) and got.point == point
    if TRANSPORT_FAULTS[where]:          # the other side fails too, at once (not at its deadline)
        if side == "send":
            assert isinstance(got, KVTransferError) and not isinstance(got, KVTransferTimeout), got
            assert recv_s < TIMEOUT_S - 1, recv_s
        else:
            assert status == "err" and value[0] == "KVTransferError", value
            assert send_s < TIMEOUT_S - 1, send_s
    else:                                                           # the other side finished
        nbytes = len(SRC) * KVLayout.of(pair.caches).bytes_per_block
        if side == "recv":
            assert (status, value) == ("ok", nbytes)
        else:
            assert got == nbytes, got

    # What the receiver's blocks hold: untouched unless the payload arrived; half the layers
    # at recv:mid_payload (the partly received blocks the worker must never commit).
    theirs = child.call("caches", pair.p)
    half = LAYOUT["num_layers"] // 2
    for layer, ((sk, sv), (rk, rv), (bk, bv)) in enumerate(zip(theirs, pair.caches, before)):
        arrived = point == "after_payload" or (where == "recv:mid_payload" and layer < half)
        for s, r, b in ((sk, rk, bk), (sv, rv, bv)):
            assert torch.equal(r[DST], s[SRC] if arrived else b[DST]), (layer, arrived)

    connects = child.call("num_connects", pair.p), pair.d.num_connects
    pair.assert_exact([8, 9, 31], [0, 1, 23])                      # the same pair, rebuilt on both sides
    assert child.call("num_connects", pair.p) == connects[0] + 1 and pair.d.num_connects == connects[1] + 1
    pair.assert_exact([4], [3])                                    # and cached again
    assert pair.d.num_connects == connects[1] + 1


@pytest.mark.parametrize("side", ["send", "recv"])
def test_a_peer_that_comes_after_the_failure_fails_at_once(child, side):
    """The faulty side fails before its peer even calls (the order the test above leaves to
    chance): the peer, finding the pair's epoch bumped, reconnects, and learns from the store
    that this transfer was given up, instead of waiting out its timeout."""
    pair = Pair(child, f"late-{side}")
    pair.assert_exact([0], [1])
    pair.tid += 1
    send = ("send", pair.p, pair.d.worker_id, pair.d.peer_for(pair.p), SRC, TIMEOUT_S, pair.tid)
    t0 = time.monotonic()
    if side == "send":
        status, value, _ = child.call_raw(*send, "send:before_header:fail")
        assert status == "err" and value[3] == "InjectedFault", value
        with pytest.raises(KVTransferError, match="gave up on transfer") as e:
            pair.d.recv_blocks(pair.p, pair.caches, DST, TIMEOUT_S, pair.tid)
        assert e.value.point == "connect" and not isinstance(e.value, KVTransferTimeout)
    else:
        with pytest.raises(KVTransferError, match="recv:before_header"):
            pair.d.recv_blocks(pair.p, pair.caches, DST, TIMEOUT_S, pair.tid,
                               FaultPlan.parse("recv:before_header:fail"))
        status, value, _ = child.call_raw(*send, "")
        assert (status, value[0], value[2]) == ("err", "KVTransferError", "connect"), value
        assert "gave up on transfer" in value[1]
    assert time.monotonic() - t0 < TIMEOUT_S - 1
    pair.assert_exact([8, 9], [0, 1])


@pytest.mark.parametrize("where", ["recv:before_header", "send:mid_payload"])
def test_a_short_stall_only_slows_the_transfer(child, where):
    side, _ = where.split(":")
    pair = Pair(child, f"slow-{side}")
    pair.assert_exact([0], [1])
    before = clone(pair.caches)
    delay_s = 0.3
    rule = f"{where}:delay={delay_s}"
    (got, recv_s), (status, sent, _) = pair.transfer(SRC, DST, send_faults=rule if side == "send" else "",
                                                     recv_faults=rule if side == "recv" else "")
    assert status == "ok" and got == sent, (got, sent)
    assert recv_s >= delay_s                                        # it did stall, and still finished
    theirs = child.call("caches", pair.p)
    for (sk, sv), (rk, rv), (bk, bv) in zip(theirs, pair.caches, before):
        assert torch.equal(rk[DST], sk[SRC]) and torch.equal(rv[DST], sv[SRC])
        others = [b for b in range(rk.shape[0]) if b not in DST]          # and nothing else was written
        assert torch.equal(rk[others], bk[others]) and torch.equal(rv[others], bv[others])
    assert pair.d.num_connects == 1                                 # nothing broke: the same group


def test_a_stall_past_the_timeout_times_out_both_sides_and_the_pair_recovers(child):
    """The sender stalls mid-payload past the deadline: the receiver, waiting for the payload,
    times out at its deadline; the sender times out when it wakes; the next transfer is exact."""
    pair = Pair(child, "stall")
    pair.assert_exact([0], [1])
    timeout_s = 1.5
    (got, recv_s), (status, value, send_s) = pair.transfer(SRC, DST, send_faults="send:mid_payload:delay=2.5",
                                                          timeout_s=timeout_s)
    assert isinstance(got, KVTransferTimeout) and got.point == "mid_payload", got
    assert timeout_s - 0.1 <= recv_s <= timeout_s + 1.5, recv_s
    assert status == "err" and value[0] == "KVTransferTimeout" and value[2] == "mid_payload", value
    assert send_s >= 2.5
    pair.assert_exact([8, 9], [0, 1])
    assert pair.d.num_connects == 2


# -- workers -----------------------------------------------------------------------------------------
PROMPT = list(range(7, 47))                 # 40 tokens: 3 blocks of 16
MAX_TOKENS = 8


def params():
    from workers.sequence import SamplingParams
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


class Fake:
    """An injected clock."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_prefill_lease_expires_on_an_injected_clock(monkeypatch, spawns):
    """A prefill worker (the Worker class, in this process) runs a prompt to its first token and
    holds the KV under a 10-minute lease; moving its book's clock past the lease frees the
    blocks at once, with no real waiting; just before the end they are still held. (It also
    shows a worker taking its fault plan from the environment.)"""
    from test_contract import local_worker
    from workers import messages as msg
    monkeypatch.setenv(ENV_VAR, "send:after_payload:delay=0.5*2")
    with local_worker("prefill-lease", "prefill", lease_s=600) as (w, drain, events):
        assert str(w.faults) == "send:after_payload:delay=0.5*2"
        clock = Fake()
        w.handoffs.clock = clock
        w.submit(msg.encode(msg.PrefillOp("r1", PROMPT, params())))
        reply = wait_for(drain, lambda r: r.load.held == 1 and any(isinstance(e, msg.TokenEvent) for e in events))
        assert reply.load.kv_blocks_used == 3
        clock.now += 600 - 1e-3
        for _ in range(2):                  # two whole loop turns (commands, lease expiry, report)
            w.loop.ask(lambda: None)
        stats = w.stats()
        assert (stats.held, stats.kv_blocks_used) == (1, 3)
        clock.now += 2e-3                   # past the lease: freed within a loop turn or two
        wait_for(drain, lambda r: r.load.held == 0 and r.load.kv_blocks_used == 0, 5)
        assert not [e for e in events if isinstance(e, msg.ErrorEvent)]


class Side:
    """A worker (a Ray actor, or a Worker object in this process) and the events it emitted."""

    def __init__(self, worker, local: bool = False):
        self.w, self.local, self.events = worker, local, []
        self.held = {}                      # rid -> its held event's HeldKV (the router forwards it)

    def _call(self, method: str, *args):
        import ray
        if self.local:
            return getattr(self.w, method)(*args)
        return ray.get(getattr(self.w, method).remote(*args), timeout=60)

    def on(self, fn, *args):
        """fn(worker, *args) run where the worker lives."""
        import ray
        return fn(self.w, *args) if self.local else ray.get(self.w.__ray_call__.remote(fn, *args), timeout=60)

    def submit(self, op) -> None:
        from workers import messages as msg
        self._call("submit", msg.encode(op))

    def drain(self):
        from workers import messages as msg
        reply = msg.decode(self._call("poll", 0.1), msg.PollReply)
        self.events.extend(reply.events)
        return reply

    def stats(self):
        return self._call("stats")

    def set_faults(self, spec: str) -> None:
        self.on(lambda w, s: setattr(w, "faults", FaultPlan.parse(s)), spec)

    def fault_hits(self) -> dict:
        return self.on(lambda w: dict(w.faults.hits))

    def wait_event(self, ok, deadline_s: float = 30.0):
        def probe():
            self.drain()
            return next((e for e in self.events if ok(e)), None)
        return wait_for(probe, lambda e: e is not None, deadline_s)

    def tokens(self, rid: str) -> list[int]:
        return [t for e in self.events if e.rid == rid and hasattr(e, "tokens") for t in e.tokens]


def prefill(P: Side, rid: str) -> int:
    from workers import messages as msg
    P.submit(msg.PrefillOp(rid, PROMPT, params()))
    ev = P.wait_event(lambda e: e.rid == rid)
    assert isinstance(ev, msg.TokenEvent) and ev.held and len(ev.tokens) == 1, ev
    P.held[rid] = ev.kv
    return ev.tokens[0]


def handoff(P: Side, D: Side, rid: str):
    """Prefill on P, then the DecodeOp on D; the request's last event on D (an error or the end)."""
    from workers import messages as msg
    first = prefill(P, rid)
    D.submit(msg.DecodeOp(rid, PROMPT, params(), output_token_ids=[first], prefill_id=P_ID, kv=P.held[rid]))
    return first, D.wait_event(lambda e: e.rid == rid and (isinstance(e, msg.ErrorEvent) or e.finished))


def assert_clean(*sides: Side) -> None:
    """No block in use, nothing held, receiving, pending, running or waiting (within a deadline:
    releases travel asynchronously)."""
    wait_for(lambda: [s.stats() for s in sides],
             lambda st: all(s.kv_blocks_used == 0 and s.held == 0 and s.receiving == 0 and s.pending == 0
                            and s.running == 0 and s.waiting == 0 for s in st), 20)


P_ID = "prefill-0"


@pytest.fixture(scope="module")
def reference():
    """The offline single engine's greedy continuation of PROMPT (the oracle for a handoff)."""
    from workers.config import EngineConfig
    from workers.engine import LLMEngine
    return LLMEngine(EngineConfig(model="tiny")).generate([{"prompt_token_ids": PROMPT}], params())[0].token_ids


def _launch(kv_transport: str):
    """One prefill and one decode worker actor, launched as `pdcluster serve` does."""
    from cluster.run.launcher import ClusterSpec, launch, shutdown
    spec = ClusterSpec(model="tiny", num_prefill=1, num_decode=1, engine={"cache": {"num_blocks": 64}},
                       num_cpus_per_worker=0.5, lease_s=60, transfer_timeout_s=5, kv_transport=kv_transport)
    workers, _ = launch(spec)
    try:
        yield spec, Side(workers[0].handle), Side(workers[1].handle), workers
    finally:
        shutdown(workers)


@pytest.fixture(scope="module")
def gloo_pool(ray_session):
    yield from _launch("gloo")


@pytest.fixture(scope="module")
def shm_pool(ray_session):
    """The same on one node through shared memory (the decode worker copies out of the prefill
    worker's cache)."""
    yield from _launch("shm")


@pytest.fixture(scope="module", params=["gloo", "shm"])
def pool(request, ray_session):
    return request.getfixturevalue(f"{request.param}_pool")


# Where each transport can fail: through shared memory the sender takes no part in the copy,
# and there is no header (its loans, the path without a HeldKV, are tested below).
WORKER_FAULTS = {"gloo": ("send:before_header", "send:mid_payload", "send:after_payload", "recv:before_header",
                          "recv:mid_payload", "recv:after_payload", "recv:before_commit"),
                 "shm": ("recv:mid_payload", "recv:after_payload", "recv:before_commit")}


@pytest.mark.parametrize("transport,where", [(t, w) for t, ws in WORKER_FAULTS.items() for w in ws])
def test_a_fault_fails_the_pull_cleanly_and_the_request_completes_when_run_again(request, reference, transport,
                                                                                  where, ray_session):
    """The decode worker reports a retryable error and decodes nothing; both workers get every
    block back; the failure is counted under its point (the decode side's view: a sender that
    breaks before the payload leaves the receiver waiting for the header or the payload). Run
    again, as the router does, the request completes with the single engine's tokens, over the
    same pair of workers."""
    from workers import messages as msg
    _, P, D, _ = request.getfixturevalue(f"{transport}_pool")
    side, point = where.split(":")
    (P if side == "send" else D).set_faults(f"{where}:fail*1")
    before = D.stats().kv_transfer
    rid = f"{where}.0"
    try:
        _, ev = handoff(P, D, rid)
        assert isinstance(ev, msg.ErrorEvent) and ev.retryable and "KV transfer failed" in ev.error, ev
        assert not D.tokens(rid)                                     # nothing decoded from that KV
        assert_clean(P, D)
        after = D.stats().kv_transfer
        assert (after.failures, after.count) == (before.failures + 1, before.count)
        assert after.failures_by_point == {**before.failures_by_point,
                                           point: before.failures_by_point.get(point, 0) + 1}
        assert set(after.failures_by_point) <= set(FAILURE_POINTS)
        assert (P if side == "send" else D).fault_hits() == {where: 1}

        first, ev = handoff(P, D, f"{where}.1")                      # the retry
        assert isinstance(ev, msg.TokenEvent) and ev.finished, ev
        assert [first] + D.tokens(f"{where}.1") == reference
        assert D.stats().kv_transfer.count == before.count + 1
        assert_clean(P, D)
    finally:
        for s in (P, D):
            s.set_faults("")


def test_partly_received_blocks_are_never_computed_on(pool, reference):
    """vLLM's issue #21570, here: the decode side (a Worker in this process, its engine in view;
    the prefill side is the actor) fails halfway through copying the payload into its reserved
    blocks. Those blocks now hold half the layers of the prompt's KV; the worker never commits
    them: the sequence never joins the batch (the engine takes no step at all), the blocks go
    back to the free list without entering the prefix cache, and nothing is decoded. Run again,
    the request decodes the single engine's tokens (and its committed blocks are indexed)."""
    from workers import messages as msg
    from workers.config import CacheConfig, EngineConfig
    from workers.worker import Worker, WorkerSettings
    spec, P, _, _ = pool
    w = Worker("decode-local", "decode", EngineConfig(model="tiny", cache=CacheConfig(num_blocks=32)),
               WorkerSettings(spec.kv_transport, transfer_timeout_s=5, cluster_id=spec.cluster_id))
    try:
        D = Side(w, local=True)
        w.faults = FaultPlan.parse("recv:mid_payload:fail*1")
        reserved, reserve = [], w.engine.reserve

        def spy(*args, **kw):                       # the blocks each DecodeOp receives into
            ids = reserve(*args, **kw)
            if ids is not None:
                reserved.append(list(ids))
            return ids
        w.engine.reserve = spy
        caches, pool_blocks = w.engine.runner.kv_caches, w.engine.kv.pool.blocks
        before = clone(caches)

        def held_kv(worker, rid):                   # on the prefill actor: the held blocks' KV
            ids = worker.loop.ask(lambda: worker.engine.held_block_ids(rid))
            return [(k[ids].clone(), v[ids].clone()) for k, v in worker.engine.runner.kv_caches]
        first = prefill(P, "partial.0")
        sent = P.on(held_kv, "partial.0")
        D.submit(msg.DecodeOp("partial.0", PROMPT, params(), output_token_ids=[first], prefill_id=P_ID))
        ev = D.wait_event(lambda e: e.rid == "partial.0")
        assert isinstance(ev, msg.ErrorEvent) and ev.retryable and "mid_payload" in ev.error, ev

        dst = reserved[0]
        assert len(dst) == len(sent[0][0]) == 3
        parts = [(layer, kv) for layer in range(len(caches)) for kv in (0, 1)]
        for i, (layer, kv) in enumerate(parts):     # the first half of the payload landed
            expect = sent[layer][kv] if i < len(parts) // 2 else before[layer][kv][dst]
            assert torch.equal(caches[layer][kv][dst], expect), (layer, kv)
        stats = wait_for(D.stats, lambda st: st.receiving == 0 and st.kv_blocks_used == 0)
        assert stats.steps == 0 and stats.running == 0 and not D.tokens("partial.0")
        assert all(pool_blocks[b].block_hash is None for b in dst)        # never findable by a prefix hit
        assert stats.kv_transfer.failures_by_point == {"mid_payload": 1} and w.faults.hits == {"recv:mid_payload": 1}
        assert_clean(P, D)

        first, ev = handoff(P, D, "partial.1")
        assert isinstance(ev, msg.TokenEvent) and ev.finished, ev
        assert [first] + D.tokens("partial.1") == reference
        assert pool_blocks[reserved[1][0]].block_hash is not None        # committed KV is indexed
        assert_clean(P, D)
    finally:
        w.shutdown()


def test_a_loan_whose_reader_vanishes_is_freed_at_its_deadline(shm_pool):
    """A decode worker borrowed a held request's blocks (shared memory) and died before giving
    them back: the prefill worker frees them once the loan's deadline (the transfer timeout)
    passes, not at the end of the 60 s lease; the blocks named are the request's."""
    spec, P, _, _ = shm_pool
    first = prefill(P, "vanished.0")
    lent = P._call("lend_kv", "vanished.0", 0)      # this process reads nothing and never releases
    assert lent is not None and len(lent[0]) == -(-(len(PROMPT) + 1 - 1) // 16) and first is not None
    assert P.stats().held == 1
    wait_for(P.stats, lambda s: s.held == 0 and s.kv_blocks_used == 0, spec.transfer_timeout_s + 10)
    assert P._call("lend_kv", "vanished.0", 0) is None                 # nothing left to lend


def test_a_pull_of_kv_no_longer_held_is_refused_at_once(pool, reference):
    """The prefill side dropped the KV (its request was aborted, or its lease ran out) before the
    decode side pulled: the sender says so in its header, so the receiver fails at once instead
    of waiting out its transfer timeout (which would also stall every later pull from that
    prefill worker); the pair stays usable for the next request."""
    import time

    from workers import messages as msg
    spec, P, D, _ = pool
    rid = "refused.0"
    first = prefill(P, rid)
    P.submit(msg.AbortOp(rid))
    wait_for(lambda: P.stats(), lambda s: s.held == 0)
    before = D.stats().kv_transfer
    t0 = time.monotonic()
    D.submit(msg.DecodeOp(rid, PROMPT, params(), output_token_ids=[first], prefill_id=P_ID))
    ev = D.wait_event(lambda e: e.rid == rid)
    assert time.monotonic() - t0 < spec.transfer_timeout_s / 2
    assert isinstance(ev, msg.ErrorEvent) and ev.retryable and "no longer holds" in ev.error, ev
    after = D.stats().kv_transfer
    assert after.failures_by_point.get("refused", 0) == before.failures_by_point.get("refused", 0) + 1
    assert_clean(P, D)
    first, ev = handoff(P, D, "refused.1")                            # the same pair, next request
    assert isinstance(ev, msg.TokenEvent) and ev.finished, ev
    assert [first] + D.tokens("refused.1") == reference


def test_shared_kv_whose_blocks_were_reused_is_refused_by_their_counts(shm_pool, reference):
    """Through shared memory the decode worker copies with no word from the prefill worker: the
    held event's allocation counts guard it. Aborted, the request's blocks keep their bytes, and
    a copy of them is still that request's KV (it decodes the single engine's tokens); once a
    later prompt took some of those blocks, the counts differ and the copy is refused at once; so
    is one whose blocks are named in another cache than the prefill worker's now."""
    import random

    from workers import messages as msg
    spec, P, D, _ = shm_pool

    def decode(rid: str, first: int):
        D.submit(msg.DecodeOp(rid, PROMPT, params(), output_token_ids=[first], prefill_id=P_ID, kv=P.held[rid]))
        return D.wait_event(lambda e: e.rid == rid and (isinstance(e, msg.ErrorEvent) or e.finished))
    first = prefill(P, "intact.0")
    P.submit(msg.AbortOp("intact.0"))
    wait_for(P.stats, lambda s: s.held == 0)
    ev = decode("intact.0", first)
    assert isinstance(ev, msg.TokenEvent) and ev.finished, ev
    assert [first] + D.tokens("intact.0") == reference

    first = prefill(P, "reused.0")
    kv = P.held["reused.0"]
    assert kv is not None and len(kv.block_ids) == 3
    P.submit(msg.AbortOp("reused.0"))
    wait_for(P.stats, lambda s: s.held == 0)
    filler = [random.Random(1).randrange(3, 250) for _ in range(1000)]     # 63 of the 64 blocks
    P.submit(msg.PrefillOp("filler", filler, params()))
    held = P.wait_event(lambda e: e.rid == "filler")
    assert held.held and set(held.kv.block_ids) & set(kv.block_ids)      # it took some of them
    before = D.stats().kv_transfer
    ev = decode("reused.0", first)
    assert isinstance(ev, msg.ErrorEvent) and ev.retryable and "reused" in ev.error, ev
    assert not D.tokens("reused.0")
    after = D.stats().kv_transfer
    assert after.failures_by_point.get("refused", 0) == before.failures_by_point.get("refused", 0) + 1
    P.submit(msg.AbortOp("filler"))
    assert_clean(P, D)

    # Blocks named in another cache than the one the prefill worker has now (it restarted since
    # it held them): refused, whatever the counts say.
    first = prefill(P, "restarted.0")
    kv = P.held["restarted.0"]
    P.held["restarted.0"] = msg.HeldKV(kv.block_ids, kv.generations, kv.segment ^ 1)
    ev = decode("restarted.0", first)
    assert isinstance(ev, msg.ErrorEvent) and ev.retryable and "restarted" in ev.error, ev
    P.submit(msg.AbortOp("restarted.0"))
    assert_clean(P, D)


def test_a_request_resumes_through_a_failed_handoff(pool, reference):
    """End to end through the router's dispatcher (last in this module: its pumps drain the
    workers' events): the decode worker fails the first pull at mid-payload; the request resumes
    from what it delivered and the stream is the single engine's tokens, none twice, none lost."""
    import asyncio

    from router.dispatch import Dispatcher, DispatchSettings
    from router.leadership import Leadership
    from router.metrics import Metrics
    from router.supervisor import Supervisor
    from router.protocol import GenerationRequest
    _, P, D, workers = pool
    D.set_faults("recv:mid_payload:fail*1")
    before = D.stats().kv_transfer

    async def run() -> tuple[list[int], Metrics]:
        metrics = Metrics()
        dispatcher = Dispatcher(workers, "disaggregated", metrics, DispatchSettings(max_retries=2))
        supervisor = Supervisor(dispatcher, Leadership(leads=True))
        supervisor.start()
        try:
            req = GenerationRequest("completion", "tiny", PROMPT, params(), stream=True)
            out = []
            async for ev in dispatcher.generate(req):
                out += ev.token_ids
            return out, metrics
        finally:
            await supervisor.stop()
    try:
        tokens, metrics = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        D.set_faults("")
    assert tokens == reference
    assert metrics.registry.get_sample_value("pdcluster:requests_resumed_total", {"cause": "handoff_failed"}) == 1
    after = D.stats().kv_transfer
    assert after.failures_by_point.get("mid_payload", 0) == before.failures_by_point.get("mid_payload", 0) + 1
    assert after.count == before.count + 1
    assert_clean(P, D)



def test_a_fault_that_never_clears_fails_the_request_after_its_retries(pool, reference):
    """Every pull fails (a persistent fault): the real dispatcher resumes the request
    `max_retries` times, each attempt delivering one more token (the prefill's; none twice, none
    lost), then gives up with RequestFailed (a 503 at the HTTP layer: test_batch_prompts); no
    block is left anywhere."""
    import asyncio

    from router.dispatch import Dispatcher, DispatchSettings, RequestFailed
    from router.leadership import Leadership
    from router.metrics import Metrics
    from router.supervisor import Supervisor
    from router.protocol import GenerationRequest
    _, P, D, workers = pool
    D.set_faults("recv:after_payload:fail")        # a point both transports pass
    before = D.stats().kv_transfer
    metrics = Metrics()
    out: list[int] = []

    async def run() -> None:
        dispatcher = Dispatcher(workers, "disaggregated", metrics, DispatchSettings(max_retries=2))
        supervisor = Supervisor(dispatcher, Leadership(leads=True))
        supervisor.start()
        try:
            async for ev in dispatcher.generate(GenerationRequest("completion", "tiny", PROMPT, params())):
                out.extend(ev.token_ids)
        finally:
            await supervisor.stop()
    try:
        with pytest.raises(RequestFailed, match="3 attempts in a row failed"):
            asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        D.set_faults("")
    assert out == reference[:3]
    assert metrics.registry.get_sample_value("pdcluster:requests_resumed_total", {"cause": "handoff_failed"}) == 2
    after = D.stats().kv_transfer
    assert after.failures_by_point.get("after_payload", 0) == before.failures_by_point.get("after_payload", 0) + 3
    assert_clean(P, D)


@pytest.fixture
def fails_first_pull(monkeypatch, ray_session):
    """A served cluster whose decode worker fails its first KV pull halfway (a fault drill)."""
    from common import api_cluster
    monkeypatch.setenv(ENV_VAR, "recv:mid_payload:fail*1")
    with api_cluster() as c:
        yield c


def test_a_resumed_stream_keeps_its_logprobs_stop_string_and_usage(fails_first_pull):
    """The same streamed request twice: the first through a failed handoff (it resumes after its
    first token), the second clean. Everything the client sees is the same: text, token ids,
    logprobs, a stop string that spans the resume point, the finish reason, the usage chunk."""
    import httpx

    from common import sse_events
    from workers.config import EngineConfig
    from workers.engine import LLMEngine
    from workers.sequence import SamplingParams
    c = fails_first_pull
    decode = c.server.tokenizer.decode
    engine = LLMEngine(EngineConfig(model="tiny"))
    # Seeded sampling (a resume continues the same: draws depend on the position), with a seed
    # whose tokens 2-4 are whole characters that first appear there: the stop string spans the
    # resume point, which comes after token 1.
    for seed in range(100):
        want = engine.generate([{"prompt_token_ids": PROMPT}], SamplingParams(
            temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True))[0].token_ids
        stop = decode(want[1:4])
        if "\ufffd" not in decode(want[:4]) and decode(want[:4]).find(stop) == len(decode(want[:1])):
            break
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": seed,
            "ignore_eos": True, "logprobs": 2, "stop": [stop], "stream": True,
            "stream_options": {"include_usage": True}}

    def seen() -> dict:
        with httpx.Client(base_url=c.base_url, timeout=120) as client:
            events = sse_events(client.post("completions", json=body).text)
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), events[-3:]
        chunks = [e["choices"][0] for e in events[:-2]]
        return {"text": "".join(ch["text"] for ch in chunks), "ids": [t for ch in chunks for t in ch["token_ids"]],
                "logprobs": [x for ch in chunks for x in ch["logprobs"]["token_logprobs"]],
                "tops": [x for ch in chunks for x in ch["logprobs"]["top_logprobs"]],
                "finish": [ch["finish_reason"] for ch in chunks if ch["finish_reason"]],
                "usage": events[-2]["usage"]}
    registry = c.server.metrics.registry
    resumed = seen()
    assert registry.get_sample_value("pdcluster:requests_resumed_total", {"cause": "handoff_failed"}) == 1
    clean = seen()
    assert registry.get_sample_value("pdcluster:requests_resumed_total", {"cause": "handoff_failed"}) == 1
    assert resumed["ids"] == clean["ids"] == want[:4]
    assert resumed["text"] == clean["text"] == decode(want[:1])
    assert resumed["finish"] == clean["finish"] == ["stop"]
    assert resumed["usage"] == clean["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 4,
                                                   "total_tokens": len(PROMPT) + 4}
    assert resumed["logprobs"] == pytest.approx(clean["logprobs"], abs=1e-4)
    assert [set(t) for t in resumed["tops"]] == [set(t) for t in clean["tops"]]
