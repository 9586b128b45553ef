"""Who else patched a transformers model class, module or function before (or after) us.

Upstream: liger-kernel's ``apply_liger_kernel_to_<family>`` (0.3+) assigns its own ``forward``
functions and ``LigerRMSNorm`` classes into ``transformers.models.<family>.modeling_<family>``;
transformers' ``TrainingArguments(use_liger_kernel=True)`` (4.45+) calls the same functions,
class- or instance-level; unsloth replaces forwards with its own; transformers' hub kernels
(``use_kernels=True`` / ``kernels.kernelize``, 4.52+) swap the ``forward`` of module instances.

Stacking our wrapper on top of one of those would run two fused losses or two norms and make
``revert()`` ambiguous, so the model shims leave such a target alone and report the conflict
through :meth:`Registry.report_conflict <liger_compat.shims._registry.Registry.report_conflict>`.
Detection is by the module an object was defined in, never by name matching of classes.
"""

from __future__ import annotations

import types
from typing import Any

from ..shims._patching import unwrap

#: top-level package of a foreign object -> how the report names it
KNOWN_PATCHERS: dict[str, str] = {
    "liger_kernel": "liger-kernel (apply_liger_kernel_to_* or TrainingArguments.use_liger_kernel)",
    "unsloth": "unsloth",
    "unsloth_zoo": "unsloth",
    "kernels": "transformers hub kernels (use_kernels / kernelize)",
}


#: packages whose wrappers around a forward are not competing kernels (device-map hooks, adapters)
_BENIGN = frozenset({"transformers", "liger_compat", "torch", "accelerate", "peft", "functools"})


def defining_module(obj: Any) -> str:
    """The module an object (function, method, wrapper or class) was defined in."""
    inner = unwrap(obj)
    if isinstance(inner, (staticmethod, classmethod)):
        inner = inner.__func__
    if isinstance(inner, types.MethodType):
        inner = inner.__func__
    return getattr(inner, "__module__", None) or ""


def foreign_owner(obj: Any) -> str | None:
    """Who defined ``obj``, when it is neither transformers' nor ours; None otherwise."""
    mod = defining_module(obj)
    if not mod:
        return None
    top = mod.split(".", 1)[0]
    if top in _BENIGN:
        return None
    if mod.startswith("transformers_modules"):  # trust_remote_code models: their own code
        return None
    return KNOWN_PATCHERS.get(top, f"{top} (function from module {mod})")


def known_patcher(obj: Any) -> str | None:
    """Like :func:`foreign_owner`, but only for the libraries of :data:`KNOWN_PATCHERS`
    (user and remote code outside transformers is not a competing patch)."""
    mod = defining_module(obj)
    return KNOWN_PATCHERS.get(mod.split(".", 1)[0]) if mod else None


def instance_override(module: Any, name: str = "forward") -> str | None:
    """A foreign per-instance override of ``module.<name>`` (liger instance patching, kernelize)."""
    d = getattr(module, "__dict__", None)
    if not d or name not in d:
        return None
    return foreign_owner(d[name])
