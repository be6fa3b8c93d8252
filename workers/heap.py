"""The garbage collector's share of a serving process: what it started with kept out of its reach.

A full (oldest-generation) collection walks every container object alive, and a serving process
holds hundreds of thousands from its start (torch, Ray, the model's modules, the tokenizer) that
live until it exits. Each such walk stopped the router's event loop for 150-220 ms on a 2-core
test box (380,000 objects in a test's process), with the prefill line held near the TTFT target
under overload, and every request in the line missed. Frozen after start (`gc.freeze`: the
objects alive move to a generation no collection walks), a collection walks only what the
process made since (3-14 ms there). vLLM's API server and engine freeze theirs after start too.

The router holds it while it serves (cluster/run/serve.py DrainingServer), and a worker started by
the launcher from its start to its shutdown (`WorkerSettings.freeze_heap`): served at three times
capacity, the router's collections of 156-191 ms came every 7-20 s and each stalled the stream of
every request decoding then (110-129 at once), and a worker's came about once in 100 s (179 ms).
`hold` and `release` pair up, so that a process that runs a router for a while and then goes on
(a test, a notebook: `ServingCluster` in-process) gets its collector back as it was once the last
holder in it stops. A Worker made in a test's own process does not freeze (the setting's default).
"""
from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0


def hold() -> None:
    """Collect once (garbage made at start would otherwise stay frozen), then freeze what is
    alive: later full collections walk only objects made after it."""
    global _holders
    with _lock:
        gc.collect()
        gc.freeze()
        _holders += 1


def release() -> None:
    """One holder is done; the last one hands the frozen objects back to the collector (they
    join the oldest generation, and garbage among them is collected again)."""
    global _holders
    with _lock:
        _holders = max(0, _holders - 1)
        if _holders == 0:
            gc.unfreeze()
