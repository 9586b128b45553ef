"""The kernels as torch custom ops (``torch.library``), for code traced by ``torch.compile``.

TorchDynamo cannot trace into a Triton launch or through a host sync: a ``torch.autograd.Function``
whose forward compacts ignored rows with ``nonzero`` broke the graph (10 breaks on a Llama step,
torch 2.11), and Inductor refused the row kernel's ``int8 -> bool`` view (``torch.bool is not
supported by torch.iinfo``). Each op here is one node to the tracer: a fake implementation gives
the output shapes, the autograd formula is registered with the op, and the real implementation
runs the same code as the eager path (the Triton kernels on CUDA, the torch reference on CPU,
picked by :func:`liger_compat.kernels._dispatch.choose` when the backend argument is ``"auto"``).
Whatever the real implementation does (a host sync to skip ignored rows, a bool view) happens at
run time, invisible to the tracer.

This module registers the ops and imports the kernel modules whose functions they run; the kernel
modules never import it back. The package imports it after them, and their public functions call
the ops through ``torch.ops.liger_compat`` (:data:`._dispatch.OPS`) while
``torch.compiler.is_compiling()``; eager calls keep their
``autograd.Function`` (same numbers, no dispatcher cost, and the MLP recompute of
``_recompute.py`` reads those nodes; it steps aside under compile anyway).

Outputs are always fresh tensors (custom ops may not return views of their inputs); a gradient
that is not needed comes back as an empty ``[0]`` tensor and is not passed on. Token-accuracy
hits are float32 (0 / 1) rows rather than bool. The fused loss's out-of-range-target flag stays
inside its op: the real implementation allocates it, queues it and polls (``_device_errors``),
so a bad target raises ``TargetOutOfRangeError`` from the compiled step as from an eager one
(CPU: that call; GPU: once the GPU has got there, the next fused-loss call at the latest).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _checks, _dispatch

_NS = "liger_compat"


def _backend(kernel: str, backend: str, device: torch.device) -> str:
    return _dispatch.choose(kernel, device) if backend == "auto" else backend


def _if_needed(t: Tensor, needed: bool) -> Tensor | None:
    return t if needed else None


# --------------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------------


@torch.library.custom_op(f"{_NS}::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x2: Tensor, w: Tensor, eps: float, offset: float, casting: str, backend: str) -> tuple[Tensor, Tensor]:
    from . import norm

    be = _backend("rms_norm", backend, x2.device)
    y, rstd = norm._forward_fn(be)(x2, w, eps, offset, casting)
    return y, rstd


@rms_norm_fwd.register_fake
def _(x2, w, eps, offset, casting, backend):
    return x2.new_empty(x2.shape, dtype=_checks.norm_out_dtype(x2, w, casting)), x2.new_empty(x2.shape[0], dtype=torch.float32)


@torch.library.custom_op(f"{_NS}::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: Tensor, x2: Tensor, w: Tensor, rstd: Tensor, offset: float, casting: str, need_dw: bool,
                 backend: str) -> tuple[Tensor, Tensor]:
    from . import norm

    be = _backend("rms_norm", backend, x2.device)
    if be == "triton":
        from ._rms_norm_triton import rms_norm_backward_triton as bwd
    else:
        bwd = norm.rms_norm_backward_torch
    dx, dw = bwd(dy.contiguous(), x2, w, rstd, offset, casting, need_dw)
    dw = dw.to(w.dtype) if need_dw else w.new_empty(0)
    return dx.to(x2.dtype), dw


@rms_norm_bwd.register_fake
def _(dy, x2, w, rstd, offset, casting, need_dw, backend):
    return x2.new_empty(x2.shape), w.new_empty(w.shape if need_dw else (0,))


def _rms_setup(ctx, inputs, output):
    x2, w, eps, offset, casting, backend = inputs
    ctx.save_for_backward(x2, w, output[1])
    ctx.offset, ctx.casting, ctx.backend = offset, casting, backend
    ctx.mark_non_differentiable(output[1])


def _rms_backward(ctx, dy, _drstd):
    x2, w, rstd = ctx.saved_tensors
    need_dw = ctx.needs_input_grad[1]
    dx, dw = rms_norm_bwd(dy, x2, w, rstd, ctx.offset, ctx.casting, need_dw, ctx.backend)
    return dx, _if_needed(dw, need_dw), None, None, None, None


rms_norm_fwd.register_autograd(_rms_backward, setup_context=_rms_setup)


# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------


@torch.library.custom_op(f"{_NS}::rope", mutates_args=())
def rope(q: Tensor, k: Tensor, cos_u: Tensor, sin_u: Tensor, backward: bool, out_q: torch.dtype,
         out_k: torch.dtype, backend: str, variant: str) -> tuple[Tensor, Tensor]:
    from . import rope as _rope

    be = _backend("rope", backend, q.device)
    if be == "triton":
        from ._rope_triton import rope_triton

        qe, ke = rope_triton(q, k, cos_u, sin_u, backward, out_q, out_k, variant=variant)
    else:
        qe = _rope._rotate(q, cos_u, sin_u, out_q, backward)
        ke = _rope._rotate(k, cos_u, sin_u, out_k, backward)
    return _like(qe, q, out_q), _like(ke, k, out_k)


def _like(out: Tensor, x: Tensor, dtype: torch.dtype) -> Tensor:
    """``out`` laid out as ``torch.empty_like(x, dtype=dtype)`` (what the fake promises)."""
    if out.stride() == torch.empty_like(x, dtype=dtype, device="meta").stride():  # no allocation
        return out
    want = torch.empty_like(x, dtype=dtype)
    want.copy_(out)
    return want


@rope.register_fake
def _(q, k, cos_u, sin_u, backward, out_q, out_k, backend, variant):
    return torch.empty_like(q, dtype=out_q), torch.empty_like(k, dtype=out_k)


def _rope_setup(ctx, inputs, output):
    q, k, cos_u, sin_u, backward, out_q, out_k, backend, variant = inputs
    ctx.save_for_backward(cos_u, sin_u)
    ctx.dtypes, ctx.backend, ctx.variant = (q.dtype, k.dtype), backend, variant


def _rope_backward(ctx, gq, gk):
    cos_u, sin_u = ctx.saved_tensors
    if gq is None or gk is None:
        gq = torch.zeros_like(gk) if gq is None else gq
        gk = torch.zeros_like(gq) if gk is None else gk
    dq, dk = rope(gq, gk, cos_u, sin_u, True, ctx.dtypes[0], ctx.dtypes[1], ctx.backend, ctx.variant)
    return dq, dk, None, None, None, None, None, None, None


rope.register_autograd(_rope_backward, setup_context=_rope_setup)


# --------------------------------------------------------------------------------------------
# gated MLP activations
# --------------------------------------------------------------------------------------------


def _gated_kernel(kind: str) -> str:
    return "swiglu" if kind == "silu" else "geglu"


@torch.library.custom_op(f"{_NS}::gated_fwd", mutates_args=())
def gated_fwd(gate: Tensor, up: Tensor, kind: str, backend: str) -> Tensor:
    from . import gated_mlp

    be = _backend(_gated_kernel(kind), backend, gate.device)
    return gated_mlp._forward_fn(be)(gate, up, kind)


@gated_fwd.register_fake
def _(gate, up, kind, backend):
    return torch.empty_like(gate)


@torch.library.custom_op(f"{_NS}::gated_bwd", mutates_args=())
def gated_bwd(dy: Tensor, gate: Tensor, up: Tensor, kind: str, backend: str) -> tuple[Tensor, Tensor]:
    from . import gated_mlp

    be = _backend(_gated_kernel(kind), backend, gate.device)
    if be == "triton":
        from ._gated_mlp_triton import gated_backward_triton

        return gated_backward_triton(dy.contiguous(), gate, up, kind)  # not in place: gate / up are inputs
    return gated_mlp.gated_backward_torch(dy.contiguous(), gate, up, kind)


@gated_bwd.register_fake
def _(dy, gate, up, kind, backend):
    return torch.empty_like(gate), torch.empty_like(up)


def _gated_setup(ctx, inputs, output):
    gate, up, kind, backend = inputs
    ctx.save_for_backward(gate, up)
    ctx.kind, ctx.backend = kind, backend


def _gated_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dg, du = gated_bwd(dy, gate, up, ctx.kind, ctx.backend)
    return dg, du, None, None


gated_fwd.register_autograd(_gated_backward, setup_context=_gated_setup)


@torch.library.custom_op(f"{_NS}::gated_linear_fwd", mutates_args=())
def gated_linear_fwd(gate: Tensor, up: Tensor, weight: Tensor, bias: Optional[Tensor], kind: str,
                     backend: str) -> Tensor:
    """``linear(act(gate) * up, weight, bias)`` whose autograd keeps ``gate``, ``up`` and ``weight``
    only (``gated_mlp.gated_linear``): as one opaque node, the partitioner cannot keep the
    activation for the weight gradient, as it does for ``linear(gated_fwd(...))``."""
    from . import gated_mlp

    be = _backend(_gated_kernel(kind), backend, gate.device)
    return gated_mlp.gated_linear_forward(gate, up, weight, bias, kind, be)


@gated_linear_fwd.register_fake
def _(gate, up, weight, bias, kind, backend):
    return gate.new_empty((*gate.shape[:-1], weight.shape[0]))


@torch.library.custom_op(f"{_NS}::gated_linear_bwd", mutates_args=())
def gated_linear_bwd(dout: Tensor, gate: Tensor, up: Tensor, weight: Tensor, kind: str, backend: str, need_w: bool,
                     need_b: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from . import gated_mlp

    be = _backend(_gated_kernel(kind), backend, gate.device)
    # not in place: gate / up are inputs of the op
    dg, du, dw, db = gated_mlp.gated_linear_backward(dout, gate, up, weight, kind, be, False, need_w, need_b)
    return dg, du, dw if need_w else _empty(weight), db if need_b else _empty(weight)


@gated_linear_bwd.register_fake
def _(dout, gate, up, weight, kind, backend, need_w, need_b):
    return (torch.empty_like(gate), torch.empty_like(up), torch.empty_like(weight) if need_w else weight.new_empty(0),
            dout.new_empty(weight.shape[0]) if need_b else weight.new_empty(0))


def _gated_linear_setup(ctx, inputs, output):
    gate, up, weight, bias, kind, backend = inputs
    ctx.save_for_backward(gate, up, weight)
    ctx.kind, ctx.backend, ctx.has_bias = kind, backend, bias is not None


def _gated_linear_backward(ctx, dout):
    gate, up, weight = ctx.saved_tensors
    need_w, need_b = ctx.needs_input_grad[2], ctx.has_bias and ctx.needs_input_grad[3]
    dg, du, dw, db = gated_linear_bwd(dout, gate, up, weight, ctx.kind, ctx.backend, need_w, need_b)
    return dg, du, _if_needed(dw, need_w), _if_needed(db, need_b), None, None


gated_linear_fwd.register_autograd(_gated_linear_backward, setup_context=_gated_linear_setup)


# --------------------------------------------------------------------------------------------
# fused linear cross-entropy
# --------------------------------------------------------------------------------------------


def _opt(ignore_index, label_smoothing, lse_square_scale, softcap):
    from .loss import CEOptions

    return CEOptions(ignore_index, label_smoothing, lse_square_scale, softcap)


def _empty(t: Tensor) -> Tensor:
    return t.new_empty(0)


def _flce(h, w, b, target, scale, ignore_index, label_smoothing, lse_square_scale, softcap, grads, want_stats,
          backend, logits_impl, compact_ignored, ce_variant):
    """The eager path's pass, with its target checks, at run time (the tracer sees none of it):
    the up-front check where the eager entry point runs it (CPU torch reference, or
    ``LIGER_COMPAT_DEBUG``), and the kernels' out-of-range flag, queued without a sync and polled
    as the eager forward and backward do (``_device_errors``)."""
    from . import _device_errors
    from . import loss as _loss

    _device_errors.poll()
    be = _backend("fused_linear_cross_entropy", backend, h.device)
    _checks.target_range("target", target, w.shape[0], ignore_index, kernel_reports=be == "triton")
    opt = _opt(ignore_index, label_smoothing, lse_square_scale, softcap)
    bad = _device_errors.new_flag(h.device) if want_stats else None
    knobs = _loss.FlceKnobs(logits_impl, compact_ignored, ce_variant)  # checked by the entry point
    out = _loss._flce_pass(h, w, b, target, opt, be, scale=scale, grads=grads, want_stats=want_stats, bad=bad,
                           knobs=knobs)
    if bad is not None:
        _device_errors.watch(bad, "fused_linear_cross_entropy", w.shape[0], ignore_index)
        _device_errors.poll()  # CPU: this call's own bad targets; GPU: whatever has finished
    return out


def _rows_out(stats) -> tuple[Tensor, Tensor, Tensor]:
    loss_rows, zl_rows, correct = stats
    return loss_rows, zl_rows, correct.to(torch.float32)


def _graphed_with_grads(h, w, b, target, scale, ignore_index, label_smoothing, lse_square_scale, softcap, grads,
                        backend, logits_impl, compact_ignored, ce_variant):
    """:func:`flce_with_grads`'s outputs from the fused loss's CUDA graphs (``loss._GRAPHS``, the
    same rule as the eager path's, :func:`liger_compat.kernels.loss._graphable`), or None (run it
    eagerly). A compiled graph keeps the op's outputs until its backward, which this op does not
    see: the loss and the per-row outputs (which a caller may keep past the next call) are copied
    out of the graph's buffers; the gradients, which only the op's backward reads, are handed on
    as aliases of them (:func:`_graphs.alias`: no copy of grad_weight), and the graph does not
    replay while any tensor still shares their storage (a later call meanwhile runs eagerly)."""
    from . import _device_errors, _graphs
    from . import loss as _loss

    be = _backend("fused_linear_cross_entropy", backend, h.device)
    knobs = _loss.FlceKnobs(logits_impl, compact_ignored, ce_variant)
    if not any(grads) or not _loss._graphable(h, w, be, knobs):
        return None
    _device_errors.poll()
    _checks.target_range("target", target, w.shape[0], ignore_index, kernel_reports=True)
    opt = _opt(ignore_index, label_smoothing, lse_square_scale, softcap)
    key = ("flce_with_grads", _loss.graph_key(h, w, b, target, opt, be, knobs), tuple(scale.shape), scale.dtype,
           grads)

    def body(hs, ts, ss):
        bad = _device_errors.new_flag(hs.device)
        stats, gh, gw, gb = _loss._flce_pass(hs, w, b, ts, opt, be, scale=ss, grads=grads, want_stats=True, bad=bad,
                                             knobs=knobs)
        loss_rows, zl_rows, hits = _rows_out(stats)
        return loss_rows.sum() * ss, zl_rows, hits, gh, gw, gb, bad

    got = _loss._GRAPHS.run(key, body, (h, target, scale), h.device)
    if got is None:
        return None
    outs, lease = got
    loss, zl, hits = (None if t is None else t.clone() for t in outs[:3])
    gh, gw, gb = (_graphs.alias(t) for t in outs[3:6])
    _device_errors.watch(outs[6], "fused_linear_cross_entropy", w.shape[0], ignore_index)
    del outs, lease  # from here the gradients' aliases alone keep the graph from replaying
    _device_errors.poll()
    return (loss, zl, hits, gh if gh is not None else _empty(h), gw if gw is not None else _empty(w),
            gb if gb is not None else _empty(h))


@torch.library.custom_op(f"{_NS}::flce_with_grads", mutates_args=())
def flce_with_grads(h: Tensor, w: Tensor, b: Optional[Tensor], target: Tensor, scale: Tensor, ignore_index: int,
                    label_smoothing: float, lse_square_scale: float, softcap: Optional[float], need_gh: bool,
                    need_gw: bool, need_gb: bool, backend: str, logits_impl: str, compact_ignored: bool,
                    ce_variant: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Scalar loss ``sum(loss_rows) * scale`` with its gradients formed in the same pass.

    Returns ``(loss, z-loss rows, hit rows, grad_hidden, grad_weight, grad_bias)``; the gradients
    are those of ``loss`` (already times ``scale``), empty where not asked for.
    """
    grads = (need_gh, need_gw, need_gb and b is not None)
    got = _graphed_with_grads(h, w, b, target, scale, ignore_index, label_smoothing, lse_square_scale, softcap, grads,
                              backend, logits_impl, compact_ignored, ce_variant)
    if got is not None:
        return got
    stats, gh, gw, gb = _flce(h, w, b, target, scale, ignore_index, label_smoothing, lse_square_scale, softcap,
                              grads, True, backend, logits_impl, compact_ignored, ce_variant)
    loss_rows, zl_rows, hits = _rows_out(stats)
    loss = loss_rows.sum() * scale
    return (loss, zl_rows, hits, gh if gh is not None else _empty(h), gw if gw is not None else _empty(w),
            gb if gb is not None else _empty(h))


@flce_with_grads.register_fake
def _(h, w, b, target, scale, ignore_index, label_smoothing, lse_square_scale, softcap, need_gh, need_gw, need_gb,
      backend, logits_impl, compact_ignored, ce_variant):
    n = h.shape[0]
    f32 = torch.float32
    gh = h.new_empty(h.shape) if need_gh else h.new_empty(0)
    gw = w.new_empty(w.shape) if need_gw else w.new_empty(0)
    gb = b.new_empty(b.shape) if (need_gb and b is not None) else h.new_empty(0)
    return h.new_empty((), dtype=f32), h.new_empty(n, dtype=f32), h.new_empty(n, dtype=f32), gh, gw, gb


def _with_grads_setup(ctx, inputs, output):
    b = inputs[2]
    ctx.flags = (inputs[9], inputs[10], inputs[11] and b is not None)
    _, zl, hits, gh, gw, gb = output
    ctx.save_for_backward(gh, gw, gb)
    ctx.mark_non_differentiable(zl, hits, gh, gw, gb)


def _with_grads_backward(ctx, g_loss, *_rest):
    gh, gw, gb = ctx.saved_tensors
    need_gh, need_gw, need_gb = ctx.flags
    # always a multiply, as in eager (no host-side test for grad_output == 1): exact for 1.0; the fp32
    # 0-d grad_output multiplies each entry in fp32 and the product keeps the gradient's dtype, as eager's
    out_h = gh * g_loss if need_gh else None
    out_w = gw * g_loss if need_gw else None
    out_b = gb * g_loss if need_gb else None
    return (out_h, out_w, out_b) + (None,) * 13


flce_with_grads.register_autograd(_with_grads_backward, setup_context=_with_grads_setup)


@torch.library.custom_op(f"{_NS}::flce_rows", mutates_args=())
def flce_rows(h: Tensor, w: Tensor, b: Optional[Tensor], target: Tensor, ignore_index: int, label_smoothing: float,
              lse_square_scale: float, softcap: Optional[float], backend: str, logits_impl: str,
              compact_ignored: bool, ce_variant: str) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row ``(loss, z-loss, hit)``; differentiable in the loss rows (the backward runs the
    chunks again with the per-row ``grad_output``, :func:`flce_rows_backward`)."""
    one = torch.ones((), dtype=torch.float32, device=h.device)
    stats, *_ = _flce(h, w, b, target, one, ignore_index, label_smoothing, lse_square_scale, softcap,
                      (False, False, False), True, backend, logits_impl, compact_ignored, ce_variant)
    return _rows_out(stats)


@flce_rows.register_fake
def _(h, w, b, target, ignore_index, label_smoothing, lse_square_scale, softcap, backend, logits_impl, compact_ignored,
      ce_variant):
    n = h.shape[0]
    return tuple(h.new_empty(n, dtype=torch.float32) for _ in range(3))


@torch.library.custom_op(f"{_NS}::flce_rows_backward", mutates_args=())
def flce_rows_backward(h: Tensor, w: Tensor, b: Optional[Tensor], target: Tensor, grad_rows: Tensor,
                       ignore_index: int, label_smoothing: float, lse_square_scale: float, softcap: Optional[float],
                       need_gh: bool, need_gw: bool, need_gb: bool, backend: str, logits_impl: str,
                       compact_ignored: bool, ce_variant: str) -> tuple[Tensor, Tensor, Tensor]:
    grads = (need_gh, need_gw, need_gb and b is not None)
    _, gh, gw, gb = _flce(h, w, b, target, grad_rows.float().reshape(-1), ignore_index, label_smoothing,
                          lse_square_scale, softcap, grads, False, backend, logits_impl, compact_ignored, ce_variant)
    return (gh if gh is not None else _empty(h), gw if gw is not None else _empty(w),
            gb if gb is not None else _empty(h))


@flce_rows_backward.register_fake
def _(h, w, b, target, grad_rows, ignore_index, label_smoothing, lse_square_scale, softcap, need_gh, need_gw,
      need_gb, backend, logits_impl, compact_ignored, ce_variant):
    gh = h.new_empty(h.shape) if need_gh else h.new_empty(0)
    gw = w.new_empty(w.shape) if need_gw else w.new_empty(0)
    gb = b.new_empty(b.shape) if (need_gb and b is not None) else h.new_empty(0)
    return gh, gw, gb


def _rows_setup(ctx, inputs, output):
    h, w, b, target, ignore_index, label_smoothing, lse_square_scale, softcap, backend, *knobs = inputs
    ctx.save_for_backward(h, w, b, target)
    ctx.args = (ignore_index, label_smoothing, lse_square_scale, softcap)
    ctx.backend, ctx.knobs = backend, tuple(knobs)
    ctx.mark_non_differentiable(output[1], output[2])


def _rows_backward(ctx, g_rows, *_rest):
    h, w, b, target = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_gh, need_gw, need_gb = bool(need[0]), bool(need[1]), bool(need[2]) and b is not None
    gh, gw, gb = flce_rows_backward(h, w, b, target, g_rows, *ctx.args, need_gh, need_gw, need_gb, ctx.backend,
                                    *ctx.knobs)
    return (_if_needed(gh, need_gh), _if_needed(gw, need_gw), _if_needed(gb, need_gb)) + (None,) * 9


flce_rows.register_autograd(_rows_backward, setup_context=_rows_setup)


# --------------------------------------------------------------------------------------------
# fused linear cross-entropy, low-memory mode (no stored logits: ``_lowmem_triton``)
# --------------------------------------------------------------------------------------------


def _lowmem_backend(h: Tensor) -> None:
    be = _dispatch.choose("fused_linear_cross_entropy", h.device)
    if be != "triton":
        raise RuntimeError("the low-memory fused loss needs the Triton path (CUDA, or TRITON_INTERPRET=1)")


@torch.library.custom_op(f"{_NS}::flce_lowmem_rows", mutates_args=())
def flce_lowmem_rows(h: Tensor, w: Tensor, b: Optional[Tensor], target: Tensor, ignore_index: int,
                     label_smoothing: float, lse_square_scale: float, softcap: Optional[float],
                     config: Optional[str], compact_ignored: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per row: loss, z-loss, argmax hit (fp32 0/1) and lse (0 for rows left out)."""
    from . import _device_errors
    from . import loss as _loss

    _device_errors.poll()
    _lowmem_backend(h)
    _checks.target_range("target", target, w.shape[0], ignore_index, kernel_reports=True)
    opt = _opt(ignore_index, label_smoothing, lse_square_scale, softcap)
    loss_rows, zl_rows, correct, idx, lse, _ok = _loss._lowmem_forward(h, w, b, target, opt, config, compact_ignored)
    lse_rows = torch.zeros_like(loss_rows).index_copy_(0, idx, lse)
    _device_errors.poll()
    return loss_rows, zl_rows, correct.to(torch.float32), lse_rows


@flce_lowmem_rows.register_fake
def _(h, w, b, target, ignore_index, label_smoothing, lse_square_scale, softcap, config, compact_ignored):
    n = h.shape[0]
    return tuple(h.new_empty(n, dtype=torch.float32) for _ in range(4))


@torch.library.custom_op(f"{_NS}::flce_lowmem_rows_backward", mutates_args=())
def flce_lowmem_rows_backward(h: Tensor, w: Tensor, b: Optional[Tensor], target: Tensor, lse_rows: Tensor,
                              grad_rows: Tensor, ignore_index: int, label_smoothing: float, lse_square_scale: float,
                              softcap: Optional[float], config: Optional[str], need_gh: bool, need_gw: bool,
                              need_gb: bool, compact_ignored: bool) -> tuple[Tensor, Tensor, Tensor]:
    from . import loss as _loss

    _lowmem_backend(h)
    opt = _opt(ignore_index, label_smoothing, lse_square_scale, softcap)
    grads = (need_gh, need_gw, need_gb and b is not None)
    idx = _loss._lowmem_rows_index(target, opt, h.device, compact_ignored)
    tc = target.index_select(0, idx)
    ok = (tc != ignore_index) & (tc >= 0) & (tc < w.shape[0])
    gh, gw, gb = _loss._lowmem_backward(h, w, b, target, opt, idx, lse_rows.index_select(0, idx), ok,
                                        grad_rows, grads, config)
    return (gh if gh is not None else _empty(h), gw if gw is not None else _empty(w),
            gb if gb is not None else _empty(h))


@flce_lowmem_rows_backward.register_fake
def _(h, w, b, target, lse_rows, grad_rows, ignore_index, label_smoothing, lse_square_scale, softcap, config,
      need_gh, need_gw, need_gb, compact_ignored):
    gh = h.new_empty(h.shape) if need_gh else h.new_empty(0)
    gw = w.new_empty(w.shape) if need_gw else w.new_empty(0)
    gb = b.new_empty(b.shape) if (need_gb and b is not None) else h.new_empty(0)
    return gh, gw, gb


def _lowmem_setup(ctx, inputs, output):
    h, w, b, target, ignore_index, label_smoothing, lse_square_scale, softcap, config, compact_ignored = inputs
    ctx.save_for_backward(h, w, b, target, output[3])
    ctx.args = (ignore_index, label_smoothing, lse_square_scale, softcap, config)
    ctx.compact_ignored = compact_ignored
    ctx.mark_non_differentiable(output[1], output[2], output[3])


def _lowmem_rows_backward(ctx, g_rows, *_rest):
    h, w, b, target, lse_rows = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_gh, need_gw, need_gb = bool(need[0]), bool(need[1]), bool(need[2]) and b is not None
    gh, gw, gb = flce_lowmem_rows_backward(h, w, b, target, lse_rows, g_rows, *ctx.args, need_gh, need_gw, need_gb,
                                           ctx.compact_ignored)
    return (_if_needed(gh, need_gh), _if_needed(gw, need_gw), _if_needed(gb, need_gb)) + (None,) * 7


flce_lowmem_rows.register_autograd(_lowmem_rows_backward, setup_context=_lowmem_setup)
