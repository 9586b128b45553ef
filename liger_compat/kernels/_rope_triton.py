"""Triton rotary embedding, forward and backward (the transposed rotation), any strides.

``x`` is viewed as ``[B, X, Y, D]`` and ``cos``/``sin`` are expanded to ``[B, X, Y, rot]`` with
stride 0 on broadcast dims, so one kernel serves the ``[B, heads, T, D]`` and ``[B, T, heads,
D]`` layouts, per-batch or shared ``cos``, and partial rotary (channels ``rot..D`` copied
through). Two kernels: "flat" (whole rows, q and k in one launch; 4-D q/k whose outputs share
their strides, i.e. every layout transformers passes except slices of a fused qkv projection)
and "rows" (half-row tiles, one launch per tensor; any dims and strides), picked by the ``variant``
argument of :func:`rope_triton`. ``outputs`` keep the inputs' memory layout, as the native ops do.
"""

from __future__ import annotations

import torch

from ._dispatch import triton, tl, cdiv, next_pow2
from ._checks import rope_variant

__all__ = ["rope_triton"]


@triton.jit
def _rotate_tile(x_ptr, o_ptr, xo, oo, cols, m, c1, c2, s1, s2, HALF: tl.constexpr, PASS: tl.constexpr,
                 BACKWARD: tl.constexpr, BLOCK_PASS: tl.constexpr, tmask):
    x1 = tl.load(x_ptr + xo + cols, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + xo + HALF + cols, mask=m, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    ty = o_ptr.dtype.element_ty
    tl.store(o_ptr + oo + cols, y1.to(ty), mask=m)
    tl.store(o_ptr + oo + HALF + cols, y2.to(ty), mask=m)
    if PASS > 0:
        pc = tl.arange(0, BLOCK_PASS)[None, :]
        pm = tmask[:, None] & (pc < PASS)
        xp = tl.load(x_ptr + xo + 2 * HALF + pc, mask=pm, other=0.0)
        tl.store(o_ptr + oo + 2 * HALF + pc, xp.to(ty), mask=pm)


@triton.jit
def _rope_kernel(
    x_ptr, o_ptr, c_ptr, s_ptr, n_rows, X, Y,
    sxb, sxx, sxy, sob, sox, soy, scb, scx, scy, ssb, ssx, ssy,
    HALF: tl.constexpr, PASS: tl.constexpr, BACKWARD: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    b = rows // (X * Y)
    xx = (rows // Y) % X
    yy = rows % Y
    co = (b * scb + xx * scx + yy * scy)[:, None]
    so = (b * ssb + xx * ssx + yy * ssy)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    m = rmask[:, None] & (cols < HALF)
    c1 = tl.load(c_ptr + co + cols, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + co + HALF + cols, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr + so + cols, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptr + so + HALF + cols, mask=m, other=0.0).to(tl.float32)
    _rotate_tile(x_ptr, o_ptr, (b * sxb + xx * sxx + yy * sxy)[:, None], (b * sob + xx * sox + yy * soy)[:, None],
                 cols, m, c1, c2, s1, s2, HALF, PASS, BACKWARD, BLOCK_PASS, rmask)


@triton.jit
def _flat_rows(x_ptr, o_ptr, c_ptr, s_ptr, r0, n_rows, X, Y, sb, sx, sy, cb, cx, cy,
               D: tl.constexpr, HALF: tl.constexpr, BACKWARD: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """``BLOCK_R`` whole rows from row ``r0`` of one tensor viewed as ``[B, X, Y, D]`` (the
    output has the input's strides, sin has cos's): each element is rotated with its partner
    ``(j + rot/2) % rot``, loaded a second time (an L1 hit) rather than split into halves, so
    loads and stores cover whole rows."""
    rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
    rmask = rows < n_rows
    b = rows // (X * Y)
    xx = (rows // Y) % X
    yy = rows % Y
    cols = tl.arange(0, BLOCK_D)[None, :]
    first = cols < HALF
    in_rot = cols < 2 * HALF
    partner = tl.where(first, cols + HALF, tl.where(in_rot, cols - HALF, cols))
    m = rmask[:, None] & (cols < D)
    mr = rmask[:, None] & in_rot
    xo = (b * sb + xx * sx + yy * sy)[:, None]
    co = (b * cb + xx * cx + yy * cy)[:, None]
    x = tl.load(x_ptr + xo + cols, mask=m, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + xo + partner, mask=mr, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + co + cols, mask=mr, other=1.0).to(tl.float32)  # pass-through channels: x * 1
    if BACKWARD:  # transpose: y_j = x_j c_j + sign x_p s_p, sign + on the first half
        s = tl.load(s_ptr + co + partner, mask=mr, other=0.0).to(tl.float32)
        y = x * c + tl.where(first, xp * s, -xp * s)
    else:  # y_j = x_j c_j + sign x_p s_j, sign - on the first half
        s = tl.load(s_ptr + co + cols, mask=mr, other=0.0).to(tl.float32)
        y = x * c + tl.where(first, -xp * s, xp * s)
    tl.store(o_ptr + xo + cols, y.to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rope_flat_kernel(
    q_ptr, oq_ptr, k_ptr, ok_ptr, c_ptr, s_ptr,
    nq, XQ, YQ, qb, qx, qy, cqb, cqx, cqy, nk, XK, YK, kb, kx, ky, ckb, ckx, cky,
    D: tl.constexpr, HALF: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """q's row blocks, then k's, in one launch."""
    pid = tl.program_id(0)
    q_programs = tl.cdiv(nq, BLOCK_R)
    if pid < q_programs:
        _flat_rows(q_ptr, oq_ptr, c_ptr, s_ptr, pid.to(tl.int64) * BLOCK_R, nq, XQ, YQ, qb, qx, qy,
                   cqb, cqx, cqy, D, HALF, BACKWARD, BLOCK_R, BLOCK_D)
    else:
        _flat_rows(k_ptr, ok_ptr, c_ptr, s_ptr, (pid - q_programs).to(tl.int64) * BLOCK_R, nk, XK, YK,
                   kb, kx, ky, ckb, ckx, cky, D, HALF, BACKWARD, BLOCK_R, BLOCK_D)


#: rows per program of the flat kernel on CUDA, and its warps (benchmarks.kernels sweeps both;
#: ordering the rows with the heads fastest, so one cos/sin row serves a program, was never
#: faster than memory order: NOTES.md, RoPE)
FLAT_BLOCK_R = 4
FLAT_WARPS = 1


def _flat_ok(q, k, oq, ok, cos_u, sin_u) -> bool:
    """The flat kernel's assumptions: 4-D q/k with unit column stride, outputs with the inputs'
    strides (``empty_like`` of a dense tensor), sin laid out like cos."""
    return (q.dim() == k.dim() == 4 and q.stride(-1) == k.stride(-1) == 1
            and oq.stride() == q.stride() and ok.stride() == k.stride() and cos_u.stride() == sin_u.stride())


def _flat_operands(x, c):
    """(rows, X, Y, x strides, cos strides) of 4-D x as ``[B, X, Y, D]`` with cos expanded to
    it (stride 0 where it broadcasts); X and Y swapped where that gives Y the smaller stride in
    x, so the rows of one program lie next to each other in memory."""
    c = c.expand(*x.shape[:-1], c.shape[-1])
    xs, cs = list(x.stride()[:3]), list(c.stride()[:3])
    shape = list(x.shape[:3])
    if xs[1] < xs[2]:
        for lst in (xs, cs, shape):
            lst[1], lst[2] = lst[2], lst[1]
    return [shape[0] * shape[1] * shape[2], shape[1], shape[2], *xs, *cs]


def _rope_flat(q, k, oq, ok, cos_u, sin_u, backward):
    d = q.shape[-1]
    block_d = next_pow2(d)
    block_r = FLAT_BLOCK_R if q.device.type == "cuda" else 4
    block_r = max(1, min(block_r, 8192 // block_d))
    qa, ka = _flat_operands(q, cos_u), _flat_operands(k, cos_u)
    grid = (cdiv(qa[0], block_r) + cdiv(ka[0], block_r),)
    if grid[0]:
        _rope_flat_kernel[grid](q, oq, k, ok, cos_u, sin_u, *qa, *ka, D=d, HALF=cos_u.shape[-1] // 2,
                                BACKWARD=backward, BLOCK_R=block_r, BLOCK_D=block_d,
                                num_warps=FLAT_WARPS if q.device.type == "cuda" else 1)
    return oq, ok


def _as4(x: torch.Tensor, cos_u: torch.Tensor, sin_u: torch.Tensor):
    """x -> [B, X, Y, D] view (copy only if needed), cos/sin expanded to its leading shape."""
    rot = cos_u.shape[-1]
    lead = x.shape[:-1]
    c = cos_u.expand(*lead, rot)
    s = sin_u.expand(*lead, rot)
    if x.stride(-1) != 1:
        x = x.contiguous()
    while x.dim() < 4:
        x, c, s = x.unsqueeze(0), c.unsqueeze(0), s.unsqueeze(0)
    if x.dim() > 4:
        x = x.reshape(-1, *x.shape[-3:])
        c = c.reshape(-1, *c.shape[-3:])
        s = s.reshape(-1, *s.shape[-3:])
    if c.stride(-1) != 1:
        c = c.contiguous()
    if s.stride(-1) != 1:
        s = s.contiguous()
    return x, c, s


def _rope_one(x, cos_u, sin_u, backward, out_dtype):
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if x.numel() == 0:
        return out
    x4, c4, s4 = _as4(x, cos_u, sin_u)
    o4 = out.view(x4.shape)
    d = x4.shape[-1]
    rot = c4.shape[-1]
    half = rot // 2
    bsz, xdim, ydim = x4.shape[:3]
    n_rows = bsz * xdim * ydim
    block_half = next_pow2(half)
    block_pass = next_pow2(max(d - rot, 1))
    block_r = max(1, min(64 if x.device.type == "cuda" else 16, 4096 // max(block_half * 2, 1)))
    grid = (cdiv(n_rows, block_r),)
    _rope_kernel[grid](
        x4, o4, c4, s4, n_rows, xdim, ydim,
        *x4.stride()[:3], *o4.stride()[:3], *c4.stride()[:3], *s4.stride()[:3],
        HALF=half, PASS=d - rot, BACKWARD=backward,
        BLOCK_R=block_r, BLOCK_HALF=block_half, BLOCK_PASS=block_pass, num_warps=4,
    )
    return out


def rope_triton(q, k, cos_u, sin_u, backward, out_q, out_k, *, variant="flat"):
    """Rotate ``q`` and ``k`` (``backward``: by the transpose) into new tensors of dtypes
    ``out_q`` / ``out_k``. ``variant`` (:data:`liger_compat.kernels.rope.ROPE_VARIANTS`): "flat"
    where its assumptions hold, else "rows"; or "rows" always."""
    rope_variant(variant)
    if variant == "flat":
        if cos_u.stride(-1) != 1 or sin_u.stride(-1) != 1 or cos_u.stride() != sin_u.stride():
            cos_u, sin_u = cos_u.contiguous(), sin_u.contiguous()
        oq = torch.empty_like(q, dtype=out_q)
        ok = torch.empty_like(k, dtype=out_k)
        if _flat_ok(q, k, oq, ok, cos_u, sin_u):
            return _rope_flat(q, k, oq, ok, cos_u, sin_u, backward)
    return _rope_one(q, cos_u, sin_u, backward, out_q), _rope_one(k, cos_u, sin_u, backward, out_k)
