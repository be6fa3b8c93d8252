"""`pdcluster generate` and `pdcluster export-model`: bad input gets one clear line and exit
code 2 (never a traceback); good input gives the same results as the Python API, in order."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from cluster.cli import main
from workers.config import CacheConfig, EngineConfig
from workers.engine import LLMEngine
from workers.sequence import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PDCLUSTER = ROOT / ".venv" / "bin" / "pdcluster"
SMALL = ["--kv-cache-memory-mib", "16", "--swap-space-mib", "0"]


def run_cli(args: list[str], capsys) -> tuple[int | None, str]:
    """cluster.cli.main in-process; an exception escaping it counts as a traceback."""
    capsys.readouterr()
    try:
        rc = main(args)
    except SystemExit as e:                       # argparse
        rc = e.code
    except BaseException:                         # what the console script would print
        return None, capsys.readouterr().err + traceback.format_exc()
    return rc, capsys.readouterr().err


def run_console_script(args: list[str]) -> subprocess.CompletedProcess:
    exe = [str(PDCLUSTER)] if PDCLUSTER.exists() else [sys.executable, "-m", "cluster.cli"]
    return subprocess.run(exe + args, capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def write_jsonl(path: Path, lines: list) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def assert_clean_error(rc, err: str, *needles: str) -> None:
    assert "Traceback" not in err, err
    assert rc == 2, (rc, err)
    assert "pdcluster generate: error:" in err, err
    for n in needles:
        assert n in err, (n, err)


def test_prompt_longer_than_max_model_len(tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "short", "max_tokens": 2},
                                             {"prompt": "x" * 100, "max_tokens": 2}])
    rc, err = run_cli(["generate", "--input", inp, "--output", str(tmp_path / "out.jsonl"),
                       "--max-model-len", "32", *SMALL], capsys)
    assert_clean_error(rc, err, "max_model_len", "100")
    assert not (tmp_path / "out.jsonl").exists()


def test_max_tokens_zero(tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi", "max_tokens": 0}])
    rc, err = run_cli(["generate", "--input", inp, "--output", str(tmp_path / "out.jsonl"), *SMALL], capsys)
    assert_clean_error(rc, err, "max_tokens", f"{inp}:1")


def test_unknown_model_path(tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi", "max_tokens": 2}])
    missing = str(tmp_path / "no-such-model")
    rc, err = run_cli(["generate", "--input", inp, "--output", str(tmp_path / "out.jsonl"),
                       "--model", missing, *SMALL], capsys)
    assert_clean_error(rc, err, missing)


def test_malformed_jsonl_line_names_the_line(tmp_path, spawns):
    """Through the installed console script, as a user runs it."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "fine", "max_tokens": 2}, "",
                                             '{"prompt": "broken", "max_tokens": 2'])
    res = run_console_script(["generate", "--input", inp, "--output", str(tmp_path / "out.jsonl"), *SMALL])
    assert_clean_error(res.returncode, res.stderr, f"{inp}:3", "JSON")
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("bad", [{"stop": [5]}, {"stop_token_ids": "x"}], ids=["stop-not-str", "stop-ids-not-list"])
def test_malformed_sampling_fields_rejected_cleanly(bad, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [dict({"prompt": "hi", "max_tokens": 4}, **bad)])
    rc, err = run_cli(["generate", "--input", inp, "--output", str(tmp_path / "out.jsonl"), *SMALL], capsys)
    assert_clean_error(rc, err, f"{inp}:1", next(iter(bad)))


def test_generate_happy_path_matches_python_api(tmp_path, spawns):
    requests = [
        {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0},
        {"prompt_token_ids": [5, 200, 17, 99, 3], "max_tokens": 3, "temperature": 0},
        {"prompt": "Once upon a time " * 8, "max_tokens": 20, "temperature": 0},
        {"prompt_token_ids": list(range(60)), "max_tokens": 1, "temperature": 0},
        {"prompt": "x", "max_tokens": 7, "temperature": 0, "ignore_eos": True},
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", requests)
    out = tmp_path / "out.jsonl"
    res = run_console_script(["generate", "--input", inp, "--output", str(out), *SMALL])
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]

    engine = LLMEngine(EngineConfig(model="tiny", cache=CacheConfig(kv_cache_memory_bytes=16 * 2**20,
                                                                    swap_space_bytes=0)))
    want = engine.generate([
        {k: v for k, v in r.items() if k in ("prompt", "prompt_token_ids")} |
        {"params": SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=r.get("ignore_eos", False))}
        for r in requests])
    assert len(got) == len(requests)
    for g, w, r in zip(got, want, requests):
        assert g["token_ids"] == w.token_ids
        assert g["text"] == w.text
        assert g["finish_reason"] == w.finish_reason
        if w.finish_reason == "length":           # input order: each line has its own length
            assert len(g["token_ids"]) == r["max_tokens"]


def test_export_model_writes_a_hf_checkpoint(tmp_path, capsys, tiny_dir):
    out = tmp_path / "exported"
    capsys.readouterr()
    assert main(["export-model", "tiny", str(out)]) == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).is_file(), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == 258
    # Deterministic: the same weights as the session's export.
    assert (out / "model.safetensors").read_bytes() == (Path(tiny_dir) / "model.safetensors").read_bytes()
    rc, err = run_cli(["export-model", "no-such-builtin", str(tmp_path / "x")], capsys)
    assert rc == 2 and "Traceback" not in err and "no-such-builtin" in err


@pytest.mark.parametrize("args, needle", [
    (["router", "--port", "0"], "give their Ray cluster's address"),
    (["router", "--address", "127.0.0.1:1", "--cluster-id", "a/b", "--port", "0"], "--cluster-id takes"),
    (["router", "--address", "127.0.0.1:1", "--router-id", "a~b", "--port", "0"], "--router-id takes"),
    (["serve", "--routers", "0"], "--routers must be >= 1"),
    (["serve", "--cluster-id", ""], "--cluster-id takes"),
    (["down"], "give their Ray cluster's address"),
    (["down", "--address", "127.0.0.1:1", "--cluster-id", "a/b"], "--cluster-id takes"),
    (["down", "--address", "127.0.0.1:1", "--grace-s", "-1"], "--grace-s must be >= 0"),
], ids=["no-address", "bad-cluster-id", "bad-router-id", "no-routers", "empty-cluster-id", "down-no-address",
        "down-bad-cluster-id", "down-bad-grace"])
def test_several_routers_flags_fail_clearly(args, needle, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    rc, err = run_cli(args, capsys)
    assert rc == 2 and "Traceback" not in err and f"pdcluster {args[0]}: error:" in err and needle in err, err


def test_a_router_without_a_ray_cluster_there_says_so(spawns):
    """(A process of its own: this one may have joined the tests' Ray already.)"""
    out = run_console_script(["router", "--address", "127.0.0.1:1", "--port", "0"])
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "pdcluster router: error: cannot reach the Ray cluster at 127.0.0.1:1" in out.stderr, out.stderr
