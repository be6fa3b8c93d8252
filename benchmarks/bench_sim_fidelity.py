#!/usr/bin/env python
"""The simulator against the served cluster on this machine, same workload, side by side.

    .venv/bin/python benchmarks/bench_sim_fidelity.py [--rates 2,12] [--num-prompts 100,300]

1. `pdcluster profile --model tiny` (engine steps, the handoff, the served path's overheads),
   again before each rate unless --profile is given: this box's speed drifts by a third and more
   over minutes, so a profile taken next to the run it is compared with is the fair calibration;
2. per rate: `pdcluster bench --launch` (serve's defaults, 1 prefill + 1 decode, in a process
   of its own; random 256 -> 48 tokens, range ratio 0.5, ignore_eos) and `pdcluster simulate
   --profile` with the same dataset flags and seed, so both see the same prompt lengths and
   send times;
3. a table of median and p99 TTFT and TPOT, simulated / measured; with --repeats N, each rate
   N times over (rates in turn, so that the box's slow and fast minutes fall on all of them)
   and the median of the N ratios after it, with their range.
Runs one thing at a time (the cores are shared: a real run beside anything else is not a
measurement).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PDCLUSTER = [str(ROOT / ".venv" / "bin" / "pdcluster")]
WORKLOAD = ["--random-input-len", "256", "--random-output-len", "48", "--random-range-ratio", "0.5",
            "--goodput", "ttft:1000", "tpot:100", "--percentile-metrics", "ttft,tpot,itl",
            "--metric-percentiles", "50,99", "--seed", "0"]
METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def run(args: list[str]) -> None:
    out = subprocess.run(PDCLUSTER + args, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode:
        sys.exit(f"pdcluster {args[0]} failed:\n{out.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="2,12")
    ap.add_argument("--num-prompts", default="100,300", help="per rate")
    ap.add_argument("--profile", default=None, help="use this profile instead of making one")
    ap.add_argument("--repeats", type=int, default=1, help="rounds over the rates; the table gives each "
                    "ratio's median over them")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rates = [float(r) for r in a.rates.split(",")]
    counts = [int(n) for n in a.num_prompts.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="simfid-"))
    rows = []
    for rnd in range(a.repeats):
        for rate, n in zip(rates, counts):
            rows.append(one_rate(a, tmp, rate, n, f"{rate:g}-{rnd}"))
    print(f"\n{'rate':>6} {'metric':<16} {'measured ms':>12} {'simulated ms':>13} {'sim / real':>10}")
    for r in rows:
        for m in METRICS:
            x, y = r["real"][m], r["sim"][m]
            print(f"{r['rate']:>6g} {m:<16} {x:>12.2f} {y:>13.2f} {y / x:>10.2f}")
    if a.repeats > 1:
        print(f"\nover {a.repeats} rounds: sim / real, median (range)")
        for rate in rates:
            for m in METRICS:
                ratios = sorted(r["sim"][m] / r["real"][m] for r in rows if r["rate"] == rate)
                print(f"{rate:>6g} {m:<16} {statistics.median(ratios):6.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows}, indent=1))


def one_rate(a, tmp: Path, rate: float, n: int, tag: str) -> dict:
    """A profile (unless one was given), the served run and the simulated one at `rate`."""
    profile = a.profile or str(tmp / f"profile-{tag}.json")
    if not a.profile:
        print(f"rate {rate:g}: profiling tiny on this machine ...", flush=True)
        run(["profile", "--model", "tiny", "--output", profile])
    served = json.loads(Path(profile).read_text())["profile"].get("served", {})
    print(f"profile: {profile}; served path: {json.dumps({k: round(v, 5) for k, v in served.items()})}")
    common = [*WORKLOAD, "--num-prompts", str(n), "--request-rate", f"{rate:g}", "--save-result",
              "--result-dir", str(tmp), "--no-plots"]
    print(f"rate {rate:g}: measuring ...", flush=True)
    run(["bench", "--launch", "--ignore-eos", "--disable-tqdm", *common, "--result-filename", f"real-{tag}.json"])
    run(["simulate", "--profile", profile, *common, "--result-filename", f"sim-{tag}.json"])
    real = json.loads((tmp / f"real-{tag}.json").read_text())
    sim = json.loads((tmp / f"sim-{tag}.json").read_text())
    local = {"real": real.get("server", {}).get("local_prefills"), "sim": sim["simulator"]["local_prefills"]}
    print(f"rate {rate:g}: prefilled on the decode worker: {local['real']} served, {local['sim']} simulated", flush=True)
    return {"rate": rate, "num_prompts": n, "profile_served": served, "real": {m: real[m] for m in METRICS},
            "sim": {m: sim[m] for m in METRICS}, "local_prefills": local}


if __name__ == "__main__":
    main()
