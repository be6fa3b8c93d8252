#!/usr/bin/env python
"""The engine on a CUDA GPU: offline throughput beside HF transformers on the same GPU, and
batch-1 decode beside the GPU's memory-bandwidth bound.

    python benchmarks/bench_gpu.py [--part offline|decode|all] [--model small] [--dtype bfloat16]
                                   [--repeats 1] [--json OUT]

--part offline: bench_offline.py's workloads on the built-in `--model` (default `small`, ~97M
  parameters) exported as a Hugging Face checkpoint, greedy, ignore_eos:
    (a) 32 prompts x 128 tokens -> 64 new tokens each;
    (b) 64 requests, prompts 16-512 tokens, outputs 16-256 tokens (fixed seed).
  pdcluster: `LLMEngine(EngineConfig(model=dir, device="cuda", dtype=...)).generate(...)` after
  bench_offline.py's warm-up; tokens/s = requested output tokens / wall time of the call.
  HF: `AutoModelForCausalLM.from_pretrained(dir, dtype=...)` on the same GPU, `generate` on static
  batches (32 for a, 16 for b, arrival order, left padding; only the tokens each request asked
  for count), timed to the GPU's completion. Then bench_offline.py's step anatomy: one decode
  step with 64 sequences decoding, wall against model time (the rest is the engine's overhead:
  on a GPU, the host work that the kernels wait for).
--part decode: one 128-token prompt -> 128 tokens on `--model`; the decode steps' tokens/s
  beside the bound = the GPU's copy bandwidth (1 GiB fp32 device-to-device copy_, best of 7,
  counting bytes read + written, STREAM's convention) / the weight bytes a decode step reads.
  A model this small is far from that bound at batch 1: each step launches a few hundred small
  kernels from Python (no CUDA graphs here), so the figure mostly measures that host path.

make gpu-check runs both parts (benchmarks/gpu_check.py). Needs a CUDA GPU and transformers.
"""
from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.bench_offline import (describe, hf_batches, make_workload, pd_run, pd_warmup,  # noqa: E402
                                      random_prompts, step_anatomy, warmup_requests,
                                      weight_bytes_per_decode_step)
from benchmarks.common import memory_bandwidth, write_json  # noqa: E402
from workers.checkpoint import export_builtin  # noqa: E402
from workers.config import CacheConfig, EngineConfig  # noqa: E402
from workers.engine import LLMEngine  # noqa: E402
from workers.sequence import SamplingParams  # noqa: E402

HF_BATCH = {"a": 32, "b": 16}


def engine_on(device: str, model: str, dtype: str, backend: str, kv_gib: float) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, attention_backend=backend,
                                  cache=CacheConfig(kv_cache_memory_bytes=int(kv_gib * 2**30), swap_space_bytes=0)))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- HF transformers on the same GPU ---------------------------------------------------------------
def hf_load(ckpt: Path, dtype: str, device: str):
    import transformers
    from transformers import AutoModelForCausalLM
    transformers.logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=getattr(torch, dtype)).to(device).eval()
    gc = model.generation_config
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
    return model


@torch.inference_mode()
def hf_generate_batch(model, batch: list[dict]) -> int:
    device = str(model.device)
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
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, pad_token_id=pad)
    sync(device)
    if out.shape[1] - width != n:
        raise RuntimeError(f"HF generated {out.shape[1] - width} tokens, asked for {n}")
    return sum(r["max_tokens"] for r in batch)


def hf_run(model, reqs: list[dict], batch_size: int) -> dict:
    batches = hf_batches(reqs, batch_size, "none")
    t0 = time.perf_counter()
    useful = sum(hf_generate_batch(model, b) for b in batches)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "output_tokens": useful, "tok_s": useful / dt, "batches": len(batches),
            "batch_size": batch_size}


def median(runs: list[dict]) -> dict:
    res = dict(sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2])
    if len(runs) > 1:
        res["runs_tok_s"] = [r["tok_s"] for r in runs]
    return res


# -- the parts -------------------------------------------------------------------------------------
def offline(args, ckpt: Path) -> dict:
    out: dict = {"workloads": {}}
    engine = engine_on(args.device, str(ckpt), args.dtype, args.attention_backend, args.kv_cache_gib)
    out["attention_backend"] = engine.runner.backend.name
    pd_warmup(engine)
    for w in args.workloads:
        out["workloads"][w] = {"requests": describe(make_workload(w))}
        res = median([pd_run(engine, make_workload(w, i)) for i in range(args.repeats)])
        out["workloads"][w]["pdcluster"] = res
        print(f"[{w}] pdcluster {res['tok_s']:.0f} tok/s", flush=True)
    out["step_anatomy"] = step_anatomy(engine)
    del engine
    if args.skip_hf:
        return out
    model = hf_load(ckpt, args.dtype, args.device)
    warm = warmup_requests()
    hf_generate_batch(model, warm[:8])
    hf_generate_batch(model, warm[8:])
    for w in args.workloads:
        res = median([hf_run(model, make_workload(w, i), HF_BATCH[w]) for i in range(args.repeats)])
        out["workloads"][w]["hf"] = res
        out["workloads"][w]["pdcluster_over_hf"] = out["workloads"][w]["pdcluster"]["tok_s"] / res["tok_s"]
        print(f"[{w}] HF {res['tok_s']:.0f} tok/s", flush=True)
    return out


def decode(args, ckpt: Path, prompt_len: int = 128, max_tokens: int = 128) -> dict:
    bw = memory_bandwidth(mib=1024 if args.device.startswith("cuda") else 256, device=args.device)
    engine = engine_on(args.device, str(ckpt), args.dtype, args.attention_backend, 1.0)
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.generate([{"prompt_token_ids": random_prompts(1, 32, seed=11)[0], "params": warm}])
    seq = engine.add_request(prompt_token_ids=random_prompts(1, prompt_len, seed=12)[0],
                             params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while seq.num_output_tokens == 0:                # prefill -> first token, not counted
        engine.step()
    steps, model_s = 0, 0.0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()                                # the runner synchronizes the GPU each step
        steps += 1
        model_s += engine.runner.last_times.model_s
    dt = time.perf_counter() - t0
    engine.result(seq)
    wbytes = weight_bytes_per_decode_step(engine.model)
    copy_rw = 2 * bw["copy"]                         # read + write
    res = {"decode_steps": steps, "seconds": dt, "tok_s": steps / dt, "model_only_tok_s": steps / model_s,
           "weight_bytes_per_step": wbytes, "num_params": engine.model_config.num_params(),
           "attention_backend": engine.runner.backend.name,
           "bandwidth_GBps": {"copy_read_write": copy_rw / 1e9, "read": bw["read"] / 1e9},
           "bound_tok_s": copy_rw / wbytes}
    res["fraction_of_bound"] = res["tok_s"] / res["bound_tok_s"]
    return res


def report(r: dict) -> None:
    off = r.get("offline")
    if off:
        print(f"\n=== offline throughput on {r['env']['gpu']}, {r['model']} {r['dtype']}, "
              f"attention {off['attention_backend']}, greedy, ignore_eos ===")
        for w, x in off["workloads"].items():
            line = f"[{w}] {x['requests']}\n  pdcluster {x['pdcluster']['tok_s']:9.0f} tok/s"
            if "hf" in x:
                line += (f"   HF generate {x['hf']['tok_s']:9.0f} tok/s (static batches of {x['hf']['batch_size']})"
                         f"   pdcluster / HF = {x['pdcluster_over_hf']:.2f}x")
            print(line)
        an = off["step_anatomy"]
        print(f"  one decode step, {an['num_seqs']} sequences: wall {an['wall']['p50_ms']:.2f} ms p50, model "
              f"{an['model']['p50_ms']:.2f} ms, overhead {an['overhead']['p50_ms']:.2f} ms "
              f"(prepare {an['prepare']['p50_ms']:.2f}); {an['decode_tok_s']:.0f} tok/s in those steps")
    d = r.get("decode")
    if d:
        b = d["bandwidth_GBps"]
        print(f"\n=== batch-1 decode, {r['model']} {r['dtype']} ({d['num_params'] / 1e6:.0f}M params, "
              f"{d['weight_bytes_per_step'] / 1e6:.0f} MB of weights a step) ===")
        print(f"  copy bandwidth (device-to-device, read + write): {b['copy_read_write']:.0f} GB/s; "
              f"bound {d['bound_tok_s']:.0f} tok/s")
        print(f"  measured {d['tok_s']:.1f} tok/s over {d['decode_steps']} steps (model time alone "
              f"{d['model_only_tok_s']:.1f} tok/s) -> {d['fraction_of_bound']:.2%} of the bound")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["offline", "decode", "all"], default="all")
    ap.add_argument("--workloads", default="a,b", help="offline: a subset of a,b (default both)")
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu only to try the script out")
    ap.add_argument("--model", default="small", help="a built-in model (tiny, small); default small")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 (the engine's default on CUDA), float16 or float32")
    ap.add_argument("--attention-backend", default="auto", help="auto (flash when a build imports), torch, flash")
    ap.add_argument("--kv-cache-gib", type=float, default=4.0, help="the engine's KV cache for --part offline")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per engine and workload (median)")
    ap.add_argument("--skip-hf", action="store_true", help="offline: pdcluster only")
    ap.add_argument("--json", default=None, help="also write all numbers to this JSON file")
    args = ap.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in args.workloads:
        make_workload(w)                             # validates the names before any work
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"bench_gpu.py: torch {torch.__version__} sees no CUDA GPU here; nothing to measure", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"CPU ({args.device})"
    r: dict = {"env": {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
                       "python": platform.python_version()},
               "model": args.model, "dtype": args.dtype}
    print(f"bench_gpu | {r['env']['gpu']} | torch {r['env']['torch']} (CUDA {r['env']['cuda']}) | "
          f"{args.model} {args.dtype}", flush=True)
    with tempfile.TemporaryDirectory(prefix="pdbench-gpu-") as tmp:
        ckpt = export_builtin(args.model, Path(tmp) / args.model)
        if args.part in ("offline", "all"):
            t0 = time.perf_counter()
            r["offline"] = offline(args, ckpt)
            r["offline"]["wall_s"] = time.perf_counter() - t0
        if args.part in ("decode", "all"):
            t0 = time.perf_counter()
            r["decode"] = decode(args, ckpt)
            r["decode"]["wall_s"] = time.perf_counter() - t0
    report(r)
    write_json(args.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
