"""After CI's main run has passed (``LIGER_COMPAT_MAIN_RUN_PASSED_ON``, set by ``.ci/run``), a grid cell
skips exactly what cannot tell it from the main run: the repository's data and tools everywhere, the
torch-and-Triton-only tests on the main run's torch and Triton; the rest runs (tests/suite_scope.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from suite_scope import (FRESH_PROCESS, FRESH_PROCESS_LABEL, INTEGRATION, INTEGRATION_LABEL, MAIN_RUN_ENV,  # noqa: E402
                         MAIN_RUN_ONLY, STACK_ONLY_DIRS, TORCH_AXIS_SKIP, TORCH_INTEGRATION,
                         skip_what_the_main_run_passed, stack_id)

sys.path.pop(0)

TOOLING = "tests/test_ranges.py::test_some_shims_declare_a_range"
KERNEL = "tests/kernels/test_validation.py::test_bias_shape_and_target_range_on_logits"
COMPILED_KERNEL = "tests/compile/test_compile.py::test_bad_target_under_compile_is_a_clear_error"
LIBRARY = "tests/models/test_cpu_native.py::test_the_setting_off_and_a_forced_backend_run_the_references"


def _outcomes(passed_on: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != MAIN_RUN_ENV}
    if passed_on is not None:
        env[MAIN_RUN_ENV] = passed_on
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-rA",
                        TOOLING, KERNEL, COMPILED_KERNEL, LIBRARY], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = {}
    for line in r.stdout.splitlines():
        for node in (TOOLING, KERNEL, COMPILED_KERNEL, LIBRARY):
            if node in line and line.split(" ")[0] in ("PASSED", "SKIPPED"):
                out[node] = line.split(" ")[0]
            elif line.startswith("SKIPPED") and node.split("::")[0] in line:
                out[node] = "SKIPPED"
    return out


def test_a_cell_after_the_main_run_skips_only_what_does_not_depend_on_its_pins():
    """The rule as pytest applies it (conftest, markers, the real stack): one run, on the main run's
    stack; the same nodes on another torch and with no main run go through the rule itself below."""
    on_main_stack = _outcomes(stack_id())
    assert on_main_stack == {TOOLING: "SKIPPED", KERNEL: "SKIPPED", COMPILED_KERNEL: "SKIPPED", LIBRARY: "PASSED"}


def test_the_kernel_tests_run_on_another_torch_and_everything_runs_without_a_main_run(monkeypatch):
    nodes = [n.removeprefix("tests/") for n in (TOOLING, KERNEL, COMPILED_KERNEL, LIBRARY)]
    stack_marked = {nodes[2]}  # the compiled-kernel test is marked stack_only
    # a cell of the torch axis: its torch differs, so the kernel tests run there
    assert _skipped(nodes, monkeypatch, None, stack_marked=stack_marked) == {nodes[0]}
    assert _skipped(nodes, monkeypatch, None, passed_on=stack_id(),
                    stack_marked=stack_marked) == set(nodes[:3])
    # no main run passed (a local run, or the main run itself): everything runs
    assert _skipped(nodes, monkeypatch, None, passed_on=None, stack_marked=stack_marked) == set()


@pytest.mark.parametrize("path", sorted(p for p in MAIN_RUN_ONLY if "::" not in p))
def test_every_main_run_only_module_exists(path):
    assert (ROOT / "tests" / path).is_file(), f"tests/suite_scope.py MAIN_RUN_ONLY names a missing module: {path}"


def test_stack_only_directories_exist():
    assert all((ROOT / "tests" / d).is_dir() for d in STACK_ONLY_DIRS)


class _Item:
    """What skip_what_the_main_run_passed reads of a collected test."""

    def __init__(self, node: str):
        path, _, name = node.partition("::")
        self.fspath = ROOT / "tests" / path
        self.name = name
        self.originalname = name.split("[")[0]
        self.keywords: dict = {}
        self.skipped = False

    def add_marker(self, marker) -> None:
        self.skipped = self.skipped or marker.name == "skip"


def _skipped(nodes: list[str], monkeypatch, cell: str | None, passed_on: str | None = "torch==0.0.0 triton==0.0.0",
             stack_marked: set[str] = frozenset()):
    if passed_on is None:
        monkeypatch.delenv(MAIN_RUN_ENV, raising=False)
    else:
        monkeypatch.setenv(MAIN_RUN_ENV, passed_on)
    if cell is None:
        monkeypatch.delenv("TOX_ENV_NAME", raising=False)
    else:
        monkeypatch.setenv("TOX_ENV_NAME", cell)
    items = [_Item(n) for n in nodes]
    for item, node in zip(items, nodes):
        if node in stack_marked:
            item.keywords["stack_only"] = True
    skip_what_the_main_run_passed(items)
    return {n for n, i in zip(nodes, items) if i.skipped}


def test_integration_tests_run_in_the_cells_labelled_for_them_and_outside_the_grid(monkeypatch):
    from liger_compat.matrix import grid

    g = grid.load()
    labelled = [c.name for c in g.labelled("ci") if INTEGRATION_LABEL in c.labels and not c.own_torch]
    torch_axis = [c.name for c in g.labelled("ci") if INTEGRATION_LABEL in c.labels and c.own_torch]
    others = [c.name for c in g.labelled("ci") if INTEGRATION_LABEL not in c.labels]
    assert labelled and torch_axis and others
    integration = [f"{path}::test_x" for path in sorted(INTEGRATION)]
    plain = "models/test_causal_lm.py::test_x[llama]"
    main_only = "launcher/test_run.py::test_exit_code_and_signals_pass_through"
    library = "launcher/test_run.py::test_python_script_takes_the_fused_path_with_native_loss"
    nodes = [*integration, plain, main_only, library]
    for cell in labelled:
        assert _skipped(nodes, monkeypatch, cell) == {main_only}, cell
    # the torch axis: only the modules that turn on torch's own machinery
    not_torch = {f"{path}::test_x" for path in INTEGRATION if path not in TORCH_INTEGRATION}
    assert not_torch and len(not_torch) < len(integration)
    for cell in torch_axis:
        assert _skipped(nodes, monkeypatch, cell) == {*not_torch, main_only, library}, cell
    for cell in others:
        assert _skipped(nodes, monkeypatch, cell) == {*integration, main_only, library}, cell
    # a run outside the grid's cells, and any run before a passed main run: everything runs
    assert _skipped(nodes, monkeypatch, "my-own-env") == {main_only}
    assert _skipped(nodes, monkeypatch, None) == {main_only}
    assert _skipped(nodes, monkeypatch, others[0], passed_on=None) == set()


def test_fresh_process_tests_run_in_the_cells_labelled_for_them_and_outside_the_grid(monkeypatch):
    from liger_compat.matrix import grid

    g = grid.load()
    labelled = [c.name for c in g.labelled("ci") if FRESH_PROCESS_LABEL in c.labels]
    others = [c.name for c in g.labelled("ci") if FRESH_PROCESS_LABEL not in c.labels]
    assert len(labelled) >= 2 and others
    # the oldest pair, a 4.x and a 5.x pair carry the label
    assert {grid.load().cell(c).transformers.split(".")[0] for c in labelled} == {"4", "5"}
    fresh = [f"{node}::test_x" if "::" not in node else f"{node}[case]" for node in sorted(FRESH_PROCESS)]
    in_process = ["models/test_modules.py::test_patched_model_imports_nothing[llama]",
                  "foundation/test_import_hooks.py::test_some_other_hook_test"]
    nodes = [*fresh, *in_process]
    for cell in labelled:
        assert _skipped(nodes, monkeypatch, cell) == set(), cell
    for cell in others:
        assert _skipped(nodes, monkeypatch, cell) == set(fresh), cell
    assert _skipped(nodes, monkeypatch, "my-own-env") == set()  # outside the grid, and before a passed main run
    assert _skipped(nodes, monkeypatch, others[0], passed_on=None) == set()


@pytest.mark.parametrize("node", sorted(n for n in FRESH_PROCESS if "::" in n))
def test_every_fresh_process_test_exists(node):
    path, name = node.split("::")
    assert f"def {name}(" in (ROOT / "tests" / path).read_text(), f"FRESH_PROCESS names a missing test: {node}"


@pytest.mark.parametrize("path", sorted({n.split("::")[0] for n in FRESH_PROCESS}))
def test_every_fresh_process_module_exists(path):
    assert (ROOT / "tests" / path).is_file(), f"tests/suite_scope.py FRESH_PROCESS names a missing module: {path}"


@pytest.mark.parametrize("node", sorted(n for n in MAIN_RUN_ONLY if "::" in n))
def test_every_main_run_only_test_exists(node):
    path, name = node.split("::")
    assert f"def {name}(" in (ROOT / "tests" / path).read_text(), f"MAIN_RUN_ONLY names a missing test: {node}"


@pytest.mark.parametrize("path", sorted(INTEGRATION))
def test_every_integration_module_exists(path):
    assert (ROOT / "tests" / path).is_file(), f"tests/suite_scope.py INTEGRATION names a missing module: {path}"


def test_the_torch_axis_integration_modules_are_integration_modules():
    assert TORCH_INTEGRATION and TORCH_INTEGRATION < set(INTEGRATION)


def test_the_torch_axis_skips_the_interpreter_studies_and_keeps_the_other_interpreter_runs(monkeypatch):
    """A cell of the torch axis after a passed main run on another stack runs the kernel tests, the
    interpreter re-runs among them, except the numeric studies of TORCH_AXIS_SKIP; a cell on the main
    run's stack skips every kernel test anyway, and without a passed main run everything runs."""
    from liger_compat.matrix import grid

    g = grid.load()
    torch_axis = [c.name for c in g.labelled("ci") if c.own_torch]
    same_torch = [c.name for c in g.labelled("ci") if not c.own_torch]
    assert torch_axis and same_torch
    studies = sorted(TORCH_AXIS_SKIP)
    kept = ["kernels/test_interpret.py::test_triton_kernels_under_interpreter[test_lowmem.py]",
            "kernels/test_interpret.py::test_triton_kernels_under_interpreter[test_cross_entropy.py]"]
    nodes = [*studies, *kept]
    for cell in torch_axis:
        assert _skipped(nodes, monkeypatch, cell) == set(studies), cell
        assert _skipped(nodes, monkeypatch, cell, passed_on=None) == set(), cell
    for cell in same_torch:
        assert _skipped(nodes, monkeypatch, cell, passed_on=stack_id()) == set(nodes), cell
    assert _skipped(nodes, monkeypatch, "my-own-env") == set()  # outside the grid: all of them


@pytest.mark.parametrize("node", sorted(TORCH_AXIS_SKIP))
def test_every_torch_axis_study_is_an_interpreter_run_of_an_existing_module(node):
    path, name = node.split("::")
    module = name.split("[")[1].rstrip("]")
    assert f"\"{module}\"" in (ROOT / "tests" / path).read_text(), node
    assert (ROOT / "tests" / "kernels" / module).is_file(), node
