"""Test knobs shared by the kernel tests.

The same test modules run twice: in the normal session on the torch reference, and in a
subprocess with ``TRITON_INTERPRET=1`` (see ``test_interpret.py``) where the dispatch must pick
the Triton path. ``LIGER_COMPAT_TEST_EXAMPLES`` caps hypothesis examples in that subprocess.
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def expected_backend() -> str:
    return "triton" if interpreting() else "torch"


def examples(n: int) -> int:
    cap = os.environ.get("LIGER_COMPAT_TEST_EXAMPLES")
    return min(n, int(cap)) if cap else n
