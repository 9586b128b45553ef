"""Logits in training for a Trainer subclass whose own ``compute_loss`` may read them.

Upstream: ``transformers.Trainer.compute_loss`` (every release of the grid) is the documented place to
customise the loss; a subclass overriding it calls ``model(**inputs)`` with the labels still in the
batch and reads ``outputs.logits`` (``outputs["logits"]``). transformers' own and trl's
``compute_loss`` read only the loss (trl's SFT metrics are handled by ``trl.sft_token_accuracy``).

Failure prevented: with the fused forward a training call with labels returns ``logits=None``, so such a
subclass died with ``TypeError: 'NoneType' object is not subscriptable`` and no hint.

What the shim does: when a trainer is constructed, and at each ``training_step`` (a ``model_init``
model is made in ``train``), a trainer whose class has a ``compute_loss`` of its own below the
library trainers (a class in its MRO before the first class of transformers or trl that defines it)
(not a library's function assigned to it) gets the logits for its model: every patched causal LM inside ``trainer.model`` is marked
(``causal_lm.RETURN_LOGITS_ATTR``), and the fused forward then computes the logits besides the fused
loss for that instance only, as ``return_logits=True`` would. ``check()`` names the trainer.
``training_step`` also counts the steps running, so that reading ``logits`` of a training output
there does not warn (:mod:`.training_output`).
"""

from __future__ import annotations

from typing import Any

from ._patching import ShimPatches, unwrap
from ._registry import register
from . import training_output

SHIM_ID = "transformers.custom_compute_loss_logits"
#: packages whose trainers' compute_loss reads no logits of a training call with labels
LIBRARY_PACKAGES = ("transformers", "trl")

_events: list[str] = []
#: trainer class -> the class of its own compute_loss (None: the library's)
_owner_cache: dict[type, type | None] = {}


def _library(obj: Any) -> bool:
    return str(getattr(obj, "__module__", None)).split(".")[0] in LIBRARY_PACKAGES


def own_compute_loss(trainer_cls: type) -> type | None:
    """The class in ``trainer_cls``'s MRO whose ``compute_loss`` runs, when it is not one of the
    libraries' own trainers (a user's subclass, or another package's); None otherwise."""
    hit = _owner_cache.get(trainer_cls, False)
    if hit is not False:
        return hit
    owner = None
    for klass in trainer_cls.__mro__:
        if _library(klass):
            break
        if "compute_loss" in vars(klass):
            # a library's own function put on a subclass (``compute_loss = Trainer.compute_loss``) is not one
            owner = None if _library(unwrap(vars(klass)["compute_loss"])) else klass
            break
    _owner_cache[trainer_cls] = owner
    return owner


def _mark(trainer: Any) -> None:
    owner = own_compute_loss(type(trainer))
    model = getattr(trainer, "model", None)
    if owner is None or model is None or vars(trainer).get("_liger_compat_marked") is model:
        return
    from . import causal_lm

    marked = []
    for m in causal_lm._causal_lms_in(model):
        m.__dict__[causal_lm.RETURN_LOGITS_ATTR] = True
        marked.append(type(m).__name__)
    trainer.__dict__["_liger_compat_marked"] = model
    if marked:
        entry = (f"{type(trainer).__name__} overrides compute_loss ({owner.__module__}.{owner.__qualname__}): "
                 f"{', '.join(sorted(set(marked)))} returns logits in training")
        if entry not in _events:
            _events.append(entry)


def _init_middleware(call_next: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    result = call_next(args, kwargs)
    if instance is not None:
        _mark(instance)
    return result


def _training_step(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    if instance is not None:
        _mark(instance)
    training_output.trainer_steps += 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        training_output.trainer_steps -= 1


def _patch(module: Any, patches: ShimPatches) -> list[str]:
    trainer = getattr(module, "Trainer", None)
    if trainer is None or "training_step" not in vars(trainer):
        return []
    patches.middleware(trainer, "__init__", _init_middleware)
    patches.wrap(trainer, "training_step", _training_step)
    return ["Trainer.__init__", "Trainer.training_step"]


def _revert() -> None:
    _owner_cache.clear()


register(
    id=SHIM_ID,
    library="transformers",
    trigger="transformers",
    target="Trainer.__init__, Trainer.training_step (a subclass's own compute_loss)",
    upstream="transformers Trainer.compute_loss, overridden by a subclass that reads outputs.logits with labels",
    fixes=(),
    description=__doc__.split("\n\n")[0],
    modules=("transformers.trainer",),
    patch_module=_patch,
    _revert=_revert,
    in_use=lambda: "; ".join(_events),
)
