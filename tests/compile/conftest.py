"""torch.compile tests: liger_compat active with every kernel selected, one intra-op thread, the fused
loss's op traced at the tiny models' sizes too (below its size bound a compiled step keeps the
native loss where a kernel would run: on a GPU, under ``TRITON_INTERPRET=1``)."""

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


@pytest.fixture(autouse=True)
def _fused_loss_at_tiny_sizes(monkeypatch):
    from liger_compat.shims import causal_lm

    monkeypatch.setattr(causal_lm, "COMPILED_NATIVE_LOSS_MAX_MACS", 0)
