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

from typing import Any

from .._log import log
from ..compat import conflicts, families
from ._forward_args import NEW, OLD, forward_params, keep_positions, normalize_keep, pop_keep
from ._patching import ShimPatches, is_ours
from ._registry import REGISTRY, register


# --------------------------------------------------------------------------------------------
# the wrapper
# --------------------------------------------------------------------------------------------

_warned_full: set[str] = set()


def translate(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
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


def _causal_lm_classes(module: Any) -> list[type]:
    name = module.__name__
    out = []
    for cls_name, obj in list(vars(module).items()):
        if isinstance(obj, type) and cls_name.endswith("ForCausalLM") and obj.__module__ == name and "forward" in vars(obj):
            out.append(obj)
    return out


_SHIM_ID = "transformers.logits_to_keep"
def _patch_module(module: Any, patches: ShimPatches) -> list[str]:
    done = []
    for cls in _causal_lm_classes(module):
        current = vars(cls)["forward"]
        if is_ours(current, translate):
            continue
        if forward_params(current).keep is None:
            continue
        owner = conflicts.foreign_owner(current)
        if owner is not None:
            REGISTRY.report_conflict(f"{cls.__name__}.forward", owner, f"{_SHIM_ID} left it alone")
            continue
        patches.wrap(cls, "forward", translate, traceable=True)
        done.append(f"{cls.__name__}.forward")
    return done


def describe(cls: type) -> str | None:
    """``"translates X -> Y"`` when this shim wraps ``cls.forward``, else None."""
    fwd = vars(cls).get("forward")
    if fwd is None or not is_ours(fwd, translate):
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
    modules=families.all_modeling_modules,
    patch_module=_patch_module,
)
