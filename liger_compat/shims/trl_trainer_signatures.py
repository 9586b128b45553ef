"""Old trl trainers called with the arguments newer transformers Trainer loops pass (trl < 0.13).

Upstream: transformers 4.46 ``Trainer.training_step`` calls
``self.compute_loss(model, inputs, num_items_in_batch=...)`` and the training loop calls
``self.get_batch_samples(epoch_iterator, num_batches)`` (4.50: ``..., device``); 4.47
``Trainer._maybe_log_save_evaluate`` calls ``self.log(logs, start_time)``. trl 0.11 ``DPOTrainer``,
``ORPOTrainer``, ``CPOTrainer``, ``KTOTrainer``, ``BCOTrainer`` override ``compute_loss(model, inputs,
return_outputs=False)``, ``log(logs)`` and an unrelated ``get_batch_samples(model, batch)`` (sample
generation for eval logging); trl 0.12 fixed the first and the last, 0.13 the ``log`` signature.

Failures prevented: ``TypeError: DPOTrainer.compute_loss() got an unexpected keyword argument
'num_items_in_batch'``, ``TypeError: DPOTrainer.get_batch_samples() takes 3 positional arguments but 4
were given`` (or the iterator taken for a model), ``TypeError: log() takes 2 positional arguments but 3
were given``.

What the shim does, for each method a trl trainer class overrides with a narrower signature than the
installed ``transformers.Trainer`` method: arguments the override does not take (``num_items_in_batch``,
``start_time``) are dropped for it (the old trainers normalise their own losses and time nothing), and a
``get_batch_samples`` call in the Trainer loop's form (an iterator and a batch count) goes to
``transformers.Trainer.get_batch_samples`` while trl's own ``(model, batch)`` calls still reach trl's.
"""

from __future__ import annotations

import inspect
from typing import Any

from ._patching import PatchSet, signature
from ._registry import register
from ..compat import trl_trainer_locations as locations
from ..compat.trl_trainer_locations import TRAINER_BASE, classes_defined_in


def _params(fn: Any) -> list[inspect.Parameter] | None:
    try:
        return list(signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def _takes(params: list[inspect.Parameter], name: str) -> bool:
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def _drop_kwarg(name: str):
    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        kwargs.pop(name, None)
        return wrapped(*args, **kwargs)

    return wrapper


def _limit_positional(n: int, drop: tuple[str, ...]):
    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        for name in drop:
            kwargs.pop(name, None)
        return wrapped(*args[:n], **kwargs)

    return wrapper


def _is_loop_call(args: tuple, kwargs: dict[str, Any]) -> bool:
    if "epoch_iterator" in kwargs or "num_batches" in kwargs:
        return True
    return len(args) >= 2 and isinstance(args[1], int) and hasattr(args[0], "__next__")


def _batch_samples_dispatch(trainer_cls: type):
    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        if _is_loop_call(args, kwargs):
            return trainer_cls.get_batch_samples(instance, *args, **kwargs)
        return wrapped(*args, **kwargs)

    return wrapper


def _patch(module: Any, patches: PatchSet) -> list[str]:
    from transformers import Trainer  # a trl trainer module is being imported: transformers.trainer is loaded

    done = []
    for cls in classes_defined_in(module, TRAINER_BASE):
        own = cls.__dict__
        if "compute_loss" in own:
            mine, base = _params(own["compute_loss"]), _params(Trainer.compute_loss)
            if mine is not None and base is not None and _takes(base, "num_items_in_batch") \
                    and not _takes(mine, "num_items_in_batch"):
                patches.wrap(cls, "compute_loss", _drop_kwarg("num_items_in_batch"))
                done.append(f"{cls.__name__}.compute_loss")
        if "log" in own:
            mine, base = _params(own["log"]), _params(Trainer.log)
            if mine is not None and base is not None and len(mine) < len(base) \
                    and not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in mine):
                dropped = tuple(p.name for p in base[len(mine):])
                patches.wrap(cls, "log", _limit_positional(len(mine) - 1, dropped))  # minus self
                done.append(f"{cls.__name__}.log")
        if "get_batch_samples" in own and "get_batch_samples" in vars(Trainer):
            mine = _params(own["get_batch_samples"])
            if mine is not None and [p.name for p in mine[1:3]] == ["model", "batch"]:
                patches.wrap(cls, "get_batch_samples", _batch_samples_dispatch(Trainer))
                done.append(f"{cls.__name__}.get_batch_samples")
    return done


register(
    id="trl.trainer_signatures",
    library="trl",
    trigger="trl",
    target="compute_loss / log / get_batch_samples of trl < 0.13 trainers",
    versions="<0.13",
    upstream="transformers 4.46 compute_loss(num_items_in_batch=) and get_batch_samples(epoch_iterator, num_batches); "
             "4.47 log(logs, start_time); trl 0.12 / 0.13 followed",
    fixes=("F5",),
    description=__doc__.split("\n\n")[0],
    modules=locations.all_trainer_modules(),
    patch_module=_patch,
)
