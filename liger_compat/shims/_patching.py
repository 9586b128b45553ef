"""Reversible attribute patches, recorded so that ``revert()`` restores the exact originals.

A patch remembers whether the attribute lived in the owner's own ``__dict__`` or was
inherited: reverting puts the very same object back, or deletes the override so the
inherited one shows through again. Function wrappers are ``wrapt.FunctionWrapper``
objects, as in OpenTelemetry's instrumentations (wrapt is imported on the first patch, not when
liger_compat is imported, see :mod:`liger_compat._import_hooks`), except where the patched function runs inside
``torch.compile``d code (model forwards, ``apply_rotary_pos_emb``): TorchDynamo cannot trace
wrapt's C proxy objects (``Unsupported: Missing hash_impl override ... FunctionWrapper``, torch
2.x), so ``wrap(..., traceable=True)`` installs a plain Python function calling the same
``wrapper(wrapped, instance, args, kwargs)`` instead. It carries ``__wrapped__`` (the original,
so ``inspect.signature`` shows the native signature and :func:`unwrap` works) and
``_self_wrapper`` (the wrapper, as wrapt names it), which :func:`is_ours` reads for both kinds.

Several shims may wrap the same method (a trainer's ``__init__``): :meth:`ShimPatches.middleware`
puts each shim's function on one shared chain, so the shims can be reverted in any order.
"""

from __future__ import annotations

import functools
import threading
import types
from typing import Any, Callable

from .._record import Record

_MISSING = object()


class Gate:
    """Whether a wrapper of ours still runs. A patch that cannot be removed (another library wrapped
    over it) is left in place with its gate closed: the wrapper then calls straight through to the
    code it wraps, so after ``revert()`` nothing of ours runs, removed or not."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = True

    def close(self, removed: bool) -> None:
        """Turn the wrapper off: ``removed`` when its patch was taken out (a reference kept
        elsewhere then runs nothing of ours either), else when it had to be left in place."""
        self.on = False


class Patch(Record):
    _fields = ("owner", "name", "original", "replacement", "gate")

    def __init__(self, owner: Any, name: str, original: Any, replacement: Any, gate: Gate | None = None) -> None:
        self.owner = owner
        self.name = name
        self.original = original  # the value in owner.__dict__ before patching, or _MISSING if inherited
        self.replacement = replacement
        self.gate = gate  # None: a plain value, in effect until removed

    def _put_back(self, current: Any) -> bool:
        """Whether whoever replaced ours has put the native code back: ``current`` is the original
        (or the same function under other wrappers), and ours is not in its wrapper chain."""
        if current is self.original:
            return True
        if current is _MISSING or self.original is _MISSING or unwrap(current) is not unwrap(self.original):
            return False
        seen = 0
        while current is not None and seen < _MAX_DEPTH:
            if current is self.replacement:
                return False
            current, seen = getattr(current, "__wrapped__", None), seen + 1
        return True

    def revert(self) -> None:
        current = _own(self.owner, self.name)
        if current is not self.replacement and self._put_back(current):
            if self.gate is not None:
                self.gate.close(removed=True)
            return
        if current is not self.replacement:
            # someone patched on top of us; putting our original back would drop their patch
            if self.gate is not None:
                self.gate.close(removed=False)
            state = ("our wrapper there now calls straight through to the native code" if self.gate is not None
                     else "it stays in effect")
            raise RuntimeError(f"cannot revert {_qual(self.owner)}.{self.name}: it was replaced again after "
                               f"liger_compat patched it; {state}")
        if self.original is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)
        if self.gate is not None:
            self.gate.close(removed=True)


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

    def set(self, owner: Any, name: str, replacement: Any, gate: Gate | None = None) -> Any:
        """Replace ``owner.name`` with ``replacement``; returns the replacement. ``gate``: the
        :class:`Gate` the replacement reads (closed when the patch is reverted, or cannot be)."""
        original = _own(owner, name)
        if original is _MISSING and not hasattr(owner, name):
            raise AttributeError(f"{_qual(owner)} has no attribute {name!r} to patch")
        setattr(owner, name, replacement)
        self._patches.append(Patch(owner, name, original, replacement, gate))
        return replacement

    def wrap(self, owner: Any, name: str, wrapper: Callable[..., Any], *, traceable: bool = False) -> Any:
        """Wrap ``owner.name`` with a wrapt wrapper ``wrapper(wrapped, instance, args, kwargs)``.

        ``traceable=True``: when the attribute is a plain function (a method of a class, or a
        module-level function), install a plain Python function instead of a wrapt proxy
        (:func:`traceable_wrapper`), so ``torch.compile`` can trace through it.
        """
        current = getattr(owner, name)
        if isinstance(owner, type):
            # look the attribute up without the descriptor protocol so that
            # staticmethod / classmethod keep their kind under the wrapper
            for klass in owner.__mro__:
                if name in klass.__dict__:
                    current = klass.__dict__[name]
                    break
        gate = Gate()
        if traceable and isinstance(current, types.FunctionType):
            fw = traceable_wrapper(current, wrapper, method=isinstance(owner, type), gate=gate)
        else:
            import wrapt

            fw = wrapt.FunctionWrapper(current, wrapper, enabled=lambda: gate.on)
        return self.set(owner, name, fw, gate)

    def revert(self) -> list[str]:
        """Undo every patch, newest first. Returns the errors (empty when all went back). A patch
        that cannot be undone (another library wrapped over it) stays recorded, its wrapper
        inert (:class:`Gate`), and is tried again, and reported again, by the next ``revert``."""
        errors = []
        stuck = []
        for p in reversed(self._patches):
            try:
                p.revert()
            except Exception as exc:  # keep going: revert as much as possible
                errors.append(str(exc))
                stuck.append(p)
        self._patches = stuck[::-1]
        return errors


def traceable_wrapper(original: types.FunctionType, wrapper: Callable[..., Any], *, method: bool,
                      gate: Gate | None = None) -> Any:
    """A plain function that calls ``wrapper(wrapped, instance, args, kwargs)`` as wrapt would.

    ``method=True`` (a function in a class): bound like the original, ``wrapped`` is
    ``functools.partial(original, instance)`` and ``instance`` the instance (also when called
    through the class, ``Cls.forward(obj, ...)``); a partial, not a bound method, because
    TorchDynamo cannot build ``types.MethodType`` on a submodule. :func:`wrapped_function` gives
    ``original`` back from either. ``method=False`` (a module-level function): ``wrapped`` is
    the original and ``instance`` is None. A closed ``gate`` calls the original directly.
    """
    gate = Gate() if gate is None else gate
    if method:
        @functools.wraps(original)
        def patched(self, *args, **kwargs):
            if not gate.on:
                return original(self, *args, **kwargs)
            return wrapper(functools.partial(original, self), self, args, kwargs)
    else:
        @functools.wraps(original)
        def patched(*args, **kwargs):
            if not gate.on:
                return original(*args, **kwargs)
            return wrapper(original, None, args, kwargs)
    patched._self_wrapper = wrapper  # type: ignore[attr-defined]
    return patched


def wrapped_function(wrapped: Any) -> Any:
    """The object a wrapper's ``wrapped`` argument stands for, the same on every call: the function
    of a traceable wrapper's partial, the class-level wrapper of a wrapt bound wrapper, a bound
    method's function, else ``wrapped`` itself."""
    if type(wrapped) is functools.partial:
        return wrapped.func
    parent = getattr(wrapped, "_self_parent", None)
    if parent is not None:
        return parent
    return getattr(wrapped, "__func__", wrapped)


def call_below(wrapped: Any) -> Any:
    """The callable one wrapper layer below ``wrapped`` (a wrapper's ``wrapped`` argument), bound alike."""
    if type(wrapped) is functools.partial:  # a traceable wrapper bound to an instance
        return functools.partial(wrapped.func.__wrapped__, *wrapped.args)
    return wrapped.__wrapped__


def unwrap(obj: Any) -> Any:
    """The innermost function under any wrapt wrappers and ``functools.wraps`` chains."""
    # a bounded walk rather than a set of seen ids: traceable by torch.compile (an id() of a
    # bound method made on the fly fails its guards) and still safe against a cycle
    for _ in range(_MAX_DEPTH):
        inner = getattr(obj, "__wrapped__", None)
        if inner is None or inner is obj:
            break
        obj = inner
    return obj


_MAX_DEPTH = 64

_signatures: dict[Any, Any] = {}


def signature(fn: Any) -> Any:
    """``inspect.signature(unwrap(fn))``, cached: the one way the shims read a signature.

    Keyed by the unwrapped function (a bound method by its function, apart from the function
    itself, whose signature still has ``self``); an unhashable callable is not cached. Raises what
    ``inspect.signature`` raises (``TypeError``, ``ValueError``) for a callable without one.
    """
    import inspect  # not at import: ``import liger_compat`` stays light

    inner = unwrap(fn)
    func = getattr(inner, "__func__", None) if inspect.ismethod(inner) else None
    key = ("bound", func) if func is not None else inner
    try:
        hit = _signatures.get(key)
    except TypeError:  # unhashable
        return inspect.signature(inner)
    if hit is None:
        hit = _signatures[key] = inspect.signature(inner)
    return hit


def is_ours(obj: Any, wrapper: Any) -> bool:
    """Whether ``wrapper`` (a wrapper function of ours) is anywhere in ``obj``'s wrapper chain."""
    seen = set()
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        if getattr(obj, "_self_wrapper", None) is wrapper:
            return True
        obj = getattr(obj, "__wrapped__", None)
    return False


# --------------------------------------------------------------------------------------------
# middleware chains: several shims around one method, revertible in any order
# --------------------------------------------------------------------------------------------

_chain_lock = threading.RLock()


class _Chain:
    """One wrapper on ``owner.attr`` running the middlewares of every shim that asked for one.

    Middlewares run in shim registration order (the first registered is outermost); each is
    ``fn(call_next, wrapped, instance, args, kwargs)`` (``wrapped``: the original method) and calls
    ``call_next(args, kwargs)`` to go on. A shim removes only its own middleware; the wrapper
    itself goes when the last middleware does.
    """

    def __init__(self, owner: Any, attr: str) -> None:
        self.items: dict[str, tuple[int, Callable[..., Any]]] = {}
        self.patches = PatchSet()
        self.patches.wrap(owner, attr, self._call)

    def _call(self, wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        fns = [fn for _, fn in sorted(self.items.values(), key=lambda x: x[0])]

        def step(i: int, a: tuple, k: dict[str, Any]) -> Any:
            if i == len(fns):
                return wrapped(*a, **k)
            return fns[i](lambda a2, k2: step(i + 1, a2, k2), wrapped, instance, a, k)

        return step(0, tuple(args), dict(kwargs))


_chains: dict[tuple[int, str], _Chain] = {}


class ShimPatches(PatchSet):
    """The patches of one shim in one module: a :class:`PatchSet` that can also add middlewares to
    shared chains (:class:`_Chain`); ``order`` places the shim's middleware on a chain."""

    def __init__(self, shim_id: str, order: int = 0) -> None:
        super().__init__()
        self.shim_id = shim_id
        self.order = order
        self._chained: list[tuple[int, str]] = []

    def middleware(self, owner: Any, attr: str, fn: Callable[..., Any]) -> None:
        with _chain_lock:
            key = (id(owner), attr)
            chain = _chains.get(key)
            if chain is None:
                chain = _chains[key] = _Chain(owner, attr)
            chain.items[self.shim_id] = (self.order, fn)
            self._chained.append(key)

    def __len__(self) -> int:
        return super().__len__() + len(self._chained)

    def revert(self) -> list[str]:
        errors = []
        with _chain_lock:
            stuck = []
            for key in reversed(self._chained):
                chain = _chains.get(key)
                if chain is None:
                    continue
                chain.items.pop(self.shim_id, None)
                if not chain.items:
                    failed = chain.patches.revert()
                    if failed:  # left in place, running no middleware: kept, and tried again next time
                        errors += failed
                        stuck.append(key)
                    else:
                        del _chains[key]
            self._chained = stuck[::-1]
        return errors + super().revert()
