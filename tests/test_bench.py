"""`pdcluster bench`: latency arithmetic against a server with known injected delays, arrival
statistics against the gamma distribution, failure accounting, the goodput search, and a run
against the real cluster through `--launch`."""
from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from cluster.loadtest import bench, loadgen
from cluster.loadtest.bench import search_rate
from cluster.loadtest.bench_data import (DECODE_HEAVY, PREFILL_HEAVY, Phase, TraceRow, alternate, load_trace, phase_rows,
                                sample_random, sample_trace)
from cluster.cli import main
from common import free_port
from workers.checkpoint import load_tokenizer

# The injected server: "fast" prompts get their first token after FAST_MS, "slow" ones after
# SLOW_MS, then one token every ITL_MS, scheduled on absolute times so that jitter does not
# accumulate. Arrival times at the client can only be later than these, never earlier.
# TTFT_TOL_MS is the slack a busy 2-core box needs; it is under half of ITL_MS, so a TTFT
# clocked at the second token (one ITL_MS late) lands outside it, whatever the jitter.
FAST_MS, SLOW_MS, ITL_MS, TOKENS = 60.0, 400.0, 130.0, 8
TTFT_TOL_MS = 60.0
LATENESS: list[float] = []    # s: per request, the injected server's own delay past its schedule
LIMITED_ITL_MS = 25.0          # the capacity-limited endpoint's token gap (the sweep test)
RECEIVED: list[tuple[float, str, int]] = []   # every request: (perf_counter on arrival, prompt, max_tokens)


def injected_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model", "num_workers": 4, "num_gpus": 2}]}

    async def stream(first_s: float, n: int, chat: bool, itl_ms: float = ITL_MS, received: float | None = None):
        t0 = time.perf_counter()
        if chat:           # a role-only chunk first, as OpenAI and vLLM send: it carries no token
            yield 'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
        for k in range(n):
            await asyncio.sleep(max(0.0, t0 + first_s + k * itl_ms / 1000 - time.perf_counter()))
            if k == 0 and received is not None:     # how late this server itself was (a busy box)
                LATENESS.append(time.perf_counter() - received - first_s)
            piece = {"delta": {"content": f"t{k} "}} if chat else {"text": f"t{k} "}
            yield f"data: {json.dumps({'choices': [{'index': 0, **piece, 'finish_reason': None}]})}\n\n"
        yield f'data: {json.dumps({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}})}\n\n'
        yield "data: [DONE]\n\n"

    async def handle(request: Request, chat: bool):
        received = time.perf_counter()
        body = await request.json()
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        RECEIVED.append((received, prompt, body["max_tokens"]))
        if prompt.startswith("fail"):
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error",
                                           "param": None, "code": None}}, status_code=500)
        if prompt.startswith("hang"):
            await asyncio.sleep(30)
        if prompt.startswith("limited"):       # a server with a capacity: 2 at a time, 20 ms each
            return StreamingResponse(limited(body["max_tokens"]), media_type="text/event-stream")
        first = (SLOW_MS if prompt.startswith("slow") else FAST_MS) / 1000
        return StreamingResponse(stream(first, body["max_tokens"], chat, received=received),
                                 media_type="text/event-stream")

    seats = asyncio.Semaphore(2)

    async def limited(n: int):
        async with seats:
            async for chunk in stream(0.005, n, False, LIMITED_ITL_MS):
                yield chunk

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def injected_url():
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(injected_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the injected server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = server.force_exit = True    # requests a test gave up on are not waited for
    thread.join(timeout=10)
    assert not thread.is_alive()


def write_custom(path, prompts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "output_tokens": TOKENS}) + "\n" for p in prompts))
    return str(path)


def run_bench(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["bench", "--disable-tqdm", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_latencies_match_injected_delays(injected_url, tmp_path, capsys, endpoint):
    LATENESS.clear()
    prompts = ["slow question" if i % 4 == 3 else "fast question" for i in range(16)]   # 12 fast, 4 slow
    rc, out, err = run_bench(
        capsys, "--base-url", injected_url, "--endpoint", endpoint, "--dataset-name", "custom",
        "--dataset-path", write_custom(tmp_path / "p.jsonl", prompts), "--num-prompts", "16",
        "--request-rate", "40", "--goodput", "ttft:200", f"tpot:{ITL_MS * 2:g}",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json")
    assert rc == 0, err
    r = json.loads((tmp_path / "r.json").read_text())
    # s: a busy 2-core box schedules late, never early; where the server itself ran late (it
    # shares this process with the client), its first tokens left that much later
    assert len(LATENESS) == 16
    tol = TTFT_TOL_MS / 1000 + float(np.median(LATENESS))
    assert 2 * TTFT_TOL_MS < ITL_MS  # ... and a TTFT taken at the second token must not fit in it
    ttft = np.asarray(r["ttfts"])
    slow = np.asarray([p.startswith("slow") for p in prompts])
    late = ttft - np.where(slow, SLOW_MS, FAST_MS) / 1000     # each request's TTFT past its server's
    assert np.all(late >= -0.002)                              # never early, the slow ones included
    # The median request: a TTFT clocked at the second token would be one ITL_MS late on every
    # request, while a stalled box (a request reaching the server a second late, seen once on CI)
    # delays a few. The medians of each kind then hold that bound together.
    assert np.median(late) <= tol, late
    assert np.median(late[~slow]) <= tol and np.min(late[slow]) <= tol, late
    # The summary's statistics are those of the per-request TTFTs
    assert r["median_ttft_ms"] == pytest.approx(np.median(ttft) * 1000)
    assert r["p99_ttft_ms"] == pytest.approx(np.percentile(ttft, 99) * 1000)
    # Tokens on an absolute schedule: a request's gaps average ITL_MS exactly, unless the busy box
    # delivered its first token late (its later gaps are then shorter by as much: a CI run's
    # mean TPOT was 123 ms), so the median request is judged; single gaps jitter. The summary's
    # mean is that of the gaps.
    per_request = [1000 * sum(gaps) / len(gaps) for gaps in r["itls"]]
    assert abs(np.median(per_request) - ITL_MS) <= 5 and abs(r["median_itl_ms"] - ITL_MS) <= 8
    assert r["mean_itl_ms"] == pytest.approx(1000 * np.mean([g for gaps in r["itls"] for g in gaps]))
    itl_count = sum(len(x) for x in r["itls"])
    assert itl_count == 16 * (TOKENS - 1)               # the role-only chat chunk is not a token
    # End to end is the first token plus the gaps after it, request by request
    assert r["mean_e2el_ms"] == pytest.approx(ttft.mean() * 1000 + (TOKENS - 1) * r["mean_tpot_ms"])
    # Goodput: the requests with TTFT <= 200 ms and TPOT (their mean gap) <= twice ITL_MS: no slow
    # one, and the fast ones unless the box stalled them past it
    assert r["completed"] == 16 and r["failed"] == 0
    good = (ttft <= 0.2) & (np.asarray([np.mean(x) for x in r["itls"]]) <= 2 * ITL_MS / 1000)
    assert not good[slow].any() and np.median(late[~slow]) <= tol
    assert r["slo_attainment"] == pytest.approx(good.sum() / 16) and good.sum() >= 8
    assert r["request_goodput"] == pytest.approx(good.sum() / r["duration"])
    assert r["output_lens"] == [TOKENS] * 16 and r["input_lens"] == [7] * 16     # from `usage`
    assert r["total_output_tokens"] == 16 * TOKENS
    assert r["output_throughput"] == pytest.approx(16 * TOKENS / r["duration"])
    assert "Request goodput (req/s):" in out and "SLO attainment:" in out and f"{100 * good.sum() / 16:.1f}%" in out
    assert (tmp_path / "r-latency.png").stat().st_size > 10_000
    # Each request went with a trace id of its own; this server does not trace, and the report says so.
    assert len(set(r["trace_ids"])) == 16 and r["ttft_phases"] is None
    assert "the server does not trace" in out and not (tmp_path / "r-ttft-phases.png").exists()


def test_failures_and_timeouts_are_counted_with_their_error(injected_url, tmp_path, capsys):
    prompts = ["fast a", "fail b", "hang c", "fast d", "fail e"]
    rc, out, err = run_bench(
        capsys, "--base-url", injected_url, "--dataset-name", "custom", "--dataset-path",
        write_custom(tmp_path / "p.jsonl", prompts), "--num-prompts", "5", "--request-timeout", "1.5",
        "--goodput", "ttft:1000", "--save-result", "--result-dir", str(tmp_path), "--result-filename",
        "f.json", "--no-plots")
    assert rc == 0, err
    r = json.loads((tmp_path / "f.json").read_text())
    assert (r["completed"], r["failed"]) == (2, 3)
    assert len(r["errors"]) == len(r["ttfts"]) == len(r["output_lens"]) == 5
    assert r["errors"][1] == r["errors"][4] == "HTTP 500: injected failure"
    assert "timed out after 1.5 s" in r["errors"][2]
    assert r["errors"][0] == r["errors"][3] == ""
    assert r["slo_attainment"] == pytest.approx(2 / 5)       # failures count against attainment
    assert "Failed requests:" in out and "2 x HTTP 500: injected failure" in out


def test_arrival_gaps_follow_the_gamma_distribution():
    n, rate = 4000, 8.0
    for burstiness in (1.0, 0.5, 4.0):
        gaps = loadgen.arrival_gaps(n, rate, burstiness, seed=1)
        mean, cv = gaps.mean(), gaps.std() / gaps.mean()
        # Standard errors over 4000 gaps: mean ~ cv/sqrt(n) relative (<= 2.3 %), cv ~ 3 %; 4 sigma.
        assert mean == pytest.approx(1 / rate, rel=4 * (1 / math.sqrt(burstiness)) / math.sqrt(n))
        assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.12)
    # Poisson arrivals: the gaps are exponential, so P(gap > mean) = 1/e.
    gaps = loadgen.arrival_gaps(n, rate, 1.0, seed=2)
    assert (gaps > 1 / rate).mean() == pytest.approx(math.exp(-1), abs=0.03)
    assert np.array_equal(gaps, loadgen.arrival_gaps(n, rate, 1.0, seed=2))      # seeded
    assert not loadgen.arrival_gaps(5, math.inf).any()


def test_goodput_search_brackets_the_threshold():
    for threshold in (0.3, 1.0, 7.3, 40.0):
        probes = []

        def meets(rate, t=threshold):
            probes.append(rate)
            return rate <= t

        best = search_rate(meets, start=1.0, steps=4)
        # The bracket [lo, 2 lo] from the doubling is halved 4 times: within lo / 16 below.
        assert best is not None and 0 <= threshold - best <= best / 16 + 1e-9
        assert len(probes) <= 12 + 4
    assert search_rate(lambda r: False, 1.0, 3) is None


def test_sweep_finds_the_rate_a_limited_server_sustains(injected_url, tmp_path, capsys):
    # The server takes 2 requests at a time, ~60 ms each (4 tokens after 5 ms): ~30 req/s.
    # At 5 req/s it keeps up within the 1 s TTFT SLO (with room for a busy box); at 400 req/s it
    # queues: 0.3 s of arrivals is 120 requests, which take ~4 s to drain, so TTFTs blow the SLO
    # and it completes ~30 req/s, far under the offered rate.
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": "limited", "output_tokens": 4}) + "\n" for _ in range(6)))
    rc, out, err = run_bench(
        capsys, "--base-url", injected_url, "--dataset-name", "custom", "--dataset-path", str(path),
        "--num-prompts", "6", "--sweep", "--sweep-rates", "400,5", "--sweep-duration", "0.3",
        "--goodput", "ttft:1000", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "s.json")
    assert rc == 0, err
    r = json.loads((tmp_path / "s.json").read_text())
    low, high = r["sweep"]
    assert (low["request_rate"], low["num_prompts"], high["request_rate"], high["num_prompts"]) == (5.0, 6, 400.0, 120)
    assert low["slo_attainment"] == 1.0 and low["kept_pace"] and low["passed"]
    assert high["completed"] == 120 and not high["kept_pace"] and not high["passed"]
    assert high["request_throughput"] < 60 and high["slo_attainment"] < 0.5
    assert r["max_goodput_rate"] == 5.0 and r["goodput_is_lower_bound"] is False     # 400 req/s missed
    assert r["max_goodput_rate_per_worker"] == 5.0 / 4 and r["max_goodput_rate_per_gpu"] == 5.0 / 2
    assert "goodput: 5 req/s" in out and "per GPU (2 GPUs)" in out and "no (pace)" in out
    assert "lower bound" not in out and r["interrupted"] is False
    assert (tmp_path / "s-sweep.png").stat().st_size > 10_000


def test_each_run_keeps_its_result_and_plots_paired(injected_url, tmp_path, capsys):
    # Two runs into one directory under the default, timestamped name (the same second, most
    # likely): neither overwrites the other, and each plot carries its result file's stem.
    data = write_custom(tmp_path / "p.jsonl", ["fast a", "fast b", "fast c"])
    saved = []
    for n in (3, 2):
        rc, out, err = run_bench(capsys, "--base-url", injected_url, "--dataset-name", "custom",
                                 "--dataset-path", data, "--num-prompts", str(n), "--save-result",
                                 "--result-dir", str(tmp_path / "results"))
        assert rc == 0, err
        lines = out.splitlines()
        result = next(x.split(maxsplit=1)[1] for x in lines if x.startswith("result: "))
        plots = [x.split(maxsplit=1)[1] for x in lines if x.startswith("plot:   ")]
        saved.append((result, plots, n))
    (json1, plots1, _), (json2, plots2, _) = saved
    assert json1 != json2
    for result, plots, n in saved:
        path = Path(result)
        assert path.parent == tmp_path / "results" and path.name.startswith("pdcluster-bench-fake-")
        assert json.loads(path.read_text())["completed"] == n                  # its own run's result
        assert plots == [str(path.with_name(path.stem + "-latency.png"))]
        assert Path(plots[0]).stat().st_size > 10_000
    names = sorted(p.name for p in (tmp_path / "results").iterdir())
    assert len(names) == 4 and sorted(Path(x).name for x in (json1, json2, *plots1, *plots2)) == names


def _fake_sweep(monkeypatch, threshold: float, *flags: str):
    """sweep() with run_once replaced by a server that meets the SLOs at rates <= threshold
    and always keeps pace: (the result as cmd_bench builds it, its report, the rates tried)."""
    from cluster.cli import build_parser
    tried = []

    def fake_run_once(target, requests, rate, a, opts, desc):
        tried.append(rate)
        good = 1.0 if rate <= threshold else 0.0
        return {"request_rate": rate, "num_prompts": len(requests), "completed": len(requests), "failed": 0,
                "request_throughput": rate, "request_goodput": good * rate, "slo_attainment": good,
                "output_throughput": 0.0, "mean_ttft_ms": 1.0}

    monkeypatch.setattr(bench, "run_once", fake_run_once)
    a = build_parser().parse_args(["bench", "--goodput", "ttft:100", "--sweep", "--num-prompts", "1", *flags])
    points, best, cut = bench.sweep(None, lambda n, k: [None] * n, a, bench.parse_options(a))
    assert cut is None
    info = {"num_workers": 4, "num_gpus": 2}
    result = {"num_workers": 4, "num_gpus": 2, **bench._sweep_summary(points, best, info, a)}
    return result, bench.sweep_report(result, a), tried


def test_sweep_says_when_its_goodput_is_only_a_lower_bound(monkeypatch):
    # Every rate passes: the doubling stops at its last probe, 2048 x --sweep-start.
    r, text, tried = _fake_sweep(monkeypatch, math.inf, "--sweep-start", "1")
    assert max(tried) == 2048 and r["max_goodput_rate"] == 2048 and r["goodput_is_lower_bound"] is True
    assert "goodput: >= 2.05e+03 req/s" in text and "raise --sweep-start to find the limit" in text
    assert ">= 512 req/s per worker" in text and ">= 1.02e+03 req/s per GPU" in text
    # Listed rates that all pass: the highest is a lower bound too.
    r, text, _ = _fake_sweep(monkeypatch, math.inf, "--sweep-rates", "1,2,4")
    assert r["max_goodput_rate"] == 4 and r["goodput_is_lower_bound"] is True
    assert "goodput: >= 4 req/s" in text and "add higher rates to --sweep-rates" in text
    # A rate above the best missed: the goodput is bracketed, no lower-bound wording.
    r, text, tried = _fake_sweep(monkeypatch, 7.3, "--sweep-steps", "3")
    # (1, 2, 4 pass, 8 misses; bisection: 6 and 7 pass, 7.5 misses.)
    assert r["max_goodput_rate"] == 7.0 and r["goodput_is_lower_bound"] is False and max(tried) == 8
    assert "goodput: 7 req/s" in text and "lower bound" not in text and "1.75 req/s per worker" in text
    # No rate passes: said plainly, with what to change.
    r, text, _ = _fake_sweep(monkeypatch, 0.0, "--sweep-rates", "1,2")
    assert r["max_goodput_rate"] is None and r["goodput_is_lower_bound"] is False
    assert r["max_goodput_rate_per_worker"] is None and r["max_goodput_rate_per_gpu"] is None
    assert "no rate tried reached 90% attainment of ttft <= 100 ms" in text and "try lower rates (--sweep-rates)" in text


def _interrupt_after(monkeypatch, n: int) -> dict:
    """Ctrl-C, as the terminal sends it, once the progress bar has counted `n` finished requests:
    SIGINT raised from the event loop, where asyncio.run's handler turns it into a cancellation
    of the run. Returns counters: finished requests seen in all, and at the interrupt."""
    seen = {"finished": 0, "at_interrupt": None, "handler_was_asyncio": None}
    original = bench.Progress.__call__

    def counting(self, r):
        original(self, r)
        seen["finished"] += 1
        if seen["finished"] == n:
            seen["at_interrupt"] = n
            # Raised only under asyncio.run's own handler: never a bare KeyboardInterrupt into pytest.
            seen["handler_was_asyncio"] = signal.getsignal(signal.SIGINT) is not signal.default_int_handler
            if seen["handler_was_asyncio"]:
                asyncio.get_running_loop().call_soon(signal.raise_signal, signal.SIGINT)

    monkeypatch.setattr(bench.Progress, "__call__", counting)
    return seen


def test_ctrl_c_keeps_what_finished_and_exits_130(injected_url, tmp_path, capsys, monkeypatch):
    # 4 fast requests (done ~1 s after they are sent), then 24 that hang: at the interrupt,
    # after the 4th result, some hanging ones are in flight and the rest not yet sent
    # (8 req/s, near-regular gaps: ~11 sent by then, 28 would take 3.5 s).
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    prompts = ["fast q"] * 4 + ["hang q"] * 24
    seen = _interrupt_after(monkeypatch, 4)
    rc, out, err = run_bench(
        capsys, "--base-url", injected_url, "--dataset-name", "custom", "--dataset-path",
        write_custom(tmp_path / "p.jsonl", prompts), "--num-prompts", "28", "--request-rate", "8",
        "--burstiness", "1000", "--goodput", "ttft:1000", "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", "i.json")
    assert seen["handler_was_asyncio"] and rc == 130, err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler          # restored
    r = json.loads((tmp_path / "i.json").read_text())
    assert r["interrupted"] is True and r["num_prompts"] == 28
    assert (r["completed"], r["failed"], r["not_finished"]) == (4, 0, 24)       # cut off != failed
    assert seen["finished"] == 4 and r["errors"] == [""] * 4 and r["output_lens"] == [TOKENS] * 4
    assert r["in_flight_at_interrupt"] >= 1 and r["not_sent"] >= 1
    assert r["in_flight_at_interrupt"] + r["not_sent"] == 24
    assert r["slo_attainment"] == 1.0                                            # of those that finished
    assert r["duration"] < 30 and r["request_throughput"] == pytest.approx(4 / r["duration"])
    assert "Serving Benchmark Result (interrupted)" in out and "Not finished (Ctrl-C):" in out
    assert "interrupted (Ctrl-C)" in out and "result: " + str(tmp_path / "i.json") + " (partial: interrupted)" in out
    assert (tmp_path / "i-latency.png").stat().st_size > 10_000


def test_ctrl_c_during_a_sweep_keeps_the_rates_it_finished(injected_url, tmp_path, capsys, monkeypatch):
    # Rate 5 (6 requests) finishes and passes; Ctrl-C comes after 3 results of rate 50 (15
    # requests): that point is reported as interrupted and left out, 5 req/s stays the goodput,
    # a lower bound since no rate above it was seen to miss.
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": "limited", "output_tokens": 4}) + "\n" for _ in range(6)))
    seen = _interrupt_after(monkeypatch, 6 + 3)
    rc, out, err = run_bench(
        capsys, "--base-url", injected_url, "--dataset-name", "custom", "--dataset-path", str(path),
        "--num-prompts", "6", "--sweep", "--sweep-rates", "5,50", "--sweep-duration", "0.3",
        "--goodput", "ttft:1000", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "s.json")
    assert seen["handler_was_asyncio"] and rc == 130, err
    r = json.loads((tmp_path / "s.json").read_text())
    assert r["interrupted"] is True and [p["request_rate"] for p in r["sweep"]] == [5.0]
    assert r["sweep"][0]["passed"] and r["max_goodput_rate"] == 5.0 and r["goodput_is_lower_bound"] is True
    cut = r["interrupted_point"]
    finished = cut["completed"] + cut["failed"]
    assert cut["interrupted"] and cut["request_rate"] == 50.0 and cut["num_prompts"] == 15
    assert finished == seen["finished"] - 6 >= 3 and cut["not_finished"] == 15 - finished
    assert f"interrupted (Ctrl-C) at rate 50 req/s, after {finished} of its 15 requests finished" in out
    assert "goodput: >= 5 req/s" in out and "the sweep was interrupted before a rate missed" in out
    assert (tmp_path / "s-sweep.png").stat().st_size > 10_000


@pytest.mark.parametrize("args, message", [
    (["--goodput", "latency:5"], "unknown metric 'latency'"),
    (["--goodput", "ttft:abc"], "needs a number of milliseconds"),
    (["--sweep"], "--sweep needs --goodput"),
    (["--burstiness", "0"], "--burstiness must be positive"),
    (["--percentile-metrics", "ttft,foo"], "unknown metric 'foo'"),
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--base-url", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9/v1/models"),
    (["--dataset-name", "trace"], "--dataset-name trace needs --dataset-path"),
    (["--dataset-name", "trace", "--dataset-path", "azure-conv", "--request-rate", "4"], "drop --request-rate"),
    (["--dataset-name", "trace", "--dataset-path", "azure-conv", "--burstiness", "0.5"], "drop --request-rate"),
    (["--dataset-name", "trace", "--dataset-path", "azure-conv", "--goodput", "ttft:100", "--sweep"],
     "--sweep does not apply to --dataset-name trace"),
    (["--dataset-name", "trace", "--dataset-path", "azure-conv", "--trace-max-len", "1"], "at least 2"),
    (["--dataset-name", "phases", "--request-rate", "4"], "--dataset-name phases sets its rates per phase: drop --request-rate"),
    (["--dataset-name", "phases", "--phases", "0"], "--phases must be at least 1"),
    (["--dataset-name", "phases", "--phase-s", "0"], "--phase-s must be positive"),
    (["--dataset-name", "phases", "--decode-phase-rate", "0"], "--decode-phase-rate must be a positive number"),
    (["--dataset-name", "phases", "--prefill-phase-output-len", "0"], "--prefill-phase-output-len must be at least 1"),
    (["--dataset-name", "phases", "--goodput", "ttft:100", "--sweep"], "--sweep does not apply to --dataset-name phases"),
    (["--save-trace", "x.jsonl"], "--save-trace writes a timed workload: it needs --dataset-name phases or trace"),
])
def test_bad_bench_input_gets_one_clear_line(capsys, args, message):
    rc = main(["bench", "--disable-tqdm", "--base-url", "http://127.0.0.1:9", *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_launch_runs_the_real_cluster(spawns, tmp_path, capsys):
    rc, out, err = run_bench(
        capsys, "--launch", "--dataset-name", "random", "--num-prompts", "12", "--random-input-len", "40",
        "--random-output-len", "10", "--random-range-ratio", "0.5", "--ignore-eos", "--request-rate", "30",
        "--goodput", "ttft:30000", "tpot:10000", "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", "c.json", "--no-plots")
    assert rc == 0, err
    r = json.loads((tmp_path / "c.json").read_text())
    for key in ("duration", "completed", "failed", "request_throughput", "request_goodput", "output_throughput",
                "total_token_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms",
                "input_lens", "output_lens", "ttfts", "itls", "errors"):
        assert key in r, key
    # the launched server admits by the targets this run judges (a busy box's handoff gaps are
    # no miss of a 10 s TPOT)
    assert "SLO targets TTFT 30000 ms, TPOT 10000 ms" in out
    assert (r["completed"], r["failed"]) == (12, 0) and r["errors"] == [""] * 12, [e for e in r["errors"] if e]
    assert r["total_output_tokens"] == sum(r["output_lens"])
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])
    assert r["request_throughput"] == pytest.approx(12 / r["duration"])
    # The dataset is the oracle: with ignore_eos every request got the tokens it asked for, and
    # the server's prompt count (usage) equals the client tokenizer's.
    asked = sample_random(load_tokenizer("tiny"), 12, 40, 10, 0.5, 0, seed=0)
    assert r["output_lens"] == [q.output_len for q in asked]
    assert r["input_lens"] == [q.prompt_len for q in asked]
    assert all(len(x) <= n - 1 for x, n in zip(r["itls"], r["output_lens"]))   # chunks may carry >1 token
    assert r["num_workers"] == 2 and r["workers_by_role"]["prefill"] == 1
    # The cluster's own counters over the run: each request handed off (none failed) or, while
    # the prefill worker had a queue, prefilled on the decode worker (serve's default, auto).
    server = r["server"]
    assert server["kv_transfers"] + server["local_prefills"] == 12 and server["kv_transfer_failures"] == 0
    assert server["kv_transfer_bytes"] > 0 and server["kv_transfer_mean_ms"] > 0
    assert 0 <= server["prefix_cache_hit_rate"] <= 1 and server["preemptions"] == 0
    assert set(server["mean_batch_size"]) == {"prefill", "decode"}
    assert "KV handoffs:" in out
    assert "Serving Benchmark Result" in out and "launching a local cluster" in out


def test_datasets_size_prompts_in_the_tokenizer(tmp_path):
    from cluster.loadtest.bench_data import load_custom, sample_prefix_repetition, sample_sharegpt
    tok = load_tokenizer("tiny")
    reqs = sample_random(tok, 40, 64, 20, range_ratio=0.25, prefix_len=16, seed=3)
    assert all(len(tok.encode(q.prompt)) == q.prompt_len for q in reqs)
    assert all(16 + 48 <= q.prompt_len <= 16 + 80 for q in reqs) and all(15 <= q.output_len <= 25 for q in reqs)
    prefix = tok.decode(tok.encode(reqs[0].prompt)[:12])
    assert all(q.prompt.startswith(prefix) for q in reqs)                  # --random-prefix-len is shared
    assert len({q.prompt_len for q in reqs}) > 5                            # lengths do vary

    reps = sample_prefix_repetition(tok, 30, prefix_len=40, suffix_len=10, num_prefixes=3, output_len=7, seed=1)
    heads = {tok.decode(tok.encode(q.prompt)[:30]) for q in reps}
    assert len(heads) == 3 and all(q.output_len == 7 for q in reps)
    assert all(len(tok.encode(q.prompt)) == q.prompt_len for q in reps)

    convs = [{"conversations": [{"from": "human", "value": f"question number {i} " * 3},
                                {"from": "gpt", "value": "an answer " * (i + 1)}]} for i in range(20)]
    convs.append({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "short"}]})
    (tmp_path / "sg.json").write_text(json.dumps(convs))
    sg = sample_sharegpt(str(tmp_path / "sg.json"), tok, 20)
    assert len(sg) == 20 and all(q.prompt_len >= 4 for q in sg)            # "hi" is filtered out
    assert sorted(q.output_len for q in sg) == sorted(len(tok.encode("an answer " * (i + 1))) for i in range(20))
    with pytest.raises(ValueError, match="only 20 usable conversations"):
        sample_sharegpt(str(tmp_path / "sg.json"), tok, 21)

    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"prompt": 5}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: needs a non-empty string 'prompt'"):
        load_custom(str(tmp_path / "bad.jsonl"), tok, 10, 8)


def write_trace(path, rows: list[tuple]) -> str:
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" + "".join(",".join(map(str, r)) + "\n"
                                                                              for r in rows))
    return str(path)


def test_load_trace_sorts_scales_and_clips(tmp_path):
    # Out of order and not starting at 0; a blank line is skipped; "7.0" tokens is a whole number.
    path = str(tmp_path / "t.csv")
    Path(path).write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n12.5,100,10\n10,40,300\n\n11.0,7.0,1\n")
    assert load_trace(path) == [TraceRow(0.0, 40, 300), TraceRow(1.0, 7, 1), TraceRow(2.5, 100, 10)]
    assert load_trace(path, num=2) == [TraceRow(0.0, 40, 300), TraceRow(1.0, 7, 1)]         # the first 2 in time
    # time_scale 2: twice the rate; lengths scaled and rounded, at least 1.
    assert load_trace(path, time_scale=2, length_scale=0.25) == [
        TraceRow(0.0, 10, 75), TraceRow(0.5, 2, 1), TraceRow(1.25, 25, 2)]
    # max_len: the prompt gives way so that prompt + output fits; an output alone too long is cut.
    rows = load_trace(path, max_len=64)
    assert [(r.prompt_len, r.output_len) for r in rows] == [(1, 63), (7, 1), (54, 10)]
    assert all(r.prompt_len + r.output_len <= 64 for r in rows)
    assert [(r.prompt_len, r.output_len) for r in load_trace(path, max_len=2)] == [(1, 1)] * 3
    # Extra columns are fine; the three named ones are what counts.
    (tmp_path / "x.csv").write_text("request_id,arrived_at,num_decode_tokens,num_prefill_tokens\nq1,3,5,9\n")
    assert load_trace(str(tmp_path / "x.csv")) == [TraceRow(0.0, 9, 5)]


@pytest.mark.parametrize("text, message", [
    ("arrival_time,prompt_len,output_len\n0,1,1\n",
     "t.csv:1: expected a CSV header with the columns arrived_at,num_prefill_tokens,num_decode_tokens"),
    ("", "got an empty file"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n", "t.csv: no requests in the trace"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,5\n1,abc,5\n", "t.csv:3: num_prefill_tokens must be a number"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,5\n\n-1,5,5\n", "t.csv:4: arrived_at must be a non-negative"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,-2\n", "t.csv:2: num_decode_tokens must be a non-negative"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5.5,2\n", "t.csv:2: num_prefill_tokens must be a whole number"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5\n", "t.csv:2: no value for num_decode_tokens"),
])
def test_load_trace_names_the_file_and_line_of_a_bad_row(tmp_path, text, message):
    (tmp_path / "t.csv").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_trace(str(tmp_path / "t.csv"))


def test_load_trace_refuses_bad_scales_and_missing_files(tmp_path):
    path = write_trace(tmp_path / "t.csv", [(0, 5, 5)])
    for kwargs, message in (({"time_scale": 0}, "--trace-time-scale must be positive"),
                            ({"length_scale": -1}, "--trace-length-scale must be positive"),
                            ({"max_len": 1}, "--trace-max-len must be at least 2")):
        with pytest.raises(ValueError, match=message):
            load_trace(path, **kwargs)
    with pytest.raises(FileNotFoundError, match="nope.csv: no such file .built-in traces: azure-conv, azure-code"):
        load_trace(str(tmp_path / "nope.csv"))


def test_built_in_traces_resolve_by_name():
    for name, count in (("azure-conv", 19366), ("azure-code", 8819)):
        rows = load_trace(name)
        assert len(rows) == count and rows[0].arrival_s == 0.0
        assert all(a.arrival_s <= b.arrival_s for a, b in zip(rows, rows[1:]))
        assert 3400 < rows[-1].arrival_s < 3600 and min(r.prompt_len for r in rows) >= 1
    assert len(load_trace("azure-code", num=10, time_scale=100)) == 10


def test_workload_gives_the_send_times_run_load_uses(tmp_path):
    # What `pdcluster simulate` gets without a server: a trace's scaled times, else the cumulative
    # gamma gaps that run_load draws itself (the first request waits one gap).
    from cluster.cli import build_parser
    tok = load_tokenizer("tiny")
    path = write_trace(tmp_path / "t.csv", [(5.0, 30, 8), (6.0, 300, 40), (9.0, 12, 100)])
    a = build_parser().parse_args(["bench", "--dataset-name", "trace", "--dataset-path", path, "--trace-time-scale",
                                   "4", "--trace-length-scale", "0.5", "--trace-max-len", "64", "--seed", "3"])
    reqs, times = bench.workload(a, tok)
    rows = load_trace(path, None, 4, 0.5, 64)
    assert times == [0.0, 0.25, 1.0] == [r.arrival_s for r in rows]
    assert [(q.prompt_len, q.output_len) for q in reqs] == [(15, 4), (44, 20), (6, 50)]
    assert [(q.prompt, q.prompt_len) for q in reqs] == [(q.prompt, q.prompt_len) for q in sample_trace(tok, rows, 3)]
    assert all(len(tok.encode(q.prompt)) == q.prompt_len for q in reqs)
    a = build_parser().parse_args(["bench", "--num-prompts", "20", "--random-input-len", "8", "--random-output-len",
                                   "4", "--request-rate", "10", "--burstiness", "2", "--seed", "5"])
    reqs, times = bench.workload(a, tok)
    assert len(reqs) == 20 and times == pytest.approx(np.cumsum(loadgen.arrival_gaps(20, 10, 2, 5)).tolist())
    assert times == loadgen.send_times(20, 10, 2, 5) and 0 < times[0] and np.all(np.diff(times) >= 0)
    a.request_rate = math.inf
    assert bench.workload(a, tok)[1] == [0.0] * 20


def test_trace_requests_are_sent_at_the_trace_times(injected_url, tmp_path, capsys, monkeypatch):
    # Out of order in the file and starting at 100 s; --trace-time-scale 2 halves the gaps, so the
    # first five are due 0, 0.1, 0.4, 0.6, 0.9 s after the start; the sixth is beyond --num-prompts.
    path = write_trace(tmp_path / "t.csv", [(100.0, 20, 3), (100.8, 35, 2), (100.2, 12, 4), (101.8, 50, 3),
                                            (101.2, 8, 2), (102.6, 30, 5)])
    tok = load_tokenizer("tiny")
    rows = load_trace(path, 5, time_scale=2)
    due = [r.arrival_s for r in rows]
    assert due == pytest.approx([0.0, 0.1, 0.4, 0.6, 0.9])
    sent: list[tuple[float, str, int]] = []
    send = loadgen.send

    async def recording_send(session, target, req):          # the moment the client sends each
        sent.append((time.perf_counter(), req.prompt, req.output_len))
        return await send(session, target, req)

    monkeypatch.setattr(loadgen, "send", recording_send)
    RECEIVED.clear()
    rc, out, err = run_bench(
        capsys, "--base-url", injected_url, "--tokenizer", "tiny", "--dataset-name", "trace", "--dataset-path", path,
        "--num-prompts", "5", "--trace-time-scale", "2", "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", "t.json", "--no-plots")
    assert rc == 0, err
    # Sent in the trace's order, each at its due time after the first (which goes at the start):
    # never early, late by no more than a busy box's scheduling slack.
    assert [p for _, p, _ in sent] == [q.prompt for q in sample_trace(tok, rows, seed=0)]
    lateness = [t - sent[0][0] - d for (t, _, _), d in zip(sent, due)]
    assert all(-0.005 <= x <= 0.1 for x in lateness), lateness
    # ... with the trace's prompt lengths (by the client's tokenizer: the fake server's usage
    # always says 7) and output lengths, and the server got exactly those requests, no earlier
    # than they were sent (the bench and the server share this process's clock).
    assert [len(tok.encode(p)) for _, p, _ in sent] == [r.prompt_len for r in rows] == [20, 12, 35, 8, 50]
    assert [n for _, _, n in sent] == [r.output_len for r in rows] == [3, 4, 2, 2, 3]
    at = {p: t for t, p, _ in sent}
    assert sorted((p, n) for _, p, n in RECEIVED) == sorted((p, n) for _, p, n in sent)
    assert all(t >= at[p] for t, p, _ in RECEIVED)
    r = json.loads((tmp_path / "t.json").read_text())
    assert (r["completed"], r["failed"], r["num_prompts"]) == (5, 0, 5)
    assert r["output_lens"] == [3, 4, 2, 2, 3] and r["input_lens"] == [7] * 5           # (usage)
    assert r["request_rate"] == pytest.approx(4 / 0.9) and r["burstiness"] is None
    assert (r["trace"], r["trace_time_scale"], r["trace_length_scale"], r["trace_max_len"]) == (path, 2.0, 1.0, None)
    assert r["duration"] >= 0.9
    assert "5 requests (trace " in out and "0.9 s of arrivals" in out and "trace x2" in out


def write_jsonl(path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def test_load_trace_reads_jsonl_in_vllm_shape_and_our_own(tmp_path):
    tok = load_tokenizer("tiny")
    # vLLM's timed_trace shape (Mooncake's traces): "timestamp" in ms there, hence --trace-timestamp-unit ms;
    # hash_ids are ignored. Out of order in the file: sorted by time, as a CSV trace is.
    path = write_jsonl(tmp_path / "mc.jsonl", [
        {"timestamp": 3000, "input_length": 300, "output_length": 40, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 50, "output_length": 4, "hash_ids": [2]},
        {"timestamp": 1500, "input_length": 7, "output_length": 9}])
    assert load_trace(path, timestamp_unit="ms") == [TraceRow(0.0, 50, 4), TraceRow(0.5, 7, 9), TraceRow(2.0, 300, 40)]
    assert [r.arrival_s for r in load_trace(path)] == [0.0, 500.0, 2000.0]              # seconds by default
    assert load_trace(path, num=2, timestamp_unit="ms") == [TraceRow(0.0, 50, 4), TraceRow(0.5, 7, 9)]
    # A tokenizer function is only called when a text prompt needs one.
    assert load_trace(path, tokenizer=lambda: pytest.fail("loaded a tokenizer for lengths"))[0] == TraceRow(0.0, 50, 4)
    # Our names: arrival_s (always seconds), the prompt as text or prompt_len, output_len or output_tokens, a
    # phase; a blank line is skipped; a .txt name starting with "{" is JSONL too.
    text = "hello there, how are you today?"                     # 31 tokens in tiny's byte-level tokenizer
    path = write_jsonl(tmp_path / "own.txt", [
        {"arrival_s": 12.5, "prompt": text, "output_tokens": 5, "phase": "b"}, "",
        {"arrival_s": 12.0, "prompt_len": 12, "output_len": 3.0, "phase": 1}])
    rows = load_trace(path, tokenizer=tok)
    assert rows == [TraceRow(0.0, 12, 3, None, "1"), TraceRow(0.5, 31, 5, text, "b")]
    # Lengths given as numbers scale; a text prompt is sent as written, or cut by tokens to fit --trace-max-len.
    rows = load_trace(path, time_scale=2, length_scale=2, tokenizer=tok)
    assert [(r.arrival_s, r.prompt_len, r.output_len, r.prompt) for r in rows] == [(0.0, 24, 6, None),
                                                                                  (0.25, 31, 10, text)]
    assert load_trace(path, max_len=10, tokenizer=tok)[1] == TraceRow(0.5, 5, 5, "hello", "b")
    reqs = sample_trace(tok, load_trace(path, tokenizer=tok))
    assert (reqs[1].prompt, reqs[1].prompt_len, reqs[1].output_len, reqs[1].phase) == (text, 31, 5, "b")
    assert len(tok.encode(reqs[0].prompt)) == reqs[0].prompt_len == 12 and reqs[0].phase == "1"


@pytest.mark.parametrize("text, message", [
    ('{"arrival_s": 0, "prompt_len": 5, "output_len": 5}\n{"arrival_s": 1, "prompt_len": 5,\n', "t.jsonl:2: not JSON"),
    ('[0, 5, 5]\n', "t.jsonl:1: expected one JSON object per line, got list"),
    ('{"prompt_len": 5, "output_len": 5}\n', "t.jsonl:1: no arrival time: give 'arrival_s' (seconds) or 'timestamp'"),
    ('{"arrival_s": 0, "output_len": 5}\n', "t.jsonl:1: no prompt: give 'prompt' (text) or its length in tokens"),
    ('{"arrival_s": 0, "prompt_len": 5}\n', "t.jsonl:1: no output length: give 'output_len', 'output_length'"),
    ('\n{"arrival_s": -1, "prompt_len": 5, "output_len": 5}\n', "t.jsonl:2: 'arrival_s' must be a non-negative number, got -1"),
    ('{"arrival_s": NaN, "prompt_len": 5, "output_len": 5}\n', "t.jsonl:1: 'arrival_s' must be a non-negative number, got nan"),
    ('{"timestamp": "soon", "prompt_len": 5, "output_len": 5}\n', "t.jsonl:1: 'timestamp' must be a number, got \"soon\""),
    ('{"arrival_s": 0, "input_length": true, "output_len": 5}\n', "t.jsonl:1: 'input_length' must be a number, got true"),
    ('{"arrival_s": 0, "prompt_len": 2.5, "output_len": 5}\n',
     "t.jsonl:1: 'prompt_len' must be a whole number of tokens, at least 1, got 2.5"),
    ('{"arrival_s": 0, "prompt_len": 5, "output_length": 0}\n',
     "t.jsonl:1: 'output_length' must be a whole number of tokens, at least 1, got 0"),
    ('{"arrival_s": 0, "prompt": "", "output_len": 5}\n', "t.jsonl:1: 'prompt' must be a non-empty string"),
    ('{"arrival_s": 0, "prompt": "hi", "output_len": 5}\n', "t.jsonl:1: a text 'prompt' needs a tokenizer"),
    ('{"arrival_s": 0, "prompt_len": 5, "output_len": 5, "phase": [1]}\n', "t.jsonl:1: 'phase' must be a string or an integer"),
    ("", "t.jsonl: no requests in the trace"),
    ("\n  \n", "t.jsonl: no requests in the trace"),
])
def test_load_trace_names_the_line_and_field_of_a_bad_jsonl_row(tmp_path, text, message):
    (tmp_path / "t.jsonl").write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_trace(str(tmp_path / "t.jsonl"))


def test_a_bad_jsonl_trace_is_one_clear_line_from_the_cli(tmp_path, capsys):
    # --save-trace needs no server, so the trace's own error is what the user sees.
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"arrival_s": 0, "prompt_len": 5, "output_len": 5}, '{"arrival_s": 1,'])
    rc = main(["bench", "--dataset-name", "trace", "--dataset-path", bad, "--save-trace", str(tmp_path / "o.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and "bad.jsonl:2: not JSON" in err and "Traceback" not in err
    assert not (tmp_path / "o.jsonl").exists()


def test_phases_alternate_with_their_own_rates_and_lengths():
    prefill, decode = Phase(PREFILL_HEAVY, 800, 8, 20.0), Phase(DECODE_HEAVY, 20, 300, 5.0)
    phases = alternate(4, prefill, decode)
    assert phases == [prefill, decode, prefill, decode]
    rows = phase_rows(phases, 60.0, range_ratio=0.25, seed=7)
    assert rows == phase_rows(phases, 60.0, range_ratio=0.25, seed=7)                 # seeded
    assert rows != phase_rows(phases, 60.0, range_ratio=0.25, seed=8)
    assert [r.arrival_s for r in rows] == sorted(r.arrival_s for r in rows)
    for k, ph in enumerate(phases):
        mine = [r for r in rows if k * 60 <= r.arrival_s < (k + 1) * 60]
        assert {r.phase for r in mine} == {ph.name} and mine[0].arrival_s == k * 60     # one starts the phase
        # Poisson: the requests after the first number 60 * rate on average, sd its square root; 4 sigma.
        assert abs(len(mine) - 1 - 60 * ph.rate) <= 4 * math.sqrt(60 * ph.rate)
        for mean, got in ((ph.input_len, [r.prompt_len for r in mine]), (ph.output_len, [r.output_len for r in mine])):
            lo, hi = round(mean * 0.75), round(mean * 1.25)
            assert lo <= min(got) and max(got) <= hi and max(got) - min(got) > (hi - lo) / 2
            # uniform on [lo, hi]: sd (hi - lo) / sqrt(12); the mean within 4 standard errors
            assert abs(np.mean(got) - (lo + hi) / 2) <= 4 * (hi - lo) / math.sqrt(12 * len(got))
    # Gamma gaps within a phase: burstiness 4 is more regular (cv 1/2), 1 is Poisson (cv 1).
    for burstiness in (1.0, 4.0):
        gaps = np.diff([r.arrival_s for r in phase_rows([Phase(PREFILL_HEAVY, 8, 8, 50.0)], 60.0, burstiness, seed=1)])
        assert gaps.mean() == pytest.approx(1 / 50, rel=0.1)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.12)


def _result(ttft: float, ok: bool = True) -> loadgen.RequestResult:
    return loadgen.RequestResult(prompt_len=7, output_len=5, ttft=ttft, itl=[0.05] * 4, latency=ttft + 0.2,
                                 success=ok, error="" if ok else "HTTP 500: x")


def test_results_split_by_the_phase_each_request_was_sent_in():
    # Three phases (the third repeats the first's label: a phase is a run of one label), sent at these times.
    labels = ["p"] * 4 + ["d"] * 3 + ["p"] * 2
    arrivals = [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 12.0]
    results = [_result(0.1), _result(0.1), _result(0.9), _result(0.1, ok=False),     # 2 of 4 good
               _result(0.2), None, _result(0.3),                                     # 1 cut off by Ctrl-C
               _result(0.1), _result(0.4)]
    p1, d, p2 = loadgen.summarize_phases(results, arrivals, labels, {"ttft": 0.5}, (50.0, 99.0))
    assert (p1["phase"], d["phase"], p2["phase"]) == ("p", "d", "p")
    assert [(x["start_s"], x["end_s"]) for x in (p1, d, p2)] == [(0.0, 4.0), (4.0, 10.0), (10.0, 14.0)]
    assert (p1["num_prompts"], p1["completed"], p1["failed"], p1["not_finished"]) == (4, 3, 1, 0)
    assert (d["num_prompts"], d["completed"], d["failed"], d["not_finished"]) == (3, 2, 0, 1)
    assert p1["slo_attainment"] == 0.5 and p1["request_goodput"] == 2 / 4
    assert d["slo_attainment"] == 1.0 and d["request_goodput"] == 2 / 6                # of those that finished
    assert p2["slo_attainment"] == 1.0 and p2["request_goodput"] == 2 / 4             # ends one mean gap on
    assert p1["mean_ttft_ms"] == pytest.approx(1100 / 3) and p1["p50_ttft_ms"] == pytest.approx(100)
    assert d["p99_ttft_ms"] == pytest.approx(299) and p2["mean_tpot_ms"] == pytest.approx(50)
    no_slo = loadgen.summarize_phases(results, arrivals, labels)
    assert [x["slo_attainment"] for x in no_slo] == [None] * 3 and no_slo[0]["request_goodput"] is None
    assert "p99_ttft_ms" in no_slo[0] and [x["num_prompts"] for x in no_slo] == [4, 3, 2]


def test_phases_save_as_a_trace_that_replays_the_same_load(tmp_path, capsys):
    from cluster.cli import build_parser
    flags = ["--dataset-name", "phases", "--phases", "3", "--phase-s", "4", "--prefill-phase-rate", "3",
             "--decode-phase-rate", "1.5", "--prefill-phase-input-len", "40", "--prefill-phase-output-len", "2",
             "--decode-phase-input-len", "6", "--decode-phase-output-len", "30", "--random-range-ratio", "0.5",
             "--seed", "5"]
    out = tmp_path / "ph.jsonl"
    rc = main(["bench", *flags, "--save-trace", str(out)])                          # no server: writes and exits
    stdout = capsys.readouterr().out
    rows = bench.trace_rows(build_parser().parse_args(["bench", *flags]))
    assert rc == 0 and f"wrote {len(rows)} requests" in stdout and "replay: --dataset-name trace" in stdout
    assert [r.phase for r in rows if r.arrival_s in (0, 4, 8)] == [PREFILL_HEAVY, DECODE_HEAVY, PREFILL_HEAVY]
    replay = load_trace(str(out))
    assert [(r.prompt_len, r.output_len, r.phase) for r in replay] == [(r.prompt_len, r.output_len, r.phase) for r in rows]
    assert [r.arrival_s for r in replay] == pytest.approx([r.arrival_s for r in rows], abs=1e-6)
    # bench sends the same requests at the same times from either
    tok = load_tokenizer("tiny")
    reqs, times = bench.workload(build_parser().parse_args(["bench", *flags]), tok)
    again, times2 = bench.workload(build_parser().parse_args(
        ["bench", "--dataset-name", "trace", "--dataset-path", str(out), "--num-prompts", "10000", "--seed", "5"]), tok)
    assert [(q.prompt, q.output_len, q.phase) for q in reqs] == [(q.prompt, q.output_len, q.phase) for q in again]
    assert times == pytest.approx(times2, abs=1e-6)


def test_phases_run_against_a_server_and_report_phase_by_phase(injected_url, tmp_path, capsys):
    # Two phases of 0.6 s at 10 req/s. Prefill-heavy asks 1 token: done ~FAST_MS after it is sent; decode-heavy
    # asks 4: FAST_MS + 3 ITL_MS = 450 ms at the earliest. Against e2el <= 300 ms the first phase meets the SLO
    # and the second cannot.
    from cluster.cli import build_parser
    flags = ["--dataset-name", "phases", "--phases", "2", "--phase-s", "0.6", "--prefill-phase-rate", "10",
             "--decode-phase-rate", "10", "--prefill-phase-input-len", "30", "--prefill-phase-output-len", "1",
             "--decode-phase-input-len", "5", "--decode-phase-output-len", "4", "--seed", "2"]
    rows = bench.trace_rows(build_parser().parse_args(["bench", *flags]))
    n1 = sum(r.phase == PREFILL_HEAVY for r in rows)
    rc, out, err = run_bench(capsys, "--base-url", injected_url, "--tokenizer", "tiny", *flags, "--goodput", "e2el:300",
                             "--save-result", "--result-dir", str(tmp_path), "--result-filename", "p.json", "--no-plots")
    assert rc == 0, err
    r = json.loads((tmp_path / "p.json").read_text())
    assert (r["completed"], r["failed"]) == (len(rows), 0) and r["output_lens"] == [x.output_len for x in rows]
    p1, p2 = r["phases"]
    assert (p1["phase"], p1["start_s"], p1["num_prompts"]) == (PREFILL_HEAVY, 0.0, n1)
    assert (p2["phase"], p2["start_s"], p2["num_prompts"]) == (DECODE_HEAVY, 0.6, len(rows) - n1)
    assert p1["slo_attainment"] == 1.0 and p1["request_goodput"] == pytest.approx(n1 / 0.6)
    assert p2["slo_attainment"] == 0.0 and p2["request_goodput"] == 0.0
    assert r["slo_attainment"] == pytest.approx(n1 / len(rows))
    assert r["phase_config"]["phases"] == 2 and r["phase_config"][DECODE_HEAVY]["output_len"] == 4
    assert "Per phase (by send time)" in out and "2 phases x 0.6 s" in out and "prefill-heavy" in out
