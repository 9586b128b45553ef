"""Kernel benchmark section ``logprob``: the fused log-prob heads (trl's ``add_fused_lm_head``
scoring) against trl's chunked head."""

from __future__ import annotations

import gc

import torch

from . import kernels_common as C
from .kernels_common import log, measure_rounds, rel
from .kernels_flce import HEADS, _flce_inputs, _ref_grads


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
    mt = C.RESULTS["meta"].get("matmul_tflops", 797.0)
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
