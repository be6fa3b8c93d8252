#!/usr/bin/env python
"""The KV handoff as served (issue 16, item 1): a local `small` cluster of 1 prefill + 1 decode
worker behind the HTTP server, prompts sent one at a time, once per transport, beside this
machine's memcpy measured in the same run.

    .venv/bin/python benchmarks/bench_handoff.py [--long 5] [--short 20] [--transports gloo,shm,shm@2/1]
        [--overlap N] [--max-num-batched-tokens 2048]

Per transport, a fresh cluster gets --long prompts of --long-len tokens, then --short prompts
of --short-len tokens (random token ids, each prompt distinct, so no block is in the decode
worker's prefix cache), each for 4 greedy tokens, streamed; the long prompts --overlap at a time
(1: one after another; more: each handoff overlaps the next prompts' prefill, as under load).
From the decode worker's own counters (`pdcluster:kv_transfer_bytes`, `pdcluster:kv_transfer_seconds`:
one pull's seconds of copying, from asking the prefill worker for the KV to the last byte in the
reserved blocks, less any wait for the next chunk when it streams; `pdcluster:kv_transfer_tail_seconds`:
what the pull had left once the prompt was held):

    copying ms   mean seconds of one pull
    GB/s         bytes pulled / seconds pulling, and that as a fraction of memcpy
    left after   mean tail: a prompt longer than --max-num-batched-tokens is prefilled in chunks
                 and its KV streams chunk by chunk, so only the last chunk's copy is left; as a
                 fraction of memcpy: bytes pulled / tail seconds
    gap ms       as the client sees it: first token to second token (the handoff, the decode
                 worker taking the sequence into its batch, and one decode step), median

memcpy = bytes / time of `y.copy_(x)` on 256 MiB of fp32 (best of 7) from
benchmarks/common.py's memory_bandwidth(), with this process's torch threads (two on the
2-core box), before the clusters.

`TRANSPORT@P/D` runs tensor-parallel pools: P ranks per prefill worker, D per decode worker (the
handoff re-shards the KV heads on the way; each rank asks Ray for --cpus-per-worker).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from benchmarks.common import Meter, add_common_args, memory_bandwidth, write_json  # noqa: E402
from cluster.run.launcher import NAMESPACE, ClusterSpec  # noqa: E402
from cluster.run.serve import ServingCluster, free_port  # noqa: E402


def counter(cluster, name: str) -> float:
    """A metric summed over its label sets (the router's registry: what /metrics serves)."""
    return sum(s.value for family in cluster.server.metrics.registry.collect() for s in family.samples
               if s.name == name)


def pulls(cluster) -> tuple[float, float, float, float]:
    """(bytes, seconds, count, tail seconds) of the decode worker's KV pulls so far."""
    return (counter(cluster, "pdcluster:kv_transfer_bytes_total"), counter(cluster, "pdcluster:kv_transfer_seconds_sum"),
            counter(cluster, "pdcluster:kv_transfer_seconds_count"),
            counter(cluster, "pdcluster:kv_transfer_tail_seconds_sum"))


def wait_counted(cluster, count: float, deadline_s: float = 30.0) -> tuple[float, float, float, float]:
    """The pulls once the router has polled `count` of them (the samples ride on polls)."""
    end = time.monotonic() + deadline_s
    while True:
        got = pulls(cluster)
        if got[2] >= count or time.monotonic() > end:
            return got
        time.sleep(0.05)


def second_token_gap(client: httpx.Client, url: str, prompt: list[int]) -> float:
    """Seconds from the first streamed token to the second."""
    times = []
    body = {"model": "small", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
    with client.stream("POST", url, json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and '"text"' in line:
                times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError(f"expected at least 2 streamed tokens, got {len(times)}")
    return times[1] - times[0]


def phase(c, client: httpx.Client, n: int, length: int, rng: random.Random, overlap: int = 1) -> dict:
    """`n` prompts of `length` tokens, `overlap` in flight at a time (1: one after another; more:
    a prompt's handoff runs while the next ones prefill, as under load)."""
    before = wait_counted(c, 0)
    prompts = [[rng.randrange(3, 250) for _ in range(length)] for _ in range(n)]
    url = c.base_url + "/completions"
    if overlap <= 1:
        gaps = [second_token_gap(client, url, prompt) for prompt in prompts]
    else:
        with concurrent.futures.ThreadPoolExecutor(overlap) as pool:
            gaps = list(pool.map(lambda prompt: second_token_gap(client, url, prompt), prompts))
    after = wait_counted(c, before[2] + n)
    nbytes, seconds, count, tail = (a - b for a, b in zip(after, before))
    return {"prompts": n, "tokens": length, "pulls": count, "bytes_per_pull": nbytes / max(count, 1),
            "handoff_ms": 1e3 * seconds / max(count, 1), "GBps": nbytes / seconds / 1e9 if seconds else 0.0,
            "tail_ms": 1e3 * tail / max(count, 1), "tail_GBps": nbytes / tail / 1e9 if tail else 0.0,
            "gap_ms_p50": 1e3 * statistics.median(gaps), "overlap": overlap}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--long", type=int, default=5)
    p.add_argument("--long-len", type=int, default=3000)
    p.add_argument("--short", type=int, default=20)
    p.add_argument("--short-len", type=int, default=64)
    p.add_argument("--overlap", type=int, default=1,
                   help="long prompts in flight at a time (more than 1: handoffs overlap the next prefills)")
    p.add_argument("--transports", default="gloo,shm")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="the prefill's token budget per step (serve's default): a longer prompt is prefilled "
                        "in chunks, and its KV streams to the decode worker chunk by chunk")
    p.add_argument("--ray-cpus", type=int, default=4)
    add_common_args(p, "each transport's run")
    a = p.parse_args()
    import ray
    ray.init(num_cpus=a.ray_cpus, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    meter = Meter()
    memcpy = memory_bandwidth()["copy"] / 1e9
    print(f"memcpy {memcpy:.2f} GB/s", flush=True)
    report = {"memcpy_GBps": memcpy, "transports": {}}
    rng = random.Random(0)
    for name in a.transports.split(","):
        transport, _, sizes = name.partition("@")
        prefill_tp, decode_tp = map(int, (sizes or "1/1").split("/"))
        spec = ClusterSpec(model="small", num_prefill=1, num_decode=1, num_cpus_per_worker=1, kv_transport=transport,
                           prefill_tensor_parallel_size=prefill_tp, decode_tensor_parallel_size=decode_tp,
                           engine={"scheduler": {"max_num_batched_tokens": a.max_num_batched_tokens}})
        with ServingCluster(spec, port=free_port(), admission="queue") as c, httpx.Client() as client:
            second_token_gap(client, c.base_url + "/completions", [rng.randrange(3, 250) for _ in range(16)])  # warm
            if a.wait_idle:
                meter.wait_idle(a.wait_idle)
            with meter.part(name):
                rows = {"long": phase(c, client, a.long, a.long_len, rng, a.overlap),
                        "short": phase(c, client, a.short, a.short_len, rng)}
        report["transports"][name] = rows
        for phase_name, r in rows.items():
            print(f"{name:9s} {phase_name:5s} {r['tokens']:5d} tokens x{r['overlap']}: {r['bytes_per_pull'] / 1e6:7.2f} MB/pull, "
                  f"copying {r['handoff_ms']:8.2f} ms, {r['GBps']:6.2f} GB/s ({r['GBps'] / memcpy:5.1%} of memcpy), "
                  f"left after the prefill {r['tail_ms']:8.2f} ms ({r['tail_GBps'] / memcpy:6.1%} of memcpy), "
                  f"first->second token {r['gap_ms_p50']:7.1f} ms", flush=True)
    t = report["transports"]
    base = next(iter(t))
    for name in t:                  # each run against the first in --transports
        if name != base:
            print(f"{name} / {base}: long handoff {t[name]['long']['handoff_ms'] / t[base]['long']['handoff_ms']:.3f}x, "
                  f"short handoff {t[name]['short']['handoff_ms'] / t[base]['short']['handoff_ms']:.3f}x")
    busy = meter.busy()
    if busy:
        print(f"note: other processes kept cores busy during {busy}")
    write_json(a.json, {"args": vars(a), "report": report, "parts": meter.parts})


if __name__ == "__main__":
    main()
