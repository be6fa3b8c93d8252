"""The worker actor: one engine, a role, a loop thread, and msgpack messages in and out.

    router ──submit(msgpack)──▶ inbox ──▶ engine loop thread ──▶ events ──poll()──▶ router
                                            │  (steps while there is work)
    decode worker ──send_kv()──▶ transfer thread reads held blocks ──▶ transport ──▶ peer

Metrics: the load report carries gauges and cumulative counters; per-step and per-transfer
samples (step time, batch size, tokens, queue times, KV transfer seconds) wait in a bounded
buffer until the next poll drains them, and the router turns them into Prometheus histograms.

Roles: `prefill` runs requests to their first token and holds the KV under a lease;
`decode` reserves blocks (only when it has room), pulls the KV from the prefill worker,
then decodes; `colocated` runs whole requests (chunked prefill mixes into decode steps).

The engine is touched only by the loop thread; other threads hand it closures through the
inbox. Ray stays out of this module's logic: the launcher wraps `Worker` with ray.remote, and
peers arrive as opaque handles whose methods are called with `.remote`.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future

import msgpack
import torch

from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.engine import LLMEngine
from workers.sequence import SamplingParams

log = logging.getLogger("pdcluster.worker")
ROLES = ("prefill", "decode", "colocated")
SAMPLE_KINDS = ("step_s", "batch_size", "step_tokens", "queue_s", "kv_transfer_s")
MAX_SAMPLES = 4096                  # per kind between polls; older ones are dropped


def engine_config_from_dict(d: dict) -> EngineConfig:
    d = dict(d)
    cache = CacheConfig(**d.pop("cache", {}))
    sched = SchedulerConfig(**d.pop("scheduler", {}))
    return EngineConfig(cache=cache, scheduler=sched, **d)


class Worker:
    def __init__(self, worker_id: str, role: str, engine_cfg: dict, transport: str = "auto",
                 num_threads: int = 1, lease_s: float = 30.0, transfer_timeout_s: float = 30.0,
                 cluster_id: str = "default"):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        torch.set_num_threads(num_threads)
        self.worker_id, self.role, self.cluster_id = worker_id, role, cluster_id
        self.engine = LLMEngine(engine_config_from_dict(engine_cfg))
        self.lease_s, self.transfer_timeout_s = lease_s, transfer_timeout_s
        self._transport_kind = transport
        self._transport = None
        self._inbox: deque = deque()
        self._events: list[dict] = []
        self._cv = threading.Condition()
        self._leases: dict[str, float] = {}          # held request id -> expiry (monotonic)
        self._pending: deque[dict] = deque()         # decode requests waiting for room
        self._params: dict[str, SamplingParams] = {}
        self._stop = False
        self._peer_locks: dict[str, threading.Lock] = {}
        self._transfer_ids = 0
        self._transfer_stats = {"bytes": 0, "count": 0, "seconds": 0.0, "failures": 0}
        self._samples = {k: deque(maxlen=MAX_SAMPLES) for k in SAMPLE_KINDS}
        self.steps = 0
        self._loop = threading.Thread(target=self._run, name=f"engine-{worker_id}", daemon=True)
        self._loop.start()

    # -- called by the router / launcher (any thread) -----------------------------------------
    def ready(self) -> dict:
        e = self.engine
        return {"worker_id": self.worker_id, "role": self.role, "max_model_len": e.max_model_len,
                "num_blocks": e.layout.num_blocks, "block_size": e.layout.block_size,
                "attention_backend": e.runner.backend.name, "device": str(e.device)}

    def submit(self, payload: bytes) -> None:
        """msgpack {"op": "generate"|"prefill"|"decode"|"abort", ...}; results come as events."""
        self._call_in_loop(lambda: self._handle(msgpack.unpackb(payload, strict_map_key=False)))

    def poll(self, timeout_s: float = 1.0) -> bytes:
        """Long poll: the events since the last call (msgpack), plus a fresh load report and
        the metric samples since the last call."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not self._events and not self._stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            events, self._events = self._events, []
            samples = {k: list(q) for k, q in self._samples.items()}
            for q in self._samples.values():
                q.clear()
        return msgpack.packb({"events": events, "load": self._load, "samples": samples})

    def stats(self) -> dict:
        return dict(self._load)

    def shutdown(self) -> None:
        self._stop = True
        with self._cv:
            self._cv.notify_all()

    # -- KV handoff: the prefill side ---------------------------------------------------------
    def send_kv(self, request_id: str, peer_id: str, store_addr: str, transfer_id: int) -> int:
        """Send a held request's prompt KV to the decode worker that asked for it (it waits in
        recv with the same transfer id)."""
        from workers.kv_transfer import KVPeer
        block_ids = self._in_loop(lambda: self.engine.held_block_ids(request_id))
        return self._get_transport().send_blocks(KVPeer(peer_id, store_addr), self.engine.runner.kv_caches,
                                                 block_ids, self.transfer_timeout_s, transfer_id)

    def release_kv(self, request_id: str) -> None:
        """The decode worker has the KV (or gave up): free our copy (full blocks stay cached)."""
        self._call_in_loop(lambda: self._release(request_id))

    # -- the loop thread -----------------------------------------------------------------------
    def _call_in_loop(self, fn) -> None:
        with self._cv:
            self._inbox.append(fn)
            self._cv.notify_all()

    def _in_loop(self, fn):
        fut: Future = Future()

        def run():
            try:
                fut.set_result(fn())
            except Exception as e:     # handed back to the caller's thread
                fut.set_exception(e)
        self._call_in_loop(run)
        return fut.result(timeout=self.transfer_timeout_s)

    def _run(self) -> None:
        while not self._stop:
            with self._cv:
                while self._inbox:
                    fn = self._inbox.popleft()
                    try:
                        fn()
                    except Exception:
                        log.exception("worker %s: command failed", self.worker_id)
            self._expire_leases()
            self._admit_pending()
            if self.engine.has_unfinished():
                self._step()
                continue
            with self._cv:
                if not self._inbox:
                    # Idle: a command wakes us; the timeout only paces lease expiry and retries
                    # of pending reservations (room appears through commands: aborts, commits).
                    self._cv.wait(0.05)

    def _step(self) -> None:
        t0 = time.monotonic()
        outputs = self.engine.step()
        step_s = time.monotonic() - t0
        self.steps += 1
        shape = self.engine.last_step
        if shape.num_seqs:
            with self._cv:
                self._samples["step_s"].append(step_s)
                self._samples["batch_size"].append(shape.num_seqs)
                self._samples["step_tokens"].append(shape.num_tokens)
                self._samples["queue_s"].extend(shape.queue_times_s)
        events = []
        for o in outputs:
            ev = {"rid": o.request_id, "tokens": o.new_token_ids, "finished": o.finished,
                  "reason": o.finish_reason}
            if o.held:
                ev["held"] = True
                self._leases[o.request_id] = time.monotonic() + self.lease_s
            if o.new_logprobs is not None:
                ev["logprobs"] = o.new_logprobs
            events.append(ev)
        self._emit(events)

    def _emit(self, events: list[dict]) -> None:
        with self._cv:
            self._events.extend(events)
            self._cv.notify_all()

    @property
    def _load(self) -> dict:
        s = self.engine.scheduler
        queued_prefill = sum(q.num_tokens - q.num_computed_tokens for q in list(s.waiting))
        return {"worker_id": self.worker_id, "role": self.role, "waiting": len(s.waiting),
                "running": len(s.running), "swapped": len(s.swapped), "receiving": s.num_receiving,
                "pending": len(self._pending), "queued_prefill_tokens": queued_prefill,
                "kv_blocks_used": self.engine.kv.pool.num_blocks - self.engine.kv.num_free_blocks,
                "kv_blocks_total": self.engine.kv.pool.num_blocks, "held": len(self._leases),
                "steps": self.steps, "kv_transfer": dict(self._transfer_stats),
                # Cumulative counters; the router turns their growth into Prometheus counters.
                "prefix_cache_queries": s.stats.prefix_cache_queries,
                "prefix_cache_hits": s.stats.prefix_cache_hits,
                "preemptions": dict(s.stats.num_preemptions)}

    # -- commands (loop thread) ----------------------------------------------------------------
    def _handle(self, msg: dict) -> None:
        op, rid = msg["op"], msg["rid"]
        if op == "abort":
            self._abort(rid)
            return
        params = SamplingParams(**msg["params"])
        try:
            if op == "generate":
                self.engine.add_request(prompt_token_ids=msg["prompt_token_ids"], params=params,
                                        request_id=rid, priority=msg.get("priority", 0))
            elif op == "prefill":
                self.engine.add_request(prompt_token_ids=msg["prompt_token_ids"], params=params,
                                        request_id=rid, priority=msg.get("priority", 0), prefill_only=True)
            elif op == "decode":
                msg["params_obj"] = params
                self._pending.append(msg)
            else:
                raise ValueError(f"unknown op {op!r}")
        except ValueError as e:
            self._emit([{"rid": rid, "tokens": [], "finished": True, "reason": "error", "error": str(e)}])

    def _abort(self, rid: str) -> None:
        self._pending = deque(m for m in self._pending if m["rid"] != rid)
        self._leases.pop(rid, None)
        self.engine.abort(rid)

    def _release(self, rid: str) -> None:
        self._leases.pop(rid, None)
        self.engine.release(rid)

    def _expire_leases(self) -> None:
        if not self._leases:
            return
        now = time.monotonic()
        for rid in [r for r, t in self._leases.items() if t < now]:
            log.warning("worker %s: KV lease of %s expired before a decode worker pulled it",
                        self.worker_id, rid)
            self._release(rid)

    def _admit_pending(self) -> None:
        """Reserve blocks for waiting decode requests, oldest first, while there is room."""
        while self._pending:
            msg = self._pending[0]
            p = msg["prompt_token_ids"]
            dst = self.engine.reserve(msg["rid"], p + msg["first_tokens"], len(p), msg["params_obj"],
                                      msg.get("priority", 0))
            if dst is None:
                return                                  # backpressure: pull later
            self._pending.popleft()
            threading.Thread(target=self._pull, args=(msg, dst), daemon=True,
                             name=f"pull-{msg['rid']}").start()

    def _pull(self, msg: dict, dst: list[int]) -> None:
        """Transfer thread: ask the prefill worker to send, receive into the reserved blocks."""
        rid, prefill_id = msg["rid"], msg["prefill_id"]
        prefill = _peer(self.cluster_id, prefill_id)
        try:
            transport = self._get_transport()
            # One pull at a time per prefill peer, and a shared id: both sides run the pair's
            # transfers in the same order, and a mix-up fails loudly instead of swapping KV.
            with self._peer_lock(prefill_id):
                self._transfer_ids += 1
                tid = self._transfer_ids
                t0 = time.monotonic()
                sent = prefill.send_kv.remote(rid, self.worker_id, transport.store_addr, tid)
                nbytes = transport.recv_blocks(prefill_id, self.engine.runner.kv_caches, dst,
                                               self.transfer_timeout_s, tid)
                _wait_ref(sent, self.transfer_timeout_s)
                self._record_transfer(nbytes, time.monotonic() - t0)
        except Exception as e:
            log.warning("worker %s: KV pull of %s failed: %s", self.worker_id, rid, e)
            with self._cv:
                self._transfer_stats["failures"] += 1
            prefill.release_kv.remote(rid)
            self._call_in_loop(lambda: (self.engine.abort(rid), self._emit(
                [{"rid": rid, "tokens": [], "finished": True, "reason": "error",
                  "error": f"KV transfer failed: {e}", "retryable": True}])))
            return
        prefill.release_kv.remote(rid)                  # acknowledged: the prefill side frees
        self._call_in_loop(lambda: self.engine.commit_received(rid))

    def _peer_lock(self, peer_id: str) -> threading.Lock:
        with self._cv:
            return self._peer_locks.setdefault(peer_id, threading.Lock())

    def _record_transfer(self, nbytes: int, seconds: float) -> None:
        with self._cv:
            self._transfer_stats["bytes"] += nbytes
            self._transfer_stats["count"] += 1
            self._transfer_stats["seconds"] += seconds
            self._samples["kv_transfer_s"].append(seconds)

    def _get_transport(self):
        with self._cv:
            if self._transport is None:
                from workers.kv_transfer import make_transport
                self._transport = make_transport(self._transport_kind, self.engine.device, self.worker_id,
                                                 host=_node_ip())
            return self._transport


def actor_name(cluster_id: str, worker_id: str) -> str:
    return f"pdcluster-{cluster_id}-{worker_id}"


def _peer(cluster_id: str, worker_id: str):
    import ray                     # peers are named actors in the cluster's namespace
    return ray.get_actor(actor_name(cluster_id, worker_id), namespace="pdcluster")


def _node_ip() -> str:
    import ray
    return ray.util.get_node_ip_address()


def _wait_ref(ref, timeout_s: float):
    import ray
    return ray.get(ref, timeout=timeout_s)
