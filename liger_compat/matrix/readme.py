"""The support tables, generated from grid.toml + verified.json: a short one in the README and the
full one (every pinned release) in docs/version-matrix.md.

Only the block between the two markers of each file is ever rewritten. The tables depend on the
grid and the recorded runs alone, never on the content fingerprint of the code, so that editing
the code or a test leaves them current: a cell CI runs is *verified by CI* (nothing lands unless
``.ci/run`` passes it); any other cell shows the commit and date of its last recorded run.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any, Callable

from packaging.version import Version

from .grid import Cell, Grid
from .results import passing
from .status import recorded_at

START = "<!-- support-table:start -->"
END = "<!-- support-table:end -->"


class ReadmeError(ValueError):
    pass


@dataclass(frozen=True)
class Column:
    """One column of a support table: its header, its markdown alignment and how a row fills it
    from a cell and the cell's recorded run (None when none was recorded)."""

    header: str
    align: str
    value: Callable[[Cell, dict[str, Any] | None], str]


def _installs(package: str) -> Callable[[Cell, dict[str, Any] | None], str]:
    """A column value: the release of ``package`` the cell installs; for the newest cell
    ``newest`` and, once it ran, the release its recorded run installed."""
    def value(cell: Cell, result: dict[str, Any] | None) -> str:
        if package == "torch":
            return cell.torch
        if not cell.newest:
            return cell.pins()[package]
        got = ((result or {}).get("versions") or {}).get(package)
        return f"newest ({got})" if got else "newest"
    return value


def _state(cell: Cell, result: dict[str, Any] | None) -> str:
    """What the tables say of a cell: ``verified by CI``, or for a cell CI does not run
    ``passed at <commit> <date>``, ``FAILING (n tests) at <commit> <date>`` or ``not run yet``."""
    if cell.ci:
        return "verified by CI"
    if result is None:
        return "not run yet"
    if passing(result):
        return f"passed at {recorded_at(result)}"
    n = result["failed"] + result["errors"]
    return f"FAILING ({n} test{'s' if n != 1 else ''}) at {recorded_at(result)}"


def _count(*keys: str) -> Callable[[Cell, dict[str, Any] | None], str]:
    """A column value: the sum of these counts of the recorded run (empty when none was recorded)."""
    return lambda cell, result: str(sum(result[k] for k in keys)) if result else ""


def _tests(cell: Cell, result: dict[str, Any] | None) -> str:
    """``passed / failed / skipped`` of the recorded run, as in the full table's three columns."""
    return " / ".join(COLUMNS[h].value(cell, result) for h in ("passed", "failed", "skipped")) if result else ""


def _extras(cell: Cell, result: dict[str, Any] | None) -> str:
    """The libraries the cell pins beside the pair (peft, liger-kernel ...)."""
    return ", ".join(f"{d} {v}" for d, v in cell.extras) or "-"


COLUMNS = {c.header: c for c in (
    Column("transformers", "---", _installs("transformers")),
    Column("trl", "---", _installs("trl")),
    Column("torch", "---", _installs("torch")),
    Column("accelerate", "---", _installs("accelerate")),
    Column("datasets", "---", _installs("datasets")),
    Column("also installed", "---", _extras),
    Column("state", "---", _state),
    Column("tests passed / failed / skipped", "---:", _tests),
    Column("passed", "---:", _count("passed")),
    Column("failed", "---:", _count("failed", "errors")),
    Column("skipped", "---:", _count("skipped")),
    Column("recorded at", "---", lambda cell, result: recorded_at(result) if result else ""),
    Column("tox env", "---", lambda cell, result: f"`{cell.name}`"),
)}
#: the README's table: what a newcomer needs at a glance
SHORT = ("transformers", "trl", "torch", "also installed", "state", "tests passed / failed / skipped",
         "recorded at", "tox env")
#: docs/version-matrix.md's table: every release a cell pins, every count
FULL = ("transformers", "trl", "torch", "accelerate", "datasets", "also installed", "state", "passed", "failed",
        "skipped", "recorded at", "tox env")
#: the files with a support table (relative to the repository root) -> whether theirs is the full one
TARGETS = {"README.md": False, "docs/version-matrix.md": True}


def _series(grid: Grid) -> list[tuple[str, list[Cell]]]:
    """The grid's cells in grid order, grouped by transformers major release, each group with its
    label (``transformers 4.45-4.57``); the newest cell joins the newest series."""
    newest_major = max(Version(c.transformers).major for c in grid.pinned)  # type: ignore[arg-type]
    groups = groupby(grid.cells, key=lambda c: newest_major if c.newest else Version(c.transformers).major)
    out = []
    for _, cells in groups:
        cells = list(cells)
        minors = sorted({Version(c.transformers).release[:2] for c in cells if not c.newest})  # type: ignore[arg-type]
        span = ".".join(map(str, minors[0])) + ("-" + ".".join(map(str, minors[-1])) if len(minors) > 1 else "")
        out.append((f"transformers {span}" + (" and the newest release" if any(c.newest for c in cells) else ""),
                    cells))
    return out


def _intro(grid: Grid) -> str:
    """The paragraph above each table: what was tested and what its states mean."""
    axis = ", ".join(t for t in grid.torch_releases if t != grid.torch)
    return (
        f"Tested on Python {grid.python} (CPU test suite, `tox -e <cell>`), with torch {grid.torch} and, on the "
        f"cells of the torch axis (each beside the same pair on torch {grid.torch}), with torch {axis}. "
        "*verified by CI*: `.ci/run` runs the cell on every submission and nothing lands unless it passes, so the "
        "cell is verified at every landed commit (CI runs its main suite on the newest release of every dependency, "
        "torch held, which is what the `newest` cell installs, and every cell labelled `ci` in grid.toml); its "
        "counts are those of its last recorded run. Any other cell shows its last recorded run, *passed at* or "
        "*FAILING at* its commit and date, or *not run yet* (record one with `tox -e <cell>`, then "
        "`python -m liger_compat.matrix record .tox/matrix-results`). The `newest` cell pins nothing: it installs "
        "the newest release of every dependency when it runs (shown: the releases of its recorded run). "
        "*also installed*: libraries pinned beside the pair to test coexistence with them."
    )


def table(grid: Grid, verified: dict[str, Any], full: bool = False) -> str:
    """The README's table (``full``: docs/version-matrix.md's), with its intro, rows grouped by
    transformers series."""
    columns = [COLUMNS[h] for h in (FULL if full else SHORT)]
    recorded = verified.get("cells", {})
    rows = [
        "<!-- generated by `python -m liger_compat.matrix readme` from liger_compat/matrix/grid.toml and verified.json; do not edit -->",
        "",
        _intro(grid),
        "",
        "| " + " | ".join(c.header for c in columns) + " |",
        "|" + "|".join(c.align for c in columns) + "|",
    ]
    for label, cells in _series(grid):
        rows.append(f"| **{label}** |" + " |" * (len(columns) - 1))
        rows += ["| " + " | ".join(col.value(c, recorded.get(c.name)) for col in columns) + " |" for c in cells]
    return "\n".join(rows)


def _split(text: str) -> tuple[str, str, str]:
    if text.count(START) != 1 or text.count(END) != 1:
        raise ReadmeError(f"the file must contain {START} and {END} exactly once each")
    head, rest = text.split(START)
    body, tail = rest.split(END)
    return head, body, tail


def has_markers(text: str) -> bool:
    return START in text and END in text


def render(text: str, grid: Grid, verified: dict[str, Any], full: bool = False) -> str:
    """``text`` with the block between the markers replaced by the current table."""
    head, _, tail = _split(text)
    return f"{head}{START}\n{table(grid, verified, full)}\n{END}{tail}"


def is_current(text: str, grid: Grid, verified: dict[str, Any], full: bool = False) -> bool:
    return render(text, grid, verified, full) == text


def update(path: Path, grid: Grid, verified: dict[str, Any], full: bool = False) -> bool:
    """Rewrite the block in ``path``; True when the file changed."""
    text = path.read_text(encoding="utf-8")
    new = render(text, grid, verified, full)
    if new != text:
        path.write_text(new, encoding="utf-8")
        return True
    return False
