"""A streamed handoff's bookkeeping (workers/kv_stream.py): words only move forward, a waiting
pull wakes on the next word, an abort or silence ends it, and the copy plan copies each block
once unless its allocation count says it changed. Pure: no torch, no Ray."""
from __future__ import annotations

import threading

import pytest

from workers.kv_stream import CopyPlan, KVFeed, StreamEnded, newer
from workers.messages import HeldKV


def word(ids, gens=None):
    return HeldKV(list(ids), list(gens) if gens is not None else [1] * len(ids), 7)


def test_a_word_is_newer_when_it_names_more_blocks_or_is_the_held_one_and_nothing_follows_that():
    a, b = word([1, 2]), word([1, 2, 3])
    assert newer(b, False, a, False) and not newer(a, False, b, False) and not newer(a, False, a, False)
    assert newer(a, True, b, False)                  # the held KV's word, even naming fewer
    assert not newer(b, True, a, True)               # nothing after it


def test_the_feed_keeps_the_newest_word_and_wakes_a_waiting_pull():
    clock = [0.0]
    feed = KVFeed(word([1]), clock=lambda: clock[0])
    feed.tell(word([]), False)                       # overtaken by the first: stale
    assert feed.kv.block_ids == [1]
    got = []
    t = threading.Thread(target=lambda: got.append(feed.wait(feed.kv, timeout_s=60)))
    t.start()
    clock[0] = 2.5
    feed.tell(word([1, 2, 3], [1, 1, 2]), True)
    t.join(60)
    assert got and got[0][0].block_ids == [1, 2, 3] and got[0][1] is True and feed.final_at == 2.5
    feed.tell(word([1, 2, 3, 4]), False)             # after the held word: stale
    assert feed.kv.block_ids == [1, 2, 3]


def test_an_abort_or_a_silence_ends_the_wait():
    feed = KVFeed(word([1]))
    ended = []

    def wait():
        try:
            feed.wait(feed.kv, 60)
        except StreamEnded as e:
            ended.append(e)
    t = threading.Thread(target=wait)
    t.start()
    feed.end("aborted", aborted=True)
    t.join(60)
    assert ended and ended[0].aborted
    clock = [0.0]

    def tick():                                      # each reading a second later: past the deadline at once
        clock[0] += 1.0
        return clock[0]
    quiet = KVFeed(word([1]), clock=tick)
    with pytest.raises(StreamEnded, match="no word") as e:
        quiet.wait(quiet.kv, timeout_s=0.5)
    assert not e.value.aborted


def test_the_plan_copies_each_block_once_and_again_only_when_its_count_changed():
    dst = [40, 41, 42, 43]
    plan = CopyPlan(dst, skip=1)                     # the first source block is in this worker's prefix cache
    w1 = word([9, 10, 11], [5, 5, 5])
    src, to, gens = plan.needed(w1)
    assert (src, to, gens) == ([10, 11], [40, 41], [5, 5])
    assert plan.copied(w1, src, [5, 6]) == 1         # block 11 was reallocated during the copy
    w2 = word([9, 10, 11, 12], [5, 5, 6, 5])
    assert plan.needed(w2)[:2] == ([11, 12], [41, 42])
    plan.copied(w2, [11, 12], [6, 5])
    held = word([9, 10, 11, 12, 20], [5, 5, 6, 5, 3])
    assert plan.needed(held)[:2] == ([20], [43]) and not plan.complete(held)
    plan.copied(held, [20], [3])
    assert plan.complete(held)
    moved = word([9, 10, 30, 12, 20], [5, 5, 1, 5, 3])   # the prefill worker moved a block: it comes again
    assert plan.needed(moved)[:2] == ([30], [41])
    with pytest.raises(ValueError, match="reserved"):
        plan.needed(word(range(6)))
