"""`pdcluster plan`: the placement with the highest goodput per GPU, found by simulation.

    pdcluster plan --model opt-13b --gpu a100-80g --num-gpus 4 --slo-ttft-ms 200 --slo-tpot-ms 100

For every placement that fits the GPUs (disaggregated: prefill and decode worker counts and a
tensor-parallel degree per pool; colocated: workers of one degree, the baseline), a rate
search finds the highest request rate at which the SLO attainment (the share of requests
meeting both the TTFT and the TPOT target) stays at --slo-attainment: DistServe's goodput.
Divided by the placement's GPUs, it ranks the candidates. Each probe is one simulated run of
the same workload (bench's dataset flags; a trace keeps its own arrival pattern, scaled in
time to the probed rate, other datasets arrive as a Poisson process at it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from cluster.capacity.commands import (Costs, add_cost_args, cluster_from_args, costs_from_args, engine_from_args, simulate,
                              sim_workload)
from cluster.capacity.simulate import SimRequest
from router.slo import ATTAINMENT
from workers.cost_model import DISTSERVE_OPT13B_A100_TP, VLLM2023_OPT13B_A100_TP1, CostModel, Link, model_shape
from workers.names import COLOCATED, DISAGGREGATED

TP_DEGREES = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    mode: str
    num_prefill: int = 0
    num_decode: int = 0
    prefill_tp: int = 1
    decode_tp: int = 1
    num_workers: int = 0          # colocated
    tp: int = 1                   # colocated

    @property
    def num_gpus(self) -> int:
        if self.mode == COLOCATED:
            return self.num_workers * self.tp
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    def describe(self) -> str:
        if self.mode == COLOCATED:
            return f"colocated {self.num_workers} x TP{self.tp}"
        return f"{self.num_prefill} prefill x TP{self.prefill_tp} + {self.num_decode} decode x TP{self.decode_tp}"

    def to_json(self) -> dict:
        if self.mode == COLOCATED:
            return {"num_workers": self.num_workers, "tp": self.tp, "num_gpus": self.num_gpus}
        return {"num_prefill": self.num_prefill, "num_decode": self.num_decode, "prefill_tp": self.prefill_tp,
                "decode_tp": self.decode_tp, "num_gpus": self.num_gpus}


def placements(num_gpus: int, degrees=TP_DEGREES) -> list[Placement]:
    """Every disaggregated placement within `num_gpus` (at least one worker per pool), and
    colocated ones using all of them at each degree."""
    ds = [d for d in degrees if d <= num_gpus]
    out = []
    for ptp in ds:
        for dtp in ds:
            for n_p in range(1, num_gpus // ptp + 1):
                for n_d in range(1, (num_gpus - n_p * ptp) // dtp + 1):
                    out.append(Placement(DISAGGREGATED, n_p, n_d, ptp, dtp))
    out += [Placement(COLOCATED, num_workers=num_gpus // tp, tp=tp) for tp in ds]
    return out


def add_plan_args(p: argparse.ArgumentParser) -> None:
    from cluster.loadtest.bench import add_dataset_args
    from cluster.capacity.commands import add_shape_args
    add_cost_args(p)
    p.add_argument("--num-gpus", type=int, required=True, help="GPUs to place the workers on")
    p.add_argument("--step-costs", default="roofline", choices=("roofline", "distserve"),
                   help="roofline (any model and GPU) or distserve: DistServe's published profile of "
                   "OPT-13B on A100-80GB (TP 1, 2, 4), to compare with its planner")
    p.add_argument("--colocated-step-costs", default="same", choices=("same", "vllm-2023"),
                   help="same: colocated candidates on the same costs; vllm-2023 (with --step-costs "
                   "distserve): DistServe's baseline, its profile of 2023's vLLM (TP1 only)")
    s = p.add_argument_group("SLOs")
    s.add_argument("--slo-ttft-ms", type=float, required=True)
    s.add_argument("--slo-tpot-ms", type=float, required=True)
    s.add_argument("--slo-attainment", type=float, default=ATTAINMENT, help="share of requests that must meet "
                   f"both (default {ATTAINMENT})")
    r = p.add_argument_group("search")
    r.add_argument("--max-rate-per-gpu", type=float, default=None, help="where the rate search starts looking "
                   "(default: found by doubling from 1 req/s per GPU)")
    r.add_argument("--search-steps", type=int, default=7, help="bisection steps per placement (default 7)")
    r.add_argument("--context-len", type=int, action="append", default=[], metavar="TOKENS",
                   help="also print the largest batch at this context length (repeatable)")
    r.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")
    r.add_argument("--plot", default=None, metavar="FILE", help="PNG of SLO attainment against rate per "
                   "placement (default: beside --json)")
    add_shape_args(p)
    add_dataset_args(p)
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson); "
                   "not for a trace, which keeps its own")
    p.set_defaults(request_rate=math.inf, max_concurrency=None, tokenizer=None)


# -- costs per placement --------------------------------------------------------------------------------
def distserve_costs(tp: int, link: Link | None) -> CostModel:
    """DistServe's published OPT-13B A100 step profile at this degree, with its measured KV
    capacity (their max_num_tokens table) and our NVLink handoff."""
    if tp not in DISTSERVE_OPT13B_A100_TP:
        raise ValueError(f"DistServe's profile of OPT-13B has TP {sorted(DISTSERVE_OPT13B_A100_TP)}, not {tp}")
    step, capacity = DISTSERVE_OPT13B_A100_TP[tp]
    from workers.cost_model import hardware, nvlink
    shape = model_shape("opt-13b")
    return CostModel(step, shape.kv_bytes_per_token(2), capacity, link or nvlink(hardware("a100-80g")), tp,
                     f"distserve opt-13b a100-80g tp{tp}")


def costs_for(a: argparse.Namespace, p: Placement) -> Costs:
    ptp, dtp = (p.tp, p.tp) if p.mode == COLOCATED else (p.prefill_tp, p.decode_tp)
    if a.colocated_step_costs == "vllm-2023" and a.step_costs != "distserve":
        raise ValueError("--colocated-step-costs vllm-2023 goes with --step-costs distserve")
    if a.colocated_step_costs == "vllm-2023" and p.mode == COLOCATED:
        if p.tp != 1:
            raise ValueError("does not fit: DistServe's vLLM profile is TP1 only")
        cost = dataclasses.replace(distserve_costs(1, None), step=VLLM2023_OPT13B_A100_TP1,
                                   source="distserve's vllm-2023 opt-13b a100-80g tp1")
        return Costs(cost, cost, 2048, cost.source)
    if a.step_costs == "distserve":
        if (a.model or "").lower() != "opt-13b" or a.gpu != "a100-80g":
            raise ValueError("--step-costs distserve is DistServe's profile of --model opt-13b on --gpu a100-80g")
        from workers.cost_model import link
        lk = link(a.kv_link) if a.kv_link else None
        return Costs(distserve_costs(ptp, lk), distserve_costs(dtp, lk), 2048, "distserve opt-13b a100-80g")
    return costs_from_args(a, ptp, dtp)


# -- the rate search ----------------------------------------------------------------------------------
def at_rate(requests: list[SimRequest], rate: float) -> list[SimRequest]:
    """The workload's arrivals scaled in time so that its mean rate is `rate`."""
    span = requests[-1].arrival_s - requests[0].arrival_s
    base = (len(requests) - 1) / span if span > 0 else math.inf
    k = base / rate
    t0 = requests[0].arrival_s
    return [r.at((r.arrival_s - t0) * k) for r in requests]


def search(probe, start: float, steps: int, target: float) -> tuple[float, list[tuple[float, float]]]:
    """The highest rate whose attainment (probe(rate)) reaches target: doubling (or halving)
    to bracket it, then bisection. Returns it (0 when even a tiny rate fails) and the probes."""
    probes = []

    def ok(rate):
        att = probe(rate)
        probes.append((rate, att))
        return att >= target
    lo, hi = 0.0, start
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > start * 2**12:
            return lo, probes
    if lo == 0.0:
        floor = start / 2**10
        while hi > floor and not ok(hi / 2):
            hi /= 2
        if hi <= floor:
            return 0.0, probes
        lo = hi / 2
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo, probes


def plan(a: argparse.Namespace, progress=print) -> dict:
    if a.num_gpus < 1:
        raise ValueError("--num-gpus must be at least 1")
    if not 0 < a.slo_attainment <= 1:
        raise ValueError("--slo-attainment must be in (0, 1]")
    if a.slo_ttft_ms <= 0 or a.slo_tpot_ms <= 0:
        raise ValueError("--slo-ttft-ms and --slo-tpot-ms must be positive")
    if a.search_steps < 1:
        raise ValueError("--search-steps must be at least 1")
    if a.dataset_name != "trace":
        a.request_rate = 1.0                       # the Poisson gaps' shape; each probe rescales them
    engine = engine_from_args(a)
    base, shared, _ = sim_workload(a)
    if len(base) < 2:
        raise ValueError("--num-prompts must be at least 2 for a rate search")
    if not shared and engine.cache.enable_prefix_caching:
        engine = dataclasses.replace(engine, cache=dataclasses.replace(engine.cache, enable_prefix_caching=False))
    slos = {"ttft": a.slo_ttft_ms / 1000, "tpot": a.slo_tpot_ms / 1000}
    start = a.max_rate_per_gpu or 1.0
    rows = []
    for p in placements(a.num_gpus):
        try:
            costs = costs_for(a, p)
        except ValueError as e:
            if "does not fit" in str(e):           # the weights need more GPUs per worker
                continue
            raise
        cluster = dataclasses.replace(
            cluster_from_args(_shape_args(a, p), costs, engine), seed=a.seed)

        def probe(rate, cluster=cluster, costs=costs):
            run = simulate(cluster, at_rate(base, rate), slos, ("ttft", "tpot"), (90.0,), costs.max_model_len)
            return run["slo_attainment"]
        rate, probes = search(probe, start * p.num_gpus, a.search_steps, a.slo_attainment)
        rows.append({"mode": p.mode, "placement": p, "goodput": rate, "goodput_per_gpu": rate / p.num_gpus,
                     "probes": sorted(probes)})
        progress(f"  {p.describe():<38} {p.num_gpus} GPUs  goodput {rate:7.2f} req/s  "
                 f"{rate / p.num_gpus:6.3f} req/s/GPU")
    if not rows:
        raise ValueError(f"no placement fits {a.num_gpus} GPUs: the model's weights need more")
    best = {}
    for mode in (DISAGGREGATED, COLOCATED):
        cands = [r for r in rows if r["mode"] == mode]
        if cands:
            b = max(cands, key=lambda r: (r["goodput_per_gpu"], -r["placement"].num_gpus))
            best[mode] = {"goodput_per_gpu": b["goodput_per_gpu"], "goodput": b["goodput"], **b["placement"].to_json()}
    return {"model": a.model, "gpu": a.gpu, "num_gpus": a.num_gpus, "step_costs": a.step_costs,
            "colocated_step_costs": a.colocated_step_costs,
            "slo": {"ttft_ms": a.slo_ttft_ms, "tpot_ms": a.slo_tpot_ms, "attainment": a.slo_attainment},
            "workload": {"dataset_name": a.dataset_name, "dataset_path": a.dataset_path, "num_prompts": len(base),
                         "mean_prompt_tokens": sum(r.prompt_len for r in base) / len(base),
                         "mean_output_tokens": sum(r.output_len for r in base) / len(base)},
            **best,
            "candidates": [{"placement": r["placement"].describe(), "mode": r["mode"], **r["placement"].to_json(),
                            "goodput": r["goodput"], "goodput_per_gpu": r["goodput_per_gpu"],
                            "probes": [{"rate": x, "attainment": y} for x, y in r["probes"]]} for r in rows]}


def _shape_args(a: argparse.Namespace, p: Placement) -> argparse.Namespace:
    """The cluster flags of one placement, as `simulate` would take them."""
    b = argparse.Namespace(**vars(a))
    for k in ("prefill", "decode", "workers"):          # given or not, these come from the placement
        if hasattr(b, k):
            delattr(b, k)
    b.mode = p.mode
    if p.mode == COLOCATED:
        b.workers = p.num_workers
    else:
        b.prefill, b.decode = p.num_prefill, p.num_decode
    return b


def kv_arithmetic(a: argparse.Namespace, result: dict) -> list[str]:
    """Bytes per token and the largest batch at a few context lengths, per tensor-parallel degree."""
    shape = model_shape(a.model)
    lines = [f"KV cache of {shape.name}: {shape.kv_bytes_per_token(2):,} bytes per token (bf16: 2 x "
             f"{shape.num_layers} layers x {shape.num_kv_heads} KV heads x {shape.head_dim} x 2 B)"]
    if any(c < 1 for c in a.context_len):
        raise ValueError("--context-len must be at least 1")
    contexts = sorted({512, 2048, min(shape.max_len, 8192), *a.context_len,
                       round(result["workload"]["mean_prompt_tokens"] + result["workload"]["mean_output_tokens"])})
    for tp in (d for d in TP_DEGREES if d <= a.num_gpus):
        try:
            cost = costs_for(a, Placement(COLOCATED, num_workers=1, tp=tp)).prefill
        except ValueError as e:
            lines.append(f"  TP{tp}: {e}")
            continue
        batches = ", ".join(f"{cost.max_batch_at(c)} at {c}" for c in contexts)
        lines.append(f"  TP{tp}: {cost.kv_capacity_tokens:,} tokens of KV per worker; largest batch: {batches}")
    return lines


def table(result: dict) -> str:
    lines = [f"{'placement':<40}{'GPUs':>5}{'goodput':>10}{'per GPU':>10}", "-" * 65]
    for c in sorted(result["candidates"], key=lambda c: -c["goodput_per_gpu"]):
        lines.append(f"{c['placement']:<40}{c['num_gpus']:>5}{c['goodput']:>10.2f}{c['goodput_per_gpu']:>10.3f}")
    d, c = result.get(DISAGGREGATED), result.get(COLOCATED)
    if d:
        lines.append(f"best disaggregated: {d['num_prefill']} prefill x TP{d['prefill_tp']} + {d['num_decode']} "
                     f"decode x TP{d['decode_tp']}: {d['goodput_per_gpu']:.3f} req/s per GPU")
    if c:
        lines.append(f"best colocated:     {c['num_workers']} x TP{c['tp']}: {c['goodput_per_gpu']:.3f} req/s per GPU")
    if d and c and c["goodput_per_gpu"] > 0:
        lines.append(f"disaggregated / colocated: {d['goodput_per_gpu'] / c['goodput_per_gpu']:.2f}x")
    elif d and c and d["goodput_per_gpu"] > 0:
        lines.append("disaggregated / colocated: unbounded (no colocated placement meets the SLOs at any rate)")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for c in sorted(result["candidates"], key=lambda c: -c["goodput_per_gpu"]):
        pts = sorted((p["rate"] / c["num_gpus"], p["attainment"]) for p in c["probes"])
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3,
                ls="-" if c["mode"] == DISAGGREGATED else "--", label=c["placement"])
    ax.axhline(result["slo"]["attainment"], color="grey", lw=0.8)
    ax.set_xlabel("request rate per GPU (req/s)")
    ax.set_ylabel("SLO attainment (TTFT and TPOT)")
    ax.set_title(f"{result['model']} on {result['num_gpus']} x {result['gpu']}: TTFT <= {result['slo']['ttft_ms']:g} ms, "
                 f"TPOT <= {result['slo']['tpot_ms']:g} ms")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cmd_plan(a: argparse.Namespace) -> int:
    if not a.gpu or not a.model:
        raise ValueError("pdcluster plan needs --gpu and --model (plans are for GPUs; profiles of this "
                         "machine are for `simulate`)")
    if a.profile:
        raise ValueError("pdcluster plan takes --gpu and --model, not --profile")
    print(f"pdcluster plan: {a.model} on {a.num_gpus} x {a.gpu}, SLOs TTFT {a.slo_ttft_ms:g} ms and TPOT "
          f"{a.slo_tpot_ms:g} ms at {a.slo_attainment:.0%}; step costs: {a.step_costs}", flush=True)
    result = plan(a)
    w = result["workload"]
    print(f"workload: {a.dataset_name}, {w['num_prompts']} requests, mean prompt {w['mean_prompt_tokens']:.0f} "
          f"tokens, mean output {w['mean_output_tokens']:.0f} tokens")
    print(table(result))
    result["kv"] = kv_arithmetic(a, result)
    print("\n".join(result["kv"]))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"result: {a.json}")
    png = a.plot or (str(Path(a.json).with_suffix(".png")) if a.json else None)
    if png:
        print(f"plot:   {plot(result, Path(png))}")
    return 0
