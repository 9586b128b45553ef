"""Kernel benchmark sections of the fused linear cross-entropy: ``flce`` (with ``softcap`` and
``acc``) against its peers, ``flce_rows``, ``variants`` and ``flce_mib`` (chunk settings)."""

from __future__ import annotations

import gc
import math

import torch
import torch.nn.functional as F

from . import kernels_common as C
from .kernels_common import log, measure, measure_rounds, rel


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
    mt = C.RESULTS["meta"].get("matmul_tflops", 797.0)
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

    mt = C.RESULTS["meta"].get("matmul_tflops", 797.0)
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
    mt = C.RESULTS["meta"].get("matmul_tflops", 797.0)
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

    mt = C.RESULTS["meta"].get("matmul_tflops", 797.0)
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
