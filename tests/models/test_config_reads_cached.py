"""The fused forward reads the final-logit quirks (soft-cap, logit scale) once per config object,
and again when the config changes: a changed value, a replaced config, never a stale one."""

from __future__ import annotations

import pytest
import torch

from liger_compat.compat import families
from liger_compat.shims import causal_lm
from model_helpers import native, random_batch, tiny


def _loss(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss.detach()


def _native_loss(model, ids, labels):
    with native():
        return _loss(model, ids, labels)


def test_softcap_change_is_seen():
    model = tiny("gemma2")
    ids, labels = random_batch(model, seed=4)
    for cap in (30.0, 2.0, None, 0.5):
        model.config.final_logit_softcapping = cap
        torch.testing.assert_close(_loss(model, ids, labels), _native_loss(model, ids, labels), rtol=1e-5, atol=1e-5)


def test_logit_scale_change_and_new_config_object_are_seen():
    model = tiny("granite")
    ids, labels = random_batch(model, seed=5)
    for scale in (4.0, 0.25):
        model.config.logits_scaling = scale
        torch.testing.assert_close(_loss(model, ids, labels), _native_loss(model, ids, labels), rtol=1e-5, atol=1e-5)
    cfg = type(model.config).from_dict(model.config.to_dict())
    cfg.logits_scaling = 9.0
    model.config = cfg
    torch.testing.assert_close(_loss(model, ids, labels), _native_loss(model, ids, labels), rtol=1e-5, atol=1e-5)


def test_quirks_read_once_per_config(monkeypatch):
    """Repeated calls on one unchanged config take the cached quirks (the config's attribute
    lookups, ~1 us each through ``PretrainedConfig.__getattribute__``, are not repeated)."""
    model = tiny("gemma2")
    fam = families.family_of(type(model))
    reads = []
    real = causal_lm._read_quirks
    monkeypatch.setattr(causal_lm, "_read_quirks", lambda cfg, f: reads.append(f.name) or real(cfg, f))
    monkeypatch.setattr(causal_lm, "_quirks", {})
    for _ in range(5):
        first = causal_lm._final_logit_quirks(model, fam)
    assert len(reads) == 1 and first == (model.config.final_logit_softcapping, None)
    model.config.final_logit_softcapping = 7.0
    assert causal_lm._final_logit_quirks(model, fam) == (7.0, None) and len(reads) == 2


def test_text_config_follows_a_replaced_text_part():
    class Composite:
        def __init__(self, text):
            self.text_config = text

        def get_text_config(self):
            return self.text_config

    a, b = Composite(None), Composite(None)
    inner1, inner2 = type("T", (), {})(), type("T", (), {})()
    a.text_config = inner1
    assert causal_lm._text_config(a) is inner1
    a.text_config = inner2
    assert causal_lm._text_config(a) is inner2
    b.text_config = inner1
    assert causal_lm._text_config(b) is inner1 and causal_lm._text_config(a) is inner2


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_caches_do_not_keep_configs_alive(family):
    import gc
    import weakref

    model = tiny(family)
    ids, labels = random_batch(model, seed=6)
    _loss(model, ids, labels)
    ref = weakref.ref(model.config)
    del model
    gc.collect()
    assert ref() is None
