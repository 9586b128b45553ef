"""Model-shim tests: every test starts with liger_compat active and all kernels selected."""

from __future__ import annotations

import pytest

from patch_helpers import all_kernels_active

_patched = pytest.fixture(autouse=True)(all_kernels_active)
