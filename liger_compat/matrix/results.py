"""Recorded matrix results: ``verified.json``, written only from real tox runs.

Each tox environment of the grid runs two steps (see tox.ini):

1. ``python -m liger_compat.matrix env-check CELL --out DIR`` asserts that the pinned
   transformers / trl really shadow the system-wide ones and writes ``DIR/env.json`` with the
   versions actually imported (and removes any stale ``DIR/junit.xml``);
2. ``pytest tests --junitxml DIR/junit.xml``.

``python -m liger_compat.matrix record .tox/matrix-results`` then reads every ``DIR`` and merges
one entry per cell into ``verified.json``: versions (``torch``: the torch release the run
imported, which must be the cell's), pass/fail/skip/error counts, failing test ids and the date
pytest wrote into the junit file.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

from packaging.version import Version

from .grid import EXTRA_PINS, PACKAGES, Cell, Grid, _release

SCHEMA = 1
#: distributions whose versions env-check records besides the pinned ones
RECORDED = ("torch", "triton", "tokenizers", "huggingface-hub", "numpy", "peft", "liger-kernel",
            "cut-cross-entropy", "unsloth", "pytest",
            "wrapt", "packaging", "hypothesis", "pytest-xdist", "safetensors")
ENV_FILE = "env.json"
JUNIT_FILE = "junit.xml"
MAX_FAILURE_IDS = 25


class RecordError(RuntimeError):
    pass


def verified_path() -> Path:
    """verified.json inside the source tree / installed package."""
    return Path(str(resources.files(__package__).joinpath("verified.json")))


def load_verified(path: Path | None = None) -> dict[str, Any]:
    """The recorded results; an empty record when none were written yet."""
    path = path or verified_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {"schema": SCHEMA, "cells": {}}
    if data.get("schema") != SCHEMA or not isinstance(data.get("cells"), dict):
        raise RecordError(f"{path}: not a schema-{SCHEMA} verified.json")
    return data


def passing(result: dict[str, Any] | None) -> bool:
    return bool(result) and result["failed"] == 0 and result["errors"] == 0 and result["passed"] > 0


# -- step 1: inside the tox env ------------------------------------------------------------------

def _dist_version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def full_suite(pytest_args: list[str] | None) -> bool:
    """Whether pytest arguments run the whole suite (``tests``, no selection)."""
    if not pytest_args:
        return False
    selecting = ("-k", "-m", "--deselect", "--lf", "--last-failed", "--ff", "--sw", "--stepwise", "-x", "--exitfirst", "--maxfail")
    if any(a.split("=")[0] in selecting for a in pytest_args):
        return False
    paths = [a for a in pytest_args if not a.startswith("-") and (a.startswith("tests") or a.endswith(".py") or "::" in a)]
    return [p.rstrip("/") for p in paths] == ["tests"]


def env_check(cell: Cell, out: Path, env_site: str | None = None, pytest_args: list[str] | None = None) -> dict[str, Any]:
    """Check that the running interpreter imports exactly the cell's pins; write ``out/env.json``.

    Imports transformers and trl (that is the point: ``__version__`` of the module that
    ``import`` finds must be the pinned one, not the system-wide one). Raises
    :class:`RecordError` naming every mismatch.

    The newest cell pins nothing: it records the releases imported (``env.json`` ``versions``,
    which ``record`` copies into verified.json) and only checks that what is imported is what the
    distribution metadata says and not older than the grid's newest pinned cell (an environment
    still on older system-wide releases did not upgrade).
    """
    import importlib

    problems = []
    imported: dict[str, dict[str, str | None]] = {}
    floor = _newest_pins() if cell.newest else {}
    for pkg in (*PACKAGES, *EXTRA_PINS):
        mod = importlib.import_module(pkg)
        got = getattr(mod, "__version__", None)
        meta = _dist_version(pkg)
        where = os.path.dirname(os.path.dirname(os.path.abspath(mod.__file__ or "")))
        # pip leaves a system-wide install alone when it already is the pinned release, so the
        # module may come from outside the env; what matters is that the pinned release is the
        # one imported (a different system-wide release must be shadowed by the env's)
        origin = "env" if env_site and os.path.realpath(where) == os.path.realpath(env_site) else "system"
        imported[pkg] = {"version": got, "metadata": meta, "path": where, "origin": origin}
        if cell.newest:
            if _release(got) is None or _release(got) != _release(meta):
                problems.append(f"{pkg}: imported {got} from {where} but the installed distribution is {meta}")
            elif pkg in floor and _release(got) < _release(floor[pkg]):  # type: ignore[operator]
                problems.append(f"{pkg}: the newest cell imported {got} from {where}, older than the grid's "
                                f"newest pin {floor[pkg]}: the environment did not upgrade")
            continue
        want = cell.pins()[pkg]
        if _release(got) != _release(want) or _release(meta) != _release(want):
            problems.append(f"{pkg}: pinned {want}, imported {got} (metadata {meta}) from {where}")
    for dist, want in ([] if cell.newest else cell.extras):
        meta = _dist_version(dist)
        if _release(meta) != _release(want):
            problems.append(f"{dist}: pinned {want}, installed {meta or 'nothing'}")
    import torch

    torch_where = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    if _release(torch.__version__) != _release(cell.torch):
        problems.append(f"torch: cell {cell.name} runs on torch {cell.torch}, imported {torch.__version__} from {torch_where}")
    if problems:
        raise RecordError(f"cell {cell.name}: environment does not match the grid:\n  " + "\n  ".join(problems))
    env = {
        "cell": cell.name,
        "newest": cell.newest,
        "python": sys.version.split()[0],
        "pins": cell.pins(),
        "imported": imported,
        "torch_path": torch_where,
        "versions": {name: _dist_version(name) for name in (*PACKAGES, *EXTRA_PINS, *RECORDED)},
        "checked_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "pytest_args": pytest_args,
        "source": _source_commit(),
        "full_suite": full_suite(pytest_args),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / JUNIT_FILE).unlink(missing_ok=True)  # never pair this env with a stale test run
    (out / ENV_FILE).write_text(json.dumps(env, indent=2) + "\n", encoding="utf-8")
    return env


def _newest_pins() -> dict[str, str]:
    from .grid import load

    pinned = load().pinned
    return {pkg: max((c.pins()[pkg] for c in pinned), key=Version) for pkg in (*PACKAGES, *EXTRA_PINS)}


def _source_commit() -> dict[str, Any]:
    """The git commit the tested source comes from, whether tracked files differ from it, and
    the content fingerprints of the tested package and tests (what decides, later, whether the
    run still describes the code: see :mod:`.fingerprint`)."""
    import subprocess

    from . import fingerprint

    prints = fingerprint.current(with_tests=True)
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "fingerprint": prints}
    if head.returncode != 0:
        return {"commit": None, "dirty": None, "fingerprint": prints}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip()), "fingerprint": prints}


# -- step 2: after the runs -----------------------------------------------------------------------

def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and failing test ids from a pytest ``--junitxml`` file."""
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as exc:
        raise RecordError(f"{path}: cannot read junit xml: {exc}") from None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if not suites:
        raise RecordError(f"{path}: no <testsuite> element")
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    failures: list[str] = []
    duration = 0.0
    stamps = []
    for suite in suites:
        duration += float(suite.get("time", 0) or 0)
        if suite.get("timestamp"):
            stamps.append(suite.get("timestamp"))
        for case in suite.iter("testcase"):
            tid = _test_id(case)
            if case.find("failure") is not None:
                counts["failed"] += 1
                failures.append(tid)
            elif case.find("error") is not None:
                counts["errors"] += 1
                failures.append(tid + " (error)")
            elif case.find("skipped") is not None:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    date = min(stamps) if stamps else datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat(timespec="seconds")
    return {**counts, "tests": sum(counts.values()), "duration_s": round(duration, 1), "date": date,
            "failures": failures[:MAX_FAILURE_IDS], "failures_total": len(failures)}


def _test_id(case: ET.Element) -> str:
    """``tests.test_x.TestY::test_z[param]`` (pytest writes the module path dotted into classname)."""
    cls, name = case.get("classname", ""), case.get("name", "")
    return f"{cls}::{name}" if cls else name


def collect(dirs: Iterable[Path], grid: Grid) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Results per cell found under ``dirs`` (a result dir, or a dir holding result dirs), and the
    problems that kept a directory from counting (no junit: pytest did not finish; pins that
    are not the grid's any more; a cell not in the grid)."""
    found: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            problems.append(f"{d}: no such directory")
            continue
        candidates = [d] if (d / ENV_FILE).exists() else sorted(p for p in d.iterdir() if (p / ENV_FILE).exists())
        if not candidates:
            problems.append(f"{d}: no {ENV_FILE} here or one level down")
        for rd in candidates:
            env = json.loads((rd / ENV_FILE).read_text(encoding="utf-8"))
            name = env.get("cell")
            try:
                cell = grid.cell(name)
            except KeyError:
                problems.append(f"{rd}: cell {name!r} is not in the grid (grid.toml changed since that run?)")
                continue
            if env.get("pins") != cell.pins():
                problems.append(f"{rd}: run pinned {env.get('pins')}, grid cell {name} now pins {cell.pins()}: rerun it")
                continue
            if not env.get("full_suite"):
                problems.append(f"{rd}: partial run of {name} (pytest {' '.join(env.get('pytest_args') or ['?'])}): "
                                "only runs of the whole suite are recorded")
                continue
            junit = rd / JUNIT_FILE
            if not junit.exists():
                problems.append(f"{rd}: {ENV_FILE} but no {JUNIT_FILE}: pytest did not finish for {name}")
                continue
            try:
                res = parse_junit(junit)
            except RecordError as exc:
                problems.append(str(exc))
                continue
            versions = env.get("versions") or {}
            ran_torch = _release(versions.get("torch"))
            if ran_torch != Version(cell.torch):
                problems.append(f"{rd}: run on torch {versions.get('torch') or 'unknown'}, grid cell {name} runs on "
                                f"torch {cell.torch}: rerun it")
                continue
            if cell.newest and not (versions.get("transformers") and versions.get("trl")):
                problems.append(f"{rd}: newest cell {name} without recorded transformers / trl versions: rerun it")
                continue
            # the newest cell's releases are the ones its run installed
            t, r = (versions["transformers"], versions["trl"]) if cell.newest else (cell.transformers, cell.trl)
            found[name] = {"transformers": t, "trl": r, "torch": str(ran_torch), "newest": cell.newest,
                           "python": env.get("python"),
                           "versions": versions, "source": env.get("source"), **res}
    return found, problems


def record(dirs: Iterable[Path], grid: Grid, path: Path | None = None) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Merge the results found under ``dirs`` into verified.json.

    Returns the new entries and the problems met; raises :class:`RecordError` (writing
    nothing) when no result at all was found.
    """
    path = path or verified_path()
    new, problems = collect(dirs, grid)
    if not new:
        raise RecordError("no results found (expected DIR/env.json + DIR/junit.xml from tox runs)"
                          + "".join(f"\n  {p}" for p in problems))
    data = load_verified(path)
    data["cells"].update(new)
    # keep grid order; drop results of cells no longer in the grid
    data["cells"] = {c.name: data["cells"][c.name] for c in grid.cells if c.name in data["cells"]}
    data["torch"] = grid.torch
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return new, problems
