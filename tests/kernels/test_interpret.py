"""The Triton kernels themselves, run by Triton's CPU interpreter (``TRITON_INTERPRET=1``).

Triton picks interpreted vs compiled kernels when ``@triton.jit`` runs, i.e. at import, so the
kernel test modules are re-run in a fresh subprocess with the variable set. There the tests
assert that the dispatch chose ``"triton"`` (``harness.expected_backend``), so a silent fallback
to the torch reference would fail. Shapes are the small hypothesis shapes of those modules,
with fewer examples.

They depend on torch and Triton only (the kernels import no other library), so a grid cell on
the torch and Triton of CI's passed main run skips them, as every test of tests/kernels
(``STACK_ONLY_DIRS`` in tests/suite_scope.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
#: a module takes 10-60 s alone; a busy 2-core machine (the other pytest worker, another job) has
#: taken 5x that: the limit only catches a hang
INTERPRETER_TIMEOUT_S = 1800
ROOT = HERE.parent.parent


@pytest.mark.interpret
@pytest.mark.parametrize("module", ["test_cross_entropy.py", "test_target_errors.py", "test_elementwise.py", "test_recompute.py",
                                    "test_lowmem.py", "test_lowmem_sparsity.py", "test_sparse_chunked.py", "test_peaked_rows.py", "test_target_terms.py",
                                    "test_logprob.py", "test_shift_target.py"])
def test_triton_kernels_under_interpreter(module):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", LIGER_COMPAT_TEST_EXAMPLES="4", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W", "ignore", str(HERE / module)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=INTERPRETER_TIMEOUT_S,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.split("\n")[-2], tail
