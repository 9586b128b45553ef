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
    def forward(ctx, gate, up, kind, backend):
        if backend == "triton":
            from ._gated_mlp_triton import gated_forward_triton as fwd
        else:
            fwd = gated_forward_torch
        ctx.save_for_backward(gate, up)
        ctx.kind, ctx.backend = kind, backend
        return fwd(gate, up, kind)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        if ctx.backend == "triton":
            from ._gated_mlp_triton import gated_backward_triton as bwd
        else:
            bwd = gated_backward_torch
        dg, du = bwd(dy.contiguous(), gate, up, ctx.kind)
        return dg, du, None, None


def _gated(name: str, kind: str, gate, up):
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
    return _Gated.apply(g, u, kind, backend)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, elementwise, same shape and dtype as the inputs."""
    return _gated("swiglu", "silu", gate, up)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up``, elementwise."""
    return _gated("geglu", "gelu_tanh", gate, up)
