"""Kernel benchmark sections ``profile``, ``flce_gemm`` and ``flce_sweep``: where the fused loss's
time goes, its cuBLAS shapes, and its time over a sweep of rows."""

from __future__ import annotations

import gc
import math
import traceback

import torch

from . import kernels_common as C
from .kernels_common import add, bench_ms, log, measure, rel
from .kernels_flce import ALL_HEADS, HEADS, _flce_inputs, flce_impls


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
    mt = C.RESULTS["meta"].get("matmul_tflops", 797.0)
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
    stored0 = buf.clone()  # as the GEMM stores them (tile-relative where shifted), for its partials
    rec("CE: stats+grad from GEMM partials (combine, grad)",
        lambda: (buf.copy_(stored0), _ce_triton.ce_rows_triton(buf, tc, opt, scale=torch.ones((), device="cuda"), grad=buf, partials=parts)))
    del stored0
    # correctness of the Triton GEMM and its partials
    ref = torch.mm(hc, w.t())
    mine = torch.empty_like(ref)
    parts = _logits_triton.logits_with_partials(hc, w, mine, opt)
    st_ref = _ce_triton.ce_rows_triton(ref, tc, opt)
    st_mine = _ce_triton.ce_rows_triton(mine, tc, opt, partials=parts)
    C.RESULTS["meta"]["triton_logits_check"] = dict(
        logits_rel_err_vs_cublas=rel(_logits_triton.absolute_logits(mine, parts), ref), lse_maxdiff=(st_mine[2] - st_ref[2]).abs().max().item(),
        loss_maxdiff=(st_mine[0] - st_ref[0]).abs().max().item())
    log("triton logits check", C.RESULTS["meta"]["triton_logits_check"])
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
        C.RESULTS["meta"]["triton_logits_best"] = best[1]
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
