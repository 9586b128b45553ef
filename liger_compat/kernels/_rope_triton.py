"""Triton rotary embedding, forward and backward (the transposed rotation), any strides.

``x`` is viewed as ``[B, X, Y, D]`` (leading dims merged or padded to three) and ``cos``/``sin``
are expanded to ``[B, X, Y, rot]`` with stride 0 on broadcast dims, so one kernel serves the
``[B, heads, T, D]`` and ``[B, T, heads, D]`` layouts, per-batch or shared ``cos``, and partial
rotary (channels ``rot..D`` copied through). Each program handles ``BLOCK_R`` rows.
"""

from __future__ import annotations

import torch

from ._dispatch import triton, tl

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
def _rope_heads_kernel(
    q_ptr, k_ptr, oq_ptr, ok_ptr, c_ptr, s_ptr, T, HQ, HK,
    sqb, sqh, sqt, skb, skh, skt, soqb, soqh, soqt, sokb, sokh, sokt, scb, sct, ssb, sst,
    HALF: tl.constexpr, PASS: tl.constexpr, BACKWARD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    """One program per (block of positions, batch): cos/sin loaded once, every q and k head
    of those positions rotated with them (one launch for q and k)."""
    b = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    m = tmask[:, None] & (cols < HALF)
    co = (b * scb + t * sct)[:, None]
    so = (b * ssb + t * sst)[:, None]
    c1 = tl.load(c_ptr + co + cols, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + co + HALF + cols, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr + so + cols, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptr + so + HALF + cols, mask=m, other=0.0).to(tl.float32)
    for h in range(HQ):
        _rotate_tile(q_ptr, oq_ptr, (b * sqb + h * sqh + t * sqt)[:, None], (b * soqb + h * soqh + t * soqt)[:, None],
                     cols, m, c1, c2, s1, s2, HALF, PASS, BACKWARD, BLOCK_PASS, tmask)
    for h in range(HK):
        _rotate_tile(k_ptr, ok_ptr, (b * skb + h * skh + t * skt)[:, None], (b * sokb + h * sokh + t * sokt)[:, None],
                     cols, m, c1, c2, s1, s2, HALF, PASS, BACKWARD, BLOCK_PASS, tmask)


#: positions per program of the heads kernel on CUDA, and its warps (benchmarks.kernels sweeps both)
HEADS_BLOCK_T = 16
HEADS_WARPS = 4


def _heads_view(x, head_dim_index):
    """[B, H, T, D] view of a 4-D q/k whose head dimension is ``head_dim_index`` (1 or 2)."""
    return x if head_dim_index == 1 else x.permute(0, 2, 1, 3)


def _rope_heads(q, k, cos_u, sin_u, backward, out_q, out_k, head_dim_index):
    # outputs in the inputs' memory layout: transformers hands q/k as [B, heads, T, D] views of
    # [B, T, heads, D] projections, and attention kernels and the projections' backward then
    # see the layout they would have seen without us
    oq = torch.empty_like(q, dtype=out_q)
    ok = torch.empty_like(k, dtype=out_k)
    q4, k4 = _heads_view(q, head_dim_index), _heads_view(k, head_dim_index)
    oq4, ok4 = _heads_view(oq, head_dim_index), _heads_view(ok, head_dim_index)
    bsz, hq, t, d = q4.shape
    hk = k4.shape[1]
    rot = cos_u.shape[-1]
    c = _heads_view(cos_u.expand(*q.shape[:-1], rot), head_dim_index)[:, 0]  # [B, T, rot]
    s = _heads_view(sin_u.expand(*q.shape[:-1], rot), head_dim_index)[:, 0]
    if c.stride(-1) != 1:
        c = c.contiguous()
    if s.stride(-1) != 1:
        s = s.contiguous()
    half = rot // 2
    block_t = HEADS_BLOCK_T if q.device.type == "cuda" else 4
    grid = (triton.cdiv(t, block_t), bsz)
    _rope_heads_kernel[grid](
        q4, k4, oq4, ok4, c, s, t, hq, hk,
        q4.stride(0), q4.stride(1), q4.stride(2), k4.stride(0), k4.stride(1), k4.stride(2),
        oq4.stride(0), oq4.stride(1), oq4.stride(2), ok4.stride(0), ok4.stride(1), ok4.stride(2),
        c.stride(0), c.stride(1), s.stride(0), s.stride(1),
        HALF=half, PASS=d - rot, BACKWARD=backward, BLOCK_T=block_t,
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_PASS=triton.next_power_of_2(max(d - rot, 1)),
        num_warps=HEADS_WARPS,
    )
    return oq, ok


def _heads_layout(q, k, cos_u, head_dim_index):
    """True when the heads kernel applies: 4-D q/k sharing B and T, last dim contiguous, cos
    broadcast over the head dimension."""
    if head_dim_index not in (1, 2) or q.dim() != 4 or k.dim() != 4 or cos_u.dim() != 4:
        return False
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        return False
    q4, k4 = _heads_view(q, head_dim_index), _heads_view(k, head_dim_index)
    if q4.shape[0] != k4.shape[0] or q4.shape[2] != k4.shape[2]:
        return False
    return cos_u.shape[head_dim_index] == 1


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
    block_half = triton.next_power_of_2(half)
    block_pass = triton.next_power_of_2(max(d - rot, 1))
    block_r = max(1, min(64 if x.device.type == "cuda" else 16, 4096 // max(block_half * 2, 1)))
    grid = (triton.cdiv(n_rows, block_r),)
    _rope_kernel[grid](
        x4, o4, c4, s4, n_rows, xdim, ydim,
        *x4.stride()[:3], *o4.stride()[:3], *c4.stride()[:3], *s4.stride()[:3],
        HALF=half, PASS=d - rot, BACKWARD=backward,
        BLOCK_R=block_r, BLOCK_HALF=block_half, BLOCK_PASS=block_pass, num_warps=4,
    )
    return out


#: "heads" (one program per positions block, all heads) where the layout allows, else "rows"
ROPE_KERNEL_VARIANT = "heads"


def rope_triton(q, k, cos_u, sin_u, backward, out_q, out_k, head_dim_index=None):
    if ROPE_KERNEL_VARIANT == "heads" and head_dim_index is not None and _heads_layout(q, k, cos_u, head_dim_index):
        return _rope_heads(q, k, cos_u, sin_u, backward, out_q, out_k, head_dim_index)
    return _rope_one(q, cos_u, sin_u, backward, out_q), _rope_one(k, cos_u, sin_u, backward, out_k)
