"""`pdcluster profile`, `simulate` and `plan` as a user runs them: bench's report and JSON from
a simulated cluster, a profile of this machine that simulate reads back, a plan's JSON and plot,
and one-line errors for flags that do not go together."""
from __future__ import annotations

import json
import subprocess

import pytest

from cluster.capacity.profile import SERVED_OUTPUT
from cluster.loadtest import loadgen
from cluster.cli import main
from tests.common import pdcluster_cmd, subprocess_env
from workers.cost_model import BatchShape, CostModel, LinearStepModel, Link

ROOFLINE = ["--gpu", "h100-sxm", "--model", "llama-3-8b"]
SMALL = ["--dataset-name", "random", "--random-input-len", "300", "--random-output-len", "40",
         "--num-prompts", "80", "--request-rate", "20"]


def test_simulate_writes_benchs_result(tmp_path, capsys):
    rc = main(["simulate", *ROOFLINE, "--prefill", "1", "--decode", "2", *SMALL, "--goodput", "ttft:200", "tpot:50",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
               "--result-dir", str(tmp_path), "--result-filename", "sim.json"])
    out = capsys.readouterr().out
    assert rc == 0
    r = json.loads((tmp_path / "sim.json").read_text())
    # Every field bench's summary has, by the same function's own key set.
    slos = {"ttft": 0.2, "tpot": 0.05}
    expected = loadgen.summarize([], 1.0, slos, ("ttft", "tpot", "itl", "e2el"), (50.0, 99.0))
    assert set(expected) <= set(r)
    assert r["completed"] == 80 and r["failed"] == 0 and r["num_gpus"] == 3
    assert r["workers_by_role"] == {"prefill": 1, "decode": 2}
    assert len(r["itls"]) == 80 and all(len(x) == n - 1 for x, n in zip(r["itls"], r["output_lens"]))
    assert r["request_rate"] == 20 and r["simulator"]["events"] > 0
    # Each prompt prefilled once: handed off from the prefill pool or computed on its decode worker.
    assert r["simulator"]["handoffs"] + r["simulator"]["local_prefills"] == 80
    assert "Simulated Serving Benchmark Result" in out and "Median TTFT (ms):" in out
    assert (tmp_path / "sim-latency.png").stat().st_size > 10_000


def test_simulate_reports_phase_by_phase(tmp_path, capsys):
    """bench's phase generator drives the simulator; each phase's requests are the ones the
    generator made for it (the saved trace is the oracle), and each has its own latencies."""
    phases = ["--dataset-name", "phases", "--phases", "2", "--phase-s", "20", "--prefill-phase-rate", "10",
              "--decode-phase-rate", "10", "--seed", "3"]
    assert main(["bench", *phases, "--save-trace", str(tmp_path / "load.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "load.jsonl").read_text().splitlines()]
    assert main(["simulate", *ROOFLINE, "--prefill", "1", "--decode", "1", *phases, "--goodput", "ttft:500",
                 "--save-result", "--no-plots", "--result-dir", str(tmp_path), "--result-filename", "sim.json"]) == 0
    r = json.loads((tmp_path / "sim.json").read_text())
    assert [(p["phase"], p["num_prompts"], p["completed"]) for p in r["phases"]] == [
        (name, n, n) for name, n in ((k, sum(x["phase"] == k for x in rows)) for k in ("prefill-heavy", "decode-heavy"))]
    assert "Per phase" in capsys.readouterr().out
    assert "results" not in r


def test_simulate_reads_a_profile(tmp_path, capsys):
    cost = CostModel(LinearStepModel(0.004, 6e-5, 4e-8, 0.003, 1e-6, 1e-4), 4096, 65536, Link("m", 1e9, 0.01))
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**cost.to_json(), "profile": {"cpus": 2, "max_model_len": 2048,
                                                             "served": {"request_overhead_s": 0.01}}}))
    assert main(["simulate", "--profile", str(path), *SMALL, "--save-result", "--result-dir", str(tmp_path),
                 "--result-filename", "r.json", "--no-plots"]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["completed"] == 80 and r["cost_model"] == cost.source
    # The profile's measured overhead reaches every request: no TTFT below it plus a prefill step.
    assert min(r["ttfts"]) >= 0.01 + cost.step_s(BatchShape(1, 2, 4)) - 1e-9


@pytest.mark.parametrize("args,message", [
    ([*SMALL], "give --profile FILE"),
    (["--profile", "p.json", "--gpu", "a100-80g", *SMALL], "not both"),
    (["--gpu", "a100-80g", *SMALL], "--gpu NAME with --model NAME"),
    ([*ROOFLINE, "--workers", "3", *SMALL], "--workers applies to --mode colocated"),
    ([*ROOFLINE, "--max-concurrency", "4", *SMALL], "--max-concurrency"),
    ([*ROOFLINE, "--model", "gpt-5", *SMALL], "unknown model"),
    (["--gpu", "a100-80g", "--model", "opt-175b", *SMALL], "does not fit"),
    ([*ROOFLINE, "--dataset-name", "sharegpt", "--dataset-path", "x.json"], "needs --tokenizer"),
])
def test_simulate_flags_that_do_not_go_together(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.json").write_text("{}")
    assert main(["simulate", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_plan_writes_its_json_and_plot(tmp_path, capsys):
    rc = main(["plan", "--model", "opt-13b", "--gpu", "a100-80g", "--num-gpus", "2", "--slo-ttft-ms", "200",
               "--slo-tpot-ms", "100", "--dataset-name", "random", "--random-input-len", "400",
               "--random-output-len", "40", "--num-prompts", "60", "--search-steps", "2", "--context-len", "956",
               "--json", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    assert rc == 0
    r = json.loads((tmp_path / "plan.json").read_text())
    d, c = r["disaggregated"], r["colocated"]
    assert {"goodput_per_gpu", "num_prefill", "num_decode", "prefill_tp", "decode_tp"} <= set(d)
    assert {"goodput_per_gpu", "num_workers", "tp"} <= set(c)
    assert d["num_prefill"] * d["prefill_tp"] + d["num_decode"] * d["decode_tp"] <= 2
    best = max((x for x in r["candidates"] if x["mode"] == "disaggregated"), key=lambda x: x["goodput_per_gpu"])
    assert d["goodput_per_gpu"] == best["goodput_per_gpu"] > 0
    assert "819,200 bytes per token" in out and "largest batch" in out
    # A100-80GB TP1 (roofline KV capacity): 956-token sequences hold 60 blocks of 16 each.
    from workers.cost_model import roofline
    capacity = roofline("opt-13b", "a100-80g", 1).kv_capacity_tokens
    assert f"{capacity // 16 // 60} at 956" in out
    assert (tmp_path / "plan.png").stat().st_size > 10_000


def test_plan_against_distserves_baseline(tmp_path, capsys):
    """DistServe's own comparison: its OPT-13B profile for the disaggregated candidates, its
    profile of 2023's vLLM (TP1) for the colocated one, which cannot prefill 1,400-token prompts
    within 200 ms (22 + 0.1405 x 1,400 + 8.08e-6 x 1,400² ms = 234 ms) at any rate."""
    args = ["plan", "--model", "opt-13b", "--gpu", "a100-80g", "--num-gpus", "2", "--slo-ttft-ms", "200",
            "--slo-tpot-ms", "100", "--random-input-len", "1000", "--random-output-len", "40",
            "--random-range-ratio", "0.5", "--num-prompts", "60", "--search-steps", "2", "--step-costs", "distserve",
            "--colocated-step-costs", "vllm-2023", "--json", str(tmp_path / "p.json")]
    assert main(args) == 0
    r = json.loads((tmp_path / "p.json").read_text())
    assert r["colocated"]["goodput_per_gpu"] == 0 and r["colocated"]["tp"] == 1
    assert r["disaggregated"]["goodput_per_gpu"] > 0
    assert "unbounded" in capsys.readouterr().out
    assert main(args[:-6] + ["--colocated-step-costs", "vllm-2023"]) == 2       # needs --step-costs distserve
    assert "goes with --step-costs distserve" in capsys.readouterr().err


def test_profile_of_this_machine_feeds_simulate(tmp_path, spawns, alone):
    """The real profile (engine steps, handoff, and the served path on a local cluster), then a
    simulation from it."""
    out = tmp_path / "profile.json"
    run = subprocess.run(pdcluster_cmd("profile", "--model", "tiny", "--repeats", "3", "--output", str(out)),
                         env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    cost = CostModel.from_json(doc)
    p = doc["profile"]
    assert p["fit_median_rel_error"] < 0.25, p["fit_median_rel_error"]
    assert cost.kv_bytes_per_token == 4096 and cost.link.bandwidth > 1e8
    served = p["served"]
    assert 0.5 < served["prefill_step_factor"] < 3 and 0.5 < served["decode_step_factor"] < 3
    assert served["requests"] == 30 and served["request_overhead_s"] >= 0
    # The router's and client's CPU per streamed token, alone and under a closed loop (the
    # simulator's figure): each thread's own clock, so Ray's threads and idle polls stay out.
    assert 0 < served["router_cpu_per_token_s"] < 0.05 and 0 < served["router_cpu_per_token_alone_s"] < 0.05
    # The machine's busy CPU beside the engines' steps (what the simulator charges on shared
    # cores), per request and per token: a short request's share is some, and under a second.
    beside = served["background_cpu_per_request_s"] + SERVED_OUTPUT * served["background_cpu_per_token_s"]
    assert served["background_cpu_per_request_s"] >= 0 and served["background_cpu_per_token_s"] >= 0
    assert 0 < beside < 1, served
    assert served["loaded_prefill_step_wait"] >= 0 and served["loaded_decode_step_wait"] >= 0
    assert 0.1 <= served["prefill_wait_share"] <= 0.9
    sim = subprocess.run(pdcluster_cmd("simulate", "--profile", str(out), *SMALL), env=subprocess_env(),
                         capture_output=True, text=True, timeout=120)
    assert sim.returncode == 0, sim.stderr[-3000:]
    assert "Successful requests:                            80" in sim.stdout
