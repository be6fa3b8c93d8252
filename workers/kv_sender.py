"""The prefill side of the handoff: a held request's KV leaves this worker, sent over the
transport to the decode worker that asked (`send`), or lent to one on this node that copies it
out of this worker's shared-memory cache itself (`lend`); `release` frees it once the decode
worker has it (full blocks stay in the prefix cache). The held block ids are in the handoff
book from the moment the request is held, so none of this waits for the engine loop."""
from __future__ import annotations

import os
from collections.abc import Callable

from workers.handoff import HandoffBook, HandoffError
from workers.kv_movers import LocalKV
from workers.kv_shm import copy_heads
from workers.messages import KVSendRequest, decode


class KVSender:
    def __init__(self, local: LocalKV, handoffs: HandoffBook, in_loop: Callable, apply: Callable):
        """`in_loop(fn)` runs fn on the engine loop thread; `apply(rid, outcome)` carries out
        what the handoff book decided for a request's blocks there."""
        self.local, self.handoffs, self.in_loop, self.apply = local, handoffs, in_loop, apply

    def send(self, payload: bytes) -> int:
        """Send a held request's prompt KV to the decode worker that asked (an encoded
        KVSendRequest; the receiver waits in recv with the same transfer id). Returns bytes."""
        from workers.kv_transfer import KVPeer
        local = self.local
        req = decode(payload, KVSendRequest)
        block_ids = self.handoffs.start_send(req.rid)      # None: released, aborted, expired
        peer = KVPeer(req.peer_id, req.store_addr, req.secret)
        if block_ids is None:
            local.transport().refuse(peer, local.wire_caches(0), local.timeout_s, req.transfer_id)
            raise HandoffError(f"request {req.rid}: no KV held here (released, aborted or its lease expired)")
        try:
            ids = list(block_ids[req.skip:])
            caches = local.wire_caches(len(ids))
            if caches is not local.engine.runner.kv_caches:      # tensor parallel: gather the ranks' heads
                gathered = list(range(len(ids)))
                copy_heads(local.parts, ids, [(0, caches)], gathered)
                ids = gathered
            return local.transport().send_blocks(peer, caches, ids, local.timeout_s, req.transfer_id, local.faults)
        finally:
            self.in_loop(lambda: self.apply(req.rid, self.handoffs.end_send(req.rid)))

    def lend(self, rid: str, skip: int = 0) -> tuple[list[int], float, int] | None:
        """(the block ids after the first `skip`, the loan's deadline on this node's monotonic
        clock, this process's id), or None when nothing is held."""
        self.local.faults.hit("send", "before_header")
        lent = self.handoffs.lend(rid, self.local.timeout_s)
        if lent is None:
            return None
        block_ids, deadline = lent
        return list(block_ids[skip:]), deadline, os.getpid()

    def release(self, rid: str) -> None:
        self.in_loop(lambda: self.apply(rid, self.handoffs.release(rid)))
