"""Triton elementwise kernels for SwiGLU / GeGLU (tanh gelu), forward and backward.

Flat over the contiguous inputs; fp32 math, one rounding to the storage dtype. gelu-tanh is
written as ``a * sigmoid(2u)`` (equal to ``0.5 a (1 + tanh u)``) to avoid cancellation.
"""

from __future__ import annotations

import torch

from ._dispatch import triton, tl, cdiv

__all__ = ["gated_forward_triton", "gated_backward_triton"]



@triton.jit
def _act(a, GELU: tl.constexpr):
    if GELU:
        s = tl.sigmoid(1.5957691216057308 * (a + 0.044715 * a * a * a))  # 1.59... = 2 * sqrt(2 / pi)
        act = a * s
        d = s + a * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 3.0 * 0.044715 * a * a)
    else:
        s = tl.sigmoid(a)
        act = a * s
        d = s * (1.0 + a * (1.0 - s))
    return act, d


@triton.jit
def _gated_fwd(a_ptr, b_ptr, y_ptr, n, GELU: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act, _ = _act(a, GELU)
    tl.store(y_ptr + offs, (act * b).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd(dy_ptr, a_ptr, b_ptr, da_ptr, db_ptr, y_ptr, n, GELU: tl.constexpr, STORE_Y: tl.constexpr,
               BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act, d = _act(a, GELU)
    tl.store(da_ptr + offs, (dy * b * d).to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + offs, (dy * act).to(db_ptr.dtype.element_ty), mask=mask)
    if STORE_Y:  # the forward's output again, same rounding as _gated_fwd
        tl.store(y_ptr + offs, (act * b).to(y_ptr.dtype.element_ty), mask=mask)


def _block(device: torch.device) -> int:
    return 2048 if device.type == "cuda" else 256


def gated_forward_triton(gate, up, kind):
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        blk = _block(gate.device)
        _gated_fwd[(cdiv(n, blk),)](gate, up, y, n, GELU=kind != "silu", BLOCK=blk, num_warps=8)
    return y


def gated_backward_triton(dy, gate, up, kind, inplace=False, output_over_dy=False):
    """Gradients for gate and up. ``inplace=True`` writes them over ``gate`` and ``up`` (each
    element is loaded before it is stored), saving two [N, I] buffers at the backward's peak.
    ``output_over_dy=True`` also writes the forward's output ``act(gate) * up`` over ``dy`` (for
    a weight gradient that needs it, without a pass of its own); returns ``(da, db, y)`` then."""
    da = gate if inplace else torch.empty_like(gate)
    db = up if inplace else torch.empty_like(up)
    n = gate.numel()
    if n:
        blk = _block(gate.device)
        _gated_bwd[(cdiv(n, blk),)](dy, gate, up, da, db, dy, n, GELU=kind != "silu",
                                           STORE_Y=bool(output_over_dy), BLOCK=blk, num_warps=8)
    return (da, db, dy) if output_over_dy else (da, db)
