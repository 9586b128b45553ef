"""Kernel benchmark section ``lowmem`` (``flce_lowmem``): the low-memory mode of the fused loss at
the four heads and a 32k-token head, beside the chunked default, cut-cross-entropy and liger-kernel."""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F

from . import kernels_common as C
from .kernels_common import log, measure_rounds, rel, save
from .kernels_flce import HEADS, _flce_inputs


#: heads of the ``flce_lowmem`` section: the four HEADS and a 32k-token Llama-3-8B head
LOWMEM_HEADS = {**HEADS, "llama3-8b-32k": (32768, 4096, 128256, None)}
#: tile configurations of the low-memory kernels that ``flce_lowmem`` also times (``--lowmem-configs``)
LOWMEM_CONFIGS: tuple[str, ...] = ()
#: forward/backward pairs that ``--lowmem-configs all`` adds to the single configurations
LOWMEM_PAIRS = ("m128n128k64w8s3/m128n256k32w8s4", "m128n128k64w8s3/m128n64k64w4s4", "m128n64k64w4s4/m128n128k64w8s3")


def _ref_grads_fp32(h, w, t, softcap, rows=4096, peaked_p=None):
    """grad_hidden, grad_weight and loss of the all-fp32 LM head (mean over non-ignored rows),
    in chunks of ``rows`` so that the 32k-token head's fp32 logits need not exist at once. With
    ``peaked_p``, also the indices of the kept rows whose target has fp32 softmax probability
    ``>= peaked_p`` (``exp(-row loss)``)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        w32 = w.detach().float().requires_grad_(True)
        n_valid = max(int((t != -100).sum()), 1)
        gh = torch.empty(h.shape, dtype=torch.float32, device=h.device)
        gw = torch.zeros_like(w32)
        total = 0.0
        peaked = []
        for s in range(0, h.shape[0], rows):
            hc = h[s:s + rows].detach().float().requires_grad_(True)
            tc = t[s:s + rows]
            z = hc @ w32.t()
            if softcap is not None:
                z = softcap * torch.tanh(z / softcap)
            row_loss = F.cross_entropy(z, tc, ignore_index=-100, reduction="none")
            loss = row_loss.sum() / n_valid
            a, b = torch.autograd.grad(loss, (hc, w32))
            gh[s:s + rows] = a
            gw += b
            total += loss.item()
            if peaked_p is not None:
                hit = (tc != -100) & (torch.exp(-row_loss.detach()) >= peaked_p)
                peaked.append(hit.nonzero().squeeze(1) + s)
            del z, loss, row_loss, a, b, hc
        if peaked_p is not None:
            return gh, gw, total, torch.cat(peaked)
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
    mt = C.RESULTS["meta"].get("matmul_tflops", 797.0)
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
        for r in C.RESULTS["rows"]:
            if r.get("section") == "flce_lowmem" and r.get("shape") == shape and r.get("ms") and cce:
                r["x_cce"] = r["ms"] / cce
        save()
        del h, w, t, steps
        gc.collect()
        torch.cuda.empty_cache()
