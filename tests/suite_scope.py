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
#: peft, liger-kernel, torch): the repository's own data and tools, our settings' parsing; and the one
#: test that measures seconds, run once (its machine-independent twin runs everywhere). A cell run
#: after a passed main run skips them. Paths relative to tests/; why each is here:
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
    "launcher/test_startup_file.py": "the launcher's start-up file (written, found, removed; no library imported)",
    # the launcher's own process handling: each command is `python -c` code or `sh`, importing no pinned library
    "launcher/test_run.py::test_options_reach_every_process_as_settings": "the launcher's options as settings",
    "launcher/test_run.py::test_bad_option_is_a_usage_error_and_nothing_runs": "the launcher's usage errors",
    "launcher/test_run.py::test_exit_code_and_signals_pass_through": "the launcher's exit codes and signals",
    "launcher/test_run.py::test_existing_sitecustomize_still_runs": "the launcher's start-up beside a sitecustomize",
    "launcher/test_run.py::test_a_broken_sitecustomize_is_reported_as_python_does": "the launcher's start-up",
    "launcher/test_run.py::test_bad_inherited_setting_is_reported_and_the_command_runs": "the launcher's settings",
    "launcher/test_run.py::test_non_python_and_python_without_the_package_are_left_alone": "the launcher's start-up",
    "launcher/test_run.py::test_nested_runs_put_the_start_up_directory_once": "the launcher's PYTHONPATH",
    "launcher/test_run.py::test_usage_page_shows_the_current_help": "the launcher's help text",
    # our settings' parsing and the CLI's usage errors, each case a fresh `python -c` process
    "foundation/test_report_cli.py::test_report_shows_the_tuning_settings_in_effect": "the tuning settings' parsing",
    "foundation/test_report_cli.py::test_kernels_env_and_configure": "the kernels setting's parsing",
    "foundation/test_report_cli.py::test_cli_usage_errors_exit_2": "the CLI's usage errors",
    "foundation/test_settings.py::test_check_shows_every_setting_with_its_value_and_source": "the settings' parsing",
    # LIGER_COMPAT_DISABLE: nothing is registered, so no pinned library's code is reached
    "foundation/test_report_cli.py::test_disable_env_turns_everything_off": "the off switch",
    "foundation/test_report_cli.py::test_disabled_report_says_everything_is_off_and_nothing_waits": "the off switch's report",
    "distributed/test_context.py::test_a_distributed_run_past_its_time_is_killed_with_every_process_below_it":
        "the test harness's process handling (a sleeping Python child under a Python parent)",
    # seconds, not work: measured once per CI run; the Python-call count beside it, which no clock
    # moves, guards every cell
    "models/test_host_syncs.py::test_tiny_model_cpu_step_close_to_native": "a CPU step's time against native's",
}

#: Integration tests that start fresh Python processes for a whole run (a trainer under torch.compile,
#: gloo ranks, trl's command line, a script under the launcher): the costliest of the suite (about
#: half a cell's CPU time on transformers 5.23). Their outcome depends on the pins, and the in-process
#: tests of every cell cover the same code paths (the forward, the loss, the trainers' kwargs, the
#: shims); after a passed main run, a CI cell runs them only where the grid labels it
#: ``ci-integration``: the two ends of the range, the oldest pinned pair and the newest pinned pair on
#: the torch axis's newest torch, where torch.compile and torch.distributed change (the main run is
#: the newest releases).
INTEGRATION_LABEL = "ci-integration"
INTEGRATION = {
    "trainers/test_compile_trainers.py": "Trainer / SFTTrainer with torch_compile, each side in its own process",
    "compile/test_compile.py": "torch.compile of the patched models, graph breaks and recompiles counted in fresh processes",
    "distributed/test_trainers_gloo.py": "Trainer / SFTTrainer over two gloo ranks",
    "distributed/test_gloo.py": "DDP / FSDP2 / ZeRO-3 steps over two gloo ranks",
    "distributed/test_tensor_parallel.py": "tensor parallelism (tp_plan, FSDP2 x TP) over two and four gloo ranks",
    "launcher/test_trl_cli.py": "trl's own command line under the launcher",
    "launcher/test_run.py": "training scripts under the launcher, against the same script run natively",
    "models/test_upstream_model_tests.py": "transformers' own model test mixin in three fresh pytest processes",
}

#: Tests that start a fresh Python process for what happens at import time or in a whole CLI run:
#: the import orders of liger_compat, transformers, trl and a modeling module; a modeling module
#: imported under another default device; when wrapt is imported; the CLI's report; the host reads
#: of a step under Triton's interpreter. Each costs a fresh interpreter importing torch and
#: transformers (3-6 s of CPU; together about half of a cell's CPU time beside its in-process tests
#: on transformers 5.23, once the tiny models ran at full speed). Their outcome turns on the pinned
#: libraries' import structure and module layout, which change with their major lines, not with each
#: release: after a passed main run (the newest releases), a CI cell runs them where the grid labels it
#: ``ci-fresh-process``: the oldest pair (transformers 4.45, trl 0.11) and the first 5.x pair in CI
#: (5.20, trl 1.14); the main run is the newest releases.
FRESH_PROCESS_LABEL = "ci-fresh-process"
FRESH_PROCESS = {
    "foundation/test_hook_order.py": "a shim applies in any import order",
    "trainers/test_import_order.py": "a trainer module is patched in any import order",
    "foundation/test_import_hooks.py::test_wrapt_is_imported_when_a_target_library_is_imported_not_before":
        "wrapt is imported with a target library, not before",
    "models/test_modules.py::test_modeling_module_imported_under_another_default_device_is_patched":
        "a modeling module imported under another default device",
    "models/test_scenarios_and_report.py::test_hooks_patch_modeling_modules_imported_before_and_after_liger_compat":
        "modeling modules imported before and after liger_compat",
    "foundation/test_report_truth.py::test_cli_prints_the_table_once_and_shows_waiting_shims": "the CLI's report",
    "foundation/test_report_cli.py::test_deep_report_fits_a_screen_and_cuts_nothing": "the CLI's deep report",
    "models/test_host_syncs.py::test_no_more_host_reads_than_native": "host reads under Triton's interpreter",
}

#: The integration modules whose outcome turns on torch's own machinery (torch.compile's graphs and
#: guards; DDP, FSDP2 and DTensor in torch.distributed): the only ones a cell of the torch axis (a cell
#: that installs its own torch) runs, when it is labelled ``ci-integration``. The trainers under
#: compile or gloo, trl's command line and the launcher's scripts reach the same torch machinery
#: through the pinned libraries' code, which the oldest cell and the main run cover.
TORCH_INTEGRATION = {"compile/test_compile.py", "distributed/test_gloo.py", "distributed/test_tensor_parallel.py"}

#: Interpreter re-runs of kernel modules that are studies of the kernels' numbers at chosen inputs
#: (which tiles the sparse backward leaves out against a float64 simulation; peaked rows' target
#: gradient), not of their code paths: the same kernels, with the same code paths (the sparse
#: backward, the fp32 target logit), run under the interpreter in ``test_lowmem.py`` and
#: ``test_cross_entropy.py``, which every run of the stack-only tests keeps. A cell of the torch axis
#: (its own torch and Triton) skips these after a passed main run, which ran them on the newest Triton;
#: about a third of that cell's interpreter time. Node ids relative to tests/.
TORCH_AXIS_SKIP = {
    "kernels/test_interpret.py::test_triton_kernels_under_interpreter[test_lowmem_sparsity.py]":
        "the sparse backward's skip rule against its float64 simulation",
    "kernels/test_interpret.py::test_triton_kernels_under_interpreter[test_peaked_rows.py]":
        "peaked rows' target gradient against a float64 head",
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


def _cell(cell: str | None):
    """The grid's cell of that tox environment name, or None (outside tox, or not a cell of the grid)."""
    if not cell:
        return None
    from liger_compat.matrix import grid

    try:
        return grid.load().cell(cell)
    except (KeyError, grid.GridError):
        return None


def runs_fresh_process_tests(cell: str | None) -> bool:
    """Whether the grid cell ``cell`` runs the :data:`FRESH_PROCESS` tests after a passed main run:
    a cell labelled :data:`FRESH_PROCESS_LABEL`, or any run that is not a known cell of the grid."""
    c = _cell(cell)
    return c is None or FRESH_PROCESS_LABEL in c.labels


def integration_modules(cell: str | None) -> set[str]:
    """The :data:`INTEGRATION` modules the grid cell ``cell`` (tox's ``TOX_ENV_NAME``; None outside
    tox) runs after a passed main run: every one in a cell labelled :data:`INTEGRATION_LABEL` or in
    any run that is not a known cell of the grid, :data:`TORCH_INTEGRATION` in a labelled cell of
    the torch axis, none in the other cells."""
    c = _cell(cell)
    if c is None:
        return set(INTEGRATION)
    if INTEGRATION_LABEL not in c.labels:
        return set()
    return set(TORCH_INTEGRATION) if c.own_torch else set(INTEGRATION)


def skip_what_the_main_run_passed(items) -> None:
    """In a grid cell after CI's passed main run: skip the tests that cannot tell this cell from it,
    and the :data:`INTEGRATION` tests the cell does not run (:func:`integration_modules`)."""
    passed_on = os.environ.get(MAIN_RUN_ENV)
    if not passed_on:
        return
    same_stack = passed_on == stack_id()
    integration = integration_modules(os.environ.get("TOX_ENV_NAME"))
    fresh = runs_fresh_process_tests(os.environ.get("TOX_ENV_NAME"))
    cell = _cell(os.environ.get("TOX_ENV_NAME"))
    torch_axis = cell is not None and cell.own_torch
    for item in items:
        path = _suite_path(item)
        test = f"{path}::{getattr(item, 'originalname', None) or item.name.split('[')[0]}"
        study = TORCH_AXIS_SKIP.get(f"{path}::{item.name}")
        only = MAIN_RUN_ONLY.get(path) or MAIN_RUN_ONLY.get(test)
        at_import = FRESH_PROCESS.get(path) or FRESH_PROCESS.get(test)
        if only:
            item.add_marker(pytest.mark.skip(reason=f"passed in CI's main run; depends on no pinned library "
                                                    f"({only})"))
        elif at_import and not fresh:
            item.add_marker(pytest.mark.skip(reason=f"fresh-process test ({at_import}): passed in CI's main run; "
                                                    f"run by the cells labelled {FRESH_PROCESS_LABEL}"))
        elif path in INTEGRATION and path not in integration:
            item.add_marker(pytest.mark.skip(reason=f"integration test ({INTEGRATION[path]}): passed in CI's main "
                                                    f"run; run by the cells labelled {INTEGRATION_LABEL} (on the torch axis: "
                                                    "TORCH_INTEGRATION only)"))
        elif study and torch_axis:
            item.add_marker(pytest.mark.skip(reason=f"interpreter study ({study}): passed in CI's main run; its kernels "
                                                    "run under the interpreter in this cell's other modules"))
        elif same_stack and (path.split("/")[0] in STACK_ONLY_DIRS or "stack_only" in item.keywords):
            item.add_marker(pytest.mark.skip(reason=f"passed in CI's main run on {passed_on}; depends on "
                                                    "Python, torch and Triton only"))
