"""The package's logger (``logging.getLogger("liger_compat")``), looked up on first use.

``import logging`` brings ``traceback``, ``string`` and ``textwrap`` along: ~8 ms of the budget
for ``import liger_compat`` (under 50 ms, benchmarks/overhead.py), paid by every process even
though most never log anything. Modules write ``log.warning(...)`` as with a real logger.
"""

from __future__ import annotations

from typing import Any


class _LazyLogger:
    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        import logging

        return getattr(logging.getLogger("liger_compat"), name)

    def __repr__(self) -> str:
        return "<liger_compat logger, created on first use>"


log = _LazyLogger()
