"""``logits_to_keep`` and ``num_logits_to_keep`` accepted under either name, on every release.

Upstream: transformers 4.45 added ``num_logits_to_keep`` (an int) to the ``*ForCausalLM``
forwards; 4.49 renamed it ``logits_to_keep`` and let it be a 1-D index tensor too
(huggingface/transformers#35757); from 4.50 the old name is no longer translated. trl's GRPO
passes ``logits_to_keep``. On 4.45 .. 4.48 that name falls into ``**kwargs`` and is ignored,
so full ``[B, T, V]`` logits come back silently (known issue F3, ~1200x the memory on a real
vocabulary); on 4.50+ ``num_logits_to_keep`` is ignored the same way.

This shim wraps the forward of every ``*ForCausalLM`` class whose forward knows exactly one of
the two names and renames the other. A 1-D index tensor given to a forward that only takes an
int is served by computing all logits and selecting the rows (correct, not memory-efficient; the
fused forward of :mod:`liger_compat.shims.causal_lm` avoids that for the families it knows).
The forward's signature is left as it is (``inspect.signature`` still shows the native one).

transformers 5.21 (``modeling_utils.slice_logits_to_keep``) also takes a 2-D tensor: integer
``(batch, k)`` positions per sample, or a bool ``(batch, seq)`` mask whose kept positions flatten
to ``(num_true, ...)``. :func:`normalize_keep` accepts both and :func:`keep_positions` selects
exactly what that function selects, so the fused forward honours them on every release; before
5.21 a native forward indexes ``hidden_states[:, keep, :]`` with them (a wrong shape or an
IndexError), which :func:`native_slices_2d` tells apart.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

from .._log import log
from . import conflicts, families
from ._patching import PatchSet, signature, unwrap, wrapped_function
from ._registry import REGISTRY, register
from ..compat.scenarios import Context, Skip, scenario


NEW, OLD = "logits_to_keep", "num_logits_to_keep"
_UNSET = object()


# --------------------------------------------------------------------------------------------
# helpers shared with the fused forward
# --------------------------------------------------------------------------------------------

class ForwardParams(NamedTuple):
    """What a forward accepts, as the logits-to-keep shims need it (plain fields: read while
    ``torch.compile`` traces a forward)."""

    #: the one spelling of the keep argument it names, ``NEW`` or ``OLD``; ``None`` when it names
    #: neither or both (then :attr:`both`)
    keep: str | None
    #: it names both ``logits_to_keep`` and ``num_logits_to_keep``
    both: bool
    #: its named parameters (not ``*args`` / ``**kwargs``)
    names: frozenset[str]
    #: it takes ``**kwargs``
    varkw: bool


_param_cache: dict[Any, ForwardParams] = {}


def stable_key(forward: Any) -> Any:
    """A cache key for a (possibly bound, possibly wrapped) forward that is the same object on every
    call: wrapt binds a new ``BoundFunctionWrapper`` per attribute access, whose ``_self_parent``
    (the class-level wrapper) is stable and cheap to read, while its proxied ``__func__`` costs
    ~2 us; a plain bound method's ``__func__`` and a traceable wrapper's partial's ``func`` are
    stable (``_patching.wrapped_function``)."""
    return wrapped_function(forward)


def forward_params(forward: Any) -> ForwardParams:
    """The parameters of ``forward`` (:class:`ForwardParams`), cached per forward."""
    base = stable_key(forward)
    hit = _param_cache.get(base)
    if hit is not None:
        return hit
    fn = unwrap(base)
    key = getattr(fn, "__code__", fn)
    hit = _param_cache.get(key)
    if hit is None:
        params = signature(fn).parameters
        names = frozenset(n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
        varkw = any(p.kind == p.VAR_KEYWORD for p in params.values())
        new, old = NEW in names, OLD in names
        hit = ForwardParams(None if new == old else (NEW if new else OLD), new and old, names, varkw)
        _param_cache[key] = hit
    _param_cache[base] = hit
    return hit


def pop_keep(kwargs: dict[str, Any]) -> Any:
    """Remove both spellings from ``kwargs`` and return the value (``_UNSET`` when neither)."""
    new = kwargs.pop(NEW, _UNSET)
    old = kwargs.pop(OLD, _UNSET)
    if new is not _UNSET and old is not _UNSET and not _same(new, old):
        raise ValueError(f"got both {NEW}={new!r} and {OLD}={old!r}; pass one of them")
    return new if new is not _UNSET else old


def _same(a: Any, b: Any) -> bool:
    try:
        import torch

        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    except ImportError:  # pragma: no cover
        pass
    return a == b


def normalize_keep(keep: Any) -> Any:
    """``int >= 0`` (0 = every position) or a 1-D integer index tensor; clear error otherwise."""
    if keep is _UNSET or keep is None:
        return 0
    if type(keep) is int:  # the common case, without touching torch
        if keep < 0:
            raise ValueError(f"{NEW} must be >= 0 (0 keeps every position), got {keep}")
        return keep
    import torch

    if isinstance(keep, torch.Tensor):
        if keep.dim() == 0 and not keep.is_floating_point() and keep.dtype != torch.bool:
            return int(keep)
        ok = (keep.dim() == 1 and not keep.is_floating_point() and keep.dtype != torch.bool) or (
            keep.dim() == 2 and not keep.is_floating_point() and not keep.is_complex())
        if not ok:
            raise ValueError(
                f"{NEW} must be an int, a 1-D integer tensor of positions, a 2-D integer (batch, k) tensor "
                f"of positions or a 2-D bool (batch, seq) mask, got a tensor of shape {tuple(keep.shape)} "
                f"and dtype {keep.dtype}"
            )
        return keep
    if isinstance(keep, bool):
        raise ValueError(f"{NEW} must be an int or a 1-D integer tensor, got {keep!r}")
    try:
        k = operator.index(keep)
    except TypeError:
        raise ValueError(f"{NEW} must be an int or a 1-D integer tensor, got {type(keep).__name__}") from None
    if k < 0:
        raise ValueError(f"{NEW} must be >= 0 (0 keeps every position), got {k}")
    return k


def keep_positions(t: Any, keep: Any, dim: int = 1) -> Any:
    """Select the kept positions of ``t`` along ``dim`` (int: the last ``keep``; 0: all; 1-D
    tensor: these positions; 2-D tensor, ``dim`` 1 only: integer ``(batch, k)`` positions per
    sample, or a bool ``(batch, seq)`` mask whose selected rows flatten to ``(num_true, ...)``)."""
    if isinstance(keep, int):
        if keep == 0:
            return t
        return t.narrow(dim, max(t.shape[dim] - keep, 0), min(keep, t.shape[dim]))
    if keep.dim() == 1:
        return t.index_select(dim, keep.to(t.device))
    if dim != 1:
        raise ValueError(f"a 2-D {NEW} selects along the sequence dimension (1), not {dim}")
    import torch

    if keep.dtype == torch.bool:
        if tuple(keep.shape) != tuple(t.shape[:2]):
            raise ValueError(f"a bool {NEW} mask must have the (batch, seq) shape {tuple(t.shape[:2])}, "
                             f"got {tuple(keep.shape)}")
        return t[keep.to(t.device)]
    if keep.shape[0] != t.shape[0]:
        raise ValueError(f"a 2-D integer {NEW} must have one row per sample ({t.shape[0]}), got shape "
                         f"{tuple(keep.shape)}")
    idx = keep.to(t.device).reshape(*keep.shape, *([1] * (t.dim() - 2)))
    return torch.take_along_dim(t, idx, dim=1)


def is_2d(keep: Any) -> bool:
    """Whether ``keep`` is a 2-D tensor (per-sample positions or a bool mask)."""
    return not isinstance(keep, int) and keep.dim() == 2


_slices_2d: dict[Any, bool] = {}


def native_slices_2d(forward: Any) -> bool:
    """Whether a native ``*ForCausalLM.forward`` slices with ``slice_logits_to_keep`` (transformers
    5.21+), which is what honours a 2-D ``logits_to_keep``: probed from the names its code uses."""
    key = stable_key(forward)
    hit = _slices_2d.get(key)
    if hit is None:
        code = getattr(unwrap(forward), "__code__", None)
        hit = _slices_2d[key] = bool(code is not None and "slice_logits_to_keep" in code.co_names)
    return hit


# --------------------------------------------------------------------------------------------
# the wrapper
# --------------------------------------------------------------------------------------------

_warned_full: set[str] = set()


def _translate(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    if NEW not in kwargs and OLD not in kwargs:
        return wrapped(*args, **kwargs)
    known = forward_params(wrapped).keep
    if known is None:  # neither spelling (nothing to translate) or both (the forward takes either)
        return wrapped(*args, **kwargs)
    keep = pop_keep(kwargs)
    if known == NEW:
        kwargs[NEW] = keep
        return wrapped(*args, **kwargs)
    keep = normalize_keep(keep)
    if isinstance(keep, int):
        kwargs[OLD] = keep
        return wrapped(*args, **kwargs)
    # an index tensor for a forward that only slices the last k positions
    if kwargs.get("labels") is not None:
        raise TypeError(
            f"{type(instance).__name__}.forward of this transformers release takes {OLD} as an int only; "
            f"an index tensor together with labels is not supported here"
        )
    name = type(instance).__name__
    if name not in _warned_full:
        _warned_full.add(name)
        log.warning("liger_compat: %s.forward takes %s as an int only; computing all logits to select "
                    "the requested positions", name, OLD)
    kwargs[OLD] = 0
    out = wrapped(*args, **kwargs)
    if isinstance(out, tuple):
        return (keep_positions(out[0], keep),) + tuple(out[1:])
    out["logits"] = keep_positions(out["logits"], keep)
    return out


def is_ours(obj: Any, wrapper: Any) -> bool:
    """Whether ``wrapper`` (a wrapt wrapper function of ours) is anywhere in ``obj``'s wrapper chain."""
    seen = set()
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        if getattr(obj, "_self_wrapper", None) is wrapper:
            return True
        obj = getattr(obj, "__wrapped__", None)
    return False


def _causal_lm_classes(module: Any) -> list[type]:
    name = module.__name__
    out = []
    for cls_name, obj in list(vars(module).items()):
        if isinstance(obj, type) and cls_name.endswith("ForCausalLM") and obj.__module__ == name and "forward" in vars(obj):
            out.append(obj)
    return out


_SHIM_ID = "transformers.logits_to_keep"
_patches: PatchSet | None = None


def _patch_module(module: Any) -> None:
    if _patches is None:
        return
    for cls in _causal_lm_classes(module):
        current = vars(cls)["forward"]
        if is_ours(current, _translate):
            continue
        if forward_params(current).keep is None:
            continue
        owner = conflicts.foreign_owner(current)
        if owner is not None:
            REGISTRY.report_conflict(f"{cls.__name__}.forward", owner, f"{_SHIM_ID} left it alone")
            continue
        _patches.wrap(cls, "forward", _translate, traceable=True)


_watcher = families.ModelingWatcher(_SHIM_ID, _patch_module, families.all_modeling_modules)


def _apply(module: Any, patches: PatchSet) -> None:
    global _patches
    _patches = patches
    _watcher.start()


def _revert() -> None:
    _watcher.stop()


def describe(cls: type) -> str | None:
    """``"translates X -> Y"`` when this shim wraps ``cls.forward``, else None."""
    fwd = vars(cls).get("forward")
    if fwd is None or not is_ours(fwd, _translate):
        return None
    known = forward_params(fwd).keep
    other = OLD if known == NEW else NEW
    return f"{other} -> {known}"


SHIM = register(
    id=_SHIM_ID,
    library="transformers",
    trigger="transformers",
    target="<Model>ForCausalLM.forward of every modeling module (logits_to_keep / num_logits_to_keep)",
    upstream="transformers 4.49 renamed num_logits_to_keep -> logits_to_keep (huggingface/transformers#35757)",
    fixes=("F3",),
    description=__doc__.split("\n\n")[0],
    _apply=_apply,
    _revert=_revert,
)


# --------------------------------------------------------------------------------------------
# check --deep
# --------------------------------------------------------------------------------------------


@scenario("F3", "GRPO-style logits_to_keep on a causal LM returns [B, k, V]", issue="F3",
          requires=("transformers",))
def _scenario_f3(ctx: Context) -> str:
    import torch

    from .tiny_models import FamilyUnavailable, build

    try:
        model = build("qwen2", seed=ctx.seed, device=ctx.device, dtype=getattr(torch, ctx.dtype))
    except FamilyUnavailable as exc:
        raise Skip(str(exc)) from None
    v = model.config.vocab_size
    g = torch.Generator().manual_seed(ctx.seed)
    ids = torch.randint(3, v, (2, 16), generator=g).to(ctx.device)
    with torch.no_grad():
        full = model(ids).logits
        shapes = {}
        for name in (NEW, OLD):
            out = model(ids, **{name: 4}).logits
            shapes[name] = tuple(out.shape)
            if tuple(out.shape) != (2, 4, v):
                raise AssertionError(f"model(ids, {name}=4).logits has shape {tuple(out.shape)}, expected (2, 4, {v})")
            torch.testing.assert_close(out, full[:, -4:], rtol=1e-4, atol=1e-4)
        idx = torch.tensor([0, 7, 15], device=ctx.device)
        out = model(ids, logits_to_keep=idx).logits
        if tuple(out.shape) != (2, 3, v):
            raise AssertionError(f"logits_to_keep=<index tensor of 3> gave shape {tuple(out.shape)}")
        torch.testing.assert_close(out, full[:, idx], rtol=1e-4, atol=1e-4)
    return f"Qwen2ForCausalLM: logits_to_keep=4 and num_logits_to_keep=4 -> {shapes[NEW]}; index tensor -> (2, 3, {v})"
