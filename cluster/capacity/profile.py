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
from workers.names import DECODE, PREFILL
from workers.step_profile import profile_steps

log = logging.getLogger("pdcluster.profile")

HANDOFF_TOKENS = [16, 64, 256, 1024, 2048]


# -- the handoff: two processes on one node, through shared memory, as the CPU cluster's pairs ----
def _owner(conn, layout: tuple[int, int, int, int], num_blocks: int) -> None:
    """The prefill side: a KV cache in shared memory, held until told to go."""
    import torch

    from workers.kv_shm import SharedKVCache
    layers, block_size, heads, dim = layout
    cache = SharedKVCache(layers, (num_blocks, block_size, heads, dim), torch.float32)
    for k, v in cache.kv_caches:
        k.normal_()
        v.normal_()
    conn.send(cache.segment("local").to_dict())
    conn.recv()


def profile_handoff(layout: tuple[int, int, int, int], repeats: int = 5,
                    progress=print) -> list[tuple[int, float]]:
    """(bytes, seconds) of KV handoffs of HANDOFF_TOKENS tokens between two processes of one
    node, as the served path makes them (workers/kv_shm.py: the decode side copies the held
    blocks out of the prefill side's cache, one copy per run of blocks per layer)."""
    import torch

    from workers.kv_shm import KVSegment, PeerCaches, copy_blocks
    torch.set_num_threads(1)
    block_size = layout[1]
    num_blocks = 2 * math.ceil(max(HANDOFF_TOKENS) / block_size) + 1
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_owner, args=(child_conn, layout, num_blocks), daemon=True)
    child.start()
    peers = PeerCaches()
    try:
        if not conn.poll(120):
            raise RuntimeError("the handoff probe's other process did not answer within 120 s")
        layers, _, heads, dim = layout
        mine = [(torch.zeros(num_blocks, block_size, heads, dim), torch.zeros(num_blocks, block_size, heads, dim))
                for _ in range(layers)]
        theirs, _ = peers.open("prefill-0", KVSegment(**conn.recv()), mine)
        out = []
        for tokens in HANDOFF_TOKENS:
            n = math.ceil(tokens / block_size)
            src, dst = list(range(n)), list(range(num_blocks - n, num_blocks))   # apart, as in a pool
            times = []
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                nbytes = copy_blocks(theirs, src, mine, dst)
                if i:                              # the first touches the pages
                    times.append(time.perf_counter() - t0)
            out.append((nbytes, statistics.median(times)))
            progress(f"  handoff of {tokens} tokens ({out[-1][0] / 2**20:.2f} MiB): {out[-1][1] * 1e3:.2f} ms")
        conn.send(None)
    finally:
        peers.close_all()
        child.join(10)
        if child.is_alive():
            child.kill()
    return out


# -- the served path: what a request pays beyond the engine's steps --------------------------------
SERVED_PROMPTS = (32, 128, 256, 384, 512)
SERVED_OUTPUT = 24
LONG_OUTPUT = 96                    # the second loaded loop's outputs: the CPU per token apart from per request
LOADED_CLIENTS = 8                  # the closed loop that measures the router's CPU under load
IDLE_WINDOW_S = 1.0                 # the router's idle CPU, measured before the requests


def profile_served(engine_cfg, step: LinearStepModel, link: Link, kv_bytes_per_token: int, repeats: int = 6,
                   progress=print) -> dict:
    """Serve requests one at a time on a local 1 prefill + 1 decode cluster and measure, against
    the fitted step costs: each decode step's loop overhead (streamed token gaps beyond the step),
    the handoff as served (the gap before the second token beyond one decode step), and what
    a request pays before its prefill (TTFT beyond the prefill step): HTTP, tokenizing, picking,
    the worker's inbox, the event's way back. Then the same number of other prompts from a
    closed loop of LOADED_CLIENTS: the router's and the client's CPU per streamed token under
    load (`router_cpu_per_token_s`; one at a time a token costs about twice that, its events
    unbatched: `router_cpu_per_token_alone_s`). Under that load too, what the simulator charges
    on shared cores: all the machine's busy CPU beside the engines' steps (the router, the
    client, the workers' other threads, Ray) per request and per streamed token, from that loop
    and one more with longer outputs (`background_cpu_per_request_s`, `background_cpu_per_token_s`);
    and each role's steps' wait for a core over their CPU (`loaded_prefill_step_wait`,
    `loaded_decode_step_wait`), whose split is how the simulator shares a shortage of cores
    between prefill and decode steps (`prefill_wait_share`)."""
    import asyncio

    import aiohttp

    from cluster.loadtest import loadgen, promtext
    from cluster.loadtest.bench_data import BenchRequest, RandomText
    from cluster.run.serve import ServingCluster, free_port
    from cluster.run.spec import ClusterSpec
    from workers.checkpoint import load_tokenizer
    tokenizer = load_tokenizer(engine_cfg.model)
    if tokenizer is None:
        raise ValueError(f"model {engine_cfg.model!r} has no tokenizer: the served calibration sends text")
    text = RandomText(tokenizer, random.Random(1))

    def some_requests(seed: int, output_len: int = SERVED_OUTPUT) -> list[BenchRequest]:
        out = [BenchRequest(*text.text(n), output_len) for n in SERVED_PROMPTS for _ in range(repeats)]
        random.Random(seed).shuffle(out)          # lengths interleaved: drift hits them alike
        return out
    # Sets of prompts, none a prefix of another's: one at a time, then under load twice, with
    # short and with long outputs (the machine's CPU beside the steps per request and per token).
    requests, loaded_requests, long_requests = some_requests(2), some_requests(3), some_requests(4, LONG_OUTPUT)
    spec = ClusterSpec(model=engine_cfg.model, num_prefill=1, num_decode=1, engine=engine_cfg)
    progress(f"  launching 1 prefill + 1 decode on {engine_cfg.model} for {len(requests)} requests one at a time, "
             f"{len(loaded_requests)} by {LOADED_CLIENTS} clients")
    with ServingCluster(spec, port=free_port()) as c:
        target = loadgen.Target(f"http://{c.host}:{c.port}", model=engine_cfg.model, ignore_eos=True, timeout_s=120)

        base = f"http://{c.host}:{c.port}"

        async def measured():
            async with aiohttp.ClientSession() as session:
                await loadgen.send(session, target, requests[0])          # warm-up: connections, caches
                # What the router's thread spends with nothing to serve (its polls of the workers):
                # a time-bound cost, taken out of the per-token figures below.
                idle0, t0 = c.router_cpu_s(), time.monotonic()
                await asyncio.sleep(IDLE_WINDOW_S)
                idle_per_s = (c.router_cpu_s() - idle0) / (time.monotonic() - t0)

                async def cpu_per_token(send_all) -> tuple[list, float]:
                    """Run `send_all` and say what the router's thread and this (the client's)
                    thread spent per streamed token, each by its own CPU clock: the process's
                    other threads (Ray's, the supervisor's) cost by time, not by token."""
                    router0, client0, t0 = c.router_cpu_s(), time.thread_time(), time.monotonic()
                    out = await send_all()
                    router_s = c.router_cpu_s() - router0 - idle_per_s * (time.monotonic() - t0)
                    return out, (max(0.0, router_s) + time.thread_time() - client0) / max(1, sum(r.output_len for r in out))

                async def one_at_a_time():
                    return [await loadgen.send(session, target, r) for r in requests]

                async def closed_loop(todo: list[BenchRequest]):   # LOADED_CLIENTS at a time: events batch
                    todo, out = list(todo), []

                    async def client():
                        while todo:
                            out.append(await loadgen.send(session, target, todo.pop()))
                    await asyncio.gather(*(client() for _ in range(LOADED_CLIENTS)))
                    return out
                def since(done: list, m0: dict, box0: float | None) -> tuple:
                    """A loop's results, the metrics before and now, the machine's busy CPU between."""
                    box1 = box_cpu_s()
                    return done, m0, promtext.scrape(base + "/metrics"), None if box0 is None else box1 - box0
                before = promtext.scrape(base + "/metrics")      # the step factors: one at a time
                out, alone = await cpu_per_token(one_at_a_time)
                after, box0 = promtext.scrape(base + "/metrics"), box_cpu_s()
                loaded_results, loaded = await cpu_per_token(lambda: closed_loop(loaded_requests))
                short = since(loaded_results, after, box0)
                m0, box0 = promtext.scrape(base + "/metrics"), box_cpu_s()
                long = since(await closed_loop(long_requests), m0, box0)
                return out, alone, loaded, before, after, [short, long]
        results, cpu_alone, cpu_loaded, before, after, beside = asyncio.run(measured())
    failed = [r.error for r in results + [r for done, *_ in beside for r in done] if not r.success]
    if failed:
        raise RuntimeError(f"served calibration: {len(failed)} requests failed, e.g. {failed[0]}")

    def grew(name: str, role: str, start: dict, end: dict) -> float:
        return promtext.total(end, name, role=role) - promtext.total(start, name, role=role)

    def served_s(role: str) -> tuple[float, float]:
        return tuple(grew("pdcluster:engine_step_duration_seconds" + k, role, before, after) for k in ("_sum", "_count"))

    def prefill_s(n: int) -> float:
        return step.step_s(BatchShape(1, n, n * n))

    def decode_s(context: int) -> float:
        return step.step_s(BatchShape(num_decode=1, decode_context=context))
    # The workers' own step times against the fit's: a served worker shares its process with the
    # actor's threads, and the machine with the router, so its steps run slower than alone.
    (p_sum, p_count), (d_sum, _) = served_s(PREFILL), served_s(DECODE)
    p_factor = p_sum / sum(prefill_s(r.prompt_len) for r in results) if p_count == len(results) else 1.0
    d_factor = d_sum / sum(decode_s(r.prompt_len + 1 + i) for r in results for i in range(r.output_len - 1))
    # What a token pays on its way to the client beyond its decode step (polls, streaming).
    loop = max(0.0, statistics.median(gap - d_factor * decode_s(r.prompt_len + 2 + i)
                                      for r in results for i, gap in enumerate(r.itl[1:])))
    handoff = statistics.median(r.itl[0] - d_factor * decode_s(r.prompt_len + 1) - loop for r in results)
    wire = statistics.median(r.prompt_len * kv_bytes_per_token / link.bandwidth for r in results)
    # Before the prefill: a fixed part and a part that grows with the prompt (its text is sent,
    # parsed and tokenized).
    fixed, per_token = fit_line([(r.prompt_len, r.ttft - p_factor * prefill_s(r.prompt_len)) for r in results])
    # Under the closed loops: what ran beside the engines' steps (the router, the client, the
    # workers' other threads, Ray), from the machine's own count of busy CPU, per request and
    # per streamed token (the short and the long outputs' loops solved for both); and how long
    # the steps waited for a core, over their CPU, by role.
    rows, waited = [], {PREFILL: [0.0, 0.0], DECODE: [0.0, 0.0]}
    for done, m0, m1, box_s in beside:
        steps_cpu = {role: grew("pdcluster:engine_step_cpu_seconds_total", role, m0, m1) for role in waited}
        for role, cpu in steps_cpu.items():
            waited[role][0] += grew("pdcluster:engine_step_duration_seconds_sum", role, m0, m1) - cpu
            waited[role][1] += cpu
        if box_s is not None:
            rows.append((len(done), sum(r.output_len for r in done), box_s - sum(steps_cpu.values())))
    beside_request, beside_token = 0.0, cpu_loaded
    if len(rows) == 2 and rows[0][1] / rows[0][0] != rows[1][1] / rows[1][0]:
        (r1, t1, c1), (r2, t2, c2) = rows
        beside_token = max(0.0, (c2 / r2 - c1 / r1) / (t2 / r2 - t1 / r1))
        beside_request = max(0.0, (c1 - beside_token * t1) / r1)
    waits = {role: max(0.0, w) / cpu if cpu > 0 else 0.0 for role, (w, cpu) in waited.items()}
    return {"prefill_step_factor": p_factor, "decode_step_factor": d_factor, "token_overhead_s": loop,
            "handoff_latency_s": max(link.latency_s, handoff - wire), "request_overhead_s": fixed,
            "request_overhead_per_token_s": per_token, "requests": len(results),
            "router_cpu_per_token_s": cpu_loaded, "router_cpu_per_token_alone_s": cpu_alone,
            "background_cpu_per_request_s": beside_request, "background_cpu_per_token_s": beside_token,
            "prefill_wait_share": wait_share(waits[PREFILL], waits[DECODE]),
            **{f"loaded_{role}_step_wait": wait for role, wait in waits.items()}}


def wait_share(prefill_wait: float, decode_wait: float) -> float:
    """The prefill steps' share of the cores the workers' steps go without, from each role's
    wait over its CPU under load (0.5, evenly, without a wait measured; within 0.1-0.9)."""
    if prefill_wait <= 0 or decode_wait <= 0:
        return 0.5
    return min(0.9, max(0.1, prefill_wait / (prefill_wait + decode_wait)))


def box_cpu_s() -> float | None:
    """CPU seconds this machine's cores have been busy since it booted (Linux's /proc/stat: user,
    nice, system, irq and softirq time, not idle, I/O wait or time the hypervisor took); None
    where there is no /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if fields[0] != "cpu" or len(fields) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def fit_line(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b·x with a, b >= 0 (b = 0: the mean; a = 0: through the origin)."""
    n = len(samples)
    mx = sum(x for x, _ in samples) / n
    my = sum(y for _, y in samples) / n
    b = sum((x - mx) * (y - my) for x, y in samples) / max(1e-30, sum((x - mx) ** 2 for x, _ in samples))
    if b <= 0:
        return max(0.0, my), 0.0
    a = my - b * mx
    if a < 0:
        return 0.0, max(0.0, sum(x * y for x, y in samples) / max(1e-30, sum(x * x for x, _ in samples)))
    return a, b


def fit_link(samples: list[tuple[int, float]], name: str) -> Link:
    """seconds = latency + bytes / bandwidth, by least squares."""
    latency, per_byte = fit_line(samples)
    return Link(name, 1.0 / max(per_byte, 1e-15), latency)


def relative_errors(model: LinearStepModel, samples: list[tuple[BatchShape, float]]) -> list[float]:
    return [abs(model.step_s(s) - t) / t for s, t in samples if t > 0]


def run_profile(engine_cfg, output: str, repeats: int = 5, serve: bool = True, progress=print) -> dict:
    """Profile `engine_cfg`'s model on this machine and write the cost model JSON; with `serve`,
    calibrate the served path's overheads on a local cluster too."""
    import dataclasses

    import torch

    from workers.engine import LLMEngine
    torch.set_num_threads(1)
    cfg = dataclasses.replace(engine_cfg, cache=dataclasses.replace(engine_cfg.cache, enable_prefix_caching=False))
    t_start = time.perf_counter()
    engine = LLMEngine(cfg)
    startup_s = time.perf_counter() - t_start       # a new worker's engine: weights, KV cache, kernels
    progress(f"profiling {cfg.model} on this machine ({os.cpu_count()} CPUs, 1 torch thread): engine steps")
    steps = profile_steps(engine, repeats, progress=progress)
    step_model = LinearStepModel.fit(steps, per_chunk=True)
    errors = relative_errors(step_model, steps)
    mcfg = engine.model_config
    layout = (mcfg.num_hidden_layers, cfg.cache.block_size, mcfg.num_key_value_heads, mcfg.head_dim)
    progress("the KV handoff (shared memory between two processes)")
    transfers = profile_handoff(layout, repeats, progress)
    link = fit_link(transfers, "measured: shared memory, two processes on this machine")
    layout, max_model_len, vocab = engine.layout, engine.max_model_len, engine.vocab_size
    del engine
    served = {}
    if serve:
        progress("the served path (HTTP, router, worker loops, the handoff as served)")
        served = profile_served(engine_cfg, step_model, link, layout.bytes_per_token, progress=progress)
        progress(f"  steps x{served['prefill_step_factor']:.2f} (prefill), x{served['decode_step_factor']:.2f} "
                 f"(decode); per token {served['token_overhead_s'] * 1e3:.2f} ms, per handoff "
                 f"{served['handoff_latency_s'] * 1e3:.2f} ms, per request {served['request_overhead_s'] * 1e3:.2f} ms "
                 f"+ {served['request_overhead_per_token_s'] * 1e6:.1f} us per prompt token")
        # Steps as the served workers run them; each decode step's token also pays its way out.
        fp, fd = served["prefill_step_factor"], served["decode_step_factor"]
        m = step_model
        step_model = dataclasses.replace(
            m, p0=m.p0 * fp, p1=m.p1 * fp, p2=m.p2 * fp, p3=m.p3 * fp, pc=None if m.pc is None else m.pc * fp,
            d0=m.d0 * fd + served["token_overhead_s"], d1=m.d1 * fd, d2=m.d2 * fd)
        link = dataclasses.replace(link, name="measured: the served handoff on this machine",
                                   latency_s=served["handoff_latency_s"])
    cost = CostModel(step=step_model, kv_bytes_per_token=layout.bytes_per_token,
                     kv_capacity_tokens=layout.max_resident_tokens, link=link, tp=1,
                     source=f"profile of {cfg.model} on {platform.node() or 'this machine'}")
    doc = cost.to_json()
    doc["profile"] = {
        "model": cfg.model, "cpus": os.cpu_count(), "torch_threads": 1, "block_size": cfg.cache.block_size,
        "max_model_len": max_model_len, "vocab_size": vocab,
        "fit_median_rel_error": statistics.median(errors), "fit_max_rel_error": max(errors),
        "served": served,
        "startup_s": startup_s,
        "seconds": time.perf_counter() - t_start,
        "steps": [{"shape": dataclasses.asdict(s), "seconds": t} for s, t in steps],
        "handoffs": [{"bytes": b, "seconds": t} for b, t in transfers],
    }
    Path(output).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def load_profile(path: str) -> tuple[CostModel, dict]:
    """A profile JSON (or any CostModel JSON): the cost model and the profile's facts ({} if none)."""
    from cluster.loadtest.bench_data import read_json
    doc = read_json(path, "--profile", "no such file (make one with `pdcluster profile`)")
    try:
        return CostModel.from_json(doc), doc.get("profile", {})
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--profile {path}: not a cost model ({e})") from None
