"""Where a benchmark's results go: ``<name>.json`` and ``<name>.md`` under the output folder.

Every result file names the command that regenerates it: the JSON has a top-level
``"regenerate"`` string, the markdown starts with a ``regenerate: `...` `` line.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

#: the script that writes the multi-GPU results (distributed_2gpu*, distributed_scaling*)
DISTRIBUTED = "OUT=benchmarks/results WITH_ZERO3=1 bash benchmarks/distributed_gpu_run.sh"


def command(module: str, argv: list[str]) -> str:
    """``python -m <module> <argv>``, less ``--out DIR``: the command that writes this result
    into ``benchmarks/results`` (the default output folder)."""
    args, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            args.append(a)
    return shlex.join(["python", "-m", module, *args])


def md_line(cmd: str) -> str:
    """The first line of a result's markdown."""
    return f"regenerate: `{cmd}`\n\n"


def profile_text(profile, order: str, limit: int) -> str:
    """A ``cProfile.Profile``'s table, sorted by ``order`` (``"tottime"``, ``"cumulative"``),
    its first ``limit`` functions."""
    import io
    import pstats

    buf = io.StringIO()
    pstats.Stats(profile, stream=buf).sort_stats(order).print_stats(limit)
    return buf.getvalue()


def with_command(data, cmd: str) -> dict:
    """``data`` as a JSON object whose first key is ``regenerate`` (a list becomes ``rows``)."""
    body = {"rows": data} if isinstance(data, list) else {k: v for k, v in data.items() if k != "regenerate"}
    return {"regenerate": cmd, **body}


def rows(data) -> list:
    """The rows of a result written by :func:`write` (or of an older bare list)."""
    return data["rows"] if isinstance(data, dict) else data


def write(out: str | Path, name: str, data, markdown: str, cmd: str) -> None:
    """Write ``data`` as JSON and ``markdown`` beside it, each naming ``cmd``, and print the markdown."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(with_command(data, cmd), indent=2))
    markdown = md_line(cmd) + markdown
    (out / f"{name}.md").write_text(markdown)
    print(markdown)


def table_rows(rows: list[dict], impls, ncols: int):
    """For a results table with one row per (model, shape, impl): ``(line, None, None)`` for a row
    whose status is not ok (the status in the step column, ``ncols`` columns), else ``(None, row,
    {impl: row})`` with the other implementations of the same (model, shape); rows ordered by
    (model, shape) as first seen, then as in ``impls``."""
    by: dict = {}
    for r in rows:
        by.setdefault((r["model"], r["shape"]), {})[r["impl"]] = r
    for (m, s), d in by.items():
        for impl in impls:
            r = d.get(impl)
            if r is None:
                continue
            if r.get("status") != "ok":
                yield f"| {m} | {s} | {impl} | {r.get('status')} |" + " |" * (ncols - 4), None, None
            else:
                yield None, r, d


class SyncSites:
    """A context that records the host syncs made inside it on CUDA
    (``torch.cuda.set_sync_debug_mode("warn")``), each with the innermost frames of the stack that
    made it, in :attr:`found`."""

    def __init__(self, frames: int = 8):
        self.frames = frames
        self.found: list[str] = []

    def __enter__(self):
        import traceback
        import warnings

        import torch

        torch.cuda.synchronize()
        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("always")
        self._old = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "prototype feature" in str(message):  # torch's notice on turning the mode on, not a sync
                return
            frames = [f"{fs.filename.split('site-packages/')[-1]}:{fs.lineno} {fs.name}"
                      for fs in traceback.extract_stack()[:-1] if not fs.filename.endswith("warnings.py")]
            self.found.append(f"{str(message)[:80]} <- " + " <- ".join(reversed(frames[-self.frames:])))

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        import warnings

        import torch

        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = self._old
        self._ctx.__exit__(*exc)
        torch.cuda.synchronize()
        return False
