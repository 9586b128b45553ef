"""GPU benchmark of the fused linear cross-entropy in four logit regimes (``benchmarks/regimes.py``):
every implementation at every head in the near-uniform (``init``), ``spread``, ``trained``-like and
``peaked`` regimes: forward+backward ms, extra MiB, grad_hidden and grad_weight error against an fp32 head.

    python -m benchmarks.kernels_regimes [--heads llama3-8b,...] [--regimes init,spread,trained]
        [--impls ...] [--reps 3] [--budget-s 230] [--name kernels_regimes] [--out DIR]

Each head runs in its own process (one CUDA context, every implementation on fresh copies of the
inputs, the allocator emptied between them); rows go to ``<name>.json`` as they are measured, so a
run cut short keeps what it has. ``--budget-s``: no measurement starts after that many seconds
(the heads are taken in the order given; the rest is recorded as not run; ``--append`` adds a
second call's heads to the same file). ms: median of ``--reps``
timed calls after one warm-up call (the warm-up's gradients give the errors; "peaked rows": grad_h's
error over the rows whose target has fp32 probability >= 0.99 alone); extra MiB: peak
allocated during one forward+backward beyond the inputs and the gradients it returns.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEADS = {
    "llama3-8b": (8192, 4096, 128256, None),
    "gemma2-9b-softcap": (8192, 3584, 256000, 30.0),
    "qwen2-7b": (8192, 3584, 152064, None),
    "llama3.2-1b": (16384, 2048, 128256, None),
    "llama3-8b-32k": (32768, 4096, 128256, None),
}
#: implementation names, in the order measured
IMPLS = ("liger_compat", "liger_compat unshifted logits", "liger_compat sparse", "liger_compat rounded target",
         "liger_compat fp32 grad_weight", "liger_compat fp32 grad_weight unshifted logits",
         "liger_compat fp32 grad_weight without target terms",
         "liger_compat lowmem",
         "liger_compat lowmem dense", "torch eager", "torch.compile",
         "liger-kernel", "cce", "cce_kahan_full_c", "cce_exact", "cce filter_eps=None")
REGIMES = ("init", "spread", "trained", "peaked")
MATMUL_TFLOPS = 790.0  # used for the floor where the run measures none


def log(*a):
    print(*a, flush=True)


def _load(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"regenerate": "", "meta": {}, "rows": []}


def _append(path: Path, row: dict) -> None:
    data = _load(path)
    data["rows"].append(row)
    path.write_text(json.dumps(data, indent=1, default=str))
    log("  ", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})


# ---------------------------------------------------------------------------------------------
# one head, in its own process
# ---------------------------------------------------------------------------------------------

class _NoTargetTerms:
    """Stands in for ``_target_terms_triton``: grad_weight's target terms left as stored."""

    @staticmethod
    def add_target_terms(*args, **kwargs) -> None:
        return None


def _impls(softcap):
    import torch

    from benchmarks.kernels_flce import _eager_loss
    from liger_compat.kernels import _logits_triton, _lowmem_triton, fused_linear_cross_entropy
    from liger_compat.kernels import loss as loss_mod

    from liger_compat import _config

    def step_with(obj, attr, value, fn=None, **kw):
        """fused_linear_cross_entropy's forward and backward (or ``fn``'s) with ``obj.attr = value``
        for the call."""
        def step(h, w, t):
            old = getattr(obj, attr)
            setattr(obj, attr, value)
            try:
                if fn is not None:
                    return fn(h, w, t)
                loss = fused_linear_cross_entropy(h, w, t, softcap=softcap, **kw)
                return torch.autograd.grad(loss, (h, w)), loss
            finally:
                setattr(obj, attr, old)
        return step

    out = {
        "liger_compat": lambda h, w, t: fused_linear_cross_entropy(h, w, t, softcap=softcap),
        # LIGER_COMPAT_FLCE_FP32_GRAD_WEIGHT=1
        "liger_compat fp32 grad_weight": step_with(_config.settings, "flce_fp32_grad_weight", True),
        "liger_compat lowmem": lambda h, w, t: fused_linear_cross_entropy(h, w, t, softcap=softcap, mode="lowmem"),
        # LIGER_COMPAT_FLCE_SPARSE_CHUNKED=1: the chunked mode's gradient matmuls block-sparse
        "liger_compat sparse": lambda h, w, t: fused_linear_cross_entropy(h, w, t, softcap=softcap, sparse_grads=True),
        # the chunked mode with each target entry of grad_hidden's product as stored in bf16 (no
        # exact-target correction), as before the correction
        "liger_compat rounded target": step_with(loss_mod, "_target_fix_mode", lambda *a: None),
    }
    # the Triton logits GEMM storing the logits as a 16-bit product does, not tile-relative
    out["liger_compat unshifted logits"] = step_with(_logits_triton, "SHIFT_LOGITS", False)
    out["liger_compat fp32 grad_weight unshifted logits"] = step_with(
        _config.settings, "flce_fp32_grad_weight", True, fn=step_with(_logits_triton, "SHIFT_LOGITS", False))
    # the fp32 sum of grad_weight with its target entries as stored in bf16 (no exact target terms)
    no_terms = step_with(loss_mod, "_target_terms", lambda: _NoTargetTerms)
    out["liger_compat fp32 grad_weight without target terms"] = step_with(
        _config.settings, "flce_fp32_grad_weight", True, fn=no_terms)

    # the low-memory backward leaving no tile out, as before it could
    out["liger_compat lowmem dense"] = step_with(_lowmem_triton, "SKIP_EPS", 0.0, mode="lowmem")
    out["torch eager"] = lambda h, w, t: _eager_loss(h, w, t, softcap)
    comp = torch.compile(lambda h, w, t: _eager_loss(h, w, t, softcap), dynamic=False)
    out["torch.compile"] = comp
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        lk = LigerFusedLinearCrossEntropyLoss(softcap=softcap)
        out["liger-kernel"] = lambda h, w, t: lk(w, h, t)
    except Exception as exc:
        log("liger-kernel unavailable:", exc)
    try:
        from cut_cross_entropy import linear_cross_entropy

        out["cce"] = lambda h, w, t: linear_cross_entropy(h, w, t, softcap=softcap, impl="cce")
        for name in ("cce_kahan_full_c", "cce_exact"):
            if cce_implements(name):
                out[name] = (lambda impl: lambda h, w, t: linear_cross_entropy(h, w, t, softcap=softcap, impl=impl))(name)
        out["cce filter_eps=None"] = (
            lambda h, w, t: linear_cross_entropy(h, w, t, softcap=softcap, impl="cce", filter_eps=None))
    except Exception as exc:
        log("cut-cross-entropy unavailable:", exc)
    return out


def cce_implements(impl: str) -> bool:
    """Whether the installed cut-cross-entropy knows ``impl``: its ``LinearCrossEntropyImpl`` names
    the implementations (25.1.1, the newest release on PyPI, only ``cce`` and ``torch_compile``; the
    Kahan-summed and exact variants are on its GitHub main)."""
    from cut_cross_entropy import linear_cross_entropy as lce

    names = getattr(getattr(sys.modules.get(lce.__module__), "LinearCrossEntropyImpl", None), "__members__", None)
    return names is None or impl.upper() in names


def _step(fn, h, w, t):
    """Forward + backward: ``((grad_hidden, grad_weight), loss)``."""
    import torch

    res = fn(h, w, t)
    if isinstance(res, tuple):  # already differentiated
        return res
    return torch.autograd.grad(res, (h, w)), res


def _matmul_tflops() -> float:
    import torch

    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b.t()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(10):
        a @ b.t()
    ev[1].record()
    torch.cuda.synchronize()
    return 2 * 8192 * 4096 * 16384 * 10 / (ev[0].elapsed_time(ev[1]) * 1e-3) / 1e12


#: a row whose target has at least this fp32 probability counts as peaked (its own grad_h column)
PEAKED_P = 0.99


def worker(head: str, regimes, impls, reps: int, deadline: float, path: Path) -> None:
    import torch

    from benchmarks.kernels_common import rel
    from benchmarks.kernels_lowmem import _ref_grads_fp32
    from benchmarks.regimes import make_inputs
    from liger_compat.kernels import _lowmem_triton, _sparse_grads_triton

    n, hd, v, softcap = HEADS[head]
    tflops = _matmul_tflops()
    floor = 6 * n * hd * v / (tflops * 1e12) * 1e3
    all_impls = _impls(softcap)
    bm, bn = _lowmem_triton.CONFIGS[_lowmem_triton.DEFAULT_CONFIG][:2]
    for regime in regimes:
        shape = f"{head} N={n} H={hd} V={v}" + (f" softcap={softcap:g}" if softcap else "")
        base = dict(section="flce_regimes", head=head, shape=shape, regime=regime, floor_ms=floor,
                    matmul_tflops=tflops)
        if time.time() > deadline:
            _append(path, dict(base, status="not run (budget)"))
            continue
        h0, w0, t, info = make_inputs(regime, n, hd, v, softcap=softcap, device="cuda", seed=0)
        rh, rw, rl, peaked = _ref_grads_fp32(h0, w0, t, softcap, peaked_p=PEAKED_P)
        base.update(entropy=info["entropy"], regime_loss=info["loss"], alpha=info.get("alpha"))
        log(f"## {shape} {regime}: entropy {info['entropy']:.2f}, loss {info['loss']:.2f}")
        for impl in impls:
            row = dict(base, impl=impl)
            if impl not in all_impls:
                why = "unavailable"
                if impl.startswith("cce_"):
                    from importlib.metadata import PackageNotFoundError, version

                    try:
                        why = f"not in cut-cross-entropy {version('cut-cross-entropy')} (no such impl)"
                    except PackageNotFoundError:
                        pass
                _append(path, dict(row, status=why))
                continue
            if time.time() > deadline:
                _append(path, dict(row, status="not run (budget)"))
                continue
            fn = all_impls[impl]
            h = w = None
            try:
                gc.collect()
                torch.cuda.empty_cache()
                h = h0.detach().clone().requires_grad_(True)
                w = w0.detach().clone().requires_grad_(True)
                _sparse_grads_triton.last_pairs = _sparse_grads_triton.last_probe = None
                (gh, gw), loss = _step(fn, h, w, t)  # warm-up; its gradients give the errors
                torch.cuda.synchronize()
                if peaked.numel():  # the rows whose target has p >= PEAKED_P, alone
                    row.update(gh_peaked_rows_err_vs_fp32=rel(gh[peaked], rh[peaked]), peaked_rows=int(peaked.numel()))
                row.update(gh_err_vs_fp32=rel(gh, rh), gw_err_vs_fp32=rel(gw, rw),
                           loss_absdiff_vs_fp32=abs(float(loss) - rl),
                           finite=bool(torch.isfinite(gh).all() and torch.isfinite(gw).all()))
                if impl == "liger_compat sparse":
                    row["probe_left_out"] = _sparse_grads_triton.last_probe
                    if _sparse_grads_triton.last_pairs is not None:  # the chunks after the probe
                        left, tested = _sparse_grads_triton.last_pairs
                        row["tiles_skipped"] = int(left)
                        row["tiles_skipped_share"] = int(left) / max(tested, 1)
                if impl == "liger_compat lowmem" and _lowmem_triton.last_skipped is not None:
                    valid = int((t != -100).sum())
                    row["tiles_skipped"] = int(_lowmem_triton.last_skipped)
                    row["tiles_skipped_share"] = row["tiles_skipped"] / (math.ceil(valid / bm) * math.ceil(v / bn))
                del gh, gw, loss
                gc.collect()
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                times = []
                for i in range(reps):
                    ev[0].record()
                    (gh, gw), loss = _step(fn, h, w, t)
                    ev[1].record()
                    torch.cuda.synchronize()
                    if i == 0:
                        kept = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in (gh, gw)
                                if x.untyped_storage().data_ptr() not in
                                {h.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()}}
                        row["extra_mib"] = (torch.cuda.max_memory_allocated() - before - sum(kept.values())) / 2**20
                    times.append(ev[0].elapsed_time(ev[1]))
                    del gh, gw, loss
                row.update(ms=statistics.median(times), ms_samples=times, x_floor=statistics.median(times) / floor,
                           status="ok")
            except Exception as exc:  # OOM or an implementation's own error: recorded, the run goes on
                row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:300])
            _append(path, row)
            del h, w
            gc.collect()
            torch.cuda.empty_cache()
        del h0, w0, t, rh, rw
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def report(data: dict) -> str:
    rows = [r for r in data["rows"] if r.get("section") == "flce_regimes"]
    lines = [f"regenerate: `{data.get('regenerate', '')}`", "", "# Fused linear cross-entropy in four logit regimes", "",
             f"device: {data['meta'].get('device', '?')}; {data['meta'].get('versions', '')}", "",
             *([data["meta"]["note"], ""] if data["meta"].get("note") else []),
             "Regimes (benchmarks/regimes.py): init = h ~ 0.5 N(0,1), w ~ 0.02 N(0,1); spread = h ~ N(0,1), "
             "w ~ N(0, 4/H); trained = Zipf(1.1) targets over a permuted vocabulary, a log-prior weight column, "
             "h = noise + alpha W[target] with mean entropy 2.5 nats; peaked = the same at 0.05 nats (most rows' "
             "target probability above 0.99). 10 % of targets ignored; bf16 inputs; "
             "errors against an all-fp32 head.", ""]
    for r in rows:
        r.setdefault("shape", r.get("head", "?"))
    heads = list(dict.fromkeys(r["shape"] for r in rows))
    for shape in heads:
        lines += [f"## {shape}", ""]
        for regime in REGIMES:
            rr = [r for r in rows if r["shape"] == shape and r.get("regime") == regime]
            if not rr:
                continue
            ent = next((r for r in rr if "entropy" in r), {})
            floor = rr[0].get("floor_ms") or float("nan")
            lines += [f"### {regime}: entropy {ent.get('entropy', float('nan')):.2f} nats, loss "
                      f"{ent.get('regime_loss', float('nan')):.2f}; dense 3-matmul floor {floor:.1f} ms", "",
                      "| impl | ms | x floor | extra MiB | grad_h err | grad_w err | grad_h err, peaked rows | note |",
                      "|---|---|---|---|---|---|---|---|"]
            for r in rr:
                if "impl" not in r:
                    continue
                if r.get("status") != "ok":
                    lines.append(f"| {r['impl']} | | | | | | | {r.get('status')} {r.get('error', '')} |")
                    continue
                note = (f"{100 * r['tiles_skipped_share']:.1f} % of tiles skipped" if "tiles_skipped_share" in r else "")
                if r.get("probe_left_out") is not None and "tiles_skipped_share" not in r:
                    note = f"probe left out {100 * r['probe_left_out']:.1f} %: every chunk dense"
                pk = (f"{r['gh_peaked_rows_err_vs_fp32']:.1e} ({r['peaked_rows']} rows)"
                      if "gh_peaked_rows_err_vs_fp32" in r else "")
                lines.append(f"| {r['impl']} | {r['ms']:.2f} | {r['x_floor']:.2f} | {r['extra_mib']:.0f} | "
                             f"{r['gh_err_vs_fp32']:.1e} | {r['gw_err_vs_fp32']:.1e} | {pk} | {note} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def _meta() -> dict:
    import torch

    meta = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    vers = [f"torch {torch.__version__}"]
    for mod in ("triton", "liger_kernel", "cut_cross_entropy"):
        try:
            from importlib.metadata import version

            vers.append(f"{mod} {version(mod.replace('_', '-'))}")
        except Exception:
            pass
    meta["versions"] = ", ".join(vers)
    return meta


def _pick(value: str | None, allowed, what: str, parser) -> list[str]:
    if not value:
        return list(allowed)
    got = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in got if x not in allowed]
    if bad:
        parser.error(f"{what}: unknown {', '.join(map(repr, bad))}; choose from {', '.join(allowed)}")
    return got


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--name", default="kernels_regimes", help="result files <name>.json, <name>.md")
    p.add_argument("--heads", help=f"comma-separated, of {', '.join(HEADS)} (default: all, in that order)")
    p.add_argument("--regimes", help=f"of {', '.join(REGIMES)}")
    p.add_argument("--impls", help=f"of {', '.join(IMPLS)}")
    p.add_argument("--reps", type=int, default=3, help="timed calls per implementation (default 3)")
    p.add_argument("--budget-s", type=float, default=230.0, help="start no measurement after this (default 230 s)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    p.add_argument("--report", action="store_true", help="only write <name>.md from <name>.json")
    p.add_argument("--append", action="store_true",
                   help="keep the rows of other heads already in <name>.json (a run split over several calls)")
    args = p.parse_args(argv)
    heads = _pick(args.heads, HEADS, "--heads", p)
    regimes = _pick(args.regimes, REGIMES, "--regimes", p)
    impls = _pick(args.impls, IMPLS, "--impls", p)
    if args.reps < 1:
        p.error("--reps must be at least 1")
    if args.budget_s <= 0:
        p.error("--budget-s must be positive")
    out = Path(args.out)
    path = out / f"{args.name}.json"
    if args.worker:
        worker(args.worker, regimes, impls, args.reps, args.deadline, path)
        return 0
    if args.report:
        (out / f"{args.name}.md").write_text(report(_load(path)))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    from benchmarks import _results

    given = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--name" or a.startswith("--name=") for a in given):
        given += ["--name", args.name]  # the command names the file it writes
    cmd = _results.command("benchmarks.kernels_regimes", given)
    data = {"regenerate": cmd, "meta": _meta(), "rows": []}
    if args.append and path.exists():
        old = _load(path)
        data["rows"] = [r for r in old["rows"] if r.get("head") not in heads]
        data["regenerate"] = f"{old.get('regenerate', '')}; {cmd}".lstrip("; ")
    path.write_text(json.dumps(data, indent=1))
    deadline = time.time() + args.budget_s
    for head in heads:
        if time.time() > deadline:
            for regime in regimes:
                _append(path, dict(section="flce_regimes", head=head, shape=head, regime=regime,
                                   status="not run (budget)"))
            continue
        sub = [sys.executable, "-m", "benchmarks.kernels_regimes", "--worker", head, "--deadline", str(deadline),
               "--regimes", ",".join(regimes), "--impls", ",".join(impls), "--reps", str(args.reps),
               "--out", str(out), "--name", args.name]
        try:
            # a measurement started just before the deadline may run on a while
            rc = subprocess.run(sub, timeout=max(30.0, deadline - time.time() + 90.0)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc != 0:
            _append(path, dict(section="flce_regimes", head=head, shape=head, regime="", status=f"worker exit {rc}"))
    (out / f"{args.name}.md").write_text(report(_load(path)))
    log((out / f"{args.name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
