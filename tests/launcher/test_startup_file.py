"""The start-up file opt-in: ``liger-compat enable`` makes every Python of an environment activate
liger_compat at start-up, ``liger-compat disable`` undoes it. Run against a fresh virtual environment
made here, never the real site-packages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from liger_compat import launcher
from liger_compat.compat import report

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "liger_compat", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=120)


@pytest.fixture
def fresh_venv(tmp_path):
    """A new virtual environment (no pip, no liger_compat installed in it) and its site-packages."""
    root = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    python = root / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return python, Path(site)


def _probe(python: Path, tmp_path: Path) -> dict:
    """Start the environment's Python (liger_compat importable from this checkout) and say whether and
    how liger_compat was activated before the program's first line."""
    code = ("import json, sys; loaded = 'liger_compat' in sys.modules; "
            "a = sys.modules.get('liger_compat._activation'); from liger_compat import launcher; "
            "print(json.dumps({'loaded': loaded, 'how': a and a.how, "
            "'files': launcher.startup_files()}))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGER_COMPAT_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return json.loads(proc.stdout)


def test_enable_disable_round_trip(fresh_venv, tmp_path):
    python, site = fresh_venv
    assert _probe(python, tmp_path) == {"loaded": False, "how": None, "files": []}

    enabled = _cli("enable", "--target", str(site))
    assert enabled.returncode == 0, enabled.stderr
    path = site / launcher.STARTUP_FILE
    assert path.is_file() and str(path.parent) in enabled.stdout
    assert _probe(python, tmp_path) == {"loaded": True, "how": "startup file", "files": [str(path)]}

    again = _cli("enable", "--target", str(site))  # idempotent
    assert again.returncode == 0 and sorted(p.name for p in site.glob("*.pth")) == [launcher.STARTUP_FILE]

    disabled = _cli("disable", "--target", str(site))
    assert disabled.returncode == 0 and str(path) in disabled.stdout
    assert not path.exists()
    assert _probe(python, tmp_path) == {"loaded": False, "how": None, "files": []}
    nothing = _cli("disable", "--target", str(site))
    assert nothing.returncode == 0 and "nothing to do" in nothing.stdout


def test_startup_file_without_liger_compat_is_silent(fresh_venv, tmp_path):
    """Once liger_compat is gone (here: the start-up file it names does not exist) the line does nothing."""
    python, site = fresh_venv
    (site / launcher.STARTUP_FILE).write_text(
        launcher.startup_line(tmp_path / "gone" / "sitecustomize.py") + "\n", encoding="utf-8")
    proc = subprocess.run([str(python), "-c", "import sys; print('liger_compat' in sys.modules)"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "False\n", "")


def test_disable_leaves_a_file_it_did_not_write(tmp_path):
    foreign = tmp_path / launcher.STARTUP_FILE
    foreign.write_text("import something_else\n")
    proc = _cli("disable", "--target", str(tmp_path))
    assert proc.returncode == 1 and "was not written by liger-compat enable" in proc.stderr
    assert foreign.read_text() == "import something_else\n"
    bad = _cli("enable", "--target", str(tmp_path / "missing"))
    assert bad.returncode == 1 and "is not a directory" in bad.stderr


def test_report_lines_name_the_way_process_and_ranks():
    act = {"how": "launcher", "by": "liger-compat run", "pid": 100,
           "process": {"pid": 123, "executable": "python", "argv": []},
           "ranks": {"RANK": "3", "WORLD_SIZE": "8"}, "startup_files": ["/x/liger_compat_startup.pth"]}
    lines = report._activation_lines(act)
    assert lines == ["  by liger-compat run, in pid 100; this process (pid 123) inherited it from there",
                     "  rank variables: RANK=3, WORLD_SIZE=8",
                     "  start-up file (liger-compat enable): /x/liger_compat_startup.pth"]
