#!/usr/bin/env python
"""KV handoff bandwidth and latency between two processes, beside this machine's memcpy.

    .venv/bin/python benchmarks/bench_kv_transfer.py [--iters 7] [--threads 1]
    python benchmarks/bench_kv_transfer.py --device cuda [--dtype bfloat16] [--json OUT]   # NCCL

This process is the prefill side (sender); a spawned child is the decode side (receiver), as
in the cluster. For each layout and prompt length, the prompt's ceil(tokens / block_size)
blocks are sent from scattered block ids into different scattered block ids (one transfer =
header round trip + one packed buffer). Per transfer:

    latency  = receiver's end of unpack - sender's start (one CLOCK_MONOTONIC on one host)
    pack     = sender's index_select of every layer's K and V into the buffer (it runs while
               the header makes its round trip, so part of it can hide there)
    unpack   = receiver's index_copy_ into its cache
    wire     = latency - pack - unpack: what is left of the header round trip, and the payload
               through Gloo (user -> kernel socket -> user on loopback, plus Gloo's framing)
    GB/s     = KV bytes / latency (1 GB = 1e9 bytes), and that as a fraction of memcpy

memcpy = bytes / time of `y.copy_(x)` on 256 MiB of fp32 (best of 7), measured in this run with
the same torch thread count by memory_bandwidth() of benchmarks/common.py (bench_offline.py's
probe too); `x.clone()` is printed too, but it also pays a page fault per fresh 4 KiB page,
which the transport's reused staging buffers do not. A handoff has at least four such copies on
one host (pack, into the socket, out of the socket, unpack), so ~25% of memcpy is the ceiling.
Medians over --iters transfers after one warm-up (the warm-up also builds the pair's group).

--device cuda: the same over NCCL, caches on the GPU, beside the GPU's own device-to-device
copy_ (the same probe on the device). With two or more GPUs the sender uses cuda:0 and the
receiver cuda:1, as a prefill and a decode worker would. With one GPU both use cuda:0, which NCCL
only accepts when each process has its own NCCL_HOSTID: it then takes them for two hosts and
moves the bytes through its socket transport over loopback (plus a device-host copy on each
side), so the one-GPU figures measure that path, a lower bound, not NVLink; the header says which.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import memory_bandwidth, write_json  # noqa: E402
from workers.kv_transfer import KVLayout, make_transport  # noqa: E402

LAYOUTS = {   # num_layers, block_size, num_kv_heads, head_dim (fp32), as the built-in models
    "tiny": (4, 16, 4, 32),
    "small": (12, 16, 4, 64),
}
PROMPTS = [128, 512, 1024, 2048, 4096]
NUM_BLOCKS = 320                           # > 4096 / 16, so every prompt fits with room to scatter
HOST = "127.0.0.1"
REPLY_S = 120


def make_caches(layout: tuple[int, int, int, int], seed: int, device: str = "cpu", dtype: str = "float32"):
    layers, block_size, heads, dim = layout
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, block_size, heads, dim)
    dt = getattr(torch, dtype)
    return [(torch.randn(shape, generator=g).to(device, dt), torch.randn(shape, generator=g).to(device, dt))
            for _ in range(layers)]


def devices(device: str) -> tuple[str, str, bool]:
    """(sender's device, receiver's device, whether both share one GPU)."""
    if device == "cpu":
        return "cpu", "cpu", False
    if torch.cuda.device_count() >= 2:
        return "cuda:0", "cuda:1", False
    return "cuda:0", "cuda:0", True


def use_single_gpu_nccl_env() -> None:
    """Two processes on one GPU form an NCCL pair only with host ids of their own (NCCL then uses
    its network transport between them); over loopback unless the environment names an interface.
    tests/test_cuda_nccl.py does the same."""
    os.environ["NCCL_HOSTID"] = f"pdcluster-bench-{os.getpid()}"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")


def transport(worker_id: str, device: str, shared_gpu: bool):
    if shared_gpu:
        use_single_gpu_nccl_env()
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    return make_transport("nccl" if device.startswith("cuda") else "gloo", device, worker_id, HOST)


def scattered(n: int, seed: int) -> list[int]:
    return torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))[:n].tolist()


def receiver_main(conn, threads: int, device: str = "cpu", dtype: str = "float32", shared_gpu: bool = False) -> None:
    """The decode side: answers `setup` with how the sender addresses it (its store and the pair's
    secret: a KVPeer), `recv` with (end time, stats)."""
    torch.set_num_threads(threads)
    receiver = transport("decode-0", device, shared_gpu)
    caches = None
    while (msg := conn.recv()) is not None:
        op, args = msg
        if op == "setup":
            caches = make_caches(*args, device=device, dtype=dtype)
            conn.send(receiver.peer_for("prefill-0"))
        elif op == "recv":
            block_ids, = args
            conn.send("ready")
            receiver.recv_blocks("prefill-0", caches, block_ids, timeout_s=60.0)
            conn.send((time.perf_counter(), receiver.last_stats))


def reply(conn):
    if not conn.poll(REPLY_S):
        raise SystemExit(f"receiver did not answer within {REPLY_S}s")
    return conn.recv()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (workers use 1)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: Gloo over loopback (default); cuda: NCCL, caches on the GPU")
    ap.add_argument("--dtype", default="float32", help="KV cache dtype (float32, the default, or bfloat16)")
    ap.add_argument("--prompts", default=",".join(map(str, PROMPTS)), help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA GPU here (torch " + torch.__version__ + ")")
    prompts = [int(x) for x in args.prompts.split(",") if x.strip()]
    limit = NUM_BLOCKS * min(layout[1] for layout in LAYOUTS.values())
    if not prompts or min(prompts) < 1 or max(prompts) > limit:
        raise SystemExit(f"--prompts: lengths from 1 to {limit} tokens (the caches hold {NUM_BLOCKS} blocks)")
    send_dev, recv_dev, shared_gpu = devices(args.device)

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=receiver_main, args=(child_conn, args.threads, recv_dev, args.dtype, shared_gpu),
                        daemon=True)
    child.start()
    sender = transport("prefill-0", send_dev, shared_gpu)

    bw = memory_bandwidth(device=send_dev)
    copy_bw = bw["copy"] / 1e9
    where = "device-to-device " if args.device == "cuda" else ""
    print(f"memcpy: {copy_bw:.2f} GB/s {where}copy_ into a preallocated tensor, {bw['clone'] / 1e9:.2f} GB/s clone "
          f"(256 MiB fp32, best of 7, {args.threads} torch thread(s)); the bound below is copy_")
    if args.device == "cpu":
        link = "gloo over loopback"
    elif shared_gpu:
        link = (f"nccl, both processes on {torch.cuda.get_device_name(0)} (one GPU: distinct NCCL_HOSTID, "
                "so NCCL's socket transport over loopback, not NVLink: a lower bound)")
    else:
        link = f"nccl, {send_dev} ({torch.cuda.get_device_name(0)}) -> {recv_dev} ({torch.cuda.get_device_name(1)})"
    print(f"torch {torch.__version__}, {link}, KV {args.dtype}, {os.cpu_count()} CPUs, "
          f"medians of {args.iters} transfers\n")
    report = {"device": args.device, "link": link, "dtype": args.dtype, "torch": torch.__version__,
              "memcpy_GBps": copy_bw, "clone_GBps": bw["clone"] / 1e9, "iters": args.iters, "rows": []}
    header = (f"{'layout':<6} {'tokens':>6} {'blocks':>6} {'MiB':>7} {'latency ms':>10} {'GB/s':>6} "
              f"{'of memcpy':>9} {'pack ms':>8} {'wire ms':>8} {'unpack ms':>9}  time share pack/wire/unpack")
    print(header)
    print("-" * len(header))
    for name, layout in LAYOUTS.items():
        conn.send(("setup", (layout, 2)))
        peer = reply(conn)
        caches = make_caches(layout, 1, send_dev, args.dtype)
        bytes_per_block = KVLayout.of(caches).bytes_per_block
        for tokens in [0] + prompts:        # 0 tokens: the header round trip alone
            n = math.ceil(tokens / layout[1])
            src, dst = scattered(n, tokens), scattered(n, tokens + 1)
            rows = []
            for i in range(args.iters + 1):
                conn.send(("recv", (dst,)))
                assert reply(conn) == "ready"
                t0 = time.perf_counter()
                sender.send_blocks(peer, caches, src, timeout_s=60.0)
                pack_s = sender.last_stats.pack_s
                t_end, rstats = reply(conn)
                if i:                       # the first one is a warm-up (and may connect)
                    rows.append((t_end - t0, pack_s, rstats.unpack_s))
                else:
                    connect_s = sender.last_stats.connect_s
            lat = statistics.median(r[0] for r in rows)
            pack = statistics.median(r[1] for r in rows)
            unpack = statistics.median(r[2] for r in rows)
            wire = lat - pack - unpack
            nbytes = n * bytes_per_block
            if not n:
                print(f"{name:<6} {'header round trip alone':>21} {lat * 1e3:>10.3f}   "
                      f"(first transfer built the pair's group in {connect_s * 1e3:.1f} ms)")
                report["rows"].append({"layout": name, "tokens": 0, "latency_ms": lat * 1e3,
                                       "connect_ms": connect_s * 1e3})
                continue
            gbps = nbytes / lat / 1e9
            report["rows"].append({"layout": name, "tokens": tokens, "blocks": n, "bytes": nbytes,
                                   "latency_ms": lat * 1e3, "GBps": gbps, "fraction_of_memcpy": gbps / copy_bw,
                                   "pack_ms": pack * 1e3, "wire_ms": wire * 1e3, "unpack_ms": unpack * 1e3})
            print(f"{name:<6} {tokens:>6} {n:>6} {nbytes / 2**20:>7.2f} {lat * 1e3:>10.3f} {gbps:>6.2f} "
                  f"{gbps / copy_bw:>9.0%} {pack * 1e3:>8.3f} {wire * 1e3:>8.3f} {unpack * 1e3:>9.3f}  "
                  f"{pack / lat:>4.0%} / {wire / lat:>4.0%} / {unpack / lat:>4.0%}")
        sender.close("decode-0")            # the next layout reconnects: a new handshake
    conn.send(None)
    child.join(10)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
