"""Constants and checks shared by the test modules (plain Python, importable from tests)."""
from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

VOCAB = 258                 # the byte-level tokenizer: 256 bytes + <s> + </s>
MAX_NEW_TOKENS = 64


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


# >= 16 prompts with lengths spread over 1..300, both ends included.
PROMPT_LENGTHS = [1, 300, 2, 17, 64, 100, 150, 255, 5, 33, 16, 31, 200, 8, 127, 48]
PROMPTS = random_prompts(0, PROMPT_LENGTHS)


def _shared_prefix_prompts() -> list[list[int]]:
    """Three prefixes (48, 100, 200 tokens) each followed by several suffixes; includes exact
    duplicates and a prompt that is exactly a prefix, so full-block hits and the
    last-token-recomputed rule are both exercised."""
    rng = random.Random(1)
    prefixes = [[rng.randrange(VOCAB) for _ in range(n)] for n in (48, 100, 200)]
    prompts = []
    for i, prefix in enumerate(prefixes):
        for suffix_len in (0, 1, 7, 16, 40, 100 - 30 * i):
            prompts.append(prefix + [rng.randrange(VOCAB) for _ in range(suffix_len)])
    prompts.append(list(prompts[3]))          # an exact duplicate
    return prompts


SHARED_PREFIX_PROMPTS = _shared_prefix_prompts()


def assert_all_blocks_free(engine) -> None:
    """After a run: nothing unfinished, every device block back on the free list with
    refcount 0, and the host swap space empty."""
    kv = engine.kv
    assert not engine.scheduler.has_unfinished()
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert len(list(kv.pool.free_queue)) == kv.pool.num_blocks
    assert kv.host.num_free == kv.host.num_blocks


def wait_pools_clean(cluster, deadline_s: float = 30.0) -> list:
    """Every worker of a ServingCluster: no referenced block, nothing held, queued or running
    (within a deadline: aborts and releases travel asynchronously); their LoadReports."""
    import ray

    def probe():
        try:
            return ray.get([w.handle.stats.remote() for w in cluster.workers], timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return None                     # one is being restarted: ask again
    return wait_for(probe, lambda stats: stats is not None and all(
        s.kv_blocks_used == 0 and s.held == 0 and s.running == 0 and s.waiting == 0 and s.pending == 0
        and s.receiving == 0 for s in stats), deadline_s)


def wait_for(probe, ok, deadline_s: float = 20.0, describe=None, poll_s: float = 0.02):
    """probe() until ok(value), then the value; past the deadline an AssertionError naming
    the last value (and describe(), if given). Conditions with deadlines, never bare sleeps."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = probe()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {deadline_s}s: "
                                 f"{describe() if describe else ''} (last: {value})")
        time.sleep(poll_s)


# -- processes a test started (Ray daemons, actors), read from /proc ------------------------------
def _proc_stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, start time, state) of a process, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), fields[19], fields[0]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(*roots: int) -> dict[tuple[int, str], str]:
    """{(pid, start time): command line} of every live process under `roots` (not the roots).
    The start time tells a process from a later one that reuses its pid."""
    parent, started = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _proc_stat(int(entry.name))) is not None:
            parent[int(entry.name)], started[int(entry.name)] = st[0], st[1]
    found, frontier = {}, list(roots)
    while frontier:
        p = frontier.pop()
        for child, pp in parent.items():
            if pp == p and (child, started[child]) not in found:
                found[(child, started[child])] = _cmdline(child)
                frontier.append(child)
    return found


def still_running(procs: dict[tuple[int, str], str]) -> list[str]:
    """The command lines of those processes that still run (a zombie has ended)."""
    return [cmd for (pid, start), cmd in procs.items()
            if (st := _proc_stat(pid)) is not None and st[1] == start and st[2] != "Z"]


def kill_all(procs: dict[tuple[int, str], str]) -> None:
    """SIGKILL whichever of these processes still runs (cleanup after a failure)."""
    for (pid, start), _ in procs.items():
        if (st := _proc_stat(pid)) is not None and st[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
