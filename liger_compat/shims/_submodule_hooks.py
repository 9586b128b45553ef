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

import logging
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import wrapt

from ._patching import PatchSet
from ._registry import REGISTRY, Shim, State

log = logging.getLogger("liger_compat")

#: module name -> callbacks; one wrapt hook per module name for the whole process
_callbacks: dict[str, list[Callable[[Any], None]]] = {}
_lock = threading.RLock()


def _dispatch(module: Any) -> None:
    for cb in list(_callbacks.get(getattr(module, "__name__", ""), ())):
        cb(module)


def _on_import(name: str, callback: Callable[[Any], None]) -> None:
    with _lock:
        first = name not in _callbacks
        cbs = _callbacks.setdefault(name, [])
        if callback not in cbs:
            cbs.append(callback)
        if first:
            wrapt.register_post_import_hook(_dispatch, name)  # fires at once when already imported
        elif name in sys.modules:
            callback(sys.modules[name])


@dataclass(eq=False)
class SubmoduleShim(Shim):
    """A shim applied per submodule. ``patch_module(module, patches)`` returns what it patched."""

    modules: tuple[str, ...] = ()
    patch_module: Callable[[Any, PatchSet], list[str]] | None = None

    # runtime
    patched: list[str] = field(default_factory=list)
    sub_errors: list[str] = field(default_factory=list)
    module_patches: dict[str, PatchSet] = field(default_factory=dict)
    _active: bool = False

    def __post_init__(self) -> None:
        self._apply = self._install
        self._revert = self._uninstall

    def _install(self, root: Any, patches: PatchSet) -> None:
        self._active = True
        try:
            for name in self.modules:
                _on_import(name, self._on_submodule)
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
        ps = PatchSet()
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
        st = super().status()
        if self.state == State.APPLIED and not st["reason"]:
            if self.patched:
                st["reason"] = "patched " + ", ".join(self.patched)
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


def classes_defined_in(module: Any, base: type) -> list[type]:
    """Subclasses of ``base`` defined in ``module`` itself (not merely imported into it)."""
    out = []
    for obj in list(vars(module).values()):
        if isinstance(obj, type) and issubclass(obj, base) and obj.__module__ == module.__name__:
            out.append(obj)
    return out
