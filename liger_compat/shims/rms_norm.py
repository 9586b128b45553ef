"""Each family's RMSNorm routed to :func:`liger_compat.kernels.rms_norm`.

Upstream: ``<Family>RMSNorm.forward`` of ``transformers.models.<family>.modeling_<family>``
(4.45 .. 5.x): ``pow``, ``mean``, ``rsqrt`` and two casts per call, replaced by one kernel. OLMo2's
RMSNorm moved from Llama casting (cast, then multiply by the weight) to multiplying in fp32 (4.5x);
Gemma's offset norm (``1 + w``) computes in fp32 throughout. Rather than a table per release, each
module is checked against its native forward once per class, attributes it can read (its
fingerprint, :func:`~._module_shims.instance_key`) and dtypes, on a small probe, both weight offsets
and both castings tried, and the matching kernel mode is used; a class that matches none keeps its
native forward and the report lists it.

On a GPU, a norm whose output is below 16 MiB runs torch's fused RMSNorm op
(``torch.nn.functional.rms_norm``: one kernel and one C++ autograd node, where torch has them for
the device; in Gemma's casting with the casts and the offset native does around it) instead of our
kernel: a small step waits on the host, where that op costs a fraction
of our kernel's Python launch (:func:`_small_on_torch`, ``LIGER_COMPAT_RMS_NORM_SMALL_TORCH``).
"""

from __future__ import annotations

from typing import Any, Callable

from .._log import log
from .. import _config
from ..compat import families
from ._module_shims import (UPSTREAM, ModuleShim, classes, foreign_replacements,
                            guarded, kernel_refusal, kernels_module, patch_instances, replaced_classes, native_call,
                            verdict_key)
from ._patching import PatchSet, ShimPatches
from ._registry import register


_RMS = "rms_norm"
_CASTINGS = ("llama", "gemma")
#: (class, instance fingerprint, training, input dtype, weight dtype) -> (offset, casting) or the
#: reason no kernel mode matches
_rms_modes: dict[tuple[Any, ...], tuple[float, str] | str] = {}


def _is_rms_name(name: str) -> bool:
    return name.endswith("RMSNorm")


def _rms_eps(m: Any) -> float | None:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(m, attr, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _rms_shape_ok(w: Any, x: Any) -> bool:
    """``w`` (the module's weight) and ``x`` are what the kernel's checks can take: a 1-D float
    weight as long as ``x``'s last dimension."""
    return (w is not None and getattr(w, "dim", lambda: 0)() == 1 and x.dim() >= 1
            and x.shape[-1] == w.shape[0] and w.is_floating_point() and x.is_floating_point())


def _rms_mode(native: Callable[[Any], Any], m: Any, x: Any, w: Any) -> tuple[float, str] | str:
    """Which kernel mode reproduces ``native`` (``w``: the module's weight); probed once per class,
    instance fingerprint (:func:`~._module_shims.verdict_key`: the attributes and config its forward
    can read), training mode and dtypes."""
    key = verdict_key(m, x.dtype, w.dtype)
    hit = None if key is None else _rms_modes.get(key)
    if hit is not None:
        return hit
    import torch

    from .. import kernels
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
        for off, casting in order:  # the inputs passed the kernel's checks (check_args) before this
            y = kernels.rms_norm(probe, w, eps, offset=off, casting=casting)
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


def rms_forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    if len(args) != 1 or kwargs or instance is None or not _config.kernel_enabled(_RMS):
        return wrapped(*args, **kwargs)
    x = args[0]
    if native_call(x):
        return wrapped(x)
    eps = _rms_eps(instance)
    w = getattr(instance, "weight", None)  # read once: the checks and the mode key take it
    if eps is None or not _rms_shape_ok(w, x):
        return wrapped(x)
    norm = kernels_module().norm
    # the kernel's own argument checks, run once: the call below skips them
    device, refusal = kernel_refusal(lambda: norm.check_args(x, w, eps))
    if refusal is not None:  # the mode probe below would run the kernel on these inputs
        return guarded("rms_norm", refusal, lambda: None, lambda: wrapped(x))[0]
    mode = _rms_mode(wrapped, instance, x, w)
    if not isinstance(mode, tuple):
        return wrapped(x)
    if _small_on_torch(x, w, device, norm, mode):
        op = _fused_ops[device.type]
        if mode == _LLAMA_MODE:
            return op(x, (x.shape[-1],), w, eps)
        # Gemma's casting (or Llama's on fp32): native's math in fp32 (the input and the weight, plus
        # its offset, cast up), the result cast back to the input's dtype once
        wf = w.float()
        return op(x.float(), (x.shape[-1],), wf + mode[0] if mode[0] else wf, eps).to(x.dtype)
    return norm.rms_norm_checked(x, w, eps, mode[0], mode[1], device)


#: the kernel mode of transformers' ``LlamaRMSNorm`` (no weight offset, the normalised activations
#: cast to the input dtype before the weight multiplies them)
_LLAMA_MODE = (0.0, "llama")
_FP32: Any = None
_autocast: Any = None  # torch.is_autocast_enabled(device_type)
#: device type -> torch's fused RMSNorm op for it (:func:`_fused_op`), or None where it has none
_fused_ops: dict[str, Any] = {}
#: ``torch.Tensor`` and the classes of a plain weight, read with torch's names by :func:`_fused_op`
_Tensor: Any = None
_PLAIN: tuple = ()


def _fused_op(device: Any) -> Any:
    """``torch.nn.functional.rms_norm`` where it runs one fused kernel on ``device`` (CUDA, where
    torch registers ``aten::_fused_rms_norm`` and its backward for it: one C++ autograd node), else
    None (there it is a composite of elementwise ops); kept per device type."""
    kind = device.type
    if kind not in _fused_ops:
        import torch

        global _Tensor, _PLAIN, _FP32, _autocast
        _Tensor, _PLAIN = torch.Tensor, (torch.Tensor, torch.nn.Parameter)
        _FP32 = torch.float32
        _autocast = torch.is_autocast_enabled
        op = getattr(torch.nn.functional, "rms_norm", None)
        has = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
        try:  # forward and backward: a torch with the one and not the other fails the backward
            fused = (op is not None and kind == "cuda" and has is not None
                     and has("aten::_fused_rms_norm", "CUDA") and has("aten::_fused_rms_norm_backward", "CUDA"))
        except RuntimeError:  # no such operator in this torch
            fused = False
        _fused_ops[kind] = op if fused else None
    return _fused_ops[kind]


def _small_on_torch(x: Any, w: Any, device: Any, norm: Any, mode: tuple[float, str]) -> bool:
    """Whether this RMSNorm call runs torch's fused RMSNorm op instead of our kernel
    (``LIGER_COMPAT_RMS_NORM_SMALL_TORCH``, on by default): an output below
    ``kernels.norm.RECOMPUTE_INPUT_MIN_BYTES`` (16 MiB: fewer than 8M bf16 values; a 2 x 2048-token
    step of a 1024-wide model has 4M), plain tensors (a DTensor's sharding, or another subclass's
    dispatch, keeps our kernel's path), on a device where torch's op is one fused kernel
    (:func:`_fused_op`), and a kernel mode torch's op computes: Llama's casting without a weight
    offset, input and weight of one dtype (the op on them as they are), or Gemma's casting with any
    offset (the op on the input and ``offset + weight`` in fp32, the output cast back: native's own
    steps; so too Llama's casting with an offset on fp32, where the two castings are one); the
    kernel's argument checks, run before, leave bf16, fp16 and fp32 inputs only. Under autocast
    (where torch's op runs in fp32 and returns fp32) a Llama-casting norm on a half-precision input
    keeps our kernel: native returns the input's dtype. Such a norm's GPU time is a few
    microseconds; its host time is what a step waits for, and our kernel's Python launch and
    autograd Function cost more of it than torch's few C++ ops (forward and backward). At and above the bound our kernel runs: its
    output is what the MLP's recompute rebuilds in the backward (``kernels.norm.project_norm_output``,
    the same bound). The same math (Llama's casting: the normalised values rounded once, not twice):
    the outputs differ from native's by at most a rounding of the input dtype."""
    if not (_config.settings.rms_norm_small_torch and _fused_op(device) is not None
            and type(x) is _Tensor and type(w) in _PLAIN
            and x.numel() * x.element_size() < norm.RECOMPUTE_INPUT_MIN_BYTES):
        return False
    if mode[1] == "llama":  # under autocast torch's op runs in fp32 and returns fp32: native's is x's
        return (x.dtype == w.dtype and (mode[0] == 0.0 or x.dtype is _FP32)
                and (x.dtype is _FP32 or not _autocast(device.type)))
    return True  # Gemma's casting: cast back to the input's dtype, autocast or not


def _patch_norms(self: ModuleShim, module: Any, patches: ShimPatches) -> None:
    for name, owner in foreign_replacements(module, _is_rms_name):
        self.conflict(module, f"{module.__name__}.{name}", owner)
    for cls in classes(module, _is_rms_name):
        self.wrap_class_forward(module, cls, rms_forward, patches)


def refused(module_name: str) -> list[str]:
    """RMSNorm classes of the module that no kernel mode reproduced (native after probe)."""
    return sorted({k[0].__name__ for k, v in list(_rms_modes.items())
                   if isinstance(v, str) and k[0].__module__ == module_name})


STATE = ModuleShim("transformers.rms_norm", "rms_norm", _patch_norms, replaced_classes(_is_rms_name))


def _norm_instances(model: Any, patches: PatchSet) -> bool:
    def ok(m: Any) -> bool:
        w = getattr(m, "weight", None)
        return _rms_eps(m) is not None and w is not None and getattr(w, "dim", lambda: 0)() == 1
    return patch_instances(model, rms_forward, _is_rms_name, ok, patches, STATE.id)


SHIM = register(
    id=STATE.id, library="transformers", trigger="transformers",
    target="<Family>RMSNorm.forward of " + ", ".join(f.name for f in families.FAMILIES),
    upstream=UPSTREAM + " (OLMo2 RMSNorm casting changed in 4.5x)",
    kernels=("rms_norm",), description="RMSNorm routed to liger_compat.kernels.rms_norm (on a GPU below 16 MiB "
                                        "of output: torch's fused RMSNorm op)",
    modules=families.family_modules, patch_module=STATE.patch_module, _revert=STATE.revert,
    apply_to_model=_norm_instances,
)
