"""How much of a fused loss's backward a gradient filter could leave out, and at what error, in the
three logit regimes of ``benchmarks/regimes.py``: exact fp32 arithmetic in torch, no kernel timed.

A (row block, vocabulary tile) pair whose non-target softmax entries are all below ``eps`` is left
out of the two gradient matmuls (rule ``max``, cut-cross-entropy's); rule ``max+share``, the
low-memory backward's (``liger_compat/kernels/_lowmem_triton.py``), also asks that no row holds more
than ``SKIP_SHARE`` of its share of its non-target mass in the tile. This measures, per head,
regime, rule and ``eps``:

* the share of pairs left out, with the vocabulary in its own order and sorted by each column's
  mean logit over the rows (``W @ mean(h)``, which the backward can compute from its inputs: a
  cut-cross-entropy-style ordering that gathers the near-zero columns into whole tiles);
* the relative error (Frobenius) that leaving them out puts into ``grad_hidden`` and ``grad_weight``;
* the ``grad_hidden`` error when every left-out pair adds back its rows' left-out softmax mass times
  the mean weight row of its run of ``MEAN_TILES`` tiles (``mass @ mean(W)``: one small matmul a
  group of rows), which keeps the part of the left-out gradient that all those columns share.

``--prefix-rows 2048,512,128`` adds, per regime, what a filter that cuts the sorted vocabulary at one
column per group of that many rows would leave out: every column past the group's last one with a
non-target entry at or above ``eps`` (rule ``max``), the two gradient matmuls then dense on a prefix
(what the chunked mode's cuBLAS matmuls could do with the cut known on the host).

``--pt-noise S`` adds Gaussian noise of deviation ``S`` to each row's ``log p_t`` where the rule
reads the row's non-target mass (the kernel takes it from a target logit and an lse summed apart).

    python -m benchmarks.skip_analysis [--heads llama3-8b] [--rows 1024] [--regimes init,spread,trained]
        [--eps 10,11,12,14] [--block-m 128] [--block-n 256] [--prefix-rows 2048,512,128] [--pt-noise 0] [--device cpu]
        [--name skip_analysis] [--out DIR]

``--eps`` takes exponents: ``12`` is 2^-12. Rows are the first ``--rows`` of each regime's inputs
(the ignored ones left out, the rest cut to whole row blocks). On the CPU the Llama-3-8B head takes
a few minutes a regime (the trained-like regime's entropy bisection most of it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.kernels_regimes import HEADS
from benchmarks.regimes import IGNORE_INDEX, REGIMES, make_inputs
from liger_compat.kernels import _lowmem_triton


def log(*a):
    print(*a, flush=True)


def column_order(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The low-memory backward's column order (its ``column_order``: mean logit over the rows of
    ``h``, largest first) for fp32 ``h`` / ``w`` whose rows all get a gradient, as int64 indices."""
    rows = torch.arange(h.shape[0], device=h.device)
    return _lowmem_triton.column_order(h, w, None, rows, torch.ones(h.shape[0], device=h.device)).long()


@torch.no_grad()
def analyse(h, w, t, softcap, eps_list, bm, bn, ordered, share, floor, pt_noise=0.0):
    """Rows of the table for one regime's inputs (``h`` / ``w`` / ``t`` as the regime made them), for
    each eps under two rules: ``max`` (every non-target entry below eps, cut-cross-entropy's rule)
    and ``max+share`` (also each row's non-target mass in the tile at most ``share`` times its
    share ``bn / V`` of the row's non-target mass, that at least ``floor * (|lse| + 1)``: the
    low-memory kernel's rule)."""
    keep = t != IGNORE_INDEX
    hf, t = h[keep].float(), t[keep]
    n = hf.shape[0] // bm * bm
    hf, t = hf[:n], t[:n]
    v, hd = w.shape
    wf = w.float()
    if ordered:
        perm = column_order(hf, wf)
        wf = wf[perm]
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(v, device=perm.device)
        t = inv[t]
    z = hf @ wf.t()
    dcap = None
    if softcap is not None:
        th = torch.tanh(z / softcap)
        z = softcap * th
        dcap = 1.0 - th * th  # d capped / d raw
        del th
    lse = torch.logsumexp(z, -1)
    p = torch.softmax(z, -1)
    del z
    log_pt = torch.log(p.gather(1, t[:, None]).squeeze(1).clamp(min=1e-38))
    if pt_noise:
        log_pt = log_pt + pt_noise * torch.randn(log_pt.shape, generator=torch.Generator().manual_seed(1)).to(log_pt)
    row_mass = torch.maximum(-torch.expm1(log_pt.clamp(max=0.0)), (lse.abs() + 1.0) * floor)
    d = p.clone()
    d.scatter_add_(1, t[:, None], -torch.ones(n, 1, device=d.device))
    if dcap is not None:
        d *= dcap
        del dcap
    gh = d @ wf
    gw = d.t() @ hf
    pn = p.scatter(1, t[:, None], 0.0)  # the filter looks at the non-target entries
    del p
    dn = d.scatter(1, t[:, None], 0.0)  # what a left-out pair takes out of the gradient
    del d
    nb, nt = n // bm, math.ceil(v / bn)
    pad = nt * bn - v
    tiles = torch.nn.functional.pad(pn, (0, pad)).view(nb, bm, nt, bn)
    tile_max = tiles.amax(dim=3)  # [nb, bm, nt]
    heavy = tiles.sum(dim=3) > share * row_mass.view(nb, bm, 1) * (bn / v)
    del pn, tiles
    # the mean weight row of each run of MEAN_TILES tiles (the kernel's table), one per tile
    span = _lowmem_triton.MEAN_TILES * bn
    ns = math.ceil(v / span)
    wpad = torch.nn.functional.pad(wf, (0, 0, 0, ns * span - v)).view(ns, span, hd)
    counts = torch.full((ns,), float(span), device=wf.device)
    counts[-1] = v - (ns - 1) * span
    mu = (wpad.sum(1) / counts[:, None]).repeat_interleave(_lowmem_triton.MEAN_TILES, 0)[:nt]  # [nt, H]
    del wpad
    rows = []
    for e in eps_list:
        small = tile_max < 2.0 ** -e
        for rule, ok in (("max", small), ("max+share", small & ~heavy)):
            skip = ok.all(dim=1)  # [nb, nt]
            mask = skip[:, None, :, None].expand(nb, bm, nt, bn).reshape(n, nt * bn)[:, :v]
            left = dn * mask
            err_h = left @ wf
            mass = torch.nn.functional.pad(left, (0, pad)).view(n, nt, bn).sum(-1)  # [n, nt]
            err_hc = err_h - mass @ mu
            err_w = left.t() @ hf
            rows.append({
                "eps": f"2^-{e}", "rule": rule, "ordered": ordered,
                "skipped_pct": 100.0 * float(skip.float().mean()),
                "grad_h_err": float(err_h.norm() / gh.norm()),
                "grad_h_err_corrected": float(err_hc.norm() / gh.norm()),
                "grad_w_err": float(err_w.norm() / gw.norm()),
            })
            del left, err_h, err_hc, err_w, mask
    return n, rows


@torch.no_grad()
def prefix_cut(h, w, t, softcap, eps_list, groups) -> list[dict]:
    """Per eps and group size: the share of the sorted vocabulary's columns past each group's cut
    (one column past its last non-target entry at or above eps), averaged over the groups, and the
    share of rows whose own cut would be in the first half."""
    keep = t != IGNORE_INDEX
    hf, t = h[keep].float(), t[keep]
    wf = w.float()
    perm = column_order(hf, wf)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(wf.shape[0], device=perm.device)
    wf, t = wf[perm], inv[t]
    v = wf.shape[0]
    n = hf.shape[0]
    last = {e: torch.empty(n, dtype=torch.long, device=hf.device) for e in eps_list}
    cols = torch.arange(v, device=hf.device)
    for s0 in range(0, n, 256):  # [256, V] softmax blocks
        z = hf[s0:s0 + 256] @ wf.t()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        p = torch.softmax(z, -1).scatter_(1, t[s0:s0 + 256, None], 0.0)
        del z
        for e in eps_list:
            last[e][s0:s0 + 256] = torch.where(p >= 2.0 ** -e, cols, -1).amax(dim=1)
    rows = []
    for e in eps_list:
        for g in groups:
            cuts = [int(last[e][a:a + g].max()) + 1 for a in range(0, n, g)]
            rows.append({"eps": f"2^-{e}", "rows_per_group": g, "left_out_pct": 100.0 * (1 - sum(cuts) / (len(cuts) * v)),
                         "rows_cut_in_first_half_pct": 100.0 * float(((last[e] + 1) <= v // 2).float().mean())})
    return rows


def report(data: dict) -> str:
    out = [f"regenerate: `{data['regenerate']}`", "",
           "# How much of the fused loss's backward a gradient filter could leave out", "",
           f"torch {data['meta']['torch']}, device {data['meta']['device']}, fp32 arithmetic", "",
           "A (row block, vocabulary tile) pair is left out when every non-target softmax entry in it is below "
           "eps (rule *max*, cut-cross-entropy's), and with rule *max+share* (the low-memory backward's) only "
           f"where also each row's non-target mass in the tile is at most {data['share']:g} times the tile's "
           "share of the vocabulary times the row's non-target mass. *sorted*: the vocabulary sorted by each "
           "column's mean logit (`W @ mean(h)`) before tiling. Errors are relative (Frobenius) against the "
           "exact fp32 gradient; *corrected*: each left-out pair adds back its rows' left-out mass times the "
           f"mean weight row of its run of {data.get('mean_tiles', 1)} tiles (what the low-memory backward does). "
           f"Row mass floor {data.get('floor', 0):g} x (|lse| + 1); noise on log p_t where the rule reads the "
           f"row's mass: {data.get('pt_noise', 0):g}.", ""]
    for head in data["heads"]:
        out += [f"## {head['head']} H={head['H']} V={head['V']}, {head['rows']} rows, "
                f"tiles {head['block_m']} x {head['block_n']}", ""]
        for reg in head["regimes"]:
            out += [f"### {reg['regime']}: entropy {reg['entropy']:.2f} nats, loss {reg['loss']:.2f}", "",
                    "| vocabulary | rule | eps | pairs left out | grad_h err | grad_h err, corrected | grad_w err |",
                    "|---|---|---|---|---|---|---|"]
            for r in reg["rows"]:
                out.append(f"| {'sorted' if r['ordered'] else 'own order'} | {r['rule']} | {r['eps']} | "
                           f"{r['skipped_pct']:.1f} % | "
                           f"{r['grad_h_err']:.1e} | {r['grad_h_err_corrected']:.1e} | {r['grad_w_err']:.1e} |")
            out.append("")
            if reg.get("prefix"):
                out += ["A prefix of the sorted vocabulary per group of rows (rule *max*): the columns past each "
                        "group's cut, averaged over the groups, and the rows whose own cut is in the first half.", "",
                        "| rows per group | eps | columns left out | rows cut in the first half |", "|---|---|---|---|"]
                for r in reg["prefix"]:
                    out.append(f"| {r['rows_per_group']} | {r['eps']} | {r['left_out_pct']:.1f} % | "
                               f"{r['rows_cut_in_first_half_pct']:.1f} % |")
                out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.skip_analysis", description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", default="llama3-8b", help=f"comma-separated, of {', '.join(HEADS)}")
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--regimes", default=",".join(REGIMES))
    p.add_argument("--eps", default="10,12", help="exponents: 12 is 2^-12 (the kernel's: "
                   f"{-math.log2(_lowmem_triton.SKIP_EPS):g})")
    p.add_argument("--block-m", type=int, default=128)
    p.add_argument("--block-n", type=int, default=256)
    p.add_argument("--prefix-rows", default="", help="comma-separated group sizes for the prefix-cut table (none)")
    p.add_argument("--pt-noise", type=float, default=0.0, help="deviation of noise on each row's log p_t (0)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--name", default="skip_analysis")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    heads = [x for x in args.heads.split(",") if x]
    regimes = [x for x in args.regimes.split(",") if x]
    for x in heads:
        if x not in HEADS:
            p.error(f"--heads: unknown head {x!r} (known: {', '.join(HEADS)})")
    for x in regimes:
        if x not in REGIMES:
            p.error(f"--regimes: unknown regime {x!r} (known: {', '.join(REGIMES)})")
    try:
        eps_list = [int(x) for x in args.eps.split(",") if x]
    except ValueError:
        p.error(f"--eps: comma-separated integer exponents, got {args.eps!r}")
    try:
        groups = [int(x) for x in args.prefix_rows.split(",") if x]
    except ValueError:
        p.error(f"--prefix-rows: comma-separated row counts, got {args.prefix_rows!r}")
    if any(g < 1 for g in groups):
        p.error(f"--prefix-rows: row counts must be positive, got {args.prefix_rows!r}")
    if args.rows < args.block_m:
        p.error(f"--rows must be at least --block-m ({args.block_m}), got {args.rows}")
    cmd = "python -m benchmarks.skip_analysis " + " ".join(argv if argv is not None else sys.argv[1:])
    data = {"regenerate": cmd.strip(), "meta": {"torch": torch.__version__, "device": args.device},
            "share": _lowmem_triton.SKIP_SHARE, "mean_tiles": _lowmem_triton.MEAN_TILES,
            "floor": _lowmem_triton.ROW_MASS_FLOOR, "pt_noise": args.pt_noise, "heads": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for head in heads:
        _n, hd, v, softcap = HEADS[head]
        entry = {"head": head, "H": hd, "V": v, "block_m": args.block_m, "block_n": args.block_n, "regimes": []}
        data["heads"].append(entry)
        for regime in regimes:
            t0 = time.time()
            h, w, t, info = make_inputs(regime, args.rows, hd, v, softcap=softcap, device=args.device)
            reg = {"regime": regime, "entropy": info["entropy"], "loss": info["loss"], "rows": []}
            for ordered in (False, True):
                n, rows = analyse(h, w, t, softcap, eps_list, args.block_m, args.block_n, ordered,
                                  _lowmem_triton.SKIP_SHARE, _lowmem_triton.ROW_MASS_FLOOR, args.pt_noise)
                reg["rows"] += rows
            if groups:
                reg["prefix"] = prefix_cut(h, w, t, softcap, eps_list, groups)
            entry["rows"] = n
            entry["regimes"].append(reg)
            log(f"{head} {regime}: {time.time() - t0:.0f} s")
            for r in reg["rows"]:
                log("  ", r)
            (out / f"{args.name}.json").write_text(json.dumps(data, indent=1))
            (out / f"{args.name}.md").write_text(report(data) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
