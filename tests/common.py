"""Constants and checks shared by the test modules (plain Python, importable from tests)."""
from __future__ import annotations

import random
import time

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
