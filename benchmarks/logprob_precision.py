"""Error of the fused log-prob head's per-token log-probs against float64, with each target logit
taken in fp32 from the hidden row and the target's weight row (the default) and as stored.

    python -m benchmarks.logprob_precision [--device cpu|cuda] [--heads small,...] [--reps 10]
        [--name logprob_precision] [--out DIR]

``liger_compat.kernels.fused_linear_logprobs`` on bf16 inputs of ``benchmarks/regimes.py``'s four
logit regimes, ``logprob.EXACT_TARGET`` on and off in the same process on the same inputs: the RMS
and the largest absolute error of the log-probs (and the entropy's RMS error) against a float64 head
on the same bf16 values, over the scored rows. On CUDA also the forward's time, the median of
``--reps`` calls between CUDA events. Writes ``<name>.json`` and ``<name>.md``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from . import _results
from .kernels_common import event_ms
from .regimes import REGIMES, make_inputs

#: name -> (rows, hidden, vocabulary)
HEADS = {"small": (512, 256, 8192), "llama3.2-1b": (4096, 2048, 128256), "llama3-8b": (4096, 4096, 128256)}


def _ref64(h, w, t, chunk=1024):
    """float64 log-probs and entropy of the scored rows, a chunk of rows at a time."""
    lp, ent = [], []
    w64 = w.double()
    for s in range(0, h.shape[0], chunk):
        z = h[s:s + chunk].double() @ w64.T
        logp = torch.log_softmax(z, -1)
        tt = t[s:s + chunk].clamp(min=0)
        lp.append(logp.gather(1, tt[:, None]).squeeze(1))
        ent.append(-(logp.exp() * logp).sum(-1))
        del z, logp
    return torch.cat(lp), torch.cat(ent)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--heads", default="small", help=f"comma-separated, of {', '.join(HEADS)}")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--name", default="logprob_precision")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    heads = [x.strip() for x in args.heads.split(",") if x.strip()]
    bad = [x for x in heads if x not in HEADS]
    if bad or not heads:
        ap.error(f"--heads: unknown {', '.join(map(repr, bad))}; choose from {', '.join(HEADS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    from liger_compat.kernels import fused_linear_logprobs, last_backend
    from liger_compat.kernels import logprob as lp_mod

    rows_out = []
    for head in heads:
        n, hd, v = HEADS[head]
        for regime in REGIMES:
            h, w, t, info = make_inputs(regime, n, hd, v, device=args.device, seed=0)
            ref_lp, ref_ent = _ref64(h, w, t)
            scored = t != -100
            row = dict(head=head, shape=f"{n} x {hd} x {v}", regime=regime, entropy=info["entropy"])
            for exact in (True, False):
                lp_mod.EXACT_TARGET = exact
                try:
                    out = fused_linear_logprobs(h, w, t, want=("log_probs", "entropy"))
                    e = (out.log_probs.double() - ref_lp)[scored]
                    ee = (out.entropy.double() - ref_ent)[scored]
                    key = "exact" if exact else "stored"
                    row[f"{key}_lp_rms"] = float(e.pow(2).mean().sqrt())
                    row[f"{key}_lp_max"] = float(e.abs().max())
                    row[f"{key}_ent_rms"] = float(ee.pow(2).mean().sqrt())
                    if args.device == "cuda":
                        row[f"{key}_ms"] = event_ms(lambda: fused_linear_logprobs(h, w, t, want=("log_probs", "entropy")),
                                               args.reps)
                finally:
                    lp_mod.EXACT_TARGET = True
            row["backend"] = last_backend["fused_linear_logprobs"]
            rows_out.append(row)
            print(row, flush=True)
            del h, w, t, ref_lp, ref_ent
    dev = (torch.cuda.get_device_name() if args.device == "cuda" else "CPU") + f"; torch {torch.__version__}"
    timed = args.device == "cuda"
    lines = ["# The fused log-prob head's log-probs against float64: target logits in fp32 or as stored\n\n",
             f"{dev}; bf16 inputs of benchmarks/regimes.py (10 % of targets ignored), the scored rows; "
             "exact: each target logit in fp32 from its hidden row and weight row (the default), stored: "
             "as the 16-bit logits hold it" + (f"; forward ms: median of {args.reps} calls" if timed else "") + ".\n\n",
             "| head | rows x H x V | regime | log-prob RMS error, exact | stored | largest, exact | stored "
             "| entropy RMS error, exact | stored |" + (" ms exact | ms stored |" if timed else "") + "\n",
             "|---|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if timed else "") + "\n"]
    for r in rows_out:
        lines.append(f"| {r['head']} | {r['shape']} | {r['regime']} | {r['exact_lp_rms']:.2e} | {r['stored_lp_rms']:.2e} "
                     f"| {r['exact_lp_max']:.2e} | {r['stored_lp_max']:.2e} | {r['exact_ent_rms']:.2e} "
                     f"| {r['stored_ent_rms']:.2e} |" + (f" {r['exact_ms']:.2f} | {r['stored_ms']:.2f} |" if timed else "")
                     + "\n")
    cmd = _results.command("benchmarks.logprob_precision", argv)
    _results.write(args.out, args.name, {"device": dev, "rows": rows_out}, "".join(lines), cmd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
