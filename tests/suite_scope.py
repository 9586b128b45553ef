"""Which tests a grid cell runs after CI's main run has passed (used by tests/conftest.py, and by
``.ci/run`` for :func:`stack_id`).

A plain module, not a conftest: several conftest modules of this suite share that name, so a test
importing ``conftest`` could get another one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

#: Set by ``.ci/run`` once its main run (the whole suite on the newest releases) has passed, to the
#: torch and Triton it ran on (``stack_id()``); ``tox.ini`` passes it into the grid's cells.
MAIN_RUN_ENV = "LIGER_COMPAT_MAIN_RUN_PASSED_ON"

#: Tests whose outcome depends on nothing a grid cell pins (transformers, trl, accelerate, datasets,
#: peft, liger-kernel, torch): the repository's own data and tools. A cell run after a passed main
#: run skips them. Paths relative to tests/; why each is here:
MAIN_RUN_ONLY = {
    "test_matrix.py": "the version grid's data, tox.ini / README generation",
    "test_ranges.py": "shim version ranges against the grid's data",
    "test_advice.py": "check()'s advice, from the grid's data with versions given by the tests",
    "foundation/test_docs.py": "generated sections of the README and docs",
    "foundation/test_layers.py": "the package's import structure, read from the source",
    "foundation/test_test_seed.py": "the suite's own per-test seeding",
    "foundation/test_main_run_skips.py": "this skip rule itself",
    "foundation/test_benchmark_tools.py": "the benchmarks' own logic (they run on the GPU machine's releases)",
    "foundation/test_benchmark_regimes.py": "the benchmarks' logit regimes",
}

#: Directories whose tests depend on Python, torch and Triton only (the kernels import no other
#: library; ``foundation/test_layers.py`` checks it for the package and these test modules): a cell
#: on the torch and Triton of the passed main run skips them, a cell of the torch axis runs them.
STACK_ONLY_DIRS = {"kernels"}


def stack_id() -> str:
    """What the stack-only tests' outcome depends on besides our code: ``torch==X triton==Y``."""
    import torch

    try:
        import triton

        tri = triton.__version__
    except ImportError:
        tri = None
    return f"torch=={torch.__version__} triton=={tri}"


def _suite_path(item) -> str:
    return Path(str(item.fspath)).resolve().relative_to(TESTS).as_posix()


def skip_what_the_main_run_passed(items) -> None:
    """In a grid cell after CI's passed main run: skip the tests that cannot tell this cell from it."""
    passed_on = os.environ.get(MAIN_RUN_ENV)
    if not passed_on:
        return
    same_stack = passed_on == stack_id()
    for item in items:
        path = _suite_path(item)
        if path in MAIN_RUN_ONLY:
            item.add_marker(pytest.mark.skip(reason=f"passed in CI's main run; depends on no pinned library "
                                                    f"({MAIN_RUN_ONLY[path]})"))
        elif same_stack and (path.split("/")[0] in STACK_ONLY_DIRS or "stack_only" in item.keywords):
            item.add_marker(pytest.mark.skip(reason=f"passed in CI's main run on {passed_on}; depends on "
                                                    "Python, torch and Triton only"))
