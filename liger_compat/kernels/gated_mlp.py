"""Gated-MLP activations: ``swiglu(gate, up) = silu(gate) * up`` (Llama, Qwen, Mistral) and
``geglu(gate, up) = gelu_tanh(gate) * up`` (Gemma's ``gelu_pytorch_tanh``).

Both compute in fp32 and round once to the input dtype. The backward recomputes the
activation from ``gate`` and ``up`` instead of saving it. Triton kernels in
``_gated_mlp_triton.py``; the torch reference below is what CPU tensors run.

:func:`gated_project` is the MLP's ``down(act(gate) * up)`` without the activation kept for the
backward: ``down`` would save it for its weight gradient, and it is rebuilt from ``gate`` and
``up`` (kept anyway) when that gradient is computed (``_recompute.py``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.modules.module as _module

from .. import _config
from . import _checks, _dispatch, _recompute
from .errors import ShapeMismatchError

__all__ = ["swiglu", "geglu", "gated_project"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)

def recompute_parts() -> frozenset[str]:
    """What the MLP rebuilds in the backward instead of keeping from the forward
    (``LIGER_COMPAT_MLP_RECOMPUTE``, :func:`liger_compat._config.mlp_recompute_parts`): ``activation``
    (``act(gate) * up``, :func:`gated_project`), ``input`` (the norm output feeding gate / up,
    :func:`norm.project_norm_output`), both (``1``, the default) or neither (``0``). A bad value
    raises a ``ValueError`` naming the setting, marked to be passed on by the MLP shim."""
    try:
        return _config.mlp_recompute_parts()
    except ValueError as exc:
        exc.liger_compat_passed_on = True  # a setting error, not an input the kernel refuses
        raise


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


def _forward_fn(backend):
    if backend == "triton":
        from ._gated_mlp_triton import gated_forward_triton

        return gated_forward_triton
    return gated_forward_torch


_TWICE = ("liger_compat swiglu/geglu: backward ran twice through the same graph; its saved "
          "inputs were reused for the first backward's gradients. Recompute the forward "
          "instead of backward(retain_graph=True), or set LIGER_COMPAT_KERNELS without swiglu/geglu.")


class _Gated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, kind, backend, inplace_backward):
        ctx.save_for_backward(gate, up)
        ctx.kind, ctx.backend = kind, backend
        ctx.consumed, ctx.inplace = False, inplace_backward
        return _forward_fn(backend)(gate, up, kind)

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
                raise RuntimeError(_TWICE)
            ctx.consumed = True
            dg, du = gated_backward_triton(dy.contiguous(), gate, up, ctx.kind, inplace=True)
        elif ctx.backend == "triton":
            from ._gated_mlp_triton import gated_backward_triton

            dg, du = gated_backward_triton(dy.contiguous(), gate, up, ctx.kind)
        else:
            dg, du = gated_backward_torch(dy.contiguous(), gate, up, ctx.kind)
        return dg, du, None, None, None


def gated_linear_forward(gate, up, weight, bias, kind: str, backend: str) -> torch.Tensor:
    """``linear(act(gate) * up, weight, bias)``; the activation is a temporary of this call."""
    return torch.nn.functional.linear(_forward_fn(backend)(gate, up, kind), weight, bias)


def gated_linear_backward(dout, gate, up, weight, kind: str, backend: str, inplace: bool, need_w: bool,
                          need_b: bool):
    """Gradients of :func:`gated_linear_forward` for ``gate``, ``up``, ``weight`` and ``bias``
    (``None`` where not needed): ``d(act*up) = dout @ weight``, then one elementwise kernel reads it
    with ``gate`` and ``up``, writes their gradients and, over ``d(act*up)``, the activation again,
    which the weight gradient ``dout^T @ act*up`` reads. ``inplace`` writes the gate / up gradients
    over ``gate`` and ``up`` (Triton only)."""
    d2 = dout.reshape(-1, dout.shape[-1])
    dh = (d2 @ weight).view(gate.shape)
    h = None
    if backend == "triton":
        from ._gated_mlp_triton import gated_backward_triton, gated_forward_triton

        if need_w and dh.dtype == gate.dtype:
            dg, du, h = gated_backward_triton(dh, gate, up, kind, inplace=inplace, output_over_dy=True)
        else:  # the activation first: an in-place backward overwrites gate / up
            h = gated_forward_triton(gate, up, kind) if need_w else None
            dg, du = gated_backward_triton(dh, gate, up, kind, inplace=inplace)
    else:
        h = gated_forward_torch(gate, up, kind) if need_w else None
        dg, du = gated_backward_torch(dh, gate, up, kind)
    dw = d2.t() @ h.reshape(-1, h.shape[-1]) if need_w else None
    db = d2.sum(0) if need_b else None
    return dg, du, dw, db


class _GatedLinear(torch.autograd.Function):
    """``linear(act(gate) * up, weight, bias)`` saving ``gate``, ``up`` and ``weight`` only: the
    activation costs one extra write in the backward (:func:`gated_linear_backward`) instead of
    being kept from the forward to the backward. Under ``torch.compile`` the custom op
    ``gated_linear_fwd`` of ``_ops.py`` does the same (never in place)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, kind, backend, inplace_backward):
        ctx.save_for_backward(gate, up, weight)
        ctx.kind, ctx.backend, ctx.has_bias = kind, backend, bias is not None
        ctx.consumed, ctx.inplace = False, inplace_backward
        return gated_linear_forward(gate, up, weight, bias, kind, backend)

    @staticmethod
    def backward(ctx, dout):
        gate, up, weight = ctx.saved_tensors
        if ctx.consumed:
            raise RuntimeError(_TWICE)
        inplace = ctx.backend == "triton" and ctx.inplace
        ctx.consumed = inplace  # see _Gated.backward
        dg, du, dw, db = gated_linear_backward(dout, gate, up, weight, ctx.kind, ctx.backend, inplace,
                                               ctx.needs_input_grad[2], ctx.has_bias and ctx.needs_input_grad[3])
        return dg, du, dw, db, None, None, None


def _remake(out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """Rebuilds ``out`` (the :class:`_Gated` output) from the inputs its node keeps."""
    ctx = out.grad_fn  # a custom Function's node is its ctx
    kind, backend = ctx.kind, ctx.backend
    fwd = _forward_fn(backend)

    def remake() -> torch.Tensor:
        if ctx.consumed:  # gate / up already hold their gradients
            raise RuntimeError(_TWICE)
        return fwd(gate, up, kind)

    return remake


def check_args(gate, up) -> torch.device:
    """The gated kernels' argument checks (``TypeError`` / ``ValueError`` naming the argument); the
    inputs' device. The MLP shim runs them once, before :func:`gated_project_checked`."""
    _checks.tensor("gate", gate)
    _checks.tensor("up", up)
    _checks.float_dtype("gate", gate)
    _checks.float_dtype("up", up)
    if gate.shape != up.shape:
        raise ShapeMismatchError(f"gate has shape {tuple(gate.shape)} but up has {tuple(up.shape)}; they must match")
    if up.dtype != gate.dtype:
        _checks.same_dtype(gate=gate, up=up)  # raises, naming both
    return _checks.same_device2("gate", gate, "up", up)


def _contiguous(name: str, gate, up, device):
    """Contiguous ``(gate, up, backend)`` of checked inputs."""
    backend = "auto" if _dispatch.compiling() else _dispatch.choose(name, device)
    g = gate if gate.is_contiguous() else gate.contiguous()
    u = up if up.is_contiguous() else up.contiguous()
    return g, u, backend


def _prepare(name: str, gate, up):
    """Checked, contiguous ``(gate, up, backend)``."""
    return _contiguous(name, gate, up, check_args(gate, up))


def _apply_gated(g, u, kind: str, backend: str, inplace: bool):
    if _dispatch.compiling():  # one custom op for the tracer; its backward never works in place
        return _dispatch.OPS.gated_fwd.default(g, u, kind, backend)
    return _Gated.apply(g, u, kind, backend, inplace)


def _gated(name: str, kind: str, gate, up, inplace_backward: bool = False):
    g, u, backend = _prepare(name, gate, up)
    return _apply_gated(g, u, kind, backend, bool(inplace_backward)), g, u


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """``silu(gate) * up``, elementwise, same shape and dtype as the inputs.

    ``inplace_backward=True`` lets the Triton backward write the gradients over ``gate`` and ``up``
    (two buffers of their size less at the backward's peak). Only for callers whose ``gate`` and
    ``up`` are temporaries nobody reads after the forward (the MLP shim's projections); a second
    backward through the same graph then raises.
    """
    return _gated("swiglu", "silu", gate, up, inplace_backward)[0]


def geglu(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up``, elementwise; ``inplace_backward`` as for :func:`swiglu`."""
    return _gated("geglu", "gelu_tanh", gate, up, inplace_backward)[0]


#: activation kind -> the kernel (and ``LIGER_COMPAT_KERNELS`` name) that computes it
KERNEL_OF_ACTIVATION = {"silu": "swiglu", "gelu_tanh": "geglu"}


def _autocast_on(device: torch.device) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device.type))
    except TypeError:  # torch < 2.4: no device argument
        return bool(torch.is_autocast_enabled())


#: torch's global module hooks (each a dict; any entry makes every module call run hooks)
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def _plain_param(p, x: torch.Tensor) -> bool:
    """A plain ``nn.Parameter`` of ``x``'s dtype and device: no DTensor or other tensor subclass
    underneath, no DeepSpeed ZeRO-3 partition."""
    return (type(p) is torch.nn.Parameter and p.dtype == x.dtype and p.device == x.device
            and type(p.data) is torch.Tensor and not hasattr(p, "ds_id"))


def linear_params(m, x: torch.Tensor):
    """``(weight, bias)`` of ``m`` where it is an ``nn.Linear`` whose call is exactly
    ``F.linear(x, weight, bias)`` (:func:`plain_linear`), else None. Runs on every MLP call: the
    parameters are read from the module's own table (no ``nn.Module.__getattr__``)."""
    if type(m) is not torch.nn.Linear:
        return None
    d = m.__dict__
    if "forward" in d or "weight" in d or "bias" in d or d.get("_forward_hooks") or d.get("_forward_pre_hooks") \
            or d.get("_backward_hooks") or d.get("_backward_pre_hooks"):
        return None
    for name in _GLOBAL_HOOKS:
        if getattr(_module, name, None):
            return None
    params = d.get("_parameters")
    if params is None or "bias" not in params:
        return None
    w, b = params.get("weight"), params["bias"]
    if w is None or not _plain_param(w, x) or (b is not None and not _plain_param(b, x)) or _autocast_on(x.device):
        return None
    return w, b


def plain_linear(m, x: torch.Tensor) -> bool:
    """``m`` is an ``nn.Linear`` whose call is exactly ``F.linear(x, weight, bias)``: no hooks, plain
    same-dtype parameters (no DTensor, no DeepSpeed ZeRO-3 partition), no autocast."""
    return linear_params(m, x) is not None


def gated_project(gate: torch.Tensor, up: torch.Tensor, project, *, activation: str = "silu",
                  inplace_backward: bool = False):
    """``project(act(gate) * up)`` (``act`` = ``"silu"`` or ``"gelu_tanh"``) without keeping the
    activation for the backward.

    ``project`` (the MLP's ``down_proj``) would save its input for its weight gradient; that input
    is instead rebuilt from ``gate`` and ``up`` (saved by the gated kernel anyway) when the backward
    needs it: one ``[..., I]`` buffer less per MLP until the backward.

    * ``project`` a plain ``nn.Linear`` (no hooks, plain parameters of the inputs' dtype, no
      autocast): one autograd node for the activation and the linear layer, whose backward writes
      the activation again in the same kernel that computes the gate / up gradients.
    * any other module or callable (LoRA-wrapped, sharded, hooked): ``project`` runs as it is, and
      views of the activation its graph would keep are rebuilt by one more elementwise launch in
      the backward (``_recompute.call_recomputing``; it steps aside under other saved-tensor hooks).

    Values and gradients equal ``project(swiglu(gate, up))``'s (the activation is recomputed by the
    same kernel). Without grad, under ``torch.compile`` or with ``LIGER_COMPAT_MLP_RECOMPUTE`` not
    naming ``activation`` this is exactly that call. ``inplace_backward`` as for :func:`swiglu`.
    """
    if activation not in KERNEL_OF_ACTIVATION:
        raise ValueError(f"activation must be one of {sorted(KERNEL_OF_ACTIVATION)}, got {activation!r}")
    return gated_project_checked(gate, up, project, activation, bool(inplace_backward), check_args(gate, up))


def gated_project_checked(gate: torch.Tensor, up: torch.Tensor, project, activation: str, inplace: bool,
                          device: torch.device):
    """:func:`gated_project` on arguments :func:`check_args` passed (``activation`` a key of
    :data:`KERNEL_OF_ACTIVATION`, ``device`` the one it returned)."""
    g, u, backend = _contiguous(KERNEL_OF_ACTIVATION[activation], gate, up, device)
    rebuild = "activation" in recompute_parts()
    params = (linear_params(project, g) if rebuild and torch.is_grad_enabled() and not _recompute.compiling()
              else None)
    if params is not None and (g.requires_grad or u.requires_grad or params[0].requires_grad):
        return gated_linear(g, u, params[0], params[1], activation, backend, inplace)
    h = _apply_gated(g, u, activation, backend, inplace)
    try:
        if not rebuild or not _recompute.applies(h):
            return project(h)
        return _recompute.call_recomputing(project, h, _remake(h, g, u))
    except (TypeError, ValueError) as exc:
        # project's own error, not this kernel refusing its input: callers that fall back to
        # native code on a refusal (the MLP shim) pass it on instead
        exc.liger_compat_passed_on = True
        raise


def gated_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias, activation: str,
                 backend: str = "auto", inplace: bool = False) -> torch.Tensor:
    """``linear(act(gate) * up, weight, bias)`` as one autograd node that keeps ``gate``, ``up`` and
    ``weight`` (the activation is written again in the backward), for callers that checked the
    inputs (:func:`check_args`; contiguous, one dtype with ``weight``) and that the layer is a plain
    linear one. While TorchDynamo traces it is the custom op ``gated_linear_fwd`` (one opaque node,
    so the partitioner cannot keep the activation; its backward never works in place); else
    :class:`_GatedLinear` (``inplace`` as for :func:`swiglu`)."""
    if _dispatch.compiling():
        return _dispatch.OPS.gated_linear_fwd.default(gate, up, weight, bias, activation, backend)
    if backend == "auto":
        backend = _dispatch.choose(KERNEL_OF_ACTIVATION[activation], gate.device)
    return _GatedLinear.apply(gate, up, weight, bias, activation, backend, bool(inplace))
