"""Shims: one small module per upstream change liger_compat adapts to.

Every module listed in :data:`SHIM_MODULES` registers its shims on import. Shim modules
must stay cheap to import (no torch / transformers / trl at module level): importing
``liger_compat`` imports them all so that ``check()`` can list every shim, and the actual
patching happens in post-import hooks when the target library is imported.
"""

from __future__ import annotations

import importlib

from .._log import log
from ._registry import REGISTRY, Shim, State, register  # noqa: F401

#: shim modules, imported in this order
SHIM_MODULES: tuple[str, ...] = (
    "logits_to_keep",  # F3: logits_to_keep <-> num_logits_to_keep on every *ForCausalLM
    "causal_lm",  # F2, F4 (+ token accuracy for F1): the fused causal-LM forward of the families
    "rms_norm",  # RMSNorm of the families
    "gated_mlp",  # SwiGLU / GeGLU MLPs of the families
    "rope",  # apply_rotary_pos_emb of the families
    "compiled_causal_skip",  # flash attention under torch.compile when there is no padding mask
    "renamed_kwargs",  # F5: tokenizer <-> processing_class and other renamed trainer / config kwargs
    "num_items_in_batch_labels",  # F5: gradient-accumulation token count from whichever label keys a batch has
    "trl_sft_token_accuracy",  # F1: SFTTrainer token accuracy / entropy from the fused forward, not logits
    "trainer_custom_loss_logits",  # logits in training for a Trainer subclass with its own compute_loss
    "trainer_liger_switch",  # use_liger_kernel / use_liger turned off while liger_compat applies its kernels
    "trl_fused_lm_head",  # trl 1.15+ add_fused_lm_head: trl's head scored by our fused log-prob kernel
    "trl_trainer_signatures",  # trl < 0.13 trainers called with compute_loss / log / get_batch_samples of 4.46+
)

_loaded = False


def load_all() -> None:
    """Import every shim module once. A module that fails to import is logged, never raised."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name in SHIM_MODULES:
        try:
            importlib.import_module(f"{__name__}.{name}")
        except Exception as exc:  # a broken shim module must not break `import liger_compat`
            log.warning("liger_compat: shim module %s not loaded: %s", name, exc)
            REGISTRY.load_errors.append(f"liger_compat.shims.{name}: {type(exc).__name__}: {exc}")
