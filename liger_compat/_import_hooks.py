"""Post-import hooks: call a function once a named module has been imported, whenever that happens.

The one mechanism every shim uses to patch a library when, and only when, it is imported (before or
after ``liger_compat``). It is written against the standard library alone because it runs at
``import liger_compat``: wrapt's ``register_post_import_hook`` does the same job, but ``import wrapt``
2.5 imports ``asyncio`` (and with it ``socket``, ``logging``, ``traceback`` ...), which would be paid
by every script that merely imports us. wrapt is imported by the shims when they patch, i.e. once a
target library is imported, where its cost disappears in that library's own import.

How it works: a finder at the front of ``sys.meta_path`` answers only for watched names. It asks the
finders behind it for the real spec and hands the import system a loader that runs the real loader's
``exec_module`` and then the callbacks, with the module fully executed. ``module.__loader__`` and
``module.__spec__.loader`` are the real loader again before the module's code runs.

A hook registered for a module that is in ``sys.modules`` but still executing (a watched package
imported from inside its own import) cannot ride on that import any more: it is kept pending and run
by :func:`flush_pending` (called on every later hook dispatch and before a report is made).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

Callback = Callable[[Any], None]

_lock = threading.RLock()
#: module name -> callbacks, in registration order
_callbacks: dict[str, list[Callback]] = {}
#: watched modules that were mid-import when a hook was registered for them
_pending: set[str] = set()
_finding = threading.local()


def _initializing(module: Any) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _fire(name: str, module: Any) -> None:
    with _lock:
        callbacks = list(_callbacks.get(name, ()))
    for cb in callbacks:
        cb(module)


def flush_pending() -> None:
    """Run the hooks of watched modules that were mid-import at registration and have finished since."""
    with _lock:
        done = [n for n in _pending if n in sys.modules and not _initializing(sys.modules[n])]
        _pending.difference_update(done)
    for name in done:
        _fire(name, sys.modules[name])


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once module ``name`` is imported: at once if it already is, else right
    after its import has executed it. A callback registered again for the same name is kept once
    (later imports call it once) but is still called at once when the module is already imported:
    that is how a shim re-applies after ``revert()``, so callbacks must be idempotent."""
    with _lock:
        cbs = _callbacks.setdefault(name, [])
        if callback not in cbs:
            cbs.append(callback)
        _install()
        module = sys.modules.get(name)
        if module is not None and _initializing(module):
            _pending.add(name)
            return
    if module is not None:
        callback(module)


def watched() -> list[str]:
    """The module names hooks are registered for (for the report and the tests)."""
    with _lock:
        return sorted(_callbacks)


class _Loader:
    """Runs the real loader, then the hooks of the module's name."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, attr: str) -> Any:  # get_source, is_package, get_resource_reader ...
        return getattr(self.loader, attr)

    def create_module(self, spec: Any) -> Any:
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self.loader
        spec = getattr(module, "__spec__", None)
        if spec is not None:
            spec.loader = self.loader
        self.loader.exec_module(module)
        flush_pending()
        _fire(module.__name__, sys.modules.get(module.__name__, module))


class _Finder:
    """Finds nothing itself: wraps the loader of a watched module found by the finders behind it."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _callbacks:
            return None
        busy = getattr(_finding, "names", None)
        if busy is None:
            busy = _finding.names = set()
        if fullname in busy:
            return None
        busy.add(fullname)
        try:
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            busy.discard(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module") or isinstance(loader, _Loader):
            return spec  # a namespace package or a legacy loader: imported without hooks
        spec.loader = _Loader(loader)
        return spec

    def invalidate_caches(self) -> None:
        pass


_FINDER = _Finder()


def _install() -> None:
    if not any(f is _FINDER for f in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)
