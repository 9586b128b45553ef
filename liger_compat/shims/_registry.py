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
* what it patches, one of:

  - ``_apply(module, patches)``: the trigger module itself, once it is imported;
  - ``modules`` (names, or a function returning them) and ``patch_module(module, patches)``:
    each of those modules when, and if, it is imported (transformers and trl import their
    modeling and trainer modules lazily, and move them between releases). Every module gets its
    own :class:`~liger_compat.shims._patching.ShimPatches`, so a module that fails to patch is
    rolled back and reported alone while the others stay patched. ``patch_module`` returns what
    it patched; an entry starting with ``"not needed"`` is a note, and a shim whose every entry
    is one reports ``not needed``,

  every attribute change goes through ``patches`` so revert is exact; one that finds another
  library's patch reports it with :meth:`Registry.report_conflict` and leaves the target alone,
* optional ``_revert()``: forgets the shim's own bookkeeping after the registry reverted its
  patches; optional ``in_use()``: a line for the report saying what the shim did at run time,
* optional ``apply_to_model(model, patches)``: instance-level patching for ``apply(model=...)``.

The registry is the one place that installs post-import hooks (through
:func:`liger_compat._import_hooks.when_imported`), for triggers and for ``modules`` alike, and it
applies a shim only inside its declared ``versions``.

A shim that raises while applying is marked ``failed`` with the reason and the
library keeps its native behaviour: the import never breaks.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import sys
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator

from .. import _config, _import_hooks
from .._log import log
from .._record import Record
from ..compat import versions
from ._patching import PatchSet, ShimPatches



class State(str, enum.Enum):
    WAITING = "waiting"  # trigger module (or, in the report, every target module) not imported yet
    APPLIED = "applied"
    NOT_NEEDED = "not needed"
    FAILED = "failed"
    DISABLED = "disabled"  # by LIGER_COMPAT_DISABLE / configure / kernel selection
    REVERTED = "reverted"


class Shim(Record):
    _fields = ("id", "library", "trigger", "target", "upstream", "versions", "fixes", "kernels", "description",
               "_apply", "_revert", "modules", "patch_module", "in_use", "apply_to_model",
               "state", "reason", "patches", "module_patches", "patched", "module_errors", "model_patches", "stuck")

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
        modules: tuple[str, ...] | Callable[[], Iterable[str]] = (),
        patch_module: Callable[[Any, ShimPatches], list[str] | None] | None = None,
        in_use: Callable[[], str] | None = None,
        apply_to_model: Callable[[Any, PatchSet], bool] | None = None,
        state: State = State.WAITING,
        reason: str = "",
        patches: PatchSet | None = None,
        module_patches: dict[str, ShimPatches] | None = None,
        patched: list[str] | None = None,
        module_errors: dict[str, str] | None = None,
        model_patches: list[PatchSet] | None = None,
        stuck: list[PatchSet] | None = None,
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
        self.modules = modules
        self.patch_module = patch_module
        self.in_use = in_use
        self.apply_to_model = apply_to_model
        # runtime state, owned by the registry
        self.state = state
        self.reason = reason
        self.patches = PatchSet() if patches is None else patches
        #: module name -> its patches, for shims with ``patch_module``
        self.module_patches: dict[str, ShimPatches] = {} if module_patches is None else module_patches
        #: what ``patch_module`` returned, over every module
        self.patched: list[str] = [] if patched is None else patched
        #: module name -> why it kept its native code (``patch_module`` raised)
        self.module_errors: dict[str, str] = {} if module_errors is None else module_errors
        self.model_patches: list[PatchSet] = [] if model_patches is None else model_patches
        #: patches a revert could not remove (another library wrapped over them): still recorded,
        #: their wrappers inert, tried again by every revert
        self.stuck: list[PatchSet] = [] if stuck is None else stuck

    def module_names(self) -> list[str]:
        return list(self.modules() if callable(self.modules) else self.modules)

    def status(self) -> dict[str, Any]:
        reason = self.reason
        state = self.state.value
        if self.patch_module is not None and self.state == State.APPLIED:
            _import_hooks.flush_pending()
            in_use = self.in_use() if self.in_use is not None else ""
            done = [p for p in self.patched if not p.startswith("not needed")]
            notes = [p for p in self.patched if p.startswith("not needed")]
            if in_use:
                reason = in_use
            elif done:
                reason = "patched " + ", ".join(done) + ("; " + "; ".join(notes) if notes else "")
            elif notes:
                state = State.NOT_NEEDED.value
                reason = "; ".join(n[len("not needed"):].lstrip(": ") for n in notes)
            else:  # hooked, none of its modules imported yet
                state = State.WAITING.value
                reason = "waiting for " + _one_of(self.module_names())
            if self.module_errors:
                reason += "; failed: " + "; ".join(f"{m}: {e}" for m, e in self.module_errors.items())
        elif self.in_use is not None and self.state == State.APPLIED:
            reason = self.in_use() or reason
        elif self.state == State.WAITING and _config.settings.disabled:
            # never activated (LIGER_COMPAT_DISABLE=1 at import): nothing waits for an import
            state, reason = State.DISABLED.value, _config.off_reason()
        elif self.state == State.WAITING and not reason:
            reason = f"waiting for {self.trigger}"
        if self.stuck and self.state != State.APPLIED:
            left = ", ".join(f"{type(p.owner).__name__ if not isinstance(p.owner, type) else p.owner.__name__}.{p.name}"
                             for ps in self.stuck for p in ps)
            reason = (f"{reason}; " if reason else "") + (
                f"could not remove {left or 'a patch'} (another library wrapped over it): left in place, inert")
        return {
            "id": self.id,
            "library": self.library,
            "target": self.target,
            "state": state,
            "reason": reason,
            "versions": self.versions or "any",
            "fixes": list(self.fixes),
            "upstream": self.upstream,
            "kernels": list(self.kernels),
            "description": self.description,
        }


def _one_of(modules: list[str]) -> str:
    if not modules:
        return "a target module"
    if len(modules) == 1:
        return modules[0]
    return f"one of {len(modules)} modules ({modules[0]}, ...)"


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
        self._module_hooks: dict[str, Callable[[Any], None]] = {}
        self._lock = threading.RLock()
        self.conflicts: list[Conflict] = []
        self.load_errors: list[str] = []  # shim modules that failed to import
        self.active = False  # hooks fire only while active
        #: models given to ``apply(model=...)``: patched again by every later ``apply()`` (after a
        #: revert, or a new kernel selection from ``configure``)
        self._models: weakref.WeakSet[Any] = weakref.WeakSet()
        self._unweakable_models: list[Any] = []

    # -- registration -----------------------------------------------------------------------
    def register(self, shim: Shim) -> Shim:
        with self._lock:
            if shim.id in self._shims:
                raise ValueError(f"shim id {shim.id!r} registered twice")
            if (shim._apply is None) == (shim.patch_module is None):
                raise ValueError(f"shim {shim.id!r} needs exactly one of _apply and patch_module")
            self._shims[shim.id] = shim
            if self.active:
                self._hook(shim.trigger)
                mod = sys.modules.get(shim.trigger)
                if mod is not None and shim.state != State.APPLIED:  # a trigger hooked earlier fires no more
                    self._apply_one(shim, mod)
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
                if shim._apply is not None:
                    shim._apply(module, shim.patches)
                else:
                    shim.state = State.APPLIED  # the hooks below may fire at once
                    for name in shim.module_names():
                        _import_hooks.when_imported(name, self._module_hook(shim.id))
            except Exception as exc:
                errors = self._revert_modules(shim) + self._revert_set(shim, shim.patches)  # nothing half-applied
                if len(shim.patches):
                    shim.patches = PatchSet()
                shim.state = State.FAILED
                shim.reason = f"{type(exc).__name__}: {exc}" + (f" (revert: {errors})" if errors else "")
                log.warning("liger_compat: shim %s failed, native behaviour kept: %s", shim.id, shim.reason)
                import traceback

                log.debug("%s", traceback.format_exc())
                return
            shim.state, shim.reason = State.APPLIED, ""

    def _module_hook(self, shim_id: str) -> Callable[[Any], None]:
        """The one hook object per shim (a hook registered again is kept once)."""
        hook = self._module_hooks.get(shim_id)
        if hook is None:
            hook = self._module_hooks[shim_id] = functools.partial(self._on_module, shim_id)
        return hook

    def _on_module(self, shim_id: str, module: Any) -> None:
        """Patch one of a shim's ``modules`` (a post-import hook: never raises)."""
        shim = self._shims.get(shim_id)
        name = getattr(module, "__name__", "?")
        with self._lock:
            if shim is None or shim.state != State.APPLIED or name in shim.module_patches:
                return
            ps = ShimPatches(shim.id, list(self._shims).index(shim.id))
            try:
                done = shim.patch_module(module, ps) or []
            except Exception as exc:
                errs = ps.revert()
                shim.module_errors[name] = f"{type(exc).__name__}: {exc}" + (f" (revert: {errs})" if errs else "")
                log.warning("liger_compat: shim %s left %s native: %s", shim.id, name, shim.module_errors[name])
                return
            shim.module_errors.pop(name, None)
            shim.module_patches[name] = ps
            shim.patched.extend(done)

    @staticmethod
    def _revert_set(shim: Shim, ps: PatchSet) -> list[str]:
        """Revert ``ps``; what stays in place is kept in ``shim.stuck``, inert."""
        errors = ps.revert()
        if len(ps) and all(ps is not other for other in shim.stuck):
            shim.stuck.append(ps)
        return errors

    def _revert_modules(self, shim: Shim) -> list[str]:
        errors: list[str] = []
        for ps in reversed(list(shim.module_patches.values())):
            errors += self._revert_set(shim, ps)
        shim.module_patches.clear()
        shim.patched.clear()
        shim.module_errors.clear()
        return errors

    def apply(self, model: Any = None) -> None:
        """Activate hooks, apply every shim whose trigger is imported, then patch ``model``."""
        self.activate()
        for shim in self.shims():
            mod = sys.modules.get(shim.trigger)
            if mod is not None and shim.state != State.APPLIED:
                self._apply_one(shim, mod)
        for known in list(self._models) + self._unweakable_models:
            if known is not model:
                self.apply_model(known)
        if model is not None:
            self.apply_model(model)

    def apply_model(self, model: Any) -> list[str]:
        """Instance-level patches, made again by every later :meth:`apply`. Returns the ids of
        shims that patched something."""
        done: list[str] = []
        if _config.settings.disabled:
            return done
        try:
            self._models.add(model)
        except TypeError:  # not weakly referenceable: kept while the process lives
            if all(model is not m for m in self._unweakable_models):
                self._unweakable_models.append(model)
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
                self._revert_set(shim, ps)
                log.warning("liger_compat: shim %s could not patch the model: %s", shim.id, exc)
        return done

    def revert(self) -> list[str]:
        """Undo every patch (classes and instances) and stop the hooks. Returns errors."""
        errors: list[str] = []
        with self._lock:
            self.active = False
            for shim in reversed(self.shims()):
                earlier = list(shim.stuck)
                for ps in reversed(shim.model_patches):
                    errors += self._revert_set(shim, ps)
                shim.model_patches.clear()
                if shim.state == State.APPLIED:
                    errors += self._revert_one(shim, "liger_compat.revert()")
                elif shim.state in (State.WAITING, State.FAILED, State.NOT_NEEDED):
                    shim.state, shim.reason = State.REVERTED, "liger_compat.revert()"
                for ps in earlier:  # left in place by an earlier revert: tried again, after the newer ones
                    errors += ps.revert()
                    if not len(ps):
                        shim.stuck.remove(ps)
        return errors


    def _revert_one(self, shim: Shim, reason: str) -> list[str]:
        errors = self._revert_modules(shim)
        if shim._revert is not None:
            try:
                shim._revert()
            except Exception as exc:
                errors.append(f"{shim.id}: {exc}")
        errors += self._revert_set(shim, shim.patches)
        if len(shim.patches):
            shim.patches = PatchSet()
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

