"""Defer a costly stdlib import that ``import liger_compat`` would otherwise pay for.

wrapt (whose ``register_post_import_hook`` installs our hooks) runs ``import importlib.metadata``
at the top of ``wrapt.importer``, and ``importlib.metadata`` pulls in ``email``, ``csv``,
``zipfile``, ``socket``, ``datetime`` ...: about 25 ms of the ~60 ms ``import liger_compat`` cost,
for a module that wrapt only uses when asked to discover entry-point hooks and that liger_compat
only reads in ``check()`` / when a hook fires (transformers and torch load it anyway).

:func:`defer` puts a module object for ``name`` in ``sys.modules`` whose code has not run yet: it
runs, in that same module object, on the first access to an attribute the module does not have
yet (PEP 562 module ``__getattr__``), or on ``dir()``. ``__spec__``, ``__name__``, ``__path__``
and ``__file__`` are set up front, so ``import importlib.metadata`` statements (which read
``__spec__``) do not trigger the load; ``from importlib.metadata import version``,
``importlib.metadata.entry_points(...)`` and the like do. Attributes set on the module before it
loaded (a test's stub ``version``, say) are kept over the module's own, as with
``importlib.util.LazyLoader``.

Why not ``importlib.util.LazyLoader`` itself: its lazy module loads on *any* attribute access,
``__spec__`` included, and the import system reads ``__spec__`` of a module it finds in
``sys.modules``, so wrapt's own ``import importlib.metadata`` statement would load it at once.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from typing import Any


def defer(name: str) -> None:
    """Make ``name`` (a top-level stdlib module or package, or a submodule of an already imported
    one) load on first use instead of now. Does nothing when it is already imported or not found."""
    if name in sys.modules:
        return
    parent_name, _, child = name.rpartition(".")
    parent = sys.modules.get(parent_name) if parent_name else None
    if parent_name and parent is None:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return
    module = importlib.util.module_from_spec(spec)
    lock = threading.RLock()
    loading = threading.local()

    def load() -> None:
        with lock:
            ns = module.__dict__
            if ns.get("__getattr__") is not __getattr__:
                return  # another thread loaded it while this one waited
            if getattr(loading, "active", False):
                raise AttributeError  # the module's own code probing itself mid-load (hasattr)
            kept = {k: v for k, v in ns.items() if k not in before or before[k] is not v}
            loading.active = True
            try:
                spec.loader.exec_module(module)
            except BaseException:
                if sys.modules.get(name) is module:  # as for a failed import: try afresh next time
                    del sys.modules[name]
                raise
            finally:
                loading.active = False
            ns.update(kept)
            for hook, ours in (("__getattr__", __getattr__), ("__dir__", __dir__)):
                if ns.get(hook) is ours:
                    del ns[hook]

    def __getattr__(attr: str) -> Any:
        try:
            load()
        except AttributeError:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}") from None
        return getattr(module, attr)

    def __dir__() -> list[str]:
        load()
        return dir(module)

    module.__getattr__ = __getattr__
    module.__dir__ = __dir__
    before = dict(module.__dict__)
    sys.modules[name] = module
    if parent is not None:
        setattr(parent, child, module)
