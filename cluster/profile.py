"""`pdcluster profile`: measure this machine's engine and KV handoff, fit the cost model.

    pdcluster profile --model tiny --output profile.json

Steps are timed on the real engine (the served code path, one torch thread as a worker runs)
over a grid of batch shapes: prefill batches of k prompts of l tokens, chunks on cached context,
and decode batches of n sequences at context c. Each timed step's shape is the one the engine
itself reports (`last_shape`), so the fit sees exactly what the simulator will ask about. The
handoff is timed between two processes over the transport the CPU cluster uses (Gloo), and
fitted as latency + bytes / bandwidth. The JSON is a CostModel (workers/cost_model.py) plus the
raw samples and the fit's error, so a profile can be checked and refitted.
"""
from __future__ import annotations

import json
import logging
import math
import multiprocessing as mp
import os
import platform
import random
import statistics
import time
from pathlib import Path

from workers.cost_model import BatchShape, CostModel, LinearStepModel, Link

log = logging.getLogger("pdcluster.profile")

PREFILL_GRID = [(1, 16), (1, 64), (1, 128), (1, 256), (1, 384), (1, 512), (2, 256), (4, 128), (4, 256),
                (8, 64), (2, 512), (1, 1024)]                   # (prompts, tokens each)
DECODE_GRID = [(1, 64), (1, 512), (4, 128), (8, 256), (16, 128), (16, 512), (32, 64), (32, 256), (64, 128),
               (64, 384), (128, 64), (8, 1024)]                 # (sequences, context)
HANDOFF_TOKENS = [16, 64, 256, 1024, 2048]
HOST = "127.0.0.1"


def _median_step(engine, repeats: int) -> tuple[BatchShape, float] | None:
    """Time `repeats` steps of the engine as it stands; the median, with the first step's shape
    (later steps of a decode batch differ only in context, which the fit sees per sample)."""
    samples = []
    for _ in range(repeats):
        if not engine.has_unfinished():
            break
        t0 = time.perf_counter()
        engine.step()
        samples.append((engine.last_shape, time.perf_counter() - t0))
    if not samples:
        return None
    samples.sort(key=lambda s: s[1])
    return samples[len(samples) // 2]


def profile_steps(engine, repeats: int = 5, seed: int = 0, progress=print) -> list[tuple[BatchShape, float]]:
    """Timed steps over the grids, on an engine without prefix caching (every token computes)."""
    from workers.sequence import SamplingParams
    rng = random.Random(seed)
    vocab, limit = engine.vocab_size, engine.max_model_len
    budget = engine.scheduler.cfg.max_num_batched_tokens
    max_seqs = engine.scheduler.cfg.max_num_seqs
    out = []
    ids = (lambda n: [rng.randrange(vocab) for _ in range(n)])

    def clear():
        for rid in list(engine._seqs):
            engine.abort(rid)

    engine.generate([{"prompt_token_ids": ids(32)}], SamplingParams(max_tokens=4, ignore_eos=True))   # warm-up
    for k, n in PREFILL_GRID:
        if k * n > budget or n >= limit:
            continue
        for _ in range(repeats):                  # each prompt prefills once: repeat the batch
            for _ in range(k):
                engine.add_request(prompt_token_ids=ids(n), params=SamplingParams(max_tokens=1, ignore_eos=True))
            s = _median_step(engine, 1)
            clear()
            out.append(s)
        progress(f"  prefill {k} x {n} tokens: {statistics.median(t for _, t in out[-repeats:]) * 1e3:.2f} ms")
    # A chunk on cached context: a long prompt split by a small budget (its later chunks attend to the earlier).
    for n in (512, 1024):
        if n >= limit:
            continue
        engine.scheduler.cfg.max_num_batched_tokens = n // 4
        engine.add_request(prompt_token_ids=ids(n), params=SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            out.append((engine.last_shape, time.perf_counter() - t0))
        engine.scheduler.cfg.max_num_batched_tokens = budget
        progress(f"  chunked prefill of {n} tokens in chunks of {n // 4}")
    for k, ctx in DECODE_GRID:
        if k > max_seqs or ctx + repeats + 2 >= limit or k * ctx > engine.layout.max_resident_tokens * 0.9:
            continue
        for _ in range(k):
            engine.add_request(prompt_token_ids=ids(ctx), params=SamplingParams(max_tokens=repeats + 2,
                                                                                 ignore_eos=True))
        while any(s.num_output_tokens == 0 for s in engine._seqs.values()):
            engine.step()                          # prefill them all (not timed)
        s = _median_step(engine, repeats)
        clear()
        if s is not None and s[0].num_decode == k:
            out.append(s)
            progress(f"  decode {k} x {ctx} context: {s[1] * 1e3:.2f} ms")
    return out


# -- the handoff: two processes over Gloo, as the CPU cluster's pairs ---------------------------------
def _receiver(conn, layout: tuple[int, int, int, int], num_blocks: int) -> None:
    import torch

    from workers.kv_transfer import GlooTransport
    torch.set_num_threads(1)
    transport = GlooTransport("decode-0", "cpu", HOST)
    caches = _caches(layout, num_blocks)
    conn.send(transport.store_addr)
    while (block_ids := conn.recv()) is not None:
        conn.send("ready")
        transport.recv_blocks("prefill-0", caches, block_ids, timeout_s=60.0)
        conn.send(time.perf_counter())


def _caches(layout, num_blocks: int):
    import torch
    layers, block_size, heads, dim = layout
    return [(torch.zeros(num_blocks, block_size, heads, dim), torch.zeros(num_blocks, block_size, heads, dim))
            for _ in range(layers)]


def profile_handoff(layout: tuple[int, int, int, int], repeats: int = 5,
                    progress=print) -> list[tuple[int, float]]:
    """(bytes, seconds) of KV transfers of HANDOFF_TOKENS tokens between two processes."""
    import torch

    from workers.kv_transfer import GlooTransport, KVLayout, KVPeer
    torch.set_num_threads(1)
    block_size = layout[1]
    num_blocks = math.ceil(max(HANDOFF_TOKENS) / block_size) + 1
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_receiver, args=(child_conn, layout, num_blocks), daemon=True)
    child.start()

    def reply():
        if not conn.poll(120):
            raise RuntimeError("the handoff probe's receiver did not answer within 120 s")
        return conn.recv()
    try:
        peer = KVPeer("decode-0", reply())
        sender = GlooTransport("prefill-0", "cpu", HOST)
        caches = _caches(layout, num_blocks)
        per_block = KVLayout.of(caches).bytes_per_block
        out = []
        for tokens in HANDOFF_TOKENS:
            blocks = list(range(math.ceil(tokens / block_size)))
            times = []
            for i in range(repeats + 1):
                conn.send(blocks)
                reply()
                t0 = time.perf_counter()
                sender.send_blocks(peer, caches, blocks, timeout_s=60.0)
                end = reply()
                if i:                              # the first builds the pair's group
                    times.append(end - t0)
            out.append((len(blocks) * per_block, statistics.median(times)))
            progress(f"  handoff of {tokens} tokens ({out[-1][0] / 2**20:.2f} MiB): {out[-1][1] * 1e3:.2f} ms")
        sender.close("decode-0")
        conn.send(None)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    return out


def fit_link(samples: list[tuple[int, float]], name: str) -> Link:
    """Least squares of seconds = latency + bytes / bandwidth."""
    n = len(samples)
    mx = sum(b for b, _ in samples) / n
    my = sum(t for _, t in samples) / n
    slope = sum((b - mx) * (t - my) for b, t in samples) / max(1e-30, sum((b - mx) ** 2 for b, _ in samples))
    slope = max(slope, 1e-15)
    return Link(name, 1.0 / slope, max(0.0, my - slope * mx))


def relative_errors(model: LinearStepModel, samples: list[tuple[BatchShape, float]]) -> list[float]:
    return [abs(model.step_s(s) - t) / t for s, t in samples if t > 0]


def run_profile(engine_cfg, output: str, repeats: int = 5, progress=print) -> dict:
    """Profile `engine_cfg`'s model on this machine and write the cost model JSON."""
    import dataclasses

    import torch

    from workers.engine import LLMEngine
    torch.set_num_threads(1)
    cfg = dataclasses.replace(engine_cfg, cache=dataclasses.replace(engine_cfg.cache, enable_prefix_caching=False))
    t_start = time.perf_counter()
    engine = LLMEngine(cfg)
    progress(f"profiling {cfg.model} on this machine ({os.cpu_count()} CPUs, 1 torch thread): engine steps")
    steps = profile_steps(engine, repeats, progress=progress)
    step_model = LinearStepModel.fit(steps, per_chunk=True)
    errors = relative_errors(step_model, steps)
    mcfg = engine.model_config
    layout = (mcfg.num_hidden_layers, cfg.cache.block_size, mcfg.num_key_value_heads, mcfg.head_dim)
    progress("the KV handoff (Gloo between two processes)")
    transfers = profile_handoff(layout, repeats, progress)
    link = fit_link(transfers, "measured: gloo, two processes on this machine")
    cost = CostModel(step=step_model, kv_bytes_per_token=engine.layout.bytes_per_token,
                     kv_capacity_tokens=engine.layout.max_resident_tokens, link=link, tp=1,
                     source=f"profile of {cfg.model} on {platform.node() or 'this machine'}")
    doc = cost.to_json()
    doc["profile"] = {
        "model": cfg.model, "cpus": os.cpu_count(), "torch_threads": 1, "block_size": cfg.cache.block_size,
        "max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
        "fit_median_rel_error": statistics.median(errors), "fit_max_rel_error": max(errors),
        "seconds": time.perf_counter() - t_start,
        "steps": [{"shape": dataclasses.asdict(s), "seconds": t} for s, t in steps],
        "handoffs": [{"bytes": b, "seconds": t} for b, t in transfers],
    }
    Path(output).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def load_profile(path: str) -> tuple[CostModel, dict]:
    """A profile JSON (or any CostModel JSON): the cost model and the profile's facts ({} if none)."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"--profile {path}: no such file (make one with `pdcluster profile`)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--profile {path}: not JSON ({e})") from None
    try:
        return CostModel.from_json(doc), doc.get("profile", {})
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--profile {path}: not a cost model ({e})") from None
