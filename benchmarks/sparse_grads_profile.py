"""GPU profile of one chunk of the block-sparse gradient matmuls (``_sparse_grads_triton``) against
cuBLAS's dense products on the same chunk, kernel by kernel and over tile configurations.

    python -m benchmarks.sparse_grads_profile [--head llama3-8b] [--regime trained] [--rows 2048]
        [--name sparse_grads_profile] [--out DIR]

One chunk of ``--rows`` rows of the head in the regime (``benchmarks/regimes.py``), its logits
against the sorted weight and its gradient as the sparse chunked pass forms them; then each step
timed alone (median of 5 CUDA-event timings after a warm-up): the filter, the lists, grad_hidden and
grad_weight with the pairs the filter keeps and with every pair kept (the kernels' dense
efficiency), for each configuration in ``CONFIGS``; cuBLAS's ``d @ W`` and ``d.T @ h`` beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

GH_CONFIGS = [  # BH, BK, warps, stages, programs of one block of rows side by side
    (128, 64, 4, 3, False), (128, 64, 4, 3, True), (256, 64, 8, 3, False), (256, 64, 8, 3, True),
    (128, 64, 8, 3, True), (128, 64, 4, 4, True), (128, 64, 4, 5, True), (256, 64, 8, 4, True), (128, 128, 4, 3, True),
    (128, 32, 4, 4, True), (64, 64, 4, 4, True), (128, 64, 4, 6, True), (128, 64, 8, 5, True),
]
GW_CONFIGS = [  # BNW, BH, BKR, warps, stages, programs of one part of a tile side by side
    (128, 256, 64, 8, 3, False), (128, 256, 64, 8, 3, True), (128, 128, 64, 4, 3, False), (128, 128, 64, 4, 3, True),
    (64, 128, 64, 4, 3, True), (128, 256, 64, 8, 4, True), (128, 128, 64, 4, 4, True), (128, 128, 64, 8, 3, True),
    (128, 128, 128, 4, 3, True), (128, 128, 32, 4, 5, True), (256, 128, 64, 8, 3, True), (128, 128, 32, 4, 6, True),
    (128, 128, 32, 8, 5, True), (128, 128, 64, 4, 5, True),
]


def _time(fn, reps=5):
    import torch

    fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    out = []
    for _ in range(reps):
        ev[0].record()
        fn()
        ev[1].record()
        torch.cuda.synchronize()
        out.append(ev[0].elapsed_time(ev[1]))
    return statistics.median(out)


def report(data: dict) -> str:
    lines = [f"regenerate: `{data['regenerate']}`", "",
             f"# One chunk of the block-sparse gradient matmuls against cuBLAS ({data['device']})", "",
             f"{data['head']}, {data['regime']} (entropy {data['entropy']:.2f} nats), {data['chunk_rows']} rows; "
             f"{100 * data['pairs_left_out']:.1f} % of (128-row, 256-column) pairs left out; torch {data['torch']}. "
             "ms: median of 5 CUDA-event timings after a warm-up.", "",
             "| step | ms |", "|---|---|"]
    for key, name in (("cublas_d_at_W_ms", "cuBLAS `d @ W` (dense grad_hidden)"),
                      ("cublas_dT_at_h_ms", "cuBLAS `d.T @ h` (dense grad_weight)"),
                      ("logits_mm_ms", "cuBLAS logits `h @ Ws.T`"), ("filter_ms", "filter reading `d` (the probe's)"),
                      ("filter_stats_ms", "filter from the row kernel's tile statistics (the sparse chunks')"),
                      ("lists_ms", "kept-pair lists")):
        if key in data:
            lines.append(f"| {name} | {data[key]:.3f} |")
    if "pairs_agree" in data:
        lines += ["", f"The two filters keep the same pairs: {data['pairs_agree']}."]
    lines += ["", "| kernel | configuration | kept pairs ms | every pair ms |", "|---|---|---|---|"]
    for r in data["rows"]:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['config']} | {r['error']} | |")
        else:
            lines.append(f"| {r['kernel']} | {r['config']} | {r['sparse_ms']:.3f} | {r['all_pairs_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head", default="llama3-8b")
    p.add_argument("--regime", default="trained")
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--name", default="sparse_grads_profile")
    p.add_argument("--report", action="store_true", help="only write <name>.md from <name>.json")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.report:
        (out / f"{args.name}.md").write_text(report(json.loads((out / f"{args.name}.json").read_text())))
        return 0
    import torch

    from benchmarks import _results
    from benchmarks.kernels_regimes import HEADS
    from benchmarks.regimes import make_inputs
    from liger_compat.kernels import _sparse_grads_triton as sg
    from liger_compat.kernels._ce_triton import ce_rows_triton
    from liger_compat.kernels.loss import CEOptions

    n, hd, v, softcap = HEADS[args.head]
    h, w, t, info = make_inputs(args.regime, n, hd, v, softcap=softcap, device="cuda", seed=0)
    c = args.rows
    opt = CEOptions(softcap=softcap)
    sp = sg.SparseChunks(h, w, t, opt, c, (True, True, False))
    hc, tc = h[:c].contiguous(), t[:c]
    tpos = sp.sorted_targets(tc)
    d = torch.mm(hc, sp.ws.t())
    valid = tc != -100
    sc = torch.where(valid, 1.0 / valid.sum(), 0.0).float()
    fix = torch.empty(c, hd, dtype=torch.float32, device="cuda")
    dt, rest, tq, ts, tbn = sp.row_buffers(c)
    st = ce_rows_triton(d, tpos, opt, scale=sc, grad=d, head=(hc, sp.ws, None), target_fix=(fix, sp.ws),
                        sparse=(dt, rest, tq, ts, tbn))
    lse = st[2]
    mass = sp.mass[:c].zero_()
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    keep = sg.tile_filter(d, sc, rest, lse, mass, counter)
    share = 1.0 - float(keep.float().mean())
    lists = sg.tile_lists(keep)
    full = sg.tile_lists(torch.ones_like(keep))
    tpos_live = torch.where(valid, tpos, torch.full_like(tpos, -1))
    gh = torch.empty(c, hd, dtype=h.dtype, device="cuda")
    gw = torch.empty_like(w)
    rows_out = torch.arange(c, device="cuda")
    res = {"head": args.head, "regime": args.regime, "chunk_rows": c, "entropy": info["entropy"], "pairs_left_out": share,
           "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    res["cublas_d_at_W_ms"] = _time(lambda: torch.mm(d, w))
    res["cublas_dT_at_h_ms"] = _time(lambda: torch.mm(d.t(), hc))
    res["logits_mm_ms"] = _time(lambda: torch.mm(hc, sp.ws.t()))
    res["filter_ms"] = _time(lambda: sg.tile_filter(d, sc, rest, lse, mass, counter))
    res["filter_stats_ms"] = _time(lambda: sg.tile_filter_stats(tq, ts, sc, rest, lse, mass, counter, v))
    res["pairs_agree"] = bool(torch.equal(keep, sg.tile_filter_stats(tq, ts, sc, rest, lse, mass, counter, v)))
    res["lists_ms"] = _time(lambda: sg.tile_lists(keep))
    base = dict(sg.config_for(h.device))
    rows = []
    for bh, bk, warps, stages, side in GH_CONFIGS:
        cfg = dict(base, BH=bh, BK=bk, gh_warps=warps, gh_stages=stages, gh_h_first=side)
        r = {"kernel": "grad_hidden", "config": f"BH{bh} BK{bk} w{warps} s{stages}" + (" rows-first" if side else "")}
        try:
            r["sparse_ms"] = _time(lambda: sg.sparse_grad_hidden(d, sp.ws, lists[0], lists[1], mass, sp.mu, fix, gh,
                                                                  rows_out, cfg=cfg))
            r["all_pairs_ms"] = _time(lambda: sg.sparse_grad_hidden(d, sp.ws, full[0], full[1], None, None, None, gh,
                                                                     rows_out, cfg=cfg))
        except Exception as exc:
            r["error"] = f"{type(exc).__name__}: {exc}"[:200]
        print(r, flush=True)
        rows.append(r)
    for bnw, bh, bkr, warps, stages, side in GW_CONFIGS:
        cfg = dict(base, BNW=bnw, BHW=bh, BKR=bkr, gw_warps=warps, gw_stages=stages, gw_h_first=side)
        r = {"kernel": "grad_weight", "config": f"BNW{bnw} BH{bh} BKR{bkr} w{warps} s{stages}" + (" tile-first" if side else "")}
        try:
            r["sparse_ms"] = _time(lambda: sg.sparse_grad_weight(d, hc, lists[2], lists[3], tpos_live, dt, sp.order, gw,
                                                                  cfg=cfg))
            r["all_pairs_ms"] = _time(lambda: sg.sparse_grad_weight(d, hc, full[2], full[3], tpos_live, dt, sp.order,
                                                                     gw, cfg=cfg))
        except Exception as exc:
            r["error"] = f"{type(exc).__name__}: {exc}"[:200]
        print(r, flush=True)
        rows.append(r)
    res["rows"] = rows
    out.mkdir(parents=True, exist_ok=True)
    given = list(sys.argv[1:] if argv is None else argv)
    data = {"regenerate": _results.command("benchmarks.sparse_grads_profile", given), **res}
    (out / f"{args.name}.json").write_text(json.dumps(data, indent=1))
    (out / f"{args.name}.md").write_text(report(data))
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
