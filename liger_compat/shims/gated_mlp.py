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
from ._module_shims import (UPSTREAM, ModuleShim, classes, close, constant_result, foreign_replacements,
                            compiling, guarded, kernels_module, patch_instances, kernel_refusal,
                            registered, replaced_classes, native_call, verdict_key)
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


def _member(m: Any, name: str) -> Any:
    """``getattr(m, name, None)``, a registered submodule read from the module's own table (this runs
    on every MLP call; :func:`~._module_shims.registered`); plain ``getattr`` while TorchDynamo traces."""
    if compiling():
        return getattr(m, name, None)
    return registered(m, name)


def _linear(m: Any, name: str) -> Any:
    import torch

    mod = _member(m, name)
    return mod if isinstance(mod, torch.nn.Module) else None


def mlp_layout(m: Any) -> tuple[str, tuple[Any, ...], Any] | None:
    """``(layout, projections, activation module)`` of a gated MLP, found by attributes."""
    act = None
    for attr in ("act_fn", "activation_fn", "act"):
        act = _member(m, attr)
        if act is not None:
            break
    if act is None:
        return None
    for layout, names in _LAYOUTS:
        found = _linears(m, names)
        if found is not None:
            return layout, found, act
    return None


#: the gated MLP layouts, by the names of their projections (the last one the down projection)
_LAYOUTS = (("gate_up_down", ("gate_proj", "up_proj", "down_proj")), ("fused_gate_up", ("gate_up_proj", "down_proj")),
            ("w1_w3_w2", ("w1", "w3", "w2")))


def _linears(m: Any, names: tuple[str, ...]) -> tuple[Any, ...] | None:
    """The modules named, or None from the first name that is no module."""
    found = []
    for name in names:
        mod = _linear(m, name)
        if mod is None:
            return None
        found.append(mod)
    return tuple(found)


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
    if _small_native(x, down_proj):
        return wrapped(*args)

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


#: an eager MLP call on a GPU runs the module's native forward where its activation ``act(gate) * up``
#: (tokens x intermediate x the input's element size) is below this (``LIGER_COMPAT_MLP_SMALL_NATIVE``),
#: the compiled route's bound (:data:`COMPILED_ROUTE_MIN_BYTES`). Such a step is host-bound: the kernel
#: saves an elementwise pass of GPU time (a few microseconds at 16 MiB) and costs the host its Python
#: launch and autograd Function, and the MLP's recompute saves memory a step this small does not lack.
#: Timed step by step on an H200 with the kernel left out (``benchmarks/results/kernel_leave_out_*.md``,
#: 2 x 1024 and 2 x 2048 tokens of 1024-wide models: 11.5-23 MiB), the native MLP was the faster in
#: most families: Llama 0.770 -> 0.750 and 0.798 -> 0.760 of native, GLM-4 0.761 -> 0.731, Cohere
#: 0.872 -> 0.837, Ministral 0.786 -> 0.754; with this route against the kernel at every size in one
#: process (``kernel_leave_out_mlp_small_1024.md``) below it in all five families timed
EAGER_NATIVE_MAX_BYTES = 64 * 2**20
#: the devices whose eager small MLPs run natively (the kernels' GPU path; CPU tensors run
#: transformers' own code already unless ``LIGER_COMPAT_CPU_NATIVE=0``, and the interpreter's tests
#: run the kernels at every size)
SMALL_NATIVE_DEVICES = ("cuda",)


def _small_native(x: Any, down_proj: Any) -> bool:
    """Whether this eager MLP call runs its native forward (:data:`EAGER_NATIVE_MAX_BYTES`): on
    :data:`SMALL_NATIVE_DEVICES`, ``LIGER_COMPAT_MLP_SMALL_NATIVE`` on, the activation below the
    bound (the down projection's input width read as ``in_features``; a projection without one keeps
    the kernel)."""
    width = getattr(down_proj, "in_features", None)
    if not (_config.settings.mlp_small_native and isinstance(width, int)):
        return False
    dim = x.dim()
    if dim == 0 or x.device.type not in SMALL_NATIVE_DEVICES:
        return False
    return (x.numel() // max(x.shape[-1], 1)) * width * x.element_size() < EAGER_NATIVE_MAX_BYTES


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
                 kind: str, layout: str, first_proj: Any) -> bool:
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
    key = verdict_key(m, x.dtype, autocast, layout, kind, getattr(weight, "dtype", None))
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


#: the compiled MLP takes the gated linear op where the activation it would keep is at least this
#: large (a layer): below it the op's host cost is not worth the buffer (a 2 x 1024-token step of
#: a 1024-wide model keeps 16 MiB a layer and is host-bound; an 8-layer 2048-wide Llama at 4 x 2048
#: tokens 128 MiB, 1.0 GiB in all, at the same step time with the op)
COMPILED_ROUTE_MIN_BYTES = 64 * 2**20


def _compiled_mlp_forward(wrapped: Any, m: Any, x: Any) -> Any:
    """The MLP while TorchDynamo traces a training step: ``down(act(gate(x)) * up(x))`` with the
    activation and ``down_proj`` as one custom op that keeps ``gate``, ``up`` and the weight
    (``kernels.gated_mlp.gated_linear``), where the module's native forward is exactly that
    (:func:`plain_gated_forward`), its activation one of our kernels' and its projections plain
    ``nn.Linear`` layers, and the activation would take at least :data:`COMPILED_ROUTE_MIN_BYTES`;
    the native forward otherwise, and without grad (Inductor fuses the activation then, with
    nothing to keep). Natively the compiled step keeps ``act(gate) * up`` for
    ``down_proj``'s weight gradient: one ``[tokens, intermediate]`` buffer a layer."""
    import torch

    if not (torch.is_grad_enabled() and isinstance(x, torch.Tensor)):
        return wrapped(x)
    found = mlp_layout(m)
    if found is None or found[0] != "gate_up_down":
        return wrapped(x)
    gate_proj, up_proj, down_proj = found[1]
    route = _compiled_route
    if route is None:  # no module patched yet (not reached: a patched forward is what calls this)
        return wrapped(x)
    act_name = route(getattr(wrapped, "func", None), str(x.device))
    # the size first, from shapes the step's guards already hold (the input's and the gate weight's,
    # which native code reads too): each check below adds guards that the compiled step evaluates
    # at every call (the plain-layer checks a dozen a projection), for an answer a small step does
    # not use
    w = getattr(gate_proj, "weight", None)
    if not act_name or not isinstance(w, torch.Tensor) or w.dim() != 2 or (
            x.numel() // max(x.shape[-1], 1) * w.shape[0] * x.element_size() < COMPILED_ROUTE_MIN_BYTES):
        return wrapped(x)
    kind = activation_kind(getattr(m, act_name))  # the activation the forward calls
    fam = families.BY_MODULE.get(type(m).__module__)
    if kind is None or (fam is not None and fam.mlp_act != kind):
        return wrapped(x)
    gated = kernels_module().gated_mlp
    if not _config.kernel_enabled(gated.KERNEL_OF_ACTIVATION[kind]):
        return wrapped(x)
    # down_proj's own forward and hooks would not run (the op computes it): plain layers only; a
    # hook added later fails a guard on what is read here, and the step compiles again
    if not all(gated.plain_linear(p, x) for p in (gate_proj, up_proj, down_proj)):
        return wrapped(x)
    return gated.gated_linear(gate_proj(x), up_proj(x), down_proj.weight, down_proj.bias, kind)


def _compiled_route_eager(native_fn: Any, device: str) -> str:
    """The name of the activation attribute when an MLP whose native forward is ``native_fn`` may
    run as one gated linear op under compile on ``device``, else ``""``: the forward is exactly
    ``down(act(gate(x)) * up(x))`` (:func:`plain_gated_forward`), the device runs the Triton kernels
    (or ``LIGER_COMPAT_CPU_NATIVE=0``) and ``LIGER_COMPAT_MLP_RECOMPUTE`` names ``activation``. Runs
    eagerly while dynamo traces (:data:`_compiled_route`): it writes no global that traced code
    reads (``kernels_module`` and ``_config.compiling`` keep their answers in globals, and the
    trace's guards on them would fail to build), so it imports the kernels itself."""
    import torch

    from .. import kernels

    if native_fn is None or (_config.settings.cpu_native and kernels._dispatch.reference_only(torch.device(device))):
        return ""
    if "activation" not in kernels.gated_mlp.recompute_parts():
        return ""
    return plain_gated_forward(native_fn) or ""


#: :func:`_compiled_route_eager` marked for dynamo (:func:`~._module_shims.constant_result`), set when the shim
#: first patches a module (torch is imported then; ``import liger_compat`` imports no torch)
_compiled_route: Callable[..., str] | None = None


def _mark_compiled_route() -> None:
    global _compiled_route
    if _compiled_route is None:
        _compiled_route = constant_result(_compiled_route_eager)


#: MLP forward function -> its activation attribute, or None (:func:`plain_gated_forward`)
_plain_forwards: dict[Any, str | None] = {}

_ACT_ATTRS = ("act_fn", "activation_fn", "act")


def plain_gated_forward(fn: Any) -> str | None:
    """The activation attribute's name when the source of ``fn`` (an MLP's ``forward(self, x)``) is
    exactly ``self.down_proj(self.<act>(self.gate_proj(x)) * self.up_proj(x))``, written in one
    expression or through local names, the product either way round; else None. Read from the
    source, not probed, so it holds for every instance: the forward reads nothing else (no config
    branch, as transformers 4.45's ``pretraining_tp``; no multiplier, as Falcon-H1's). Kept per
    function."""
    if fn in _plain_forwards:
        return _plain_forwards[fn]
    import ast
    import inspect
    import textwrap

    found = None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        tree = None
    fdef = tree.body[0] if tree is not None and tree.body else None
    if isinstance(fdef, ast.FunctionDef):
        found = _plain_gated_body(fdef)
    _plain_forwards[fn] = found
    return found


def _plain_gated_body(fdef: Any) -> str | None:
    import ast

    a = fdef.args
    if (len(a.args) != 2 or a.vararg or a.kwarg or a.kwonlyargs or a.defaults or getattr(a, "posonlyargs", None)
            or fdef.decorator_list):
        return None
    this, param = a.args[0].arg, a.args[1].arg
    body = list(fdef.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]  # the docstring
    names: dict[str, Any] = {}

    def canon(node: Any) -> Any:
        if isinstance(node, ast.Name):
            if node.id in names:
                return names[node.id]
            return ("x",) if node.id == param else None
        if (isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords
                and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                and node.func.value.id == this):
            inner = canon(node.args[0])
            return None if inner is None else ("call", node.func.attr, inner)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            left, right = canon(node.left), canon(node.right)
            return None if left is None or right is None else ("mul", left, right)
        return None

    if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return None
    for stmt in body[:-1]:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            return None
        value = canon(stmt.value)
        if value is None:
            return None
        names[stmt.targets[0].id] = value
    out = canon(body[-1].value)
    x = ("x",)
    up = ("call", "up_proj", x)
    for act in _ACT_ATTRS:
        gate = ("call", act, ("call", "gate_proj", x))
        if out in (("call", "down_proj", ("mul", gate, up)), ("call", "down_proj", ("mul", up, gate))):
            return act
    return None


def _patch_mlps(self: ModuleShim, module: Any, patches: ShimPatches) -> None:
    _mark_compiled_route()
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
    _mark_compiled_route()
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
