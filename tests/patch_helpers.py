"""Helpers shared by the model and trainer tests (importable from any test folder: pytest puts
``tests/`` on ``sys.path`` to load ``tests/conftest.py``)."""

from __future__ import annotations

import contextlib

import liger_compat
from liger_compat import _config


@contextlib.contextmanager
def native():
    """Every liger_compat patch removed inside the block, re-applied after it."""
    errors = liger_compat.revert()
    assert not errors, errors
    try:
        yield
    finally:
        liger_compat.apply()


#: the families the detailed contract tests (tests/models/test_causal_lm.py, test_modules.py, the
#: Trainer evaluate / predict test) run on; every family of the table gets the parity tests of
#: tests/models/test_families.py
CORE_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "olmo2",
                 "granite")


def all_kernels_active():
    """A fixture body (``pytest.fixture(autouse=True)(all_kernels_active)`` in a conftest): the test
    starts with liger_compat active and every kernel selected, and the settings go back after it."""
    s = _config.settings
    saved = (s.disabled, s.kernels, dict(s.source))
    s.disabled, s.kernels = False, frozenset(_config.ALL_KERNELS)
    liger_compat.apply()
    yield
    s.disabled, s.kernels, s.source = saved[0], saved[1], saved[2]
    liger_compat.apply()
