"""Each family's gated MLP routed to :func:`liger_compat.kernels.swiglu` / ``geglu``.

Upstream: ``<Family>MLP.forward`` of ``transformers.models.<family>.modeling_<family>`` (4.45 ..
5.x; ``MixtralBlockSparseTop2MLP`` before transformers 5): ``down(act(gate(x)) * up(x))`` with the
activation and product replaced by one kernel. Phi3 and GLM-4 fuse gate and up into
``gate_up_proj``; Mixtral's experts (4.x) name them w1/w3/w2; transformers 5 Mixtral has fused
expert tensors (no per-expert MLP module: left native). The activation must be recognised as SiLU
or tanh-GELU, and each module is checked against its native forward once per class, attributes
it can read (its fingerprint, :func:`~._module_shims.instance_key`) and dtypes: an ``*MLP`` that
is no gated MLP of ours (gpt-oss's router and experts, Nemotron's relu^2, Falcon-H1's
multipliers other than 1) keeps its native forward and the report lists it.
"""

from __future__ import annotations

from typing import Any, Callable

from .._log import log
from .. import _config
from ..compat import families
from ._module_shims import (UPSTREAM, ModuleShim, classes, close, foreign_replacements,
                            compiling, guarded, kernels_module, patch_instances, kernel_refusal,
                            replaced_classes, native_call, verdict_key)
from ._patching import PatchSet, ShimPatches
from ._registry import register


_SILU_NAMES = {"SiLU", "SiLUActivation"}
_GELU_TANH_NAMES = {"GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh"}


def _is_mlp_name(name: str) -> bool:
    return "MLP" in name


def activation_kind(act: Any) -> str | None:
    """``"silu"`` / ``"gelu_tanh"`` for activations our gated kernels implement, else None."""
    import torch

    name = type(act).__name__
    if isinstance(act, torch.nn.SiLU) or name in _SILU_NAMES:
        return "silu"
    if isinstance(act, torch.nn.GELU):
        return "gelu_tanh" if getattr(act, "approximate", "none") == "tanh" else None
    if name in _GELU_TANH_NAMES:
        return "gelu_tanh"
    return None


def _linear(m: Any, name: str) -> Any:
    import torch

    mod = getattr(m, name, None)
    return mod if isinstance(mod, torch.nn.Module) else None


def mlp_layout(m: Any) -> tuple[str, tuple[Any, ...], Any] | None:
    """``(layout, projections, activation module)`` of a gated MLP, found by attributes."""
    act = None
    for attr in ("act_fn", "activation_fn", "act"):
        act = getattr(m, attr, None)
        if act is not None:
            break
    if act is None:
        return None
    if all(_linear(m, n) is not None for n in ("gate_proj", "up_proj", "down_proj")):
        return "gate_up_down", (m.gate_proj, m.up_proj, m.down_proj), act
    if _linear(m, "gate_up_proj") is not None and _linear(m, "down_proj") is not None:
        return "fused_gate_up", (m.gate_up_proj, m.down_proj), act
    if all(_linear(m, n) is not None for n in ("w1", "w3", "w2")):
        return "w1_w3_w2", (m.w1, m.w3, m.w2), act
    return None


def mlp_forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    if len(args) == 1 and not kwargs and instance is not None and compiling():
        return _compiled_mlp_forward(wrapped, instance, args[0])
    if len(args) != 1 or kwargs or instance is None or native_call(args[0]):
        return wrapped(*args, **kwargs)
    found = mlp_layout(instance)
    if found is None:
        _not_gated(instance)
        return wrapped(*args)
    layout, projs, act = found
    kind = activation_kind(act)
    fam = families.BY_MODULE.get(type(instance).__module__)
    if kind is None or (fam is not None and fam.mlp_act != kind):
        _not_gated(instance)
        return wrapped(*args)
    kernels = kernels_module()
    kernel_name = kernels.gated_mlp.KERNEL_OF_ACTIVATION[kind]
    if not _config.kernel_enabled(kernel_name):
        return wrapped(*args)

    x = args[0]
    down_proj = projs[-1]

    def project_in(t: Any) -> tuple[Any, Any]:
        if layout == "fused_gate_up":
            return projs[0](t).chunk(2, dim=-1)
        return projs[0](t), projs[1](t)

    # the verdict first: a module the probe turned down runs its native forward alone (the
    # projections are not computed twice)
    if not _mlp_matches(wrapped, instance, x, project_in, down_proj, kind, layout, projs[0]):
        return wrapped(*args)
    # x is our RMSNorm's output when the family's norm is patched: gate_proj / up_proj then keep
    # nothing of it, it is recomputed from the norm's saved input in the backward
    gate, up = kernels.project_norm_output(x, project_in)
    # gate / up are this call's own projections, read by nothing after the forward: the kernel
    # may overwrite them with their gradients in the backward. down_proj's input is rebuilt from
    # them in the backward instead of being kept (kernels.gated_project). The verdict holds for
    # these inputs, so down(act(gate) * up) is the native result where the kernel refuses them.
    # the kernel's own argument checks, run once: the call below skips them
    device, refusal = kernel_refusal(lambda: kernels.gated_mlp.check_args(gate, up))
    if refusal is not None:
        return guarded(kernel_name, refusal, lambda: None, lambda: down_proj(act(gate) * up))[0]
    return kernels.gated_mlp.gated_project_checked(gate, up, down_proj, kind, True, device)


#: (class, instance fingerprint, training, input dtype, autocast dtype or None, layout, activation,
#: projection weight dtype) -> True where ``down(act(gate) * up)`` reproduces the module's forward,
#: False where it does not, or the kernel's refusal of the probe's inputs (native code, not listed
#: as refused by the probe); (class, None) -> False for an ``*MLP`` class that is no gated MLP of
#: ours (gpt-oss's router and experts, Nemotron's relu^2 MLP): recorded for the report
_mlp_verdicts: dict[tuple[Any, ...], bool | str] = {}


def _not_gated(m: Any) -> None:
    key = (type(m), None)
    if key not in _mlp_verdicts:
        _mlp_verdicts[key] = False


def _mlp_matches(native: Any, m: Any, x: Any, project_in: Callable[[Any], tuple[Any, Any]], down_proj: Any,
                 kind: str, layout: str, first_proj: Any, force_key: bool = False) -> bool:
    """The structural probe of a gated MLP: its native forward and the gated kernel on this input,
    once per instance fingerprint (:func:`~._module_shims.verdict_key`: the attributes and config
    its forward can read), training mode and dtypes. A forward that does more than
    ``down(act(gate) * up)`` (Falcon-H1's gate / down multipliers, a clamped SwiGLU) fails it and
    keeps its native code."""
    import torch

    # under autocast the projections run in the autocast dtype: a verdict (and the tolerance) of its
    # own, so one autocast call never turns the kernel off for the plain dtype or the other way round
    autocast = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None
    weight = getattr(first_proj, "weight", None)
    key = verdict_key(m, x.dtype, autocast, layout, kind, getattr(weight, "dtype", None), force=force_key)
    hit = None if key is None else _mlp_verdicts.get(key)
    if hit is not None:
        return hit is True

    from .. import kernels

    if x.numel() == 0:
        # nothing to compare (an MoE expert routed no token, an empty batch): this call runs its
        # native forward and the verdict waits for an input with rows
        return False
    with torch.no_grad():
        probe = x.detach()[..., :8, :] if x.dim() >= 2 else x.detach()
        gate, up = project_in(probe)
        _, refusal = kernel_refusal(lambda: kernels.gated_mlp.check_args(gate, up))
        if refusal is not None:
            log.warning("liger_compat: %s kernel refuses an input, native code used: %s",
                        kernels.gated_mlp.KERNEL_OF_ACTIVATION[kind], refusal)
            _mlp_verdicts[key] = refusal
            return False
        ref = native(probe)
        got = kernels.gated_project(gate.contiguous(), up.contiguous(), down_proj, activation=kind)
    ok = isinstance(ref, torch.Tensor) and close(got, ref, autocast or x.dtype)
    if not ok:
        log.warning("liger_compat: %s keeps its native forward: it is not down(%s(gate) * up)", type(m).__name__, kind)
    _mlp_verdicts[key] = ok
    return ok


def _compiled_mlp_forward(wrapped: Any, m: Any, x: Any) -> Any:
    """The MLP while TorchDynamo traces a training step: ``down(act(gate(x)) * up(x))`` with the
    activation and ``down_proj`` as one custom op that keeps ``gate``, ``up`` and the weight
    (``kernels.gated_mlp.gated_linear``), where :func:`_compiled_route` found the module to be
    exactly that; the native forward otherwise, and without grad (Inductor fuses the activation
    then, with nothing to keep). Natively the compiled step keeps ``act(gate) * up`` for
    ``down_proj``'s weight gradient: one ``[tokens, intermediate]`` buffer a layer."""
    import torch

    if not (torch.is_grad_enabled() and isinstance(x, torch.Tensor)):
        return wrapped(x)
    found = mlp_layout(m)
    if found is None or found[0] != "gate_up_down":
        return wrapped(x)
    gate_proj, up_proj, down_proj = found[1]
    # hooks on down_proj would not run (its forward is the op's): read here so that a hook added
    # later is a guard that fails, and the step compiles again (native then)
    if down_proj._forward_hooks or down_proj._forward_pre_hooks:
        return wrapped(x)
    kind = _compiled_route(m, getattr(wrapped, "func", None), str(x.dtype).split(".")[-1], str(x.device))
    if not kind:
        return wrapped(x)
    return kernels_module().gated_mlp.gated_linear(gate_proj(x), up_proj(x), down_proj.weight, down_proj.bias, kind)


def _constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run eagerly while TorchDynamo traces, its result a constant of the graph
    (``torch._dynamo.assume_constant_result``); ``fn`` itself where torch has no such decorator."""
    import torch

    deco = getattr(getattr(torch, "_dynamo", None), "assume_constant_result", None)
    return fn if deco is None else deco(fn)


def _compiled_route_eager(m: Any, native_fn: Any, dtype_name: str, device: str) -> str:
    """The activation kind (``"silu"`` / ``"gelu_tanh"``) when module ``m`` may run as one gated
    linear op under compile, else ``""``: the eager path's conditions (kernel selected, a device
    with Triton kernels or ``LIGER_COMPAT_CPU_NATIVE=0``, ``LIGER_COMPAT_MLP_RECOMPUTE`` naming
    ``activation``, the family's activation, three plain ``nn.Linear`` projections of the input's
    dtype) and the structural probe of :func:`_mlp_matches` on a random input of the step's dtype
    and device (the verdict is kept with the eager ones, keyed the same way). Runs eagerly while
    dynamo traces (:data:`_compiled_route`), once per graph."""
    import functools

    import torch

    kernels = kernels_module()
    found = mlp_layout(m)
    if found is None or found[0] != "gate_up_down" or native_fn is None:
        return ""
    projs, act = found[1], found[2]
    kind = activation_kind(act)
    fam = families.BY_MODULE.get(type(m).__module__)
    if kind is None or (fam is not None and fam.mlp_act != kind):
        return ""
    if not _config.kernel_enabled(kernels.gated_mlp.KERNEL_OF_ACTIVATION[kind]):
        return ""
    dev, dtype = torch.device(device), getattr(torch, dtype_name)
    if _config.settings.cpu_native and kernels._dispatch.reference_only(dev):
        return ""
    if "activation" not in kernels.gated_mlp.recompute_parts():
        return ""
    width = getattr(projs[0], "in_features", None)
    if not isinstance(width, int):
        return ""
    probe = torch.randn(1, 8, width, generator=torch.Generator().manual_seed(0)).to(device=dev, dtype=dtype)
    if not all(kernels.gated_mlp._plain_linear(p, probe) for p in projs):
        return ""
    ok = _mlp_matches(functools.partial(native_fn, m), m, probe, lambda t: (projs[0](t), projs[1](t)), projs[2],
                      kind, "gate_up_down", projs[0], force_key=True)
    return kind if ok else ""


_compiled_route = _constant_result(_compiled_route_eager)


def _patch_mlps(self: ModuleShim, module: Any, patches: ShimPatches) -> None:
    for name, owner in foreign_replacements(module, _is_mlp_name):
        self.conflict(module, f"{module.__name__}.{name}", owner)
    for cls in classes(module, _is_mlp_name):
        self.wrap_class_forward(module, cls, mlp_forward, patches)


def refused(module_name: str) -> list[str]:
    """MLP classes of the module the probe turned down (native after probe)."""
    return sorted({k[0].__name__ for k, ok in list(_mlp_verdicts.items())
                   if ok is False and k[0].__module__ == module_name})


STATE = ModuleShim("transformers.gated_mlp", "gated_mlp", _patch_mlps, replaced_classes(_is_mlp_name))


def _mlp_instances(model: Any, patches: PatchSet) -> bool:
    def ok(m: Any) -> bool:
        found = mlp_layout(m)
        return found is not None and activation_kind(found[2]) is not None
    return patch_instances(model, mlp_forward, _is_mlp_name, ok, patches, STATE.id)


SHIM = register(
    id=STATE.id, library="transformers", trigger="transformers",
    target="<Family>MLP.forward (gate/up/down, gate_up_proj, w1/w3/w2) of the families",
    upstream=UPSTREAM + " (Mixtral experts fused into tensors in 5.0)",
    kernels=("swiglu", "geglu"), description="act(gate) * up routed to liger_compat.kernels.swiglu / geglu",
    modules=families.family_modules, patch_module=STATE.patch_module, _revert=STATE.revert,
    apply_to_model=_mlp_instances,
)
