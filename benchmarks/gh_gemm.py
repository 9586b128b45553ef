"""The fused loss's grad_hidden product in a bf16 result against an fp32 one, on one GPU.

    python -m benchmarks.gh_gemm [--reps 20] [--out DIR]

The chunked fused loss multiplies each chunk's logits gradient ``d [rows, V]`` (bf16) by the
weight ``W [V, H]``. Written to a bf16 result (``torch.mm``), every row is rounded once from cuBLAS's
fp32 sum; the exact-target variant instead adds the product to an fp32 buffer that already holds the
target entries' correction (``torch.addmm(C, d, W, out_dtype=torch.float32, out=C)``) and casts that
once. This times both (and the cast) at the heads of ``benchmarks.kernels_regimes`` and at the small
step's head, each the median of ``--reps`` timed calls between CUDA events. Writes ``<name>.json``
and ``<name>.md``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from . import _results
from .kernels_common import event_ms

#: (name, chunk rows, vocabulary, hidden): the chunk the fused loss runs at each head
HEADS = (("llama3-8b", 2048, 128256, 4096), ("qwen2-7b", 2048, 152064, 3584), ("llama3.2-1b", 2048, 128256, 2048),
         ("gemma2-9b", 1024, 256000, 3584), ("small step", 2048, 128256, 1024))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--name", default="gh_gemm")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if not torch.cuda.is_available():
        print("gh_gemm needs a CUDA GPU", file=sys.stderr)
        return 2
    rows_out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, rows, v, hdim in HEADS:
        d = (torch.randn(rows, v, device="cuda", generator=g) * 1e-4).bfloat16()
        w = (torch.randn(v, hdim, device="cuda", generator=g) * 0.02).bfloat16()
        out = torch.empty(rows, hdim, device="cuda", dtype=torch.bfloat16)
        c = torch.zeros(rows, hdim, device="cuda", dtype=torch.float32)
        bf16 = event_ms(lambda: torch.mm(d, w, out=out), args.reps)
        fp32 = event_ms(lambda: torch.addmm(c, d, w, out_dtype=torch.float32, out=c), args.reps)
        cast = event_ms(lambda: out.copy_(c), args.reps)
        rows_out.append(dict(head=name, rows=rows, vocab=v, hidden=hdim, bf16_ms=bf16, fp32_ms=fp32, cast_ms=cast,
                             ratio=(fp32 + cast) / bf16))
        print(rows_out[-1], flush=True)
        del d, w, out, c
    cmd = _results.command("benchmarks.gh_gemm", argv)
    dev = f"{torch.cuda.get_device_name()}; torch {torch.__version__}"
    lines = ["# grad_hidden product of one chunk: bf16 result against fp32 (then cast)\n\n",
             f"{dev}; d ~ 1e-4 N(0,1), W ~ 0.02 N(0,1), bf16 operands; median of {args.reps} calls.\n\n",
             "| head | rows x V x H | bf16 result ms | fp32 result ms | cast ms | (fp32 + cast) / bf16 |\n",
             "|---|---|---:|---:|---:|---:|\n"]
    for r in rows_out:
        lines.append(f"| {r['head']} | {r['rows']} x {r['vocab']} x {r['hidden']} | {r['bf16_ms']:.3f} | "
                     f"{r['fp32_ms']:.3f} | {r['cast_ms']:.3f} | {r['ratio']:.3f} |\n")
    _results.write(args.out, args.name, {"device": dev, "rows": rows_out}, "".join(lines), cmd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
