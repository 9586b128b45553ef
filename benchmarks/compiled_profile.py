"""Where a compiled training step's time goes, GPU or host, native against patched, on one GPU.

    python -m benchmarks.compiled_profile [--model llama-small] [--shape 2x1024]
        [--impls native_compiled,liger_compat_compiled,...] [--steps 30] [--out DIR]

Each implementation (``benchmarks.e2e``'s: the model in ``torch.compile(model)``, default mode,
or under a setting of ours) runs in its own fresh process: warm-up steps (compilation), then

- the step: median wall time of synchronised steps (forward with labels, backward, fused AdamW);
- the host: median time to enqueue one whole step with the GPU drained before it and no
  synchronisation inside (what the Python, dynamo guards and launches cost, whatever the GPU does);
- the GPU: a ``torch.profiler`` trace of a few steps: the kernels' own time per step (one stream:
  their sum is the GPU's busy time), launches per step and the kernels taking the most time, and
  where the GPU idles, by the host code whose launch ended each idle stretch (``benchmarks.gpu_gaps``).

A step whose wall time is well above its GPU time is host-bound: its host column says by how much.
Writes ``<name>.json`` and ``<name>.md`` under ``--out``, naming the command that regenerates them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from . import _results, gpu_gaps

DEFAULT_IMPLS = ("native_compiled", "liger_compat_compiled", "liger_compat_keep_compiled",
                 "liger_compat_flce_compiled", "liger_compat_noflce_compiled", "liger_compat_shims_compiled")


def _step(run, opt, ids, labels, cudagraphs=False):
    if cudagraphs:
        import torch

        torch.compiler.cudagraph_mark_step_begin()
    out = run(input_ids=ids, labels=labels)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out


def _phases(run, opt, ids, labels, cg, steps):
    """Median host time of the forward call, the backward call and the optimizer step, the GPU
    drained before each step and nothing synchronised inside it."""
    import torch

    out: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    for _ in range(steps):
        torch.cuda.synchronize()
        if cg:
            torch.compiler.cudagraph_mark_step_begin()
        t0 = time.perf_counter()
        res = run(input_ids=ids, labels=labels)
        t1 = time.perf_counter()
        res.loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        for k, a, b in (("forward", t0, t1), ("backward", t1, t2), ("optimizer", t2, t3)):
            out[k].append((b - a) * 1e3)
    torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in out.items()}


def _syncs(run, opt, ids, labels, cg) -> list[str]:
    """The host syncs of one step (``torch.cuda.set_sync_debug_mode``), each with the innermost
    frames of the stack that made it."""
    with _results.SyncSites() as rec:
        _step(run, opt, ids, labels, cg)
    return rec.found


def _cprofile(run, opt, ids, labels, cg, steps: int) -> list[dict]:
    """The functions with the most own host time over ``steps`` steps (cProfile)."""
    import cProfile
    import pstats

    import torch

    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        _step(run, opt, ids, labels, cg)
    pr.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(pr)
    rows = []
    for (fn, line, name), (cc, nc, tt, ct, _callers) in st.stats.items():
        rows.append({"function": f"{fn.split('site-packages/')[-1]}:{line} {name}", "calls_per_step": nc / steps,
                     "own_ms_per_step": tt / steps * 1e3, "cum_ms_per_step": ct / steps * 1e3})
    return sorted(rows, key=lambda r: -r["own_ms_per_step"])[:25]


def _kernel_name(name: str) -> str:
    return name if len(name) <= 90 else name[:87] + "..."


def one(model: str, shape: str, impl: str, steps: int, warmup: int, prof_steps: int) -> dict:
    """One implementation in this process (call it in a fresh one)."""
    from .e2e import setup, step_model

    model_, opt, ids, labels = setup(model, shape, impl)
    import torch
    from torch.autograd import DeviceType

    from .e2e import REDUCE_OVERHEAD

    run = step_model(model_, impl)
    cg = impl in REDUCE_OVERHEAD
    for _ in range(warmup):
        _step(run, opt, ids, labels, cg)
    torch.cuda.synchronize()
    walls, hosts = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _step(run, opt, ids, labels, cg)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        hosts.append(t1 - t0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(prof_steps):
            _step(run, opt, ids, labels, cg)
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    launches = 0
    for e in prof.events():
        # kernels, copies and sets on the GPU; not the GPU-side ranges of record_function annotations
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            per_kernel[_kernel_name(e.name)] += e.time_range.elapsed_us()
            launches += 1
    busy = sum(per_kernel.values()) / prof_steps / 1e3
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
    # where the GPU idles, by the host code it waited for
    idle_text, idle = gpu_gaps.summarize(gpu_gaps.from_profiler(prof), prof_steps, rows=12)
    phases = _phases(run, opt, ids, labels, cg, steps)
    syncs = _syncs(run, opt, ids, labels, cg)
    hot = _cprofile(run, opt, ids, labels, cg, steps=10)
    return {"phases_ms": phases, "syncs": syncs, "cprofile": hot, "model": model, "shape": shape, "impl": impl, "status": "ok",
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
            "step_ms": statistics.median(walls) * 1e3, "host_ms": statistics.median(hosts) * 1e3,
            "gpu_busy_ms": busy, "launches_per_step": launches / prof_steps, "idle": idle, "idle_text": idle_text,
            "top_kernels": [{"kernel": k, "ms_per_step": v / prof_steps / 1e3} for k, v in top]}


def _markdown(rows: list[dict], cmd: str) -> str:
    ok = [r for r in rows if r.get("status") == "ok"]
    head = ok[0] if ok else {}
    lines = [f"regenerate: `{cmd}`", "", "# A compiled step's time: GPU busy against host enqueue", "",
             f"GPU: {head.get('gpu', '?')}; torch {head.get('torch', '?')}", "",
             "Each implementation in a fresh process. step: median synchronised step; host: median time to "
             "enqueue a step with the GPU drained before it; GPU busy: the kernels' own time per step "
             "(torch.profiler, one stream); idle: step less GPU busy.", "",
             "| model | batch x seq | impl | step ms | host ms | GPU busy ms | GPU idle ms | launches / step |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['model']} | {r['shape']} | {r['impl']} | {r.get('status')} | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['shape']} | {r['impl']} | {r['step_ms']:.2f} | {r['host_ms']:.2f} | "
                     f"{r['gpu_busy_ms']:.2f} | {r['step_ms'] - r['gpu_busy_ms']:.2f} | "
                     f"{r['launches_per_step']:.0f} |")
    for r in ok:
        lines += ["", f"## {r['impl']}: kernels taking the most GPU time", "", "| kernel | ms / step |", "|---|---:|"]
        lines += [f"| `{k['kernel']}` | {k['ms_per_step']:.3f} |" for k in r["top_kernels"]]
        ph = r["phases_ms"]
        lines += ["", f"host ms per step: forward call {ph['forward']:.2f}, backward call {ph['backward']:.2f}, "
                  f"optimizer {ph['optimizer']:.2f}; host syncs in one step: {len(r['syncs'])}"]
        lines += [f"- sync: `{x}`" for x in r["syncs"]]
        if r.get("idle_text"):
            lines += ["", r["idle_text"]]
        lines += ["", "| function (cProfile, most own time) | calls / step | own ms / step | cum ms / step |",
                  "|---|---:|---:|---:|"]
        lines += [f"| `{c['function']}` | {c['calls_per_step']:.0f} | {c['own_ms_per_step']:.3f} | "
                  f"{c['cum_ms_per_step']:.3f} |" for c in r["cprofile"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--shape", default="2x1024")
    ap.add_argument("--impls", default=",".join(DEFAULT_IMPLS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--prof-steps", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--name", default="compiled_profile")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print("RESULT " + json.dumps(one(a.model, a.shape, a.one, a.steps, a.warmup, a.prof_steps)))
        return 0
    from .e2e import IMPLS

    impls = a.impls.split(",")
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        ap.error(f"--impls: unknown {bad}; choose from {', '.join(IMPLS)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python -m benchmarks.compiled_profile " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in (("model", a.model), ("shape", a.shape), ("impls", a.impls),
                                                     ("steps", a.steps), ("warmup", a.warmup),
                                                     ("prof_steps", a.prof_steps)))
    if a.name != "compiled_profile":
        cmd += f" --name {a.name}"
    rows = []
    for impl in impls:
        t0 = time.time()
        p = subprocess.run([sys.executable, "-m", "benchmarks.compiled_profile", "--one", impl, "--model", a.model,
                            "--shape", a.shape, "--steps", str(a.steps), "--warmup", str(a.warmup),
                            "--prof-steps", str(a.prof_steps)], capture_output=True, text=True)
        res = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        row = json.loads(res[-1][7:]) if res else {"model": a.model, "shape": a.shape, "impl": impl,
                                                    "status": f"failed (rc {p.returncode})",
                                                    "stderr": p.stderr[-3000:]}
        rows.append(row)
        print(f"{impl}: {row.get('status')} {row.get('step_ms', 0):.2f} ms step, {row.get('host_ms', 0):.2f} ms host, "
              f"{row.get('gpu_busy_ms', 0):.2f} ms GPU ({time.time() - t0:.0f} s)", flush=True)
        if row.get("status") != "ok":
            print(row.get("stderr", ""), flush=True)
        (out / f"{a.name}.json").write_text(json.dumps({"regenerate": cmd, "rows": rows}, indent=1))
        (out / f"{a.name}.md").write_text(_markdown(rows, cmd))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
