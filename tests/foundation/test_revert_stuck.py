"""A patch another library wrapped over cannot be removed: ``revert()`` keeps it recorded, reports
it on every call, and our wrapper falls through to the native code; ``apply()`` makes it ours again."""

from __future__ import annotations

import importlib
import itertools
import sys
import textwrap

import pytest

from liger_compat import _config
from liger_compat.shims._patching import PatchSet
from liger_compat.shims._registry import Registry, Shim, State

_counter = itertools.count()


@pytest.fixture
def target_module(tmp_path, monkeypatch):
    name = f"lc_stuck_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(
        """
        class Model:
            def step(self, x):
                return x + 1
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch):
    monkeypatch.setattr(_config, "settings", _config.Settings())


def _shim(name: str, traceable: bool) -> Shim:
    def apply(module, patches: PatchSet) -> None:
        patches.wrap(module.Model, "step", lambda wrapped, inst, args, kw: ("ours", wrapped(*args, **kw)),
                     traceable=traceable)

    return Shim(id="test.step", library="packaging", trigger=name, target="Model.step", upstream="test",
                _apply=apply)


@pytest.mark.parametrize("traceable", [False, True], ids=["wrapt", "traceable"])
def test_a_wrapped_over_patch_stays_recorded_inert_and_reported_on_every_revert(target_module, traceable):
    mod = importlib.import_module(target_module)
    original = mod.Model.__dict__["step"]
    reg = Registry()
    shim = reg.register(_shim(target_module, traceable))
    reg.apply()
    assert mod.Model().step(1) == ("ours", 2)
    ours = mod.Model.__dict__["step"]

    def foreign(self, x):  # another library wraps over ours
        return ("foreign", ours(self, x))

    mod.Model.step = foreign
    first = reg.revert()
    assert first and "replaced again" in first[0]
    assert mod.Model().step(1) == ("foreign", 2), "our wrapper still runs after revert()"
    assert shim.state == State.REVERTED
    assert "could not remove Model.step" in shim.status()["reason"]
    assert reg.revert() == first, "the patch left in place is reported again"
    # apply() again: a new wrapper of ours over the other library's, the old one still inert
    reg.apply()
    assert mod.Model().step(1) == ("ours", ("foreign", 2))
    again = reg.revert()
    assert again == first and mod.Model.__dict__["step"] is foreign
    # the other library goes away: the next revert removes ours too
    mod.Model.step = ours
    assert reg.revert() == []
    assert mod.Model.__dict__["step"] is original
    assert not shim.stuck and "could not remove" not in shim.status()["reason"]
    assert reg.revert() == []
