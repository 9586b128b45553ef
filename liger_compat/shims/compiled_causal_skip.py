"""Flash attention inside ``torch.compile``: the causal mask skipped when no padding mask exists.

Upstream: transformers 4.53 ``masking_utils._ignore_causal_mask_sdpa`` (the check that lets SDPA run
with ``is_causal=True`` and no mask tensor) returns False whenever TorchDynamo traces, even when the
caller passed no attention mask at all, so nothing data-dependent would be read. transformers 5.2x
skips again under compile when there is no padding mask, but decides "exporting or not" with
``torch.compiler.is_exporting()``, which TorchDynamo before torch 2.13 folds to True while compiling.

Failure prevented: a ``torch.compile``d model trained without a padding mask (packed or unpadded
batches, a plain ``model(input_ids, labels=...)``) gets a materialised ``[B, 1, S, S]`` causal mask,
so SDPA cannot use its flash kernel and falls back to the memory-efficient kernel with a mask: every
attention layer of the compiled training step is slower than in eager mode.

What the shim does: where upstream answered False, the answer is True when, and only when, dynamo
is compiling (not exporting: the export flag itself is read, not ``is_exporting()``), the padding
mask is None, no sliding window applies at this length, the query offset is not a traced tensor,
and the query is one token or as long as the keys (or starts at offset 0): the cases in which the
eager path of the same transformers skips the mask. Eager calls get upstream's answer unchanged.
"""

from __future__ import annotations

from typing import Any

from ._patching import PatchSet, signature
from ._registry import register

SHIM_ID = "transformers.compiled_causal_skip"
FUNCTION = "_ignore_causal_mask_sdpa"
#: parameter names across releases: 4.53-5.1x ``query_length``/``q_length``, ``kv_length``
_Q_LENGTH = ("q_length", "query_length")
_KV_LENGTH = ("kv_length", "key_value_length")


def _first(bound: dict[str, Any], names: tuple[str, ...]) -> Any:
    for name in names:
        if name in bound:
            return bound[name]
    raise KeyError(names[0])


def skip_when_compiling(bound: dict[str, Any]) -> bool:
    """Whether the causal mask can be left to SDPA's ``is_causal`` for the arguments ``bound`` (by
    name) of ``_ignore_causal_mask_sdpa`` while dynamo compiles: no padding mask, not exporting,
    no sliding window at this length, no traced query offset, a square or one-token query (or
    one starting at 0)."""
    import torch

    if bound.get("padding_mask") is not None:
        return False
    if getattr(torch.compiler, "_is_exporting_flag", False):
        return False
    q_length, kv_length = _first(bound, _Q_LENGTH), _first(bound, _KV_LENGTH)
    local = bound.get("local_attention_size")
    if local is not None and kv_length >= local:
        return False
    q_offset = bound.get("q_offset", 0)
    if isinstance(q_offset, torch.Tensor):
        return False
    return q_length == 1 or kv_length == q_length or q_offset == 0


def _wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    if result:
        return result
    import torch

    if not torch.compiler.is_compiling():
        return result
    bound = dict(zip(_names, args))
    bound.update(kwargs)
    try:
        return skip_when_compiling(bound)
    except KeyError:
        return result


#: the patched function's parameter names, read once at patch time (not while dynamo traces)
_names: tuple[str, ...] = ()


def _patch(module: Any, patches: PatchSet) -> list[str]:
    fn = getattr(module, FUNCTION, None)
    if fn is None:
        return []
    names = tuple(signature(fn).parameters)
    if "padding_mask" not in names or not any(n in names for n in _Q_LENGTH) or not any(n in names for n in _KV_LENGTH):
        raise TypeError(f"transformers.masking_utils.{FUNCTION}{tuple(names)}: not the signature this shim knows")
    global _names
    _names = names
    patches.wrap(module, FUNCTION, _wrapper, traceable=True)
    return [f"masking_utils.{FUNCTION}"]


register(
    id=SHIM_ID,
    library="transformers",
    trigger="transformers",
    target=f"masking_utils.{FUNCTION} (under torch.compile, no padding mask)",
    versions=">=4.53",
    upstream="transformers 4.53 masking_utils._ignore_causal_mask_sdpa never skips the causal mask while "
             "dynamo traces (5.2x: only with torch >= 2.13's is_exporting)",
    fixes=(),
    description=__doc__.split("\n\n")[0],
    modules=("transformers.masking_utils",),
    patch_module=_patch,
)
