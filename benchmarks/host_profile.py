"""Where the host time of a small training step goes, native against patched, on one GPU.

    python -m benchmarks.host_profile [--families llama,deepseek_v2] [--steps 30] [--out DIR]

Per family, at ``benchmarks.models_gpu``'s host-bound shape (2 layers, hidden 1024, vocabulary
128256, 2 x 1024 tokens, bf16, SDPA): one model, native (``liger_compat.revert()``) and patched
steps (forward with labels + backward) alternating in batches, CUDA-event timing; then, for each
side, the host's own time per step (``time.perf_counter`` around the step with no synchronisation
inside it, the GPU drained before and after: what the Python and launch code cost, whatever the
GPU does), a ``cProfile`` of the patched steps (top functions by own time), and a
``torch.profiler`` table of each side (top operators by self CPU time and, on the GPU, by their
kernels' own GPU time, with its total per step: where a GPU-bound step's time goes; host syncs per
step); and the garbage collector's part: collections per step and the times with it off.
Writes ``host_profile_<family>.txt`` and ``host_profile.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import liger_compat

from . import _results
from .models_gpu import batch, make_model, timed

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense",
            "aten::nonzero", "aten::equal", "aten::masked_select")


def _args(ns: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(layers=ns.layers, hidden=ns.hidden, vocab=ns.vocab, batch=ns.batch, seq=ns.seq,
                              intermediate=0, device=ns.device)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _step(model, kw, labels):
    model.zero_grad(set_to_none=True)
    model(**kw, labels=labels, use_cache=False).loss.backward()


def _gpu_ms(model, kw, labels, steps: int) -> float:
    if not labels.is_cuda:
        return _host_ms(model, kw, labels, steps)
    return timed(model, kw, labels, steps, warmup=0)


def _host_ms(model, kw, labels, steps: int) -> float:
    times = []
    for _ in range(steps):
        _sync()
        t0 = time.perf_counter()
        _step(model, kw, labels)
        times.append((time.perf_counter() - t0) * 1e3)
    _sync()
    return statistics.median(times)


def _torch_profile(model, kw, labels, steps: int) -> tuple[str, dict]:
    from torch.profiler import ProfilerActivity, profile

    _sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if labels.is_cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            _step(model, kw, labels)
        _sync()
    avg = prof.key_averages()
    syncs = {e.key: e.count / steps for e in avg if e.key in SYNC_OPS and e.count}
    table = avg.table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=60)
    gpu_ms = None
    if labels.is_cuda:  # where a GPU-bound step's time goes: its kernels by their own GPU time
        attr = "self_device_time_total" if hasattr(avg[0], "self_device_time_total") else "self_cuda_time_total"
        gpu_ms = sum(getattr(e, attr, 0) for e in avg if e.device_type.name == "CPU") / steps / 1e3
        table += "\n\nby GPU time:\n" + avg.table(sort_by=attr, row_limit=40, max_name_column_width=60)
    return table, syncs, gpu_ms


def _interleaved(model, kw, labels, sides: dict, rounds: int, steps: int) -> tuple[dict, dict]:
    """Per side, the median step (CUDA events) and host milliseconds over ``rounds`` rounds of
    ``steps`` steps, native and patched alternating, the order reversed every other round."""
    gpu: dict[str, list[float]] = {s: [] for s in sides}
    host: dict[str, list[float]] = {s: [] for s in sides}
    for r in range(rounds):
        for side in (("native", "patched") if r % 2 == 0 else ("patched", "native")):
            sides[side]()
            gpu[side].append(_gpu_ms(model, kw, labels, steps))
            host[side].append(_host_ms(model, kw, labels, steps))
    return ({s: statistics.median(v) for s, v in gpu.items()}, {s: statistics.median(v) for s, v in host.items()})


def _gc_effect(model, kw, labels, sides: dict, steps: int) -> dict:
    """Python's garbage collector per side: collections per step of each generation (counted over
    ``steps`` steps), and the step and host times with the collector off (two interleaved rounds,
    medians): how much of a host-bound step's difference is the collector's pauses."""
    out: dict = {}
    for side, switch in sides.items():
        switch()
        gc.collect()
        before = [st["collections"] for st in gc.get_stats()]
        _host_ms(model, kw, labels, steps)
        after = [st["collections"] for st in gc.get_stats()]
        out[f"gc_per_step_{side}"] = [round((a - b) / steps, 3) for a, b in zip(after, before)]
    gc.collect()
    gc.disable()
    try:
        step, host = _interleaved(model, kw, labels, sides, 2, steps)
    finally:
        gc.enable()
    for side in sides:
        out[f"step_ms_nogc_{side}"] = step[side]
        out[f"host_ms_nogc_{side}"] = host[side]
    return out


def warm_model(family: str, ns: argparse.Namespace) -> tuple:
    """``(model, inputs, labels, sides)``: ``family`` in bf16 at the shape ``ns`` names (layers,
    hidden, vocab, batch, seq, device), its inputs, and ``sides`` (``native`` / ``patched`` to the
    function that switches liger_compat to it), after 4 warm-up steps a side (kernels compile,
    caches fill)."""
    args = _args(ns)
    model = make_model(family, args, torch.bfloat16)
    kw, labels = batch(model, args, family)
    kw = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in kw.items()}
    sides = {"native": liger_compat.revert, "patched": liger_compat.apply}
    for switch in sides.values():
        switch()
        for _ in range(4):
            _step(model, kw, labels)
    return model, kw, labels, sides


def _profiled(fn, steps: int) -> cProfile.Profile:
    """A ``cProfile`` of ``steps`` calls of ``fn``, the GPU drained before and after."""
    pr = cProfile.Profile()
    _sync()
    pr.enable()
    for _ in range(steps):
        fn()
    pr.disable()
    _sync()
    return pr


def profile_family(family: str, ns: argparse.Namespace) -> tuple[dict, str]:
    model, kw, labels, sides = warm_model(family, ns)
    gpu, host = _interleaved(model, kw, labels, sides, ns.rounds, ns.steps)
    row = {"family": family, "shape": f"{ns.batch}x{ns.seq}",
           **{f"step_ms_{s}": v for s, v in gpu.items()},
           **{f"host_ms_{s}": v for s, v in host.items()}}
    row["ratio"] = row["step_ms_patched"] / row["step_ms_native"]
    row.update(_gc_effect(model, kw, labels, sides, ns.steps))
    text = [f"{family} {row['shape']}: step ms native {row['step_ms_native']:.2f} patched {row['step_ms_patched']:.2f} "
            f"(ratio {row['ratio']:.3f}); host ms per step (no sync inside) native {row['host_ms_native']:.2f} "
            f"patched {row['host_ms_patched']:.2f}", ""]
    liger_compat.apply()
    step = lambda: _step(model, kw, labels)  # noqa: E731
    forward = lambda: model(**kw, labels=labels, use_cache=False)  # noqa: E731
    pr = _profiled(step, ns.steps)
    if ns.dump:
        # the forwards alone too, and the native side's (a shim's functions beside the module
        # forwards they replace): <name>_<family>[_forward][_native].pstats
        dumps = {"": pr, "_forward": _profiled(forward, ns.steps)}
        liger_compat.revert()
        dumps["_forward_native"] = _profiled(forward, ns.steps)
        dumps["_native"] = _profiled(step, ns.steps)
        liger_compat.apply()
        for suffix, prof in dumps.items():
            prof.dump_stats(str(Path(ns.out) / f"{ns.name}_{family}{suffix}.pstats"))
    for key in ("tottime", "cumulative"):
        text += [f"## cProfile of {ns.steps} patched steps, by {key}", _results.profile_text(pr, key, 45)]
    for side, switch in sides.items():
        switch()
        table, syncs, gpu_ms = _torch_profile(model, kw, labels, 5)
        row[f"syncs_{side}"] = syncs
        row[f"gpu_ms_{side}"] = gpu_ms
        kernels = "" if gpu_ms is None else f"; GPU time of its kernels per step {gpu_ms:.2f} ms"
        text += [f"## torch.profiler, {side}, 5 steps; host syncs per step: {syncs}{kernels}", table, ""]
    liger_compat.apply()
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row, "\n".join(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="llama,deepseek_v2,mllama_text")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (tiny sizes advised)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="host_profile")
    ap.add_argument("--dump", action="store_true", help="also write the cProfile data (.pstats) of the steps and of the "
                    "forwards alone, patched (<name>_<family>[_forward].pstats) and native (..._native.pstats)")
    ns = ap.parse_args(argv)
    if ns.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    liger_compat.apply()
    import transformers

    meta = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__,
                transformers=transformers.__version__, rounds=ns.rounds, steps=ns.steps, layers=ns.layers,
                hidden=ns.hidden, vocab=ns.vocab)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for family in [f for f in ns.families.split(",") if f]:
        try:
            row, text = profile_family(family, ns)
        except Exception as exc:  # one family failing must not hide the others
            row, text = {"family": family, "error": f"{type(exc).__name__}: {exc}"}, ""
        print(json.dumps(row), flush=True)
        rows.append(row)
        cmd = _results.command("benchmarks.host_profile", sys.argv[1:] if argv is None else argv)
        if text:
            (out / f"{ns.name}_{family}.txt").write_text(_results.md_line(cmd) + text)
        (out / f"{ns.name}.json").write_text(json.dumps({"regenerate": cmd, "meta": meta, "rows": rows}, indent=2))
        (out / f"{ns.name}.md").write_text(_results.md_line(cmd) + _markdown(rows, meta))
    return 0


def _markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"A small training step's time and host time, native and patched in one process ({meta['rounds']} "
             f"interleaved rounds of {meta['steps']} steps, medians); {meta['gpu']}, torch {meta['torch']}, "
             f"transformers {meta['transformers']}; {meta['layers']} layers, hidden {meta['hidden']}, vocabulary "
             f"{meta['vocab']}, bf16. Host ms: the step's own host time with the GPU drained before it. Profiles: "
             "host_profile_<family>.txt.", "",
             "| family | batch x seq | step ms native | step ms patched | patched / native | host ms native | host ms patched "
             "| GPU kernel ms native / patched | host syncs native / patched | step ms without GC native / patched "
             "| GC collections per step (gen 0/1/2) native; patched |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r['error']} | | | | | | | | | |")
            continue
        syncs = f"{sum(r['syncs_native'].values()):.1f} / {sum(r['syncs_patched'].values()):.1f}"
        gpu = ("-" if r.get("gpu_ms_native") is None else
               f"{r['gpu_ms_native']:.2f} / {r['gpu_ms_patched']:.2f}")
        lines.append(f"| {r['family']} | {r['shape']} | {r['step_ms_native']:.2f} | {r['step_ms_patched']:.2f} | "
                     f"{r['ratio']:.3f} | {r['host_ms_native']:.2f} | {r['host_ms_patched']:.2f} | {gpu} | {syncs} | "
                     f"{r['step_ms_nogc_native']:.2f} / {r['step_ms_nogc_patched']:.2f} | "
                     f"{'/'.join(f'{x:g}' for x in r['gc_per_step_native'])}; "
                     f"{'/'.join(f'{x:g}' for x in r['gc_per_step_patched'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
