"""The inner plane trusts no stranger (issue 26).

One `pdcluster serve` (1 prefill + 1 decode, `--kv-transport gloo` so the KV rendezvous store and
Gloo's pairs exist) for the module, as a user runs it:

- every TCP socket listening in its processes (the serve process, Ray's daemons and agents, the
  workers) is on loopback;
- a stranger connected to each of the workers' listeners (a ZeroMQ PULL socket, a raw TCP
  client, a TCPStore client) receives no frame and changes no output: the greedy outputs of
  requests made while it is connected equal those of the same requests without it (the
  fault-free run is the oracle).

And without a cluster: the secret-namespaced, signed KV rendezvous (a stranger on the store,
guessing sequential ids or even listing the keys, cannot fail a transfer), and the typed
tensor-parallel broadcast (round trip; a pickle is refused).
"""
from __future__ import annotations

import pickle
import socket
import threading
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
import zmq

from common import SMALL_KV, ServeProcess, descendants, free_port, random_prompts

MAX_TOKENS = 16
PROMPTS = random_prompts(26, [5, 40, 90, 17, 130, 3])


# -- listening sockets, by process, from /proc ------------------------------------------------------
def _listeners(pids: set[int]) -> dict[tuple[str, int], set[int]]:
    """{(address, port): pids} of the TCP sockets listening in these processes (v4 and v6)."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = fd.readlink().as_posix()
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:                     # gone meanwhile
            continue
    found: dict[tuple[str, int], set[int]] = {}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:          # 0A: LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if v6:
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                addr = socket.inet_ntop(socket.AF_INET6, raw)
            else:
                addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
            found.setdefault((addr, int(hexport, 16)), set()).add(inodes[f[9]])
    return found


def _loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr in ("::1", "::ffff:127.0.0.1")


def _greedy(port: int) -> list[list[int]]:
    """The prompts' greedy continuations, all requests at once."""
    out: list = [None] * len(PROMPTS)

    def one(i):
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0,
                             "ignore_eos": True})
        r.raise_for_status()
        out[i] = r.json()["choices"][0]["token_ids"]
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert all(o is not None for o in out), "a request did not finish"
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory, spawns):
    port = free_port()
    log = tmp_path_factory.mktemp("inner") / "serve.log"
    with ServeProcess(log, "--kv-transport", "gloo", "--host", "127.0.0.1", *SMALL_KV, port=port) as s:
        oracle = _greedy(port)              # no stranger; also opens the KV store and Gloo's pairs
        yield s, oracle


def _worker_pids(s: ServeProcess) -> set[int]:
    return {pid for (pid, _), cmd in descendants(s.proc.pid).items() if "ray::Worker" in cmd}


def test_every_listener_of_the_cluster_is_on_loopback(served):
    s, _ = served
    pids = {s.proc.pid} | {pid for pid, _ in descendants(s.proc.pid)}
    listening = _listeners(pids)
    workers = _worker_pids(s)
    assert any(workers & ps for ps in listening.values()), "the workers listen on nothing: the test sees nothing"
    exposed = {a: ps for a, ps in listening.items() if not _loopback(a[0])}
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_a_stranger_on_every_worker_port_gets_nothing_and_changes_nothing(served):
    s, oracle = served
    ports = sorted(port for (addr, port), ps in _listeners(_worker_pids(s)).items() if _loopback(addr))
    assert ports
    ctx = zmq.Context()
    strangers, raw, stores = [], [], []
    try:
        for port in ports:
            sock = ctx.socket(zmq.PULL)               # would take a share of a PUSH socket's frames
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port}")
            strangers.append(sock)
            c = socket.create_connection(("127.0.0.1", port), timeout=5)
            c.setblocking(False)
            raw.append(c)
        def store_client(port: int) -> None:
            try:
                stores.append(dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=2),
                                            wait_for_workers=False))
            except Exception:                         # not a store
                pass
        # A TCPStore client where one connects; on a port that is not a store its handshake may
        # wait for an answer that never comes: such a client stays connected, stuck, a stranger too.
        probes = [threading.Thread(target=store_client, args=(port,), daemon=True) for port in ports]
        for t in probes:
            t.start()
        for t in probes:
            t.join(10)
        assert stores, "no TCPStore among the workers' listeners: the KV rendezvous was not exercised"
        for st in stores:                             # guessing: old ids, the pair's names without the secret
            for key in ("kv/prefill-0->decode-0/gave_up/send", "kv/prefill-0->decode-0/gen"):
                try:
                    st.set(key, "1")
                except Exception:
                    pass
        got = _greedy(s.port)
        assert got == oracle
        for sock in strangers:
            assert sock.poll(0) == 0, "a stranger received a frame"
        for c in raw:
            try:
                data = c.recv(65536)
            except BlockingIOError:
                data = None
            # A CURVE server sends its greeting (no payload); nothing beyond a greeting's 64 bytes.
            assert data is None or len(data) <= 64, data
    finally:
        for sock in strangers:
            sock.close()
        for c in raw:
            c.close()
        ctx.term()


# -- the KV rendezvous: secret-namespaced and signed ------------------------------------------------
def _caches(num_blocks: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(num_blocks, 4, 2, 8, generator=g), torch.randn(num_blocks, 4, 2, 8, generator=g))
            for _ in range(2)]


def test_a_stranger_on_the_kv_store_cannot_fail_or_forge_a_transfer():
    from workers.kv_transfer import GlooTransport
    d, p = GlooTransport("d-x", "cpu", "127.0.0.1"), GlooTransport("p-x", "cpu", "127.0.0.1")
    recv_caches, send_caches = _caches(8, 0), _caches(8, 1)
    peer = d.peer_for("p-x")
    assert peer.secret and peer.secret not in peer.store_addr
    host, port = peer.store_addr.rsplit(":", 1)
    stranger = dist.TCPStore(host, int(port), None, False, timedelta(seconds=5), wait_for_workers=False)
    try:
        def transfer(tid: int, src: list[int], dst: list[int]) -> None:
            done: dict = {}
            t = threading.Thread(target=lambda: done.setdefault("sent", p.send_blocks(peer, send_caches, src, 10.0, tid)))
            t.start()
            d.recv_blocks("p-x", recv_caches, dst, 10.0, tid)
            t.join(15)
            assert "sent" in done
            for (k, v), (sk, sv) in zip(recv_caches, send_caches):
                assert torch.equal(k[dst], sk[src]) and torch.equal(v[dst], sv[src])
        transfer(1, [0, 1], [2, 3])
        # Guessing, as before the secret: the next ids under the names alone.
        for tid in range(2, 6):
            for side in ("send", "recv"):
                stranger.set(f"kv/p-x->d-x/gave_up/{side}", str(tid))
        # Reading the namespace off the store (a client can list keys): forged signals and a
        # forged sender's generation, unsigned.
        names = {k.split("/")[1] for k in stranger.list_keys() if k.startswith("kv/")}
        assert peer.secret in names
        ns = f"kv/{peer.secret}/p-x->d-x"
        for side in ("send", "recv"):
            stranger.set(f"{ns}/gave_up/{side}", "2")
        gen = stranger.add(f"{ns}/gen", 1)
        stranger.set(f"{ns}/{gen}/hello/0", b"\x80forged")
        stranger.set(f"{ns}/{gen + 1}/skipped", "1")
        p.close("d-x")                  # the next transfer rendezvouses again, amid the forgeries
        d.close("p-x")
        transfer(2, [4, 5, 6], [0, 1, 7])
    finally:
        p.shutdown()
        d.shutdown()


def test_the_kv_store_listens_on_its_host_only():
    from workers.kv_transfer import listen_store
    store = listen_store("127.0.0.1", timedelta(seconds=5))
    found = _listeners({__import__("os").getpid()})
    assert [a for a, port in found if port == store.port] == ["127.0.0.1"]


# -- the tensor-parallel broadcast: typed msgpack ------------------------------------------------------
def test_the_tensor_parallel_step_round_trips_and_a_pickle_is_refused():
    from workers.attention import AttentionMetadata, PrefillChunk
    from workers.messages import ContractError
    from workers.model_runner import StepInputs
    from workers.tensor_parallel import decode_step, encode_step
    meta = AttentionMetadata(torch.arange(7), 2, 9, 3, torch.tensor([[1, 2], [3, 4]]), torch.tensor([5, 9]),
                             torch.tensor([0, 1, 2]), [PrefillChunk(3, 7, 0, None), PrefillChunk(2, 3, 4, torch.tensor([6]))])
    step = StepInputs([(1, 2)], [(3, 4)], [], torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2]), meta)
    back = decode_step(encode_step(step), torch.device("cpu"))
    assert back.copies == [(1, 2)] and back.swap_out == [(3, 4)] and back.swap_in == []
    assert torch.equal(back.input_ids, step.input_ids) and torch.equal(back.positions, step.positions)
    m = back.meta
    assert torch.equal(m.slot_mapping, meta.slot_mapping) and torch.equal(m.paged_block_tables, meta.paged_block_tables)
    assert (m.num_decodes, m.decode_max_context, m.num_paged_rows) == (2, 9, 3)
    assert [(c.start, c.end, c.num_context) for c in m.prefills] == [(3, 7, 0), (2, 3, 4)]
    assert m.prefills[0].block_table is None and torch.equal(m.prefills[1].block_table, torch.tensor([6]))
    assert decode_step(encode_step(None), torch.device("cpu")) is None

    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled')",))
    for payload in (pickle.dumps(step), pickle.dumps(Boom()), b"", b"\x93\x01\x02\x03"):
        with pytest.raises(ContractError):
            decode_step(payload, torch.device("cpu"))
