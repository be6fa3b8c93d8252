"""One worker's events as a stream: its poll replies pushed over ZeroMQ, not asked for by a Ray
call each (workers/worker.py `stream_events`), and a watch on its process.

    worker: streamer thread ── poll(0.5) ─▶ PUSH ══ tcp ══▶ PULL ─▶ EventStream.next()  (router)
    worker: watch() blocks until the worker shuts down ◀── one pending Ray call: fails at once
                                                           when the process dies

The stream is a ZeroMQ CURVE connection: the router gives its public key in the Ray call that
asks for the stream, the worker answers with its own (`stream_events`), and the worker's ZAP
handler admits no other client key on that socket; so a process that connects to the worker's
port without this router's secret key completes no handshake and receives nothing, and the
frames are encrypted on the wire.

A frame is a PollReply, as a poll returned it: the events since the last frame, the latest
load report, the metric samples, the cache events; at least one every half second. The stream
has no acknowledgement: each router reads its own stream (its outbox on the worker: its
requests' events, everyone's load and samples), and a frame it never reads (it timed out, the
worker is being replaced) is dropped with the stream, as an unanswered poll was.
"""
from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio


_KEYS: tuple[bytes, bytes] | None = None


def client_keys() -> tuple[bytes, bytes]:
    """This process's CURVE keypair as a stream reader (public, secret; z85), made once."""
    global _KEYS
    if _KEYS is None:
        _KEYS = zmq.curve_keypair()
    return _KEYS


def curve_client(sock: zmq.Socket, server_key: str) -> None:
    """Make `sock` (before it connects) a CURVE client of the worker whose public key is `server_key`."""
    public, secret = client_keys()
    sock.curve_serverkey = server_key.encode()
    sock.curve_publickey = public
    sock.curve_secretkey = secret


class WorkerStopped(RuntimeError):
    """The worker's watch ended without an error: it shut down."""


async def _result(ref):
    return await ref


async def _outcome(ref) -> BaseException | None:
    """How a call ended: None, or its error without a traceback. A traceback would hold this
    coroutine's frame, and with it the call's ObjectRef, for as long as the error lives (in a
    cycle through the stream, until a full garbage collection): one reference kept per dead
    worker."""
    try:
        await ref
    except Exception as e:
        return e.with_traceback(None)
    return None


class EventStream:
    """Read with `next`; `close` when done (or when the worker is given up on)."""

    def __init__(self, handle, address: str, server_key: str):
        self._sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        curve_client(self._sock, server_key)
        self._sock.connect(address)
        self._watch: asyncio.Future | None = asyncio.ensure_future(_outcome(handle.watch.remote()))
        self._last = time.monotonic()

    @classmethod
    async def open(cls, handle, owner: str, timeout_s: float) -> EventStream:
        """Ask the worker for the stream of `owner`'s outbox (Ray call, with this process's CURVE
        public key) and connect to it (with the worker's)."""
        public = client_keys()[0].decode()
        address, server_key = await asyncio.wait_for(_result(handle.stream_events.remote(owner, public)), timeout_s)
        return cls(handle, address, server_key)

    async def next(self, timeout_s: float) -> tuple[bytes, float]:
        """The next frame and a time before which every operation sent to the worker is in its
        report (when the frame before it arrived: the worker's poll for this frame started after
        it sent that one). Raises asyncio.TimeoutError after `timeout_s` without a frame, the
        Ray error when the worker's process died, WorkerStopped when it shut down."""
        recv = asyncio.ensure_future(self._sock.recv(copy=False))
        done, _ = await asyncio.wait({recv, self._watch}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if recv in done:
            covered, self._last = self._last, time.monotonic()
            return recv.result().bytes, covered
        recv.cancel()
        if self._watch in done:
            error, self._watch = self._watch.result(), None
            if error is not None:
                raise error                      # the worker's death
            raise WorkerStopped("the worker shut down")
        raise TimeoutError

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self._sock.close()
