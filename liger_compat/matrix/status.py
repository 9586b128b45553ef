"""Is the installed (transformers, trl) pair a verified cell of the grid? Which one is nearest?

Used by ``check()``; reads grid.toml and verified.json only (no torch / transformers import).
"""

from __future__ import annotations

from typing import Any

from packaging.version import Version

from .grid import Cell, Grid, _release
from .grid import load as load_grid
from .results import load_verified, passing


def _ordinal(v: Version) -> float:
    """A line on which one major release weighs 100 minors and one minor 100 patches."""
    major, minor, micro = (list(v.release) + [0, 0])[:3]
    return major * 100 + minor + min(micro, 99) / 100


def distance(transformers: str | None, trl: str | None, cell: Cell) -> float:
    """How far an installed pair is from a cell (a missing package does not count)."""
    d = 0.0
    for raw, pinned in ((transformers, cell.transformers), (trl, cell.trl)):
        rel = _release(raw)
        if rel is not None:
            d += abs(_ordinal(rel) - _ordinal(Version(pinned)))
    return round(d, 4)


def _brief(result: dict[str, Any]) -> str:
    s = f"{result['passed']} passed, {result['failed']} failed, {result['skipped']} skipped"
    if result.get("errors"):
        s += f", {result['errors']} errors"
    return f"{s}; {str(result.get('date', '?'))[:10]}"


def verification_status(transformers_raw: str | None, trl_raw: str | None,
                        grid: Grid | None = None, verified: dict[str, Any] | None = None) -> dict[str, Any]:
    """Where the installed pair stands in the version matrix.

    Keys: ``summary`` (one line), ``verified`` (the pair is a grid cell whose recorded run had
    no failures or errors), ``cell`` (name of the grid cell pinning exactly these releases, or
    None), ``results`` (that cell's recorded results, or None), ``nearest`` (the nearest cell
    with a passing recorded run, when the pair is not verified itself: name, versions,
    distance, results; None when nothing passed yet), ``installed``, ``grid_cells``,
    ``recorded_cells``.
    """
    grid = grid or load_grid()
    verified = verified if verified is not None else load_verified()
    recorded: dict[str, Any] = verified.get("cells", {})
    cell = grid.find(transformers_raw, trl_raw)
    results = recorded.get(cell.name) if cell else None
    ok = cell is not None and passing(results)
    out: dict[str, Any] = {
        "verified": ok,
        "cell": cell.name if cell else None,
        "results": results,
        "nearest": None,
        "installed": {"transformers": transformers_raw, "trl": trl_raw},
        "grid_cells": len(grid.cells),
        "recorded_cells": sum(1 for c in grid.cells if c.name in recorded),
    }
    pair = f"transformers {transformers_raw or 'not installed'} + trl {trl_raw or 'not installed'}"
    if ok:
        out["summary"] = f"verified: {pair} is grid cell {cell.name} ({_brief(results)})"
        return out

    candidates = [c for c in grid.cells if c is not cell and passing(recorded.get(c.name))]
    if transformers_raw is not None and candidates:
        best = min(candidates, key=lambda c: (distance(transformers_raw, trl_raw, c), grid.cells.index(c)))
        out["nearest"] = {"cell": best.name, "transformers": best.transformers, "trl": best.trl,
                          "distance": distance(transformers_raw, trl_raw, best), "results": recorded[best.name]}
    near = (f"; nearest verified cell: {out['nearest']['cell']} (transformers {out['nearest']['transformers']}, "
            f"trl {out['nearest']['trl']})" if out["nearest"] else "; no verified cell to compare with")
    if transformers_raw is None:
        out["summary"] = "transformers not installed: nothing to compare with the version matrix"
    elif cell is not None and results is not None:
        out["summary"] = f"NOT verified: {pair} is grid cell {cell.name} but its recorded run failed ({_brief(results)}){near}"
    elif cell is not None:
        out["summary"] = f"{pair} is grid cell {cell.name}, not run yet{near}"
    else:
        out["summary"] = f"{pair} is not a grid cell{near}"
    return out
