"""The fused log-prob head's row passes over one chunk of logits, by block width and warps, on one GPU.

    python -m benchmarks.logprob_rows [--rows 2048] [--vocab 128256] [--blocks 2048,4096,8192]
        [--warps 4,8,16] [--reps 20] [--out DIR] [--name NAME]

``kernels/_logprob_triton.py`` reads a chunk's stored logits (bf16 ``[rows, vocab]``) twice: the
statistics pass (per (row, block) partials, then one combine program a row) and the gradient pass
(each block overwritten in place with ``d log p_target / d logits``, then the target's entry). Each
``(BLOCK_V, num_warps)`` is timed with CUDA events (median of ``--reps`` calls after warm-up) with
the options trl's SFTTrainer asks for (entropy, is_top1), against a bandwidth reference: the same
bytes moved by ``torch`` (one read: ``logits.amax(1)``; read and write: ``logits.mul_(1)``).
Writes ``<name>.json`` and ``<name>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import _results


def run(rows: int, vocab: int, blocks: list[int], warps: list[int], reps: int) -> tuple[list[dict], dict]:
    import torch

    from liger_compat.kernels import _logprob_triton as lpt
    from liger_compat.kernels.logprob import LPOptions

    from .kernels_common import event_ms as _time

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 3).to(torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    opt = LPOptions(entropy=True, is_top1=True)
    glp = torch.full((), -1.0 / rows, device="cuda")
    gbytes = logits.numel() * logits.element_size() / 1e9
    out = []
    read_ms = _time(lambda: logits.amax(1), reps)
    rw = logits.clone()
    rw_ms = _time(lambda: rw.mul_(1), reps)
    ref = {"read_ms": read_ms, "read_write_ms": rw_ms, "gbytes": gbytes}
    real_block = lpt._block
    try:
        for bv in blocks:
            for nw in warps:
                lpt._block = lambda v, device, bv=bv, nw=nw: (min(bv, lpt.next_pow2(v)), nw)
                stats = lpt.lp_rows_triton(logits, target, opt)
                lse, ent = stats[5], stats[1]
                buf = logits.clone()
                s_ms = _time(lambda: lpt.lp_rows_triton(logits, target, opt), reps)
                g_ms = _time(lambda: lpt.lp_rows_triton(buf, target, opt, grad=buf, g_lp=glp, lse=lse, entropy=ent),
                             reps)
                out.append({"block_v": bv, "warps": nw, "stats_ms": s_ms, "grad_ms": g_ms})
                print(f"BLOCK_V {bv} warps {nw}: stats {s_ms:.3f} ms, grad {g_ms:.3f} ms", flush=True)
    finally:
        lpt._block = real_block
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "rows": rows, "vocab": vocab,
            "default": list(real_block(vocab, logits.device)), **ref}
    return out, meta


def _markdown(rows: list[dict], meta: dict, cmd: str) -> str:
    lines = [_results.md_line(cmd).rstrip("\n"), "",
             "# The log-prob head's row passes over one chunk, by block width and warps", "",
             f"GPU: {meta['gpu']}; torch {meta['torch']}; Triton {meta['triton']}; logits bf16 "
             f"{meta['rows']} x {meta['vocab']} ({meta['gbytes']:.2f} GB); entropy and is_top1 asked; "
             f"the default is BLOCK_V {meta['default'][0]} with {meta['default'][1]} warps.", "",
             f"Bandwidth reference, the same bytes through torch: one read (`amax(1)`) {meta['read_ms']:.3f} ms, "
             f"read and write (`mul_(1)`) {meta['read_write_ms']:.3f} ms.", "",
             "| BLOCK_V | warps | statistics ms (partials + combine) | x one read | gradient ms (in place + target) "
             "| x read and write |", "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['block_v']} | {r['warps']} | {r['stats_ms']:.3f} | {r['stats_ms'] / meta['read_ms']:.2f} | "
                     f"{r['grad_ms']:.3f} | {r['grad_ms'] / meta['read_write_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--blocks", default="2048,4096,8192")
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--name", default="logprob_rows")
    a = ap.parse_args(argv)
    try:
        blocks = [int(x) for x in a.blocks.split(",") if x.strip()]
        warps = [int(x) for x in a.warps.split(",") if x.strip()]
    except ValueError:
        ap.error("--blocks and --warps: comma-separated integers")
    if a.rows < 1 or a.vocab < 1 or a.reps < 1 or not blocks or not warps:
        ap.error("--rows, --vocab, --reps: at least 1; --blocks and --warps: at least one value")
    if any(b < 16 or b & (b - 1) for b in blocks) or any(w not in (1, 2, 4, 8, 16, 32) for w in warps):
        ap.error("--blocks: powers of two from 16; --warps: 1, 2, 4, 8, 16 or 32")
    import torch

    if not torch.cuda.is_available():
        print("logprob_rows: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows, meta = run(a.rows, a.vocab, blocks, warps, a.reps)
    cmd = _results.command("benchmarks.logprob_rows", argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps({"regenerate": cmd, "meta": meta, "rows": rows}, indent=1))
    (out / f"{a.name}.md").write_text(_markdown(rows, meta, cmd))
    print((out / f"{a.name}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
