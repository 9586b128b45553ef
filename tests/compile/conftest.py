"""torch.compile tests: liger_compat active with every kernel selected, one intra-op thread."""

from __future__ import annotations

import pytest

from patch_helpers import all_kernels_active

_patched = pytest.fixture(autouse=True)(all_kernels_active)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch

    torch._dynamo.reset()
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models on a shared machine: steadier and not slower
    yield
    torch.set_num_threads(before)
    torch._dynamo.reset()
