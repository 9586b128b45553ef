"""RMSNorm, gated MLP and rotary embedding of each decoder family routed to our kernels.

Upstream: ``<Family>RMSNorm.forward``, ``<Family>MLP.forward`` (``MixtralBlockSparseTop2MLP`` before
transformers 5) and the module-level ``apply_rotary_pos_emb`` of ``transformers.models.<family>.
modeling_<family>`` (4.45 .. 5.x). Their eager forwards launch a chain of small ops each
(``pow``, ``mean``, ``rsqrt``, two casts; ``act(gate) * up``; ``rotate_half``, four multiplies)
that the fused kernels replace. What changed across releases and is handled here:

* OLMo2's RMSNorm moved from Llama casting (cast, then multiply by the weight) to multiplying in
  fp32 (4.5x); Gemma's offset norm computes in fp32 throughout. Rather than a table per release,
  each norm class is checked once per dtype against its native forward on a small probe and the
  matching kernel mode is used; a class that matches no mode keeps its native forward.
* ``apply_rotary_pos_emb`` lost its unused ``position_ids`` argument in transformers 5, while
  Mixtral 4.45 still indexes a ``[seq, dim]`` cos/sin cache with it; Phi3 rotates only part of
  the head (``cos.shape[-1] < head_dim``). The wrapper binds the native signature each call.
* Phi3 fuses gate and up into ``gate_up_proj``; Mixtral's experts (4.x) name them w1/w3/w2;
  transformers 5 Mixtral has fused expert tensors (no per-expert MLP module: left native).

Modules are found structurally (classes named ``*RMSNorm`` / ``*MLP`` of the family's modeling
module with the right attributes; an activation recognised as SiLU or tanh-GELU) and confirmed
numerically: on its first call per class (RMSNorm: per dtype, both weight offsets; gated MLP: per
input dtype) or per rotary function and shapes, the native code and the kernel run on the same
input and a mismatch keeps the native code for good (logged, and listed by the report as "native
after probe"). That is what keeps gpt-oss's half-split rotation with half-width cos, GLM-4's /
Cohere's interleaved rotary, Falcon-H1's MLP multipliers and any later variation correct without a
table entry. Patches go on the classes, so existing instances are covered. ``liger_compat.apply(model=...)`` additionally
patches RMSNorm and MLP *instances* of classes outside the families (remote-code models) that pass
the same structural and numeric checks, and reports instances whose forward another library
replaced (liger-kernel instance patching, ``kernels.kernelize``).
"""

from __future__ import annotations

import types
from typing import Any, Callable

from .._log import log
from .. import _config
from . import conflicts, families
from ._patching import PatchSet, signature, unwrap
from ._registry import REGISTRY, register
from .logits_to_keep import is_ours



def _compiling() -> bool:
    import torch

    try:
        return bool(torch.compiler.is_compiling())
    except AttributeError:  # torch < 2.3: no torch.compiler.is_compiling, and no compiling through it
        return False


def _classes(module: Any, test: Callable[[str], bool]) -> list[type]:
    name = module.__name__
    return [obj for cls_name, obj in list(vars(module).items())
            if isinstance(obj, type) and test(cls_name) and obj.__module__ == name and "forward" in vars(obj)]


def _foreign_replacements(module: Any, test: Callable[[str], bool]) -> list[tuple[str, str]]:
    """Names in the modeling module that another library bound to its own class (LigerRMSNorm)."""
    out = []
    for cls_name, obj in list(vars(module).items()):
        if isinstance(obj, type) and test(cls_name) and obj.__module__ != module.__name__:
            owner = conflicts.foreign_owner(obj)
            if owner is not None:
                out.append((cls_name, owner))
    return out


_refused: set[tuple[str, str]] = set()


def _refusal(checks: Callable[[], Any]) -> str | None:
    """Why the kernel would refuse these inputs, from its own argument checks run on them before
    any call (``checks`` calls ``kernels._checks`` functions, which raise TypeError / ValueError
    naming the argument: float64 or integer tensors, mixed devices or dtypes); None when it takes
    them."""
    try:
        checks()
    except (TypeError, ValueError) as exc:  # only the argument checks run here: a refusal, not a bug
        return f"{type(exc).__name__}: {exc}"
    return None


def _guarded(kernel: str, refusal: str | None, run_kernel: Callable[[], Any],
             run_native: Callable[[], Any]) -> tuple[Any, bool]:
    """``(result, True)`` from the kernel, or ``(native result, False)`` when :func:`_refusal` found
    inputs it refuses (logged once per kernel and reason). The kernel's call is not guarded: an
    error inside it is a bug, and raises."""
    if refusal is None:
        return run_kernel(), True
    key = (kernel, refusal)
    if key not in _refused:
        _refused.add(key)
        log.warning("liger_compat: %s kernel refuses an input, native code used: %s", kernel, refusal)
    return run_native(), False


# --------------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------------

_RMS = "rms_norm"
_CASTINGS = ("llama", "gemma")
#: (class, input dtype, weight dtype) -> (offset, casting) or the reason no kernel mode matches
_rms_modes: dict[tuple[Any, Any, Any], tuple[float, str] | str] = {}


def _is_rms_name(name: str) -> bool:
    return name.endswith("RMSNorm")


def _rms_eps(m: Any) -> float | None:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(m, attr, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _rms_shape_ok(m: Any, x: Any) -> bool:
    w = getattr(m, "weight", None)
    return (w is not None and getattr(w, "dim", lambda: 0)() == 1 and x.dim() >= 1
            and x.shape[-1] == w.shape[0] and w.is_floating_point() and x.is_floating_point())


def _rms_mode(native: Callable[[Any], Any], m: Any, x: Any) -> tuple[float, str] | str:
    """Which kernel mode reproduces ``native``; probed once per class and dtypes."""
    import torch

    from .. import kernels

    key = (type(m), x.dtype, m.weight.dtype)
    hit = _rms_modes.get(key)
    if hit is not None:
        return hit
    fam = families.BY_MODULE.get(type(m).__module__)
    offset = fam.rms_offset if fam else 0.0
    first = fam.rms_casting if fam else "llama"
    # the table's mode first; the other offset too (Qwen3-Next / Qwen3.5 store w - 1 as Gemma does)
    castings = [first] + [c for c in _CASTINGS if c != first]
    order = [(offset, c) for c in castings] + [(1.0 - offset, c) for c in castings]
    eps = _rms_eps(m)
    g = torch.Generator().manual_seed(1234)
    probe = (torch.randn(4, x.shape[-1], generator=g) * 3).to(device=x.device, dtype=x.dtype)
    best: tuple[float, str] | None = None
    best_err = float("inf")
    with torch.no_grad():
        ref = native(probe).float()
        scale = ref.abs().max().clamp(min=1e-6)
        for off, casting in order:  # the inputs passed the kernel's checks (_rms_checks) before this
            y = kernels.rms_norm(probe, m.weight, eps, offset=off, casting=casting)
            if y.shape != ref.shape:
                continue
            err = float(((y.float() - ref).abs().max() / scale).item())
            if err < best_err:
                best, best_err = (off, casting), err
    tol = 1e-5 if x.dtype in (torch.float32, torch.float64) else 1e-2
    result: tuple[float, str] | str
    if best is not None and best_err <= tol:
        result = best
    else:
        result = f"no kernel mode matches {type(m).__name__} (offset {offset}: rel. error {best_err:.2g})"
        log.warning("liger_compat: %s keeps its native forward: %s", type(m).__name__, result)
    _rms_modes[key] = result
    return result


def _rms_checks(x: Any, w: Any) -> None:
    from ..kernels import _checks

    _checks.float_dtype("x", x)
    _checks.float_dtype("weight", w)
    _checks.same_device(x=x, weight=w)


def _rms_forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    if len(args) != 1 or kwargs or instance is None or not _config.kernel_enabled(_RMS):
        return wrapped(*args, **kwargs)
    x = args[0]
    eps = _rms_eps(instance)
    if eps is None or not _rms_shape_ok(instance, x):
        return wrapped(x)
    refusal = _refusal(lambda: _rms_checks(x, instance.weight))
    if refusal is not None:  # the mode probe below would run the kernel on these dtypes
        return _guarded("rms_norm", refusal, lambda: None, lambda: wrapped(x))[0]
    if _compiling():
        fam = families.BY_MODULE.get(type(instance).__module__)
        mode: Any = (fam.rms_offset, fam.rms_casting) if fam else None
    else:
        mode = _rms_mode(wrapped, instance, x)
    if not isinstance(mode, tuple):
        return wrapped(x)
    from .. import kernels

    return _guarded("rms_norm", refusal, lambda: kernels.rms_norm(x, instance.weight, eps, offset=mode[0],
                                                                  casting=mode[1]), lambda: wrapped(x))[0]


# --------------------------------------------------------------------------------------------
# gated MLP
# --------------------------------------------------------------------------------------------

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


def _mlp_forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    if len(args) != 1 or kwargs or instance is None:
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
    from .. import kernels

    kernel_name = kernels.gated_mlp.KERNEL_OF_ACTIVATION[kind]
    if not _config.kernel_enabled(kernel_name):
        return wrapped(*args)

    x = args[0]
    down_proj = projs[-1]

    def project_in(t: Any) -> tuple[Any, Any]:
        if layout == "fused_gate_up":
            return projs[0](t).chunk(2, dim=-1)
        return projs[0](t), projs[1](t)

    # x is our RMSNorm's output when the family's norm is patched: gate_proj / up_proj then keep
    # nothing of it, it is recomputed from the norm's saved input in the backward
    gate, up = kernels.project_norm_output(x, project_in)
    # gate / up are this call's own projections, read by nothing after the forward: the kernel
    # may overwrite them with their gradients in the backward. down_proj's input is rebuilt from
    # them in the backward instead of being kept (kernels.gated_project).
    def checks() -> None:
        from ..kernels import _checks

        _checks.float_dtype("gate", gate)
        _checks.float_dtype("up", up)
        if gate.shape != up.shape:
            raise ValueError(f"gate has shape {tuple(gate.shape)} but up has {tuple(up.shape)}")
        _checks.same_dtype(gate=gate, up=up)
        _checks.same_device(gate=gate, up=up)

    refusal = _refusal(checks)
    if refusal is None and not _mlp_matches(wrapped, instance, x, project_in, down_proj, kind):
        return wrapped(*args)
    return _guarded(kernel_name, refusal,
                    lambda: kernels.gated_project(gate, up, down_proj, activation=kind, inplace_backward=True),
                    lambda: down_proj(act(gate) * up))[0]


#: (class, input dtype) -> whether ``down(act(gate) * up)`` reproduces the class's forward; (class,
#: None) -> False for an ``*MLP`` class that is no gated MLP of ours (gpt-oss's router and experts,
#: Nemotron's relu^2 MLP): recorded for the report
_mlp_verdicts: dict[tuple[Any, Any], bool] = {}


def _not_gated(m: Any) -> None:
    key = (type(m), None)
    if key not in _mlp_verdicts and not _compiling():
        _mlp_verdicts[key] = False


def _probe_tol(dtype: Any) -> float:
    import torch

    return 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2


def _close(a: Any, b: Any, dtype: Any) -> bool:
    a, b = a.float(), b.float()
    if a.shape != b.shape:
        return False
    scale = b.abs().max().clamp(min=1e-6)
    return bool(((a - b).abs().max() / scale).item() <= _probe_tol(dtype))


def _mlp_matches(native: Any, m: Any, x: Any, project_in: Callable[[Any], tuple[Any, Any]], down_proj: Any,
                 kind: str) -> bool:
    """The structural probe of a gated MLP: its native forward and the gated kernel on this input,
    once per class and dtype. A class whose forward does more than ``down(act(gate) * up)`` (Falcon-H1's
    gate / down multipliers, a clamped SwiGLU) fails it and keeps its native forward."""
    key = (type(m), x.dtype)
    hit = _mlp_verdicts.get(key)
    if hit is not None or _compiling():
        return True if hit is None else hit
    import torch

    from .. import kernels

    with torch.no_grad():
        probe = x.detach()[..., :8, :] if x.dim() >= 2 else x.detach()
        ref = native(probe)
        gate, up = project_in(probe)
        got = kernels.gated_project(gate.contiguous(), up.contiguous(), down_proj, activation=kind)
    ok = isinstance(ref, torch.Tensor) and _close(got, ref, x.dtype)
    if not ok:
        log.warning("liger_compat: %s keeps its native forward: it is not down(%s(gate) * up)", type(m).__name__, kind)
    _mlp_verdicts[key] = ok
    return ok


# --------------------------------------------------------------------------------------------
# rotary embedding
# --------------------------------------------------------------------------------------------

_ROPE = "rope"
_ROPE_FN = "apply_rotary_pos_emb"
#: native function -> its parameter names when all are positional-or-keyword (bound by
#: :func:`_bind`, which torch.compile traces), else its ``inspect.Signature``
_rope_sig_cache: dict[Any, Any] = {}


def _rope_params(fn: Any) -> Any:
    hit = _rope_sig_cache.get(fn)
    if hit is None:
        sig = signature(fn)
        plain = all(p.kind == p.POSITIONAL_OR_KEYWORD for p in sig.parameters.values())
        hit = _rope_sig_cache[fn] = tuple(sig.parameters) if plain else sig
    return hit


def _bind(names: tuple[str, ...], args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """``inspect.Signature.bind(...).arguments`` for positional-or-keyword ``names`` (no defaults
    filled in), or None where ``bind`` raises ``TypeError`` for too many or unknown arguments."""
    if len(args) > len(names):
        return None
    a = dict(zip(names, args))
    for k, v in kwargs.items():
        if k in a or k not in names:
            return None
        a[k] = v
    return a


def _rope_forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    if not _config.kernel_enabled(_ROPE):
        return wrapped(*args, **kwargs)
    params = _rope_params(unwrap(wrapped))
    if isinstance(params, tuple):
        a = _bind(params, args, kwargs)
    else:
        try:
            a = params.bind(*args, **kwargs).arguments
        except TypeError:
            a = None
    if a is None:
        return wrapped(*args, **kwargs)
    q, k, cos, sin = a.get("q"), a.get("k"), a.get("cos"), a.get("sin")
    position_ids = a.get("position_ids")
    unsqueeze_dim = a.get("unsqueeze_dim", 1)
    if q is None or k is None or cos is None or sin is None or set(a) - {"q", "k", "cos", "sin", "position_ids", "unsqueeze_dim"}:
        return wrapped(*args, **kwargs)
    if cos.dim() == 2 and position_ids is None:
        return wrapped(*args, **kwargs)  # a cache without positions: let the native code decide
    if cos.dim() != 2:
        position_ids = None  # deprecated and unused by the native function when cos is per position
    rot = cos.shape[-1]
    if rot % 2 or rot > q.shape[-1] or k.shape[-1] != q.shape[-1] or q.dtype != k.dtype:
        return wrapped(*args, **kwargs)
    from .. import kernels

    def checks() -> None:
        from ..kernels import _checks
        from ..kernels.rope import _broadcasts_into

        for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
            _checks.float_dtype(name, t)
        _checks.same_device(q=q, k=k, cos=cos, sin=sin)
        if cos.shape != sin.shape:
            raise ValueError(f"cos has shape {tuple(cos.shape)} but sin has {tuple(sin.shape)}")
        if position_ids is not None:
            _checks.integer_target("position_ids", position_ids)
        # the shape of cos.unsqueeze(unsqueeze_dim) (after the position lookup), in plain Python
        shape = list(cos.shape if position_ids is None else (*position_ids.shape, rot))
        if not isinstance(unsqueeze_dim, int) or not -len(shape) - 1 <= unsqueeze_dim <= len(shape):
            raise ValueError(f"unsqueeze_dim={unsqueeze_dim} is out of range for cos of shape {tuple(cos.shape)}")
        shape.insert(unsqueeze_dim if unsqueeze_dim >= 0 else len(shape) + 1 + unsqueeze_dim, 1)
        for name, t in (("q", q), ("k", k)):
            if not _broadcasts_into(tuple(shape[:-1]), t.shape[:-1]):
                raise ValueError(f"cos of shape {tuple(cos.shape)} does not broadcast against {name}")

    refusal = _refusal(checks)
    key = (unwrap(wrapped), q.shape[-1], rot, cos.dim(), unsqueeze_dim, q.dtype, cos.dtype)
    verdict = _rope_verdicts.get(key)
    if verdict is False:
        return wrapped(*args, **kwargs)

    def run_kernel() -> tuple[Any, Any]:
        q_out, k_out = kernels.apply_rotary_pos_emb(q, k, cos, sin, position_ids=position_ids,
                                                    unsqueeze_dim=unsqueeze_dim)
        if cos.dtype != q.dtype:
            # mixed precision (OLMo2 5.x keeps cos/sin in fp32): some natives cast back to q's dtype
            want = _rope_out_dtype(wrapped, unwrap(wrapped), q, cos, a, unsqueeze_dim)
            q_out, k_out = q_out.to(want[0]), k_out.to(want[1])
        return q_out, k_out

    if verdict is None and _compiling() and _rope_fn_verdicts.get(unwrap(wrapped)) is False:
        # no eager call probed these shapes, and the function failed the probe of its patch time
        return wrapped(*args, **kwargs)
    if verdict is None and refusal is None and not _compiling():
        # the structural probe: the native function and the kernel on this call's inputs, once per
        # function and shapes. gpt-oss rotates halves with a half-width cos, GLM-4 / Cohere / DeepSeek
        # rotate interleaved pairs: those fail it and keep the native function.
        import torch

        with torch.no_grad():
            ref = wrapped(*args, **kwargs)
            got = run_kernel()
        ok = (isinstance(ref, tuple) and len(ref) == 2
              and all(_close(g_, r_, q.dtype) and g_.dtype == r_.dtype for g_, r_ in zip(got, ref)))
        _rope_verdicts[key] = ok
        if not ok:
            log.warning("liger_compat: %s.%s keeps its native code: the rotary kernel does not reproduce it",
                        getattr(unwrap(wrapped), "__module__", "?"), _ROPE_FN)
            return wrapped(*args, **kwargs)
    return _guarded(_ROPE, refusal, run_kernel, lambda: wrapped(*args, **kwargs))[0]


#: (native function, head dim, rotary dim, cos rank, unsqueeze_dim, dtypes) -> kernel reproduces it
_rope_verdicts: dict[tuple[Any, ...], bool] = {}
#: native function -> whether it reproduces the kernel on a synthetic full-width call, probed when
#: its module is patched: the answer torch.compile uses when it traces shapes no eager call probed
_rope_fn_verdicts: dict[Any, bool] = {}


def _probe_rope_function(fn: Any) -> None:
    import torch

    from .. import kernels

    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 1, 3, 8, generator=g)
    angles = torch.randn(1, 3, 4, generator=g)
    results = []
    # a full-width cos (Llama's layout) and a half-width one (partial rotary, or gpt-oss's halves)
    for cos, sin in ((torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)),
                     (torch.cat([angles[..., :2].cos()] * 2, -1), torch.cat([angles[..., :2].sin()] * 2, -1)),
                     (angles.cos(), angles.sin())):
        try:
            with torch.no_grad():
                ref = fn(q, k, cos, sin)
                got = kernels.apply_rotary_pos_emb(q, k, cos, sin)
        except Exception:  # a call this function does not take (4.x position_ids lookups): no answer
            continue
        results.append(all(_close(a, b, torch.float32) for a, b in zip(got, ref)))
    if results:
        _rope_fn_verdicts[fn] = all(results)


_rope_dtypes: dict[tuple[Any, Any, Any], tuple[Any, Any]] = {}


def _rope_out_dtype(native: Any, fn: Any, q: Any, cos: Any, a: dict[str, Any], unsqueeze_dim: int) -> tuple[Any, Any]:
    """The output dtypes of the native function for these input dtypes, from a one-element probe."""
    import torch

    key = (fn, q.dtype, cos.dtype)
    hit = _rope_dtypes.get(key)
    if hit is None:
        d, rot = q.shape[-1], cos.shape[-1]
        qp = torch.zeros(1, 1, 1, d, dtype=q.dtype, device=q.device)
        kw: dict[str, Any] = {"unsqueeze_dim": unsqueeze_dim} if "unsqueeze_dim" in a else {}
        if cos.dim() == 2:
            cp = torch.ones(1, rot, dtype=cos.dtype, device=cos.device)
            kw["position_ids"] = torch.zeros(1, 1, dtype=torch.long, device=cos.device)
        else:
            cp = torch.ones(1, 1, rot, dtype=cos.dtype, device=cos.device)
        with torch.no_grad():
            qo, ko = native(qp, qp.clone(), cp, cp.clone(), **kw)
        hit = (qo.dtype, ko.dtype)
        if not _compiling():  # a cache filled while tracing would make the next call recompile
            _rope_dtypes[key] = hit
    return hit


# --------------------------------------------------------------------------------------------
# shims
# --------------------------------------------------------------------------------------------


class _ModuleShim:
    """Bookkeeping shared by the three module shims: one watcher over the family modules."""

    def __init__(self, shim_id: str, what: str, patch: Callable[["_ModuleShim", Any], None],
                 replaced: Callable[[Any], str | None]):
        self.id = shim_id
        self.what = what
        self._patch = patch
        self._replaced = replaced  # module -> who replaced our patch afterwards, for the report
        self.patches: PatchSet | None = None
        self.left_alone: dict[str, str] = {}  # module name -> reason
        self.patched: dict[str, list[str]] = {}  # module name -> patched targets
        self.watcher = families.ModelingWatcher(shim_id, self._on_module, families.family_modules)

    def _on_module(self, module: Any) -> None:
        if self.patches is not None:
            self._patch(self, module)

    def apply(self, module: Any, patches: PatchSet) -> None:
        self.patches = patches
        self.left_alone.clear()
        self.patched.clear()
        self.watcher.start()

    def revert(self) -> None:
        self.watcher.stop()
        self.left_alone.clear()
        self.patched.clear()

    def wrap_class_forward(self, module: Any, cls: type, wrapper: Any) -> None:
        current = vars(cls)["forward"]
        if is_ours(current, wrapper):
            return
        owner = conflicts.foreign_owner(current)
        if owner is not None:
            self.conflict(module, f"{cls.__name__}.forward", owner)
            return
        self.patches.wrap(cls, "forward", wrapper, traceable=True)
        self.patched.setdefault(module.__name__, []).append(cls.__name__)

    def conflict(self, module: Any, what: str, owner: str) -> None:
        self.left_alone[module.__name__] = f"{what} replaced by {owner}"
        REGISTRY.report_conflict(what, owner, f"{self.id} left it alone")

    def describe(self, module: Any) -> tuple[bool, str]:
        """``(patched, text)``: the kernel name, or why the module keeps its native code."""
        name = module.__name__
        if name in self.left_alone:
            return False, f"{self.what} conflict ({self.left_alone[name]})"
        if name in self.watcher.failures:
            return False, f"{self.what} failed ({self.watcher.failures[name]})"
        if self.patched.get(name):
            owner = self._replaced(module)
            if owner is not None:
                return False, f"{self.what} replaced afterwards by {owner}"
            return True, self.what
        return False, f"no {self.what}"


def _patch_norms(self: _ModuleShim, module: Any) -> None:
    for name, owner in _foreign_replacements(module, _is_rms_name):
        self.conflict(module, f"{module.__name__}.{name}", owner)
    for cls in _classes(module, _is_rms_name):
        self.wrap_class_forward(module, cls, _rms_forward)


def _patch_mlps(self: _ModuleShim, module: Any) -> None:
    for name, owner in _foreign_replacements(module, _is_mlp_name):
        self.conflict(module, f"{module.__name__}.{name}", owner)
    for cls in _classes(module, _is_mlp_name):
        self.wrap_class_forward(module, cls, _mlp_forward)


def _patch_rope(self: _ModuleShim, module: Any) -> None:
    current = vars(module).get(_ROPE_FN)
    if current is None or not callable(current):
        return
    if is_ours(current, _rope_forward):
        return
    owner = conflicts.foreign_owner(current)
    if owner is not None:
        self.conflict(module, f"{module.__name__}.{_ROPE_FN}", owner)
        return
    params = signature(current).parameters
    if not {"q", "k", "cos", "sin"} <= set(params):
        self.left_alone[module.__name__] = f"{_ROPE_FN} has an unknown signature {tuple(params)}"
        return
    _rope_params(unwrap(current))  # cached now, not while torch.compile traces the first call
    if unwrap(current) not in _rope_fn_verdicts:
        _probe_rope_function(unwrap(current))
    self.patches.wrap(module, _ROPE_FN, _rope_forward, traceable=True)
    self.patched.setdefault(module.__name__, []).append(_ROPE_FN)


def _replaced_classes(test: Callable[[str], bool]) -> Callable[[Any], str | None]:
    def check(module: Any) -> str | None:
        found = _foreign_replacements(module, test)
        return found[0][1] if found else None
    return check


def _replaced_rope(module: Any) -> str | None:
    current = vars(module).get(_ROPE_FN)
    return None if current is None or is_ours(current, _rope_forward) else conflicts.foreign_owner(current)


_NORMS = _ModuleShim("transformers.rms_norm", "rms_norm", _patch_norms, _replaced_classes(_is_rms_name))
_MLPS = _ModuleShim("transformers.gated_mlp", "gated_mlp", _patch_mlps, _replaced_classes(_is_mlp_name))
_ROPES = _ModuleShim("transformers.rope", "rope", _patch_rope, _replaced_rope)


# -- instance level (apply(model=...)) ------------------------------------------------------


def _rms_instance_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    return _rms_forward(type(self).forward.__get__(self, type(self)), self, args, kwargs)


def _mlp_instance_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    return _mlp_forward(type(self).forward.__get__(self, type(self)), self, args, kwargs)


#: class-level wrapper -> the function bound to instances for the same job; a bound method (not a
#: closure) so that ``copy.deepcopy(model)`` (trl's reference models) rebinds it to the copy
_INSTANCE_FORWARDS: dict[Any, Any] = {}


def _class_covered(cls: type, wrapper: Any) -> bool:
    for klass in cls.__mro__:
        fwd = vars(klass).get("forward")
        if fwd is not None:
            return is_ours(fwd, wrapper)
    return False


def _instances(model: Any, wrapper: Any, name_test: Callable[[str], bool], structural: Callable[[Any], bool],
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
            if getattr(d["forward"], "__func__", None) is _INSTANCE_FORWARDS[wrapper]:
                continue
            owner = conflicts.instance_override(m)
            if owner is not None:
                REGISTRY.report_conflict(f"{cls.__name__}.forward (instance)", owner, f"{shim_id} left it alone")
            continue
        if _class_covered(cls, wrapper) or conflicts.known_patcher(cls) is not None or not structural(m):
            continue
        patches.set(m, "forward", types.MethodType(_INSTANCE_FORWARDS[wrapper], m))
        changed = True
    return changed


_INSTANCE_FORWARDS.update({_rms_forward: _rms_instance_forward, _mlp_forward: _mlp_instance_forward})


def _norm_instances(model: Any, patches: PatchSet) -> bool:
    def ok(m: Any) -> bool:
        w = getattr(m, "weight", None)
        return _rms_eps(m) is not None and w is not None and getattr(w, "dim", lambda: 0)() == 1
    return _instances(model, _rms_forward, _is_rms_name, ok, patches, _NORMS.id)


def _mlp_instances(model: Any, patches: PatchSet) -> bool:
    def ok(m: Any) -> bool:
        found = mlp_layout(m)
        return found is not None and activation_kind(found[2]) is not None
    return _instances(model, _mlp_forward, _is_mlp_name, ok, patches, _MLPS.id)


def describe(fam: families.Family, module: Any) -> str:
    """``"rms_norm, gated_mlp, rope"``; what is not patched says why."""
    done, other = [], []
    for shim in (_NORMS, _MLPS, _ROPES):
        ok, text = shim.describe(module)
        (done if ok else other).append(text)
    # what the structural probes turned down on the calls so far (native code kept there)
    name = module.__name__
    refused = sorted({k[0].__name__ for k, ok in list(_mlp_verdicts.items()) if not ok and k[0].__module__ == name})
    refused += sorted({f"{_ROPE_FN} (not the kernel's rotation)" for k, ok in list(_rope_verdicts.items())
                       if not ok and getattr(k[0], "__module__", None) == name})
    refused += sorted({k[0].__name__ for k, v in list(_rms_modes.items())
                       if isinstance(v, str) and k[0].__module__ == name})
    if refused:
        other.append("native after probe: " + ", ".join(refused))
    return ", ".join(done + other)


_UPSTREAM = "transformers models/<family>/modeling_<family>.py, 4.45 .. 5.x"

NORM_SHIM = register(
    id=_NORMS.id, library="transformers", trigger="transformers",
    target="<Family>RMSNorm.forward of " + ", ".join(f.name for f in families.FAMILIES),
    upstream=_UPSTREAM + " (OLMo2 RMSNorm casting changed in 4.5x)",
    kernels=("rms_norm",), description="RMSNorm routed to liger_compat.kernels.rms_norm",
    _apply=_NORMS.apply, _revert=_NORMS.revert, apply_to_model=_norm_instances,
)
MLP_SHIM = register(
    id=_MLPS.id, library="transformers", trigger="transformers",
    target="<Family>MLP.forward (gate/up/down, gate_up_proj, w1/w3/w2) of the families",
    upstream=_UPSTREAM + " (Mixtral experts fused into tensors in 5.0)",
    kernels=("swiglu", "geglu"), description="act(gate) * up routed to liger_compat.kernels.swiglu / geglu",
    _apply=_MLPS.apply, _revert=_MLPS.revert, apply_to_model=_mlp_instances,
)
ROPE_SHIM = register(
    id=_ROPES.id, library="transformers", trigger="transformers",
    target="apply_rotary_pos_emb of the families' modeling modules",
    upstream=_UPSTREAM + " (position_ids argument dropped in 5.0)",
    kernels=("rope",), description="rotary embedding routed to liger_compat.kernels.apply_rotary_pos_emb",
    _apply=_ROPES.apply, _revert=_ROPES.revert,
)
