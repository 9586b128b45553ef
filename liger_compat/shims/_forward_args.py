"""The ``logits_to_keep`` / ``num_logits_to_keep`` argument as the causal-LM shims read it.

Upstream: transformers 4.45 ``num_logits_to_keep`` (int), 4.49 ``logits_to_keep`` (int or 1-D index
tensor), 5.21 ``slice_logits_to_keep`` (2-D per-sample positions or a bool mask). Which spelling a
forward accepts (:func:`forward_params`), the value checked once (:func:`normalize_keep`) and the
kept positions selected (:func:`keep_positions`), shared by :mod:`.logits_to_keep` (which translates
the spelling) and :mod:`.causal_lm` (which slices the hidden states before the head).
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

from ._patching import signature, unwrap, wrapped_function


NEW, OLD = "logits_to_keep", "num_logits_to_keep"
_UNSET = object()


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


#: a forward's stable key (:func:`stable_key`) -> its parameters, and its code object -> the same:
#: one stable key per code object is kept (:data:`_key_of_code`), so the wrappers a revert / apply
#: cycle leaves behind do not pile up
_param_cache: dict[Any, ForwardParams] = {}
_key_of_code: dict[Any, Any] = {}


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
    older = _key_of_code.get(key)
    if older is not None and older is not base and older is not key:
        _param_cache.pop(older, None)
    _key_of_code[key] = base
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
