"""What the three module shims share (:mod:`.rms_norm`, :mod:`.gated_mlp`, :mod:`.rope`).

Upstream: the ``<Family>RMSNorm`` / ``<Family>MLP`` classes and the module-level
``apply_rotary_pos_emb`` of ``transformers.models.<family>.modeling_<family>`` (4.45 .. 5.x).
Each shim finds its targets structurally in every family modeling module (classes named
``*RMSNorm`` / ``*MLP`` defined there, the rotary function by name), patches the classes (so
existing instances are covered), keeps a target another library replaced native and reports it,
and confirms numerically on first use that the kernel reproduces the native code (a mismatch keeps
the native code for good, listed by the report as "native after probe"). ``apply(model=...)``
also patches RMSNorm and MLP *instances* of classes outside the families (remote-code models) that
pass the same checks.

Here: the bookkeeping per shim (:class:`ModuleShim`), the guarded kernel call, the probe
tolerance, instance patching and the report line of a family's modules (:func:`describe`).
"""

from __future__ import annotations

import types
import weakref
from typing import Any, Callable

from .. import _config
from .._log import log
from ..compat import conflicts, families
from ._patching import Gate, PatchSet, ShimPatches, is_ours
from ._registry import REGISTRY


compiling = _config.compiling


def classes(module: Any, test: Callable[[str], bool]) -> list[type]:
    name = module.__name__
    return [obj for cls_name, obj in list(vars(module).items())
            if isinstance(obj, type) and test(cls_name) and obj.__module__ == name and "forward" in vars(obj)]


def foreign_replacements(module: Any, test: Callable[[str], bool]) -> list[tuple[str, str]]:
    """Names in the modeling module that another library bound to its own class (LigerRMSNorm)."""
    out = []
    for cls_name, obj in list(vars(module).items()):
        if isinstance(obj, type) and test(cls_name) and obj.__module__ != module.__name__:
            owner = conflicts.foreign_owner(obj)
            if owner is not None:
                out.append((cls_name, owner))
    return out


def decode_step(x: Any) -> bool:
    """Whether a module call on ``x`` is a decode step that runs transformers' own code
    (``LIGER_COMPAT_DECODE_NATIVE``, on by default): no autograd graph is being built
    (``no_grad`` / ``inference_mode``, as in ``generate``), and one position per sequence
    (``x.shape[-2] == 1``: hidden states ``[batch, 1, hidden]``, or the rotary ``cos``
    ``[batch, 1, dim]``). There each kernel gets a handful of rows, where its launch
    costs more than the native ops it replaces, and with no backward there is no memory to save.
    Calls over whole sequences (prefill, evaluation, a reference model's forward) keep the kernels,
    so a policy and its reference model still compute the same way."""
    import torch

    if not _config.settings.decode_native or torch.is_grad_enabled():
        return False
    return isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-2] == 1


def native_call(x: Any) -> bool:
    """Whether a module call on ``x`` runs transformers' own code: every call while torch.compile
    traces (Inductor fuses the native ops with their neighbours, which a kernel's custom op would
    stop: a small compiled step took 12.0 ms with them against native's 8.1; docs/torch-compile.md),
    a decode step (:func:`decode_step`), or tensors no Triton kernel runs on by default (``kernels._dispatch.reference_only``: CPU tensors
    without ``TRITON_INTERPRET=1``, or no importable Triton) while ``LIGER_COMPAT_CPU_NATIVE`` is on
    (the default). There the kernels would run their torch references, the native module's result
    with more ops and Python a call (a tiny model's CPU step took 1.9x native's with them).
    ``LIGER_COMPAT_CPU_NATIVE=0`` runs the references (the kernels' math, checked without a GPU); so
    does a forced ``kernels.use_backend("torch")``."""
    if compiling():
        return True
    device = getattr(x, "device", None)
    if device is None:
        return False
    # the kept kernels package read directly: this runs on every module call
    if _config.settings.cpu_native and (_kernels or kernels_module())._dispatch.reference_only(device):
        return True
    return decode_step(x)


_kernels: Any = None


def kernels_module() -> Any:
    """``liger_compat.kernels``, imported on the first eager module call (it imports torch, which
    ``import liger_compat`` does not) and kept: no import statement runs on later calls. Not kept
    while torch.compile traces: a global written then fails the next call's guards."""
    global _kernels
    mod = _kernels
    if mod is None:
        from .. import kernels as mod

        if not _config.compiling():
            _kernels = mod
    return mod


#: ``torch.nn.Module.__getattr__``, read on the first :func:`registered` call (torch is not imported
#: by ``import liger_compat``)
_module_getattr: Any = None
#: the tables ``nn.Module.__getattr__`` reads, in its order
_MODULE_TABLES = ("_parameters", "_buffers", "_modules")


def registered(m: Any, name: str) -> Any:
    """``getattr(m, name, None)`` for an ``nn.Module``, without ``nn.Module.__getattr__`` (about a
    microsecond a read of a submodule, more for a name it lacks, which it raises for): the MLP shim
    reads a few names on every call. A name among the instance's or its class's own attributes
    (which plain ``getattr`` finds first), or a class with its own ``__getattr__`` (an FSDP or PEFT
    wrapper forwarding to what it wraps), is read with ``getattr``; otherwise the parameter, buffer
    and submodule tables are looked up as ``nn.Module.__getattr__`` does. The result is always what
    ``getattr`` gives."""
    global _module_getattr
    if _module_getattr is None:
        import torch

        _module_getattr = torch.nn.Module.__getattr__
    cls = type(m)
    d = m.__dict__
    if name in d or hasattr(cls, name) or getattr(cls, "__getattr__", None) is not _module_getattr:
        return getattr(m, name, None)
    for table in _MODULE_TABLES:
        entries = d.get(table)
        if entries is not None and name in entries:
            return entries[name]
    return None


def constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run eagerly while TorchDynamo traces, its result a constant of the graph
    (``torch._dynamo.assume_constant_result``; its arguments must be constants: functions, strings,
    not modules); ``fn`` itself where torch has no such decorator."""
    import torch

    deco = getattr(getattr(torch, "_dynamo", None), "assume_constant_result", None)
    return fn if deco is None else deco(fn)


_refused: set[tuple[str, str]] = set()


def kernel_refusal(checks: Callable[[], Any]) -> tuple[Any, str | None]:
    """``(what checks returned, None)``, or ``(None, why the kernel refuses these inputs)``: ``checks``
    runs the kernel's own argument checks (a ``check_args`` of the kernels, which raise TypeError /
    ValueError naming the argument: float64 or integer tensors, mixed devices or dtypes) before any
    call, and the shim then calls the kernel's unchecked entry with what they returned."""
    try:
        return checks(), None
    except (TypeError, ValueError) as exc:  # only the argument checks run here: a refusal, not a bug
        return None, f"{type(exc).__name__}: {exc}"


def guarded(kernel: str, refusal: str | None, run_kernel: Callable[[], Any],
             run_native: Callable[[], Any]) -> tuple[Any, bool]:
    """``(result, True)`` from the kernel, or ``(native result, False)`` when :func:`kernel_refusal` found
    inputs it refuses (logged once per kernel and reason). The kernel's call is not guarded: an
    error inside it is a bug, and raises."""
    if refusal is None:
        return run_kernel(), True
    key = (kernel, refusal)
    if key not in _refused:
        _refused.add(key)
        log.warning("liger_compat: %s kernel refuses an input, native code used: %s", kernel, refusal)
    return run_native(), False


#: where :func:`instance_key` keeps an instance's fingerprint (in its ``__dict__``)
_KEY_ATTR = "_liger_compat_probe_key"
_OPAQUE_DEPTH = 2


def _value_key(v: Any, depth: int) -> Any:
    """A hashable stand-in for an attribute value a native forward could read: the value itself for
    scalars and strings, element-wise for tuples / lists / dicts, one level of a plain object's
    public attributes (a ``config``), the identity of anything else (a tensor held as a plain
    attribute, a function)."""
    import torch

    if v is None or isinstance(v, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
        return v
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_value_key(x, depth) for x in v))
    if isinstance(v, dict):
        items = ((repr(k), _value_key(x, depth + 1)) for k, x in v.items())
        return ("dict", tuple(sorted(items, key=lambda kv: kv[0])))
    if isinstance(v, types.MethodType):
        return ("method", v.__func__)
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, type)):
        return v
    if (depth < _OPAQUE_DEPTH and not isinstance(v, (torch.nn.Module, torch.Tensor)) and not callable(v)
            and isinstance(getattr(v, "__dict__", None), dict)):
        return (type(v), _public_attrs(v, depth + 1))
    return (type(v), id(v))


def _public_attrs(obj: Any, depth: int) -> tuple[Any, ...]:
    return tuple((name, _value_key(v, depth)) for name, v in sorted(vars(obj).items())
                 if not name.startswith("_") and name not in _PER_CALL)


#: attributes left out of :func:`instance_key`: an instance-level ``forward`` (ours, from
#: ``apply(model=...)``), and ``training``, which changes with ``train()`` / ``eval()`` and is read
#: on every call instead (:func:`verdict_key`)
_PER_CALL = frozenset({"forward", "training"})


def instance_key(m: Any) -> Any:
    """What a module's native forward can read besides its parameters, buffers and submodules: its
    public attributes (``gate_multiplier``, ``variance_epsilon``, ``with_scale``) and one level of
    its ``config``, as a fingerprint (a number standing for it). A probe verdict is keyed on it, so
    two instances of one class that differ there are probed separately. Computed on an instance's
    first call and kept on it (under ``torch.compile``: None where no eager call computed it); private names
    (torch's, accelerate's and peft's bookkeeping) and an instance-level ``forward`` are left out."""
    key = getattr(m, _KEY_ATTR, None)
    if key is None and not compiling():
        # a small int stands for the fingerprint in the verdict keys: hashed on every call
        key = _fingerprints.setdefault(_public_attrs(m, 0), len(_fingerprints) + 1)
        object.__setattr__(m, _KEY_ATTR, key)
    return key


#: instance fingerprint -> the number that stands for it (:func:`instance_key`)
_fingerprints: dict[tuple[Any, ...], int] = {}


def verdict_key(m: Any, *rest: Any) -> tuple[Any, ...] | None:
    """``(class, instance fingerprint, training, *rest)``: the key of a probe verdict on module
    ``m``; None under ``torch.compile`` for an instance no eager call has seen."""
    key = instance_key(m)
    return None if key is None else (type(m), key, bool(m.training), *rest)


def probe_tol(dtype: Any) -> float:
    import torch

    return 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2


def close(a: Any, b: Any, dtype: Any) -> bool:
    a, b = a.float(), b.float()
    if a.shape != b.shape:
        return False
    if b.numel() == 0:  # equal shapes and no values: nothing differs
        return True
    scale = b.abs().max().clamp(min=1e-6)
    return bool(((a - b).abs().max() / scale).item() <= probe_tol(dtype))


class ModuleShim:
    """Bookkeeping shared by the three module shims, each patching the family modules."""

    def __init__(self, shim_id: str, what: str, patch: Callable[["ModuleShim", Any, ShimPatches], None],
                 replaced: Callable[[Any], str | None]):
        self.id = shim_id
        self.what = what
        self._patch = patch
        self._replaced = replaced  # module -> who replaced our patch afterwards, for the report
        self.left_alone: dict[str, str] = {}  # module name -> reason
        self.patched: dict[str, list[str]] = {}  # module name -> patched targets

    def patch_module(self, module: Any, patches: ShimPatches) -> list[str]:
        self.left_alone.pop(module.__name__, None)
        self._patch(self, module, patches)
        return list(self.patched.get(module.__name__, ()))

    def revert(self) -> None:
        self.left_alone.clear()
        self.patched.clear()

    def free(self, module: Any, current: Any, wrapper: Any, what: str) -> bool:
        """Whether ``current`` is to be wrapped: not ours already, and not replaced by another library
        (that is reported as a conflict and left alone)."""
        if is_ours(current, wrapper):
            return False
        owner = conflicts.foreign_owner(current)
        if owner is not None:
            self.conflict(module, what, owner)
            return False
        return True

    def wrap_class_forward(self, module: Any, cls: type, wrapper: Any, patches: ShimPatches) -> None:
        if not self.free(module, vars(cls)["forward"], wrapper, f"{cls.__name__}.forward"):
            return
        patches.wrap(cls, "forward", wrapper, traceable=True)
        self.patched.setdefault(module.__name__, []).append(cls.__name__)

    def conflict(self, module: Any, what: str, owner: str) -> None:
        self.left_alone[module.__name__] = f"{what} replaced by {owner}"
        REGISTRY.report_conflict(what, owner, f"{self.id} left it alone")

    def describe(self, module: Any) -> tuple[bool, str]:
        """``(patched, text)``: the kernel name, or why the module keeps its native code."""
        name = module.__name__
        if name in self.left_alone:
            return False, f"{self.what} conflict ({self.left_alone[name]})"
        errors = REGISTRY.get(self.id).module_errors
        if name in errors:
            return False, f"{self.what} failed ({errors[name]})"
        if self.patched.get(name):
            owner = self._replaced(module)
            if owner is not None:
                return False, f"{self.what} replaced afterwards by {owner}"
            return True, self.what
        return False, f"no {self.what}"


def replaced_classes(test: Callable[[str], bool]) -> Callable[[Any], str | None]:
    def check(module: Any) -> str | None:
        found = foreign_replacements(module, test)
        return found[0][1] if found else None
    return check


#: class-level wrapper -> the function bound to instances for the same job, as a bound method so
#: that ``copy.deepcopy(model)`` (trl's reference models) rebinds it to the copy
INSTANCE_FORWARDS: dict[Any, Any] = {}
#: id(module) -> weakref to it: instances whose forward of ours could not be removed by ``revert()``
#: (another library wrapped over it): that forward calls the class's own forward
_inert: dict[int, Any] = {}


class InstanceGate(Gate):
    """The :class:`~._patching.Gate` of an instance-level forward (shared by every instance, so
    the closed ones are listed in :data:`_inert`)."""

    __slots__ = ("ref",)

    def __init__(self, m: Any) -> None:
        key = id(m)
        self.ref = weakref.ref(m, lambda r: _inert.pop(key, None) if _inert.get(key) is r else None)
        super().__init__()

    def close(self, removed: bool) -> None:
        if not removed:  # a removed instance forward is gone from the instance: nothing to turn off
            self.on = False

    @property
    def on(self) -> bool:  # type: ignore[override]
        return id(self.ref()) not in _inert

    @on.setter
    def on(self, value: bool) -> None:
        m = self.ref()
        if m is None:
            return
        if value:
            _inert.pop(id(m), None)
        else:
            _inert[id(m)] = self.ref


def instance_forward(wrapper: Any) -> Any:
    """The instance-level forward running ``wrapper`` around the class's own forward (one per wrapper)."""
    fn = INSTANCE_FORWARDS.get(wrapper)
    if fn is None:
        def fn(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _inert and id(self) in _inert:
                return type(self).forward(self, *args, **kwargs)
            return wrapper(type(self).forward.__get__(self, type(self)), self, args, kwargs)

        INSTANCE_FORWARDS[wrapper] = fn
    return fn


def _class_covered(cls: type, wrapper: Any) -> bool:
    for klass in cls.__mro__:
        fwd = vars(klass).get("forward")
        if fwd is not None:
            return is_ours(fwd, wrapper)
    return False


def patch_instances(model: Any, wrapper: Any, name_test: Callable[[str], bool], structural: Callable[[Any], bool],
               patches: PatchSet, shim_id: str) -> bool:
    changed = False
    if not callable(getattr(model, "modules", None)):  # apply(model=...) with no torch module: nothing to patch
        return False
    for m in list(model.modules()):
        cls = type(m)
        if not name_test(cls.__name__):
            continue
        d = vars(m)
        if "forward" in d:
            if getattr(d["forward"], "__func__", None) is instance_forward(wrapper):
                continue
            if id(m) in _inert and structural(m):
                # ours, under a forward another library put over it, closed by a revert: open again
                # (it stays recorded where that revert left it, and the next revert closes it again)
                _inert.pop(id(m), None)
                changed = True
                continue
            owner = conflicts.instance_override(m)
            if owner is not None:
                REGISTRY.report_conflict(f"{cls.__name__}.forward (instance)", owner, f"{shim_id} left it alone")
            continue
        if _class_covered(cls, wrapper) or conflicts.known_patcher(cls) is not None or not structural(m):
            continue
        patches.set(m, "forward", types.MethodType(instance_forward(wrapper), m), InstanceGate(m))
        changed = True
    return changed


def describe(fam: families.Family, module: Any) -> str:
    """``"rms_norm, gated_mlp, rope"``; what is not patched says why."""
    from . import gated_mlp, rms_norm, rope

    done, other = [], []
    for shim in (rms_norm.STATE, gated_mlp.STATE, rope.STATE):
        ok, text = shim.describe(module)
        (done if ok else other).append(text)
    # what the structural probes turned down on the calls so far (native code kept there)
    name = module.__name__
    refused = gated_mlp.refused(name) + rope.refused(name) + rms_norm.refused(name)
    if refused:
        other.append("native after probe: " + ", ".join(refused))
    return ", ".join(done + other)


#: the upstream location every module shim names
UPSTREAM = "transformers models/<family>/modeling_<family>.py, 4.45 .. 5.x"
