"""Keyword arguments that transformers and trl renamed, translated both ways with one warning.

Upstream renames between the oldest (transformers 4.45 / trl 0.11) and newest (transformers 5.23 /
trl 1.16) releases of the grid, read from their sources:

* ``Trainer(tokenizer=)`` -> ``processing_class=``: transformers 4.46 (deprecated), 5.0 (removed);
  every trl trainer in trl 0.12 (``tokenizer`` gone at once).
* ``TrainingArguments``: ``evaluation_strategy`` -> ``eval_strategy`` (removed 4.51); ``no_cuda`` ->
  ``use_cpu``, ``per_gpu_{train,eval}_batch_size`` -> ``per_device_*``, ``push_to_hub_token`` ->
  ``hub_token``, ``include_inputs_for_metrics`` -> ``include_for_metrics=["inputs"]`` (all removed
  in 5.0); ``group_by_length`` -> ``train_sampling_strategy="group_by_length"`` (5.5);
  ``warmup_ratio`` -> a float ``warmup_steps`` below 1 (5.23; 5.0 .. 5.22 take both);
  ``gradient_checkpointing[_kwargs]`` -> ``activation_checkpointing[_kwargs]`` (5.23).
* ``SFTConfig``: ``max_seq_length`` -> ``max_length`` (trl 0.16, old name removed 0.20);
  ``use_liger`` -> ``use_liger_kernel`` (0.16, removed 0.18).
* ``DPOConfig``: ``max_target_length`` -> ``max_completion_length`` (removed 0.14);
  ``use_num_logits_to_keep`` -> ``use_logits_to_keep`` (0.15, removed 0.17).
* ``GRPOConfig``: ``wandb_log_unique_prompts`` -> ``log_unique_prompts`` (0.26/0.27);
  ``vllm_guided_decoding_regex`` -> ``vllm_structured_outputs_regex`` (0.27/0.28);
  ``vllm_max_model_len`` -> ``vllm_max_model_length`` (removed 0.18, back under the new name 0.26).
* trl 0.13 removed the SFT/DPO options that 0.9 .. 0.12 still took as trainer arguments
  (``SFTTrainer(max_seq_length=, packing=, dataset_text_field= ...)``, ``DPOTrainer(beta= ...)``):
  they are moved onto the ``args`` config when the trainer no longer takes them.

Failure prevented: ``TypeError: __init__() got an unexpected keyword argument 'tokenizer'`` (and the
like) when a script written for one release runs on another. The direction is decided per call from
the callee's own signature: a name it accepts is left alone (the library's own deprecation path
runs), a name it lacks is renamed to the spelling it has. Each translation warns once, with
:class:`RenamedKwargWarning`; a translation nested inside another (trl 0.11 passing ``tokenizer=``
on to transformers 5) is logged, not warned again.
"""

from __future__ import annotations

import contextvars
import warnings
from typing import Any, Callable, NamedTuple

from .._log import log
from ._patching import ShimPatches, signature, unwrap
from ._registry import register
from ..compat import trl_trainer_locations as locations
from ..compat.trl_trainer_locations import ARGS_BASE, TRAINER_BASE, classes_defined_in



class RenamedKwargWarning(FutureWarning):
    """A keyword argument was translated to the spelling the installed library accepts."""


class Rename(NamedTuple):
    old: str
    new: str
    #: class names (anywhere in the MRO) the rename applies to
    scope: tuple[str, ...]
    lib: str
    to_new: Callable[[Any], Any] | None = None
    to_old: Callable[[Any], Any] | None = None
    note: str = ""


def _inputs_to_list(v: Any) -> list[str]:
    return ["inputs"] if v else []


def _list_to_inputs(v: Any) -> bool:
    items = [v] if isinstance(v, str) else list(v or [])
    extra = [x for x in items if x != "inputs"]
    if extra:
        raise ValueError(f"include_for_metrics={v!r}: this transformers only knows include_inputs_for_metrics (bool); "
                         f"{extra} cannot be expressed")
    return bool(items)


def _group_to_strategy(v: Any) -> str:
    return "group_by_length" if v else "random"


def _strategy_to_group(v: Any) -> bool:
    if v in ("group_by_length", "random"):
        return v == "group_by_length"
    raise ValueError(f"train_sampling_strategy={v!r} has no equivalent in this transformers "
                     "(only group_by_length=True/False)")


_TA = ("TrainingArguments",)
RENAMES: tuple[Rename, ...] = (
    Rename("tokenizer", "processing_class", ("Trainer",), "transformers 4.46 / trl 0.12"),
    Rename("evaluation_strategy", "eval_strategy", _TA, "transformers 4.41 (old name removed 4.51)"),
    Rename("no_cuda", "use_cpu", _TA, "transformers 4.34 (old name removed 5.0)"),
    Rename("per_gpu_train_batch_size", "per_device_train_batch_size", _TA, "transformers (old name removed 5.0)"),
    Rename("per_gpu_eval_batch_size", "per_device_eval_batch_size", _TA, "transformers (old name removed 5.0)"),
    Rename("push_to_hub_token", "hub_token", _TA, "transformers (old name removed 5.0)"),
    Rename("include_inputs_for_metrics", "include_for_metrics", _TA, "transformers 4.46 (old name removed 5.0)",
           _inputs_to_list, _list_to_inputs),
    Rename("group_by_length", "train_sampling_strategy", _TA, "transformers 5.5",
           _group_to_strategy, _strategy_to_group),
    Rename("gradient_checkpointing", "activation_checkpointing", _TA, "transformers 5.23"),
    Rename("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs", _TA, "transformers 5.23"),
    Rename("max_seq_length", "max_length", ("SFTConfig",), "trl 0.16 (old name removed 0.20)"),
    Rename("use_liger", "use_liger_kernel", ("SFTConfig",), "trl 0.16 (old name removed 0.18)"),
    Rename("max_target_length", "max_completion_length", ("DPOConfig",), "trl (old name removed 0.14)"),
    Rename("use_num_logits_to_keep", "use_logits_to_keep", ("DPOConfig",), "trl 0.15 (old name removed 0.17)"),
    Rename("wandb_log_unique_prompts", "log_unique_prompts", ("GRPOConfig",), "trl 0.26 (old name removed 0.27)"),
    Rename("vllm_guided_decoding_regex", "vllm_structured_outputs_regex", ("GRPOConfig",),
           "trl 0.27 (old name removed 0.28)"),
    Rename("vllm_max_model_len", "vllm_max_model_length", ("GRPOConfig",), "trl 0.26"),
)

#: trainer options that trl 0.13 moved onto the config (still trainer arguments in 0.11 / 0.12)
MOVED_TO_CONFIG: dict[str, tuple[str, ...]] = {
    "SFTTrainer": ("max_seq_length", "dataset_text_field", "packing", "dataset_num_proc", "dataset_batch_size",
                   "dataset_kwargs", "eval_packing", "num_of_sequences", "chars_per_token", "neftune_noise_alpha",
                   "model_init_kwargs", "infinite"),
    "DPOTrainer": ("beta", "label_smoothing", "loss_type", "label_pad_token_id", "padding_value", "truncation_mode",
                   "max_length", "max_prompt_length", "max_target_length", "is_encoder_decoder", "disable_dropout",
                   "generate_during_eval", "precompute_ref_log_probs", "dataset_num_proc", "model_init_kwargs",
                   "ref_model_init_kwargs", "model_adapter_name", "ref_adapter_name", "reference_free",
                   "force_use_ref_model"),
}

#: set while a call whose arguments were translated runs: translations inside it are the library's own
_outer_translated: contextvars.ContextVar[bool] = contextvars.ContextVar("liger_compat_outer_translated", default=False)
_params_cache: dict[Any, frozenset[str] | None] = {}


def accepted_params(func: Any) -> frozenset[str] | None:
    """Keyword names ``func`` accepts; None when it takes ``**kwargs`` (anything goes)."""
    inner = unwrap(func)
    key = getattr(inner, "__code__", inner)
    if key in _params_cache:
        return _params_cache[key]
    try:
        params = signature(inner).parameters.values()
    except (TypeError, ValueError):
        result = None
    else:
        if any(p.kind is p.VAR_KEYWORD for p in params):
            result = None
        else:
            result = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    _params_cache[key] = result
    return result


def _in_scope(cls: type, scope: tuple[str, ...]) -> bool:
    return any(k.__name__ in scope for k in cls.__mro__)


def _int_typed(cls: type, name: str) -> bool:
    import dataclasses  # loaded with the trainer classes by now; not at `import liger_compat`

    for f in dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ():
        if f.name == name:
            return f.type in (int, "int")
    return False


def translate(cls: type, func: Any, args: tuple, kwargs: dict[str, Any],
              notes: list[str] | None = None) -> dict[str, Any]:
    """The keyword arguments for ``cls.__init__`` (``func``) with renamed names translated.

    A message per translation is appended to ``notes``.
    """
    notes = [] if notes is None else notes
    _warn = notes.append
    params = accepted_params(func)
    if params is None:
        return kwargs  # takes **kwargs: an inner __init__ decides
    inner = unwrap(func)
    lib = (getattr(inner, "__module__", "") or "the library").split(".")[0]
    # the class whose __init__ is called (a trl trainer calling Trainer.__init__ is named Trainer)
    owner = (getattr(inner, "__qualname__", "") or "").rsplit(".", 1)[0] or cls.__name__
    if "<locals>" in owner:
        owner = cls.__name__
    out = kwargs
    for r in RENAMES:
        if not _in_scope(cls, r.scope):
            continue
        for src, dst, conv in ((r.old, r.new, r.to_new), (r.new, r.old, r.to_old)):
            if src in out and src not in params and dst in params:
                if dst in out:
                    raise TypeError(f"{cls.__name__}() got both {src}= and {dst}=; this version only takes {dst}=")
                out = dict(out)
                value = out.pop(src)
                out[dst] = conv(value) if conv is not None else value
                shown = "" if conv is None else f" (value {value!r} -> {out[dst]!r})"
                _warn(f"{owner}({src}=...) is spelled {dst}= in the installed {lib} "
                      f"(renamed in {r.lib}); passed it as {dst}={shown}")
    # transformers 5.23 dropped warmup_ratio for a float warmup_steps; before 5.0 warmup_steps is an int
    if _in_scope(cls, _TA):
        ws = out.get("warmup_steps")
        if ("warmup_ratio" in out and "warmup_ratio" not in params and "warmup_steps" in params
                and "warmup_steps" not in out):
            out = dict(out)
            out["warmup_steps"] = out.pop("warmup_ratio")
            _warn(f"{cls.__name__}(warmup_ratio=...) is gone from the installed transformers; passed it as "
                  f"warmup_steps={out['warmup_steps']!r} (a float below 1 is a ratio there)")
        elif (isinstance(ws, float) and 0 < ws < 1 and "warmup_ratio" in params and "warmup_ratio" not in out
              and _int_typed(cls, "warmup_steps")):
            out = dict(out)
            out["warmup_ratio"] = out.pop("warmup_steps")
            _warn(f"{cls.__name__}(warmup_steps={ws!r}) is a ratio only in transformers >= 5.0; "
                  f"passed it as warmup_ratio={ws!r}")
    # options trl 0.13 moved from the trainer onto its config
    moved = next((MOVED_TO_CONFIG[k.__name__] for k in cls.__mro__ if k.__name__ in MOVED_TO_CONFIG), ())
    stray = [k for k in moved if k in out and k not in params]
    if stray:
        import dataclasses

        cfg = out.get("args", args[1] if len(args) > 1 else None)
        if cfg is not None and dataclasses.is_dataclass(cfg):
            out = dict(out)
            for name in stray:
                value = out.pop(name)
                target = name
                if not hasattr(cfg, target):
                    for r in RENAMES:
                        if r.old == name and hasattr(cfg, r.new):
                            target = r.new
                if not hasattr(cfg, target):
                    raise TypeError(f"{cls.__name__}() got {name}=, which neither the trainer nor "
                                    f"{type(cfg).__name__} takes in this trl")
                setattr(cfg, target, value)
                _warn(f"{cls.__name__}({name}=...) is an option of {type(cfg).__name__} in the installed trl; "
                      f"set args.{target} instead")
    return out


def init_middleware(call_next: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """Translate the keyword arguments of a trainer / config construction (see the module docstring)."""
    if instance is None or not kwargs:
        return call_next(args, kwargs)
    notes: list[str] = []
    # judge by the signature of the __init__ the class defines
    kwargs = translate(type(instance), wrapped, args, kwargs, notes)
    if not notes:
        return call_next(args, kwargs)
    for msg in notes:
        if _outer_translated.get():
            log.info("liger_compat: %s", msg)
        else:
            # stack: warn <- here <- chain step <- chain wrapper <- the caller's line
            warnings.warn(f"liger_compat: {msg}", RenamedKwargWarning, stacklevel=4)
    token = _outer_translated.set(True)
    try:
        return call_next(args, kwargs)
    finally:
        _outer_translated.reset(token)


def _init_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The middleware as a plain wrapt wrapper (for classes patched outside a shim, as in the tests)."""
    return init_middleware(lambda a, k: wrapped(*a, **k), wrapped, instance, args, kwargs)


def _wrap_inits(module: Any, patches: ShimPatches) -> list[str]:
    done = []
    for cls in classes_defined_in(module, ARGS_BASE, TRAINER_BASE):
        if "__init__" in cls.__dict__:
            patches.middleware(cls, "__init__", init_middleware)
            done.append(f"{cls.__name__}.__init__")
    return done


register(
    id="transformers.renamed_kwargs",
    library="transformers",
    trigger="transformers",
    target="Trainer.__init__, TrainingArguments.__init__ (and Seq2Seq variants)",
    upstream="transformers 4.46 tokenizer -> processing_class; 4.51 / 5.0 / 5.5 / 5.23 removed renamed TrainingArguments",
    fixes=("F5",),
    description=__doc__.split("\n\n")[0],
    modules=("transformers.training_args", "transformers.trainer",
             "transformers.training_args_seq2seq", "transformers.trainer_seq2seq"),
    patch_module=_wrap_inits,
)

register(
    id="trl.renamed_kwargs",
    library="trl",
    trigger="trl",
    target="__init__ of every trl trainer and config (trl.trainer and trl.experimental)",
    upstream="trl 0.12 tokenizer -> processing_class; 0.13 trainer options moved to configs; "
             "0.16 .. 0.28 SFT/DPO/GRPO config renames",
    fixes=("F5",),
    description=__doc__.split("\n\n")[0],
    modules=locations.all_trainer_modules() + locations.all_config_modules(),
    patch_module=_wrap_inits,
)
