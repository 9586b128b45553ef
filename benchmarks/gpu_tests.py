"""The GPU-marked tests on this machine, recorded with the commit they ran at.

    python -m benchmarks.gpu_tests [--commit SHA] [--out DIR] [-- PYTEST ARGS]

Runs ``pytest -m gpu tests`` (the tests skipped without CUDA) and writes ``gpu_tests.json`` and
``gpu_tests.md``: the commit (``--commit``, else ``git rev-parse HEAD``; the device machine gets a
copy of the working tree without ``.git``), the device and library versions, the counts and every
test that failed or was skipped with its reason. Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

from . import _results


def _commit(given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_junit(path: str) -> dict:
    """Counts and the non-passing cases of a pytest junit file."""
    root = ET.parse(path).getroot()
    cases = []
    for tc in root.iter("testcase"):
        name = f"{tc.get('classname', '')}::{tc.get('name', '')}"
        outcome, detail = "passed", ""
        for kind in ("failure", "error", "skipped"):
            el = tc.find(kind)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                detail = (el.get("message") or el.text or "")[:300]
                break
        cases.append({"test": name, "outcome": outcome, "detail": detail})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return {"counts": counts, "not_passed": [c for c in cases if c["outcome"] != "passed"]}


def markdown(data: dict) -> str:
    c = data["counts"]
    lines = [f"GPU tests (`pytest -m gpu tests`) at commit `{data['commit']}` on {data['device']}, "
             f"torch {data['torch']}, triton {data['triton']}, transformers {data['transformers']}: "
             f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped.", ""]
    if data["not_passed"]:
        lines += ["| test | outcome | detail |", "|---|---|---|"]
        lines += [f"| `{r['test']}` | {r['outcome']} | {r['detail'].replace('|', '/').splitlines()[0] if r['detail'] else ''} |"
                  for r in data["not_passed"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, _, extra = (argv[: argv.index("--")], None, argv[argv.index("--") + 1:]) if "--" in argv else (argv, None, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit")
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = ap.parse_args(ours)
    import torch
    import transformers
    import triton

    with tempfile.TemporaryDirectory() as tmp:
        junit = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs",
               f"--junitxml={junit}", *(extra or ["tests"])]
        rc = subprocess.run(cmd).returncode
        if not os.path.exists(junit):
            print(f"pytest wrote no junit file (exit {rc})", file=sys.stderr)
            return rc or 1
        data = parse_junit(junit)
    data = {"commit": _commit(args.commit),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device",
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "pytest_exit": rc, **data}
    regen = _results.command("benchmarks.gpu_tests", [a for a in ours if not a.startswith("--commit")
                                                      and a != args.commit])
    _results.write(args.out, "gpu_tests", data, markdown(data), regen)
    return rc


if __name__ == "__main__":
    sys.exit(main())
