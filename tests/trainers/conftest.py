from __future__ import annotations

import logging

import pytest

from liger_compat.shims import _tiny_text as tiny


@pytest.fixture(scope="session")
def tokenizer():
    return tiny.build_tokenizer()


@pytest.fixture(autouse=True)
def _quiet_libraries():
    for name in ("transformers", "trl", "accelerate", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    yield
