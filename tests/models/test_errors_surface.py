"""Errors in the shims' own work surface (raise, or show in the report) instead of being swallowed
into a silently different result; only the specific, expected exceptions are caught."""

from __future__ import annotations

import types

import pytest
import torch

from liger_compat.shims import REGISTRY, _module_shims, causal_lm
from liger_compat.shims import trl_sft_token_accuracy as sft
from model_helpers import tiny


def test_sft_entropy_head_keeps_the_family_softcap_and_lets_its_errors_through(monkeypatch):
    """The SFT entropy metric's logits are the family's final logits (Gemma-2: soft-capped); an
    error there used to drop silently to a plain head without the soft-cap."""
    model = tiny("gemma2")
    cap = model.config.final_logit_softcapping
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, model.config.hidden_size, generator=g) * 4
    with torch.no_grad():
        got = sft._head_logits(model, hidden)
        plain = model.lm_head(hidden).double()
    want = cap * torch.tanh(plain / cap)
    assert got.abs().max() <= cap and plain.abs().max() > cap  # the cap is in force on these rows
    torch.testing.assert_close(got.double(), want, rtol=0, atol=4 * cap * torch.finfo(got.dtype).eps)

    def broken(*a, **k):
        raise RuntimeError("family head failed")

    monkeypatch.setattr(causal_lm, "_logits", broken)
    with pytest.raises(RuntimeError, match="family head failed"):
        sft._head_logits(model, hidden)


def test_sft_base_model_unwraps_peft_and_lets_its_errors_through():
    base = torch.nn.Linear(2, 2)
    wrapper = types.SimpleNamespace(get_base_model=lambda: base)
    assert sft._base_model(wrapper) is base and sft._base_model(base) is base

    def broken():
        raise RuntimeError("adapter not loaded")

    with pytest.raises(RuntimeError, match="adapter not loaded"):
        sft._base_model(types.SimpleNamespace(get_base_model=broken))


def test_model_walks_take_torch_modules_and_let_their_errors_through():
    """apply(model=...) with something that is no torch module finds nothing; a module whose
    ``modules()`` raises is not taken for an empty model."""
    model = tiny("llama")
    assert causal_lm._causal_lms_in(model) == [model]
    assert causal_lm._causal_lms_in(object()) == []
    assert REGISTRY.get("transformers.rms_norm").apply_to_model(object(), None) is False

    class Broken(torch.nn.Module):
        def modules(self):
            raise RuntimeError("modules() broke")

    with pytest.raises(RuntimeError, match=r"modules\(\) broke"):
        causal_lm._causal_lms_in(Broken())
    with pytest.raises(RuntimeError, match=r"modules\(\) broke"):
        REGISTRY.get("transformers.gated_mlp").apply_to_model(Broken(), None)


def test_compiling_probe(monkeypatch):
    from liger_compat import _config

    monkeypatch.setattr(_config, "_is_compiling", None)  # found again below, as on a first call
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _module_shims.compiling() is True
    assert _config._is_compiling is None  # never kept from a call that answered True (a trace)
    monkeypatch.delattr(torch.compiler, "is_compiling")  # torch < 2.3
    assert _module_shims.compiling() is False
    answers = iter([False, True])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: next(answers), raising=False)
    assert _module_shims.compiling() is False
    assert _module_shims.compiling() is True  # the kept function is asked on every call

