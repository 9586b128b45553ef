"""One fused ``*ForCausalLM.forward`` for every decoder family of the table, on every release.

Upstream: the ``<Family>ForCausalLM.forward`` of transformers 4.45 .. 5.x (``models/<family>/
modeling_<family>.py``), whose loss path materialises ``[B, T, V]`` logits (10+ GiB at a 128k
vocabulary). A fused forward that skips the logits has to survive what changed around it:

* trl ``DPOTrainer.concatenated_forward`` (and GRPO, KTO ...) call the model *without* labels and
  need real logits (known issue F2: a forward that assumes labels slices ``None``);
* transformers 4.47+ sends FlashAttention kwargs of padding-free batches (``cu_seq_lens_q``,
  ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``) through ``**kwargs``; forwarding them to the
  loss raised ``unexpected keyword argument 'cu_seq_lens_q'`` (F4);
* 4.49 renamed ``num_logits_to_keep`` to ``logits_to_keep`` and allowed index tensors (F3);
* 4.46 added ``num_items_in_batch`` (gradient accumulation) and later ``shift_labels`` to the loss;
* trl 0.15+ ``SFTTrainer`` logs token accuracy from ``outputs.logits`` (F1);
* transformers ``Trainer.prediction_step`` (``evaluate`` / ``predict``) calls the model with labels
  and hands every output field but the loss to ``compute_metrics`` as the predictions: with
  ``logits=None`` they were the token-accuracy scalars and a metric indexing ``[N, T, V]`` logits
  failed with ``IndexError``.

The wrapper (a plain function on the class that ``torch.compile`` traces, ``_patching.traceable_wrapper``;
``inspect.signature`` still shows the native one):

* ``labels is None``: the native forward runs with ``logits_to_keep`` renamed to what it knows;
  when it cannot honour the request (an index tensor on 4.45 .. 4.48, Granite 4.45 knowing
  neither name) the decoder and head below run instead. Real logits come back.
* labels given outside training (``model.training`` False: ``Trainer.evaluate`` / ``predict``, any
  ``model.eval()`` caller): the same as without labels, so the native forward returns the loss and
  the real logits (``logits_to_keep`` honoured) and nothing extra; where it cannot honour the keep
  request, the decoder and head below return the fused loss and the logits.
* labels given in training: ``self.model`` (the decoder) gets every kwarg except the loss's own
  (``num_items_in_batch``, ``ignore_index``, ``shift_labels``); the loss is computed from the last
  hidden states and ``lm_head.weight`` by ``liger_compat.kernels.fused_linear_cross_entropy``
  with the family's quirks (Gemma 2/3 soft-cap, Granite's logit divisor, Mixtral's router loss).
  The result is a subclass of the family's native output class (same name, native fields in
  native order, :mod:`.training_output`) with ``logits=None`` and a last field
  ``token_accuracy`` (``out.token_accuracy`` and ``out["token_accuracy"]``: 0-d fraction of
  non-ignored shifted label positions whose argmax is the label, computed inside the kernel); a
  torch pytree round trip (DDP, FSDP) rebuilds it as it rebuilds the native output.
  With ``return_dict=False`` the set fields come back as a tuple in the native order, the loss
  first and None where the logits would be (``ModelOutput.to_tuple``, and since transformers 4.51
  ``@can_return_tuple``, drop None fields: without the placeholder every later field would sit one
  position left of where the native tuple has it), no token_accuracy. In eval mode it is the
  native tuple, the loss then the logits.
* Logits together with a fused loss in training: pass ``return_logits=True`` to the forward, or set
  ``LIGER_COMPAT_RETURN_LOGITS=1`` before the import (or call ``liger_compat.configure(return_logits=True)``);
  the logits are then computed (honouring ``logits_to_keep``)
  in addition to the fused loss. A model whose Trainer subclass overrides ``compute_loss`` gets them
  too (``trainer_custom_loss_logits`` marks the instance with ``RETURN_LOGITS_ATTR``).

``logits_to_keep`` / ``num_logits_to_keep``: an int (keep the last k positions, 0 = all), a 1-D
index tensor, or (transformers 5.21 ``slice_logits_to_keep``) a 2-D integer ``(batch, k)`` tensor of
positions per sample or a bool ``(batch, seq)`` mask whose kept positions flatten to
``(num_true, vocab)`` logits, under either name and on every release (before 5.21 the native
forward cannot slice a 2-D tensor: the decoder and head below it run instead). With labels, the
labels must cover the kept positions (``(batch, k)``, or ``(num_true,)`` for a mask: shifted by one
along that flat sequence, as transformers' loss shifts them).
"""

from __future__ import annotations

import operator
import sys
from typing import Any

from .. import _config
from ..compat import conflicts, families
from ._forward_args import (NEW, OLD, ForwardParams, forward_params, is_2d, keep_positions, native_slices_2d,
                            normalize_keep, pop_keep, stable_key)
from ._module_shims import compiling, constant_result, kernels_module
from ._patching import PatchSet, ShimPatches, call_below, is_ours, signature, unwrap
from ._registry import REGISTRY, register
from .logits_to_keep import translate

from . import training_output
from . import _sharded_head as _distributed  # the fused loss inside lm_head's call (FSDP / ZeRO-3 shards)


_SHIM_ID = "transformers.fused_causal_lm_forward"
_KERNEL = "fused_linear_cross_entropy"
#: keyword arguments that belong to transformers' causal-LM loss, never to the decoder
LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")
#: keyword arguments of ours, removed before anything native sees the call
RETURN_LOGITS = "return_logits"
#: set (True) on a model instance whose trainer's own compute_loss may read the logits
#: (``trainer_custom_loss_logits``): that instance computes them besides the fused loss
RETURN_LOGITS_ATTR = "_liger_compat_return_logits"


def _want_logits(flag: Any, instance: Any) -> bool:
    if flag is not None:
        return bool(flag)
    return _config.return_logits() or instance.__dict__.get(RETURN_LOGITS_ATTR, False)


# --------------------------------------------------------------------------------------------
# calling conventions
# --------------------------------------------------------------------------------------------

#: like :data:`._forward_args._param_cache`: by stable key and by code object, one stable key per
#: code object kept (:data:`_positional_key_of_code`)
_positional_cache: dict[Any, tuple[str, ...]] = {}
_positional_key_of_code: dict[Any, Any] = {}


def _positional_names(forward: Any) -> tuple[str, ...]:
    base = stable_key(forward)
    names = _positional_cache.get(base)
    if names is not None:
        return names
    fn = unwrap(base)
    key = getattr(fn, "__code__", fn)
    names = _positional_cache.get(key)
    if names is None:
        params = list(signature(fn).parameters.values())
        names = tuple(p.name for p in params
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self")
        _positional_cache[key] = names
    older = _positional_key_of_code.get(key)
    if older is not None and older is not base and older is not key:
        _positional_cache.pop(older, None)
    _positional_key_of_code[key] = base
    _positional_cache[base] = names
    return names


def _as_kwargs(forward: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    if not args:
        return dict(kwargs)
    names = _positional_names(forward)
    if len(args) > len(names):
        raise TypeError(f"forward() takes {len(names)} positional arguments but {len(args)} were given")
    out = dict(kwargs)
    for name, value in zip(names, args):
        if name in out:
            raise TypeError(f"forward() got multiple values for argument {name!r}")
        out[name] = value
    return out


def _native_takes(params: ForwardParams, keep: Any) -> bool:
    if isinstance(keep, int) and keep == 0:
        return True
    if params.keep == NEW or params.both:
        return True
    return params.keep == OLD and isinstance(keep, int)


def _return_dict(config: Any, flag: Any) -> bool:
    if flag is not None:
        return bool(flag)
    # what config.use_return_dict computed before transformers 5 deprecated it
    return bool(getattr(config, "return_dict", True)) and not getattr(config, "torchscript", False)


# --------------------------------------------------------------------------------------------
# the forward
# --------------------------------------------------------------------------------------------


def _usable(instance: Any, fam: families.Family | None) -> bool:
    if fam is None or not _config.kernel_enabled(_KERNEL):
        return False
    mods = getattr(instance, "_modules", None)  # nn.Module's own registry: cheaper than hasattr
    if mods is not None and "model" in mods and "lm_head" in mods:
        return True
    return hasattr(instance, "model") and hasattr(instance, "lm_head")


def _call_native(wrapped: Any, kw: dict[str, Any], params: ForwardParams, has_keep: bool, keep: Any) -> Any:
    if has_keep and (params.keep is not None or params.both):
        kw[OLD if params.keep == OLD else NEW] = keep
    elif has_keep and not (isinstance(keep, int) and keep == 0):
        kw[NEW] = keep  # the forward knows neither name: as native as it gets
    if isinstance(keep, int) and getattr(stable_key(wrapped), "_self_wrapper", None) is translate:
        # our logits_to_keep wrapper sits right under this one and would pass an int under
        # the same name: call below it (one wrapper layer less on every call). An index
        # tensor still goes through it (it selects positions for int-only forwards).
        wrapped = call_below(wrapped)
    return wrapped(**kw)


def _fused_forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    # hot path: every forward call of a patched model goes through here; the common cases
    # (no labels, or labels with a usable head) stay a few microseconds (benchmarks/overhead.py)
    kw = _as_kwargs(wrapped, args, kwargs)
    flag = kw.pop(RETURN_LOGITS, None)
    has_keep = NEW in kw or OLD in kw
    keep = normalize_keep(pop_keep(kw)) if has_keep else 0
    params = forward_params(wrapped)
    fam = families.family_of(type(instance))
    if kw.get("labels") is None or _reads_logits(instance):
        # no labels (DPO, GRPO, generate) or evaluation / prediction with labels (Trainer.evaluate hands
        # the logits to compute_metrics): what the native forward returns, loss included
        if (_native_takes(params, keep) and (not is_2d(keep) or native_slices_2d(wrapped))) or not _usable(instance, fam):
            return _call_native(wrapped, kw, params, has_keep, keep)
        return _decoder_and_head(instance, fam, kw, keep, want_logits=True, accuracy=False)
    if not _usable(instance, fam) or _compiled_small_head(instance, kw["labels"]):
        return _call_native(wrapped, kw, params, has_keep, keep)
    return _decoder_and_head(instance, fam, kw, keep, want_logits=_want_logits(flag, instance))


#: rows x vocabulary x hidden up to which a training forward traced by torch.compile keeps the native
#: head and loss, which Inductor fuses: there the fused loss's op costs the host more at run time
#: (its call, its graph's replay and copies) than its GPU time saves, and the step is host-bound (a
#: 2 x 1024-token step of a 1024-wide model with a 128k vocabulary, 2.7e11: 4.6 % slower than compiled
#: native with the op, level without it, timed step by step on an H200; the fused loss's eager CUDA
#: graphs use the same bound, ``kernels.loss.GRAPH_MAX_MACS``). Above it the op stays: the logits it
#: never holds are what a larger head's step runs out of, and its GPU time is the step's.
COMPILED_NATIVE_LOSS_MAX_MACS = 2**39


def _compiled_small_head(model: Any, labels: Any) -> bool:
    """Whether a training forward being traced by torch.compile keeps the native head and loss: at
    most :data:`COMPILED_NATIVE_LOSS_MAX_MACS` rows x vocabulary x hidden, where the fused loss would
    run a kernel (not where the torch reference would: CPU tensors, which
    ``LIGER_COMPAT_CPU_NATIVE`` already keeps native). A plain 2-D head weight only (a ZeRO-3
    partitioned weight reads as ``[0]``: the fused loss, as eagerly)."""
    if not compiling():
        return False
    shape = getattr(getattr(getattr(model, "lm_head", None), "weight", None), "shape", None)
    device = getattr(labels, "device", None)
    if shape is None or len(shape) != 2 or device is None:
        return False
    if kernels_module()._dispatch.reference_only(device):
        return False
    if labels.numel() * shape[0] * shape[1] > COMPILED_NATIVE_LOSS_MAX_MACS:
        return False
    replays = _replays_cuda_graphs
    return replays is not None and not replays()


def _replays_cuda_graphs_eager() -> bool:
    """Whether the torch.compile call tracing now replays its graphs as CUDA graphs
    (``mode="reduce-overhead"`` or ``"max-autotune"``: Inductor's ``triton.cudagraphs``): there the
    fused loss's op costs no host time a step (its launches are in the caller's graph) and it stays
    (a 2 x 1024-token step: 0.948 of compiled native's time with it, 1.014 without it). Read from
    the backend of the frame being traced (TorchDynamo's own record of it); False where that cannot
    be read. Runs eagerly while dynamo traces (:data:`_replays_cuda_graphs`)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        backend = InstructionTranslator.current_tx().output.compiler_fn
    except Exception:  # not tracing, or a dynamo that keeps it elsewhere
        return False
    for _ in range(6):  # Inductor's wrapper has the config; debug and backend wrappers keep what they wrap
        config = getattr(backend, "config", None)
        if isinstance(config, dict):
            return bool(config.get("triton.cudagraphs"))
        inner = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(backend, "compiler_fn", None)
        if inner is None or inner is backend:
            break
        backend = inner
    return False


#: :func:`_replays_cuda_graphs_eager` marked for dynamo (its answer a constant of the traced graph),
#: set when the shim first patches a family (torch is imported then; ``import liger_compat`` imports
#: no torch)
_replays_cuda_graphs: Any = None


def _mark_replays_cuda_graphs() -> None:
    global _replays_cuda_graphs
    if _replays_cuda_graphs is None:
        _replays_cuda_graphs = constant_result(_replays_cuda_graphs_eager)


def _reads_logits(model: Any) -> bool:
    """Whether a forward with labels must return the logits: outside training (``model.eval()``,
    as ``Trainer.evaluate`` / ``predict`` set it) the caller reads them; training skips them."""
    return not getattr(model, "training", True)


def _decoder_and_head(model: Any, fam: families.Family, kw: dict[str, Any], keep: Any, *, want_logits: bool,
                      accuracy: bool = True) -> Any:
    config = model.config
    labels = kw.pop("labels", None)
    return_dict = _return_dict(config, kw.pop("return_dict", None))
    loss_kw = {k: kw.pop(k) for k in LOSS_KWARGS if k in kw}
    if "shift_labels" in loss_kw and not _native_loss_reads_shift_labels():
        _drop_shift_labels(model, loss_kw)
    decoder = model.model
    # the class's function, not a bound method (whose __func__ torch.compile does not look through)
    dec_names = forward_params(type(decoder).forward).names
    output_router_logits = False
    if fam.moe:
        output_router_logits = kw.get("output_router_logits")
        if output_router_logits is None:
            output_router_logits = bool(getattr(_text_config(config), "output_router_logits", False))
        kw["output_router_logits"] = output_router_logits
    if "return_dict" in dec_names:
        kw["return_dict"] = True
    # everything that is not the loss's goes to the decoder (attention kwargs of packed batches
    # included); a decoder that does not take a kwarg raises, as the native forward would
    dec_out = decoder(**kw)
    hidden = getattr(dec_out, "last_hidden_state", None)  # a ModelOutput's [0] builds its whole tuple
    if hidden is None:
        hidden = dec_out[0]
    hidden = keep_positions(hidden, keep)

    loss = token_accuracy = logits = None
    if labels is not None:
        loss, token_accuracy = _loss(model, fam, hidden, labels, loss_kw)
    if want_logits or labels is None:
        logits = _logits(model, fam, hidden)

    aux_loss = None
    if fam.moe and output_router_logits:
        router_logits = getattr(dec_out, "router_logits", None)
        balance = getattr(sys.modules.get(fam.module), "load_balancing_loss_func", None)
        if router_logits is not None and balance is not None:
            text = _text_config(config)
            aux_loss = balance(
                router_logits,
                _first_attr((model, "num_experts"), (text, "num_experts"), (text, "num_local_experts")),
                _first_attr((model, "num_experts_per_tok"), (text, "num_experts_per_tok")),
                kw.get("attention_mask"),
            )
            if loss is not None:
                coef = _first_attr((model, "router_aux_loss_coef"), (text, "router_aux_loss_coef")) or 0.0
                loss = loss + coef * aux_loss.to(loss.device)

    fields = dict(loss=loss, logits=logits)
    if fam.moe:
        fields["aux_loss"] = aux_loss
    cls, names = _output_class(fam)
    for name in names:  # everything else the decoder returned under the output's field names
        if name not in fields:
            fields[name] = getattr(dec_out, name, None)
    if not return_dict:
        return _as_tuple(cls(**fields))
    if token_accuracy is not None and accuracy:
        # the native class plus a token_accuracy field: survives a pytree round trip (DDP) as native's does
        return training_output.training_class(cls)(**fields, token_accuracy=token_accuracy)
    return cls(**fields)


def _as_tuple(out: Any) -> tuple:
    """``return_dict=False``: the set fields in the output class's order, as ``to_tuple`` gives
    them, except that a skipped ``logits`` keeps its place as None. ``to_tuple`` drops None fields,
    and since transformers 4.51 (``@can_return_tuple``) so does the native forward, whose logits
    are never None; without the placeholder every field after the loss would move one position
    left (``out[1]`` the cache instead of the logits)."""
    from dataclasses import fields

    items = []
    for f in fields(out):
        v = getattr(out, f.name, None)
        if v is not None or (f.name == "logits" and out.get("loss") is not None):
            items.append(v)
    return tuple(items)


def _plain_head(model: Any) -> Any:
    """The ``nn.Linear`` computing the head (unwrapped from an FSDP1 unit), or None for heads whose
    logits are not ``hidden @ weight.T + bias`` (LoRA, quantised): those get the unfused loss."""
    import torch

    head = model.lm_head
    inner = _distributed.head_module(head)
    if not isinstance(inner, torch.nn.Linear) or type(inner).forward is not torch.nn.Linear.forward:
        return None
    w = inner.weight
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        return None
    return inner


#: where ``get_text_config`` looks for a composite model's text part
_TEXT_KEYS = ("text_encoder", "decoder", "generator", "text_config")
_MISSING = object()
_MISSINGS = (_MISSING,) * 3  # the default of each attribute read, for map(dict.get, names, _MISSINGS)
#: id(config) -> (weak reference to it, its _TEXT_KEYS values, its text config)
_text_configs: dict[int, tuple[Any, tuple, Any]] = {}
#: (id(config), family) -> (weak reference, _TEXT_KEYS values, ((attribute, value), ...), quirks)
_quirks: dict[tuple[int, str], tuple[Any, tuple, tuple, tuple]] = {}


def _subconfigs(config: Any) -> tuple:
    d = getattr(config, "__dict__", None)
    return tuple(map(d.get, _TEXT_KEYS)) if d is not None else ()


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))  # identity: no config __eq__


def _remember(cache: dict, key: Any, config: Any, entry: tuple) -> None:
    """``cache[key] = (weakref(config), *entry)``, dropped with the config (nothing cached for a
    config that takes no weak reference)."""
    import weakref

    try:
        ref = weakref.ref(config, lambda _r, c=cache, k=key: c.pop(k, None))
    except TypeError:
        return
    cache[key] = (ref,) + entry


def _text_config(config: Any) -> Any:
    """The language model's config (``config.text_config`` of a vision-language model, else
    itself); looked up again whenever one of the config's text parts is replaced."""
    if compiling():  # traced: the config's reads become guards; a cache filled while tracing would not
        return _lookup_text_config(config)
    hit = _text_configs.get(id(config))
    if hit is not None and hit[0]() is config and _same(hit[1], _subconfigs(config)):
        return config if hit[2] is None else hit[2]
    text = _lookup_text_config(config)
    # the config itself is not stored (None): the entry must not keep it alive
    _remember(_text_configs, id(config), config, (_subconfigs(config), None if text is config else text))
    return text


def _lookup_text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    if get is not None:
        try:
            return get()
        except TypeError:  # pragma: no cover - older signature
            pass
    return getattr(config, "text_config", config)


def _first_attr(*pairs: tuple[Any, str]) -> Any:
    for obj, name in pairs:
        v = getattr(obj, name, None)
        if v is not None:
            return v
    return None


def _final_logit_quirks(model: Any, fam: families.Family) -> tuple[float | None, float | None]:
    """``(softcap, divisor)``: final logits = softcap * tanh(h W^T / divisor / softcap). A family's
    multiplier m is returned as the divisor 1 / m (logits are ``lm_head(h) * m`` natively).

    Cached per config object and family, and read again when the config's text parts or any of
    the attributes read change (they are compared as stored in the config's ``__dict__``; a
    config whose attribute is a property is read every time)."""
    config = model.config
    if compiling():  # as in _text_config
        return _read_quirks(_text_config(config), fam)
    key = (id(config), fam.name)
    hit = _quirks.get(key)
    if hit is not None and hit[0]() is config and _same(hit[1], _subconfigs(config)):
        names, values = hit[2]
        if tuple(map(_text_config(config).__dict__.get, names, _MISSINGS)) == values:
            return hit[3]
    cfg = _text_config(config)
    result = _read_quirks(cfg, fam)
    names = [a for a in (fam.softcap_attr, fam.logit_divisor_attr, fam.logit_multiplier_attr) if a]
    names = [getattr(type(cfg), "attribute_map", {}).get(a, a) for a in names]
    stored = getattr(cfg, "__dict__", None)
    if stored is not None and not any(isinstance(getattr(type(cfg), a, None), property) for a in names):
        names = tuple(names)
        _remember(_quirks, key, config, (_subconfigs(config), (names, tuple(map(stored.get, names, _MISSINGS))),
                                         result))
    return result


def _read_quirks(cfg: Any, fam: families.Family) -> tuple[float | None, float | None]:
    softcap = getattr(cfg, fam.softcap_attr, None) if fam.softcap_attr else None
    divisor = getattr(cfg, fam.logit_divisor_attr, None) if fam.logit_divisor_attr else None
    if fam.logit_multiplier_attr:
        mult = getattr(cfg, fam.logit_multiplier_attr, None)
        if mult is not None and mult != 1:
            divisor = (1.0 if divisor is None else divisor) / mult
    return softcap, divisor


def _logits(model: Any, fam: families.Family, hidden: Any) -> Any:
    import torch

    logits = model.lm_head(hidden)
    softcap, divisor = _final_logit_quirks(model, fam)
    if divisor is not None:
        logits = logits / divisor
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


_output_classes: dict[str, tuple[Any, tuple[str, ...]]] = {}


def _annotated_output(mod: Any, fam: families.Family) -> Any:
    """The ``ModelOutput`` class in the return annotation of the native forward (``tuple |
    Gemma4CausalLMOutputWithPast``; a string under postponed annotations), or None."""
    import dataclasses
    import re
    import typing

    head = getattr(mod, fam.causal_lm, None) if mod is not None else None
    fwd = vars(head).get("forward") if head is not None else None
    if fwd is None:
        return None
    try:
        ann = signature(fwd).return_annotation
    except (TypeError, ValueError):
        return None
    if isinstance(ann, str):
        found = [getattr(mod, n, None) or getattr(_outputs_module(), n, None)
                 for n in re.findall(r"\w*OutputWithPast\w*", ann)]
    else:
        found = list(typing.get_args(ann)) or [ann]
    # a MoE forward must return a class with aux_loss: transformers 4.48.0 annotates Mixtral's
    # forward with CausalLMOutputWithPast (copied from Llama) while it returns MoeCausalLMOutputWithPast
    need = {"loss", "aux_loss"} if fam.moe else {"loss"}
    for c in found:
        if isinstance(c, type) and dataclasses.is_dataclass(c) and need <= {f.name for f in dataclasses.fields(c)}:
            return c
    return None


def _output_class(fam: families.Family) -> tuple[Any, tuple[str, ...]]:
    """The output class the family's native forward returns and its field names: the modeling
    module's own ``*CausalLMOutputWithPast`` for vision-language models (it carries ``rope_deltas``,
    ``image_hidden_states`` ...), else ``(Moe)CausalLMOutputWithPast``. Cached per family."""
    hit = _output_classes.get(fam.name)
    if hit is not None:
        return hit
    import dataclasses

    mo = _outputs_module()
    mod = sys.modules.get(fam.module)
    cls = _annotated_output(mod, fam)
    if cls is None:
        cls = mo.MoeCausalLMOutputWithPast if fam.moe else mo.CausalLMOutputWithPast
    names = tuple(f.name for f in dataclasses.fields(cls))
    _output_classes[fam.name] = (cls, names)
    return cls, names


_shift_labels_read: dict[Any, bool] = {}


def _native_loss_reads_shift_labels() -> bool:
    """Whether this transformers' causal-LM loss (``loss_utils.ForCausalLMLoss``) takes
    ``shift_labels``: from 4.50 on. Before it the forward swallows the kwarg (4.46-4.49, through
    ``**kwargs`` into a loss that ignores it) or refuses it (4.45, no ``**kwargs``). Cached per loss
    function object."""
    mod = sys.modules.get("transformers.loss.loss_utils")
    fn = getattr(mod, "ForCausalLMLoss", None)
    hit = _shift_labels_read.get(fn)
    if hit is None:
        try:
            hit = fn is not None and "shift_labels" in signature(fn).parameters
        except (TypeError, ValueError):
            hit = False
        _shift_labels_read[fn] = hit
    return hit


def _drop_shift_labels(model: Any, loss_kw: dict[str, Any]) -> None:
    """``shift_labels`` where native's loss does not read it: native ignores it where its forward
    takes ``**kwargs`` (the loss is computed from ``labels``), else raises ``TypeError``."""
    if forward_params(type(model).forward).varkw:
        loss_kw.pop("shift_labels")
        return
    raise TypeError(f"{type(model).__name__}.forward() got an unexpected keyword argument 'shift_labels' "
                    f"(transformers {_tf_version()} computes the loss from labels only; shift_labels needs 4.50)")


def _tf_version() -> str:
    return getattr(sys.modules.get("transformers"), "__version__", "?")


def _targets(labels: Any, hidden: Any, loss_kw: dict[str, Any]) -> Any:
    """``shift_labels`` as given, else ``labels`` (not yet shifted: position t predicts label t + 1,
    the last position nothing), checked against the loss's positions, on ``hidden``'s device."""
    import torch

    shift_labels = loss_kw.get("shift_labels")
    for name, value in (("labels", labels), ("shift_labels", shift_labels)):
        if value is not None and not isinstance(value, torch.Tensor):
            from ..kernels.errors import NotATensorError

            raise NotATensorError(f"{name} must be a tensor of class ids, got {type(value).__name__}")
    target = labels if shift_labels is None else shift_labels
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels of shape {tuple(target.shape)} do not match the {tuple(hidden.shape[:-1])} positions "
            f"the loss is computed on (with logits_to_keep the labels must cover only the kept positions)"
        )
    return target.to(hidden.device)


def _autocast_dtype(hidden: Any) -> Any:
    """autocast's compute dtype on ``hidden``'s device, or None when autocast is off."""
    import torch

    dev = hidden.device.type
    try:
        if torch.is_autocast_enabled(dev):
            return torch.get_autocast_dtype(dev)
    except (TypeError, RuntimeError):  # older torch spellings
        if dev == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
    return None


def _loss(model: Any, fam: families.Family, hidden: Any, labels: Any, loss_kw: dict[str, Any]) -> tuple[Any, Any]:
    import torch

    ignore_index = int(loss_kw.get("ignore_index", -100))
    num_items = loss_kw.get("num_items_in_batch")
    # labels (not shift_labels) go to the fused loss unshifted: it shifts them itself, inside its
    # CUDA graph where one replays (a small step's host launches the shift's ops no more)
    from_labels = loss_kw.get("shift_labels") is None
    target = _targets(labels, hidden, loss_kw)
    unfused = _native_head_loss(model, hidden, target)
    if not unfused:
        softcap, divisor = _final_logit_quirks(model, fam)
        inner = _plain_head(model)
        unfused = inner is None or (divisor is not None and inner.bias is not None)
    if unfused:
        if from_labels:
            target = torch.nn.functional.pad(target, (0, 1), value=ignore_index)[..., 1:]
        return _unfused_loss(model, fam, hidden, target, ignore_index, num_items)
    # a sequence's first label is no position's target (native never reads it)
    _check_labels(model, target[..., 1:] if from_labels else target, "labels" if from_labels else "shift_labels",
                  ignore_index)
    h = hidden
    if divisor is not None:
        h = h / divisor  # (h W^T) / d == (h / d) W^T without a bias
    # native's loss is a mean over the labelled positions: NaN (0 / 0) when there are none (every
    # label ignore_index, a sequence of one token); the kernel's mean is 0 there unless asked.
    # Gradients stay zero either way.
    opts = dict(ignore_index=ignore_index, softcap=softcap, num_items_in_batch=num_items, return_token_accuracy=True,
                shift_target=from_labels, empty_mean="nan")
    # the weight as the sharding engine (if any) gathers it, inside lm_head's own call. The dtype is
    # autocast's, or else the gathered weight's: under FSDP2 mixed precision the shard read here is
    # fp32 while the gathered weight is param_dtype (bf16, say)
    auto = _autocast_dtype(h)
    if auto is None:  # no autocast on this device: nothing to turn off (a context manager less a call)
        res = _distributed.fused_head_loss(model.lm_head, h, target, dtype=None, **opts)
    else:
        with torch.autocast(h.device.type, enabled=False):
            res = _distributed.fused_head_loss(model.lm_head, h.to(auto), target, dtype=auto, **opts)
    return res.loss, res.token_accuracy


def _check_labels(model: Any, target: Any, name: str, ignore_index: int) -> None:
    """The fused loss's checks of its targets, run first so that the error names the forward's
    argument (``labels`` or ``shift_labels``), of the classes native's ``cross_entropy`` errors are
    too: float / bool labels a ``TargetDtypeError`` (``TypeError``, ``NotImplementedError``), a label outside
    the vocabulary a ``TargetOutOfRangeError`` (``ValueError``, ``IndexError``, ``RuntimeError``). The
    range check is the kernel's: where the torch reference runs (CPU tensors), elsewhere under
    ``LIGER_COMPAT_DEBUG`` only (the Triton kernels report bad labels without a host sync, naming the
    target)."""
    from ..kernels import _checks, _dispatch

    _checks.integer_target(name, target)
    vocab = getattr(model.lm_head, "out_features", None)
    if isinstance(vocab, int) and not compiling():
        _checks.target_range(name, target, vocab, ignore_index,
                             kernel_reports=not _dispatch.reference_only(target.device))


def _native_head_loss(model: Any, hidden: Any, target: Any) -> bool:
    """Whether the loss is computed as the native head computes it (:func:`_unfused_loss`: the logits
    through ``lm_head``'s own call, then ``cross_entropy``): on devices where no Triton kernel runs by
    default while ``LIGER_COMPAT_CPU_NATIVE`` is on (CPU tensors; the fused loss would run as torch
    ops there anyway, with more of them and more Python a call), for at most
    ``kernels.loss.DENSE_MAX_LOGITS`` logits; above that the chunked reference keeps them from
    existing (the fused loss function's own rule, ``kernels.loss.dense_for``). Out-of-range labels
    then fail as natively (``cross_entropy``'s own error)."""
    vocab = getattr(model.lm_head, "out_features", None)  # nn.Linear, and wrappers that forward it
    if not isinstance(vocab, int):
        return False
    from ..kernels.loss import dense_for

    return dense_for(target.numel(), vocab, hidden.device)


def _unfused_loss(model: Any, fam: families.Family, hidden: Any, target: Any, ignore_index: int, num_items: Any):
    """Loss from materialised logits, for heads the fused kernel cannot read (LoRA, quantised), and
    on CPU (:func:`_native_head_loss`)."""
    import torch

    logits = _logits(model, fam, hidden).float()
    flat, t = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    if num_items is None:
        loss = torch.nn.functional.cross_entropy(flat, t, ignore_index=ignore_index)
    else:
        loss = torch.nn.functional.cross_entropy(flat, t, ignore_index=ignore_index, reduction="sum")
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    with torch.no_grad():
        valid = t != ignore_index
        hits = (flat.argmax(-1) == t) & valid
        accuracy = hits.sum().float() / valid.sum().clamp(min=1).float()
    return loss, accuracy


# --------------------------------------------------------------------------------------------
# patching
# --------------------------------------------------------------------------------------------

#: family name -> why its forward was left native (conflict, missing class)
_left_alone: dict[str, str] = {}


def _outputs_module() -> Any:
    """``transformers.modeling_outputs``, imported once outside any traced call: an import
    statement on ``transformers`` (a ``_LazyModule``) inside the forward makes torch.compile 2.11
    stop with ``Unsupported: Bad import result``."""
    global _modeling_outputs
    if _modeling_outputs is None:
        import transformers.modeling_outputs

        _modeling_outputs = sys.modules["transformers.modeling_outputs"]
    return _modeling_outputs


_modeling_outputs: Any = None


def _patch_module(module: Any, patches: ShimPatches) -> list[str]:
    done = []
    for fam in families.ALL_BY_MODULE.get(module.__name__, ()):
        if _patch_family(module, fam, patches):
            done.append(f"{fam.causal_lm}.forward")
    return done


def _patch_family(module: Any, fam: families.Family, patches: ShimPatches) -> bool:
    _outputs_module()  # while not tracing
    _mark_replays_cuda_graphs()
    cls = getattr(module, fam.causal_lm, None)
    if cls is None:
        _left_alone[fam.name] = f"{module.__name__} has no {fam.causal_lm}"
        return False
    if fam.why_native():
        _left_alone[fam.name] = fam.why_native()
        return False
    current = vars(cls).get("forward")
    if current is None:
        _left_alone[fam.name] = f"{fam.causal_lm} inherits its forward"
        return False
    if is_ours(current, _fused_forward):
        return False
    owner = conflicts.foreign_owner(current)
    if owner is not None:
        _left_alone[fam.name] = f"conflict: forward already replaced by {owner}"
        REGISTRY.report_conflict(f"{fam.causal_lm}.forward", owner, f"{_SHIM_ID} left it alone")
        return False
    _left_alone.pop(fam.name, None)
    _fill_caches(module, fam, cls, current)
    training_output.training_class(_output_class(fam)[0])  # made now, not while torch.compile traces
    patches.wrap(cls, "forward", _fused_forward, traceable=True)
    return True


def _fill_caches(module: Any, fam: families.Family, cls: type, forward: Any) -> None:
    """Look up now what the hot path caches (signatures, the family of the class), so that the
    first call traced by ``torch.compile`` finds the caches as every later call will: a cache
    filled while tracing makes the second call fail its guards and compile again."""
    families.family_of(cls)
    _positional_names(forward)
    forward_params(forward)
    for obj in list(vars(module).values()):  # the decoder's class (Gemma3TextModel under Gemma3ForCausalLM ...)
        if isinstance(obj, type) and obj.__module__ == module.__name__ and "forward" in vars(obj):
            try:
                forward_params(vars(obj)["forward"])
            except (TypeError, ValueError):  # no signature to read: looked up (uncached) if ever called
                pass


def _revert() -> None:
    _left_alone.clear()


def _apply_to_model(model: Any, patches: PatchSet) -> bool:
    """Report instance-level forward replacements (liger-kernel's instance patching, unsloth)."""
    for m in _causal_lms_in(model):
        owner = conflicts.instance_override(m)
        if owner is not None:
            REGISTRY.report_conflict(f"{type(m).__name__}.forward (instance)", owner,
                                     f"{_SHIM_ID} does not run for this model instance")
    return False


def _causal_lms_in(model: Any) -> list[Any]:
    if not callable(getattr(model, "modules", None)):  # apply(model=...) with no torch module: nothing to report
        return []
    return [m for m in model.modules() if families.family_of(type(m)) is not None]


def is_fused(cls: type) -> bool:
    """Whether ``cls.forward`` is the fused forward."""
    return is_ours(vars(cls).get("forward"), _fused_forward)


def describe(fam: families.Family, module: Any) -> str:
    """``"fused forward"`` or ``"native forward (why)"`` for the report."""
    cls = getattr(module, fam.causal_lm, None)
    if cls is None:
        return f"native forward ({fam.causal_lm} missing)"
    current = vars(cls).get("forward")
    if current is not None and is_ours(current, _fused_forward):
        return "fused forward (vision-language)" if fam.vision else "fused forward"
    if fam.name in _left_alone:
        return f"native forward ({_left_alone[fam.name]})"
    owner = conflicts.foreign_owner(current) if current is not None else None
    if owner is not None:
        return f"native forward (replaced by {owner})"
    if not _config.kernel_enabled(_KERNEL):
        return f"native forward ({_KERNEL} not selected)"
    if fam.module in SHIM.module_errors:
        return f"native forward (failed: {SHIM.module_errors[fam.module]})"
    return f"native forward (shim {SHIM.state.value})"


SHIM = register(
    id=_SHIM_ID,
    library="transformers",
    trigger="transformers",
    target=", ".join(f.causal_lm for f in families.FAMILIES) + " .forward",
    upstream=("trl DPOTrainer calls the model without labels (F2); transformers 4.47+ passes FlashAttention "
              "kwargs through **kwargs (F4); 4.49 logits_to_keep rename; 4.46 num_items_in_batch"),
    fixes=("F2", "F4"),
    kernels=(_KERNEL,),
    description=__doc__.split("\n\n")[0],
    modules=families.family_modules,
    patch_module=_patch_module,
    _revert=_revert,
    apply_to_model=_apply_to_model,
)
