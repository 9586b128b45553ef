"""torch.compile tests: liger_compat active with every kernel selected, one intra-op thread."""

from __future__ import annotations

import pytest

import liger_compat
from liger_compat import _config


@pytest.fixture(autouse=True)
def _patched():
    s = _config.settings
    saved = (s.disabled, s.kernels, dict(s.source))
    s.disabled, s.kernels = False, frozenset(_config.ALL_KERNELS)
    liger_compat.apply()
    yield
    s.disabled, s.kernels, s.source = saved[0], saved[1], saved[2]
    liger_compat.apply()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch

    torch._dynamo.reset()
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models on a shared machine: steadier and not slower
    yield
    torch.set_num_threads(before)
    torch._dynamo.reset()
