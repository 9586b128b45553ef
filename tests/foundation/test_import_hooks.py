"""The post-import hook mechanism every shim rides on (liger_compat._import_hooks).

Each case runs in a fresh interpreter with a probe package written to a temporary directory, so
the import under test really happens (nothing is in sys.modules yet).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest


@pytest.fixture
def probe_dir(tmp_path):
    pkg = tmp_path / "hookprobe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("ORDER = []\nVALUE = 41\nVALUE += 1\n")
    (pkg / "sub.py").write_text("import hookprobe\nhookprobe.ORDER.append('sub executed')\nDONE = True\n")
    (pkg / "selfref.py").write_text(textwrap.dedent(
        """
        # registers a hook for itself while it is being executed
        from liger_compat import _import_hooks
        import hookprobe
        _import_hooks.when_imported(__name__, lambda m: hookprobe.ORDER.append(('selfref hook', m.FINISHED)))
        FINISHED = True
        """))
    (pkg / "swap.py").write_text(textwrap.dedent(
        """
        import sys, types
        replacement = types.ModuleType(__name__)
        replacement.SWAPPED = True
        sys.modules[__name__] = replacement  # as transformers' _LazyModule does
        """))
    return tmp_path


def _run(probe_dir, code: str) -> dict:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=120, env={"PYTHONPATH": f"{probe_dir}:{':'.join(sys.path)}", "PATH": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_hook_fires_after_the_module_executed_and_leaves_the_real_loader(probe_dir):
    d = _run(probe_dir, """
        import json, sys
        from liger_compat import _import_hooks
        seen = []
        _import_hooks.when_imported("hookprobe", lambda m: seen.append(m.VALUE))
        _import_hooks.when_imported("hookprobe.sub", lambda m: seen.append(("sub", m.DONE)))
        assert seen == []
        import hookprobe.sub
        import hookprobe.sub  # a second import does not fire again
        loader = type(hookprobe.sub.__loader__).__name__
        print(json.dumps({"seen": seen, "loader": loader, "spec_loader": type(hookprobe.__spec__.loader).__name__}))
        """)
    assert d["seen"] == [42, ["sub", True]]
    assert d["loader"] == d["spec_loader"] == "SourceFileLoader"


def test_a_callback_registered_twice_fires_once_per_import_and_at_once_when_imported(probe_dir):
    d = _run(probe_dir, """
        import json
        from liger_compat import _import_hooks
        seen = []
        cb = lambda m: seen.append(m.__name__)
        _import_hooks.when_imported("hookprobe.sub", cb)
        _import_hooks.when_imported("hookprobe.sub", cb)
        import hookprobe.sub
        on_import = list(seen)
        _import_hooks.when_imported("hookprobe.sub", cb)  # as a shim re-applying after revert()
        print(json.dumps({"on_import": on_import, "after": seen}))
        """)
    assert d["on_import"] == ["hookprobe.sub"]
    assert d["after"] == ["hookprobe.sub", "hookprobe.sub"]


def test_hook_registered_mid_import_runs_once_the_module_finished(probe_dir):
    d = _run(probe_dir, """
        import json
        import hookprobe
        from liger_compat import _import_hooks
        import hookprobe.selfref
        before = list(hookprobe.ORDER)
        _import_hooks.flush_pending()
        _import_hooks.flush_pending()
        print(json.dumps({"before": before, "after": hookprobe.ORDER}))
        """)
    assert d["before"] == []
    assert d["after"] == [["selfref hook", True]]


def test_hook_gets_the_module_that_replaced_itself_in_sys_modules(probe_dir):
    d = _run(probe_dir, """
        import json
        from liger_compat import _import_hooks
        seen = []
        _import_hooks.when_imported("hookprobe.swap", lambda m: seen.append(getattr(m, "SWAPPED", False)))
        import hookprobe.swap
        print(json.dumps({"seen": seen}))
        """)
    assert d["seen"] == [True]


def test_wrapt_is_imported_when_a_target_library_is_imported_not_before():
    pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        import liger_compat
        print("wrapt" in sys.modules)
        import transformers.models.llama.modeling_llama as m
        print("wrapt" in sys.modules, liger_compat._REGISTRY.get("transformers.fused_causal_lm_forward").state.value)
        import transformers.trainer
        print("wrapt" in sys.modules, liger_compat._REGISTRY.get("transformers.num_items_in_batch_labels").state.value)
        """)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # the model patches are plain functions (traceable by torch.compile): applied without wrapt;
    # the trainer patches are wrapt wrappers, and wrapt comes with the first of them
    words = r.stdout.split()
    assert words[:4] == ["False", "False", "applied", "True"], words
    assert " ".join(words[4:]) in ("applied", "not needed"), words  # not needed before transformers 4.46
