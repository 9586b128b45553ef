"""Helpers shared by the model and trainer tests (importable from any test folder: pytest puts
``tests/`` on ``sys.path`` to load ``tests/conftest.py``)."""

from __future__ import annotations

import contextlib

import liger_compat


@contextlib.contextmanager
def native():
    """Every liger_compat patch removed inside the block, re-applied after it."""
    errors = liger_compat.revert()
    assert not errors, errors
    try:
        yield
    finally:
        liger_compat.apply()
