"""A worker's outboxes: what each router has not read yet, and the ZeroMQ streams that push it.

One outbox per router (its owner tag, workers/names.py `owner_of`) holds that router's requests'
events, and every metric sample and prefix-cache change (each router keeps its own view of
every worker). The loop thread writes (`publish`, `cache_changes`, `set_load`); a router reads
by a long `poll` or by a stream of its own (`stream`), a thread per stream that pushes one
PollReply per frame. One lock guards the outboxes and the latest load report, nothing else.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from workers.messages import SAMPLE_KINDS, LoadReport, PollReply, encode
from workers.names import owner_of
from workers.node import bind_host

MAX_SAMPLES = 4096                  # per kind between polls; older ones are dropped
# Owners with a stream at once: each has a socket and a sender thread here, and keeps one `watch`
# call pending, which holds one of the actor's threads (launcher: max_concurrency=32).
MAX_ROUTERS = 8


class Outbox:
    """What one router has not read yet. The owner "" is the outbox of requests without an
    owner tag, read by `poll` and by a stream asked for without an owner; it gets samples and
    cache changes only once someone reads it (`fed`), so that they do not pile up where no
    router looks."""

    def __init__(self, owner: str, cached: Iterable[bytes] = ()):
        self.fed = bool(owner)
        self.events: list = []
        self.samples = {k: deque(maxlen=MAX_SAMPLES) for k in SAMPLE_KINDS}
        self.cache: dict[bytes, bool] = dict.fromkeys(cached, True)   # hash -> held now, or evicted
        self.address: str | None = None           # its ZeroMQ stream, once asked for
        self.closed = False


class StreamKeys:
    """The event streams' security: a ZeroMQ context of this worker's own, its CURVE server
    keypair, and a ZAP handler (pyzmq's, on a thread) that admits on each stream's socket (its
    ZAP domain) only the client key its router gave when asking for it (`readers`)."""

    def __init__(self):
        import zmq
        from zmq.auth.thread import ThreadAuthenticator
        self.context = zmq.Context()
        self.public, self.secret = zmq.curve_keypair()
        self.readers: dict[str, bytes] = {}             # ZAP domain -> the admitted client key (z85)
        self.auth = ThreadAuthenticator(self.context)
        self.auth.start()

    def callback(self, domain: str, key: bytes) -> bool:
        """(the ZAP thread) Whether the CURVE client `key` (z85) may read the stream `domain`."""
        return self.readers.get(domain) == key

    def close(self) -> None:
        try:
            self.auth.stop()
        except Exception:
            pass


class Outboxes:
    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self._cv = threading.Condition()
        self._boxes: dict[str, Outbox] = {"": Outbox("")}
        self._load: LoadReport | None = None       # the latest load report: every reply carries it
        self._streams: StreamKeys | None = None
        self._stop = False

    # -- the loop thread writes -------------------------------------------------------------------
    def get(self, owner: str) -> Outbox | None:
        return self._boxes.get(owner)

    def open(self, owner: str, cached: Callable[[], Iterable[bytes]]) -> Outbox:
        """(loop thread) `owner`'s outbox, made on its first request or stream, holding the
        prefix cache's every block (`cached()`), so a router that joins late knows them."""
        box = self._boxes.get(owner)
        if box is None:
            box = Outbox(owner, list(cached()))
            with self._cv:
                self._boxes = {**self._boxes, owner: box}     # readers iterate without the lock
        return box

    def close(self, owner: str) -> None:
        """(loop thread) A router gone for good: its outbox and stream end."""
        with self._cv:
            box = self._boxes.get(owner)
            if box is not None:
                box.closed = True
                self._boxes = {o: b for o, b in self._boxes.items() if o != owner}
                self._cv.notify_all()

    def publish(self, events: Iterable = (), samples: dict[str, list] | None = None) -> None:
        """Events into their owners' outboxes (an owner gone for good reads nothing), and
        metric samples (kind -> values) into every fed one."""
        with self._cv:
            if samples:
                for box in self._fed():
                    for kind, values in samples.items():
                        box.samples[kind].extend(values)
            for event in events:
                box = self._boxes.get(owner_of(event.rid))
                if box is not None:
                    box.events.append(event)
            self._cv.notify_all()

    def cache_changes(self, stored: Iterable[bytes], evicted: Iterable[bytes]) -> None:
        with self._cv:                                   # the latest word on a hash wins
            for box in self._fed():
                box.cache.update(dict.fromkeys(evicted, False))
                box.cache.update(dict.fromkeys(stored, True))

    def set_load(self, report: LoadReport) -> None:
        with self._cv:
            self._load = report

    def _fed(self) -> list[Outbox]:
        """(holding the lock) The outboxes that get every sample and cache change."""
        return [box for box in self._boxes.values() if box.fed]

    # -- routers read -----------------------------------------------------------------------------
    def poll(self, timeout_s: float) -> bytes:
        box = self._boxes[""]
        box.fed = True
        return encode(self.take(box, timeout_s))

    def take(self, box: Outbox, timeout_s: float) -> PollReply:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not box.events and not self._stop and not box.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            events, box.events = box.events, []
            samples = {k: list(q) for k, q in box.samples.items()}
            for q in box.samples.values():
                q.clear()
            load = self._load
            changes, box.cache = box.cache, {}
        return PollReply(events, load, samples, [h for h, held in changes.items() if held],
                         [h for h, held in changes.items() if not held])

    def requeue(self, box: Outbox, reply: PollReply) -> None:
        """Put an unsent reply's contents back, before anything newer: the next poll or frame
        carries them."""
        with self._cv:
            box.events[:0] = reply.events
            for kind, values in reply.samples.items():
                box.samples[kind].extendleft(reversed(values))
            older = {**dict.fromkeys(reply.cache_evicted, False), **dict.fromkeys(reply.cache_stored, True)}
            box.cache = {**older, **box.cache}
            self._cv.notify_all()

    def stream(self, owner: str, client_key: str, box: Outbox) -> tuple[str, str]:
        """Push `box`'s replies over a CURVE-secured ZeroMQ PUSH socket from now on (see
        Worker.stream_events): (its address, this worker's CURVE public key, z85)."""
        import zmq
        box.fed = True
        with self._cv:
            if self._streams is None:
                self._streams = StreamKeys()
            keys = self._streams
            domain = f"stream/{owner or '-'}"
            keys.readers[domain] = client_key.encode()
            if box.address is None:
                sock = keys.context.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.curve_secretkey = keys.secret
                sock.curve_publickey = keys.public
                sock.curve_server = True
                sock.zap_domain = domain.encode()
                keys.auth.configure_curve_callback(domain, keys)
                host = bind_host()
                port = sock.bind_to_random_port(f"tcp://{host}")
                box.address = f"tcp://{host}:{port}"
                threading.Thread(target=self._push, args=(box, sock), daemon=True,
                                 name=f"events-{self.worker_id}-{owner or 'any'}").start()
            return box.address, keys.public.decode()

    def _push(self, box: Outbox, sock) -> None:
        import zmq
        try:
            while not self._stop and not box.closed:
                if not sock.poll(500, zmq.POLLOUT):         # no reader connected
                    continue
                reply = self.take(box, 0.5)
                try:
                    sock.send(encode(reply), zmq.NOBLOCK, copy=False)
                except zmq.Again:                            # the reader left meanwhile
                    self.requeue(box, reply)
        finally:
            sock.close()

    def stop(self) -> None:
        """Wake every reader; the streams end."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
            streams = self._streams
        if streams is not None:
            streams.close()
