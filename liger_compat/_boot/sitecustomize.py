"""Start-up file of ``liger-compat run`` and ``liger-compat enable``: activates liger_compat in
the Python process that runs it.

``liger-compat run`` puts this file's directory first on ``PYTHONPATH``, so every Python the
command starts, children included, imports it as ``sitecustomize`` when it starts (``site``
does). It imports liger_compat; then it takes its directory off ``sys.path`` and runs the
``sitecustomize`` it shadows, if the rest of ``sys.path`` has one, as that module (its own
``__name__``, ``__file__`` and ``__spec__``; ``sys.modules["sitecustomize"]`` is that module
afterwards, and its errors are reported by ``site`` as they would be without us).

The ``.pth`` line that ``liger-compat enable`` writes runs this file under another name: then
it only activates.

A Python without liger_compat is left alone. Any other failure to activate is reported in one
line on stderr, what was patched is reverted, and the program runs natively. Standard library
only, ASCII, and syntax every Python 3 parses: it runs in whatever Python the command starts.
"""

import os
import sys


def _report(exc):
    text = ("%s: %s" % (type(exc).__name__, exc)).replace("\n", " ")
    sys.stderr.write("liger-compat: not active in this process (pid %d), it runs natively: %s\n"
                     % (os.getpid(), text))
    registry = sys.modules.get("liger_compat.shims._registry")
    try:
        registry.REGISTRY.revert()
    except Exception:
        pass


def activate(way):
    """Import liger_compat and record ``way`` as what activated it."""
    try:
        import liger_compat._activation
        liger_compat._activation.record(way)
    except ImportError as exc:
        if getattr(exc, "name", None) != "liger_compat":  # else: not installed for this Python
            _report(exc)
    except Exception as exc:
        _report(exc)


def _chain():
    # site has made the entries absolute; the launcher puts this directory resolved on PYTHONPATH
    here = os.path.normcase(os.path.dirname(os.path.abspath(__file__)))
    rest = [p for p in sys.path if os.path.normcase(os.path.abspath(p or os.curdir)) != here]
    sys.path[:] = rest
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    from importlib.util import module_from_spec

    module = module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if __name__ == "sitecustomize":
    activate("launcher")
    _chain()
elif __name__ == "liger_compat_startup":
    activate("startup file")
