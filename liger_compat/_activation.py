"""How liger_compat came to be active in this process, for ``check()``.

Three ways: a script's own ``import liger_compat`` (the default when nothing else is recorded),
``liger-compat run`` (its start-up ``sitecustomize`` records ``launcher``), and the start-up file
that ``liger-compat enable`` installs (``startup file``). The first record wins: a script that
imports liger_compat under the launcher does not change the answer. Standard library only, as
it is imported by every process the launcher starts.
"""

from __future__ import annotations

import os
import sys
from typing import Any

#: what activated liger_compat in this process, and the pid of the process it happened in
#: (a forked child, a dataloader worker say, inherits both)
how: str = "import"
pid: int = os.getpid()
_recorded = False

#: where the report reads a rank from, when a launcher set it
RANK_VARIABLES: tuple[str, ...] = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                   "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")

WAYS = {
    "import": "import liger_compat",
    "launcher": "liger-compat run",
    "startup file": "the start-up file of liger-compat enable",
}


def record(way: str) -> None:
    """Note that ``way`` (a key of :data:`WAYS`) activated liger_compat in this process; only the
    first call counts."""
    global how, pid, _recorded
    if way not in WAYS:
        raise ValueError(f"way must be one of {', '.join(WAYS)}, got {way!r}")
    if not _recorded:
        how, pid, _recorded = way, os.getpid(), True


def describe() -> dict[str, Any]:
    """``how`` and ``by`` (in words), the activating ``pid``, this process (``process``: pid,
    executable, argv) and the rank variables that are set."""
    return {
        "how": how,
        "by": WAYS[how],
        "pid": pid,
        "process": {"pid": os.getpid(), "executable": sys.executable, "argv": list(getattr(sys, "argv", []))},
        "ranks": {k: os.environ[k] for k in RANK_VARIABLES if k in os.environ},
    }
