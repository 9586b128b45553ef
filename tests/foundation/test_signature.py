"""The shims' one signature reader (``_patching.signature``) and ``forward_params``'s named fields."""

from __future__ import annotations

import functools
import inspect

import pytest

from liger_compat.shims._patching import signature
from liger_compat.shims._forward_args import NEW, OLD, ForwardParams, forward_params


def _plain(a, b=2, *rest, c, **kw):
    return a


class _Model:
    def forward(self, input_ids, attention_mask=None):
        return input_ids


def test_signature_unwraps_and_caches():
    @functools.wraps(_plain)
    def wrapper(*args, **kwargs):
        return _plain(*args, **kwargs)

    sig = signature(wrapper)
    assert list(sig.parameters) == ["a", "b", "rest", "c", "kw"]
    assert sig == inspect.signature(_plain)
    assert signature(wrapper) is sig and signature(_plain) is sig  # one entry for the function under both
    # a bound method leaves out self; the function keeps it: cached apart
    assert list(signature(_Model().forward).parameters) == ["input_ids", "attention_mask"]
    assert list(signature(_Model.forward).parameters) == ["self", "input_ids", "attention_mask"]
    assert signature(_Model().forward) is signature(_Model().forward)


def test_signature_of_unhashable_and_signatureless_callables():
    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, x, y=1):
            return x

    assert list(signature(Unhashable()).parameters) == ["x", "y"]
    with pytest.raises((TypeError, ValueError)):
        inspect.signature(42)  # what the helper passes on
    with pytest.raises((TypeError, ValueError)):
        signature(42)


@pytest.mark.parametrize("names, keep, both", [
    ((NEW,), NEW, False), ((OLD,), OLD, False), ((NEW, OLD), None, True), ((), None, False)])
@pytest.mark.parametrize("varkw", [False, True])
def test_forward_params_fields(names, keep, both, varkw):
    params = ", ".join(["self", "input_ids", *(f"{n}=0" for n in names)] + (["**kwargs"] if varkw else []))
    scope: dict = {}
    exec(f"def forward({params}):\n    return input_ids\n", scope)
    got = forward_params(scope["forward"])
    assert isinstance(got, ForwardParams)
    assert got == ForwardParams(keep=keep, both=both, names=frozenset({"self", "input_ids", *names}), varkw=varkw)
