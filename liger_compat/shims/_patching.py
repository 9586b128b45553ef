"""Reversible attribute patches, recorded so that ``revert()`` restores the exact originals.

A patch remembers whether the attribute lived in the owner's own ``__dict__`` or was
inherited: reverting puts the very same object back, or deletes the override so the
inherited one shows through again. Function wrappers are ``wrapt.FunctionWrapper``
objects, as in OpenTelemetry's instrumentations; wrapt is imported on the first patch, not when
liger_compat is imported (see :mod:`liger_compat._import_hooks`).
"""

from __future__ import annotations

from typing import Any, Callable

from .._record import Record

_MISSING = object()


class Patch(Record):
    _fields = ("owner", "name", "original", "replacement")

    def __init__(self, owner: Any, name: str, original: Any, replacement: Any) -> None:
        self.owner = owner
        self.name = name
        self.original = original  # the value in owner.__dict__ before patching, or _MISSING if inherited
        self.replacement = replacement

    def revert(self) -> None:
        current = _own(self.owner, self.name)
        if current is not self.replacement:
            # someone patched on top of us; putting our original back would drop their patch
            raise RuntimeError(
                f"cannot revert {_qual(self.owner)}.{self.name}: it was replaced again after liger_compat patched it"
            )
        if self.original is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)


def _own(owner: Any, name: str) -> Any:
    d = getattr(owner, "__dict__", None)
    if d is not None and name in d:
        return d[name]
    return _MISSING


def _qual(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or type(owner).__qualname__


class PatchSet:
    """The patches of one shim, reverted together in reverse order."""

    def __init__(self) -> None:
        self._patches: list[Patch] = []

    def __len__(self) -> int:
        return len(self._patches)

    def __iter__(self):
        return iter(self._patches)

    def set(self, owner: Any, name: str, replacement: Any) -> Any:
        """Replace ``owner.name`` with ``replacement``; returns the replacement."""
        original = _own(owner, name)
        if original is _MISSING and not hasattr(owner, name):
            raise AttributeError(f"{_qual(owner)} has no attribute {name!r} to patch")
        setattr(owner, name, replacement)
        self._patches.append(Patch(owner, name, original, replacement))
        return replacement

    def wrap(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> Any:
        """Wrap ``owner.name`` with a wrapt wrapper ``wrapper(wrapped, instance, args, kwargs)``."""
        current = getattr(owner, name)
        if isinstance(owner, type):
            # look the attribute up without the descriptor protocol so that
            # staticmethod / classmethod keep their kind under the wrapper
            for klass in owner.__mro__:
                if name in klass.__dict__:
                    current = klass.__dict__[name]
                    break
        import wrapt

        fw = wrapt.FunctionWrapper(current, wrapper)
        return self.set(owner, name, fw)

    def revert(self) -> list[str]:
        """Undo every patch, newest first. Returns the errors (empty when all went back)."""
        errors = []
        while self._patches:
            p = self._patches.pop()
            try:
                p.revert()
            except Exception as exc:  # keep going: revert as much as possible
                errors.append(str(exc))
        return errors


def unwrap(obj: Any) -> Any:
    """The innermost function under any wrapt wrappers and ``functools.wraps`` chains."""
    seen = set()
    while id(obj) not in seen:
        seen.add(id(obj))
        inner = getattr(obj, "__wrapped__", None)
        if inner is None:
            break
        obj = inner
    return obj
