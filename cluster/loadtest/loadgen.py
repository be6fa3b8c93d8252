"""The load generator under `pdcluster bench`: open-loop arrivals, streaming requests, per-request
latencies from the stream's arrival times, and the summary with vLLM's field names.

Works against any OpenAI-compatible server (pdcluster, vLLM, SGLang): it speaks only
`/v1/completions` and `/v1/chat/completions` with `stream: true`.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from cluster.loadtest.bench_data import BenchRequest
from router.slo import SLOTargets, judge, tpot_s

METRICS = ("ttft", "tpot", "itl", "e2el")

KEEPALIVE_S = 3.0           # below the 5 s after which uvicorn-based servers close idle connections


@dataclass(slots=True)
class RequestResult:
    prompt_len: int = 0
    output_len: int = 0          # tokens: the server's usage when reported, else counted from chunks
    ttft: float = 0.0            # s, send -> first chunk with content
    itl: list[float] = field(default_factory=list)   # s, gaps between content chunks
    latency: float = 0.0         # s, send -> end of stream
    start: float = 0.0           # perf_counter at send
    success: bool = False
    error: str = ""
    text: str = ""
    trace_id: str = ""           # the W3C trace id it was sent with (a server that traces continues it)

    @property
    def tpot(self) -> float | None:
        return tpot_s(self.ttft, self.latency, self.output_len)      # router/slo.py's definition


def arrival_gaps(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Seconds between consecutive sends. Gamma(shape=burstiness, scale=1/(rate*burstiness)): the
    mean is 1/rate at every burstiness; the coefficient of variation is 1/sqrt(burstiness), so
    1 is Poisson arrivals, below 1 burstier, above 1 more regular. rate=inf sends all at once."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {rate}")
    if math.isinf(rate):
        return np.zeros(num)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)


def send_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When `run_load` sends each of `num` requests, in seconds from its start: the cumulative
    sums of `arrival_gaps` (the first request waits one gap; all at 0 when rate is inf)."""
    return np.cumsum(arrival_gaps(num, rate, burstiness, seed)).tolist()


@dataclass(slots=True)
class Target:
    base_url: str                      # http://host:port (no /v1)
    endpoint: str = "/v1/completions"
    model: str = ""
    api_key: str | None = None
    ignore_eos: bool = False
    timeout_s: float = 600.0

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    def headers(self) -> dict:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def body(self, req: BenchRequest) -> dict:
        body = {"model": self.model, "max_tokens": req.output_len, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.0}
        if self.chat:
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


def _error_text(status: int, raw: bytes) -> str:
    try:
        msg = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = raw.decode(errors="replace")[:200]
    return f"HTTP {status}: {msg}"


class _Stream:
    """Folds one SSE stream into a RequestResult. `feed` takes each network read with its
    arrival time: events that arrive in one read share its timestamp, as they should."""

    def __init__(self, r: RequestResult, chat: bool):
        self.r, self.chat = r, chat
        self.buf, self.parts = b"", []
        self.chunks, self.counted, self.usage_out, self.last = 0, 0, None, r.start
        self.done = False

    def feed(self, data: bytes, now: float) -> None:
        *events, self.buf = (self.buf + data).replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._event(line[5:].strip(), now)

    def _event(self, data: bytes, now: float) -> None:
        if data == b"[DONE]" or self.done:
            self.done = True
            return
        msg = json.loads(data)
        if "error" in msg:
            err = msg["error"]
            raise _StreamError(err.get("message", err) if isinstance(err, dict) else err)
        if msg.get("usage"):
            self.usage_out = msg["usage"].get("completion_tokens")
            self.r.prompt_len = msg["usage"].get("prompt_tokens") or self.r.prompt_len
        choices = msg.get("choices")
        if not choices:
            return
        c = choices[0]
        piece = (c.get("delta") or {}).get("content") if self.chat else c.get("text")
        if not piece and not c.get("token_ids"):
            return                                 # role-only or finish-only chunks carry no token
        if self.chunks == 0:
            self.r.ttft = now - self.r.start
        else:
            self.r.itl.append(now - self.last)
        self.last = now
        self.chunks += 1
        self.parts.append(piece or "")
        # A chunk may carry several tokens (servers coalesce under load); without token ids
        # or usage, one chunk counts as one token.
        self.counted += len(c.get("token_ids") or ()) or 1

    def finish(self, now: float) -> None:
        r = self.r
        r.latency = now - r.start
        r.output_len = self.usage_out if self.usage_out is not None else self.counted
        r.text = "".join(self.parts)
        r.success = r.output_len > 0
        if not r.success:
            r.error = "the stream ended without a token"


class _StreamError(Exception):
    pass


async def send(session: aiohttp.ClientSession, target: Target, req: BenchRequest) -> RequestResult:
    """One streaming request; every failure ends up in `error`, never raised."""
    r = RequestResult(prompt_len=req.prompt_len, trace_id=os.urandom(16).hex())
    headers = {**target.headers(), "traceparent": f"00-{r.trace_id}-{os.urandom(8).hex()}-01"}
    r.start = time.perf_counter()
    try:
        async with asyncio.timeout(target.timeout_s):
            async with session.post(target.base_url + target.endpoint, json=target.body(req),
                                    headers=headers) as resp:
                if resp.status != 200:
                    r.error = _error_text(resp.status, await resp.read())
                    return r
                stream = _Stream(r, target.chat)
                async for data in resp.content.iter_any():
                    stream.feed(data, time.perf_counter())
                    if stream.done:
                        break
                stream.finish(time.perf_counter())
    except TimeoutError:
        r.error = f"timed out after {target.timeout_s:g} s"
    except _StreamError as e:
        r.error = f"stream error: {e}"
    except (aiohttp.ClientError, OSError) as e:
        r.error = f"{type(e).__name__}: {e}"
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        r.error = f"malformed stream: {type(e).__name__}: {e}"
    return r


class LoadInterrupted(KeyboardInterrupt):
    """Ctrl-C during `run_load` (under `asyncio.run`, whose SIGINT handler cancels the run): what
    had finished by then. `results` is in request order, None for a request that had not
    finished (`started` of them had been sent); `duration` runs from the first send to the
    interrupt. A KeyboardInterrupt, so a caller that does not look at it still stops as on Ctrl-C."""

    def __init__(self, results: list[RequestResult | None], started: int, duration: float):
        self.results, self.started, self.duration = results, started, duration
        done = sum(r is not None for r in results)
        super().__init__(f"interrupted: {done} of {len(results)} requests finished")


async def run_load(target: Target, requests: list[BenchRequest], rate: float = math.inf,
                   burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                   on_done=None, arrivals: list[float] | None = None) -> tuple[list[RequestResult], float]:
    """Send `requests` open-loop at `rate` (gamma gaps: `send_times`), or at the given `arrivals`
    (seconds from the start, one per request, in order: a trace's times; rate, burstiness and
    seed are then unused), at most `max_concurrency` in flight (a request due while all seats
    are taken waits for one); returns the results in request order and the wall duration
    (start to last finish). Cancelled (Ctrl-C under `asyncio.run`), it cancels the requests in
    flight and raises LoadInterrupted with those that had finished."""
    if arrivals is None:
        arrivals = send_times(len(requests), rate, burstiness, seed)
    elif len(arrivals) != len(requests):
        raise ValueError(f"{len(arrivals)} send times for {len(requests)} requests")
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # Idle connections are dropped before servers drop them (uvicorn, hence vLLM, after 5 s): a
    # request sent on a connection the server is closing fails with "Server disconnected".
    connector = aiohttp.TCPConnector(limit=0, force_close=False, enable_cleanup_closed=True,
                                     keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    started = 0

    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
        async def one(req: BenchRequest) -> RequestResult:
            nonlocal started
            if limit is None:
                started += 1
                res = await send(session, target, req)
            else:
                async with limit:
                    started += 1
                    res = await send(session, target, req)
            if on_done is not None:
                on_done(res)
            return res

        t0 = time.perf_counter()
        tasks = []
        try:
            for req, at in zip(requests, arrivals):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(req)))
            results = await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            stopped = time.perf_counter()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            done = [None if t.cancelled() or t.exception() else t.result() for t in tasks]
            raise LoadInterrupted(done + [None] * (len(requests) - len(tasks)), started, stopped - t0) from None
    return list(results), time.perf_counter() - t0


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    slos = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput: unknown metric {name!r} in {item!r}; use ttft, tpot or e2el")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {item!r} needs a number of milliseconds, like ttft:500") from None
        if ms <= 0:
            raise ValueError(f"--goodput: {item!r} must be positive")
        slos[name] = ms / 1000
    return slos


def meets(r: RequestResult, slos: dict[str, float], targets: SLOTargets | None = None) -> bool:
    """A request is good when it succeeded and meets every SLO given: TTFT and TPOT judged as the
    router judges them (router/slo.py; TPOT of a one-token reply is vacuous), plus E2E latency.
    (`targets`: the SLOTargets of `slos`, when the caller judges many requests.)"""
    if not r.success:
        return False
    targets = targets or SLOTargets(ttft_s=slos.get("ttft", math.inf), tpot_s=slos.get("tpot", math.inf))
    return judge(targets, r.ttft, r.latency, r.output_len).both and r.latency <= slos.get("e2el", math.inf)


def _values(results: list[RequestResult], metric: str) -> list[float]:
    ok = [r for r in results if r.success]
    if metric == "ttft":
        return [r.ttft for r in ok]
    if metric == "tpot":
        return [t for r in ok if (t := r.tpot) is not None]
    if metric == "itl":
        return [x for r in ok for x in r.itl]
    return [r.latency for r in ok]


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float] | None = None,
              percentile_metrics=("ttft", "tpot", "itl"), percentiles=(99.0,)) -> dict:
    """The result JSON: vLLM's field names, plus `slo_attainment` (good / all requests sent)."""
    slos = slos or {}
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    targets = SLOTargets(ttft_s=slos.get("ttft", math.inf), tpot_s=slos.get("tpot", math.inf))
    good = sum(meets(r, slos, targets) for r in results) if slos else len(ok)
    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "request_goodput": good / duration if slos and duration > 0 else None,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
        "slo_attainment": good / len(results) if slos and results else None,
        "goodput_slos_ms": {k: v * 1000 for k, v in slos.items()},
    }
    for m in percentile_metrics:
        xs = np.asarray(_values(results, m)) * 1000
        has = xs.size > 0
        out[f"mean_{m}_ms"] = float(xs.mean()) if has else 0.0
        out[f"median_{m}_ms"] = float(np.median(xs)) if has else 0.0
        out[f"std_{m}_ms"] = float(xs.std()) if has else 0.0
        for p in percentiles:
            out[f"p{p:g}_{m}_ms"] = float(np.percentile(xs, p)) if has else 0.0
    out.update({
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "generated_texts": [r.text for r in results],
        "errors": [r.error for r in results],
        "trace_ids": [r.trace_id for r in results],
    })
    return out


def summarize_phases(results: list[RequestResult | None], arrivals: list[float], phases: list[str | None],
                     slos: dict[str, float] | None = None, percentiles=(99.0,)) -> list[dict]:
    """Per load phase: the requests due to be sent in it, and how they fared. `results`,
    `arrivals` (send times, non-decreasing) and `phases` (labels) are in request order; a None
    result did not finish (Ctrl-C) and counts in no rate. A phase is a run of consecutive
    requests with one label; it lasts from its first send to the next phase's first send, the
    last one to one mean gap after its last send. Attainment is good / finished (as `summarize`);
    goodput is good requests per second of the phase."""
    slos = slos or {}
    targets = SLOTargets(ttft_s=slos.get("ttft", math.inf), tpot_s=slos.get("tpot", math.inf))
    runs: list[tuple[str | None, list[int]]] = []
    for i, label in enumerate(phases):
        if not runs or runs[-1][0] != label:
            runs.append((label, []))
        runs[-1][1].append(i)
    out = []
    for k, (label, idx) in enumerate(runs):
        start = arrivals[idx[0]]
        if k + 1 < len(runs):
            end = arrivals[runs[k + 1][1][0]]
        else:
            end = start + (arrivals[idx[-1]] - start) * len(idx) / (len(idx) - 1) if len(idx) > 1 else start
        done = [r for r in (results[i] for i in idx) if r is not None]
        ok = [r for r in done if r.success]
        good = sum(meets(r, slos, targets) for r in done) if slos else len(ok)
        span = end - start
        ph = {"phase": label, "start_s": start, "end_s": end, "num_prompts": len(idx), "completed": len(ok),
              "failed": len(done) - len(ok), "not_finished": len(idx) - len(done),
              "slo_attainment": good / len(done) if slos and done else None,
              "request_goodput": good / span if slos and span > 0 else None}
        for m in ("ttft", "tpot"):
            xs = np.asarray(_values(done, m)) * 1000
            ph[f"mean_{m}_ms"] = float(xs.mean()) if xs.size else 0.0
            for p in percentiles:
                ph[f"p{p:g}_{m}_ms"] = float(np.percentile(xs, p)) if xs.size else 0.0
        out.append(ph)
    return out
