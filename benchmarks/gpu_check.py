#!/usr/bin/env python3
"""GPU checks on one CUDA GPU, in one command and under 10 minutes: `make gpu-check`.

    make gpu-check                                   # or: python3 benchmarks/gpu_check.py
    make gpu-check GPU_PYTHON=/path/to/python        # the Python whose torch is a CUDA build
    python3 benchmarks/gpu_check.py --out DIR --budget-s 570 [--strict] [--verbose] [--only nccl,engine]

What it runs, each part in its own process under its own time limit (seconds), in this order:

  part           limit  what
  gpu               90  nvidia-smi -L; the Python's torch, CUDA, devices, NCCL, flash builds
  nccl             150  tests/test_cuda_nccl.py: the NCCL KV transport between two processes
                        (exact blocks, fp32 and bf16, against the Gloo path; one group per pair;
                        refusals; a sender stalled mid-payload against the receiver's deadline;
                        a sender killed mid-transfer)
  engine           120  tests/test_cuda_engine.py -k "not flash": the engine on CUDA against
                        transformers, torch backend, fp32 (chunked prefill on paged context,
                        swap preemption, prefix hits) and bf16
  flash             90  tests/test_cuda_engine.py -k flash: the flash kernel against a plain-torch
                        model of it, the flash backend against transformers as close as the torch
                        backend, `auto`'s choice, the flash path's metadata
  bench-kv          90  benchmarks/bench_kv_transfer.py --device cuda: KV handoff over NCCL
                        beside the GPU's device-to-device memcpy
  bench-offline    120  benchmarks/bench_gpu.py --part offline: `small` on the GPU, workloads a
                        and b, beside HF generate on the same GPU; one decode step's anatomy
  bench-decode      60  benchmarks/bench_gpu.py --part decode: batch-1 decode beside the HBM
                        bandwidth bound

The parts together may take at most --budget-s (570 s by default, so that a run fits a 10-minute
limit on one command); a part gets no more than what is left (healthy, they should take a few
minutes together). Logs, pytest's JUnit XML, the benchmarks' JSON and summary.json go to
out/gpu-check/ (git ignores out/). The summary prints pass/fail per part; the exit status is 0 when every part
passed, 1 when one failed, timed out or did not run, 2 when there is no CUDA GPU to check (said
in a few lines, no traceback). A part whose tests were skipped (the flash kernel tests without a
flash-attn build) passes with the skip and its reason in the summary; --strict fails it.

No .venv is needed: `make setup` installs torch's CPU wheel, so this takes the first Python whose
torch sees a GPU: --python (GPU_PYTHON), else .venv/bin/python, else python3. That Python needs
numpy, msgpack, safetensors, tokenizers, transformers and pytest (pytest-timeout helps); not Ray.

On one GPU, the NCCL parts run both processes on it: NCCL refuses two ranks on one GPU of one
host, so each process gets its own NCCL_HOSTID and NCCL moves the bytes through its socket
transport over loopback. That checks the transport's code path, not the link's speed.

What awaits two or more GPUs (not checked by this script on one):
  - the NCCL handoff between two GPUs over NVLink/PCIe (the nccl tests and bench-kv switch to
    cuda:0 -> cuda:1 by themselves when two GPUs are visible, so the same command covers it);
  - a served disaggregated cluster on GPUs (`pdcluster serve --device cuda`, one GPU per worker
    through Ray; it also needs Ray, which this script does not use);
  - tensor parallelism over NCCL (`--tensor-parallel-size 2`: a rank per GPU in a STRICT_PACK
    placement group, the all-reduce over NCCL): `tests/test_tensor_parallel.py` runs it on CPU
    with Gloo; on GPUs, `pdcluster generate --device cuda --tensor-parallel-size 2` against
    `--tensor-parallel-size 1` is the check. The handoff of a tensor-parallel worker's KV
    between GPUs is not built yet (a transfer per rank).

Status: written without a GPU; it has not yet been run on one (see BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUDGET_S = 570
NEEDED = ("numpy", "msgpack", "safetensors", "tokenizers")        # the engine and the transport

PROBE = r'''
import json, sys
info = {"python": sys.version.split()[0], "executable": sys.executable}
try:
    import torch
except Exception as e:
    info["error"] = "no torch (%s: %s)" % (type(e).__name__, e)
    print(json.dumps(info)); sys.exit(0)
info.update(torch=torch.__version__, cuda_build=torch.version.cuda, devices=[])
try:
    info["cuda_available"] = bool(torch.cuda.is_available())
except Exception as e:
    info["cuda_available"], info["error"] = False, "torch.cuda: %s" % e
if info["cuda_available"]:
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        info["devices"].append({"name": p.name, "capability": "%d.%d" % (p.major, p.minor),
                                "memory_GiB": round(p.total_memory / 2**30, 1),
                                "multiprocessors": p.multi_processor_count})
    try:
        v = torch.cuda.nccl.version()
        info["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:
        info["nccl_version"] = None
try:
    import torch.distributed as dist
    info["nccl_available"] = bool(dist.is_available() and dist.is_nccl_available())
except Exception:
    info["nccl_available"] = False
info["flash"] = {}
for mod in ("vllm_flash_attn", "flash_attn"):
    try:
        info["flash"][mod] = getattr(__import__(mod), "__version__", "?")
    except Exception:
        info["flash"][mod] = None
info["modules"] = {}
for mod in ("numpy", "msgpack", "safetensors", "tokenizers", "transformers", "pytest", "pytest_timeout"):
    try:
        info["modules"][mod] = getattr(__import__(mod), "__version__", "?")
    except Exception:
        info["modules"][mod] = None
print(json.dumps(info))
'''


@dataclass
class Part:
    name: str
    what: str
    timeout_s: int
    kind: str                              # pytest | bench
    args: list[str]
    needs: tuple[str, ...] = ()
    skips_expected: bool = False           # skipped tests are a finding, not a failure (unless --strict)
    json_out: str | None = None
    result: dict = field(default_factory=dict)


def parts(out: Path) -> list[Part]:
    pytest_needs = NEEDED + ("pytest",)
    return [
        Part("nccl", "NCCL KV transport, two processes", 150, "pytest", ["tests/test_cuda_nccl.py"], pytest_needs),
        Part("engine", "engine on CUDA vs transformers (torch backend, fp32 + bf16)", 120, "pytest",
             ["tests/test_cuda_engine.py", "-k", "not flash"], pytest_needs + ("transformers",)),
        Part("flash", "flash-attention backend vs reference and transformers", 90, "pytest",
             ["tests/test_cuda_engine.py", "-k", "flash"], pytest_needs + ("transformers",), skips_expected=True),
        Part("bench-kv", "KV handoff over NCCL vs device memcpy", 90, "bench",
             ["benchmarks/bench_kv_transfer.py", "--device", "cuda", "--dtype", "bfloat16", "--iters", "5",
              "--json", str(out / "kv_transfer.json")], NEEDED, json_out="kv_transfer.json"),
        Part("bench-offline", "offline throughput, small on the GPU vs HF generate", 120, "bench",
             ["benchmarks/bench_gpu.py", "--part", "offline", "--json", str(out / "offline.json")],
             NEEDED + ("transformers",), json_out="offline.json"),
        Part("bench-decode", "batch-1 decode vs the HBM bandwidth bound", 60, "bench",
             ["benchmarks/bench_gpu.py", "--part", "decode", "--json", str(out / "decode.json")], NEEDED,
             json_out="decode.json"),
    ]


# -- finding a Python whose torch sees a GPU ----------------------------------------------------------
def probe(python: str) -> dict:
    try:
        p = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=90, cwd=ROOT)
    except FileNotFoundError:
        return {"executable": python, "error": "not found"}
    except subprocess.TimeoutExpired:
        return {"executable": python, "error": "did not answer within 90 s (importing torch)"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return {"executable": python, "error": f"exit {p.returncode}: {tail}"}
    return json.loads(lines[-1])


def describe_probe(info: dict) -> str:
    if "error" in info and "torch" not in info:
        return info["error"]
    torch_v = info.get("torch", "?")
    if not info.get("cuda_build"):
        return f"torch {torch_v}, a CPU-only build (make setup installs the CPU wheel)"
    if not info.get("cuda_available"):
        return f"torch {torch_v} (CUDA {info['cuda_build']}) sees no GPU" + (f": {info['error']}" if "error" in info else "")
    devs = ", ".join(f"{d['name']} (sm{d['capability'].replace('.', '')}, {d['memory_GiB']} GiB)" for d in info["devices"])
    return f"torch {torch_v} (CUDA {info['cuda_build']}), {len(info['devices'])} GPU(s): {devs}"


def candidates(explicit: str | None) -> list[str]:
    if explicit:
        return [explicit]
    found = []
    venv = ROOT / ".venv" / "bin" / "python"
    if venv.exists():
        found.append(str(venv))
    for name in ("python3", sys.executable):
        path = shutil.which(name) or name
        if path not in found:
            found.append(path)
    return found


def nvidia_smi() -> str:
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi: not found"
    try:
        p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "nvidia-smi -L: no answer within 30 s"
    return (p.stdout.strip() or p.stderr.strip() or f"nvidia-smi -L: exit {p.returncode}, no output")


# -- running one part ------------------------------------------------------------------------------
def run_logged(cmd: list[str], log: Path, timeout_s: float, env: dict, echo: bool) -> tuple[int | None, float]:
    """Run cmd in its own session, its output into `log` (and on the console with echo); at the
    limit the whole session is ended. (exit status or None when it timed out, seconds)."""
    t0 = time.monotonic()
    with open(log, "w", buffering=1) as f:
        f.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, text=True, errors="replace")

        def pump():
            for line in proc.stdout:
                f.write(line)
                if echo:
                    sys.stdout.write("    " + line)
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            _end_session(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        _end_session(proc, signal.SIGKILL)        # stragglers it started (spawned children)
        proc.wait()
        reader.join(5)
        if rc is None:
            f.write(f"\n[gpu-check] stopped at its limit of {timeout_s:.0f} s\n")
    return rc, time.monotonic() - t0


def _end_session(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)                  # the session this script started for the part
    except (ProcessLookupError, PermissionError):
        pass


def junit_counts(xml: Path) -> dict | None:
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    c = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in c:
            c[k] += int(s.get(k, 0))
    c["passed"] = c["tests"] - c["failures"] - c["errors"] - c["skipped"]
    reasons: dict[str, int] = {}
    failed = []
    for case in root.iter("testcase"):
        for sk in case.findall("skipped"):
            msg = (sk.get("message") or "").removeprefix("Skipped: ")
            reasons[msg] = reasons.get(msg, 0) + 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(case.get("name"))
    c["skip_reasons"] = reasons
    c["failed_tests"] = failed
    return c


def tail(log: Path, n: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def bench_detail(part: Part, out: Path) -> str:
    try:
        d = json.loads((out / part.json_out).read_text())
    except (OSError, ValueError, TypeError):
        return "no JSON written"
    try:
        if part.name == "bench-kv":
            rows = [r for r in d["rows"] if r.get("bytes")]
            big = max(rows, key=lambda r: r["bytes"])
            rtt = min(r["latency_ms"] for r in d["rows"] if not r.get("bytes"))
            return (f"{big['layout']} {big['tokens']} tokens ({big['bytes'] / 2**20:.0f} MiB): {big['GBps']:.2f} GB/s = "
                    f"{big['fraction_of_memcpy']:.1%} of memcpy {d['memcpy_GBps']:.0f} GB/s; header round trip "
                    f"{rtt:.2f} ms; {d['link'].split(' (')[0]}")
        if part.name == "bench-offline":
            o = d["offline"]
            bits = []
            for w, x in o["workloads"].items():
                s = f"{w}: {x['pdcluster']['tok_s']:.0f} tok/s"
                if "hf" in x:
                    s += f" vs HF {x['hf']['tok_s']:.0f} ({x['pdcluster_over_hf']:.2f}x)"
                bits.append(s)
            an = o["step_anatomy"]
            bits.append(f"64-seq decode step {an['wall']['p50_ms']:.1f} ms, overhead {an['overhead']['p50_ms']:.1f} ms")
            return f"{d['model']} {d['dtype']} {o['attention_backend']}: " + "; ".join(bits)
        if part.name == "bench-decode":
            x = d["decode"]
            return (f"{x['tok_s']:.0f} tok/s = {x['fraction_of_bound']:.2%} of the bound {x['bound_tok_s']:.0f} tok/s "
                    f"(copy {x['bandwidth_GBps']['copy_read_write']:.0f} GB/s r+w, "
                    f"{x['weight_bytes_per_step'] / 1e6:.0f} MB a step)")
    except (KeyError, ValueError, TypeError) as e:
        return f"JSON without the expected fields ({e})"
    return ""


def run_part(part: Part, python: str, info: dict, out: Path, limit_s: float, args) -> dict:
    log = out / f"{part.name}.log"
    missing = [m for m in part.needs if not info["modules"].get(m)]
    if missing:
        return {"status": "fail", "detail": f"{python} lacks {', '.join(missing)}: install them there (or carry "
                                            "wheels) and run again", "seconds": 0.0, "log": None}
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    if part.kind == "pytest":
        xml = out / f"{part.name}.xml"
        cmd = [python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}", *part.args]
        if info["modules"].get("pytest_timeout"):
            cmd += ["-o", f"timeout={max(30, int(limit_s) - 20)}"]
    else:
        cmd = [python, *part.args]
    rc, seconds = run_logged(cmd, log, limit_s, env, args.verbose)
    res = {"status": "pass", "detail": "", "seconds": round(seconds, 1), "log": str(log), "exit": rc}
    if rc is None:
        res.update(status="timeout", detail=f"stopped at its limit of {limit_s:.0f} s")
        return res
    if part.kind == "pytest":
        c = junit_counts(out / f"{part.name}.xml")
        res["tests"] = c
        if c is None:
            res.update(status="fail", detail=f"pytest exit {rc}, no JUnit report")
        elif rc != 0 or c["failures"] or c["errors"] or c["tests"] == 0:
            failed = ", ".join(c["failed_tests"][:6]) or ("no tests collected" if c["tests"] == 0 else f"exit {rc}")
            res.update(status="fail", detail=f"{c['passed']} passed, {c['failures'] + c['errors']} failed: {failed}")
        else:
            res["detail"] = f"{c['passed']} passed" + (f", {c['skipped']} skipped" if c["skipped"] else "")
            if c["skipped"]:
                why = "; ".join(f"{n}x {m}" for m, n in c["skip_reasons"].items())
                res["detail"] += f" ({why})"
                if not part.skips_expected or args.strict:
                    res["status"] = "fail"
                    res["detail"] += " - skipped although a GPU is here" if not part.skips_expected else " - --strict"
                else:
                    res["status"] = "pass, skips"
    else:
        if rc != 0:
            res.update(status="fail", detail=f"exit {rc}")
        else:
            res["detail"] = bench_detail(part, out)
    return res


# -- main ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="GPU checks on one CUDA GPU (see this file's docstring).")
    ap.add_argument("--python", default=os.environ.get("GPU_PYTHON") or None,
                    help="the Python to run the parts with (default: .venv/bin/python, else python3, "
                         "whichever's torch sees a GPU)")
    ap.add_argument("--out", default=str(ROOT / "out" / "gpu-check"), help="where logs and JSON go")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="all parts together, seconds")
    ap.add_argument("--only", default="", help="comma-separated part names (default: all)")
    ap.add_argument("--strict", action="store_true", help="a part with skipped tests fails")
    ap.add_argument("--verbose", action="store_true", help="stream each part's output to the console")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    plan = parts(out)
    if args.only:
        wanted = {w.strip() for w in args.only.split(",") if w.strip()}
        unknown = wanted - {p.name for p in plan}
        if unknown:
            print(f"gpu-check: unknown part(s) {', '.join(sorted(unknown))}; parts: "
                  f"{', '.join(p.name for p in plan)}", file=sys.stderr)
            return 1
        plan = [p for p in plan if p.name in wanted]
    for p in plan:                                # no stale results from an earlier run
        for name in (f"{p.name}.log", f"{p.name}.xml", p.json_out):
            if name:
                (out / name).unlink(missing_ok=True)

    smi = nvidia_smi()
    tried = []
    chosen, info = None, None
    for py in candidates(args.python):
        i = probe(py)
        tried.append((py, i))
        if i.get("cuda_available") and i.get("devices"):
            chosen, info = py, i
            break
    summary: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "nvidia_smi": smi,
                     "pythons_tried": [{"python": py, "probe": i} for py, i in tried], "parts": {}}
    if chosen is None:
        print("gpu-check: no CUDA GPU to check on this machine; nothing was run.")
        print(f"  {smi.splitlines()[0] if smi else 'nvidia-smi: no output'}")
        for py, i in tried:
            print(f"  {py}: {describe_probe(i)}")
        print("  Run it where nvidia-smi -L lists a GPU, with a Python whose torch is a CUDA build:\n"
              "    make gpu-check GPU_PYTHON=/path/to/python")
        summary["exit"] = 2
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        return 2

    summary.update(python=chosen, probe=info)
    print(f"gpu-check: {describe_probe(info)}")
    print(f"  python {chosen} ({info['python']}); NCCL {info.get('nccl_version') or 'unavailable'}; flash builds: "
          + (", ".join(f"{k} {v}" for k, v in info["flash"].items() if v) or "none"))
    for line in smi.splitlines():
        print(f"  {line}")
    if len(info["devices"]) < 2:
        print("  one GPU: the NCCL parts run both processes on it (NCCL_HOSTID per process, sockets over loopback)")
    print(f"  logs and JSON: {out}; budget {args.budget_s:.0f} s\n")

    failed = False
    for part in plan:
        left = args.budget_s - (time.monotonic() - t_start)
        if left < 30:
            res = {"status": "not run", "detail": f"the budget of {args.budget_s:.0f} s was spent", "seconds": 0.0}
        else:
            limit = min(part.timeout_s, left - 5)
            print(f"[{part.name}] {part.what} (limit {limit:.0f} s) ...", flush=True)
            res = run_part(part, chosen, info, out, limit, args)
        res["limit_s"] = part.timeout_s
        summary["parts"][part.name] = {"what": part.what, **res}
        print(f"[{part.name}] {res['status'].upper()} in {res['seconds']:.0f} s: {res['detail']}", flush=True)
        if res["status"] not in ("pass", "pass, skips"):
            failed = True
            if res.get("log"):
                print("    " + tail(Path(res["log"])).replace("\n", "\n    "))

    total = time.monotonic() - t_start
    ndev = len(info["devices"])
    print(f"\n=== gpu-check summary ({total:.0f} s; {info['devices'][0]['name']}{f' x{ndev}' if ndev > 1 else ''}) ===")
    for name, res in summary["parts"].items():
        print(f"  {name:14s} {res['status'].upper():12s} {res['seconds']:5.0f} s / {res['limit_s']:3d} s  {res['detail']}")
    print("  not checked on one GPU: the NCCL handoff across two GPUs (the same command does it where two are"
          " visible), a served cluster on GPUs (needs Ray) and tensor parallelism over NCCL (needs two GPUs)")
    summary["seconds"] = round(total, 1)
    summary["exit"] = 1 if failed else 0
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"  written: {out / 'summary.json'}")
    return summary["exit"]


if __name__ == "__main__":
    sys.exit(main())
