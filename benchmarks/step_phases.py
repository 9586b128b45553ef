"""Where a host-bound training step's time goes, phase by phase, native against patched, on one GPU.

    python -m benchmarks.step_phases [--families qwen3_5_text,llama] [--seq 2048] [--steps 20] [--rounds 4]

Per family, at ``benchmarks.models_gpu``'s small shape (2 layers, hidden 1024, vocabulary 128256,
bf16, SDPA), one model, native (``liger_compat.revert()``) and patched steps alternating in rounds:

* **drained**: the GPU drained before each step; the host time of the forward (to its return), of
  the backward (to ``backward()``'s return) and the wait after it (the GPU's tail): what the host
  itself costs, and whether a phase blocks on the GPU.
* **steady**: steps back to back as a training loop runs them (one sync at the end of a round):
  the same phases' host times, where a host call may now block on GPU work queued before it.
* **trace**: a ``torch.profiler`` trace of 3 steps a side (CPU and CUDA), reduced to the CUDA
  runtime calls: count and host time of each kind (launches, copies, allocations, syncs), and the
  longest single calls with the operator they ran under: a call that blocks (a full launch queue, a
  ``cudaFree``, a pageable copy) shows as a long one. The profiler slows the host, so these are
  read for blocking and counts, not for the host's own cost.

* **sampled** (``--sample``): steady steps with a thread that reads every thread's Python stack
  every ``--sample-us`` microseconds: wall time per step by the innermost line of our code,
  transformers' or torch's (a blocking call, which no tracer sees, is counted where it waits).

``--conditions`` repeats the drained and steady rounds under other process settings (``default``;
``single_thread``: ``torch.autograd.set_multithreading_enabled(False)``, the backward on the
calling thread; ``switch_<us>``: ``sys.setswitchinterval`` of that many microseconds, the GIL's
hand-over; ``nogc``: the garbage collector off): a difference that one of them removes names its
cause.

Writes ``<name>.json``, ``<name>.md`` and per family ``<name>_<family>.txt`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import liger_compat

from . import _results
from .host_profile import _step, _sync, warm_model


def _phases(model, kw, labels, steps: int, drained: bool) -> dict[str, float]:
    """Median host ms of forward, backward and the wait after it over ``steps`` steps."""
    fwd, bwd, wait = [], [], []
    _sync()
    for _ in range(steps):
        model.zero_grad(set_to_none=True)  # outside the timing
        if drained:
            _sync()
        t0 = time.perf_counter()
        loss = model(**kw, labels=labels, use_cache=False).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if drained:
            _sync()
        t3 = time.perf_counter()
        fwd.append((t1 - t0) * 1e3)
        bwd.append((t2 - t1) * 1e3)
        wait.append((t3 - t2) * 1e3)
    t0 = time.perf_counter()
    _sync()
    tail = (time.perf_counter() - t0) * 1e3
    out = {"fwd": statistics.median(fwd), "bwd": statistics.median(bwd)}
    if drained:
        out["wait"] = statistics.median(wait)
    else:
        out["tail"] = tail
    return out


def _trace(model, kw, labels, steps: int, path: Path) -> dict:
    """A profiler trace of ``steps`` steps reduced to the CUDA runtime calls on the host."""
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            _step(model, kw, labels)
        _sync()
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    path.unlink()
    cpu_ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")]
    kinds: dict[str, list[float]] = {}
    for e in runtime:
        kinds.setdefault(e["name"], []).append(e["dur"] / 1e3)
    # each runtime call's innermost enclosing operator on the same thread
    by_tid: dict = {}
    for e in cpu_ops:
        by_tid.setdefault(e["tid"], []).append(e)

    def owner(e) -> str:
        best = None
        for op in by_tid.get(e["tid"], ()):
            if op["ts"] <= e["ts"] and op["ts"] + op["dur"] >= e["ts"] + e["dur"]:
                if best is None or op["dur"] < best["dur"]:
                    best = op
        return best["name"] if best else "-"

    longest = sorted(runtime, key=lambda e: -e["dur"])[:15]
    return {
        "kinds": {k: {"count": len(v) / steps, "ms": sum(v) / steps, "max_ms": max(v)}
                  for k, v in sorted(kinds.items(), key=lambda kv: -sum(kv[1]))},
        "longest": [{"name": e["name"], "ms": e["dur"] / 1e3, "under": owner(e)} for e in longest],
    }


@contextlib.contextmanager
def condition(name: str):
    """The process setting ``name`` (see the module docstring) inside the block."""
    if name == "default":
        yield
    elif name == "single_thread":
        with torch.autograd.set_multithreading_enabled(False):
            yield
    elif name.startswith("switch_"):
        old = sys.getswitchinterval()
        sys.setswitchinterval(float(name[len("switch_"):]) * 1e-6)
        try:
            yield
        finally:
            sys.setswitchinterval(old)
    elif name == "nogc":
        gc.collect()
        gc.disable()
        try:
            yield
        finally:
            gc.enable()
    else:
        raise ValueError(f"unknown condition {name!r}")


def _rounds(model, kw, labels, sides: dict, ns: argparse.Namespace) -> dict:
    """Per side and mode, the phase timings of ``ns.rounds`` interleaved rounds."""
    got: dict = {s: {"drained": [], "steady": []} for s in sides}
    for r in range(ns.rounds):
        for side in (("native", "patched") if r % 2 == 0 else ("patched", "native")):
            sides[side]()
            for mode in ("drained", "steady"):
                got[side][mode].append(_phases(model, kw, labels, ns.steps, mode == "drained"))
    return got


def _summary(got: dict, steps: int) -> dict:
    """:func:`_rounds`' timings as ``<mode>_<phase>_<side>`` medians over the rounds, and each side's
    steady step (forward, backward and its share of the round's final sync)."""
    row = {}
    for side, modes in got.items():
        for mode, runs in modes.items():
            for key in runs[0]:
                row[f"{mode}_{key}_{side}"] = statistics.median(r[key] for r in runs)
        row[f"steady_step_{side}"] = statistics.median(
            r["fwd"] + r["bwd"] + r["tail"] / steps for r in modes["steady"])
    return row


def _where(frame) -> str:
    """The innermost frame of ``frame``'s stack in liger_compat, transformers, torch or triton code, as
    ``package/file.py:line (function)``; the innermost frame of all where none is."""
    f = frame
    while f is not None:
        name = f.f_code.co_filename
        for pkg in ("liger_compat", "transformers", "triton", "torch"):
            cut = name.rfind(f"/{pkg}/")
            if cut >= 0:
                return f"{name[cut + 1:]}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def _sampled(model, kw, labels, steps: int, every_us: int) -> dict:
    """Per thread kind (``main``, ``other``), wall ms per step by :func:`_where` over ``steps`` steady steps."""
    import threading

    main_id = threading.get_ident()
    counts: dict[str, dict[str, int]] = {"main": {}, "other": {}}
    stop = threading.Event()
    me = None

    def sample():
        while not stop.is_set():
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                kind = "main" if tid == main_id else "other"
                key = _where(frame)
                if kind == "other" and key.startswith("threading.py"):
                    continue
                counts[kind][key] = counts[kind].get(key, 0) + 1
            time.sleep(every_us * 1e-6)

    _sync()
    th = threading.Thread(target=sample, daemon=True)
    t0 = time.perf_counter()
    th.start()
    me = th.ident
    for _ in range(steps):
        _step(model, kw, labels)
    _sync()
    wall = (time.perf_counter() - t0) * 1e3
    stop.set()
    th.join()
    n_main = max(sum(counts["main"].values()), 1)
    per_sample = wall / n_main / steps  # ms of a step that one main-thread sample stands for
    return {"step_ms": wall / steps, "samples": n_main,
            **{kind: {k: v * per_sample for k, v in sorted(c.items(), key=lambda kv: -kv[1])[:40]}
               for kind, c in counts.items()}}


def run_family(family: str, ns: argparse.Namespace, out: Path) -> tuple[dict, str]:
    model, kw, labels, sides = warm_model(family, argparse.Namespace(**vars(ns), device="cuda"))
    row: dict = {"family": family, "shape": f"{ns.batch}x{ns.seq}", "conditions": {}}
    for cond in ns.conditions.split(","):
        with condition(cond):
            row["conditions"][cond] = _summary(_rounds(model, kw, labels, sides, ns), ns.steps)
    text = [f"{family} {row['shape']}", ""]
    if ns.sample:
        for side, switch in sides.items():
            switch()
            smp = _sampled(model, kw, labels, ns.steps * 2, ns.sample_us)
            row[f"sampled_{side}"] = smp
            text += [f"## Wall time per step by code line, {side}: {smp['step_ms']:.2f} ms a step, "
                     f"{smp['samples']} samples of the main thread every ~{ns.sample_us} us", ""]
            for kind in ("main", "other"):
                text += [f"{kind} thread(s), ms per step:", ""]
                text += [f"- {ms:7.3f}  {k}" for k, ms in smp[kind].items()]
                text.append("")
    for side, switch in (sides.items() if ns.trace else ()):
        switch()
        tr = _trace(model, kw, labels, 3, out / f"_trace_{family}_{side}.json")
        row[f"trace_{side}"] = tr
        text += [f"## CUDA runtime calls per step, {side} (torch.profiler, 3 steps)", "",
                 "| call | per step | host ms per step | longest ms |", "|---|---|---|---|"]
        text += [f"| {k} | {v['count']:.1f} | {v['ms']:.3f} | {v['max_ms']:.3f} |" for k, v in tr["kinds"].items()]
        text += ["", f"longest single calls, {side}:", ""]
        text += [f"- {e['name']} {e['ms']:.3f} ms under {e['under']}" for e in tr["longest"]]
        text.append("")
    liger_compat.apply()
    del model
    torch.cuda.empty_cache()
    return row, "\n".join(text)


def _markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"A small training step's host time by phase, native and patched in one process ({meta['rounds']} "
             f"interleaved rounds of {meta['steps']} steps, medians); {meta['gpu']}, torch {meta['torch']}, "
             f"transformers {meta['transformers']}; {meta['layers']} layers, hidden {meta['hidden']}, vocabulary "
             f"{meta['vocab']}, bf16. Drained: the GPU idle before each step (the host's own cost; wait: the GPU's "
             "tail after backward returns). Steady: back-to-back steps (a host call can block on queued GPU work). "
             f"Runtime calls per step: `{meta['name']}_<family>.txt`.", "",
             "| family | batch x seq | condition | side | drained fwd / bwd / wait ms | steady fwd / bwd ms | "
             "steady step ms | steady patched / native |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r['error']} | | | | | | |")
            continue
        for cond, c in r["conditions"].items():
            for side in ("native", "patched"):
                ratio = f"{c['steady_step_patched'] / c['steady_step_native']:.3f}" if side == "patched" else ""
                lines.append(f"| {r['family']} | {r['shape']} | {cond} | {side} | {c[f'drained_fwd_{side}']:.2f} / "
                             f"{c[f'drained_bwd_{side}']:.2f} / {c[f'drained_wait_{side}']:.2f} | "
                             f"{c[f'steady_fwd_{side}']:.2f} / {c[f'steady_bwd_{side}']:.2f} | "
                             f"{c[f'steady_step_{side}']:.2f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="qwen3_5_text,llama")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="step_phases")
    ap.add_argument("--conditions", default="default", help="comma-separated: default, single_thread, "
                    "switch_<microseconds>, nogc (the module docstring)")
    ap.add_argument("--sample", action="store_true", help="also sample the threads' stacks during steady steps")
    ap.add_argument("--sample-us", type=int, default=200)
    ap.add_argument("--no-trace", dest="trace", action="store_false", help="skip the profiler trace")
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    liger_compat.apply()
    import transformers

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, transformers=transformers.__version__,
                rounds=ns.rounds, steps=ns.steps, layers=ns.layers, hidden=ns.hidden, vocab=ns.vocab, name=ns.name)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = _results.command("benchmarks.step_phases", sys.argv[1:] if argv is None else argv)
    rows = []
    for family in [f for f in ns.families.split(",") if f]:
        try:
            row, text = run_family(family, ns, out)
        except Exception as exc:  # one family failing must not hide the others
            row, text = {"family": family, "error": f"{type(exc).__name__}: {exc}"}, ""
        print(json.dumps({k: v for k, v in row.items() if not k.startswith(("trace_", "sampled_"))}), flush=True)
        rows.append(row)
        if text:
            (out / f"{ns.name}_{family}.txt").write_text(_results.md_line(cmd) + text)
        (out / f"{ns.name}.json").write_text(json.dumps({"regenerate": cmd, "meta": meta, "rows": rows}, indent=2))
        (out / f"{ns.name}.md").write_text(_results.md_line(cmd) + _markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
