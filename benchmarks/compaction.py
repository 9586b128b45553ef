"""The fused loss's ignored-row compaction where work is queued ahead of the loss, on one GPU.

    python -m benchmarks.compaction [--rows 8192] [--hidden 4096] [--vocab 128256]
        [--ignored 0.0005,0.1,0.5,0.8,0.95] [--queued-ms 5] [--calls 15] [--out DIR] [--name compaction]

In a training step the loss starts while the decoder's forward is still queued on the GPU. A
compacting loss must know how many rows it keeps; reading that count on the host waits for the GPU
to reach it. This times ``fused_linear_cross_entropy`` (bf16, mean, forward and backward) with
``compact_ignored=True`` and ``False`` (every row computed), each call behind a chain of bf16
matmuls of about ``--queued-ms`` on the GPU, between CUDA events recorded before the chain and after
the backward, the GPU drained before each call; the two settings alternate call by call, and the
chain alone is timed the same way. ``loss ms`` is a call's median less the chain's. The ignored
rows are drawn at random. Run it from two source trees (this code and another) to compare their
compaction in one GPU session: the uncompacted rows time the same code in both and show how far the
two processes' machine state differs. Writes ``<name>.json`` and ``<name>.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from . import _results


def _time(fn, pre) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    pre()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--ignored", default="0.0005,0.1,0.5,0.8,0.95")
    ap.add_argument("--queued-ms", type=float, default=5.0)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--name", default="compaction")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if not torch.cuda.is_available():
        print("compaction needs a CUDA GPU", file=sys.stderr)
        return 2
    from liger_compat.kernels import fused_linear_cross_entropy

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    n, hdim, v = args.rows, args.hidden, args.vocab
    h = (torch.randn(n, hdim, device=dev, generator=g)).bfloat16().requires_grad_(True)
    w = (torch.randn(v, hdim, device=dev, generator=g) / hdim**0.5).bfloat16().requires_grad_(True)
    a = torch.randn(4096, 4096, device=dev, generator=g).bfloat16()
    c = torch.empty_like(a)
    one = statistics.median(_time(lambda: torch.mm(a, a, out=c), lambda: None) for _ in range(10))
    reps = max(1, round(args.queued_ms / one))

    def chain():
        for _ in range(reps):
            torch.mm(a, a, out=c)

    def call(t, compact):
        def run():
            h.grad = w.grad = None
            fused_linear_cross_entropy(h, w, t, compact_ignored=compact).backward()
        return run

    chain_ms = statistics.median(_time(lambda: None, chain) for _ in range(args.calls))
    rows = []
    for frac in (float(x) for x in args.ignored.split(",")):
        t = torch.randint(0, v, (n,), device=dev, generator=g)
        t[torch.rand(n, device=dev, generator=g) < frac] = -100
        kept = int((t != -100).sum())
        times: dict[bool, list[float]] = {True: [], False: []}
        for compact in (True, False, True, False):  # warm-up: compilation, allocator
            _time(call(t, compact), chain)
        for i in range(args.calls):
            for compact in ((True, False) if i % 2 == 0 else (False, True)):
                times[compact].append(_time(call(t, compact), chain))
        row = dict(ignored=frac, kept=kept, chain_ms=chain_ms,
                   compact_ms=statistics.median(times[True]) - chain_ms,
                   all_rows_ms=statistics.median(times[False]) - chain_ms, compact_times=times[True],
                   all_rows_times=times[False])
        row["ratio"] = row["compact_ms"] / row["all_rows_ms"]
        rows.append(row)
        print({k: x for k, x in row.items() if not k.endswith("_times")}, flush=True)
    cmd = _results.command("benchmarks.compaction", argv)
    info = f"{torch.cuda.get_device_name()}; torch {torch.__version__}"
    lines = ["# The fused loss's ignored-row compaction behind queued work\n\n",
             f"{info}; {n} x {hdim} x {v} bf16, mean, forward + backward; each call behind {reps} bf16 "
             f"4096^3 matmuls ({chain_ms:.2f} ms on the GPU), the GPU drained before it; median of {args.calls} "
             "calls a setting, the settings alternating; loss ms = call less the chain alone.\n\n",
             "| ignored | rows kept | compacted loss ms | every row ms | compacted / every row |\n",
             "|---:|---:|---:|---:|---:|\n"]
    for r in rows:
        lines.append(f"| {r['ignored']:g} | {r['kept']} | {r['compact_ms']:.2f} | {r['all_rows_ms']:.2f} | "
                     f"{r['ratio']:.3f} |\n")
    _results.write(args.out, args.name, {"device": info, "reps": reps, "rows": rows}, "".join(lines), cmd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
