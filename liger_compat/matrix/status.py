"""Is the installed (transformers, trl) pair a verified cell of the grid? Which one is nearest?
Was the installed torch release verified by any cell?

A cell CI runs (:attr:`Cell.ci`) is verified at every landed commit, whatever verified.json
recorded for it: nothing lands unless ``.ci/run`` passes it. Any other cell is verified while its
recorded run passed on this very code: the package's content fingerprint then equals the
installed one.

Used by ``check()``; reads grid.toml and verified.json, and hashes the installed package's
files to tell whether a recorded run tested this code (no torch / transformers import).
"""

from __future__ import annotations

from typing import Any

from packaging.version import Version

from . import fingerprint
from .grid import Cell, Grid, _release
from .grid import load as load_grid
from .results import load_verified, passing


def _ordinal(v: Version) -> float:
    """A line on which one major release weighs 100 minors and one minor 100 patches."""
    major, minor, micro = (list(v.release) + [0, 0])[:3]
    return major * 100 + minor + min(micro, 99) / 100


def distance(transformers: str | None, trl: str | None, cell: Cell) -> float:
    """How far an installed pair is from a pinned cell (a missing package does not count)."""
    return _distance(transformers, trl, cell.transformers, cell.trl)  # type: ignore[arg-type]


def _distance(transformers: str | None, trl: str | None, cell_transformers: str, cell_trl: str) -> float:
    d = 0.0
    for raw, pinned in ((transformers, cell_transformers), (trl, cell_trl)):
        rel = _release(raw)
        if rel is not None:
            d += abs(_ordinal(rel) - _ordinal(Version(pinned)))
    return round(d, 4)


def _counts(result: dict[str, Any]) -> str:
    """``N passed, N failed, N skipped`` (and errors, if any) of a recorded run."""
    s = f"{result['passed']} passed, {result['failed']} failed, {result['skipped']} skipped"
    if result.get("errors"):
        s += f", {result['errors']} errors"
    return s


def _brief(result: dict[str, Any]) -> str:
    return f"{_counts(result)}; {str(result.get('date', '?'))[:10]}"


def recorded_at(result: dict[str, Any]) -> str:
    """``<short commit> <date>`` of a recorded run (the code state it describes)."""
    commit = (result.get("source") or {}).get("commit") or "unknown commit"
    return f"{commit[:7]} {str(result.get('date', '?'))[:10]}"


def cell_state(cell: Cell, result: dict[str, Any] | None, now: dict[str, str | None]) -> str:
    """``verified`` (a cell CI runs, whatever ``result`` says, or a passing run of this very
    code), ``stale`` (passing run of other code, or of code without a fingerprint), ``failing``
    or ``not run``."""
    if cell.ci:
        return "verified"
    if result is None:
        return "not run"
    if not passing(result):
        return "failing"
    return "verified" if fingerprint.matches(result.get("source"), now) else "stale"


def _speaks(cell: Cell, recorded: dict[str, Any]) -> bool:
    """Whether a cell speaks for its pair: CI runs it, or a recorded run of it passed (on
    whatever code: ``verified`` or ``stale``)."""
    return cell.ci or passing(recorded.get(cell.name))


def _ci_counts(result: dict[str, Any] | None) -> str:
    """What the summary of a cell CI runs says of it: it passes at every landed commit; the counts
    are those of its last recorded run, if any."""
    last = f"last counted: {_counts(result)} at {recorded_at(result)}" if result else "no counts recorded"
    return f"run and passed at every landed commit ({last})"


def _newest_match(grid: Grid, recorded: dict[str, Any], transformers_raw: str | None, trl_raw: str | None) -> Cell | None:
    """The newest cell, when its recorded run was on exactly these releases."""
    t, r = _release(transformers_raw), _release(trl_raw)
    if t is None or r is None:
        return None
    for c in grid.cells:
        res = recorded.get(c.name)
        if c.newest and res and _release(res.get("transformers")) == t and _release(res.get("trl")) == r:
            return c
    return None


def _releases(cell: Cell, recorded: dict[str, Any]) -> tuple[str, str] | None:
    """(transformers, trl) of a cell: its pins, or for the newest cell those of its recorded run."""
    if not cell.newest:
        return cell.transformers, cell.trl  # type: ignore[return-value]
    res = recorded.get(cell.name) or {}
    if res.get("transformers") and res.get("trl"):
        return res["transformers"], res["trl"]
    return None


def torch_pool(grid: Grid, recorded: dict[str, Any], torch_raw: str | None) -> tuple[Cell, ...]:
    """The cells whose runs speak for a user on this torch release: those on that release when
    one of them speaks for its pair (:func:`_speaks`), else those on the grid's own torch."""
    if _release(torch_raw) is not None:
        same = grid.on_torch(torch_raw)
        if any(_speaks(c, recorded) for c in same):
            return same
    return grid.on_torch(None)


def torch_status(torch_raw: str | None, grid: Grid, recorded: dict[str, Any],
                 now: dict[str, str | None], cell: Cell | None = None) -> dict[str, Any]:
    """Whether the installed torch release was verified: some cell on it is ``verified`` (CI runs
    it, or it has a passing run of this code). Keys: ``installed``, ``release``, ``verified``,
    ``cells`` (the cells verified on it), ``releases`` (each torch release of the grid -> its
    verified cells), ``cell_torch`` (the torch of ``cell``, the installed pair's cell), ``nearest`` (the
    nearest verified release when the installed one is not verified), ``summary``."""
    releases = {t: [c.name for c in grid.on_torch(t) if cell_state(c, recorded.get(c.name), now) == "verified"]
                for t in grid.torch_releases}
    rel = _release(torch_raw)
    out: dict[str, Any] = {"installed": torch_raw, "release": str(rel) if rel is not None else None,
                           "verified": False, "cells": [], "releases": releases,
                           "cell_torch": cell.torch if cell is not None else None, "nearest": None}
    if rel is None:
        out["summary"] = f"torch {torch_raw or 'not installed'}: not compared with the grid's torch releases"
        return out
    mine = next((t for t in releases if Version(t) == rel), None)
    out["cells"] = releases.get(mine, []) if mine else []
    out["verified"] = bool(out["cells"])
    done = [t for t, names in releases.items() if names]
    if out["verified"]:
        out["summary"] = f"torch {torch_raw}: verified ({len(out['cells'])} cell{'s' if len(out['cells']) != 1 else ''})"
        return out
    if done:
        out["nearest"] = min(done, key=lambda t: (abs(_ordinal(Version(t)) - _ordinal(rel)), Version(t)))
    listed = ", ".join(done) or "none yet"
    why = "a torch release of the grid without a verified cell" if mine else "no cell runs on it"
    out["summary"] = f"torch {torch_raw}: NOT verified ({why}; verified torch releases: {listed})"
    return out


def verification_status(transformers_raw: str | None, trl_raw: str | None,
                        grid: Grid | None = None, verified: dict[str, Any] | None = None,
                        current: dict[str, str | None] | None = None,
                        extras: dict[str, str | None] | None = None,
                        torch: str | None = None) -> dict[str, Any]:
    """Where the installed pair stands in the version matrix.

    Keys: ``summary`` (one line), ``state`` (``verified``, ``stale``, ``failing``, ``not run``,
    or ``not a cell``), ``verified`` (the pair is a grid cell that CI runs at every landed commit,
    whatever was recorded for it, or one whose recorded run had no failures or errors *and* ran
    this code: the recorded package fingerprint equals ``current``'s), ``ci`` (the pair's cell is
    one CI runs: :attr:`Cell.ci`), ``stale`` (a passing run recorded at another state of the code),
    ``recorded_at`` (commit and date of the cell's run), ``cell`` (name of the grid cell pinning
    exactly these releases, or the newest cell when its recorded run was on them, or None),
    ``results`` (that cell's recorded results, or None: a cell CI runs may have none),
    ``nearest`` (the nearest other cell that CI runs or with a passing recorded run, when the
    pair is not verified itself: name, versions, distance, state, results; verified cells before
    stale ones at equal distance; None when there is none), ``installed``, ``grid_cells``,
    ``recorded_cells``, ``fingerprint`` (the compared fingerprints).

    ``extras`` (distribution -> installed version) lets a cell that pins peft / liger-kernel ...
    match when those are installed at its pins (see :meth:`Grid.find`).

    ``torch`` (the installed torch version): the pair's cell on that torch release is preferred
    (a cell of the torch axis), else the pair's cell on the grid's torch; ``state`` and
    ``verified`` stay the pair's, and ``torch`` in the result says apart whether the installed
    torch release was verified (:func:`torch_status`); the summary ends with that verdict.
    Without it, torch is not looked at (``torch`` is None).

    ``current`` defaults to the fingerprint of the installed package (tests are not installed,
    so ``check()`` compares the package part only).
    """
    grid = grid or load_grid()
    verified = verified if verified is not None else load_verified()
    now = current if current is not None else fingerprint.current()
    recorded: dict[str, Any] = verified.get("cells", {})
    cell = ((grid.find(transformers_raw, trl_raw, extras, torch) if _release(torch) is not None else None)
            or grid.find(transformers_raw, trl_raw, extras) or _newest_match(grid, recorded, transformers_raw, trl_raw))
    results = recorded.get(cell.name) if cell else None
    state = cell_state(cell, results, now) if cell else "not a cell"
    ok = state == "verified"
    out: dict[str, Any] = {
        "verified": ok,
        "ci": cell is not None and cell.ci,
        "stale": state == "stale",
        "state": state,
        "cell": cell.name if cell else None,
        "results": results,
        "recorded_at": ({"commit": (results.get("source") or {}).get("commit"), "date": results.get("date")}
                        if results else None),
        "nearest": None,
        "installed": {"transformers": transformers_raw, "trl": trl_raw},
        "grid_cells": len(grid.cells),
        "recorded_cells": sum(1 for c in grid.cells if c.name in recorded),
        "fingerprint": now,
        "torch": torch_status(torch, grid, recorded, now, cell) if torch is not None else None,
    }
    out["summary"] = _nearest_and_summary(out, grid, recorded, now, cell, results, state, ok, transformers_raw,
                                          trl_raw, torch)
    if out["torch"] is not None:
        out["summary"] += "; " + out["torch"]["summary"]
    return out


def _nearest_and_summary(out: dict[str, Any], grid: Grid, recorded: dict[str, Any], now: dict[str, str | None],
                         cell: Cell | None, results: dict[str, Any] | None, state: str, ok: bool,
                         transformers_raw: str | None, trl_raw: str | None, torch: str | None) -> str:
    """Fill ``out["nearest"]`` (cells on the installed torch where one passed) and return the
    pair's one-line summary."""
    pair = f"transformers {transformers_raw or 'not installed'} + trl {trl_raw or 'not installed'}"
    if cell is not None and _release(torch) is not None and Version(cell.torch) != _release(torch):
        pair += f" (its cell runs on torch {cell.torch})"
    if ok and cell.ci:  # type: ignore[union-attr]
        return f"verified by CI: {pair} is grid cell {cell.name}, {_ci_counts(results)}"  # type: ignore[union-attr]
    if ok:
        return f"verified: {pair} is grid cell {cell.name} ({_brief(results)})"  # type: ignore[union-attr]

    pool = torch_pool(grid, recorded, torch) if torch is not None else grid.cells
    candidates = [c for c in pool
                  if c is not cell and _speaks(c, recorded) and _releases(c, recorded) is not None]
    if transformers_raw is not None and candidates:
        def key(c: Cell) -> tuple[float, bool, int]:
            t, r = _releases(c, recorded)  # type: ignore[misc]
            return (_distance(transformers_raw, trl_raw, t, r),
                    cell_state(c, recorded.get(c.name), now) != "verified", grid.cells.index(c))

        best = min(candidates, key=key)
        t, r = _releases(best, recorded)  # type: ignore[misc]
        out["nearest"] = {"cell": best.name, "transformers": t, "trl": r,
                          "distance": _distance(transformers_raw, trl_raw, t, r),
                          "state": cell_state(best, recorded.get(best.name), now),
                          "results": recorded.get(best.name)}
    if out["nearest"] is None:
        near = "; no verified cell to compare with"
    elif out["nearest"]["state"] == "verified":
        near = (f"; nearest verified cell: {out['nearest']['cell']} (transformers {out['nearest']['transformers']}, "
                f"trl {out['nearest']['trl']})")
    else:
        near = (f"; nearest passing cell: {out['nearest']['cell']} (transformers {out['nearest']['transformers']}, "
                f"trl {out['nearest']['trl']}), stale (recorded at {recorded_at(out['nearest']['results'])})")
    if transformers_raw is None:
        return "transformers not installed: nothing to compare with the version matrix"
    if state == "stale":
        near = near if out["nearest"] and out["nearest"]["state"] == "verified" else ""
        return (f"stale (recorded at {recorded_at(results)}): {pair} is grid cell {cell.name}, whose run "  # type: ignore
                f"passed ({_brief(results)}) on other code than this liger_compat{near}")  # type: ignore[arg-type]
    if state == "failing":
        return f"NOT verified: {pair} is grid cell {cell.name} but its recorded run failed ({_brief(results)}){near}"  # type: ignore
    if cell is not None:
        return f"{pair} is grid cell {cell.name}, not run yet{near}"
    return f"{pair} is not a grid cell{near}"


def nearest_cells(installed: dict[str, str | None], grid: Grid | None = None, verified: dict[str, Any] | None = None,
                  current: dict[str, str | None] | None = None, limit: int = 2,
                  only_verified: bool = False) -> list[dict[str, Any]]:
    """The cells CI runs or with a passing recorded run (:func:`_speaks`) nearest to the installed
    releases, and the pins that would put the user on each.

    ``installed``: distribution name -> installed version or None (transformers, trl, accelerate,
    datasets, torch and any optional library of the grid). Only cells that speak for the installed
    torch are offered (:func:`torch_pool`: those on that torch release when one of them speaks,
    else those on the grid's torch; torch itself is advised apart). The installed pair's own cell
    is left out; a cell with ``extras`` counts only when each of them is installed (in whatever
    release: the pins then name the cell's). Verified cells (CI runs them, or a passing run of
    this very code) come before stale ones (left out with ``only_verified``), then by
    :func:`distance`, then in grid order. Each entry: ``cell``, ``state`` (``verified`` /
    ``stale``), ``distance``, ``transformers``, ``trl``, ``pins`` (distribution ->
    release, only those that differ from what is installed) and ``command`` (a pip line).
    """
    grid = grid or load_grid()
    verified = verified if verified is not None else load_verified()
    now = current if current is not None else fingerprint.current()
    recorded: dict[str, Any] = verified.get("cells", {})
    t_raw, r_raw = installed.get("transformers"), installed.get("trl")
    if t_raw is None:
        return []
    torch_raw = installed.get("torch")
    own = ((grid.find(t_raw, r_raw, installed, torch_raw) if _release(torch_raw) is not None else None)
           or grid.find(t_raw, r_raw, installed) or _newest_match(grid, recorded, t_raw, r_raw))
    pool = torch_pool(grid, recorded, torch_raw)
    found = []
    for i, c in enumerate(grid.cells):
        res = recorded.get(c.name)
        rel = _releases(c, recorded)
        if c is own or c not in pool or not _speaks(c, recorded) or rel is None:
            continue
        if any(installed.get(d) is None for d, _ in c.extras):
            continue
        if c.newest:
            got = res.get("versions") or {}
            want = {k: got.get(k) for k in ("transformers", "trl", "accelerate", "datasets")}
            want = {k: v for k, v in want.items() if v}
        else:
            want = c.pins()
        pins = {k: v for k, v in want.items() if _release(installed.get(k)) != _release(v)}
        state = cell_state(c, res, now)
        if only_verified and state != "verified":
            continue
        found.append(((state != "verified", _distance(t_raw, r_raw, *rel), i),
                      {"cell": c.name, "state": state, "distance": _distance(t_raw, r_raw, *rel),
                       "transformers": rel[0], "trl": rel[1], "pins": pins,
                       "command": "pip install " + " ".join(f"{k}=={v}" for k, v in pins.items()) if pins else ""}))
    found.sort(key=lambda x: x[0])
    return [entry for _, entry in found[:limit]]
