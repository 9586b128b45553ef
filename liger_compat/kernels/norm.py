"""RMSNorm: ``y = x / sqrt(mean(x**2) + eps) * (offset + weight)``, Llama and Gemma flavours.

``casting="llama"`` follows transformers' ``LlamaRMSNorm``: the normalised activations are cast
back to the input dtype before the weight multiplies them (output in the promoted dtype of input
and weight). ``casting="gemma"`` follows ``GemmaRMSNorm``: everything in fp32, ``offset=1.0``
(the weight is stored as ``w - 1``), output cast to the input dtype.

Forward and backward in Triton (``_rms_norm_triton.py``) behind the one dispatch point; the
torch reference below is what CPU tensors run.

:func:`project_norm_output` runs the projections that read a norm's output (the MLP's gate / up)
without their graph keeping that output: it is recomputed from the norm's saved input in the
backward (``_recompute.py``), one ``[N, H]`` buffer less per norm until then.
"""

from __future__ import annotations

import torch

from . import _checks, _dispatch, _recompute
from .errors import ShapeMismatchError

__all__ = ["rms_norm", "project_norm_output"]

CASTINGS = ("llama", "gemma")


_out_dtype = _checks.norm_out_dtype


def rms_norm_forward_torch(x2, w, eps, offset, casting):
    """x2 [N, H] -> (y [N, H], rstd [N] fp32)."""
    xf = x2.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    n = xf * rstd[:, None]
    if casting == "llama":
        n = n.to(x2.dtype).float()
    y = n * (offset + w.float())
    return y.to(_out_dtype(x2, w, casting)), rstd


def rms_norm_backward_torch(dy, x2, w, rstd, offset, casting, need_dw=True):
    xf = x2.float()
    n = xf * rstd[:, None]
    g = dy.float() * (offset + w.float())
    dx = rstd[:, None] * (g - n * (g * n).mean(-1, keepdim=True))
    dw = None
    if need_dw:
        nw = n.to(x2.dtype).float() if casting == "llama" else n
        dw = (dy.float() * nw).sum(0)
    return dx.to(x2.dtype), dw


#: ``_rms_norm_triton`` once imported (Triton is optional: imported on the first Triton call)
_triton_impl = None


def _triton():
    global _triton_impl
    if _triton_impl is None:
        from . import _rms_norm_triton

        _triton_impl = _rms_norm_triton
    return _triton_impl


def _forward_fn(backend):
    if backend == "triton":
        return _triton().rms_norm_forward_triton
    return rms_norm_forward_torch


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps, offset, casting, backend):
        x2 = x.reshape(-1, x.shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        y, rstd = _forward_fn(backend)(x2, w, eps, offset, casting)
        ctx.save_for_backward(x2, w, rstd)
        ctx.eps, ctx.offset, ctx.casting, ctx.backend, ctx.shape = eps, offset, casting, backend, x.shape
        # the output is this node's own (no view node after it), so rebuild() can find the node
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, rstd = ctx.saved_tensors
        bwd = _triton().rms_norm_backward_triton if ctx.backend == "triton" else rms_norm_backward_torch
        dy2 = dy.reshape(x2.shape)
        dx, dw = bwd(dy2.contiguous(), x2, w, rstd, ctx.offset, ctx.casting, ctx.needs_input_grad[1])
        if dw is not None:
            dw = dw.to(w.dtype)
        return dx.view(ctx.shape), dw, None, None, None, None


def rebuild(y: torch.Tensor):
    """For ``y`` returned by :func:`rms_norm` (with grad), a function that recomputes it bit for bit
    from what its autograd node keeps (input, weight, rstd), else ``None``. Meant to run in the
    backward before the norm's own backward (``kernels._recompute``)."""
    node = y.grad_fn
    if getattr(node, "_forward_cls", None) is not _RMSNorm:
        return None
    shape = y.shape

    def remake() -> torch.Tensor:
        x2, w, _ = node.saved_tensors  # raises if the norm's backward already freed them
        return _forward_fn(node.backend)(x2, w, node.eps, node.offset, node.casting)[0].view(shape)

    return remake


def check_args(x, weight, eps, casting: str = "llama") -> torch.device:
    """:func:`rms_norm`'s argument checks (``TypeError`` / ``ValueError`` naming the argument); the
    device of ``x`` and ``weight``. The RMSNorm shim runs them once, before a call of
    :func:`rms_norm_checked`."""
    _checks.tensor("x", x)
    _checks.tensor("weight", weight)
    _checks.float_dtype("x", x)
    _checks.float_dtype("weight", weight)
    if casting not in CASTINGS:
        raise ValueError(f"casting must be one of {CASTINGS}, got {casting!r}")
    shape = x.shape
    if not shape or shape[-1] == 0:
        raise ShapeMismatchError(f"x must be [..., H] with H > 0, got shape {tuple(shape)}")
    if weight.shape != shape[-1:]:
        raise ShapeMismatchError(f"weight has shape {tuple(weight.shape)} but x's last dimension is {shape[-1]}")
    if not float(eps) >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    return _checks.same_device2("x", x, "weight", weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, offset: float = 0.0, casting: str = "llama"):
    """RMSNorm over the last dimension of ``x`` (``[..., H]``) with ``weight[H]``."""
    device = check_args(x, weight, eps, casting)
    return rms_norm_checked(x, weight, float(eps), float(offset), casting, device)


def rms_norm_checked(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str,
                     device: torch.device):
    """:func:`rms_norm` on arguments :func:`check_args` passed (``eps`` and ``offset`` floats, ``casting``
    one of :data:`CASTINGS`, ``device`` the one it returned)."""
    if _dispatch.compiling():
        x2 = x.reshape(-1, x.shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        return _dispatch.OPS.rms_norm_fwd.default(x2, weight, eps, offset, casting, "auto")[0].view(x.shape)
    backend = _dispatch.choose("rms_norm", device)
    return _RMSNorm.apply(x, weight, eps, offset, casting, backend)


#: The smallest norm output (bytes) :func:`project_norm_output` drops and rebuilds: below it the
#: rebuild's launch and hooks cost the host more than the buffer is worth (a 2 x 1024-token step of
#: a 1024-wide model keeps 4 MiB a layer, and is host-bound; Llama-3.2-1B at 8192 tokens: 32 MiB).
RECOMPUTE_INPUT_MIN_BYTES = 16 * 2**20


def project_norm_output(y: torch.Tensor, project):
    """``project(y)`` where ``y`` is :func:`rms_norm`'s output, with the tensors of ``y`` that
    ``project``'s graph would keep recomputed in the backward instead (bit for bit the same).

    Plain ``project(y)`` when ``y`` is not such an output (a view of it, a native norm's), smaller
    than :data:`RECOMPUTE_INPUT_MIN_BYTES`, without grad, under ``torch.compile`` or other
    saved-tensor hooks, or with ``LIGER_COMPAT_MLP_RECOMPUTE`` not naming ``input``. The caller must
    not keep ``y`` alive after the call.
    """
    if _recompute.compiling() or y.numel() * y.element_size() < RECOMPUTE_INPUT_MIN_BYTES:
        return project(y)
    from . import gated_mlp

    remake = rebuild(y) if "input" in gated_mlp.recompute_parts() else None
    if remake is None:
        return project(y)
    return _recompute.call_recomputing(project, y, remake)
