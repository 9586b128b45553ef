"""The shim contract and registry.

A shim is a small unit that adapts one upstream behaviour. It declares

* ``id``: stable name, ``"<library>.<what>"``,
* ``library``: the distribution whose versions gate it (``"transformers"``, ``"trl"``),
* ``trigger``: the import name whose import applies it (a module or submodule, for example
  ``"transformers.models.qwen2.modeling_qwen2"``); hooks are registered with
  :func:`liger_compat._import_hooks.when_imported` so the order of imports does not matter,
* ``target``: what it patches, in words (``"Qwen2ForCausalLM.forward"``),
* ``versions``: a ``packaging`` specifier on ``library`` where it applies (empty: all),
* ``upstream``: the upstream change or issue it answers, ``fixes``: known-issue ids,
  ``description``: one line saying what it does (shown in ``check --json``),
* ``kernels``: the kernels it routes to; it is skipped when none of them is enabled,
* ``_apply(module, patches)`` / optional ``_revert()``: the work; every attribute change goes
  through ``patches`` (a :class:`~liger_compat.shims._patching.PatchSet`) so revert is exact;
  a shim that finds the installed library already behaving records ``"not needed: ..."`` in
  what it returns, and one that finds another library's patch reports it with
  :meth:`Registry.report_conflict` and leaves the target alone,
* optional ``apply_to_model(model, patches)``: instance-level patching for ``apply(model=...)``.

A shim that raises while applying is marked ``failed`` with the reason and the
library keeps its native behaviour: the import never breaks.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import threading
from typing import Any, Callable, Iterator

from .. import _config, _import_hooks
from .._log import log
from .._record import Record
from ..compat import versions
from ._patching import PatchSet



class State(str, enum.Enum):
    WAITING = "waiting"  # trigger module not imported yet
    APPLIED = "applied"
    NOT_NEEDED = "not needed"
    FAILED = "failed"
    DISABLED = "disabled"  # by LIGER_COMPAT_DISABLE / configure / kernel selection
    REVERTED = "reverted"


class Shim(Record):
    _fields = ("id", "library", "trigger", "target", "upstream", "versions", "fixes", "kernels", "description",
               "_apply", "_revert", "apply_to_model", "state", "reason", "patches",
               "model_patches")

    def __init__(
        self,
        id: str,
        library: str,
        trigger: str,
        target: str,
        upstream: str,
        versions: str = "",
        fixes: tuple[str, ...] = (),
        kernels: tuple[str, ...] = (),
        description: str = "",
        _apply: Callable[[Any, PatchSet], None] | None = None,
        _revert: Callable[[], None] | None = None,
        apply_to_model: Callable[[Any, PatchSet], bool] | None = None,
        state: State = State.WAITING,
        reason: str = "",
        patches: PatchSet | None = None,
        model_patches: list[PatchSet] | None = None,
    ) -> None:
        self.id = id
        self.library = library
        self.trigger = trigger
        self.target = target
        self.upstream = upstream
        self.versions = versions
        self.fixes = fixes
        self.kernels = kernels
        self.description = description
        self._apply = _apply
        self._revert = _revert
        self.apply_to_model = apply_to_model
        # runtime state, owned by the registry
        self.state = state
        self.reason = reason
        self.patches = PatchSet() if patches is None else patches
        self.model_patches: list[PatchSet] = [] if model_patches is None else model_patches

    def status(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "library": self.library,
            "target": self.target,
            "state": self.state.value,
            "reason": self.reason,
            "versions": self.versions or "any",
            "fixes": list(self.fixes),
            "upstream": self.upstream,
            "kernels": list(self.kernels),
            "description": self.description,
        }


class Conflict(Record):
    _fields = ("what", "by", "detail")

    def __init__(self, what: str, by: str, detail: str) -> None:
        self.what = what
        self.by = by
        self.detail = detail

    def to_dict(self) -> dict[str, str]:
        return {"what": self.what, "by": self.by, "detail": self.detail}


class Registry:
    def __init__(self) -> None:
        self._shims: dict[str, Shim] = {}
        self._hooked: set[str] = set()
        self._lock = threading.RLock()
        self.conflicts: list[Conflict] = []
        self.load_errors: list[str] = []  # shim modules that failed to import
        self.active = False  # hooks fire only while active

    # -- registration -----------------------------------------------------------------------
    def register(self, shim: Shim) -> Shim:
        with self._lock:
            if shim.id in self._shims:
                raise ValueError(f"shim id {shim.id!r} registered twice")
            if shim._apply is None:
                raise ValueError(f"shim {shim.id!r} has no _apply")
            self._shims[shim.id] = shim
            if self.active:
                self._hook(shim.trigger)
            return shim

    def shims(self) -> list[Shim]:
        return list(self._shims.values())

    def get(self, shim_id: str) -> Shim:
        try:
            return self._shims[shim_id]
        except KeyError:
            raise KeyError(f"no shim {shim_id!r}; known: {', '.join(sorted(self._shims))}") from None

    def report_conflict(self, what: str, by: str, detail: str) -> None:
        c = Conflict(what, by, detail)
        if all(c != other for other in self.conflicts):
            self.conflicts.append(c)

    # -- hooks --------------------------------------------------------------------------------
    def _hook(self, trigger: str) -> None:
        if trigger in self._hooked:
            return
        self._hooked.add(trigger)
        # fires at once if the module is already imported, else right after its import
        _import_hooks.when_imported(trigger, self._on_import)

    def _on_import(self, module: Any) -> None:
        if not self.active:
            return
        name = getattr(module, "__name__", "")
        for shim in self.shims():
            if shim.trigger == name:
                self._apply_one(shim, module)

    def activate(self) -> None:
        """Install post-import hooks for every trigger (idempotent)."""
        with self._lock:
            self.active = True
            for shim in self.shims():
                self._hook(shim.trigger)
                if shim.state in (State.REVERTED, State.DISABLED):
                    mod = sys.modules.get(shim.trigger)
                    if mod is not None:
                        self._apply_one(shim, mod)
                    else:
                        shim.state, shim.reason = State.WAITING, ""

    # -- applying -----------------------------------------------------------------------------
    def _apply_one(self, shim: Shim, module: Any) -> None:
        with self._lock:
            if shim.state == State.APPLIED:
                return  # idempotent
            if _config.settings.disabled:
                shim.state, shim.reason = State.DISABLED, "LIGER_COMPAT_DISABLE / configure(enabled=False)"
                return
            if shim.kernels and not any(_config.kernel_enabled(k) for k in shim.kernels):
                shim.state = State.DISABLED
                shim.reason = f"kernels {', '.join(shim.kernels)} not selected"
                return
            lib = versions.installed(shim.library)
            if shim.versions and lib.installed and not versions.matches(lib.raw, shim.versions):
                shim.state = State.NOT_NEEDED
                shim.reason = f"{shim.library} {lib.raw} is outside {shim.versions}"
                return
            try:
                shim._apply(module, shim.patches)
            except Exception as exc:
                errors = shim.patches.revert()  # leave nothing half-applied
                shim.state = State.FAILED
                shim.reason = f"{type(exc).__name__}: {exc}" + (f" (revert: {errors})" if errors else "")
                log.warning("liger_compat: shim %s failed, native behaviour kept: %s", shim.id, shim.reason)
                import traceback

                log.debug("%s", traceback.format_exc())
                return
            shim.state, shim.reason = State.APPLIED, ""

    def apply(self, model: Any = None) -> None:
        """Activate hooks, apply every shim whose trigger is imported, then patch ``model``."""
        self.activate()
        for shim in self.shims():
            mod = sys.modules.get(shim.trigger)
            if mod is not None and shim.state != State.APPLIED:
                self._apply_one(shim, mod)
        if model is not None:
            self.apply_model(model)

    def apply_model(self, model: Any) -> list[str]:
        """Instance-level patches. Returns the ids of shims that patched something."""
        done = []
        if _config.settings.disabled:
            return done
        for shim in self.shims():
            if shim.apply_to_model is None:
                continue
            if shim.kernels and not any(_config.kernel_enabled(k) for k in shim.kernels):
                continue
            ps = PatchSet()
            try:
                if shim.apply_to_model(model, ps):
                    shim.model_patches.append(ps)
                    done.append(shim.id)
            except Exception as exc:
                ps.revert()
                log.warning("liger_compat: shim %s could not patch the model: %s", shim.id, exc)
        return done

    def revert(self) -> list[str]:
        """Undo every patch (classes and instances) and stop the hooks. Returns errors."""
        errors: list[str] = []
        with self._lock:
            self.active = False
            for shim in reversed(self.shims()):
                for ps in reversed(shim.model_patches):
                    errors += ps.revert()
                shim.model_patches.clear()
                if shim.state == State.APPLIED:
                    errors += self._revert_one(shim, "liger_compat.revert()")
                elif shim.state in (State.WAITING, State.FAILED, State.NOT_NEEDED):
                    shim.state, shim.reason = State.REVERTED, "liger_compat.revert()"
        return errors


    def _revert_one(self, shim: Shim, reason: str) -> list[str]:
        errors: list[str] = []
        if shim._revert is not None:
            try:
                shim._revert()
            except Exception as exc:
                errors.append(f"{shim.id}: {exc}")
        errors += shim.patches.revert()
        shim.state, shim.reason = State.REVERTED, reason
        return errors

    @contextlib.contextmanager
    def suspended(self, shim_id: str) -> Iterator[Shim]:
        """Revert one shim inside the block and apply it again on exit (only if it was applied).

        Its class- and module-level patches go; instance patches from ``apply(model=...)`` stay.
        Re-applying reads the targets afresh, as an import would. Raises when the revert fails, since
        the block would then not run without the shim."""
        shim = self.get(shim_id)
        with self._lock:
            was_applied = shim.state == State.APPLIED
            if was_applied:
                errors = self._revert_one(shim, f"suspended ({shim_id})")
                if errors:
                    mod = sys.modules.get(shim.trigger)
                    if mod is not None:
                        self._apply_one(shim, mod)
                    raise RuntimeError(f"could not suspend {shim_id}: {'; '.join(errors)}")
        try:
            yield shim
        finally:
            if was_applied:
                with self._lock:
                    mod = sys.modules.get(shim.trigger)
                    if mod is not None:
                        self._apply_one(shim, mod)
                    else:
                        shim.state, shim.reason = State.WAITING, ""


REGISTRY = Registry()


def register(**kwargs: Any) -> Shim:
    """Declare and register a shim; see the module docstring for the fields."""
    return REGISTRY.register(Shim(**kwargs))

