"""`pdcluster serve` and `pdcluster demo` as a user runs them: the installed console script in
a subprocess.

`serve` starts its own local Ray (RAY_ADDRESS is cleared, so it cannot join the test session's
Ray), answers the official `openai` client with the offline engine's greedy output (the
single-engine path, itself checked against transformers in test_hf_parity), and on Ctrl-C
(SIGINT) or SIGTERM (what Kubernetes and systemd send) drains (what is in flight finishes within
--drain-timeout-s, the rest ends with an error event), stops its workers and Ray, and
exits with 128 + the signal, the shell's convention (uvicorn re-raises the signal after its
graceful shutdown; cluster/run/serve.py turns it into an exit that runs the cleanup).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from cluster.offline import generate
from common import ROOT, SMALL_KV, ServeProcess, free_port, pdcluster_cmd, still_running, subprocess_env, wait_for
from test_drain import LONG, offline, parse, read_stream

PROMPT, MAX_TOKENS = "The quick brown fox", 12


def replay_curl(argv: list[str]) -> httpx.Response:
    """Run a `curl URL -H ... -d ...` command line: with curl when the machine has it, else the
    same request through httpx (what the line means, not what curl does with it)."""
    if shutil.which("curl"):
        out = subprocess.run(argv + ["-s", "-w", "\n%{http_code}"], capture_output=True, text=True, timeout=60)
        body, _, code = out.stdout.rpartition("\n")
        return httpx.Response(int(code), content=body.encode())
    url, headers, data = None, {}, None
    it = iter(argv[1:])
    for arg in it:
        if arg == "-H":
            k, _, v = next(it).partition(":")
            headers[k.strip()] = v.strip()
        elif arg == "-d":
            data = next(it)
        else:
            url = arg
    return httpx.post(url, headers=headers, content=data, timeout=60)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_serve_answers_like_the_offline_engine_and_a_signal_drains_then_exits_without_a_traceback(
        tmp_path, sig, code, spawns):
    port = free_port()
    key = "k-" + os.urandom(8).hex()
    with ServeProcess(tmp_path / "serve.log", "--prefill", "1", "--decode", "1", "--drain-timeout-s", "1",
                      *SMALL_KV, port=port, env={"PDCLUSTER_API_KEY": key}) as serve:
        # The key comes from the environment and is never printed; the banner's example request
        # works as printed, in a shell that has the key in its environment.
        assert key not in serve.output
        try_line = next(line for line in serve.output.splitlines() if line.strip().startswith("try: curl "))
        example = shlex.split(try_line.strip().removeprefix("try: "))
        assert "Authorization: Bearer $PDCLUSTER_API_KEY" in example, try_line
        example = [arg.replace("$PDCLUSTER_API_KEY", key) for arg in example]
        url = next(arg for arg in example if arg.startswith("http"))
        assert httpx.post(url, json={"model": "tiny", "prompt": "x"}, timeout=60).status_code == 401   # no key
        reply = replay_curl(example)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 16, reply.text

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        want = generate([{"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}],
                        model="tiny")[0]
        assert r.choices[0].token_ids == want["token_ids"]
        assert r.choices[0].text == want["text"]
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == MAX_TOKENS
        client.close()

        # The signal (an orchestrator's SIGTERM, Ctrl-C in the terminal) with two streams in
        # flight: the short one finishes within the 1 s drain, the long one ends with an error
        # event (a prefix of the offline output, never a cut stream); then serve exits with 128 +
        # the signal, and nothing it started outlives it (Ray's daemons, the worker actors). (A
        # 3 s drain let the long one's 2,000 tokens finish on a quiet box: 1.3 ms a token.)
        url, auth, short = f"http://127.0.0.1:{port}/v1/completions", {"Authorization": f"Bearer {key}"}, 8
        with ThreadPoolExecutor(2) as pool:
            long_first, short_first = threading.Event(), threading.Event()
            long_stream = pool.submit(read_stream, url, LONG, long_first, auth)
            assert long_first.wait(60)
            short_stream = pool.submit(read_stream, url, short, short_first, auth)
            assert short_first.wait(60)
            serve.signal(sig)
            t0 = time.monotonic()
            short_ids, short_reason, short_error = parse(short_stream.result(60))
            long_ids, long_reason, long_error = parse(long_stream.result(60))
        serve.proc.wait(timeout=90)
        took = time.monotonic() - t0
        rc = serve.wait_exit()
        output = serve.output
        assert rc == code, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        # Both were in flight when the signal was sent; on a busy box the short one (8 tokens)
        # may finish before serve's handler runs, the long one never does.
        draining = re.search(r"draining (\d+) request\(s\) in flight", output)
        assert draining and int(draining[1]) in (1, 2), output[-3000:]
        assert "1 request(s) did not finish and ended with an error" in output, output[-3000:]
        assert short_error is None and short_reason == "length" and short_ids == offline(short)
        assert long_error is not None and long_error["code"] == "server_shutdown", long_error
        assert 0 < len(long_ids) < LONG and long_ids == offline(len(long_ids))
        assert took < 1 + 30, took                    # the drain's 1 s, then the workers' shutdown


def test_a_second_router_serves_and_a_killed_serve_leaves_no_process_behind(tmp_path, spawns):
    """`serve --routers 2`: a `pdcluster router` on the next port serves the same pools (the
    offline engine's output). Then SIGKILL (the OOM killer, `kill -9`): serve runs no cleanup,
    yet within 10 s its worker actors and the other router have ended (its local Ray's raylet
    and GCS die with it, the workers with them; the router by PR_SET_PDEATHSIG)."""
    port = free_port()
    with ServeProcess(tmp_path / "serve.log", "--prefill", "1", "--decode", "1", "--routers", "2", *SMALL_KV,
                      port=port) as serve:
        second = f"http://127.0.0.1:{port + 1}"

        def health():
            try:
                return httpx.get(f"{second}/health", timeout=5).json().get("status")
            except (httpx.HTTPError, ValueError):
                return None
        wait_for(health, lambda s: s == "ok", 120, lambda: serve.output[-3000:], poll_s=0.2)
        client = openai.OpenAI(base_url=f"{second}/v1", api_key="x", max_retries=0, timeout=120)
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        client.close()
        want = generate([{"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}],
                        model="tiny")[0]
        assert r.choices[0].token_ids == want["token_ids"]

        serve.signal(signal.SIGKILL)
        assert serve.proc.wait(timeout=10) == -signal.SIGKILL
        ours = {k: c for k, c in serve.tree.items() if "ray::Worker" in c or " router " in c}
        assert len(ours) == 3, serve.tree                   # 2 workers and the second router were there
        wait_for(lambda: still_running(ours), lambda alive: not alive, 10)
        # (Ray's own agents notice the dead raylet up to a minute later; leaving, the fixture
        # kills whatever of the tree is left)


def test_demo_runs_and_reports_every_request(spawns):
    n = 8
    res = subprocess.run(pdcluster_cmd("demo", "--num-prompts", str(n), *SMALL_KV), cwd=ROOT, env=subprocess_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    out = res.stdout
    m = re.search(r"requests\s+(\d+) \((\d+) prompt tokens, (\d+) generated\)", out)
    assert m, out
    assert int(m.group(1)) == n
    # Each request asks for 16..128 tokens and ignores EOS.
    assert 16 * n <= int(m.group(3)) <= 128 * n, out
    assert int(m.group(2)) > 0
    ttft = re.search(r"TTFT ms\s+p50 ([\d.]+)\s+p90 ([\d.]+)\s+p99 ([\d.]+)", out)
    tpot = re.search(r"TPOT ms\s+p50 ([\d.]+)\s+p90 ([\d.]+)\s+mean ([\d.]+)", out)
    assert ttft and tpot, out
    assert 0 < float(ttft.group(1)) <= float(ttft.group(2)) <= float(ttft.group(3))
    assert 0 < float(tpot.group(1)) <= float(tpot.group(2))
    free = re.search(r"KV blocks free\s+(\d+)/(\d+) after the run", out)
    assert free and free.group(1) == free.group(2) and int(free.group(2)) > 0, out     # nothing leaked
