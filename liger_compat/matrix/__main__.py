"""``python -m liger_compat.matrix COMMAND``: maintain the version matrix.

  list                          the grid: cells, labels, why each is there
  tox-ini [--check]             (re)generate tox.ini and constraints.txt from grid.toml
  env-check CELL --out DIR      inside a tox env: assert the pins are what Python imports; write DIR/env.json
  record DIR [DIR...]           merge tox results (DIR/env.json + DIR/junit.xml) into verified.json
  readme [--check] [--root DIR] rewrite the support tables of README.md and docs/version-matrix.md
  status [TRANSFORMERS TRL] [--torch V]  verification status of a pair and a torch release (default: installed)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import readme, results, toxgen
from .grid import Grid
from .grid import load as load_grid
from .status import verification_status

ROOT = Path(__file__).resolve().parents[2]


def _write_or_check(path: Path, text: str, check: bool) -> int:
    current = path.read_text(encoding="utf-8") if path.exists() else None
    if current == text:
        print(f"{path}: up to date")
        return 0
    if check:
        print(f"{path}: STALE (regenerate with `python -m liger_compat.matrix tox-ini`)", file=sys.stderr)
        return 1
    path.write_text(text, encoding="utf-8")
    print(f"{path}: written")
    return 0


def _readme(grid: Grid, root: Path, check: bool) -> int:
    """Rewrite (with ``check``: only compare) the support table of each file of :data:`readme.TARGETS`."""
    verified = results.load_verified()
    rc = 0
    for rel, full in readme.TARGETS.items():
        path = root / rel
        try:
            if check:
                ok = readme.is_current(path.read_text(encoding="utf-8"), grid, verified, full)
                rc |= 0 if ok else 1
                said = "up to date" if ok else "OUT OF DATE (run python -m liger_compat.matrix readme)"
            else:
                said = "rewritten" if readme.update(path, grid, verified, full) else "already up to date"
        except (OSError, readme.ReadmeError) as exc:
            print(f"readme: {path}: {exc}", file=sys.stderr)
            return 2
        print(f"{path}: support table {said}")
    return rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m liger_compat.matrix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list")
    t = sub.add_parser("tox-ini")
    t.add_argument("--check", action="store_true", help="exit 1 if tox.ini is stale instead of writing it")
    t.add_argument("--root", type=Path, default=ROOT)
    e = sub.add_parser("env-check")
    e.add_argument("cell")
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--site", help="the env's site-packages (reported: env or system)")
    e.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=None,
                   help="the pytest arguments of this run (record refuses partial runs)")
    r = sub.add_parser("record")
    r.add_argument("dirs", nargs="+", type=Path)
    r.add_argument("--output", type=Path, default=None, help="default: liger_compat/matrix/verified.json")
    m = sub.add_parser("readme")
    m.add_argument("--check", action="store_true", help="exit 1 if a table is out of date instead of writing it")
    m.add_argument("--root", type=Path, default=ROOT)
    s = sub.add_parser("status")
    s.add_argument("transformers", nargs="?")
    s.add_argument("trl", nargs="?")
    s.add_argument("--torch", help="the torch release to judge (default: the installed one)")
    s.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    grid = load_grid()

    if a.cmd == "list":
        for c in grid.cells:
            t, r, a_, d = (c.transformers, c.trl, c.accelerate, c.datasets) if not c.newest else ("newest",) * 4
            print(f"{c.name:24} transformers {t:8} trl {r:7} accelerate {a_:7} "
                  f"datasets {d:6} torch {c.torch:7} {','.join(c.labels):4} {c.why}")
        return 0
    if a.cmd == "tox-ini":
        rc = _write_or_check(a.root / "tox.ini", toxgen.render(grid), a.check)
        for rel, text in toxgen.constraint_files(grid).items():
            rc |= _write_or_check(a.root / rel, text, a.check)
        return rc
    if a.cmd == "env-check":
        try:
            env = results.env_check(grid.cell(a.cell), a.out, a.site, a.pytest_args)
        except (KeyError, results.RecordError) as exc:
            print(f"env-check: {exc}", file=sys.stderr)
            return 2
        v = env["versions"]
        print(f"env-check {a.cell}: python {env['python']}, torch {v['torch']} ({env['torch_path']}), "
              + ", ".join(f"{k} {i['version']} ({i['origin']})" for k, i in env["imported"].items()))
        return 0
    if a.cmd == "record":
        try:
            new, problems = results.record(a.dirs, grid, a.output)
        except results.RecordError as exc:
            print(f"record: {exc}", file=sys.stderr)
            return 2
        for name, r in new.items():
            print(f"{name:18} {r['passed']:5} passed {r['failed']:4} failed {r['errors']:3} errors "
                  f"{r['skipped']:4} skipped  {r['date']}")
        print(f"recorded {len(new)} cell(s) into {a.output or results.verified_path()}; "
              "now run `python -m liger_compat.matrix readme`")
        for prob in problems:
            print(f"record: not recorded: {prob}", file=sys.stderr)
        return 1 if problems else 0
    if a.cmd == "readme":
        return _readme(grid, a.root, a.check)
    if a.cmd == "status":
        if a.transformers is None:
            from ..compat import versions

            a.transformers, a.trl = versions.installed("transformers").raw, versions.installed("trl").raw
        if a.torch is None:
            from ..compat import versions

            a.torch = versions.installed("torch").raw
        st = verification_status(a.transformers, a.trl, torch=a.torch)
        print(json.dumps(st, indent=2) if a.json else st["summary"])
        return 0
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
