"""The suite's own promise (tests/conftest.py): a test's unseeded torch draws depend on its id and
``LIGER_COMPAT_TEST_SEED`` only, not on what ran before it in the same worker."""

from __future__ import annotations

import os
import zlib

import pytest

torch = pytest.importorskip("torch")


def _expected(request, n: int) -> torch.Tensor:
    base = int(os.environ.get("LIGER_COMPAT_TEST_SEED", "0"))
    g = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()) ^ base)
    return torch.randn(n, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("run", [0, 1])
def test_unseeded_draws_are_those_of_the_tests_id(request, run):
    # the second case runs after the first has moved the generator on: it still starts where its id says
    got = torch.randn(5, dtype=torch.float64)
    torch.randn(1000)
    assert torch.equal(got, _expected(request, 5))
