"""Each family's ``apply_rotary_pos_emb`` routed to :func:`liger_compat.kernels.apply_rotary_pos_emb`.

Upstream: the module-level ``apply_rotary_pos_emb`` of ``transformers.models.<family>.
modeling_<family>`` (4.45 .. 5.x): ``rotate_half`` and four multiplies per call, replaced by one
kernel. It lost its unused ``position_ids`` argument in transformers 5, while Mixtral 4.45 still
indexes a ``[seq, dim]`` cos/sin cache with it; Phi3 rotates only part of the head
(``cos.shape[-1] < head_dim``). The wrapper binds the native signature each call. Each function is
probed on synthetic full- and half-width calls when its module is patched, and per shapes on first
use: gpt-oss's half-split rotation with half-width cos and GLM-4's / Cohere's interleaved rotation
do not match the kernel and keep the native function (listed by the report).
"""

from __future__ import annotations

from typing import Any

from .._log import log
from .. import _config
from ..compat import conflicts, families
from ._module_shims import (UPSTREAM, ModuleShim, close, guarded, kernel_refusal, kernels_module,
                            native_call)
from ._patching import ShimPatches, is_ours, signature, unwrap
from ._registry import register


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


def rope_forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    # cos ([batch, positions, dim] or [positions, dim]) has the positions, whatever q's layout
    if not _config.kernel_enabled(_ROPE) or native_call(args[2] if len(args) > 2 else kwargs.get("cos")):
        return wrapped(*args, **kwargs)
    fn = unwrap(wrapped)
    params = _rope_params(fn)
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
    key = (fn, q.shape[-1], rot, cos.dim(), unsqueeze_dim, q.dtype, cos.dtype)
    verdict = _rope_verdicts.get(key)
    if verdict is False:  # the probe found the kernel does not reproduce this function
        return wrapped(*args, **kwargs)
    rope = kernels_module().rope
    # the kernel's own argument checks, run once: the calls below skip them
    checked, refusal = kernel_refusal(lambda: rope.check_args(q, k, cos, sin, position_ids, unsqueeze_dim))

    def run_kernel() -> tuple[Any, Any]:
        q_out, k_out = rope.apply_checked(q, k, *checked)
        if cos.dtype != q.dtype:
            # mixed precision (OLMo2 5.x keeps cos/sin in fp32): some natives cast back to q's dtype
            want = _rope_out_dtype(wrapped, fn, q, cos, a, unsqueeze_dim)
            q_out, k_out = q_out.to(want[0]), k_out.to(want[1])
        return q_out, k_out

    if verdict is None and (q.numel() == 0 or k.numel() == 0):  # no values to judge the kernel on
        return wrapped(*args, **kwargs)
    if verdict is None and refusal is None:
        # the structural probe: the native function and the kernel on this call's inputs, once per
        # function and shapes. gpt-oss rotates halves with a half-width cos, GLM-4 / Cohere / DeepSeek
        # rotate interleaved pairs: those fail it and keep the native function.
        import torch

        with torch.no_grad():
            ref = wrapped(*args, **kwargs)
            got = run_kernel()
        ok = (isinstance(ref, tuple) and len(ref) == 2
              and all(close(g_, r_, q.dtype) and g_.dtype == r_.dtype for g_, r_ in zip(got, ref)))
        _rope_verdicts[key] = ok
        if not ok:
            log.warning("liger_compat: %s.%s keeps its native code: the rotary kernel does not reproduce it",
                        getattr(fn, "__module__", "?"), _ROPE_FN)
            return wrapped(*args, **kwargs)
    return guarded(_ROPE, refusal, run_kernel, lambda: wrapped(*args, **kwargs))[0]


#: (native function, head dim, rotary dim, cos rank, unsqueeze_dim, dtypes) -> kernel reproduces it
_rope_verdicts: dict[tuple[Any, ...], bool] = {}
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
        hit = _rope_dtypes[key] = (qo.dtype, ko.dtype)
    return hit


def _patch_rope(self: ModuleShim, module: Any, patches: ShimPatches) -> None:
    current = vars(module).get(_ROPE_FN)
    if current is None or not callable(current):
        return
    if not self.free(module, current, rope_forward, f"{module.__name__}.{_ROPE_FN}"):
        return
    params = signature(current).parameters
    if not {"q", "k", "cos", "sin"} <= set(params):
        self.left_alone[module.__name__] = f"{_ROPE_FN} has an unknown signature {tuple(params)}"
        return
    _rope_params(unwrap(current))  # read once here, not on the first call
    patches.wrap(module, _ROPE_FN, rope_forward, traceable=True)
    self.patched.setdefault(module.__name__, []).append(f"{module.__name__.rsplit('.', 1)[-1]}.{_ROPE_FN}")


def _replaced_rope(module: Any) -> str | None:
    current = vars(module).get(_ROPE_FN)
    return None if current is None or is_ours(current, rope_forward) else conflicts.foreign_owner(current)


def refused(module_name: str) -> list[str]:
    """The rotary function of the module, when a probe found it is not the kernel's rotation."""
    return sorted({f"{_ROPE_FN} (not the kernel's rotation)" for k, ok in list(_rope_verdicts.items())
                   if not ok and getattr(k[0], "__module__", None) == module_name})


STATE = ModuleShim("transformers.rope", "rope", _patch_rope, _replaced_rope)

SHIM = register(
    id=STATE.id, library="transformers", trigger="transformers",
    target="apply_rotary_pos_emb of the families' modeling modules",
    upstream=UPSTREAM + " (position_ids argument dropped in 5.0)",
    kernels=("rope",), description="rotary embedding routed to liger_compat.kernels.apply_rotary_pos_emb",
    modules=families.family_modules, patch_module=STATE.patch_module, _revert=STATE.revert,
)
