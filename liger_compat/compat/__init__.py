"""Version and feature detection, the known-issue registry and the ``check()`` report.

Nothing in here patches anything: it reads package metadata, probes the device and walks
the shim registry.
"""

from __future__ import annotations

from typing import Any

from .known_issues import KNOWN_ISSUES, KnownIssue  # noqa: F401
from .versions import installed, matches  # noqa: F401


def check(deep: bool = False, *, quiet: bool = False, device: str | None = None, progress: Any = None,
          file: Any = None, verbose: bool = False):
    """Build the diagnostic report, print it (to ``file``, default stdout) and return it.

    The printed report fits a screen: shims, model families, known issues and scenarios counted by
    state, with a row for each that needs attention; ``verbose=True`` prints every row.
    ``quiet=True`` only returns it (programmatic callers, the CLI's ``--json``). ``deep=True`` also
    runs the registered scenario smoke tests on a tiny random model on ``device`` (default:
    ``cuda`` when available, else ``cpu``). The returned
    :class:`~liger_compat.compat.report.Report` prints as a table and has ``to_dict()``,
    ``to_json()``, ``ok`` and ``exit_code``.
    """
    from . import report, scenarios

    ctx = None
    if deep:
        if device is None:
            from .device import detect

            device = "cuda" if detect().cuda_available else "cpu"
        ctx = scenarios.Context(device=device)
    r = report.build(deep=deep, ctx=ctx, progress=progress)
    if not quiet:
        r.print(file, verbose=verbose)
    return r
