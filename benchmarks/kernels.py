"""GPU benchmark of the liger_compat kernels against torch eager, torch.compile, liger-kernel and
cut-cross-entropy, in one run.

    python -m benchmarks.kernels [--out DIR] [--name kernels] [--sections ceilings,flce,logprob,variants,profile,norm,...]
    python -m benchmarks.kernels --plot DIR/kernels.json      # plots only (no GPU needed)

Prints a correctness table and a timing table (markdown, also written to ``<name>.md``),
writes every number to ``<name>.json`` (``--name``, default ``kernels``; both name the command
that regenerates them) and, where matplotlib exists, ``<name>_*.png``.
Times are ``triton.testing.do_bench`` medians of forward+backward; "extra MiB" is peak
allocated memory during forward+backward minus the inputs and the gradients returned.
Floors: the fused loss's three matmuls (6*N*H*V flop at the measured bf16 matmul rate); the
elementwise kernels' compulsory bytes (each input read once, each output written once, forward
and backward) at the measured device-copy rate.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS: dict = {"meta": {}, "rows": []}
OUT = Path("benchmarks/results")
NAME = "kernels"  # result files <NAME>.json / <NAME>.md
#: the RoPE kernel (``variant=`` of apply_rotary_pos_emb) the sections time; elem_profile sets the fastest
ROPE_VARIANT = "flat"


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


# ---------------------------------------------------------------------------------------------
# ceilings
# ---------------------------------------------------------------------------------------------


def _matmul_tflops(samples=3):
    """bf16 8192^3 matmul rate: ``samples`` medians after ~2 s of the same matmul. It moves by up
    to ~10 % within a run and between machines (685-797 TFLOP/s, NOTES.md), so the floor uses the
    fastest sample the run saw."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(8192, 8192, device="cuda", generator=g, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", generator=g, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 2.0:
        torch.mm(a, b)
        torch.cuda.synchronize()
    rates = [2 * 8192**3 / bench_ms(lambda: torch.mm(a, b)) / 1e9 for _ in range(samples)]
    del a, b
    return rates


def ceilings():
    log("## ceilings")
    rates = _matmul_tflops()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2**29, device="cuda", generator=g, dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    cms = bench_ms(lambda: y.copy_(x))
    tbps = 2 * x.numel() * 2 / cms / 1e9
    RESULTS["meta"].update(matmul_tflops=max(rates), matmul_tflops_samples=rates, copy_tbps=tbps)
    log(f"bf16 matmul {max(rates):.0f} TFLOP/s (samples {', '.join(f'{r:.0f}' for r in rates)}), copy {tbps:.2f} TB/s")
    del x, y
    save()


def ceilings_end():
    """The matmul rate again after the other sections; where it is higher, this run's matmul
    floors are rescaled to it (the floor is the fastest rate the run saw)."""
    rates = _matmul_tflops()
    meta = RESULTS["meta"]
    meta["matmul_tflops_samples"] = meta.get("matmul_tflops_samples", []) + rates
    old = meta.get("matmul_tflops")
    new = max(meta["matmul_tflops_samples"])
    log(f"bf16 matmul at the end: {', '.join(f'{r:.0f}' for r in rates)} TFLOP/s; ceiling {old} -> {new:.0f}")
    if old and new > old:
        for r in RESULTS["rows"]:
            if "run" not in r and r.get("section", "").startswith("flce") and r.get("floor_ms"):
                r["floor_ms"] *= old / new
        meta["matmul_tflops"] = new


# ---------------------------------------------------------------------------------------------
# fused linear cross-entropy
# ---------------------------------------------------------------------------------------------

HEADS = {
    "llama3-8b": (8192, 4096, 128256, None),
    "qwen2-7b": (8192, 3584, 152064, None),
    "llama3.2-1b": (16384, 2048, 128256, None),
    "gemma2-9b-softcap": (8192, 3584, 256000, 30.0),
}


def _eager_loss(h, w, t, softcap=None, acc=False):
    z = (h @ w.t()).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, t, ignore_index=-100)
    if acc:
        valid = t != -100
        a = ((z.argmax(-1) == t) & valid).sum() / valid.sum().clamp(min=1)
        return loss, a
    return loss


_compiled = {}


def flce_impls(softcap, acc):
    from liger_compat.kernels import fused_linear_cross_entropy

    impls = {}

    def ours(h, w, t):
        out = fused_linear_cross_entropy(h, w, t, softcap=softcap, return_token_accuracy=acc)
        return out.loss if acc else out

    impls["liger_compat"] = ours
    impls["torch eager"] = lambda h, w, t: _eager_loss(h, w, t, softcap, acc)[0] if acc else _eager_loss(h, w, t, softcap)
    key = (softcap, acc)
    if key not in _compiled:
        _compiled[key] = torch.compile(lambda h, w, t: _eager_loss(h, w, t, softcap, acc), dynamic=False)
    comp = _compiled[key]
    impls["torch.compile"] = (lambda h, w, t: comp(h, w, t)[0]) if acc else comp
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        lk = LigerFusedLinearCrossEntropyLoss(softcap=softcap, return_token_accuracy=acc)
        impls["liger-kernel"] = (lambda h, w, t: lk(w, h, t).loss) if acc else (lambda h, w, t: lk(w, h, t))
    except Exception as exc:
        log("liger-kernel unavailable:", exc)
    if not acc:
        try:
            from cut_cross_entropy import linear_cross_entropy

            impls["cut-cross-entropy"] = lambda h, w, t: linear_cross_entropy(h, w, t, softcap=softcap)
        except Exception as exc:
            log("cut-cross-entropy unavailable:", exc)
    return impls


def _flce_inputs(n, hd, v, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, hd, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(v, hd, device="cuda", generator=g) / math.sqrt(hd) * 2).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[torch.rand(n, device="cuda", generator=g) < 0.1] = -100
    return h.requires_grad_(True), w.requires_grad_(True), t


def _ref_grads(h, w, t, softcap, fp32):
    """grad_hidden, grad_weight, loss of the eager LM head: bf16 matmul + fp32 CE, or all fp32."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        hh = h.detach().float().requires_grad_(True) if fp32 else h.detach().clone().requires_grad_(True)
        ww = w.detach().float().requires_grad_(True) if fp32 else w.detach().clone().requires_grad_(True)
        loss = _eager_loss(hh, ww, t, softcap)
        gh, gw = torch.autograd.grad(loss, (hh, ww))
        return gh, gw, loss.detach()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def flce(names=("llama3-8b", "qwen2-7b", "llama3.2-1b"), acc_variants=(False,), section="flce"):
    mt = RESULTS["meta"].get("matmul_tflops", 797.0)
    for name in names:
        n, hd, v, softcap = HEADS[name]
        for acc in acc_variants:
            shape = f"{name} N={n} H={hd} V={v}" + (" softcap=30" if softcap else "") + (" +acc" if acc else "")
            log(f"## {section}: {shape}")
            h, w, t = _flce_inputs(n, hd, v)
            floor = 6 * n * hd * v / (mt * 1e12) * 1e3
            refs = {k: _ref_grads(h, w, t, softcap, fp32=(k == "fp32")) for k in ("eager", "fp32")}
            steps, extras = {}, {}
            for impl, fn in flce_impls(softcap, acc).items():
                def step(fn=fn):
                    loss = fn(h, w, t)
                    return torch.autograd.grad(loss, (h, w))

                errs = {}
                try:
                    loss = fn(h, w, t)
                    gh, gw = torch.autograd.grad(loss, (h, w))
                    for k, (rh, rw, rl) in refs.items():
                        errs[f"gh_err_vs_{k}"] = rel(gh, rh)
                        errs[f"gw_err_vs_{k}"] = rel(gw, rw)
                        errs[f"loss_absdiff_vs_{k}"] = abs(loss.item() - rl.item())
                    errs["finite"] = bool(torch.isfinite(gh).all() and torch.isfinite(gw).all())
                    del loss, gh, gw
                except Exception as exc:
                    errs["check_error"] = str(exc)[:300]
                steps[impl], extras[impl] = step, errs
            del refs
            gc.collect()
            torch.cuda.empty_cache()
            measure_rounds(section, shape, steps, extras, floor_ms=floor)
            del h, w, t, steps
            gc.collect()
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# fused log-prob heads (trl's add_fused_lm_head scoring)
# ---------------------------------------------------------------------------------------------

#: trl's vocabulary tile width in add_fused_lm_head (trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE)
TRL_LOGPROB_CHUNK = 32768
#: what trl's SFTTrainer asks its head for
LOGPROB_OUTPUTS = ("entropy", "is_top1")


def _logprob_impls(upstream):
    """Head implementations on the compacted rows (what trl's head passes the scoring function):
    each returns ``(loss, log_probs)`` from ``(h, w, t)`` for the ``upstream`` kind of loss:
    ``"sft"`` (minus the mean log-prob) or ``"weights"`` (per-token weights, GRPO-like)."""
    from liger_compat.kernels import fused_linear_cross_entropy
    from liger_compat.kernels.logprob import fused_linear_logprobs

    impls = {}

    def loss_of(lp, adv):
        return -lp.sum() / lp.numel() if upstream == "sft" else -(lp * adv).sum() / lp.numel()

    try:
        from trl.kernels import ChunkedLogProbFunction

        def trl_head(h, w, t, adv):
            lp = ChunkedLogProbFunction.apply(h, w, None, t, 1.0, TRL_LOGPROB_CHUNK, None, 1.0, LOGPROB_OUTPUTS)[0]
            return loss_of(lp, adv), lp

        impls["trl head"] = trl_head
    except Exception as exc:
        log("trl unavailable:", exc)

    def ours(h, w, t, adv):
        out = fused_linear_logprobs(h, w, t, want=("log_probs",) + LOGPROB_OUTPUTS,
                                    grad_mode="uniform" if upstream == "sft" else "recompute")
        return loss_of(out.log_probs, adv), out.log_probs

    impls["liger_compat logprobs"] = ours
    if upstream == "sft":
        impls["liger_compat fused loss (mean)"] = lambda h, w, t, adv: (
            fused_linear_cross_entropy(h, w, t, return_token_accuracy=True).loss, None)
    return impls


def logprob(names=("llama3-8b", "qwen2-7b", "llama3.2-1b")):
    """trl's head (ChunkedLogProbFunction) against fused_linear_logprobs at the heads, bf16, 10 % of the
    rows ignored and dropped first as trl's head does; SFT-style loss and per-token weighted upstream
    gradients; floors: 3 matmuls (gradient formed in the forward) and 4 (recomputed)."""
    mt = RESULTS["meta"].get("matmul_tflops", 797.0)
    for name in names:
        n, hd, v, _ = HEADS[name]
        h_all, w, t_all = _flce_inputs(n, hd, v)
        keep = t_all != -100
        h = h_all.detach()[keep].clone().requires_grad_(True)
        t = t_all[keep]
        m = h.shape[0]
        adv = torch.randn(m, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        floor3 = 6 * m * hd * v / (mt * 1e12) * 1e3
        floor4 = 8 * m * hd * v / (mt * 1e12) * 1e3
        refs = _ref_grads(h, w, t, None, fp32=True)  # grads of the mean NLL = the SFT loss here
        for upstream in ("sft", "weights"):
            shape = f"{name} N={n} ({m} scored) H={hd} V={v} {upstream}"
            log(f"## logprob: {shape}")
            steps, extras = {}, {}
            for impl, fn in _logprob_impls(upstream).items():
                def step(fn=fn):
                    loss, _ = fn(h, w, t, adv)
                    return torch.autograd.grad(loss, (h, w))

                errs = {"floor3_ms": floor3, "floor4_ms": floor4, "upstream": upstream}
                try:
                    loss, lp = fn(h, w, t, adv)
                    gh, gw = torch.autograd.grad(loss, (h, w))
                    if upstream == "sft":
                        errs["gh_err_vs_fp32"] = rel(gh, refs[0])
                        errs["gw_err_vs_fp32"] = rel(gw, refs[1])
                        errs["loss_absdiff_vs_fp32"] = abs(loss.item() - refs[2].item())
                    errs["finite"] = bool(torch.isfinite(gh).all() and torch.isfinite(gw).all())
                    del loss, lp, gh, gw
                except Exception as exc:
                    errs["check_error"] = str(exc)[:300]
                steps[impl], extras[impl] = step, errs
            gc.collect()
            torch.cuda.empty_cache()
            measure_rounds("logprob", shape, steps, extras, preexisting=(h, w),
                           floor_ms=floor3 if upstream == "sft" else floor4)
            del steps
        del h_all, h, w, t, t_all, refs
        gc.collect()
        torch.cuda.empty_cache()


def _set_flce(rows=None, mib=None, variant="split", compact=True, logits="auto"):
    """Set the chunk size and return the other knobs as keyword arguments of
    ``fused_linear_cross_entropy`` (no arguments: the defaults)."""
    from liger_compat import _config

    # ``rows``: that many rows per chunk exactly (the cap set from them; at V=128256);
    # ``mib``: the LIGER_COMPAT_FLCE_CHUNK_MB setting (None: unset, the rows default)
    _config.settings.flce_chunk_mb = str(rows * 2 * 128256 / 2**20) if rows else ("" if mib is None else str(mib))
    return dict(ce_variant=variant, compact_ignored=compact, logits_impl=logits)


def flce_rows():
    """Rows per chunk at the two operating points (~1000 rows, ~250 rows): cuBLAS shapes that
    are multiples of 64 or not, and the number of chunks; with 10 % ignored targets (~7370 rows
    left at the 8B head) and with none. (Even chunks against full chunks plus a remainder
    were compared here too, a knob since removed: NOTES.md, "even chunks".)"""
    from liger_compat.kernels import fused_linear_cross_entropy
    from liger_compat.kernels import loss as loss_mod

    mt = RESULTS["meta"].get("matmul_tflops", 797.0)
    configs = [dict(rows=1008), dict(rows=1024), dict(rows=960), dict(rows=248), dict(rows=256), dict(rows=192)]
    try:
        for name in ("llama3-8b", "llama3.2-1b"):
            n, hd, v, _ = HEADS[name]
            h, w, t = _flce_inputs(n, hd, v)
            floor = 6 * n * hd * v / (mt * 1e12) * 1e3
            for ignored in (True, False):
                tt = t if ignored else t.clamp(min=0)
                m = int((tt != -100).sum())
                for cfg in configs:
                    knobs = _set_flce(mib=4096, **cfg)
                    rows = loss_mod._chunk_rows(m, v, hd, 2, "triton", h.device)

                    def step():
                        return torch.autograd.grad(fused_linear_cross_entropy(h, w, tt, **knobs), (h, w))

                    label = ", ".join(f"{k}={x}" for k, x in cfg.items())
                    measure("flce_rows", f"{name} {'10% ignored' if ignored else 'no ignored'} ({m} rows)",
                            f"{label} -> {rows} x {-(-m // rows)}", step, floor_ms=floor, chunk_rows=rows)
            del h, w, t
    finally:
        _set_flce()


def flce_variants():
    """Our own knobs at the Llama-3-8B head: rows per chunk / memory cap, CE row-kernel
    variant, the logits GEMM (cuBLAS, or the Triton GEMM with the statistics in its epilogue),
    skipping ignored rows."""
    from liger_compat.kernels import fused_linear_cross_entropy
    from liger_compat.kernels import loss as loss_mod

    n, hd, v, _ = HEADS["llama3-8b"]
    h, w, t = _flce_inputs(n, hd, v)
    mt = RESULTS["meta"].get("matmul_tflops", 797.0)
    floor = 6 * n * hd * v / (mt * 1e12) * 1e3
    configs = [
        dict(), dict(logits="cublas"), dict(variant="row", logits="cublas"), dict(compact=False),
        dict(mib=62), dict(mib=62, logits="cublas"), dict(mib=128), dict(mib=256), dict(rows=4096, mib=2048),
    ]
    for cfg in configs:
        knobs = _set_flce(**cfg)

        def step():
            return torch.autograd.grad(fused_linear_cross_entropy(h, w, t, **knobs), (h, w))

        rows = loss_mod._chunk_rows(n, v, hd, 2, "triton", h.device)
        label = "default" if not cfg else ", ".join(f"{k}={v}" for k, v in cfg.items())
        measure("flce_variants", f"llama3-8b {label} ({rows} rows)", "liger_compat", step, floor_ms=floor, chunk_rows=rows)
    _set_flce()


#: heads of the end-to-end models (tokens of a 4x2048 step), for ``flce_mib`` only (``--flce-mib-heads``)
E2E_HEADS = {
    "e2e-llama-3.2-1b": (8192, 2048, 128256, None),
    "e2e-qwen2.5-1.5b": (8192, 1536, 151936, None),
}
#: every head ``flce_mib`` can run, and the ones it runs
ALL_HEADS = {**HEADS, **E2E_HEADS}
FLCE_MIB_HEADS = tuple(HEADS)
#: chunk settings that ``flce_mib`` compares at every head: ``mib:N`` (LIGER_COMPAT_FLCE_CHUNK_MB=N)
#: or ``rows:N`` (a cap of N rows' logits at that head's V); ``--flce-chunks`` sets them
FLCE_CHUNK_SETTINGS = ("mib:512", "default", "rows:4096")


def _chunk_setting(setting: str) -> tuple[str, float | None]:
    """One ``--flce-chunks`` entry as (kind, number): ``default``, ``mib:N`` (N > 0) or ``rows:N``
    (whole N > 0); ``ValueError`` otherwise."""
    kind, _, num = setting.partition(":")
    if kind == "default" and not num:
        return kind, None
    try:
        value = float(num) if kind == "mib" else int(num) if kind == "rows" else 0
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(setting)
    return kind, value


def flce_mib():
    """Every head at each chunk setting of FLCE_CHUNK_SETTINGS (same run, so the rows compare)."""
    from liger_compat.kernels import fused_linear_cross_entropy
    from liger_compat.kernels import loss as loss_mod

    mt = RESULTS["meta"].get("matmul_tflops", 797.0)
    try:
        for name in FLCE_MIB_HEADS:
            n, hd, v, softcap = ALL_HEADS[name]
            h, w, t = _flce_inputs(n, hd, v)
            floor = 6 * n * hd * v / (mt * 1e12) * 1e3
            for setting in FLCE_CHUNK_SETTINGS:
                kind, num = _chunk_setting(setting)
                if kind == "rows":
                    _set_flce(mib=num * 2 * v / 2**20)
                elif kind == "default":
                    _set_flce()
                else:
                    _set_flce(mib=num)

                def step():
                    return torch.autograd.grad(fused_linear_cross_entropy(h, w, t, softcap=softcap), (h, w))

                rows = loss_mod._chunk_rows(n, v, hd, 2, "triton", h.device)
                label = {"rows": f"{num} rows", "default": "default"}.get(kind, f"{num:g} MiB")
                measure("flce_mib", f"{name} N={n} H={hd} V={v}" + (" softcap=30" if softcap else ""),
                        f"liger_compat {label} ({rows} rows)", step, floor_ms=floor, chunk_rows=rows)
            del h, w, t
    finally:
        _set_flce()


#: heads of the ``flce_lowmem`` section: the four HEADS and a 32k-token Llama-3-8B head
LOWMEM_HEADS = {**HEADS, "llama3-8b-32k": (32768, 4096, 128256, None)}
#: tile configurations of the low-memory kernels that ``flce_lowmem`` also times (``--lowmem-configs``)
LOWMEM_CONFIGS: tuple[str, ...] = ()
#: forward/backward pairs that ``--lowmem-configs all`` adds to the single configurations
LOWMEM_PAIRS = ("m128n128k64w8s3/m128n256k32w8s4", "m128n128k64w8s3/m128n64k64w4s4", "m128n64k64w4s4/m128n128k64w8s3")


def _ref_grads_fp32(h, w, t, softcap, rows=4096):
    """grad_hidden, grad_weight and loss of the all-fp32 LM head (mean over non-ignored rows),
    in chunks of ``rows`` so that the 32k-token head's fp32 logits need not exist at once."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        w32 = w.detach().float().requires_grad_(True)
        n_valid = max(int((t != -100).sum()), 1)
        gh = torch.empty(h.shape, dtype=torch.float32, device=h.device)
        gw = torch.zeros_like(w32)
        total = 0.0
        for s in range(0, h.shape[0], rows):
            hc = h[s:s + rows].detach().float().requires_grad_(True)
            z = hc @ w32.t()
            if softcap is not None:
                z = softcap * torch.tanh(z / softcap)
            loss = F.cross_entropy(z, t[s:s + rows], ignore_index=-100, reduction="sum") / n_valid
            a, b = torch.autograd.grad(loss, (hc, w32))
            gh[s:s + rows] = a
            gw += b
            total += loss.item()
            del z, loss, a, b, hc
        return gh, gw, total
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def lowmem_impls(softcap, configs=()):
    """The implementations ``flce_lowmem`` compares: our two modes (and the low-memory kernels at
    each of ``configs``), cut-cross-entropy's ``cce`` (gradient filter on, its default) and with
    ``filter_eps=None``, liger-kernel."""
    from liger_compat.kernels import fused_linear_cross_entropy

    impls = {
        "liger_compat lowmem": lambda h, w, t: fused_linear_cross_entropy(h, w, t, softcap=softcap, mode="lowmem"),
        "liger_compat chunked": lambda h, w, t: fused_linear_cross_entropy(h, w, t, softcap=softcap, mode="chunked"),
    }
    for cfg in configs:
        impls[f"liger_compat lowmem {cfg}"] = (
            lambda h, w, t, cfg=cfg: fused_linear_cross_entropy(h, w, t, softcap=softcap, mode="lowmem", config=cfg))
    try:
        from cut_cross_entropy import linear_cross_entropy

        impls["cce"] = lambda h, w, t: linear_cross_entropy(h, w, t, softcap=softcap, impl="cce")
        impls["cce_exact (filter_eps=None)"] = (
            lambda h, w, t: linear_cross_entropy(h, w, t, softcap=softcap, impl="cce", filter_eps=None))
    except Exception as exc:
        log("cut-cross-entropy unavailable:", exc)
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        lk = LigerFusedLinearCrossEntropyLoss(softcap=softcap)
        impls["liger-kernel"] = lambda h, w, t: lk(w, h, t)
    except Exception as exc:
        log("liger-kernel unavailable:", exc)
    return impls


def flce_lowmem():
    """The low-memory mode (``mode="lowmem"``, LIGER_COMPAT_FLCE_MODE=lowmem) at the four heads
    and a 32k-token head, in one run with our chunked default, cut-cross-entropy and
    liger-kernel: ms, extra MiB, grad errors against fp32, time relative to ``cce``."""
    mt = RESULTS["meta"].get("matmul_tflops", 797.0)
    for name, (n, hd, v, softcap) in LOWMEM_HEADS.items():
        shape = f"{name} N={n} H={hd} V={v}" + (" softcap=30" if softcap else "")
        log(f"## flce_lowmem: {shape}")
        h, w, t = _flce_inputs(n, hd, v)
        floor = 6 * n * hd * v / (mt * 1e12) * 1e3
        rh, rw, rl = _ref_grads_fp32(h, w, t, softcap)
        steps, extras = {}, {}
        for impl, fn in lowmem_impls(softcap, LOWMEM_CONFIGS).items():
            def step(fn=fn):
                return torch.autograd.grad(fn(h, w, t), (h, w))

            errs = {}
            try:
                loss = fn(h, w, t)
                gh, gw = torch.autograd.grad(loss, (h, w))
                errs.update(gh_err_vs_fp32=rel(gh, rh), gw_err_vs_fp32=rel(gw, rw),
                            loss_absdiff_vs_fp32=abs(loss.item() - rl),
                            finite=bool(torch.isfinite(gh).all() and torch.isfinite(gw).all()))
                del loss, gh, gw
            except Exception as exc:
                errs["check_error"] = f"{type(exc).__name__}: {exc}"[:300]
            steps[impl], extras[impl] = step, errs
        del rh, rw
        gc.collect()
        torch.cuda.empty_cache()
        out = measure_rounds("flce_lowmem", shape, steps, extras, floor_ms=floor)
        cce = out.get("cce")
        for r in RESULTS["rows"]:
            if r.get("section") == "flce_lowmem" and r.get("shape") == shape and r.get("ms") and cce:
                r["x_cce"] = r["ms"] / cce
        save()
        del h, w, t, steps
        gc.collect()
        torch.cuda.empty_cache()


def flce_profile():
    """Time of each step of one chunk at the default budget (where the time goes)."""
    from liger_compat.kernels import _ce_triton
    from liger_compat.kernels import loss as loss_mod
    from liger_compat.kernels.loss import CEOptions

    n, hd, v, _ = HEADS["llama3-8b"]
    h, w, t = _flce_inputs(n, hd, v)
    h, w = h.detach(), w.detach()
    rows = loss_mod._chunk_rows(n, v, hd, 2, "triton", h.device)
    chunks = math.ceil(int((t != -100).sum()) / rows)
    hc, tc = h[:rows], t[:rows]
    buf = torch.empty(rows, v, device="cuda", dtype=torch.bfloat16)
    torch.mm(hc, w.t(), out=buf)
    gh = torch.empty(rows, hd, device="cuda", dtype=torch.bfloat16)
    gw = torch.randn_like(w)
    scale = torch.tensor(1.0 / n, device="cuda")
    opt = CEOptions()
    logits0 = buf.clone()
    steps = {
        "logits mm": lambda: torch.mm(hc, w.t(), out=buf),
        "CE kernel split (stats+grad)": lambda: (buf.copy_(logits0), _ce_triton.ce_rows_triton(buf, tc, opt, scale=scale, grad=buf, variant="split")),
        "CE kernel row (stats+grad)": lambda: (buf.copy_(logits0), _ce_triton.ce_rows_triton(buf, tc, opt, scale=scale, grad=buf, variant="row")),
        "copy of chunk (subtract from CE)": lambda: buf.copy_(logits0),
        "grad_hidden mm": lambda: torch.mm(buf, w, out=gh),
        "grad_weight addmm (bf16 rmw)": lambda: gw.addmm_(buf.t(), hc),
        "grad_weight mm (first chunk, no read)": lambda: torch.mm(buf.t(), hc, out=gw),
    }
    for name, fn in steps.items():
        try:
            ms = bench_ms(fn)
            add(section="flce_profile", shape=f"llama3-8b chunk {rows} rows x{chunks}", impl=name, ms=ms,
                ms_times_chunks=ms * chunks)
        except Exception as exc:
            add(section="flce_profile", shape="llama3-8b", impl=name, error=str(exc)[:300])


#: (head, rows) of the chunk whose matmuls ``flce_gemm`` times (``--gemm-chunk head:rows``)
FLCE_GEMM_CHUNK = ("llama3-8b", 1024)


def flce_gemm():
    """One chunk's matmuls (FLCE_GEMM_CHUNK) against the 8192^3 ceiling: cuBLAS,
    the Triton logits GEMM with the CE statistics in its epilogue (configs), the
    CE passes it replaces, and the whole loss with each choice at every head. (cuBLASLt, two streams
    for the gradient matmuls and a Triton grad_weight kernel were tried here too: NOTES.md.)"""
    from liger_compat.kernels import _ce_triton, _logits_triton, fused_linear_cross_entropy
    from liger_compat.kernels.loss import CEOptions

    name, rows = FLCE_GEMM_CHUNK
    n, hd, v, _ = ALL_HEADS[name]
    h, w, t = _flce_inputs(n, hd, v)
    h, w = h.detach(), w.detach()
    hc, tc = h[:rows].contiguous(), t[:rows]
    buf = torch.empty(rows, v, device="cuda", dtype=torch.bfloat16)
    gh = torch.empty(rows, hd, device="cuda", dtype=torch.bfloat16)
    gw = torch.randn_like(w)
    opt = CEOptions()
    shape = f"{name} chunk {rows} rows"
    mt = RESULTS["meta"].get("matmul_tflops", 797.0)
    ideal = 2 * rows * hd * v / (mt * 1e12) * 1e3

    def rec(impl, fn, **kw):
        try:
            ms = bench_ms(fn)
            add(section="flce_gemm", shape=shape, impl=impl, ms=ms, x_ideal_mm=ms / ideal, **kw)
            return ms
        except Exception as exc:
            add(section="flce_gemm", shape=shape, impl=impl, error=f"{type(exc).__name__}: {exc}"[:300])
            traceback.print_exc()
            return None

    rec("cublas: logits mm", lambda: torch.mm(hc, w.t(), out=buf))
    rec("cublas: grad_hidden mm", lambda: torch.mm(buf, w, out=gh))
    rec("cublas: grad_weight addmm", lambda: gw.addmm_(buf.t(), hc))
    rec("cublas: grad_weight mm", lambda: torch.mm(buf.t(), hc, out=gw))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    rec("cublas: 8192^3", lambda: torch.mm(a, a))
    del a
    torch.mm(hc, w.t(), out=buf)
    logits0 = buf.clone()
    rec("CE: copy of the chunk (subtract)", lambda: buf.copy_(logits0))
    rec("CE: stats+grad from the logits (partial, combine, grad)",
        lambda: (buf.copy_(logits0), _ce_triton.ce_rows_triton(buf, tc, opt, scale=torch.ones((), device="cuda"), grad=buf)))
    parts = _logits_triton.logits_with_partials(hc, w, buf, opt)
    rec("CE: stats+grad from GEMM partials (combine, grad)",
        lambda: (buf.copy_(logits0), _ce_triton.ce_rows_triton(buf, tc, opt, scale=torch.ones((), device="cuda"), grad=buf, partials=parts)))
    # correctness of the Triton GEMM and its partials
    ref = torch.mm(hc, w.t())
    mine = torch.empty_like(ref)
    parts = _logits_triton.logits_with_partials(hc, w, mine, opt)
    st_ref = _ce_triton.ce_rows_triton(ref, tc, opt)
    st_mine = _ce_triton.ce_rows_triton(mine, tc, opt, partials=parts)
    RESULTS["meta"]["triton_logits_check"] = dict(
        logits_rel_err_vs_cublas=rel(mine, ref), lse_maxdiff=(st_mine[2] - st_ref[2]).abs().max().item(),
        loss_maxdiff=(st_mine[0] - st_ref[0]).abs().max().item())
    log("triton logits check", RESULTS["meta"]["triton_logits_check"])
    del ref, mine
    best = None
    for cfg in [(128, 256, 64, 8, 3, False), (128, 256, 64, 8, 4, False), (128, 256, 64, 8, 2, False),
                (128, 128, 64, 8, 4, False), (128, 128, 64, 4, 4, False), (256, 128, 64, 8, 3, False),
                (128, 128, 128, 8, 3, False), (64, 256, 64, 4, 4, False), (128, 256, 64, 8, 3, True),
                (128, 128, 64, 4, 4, True)]:
        ms = rec(f"triton logits+partials {cfg}", lambda cfg=cfg: _logits_triton.logits_with_partials(hc, w, buf, opt, cfg))
        if ms is not None and (best is None or ms < best[0]):
            best = (ms, cfg)
    if best is not None:
        _logits_triton.CONFIG = best[1]
        RESULTS["meta"]["triton_logits_best"] = best[1]
    del gw, buf, gh
    gc.collect()
    torch.cuda.empty_cache()
    # the whole loss under each choice, every head
    floor_of = {}
    for name, (n, hd, v, softcap) in HEADS.items():
        h, w, t = _flce_inputs(n, hd, v)
        floor_of[name] = 6 * n * hd * v / (mt * 1e12) * 1e3
        for logits_impl in ("cublas", "triton"):

            def step():
                return torch.autograd.grad(
                    fused_linear_cross_entropy(h, w, t, softcap=softcap, logits_impl=logits_impl), (h, w))

            measure("flce_gemm_whole", f"{name} N={n} H={hd} V={v}" + (" softcap=30" if softcap else ""),
                    f"liger_compat, logits {logits_impl}", step, floor_ms=floor_of[name])
        del h, w, t


def flce_sweep():
    """Time and memory vs tokens at the Llama-3-8B head (plots)."""
    _, hd, v, _ = HEADS["llama3-8b"]
    for n in (2048, 4096, 8192):
        h, w, t = _flce_inputs(n, hd, v)
        impls = flce_impls(None, False)
        impls.pop("torch.compile", None)
        for impl, fn in impls.items():
            def step(fn=fn):
                return torch.autograd.grad(fn(h, w, t), (h, w))

            measure("flce_sweep", f"N={n} H={hd} V={v}", impl, step, n=n)
        del h, w, t


# ---------------------------------------------------------------------------------------------
# elementwise kernels
# ---------------------------------------------------------------------------------------------


def _hf_rms(x, w, eps=1e-6):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rot_half(x):
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


def _hf_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rot_half(q) * sin, k * cos + _rot_half(k) * sin


def elementwise(which=("rms_norm", "swiglu", "geglu", "rope"), sizes=None, section="elementwise"):
    import liger_compat.kernels as K

    try:
        import liger_kernel.transformers.functional as LF
    except Exception as exc:
        LF = None
        log("liger-kernel unavailable:", exc)
    bw = RESULTS["meta"].get("copy_tbps", 3.0)
    g = torch.Generator(device="cuda").manual_seed(1)
    bf = torch.bfloat16

    def run(kind, shape_label, inputs, impls, grads_of, nbytes, **fields):
        floor = nbytes / (bw * 1e12) * 1e3
        first = impls["torch eager"](*inputs)
        first = first if isinstance(first, tuple) else (first,)
        dys = [torch.randn(o.shape, device="cuda", generator=g, dtype=o.dtype) for o in first]
        del first
        ref = None
        # liger-kernel's rms_norm writes dX over dY (in_place=True, its default): check and time it last
        order = sorted(impls, key=lambda k: k == "liger-kernel")
        steps, extras = {}, {}
        for impl in order:
            fn = impls[impl]
            if fn is None:
                continue

            def step(fn=fn):
                outs = fn(*inputs)
                outs = outs if isinstance(outs, tuple) else (outs,)
                return torch.autograd.grad(outs, grads_of, dys)

            errs = {}
            try:
                res = step()
                if ref is None:
                    ref = res  # eager first: the reference for the others
                else:
                    errs["grad_err_vs_eager"] = max(rel(a, b) for a, b in zip(res, ref))
                del res
            except Exception as exc:
                errs["check_error"] = str(exc)[:300]
            steps[impl], extras[impl] = step, errs
        ref = None
        measure_rounds(section, f"{kind} {shape_label}", steps, extras, preexisting=list(inputs) + dys, graph=True,
                       last=("liger-kernel",), floor_ms=floor, kernel=kind, **fields)

    sizes = sizes or {"rms_norm": [16384], "swiglu": [16384], "geglu": [16384], "rope": [2048, (2048, "transformers")]}
    for kind in [k for k in which if k in sizes]:
        for size in sizes[kind]:
            log(f"## {section}: {kind} {size}")
            if kind == "rms_norm":
                x = torch.randn(size, 4096, device="cuda", generator=g, dtype=bf).requires_grad_(True)
                wt = (torch.rand(4096, device="cuda", generator=g) + 0.5).to(bf).requires_grad_(True)
                impls = {
                    "torch eager": lambda x, w: _hf_rms(x, w),
                    "torch.compile": torch.compile(_hf_rms, dynamic=False),
                    "liger-kernel": (lambda x, w: LF.liger_rms_norm(x, w, 1e-6)) if LF else None,
                    "liger_compat": lambda x, w: K.rms_norm(x, w, 1e-6),
                }
                run(kind, f"{size}x4096", (x, wt), impls, (x, wt), 5 * x.numel() * 2, rows=size)
            elif kind in ("swiglu", "geglu"):
                a = torch.randn(size, 14336, device="cuda", generator=g, dtype=bf).requires_grad_(True)
                b = torch.randn(size, 14336, device="cuda", generator=g, dtype=bf).requires_grad_(True)
                if kind == "swiglu":
                    eager = lambda a, b: F.silu(a) * b  # noqa: E731
                    ours, lig = K.swiglu, (LF.liger_swiglu if LF else None)
                else:
                    eager = lambda a, b: F.gelu(a, approximate="tanh") * b  # noqa: E731
                    ours, lig = K.geglu, (LF.liger_geglu if LF else None)
                impls = {"torch eager": eager, "torch.compile": torch.compile(eager, dynamic=False),
                         "liger-kernel": lig, "liger_compat": ours}
                run(kind, f"{size}x14336", (a, b), impls, (a, b), 8 * a.numel() * 2, rows=size)
            else:  # size: a sequence length, or (length, "transformers") for that layout
                size, layout = (size, "contiguous") if isinstance(size, int) else size
                q = torch.randn(8, 32, size, 128, device="cuda", generator=g, dtype=bf).requires_grad_(True)
                k = torch.randn(8, 8, size, 128, device="cuda", generator=g, dtype=bf).requires_grad_(True)
                if layout == "transformers":  # [B, heads, T, D] views of [B, T, heads, D], as models pass them
                    q = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
                    k = k.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
                inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
                ang = torch.arange(size, device="cuda").float()[:, None] * inv[None]
                ang = torch.cat([ang, ang], -1)[None].expand(8, size, 128)
                cos, sin = ang.cos().to(bf).contiguous(), ang.sin().to(bf).contiguous()
                impls = {
                    "torch eager": lambda q, k: _hf_rope(q, k, cos, sin),
                    "torch.compile": torch.compile(lambda q, k: _hf_rope(q, k, cos, sin), dynamic=False),
                    "liger-kernel": (lambda q, k: LF.liger_rope(q, k, cos, sin)) if LF else None,
                    "liger_compat": lambda q, k: K.apply_rotary_pos_emb(q, k, cos, sin, variant=ROPE_VARIANT),
                }
                nbytes = 4 * (q.numel() + k.numel()) * 2 + 2 * 2 * cos.numel() * 2
                label = f"q[8,32,{size},128] k[8,8,{size},128]"
                if layout == "transformers":
                    label += ", transformers layout"
                run(kind, label, (q, k), impls, (q, k), nbytes, seq=size)
            gc.collect()
            torch.cuda.empty_cache()


def elem_profile():
    """Launch knobs of our RMSNorm and RoPE kernels, timed alone; the fastest become the
    settings for the rest of the run (recorded in meta)."""
    from liger_compat.kernels import _rms_norm_triton as R
    from liger_compat.kernels import _rope_triton as P
    import liger_compat.kernels as K

    g = torch.Generator(device="cuda").manual_seed(3)
    bf = torch.bfloat16
    x = torch.randn(16384, 4096, device="cuda", generator=g, dtype=bf)
    wt = (torch.rand(4096, device="cuda", generator=g) + 0.5).to(bf)
    dy = torch.randn_like(x)
    best_f = best_b = None
    for warps in (4, 8, 16):
        R.FWD_WARPS = warps
        ms = bench_graph_ms(lambda: R.rms_norm_forward_triton(x, wt, 1e-6, 0.0, "llama"))
        add(section="elem_profile", shape="rms_norm fwd 16384x4096", impl=f"fwd warps={warps}", ms=ms)
        best_f = min(best_f or (ms, warps), (ms, warps))
    R.FWD_WARPS = best_f[1]
    _, rstd = R.rms_norm_forward_triton(x, wt, 1e-6, 0.0, "llama")
    for warps in (4, 8, 16):
        for per_sm in (1, 2, 4):
            R.BWD_WARPS, R.BWD_PROGRAMS_PER_SM = warps, per_sm
            ms = bench_graph_ms(lambda: R.rms_norm_backward_triton(dy, x, wt, rstd, 0.0, "llama", True))
            add(section="elem_profile", shape="rms_norm bwd 16384x4096", impl=f"bwd warps={warps} programs/SM={per_sm}", ms=ms)
            best_b = min(best_b or (ms, (warps, per_sm)), (ms, (warps, per_sm)))
    R.BWD_WARPS, R.BWD_PROGRAMS_PER_SM = best_b[1]
    try:
        from liger_kernel.ops.rms_norm import rms_norm_backward, rms_norm_forward

        y, xs, rs, blk, nw, cm = rms_norm_forward(x, wt, 1e-6, 0.0, "llama", None)
        add(section="elem_profile", shape="rms_norm fwd 16384x4096", impl="liger-kernel fwd",
            ms=bench_graph_ms(lambda: rms_norm_forward(x, wt, 1e-6, 0.0, "llama", None)))
        add(section="elem_profile", shape="rms_norm bwd 16384x4096", impl="liger-kernel bwd (not in place)",
            ms=bench_graph_ms(lambda: rms_norm_backward(dy, xs, wt, rs, 0.0, cm, blk, nw, False, None)))
    except Exception as exc:
        add(section="elem_profile", shape="rms_norm 16384x4096", impl="liger-kernel kernels", error=str(exc)[:300])
    RESULTS["meta"]["rms_norm_knobs"] = dict(fwd_warps=best_f[1], bwd=best_b[1])
    del x, dy
    q = torch.randn(8, 32, 2048, 128, device="cuda", generator=g, dtype=bf).requires_grad_(True)
    k = torch.randn(8, 8, 2048, 128, device="cuda", generator=g, dtype=bf).requires_grad_(True)
    ang = torch.rand(8, 2048, 64, device="cuda", generator=g) * 100
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(bf), ang.sin().to(bf)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    best = None

    def set_rope(variant, block=P.FLAT_BLOCK_R, warps=P.FLAT_WARPS):
        global ROPE_VARIANT
        ROPE_VARIANT = variant
        P.FLAT_BLOCK_R, P.FLAT_WARPS = block, warps

    # a wider sweep (the flat kernel's row order x 4/8/16 rows x 1/2/4/8 warps) found heads-first
    # order never faster, 16 rows or 8 warps never the fastest (NOTES.md, RoPE)
    knobs = [("rows",)] + [("flat", br, nw) for br in (4, 8) for nw in (1, 2, 4)]
    compiled = torch.compile(lambda q, k: _hf_rope(q, k, cos, sin), dynamic=False)
    for knob in knobs:
        set_rope(*knob)
        ms = bench_graph_ms(lambda: torch.autograd.grad(K.apply_rotary_pos_emb(q, k, cos, sin, variant=ROPE_VARIANT),
                                                        (q, k), (gq, gk)))
        label = knob[0] if len(knob) == 1 else f"{knob[0]} block={knob[1]} warps={knob[2]}"
        add(section="elem_profile", shape="rope fwd+bwd q[8,32,2048,128]", impl=label, ms=ms)
        best = min(best or (ms, knob), (ms, knob))
    add(section="elem_profile", shape="rope fwd+bwd q[8,32,2048,128]", impl="torch.compile",
        ms=bench_graph_ms(lambda: torch.autograd.grad(compiled(q, k), (q, k), (gq, gk))))
    # the transformers layout: q/k as [B, heads, T, D] views of [B, T, heads, D]
    qt = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
    kt = k.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
    set_rope(*best[1])
    for label, fn in (("liger_compat (best knobs)", lambda: K.apply_rotary_pos_emb(qt, kt, cos, sin, variant=ROPE_VARIANT)),
                      ("torch eager", lambda: _hf_rope(qt, kt, cos, sin)),
                      ("torch.compile", lambda: compiled(qt, kt))):
        ms = bench_graph_ms(lambda: torch.autograd.grad(fn(), (qt, kt), (gq, gk)))
        add(section="elem_profile", shape="rope fwd+bwd, transformers layout", impl=label, ms=ms)
    RESULTS["meta"]["rope_knobs"] = best[1]


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


def _spread(r, digits):
    ts = r.get("ms_rounds") or []
    return f"{min(ts):.{digits}f}-{max(ts):.{digits}f}" if len(ts) > 1 else ""


def _mib(r):
    return f"{r['extra_mib']:.0f}" if r.get("extra_mib") is not None else "-"


def _rows(section):
    return [r for r in RESULTS["rows"] if r.get("section") == section]


def report() -> str:
    m = RESULTS["meta"]
    lines = ([f"regenerate: `{RESULTS['regenerate']}`", ""] if RESULTS.get("regenerate") else []) + [
             "# liger_compat kernel benchmark", "",
             f"device: {m.get('device')}; torch {m.get('torch')}, triton {m.get('triton')}; "
             f"bf16 matmul {m.get('matmul_tflops', 0):.0f} TFLOP/s, copy {m.get('copy_tbps', 0):.2f} TB/s", ""]
    runs = {}
    for r in RESULTS["rows"]:
        if r.get("run"):
            runs.setdefault(r["run"], set()).add(r["section"])
    for run, secs in sorted(runs.items()):
        lines += [f"Sections {', '.join(sorted(secs))} come from {run}, measured separately (its own ceilings "
                  f"set their floors); every ratio compares rows measured together.", ""]
    fl = [r for r in RESULTS["rows"] if r.get("section") in ("flce", "flce_acc", "flce_softcap")]
    if fl:
        lines += ["## Fused linear cross-entropy: correctness (bf16 inputs)", "",
                  "| head | impl | loss diff vs eager | grad_h err vs eager (bf16 mm, fp32 CE) | grad_h err vs fp32 | grad_w err vs fp32 |",
                  "|---|---|---|---|---|---|"]
        for r in fl:
            if "gh_err_vs_eager" in r:
                lines.append(f"| {r['shape']} | {r['impl']} | {r['loss_absdiff_vs_eager']:.2e} | {r['gh_err_vs_eager']:.2e} | "
                             f"{r['gh_err_vs_fp32']:.2e} | {r['gw_err_vs_fp32']:.2e} |")
        lines += ["", "## Fused linear cross-entropy: forward+backward time and extra memory", "",
                  "ms: median of the rounds (each round times every implementation once, order rotated); "
                  "rounds: the fastest and slowest round.", "",
                  "| head | impl | ms | rounds | x floor | x liger_compat | extra MiB |", "|---|---|---|---|---|---|---|"]
        for shape in dict.fromkeys(r["shape"] for r in fl):
            rs = [r for r in fl if r["shape"] == shape]
            ours = next((r.get("ms") for r in rs if r["impl"] == "liger_compat"), None)
            for r in rs:
                if r.get("ms") is None:
                    lines.append(f"| {shape} | {r['impl']} | error: {r.get('error', '')[:80]} | | | | |")
                    continue
                lines.append(f"| {shape} | {r['impl']} | {r['ms']:.2f} | {_spread(r, 2)} | {r['ms'] / r['floor_ms']:.2f} | "
                             f"{r['ms'] / ours if ours else float('nan'):.2f} | {_mib(r)} |")
    lm = _rows("flce_lowmem")
    if lm:
        lines += ["", "## Low-memory fused linear cross-entropy (bf16, forward+backward, 10 % ignored targets)", "",
                  "ms: median of the rounds; x cce: time over cut-cross-entropy's `cce` (gradient filter on) "
                  "measured in the same rounds; errors: norm-relative against the all-fp32 head.", "",
                  "| head | impl | ms | rounds | x cce | x floor | extra MiB | grad_h err vs fp32 | grad_w err vs fp32 |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in lm:
            if r.get("ms") is None:
                lines.append(f"| {r['shape']} | {r['impl']} | error: {r.get('error', '')[:80]} | | | | | | |")
                continue
            xc = r.get("x_cce")
            ge, we = r.get("gh_err_vs_fp32"), r.get("gw_err_vs_fp32")
            lines.append(f"| {r['shape']} | {r['impl']} | {r['ms']:.2f} | {_spread(r, 2)} | "
                         f"{'' if xc is None else f'{xc:.2f}'} | {r['ms'] / r['floor_ms']:.2f} | {_mib(r)} | "
                         f"{'' if ge is None else f'{ge:.2e}'} | {'' if we is None else f'{we:.2e}'} |")
    for sec, title in (("flce_variants", "liger_compat FLCE variants (Llama-3-8B head)"),
                       ("flce_rows", "liger_compat FLCE rows per chunk (config -> rows x chunks)"),
                       ("flce_mib", "liger_compat FLCE at every head: chunk settings"),
                       ("flce_profile", "one chunk, step by step (Llama-3-8B head)"),
                       ("flce_gemm", "one chunk's matmuls: cuBLAS and the Triton logits GEMM"),
                       ("flce_gemm_whole", "the whole loss: cuBLAS logits vs the Triton logits GEMM"),
                       ("elem_profile", "RMSNorm / RoPE launch variants (kernels alone)")):
        rs = _rows(sec)
        if rs:
            lines += ["", f"## {title}", "", "| config | ms | extra MiB | x floor |", "|---|---|---|---|"]
            for r in rs:
                if r.get("ms") is None:
                    lines.append(f"| {r['shape']} {r['impl']} | error | | |")
                elif sec == "elem_profile":
                    lines.append(f"| {r['shape']}: {r['impl']} | {r['ms']:.3f} | | |")
                elif sec == "flce_profile":
                    lines.append(f"| {r['impl']} ({r['shape']}) | {r['ms']:.3f} (x chunks: {r['ms_times_chunks']:.2f}) | | |")
                elif sec == "flce_gemm":
                    lines.append(f"| {r['impl']} ({r['shape']}) | {r['ms']:.3f} (x ideal matmul: {r['x_ideal_mm']:.2f}) | | |")
                elif sec in ("flce_rows", "flce_gemm_whole", "flce_mib"):
                    lines.append(f"| {r['shape']}: {r['impl']} | {r['ms']:.2f} | {_mib(r)} | {r['ms'] / r['floor_ms']:.2f} |")
                else:
                    lines.append(f"| {r['shape']} | {r['ms']:.2f} | {_mib(r)} | {r['ms'] / r['floor_ms']:.2f} |")
    lp = _rows("logprob")
    if lp:
        lines += ["", "## Fused log-prob head (trl's add_fused_lm_head scoring): forward+backward, bf16, 10 % ignored", "",
                  "floor: 3 matmuls for the SFT loss, 4 with per-token weights, at the measured matmul rate; "
                  "x trl: time / trl head's time on the same rows; errors vs an fp32 head for the SFT loss.", "",
                  "| head | impl | ms | x floor | x trl head | extra MiB | grad_h err vs fp32 | grad_w err vs fp32 |",
                  "|---|---|---|---|---|---|---|---|"]
        for shape in dict.fromkeys(r["shape"] for r in lp):
            rs = [r for r in lp if r["shape"] == shape]
            trl = next((r.get("ms") for r in rs if r["impl"] == "trl head"), None)
            for r in rs:
                if r.get("ms") is None:
                    lines.append(f"| {shape} | {r['impl']} | error: {r.get('error', '')[:80]} | | | | | |")
                    continue
                ge = (f"{r['gh_err_vs_fp32']:.2e} | {r['gw_err_vs_fp32']:.2e}" if "gh_err_vs_fp32" in r else " | ")
                lines.append(f"| {shape} | {r['impl']} | {r['ms']:.2f} | {r['ms'] / r['floor_ms']:.2f} | "
                             f"{r['ms'] / trl if trl else float('nan'):.2f} | {_mib(r)} | {ge} |")
    el = _rows("elementwise")
    if el:
        lines += ["", "## RMSNorm, SwiGLU, GeGLU, RoPE (bf16, forward+backward)", "",
                  "GPU ms: CUDA-graph replay (kernel time alone), median of the rounds; rounds: the fastest and "
                  "slowest; eager ms: ordinary launches from Python (first round).", "",
                  "| kernel | impl | GPU ms | rounds | eager ms | x bandwidth floor | x liger_compat | extra MiB | grad err vs eager |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for shape in dict.fromkeys(r["shape"] for r in el):
            rs = [r for r in el if r["shape"] == shape]
            ours = next((r.get("ms") for r in rs if r["impl"] == "liger_compat"), None)
            for r in rs:
                if r.get("ms") is None:
                    lines.append(f"| {shape} | {r['impl']} | error: {r.get('error', '')[:80]} | | | | | | |")
                    continue
                ge = r.get("grad_err_vs_eager")
                le = r.get("ms_eager_launch")
                lines.append(f"| {shape} | {r['impl']} | {r['ms']:.3f} | {_spread(r, 3)} | {'' if le is None else f'{le:.3f}'} | "
                             f"{r['ms'] / r['floor_ms']:.2f} | {r['ms'] / ours if ours else float('nan'):.2f} | {_mib(r)} | "
                             f"{'' if ge is None else f'{ge:.1e}'} |")
    return "\n".join(lines) + "\n"


def plots(path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        log("matplotlib missing, no plots:", exc)
        return
    data = json.loads(path.read_text())
    rows = data["rows"]
    for sec, xkey, title in (("flce_sweep", "n", "FLCE, Llama-3-8B head: tokens"),
                             ("elementwise_sweep", None, "elementwise kernels")):
        rs = [r for r in rows if r.get("section") == sec and r.get("ms") is not None]
        if not rs:
            continue
        groups = {}
        for r in rs:
            kind = r.get("kernel", "flce")
            groups.setdefault(kind, []).append(r)
        for kind, krs in groups.items():
            x_key = xkey or ("seq" if kind == "rope" else "rows")
            fig, axes = plt.subplots(1, 2, figsize=(10, 4))
            for impl in dict.fromkeys(r["impl"] for r in krs):
                pts = sorted((r[x_key], r["ms"], r["extra_mib"]) for r in krs if r["impl"] == impl)
                axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
                axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=impl)
            axes[0].set_xlabel(x_key); axes[0].set_ylabel("fwd+bwd ms (median)")
            axes[1].set_xlabel(x_key); axes[1].set_ylabel("extra peak MiB")
            axes[1].set_yscale("symlog")
            axes[0].legend()
            fig.suptitle(f"{title}: {kind}" if kind != "flce" else title)
            fig.tight_layout()
            fig.savefig(path.parent / f"{path.stem}_{sec}_{kind}.png", dpi=110)
            plt.close(fig)
            log("plot", path.parent / f"{path.stem}_{sec}_{kind}.png")


SECTIONS = {
    "ceilings": ceilings,
    "logprob": lambda: logprob(),
    "flce": lambda: flce(),
    "softcap": lambda: flce(("gemma2-9b-softcap",), section="flce_softcap"),
    "acc": lambda: flce(("llama3-8b",), acc_variants=(True,), section="flce_acc"),
    "variants": flce_variants,
    "lowmem": flce_lowmem,
    "flce_lowmem": flce_lowmem,
    "flce_mib": flce_mib,
    "elem_profile": elem_profile,
    "profile": flce_profile,
    "norm": lambda: elementwise(),
    "flce_sweep": flce_sweep,
    "flce_rows": flce_rows,
    "flce_gemm": flce_gemm,
    "elementwise_sweep": lambda: elementwise(
        sizes={"rms_norm": [2048, 8192, 32768], "swiglu": [2048, 8192, 16384],
               "rope": [1024, 2048, 4096]},
        section="elementwise_sweep"),
}


def main(argv=None):
    global OUT, NAME, FLCE_CHUNK_SETTINGS, FLCE_MIB_HEADS, FLCE_GEMM_CHUNK, ROUNDS, LOWMEM_CONFIGS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--sections", default="ceilings,elem_profile,norm,profile,variants,flce,softcap,acc,lowmem,flce_sweep,elementwise_sweep")
    p.add_argument("--name", default=NAME, help="result files <name>.json, <name>.md, <name>_*.png")
    p.add_argument("--plot", help="only draw plots from this kernels.json")
    p.add_argument("--merge", nargs="*", help="earlier kernels.json files whose rows to keep")
    p.add_argument("--flce-chunks", help="chunk settings for the flce_mib section, e.g. mib:512,rows:2048")
    p.add_argument("--flce-mib-heads", help=f"heads for the flce_mib section (of {', '.join(ALL_HEADS)})")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help=f"timing rounds of the flce/softcap/acc and elementwise sections (default {ROUNDS})")
    p.add_argument("--gemm-chunk", help="head:rows of the chunk the flce_gemm section times (default llama3-8b:1024)")
    p.add_argument("--lowmem-configs",
                   help="tile configurations of the low-memory kernels that the flce_lowmem section also times "
                        "(comma-separated names of liger_compat.kernels._lowmem_triton.CONFIGS, or 'all')")
    args = p.parse_args(argv)
    if args.plot:
        plots(Path(args.plot))
        return 0
    # every argument checked before any module setting changes
    chunks = tuple(args.flce_chunks.split(",")) if args.flce_chunks else FLCE_CHUNK_SETTINGS
    bad = []
    for x in chunks:
        try:
            _chunk_setting(x)
        except ValueError:
            bad.append(x)
    if bad:
        p.error(f"--flce-chunks: {', '.join(map(repr, bad))} not understood; use default, mib:N or rows:N "
                "with N a positive number (rows: a whole number)")
    heads = tuple(args.flce_mib_heads.split(",")) if args.flce_mib_heads else FLCE_MIB_HEADS
    unknown = sorted(set(heads) - set(ALL_HEADS))
    if unknown:
        p.error(f"--flce-mib-heads: unknown {', '.join(unknown)}; choose from {', '.join(ALL_HEADS)}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    gemm_chunk = FLCE_GEMM_CHUNK
    if args.gemm_chunk:
        head, _, rows = args.gemm_chunk.partition(":")
        if head not in ALL_HEADS or not rows.isdigit() or int(rows) < 1:
            p.error(f"--gemm-chunk must be head:rows with a head of {', '.join(ALL_HEADS)}, got {args.gemm_chunk!r}")
        gemm_chunk = (head, int(rows))
    lowmem_configs = LOWMEM_CONFIGS
    if args.lowmem_configs:
        from liger_compat.kernels._lowmem_triton import CONFIGS

        names = [c for c in CONFIGS if c != "interpret"]
        chosen = (names + list(LOWMEM_PAIRS) if args.lowmem_configs.strip() == "all"
                  else [x.strip() for x in args.lowmem_configs.split(",") if x.strip()])
        unknown = [x for x in chosen if not x.split("/")[0] in names or not x.split("/")[-1] in names or x.count("/") > 1]
        if unknown or not chosen:
            p.error(f"--lowmem-configs: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
                    f"choose from {', '.join(names)}, FORWARD/BACKWARD pairs of them, or 'all'")
        lowmem_configs = tuple(chosen)
    unknown = [x for x in args.sections.split(",") if x not in SECTIONS]
    if unknown:
        p.error(f"--sections: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(SECTIONS)}")
    OUT, NAME, FLCE_CHUNK_SETTINGS, FLCE_MIB_HEADS, ROUNDS, FLCE_GEMM_CHUNK, LOWMEM_CONFIGS = (
        Path(args.out), args.name, chunks, heads, args.rounds, gemm_chunk, lowmem_configs)
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to benchmark")
        return 1
    import triton

    from . import _results

    RESULTS["regenerate"] = _results.command("benchmarks.kernels", sys.argv[1:] if argv is None else argv)
    RESULTS["meta"].update(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           date=time.strftime("%Y-%m-%d %H:%M"))
    sections = args.sections.split(",")
    rerun = {"norm": "elementwise", "elementwise_sweep": "elementwise_sweep", "elem_profile": "elem_profile",
             "flce": "flce", "softcap": "flce_softcap", "acc": "flce_acc", "lowmem": "flce_lowmem",
             "flce_lowmem": "flce_lowmem",
             "variants": "flce_variants", "profile": "flce_profile", "flce_sweep": "flce_sweep",
             "flce_rows": "flce_rows", "flce_gemm": "flce_gemm", "flce_mib": "flce_mib", "logprob": "logprob"}
    for m in args.merge or []:
        old = json.loads(Path(m).read_text())
        skip = {rerun[x] for x in sections if x in rerun}
        kept = [dict(r, run=r.get("run", Path(m).name)) for r in old["rows"] if r.get("section") not in skip]
        RESULTS["rows"] += kept
        RESULTS["meta"].setdefault("merged_from", []).append(
            dict(file=Path(m).name, date=old["meta"].get("date"), matmul_tflops=old["meta"].get("matmul_tflops")))
    torch._dynamo.config.cache_size_limit = 64
    for name in sections:
        t0 = time.time()
        try:
            SECTIONS[name]()
        except Exception:
            traceback.print_exc()
        log(f"[section {name} took {time.time() - t0:.0f} s]")
        save()
        (OUT / f"{NAME}.md").write_text(report())
    if "ceilings" in sections:
        ceilings_end()
        save()
    md = report()
    (OUT / f"{NAME}.md").write_text(md)
    plots(OUT / f"{NAME}.json")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
