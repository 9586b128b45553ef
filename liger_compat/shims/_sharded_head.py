"""The LM head under a sharding engine: run the fused loss where the engine gathers the weight.

The fused forward computes the loss from ``lm_head.weight`` without calling
``lm_head``. That is only right while the weight is a whole, ordinary tensor:

* FSDP2 (``fully_shard``): when ``lm_head`` is its own unit, ``lm_head.weight`` outside
  ``lm_head.forward`` is a sharded ``DTensor`` (``[V / world, H]`` locally); the unit's forward
  pre-hook all-gathers it and registers the hooks that reduce-scatter its gradient.
* DeepSpeed ZeRO-3: every parameter is partitioned (an empty tensor plus ``ds_*`` attributes)
  until the owning module's forward pre-hook fetches it. Inside the forward of the model that
  DeepSpeed wraps, recent DeepSpeed also gathers a parameter read by attribute and registers it
  as an "external parameter" of the calling module; anywhere else (a loss computed after calling
  the decoder, as trl's fused-loss paths do) the read gives a 0-element tensor: trl #3368,
  fixed for trl's own paths in trl #5891 / #6372 with ``GatheredParameters``.
* FSDP1 with ``lm_head`` wrapped as its own ``FullyShardedDataParallel`` unit: the original
  parameter is a sharded, flattened view outside the wrapper's forward.

The engines gather in the module's hooks and reduce gradients from hooks tied to that call,
so the robust route is to run the fused loss *as* ``lm_head``'s forward: :func:`through_module`
swaps ``forward`` on the instance for the duration of one ``lm_head(hidden)`` call, the
engine's hooks run around it unchanged, and autograd sends the weight's gradient to the very
parameter the engine gathered. We never all-gather or reduce anything ourselves.

:func:`fused_head_loss` is what the fused ``*ForCausalLM`` forward calls instead of
``fused_linear_cross_entropy(hidden, self.lm_head.weight, ...)``; it takes the direct route when
the head is an ordinary module (single GPU, DDP, a head inside its parent's FSDP unit) so user
hooks on ``lm_head`` are not disturbed there. :func:`head_weight` gathers the full weight for
reads without gradients (diagnostics, evaluation code), through the engine's own API.

Importing this module imports no torch; everything heavy is imported inside the functions.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any, Callable, Iterator

from .._config import compiling

__all__ = [
    "fused_head_loss", "through_module", "head_weight", "head_module", "head_sharding", "ShardedHeadError", "wired",
    "dtensor_route", "describe_dtensor_head",
]

_MISSING = object()

#: how many times the fused head went through a sharding engine's hooks (for ``check()``)
engine_calls = 0
#: how many times the fused loss ran vocabulary-parallel over a tensor-parallel head (for ``check()``)
tensor_parallel_calls = 0


class ShardedHeadError(RuntimeError):
    """The LM-head weight is sharded in a way the fused loss cannot gather (tensor parallel)."""


# --------------------------------------------------------------------------------------------
# what kind of head is this
# --------------------------------------------------------------------------------------------


def _mro_names(obj: Any) -> frozenset[str]:
    """The class names of ``obj``'s type and its bases, kept per type (read on every head call)."""
    cls = type(obj)
    if compiling():  # traced: no cache (a weak table is no constant to dynamo)
        return frozenset(c.__name__ for c in cls.__mro__)
    names = _MRO_NAMES.get(cls)
    if names is None or names[0] is not cls.__mro__:  # a class whose bases were reassigned: read again
        names = _MRO_NAMES[cls] = (cls.__mro__, frozenset(c.__name__ for c in cls.__mro__))
    return names[1]


#: type -> (its __mro__ when read, the class names in it); a weak table: a class made on the fly
#: (FSDP2's per-module FSDP classes) is dropped with it
_MRO_NAMES: "weakref.WeakKeyDictionary[type, tuple[tuple, frozenset[str]]]" = weakref.WeakKeyDictionary()


def is_dtensor(t: Any) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")  # no DTensor can exist before this import
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(t, cls)


def is_zero3_param(t: Any) -> bool:
    return hasattr(t, "ds_id") and hasattr(t, "ds_status")


def head_module(module: Any) -> Any:
    """The module whose ``forward`` computes the head: FSDP1 wraps it in ``_fsdp_wrapped_module``."""
    inner = getattr(module, "_fsdp_wrapped_module", None)
    return inner if inner is not None and "FullyShardedDataParallel" in _mro_names(module) else module


def head_sharding(lm_head: Any) -> str:
    """``"fsdp2"``, ``"fsdp1"``, ``"zero3"``, ``"dtensor"`` (sharded, no engine hooks: tensor
    parallel, or FSDP2 read outside its unit's forward) or ``"none"`` (an ordinary module)."""
    names = _mro_names(lm_head)
    if "FSDPModule" in names:
        return "fsdp2"
    if "FullyShardedDataParallel" in names:
        return "fsdp1"
    # not FSDP1 (above): the module is its own head; its parameters read from its table
    table = lm_head.__dict__.get("_parameters")
    params = ([p for p in table.values() if p is not None] if table is not None
              else list(lm_head.parameters(recurse=False)))
    if any(is_zero3_param(p) for p in params):
        return "zero3"
    if any(is_dtensor(p) for p in params):
        return "dtensor"
    return "none"


# --------------------------------------------------------------------------------------------
# running a function as the module's forward
# --------------------------------------------------------------------------------------------


def through_module(module: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """Return ``module(*args)`` with ``fn(inner, *args)`` in place of ``inner.forward``.

    ``inner`` is ``module`` itself, or the wrapped module of an FSDP1 wrapper. Every forward
    hook of ``module`` runs as for an ordinary call (FSDP2 unshard / reshard and post-backward
    registration, ZeRO-3 fetch / release, FSDP1's wrapper forward), so inside ``fn``
    ``inner.weight`` is the full, gathered parameter and its gradient is reduced by the engine.

    Pass only the tensors the loss differentiates through as ``args`` (the engines cast and move
    floating-point forward inputs under mixed precision); close over everything else.
    Where accelerate's hooks replaced ``forward`` (``_hf_hook``), ``_old_forward`` is swapped
    instead so they still run.
    """
    global engine_calls
    inner = head_module(module)
    d = inner.__dict__
    attr = "_old_forward" if "_hf_hook" in d and "_old_forward" in d else "forward"
    saved = d.get(attr, _MISSING)

    def forward(*a: Any, **k: Any) -> Any:
        return fn(inner, *a, **k)

    d[attr] = forward
    try:
        engine_calls += 1
        return module(*args)
    finally:
        if saved is _MISSING:
            d.pop(attr, None)
        else:
            d[attr] = saved


def dtensor_route(w: Any) -> str:
    """How the fused loss takes the DTensor head weight ``w``: ``"vocab"`` (``Shard(0)`` over one
    mesh dimension: tensor parallelism's vocabulary-parallel head, the loss combines the shards'
    statistics across that dimension's group), ``"replicated"`` (every rank holds the whole
    weight). Anything else raises :class:`ShardedHeadError` naming the placements."""
    placements = tuple(getattr(w, "placements", ()))
    mesh = getattr(w, "device_mesh", None)
    names = [type(p).__name__ for p in placements]
    if placements and all(n == "Replicate" for n in names):
        return "replicated"
    if mesh is not None and mesh.ndim == 1 and names == ["Shard"] and placements[0].dim == 0:
        return "vocab"
    dims = getattr(mesh, "mesh_dim_names", None)
    raise ShardedHeadError(
        f"lm_head.weight is a DTensor with placements {placements} on mesh dimensions {dims}: the fused loss takes a "
        "head split over the vocabulary (Shard(0)) along one mesh dimension, or a replicated one. Run the native "
        "head loss for this model: LIGER_COMPAT_KERNELS without fused_linear_cross_entropy, or "
        "liger_compat.configure(kernels=...)."
    )


def describe_dtensor_head(w: Any) -> str:
    """For ``check()``: the head's placements, mesh and the route the fused loss takes."""
    mesh = getattr(w, "device_mesh", None)
    dims = getattr(mesh, "mesh_dim_names", None) or ()
    shape = "x".join(f"{d}={mesh.size(i)}" for i, d in enumerate(dims)) if mesh is not None and dims else \
        f"{getattr(mesh, 'ndim', '?')}-D mesh"
    placements = ", ".join(str(p) for p in getattr(w, "placements", ()))
    try:
        route = {"vocab": "vocabulary-parallel fused loss", "replicated": "fused loss on the replicated weight"}[
            dtensor_route(w)]
    except ShardedHeadError:
        route = "NOT supported by the fused loss (native head loss needed)"
    return f"DTensor ({placements}) over {shape}: {route}"


def _vocab_shard(w: Any) -> tuple[Any, int, int, Any]:
    """(local rows, their first row in the whole vocabulary, the vocabulary, the group) of a
    ``Shard(0)`` DTensor weight: DTensor splits as ``torch.chunk`` does (ceil(V / n) rows a rank,
    the last ranks fewer or none)."""
    mesh = w.device_mesh
    n = mesh.size(0)
    vocab = int(w.shape[0])
    coord = mesh.get_coordinate()[0]
    rows = -(-vocab // n)
    offset = min(coord * rows, vocab)
    local = w.to_local()
    if local.shape[0] != min(rows, vocab - offset):
        raise ShardedHeadError(f"lm_head.weight's shard on rank {coord} of {n} has {local.shape[0]} rows, not the "
                               f"{min(rows, vocab - offset)} an even split of {vocab} gives")
    return local, offset, vocab, mesh.get_group(0)


def _dtensor_loss(w: Any, b: Any, h: Any, target: Any, dtype: Any, loss_kwargs: dict[str, Any]) -> Any:
    """The fused loss of a DTensor head weight (tensor parallel): by :func:`dtensor_route`."""
    if is_dtensor(h):  # the decoder's output as a DTensor: replicated on every rank, or not ours to take
        if not all(type(p).__name__ == "Replicate" for p in h.placements):
            raise ShardedHeadError(f"the hidden states reach lm_head as a DTensor with placements {h.placements}: "
                                   "the fused loss takes replicated hidden states (sequence parallelism's sharded "
                                   "ones are not supported); run the native head loss for this model")
        h = h.to_local()
    route = dtensor_route(w)
    dt = dtype if dtype is not None else w.dtype
    if route == "replicated":
        from ..kernels import fused_linear_cross_entropy

        wl = w.to_local().to(dt)
        bl = None if b is None else (b.to_local() if is_dtensor(b) else b).to(dt)
        return fused_linear_cross_entropy(h.to(dt), wl, target, bias=bl, **loss_kwargs)
    from ..kernels.vocab_parallel import vocab_parallel_cross_entropy

    wl, offset, vocab, group = _vocab_shard(w)
    bl = None
    if b is not None:
        bl = b.to_local() if is_dtensor(b) else b[offset:offset + wl.shape[0]]
        bl = bl.to(dt)
    global tensor_parallel_calls
    tensor_parallel_calls += 1
    return vocab_parallel_cross_entropy(h.to(dt), wl.to(dt), target, vocab_offset=offset, vocab_size=vocab,
                                        group=group, bias=bl, **loss_kwargs)


def _full_weight_and_bias(inner: Any) -> tuple[Any, Any]:
    w = inner.weight
    b = getattr(inner, "bias", None)
    for name, t in (("weight", w), ("bias", b)):
        if t is None:
            continue
        if is_dtensor(t):
            raise ShardedHeadError(
                f"lm_head.{name} is a DTensor ({getattr(t, 'placements', '?')}) inside lm_head's forward: the head is "
                "sharded without an FSDP2 unit of its own (tensor parallel, or the loss runs outside the model's "
                "forward); the fused loss needs the whole weight. Leave lm_head replicated, or disable the "
                "fused_linear_cross_entropy kernel (LIGER_COMPAT_KERNELS)."
            )
        if is_zero3_param(t) and t.numel() == 0:
            raise ShardedHeadError(
                f"lm_head.{name} is still partitioned by DeepSpeed ZeRO-3 inside lm_head's forward "
                f"(ds_status={getattr(t, 'ds_status', '?')}); its forward pre-hook did not fetch it"
            )
    return w, b


# --------------------------------------------------------------------------------------------
# the fused loss on the head
# --------------------------------------------------------------------------------------------


def fused_head_loss(lm_head: Any, hidden: Any, target: Any, *, dtype: Any = None, **loss_kwargs: Any) -> Any:
    """``fused_linear_cross_entropy(hidden, lm_head.weight, target, bias=lm_head.bias, **loss_kwargs)``
    with the head's weight gathered the way its sharding engine expects.

    ``hidden`` is ``[..., H]``, ``target`` the matching (already shifted) class ids; the keyword
    arguments are those of :func:`liger_compat.kernels.fused_linear_cross_entropy`
    (``ignore_index``, ``reduction``, ``num_items_in_batch``, ``softcap``,
    ``return_token_accuracy``, ...). Returns what that function returns. For FSDP2 / FSDP1 /
    ZeRO-3 heads the loss runs inside ``lm_head(hidden)`` (:func:`through_module`); for ordinary
    modules (single GPU, DDP, head inside its parent's FSDP unit) it is a direct call.
    The loss is computed in ``dtype`` (autocast's compute dtype, say) or, when it is None, in the
    dtype of the weight as gathered: hidden, weight and bias are cast to it inside the head's call.
    """
    from ..kernels import fused_linear_cross_entropy

    def loss(inner: Any, h: Any) -> Any:
        if is_dtensor(inner.weight):  # tensor parallel (the weight inside an FSDP2 unit's call: FSDP2 x TP)
            out = _dtensor_loss(inner.weight, getattr(inner, "bias", None), h, target, dtype, loss_kwargs)
            return tuple(out) if isinstance(out, tuple) else out
        w, b = _full_weight_and_bias(inner)
        # decided here, on the gathered weight: FSDP2's mixed precision makes the unsharded weight
        # (and, with cast_forward_inputs, ``h``) param_dtype while the sharded one keeps its own
        dt = dtype if dtype is not None else w.dtype
        h, w, b = h.to(dt), w.to(dt), (None if b is None else b.to(dt))
        out = fused_linear_cross_entropy(h, w, target, bias=b, **loss_kwargs)
        # a plain tuple, so that engines that rebuild forward outputs see nothing unusual
        return tuple(out) if isinstance(out, tuple) else out

    kind = head_sharding(lm_head)
    if kind in ("fsdp2", "fsdp1", "zero3"):
        out = through_module(lm_head, loss, hidden)
    else:
        out = loss(lm_head, hidden)
    if isinstance(out, tuple):
        from ..kernels import CrossEntropyOutput

        return CrossEntropyOutput(*out)
    return out


@contextlib.contextmanager
def head_weight(lm_head: Any) -> Iterator[tuple[Any, Any]]:
    """``with head_weight(lm_head) as (weight, bias):`` the full weight and bias, for reading.

    Gathers through the engine's own API (FSDP2 ``unshard()`` / ``reshard()``, DeepSpeed
    ``zero.GatheredParameters``, FSDP1 ``summon_full_params``) and releases on exit. Not for
    computing a loss to train on: the engines reduce gradients from hooks tied to the module's
    call, so a gradient through this weight would skip the reduction. Use
    :func:`fused_head_loss` for that; here, a sharded head with grad mode on raises.
    """
    inner = head_module(lm_head)
    kind = head_sharding(lm_head)
    if kind == "none":
        yield inner.weight, getattr(inner, "bias", None)
        return
    import torch

    if torch.is_grad_enabled() and any(p.requires_grad for p in inner.parameters(recurse=False)):
        raise RuntimeError(
            f"head_weight() on a {kind}-sharded lm_head with grad mode on: its gradient would not be reduced by "
            "the engine. Use liger_compat.shims._sharded_head.fused_head_loss(), or wrap the read in torch.no_grad()."
        )
    if kind == "fsdp2":
        if not is_dtensor(inner.weight):  # already unsharded (inside its forward, or reshard_after_forward=False)
            yield inner.weight, getattr(inner, "bias", None)
            return
        lm_head.unshard()
        try:
            yield inner.weight, getattr(inner, "bias", None)
        finally:
            lm_head.reshard()
    elif kind == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(inner.parameters(recurse=False)), modifier_rank=None):
            yield inner.weight, getattr(inner, "bias", None)
    elif kind == "fsdp1":
        with type(lm_head).summon_full_params(lm_head, recurse=False, writeback=False):
            yield inner.weight, getattr(inner, "bias", None)
    else:  # DTensor without an engine unit: materialise a full copy
        b = getattr(inner, "bias", None)
        yield inner.weight.full_tensor(), (b.full_tensor() if is_dtensor(b) else b)


# --------------------------------------------------------------------------------------------
# for check(): does the fused forward use this module?
# --------------------------------------------------------------------------------------------


def wired() -> bool:
    """True when some other loaded ``liger_compat`` module routes the fused head through here
    (it references :func:`fused_head_loss`, :func:`through_module` or this module), or when the
    engine route has already run in this process."""
    if engine_calls or tensor_parallel_calls:
        return True
    me = sys.modules.get(__name__)
    targets = {id(fused_head_loss), id(through_module), id(me)}
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("liger_compat.") or name in (__name__, "liger_compat.shims"):
            continue
        if name == "liger_compat.compat.distributed":
            continue
        try:
            values = list(vars(mod).values())
        except TypeError:
            continue
        if any(id(v) in targets for v in values):
            return True
    return False
