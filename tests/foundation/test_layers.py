"""The package's rooms and doors, read from the source's imports (the AST, nothing imported).

- ``kernels`` imports no transformers, trl, shims or compat, anywhere in a module;
- ``compat`` imports no shim at module level except through its one declared door
  (``conflicts`` reads the patch bookkeeping of ``shims._patching``, which imports no compat);
  where the report needs the shims' view it asks them from inside a function;
- the family table (``compat/families.py``) imports no shim at all: both sides read it;
- within ``kernels`` no module is imported back, directly or around a loop, by what it imports
  (function-level imports count: a lazy import is still a dependency);
- across the package, the imports that run at module level form no loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "liger_compat"

#: the one compat module that may import a shim module at module level, and what it may import
COMPAT_DOOR = {"liger_compat.compat.conflicts": {"liger_compat.shims._patching"}}


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(source: str, module: str, is_package: bool, *, top_level_only: bool = False) -> set[str]:
    """Absolute names ``module`` imports: for ``from X import y`` the submodule ``X.y`` when there
    is one, else ``X`` itself."""
    tree = ast.parse(source)
    nodes = tree.body if top_level_only else ast.walk(tree)
    here = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for a in node.names:
                sub = f"{src}.{a.name}"
                out.add(sub if sub in MODULES else src)
        elif top_level_only and isinstance(node, (ast.If, ast.Try)):  # guarded module-level imports
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    out |= _imports(ast.unparse(ast.Module(body=[inner], type_ignores=[])), module, is_package)
    return out


def _graph(prefix: str = "liger_compat", *, top_level_only: bool = False) -> dict[str, set[str]]:
    return {m: _imports(p.read_text(), m, p.name == "__init__.py", top_level_only=top_level_only)
            for m, p in MODULES.items() if m.startswith(prefix)}


def _loop(graph: dict[str, set[str]], within: str) -> list[str] | None:
    """A loop of imports among the modules under ``within`` (a package's own ``__init__`` left
    out: a submodule importing its package is how Python imports submodules), or None."""
    nodes = {m for m in graph if m.startswith(within) and not MODULES[m].name == "__init__.py"}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m] & nodes):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(nodes):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def _under(name: str, *roots: str) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def test_kernels_import_no_library_shim_or_compat():
    bad = {m: sorted(d for d in deps if _under(d, "transformers", "trl", "liger_compat.shims", "liger_compat.compat"))
           for m, deps in _graph("liger_compat.kernels").items()}
    assert {m: d for m, d in bad.items() if d} == {}


def test_compat_imports_shims_at_module_level_only_through_its_door():
    bad = {}
    for m, deps in _graph("liger_compat.compat", top_level_only=True).items():
        shims = {d for d in deps if _under(d, "liger_compat.shims")} - COMPAT_DOOR.get(m, set())
        if shims:
            bad[m] = sorted(shims)
    assert bad == {}
    for door, allowed in COMPAT_DOOR.items():  # the door itself leads to no compat module
        for target in allowed:
            assert not any(_under(d, "liger_compat.compat") for d in _graph(target)[target]), target


def test_family_table_imports_no_shim():
    deps = _graph("liger_compat.compat.families")["liger_compat.compat.families"]
    assert not [d for d in deps if _under(d, "liger_compat.shims")]


def test_no_kernel_module_is_imported_back_by_what_it_imports():
    assert _loop(_graph("liger_compat.kernels"), "liger_compat.kernels") is None


def test_module_level_imports_form_no_loop():
    assert _loop(_graph(top_level_only=True), "liger_compat") is None


def test_loop_finder_sees_a_loop_and_a_lazy_import():
    """The checks above can fail: they see a two-module loop, a longer one, and a function-level import."""
    src_a = "from . import b\n"
    src_b = "def f():\n    from . import a\n"
    MODULES.update({f"liger_compat.kernels.{m}": PKG / "kernels" / f"{m}.py" for m in "abc"})
    try:
        g = {"liger_compat.kernels.a": _imports(src_a, "liger_compat.kernels.a", False),
             "liger_compat.kernels.b": _imports(src_b, "liger_compat.kernels.b", False)}
        assert _loop(g, "liger_compat.kernels") == ["liger_compat.kernels.a", "liger_compat.kernels.b",
                                                    "liger_compat.kernels.a"]
        top = {m: _imports(s, m, False, top_level_only=True) for m, s in
               (("liger_compat.kernels.a", src_a), ("liger_compat.kernels.b", src_b))}
        assert _loop(top, "liger_compat.kernels") is None
        g["liger_compat.kernels.b"] = {"liger_compat.kernels.c"}
        g["liger_compat.kernels.c"] = {"liger_compat.kernels.a"}
        assert _loop(g, "liger_compat.kernels") == ["liger_compat.kernels.a", "liger_compat.kernels.b",
                                                    "liger_compat.kernels.c", "liger_compat.kernels.a"]
    finally:
        for m in ("a", "b", "c"):
            MODULES.pop(f"liger_compat.kernels.{m}", None)


#: what a stack-only test may not reach: every library a grid cell pins besides torch, and the
#: parts of the package that read or patch them
PINNED_LIBRARIES = ("transformers", "trl", "accelerate", "datasets", "peft", "liger_kernel",
                    "liger_compat.shims", "liger_compat.compat")


def _reach(path: Path, seen: set[Path]) -> set[str]:
    """The names imported by a test-side module (anywhere in it), and by the repository modules it
    reaches: helper modules beside it (``import harness``) and ``benchmarks.*``."""
    if path in seen:
        return set()
    seen.add(path)
    names = _imports(path.read_text(), path.stem, False)
    for n in list(names):
        local = [path.with_name(n.split(".")[0] + ".py"), ROOT / (n.replace(".", "/") + ".py")]
        for f in local:
            if f.is_file() and (n.startswith("benchmarks.") or f.parent == path.parent):
                names |= _reach(f, seen)
    return names


def test_stack_only_tests_reach_no_pinned_library():
    """tests/kernels (``STACK_ONLY_DIRS`` in tests/suite_scope.py) is skipped by grid cells on the torch and
    Triton of CI's passed main run: its modules, the helpers and benchmark modules they import, and
    the package modules they use must reach no library a cell pins but torch."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from suite_scope import STACK_ONLY_DIRS
    finally:
        sys.path.pop(0)
    bad = {}
    for d in STACK_ONLY_DIRS:
        for f in sorted((ROOT / "tests" / d).glob("*.py")):
            names = _reach(f, set())
            # the package modules they use, but not the package's root: importing it installs hooks that
            # act only when a pinned library is imported, and its functions (check, apply) are not used
            pkg = {n for n in names if _under(n, "liger_compat") and n != "liger_compat"}
            names |= {dep for m in pkg if m in MODULES for dep in _graph(m).get(m, set())}
            hits = sorted(n for n in names if _under(n, *PINNED_LIBRARIES))
            if hits:
                bad[f.name] = hits
    assert bad == {}


def test_stack_only_reach_sees_an_import_through_a_helper(tmp_path):
    """The check above can fail: a helper beside the test that imports transformers is seen."""
    (tmp_path / "helper.py").write_text("def f():\n    import transformers\n")
    (tmp_path / "test_x.py").write_text("import helper\n")
    assert "transformers" in _reach(tmp_path / "test_x.py", set())
