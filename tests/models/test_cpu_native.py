"""On CPU tensors (no Triton kernel there), the default path: transformers' own RMSNorm, RoPE and
MLP code, a model's loss as its native head computes it (the logits through ``lm_head``'s call,
then ``cross_entropy``) and the fused loss function as dense torch ops (``LIGER_COMPAT_CPU_NATIVE``,
on by default); off, or a forced backend: the kernels' torch references. Marked ``cpu_native``: this directory otherwise runs
with the setting off (tests/conftest.py)."""

from __future__ import annotations

import random

import pytest
import torch

import liger_compat
from liger_compat import _config, kernels
from liger_compat.kernels import TargetOutOfRangeError, fused_linear_cross_entropy
from liger_compat.kernels import loss as loss_mod
from model_helpers import FAMILY_NAMES, KernelCalls, grads, manual_accuracy, native, random_batch, tiny

pytestmark = pytest.mark.cpu_native

class _Spy(KernelCalls):
    """Counts calls of the module kernels the shims reach and of the fused loss's dense path."""

    def __init__(self, monkeypatch):
        super().__init__(monkeypatch)
        self.n["dense"] = 0
        real_dense = loss_mod._dense_torch

        def dense(*a, **k):
            self.n["dense"] += 1
            return real_dense(*a, **k)

        monkeypatch.setattr(loss_mod, "_dense_torch", dense)

    def modules(self) -> int:
        return self.total()


class _HeadCalls:
    """Calls of a model's ``lm_head`` module (a forward hook) and of the fused loss function."""

    def __init__(self, monkeypatch, model):
        self.head = self.fused = 0
        model.lm_head.register_forward_hook(lambda *_: setattr(self, "head", self.head + 1))
        from liger_compat.shims import _sharded_head

        real = _sharded_head.fused_head_loss

        def fused(*a, **k):
            self.fused += 1
            return real(*a, **k)

        monkeypatch.setattr(_sharded_head, "fused_head_loss", fused)


def _step(model, ids, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out, grads(model)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "mixtral"])
def test_default_cpu_step_runs_native_modules_and_the_native_head_loss(monkeypatch, family):
    assert _config.settings.cpu_native  # the default
    model = tiny(family)
    ids, labels = random_batch(model, seed=random.randrange(2**31))
    spy = _Spy(monkeypatch)
    calls = _HeadCalls(monkeypatch, model)
    out, g = _step(model, ids, labels)
    assert spy.modules() == 0 and spy.n["dense"] == 0, spy.n
    assert (calls.head, calls.fused) == (1, 0), (calls.head, calls.fused)  # the head's own call, no fused loss
    assert out.logits is None  # the training output as on the GPU: no [batch, seq, vocab] logits returned
    with native():
        ref, g_ref = _step(model, ids, labels)
    torch.testing.assert_close(out.loss, ref.loss, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(out.token_accuracy, manual_accuracy(ref.logits, labels), rtol=0, atol=1e-6)
    assert g.keys() == g_ref.keys()
    for name in g:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_setting_off_and_a_forced_backend_run_the_references(monkeypatch):
    model = tiny("llama")
    ids, labels = random_batch(model, seed=random.randrange(2**31))
    spy = _Spy(monkeypatch)
    with native():
        ref, g_ref = _step(model, ids, labels)
    calls = _HeadCalls(monkeypatch, model)
    liger_compat.configure(cpu_native=False)
    try:
        assert _config.settings.source["cpu_native"] == "configure()"
        out, g = _step(model, ids, labels)
    finally:
        liger_compat.configure(cpu_native=True)
    assert spy.n["rms_norm"] > 0 and spy.n["apply_rotary_pos_emb"] > 0 and spy.n["gated_project"] > 0
    assert spy.n["dense"] == 0 and calls.fused == 1 and calls.head == 0  # the fused loss's chunked reference
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
    for k in spy.n:
        spy.n[k] = 0
    with kernels.use_backend("torch"):  # forced: the references, whatever the setting
        out2, _ = _step(model, ids, labels)
    assert spy.modules() > 0 and spy.n["dense"] == 0
    torch.testing.assert_close(out2.loss, out.loss, rtol=0, atol=0)  # the same reference path
    with pytest.raises(ValueError, match="cpu_native must be on or off"):
        liger_compat.configure(cpu_native="sometimes")


def _head(seed, n=40, h=24, v=97, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hid = (torch.randn(n, h, generator=g) * 2).to(dtype).requires_grad_(True)
    w = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_(True)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.3] = -100
    return hid, w, t


@pytest.mark.parametrize("opts", [{}, {"softcap": 3.0, "label_smoothing": 0.1, "lse_square_scale": 1e-3},
                                  {"reduction": "none"}, {"num_items_in_batch": 17}])
def test_dense_loss_above_its_limit_is_the_chunked_reference(monkeypatch, opts):
    """The same loss, gradients and statistics from the dense path and, past
    ``DENSE_MAX_LOGITS``, the chunked reference (which the float64 property test also checks)."""
    spy = _Spy(monkeypatch)
    hid, w, t = _head(random.randrange(2**31))
    shape = (hid.shape[0],) if opts.get("reduction") == "none" else ()
    g = torch.rand(shape) + 0.5
    results = []
    for limit in (hid.shape[0] * w.shape[0], hid.shape[0] * w.shape[0] - 1):
        monkeypatch.setattr(loss_mod, "DENSE_MAX_LOGITS", limit)
        hid.grad = w.grad = None
        out = fused_linear_cross_entropy(hid, w, t, return_token_accuracy=True, return_z_loss=True, **opts)
        (out.loss * g).sum().backward()
        results.append((out.loss.detach(), out.z_loss, out.token_accuracy, hid.grad.clone(), w.grad.clone()))
    assert spy.n["dense"] == 1
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


def test_model_loss_past_the_dense_limit_is_the_fused_loss(monkeypatch):
    """Above ``DENSE_MAX_LOGITS`` logits the model's loss is the fused loss again (its chunked
    reference: the ``[N, V]`` logits never exist), with the same result."""
    model = tiny("llama")
    ids, labels = random_batch(model, seed=random.randrange(2**31))
    calls = _HeadCalls(monkeypatch, model)
    small, g_small = _step(model, ids, labels)
    monkeypatch.setattr(loss_mod, "DENSE_MAX_LOGITS", ids.numel() * model.config.vocab_size - 1)
    big, g_big = _step(model, ids, labels)
    assert (calls.head, calls.fused) == (1, 1), (calls.head, calls.fused)
    torch.testing.assert_close(big.loss, small.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(big.token_accuracy, small.token_accuracy, rtol=0, atol=1e-6)
    for name in g_small:
        torch.testing.assert_close(g_big[name], g_small[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_label_outside_the_vocabulary_fails_as_natively():
    model = tiny("llama")
    ids, labels = random_batch(model, seed=random.randrange(2**31))
    labels[0, 5] = model.config.vocab_size + 3
    with native():
        with pytest.raises(Exception) as nat:
            model(input_ids=ids, labels=labels)
    with pytest.raises(type(nat.value), match=str(model.config.vocab_size + 3)) as pat:
        model(input_ids=ids, labels=labels)
    assert str(pat.value) == str(nat.value)


def test_dense_loss_raises_on_a_target_outside_the_vocabulary():
    hid, w, t = _head(random.randrange(2**31))
    t[3] = w.shape[0] + 5
    with pytest.raises(TargetOutOfRangeError, match="target"):
        fused_linear_cross_entropy(hid, w, t)


def test_the_variable_is_read_and_reported(monkeypatch):
    import subprocess
    import sys

    code = ("import json, liger_compat; from liger_compat import _config; "
            "print(json.dumps([_config.settings.cpu_native, _config.settings.source.get('cpu_native')]))")
    for raw, want in (("0", [False, "LIGER_COMPAT_CPU_NATIVE"]), ("1", [True, "LIGER_COMPAT_CPU_NATIVE"])):
        env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("LIGER_COMPAT_")}
        env["LIGER_COMPAT_CPU_NATIVE"] = raw
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        assert __import__("json").loads(r.stdout.strip().splitlines()[-1]) == want


def test_every_family_patched_step_on_cpu_matches_native_by_default(monkeypatch):
    """Every fused family, one step each: with the modules native and the native head's loss the patched
    step's loss is native's (the families' own heads and quirks: softcap, logit scaling)."""
    for family in FAMILY_NAMES:
        model = tiny(family)
        ids, labels = random_batch(model, seed=random.randrange(2**31))
        out, _ = _step(model, ids, labels)
        with native():
            ref, _ = _step(model, ids, labels)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5, msg=family)
