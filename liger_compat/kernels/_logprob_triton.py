"""Triton row kernels of the fused linear log-probabilities (``logprob.py``).

A chunk's logits ``x[C, V]`` (as stored, in the input dtype) are read in blocks of ``BLOCK_V``
by ``(row, block)`` programs and transformed in fp32 on load:
``z = softcap * tanh(x * logit_scale / softcap) / temperature`` (the softcap only when given).

* statistics: per (row, block) partials: max ``m``, ``sum exp(z - m)``, ``sum exp(z - m) * z``
  (entropy), ``sum exp(2 (z - m))`` (``log sum p^2``), ``sum z`` (mean logit) and the block's
  argmax (first index on ties); one program per row folds them into the row's log-sum-exp,
  the target's log-prob, entropy, ``log sum p^2``, mean logit and whether the target is the
  (first) argmax. Rows whose target is ``ignore_index`` get zeros. With the rows' hidden states
  and the weight (``head``), the target's logit is taken in fp32 from them instead of as stored,
  and its term in those sums replaced: a 16-bit store loses up to 2^-9 of it (0.06 at a logit of
  30), which is most of the log-prob's error wherever the row's mass is spread over many tokens
  (the other logits' roundings average out in the log-sum-exp).
* gradient: each (row, block) program overwrites its block (in place when ``grad`` is the
  logits) with ``d / dx`` of ``g_lp * log p_target + g_ent * entropy`` for per-row upstream
  gradients ``g_lp``, ``g_ent`` (either may be absent):
  ``dz_j = g_lp (1[j = t] - p_j) - g_ent p_j (log p_j + H)``, then the chain rule through the
  temperature, the softcap (``1 - tanh^2``) and the logit scale.
"""

from __future__ import annotations

import torch

from ._ce_triton import _tanh, _target_logit, head_launch_args
from ._dispatch import triton, tl, cdiv, next_pow2

__all__ = ["lp_rows_triton"]


@triton.jit
def _transform(x, logit_scale, softcap, inv_t, HAS_SOFTCAP: tl.constexpr):
    y = x * logit_scale
    if HAS_SOFTCAP:
        y = softcap * _tanh(y / softcap)
    return y * inv_t


@triton.jit
def _lp_partial_kernel(
    logits_ptr, stride_l, pm_ptr, ps_ptr, pxs_ptr, psq_ptr, pz_ptr, pi_ptr, NB, V,
    logit_scale, softcap, inv_t,
    HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_SQ: tl.constexpr, HAS_MEAN: tl.constexpr,
    HAS_TOP1: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    x = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=0.0).to(tl.float32)
    z0 = tl.where(mask, _transform(x, logit_scale, softcap, inv_t, HAS_SOFTCAP), 0.0)
    z = tl.where(mask, z0, float("-inf"))
    bm = tl.max(z, axis=0)
    e = tl.where(mask, tl.exp(z - bm), 0.0)
    out = row * NB + blk
    tl.store(pm_ptr + out, bm)
    tl.store(ps_ptr + out, tl.sum(e, axis=0))
    if HAS_ENTROPY:
        tl.store(pxs_ptr + out, tl.sum(e * z0, axis=0))
    if HAS_SQ:
        tl.store(psq_ptr + out, tl.sum(e * e, axis=0))
    if HAS_MEAN:
        tl.store(pz_ptr + out, tl.sum(z0, axis=0))
    if HAS_TOP1:
        tl.store(pi_ptr + out, tl.argmax(z, axis=0).to(tl.int32) + blk * BLOCK_V)


@triton.jit
def _lp_combine_kernel(
    logits_ptr, stride_l, target_ptr, pm_ptr, ps_ptr, pxs_ptr, psq_ptr, pz_ptr, pi_ptr, NB,
    lp_ptr, ent_ptr, sq_ptr, mean_ptr, top1_ptr, lse_ptr,
    V, ignore_index, logit_scale, softcap, inv_t, h_ptr, stride_h, w_ptr, stride_w, b_ptr, H,
    HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_SQ: tl.constexpr, HAS_MEAN: tl.constexpr,
    HAS_TOP1: tl.constexpr, BLOCK_NB: tl.constexpr, HAS_HEAD: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tgt = tl.load(target_ptr + row).to(tl.int64)
    valid = (tgt != ignore_index) & (tgt >= 0) & (tgt < V)
    tgt_safe = tl.where(valid, tgt, 0)
    base = row * NB
    m = tl.zeros([], tl.float32) - float("inf")
    s = tl.zeros([], tl.float32)
    xs = tl.zeros([], tl.float32)
    sq = tl.zeros([], tl.float32)
    zs = tl.zeros([], tl.float32)
    best = tl.zeros([], tl.float32) - float("inf")
    best_blk = tl.zeros([], tl.int64)
    for start in range(0, NB, BLOCK_NB):
        nbs = start + tl.arange(0, BLOCK_NB)
        nmask = nbs < NB
        pm = tl.load(pm_ptr + base + nbs, mask=nmask, other=float("-inf"))
        ps = tl.load(ps_ptr + base + nbs, mask=nmask, other=0.0)
        bm = tl.max(pm, axis=0)
        m_new = tl.maximum(m, bm)
        r = tl.exp(m - m_new)
        f = tl.where(nmask, tl.exp(pm - m_new), 0.0)
        s = s * r + tl.sum(ps * f, axis=0)
        if HAS_ENTROPY:
            pxs = tl.load(pxs_ptr + base + nbs, mask=nmask, other=0.0)
            xs = xs * r + tl.sum(pxs * f, axis=0)
        if HAS_SQ:
            psq = tl.load(psq_ptr + base + nbs, mask=nmask, other=0.0)
            sq = sq * r * r + tl.sum(psq * f * f, axis=0)
        if HAS_MEAN:
            zs += tl.sum(tl.load(pz_ptr + base + nbs, mask=nmask, other=0.0), axis=0)
        if HAS_TOP1:
            bi = tl.argmax(pm, axis=0).to(tl.int64) + start  # first block on ties
            take = bm > best
            best_blk = tl.where(take, bi, best_blk)
            best = tl.where(take, bm, best)
        m = m_new
    xt = tl.load(logits_ptr + row * stride_l + tgt_safe).to(tl.float32)
    zt = _transform(xt, logit_scale, softcap, inv_t, HAS_SOFTCAP)
    if HAS_HEAD:  # the target's logit in fp32 from its hidden row and weight row, its terms replaced
        xe = _target_logit(row, tgt_safe, h_ptr, stride_h, w_ptr, stride_w, b_ptr, H, HAS_BIAS, BLOCK_H)
        ze = _transform(xe, logit_scale, softcap, inv_t, HAS_SOFTCAP)
        er = tl.exp(zt - m)
        ee = tl.exp(ze - m)
        s = tl.where(valid, tl.maximum(s - er + ee, ee), s)  # the other terms are >= 0
        if HAS_ENTROPY:
            xs = tl.where(valid, xs - er * zt + ee * ze, xs)
        if HAS_SQ:
            sq = tl.where(valid, tl.maximum(sq - er * er + ee * ee, ee * ee), sq)
        if HAS_MEAN:
            zs = tl.where(valid, zs - zt + ze, zs)
        zt = tl.where(valid, ze, zt)
    lse = m + tl.log(s)
    tl.store(lp_ptr + row, tl.where(valid, zt - lse, 0.0))
    tl.store(lse_ptr + row, lse)
    if HAS_ENTROPY:
        tl.store(ent_ptr + row, tl.where(valid, lse - xs / s, 0.0))
    if HAS_SQ:
        tl.store(sq_ptr + row, tl.where(valid, tl.log(sq) - 2.0 * tl.log(s), 0.0))
    if HAS_MEAN:
        tl.store(mean_ptr + row, tl.where(valid, zs / V, 0.0))
    if HAS_TOP1:
        best_idx = tl.load(pi_ptr + base + best_blk).to(tl.int64)
        tl.store(top1_ptr + row, (valid & (best_idx == tgt)).to(tl.int8))


@triton.jit
def _lp_grad_kernel(
    logits_ptr, stride_l, grad_ptr, stride_g, target_ptr, lse_ptr, ent_ptr, glp_ptr, stride_glp, gent_ptr,
    rest_ptr, xt_ptr, V, ignore_index, logit_scale, softcap, inv_t,
    HAS_SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Each (row, block of V) program writes its block of the gradient, adds the block's softmax
    mass outside the target to ``rest_ptr[row]`` and keeps the target's logit in ``xt_ptr[row]``:
    :func:`_lp_target_grad_kernel` then writes the target's entry from them."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    tgt = tl.load(target_ptr + row).to(tl.int64)
    valid = (tgt != ignore_index) & (tgt >= 0) & (tgt < V)
    cols = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    x = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * logit_scale
    if HAS_SOFTCAP:
        t = _tanh(y / softcap)
        z = softcap * t * inv_t
    else:
        z = y * inv_t
    log_p = z - tl.load(lse_ptr + row)
    p = tl.exp(log_p)
    d = tl.zeros([BLOCK_V], tl.float32)
    if HAS_GLP:
        g = tl.load(glp_ptr + row * stride_glp).to(tl.float32)
        d += g * (tl.where(cols == tgt, 1.0, 0.0) - p)
    if HAS_GENT:
        g2 = tl.load(gent_ptr + row).to(tl.float32)
        d -= g2 * p * (log_p + tl.load(ent_ptr + row))
    d = d * inv_t
    if HAS_SOFTCAP:
        d = d * (1.0 - t * t)
    d = tl.where(valid, d * logit_scale, 0.0)
    if HAS_GLP:
        is_t = cols == tgt
        tl.atomic_add(rest_ptr + row, tl.sum(tl.where(mask & (~is_t), p, 0.0), axis=0), sem="relaxed")
        tl.store(xt_ptr + row, tl.sum(tl.where(is_t, x, 0.0), axis=0),
                 mask=valid & (tgt >= blk * BLOCK_V) & (tgt < blk * BLOCK_V + BLOCK_V))
    tl.store(grad_ptr + row * stride_g + cols, d.to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lp_target_grad_kernel(
    grad_ptr, stride_g, target_ptr, lse_ptr, ent_ptr, glp_ptr, stride_glp, gent_ptr, rest_ptr, xt_ptr,
    V, ignore_index, logit_scale, softcap, inv_t,
    HAS_SOFTCAP: tl.constexpr, HAS_GENT: tl.constexpr,
):
    """The target's entry of each row's gradient, its ``1 - p_t`` formed as the row's softmax mass
    outside the target (precise where ``p_t`` is near 1, unlike ``1 - exp(log p_t)``)."""
    row = tl.program_id(0).to(tl.int64)
    tgt = tl.load(target_ptr + row).to(tl.int64)
    valid = (tgt != ignore_index) & (tgt >= 0) & (tgt < V)
    y = tl.load(xt_ptr + row) * logit_scale
    if HAS_SOFTCAP:
        t = _tanh(y / softcap)
        z = softcap * t * inv_t
    else:
        z = y * inv_t
    d = tl.load(glp_ptr + row * stride_glp).to(tl.float32) * tl.load(rest_ptr + row)
    if HAS_GENT:
        log_p = z - tl.load(lse_ptr + row)
        d -= tl.load(gent_ptr + row).to(tl.float32) * tl.exp(log_p) * (log_p + tl.load(ent_ptr + row))
    d = d * inv_t
    if HAS_SOFTCAP:
        d = d * (1.0 - t * t)
    tl.store(grad_ptr + row * stride_g + tl.where(valid, tgt, 0), (d * logit_scale).to(grad_ptr.dtype.element_ty),
             mask=valid)


#: block of V per program on CUDA
BLOCK_V_CUDA = 4096


def _block(v: int, device: torch.device) -> tuple[int, int]:
    block = BLOCK_V_CUDA if device.type == "cuda" else 256
    return min(block, next_pow2(v)), (8 if device.type == "cuda" else 1)


def lp_rows_triton(logits, target, opt, *, grad=None, g_lp=None, g_ent=None, lse=None, entropy=None, head=None,
                   out=None):
    """Same contract as :func:`liger_compat.kernels.logprob.lp_rows_torch`; ``out`` (with the
    statistics): ``(log_probs, entropy, log_sum_sq, mean_logits, is_top1, lse)``, the chunk's rows of
    the caller's buffers (fp32, ``is_top1`` bool; ``None`` for a field not asked for), which the
    combine launch writes instead of new tensors."""
    c, v = logits.shape
    dev = logits.device
    f32 = torch.float32
    assert logits.stride(-1) == 1
    target = target.contiguous()
    block, warps = _block(v, dev)
    nb = cdiv(v, block)
    common = dict(HAS_SOFTCAP=opt.softcap is not None)
    scal = (opt.logit_scale, opt.softcap if opt.softcap is not None else 1.0, opt.inv_t)
    stats = None
    if lse is None:
        if out is None:
            new = lambda dtype=f32: torch.empty(c, dtype=dtype, device=dev)  # noqa: E731
            out = (new(), new() if opt.entropy else None, new() if opt.log_sum_sq else None,
                   new() if opt.mean_logits else None, new(torch.bool) if opt.is_top1 else None, new())
        lp, ent, sq, mean, top1, lse = out
        # a field not asked for: its pointer is the log-probs' (the kernel does not write it)
        ent = ent if opt.entropy else lp
        sq = sq if opt.log_sum_sq else lp
        mean = mean if opt.mean_logits else lp
        top1 = top1.view(torch.int8) if opt.is_top1 else lp
        if c:
            pm = torch.empty((c, nb), dtype=f32, device=dev)
            ps = torch.empty_like(pm)
            pxs = torch.empty_like(pm) if opt.entropy else pm
            psq = torch.empty_like(pm) if opt.log_sum_sq else pm
            pz = torch.empty_like(pm) if opt.mean_logits else pm
            pi = torch.empty((c, nb), dtype=torch.int32, device=dev) if opt.is_top1 else pm
            flags = dict(HAS_ENTROPY=opt.entropy, HAS_SQ=opt.log_sum_sq, HAS_MEAN=opt.mean_logits,
                         HAS_TOP1=opt.is_top1, **common)
            _lp_partial_kernel[(c, nb)](
                logits, logits.stride(0), pm, ps, pxs, psq, pz, pi, nb, v, *scal,
                BLOCK_V=block, num_warps=warps, **flags,
            )
            head_args, head_flags = head_launch_args(head, logits)
            _lp_combine_kernel[(c,)](
                logits, logits.stride(0), target, pm, ps, pxs, psq, pz, pi, nb,
                lp, ent, sq, mean, top1, lse, v, opt.ignore_index, *scal, *head_args,
                BLOCK_NB=min(next_pow2(nb), 1024), num_warps=4 if dev.type == "cuda" else 1, **flags, **head_flags,
            )
        stats = (
            lp,
            ent if opt.entropy else None,
            sq if opt.log_sum_sq else None,
            mean if opt.mean_logits else None,
            top1.view(torch.bool) if opt.is_top1 else None,
            lse,
        )
        if opt.entropy:
            entropy = ent
    if grad is not None and c:
        assert grad.stride(-1) == 1
        if g_lp is not None:
            g_lp = g_lp.to(f32)
            stride_glp = 0 if g_lp.dim() == 0 else g_lp.stride(0)
        else:
            stride_glp = 0
        if g_ent is not None:
            g_ent = g_ent.to(f32).contiguous()
        rest = torch.zeros((2, c), dtype=f32, device=dev) if g_lp is not None else lse
        args = (target, lse, entropy if entropy is not None else lse, g_lp if g_lp is not None else lse, stride_glp,
                g_ent if g_ent is not None else lse, rest[0], rest[1], v, opt.ignore_index, *scal)
        _lp_grad_kernel[(c, nb)](
            logits, logits.stride(0), grad, grad.stride(0), *args,
            HAS_GLP=g_lp is not None, HAS_GENT=g_ent is not None, BLOCK_V=block, num_warps=warps, **common,
        )
        if g_lp is not None:
            _lp_target_grad_kernel[(c,)](grad, grad.stride(0), *args, HAS_GENT=g_ent is not None, num_warps=1,
                                         **common)
    return stats
