"""The output class of a fused training forward: the native ``*CausalLMOutputWithPast`` plus ``token_accuracy``.

Upstream: transformers registers every ``ModelOutput`` subclass as a torch pytree node
(``ModelOutput.__init_subclass__``), whose unflatten rebuilds the output as ``cls(**dict(keys, values))``.
``DistributedDataParallel`` (``find_unused_parameters=True``, the ``transformers.Trainer`` default without
gradient checkpointing, or ``static_graph=True``) and other wrappers that pass outputs through torch's
pytree flatten and rebuild a forward's output that way.

Failure prevented: a fused output carrying ``token_accuracy`` as an extra key of the native class came back
from such a round trip as ``TypeError: CausalLMOutputWithPast.__init__() got an unexpected keyword argument
'token_accuracy'``, on the first DDP step.

What this module does: for each native output class it makes, once, a dataclass subclass with the same
``__name__``, the native fields in the native order and ``token_accuracy`` (default None) last.
``isinstance(out, NativeClass)`` holds; the class is a pytree node (transformers registers it on
creation; on a release that does not, it is registered here) under a serialized type name of its own;
pickle and deepcopy rebuild it from the native class (:func:`_rebuild`), and the class itself is found
by module and qualified name (this module's ``__getattr__``), also in a process that has not made it yet.

``out.logits`` stays None when the loss skipped the logits (trl and others check ``is None``), but the
first read of it outside a ``transformers.Trainer`` training step (a custom loop indexing
``out.logits[...]`` gets ``TypeError: 'NoneType' object is not subscriptable`` right after) warns once
with :class:`LogitsSkippedWarning`, naming ``return_logits=True`` / ``LIGER_COMPAT_RETURN_LOGITS=1`` /
``liger_compat.configure(return_logits=True)``. Trainers are handled by the trainer shims instead.
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Any, Optional

from .. import _config

#: the extra field of a fused training output
FIELD = "token_accuracy"


class LogitsSkippedWarning(UserWarning):
    """``logits`` of a fused training output was read: it is None (the fused loss skips the logits)."""


#: how many ``transformers.Trainer`` training steps are running (the trainer shims count them); a
#: training output read there is read by a trainer whose needs the shims know
trainer_steps = 0
_hinted = False

HINT = ("liger_compat: logits of this training output is None: with labels in training mode the fused loss "
        "computes the loss without the [batch, seq, vocab] logits. To get them as well, pass return_logits=True "
        "to the forward, set LIGER_COMPAT_RETURN_LOGITS=1 before the import, or call "
        "liger_compat.configure(return_logits=True). (Shown once.)")


def _get_logits(self: Any) -> Any:
    value = self.__dict__.get("logits")
    if _config.compiling():  # a traced read (transformers < 4.46's __post_init__ reads every field) must
        return value  # not guard on the hint's flag, which an eager read flips afterwards
    # token_accuracy (the last field, never None here) is a key only once construction is over:
    # ModelOutput.__post_init__ reads every field while it fills the keys
    if value is None and not _hinted and not trainer_steps and dict.__contains__(self, FIELD):
        _hint()
    return value


def _set_logits(self: Any, value: Any) -> None:
    self.__dict__["logits"] = value


def _hint() -> None:
    global _hinted
    _hinted = True
    warnings.warn(HINT, LogitsSkippedWarning, stacklevel=3)


_lock = threading.Lock()
_by_native: dict[type, type] = {}
_by_qualname: dict[str, type] = {}


def training_class(native: type) -> type:
    """The subclass of ``native`` (a dataclass ``ModelOutput``) with a ``token_accuracy`` field last."""
    cls = _by_native.get(native)
    if cls is not None:
        return cls
    with _lock:
        cls = _by_native.get(native)
        if cls is None:
            cls = _make(native)
            _by_native[native] = cls
            _by_qualname[cls.__qualname__] = cls
    return cls


def _qualname_for(native: type) -> str:
    name = native.__name__
    other = _by_qualname.get(name)
    if other is None or other.__mro__[1] is native:
        return name
    # another native class of the same name (another modeling module) already took it
    return f"{name}__{native.__module__.replace('.', '__')}"


def _make(native: type) -> type:
    import dataclasses

    if not dataclasses.is_dataclass(native):
        raise TypeError(f"{native.__module__}.{native.__qualname__} is not a dataclass ModelOutput")
    if FIELD in {f.name for f in dataclasses.fields(native)}:
        return native  # a native class that already has the field (none known today)
    qualname = _qualname_for(native)
    import torch

    ns = {
        "__module__": __name__,
        "__qualname__": qualname,
        "__doc__": native.__doc__,
        "__annotations__": {FIELD: Optional[torch.FloatTensor]},
        FIELD: None,
        "__reduce__": _reduce,
        # reads like the field (None when skipped); the first read outside a trainer says how to get them
        "logits": property(_get_logits, _set_logits),
    }
    # created under its unique qualified name, so that transformers' registration on creation
    # (``f"{module}.{__name__}"``) gets a serialized type name no other class has; named as the
    # native one right after
    cls = type(qualname, (native,), ns)
    cls = dataclasses.dataclass(cls)
    cls.__name__ = native.__name__
    _ensure_pytree_node(cls)
    return cls


def _flatten(out: Any) -> tuple[list[Any], list[str]]:
    return list(out.values()), list(out.keys())


def _unflatten(values: Any, context: list[str], cls: type) -> Any:
    return cls(**dict(zip(context, values)))


def _ensure_pytree_node(cls: type) -> None:
    """Register ``cls`` as a pytree node where transformers did not (releases whose ``ModelOutput``
    registers subclasses lazily, or not at all)."""
    import functools

    import torch.utils._pytree as pytree

    if cls in pytree.SUPPORTED_NODES:
        return
    register = getattr(pytree, "register_pytree_node", None) or pytree._register_pytree_node
    register(cls, _flatten, functools.partial(_unflatten, cls=cls),
             serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")


def _reduce(self: Any) -> tuple:
    # by the native class (importable wherever transformers is), not by this generated one
    native = type(self).__mro__[1]
    return _rebuild, (native, tuple(self.items()))


def _rebuild(native: type, items: tuple) -> Any:
    return training_class(native)(**dict(items))


def _find_native(qualname: str) -> type | None:
    """The native output class a qualified name of this module stands for (a process that unpickles
    the class itself before making it): ``Name__module__path`` names its module; a plain ``Name`` is
    looked up in ``transformers.modeling_outputs``, then in the modeling modules of the families table."""
    import dataclasses
    import importlib

    from ..compat import families

    name, _, module = qualname.partition("__")
    candidates = [module.replace("__", ".")] if module else \
        ["transformers.modeling_outputs"] + sorted({f.module for f in families.FAMILIES})
    for mod_name in candidates:
        try:
            native = getattr(importlib.import_module(mod_name), name, None)
        except ImportError:
            continue
        if isinstance(native, type) and dataclasses.is_dataclass(native) and native.__module__ == mod_name:
            return native
    return None


def __getattr__(attr: str) -> Any:
    cls = _by_qualname.get(attr)
    if cls is not None:
        return cls
    if attr.startswith("_") or not attr[:1].isupper():
        raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
    native = _find_native(attr)
    if native is None:
        raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
    cls = training_class(native)
    if cls.__qualname__ != attr:
        raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
    return cls
