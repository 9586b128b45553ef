"""The trainers' own liger switch while liger_compat is active: one set of kernels, not two.

Upstream: transformers 4.45 ``TrainingArguments(use_liger_kernel=True)`` makes ``Trainer.__init__``
call liger-kernel's ``_apply_liger_kernel_to_instance`` (5.x: ``apply_liger_kernel``), which
replaces norms, MLPs and the model's forward on the instance; trl 0.15 ``SFTConfig(use_liger=True)``
loads string models through ``AutoLigerKernelForCausalLM``; trl 1.15+ keeps ``use_liger_kernel`` for
the layer kernels only (with a deprecation warning) next to its own fused LM head.

Failure prevented: liger-kernel's instance patches stacked on liger_compat's class patches (two
norms, two fused losses, a ``revert()`` that cannot undo the foreign half), or, without
liger-kernel installed, ``ImportError: ... liger-kernel >= 0.3.0 is not available``.

What the shim does: when a trainer is constructed while liger_compat is active with at least one
kernel selected, the switch is turned off on its ``args`` before the trainer reads it, with one
:class:`LigerSwitchWarning`, so liger_compat's kernels are the only ones applied. ``check()``
says so (this shim's reason and a conflict entry). ``LIGER_COMPAT_DISABLE=1`` (or
``configure(enabled=False)``) leaves the switch alone and liger-kernel in charge. trl's
``use_liger_loss`` (liger-kernel's fused preference losses, which compute the head themselves) is
left on and reported.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from .. import _config
from ._patching import ShimPatches
from ._registry import REGISTRY, register
from ..compat import trl_trainer_locations as locations
from ..compat.trl_trainer_locations import TRAINER_BASE, classes_defined_in


SHIM_ID = "transformers.trainer_liger_switch"
#: TrainingArguments / trl config fields that apply liger-kernel's kernels to the model
SWITCHES = ("use_liger_kernel", "use_liger")
#: trl config fields that route the loss through liger-kernel's fused preference losses
LOSS_SWITCHES = ("use_liger_loss",)


class LigerSwitchWarning(UserWarning):
    """A trainer's liger switch was turned off because liger_compat's kernels are applied."""


def _active() -> bool:
    s = _config.settings
    return not s.disabled and bool(s.kernels)


def _init_middleware(events: list[str], call_next: Any, wrapped: Any, instance: Any, args: tuple,
                     kwargs: dict[str, Any]) -> Any:
    def _note(entry: str) -> None:
        if entry not in events:
            events.append(entry)

    targs = kwargs.get("args", args[1] if len(args) > 1 else None)
    if targs is not None and instance is not None and _active():
        trainer = type(instance).__name__
        for switch in SWITCHES:
            if getattr(targs, switch, False) is True:
                setattr(targs, switch, False)
                kernels = ", ".join(sorted(_config.settings.kernels))
                warnings.warn(
                    f"liger_compat: {trainer}: {switch}=True turned off; liger_compat's kernels ({kernels}) are "
                    "applied instead, so the model gets one set of kernels. Set LIGER_COMPAT_DISABLE=1 to use "
                    "liger-kernel through the trainer.",
                    LigerSwitchWarning,
                    stacklevel=4,
                )
                REGISTRY.report_conflict(f"{trainer} args.{switch}", "the trainer's own liger switch",
                                         "turned off: liger_compat's kernels are the ones applied")
                _note(f"{trainer}: {switch} turned off, liger_compat kernels applied")
        for switch in LOSS_SWITCHES:
            if getattr(targs, switch, False) is True:
                REGISTRY.report_conflict(f"{trainer} loss", f"liger-kernel via args.{switch}",
                                         "liger-kernel's fused preference loss computes the LM head; "
                                         "liger_compat's layer kernels run inside the decoder")
                _note(f"{trainer}: {switch} left on (liger-kernel computes that loss's head)")
    return call_next(args, kwargs)


def _register(**fields: Any) -> None:
    """A switch shim; its report line says which kernels a trainer ended up with, once one was
    constructed with its switch on."""
    events: list[str] = []
    middleware = functools.partial(_init_middleware, events)

    def patch(module: Any, patches: ShimPatches) -> list[str]:
        done = []
        for cls in classes_defined_in(module, TRAINER_BASE):
            if "__init__" in cls.__dict__:
                patches.middleware(cls, "__init__", middleware)
                done.append(f"{cls.__name__}.__init__")
        return done

    register(patch_module=patch, in_use=lambda: "; ".join(events), description=__doc__.split("\n\n")[0],
             fixes=(), **fields)


# one shim per package: a trigger must be the package of its targets, so that a target module is
# never half-imported when its hook runs
_register(
    id=SHIM_ID,
    library="transformers",
    trigger="transformers",
    target="Trainer.__init__ (args.use_liger_kernel)",
    versions=">=4.45",
    upstream="transformers 4.45 TrainingArguments.use_liger_kernel applies liger-kernel in Trainer.__init__",
    modules=("transformers.trainer",),
)

_register(
    id="trl.trainer_liger_switch",
    library="trl",
    trigger="trl",
    target="every trl trainer's __init__ (args.use_liger_kernel / use_liger, before trl reads them)",
    upstream="trl 0.15 SFTConfig.use_liger loads AutoLigerKernelForCausalLM; trl 1.15 deprecates use_liger_kernel",
    modules=locations.all_trainer_modules(),
)
