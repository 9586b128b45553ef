"""``__repr__`` and ``__eq__`` for the plain record classes of the modules ``import liger_compat`` loads.

Those classes were ``@dataclass``es; decorating a class generates and compiles its methods, which
cost ~1 ms a class (and ``import dataclasses`` on top), a fifth of ``import liger_compat``. They are
now plain classes with a hand-written ``__init__`` that list their fields in ``_fields`` and get
from here the ``repr`` and ``==`` the dataclass gave them (unhashable, like a mutable dataclass).
Immutable records are ``typing.NamedTuple``s instead.
"""

from __future__ import annotations

from typing import Any


class Record:
    _fields: tuple[str, ...] = ()

    def _astuple(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f) for f in self._fields)

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}({', '.join(f'{f}={getattr(self, f)!r}' for f in self._fields)})"

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._astuple() == other._astuple()  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]
