"""The shim registry: hooks, gating, failure isolation, idempotence and exact revert.

Each test uses its own Registry and a throwaway module written to a temp directory, so
the real shims and libraries are untouched.
"""

from __future__ import annotations

import importlib
import itertools
import sys
import textwrap

import pytest

from liger_compat import _config
from liger_compat.shims._patching import PatchSet, unwrap
from liger_compat.shims._registry import Registry, Shim, State

_counter = itertools.count()


@pytest.fixture
def target_module(tmp_path, monkeypatch):
    """A fresh importable module ``lc_target_N`` (not yet imported) with a class to patch."""
    name = f"lc_target_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            class Base:
                def forward(self, x):
                    return ("base", x)

            class Model(Base):
                def step(self, x):
                    return x + 1

                @staticmethod
                def helper(x):
                    return x * 2
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch):
    monkeypatch.setattr(_config, "settings", _config.Settings())


def _wrap_step(module, patches: PatchSet) -> None:
    patches.wrap(module.Model, "step", lambda wrapped, inst, args, kw: ("patched", wrapped(*args, **kw)))


def make(name: str, **kw) -> Shim:
    base = dict(id="test.step", library="packaging", trigger=name, target="Model.step",
                upstream="test", _apply=_wrap_step)
    base.update(kw)
    return Shim(**base)


def test_hook_applies_when_module_imported_after_activation(target_module):
    reg = Registry()
    shim = reg.register(make(target_module))
    reg.activate()
    assert shim.state == State.WAITING
    mod = importlib.import_module(target_module)
    assert shim.state == State.APPLIED
    assert mod.Model().step(1) == ("patched", 2)


def test_hook_applies_when_module_imported_before_activation(target_module):
    mod = importlib.import_module(target_module)
    reg = Registry()
    shim = reg.register(make(target_module))
    assert shim.state == State.WAITING  # not active yet: nothing happens on register
    reg.activate()
    assert shim.state == State.APPLIED
    assert mod.Model().step(1) == ("patched", 2)


def test_apply_twice_is_a_noop_and_revert_restores_exact_object(target_module):
    mod = importlib.import_module(target_module)
    original = mod.Model.__dict__["step"]
    reg = Registry()
    shim = reg.register(make(target_module))
    reg.apply()
    first = mod.Model.__dict__["step"]
    reg.apply()
    assert mod.Model.__dict__["step"] is first, "second apply stacked another wrapper"
    assert unwrap(first) is original
    assert reg.revert() == []
    assert mod.Model.__dict__["step"] is original
    assert shim.state == State.REVERTED
    reg.apply()  # and back on again
    assert shim.state == State.APPLIED and mod.Model().step(3) == ("patched", 4)


def test_revert_of_inherited_attribute_deletes_the_override(target_module):
    mod = importlib.import_module(target_module)

    def patch_forward(module, patches):
        patches.wrap(module.Model, "forward", lambda w, i, a, k: ("wrapped",) + w(*a, **k))

    reg = Registry()
    reg.register(make(target_module, _apply=patch_forward))
    reg.apply()
    assert "forward" in mod.Model.__dict__ and mod.Model().forward(1) == ("wrapped", "base", 1)
    reg.revert()
    assert "forward" not in mod.Model.__dict__
    assert mod.Model.forward is mod.Base.forward


def test_staticmethod_stays_static_under_wrapper(target_module):
    mod = importlib.import_module(target_module)

    def patch_helper(module, patches):
        patches.wrap(module.Model, "helper", lambda w, i, a, k: w(*a, **k) + 100)

    reg = Registry()
    reg.register(make(target_module, _apply=patch_helper))
    reg.apply()
    assert mod.Model.helper(3) == 106 and mod.Model().helper(3) == 106
    reg.revert()
    assert mod.Model.helper(3) == 6


def test_failing_apply_is_isolated_and_leaves_nothing_half_done(target_module):
    mod = importlib.import_module(target_module)
    original = mod.Model.__dict__["step"]

    def half_then_fail(module, patches):
        _wrap_step(module, patches)
        raise RuntimeError("upstream moved the function")

    reg = Registry()
    shim = reg.register(make(target_module, _apply=half_then_fail))
    reg.apply()  # must not raise
    assert shim.state == State.FAILED and "upstream moved the function" in shim.reason
    assert mod.Model.__dict__["step"] is original


def test_version_gate(target_module):
    importlib.import_module(target_module)
    reg = Registry()
    out = reg.register(make(target_module, id="a", versions="<1"))  # packaging is >= 20
    inside = reg.register(make(target_module, id="b", versions=">=1", _apply=lambda m, p: None))
    reg.apply()
    assert out.state == State.NOT_NEEDED and "outside <1" in out.reason
    assert inside.state == State.APPLIED


def test_disabled_and_kernel_selection(target_module):
    importlib.import_module(target_module)
    reg = Registry()
    shim = reg.register(make(target_module, kernels=("rope",)))
    _config.settings.kernels = frozenset({"rms_norm"})
    reg.apply()
    assert shim.state == State.DISABLED and "rope" in shim.reason
    _config.settings.kernels = frozenset(_config.ALL_KERNELS)
    _config.settings.disabled = True
    reg.revert()
    reg.apply()
    assert shim.state == State.DISABLED


def test_revert_refuses_to_drop_a_patch_stacked_on_top(target_module):
    mod = importlib.import_module(target_module)
    reg = Registry()
    reg.register(make(target_module))
    reg.apply()
    foreign = lambda self, x: "foreign"  # noqa: E731
    mod.Model.step = foreign
    errors = reg.revert()
    assert errors and "replaced again" in errors[0]
    assert mod.Model.__dict__["step"] is foreign


def test_model_level_patches_are_reverted(target_module):
    mod = importlib.import_module(target_module)
    inst = mod.Model()

    def per_instance(model, patches):
        patches.set(model, "step", lambda x: "instance")
        return True

    reg = Registry()
    reg.register(make(target_module, apply_to_model=per_instance))
    reg.apply(model=inst)
    assert inst.step(1) == "instance"
    reg.revert()
    assert "step" not in inst.__dict__
    assert inst.step(1) == 2  # class patch reverted too


def test_duplicate_ids_and_missing_apply_are_rejected(target_module):
    reg = Registry()
    reg.register(make(target_module))
    with pytest.raises(ValueError, match="registered twice"):
        reg.register(make(target_module))
    with pytest.raises(ValueError, match="exactly one of _apply and patch_module"):
        reg.register(make(target_module, id="other", _apply=None))
    with pytest.raises(ValueError, match="exactly one of _apply and patch_module"):
        reg.register(make(target_module, id="both", patch_module=lambda m, p: []))


def test_patchset_rejects_missing_attribute():
    class K:
        pass

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        PatchSet().set(K, "nope", 1)


def test_suspended_reverts_one_shim_and_applies_it_again(target_module):
    mod = importlib.import_module(target_module)
    original_step, original_forward = mod.Model.__dict__["step"], mod.Base.__dict__["forward"]

    def patch_forward(module, patches):
        patches.wrap(module.Base, "forward", lambda w, i, a, k: ("wrapped",) + w(*a, **k))

    reg = Registry()
    step = reg.register(make(target_module))
    other = reg.register(make(target_module, id="test.forward", _apply=patch_forward))
    reg.apply()
    with reg.suspended("test.step") as shim:
        assert shim is step and step.state == State.REVERTED
        assert mod.Model.__dict__["step"] is original_step  # exactly the native object
        assert other.state == State.APPLIED and mod.Model().forward(1) == ("wrapped", "base", 1)
        # re-applying reads the target afresh: a step replaced meanwhile is the one wrapped on exit
        mod.Model.step = lambda self, x: x * 10
    assert step.state == State.APPLIED and mod.Model().step(2) == ("patched", 20)
    with pytest.raises(RuntimeError, match="inside"):
        with reg.suspended("test.step"):
            raise RuntimeError("inside")
    assert step.state == State.APPLIED and mod.Model().step(2) == ("patched", 20)  # applied again all the same
    assert reg.revert() == []
    assert mod.Base.__dict__["forward"] is original_forward


def test_suspended_leaves_a_shim_that_was_not_applied_alone(target_module):
    importlib.import_module(target_module)
    reg = Registry()
    shim = reg.register(make(target_module, versions=">=999"))  # not needed on this packaging
    reg.apply()
    assert shim.state == State.NOT_NEEDED
    with reg.suspended("test.step"):
        assert shim.state == State.NOT_NEEDED
    assert shim.state == State.NOT_NEEDED
    with pytest.raises(KeyError, match="no shim 'nope'"):
        with reg.suspended("nope"):
            pass


def test_every_shim_says_in_its_status_what_it_does():
    """``description`` is part of each shim's status (``check --json``), one line per shim, no two alike
    except the two halves of a shim that adapts one change in two libraries."""
    from liger_compat.shims import REGISTRY, load_all

    load_all()
    seen: dict[str, list[str]] = {}
    for shim in REGISTRY.shims():
        text = shim.status()["description"]
        assert text.strip() and "\n" not in text.strip(), shim.id
        seen.setdefault(text, []).append(shim.id)
    for text, ids in seen.items():
        assert len(ids) == 1 or len({i.split(".", 1)[1] for i in ids}) == 1, ids


# -- shims that patch several modules (``modules`` + ``patch_module``) -------------------------


@pytest.fixture
def three_modules(tmp_path, monkeypatch):
    """Three fresh importable modules ``lc_sub_N_{a,b,c}``, each with a ``Model.step``; ``b`` is the
    one the test's patch function refuses."""
    n = next(_counter)
    names = [f"lc_sub_{n}_{x}" for x in "abc"]
    for name in names:
        (tmp_path / f"{name}.py").write_text("class Model:\n    def step(self, x):\n        return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield names
    for name in names:
        sys.modules.pop(name, None)


def _per_module_shim(names, calls, **kw):
    def patch_module(module, patches):
        calls.append(module.__name__)
        patches.wrap(module.Model, "step", lambda wrapped, inst, args, kwargs: ("patched", wrapped(*args, **kwargs)))
        if module.__name__ == names[1]:
            raise RuntimeError("upstream moved Model.step")  # after a patch: must be rolled back
        return [f"{module.__name__}.Model.step"]

    base = dict(id="test.per_module", library="packaging", trigger="packaging", target="Model.step",
                upstream="test", modules=tuple(names), patch_module=patch_module)
    base.update(kw)
    return Shim(**base)


def test_each_module_is_patched_when_imported_and_a_failing_one_stays_native(three_modules):
    a, b, c = three_modules
    calls: list[str] = []
    reg = Registry()
    shim = reg.register(_per_module_shim(three_modules, calls))
    mod_a = importlib.import_module(a)  # imported before the registry applies
    reg.activate()
    assert shim.state == State.APPLIED and calls == [a]
    assert mod_a.Model().step(1) == ("patched", 2)
    mod_b = importlib.import_module(b)  # imported afterwards: the hook patches it, and it fails
    mod_c = importlib.import_module(c)
    assert calls == [a, b, c]
    assert mod_b.Model().step(1) == 2 and "step" in vars(mod_b.Model)  # rolled back to the native method
    assert mod_c.Model().step(1) == ("patched", 2)
    st = shim.status()
    assert st["state"] == "applied"
    assert f"patched {a}.Model.step, {c}.Model.step" in st["reason"]
    assert f"failed: {b}: RuntimeError: upstream moved Model.step" in st["reason"]
    assert set(shim.module_errors) == {b}


def test_per_module_patches_revert_exactly_and_apply_again_once(three_modules):
    a, b, c = three_modules
    mods = [importlib.import_module(n) for n in three_modules]
    originals = [vars(m.Model)["step"] for m in mods]
    calls: list[str] = []
    reg = Registry()
    shim = reg.register(_per_module_shim(three_modules, calls))
    reg.activate()
    assert reg.revert() == []
    assert [vars(m.Model)["step"] for m in mods] == originals
    assert shim.state == State.REVERTED and not shim.patched and not shim.module_errors
    importlib.reload(mods[2])  # an import while reverted patches nothing
    assert calls == [a, b, c]
    reg.activate()
    assert calls == [a, b, c, a, b, c]  # each module once more, not once per registration
    assert mods[0].Model().step(1) == ("patched", 2) and mods[1].Model().step(1) == 2
    with reg.suspended(shim.id):
        assert mods[0].Model().step(1) == 2
    assert mods[0].Model().step(1) == ("patched", 2)


def test_per_module_notes_and_in_use_make_the_status(three_modules):
    reg = Registry()
    shim = reg.register(_per_module_shim(three_modules, [], modules=lambda: [], id="test.nothing"))
    reg.activate()
    assert (shim.status()["state"], shim.status()["reason"]) == ("waiting", "waiting for a target module")
    notes = reg.register(_per_module_shim(
        three_modules, [], id="test.notes", modules=three_modules[:1],
        patch_module=lambda m, p: ["not needed: Model.step already takes x"]))
    importlib.import_module(three_modules[0])
    st = notes.status()
    assert (st["state"], st["reason"]) == ("not needed", "Model.step already takes x")
    used = reg.register(_per_module_shim(three_modules, [], id="test.used", modules=three_modules[2:],
                                         in_use=lambda: "in use: Model.step scored by us"))
    importlib.import_module(three_modules[2])
    assert used.status()["reason"] == "in use: Model.step scored by us"
