"""Kernel-test setup: tests marked ``gpu`` in this folder are skipped without CUDA."""

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and _HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)
