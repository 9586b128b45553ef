"""Content fingerprints of the code a matrix run tested.

A recorded run is evidence for the code it ran, not for a commit: the commit that records a run
is itself one commit after it, and unrelated commits (docs) leave the tested code as it was. So
``env-check`` stores, next to the commit, a sha256 over the files that make up

- the package: ``liger_compat/**/*.py`` plus its data files (grid.toml, ...), without
  ``verified.json`` (the results themselves) -- what a user's install has, so ``check()`` can
  compare it there;
- the tests: ``tests/**/*.py`` -- only in a source checkout (recorded beside the package's, so
  that a run says which tests it ran).

``check()`` counts a recorded cell that CI does not run as verified only while the recorded
package fingerprint equals the installed package's (a cell CI runs is verified at every landed
commit, whatever was recorded). The support tables compare no fingerprint.
Cheap: reads ~100 small files, imports nothing heavy.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

#: data files of the package that belong to the fingerprint (those the wheel ships, see
#: pyproject's package-data), relative to the package directory
DATA_GLOBS = ("matrix/*.toml", "matrix/*.json")
#: never part of the fingerprint: the results are written after the run they describe
EXCLUDE = frozenset({"matrix/verified.json"})


def package_dir() -> Path:
    """The directory of the imported ``liger_compat`` package (installed or source)."""
    return Path(__file__).resolve().parents[1]


def _digest(base: Path, files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(files, key=lambda p: p.relative_to(base).as_posix()):
        rel = f.relative_to(base).as_posix().encode()
        data = f.read_bytes()
        h.update(len(rel).to_bytes(4, "big") + rel + len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


def _py_files(base: Path) -> list[Path]:
    return [p for p in base.rglob("*.py") if "__pycache__" not in p.relative_to(base).parts and p.is_file()]


def package_fingerprint(pkg: Path | None = None) -> str:
    """sha256 over the package's ``*.py`` and data files (``verified.json`` excluded)."""
    pkg = Path(pkg) if pkg is not None else package_dir()
    if not (pkg / "__init__.py").is_file():
        raise FileNotFoundError(f"{pkg}: not a package directory (no __init__.py)")
    files = _py_files(pkg)
    for pattern in DATA_GLOBS:
        files += [p for p in pkg.glob(pattern) if p.is_file() and p.relative_to(pkg).as_posix() not in EXCLUDE]
    return _digest(pkg, files)


def tests_fingerprint(tests: Path | None = None) -> str | None:
    """sha256 over ``tests/**/*.py`` of the source checkout; None where there are no tests
    (an installed package)."""
    tests = Path(tests) if tests is not None else package_dir().parent / "tests"
    files = _py_files(tests) if tests.is_dir() else []
    return _digest(tests, files) if files else None


def current(with_tests: bool = False) -> dict[str, str | None]:
    """The fingerprints of the running code: ``{"package": ...}`` plus ``"tests"`` when asked."""
    out: dict[str, str | None] = {"package": package_fingerprint()}
    if with_tests:
        out["tests"] = tests_fingerprint()
    return out


def matches(source: dict | None, now: dict[str, str | None]) -> bool:
    """Whether a recorded run's ``source`` has the fingerprints ``now`` (every key of ``now`` that
    is not None must be recorded and equal; a run without fingerprints never matches)."""
    if not source:
        return False
    recorded = source.get("fingerprint") or {}
    keys = [k for k, v in now.items() if v is not None]
    return bool(keys) and all(recorded.get(k) == now[k] for k in keys)
