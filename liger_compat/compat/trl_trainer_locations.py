"""Where each trl trainer (and its config) lives, on every trl release of the grid.

Upstream moves, read from the trl sources of 0.11 .. 1.16:

* ``GRPOTrainer`` appeared in trl 0.14 (``trl.trainer.grpo_trainer``);
* trl 0.26 moved ``ORPOTrainer``, ``CPOTrainer``, ``KTOTrainer`` (and BCO, GKD, PPO, PRM, online
  DPO, Nash-MD, XPO) to ``trl.experimental.<name>``, leaving deprecated subclasses under
  ``trl.trainer`` until 0.28; trl 0.29 removed those aliases and brought a rewritten
  ``KTOTrainer`` back to ``trl.trainer.kto_trainer``.

Shims patch every module of :data:`TRAINER_MODULES` / :data:`CONFIG_MODULES` that gets imported;
:func:`find_trainer` is how tests and scenarios get a trainer class from wherever the installed
trl keeps it, preferring the real class over a deprecated alias.
"""

from __future__ import annotations

import importlib
from typing import Any

#: short name -> module paths that define ``<Name>Trainer``, newest location first
TRAINER_MODULES: dict[str, tuple[str, ...]] = {
    "sft": ("trl.trainer.sft_trainer",),
    "dpo": ("trl.trainer.dpo_trainer",),
    "grpo": ("trl.trainer.grpo_trainer",),
    "kto": ("trl.trainer.kto_trainer", "trl.experimental.kto.kto_trainer"),
    "orpo": ("trl.experimental.orpo.orpo_trainer", "trl.trainer.orpo_trainer"),
    "cpo": ("trl.experimental.cpo.cpo_trainer", "trl.trainer.cpo_trainer"),
    "bco": ("trl.experimental.bco.bco_trainer", "trl.trainer.bco_trainer"),
    "reward": ("trl.trainer.reward_trainer",),
    "rloo": ("trl.trainer.rloo_trainer",),
    "gkd": ("trl.experimental.gkd.gkd_trainer", "trl.trainer.gkd_trainer"),
    "online_dpo": ("trl.experimental.online_dpo.online_dpo_trainer", "trl.trainer.online_dpo_trainer"),
    "prm": ("trl.experimental.prm.prm_trainer", "trl.trainer.prm_trainer"),
    "ppo": ("trl.experimental.ppo.ppo_trainer", "trl.trainer.ppo_trainer"),
    "nash_md": ("trl.experimental.nash_md.nash_md_trainer", "trl.trainer.nash_md_trainer"),
    "xpo": ("trl.experimental.xpo.xpo_trainer", "trl.trainer.xpo_trainer"),
    "iterative_sft": ("trl.trainer.iterative_sft_trainer",),
    "distillation": ("trl.trainer.distillation_trainer",),
}

CONFIG_MODULES: dict[str, tuple[str, ...]] = {
    name: tuple(m.rsplit("_trainer", 1)[0] + "_config" for m in mods)
    for name, mods in TRAINER_MODULES.items()
    if name != "iterative_sft"
}

#: canonical class-name prefix of each short name
PREFIX: dict[str, str] = {
    "sft": "SFT", "dpo": "DPO", "grpo": "GRPO", "kto": "KTO", "orpo": "ORPO", "cpo": "CPO", "bco": "BCO",
    "reward": "Reward", "rloo": "RLOO", "gkd": "GKD", "online_dpo": "OnlineDPO", "prm": "PRM", "ppo": "PPO",
    "nash_md": "NashMD", "xpo": "XPO", "iterative_sft": "IterativeSFT", "distillation": "Distillation",
}


def all_trainer_modules() -> tuple[str, ...]:
    return tuple(m for mods in TRAINER_MODULES.values() for m in mods)


def all_config_modules() -> tuple[str, ...]:
    return tuple(m for mods in CONFIG_MODULES.values() for m in mods)


class TrainerUnavailable(Exception):
    """The installed trl has no such trainer; the message says which version and where it looked."""


def _is_deprecated_alias(cls: type) -> bool:
    # trl 0.26 .. 0.28 kept `class ORPOTrainer(experimental ORPOTrainer)` under trl.trainer
    base = cls.__mro__[1] if len(cls.__mro__) > 1 else None
    return base is not None and base.__name__ == cls.__name__ and ".experimental." in base.__module__


def find_trainer(name: str) -> tuple[type, type | None]:
    """``(TrainerClass, ConfigClass)`` for ``name`` (``"sft"``, ``"orpo"`` ...) from wherever the
    installed trl keeps it. Raises :class:`TrainerUnavailable` with the reason when it has none."""
    import warnings

    prefix = PREFIX[name]
    tried = []
    for tmod, cmod in zip(TRAINER_MODULES[name], CONFIG_MODULES.get(name, ()) + (None,) * 4):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # trl.experimental warns on import
                mod = importlib.import_module(tmod)
        except ImportError as exc:
            tried.append(f"{tmod} ({type(exc).__name__})")
            continue
        cls = getattr(mod, f"{prefix}Trainer", None)
        if cls is None:
            tried.append(f"{tmod} (no {prefix}Trainer)")
            continue
        if _is_deprecated_alias(cls):
            cls = cls.__mro__[1]
        cfg = None
        if cmod is not None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    cfg = getattr(importlib.import_module(cmod), f"{prefix}Config", None)
            except ImportError:
                cfg = None
        if cfg is None:
            cfg = getattr(mod, f"{prefix}Config", None)
        if cfg is not None and _is_deprecated_alias(cfg):
            cfg = cfg.__mro__[1]
        return cls, cfg
    import trl

    raise TrainerUnavailable(f"trl {trl.__version__} has no {prefix}Trainer (looked in {', '.join(tried)})")


# --------------------------------------------------------------------------------------------
# trainer classes of a module
# --------------------------------------------------------------------------------------------

#: the transformers base classes of trainers and of their configs, as (module, class name): matched
#: by name so that a hook on one transformers module never imports another mid-import
TRAINER_BASE = ("transformers.trainer", "Trainer")
ARGS_BASE = ("transformers.training_args", "TrainingArguments")


def classes_defined_in(module: Any, *bases: tuple[str, str]) -> list[type]:
    """Classes defined in ``module`` itself (not merely imported into it) that are, or derive from,
    one of ``bases`` (``(module name, class name)`` pairs)."""
    wanted = set(bases)
    out = []
    for obj in list(vars(module).values()):
        if not isinstance(obj, type) or obj.__module__ != module.__name__:
            continue
        if any((getattr(k, "__module__", ""), k.__name__) in wanted for k in obj.__mro__):
            out.append(obj)
    return out
