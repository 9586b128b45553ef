"""Shared pytest setup: GPU tests are skipped without CUDA; Hypothesis runs a fixed example set.

Property tests draw their examples deterministically (``derandomize``), so a CI run and a rerun
see the same inputs and a failure always reproduces; ``HYPOTHESIS_PROFILE=explore`` draws fresh
random examples instead (for hunting new failures locally).

Each test starts with torch's global generator seeded from its own id (and ``LIGER_COMPAT_TEST_SEED``,
0 unless set), so what a test draws without a generator of its own (a module's default init, an
unseeded ``torch.randn``) does not depend on which tests ran before it in the same pytest-xdist worker:
a failure reproduces alone, and a CI run sees the inputs a local run saw. Tests that want a fresh seed
every run draw one with ``random.randrange`` and put it in their failure message.

Under pytest-xdist with several workers, each worker (and every process it starts) runs torch on one
CPU thread: the workers already fill the cores, and torch's default of one OpenMP thread a core
oversubscribes them. Its threads then spin-wait on each other across processes, and the many tiny ops
of these tests ran about 14 times slower (tests/models/test_families.py with -n 2 on 2 cores: 189 s
against 13 s).
"""

from __future__ import annotations

import os

if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported: its thread pool reads it once

import zlib
from pathlib import Path

import pytest
from hypothesis import settings
from suite_scope import skip_what_the_main_run_passed

settings.register_profile("fixed", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))


def _trl_head_kernels_interpreted_on_cpu() -> None:
    """Make the unpatched trl 1.15.0 computable on this CPU machine, as a reference.

    trl 1.15.0's fused LM head launches its Triton kernels on CPU tensors (``RuntimeError: 0 active
    drivers``; trl 1.16.0 checks the device first: known issue ``trl-head-on-cpu``), so every test
    comparing a patched trainer with the unpatched one would have no native side. Triton decides
    between compiled and interpreted kernels when a ``@triton.jit`` function is defined, so trl's
    kernel modules are imported here once with ``TRITON_INTERPRET=1``: the native reference then runs
    trl's own kernels, unchanged, through Triton's CPU interpreter. liger_compat's kernels are not
    affected (they choose their path on every call). ``tests/trainers/test_trl_head_on_cpu.py`` proves
    the failure itself in a fresh process.
    """
    from importlib import metadata

    try:
        if metadata.version("trl") != "1.15.0":
            return
        import torch

        if torch.cuda.is_available():
            return
    except (metadata.PackageNotFoundError, ImportError):
        return
    import importlib

    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        # Triton's own jit-decorated library functions (tl.sum, ...) are called from trl's kernels, so
        # they are defined in the same mode (this module runs before anything imports Triton; nothing
        # in a CPU pytest run executes compiled Triton code)
        for name in ("triton.language.standard", "triton.experimental.gluon.language",
                     "trl.kernels.chunked_logprob", "trl.kernels.logprob_entropy", "trl.kernels.chunked_divergence"):
            try:
                importlib.import_module(name)
            except ImportError:
                if name.startswith("trl."):
                    raise
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


_trl_head_kernels_interpreted_on_cpu()


def pytest_collection_modifyitems(config, items):
    skip_what_the_main_run_passed(items)
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


#: the test directories that check the kernels' math: on CPU through their torch references
_KERNEL_SUITES = {"models", "compile", "kernels"}


@pytest.fixture(autouse=True)
def _kernel_references_on_cpu(request, monkeypatch):
    """In tests/models, tests/compile and tests/kernels, ``LIGER_COMPAT_CPU_NATIVE`` is off: on CPU
    tensors the patched modules and the fused loss run the kernels' torch references (the math the
    Triton kernels implement, which the interpreter tests check against the same references), not
    transformers' own code, so that comparing them with the unpatched library tests something.
    A test marked ``cpu_native`` keeps the default, the path a CPU user gets. The other suites
    (trainers, launcher, distributed, foundation) run with the default."""
    here = Path(str(request.node.fspath)).resolve().parent
    if here.name not in _KERNEL_SUITES or request.node.get_closest_marker("cpu_native") is not None:
        yield
        return
    from liger_compat import _config

    monkeypatch.setattr(_config.settings, "cpu_native", False)
    yield


@pytest.fixture(autouse=True)
def _torch_seed_of_this_test(request):
    """torch's global generator seeded from the test's id (see the module's docstring)."""
    try:
        import torch
    except ImportError:
        yield
        return
    base = int(os.environ.get("LIGER_COMPAT_TEST_SEED", "0"))
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()) ^ base)
    yield
