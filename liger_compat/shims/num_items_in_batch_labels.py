"""Gradient-accumulation token counting for batches whose labels are not under ``"labels"``.

Upstream: transformers 4.46 ``Trainer.get_batch_samples`` (and, from 4.57, ``_get_num_items_in_batch``)
counts ``num_items_in_batch`` from ``batch["labels"]`` of every micro-batch of an accumulation
window, after checking only the *first* batch for the key; unsloth's ``_unsloth_get_batch_samples``
(which it installs as ``Trainer.get_batch_samples``) and its training loop read ``batch["labels"]``
or ``batch.get`` directly. Preference batches keep their labels elsewhere (ORPO / CPO
``chosen_labels`` / ``rejected_labels``, GRPO ``completion_mask``) and GRPO's batches are lists.

Failures prevented: ``KeyError: 'labels'`` (a later micro-batch without the key, unsloth with ORPO:
unslothai/unsloth#1156), ``AttributeError: 'list' object has no attribute 'get'`` (list batches).

What the shim does: ``get_batch_samples`` is wrapped so that the batches it pulls are recorded; when
the counting inside raises one of those errors, the count is made again by
:func:`count_label_tokens`, which reads whichever label keys each batch has, and the batches are
returned as if nothing had happened. The count follows the trainer's own rule for *whether* to
count: a trainer whose loss does not consume ``num_items_in_batch`` (trl's preference trainers set
``model_accepts_loss_kwargs = False`` from trl 0.14; before, their ``compute_loss`` takes the argument
and never reads it) gets ``None``, which keeps the division of the loss by the accumulation steps
that such trainers rely on. ``Trainer.train`` makes
sure the wrapper is in front of whatever ``get_batch_samples`` is installed when training starts
(unsloth replaces the class attribute after transformers is imported).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


from .._log import log
from ._patching import PatchSet, signature, unwrap
from ._registry import register


IGNORE_INDEX = -100
#: mask keys counted when a batch has no label tensor at all (1 = a token the loss sees)
MASK_KEYS = ("completion_mask",)


def _is_tensor(x: Any) -> bool:
    return hasattr(x, "ne") and hasattr(x, "sum") and hasattr(x, "dim")


def label_keys(batch: Any) -> list[str]:
    """The keys of ``batch`` that hold label tensors, in the order they are counted."""
    if not isinstance(batch, Mapping):
        return []
    for key in ("shift_labels", "labels"):
        if _is_tensor(batch.get(key)):
            return [key]
    keys = [k for k, v in batch.items() if isinstance(k, str) and k.endswith("_labels") and _is_tensor(v)]
    if keys:
        return keys
    return [k for k in MASK_KEYS if _is_tensor(batch.get(k))]


def count_label_tokens(batch: Any, *, shift: bool = False, ignore_index: int = IGNORE_INDEX) -> Any:
    """Number of tokens the loss sees in ``batch``: non-ignored labels, whichever keys hold them.

    ``shift_labels`` (already shifted), else ``labels``, else every ``*_labels`` key (``chosen_labels``,
    ``rejected_labels`` ...), else the ``1`` entries of ``completion_mask``. ``shift=True`` drops the
    first position of (unshifted) label tensors, as a causal-LM loss does. Returns a 0-d tensor, or
    None when the batch has no labels at all (or is not a mapping).
    """
    total = None
    for key in label_keys(batch):
        t = batch[key]
        if key in MASK_KEYS:
            n = (t != 0).sum()
        else:
            if shift and key != "shift_labels":
                t = t[..., 1:]
            n = t.ne(ignore_index).sum()
        total = n if total is None else total + n
    return total


_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_FAST_LOAD_FAST", "LOAD_DEREF",
                    "LOAD_CLOSURE"})


def reads_count(compute_loss: Any) -> bool:
    """Whether the body of ``compute_loss`` reads its ``num_items_in_batch`` argument (or the ``**kwargs``
    it would arrive in). trl 0.12 / 0.13 preference trainers (ORPO, CPO, DPO, KTO) accept the argument
    and never read it, while leaving ``model_accepts_loss_kwargs`` True (trl 0.14 sets it False): a
    count handed to them is not divided by, and transformers 4.46-4.50, which then skips its own
    division by the accumulation steps, logs the loss that many times too large. Callables whose code
    cannot be read are taken to read it."""
    import dis
    import inspect

    fn = unwrap(compute_loss)
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return True
    try:
        params = signature(fn).parameters
    except (TypeError, ValueError):
        return True
    names = {"num_items_in_batch"} & set(params)
    names |= {p.name for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD}
    if not names:
        return False
    if names & set(code.co_cellvars):  # read by a nested function
        return True
    for ins in dis.get_instructions(code):
        if ins.opname in _LOADS:
            arg = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
            if names.intersection(arg):
                return True
    return False


def trainer_consumes_count(trainer: Any) -> bool:
    """Whether ``trainer``'s loss uses ``num_items_in_batch``: a ``compute_loss_func``, or the rule
    transformers 4.51+ applies (``model_accepts_loss_kwargs``) for a ``compute_loss`` that reads it."""
    if getattr(trainer, "compute_loss_func", None) is not None:
        return True
    if not bool(getattr(trainer, "model_accepts_loss_kwargs", True)):
        return False
    compute_loss = getattr(type(trainer), "compute_loss", None)
    return compute_loss is None or reads_count(compute_loss)


class _RecordingIterator:
    """Passes an epoch iterator through, remembering what it yielded."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.batches: list[Any] = []

    def __iter__(self) -> "_RecordingIterator":
        return self

    def __next__(self) -> Any:
        item = next(self._inner)
        self.batches.append(item)
        return item

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _is_label_error(exc: BaseException, batches: list[Any]) -> bool:
    if isinstance(exc, KeyError):
        return bool(exc.args) and exc.args[0] in ("labels", "shift_labels")
    if isinstance(exc, (AttributeError, TypeError)):
        # `.get` / `["labels"]` on a list batch, or a batch without the key read as None
        return any(not isinstance(b, Mapping) or "labels" not in b for b in batches)
    return False


def recount(trainer: Any, batches: list[Any], device: Any = None) -> Any:
    """``num_items_in_batch`` for ``batches`` the way the trainer would use it (None: not used)."""
    if not trainer_consumes_count(trainer):
        return None
    shift = bool(getattr(trainer, "_loss_shifts_labels", False))
    counts = [c for c in (count_label_tokens(b, shift=shift) for b in batches) if c is not None]
    if not counts:
        return None
    total = sum(counts[1:], counts[0])
    args = getattr(trainer, "args", None)
    if args is not None and getattr(args, "average_tokens_across_devices", False) and getattr(args, "world_size", 1) > 1:
        total = trainer.accelerator.gather(total.to(device or total.device)).sum()
    if device is not None:
        return total.to(device)
    return int(total.item())


def _get_batch_samples_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    args = list(args)
    if args:
        inner = args[0]
        rec = args[0] = _RecordingIterator(inner)
    elif "epoch_iterator" in kwargs:
        rec = kwargs["epoch_iterator"] = _RecordingIterator(kwargs["epoch_iterator"])
    else:
        return wrapped(*args, **kwargs)
    device = args[2] if len(args) > 2 else kwargs.get("device")
    try:
        return wrapped(*args, **kwargs)
    except (KeyError, AttributeError, TypeError) as exc:
        if not rec.batches or not _is_label_error(exc, rec.batches):
            raise
        count = recount(instance, rec.batches, device)
        log.info("liger_compat: %s.get_batch_samples raised %s: %s; counted the labels of %d batches again: %s",
                 type(instance).__name__, type(exc).__name__, exc, len(rec.batches), count)
        return rec.batches, count


def _is_ours(fn: Any) -> bool:
    import wrapt

    while isinstance(fn, wrapt.FunctionWrapper):
        if getattr(fn, "_self_wrapper", None) is _get_batch_samples_wrapper:
            return True
        fn = fn.__wrapped__
    return False


def _train_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    if instance is None or "get_batch_samples" in vars(instance):
        return wrapped(*args, **kwargs)
    current = None
    for klass in type(instance).__mro__:
        if "get_batch_samples" in klass.__dict__:
            current = klass.__dict__["get_batch_samples"]
            break
    if current is None or _is_ours(current) or _takes_model_and_batch(current):
        return wrapped(*args, **kwargs)
    # someone (unsloth) replaced get_batch_samples after we wrapped it: wrap theirs for this run
    import wrapt

    bound = wrapt.FunctionWrapper(current, _get_batch_samples_wrapper).__get__(instance, type(instance))
    instance.__dict__["get_batch_samples"] = bound
    try:
        return wrapped(*args, **kwargs)
    finally:
        instance.__dict__.pop("get_batch_samples", None)


def _takes_model_and_batch(fn: Any) -> bool:
    """trl < 0.12 trainers define an unrelated ``get_batch_samples(model, batch)`` (generation)."""
    try:
        names = list(signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return names[1:3] == ["model", "batch"]


def _patch_trainer_module(module: Any, patches: PatchSet) -> list[str]:
    trainer = getattr(module, "Trainer", None)
    if trainer is None or "get_batch_samples" not in trainer.__dict__:
        return []  # transformers < 4.46 counts nothing
    patches.wrap(trainer, "get_batch_samples", _get_batch_samples_wrapper)
    patches.wrap(trainer, "train", _train_wrapper)
    return ["Trainer.get_batch_samples", "Trainer.train"]


register(
    id="transformers.num_items_in_batch_labels",
    library="transformers",
    trigger="transformers",
    target="Trainer.get_batch_samples (and whatever replaces it when training starts)",
    versions=">=4.46",
    upstream="transformers 4.46 Trainer.get_batch_samples counts batch['labels'] for gradient accumulation; "
             "unsloth's replacement reads batch['labels'] / batch.get",
    fixes=("F5",),
    description=__doc__.split("\n\n")[0],
    modules=("transformers.trainer",),
    patch_module=_patch_trainer_module,
)
