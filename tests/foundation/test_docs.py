"""The README's generated sections match what the generators produce from committed data."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_performance_section_is_current():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "readme_perf.py"), "--check"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_readme_set_up_commands_match_ci():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = "python -m pytest -q -n 2 tests"
    assert test_cmd in readme
    assert "python3 -m pytest -q -n 2 tests" in ci
    assert "liger-compat check --deep" in readme and "liger-compat check --deep" in ci
