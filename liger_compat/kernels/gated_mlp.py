"""Gated-MLP activations: ``swiglu(gate, up) = silu(gate) * up`` (Llama, Qwen, Mistral) and
``geglu(gate, up) = gelu_tanh(gate) * up`` (Gemma's ``gelu_pytorch_tanh``).

Both compute in fp32 and round once to the input dtype. The backward recomputes the
activation from ``gate`` and ``up`` instead of saving it. Triton kernels in
``_gated_mlp_triton.py``; the torch reference below is what CPU tensors run.
"""

from __future__ import annotations

import math

import torch

from . import _checks, _dispatch

__all__ = ["swiglu", "geglu"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _act_and_grad(a: torch.Tensor, kind: str):
    """(act(a), act'(a)) in fp32."""
    if kind == "silu":
        s = torch.sigmoid(a)
        return a * s, s * (1.0 + a * (1.0 - s))
    # 0.5 * a * (1 + tanh(u)) == a * sigmoid(2u): no cancellation for negative a
    u2 = 2.0 * _SQRT_2_OVER_PI * (a + 0.044715 * a * a * a)
    s = torch.sigmoid(u2)
    act = a * s
    d = s + a * s * (1.0 - s) * 2.0 * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * a * a)
    return act, d


def gated_forward_torch(gate, up, kind):
    act, _ = _act_and_grad(gate.float(), kind)
    return (act * up.float()).to(gate.dtype)


def gated_backward_torch(dy, gate, up, kind):
    a = gate.float()
    act, d = _act_and_grad(a, kind)
    g = dy.float()
    return (g * up.float() * d).to(gate.dtype), (g * act).to(up.dtype)


class _Gated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, kind, backend, inplace_backward):
        if backend == "triton":
            from ._gated_mlp_triton import gated_forward_triton as fwd
        else:
            fwd = gated_forward_torch
        ctx.save_for_backward(gate, up)
        ctx.kind, ctx.backend = kind, backend
        ctx.consumed, ctx.inplace = False, inplace_backward
        return fwd(gate, up, kind)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        if ctx.backend == "triton" and ctx.inplace:
            from ._gated_mlp_triton import gated_backward_triton

            # the Triton backward overwrites the saved gate/up with their gradients (the peak of
            # a training step sits in the backward: two [N, I] buffers less); a second backward
            # through the same graph (retain_graph=True) would read gradients as inputs, so it
            # is refused loudly instead of giving wrong numbers
            if ctx.consumed:
                raise RuntimeError(
                    "liger_compat swiglu/geglu: backward ran twice through the same graph; its saved "
                    "inputs were reused for the first backward's gradients. Recompute the forward "
                    "instead of backward(retain_graph=True), or set LIGER_COMPAT_KERNELS without swiglu/geglu."
                )
            ctx.consumed = True
            dg, du = gated_backward_triton(dy.contiguous(), gate, up, ctx.kind, inplace=True)
        elif ctx.backend == "triton":
            from ._gated_mlp_triton import gated_backward_triton

            dg, du = gated_backward_triton(dy.contiguous(), gate, up, ctx.kind)
        else:
            dg, du = gated_backward_torch(dy.contiguous(), gate, up, ctx.kind)
        return dg, du, None, None, None


def _gated(name: str, kind: str, gate, up, inplace_backward: bool = False):
    _checks.tensor("gate", gate)
    _checks.tensor("up", up)
    _checks.float_dtype("gate", gate)
    _checks.float_dtype("up", up)
    if gate.shape != up.shape:
        raise ValueError(f"gate has shape {tuple(gate.shape)} but up has {tuple(up.shape)}; they must match")
    _checks.same_dtype(gate=gate, up=up)
    device = _checks.same_device(gate=gate, up=up)
    backend = _dispatch.choose(name, device)
    g = gate if gate.is_contiguous() else gate.contiguous()
    u = up if up.is_contiguous() else up.contiguous()
    return _Gated.apply(g, u, kind, backend, bool(inplace_backward))


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """``silu(gate) * up``, elementwise, same shape and dtype as the inputs.

    ``inplace_backward=True`` lets the Triton backward write the gradients over ``gate`` and ``up``
    (two buffers of their size less at the backward's peak). Only for callers whose ``gate`` and
    ``up`` are temporaries nobody reads after the forward (the MLP shim's projections); a second
    backward through the same graph then raises.
    """
    return _gated("swiglu", "silu", gate, up, inplace_backward)


def geglu(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up``, elementwise; ``inplace_backward`` as for :func:`swiglu`."""
    return _gated("geglu", "gelu_tanh", gate, up, inplace_backward)
