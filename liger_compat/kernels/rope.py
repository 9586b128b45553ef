"""Rotary position embedding with transformers' ``apply_rotary_pos_emb`` semantics.

``q_embed = q * cos + rotate_half(q) * sin`` on the first ``rot = cos.shape[-1]`` channels of
the head dimension; channels past ``rot`` pass through unchanged (partial rotary: Phi,
GPT-NeoX, StableLM, GLM). ``cos``/``sin`` are ``unsqueeze(unsqueeze_dim)``-ed to broadcast
against ``q``/``k`` (``unsqueeze_dim=1`` for ``[B, heads, T, D]``, ``2`` for ``[B, T, heads, D]``).
``position_ids`` is ignored as in transformers >= 4.38, except that when ``cos`` is still a 2-D
``[max_positions, rot]`` table (transformers < 4.38) it selects the rows, as it did then.

Triton forward and backward in ``_rope_triton.py`` (``variant`` picks its kernel); the torch
reference below is what CPU tensors run, whatever the variant. Gradients flow to ``q`` and ``k``;
``cos``/``sin`` are treated as constants.
"""

from __future__ import annotations

import torch

from . import _checks, _dispatch
from .errors import DimensionError, ShapeMismatchError

__all__ = ["apply_rotary_pos_emb"]

#: Values of ``variant`` (the Triton kernel): "flat" (the default: whole rows of q and k in one
#: launch) where its assumptions hold, else "rows"; "rows": half-row tiles, q and k in two
#: launches (any number of dims, outputs laid out apart from the inputs)
ROPE_VARIANTS = _checks.ROPE_VARIANTS


def _rotate(x, cos, sin, out_dtype, backward=False):
    rot = cos.shape[-1]
    half = rot // 2
    xr = x[..., :rot].float()
    x1, x2 = xr[..., :half], xr[..., half:]
    c1, c2 = cos[..., :half].float(), cos[..., half:].float()
    s1, s2 = sin[..., :half].float(), sin[..., half:].float()
    if not backward:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    else:  # transpose of the rotation above
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    parts = [y1.to(out_dtype), y2.to(out_dtype)]
    if x.shape[-1] > rot:
        parts.append(x[..., rot:].to(out_dtype))
    return torch.cat(parts, dim=-1)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos_u, sin_u, backend, variant):
        out_q = torch.promote_types(q.dtype, cos_u.dtype)
        out_k = torch.promote_types(k.dtype, cos_u.dtype)
        if backend == "triton":
            from ._rope_triton import rope_triton

            qe, ke = rope_triton(q, k, cos_u, sin_u, False, out_q, out_k, variant=variant)
        else:
            qe = _rotate(q, cos_u, sin_u, out_q)
            ke = _rotate(k, cos_u, sin_u, out_k)
        ctx.save_for_backward(cos_u, sin_u)
        ctx.backend, ctx.variant = backend, variant
        ctx.dtypes = (q.dtype, k.dtype)
        return qe, ke

    @staticmethod
    def backward(ctx, gq, gk):
        cos_u, sin_u = ctx.saved_tensors
        if gq is None or gk is None:
            gq = torch.zeros_like(gk) if gq is None else gq
            gk = torch.zeros_like(gq) if gk is None else gk
        if ctx.backend == "triton":
            from ._rope_triton import rope_triton

            dq, dk = rope_triton(gq, gk, cos_u, sin_u, True, *ctx.dtypes, variant=ctx.variant)
        else:
            dq = _rotate(gq, cos_u, sin_u, ctx.dtypes[0], backward=True)
            dk = _rotate(gk, cos_u, sin_u, ctx.dtypes[1], backward=True)
        return dq, dk, None, None, None, None


def _broadcasts_into(small, big) -> bool:
    """``small`` broadcasts to exactly ``big`` (plain Python: torch.broadcast_shapes is slow)."""
    if len(small) > len(big):
        return False
    return all(a == b or a == 1 for a, b in zip(reversed(small), reversed(big)))


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1, *, variant: str = "flat"):
    """Rotate ``q`` and ``k``; returns ``(q_embed, k_embed)`` like transformers. ``variant``
    (``"flat"``, ``"rows"``: :data:`ROPE_VARIANTS`) is the Triton path's kernel, for benchmarks
    and tests; the torch reference ignores it."""
    _checks.rope_variant(variant)
    return apply_checked(q, k, *check_args(q, k, cos, sin, position_ids, unsqueeze_dim), variant)


def check_args(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1):
    """:func:`apply_rotary_pos_emb`'s argument checks (``TypeError`` / ``ValueError`` naming the
    argument); ``(cos, sin, device)``, cos / sin looked up at ``position_ids`` and unsqueezed as
    the rotation reads them: :func:`apply_checked`'s arguments after q and k. The RoPE shim runs
    them once, before :func:`apply_checked`."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _checks.tensor(name, t)
        _checks.float_dtype(name, t)
    device = _checks.same_device(q=q, k=k, cos=cos, sin=sin)
    if cos.shape != sin.shape:
        raise ShapeMismatchError(f"cos has shape {tuple(cos.shape)} but sin has {tuple(sin.shape)}; they must match")
    if position_ids is not None and cos.dim() == 2:
        _checks.tensor("position_ids", position_ids)
        _checks.integer_target("position_ids", position_ids)
        cos, sin = cos[position_ids], sin[position_ids]
    rot = cos.shape[-1]
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ShapeMismatchError(f"q has head_dim {d} but k has {k.shape[-1]}")
    if rot % 2 or rot == 0 or rot > d:
        raise ShapeMismatchError(f"cos/sin last dimension (rotary dim) must be even, > 0 and <= head_dim {d}, got {rot}")
    try:
        cos_u = cos.unsqueeze(unsqueeze_dim)
        sin_u = sin.unsqueeze(unsqueeze_dim)
    except IndexError as exc:
        raise DimensionError(f"unsqueeze_dim={unsqueeze_dim} is out of range for cos of shape {tuple(cos.shape)}: {exc}") from None
    for name, x in (("q", q), ("k", k)):
        if not _broadcasts_into(cos_u.shape[:-1], x.shape[:-1]):
            raise ShapeMismatchError(
                f"cos of shape {tuple(cos.shape)} unsqueezed at unsqueeze_dim={unsqueeze_dim} does not broadcast "
                f"against {name} of shape {tuple(x.shape)} (without enlarging it)"
            )
    return cos_u, sin_u, device


def apply_checked(q, k, cos_u, sin_u, device, variant: str = "flat"):
    """:func:`apply_rotary_pos_emb` on what :func:`check_args` returned."""
    if _dispatch.compiling():
        out_q = torch.promote_types(q.dtype, cos_u.dtype)
        out_k = torch.promote_types(k.dtype, cos_u.dtype)
        return _dispatch.OPS.rope.default(q, k, cos_u, sin_u, False, out_q, out_k, "auto", variant)
    backend = _dispatch.choose("rope", device)
    return _Rope.apply(q, k, cos_u, sin_u, backend, variant)
