"""Generate tox.ini from the grid: one environment per cell, plus labels.

Every environment reuses the system-wide torch (``system_site_packages = true`` and
``PIP_CONSTRAINT`` pinning torch to the grid's version, so pip never installs a second torch)
and pins the cell's transformers / trl / accelerate / datasets inside the virtualenv, where they
shadow the system-wide ones; ``env-check`` asserts that before the tests run.

The newest cell pins nothing: its ``install_command`` upgrades eagerly (``pip install --upgrade
--upgrade-strategy eager``), so transformers, trl, accelerate, datasets and every dependency of
liger_compat (and theirs) come at their newest release instead of the system-wide one, still
under the torch constraint; ``env-check`` records the versions it got.

A cell of the torch axis (``torch = "..."`` in its grid entry) installs its own torch instead:
its own constraint file pins that torch, so pip installs it into the environment, where it
shadows the system-wide one (``env-check`` asserts that the cell's torch is the one imported),
and ``PIP_CONFIG_FILE=/dev/null`` keeps a machine-wide pip configuration capping torch (or
pointing at a local index without that release) from deciding which torch the cell gets. It
keeps the system site packages like its twin on the grid's torch, so that across the two only
torch changes.
"""

from __future__ import annotations

from .grid import EXTRA_PINS, PACKAGES, Grid

RESULTS_DIR = "matrix-results"
#: tox's default install command plus an eager upgrade: with system site packages pip would
#: otherwise keep every system-wide release that satisfies the requirements
NEWEST_INSTALL_COMMAND = "python -I -m pip install --upgrade --upgrade-strategy eager {opts} {packages}"
CONSTRAINTS = "liger_compat/matrix/constraints.txt"


def torch_constraints(torch: str) -> str:
    """The constraint file of the cells of the torch axis on this torch release."""
    return f"liger_compat/matrix/constraints-torch{torch}.txt"

HEADER = """\
# GENERATED from liger_compat/matrix/grid.toml by `python -m liger_compat.matrix tox-ini`.
# Do not edit by hand: edit grid.toml and regenerate (tests/test_matrix.py fails on drift).
#
#   tox -e {example}  one cell of the version grid: `pytest tests` against that pair
{newest}{torch_axis}#   tox -m ci  the CI subset: {ci}
#   tox  the full grid ({n} cells), one after the other
#   tox -e CELL -- -q tests/test_x.py  a part of the suite only (posargs replace `-q tests`)
#   python -m liger_compat.matrix record .tox/{results}  -> liger_compat/matrix/verified.json
#   python -m liger_compat.matrix readme  -> README support table
#
# torch {torch} must be installed system-wide (`pip install torch=={torch}`); it is reused by every
# environment and never installed into one (PIP_CONSTRAINT below), except by the cells of the
# torch axis, which install their own torch into the environment, where it shadows the system one.
"""


#: ``torch==X triton==Y`` of CI's main run once it has passed: a cell then skips the tests that depend
#: on none of its pins, and on the same torch and Triton those that depend on these two only (tests/suite_scope.py)
MAIN_RUN_ENV = "LIGER_COMPAT_MAIN_RUN_PASSED_ON"


def render(grid: Grid) -> str:
    ci = [c.name for c in grid.labelled("ci")]
    lines = [HEADER.format(example=[c for c in grid.pinned if not c.own_torch][-1].name, ci=", ".join(ci) or "(none)", n=len(grid.cells),
                           results=RESULTS_DIR, torch=grid.torch,
                           newest="".join(f"#   tox -e {c.name}  no pins: the newest release of every dependency (torch held)\n"
                                          for c in grid.cells if c.newest),
                           torch_axis=_torch_axis_line(grid))]
    lines += [
        "[tox]",
        "requires = tox>=4.20",
        "env_list =",
        *[f"    {c.name}" for c in grid.cells],
        "",
        "[testenv]",
        "description = full CPU test suite against one (transformers, trl) cell of the version grid",
        f"base_python = python{grid.python}",
        "system_site_packages = true",
        "package = editable",
        "extras = test",
        # set by .ci/run once its main run has passed (tests/suite_scope.py)
        f"pass_env = {MAIN_RUN_ENV}",
        "set_env =",
        f"    PIP_CONSTRAINT = {{tox_root}}/{CONSTRAINTS}",
        # no byte-compiling at install: a cell imports a few hundred of transformers' thousands of modules
        # (compiled on first import), and CI builds the next cell's environment beside a cell's tests
        "    PIP_NO_COMPILE = 1",
        "    HF_HUB_OFFLINE = 1",
        "    TRANSFORMERS_NO_ADVISORY_WARNINGS = 1",
        "    TOKENIZERS_PARALLELISM = false",
        f"    MATRIX_RESULTS = {{work_dir}}/{RESULTS_DIR}/{{env_name}}",
        "commands_pre =",
        "    python -m liger_compat.matrix env-check {env_name} --out {env:MATRIX_RESULTS} --site {env_site_packages_dir} --pytest-args {posargs:-q tests}",
        "commands =",
        "    python -m pytest -p no:cacheprovider --junitxml={env:MATRIX_RESULTS}/junit.xml {posargs:-q tests}",
        "",
    ]
    for c in grid.cells:
        why = c.why.replace("{", "(").replace("}", ")").replace("\n", " ")
        what = "newest releases, unpinned" if c.newest else f"transformers {c.transformers} + trl {c.trl}" + "".join(
            f" + {d} {v}" for d, v in c.extras) + (f" on torch {c.torch}" if c.own_torch else "")
        lines += [f"[testenv:{c.name}]", f"description = {what}: {why}"]
        if c.labels:
            lines += [f"labels = {', '.join(c.labels)}"]
        if c.own_torch:
            lines += ["set_env =",
                      "    {[testenv]set_env}",
                      f"    PIP_CONSTRAINT = {{tox_root}}/{torch_constraints(c.torch)}",
                      "    PIP_CONFIG_FILE = /dev/null"]
        if c.newest:
            # recreate: a kept environment would keep the releases of its first install
            lines += ["recreate = true", f"install_command = {NEWEST_INSTALL_COMMAND}", "deps ="]
            lines += [f"    {pkg}" for pkg in (*PACKAGES, *EXTRA_PINS)]
        else:
            lines += ["deps ="]
            lines += [f"    {pkg}=={ver}" for pkg, ver in c.pins().items()]
        lines += [""]
    return "\n".join(lines)


def _torch_axis_line(grid: Grid) -> str:
    axis = [c.name for c in grid.cells if c.own_torch]
    if not axis:
        return ""
    releases = ", ".join(t for t in grid.torch_releases if t != grid.torch)
    return f"#   tox -e {axis[-1]}  a cell of the torch axis ({releases}): installs its own torch\n"


def constraints(grid: Grid) -> str:
    return (f"# GENERATED from grid.toml by `python -m liger_compat.matrix tox-ini`: torch is reused from the\n"
            f"# system-wide install, never installed per tox environment.\ntorch=={grid.torch}\n")


def constraint_files(grid: Grid) -> dict[str, str]:
    """Path (relative to the repository root) -> text of every constraint file tox.ini names."""
    out = {CONSTRAINTS: constraints(grid)}
    for torch in grid.torch_releases:
        if torch != grid.torch:
            out[torch_constraints(torch)] = (
                f"# GENERATED from grid.toml by `python -m liger_compat.matrix tox-ini`: the cells of the torch\n"
                f"# axis on torch {torch} install it into their own environment.\ntorch=={torch}\n")
    return out
