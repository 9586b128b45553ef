"""Triton row kernel of the (fused linear) cross-entropy: one pass for the statistics, one for
the gradient, written in place over the logits when asked.

Per row of ``logits[C, V]`` (read in blocks of ``BLOCK_V``, computed in fp32):

* pass 1 (``STATS``): online max / sum-exp -> ``lse``; the target logit; the running argmax
  (first index on ties, like ``torch.argmax``) for token accuracy; the row sum for label
  smoothing; softcap ``c * tanh(z / c)`` applied on load;
* pass 2 (``GRAD``): ``scale_row * d loss_row / d logits`` =
  ``(softmax * (1 + 2 s lse) - eps / V - (1 - eps) * onehot) * (1 - tanh^2 if softcap)``,
  stored in the gradient's dtype (bf16 in the fused loss, over the logits themselves); the
  target's own entry ``p_t - 1`` is formed as minus the row's softmax mass outside the target,
  which keeps its precision in rows where ``p_t`` is close to 1; on request the part of that entry
  its bf16 rounding loses is written out, times the target's weight row, in fp32 (the fused loss
  adds it to grad_hidden before that is rounded: the exact-target correction).

The "split" variant (default on CUDA) does the same in three launches over (row, block of V)
programs: per-block partials (max, sum-exp, argmax, row sum), a per-row combine into the
statistics, and the gradient. The partials may instead come from the epilogue of the logits
GEMM (``_logits_triton.py``), which saves the first launch's read of the logits.

Targets outside ``[0, V)`` that are not ``ignore_index`` never address memory: the row's loss
is NaN, its gradient zero, and the statistics pass (row kernel, or the split variant's combine)
records it in the ``bad`` int64[3] tensor with atomics: count, largest target >= V, smallest
negative target (``_device_errors.py`` turns that into a Python error without a host sync).
"""

from __future__ import annotations

import torch

from ._dispatch import triton, tl, cdiv, next_pow2

__all__ = ["ce_rows_triton"]


@triton.jit
def _tanh(x):
    # tanh through exp: exact at the limits (exp overflow -> 1), no libdevice needed
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _row_target(target_ptr, row, ignore_index, V):
    """The row's target, whether it counts, whether it is a class id, and an index safe to load."""
    tgt = tl.load(target_ptr + row).to(tl.int64)
    valid = tgt != ignore_index
    in_range = (tgt >= 0) & (tgt < V)
    return tgt, valid, in_range, tl.where(valid & in_range, tgt, 0)


@triton.jit
def _target_logit(row, tgt_safe, h_ptr, stride_h, w_ptr, stride_w, b_ptr, H, HAS_BIAS: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """The row's raw target logit in fp32: its hidden row times the target's weight row (plus bias)."""
    offs = tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k in range(0, H, BLOCK_H):
        ks = k + offs
        km = ks < H
        a = tl.load(h_ptr + row * stride_h + ks, mask=km, other=0.0).to(tl.float32)
        b = tl.load(w_ptr + tgt_safe * stride_w + ks, mask=km, other=0.0).to(tl.float32)
        acc += a * b
    zt = tl.sum(acc, axis=0)
    if HAS_BIAS:
        zt += tl.load(b_ptr + tgt_safe).to(tl.float32)
    return zt


@triton.jit
def _exact_target(m, s, row, row_ptr, tgt_safe, h_ptr, stride_h, w_ptr, stride_w, b_ptr, H, softcap, zshift,
                  HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr):
    """The row's target logit in fp32 from its hidden row and the target's weight row (and bias),
    and the row's lse with that value in place of the stored (rounded) one: ``s`` is the row's
    sum of ``exp(z - m)`` over the stored logits, ``zshift`` what the stored target logit is less
    (tile-relative logits, ``_logits_triton``; else 0). Returns ``(raw target logit, lse)``.

    In a peaked row (``p_t`` near 1) the target's term is nearly all of ``s``, so the rounding of
    the stored target logit (up to 2^-9 of it in bf16: 0.06 at a logit of 20) moved the lse, and
    with it every other ``p_j`` and the target's ``p_t - 1``, by several per cent."""
    zt = _target_logit(row, tgt_safe, h_ptr, stride_h, w_ptr, stride_w, b_ptr, H, HAS_BIAS, BLOCK_H)
    zr = tl.load(row_ptr + tgt_safe).to(tl.float32) + zshift
    zc = zt
    if HAS_SOFTCAP:
        zc = softcap * _tanh(zt / softcap)
        zr = softcap * _tanh(zr / softcap)
    e = tl.exp(zc - m)
    s = tl.maximum(s - tl.exp(zr - m) + e, e)  # the other terms are >= 0
    return zt, m + tl.log(s)


@triton.jit
def _store_row_stats(row, zt, lse, zsum, best_idx, tgt, valid, in_range,
                     loss_ptr, zloss_ptr, lse_ptr, correct_ptr, bad_ptr, V, label_smoothing, lse_square_scale,
                     softcap, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr):
    """From the row's lse (raw target logit ``zt``, row sum ``zsum``, argmax ``best_idx``): loss
    (with z-loss; 0 when ignored, NaN for an out-of-range target), z-loss, lse and the argmax hit;
    an out-of-range target is also recorded in ``bad_ptr[0:3]`` (count, max target >= V, min
    negative target)."""
    if valid & (~in_range):  # a branch, so good rows skip the atomics' barriers entirely
        tl.atomic_add(bad_ptr, 1, sem="relaxed")
        tl.atomic_max(bad_ptr + 1, tgt, mask=tgt >= V, sem="relaxed")
        tl.atomic_min(bad_ptr + 2, tgt, mask=tgt < 0, sem="relaxed")
    if HAS_SOFTCAP:
        zt = softcap * _tanh(zt / softcap)
    loss = lse - (1.0 - label_smoothing) * zt
    if HAS_SMOOTHING:
        loss -= label_smoothing * zsum / V
    zl = lse_square_scale * lse * lse
    loss += zl
    loss = tl.where(valid, loss, 0.0)
    loss = tl.where(valid & (~in_range), float("nan"), loss)
    tl.store(loss_ptr + row, loss)
    tl.store(zloss_ptr + row, tl.where(valid, zl, 0.0))
    tl.store(lse_ptr + row, lse)
    tl.store(correct_ptr + row, (valid & (best_idx == tgt)).to(tl.int8))


@triton.jit
def _grad_block(x, cols, mask, lse, p_scale, smooth, hit, tgt_safe, softcap, HAS_SOFTCAP: tl.constexpr):
    """``d loss / d logits`` for one block of the row's stored logits ``x`` (fp32), and the block's
    softmax mass outside the target (what the target's own entry is formed from)."""
    if HAS_SOFTCAP:
        t = _tanh(x / softcap)
        z = softcap * t
    else:
        z = x
    p = tl.exp(z - lse)
    is_t = cols == tgt_safe
    rest = tl.sum(tl.where(mask & (~is_t), p, 0.0), axis=0)
    d = p * p_scale - smooth
    d = tl.where(is_t, d - hit, d)
    if HAS_SOFTCAP:
        d = d * (1.0 - t * t)
    return d, rest


@triton.jit
def _target_grad(rest, x_t, lse, scale, V, label_smoothing, lse_square_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """The target's own entry of ``d loss / d logits`` from the row's softmax mass outside it:
    ``p_t - 1`` as ``-rest`` keeps its relative precision where ``p_t`` is within fp32 rounding of
    1 (a peaked row), which ``exp(z_t - lse) - 1`` loses."""
    d = (-rest + (1.0 - rest) * 2.0 * lse_square_scale * lse + label_smoothing * (1.0 - 1.0 / V)) * scale
    if HAS_SOFTCAP:
        t = _tanh(x_t / softcap)
        d = d * (1.0 - t * t)
    return d


@triton.jit
def _target_residual(d_t, stored, ok):
    """What the stored (rounded) target entry ``stored`` lost of ``d_t``, in fp32; 0 where ``ok`` is
    false (the row has no target)."""
    return tl.where(ok, d_t - stored, 0.0)


@triton.jit
def _store_target_fix(fix_ptr, stride_fix, row, d_t, stored, ok, fw_ptr, stride_fw, tgt_safe, H,
                      BLOCK_H: tl.constexpr):
    """Row ``row`` of the exact-target correction: ``(d_t - stored) * W[target]`` in fp32, the part of
    the target's gradient entry that its stored (rounded) value ``stored`` lost, times the target's
    weight row (zeros where the row has no target). Added to the fp32 sum of ``d @ W``, it makes each
    row's grad_hidden the rounding of one fp32 value whose target term is exact: in a peaked row that
    term is nearly all of the row, and its bf16 rounding (up to 2^-9 of it) was most of the error."""
    r = _target_residual(d_t, stored, ok)
    offs = tl.arange(0, BLOCK_H)
    for k in range(0, H, BLOCK_H):
        ks = k + offs
        km = ks < H
        wv = tl.load(fw_ptr + tgt_safe * stride_fw + ks, mask=km, other=0.0).to(tl.float32)
        tl.store(fix_ptr + row * stride_fix + ks, r * wv, mask=km)


@triton.jit
def _ce_row_kernel(
    logits_ptr, stride_l, target_ptr, grad_ptr, stride_g,
    loss_ptr, zloss_ptr, lse_ptr, correct_ptr, bad_ptr, scale_ptr, stride_scale,
    V, ignore_index, label_smoothing, lse_square_scale, softcap,
    h_ptr, stride_h, w_ptr, stride_w, b_ptr, H,
    fix_ptr, stride_fix, fw_ptr, stride_fw, FH, res_ptr,
    STATS: tl.constexpr, GRAD: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_HEAD: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_FIX: tl.constexpr, BLOCK_FH: tl.constexpr, HAS_RES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l
    tgt, valid, in_range, tgt_safe = _row_target(target_ptr, row, ignore_index, V)
    offs = tl.arange(0, BLOCK_V)

    if STATS:
        m = tl.zeros([], tl.float32) - float("inf")
        s = tl.zeros([], tl.float32)
        zsum = tl.zeros([], tl.float32)
        best = tl.zeros([], tl.float32) - float("inf")
        best_idx = tl.zeros([], tl.int64)
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            mask = cols < V
            z = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
            if HAS_SOFTCAP:
                z = tl.where(mask, softcap * _tanh(z / softcap), float("-inf"))
            bm = tl.max(z, axis=0)
            bi = tl.argmax(z, axis=0).to(tl.int64) + start
            take = bm > best
            best_idx = tl.where(take, bi, best_idx)
            best = tl.where(take, bm, best)
            m_new = tl.maximum(m, bm)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
            if HAS_SMOOTHING:
                zsum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        if HAS_HEAD:
            zt, lse = _exact_target(m, s, row, row_ptr, tgt_safe, h_ptr, stride_h, w_ptr, stride_w, b_ptr, H,
                                    softcap, 0.0, HAS_SOFTCAP, HAS_BIAS, BLOCK_H)
        else:
            zt, lse = tl.load(row_ptr + tgt_safe).to(tl.float32), m + tl.log(s)
        _store_row_stats(row, zt, lse, zsum, best_idx, tgt, valid, in_range,
                         loss_ptr, zloss_ptr, lse_ptr, correct_ptr, bad_ptr, V, label_smoothing,
                         lse_square_scale, softcap, HAS_SOFTCAP, HAS_SMOOTHING)
    else:
        lse = tl.load(lse_ptr + row)

    if GRAD:
        scale = tl.load(scale_ptr + row * stride_scale).to(tl.float32)
        scale = tl.where(valid & in_range, scale, 0.0)
        p_scale = (1.0 + 2.0 * lse_square_scale * lse) * scale
        smooth = label_smoothing / V * scale
        hit = (1.0 - label_smoothing) * scale
        g_row = grad_ptr + row * stride_g
        x_t = tl.load(row_ptr + tgt_safe).to(tl.float32)  # before the gradient may overwrite it
        rest = tl.zeros([], tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            mask = cols < V
            x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            d, part = _grad_block(x, cols, mask, lse, p_scale, smooth, hit, tgt_safe, softcap, HAS_SOFTCAP)
            rest += part
            tl.store(g_row + cols, d.to(grad_ptr.dtype.element_ty), mask=mask)
        d_t = _target_grad(rest, x_t, lse, scale, V, label_smoothing, lse_square_scale, softcap, HAS_SOFTCAP)
        stored = d_t.to(grad_ptr.dtype.element_ty)
        tl.store(g_row + tgt_safe, stored, mask=valid & in_range)
        if HAS_FIX:
            _store_target_fix(fix_ptr, stride_fix, row, d_t, stored.to(tl.float32), valid & in_range, fw_ptr,
                              stride_fw, tgt_safe, FH, BLOCK_FH)
        if HAS_RES:
            tl.store(res_ptr + row, _target_residual(d_t, stored.to(tl.float32), valid & in_range))


@triton.jit
def _ce_partial_kernel(
    logits_ptr, stride_l, part_m, part_s, part_z, part_i, NB, V, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Split variant, step 1: per (row, block of V) max, sum-exp, argmax and row-sum partials."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    z = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=float("-inf")).to(tl.float32)
    if HAS_SOFTCAP:
        z = tl.where(mask, softcap * _tanh(z / softcap), float("-inf"))
    bm = tl.max(z, axis=0)
    out = row * NB + blk
    tl.store(part_m + out, bm)
    tl.store(part_s + out, tl.sum(tl.exp(z - bm), axis=0))
    tl.store(part_i + out, tl.argmax(z, axis=0).to(tl.int32) + blk * BLOCK_V)
    if HAS_SMOOTHING:
        tl.store(part_z + out, tl.sum(tl.where(mask, z, 0.0), axis=0))


@triton.jit
def _ce_combine_kernel(
    logits_ptr, stride_l, target_ptr, loss_ptr, zloss_ptr, lse_ptr, correct_ptr, bad_ptr,
    part_m, part_s, part_z, part_i, NB,
    V, ignore_index, label_smoothing, lse_square_scale, softcap,
    h_ptr, stride_h, w_ptr, stride_w, b_ptr, H,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, BLOCK_NB: tl.constexpr,
    HAS_HEAD: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr, SHIFT_BN: tl.constexpr,
):
    """Split variant, step 2: one program per row folds the row's ``NB`` partials (from step 1
    or from the logits GEMM's epilogue) into lse, loss, z-loss and the argmax hit. ``SHIFT_BN``:
    the logits are stored tile-relative (``_logits_triton``), each tile of that many columns less
    its max partial; 0: as they are."""
    row = tl.program_id(0).to(tl.int64)
    tgt, valid, in_range, tgt_safe = _row_target(target_ptr, row, ignore_index, V)
    base = row * NB
    m = tl.zeros([], tl.float32) - float("inf")
    s = tl.zeros([], tl.float32)
    zsum = tl.zeros([], tl.float32)
    best = tl.zeros([], tl.float32) - float("inf")
    best_blk = tl.zeros([], tl.int64)
    for start in range(0, NB, BLOCK_NB):
        nbs = start + tl.arange(0, BLOCK_NB)
        nmask = nbs < NB
        pm = tl.load(part_m + base + nbs, mask=nmask, other=float("-inf"))
        ps = tl.load(part_s + base + nbs, mask=nmask, other=0.0)
        bm = tl.max(pm, axis=0)
        bi = tl.argmax(pm, axis=0).to(tl.int64) + start  # first block on ties
        take = bm > best
        best_blk = tl.where(take, bi, best_blk)
        best = tl.where(take, bm, best)
        m_new = tl.maximum(m, bm)
        s = s * tl.exp(m - m_new) + tl.sum(ps * tl.exp(pm - m_new), axis=0)
        m = m_new
        if HAS_SMOOTHING:
            zsum += tl.sum(tl.load(part_z + base + nbs, mask=nmask, other=0.0), axis=0)
    row_ptr = logits_ptr + row * stride_l
    zshift = tl.zeros([], tl.float32)
    if SHIFT_BN > 0:
        zshift = tl.load(part_m + base + tgt_safe // SHIFT_BN)
    if HAS_HEAD:
        zt, lse = _exact_target(m, s, row, row_ptr, tgt_safe, h_ptr, stride_h, w_ptr, stride_w, b_ptr, H,
                                softcap, zshift, HAS_SOFTCAP, HAS_BIAS, BLOCK_H)
    else:
        zt, lse = tl.load(row_ptr + tgt_safe).to(tl.float32) + zshift, m + tl.log(s)
    best_idx = tl.load(part_i + base + best_blk).to(tl.int64)
    _store_row_stats(row, zt, lse, zsum, best_idx, tgt, valid, in_range,
                     loss_ptr, zloss_ptr, lse_ptr, correct_ptr, bad_ptr, V, label_smoothing, lse_square_scale,
                     softcap, HAS_SOFTCAP, HAS_SMOOTHING)


@triton.jit
def _ce_grad_kernel(
    logits_ptr, stride_l, target_ptr, grad_ptr, stride_g, lse_ptr, scale_ptr, stride_scale, rest_ptr, xt_ptr,
    V, ignore_index, label_smoothing, lse_square_scale, softcap, tq_ptr, ts_ptr, T, shift_ptr, NSH,
    HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr, TILE_STATS: tl.constexpr, TBN: tl.constexpr,
    SHIFT_BN: tl.constexpr,
):
    """Split variant, step 3: each (row, block of V) program writes its block of the gradient and
    adds the block's softmax mass outside the target to ``rest_ptr[row]`` (the program holding the
    target also keeps its logit in ``xt_ptr[row]``): step 4 writes the target's entry from them.
    ``TILE_STATS``: per tile of ``TBN`` columns, the largest and the summed softmax entry outside
    the target (times the softcap's derivative: the gradient entry over the row's scale) go to
    ``tq_ptr`` and ``ts_ptr`` (fp32 ``[rows, T]``), for the block-sparse gradient's filter.
    ``SHIFT_BN``: tile-relative logits, column ``j`` less ``shift_ptr[row, j // SHIFT_BN]`` (fp32
    ``[rows, NSH]``), added back on load."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    _, valid, in_range, tgt_safe = _row_target(target_ptr, row, ignore_index, V)
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row * stride_scale).to(tl.float32)
    scale = tl.where(valid & in_range, scale, 0.0)
    p_scale = (1.0 + 2.0 * lse_square_scale * lse) * scale
    cols = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    x = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=0.0).to(tl.float32)
    if SHIFT_BN > 0:  # one load per tile of the block, broadcast over its columns (not one per column)
        tiles = blk * (BLOCK_V // SHIFT_BN) + tl.arange(0, BLOCK_V // SHIFT_BN)
        sh = tl.load(shift_ptr + row * NSH + tiles, mask=tiles < NSH, other=0.0)
        x = tl.reshape(tl.reshape(x, [BLOCK_V // SHIFT_BN, SHIFT_BN]) + sh[:, None], [BLOCK_V])
    d, rest = _grad_block(x, cols, mask, lse, p_scale, label_smoothing / V * scale, (1.0 - label_smoothing) * scale,
                          tgt_safe, softcap, HAS_SOFTCAP)
    has_t = (tgt_safe >= blk * BLOCK_V) & (tgt_safe < blk * BLOCK_V + BLOCK_V)
    tl.store(xt_ptr + row, tl.sum(tl.where(cols == tgt_safe, x, 0.0), axis=0), mask=has_t)
    tl.atomic_add(rest_ptr + row, rest, sem="relaxed")
    tl.store(grad_ptr + row * stride_g + cols, d.to(grad_ptr.dtype.element_ty), mask=mask)
    if TILE_STATS:
        # (a row without a gradient has scale 0 and d 0)
        q = tl.where(mask & (cols != tgt_safe), d, 0.0) / tl.where(scale != 0.0, scale, 1.0)
        q2 = tl.reshape(q, [BLOCK_V // TBN, TBN])
        tiles = blk * (BLOCK_V // TBN) + tl.arange(0, BLOCK_V // TBN)
        tm = tiles < T
        tl.store(tq_ptr + row * T + tiles, tl.max(q2, axis=1), mask=tm)
        tl.store(ts_ptr + row * T + tiles, tl.sum(q2, axis=1), mask=tm)


@triton.jit
def _ce_target_grad_kernel(
    target_ptr, grad_ptr, stride_g, lse_ptr, scale_ptr, stride_scale, rest_ptr, xt_ptr,
    V, ignore_index, label_smoothing, lse_square_scale, softcap,
    fix_ptr, stride_fix, fw_ptr, stride_fw, FH, dt_ptr, res_ptr,
    HAS_SOFTCAP: tl.constexpr, HAS_FIX: tl.constexpr, BLOCK_FH: tl.constexpr, ZERO_TARGET: tl.constexpr,
    HAS_RES: tl.constexpr,
):
    """Split variant, step 4: the target's entry of each row's gradient (:func:`_target_grad`), and
    with ``HAS_FIX`` the row's exact-target correction (:func:`_store_target_fix`). ``ZERO_TARGET``:
    the entry is stored as 0 and kept in fp32 in ``dt_ptr[row]`` instead (0 where the row has no
    target), and the correction is then the whole ``d_t * W[target]`` (the block-sparse gradient
    matmuls add the targets' terms apart, ``_sparse_grads_triton``). ``HAS_RES``: ``res_ptr[row]``
    receives ``d_t`` minus its stored value (0 where the row has no target), for
    ``_target_terms_triton``."""
    row = tl.program_id(0).to(tl.int64)
    _, valid, in_range, tgt_safe = _row_target(target_ptr, row, ignore_index, V)
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row * stride_scale).to(tl.float32)
    d_t = _target_grad(tl.load(rest_ptr + row), tl.load(xt_ptr + row), lse, scale, V, label_smoothing,
                       lse_square_scale, softcap, HAS_SOFTCAP)
    if ZERO_TARGET:
        stored = tl.zeros([], tl.float32).to(grad_ptr.dtype.element_ty)
        tl.store(dt_ptr + row, tl.where(valid & in_range, d_t, 0.0))
    else:
        stored = d_t.to(grad_ptr.dtype.element_ty)
    tl.store(grad_ptr + row * stride_g + tgt_safe, stored, mask=valid & in_range)
    if HAS_FIX:
        _store_target_fix(fix_ptr, stride_fix, row, d_t, stored.to(tl.float32), valid & in_range, fw_ptr, stride_fw,
                          tgt_safe, FH, BLOCK_FH)
    if HAS_RES:
        tl.store(res_ptr + row, _target_residual(d_t, stored.to(tl.float32), valid & in_range))


def head_launch_args(head, logits):
    """The launch arguments of :func:`_target_logit`'s callers for ``head`` = (the rows' hidden
    states, the weight, the bias or None), or placeholders (``HAS_HEAD=False``) for None:
    ``(pointer and size arguments, constexpr flags)``."""
    if head is None:
        return (logits, 0, logits, 0, logits, 0), dict(HAS_HEAD=False, HAS_BIAS=False, BLOCK_H=16)
    hh, hw, hb = head
    c, v = logits.shape
    assert hh.shape[0] == c and hw.shape[0] == v and hh.stride(-1) == 1 and hw.stride(-1) == 1
    args = (hh, hh.stride(0), hw, hw.stride(0), hb if hb is not None else hw, hh.shape[1])
    return args, dict(HAS_HEAD=True, HAS_BIAS=hb is not None, BLOCK_H=min(next_pow2(hh.shape[1]), 512))


#: Values of ``variant``: "split" (the default): rows are cut into blocks of V spread over
#: programs (partial, combine and gradient launches; fills the GPU even for a few hundred rows);
#: "row": one program streams a whole row (one launch).
CE_KERNEL_VARIANTS = ("split", "row")
#: block of V per program for the split variant on CUDA
SPLIT_BLOCK_V = 4096


def _block_v(v: int, device: torch.device) -> tuple[int, int]:
    if device.type == "cpu":  # interpreter: small blocks keep numpy temporaries small
        return min(next_pow2(v), 1024), 1
    return min(next_pow2(v), 8192), 16


def ce_rows_triton(logits, target, opt, *, scale=None, grad=None, lse=None, variant="split", partials=None, bad=None,
                   head=None, target_fix=None, sparse=None, target_res=None, out=None):
    """Same contract as :func:`liger_compat.kernels.loss.ce_rows_torch` (``bad``: the int64[3]
    tensor of :func:`liger_compat.kernels._device_errors.new_flag` that the statistics pass
    adds out-of-range targets to; a scratch one when not given; ``head``: the rows' hidden states,
    the weight and the bias or None, from which the statistics pass takes each target logit in
    fp32, :func:`_exact_target`).

    ``partials`` = ``(max, sum-exp, argmax, row-sum, shift)``, the first four per (row, block of
    V), as written by :func:`liger_compat.kernels._logits_triton.logits_with_partials`: the
    statistics then come from them instead of a pass over the logits (split variant); ``shift``
    > 0: ``logits`` holds each tile of that many columns less its max partial (tile-relative), and
    the passes add it back.

    ``target_fix`` = ``(fix, weight)``, with ``grad``: ``fix`` (fp32 ``[C, H]``) receives each row's
    exact-target correction, ``(d_t - stored d_t) * weight[target]`` (:func:`_store_target_fix`), for
    the caller to add to the fp32 sum of ``grad @ weight``.

    ``sparse`` = ``(dt, rest, tq, ts, tbn)``, with ``grad`` (split variant): each target's entry is
    stored as 0, ``dt`` (fp32 ``[C]``) receives it in fp32, ``rest`` (fp32 ``[C]``, zeroed by the
    caller) each row's softmax mass outside its target, and ``tq`` / ``ts`` (fp32 ``[C, cdiv(V,
    tbn)]``) the largest and the summed entry of that softmax (times the softcap's derivative) per
    tile of ``tbn`` columns; with ``target_fix`` the correction is the whole ``d_t * weight[target]``.

    ``target_res`` (fp32 ``[C]``), with ``grad`` and without ``sparse``: receives each row's target
    entry in fp32 minus its stored value (0 where the row has no target), the residual
    ``_target_terms_triton.add_target_terms`` adds to grad_weight.

    ``out`` = ``(loss, z-loss, hit)``, contiguous fp32, fp32 and bool ``[C]`` tensors (without
    ``lse``): the statistics are written into them (the caller's slices of its whole-batch rows)
    and returned, instead of into new tensors."""
    c, v = logits.shape
    if c == 0:
        return None if lse is not None else tuple(torch.empty(0, device=logits.device) for _ in range(4))
    assert logits.stride(-1) == 1
    dev = logits.device
    stats = lse is None
    f32 = torch.float32
    if stats:
        if out is None:
            loss = torch.empty(c, dtype=f32, device=dev)
            zl = torch.empty(c, dtype=f32, device=dev)
            correct = torch.empty(c, dtype=torch.int8, device=dev)
        else:
            loss, zl, hit = out
            assert loss.shape == zl.shape == hit.shape == (c,) and loss.dtype == zl.dtype == f32
            assert hit.dtype == torch.bool and loss.is_contiguous() and zl.is_contiguous() and hit.is_contiguous()
            correct = hit.view(torch.int8)
        lse = torch.empty(c, dtype=f32, device=dev)
        if bad is None:
            bad = torch.zeros(3, dtype=torch.int64, device=dev)
    else:
        loss = zl = correct = lse  # unused by the kernel in this mode
        bad = target
    if grad is not None:
        assert grad.stride(-1) == 1
        if scale is None:
            scale = torch.ones((), dtype=f32, device=dev)
        scale = scale.to(f32)
        stride_scale = 0 if scale.dim() == 0 else scale.stride(0)
    else:
        scale, stride_scale = lse, 0
    shift_bn = 0
    if partials is not None:
        variant = "split"
        shift_bn = partials[4]
    target = target.contiguous()
    common = dict(HAS_SOFTCAP=opt.softcap is not None, HAS_SMOOTHING=opt.label_smoothing != 0.0)
    softcap = opt.softcap if opt.softcap is not None else 1.0
    g = grad if grad is not None else logits
    sg = grad.stride(0) if grad is not None else 0
    head_args, head_common = head_launch_args(head if stats else None, logits)
    if target_fix is not None:
        fix, fw = target_fix
        assert grad is not None and fix.shape == (c, fw.shape[1]) and fix.dtype == f32 and fix.stride(-1) == 1
        assert fw.shape[0] == v and fw.stride(-1) == 1
        fix_args = (fix, fix.stride(0), fw, fw.stride(0), fw.shape[1])
        fix_common = dict(HAS_FIX=True, BLOCK_FH=min(next_pow2(fw.shape[1]), 1024))
    else:
        fix_args = (logits, 0, logits, 0, 0)
        fix_common = dict(HAS_FIX=False, BLOCK_FH=16)
    if target_res is not None:
        assert grad is not None and sparse is None and target_res.shape == (c,) and target_res.dtype == f32
        res_common = dict(HAS_RES=True)
    else:
        target_res, res_common = lse, dict(HAS_RES=False)
    if variant == "row":
        assert sparse is None, "sparse= needs the split variant"
        block, warps = _block_v(v, dev)
        _ce_row_kernel[(c,)](
            logits, logits.stride(0), target, g, sg,
            loss, zl, lse, correct, bad, scale, stride_scale,
            v, opt.ignore_index, opt.label_smoothing, opt.lse_square_scale, softcap, *head_args, *fix_args, target_res,
            STATS=stats, GRAD=grad is not None, BLOCK_V=block, num_warps=warps, **common, **head_common, **fix_common,
            **res_common,
        )
    else:
        block = SPLIT_BLOCK_V if dev.type == "cuda" else 256
        block = max(min(block, next_pow2(v)), shift_bn)  # whole tiles of tile-relative logits a block
        nb = cdiv(v, block)
        warps = 8 if dev.type == "cuda" else 1
        if stats:
            if partials is None:
                pm = torch.empty((c, nb), dtype=f32, device=dev)
                ps = torch.empty_like(pm)
                pz = torch.empty_like(pm) if opt.label_smoothing != 0.0 else pm
                pi = torch.empty((c, nb), dtype=torch.int32, device=dev)
                _ce_partial_kernel[(c, nb)](
                    logits, logits.stride(0), pm, ps, pz, pi, nb, v, softcap,
                    BLOCK_V=block, num_warps=warps, **common,
                )
            else:
                pm, ps, pi, pz, _ = partials
            npart = pm.shape[1]
            _ce_combine_kernel[(c,)](
                logits, logits.stride(0), target, loss, zl, lse, correct, bad, pm, ps, pz, pi, npart,
                v, opt.ignore_index, opt.label_smoothing, opt.lse_square_scale, softcap, *head_args,
                BLOCK_NB=min(next_pow2(npart), 1024), num_warps=4 if dev.type == "cuda" else 1,
                SHIFT_BN=shift_bn, **common, **head_common,
            )
        if grad is not None:
            # mass outside the target; target logit (one unbind: each indexing is a host-side op)
            rest_mass, xt = torch.zeros((2, c), dtype=f32, device=dev).unbind(0)
            if sparse is not None:
                dt, rest_out, tq, ts, tbn = sparse
                assert dt.shape == (c,) and rest_out.shape == (c,) and dt.dtype == rest_out.dtype == f32
                assert tq.shape == ts.shape == (c, cdiv(v, tbn)) and block % tbn == 0
                rest_mass = rest_out
            else:
                dt, tq, ts, tbn = xt, xt, xt, 16
            if shift_bn:
                shift = partials[0]
                assert shift.shape == (c, cdiv(v, shift_bn)) and shift.is_contiguous() and block % shift_bn == 0
            else:
                shift = xt
            _ce_grad_kernel[(c, nb)](
                logits, logits.stride(0), target, g, sg, lse, scale, stride_scale, rest_mass, xt,
                v, opt.ignore_index, opt.label_smoothing, opt.lse_square_scale, softcap, tq, ts, tq.shape[-1],
                shift, shift.shape[-1] if shift_bn else 0,
                HAS_SOFTCAP=common["HAS_SOFTCAP"], BLOCK_V=block, num_warps=warps, TILE_STATS=sparse is not None,
                TBN=tbn, SHIFT_BN=shift_bn,
            )
            _ce_target_grad_kernel[(c,)](
                target, g, sg, lse, scale, stride_scale, rest_mass, xt,
                v, opt.ignore_index, opt.label_smoothing, opt.lse_square_scale, softcap, *fix_args, dt, target_res,
                HAS_SOFTCAP=common["HAS_SOFTCAP"], num_warps=4 if target_fix is not None and dev.type == "cuda" else 1,
                ZERO_TARGET=sparse is not None, **fix_common, **res_common,
            )
    if not stats:
        return None
    return loss, zl, lse, correct.view(torch.bool)
