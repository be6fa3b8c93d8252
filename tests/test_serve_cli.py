"""`pdcluster serve` and `pdcluster demo` as a user runs them: the installed console script in
a subprocess.

`serve` starts its own local Ray (RAY_ADDRESS is cleared, so it cannot join the test session's
Ray), answers the official `openai` client with the offline engine's greedy output (the
single-engine path, itself checked against transformers in test_hf_parity), and on Ctrl-C
(SIGINT) or SIGTERM (what Kubernetes and systemd send) drains, stops its workers and Ray, and
exits with 128 + the signal, the shell's convention (uvicorn re-raises the signal after its
graceful shutdown; cluster/serve.py turns it into an exit that runs the cleanup).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from cluster.offline import generate
from cluster.serve import free_port
from common import descendants, kill_all, still_running, wait_for

ROOT = Path(__file__).resolve().parent.parent
PDCLUSTER = ROOT / ".venv" / "bin" / "pdcluster"
SMALL = ["--kv-cache-memory-mib", "16", "--swap-space-mib", "0"]
PROMPT, MAX_TOKENS = "The quick brown fox", 12


def pdcluster_cmd(*args: str) -> list[str]:
    exe = [str(PDCLUSTER)] if PDCLUSTER.exists() else [sys.executable, "-m", "cluster.cli"]
    return exe + list(args)


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


def subprocess_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)          # a local Ray of its own, never the session's
    return env


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_serve_answers_like_the_offline_engine_and_stops_on_a_signal(tmp_path, sig, code):
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = pdcluster_cmd("serve", "--model", "tiny", "--port", str(port), "--prefill", "1", "--decode", "1",
                        "--api-key", "k", *SMALL)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    tree: dict = {}
    try:
        def health():
            if proc.poll() is not None:
                return "exited"
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json().get("status")
            except (httpx.HTTPError, ValueError):
                return None

        status = wait_for(health, lambda s: s in ("ok", "exited"), deadline_s=240, poll_s=0.2,
                          describe=lambda: log.read_text(errors="replace")[-3000:])
        assert status == "ok", log.read_text(errors="replace")[-3000:]

        # Its workers are actor processes of its own Ray, under the serve process.
        tree = wait_for(lambda: descendants(proc.pid),
                        lambda d: sum("ray::Worker" in c for c in d.values()) >= 2, deadline_s=60,
                        describe=lambda: log.read_text(errors="replace")[-3000:])

        # The banner's example request works as printed (the API key's header included).
        try_line = next(line for line in log.read_text().splitlines() if line.strip().startswith("try: curl "))
        example = shlex.split(try_line.strip().removeprefix("try: "))
        assert "Authorization: Bearer k" in example, try_line
        reply = replay_curl(example)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 16, reply.text

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=120)
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        want = generate([{"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}],
                        model="tiny")[0]
        assert r.choices[0].token_ids == want["token_ids"]
        assert r.choices[0].text == want["text"]
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == MAX_TOKENS
        client.close()

        tree = descendants(proc.pid) | tree            # anything started since
        proc.send_signal(sig)
        rc = proc.wait(timeout=90)
        output = log.read_text(errors="replace")
        assert rc == code, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        # Nothing it started outlives it: Ray's daemons and the worker actors are gone.
        wait_for(lambda: still_running(tree), lambda alive: not alive, deadline_s=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        kill_all(tree)                              # only on failure: what this test started


def test_demo_runs_and_reports_every_request():
    n = 8
    res = subprocess.run(pdcluster_cmd("demo", "--num-prompts", str(n), *SMALL), cwd=ROOT, env=subprocess_env(),
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
