"""The output of a fused training call is structurally the native one: it survives what DDP, FSDP and
accelerate do to outputs (a torch pytree flatten and rebuild), pickle and deepcopy; and reading its
skipped ``logits`` outside a trainer says how to get them.

DDP with ``find_unused_parameters=True`` (the ``transformers.Trainer`` default) rebuilds every output
with ``cls(**dict(keys, values))``: a ``token_accuracy`` key that is no field of the class raised
``TypeError: ... unexpected keyword argument 'token_accuracy'`` on the first step.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
import torch.utils._pytree as pytree

import liger_compat
from liger_compat import _config
from liger_compat.compat.families import FAMILIES
from liger_compat.shims import causal_lm, training_output
from model_helpers import family_model_and_batch, native

FUSED = [f.name for f in FAMILIES if not f.why_native()]


def _model_and_batch(family: str, seed: int):
    model, kw, labels, ref = family_model_and_batch(family, seed)
    model.native_output = ref
    return model, kw, labels, type(ref)


def _same_values(a, b):
    assert list(a.keys()) == list(b.keys())
    for k in a.keys():
        x, y = a[k], b[k]
        if torch.is_tensor(x):
            assert torch.equal(x, y), k
        else:
            assert type(x) is type(y), k


@pytest.mark.parametrize("family", FUSED)
def test_training_output_survives_a_pytree_round_trip_and_is_the_native_class(family):
    model, kw, labels, native_cls = _model_and_batch(family, seed=5)
    out = model(**kw, labels=labels)
    assert out.logits is None and out.token_accuracy is not None
    # the native class, by isinstance and name, its fields first in the native order, token_accuracy last
    assert isinstance(out, native_cls) and type(out).__name__ == native_cls.__name__
    names = [f.name for f in dataclasses.fields(out)]
    assert names == [f.name for f in dataclasses.fields(native_cls)] + ["token_accuracy"]

    try:
        pytree.tree_unflatten(*pytree.tree_flatten(model.native_output))
    except TypeError as exc:  # a nested output of the native forward that does not survive it either
        with pytest.raises(TypeError, match=str(exc).split("(")[0]):
            pytree.tree_unflatten(*pytree.tree_flatten(out))
        pytest.skip(f"the native {family} output fails the round trip too: {exc}")
    leaves, spec = pytree.tree_flatten(out)
    back = pytree.tree_unflatten(leaves, spec)  # what DDP's _post_forward does
    assert type(back) is type(out)
    assert back.loss is out.loss and back.token_accuracy is out.token_accuracy
    _same_values(back, out)
    back.loss.backward()  # the rebuilt loss still reaches the weights
    assert model.lm_head.weight.grad is not None
    # the spec serialises and loads back to this class (a serialized type name of its own)
    assert pytree.treespec_loads(pytree.treespec_dumps(spec)) == spec


@pytest.mark.parametrize("family", ["llama", "mixtral", "gemma3"])
def test_training_output_pickles_and_deep_copies(family):
    model, kw, labels, native_cls = _model_and_batch(family, seed=6)
    with torch.no_grad():  # (deepcopy of a non-leaf tensor fails natively too)
        out = model(**kw, labels=labels)
    for copied in (pickle.loads(pickle.dumps(out)), copy.deepcopy(out)):
        assert type(copied) is type(out) and isinstance(copied, native_cls)
        assert list(copied.keys()) == list(out.keys())
        assert torch.equal(copied.loss, out.loss) and torch.equal(copied.token_accuracy, out.token_accuracy)
        assert copied.logits is None
    assert pickle.loads(pickle.dumps(type(out))) is type(out)  # the class itself, by module and name


def test_training_output_unpickles_in_a_fresh_process(tmp_path):
    model, kw, labels, native_cls = _model_and_batch("mixtral", seed=7)
    with torch.no_grad():
        out = model(**kw, labels=labels)
    (tmp_path / "out.pkl").write_bytes(pickle.dumps(out))
    (tmp_path / "cls.pkl").write_bytes(pickle.dumps(type(out)))
    code = (
        "import json, pickle\n"
        f"out = pickle.loads(open({str(tmp_path / 'out.pkl')!r}, 'rb').read())\n"
        f"cls = pickle.loads(open({str(tmp_path / 'cls.pkl')!r}, 'rb').read())\n"
        "assert cls is type(out), (cls, type(out))\n"
        "print(json.dumps([type(out).__name__, type(out).__mro__[1].__module__, list(out.keys()),"
        " float(out.loss), float(out.token_accuracy)]))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    name, module, keys, loss, acc = json.loads(res.stdout.strip().splitlines()[-1])
    assert (name, module, keys) == (native_cls.__name__, native_cls.__module__, list(out.keys()))
    assert loss == float(out.loss) and acc == float(out.token_accuracy)


def test_same_named_native_classes_get_distinct_classes_and_serialized_names():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # another modeling module's class of the same name (as a model's remote code may define)
    other = dataclasses.dataclass(type("CausalLMOutputWithPast", (CausalLMOutputWithPast,),
                                       {"__module__": "my_remote_model.modeling", "__annotations__": {}}))
    a, b = training_output.training_class(CausalLMOutputWithPast), training_output.training_class(other)
    assert a is not b and a.__name__ == b.__name__ == "CausalLMOutputWithPast"
    assert training_output.training_class(other) is b  # made once
    assert getattr(training_output, a.__qualname__) is a and getattr(training_output, b.__qualname__) is b
    names = [pytree.SUPPORTED_SERIALIZED_TYPES[c].serialized_type_name for c in (a, b, CausalLMOutputWithPast, other)]
    assert len(set(names)) == 4, names
    x = b(loss=torch.randn(()), token_accuracy=torch.rand(()))
    leaves, spec = pytree.tree_flatten(x)
    assert type(pytree.tree_unflatten(leaves, spec)) is b


def test_return_dict_false_is_the_native_tuple_without_token_accuracy():
    model, kw, labels, _ = _model_and_batch("llama", seed=8)
    tup = model(**kw, labels=labels, return_dict=False)
    assert type(tup) is tuple and tup[1] is None  # the loss, then the skipped logits' place
    with native():
        ref = model(**kw, labels=labels, return_dict=False)
    assert len(tup) == len(ref)
    torch.testing.assert_close(tup[0], ref[0], rtol=1e-5, atol=1e-5)


@pytest.fixture
def _hint_armed(monkeypatch):
    monkeypatch.setattr(training_output, "_hinted", False)
    monkeypatch.setattr(training_output, "trainer_steps", 0)


def test_reading_skipped_logits_outside_a_trainer_warns_once_naming_the_setting(_hint_armed):
    model, kw, labels, _ = _model_and_batch("llama", seed=9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(**kw, labels=labels)
        back = pytree.tree_unflatten(*pytree.tree_flatten(out))  # constructing warns nothing
        assert "logits" not in out and out.get("logits") is None and "logits" not in back
        with pytest.raises(KeyError):
            out["logits"]
        assert not caught
        assert out.logits is None  # code that checks `is None` still sees None
        assert out.logits is None and back.logits is None
    hints = [w for w in caught if issubclass(w.category, training_output.LogitsSkippedWarning)]
    assert len(hints) == 1, [str(w.message) for w in caught]
    msg = str(hints[0].message)
    for setting in ("LIGER_COMPAT_RETURN_LOGITS=1", "liger_compat.configure(return_logits=True)",
                    "return_logits=True"):
        assert setting in msg
    assert hints[0].filename == __file__  # points at the line that read it


def test_no_hint_inside_a_trainer_step_or_when_logits_are_returned(_hint_armed):
    model, kw, labels, _ = _model_and_batch("llama", seed=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        training_output.trainer_steps = 1
        assert model(**kw, labels=labels).logits is None
        training_output.trainer_steps = 0
        with_logits = model(**kw, labels=labels, return_logits=True)
        assert with_logits.logits is not None and with_logits.token_accuracy is not None
    assert not caught, [str(w.message) for w in caught]


def test_a_marked_instance_returns_logits_and_another_of_its_class_does_not():
    model, kw, labels, _ = _model_and_batch("llama", seed=11)
    other = copy.deepcopy(model)
    model.__dict__[causal_lm.RETURN_LOGITS_ATTR] = True
    out, plain = model(**kw, labels=labels), other(**kw, labels=labels)
    assert plain.logits is None
    with native():
        ref = model(**kw, labels=labels)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
    assert out.token_accuracy is not None and not _config.return_logits()
    liger_compat.apply()


def test_the_outputs_scenario_passes_and_catches_an_output_with_an_extra_key(monkeypatch):
    from liger_compat.compat import scenarios

    sc = next(s for s in scenarios.registered() if s.id == "outputs")
    detail = sc.func(scenarios.Context())
    assert "CausalLMOutputWithPast" in detail and "MoeCausalLMOutputWithPast" in detail

    def extra_key(native):  # what the fused forward returned before: the native class plus a key
        def make(token_accuracy=None, **fields):
            out = native(**fields)
            out["token_accuracy"] = token_accuracy
            return out
        return make

    monkeypatch.setattr(training_output, "training_class", extra_key)
    with pytest.raises(TypeError, match="token_accuracy"):
        sc.func(scenarios.Context())
