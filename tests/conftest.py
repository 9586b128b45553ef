"""Shared pytest setup: GPU tests are skipped without CUDA; Hypothesis runs a fixed example set.

Property tests draw their examples deterministically (``derandomize``), so a CI run and a rerun
see the same inputs and a failure always reproduces; ``HYPOTHESIS_PROFILE=explore`` draws fresh
random examples instead (for hunting new failures locally).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("fixed", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
