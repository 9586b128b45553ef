"""Model-shim tests: every test starts with liger_compat active and all kernels selected."""

from __future__ import annotations

import pytest

import liger_compat
from liger_compat import _config


@pytest.fixture(autouse=True)
def _patched():
    """Every test starts with liger_compat active and all kernels selected, and leaves it so."""
    s = _config.settings
    saved = (s.disabled, s.kernels, dict(s.source))
    s.disabled, s.kernels = False, frozenset(_config.ALL_KERNELS)
    liger_compat.apply()
    yield
    s.disabled, s.kernels, s.source = saved[0], saved[1], saved[2]
    liger_compat.apply()
