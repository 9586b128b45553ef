"""Coexistence with trl's own chunked fused LM heads (trl 1.6+).

Upstream: trl 1.6 .. 1.14 ``SFTConfig(loss_type="chunked_nll")`` (the default from 1.10) patches
the model's forward with ``_patch_chunked_ce_lm_head``; trl 1.15+ ``SFTTrainer``, ``DPOTrainer``,
``GRPOTrainer``, ``KTOTrainer`` (and RLOO, distillation) call
``trl.trainer.utils.add_fused_lm_head(model, outputs=(...))`` in ``__init__``. Both replace
``model.forward`` on the instance; with ``add_fused_lm_head`` a call with ``fused_lm_head=True`` runs the
backbone (``model.model``) and scores the labels through trl's ``_ChunkedLogProbFunction``
(log-probs, entropy, is_top1) without building the logits; other calls go to the forward the
model had before (for a patched class: liger_compat's fused forward).

Failure prevented: two LM-head paths fighting over one model (liger_compat's fused linear
cross-entropy wrapped around, or replacing, trl's head) and a ``check()`` that cannot say which one
computed the loss. liger_compat lets trl's head be the only one on its path: the decoder
underneath still runs liger_compat's RMSNorm / RoPE / SwiGLU kernels (the backbone call goes
through the patched modules), and the metrics are trl's own, identical to a run without
liger_compat. This shim wraps both installers wherever a trl module imported them, and reports
each model a trl head was installed on (``REGISTRY.report_conflict`` and this shim's reason).
"""

from __future__ import annotations

from typing import Any

from ._patching import PatchSet
from ._registry import REGISTRY
from ._submodule_hooks import SubmoduleShim
from . import trl_trainer_locations as locations


SHIM_ID = "trl.fused_lm_head"
#: models trl's head was installed on, as the report names them
heads: list[str] = []


def _trl_version() -> str:
    from ..compat import versions

    return versions.installed("trl").raw or "?"


def _report(model: Any, by: str, path: str) -> None:
    name = type(model).__name__
    REGISTRY.report_conflict(
        f"{name} LM head",
        f"trl {_trl_version()} {by}",
        f"trl's chunked head computes the loss and metrics for {path}; liger_compat's fused linear "
        "cross-entropy stays off that path, its RMSNorm / RoPE / SwiGLU kernels still run inside the decoder",
    )
    entry = f"trl's {by} head on {name}"
    if entry not in heads:
        heads.append(entry)


def _wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    outputs = kwargs.get("outputs", ("log_probs",))
    _report(args[0] if args else kwargs.get("model"), "add_fused_lm_head",
            f"fused_lm_head=True calls (outputs {', '.join(outputs)})")
    return result


def _chunked_nll_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    _report(args[0] if args else kwargs.get("model"), "SFT loss_type='chunked_nll'", "every SFT forward with labels")
    return result


class _HeadShim(SubmoduleShim):
    def status(self) -> dict[str, Any]:
        st = super().status()
        if heads and st["state"] == "applied":
            st["reason"] = "in use: " + "; ".join(heads) + " (liger_compat layer kernels inside the decoder)"
        return st


def _patch(module: Any, patches: PatchSet) -> list[str]:
    done = []
    short = module.__name__.rsplit(".", 1)[-1]
    # trl 1.6 .. 1.14: SFTConfig(loss_type="chunked_nll"), the default from 1.10, patches the forward
    if callable(getattr(module, "_patch_chunked_ce_lm_head", None)):
        patches.wrap(module, "_patch_chunked_ce_lm_head", _chunked_nll_wrapper)
        done.append(f"{short}._patch_chunked_ce_lm_head")
    if callable(getattr(module, "add_fused_lm_head", None)):
        patches.wrap(module, "add_fused_lm_head", _wrapper)
        done.append(f"{short}.add_fused_lm_head")
    return done


REGISTRY.register(_HeadShim(
    id=SHIM_ID,
    library="trl",
    trigger="trl",
    target="trl add_fused_lm_head (trl.trainer.utils and every trainer module importing it)",
    upstream="trl 1.x trainers install their own chunked fused LM head with add_fused_lm_head",
    fixes=(),
    description=__doc__.split("\n\n")[0],
    modules=("trl.trainer.utils",) + locations.all_trainer_modules(),
    patch_module=_patch,
))
