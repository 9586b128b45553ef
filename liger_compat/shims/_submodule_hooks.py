"""One shim whose targets live in several submodules, each patched when it is imported.

trl and transformers import their trainers lazily (``from trl import SFTTrainer`` imports
``trl.trainer.sft_trainer`` on first attribute access), and trl moved trainers between
``trl.trainer`` and ``trl.experimental`` across releases. A trainer shim therefore cannot name one
trigger module; it is triggered by the package itself (``"trl"``, ``"transformers"``) and then
patches each submodule of :attr:`SubmoduleShim.modules` when, and if, that submodule is imported.

Each submodule gets its own :class:`PatchSet`, so a submodule that fails to patch is rolled back
alone and reported in the shim's reason while the other submodules stay patched.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from .. import _import_hooks
from .._log import log
from ._patching import PatchSet
from ._registry import REGISTRY, Shim, State

#: guards the middleware chains
_lock = threading.RLock()



# --------------------------------------------------------------------------------------------
# middleware chains: several shims around one method, revertible in any order
# --------------------------------------------------------------------------------------------

class _Chain:
    """One wrapper on ``owner.attr`` running the middlewares of every shim that asked for one.

    Middlewares run in shim registration order (the first registered is outermost); each is
    ``fn(call_next, wrapped, instance, args, kwargs)`` (``wrapped``: the original method) and calls
    ``call_next(args, kwargs)`` to go on. A shim
    removes only its own middleware, so shims can be reverted in any order; the wrapper itself goes
    when the last middleware does.
    """

    def __init__(self, owner: Any, attr: str) -> None:
        self.owner, self.attr = owner, attr
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


def _shim_order(shim_id: str) -> int:
    ids = [s.id for s in REGISTRY.shims()]
    return ids.index(shim_id) if shim_id in ids else len(ids)


class ShimPatches(PatchSet):
    """A :class:`PatchSet` that can also add middlewares to shared chains (see :class:`_Chain`)."""

    def __init__(self, shim_id: str) -> None:
        super().__init__()
        self.shim_id = shim_id
        self._chained: list[tuple[int, str]] = []

    def middleware(self, owner: Any, attr: str, fn: Callable[..., Any]) -> None:
        with _lock:
            key = (id(owner), attr)
            chain = _chains.get(key)
            if chain is None:
                chain = _chains[key] = _Chain(owner, attr)
            chain.items[self.shim_id] = (_shim_order(self.shim_id), fn)
            self._chained.append(key)

    def revert(self) -> list[str]:
        errors = []
        with _lock:
            for key in reversed(self._chained):
                chain = _chains.get(key)
                if chain is None:
                    continue
                chain.items.pop(self.shim_id, None)
                if not chain.items:
                    errors += chain.patches.revert()
                    del _chains[key]
            self._chained.clear()
        return errors + super().revert()


class SubmoduleShim(Shim):
    """A shim applied per submodule. ``patch_module(module, patches)`` returns what it patched."""

    _fields = Shim._fields + ("modules", "patch_module", "patched", "sub_errors", "module_patches", "_active")

    def __init__(
        self,
        *args: Any,
        modules: tuple[str, ...] = (),
        patch_module: Callable[[Any, PatchSet], list[str]] | None = None,
        patched: list[str] | None = None,
        sub_errors: list[str] | None = None,
        module_patches: dict[str, PatchSet] | None = None,
        _active: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.modules = modules
        self.patch_module = patch_module
        # runtime
        self.patched: list[str] = [] if patched is None else patched
        self.sub_errors: list[str] = [] if sub_errors is None else sub_errors
        self.module_patches: dict[str, PatchSet] = {} if module_patches is None else module_patches
        self._active = _active
        self.__post_init__()

    def __post_init__(self) -> None:
        self._apply = self._install
        self._revert = self._uninstall

    def _install(self, root: Any, patches: PatchSet) -> None:
        self._active = True
        try:
            for name in self.modules:
                _import_hooks.when_imported(name, self._on_submodule)
        except Exception:
            self._uninstall()
            raise

    def _uninstall(self) -> None:
        self._active = False
        errors = []
        for ps in reversed(list(self.module_patches.values())):
            errors += ps.revert()
        self.module_patches.clear()
        self.patched.clear()
        self.sub_errors.clear()
        if errors:
            raise RuntimeError("; ".join(errors))

    def _on_submodule(self, module: Any) -> None:
        name = module.__name__
        if not self._active or name in self.module_patches or self.state in (State.FAILED, State.DISABLED):
            return
        ps = ShimPatches(self.id)
        try:
            done = self.patch_module(module, ps) if self.patch_module else []
        except Exception as exc:
            errs = ps.revert()
            msg = f"{name}: {type(exc).__name__}: {exc}" + (f" (revert: {errs})" if errs else "")
            self.sub_errors.append(msg)
            log.warning("liger_compat: shim %s left %s native: %s", self.id, name, msg)
            return
        self.module_patches[name] = ps
        self.patched.extend(done)

    def status(self) -> dict[str, Any]:
        """``patch_module`` results starting with ``"not needed"`` are notes, not patches: a shim whose
        every imported target was not needed reports that state."""
        _import_hooks.flush_pending()
        st = super().status()
        if self.state == State.APPLIED and not st["reason"]:
            done = [p for p in self.patched if not p.startswith("not needed")]
            notes = [p for p in self.patched if p.startswith("not needed")]
            if done:
                st["reason"] = "patched " + ", ".join(done) + ("; " + "; ".join(notes) if notes else "")
            elif notes:
                st["state"] = State.NOT_NEEDED.value
                st["reason"] = "; ".join(n[len("not needed"):].lstrip(": ") for n in notes)
            else:
                st["reason"] = "no target imported yet"
        if self.sub_errors:
            st["reason"] = (st["reason"] + "; " if st["reason"] else "") + "failed: " + "; ".join(self.sub_errors)
        return st


def register_submodule_shim(**kwargs: Any) -> SubmoduleShim:
    """Declare and register a :class:`SubmoduleShim` (the fields of :class:`Shim` plus
    ``modules`` and ``patch_module``)."""
    kwargs.setdefault("_apply", lambda module, patches: None)  # replaced in __post_init__
    return REGISTRY.register(SubmoduleShim(**kwargs))  # type: ignore[return-value]


#: the transformers base classes of trainers and of their configs, as (module, class name): matched
#: by name so that a hook on one transformers module never imports another mid-import
TRAINER_BASE = ("transformers.trainer", "Trainer")
ARGS_BASE = ("transformers.training_args", "TrainingArguments")


def classes_defined_in(module: Any, *bases: tuple[str, str]) -> list[type]:
    """Classes defined in ``module`` itself (not merely imported into it) that are, or derive from,
    one of ``bases`` (``(module name, class name)`` pairs)."""
    wanted = set(bases)
    out = []
    for obj in list(vars(module).values()):
        if not isinstance(obj, type) or obj.__module__ != module.__name__:
            continue
        if any((getattr(k, "__module__", ""), k.__name__) in wanted for k in obj.__mro__):
            out.append(obj)
    return out
