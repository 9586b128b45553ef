"""What ``check()`` says of each model family: fused forward or not, which module kernels apply,
and why not, read from the model shims' own bookkeeping.

The family table (:mod:`liger_compat.compat.families`) is data both sides read; describing a
family's patch state is the shims' part, so the report asks here (:func:`family_states`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from .. import _config
from ..compat import versions
from ..compat.families import BY_MODULE, FAMILIES, Family, family_of


def family_states() -> dict[str, str]:
    """One line per family for ``check()``: what is patched, or why not.

    Reads the shims' bookkeeping and ``sys.modules``; imports nothing.
    """
    from . import causal_lm, gated_mlp, rms_norm, rope  # noqa: F401  (their registries of patched classes)

    tf = versions.installed("transformers").raw
    out: dict[str, str] = {}
    for fam in FAMILIES:
        if tf is None:
            out[fam.name] = "transformers not installed"
            continue
        if _config.settings.disabled:  # nothing patched, nothing waits for an import
            out[fam.name] = "off (liger_compat is disabled)"
            continue
        mod = sys.modules.get(fam.module)
        if mod is None:
            if importlib.util.find_spec is not None and not _module_exists(fam.module):
                out[fam.name] = f"not in transformers {tf} (added in {fam.since})"
            elif fam.why_native(tf):
                out[fam.name] = f"native forward ({fam.why_native(tf)})"
            else:
                out[fam.name] = "waiting (patched when its modeling module is imported)"
            continue
        if not hasattr(mod, fam.causal_lm):
            out[fam.name] = f"no {fam.causal_lm} in transformers {tf}"
            continue
        out[fam.name] = "; ".join(_family_parts(fam, mod))
    # other causal LMs of imported modeling modules keep their native forward
    for name, mod in list(sys.modules.items()):
        if (not name.startswith("transformers.models.") or name.startswith("transformers.models.auto.")
                or name in BY_MODULE or mod is None):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if not leaf.startswith("modeling_"):
            continue
        for cls_name, obj in list(vars(mod).items()):
            if (cls_name.endswith("ForCausalLM") and isinstance(obj, type)
                    and obj.__module__ == name and family_of(obj) is None):
                out[cls_name] = "native forward (family not in the table)"
    return out


def _module_exists(name: str) -> bool:
    """Whether module ``name`` is there, without importing anything: ``find_spec`` of a submodule
    imports its parent packages (``transformers`` itself, which would apply the shims while the
    report is being built), so a submodule of a package not imported yet is looked for as a file."""
    parent, _, _ = name.rpartition(".")
    try:
        if not parent or parent in sys.modules:
            return importlib.util.find_spec(name) is not None
        top, *rest = name.split(".")
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, *rest)
        if os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py")):
            return True
    return False


def _family_parts(fam: Family, mod: Any) -> list[str]:
    """Short enough for the report's table: ``fused forward; rms_norm, gated_mlp, rope``."""
    from . import _module_shims, causal_lm

    parts = []
    for describe in (causal_lm.describe, _module_shims.describe):
        try:
            parts.append(describe(fam, mod))
        except Exception as exc:
            parts.append(f"error {type(exc).__name__}: {exc}")
    return parts
