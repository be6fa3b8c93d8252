#!/usr/bin/env python
"""Fault recovery: the stall when a decode worker dies, the time to replace a worker, goodput under kills.

How long a stream stalls when its decode worker dies, how long a dead worker takes to be
replaced, and what a worker killed every 10 s costs a steady load in goodput.

    .venv/bin/python benchmarks/bench_faults.py [--rounds 5] [--rate 4] [--duration 60]

One cluster on the real serving path (cluster.run.serve.ServingCluster: 2 prefill + 2 decode workers
on `tiny`, half a core and one torch thread each, the router in this process), three parts:

1. Resume. --streams streaming requests at once (greedy, ignore_eos, --stream-in prompt tokens,
   --stream-out new tokens); once every stream has --kill-after tokens, the decode worker with
   the most of them open is SIGKILLed. Which streams were hit, and after how many tokens each
   resumed, comes from the router itself: the script wraps the dispatcher's `_attempt` to log
   every attempt it starts (request id, prompt, tokens already delivered); a hit stream is one
   whose next attempt starts after the kill. Its stall is the client-side gap between the
   chunk that carried its last token before the resume and the chunk that carried the first
   token after it (what the user sees; it includes noticing the death, prefilling prompt +
   delivered tokens again, the KV handoff and the first decode step). Reported as p50/p99/max
   over the hit streams of --rounds kills, beside the inter-chunk latency (ITL) of the same
   streams before the kill, and the time from the kill to that first token. Every stream's
   tokens are compared with the offline single engine's (cluster.offline.generate, same prompt,
   greedy).
2. Replace. For every kill (parts 1 and 3) a thread polls the router's GET /health every 50 ms:
   "noticed" is the kill to the first answer with the victim's pool one short, "replaced" the
   kill to the first answer with the pool whole again (Ray restarted the actor, it loaded its
   model and answered `ready()`; router/dispatch.py `_lost`/`_await_restart`). p50/max per role.
3. Goodput. `pdcluster bench`'s load (cluster.loadtest.loadgen.run_load: Poisson arrivals at --rate for
   --duration seconds, random prompts of --load-in tokens from cluster.loadtest.bench_data.sample_random,
   --load-out new tokens, ignore_eos, greedy), twice on the same cluster: without faults, then
   with a worker killed every --kill-every seconds (decode and prefill alternately, a random
   live one of that role; a kill waits until that role's pool is whole again). Both runs get
   the same arrival times and prompt lengths; the prompts are different draws, so the second
   run gets no prefix-cache hits from the first. Requests are judged against --goodput
   (cluster.loadtest.loadgen.parse_goodput / meets: TTFT and TPOT as the router judges them), and
   reported as request throughput, goodput, SLO attainment, TTFT/TPOT p99 and failed requests
   (which must be 0), with kills / no kills beside them. Their token ids (as the router streamed
   them: see trace_attempts) are compared with the offline engine's too (--no-verify-load skips
   that).

The offline engine runs once the cluster has stopped (one batch for all requests, ~10 s), so it
competes with nothing measured. Any stream or request that differs from it, or failed, makes the
script exit 1, as does a part 1 with no stream hit. A full run takes about 4 minutes.

Every part also reports how many cores other processes kept busy meanwhile (the machine's busy
time minus this process and its descendants, Ray's workers included); above 0.3 the numbers do
not stand. --wait-idle S waits for quiet before each part.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import Meter, add_common_args, write_json  # noqa: E402
from cluster.loadtest import loadgen, promtext  # noqa: E402
from cluster.loadtest.bench_data import BenchRequest, sample_random  # noqa: E402
from cluster.offline import generate  # noqa: E402
from cluster.run.serve import ServingCluster, free_port  # noqa: E402
from cluster.run.spec import ClusterSpec  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.slo import SLOTargets  # noqa: E402
from workers.checkpoint import load_tokenizer  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.engine import LLMEngine  # noqa: E402
from workers.names import DECODE, PREFILL, ROLES  # noqa: E402

MODEL = "tiny"
# Summary fields of a load run that go into the table and the JSON (loadgen.summarize's names).
LOAD_FIELDS = ("duration", "completed", "failed", "request_throughput", "request_goodput", "slo_attainment",
               "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
               "median_itl_ms", "p99_itl_ms")


def pct(xs, q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


# -- the router's view: attempts, pools, pids --------------------------------------------------
def trace_attempts(dispatcher) -> tuple[list[tuple[float, str, tuple, int]], dict[tuple, list[int]]]:
    """Log every attempt the dispatcher starts: (perf_counter, rid, prompt ids, output tokens
    already delivered). rid is "<request>.<attempt>": attempt 0 is the first, n > 0 a resume.
    Also returns prompt ids -> the request's `delivered` list: the dispatcher extends that one
    list with every token it streams, across attempts, so once the request is done it holds the
    token ids the client got (the load's check; loadgen keeps only text, and `tiny`'s byte noise
    is not valid UTF-8, so streamed text depends on the chunking).
    Instrumentation only: the wrapped method runs unchanged (on the router's event loop)."""
    if not callable(getattr(dispatcher, "_attempt", None)):
        raise RuntimeError("router.dispatch.Dispatcher._attempt is gone: update trace_attempts()")
    log: list = []
    outputs: dict[tuple, list[int]] = {}
    inner = dispatcher._attempt

    def attempt(req, rid, q, involved, delivered):
        prompt = tuple(req.prompt_token_ids)
        log.append((time.perf_counter(), rid, prompt, len(delivered)))
        outputs[prompt] = delivered
        return inner(req, rid, q, involved, delivered)
    dispatcher._attempt = attempt
    return log, outputs


def live_pids(c: ServingCluster) -> dict[str, tuple[str, int]]:
    """worker id -> (role, pid) of each worker that answers now (one being restarted does not)."""
    return {w: (info.role, info.pid) for w, info in c.answering().items()}


@dataclass
class Kill:
    role: str
    worker: str
    t_kill: float                      # perf_counter
    part: str
    t_down: float | None = None        # first /health with the role's pool one short
    t_back: float | None = None        # first /health with it whole again

    def row(self) -> dict:
        def ms(t):
            return None if t is None else round((t - self.t_kill) * 1000, 1)
        return {"part": self.part, "role": self.role, "worker": self.worker,
                "noticed_ms": ms(self.t_down), "replaced_ms": ms(self.t_back)}


class Faults:
    """Kills worker processes (SIGKILL) and times each replacement from the router's /health,
    polled every `poll_s` in a thread of its own."""

    def __init__(self, c: ServingCluster, poll_s: float = 0.05):
        self.c, self.poll_s = c, poll_s
        self.url = f"http://{c.host}:{c.port}/health"
        self.full = {r: sum(w.role == r for w in c.workers) for r in ROLES}
        self.kills: list[Kill] = []
        self.pools = dict(self.full)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="health-watch", daemon=True)
        self._thread.start()

    def health(self) -> dict:
        try:
            with urllib.request.urlopen(self.url, timeout=5) as r:
                return json.loads(r.read())["workers"]
        except urllib.error.HTTPError as e:          # 503 "degraded" still carries the counts
            return json.loads(e.read())["workers"]

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                pools = self.health()
            except (OSError, ValueError, KeyError):
                continue
            now = time.perf_counter()
            with self._lock:
                self.pools = pools
                for k in self.kills:
                    if k.t_back is not None:
                        continue
                    if k.t_down is None and pools[k.role] < self.full[k.role]:
                        k.t_down = now
                    elif k.t_down is not None and pools[k.role] == self.full[k.role]:
                        k.t_back = now

    def kill(self, worker: str, role: str, pid: int, part: str) -> Kill:
        k = Kill(role, worker, time.perf_counter(), part)
        with self._lock:
            self.kills.append(k)
        os.kill(pid, signal.SIGKILL)
        return k

    def whole(self, role: str | None = None) -> bool:
        """Every victim (of `role`, or of any role) back, and the pools at full size."""
        roles = [role] if role else ROLES
        with self._lock:
            return (all(k.t_back is not None for k in self.kills if k.role in roles)
                    and all(self.pools[r] == self.full[r] for r in roles))

    def wait_whole(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.whole():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the pools did not come back within {timeout_s:g}s: {self.pools}")
            time.sleep(self.poll_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# -- part 1: streams hit by a dead decode worker -----------------------------------------------
@dataclass
class Stream:
    req: BenchRequest
    prompt_ids: tuple
    ids: list[int] = field(default_factory=list)
    tok_t: list[float] = field(default_factory=list)     # arrival of the chunk that carried each token
    chunk_t: list[float] = field(default_factory=list)   # arrival of each chunk with tokens
    error: str = ""


async def read_stream(session: aiohttp.ClientSession, target: loadgen.Target, s: Stream, on_chunk) -> None:
    """One streaming completion (the body `pdcluster bench` sends), keeping each token's id and
    arrival time."""
    try:
        async with session.post(target.base_url + target.endpoint, json=target.body(s.req),
                                headers=target.headers()) as resp:
            if resp.status != 200:
                s.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return
            buf = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                *events, buf = (buf + data).replace(b"\r\n", b"\n").split(b"\n\n")
                for event in events:
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            return
                        m = json.loads(payload)
                        if "error" in m:
                            s.error = f"stream error: {m['error']}"
                            return
                        toks = [t for c in m.get("choices") or () for t in c.get("token_ids") or ()]
                        if toks:
                            s.ids += toks
                            s.tok_t += [now] * len(toks)
                            s.chunk_t.append(now)
                            on_chunk(s)
    except (aiohttp.ClientError, OSError, ValueError) as e:
        s.error = f"{type(e).__name__}: {e}"


async def resume_round(c: ServingCluster, faults: Faults, args, reqs: list[BenchRequest], tokenizer,
                       pids: dict) -> tuple[list[Stream], Kill]:
    """Stream `reqs` at once; once each has args.kill_after tokens, SIGKILL the decode worker
    with the most of them open."""
    target = loadgen.Target(f"http://{c.host}:{c.port}", "/v1/completions", MODEL, ignore_eos=True,
                            timeout_s=args.request_timeout)
    streams = [Stream(r, tuple(tokenizer.encode(r.prompt))) for r in reqs]
    ready = asyncio.Event()
    reached: set[int] = set()

    def on_chunk(s: Stream) -> None:
        if len(s.ids) >= args.kill_after:
            reached.add(id(s))
            if len(reached) == len(streams):
                ready.set()

    kill: list[Kill] = []

    async def killer() -> None:
        await ready.wait()
        decode = [w for w in c.workers if w.role == DECODE and w.alive]
        victim = max(decode, key=lambda w: len(w.assigned))     # the one serving most of them
        kill.append(faults.kill(victim.worker_id, DECODE, pids[victim.worker_id][1], "resume"))

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=args.request_timeout),
                                     trust_env=False) as session:
        k = asyncio.create_task(killer())
        await asyncio.gather(*(read_stream(session, target, s, on_chunk) for s in streams))
        if not k.done():                 # a stream failed before the kill point
            k.cancel()
            raise RuntimeError("streams ended before the kill point: "
                               + "; ".join(sorted({s.error for s in streams if s.error}))[:500])
    return streams, kill[0]


def stalls(streams: list[Stream], kill: Kill, attempts: list) -> list[dict]:
    """For each stream the router resumed after the kill: the tokens it had, its stall (chunk of
    the last token before the resume -> chunk of the first after) and kill -> first token after."""
    by_prompt = {s.prompt_ids: s for s in streams}
    first_resume: dict[int, int] = {}
    for t, rid, prompt, delivered in attempts:
        if t >= kill.t_kill and rid.rsplit(".", 1)[1] != "0" and prompt in by_prompt:
            first_resume.setdefault(id(by_prompt[prompt]), delivered)
    out = []
    for s in streams:
        n = first_resume.get(id(s))
        if n is None or not 0 < n < len(s.tok_t):
            continue
        out.append({"resumed_after_tokens": n, "stall_ms": (s.tok_t[n] - s.tok_t[n - 1]) * 1000,
                    "kill_to_token_ms": (s.tok_t[n] - kill.t_kill) * 1000})
    return out


def run_resume(c: ServingCluster, faults: Faults, args, tokenizer, attempts: list, meter: Meter, metric,
               checks: list) -> dict:
    """Part 1; each round's requests and streams go to `checks` for the oracle afterwards."""
    hits, itl, rounds = [], [], []
    with meter.part("resume"):
        for r in range(args.rounds):
            faults.wait_whole()
            pids = live_pids(c)
            reqs = sample_random(tokenizer, args.streams, args.stream_in, args.stream_out, seed=args.seed + 100 + r)
            resumed0 = metric("pdcluster:requests_resumed_total", cause="worker_died")
            streams, kill = asyncio.run(resume_round(c, faults, args, reqs, tokenizer, pids))
            hit = stalls(streams, kill, attempts)
            hits += hit
            itl += [(b - a) * 1000 for s in streams for a, b in zip(s.chunk_t, s.chunk_t[1:]) if b < kill.t_kill]
            fail = sum(bool(s.error) for s in streams)
            checks.append(("resume", r, reqs, [None if s.error else s.ids for s in streams]))
            rounds.append({"victim": kill.worker, "streams_hit": len(hit),
                           "resumed_worker_died": metric("pdcluster:requests_resumed_total", cause="worker_died")
                           - resumed0, "failed": fail, "errors": sorted({s.error for s in streams if s.error})[:3]})
            print(f"  resume round {r + 1}/{args.rounds}: killed {kill.worker}, {len(hit)} of {len(streams)} "
                  f"streams hit, stall p50 {pct([h['stall_ms'] for h in hit], 50):.0f} ms, {fail} failed", flush=True)
        faults.wait_whole()

    def dist(xs: list[float]) -> dict:
        return {"p50": pct(xs, 50), "p99": pct(xs, 99), "max": max(xs, default=0.0)}
    return {"rounds": rounds, "hits": hits, "streams": args.streams * args.rounds,
            "failed": sum(x["failed"] for x in rounds), "stall_ms": dist([h["stall_ms"] for h in hits]),
            "kill_to_token_ms": dist([h["kill_to_token_ms"] for h in hits]), "itl_before_ms": dist(itl),
            "other_procs_cores": meter.parts["resume"]["other_procs_cores"]}


# -- part 3: goodput under kills --------------------------------------------------------------
def killer_thread(c: ServingCluster, faults: Faults, every_s: float, seed: int,
                  stop: threading.Event) -> threading.Thread:
    """Every `every_s` seconds SIGKILL a random live worker, decode and prefill alternately; a
    kill waits until its role's pool is whole again (so a role never loses its last worker)."""
    rng = random.Random(seed)

    def run():
        t0, n = time.monotonic(), 0
        while not stop.wait(max(0.0, t0 + (n + 1) * every_s - time.monotonic())):
            role = (DECODE, PREFILL)[n % 2]
            while not faults.whole(role) and not stop.wait(0.05):
                pass
            if stop.is_set():
                return
            live = {w: pid for w, (r, pid) in live_pids(c).items() if r == role}
            if len(live) == faults.full[role]:
                victim = rng.choice(sorted(live))
                faults.kill(victim, role, live[victim], "goodput")
            n += 1
    t = threading.Thread(target=run, name="killer", daemon=True)
    t.start()
    return t


def run_goodput(c: ServingCluster, faults: Faults, args, tokenizer, slos: dict, meter: Meter, outputs: dict,
                checks: list) -> dict:
    """Part 3; each run's requests and output token ids go to `checks` for the oracle afterwards."""
    n = max(1, round(args.rate * args.duration))
    target = loadgen.Target(f"http://{c.host}:{c.port}", "/v1/completions", MODEL, ignore_eos=True,
                            timeout_s=args.request_timeout)
    out = {}
    for name, kills in (("no kills", False), ("kills", True)):
        reqs = sample_random(tokenizer, n, args.load_in, args.load_out, range_ratio=args.load_range,
                             seed=args.seed + (2 if kills else 1))
        faults.wait_whole()
        if args.wait_idle > 0:
            Meter.wait_idle(args.wait_idle)
        stop = threading.Event()
        before = len(faults.kills)
        with meter.part(name):
            killer = killer_thread(c, faults, args.kill_every, args.seed, stop) if kills else None
            try:
                results, duration = asyncio.run(loadgen.run_load(target, reqs, args.rate, 1.0, seed=args.seed))
            finally:
                stop.set()
                if killer is not None:
                    killer.join(timeout=30)
        summary = loadgen.summarize(results, duration, slos, percentile_metrics=("ttft", "tpot", "itl"),
                                    percentiles=(99,))
        row = {k: summary[k] for k in LOAD_FIELDS}
        row["num_requests"] = n
        row["kills"] = len(faults.kills) - before
        row["errors"] = sorted({r.error for r in results if r.error})[:5]
        row["other_procs_cores"] = meter.parts[name]["other_procs_cores"]
        if args.verify_load:
            checks.append(("goodput", name, reqs, [list(outputs.get(tuple(tokenizer.encode(q.prompt)), ()))
                                                   if r.success else None for q, r in zip(reqs, results)]))
        out[name] = row
        print(f"  goodput, {name}: {row['completed']}/{n} completed, {row['kills']} kills, "
              f"goodput {row['request_goodput']:.2f} req/s", flush=True)
    faults.wait_whole()
    return out


# -- the oracle --------------------------------------------------------------------------------
def offline(engine: LLMEngine, reqs: list[BenchRequest]) -> list[list[int]]:
    """The token ids the single engine generates for the same requests (greedy, ignore_eos)."""
    res = generate([{"prompt": r.prompt, "max_tokens": r.output_len, "temperature": 0, "ignore_eos": True}
                    for r in reqs], engine=engine)
    return [x["token_ids"] for x in res]


def verify(checks: list, res: dict, attempts: list, tokenizer) -> list[dict]:
    """After the cluster is gone (the oracle would compete with what is measured): compare every
    stream's and every load request's token ids with the offline engine's; a failed request
    counts as failed there, not as a mismatch. Returns each difference: where, the first token
    that differs, the lengths, and after how many tokens the router resumed that request.

    The engine is not batch-invariant to the last bit (a different batch sums in a different
    order), and `tiny`'s random weights give near-ties that such a difference can flip under
    greedy sampling. So all requests run in one batch first (fast), and a request whose output
    differs from that runs again alone; it counts as equal when it equals that (`rechecked`).
    No prefix caching: every KV block the oracle reads, it computed for that request."""
    engine = LLMEngine(EngineConfig.from_dict({"model": MODEL, "cache": {"enable_prefix_caching": False}}))
    wants = iter(offline(engine, [q for _, _, reqs, _ in checks for q in reqs]))
    resumes: dict[tuple, list[int]] = {}
    for _, rid, prompt, delivered in attempts:
        if rid.rsplit(".", 1)[1] != "0":
            resumes.setdefault(prompt, []).append(delivered)
    res["resume"]["mismatched"] = res["rechecked"] = 0
    diffs = []
    for part, key, reqs, got in checks:                  # one batch for all: much faster than each alone
        want = [next(wants) for _ in reqs]
        bad = 0
        for i, (q, g, w) in enumerate(zip(reqs, got, want)):
            if g is None or g == w:
                continue
            if g == offline(engine, [q])[0]:
                res["rechecked"] += 1
                continue
            bad += 1
            diffs.append({"part": part, "run": key, "request": i, "got_len": len(g), "want_len": len(w),
                          "first_diff": next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w))),
                          "resumed_after": resumes.get(tuple(tokenizer.encode(q.prompt)), [])})
        if part == "resume":
            res["resume"]["rounds"][key]["mismatched"] = bad
            res["resume"]["mismatched"] += bad
        else:
            res["goodput"][key]["mismatched"] = bad
    return diffs


# -- the report --------------------------------------------------------------------------------
def report(args, res: dict, kills: list[dict]) -> str:
    R, G = res["resume"], res["goodput"]
    L = [f"cluster: 2 prefill + 2 decode workers on {MODEL} (half a core, 1 torch thread each), "
         f"router in this process; {os.cpu_count()} cores",
         "",
         f"resume after the decode worker dies: {args.rounds} kills, each with {args.streams} streams of "
         f"{args.stream_in} -> {args.stream_out} tokens in flight (killed once each had {args.kill_after}); "
         f"{len(R['hits'])} streams hit",
         f"{'':46s} {'p50':>9s} {'p99':>9s} {'max':>9s}"]
    ref = R["itl_before_ms"]
    for label, key in (("stall, ms (last token before -> first after)", "stall_ms"),
                       ("kill -> first token after, ms", "kill_to_token_ms"),
                       ("ITL of the same streams before the kill, ms", "itl_before_ms")):
        v = R[key]
        L.append(f"{label:46s} {v['p50']:9.1f} {v['p99']:9.1f} {v['max']:9.1f}")
    if ref["p50"] > 0 and R["hits"]:
        L.append(f"{'stall / ITL':46s} {R['stall_ms']['p50'] / ref['p50']:8.0f}x "
                 f"{R['stall_ms']['p99'] / ref['p99']:8.0f}x")
    L.append(f"streams equal to the offline engine: {R['streams'] - R['mismatched'] - R['failed']}/{R['streams']} "
             f"(failed {R['failed']}); resumed per round (router's requests_resumed_total{{cause=worker_died}}): "
             + ", ".join(f"{x['resumed_worker_died']:g}" for x in R["rounds"]))
    if res.get("rechecked"):
        L.append(f"  ({res['rechecked']} stream(s)/request(s) differed from the batched offline run at a near-tie "
                 "and equal the engine run alone)")
    L += ["", "replace a worker (SIGKILL -> back in its pool per GET /health, polled every 50 ms)",
          f"{'role':8s} {'kills':>5s} {'noticed p50 ms':>15s} {'replaced p50 ms':>16s} {'replaced max ms':>16s}"]
    for role in (DECODE, PREFILL):
        ks = [k for k in kills if k["role"] == role and k["replaced_ms"] is not None]
        if ks:
            rep = [k["replaced_ms"] for k in ks]
            L.append(f"{role:8s} {len(ks):5d} {pct([k['noticed_ms'] for k in ks], 50):15.0f} "
                     f"{pct(rep, 50):16.0f} {max(rep):16.0f}")
    a, b = G["no kills"], G["kills"]
    slo = " ".join(f"{k}<={v * 1000:g}ms" for k, v in res["slos"].items())
    L += ["", f"goodput: {a['num_requests']} requests, Poisson at {args.rate:g}/s (~{args.duration:g} s), "
          f"{args.load_in} -> {args.load_out} tokens, SLOs {slo}; kills: a worker every {args.kill_every:g} s, "
          "decode and prefill alternately",
          f"{'':26s} {'no kills':>10s} {'kills':>10s} {'kills / none':>13s}"]
    rows = (("request throughput, /s", "request_throughput", "{:.2f}"), ("goodput, req/s", "request_goodput", "{:.2f}"),
            ("SLO attainment", "slo_attainment", "{:.1%}"), ("TTFT p50, ms", "median_ttft_ms", "{:.0f}"),
            ("TTFT p99, ms", "p99_ttft_ms", "{:.0f}"), ("TPOT p99, ms", "p99_tpot_ms", "{:.1f}"),
            ("ITL p99, ms", "p99_itl_ms", "{:.1f}"))
    for label, key, fmt in rows:
        x, y = a[key], b[key]
        L.append(f"{label:26s} {fmt.format(x):>10s} {fmt.format(y):>10s} {(f'{y / x:.2f}x' if x else '-'):>13s}")
    L.append(f"{'failed requests':26s} {a['failed']:10d} {b['failed']:10d}")
    L.append(f"{'workers killed':26s} {a['kills']:10d} {b['kills']:10d}")
    if args.verify_load:
        L.append(f"{'not equal to offline':26s} {a['mismatched']:10d} {b['mismatched']:10d}")
    L.append("")
    parts = {"resume": R["other_procs_cores"], "no kills": a["other_procs_cores"], "kills": b["other_procs_cores"]}
    L.append("others, cores: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
             + f"   (of {os.cpu_count()}, busy with other processes)")
    for name, row in G.items():
        for e in row["errors"]:
            L.append(f"  {name} error: {e[:200]}")
    for x in R["rounds"]:
        for e in x["errors"]:
            L.append(f"  resume error: {e[:200]}")
    if any(v > 0.3 for v in parts.values()):
        L.append("WARNING: other processes were busy during the run; these numbers do not stand "
                 "(rerun on a quiet machine, or with --wait-idle)")
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_argument_group("part 1: resume after the decode worker dies")
    g.add_argument("--rounds", type=int, default=5, help="kills of a decode worker under streams")
    g.add_argument("--streams", type=int, default=16, help="streams in flight at each kill")
    g.add_argument("--stream-in", type=int, default=64, help="prompt tokens of a stream")
    g.add_argument("--stream-out", type=int, default=256, help="new tokens of a stream")
    g.add_argument("--kill-after", type=int, default=64, help="kill once every stream has this many tokens")
    g = p.add_argument_group("part 3: goodput with a worker killed every --kill-every seconds")
    g.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    g.add_argument("--duration", type=float, default=60.0, help="seconds of load (rate x duration requests)")
    g.add_argument("--kill-every", type=float, default=10.0, help="seconds between kills")
    g.add_argument("--load-in", type=int, default=128, help="prompt tokens of a request")
    g.add_argument("--load-out", type=int, default=64, help="new tokens of a request")
    g.add_argument("--load-range", type=float, default=0.0, help="lengths uniform in +-this fraction")
    g.add_argument("--goodput", nargs="+", default=["ttft:1000", "tpot:100"], metavar="METRIC:MS",
                   help="SLOs a good request meets (as `pdcluster bench --goodput`)")
    g.add_argument("--no-verify-load", dest="verify_load", action="store_false",
                   help="skip comparing the load's outputs with the offline engine's")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    add_common_args(p, "each part")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.streams < 1 or not 0 < args.kill_after < args.stream_out:
        p.error("need --rounds >= 1, --streams >= 1 and 0 < --kill-after < --stream-out")
    if args.duration < args.kill_every:
        p.error("--duration must be at least --kill-every (no kill would happen)")
    try:
        slos = loadgen.parse_goodput(args.goodput)
    except ValueError as e:
        p.error(str(e))
    # The router logs each resume at WARNING; keep its errors (a worker lost) and Ray's.
    logging.getLogger("pdcluster").setLevel(logging.ERROR)

    tokenizer = load_tokenizer(MODEL)
    spec = ClusterSpec(model=MODEL, num_prefill=2, num_decode=2, num_cpus_per_worker=0.5)
    router = RouterConfig(port=free_port(), slo=SLOTargets(ttft_s=slos.get("ttft", float("inf")),
                                                           tpot_s=slos.get("tpot", float("inf"))))
    meter = Meter()
    checks: list = []
    t_start = time.monotonic()
    with ServingCluster(spec, router, ray_num_cpus=4) as c:
        attempts, outputs = trace_attempts(c.server.dispatcher)
        url = f"http://{c.host}:{c.port}/metrics"

        def metric(name: str, **labels) -> float:
            return promtext.total(promtext.scrape(url), name, **labels)
        warm = loadgen.Target(f"http://{c.host}:{c.port}", "/v1/completions", MODEL, ignore_eos=True)
        asyncio.run(loadgen.run_load(warm, sample_random(tokenizer, 8, args.load_in, 16, seed=args.seed + 9)))
        faults = Faults(c)
        try:
            if args.wait_idle > 0:
                Meter.wait_idle(args.wait_idle)
            resume = run_resume(c, faults, args, tokenizer, attempts, meter, metric, checks)
            goodput = run_goodput(c, faults, args, tokenizer, slos, meter, outputs, checks)
        finally:
            faults.close()
        kills = [k.row() for k in faults.kills]
    res = {"resume": resume, "goodput": goodput, "slos": slos}     # verify() adds "rechecked"
    t_verify = time.monotonic()
    diffs = verify(checks, res, attempts, tokenizer)
    print(f"  compared with the offline engine in {time.monotonic() - t_verify:.0f} s", flush=True)
    print()
    print(report(args, res, kills))
    for d in diffs:
        print(f"DIFFERS from the offline engine: {d['part']} {d['run']} request {d['request']}: first at token "
              f"{d['first_diff']} (got {d['got_len']} tokens, want {d['want_len']}); resumed after "
              f"{d['resumed_after'] or 'none'} delivered tokens")
    print(f"\n(whole run {time.monotonic() - t_start:.0f} s)")
    write_json(args.json, {"args": vars(args), "cpus": os.cpu_count(),
                           "slos_ms": {k: v * 1000 for k, v in slos.items()},
                           "resume": resume, "replace": kills, "goodput": goodput, "differences": diffs,
                           "rechecked_alone": res["rechecked"]})
    bad = (resume["mismatched"] or resume["failed"] or not resume["hits"]
           or any(g["failed"] or g.get("mismatched") for g in goodput.values()))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
