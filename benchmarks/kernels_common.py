"""What every section of the kernel benchmark (``python -m benchmarks.kernels``) shares: the
results being written (``RESULTS``, saved to ``OUT / NAME.json`` after every row) and the
measurement helpers (timing, extra memory, error, timing rounds).
"""

from __future__ import annotations

import gc
import json
import statistics
import time
import traceback
from pathlib import Path

import torch


RESULTS: dict = {"meta": {}, "rows": []}
OUT = Path("benchmarks/results")
NAME = "kernels"  # result files <NAME>.json / <NAME>.md


def log(*a):
    print(*a, flush=True)


def save():
    OUT.mkdir(parents=True, exist_ok=True)
    first = {k: RESULTS[k] for k in ("regenerate",) if k in RESULTS}  # the command heads the file
    (OUT / f"{NAME}.json").write_text(json.dumps(first | RESULTS, indent=1, default=str))


def add(**row):
    RESULTS["rows"].append(row)
    log("  ", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    save()


# ---------------------------------------------------------------------------------------------
# measurement helpers
# ---------------------------------------------------------------------------------------------


def event_ms(fn, reps: int) -> float:
    """Median ms of ``reps`` calls of ``fn``, each between two CUDA events (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench_ms(fn, rep_ms=None):
    from triton.testing import do_bench

    fn()  # compile / warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = (time.perf_counter() - t0) * 1e3
    rep = rep_ms or max(200.0, min(1500.0, one * 15))
    return do_bench(fn, warmup=max(25.0, one * 3), rep=rep, return_mode="median")


def bench_graph_ms(fn):
    """GPU time alone: ``fn`` captured in a CUDA graph and replayed (no Python/launch overhead,
    which at ~0.3 ms kernel sizes otherwise decides the eager-launch number)."""
    from triton.testing import do_bench_cudagraph

    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=200, return_mode="median")


def extra_peak_mib(fn, preexisting=()):
    """Peak memory during fn() beyond what was allocated before and what fn returns.

    Returned tensors that share storage with ``preexisting`` ones (liger-kernel writes some
    gradients over its inputs) are not subtracted: they were already in the baseline."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    old = {t.untyped_storage().data_ptr() for t in preexisting}
    seen, kept = set(), 0
    for t in _tensors(out):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in old and ptr not in seen:
            seen.add(ptr)
            kept += t.untyped_storage().nbytes()
    del out
    return (peak - base - kept) / 2**20


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def measure(section, shape, impl, step, extra=None, preexisting=(), graph=False, **fields):
    """One implementation timed once (one round of :func:`measure_rounds`): its ms, or None."""
    return measure_rounds(section, shape, {impl: step}, {impl: extra}, preexisting, graph, rounds=1,
                          **fields).get(impl)


#: timing rounds of ``measure_rounds`` (``--rounds``): every implementation of a shape is timed
#: once per round, the order rotated between rounds, and the row keeps the median
ROUNDS = 3


def measure_rounds(section, shape, steps, extras=None, preexisting=(), graph=False, last=(), rounds=None, **fields):
    """Time the implementations of one shape against each other: ``rounds`` (ROUNDS) rounds, each timing
    every implementation once, in an order rotated by one place per round (``last`` stays at
    the end: liger-kernel's RMSNorm writes over dY); one row per implementation with the median
    (``ms``) and every round (``ms_rounds``), then its extra memory. Within one run the same
    code timed at different moments moved by up to 7 % (NOTES.md), more than some of the gaps
    being compared."""
    extras = extras or {}
    names = [n for n in steps if n not in last]
    times: dict = {n: [] for n in steps}
    eager: dict = {}  # graph mode: one eager-launch time per implementation
    fallback: dict = {}  # graph capture failed: eager launches only, and why
    failed: dict = {}
    for r in range(ROUNDS if rounds is None else rounds):
        k = r % max(len(names), 1)
        order = names[k:] + names[:k] + [n for n in steps if n in last]
        for impl in order:
            if impl in failed:
                continue
            try:
                if graph:
                    if impl not in eager:
                        eager[impl] = bench_ms(steps[impl])
                    try:
                        times[impl].append(bench_graph_ms(steps[impl]))
                    except Exception as exc:
                        fallback[impl] = type(exc).__name__
                        times[impl].append(bench_ms(steps[impl]))
                else:
                    times[impl].append(bench_ms(steps[impl]))
            except Exception as exc:  # keep going: one broken baseline must not lose the run
                failed[impl] = f"{type(exc).__name__}: {exc}"[:400]
                traceback.print_exc()
            finally:
                gc.collect()
                torch.cuda.empty_cache()
    out = {}
    for impl in steps:
        if impl in failed:
            add(section=section, shape=shape, impl=impl, error=failed[impl], **(extras.get(impl) or {}))
            continue
        row = dict(fields, ms=statistics.median(times[impl]), ms_rounds=times[impl])
        if graph:
            fb = fallback.get(impl)
            row.update(ms_eager_launch=eager[impl],
                       timing=f"eager (graph capture failed: {fb})" if fb else "cuda graph")
        try:
            row["extra_mib"] = extra_peak_mib(steps[impl], preexisting)
        except Exception as exc:
            row["memory_error"] = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        add(section=section, shape=shape, impl=impl, **row, **(extras.get(impl) or {}))
        out[impl] = row["ms"]
    return out
