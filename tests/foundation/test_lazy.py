"""liger_compat._lazy: importlib.metadata deferred by ``import liger_compat`` still works when used."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest

from liger_compat import _lazy


def _run(code: str) -> dict:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_deferred_importlib_metadata_loads_on_first_use():
    d = _run(
        """
        import json, sys
        already = "importlib.metadata" in sys.modules
        import liger_compat
        import importlib.metadata as md
        import importlib
        lazy_after_import_statement = "version" not in vars(md)
        from importlib.metadata import PackageNotFoundError, entry_points, version
        import wrapt
        try:
            version("definitely-not-an-installed-distribution")
            missing = "found"
        except PackageNotFoundError:
            missing = "PackageNotFoundError"
        from liger_compat.compat import versions
        print(json.dumps({
            "already": already,
            "lazy": lazy_after_import_statement,
            "same_module": md is sys.modules["importlib.metadata"] is importlib.metadata,
            "wrapt": [version("wrapt"), wrapt.__version__],
            "ours": versions.installed("wrapt").raw,
            "missing": missing,
            "scripts": [e.name for e in entry_points(group="console_scripts") if e.name == "liger-compat"],
            "hooks_gone": "__getattr__" not in vars(md) and "__dir__" not in vars(md),
            "submodules": "importlib.metadata._adapters" in sys.modules,
            "file": md.__file__.endswith("__init__.py"),
        }))
        """
    )
    assert d["already"] or d["lazy"]
    assert d["same_module"]
    assert d["wrapt"][0] == d["wrapt"][1] == d["ours"]
    assert d["missing"] == "PackageNotFoundError"
    assert d["scripts"] == ["liger-compat"]
    assert d["hooks_gone"] and d["submodules"] and d["file"]


def test_attribute_set_before_the_load_is_kept():
    # the pattern of test_check_without_transformers_and_trl_reports_them_absent, after import liger_compat
    d = _run(
        """
        import json, sys
        import liger_compat
        import importlib.metadata as md
        def stub(name):
            return "stub"
        md.version = stub
        err = md.PackageNotFoundError  # loads the module
        print(json.dumps({"kept": md.version is stub, "err": err.__name__, "wrapt": md.version("wrapt")}))
        """
    )
    assert d == {"kept": True, "err": "PackageNotFoundError", "wrapt": "stub"}


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A throw-away package on sys.path whose import takes a while, counts its runs and probes
    itself mid-load; its name, and sys.modules cleaned afterwards."""
    name = "liger_lazy_probe_pkg"
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(
        """
        import time
        RUNS = globals().get("RUNS", 0) + 1
        time.sleep(0.2)  # a window for the other threads
        probed = hasattr(__import__(__name__), "missing_attr")  # the module probing itself mid-load
        from . import sub
        VALUE = 42
        """
    ))
    (pkg / "sub.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for m in (name, f"{name}.sub"):
        sys.modules.pop(m, None)


def test_defer_runs_the_module_once_on_first_use(probe):
    name = probe
    _lazy.defer(name)
    mod = sys.modules[name]
    exec(f"import {name}")  # an import statement reads __spec__: no load
    assert "VALUE" not in vars(mod) and mod.__name__ == name and mod.__path__
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(getattr(mod, "VALUE"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [42] * 4
    assert mod.RUNS == 1 and mod.probed is False and mod.sub.X == 1
    assert "__getattr__" not in vars(mod) and "VALUE" in dir(mod)
    _lazy.defer(name)  # already imported: nothing happens
    assert sys.modules[name] is mod


def test_defer_dir_loads_and_unknown_names_are_ignored(probe):
    _lazy.defer(probe)
    assert "VALUE" in dir(sys.modules[probe])
    _lazy.defer("liger_no_such_module_anywhere")
    assert "liger_no_such_module_anywhere" not in sys.modules
