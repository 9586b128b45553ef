"""Decode steps run transformers' own RMSNorm, RoPE and MLP (``LIGER_COMPAT_DECODE_NATIVE``).

A ``generate`` decode step (no autograd graph, one position per sequence) gives each kernel a
handful of rows, where its launch costs more than the native ops (``benchmarks/results/generate_*.md``).
Checked here against the unpatched library on the same weights: the decode steps call no module
kernel and give native's logits exactly; the prompt, evaluation and training keep the kernels; the
switch turns it off; torch.compile is not affected.
"""

from __future__ import annotations

import pytest
import torch

import liger_compat
from liger_compat import _config, kernels
from model_helpers import KernelCalls, native, random_batch, tiny

@pytest.fixture
def decode_on(monkeypatch):
    monkeypatch.setattr(_config.settings, "decode_native", True)


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_a_decode_step_runs_native_code_and_gives_native_logits(monkeypatch, decode_on, family):
    """The prompt runs the kernels, the decode step none; on the same cache the step's logits are
    exactly those of the unpatched library."""
    import copy

    model = tiny(family).eval()
    ids, _ = random_batch(model, b=3, t=9, seed=_seed())
    calls = KernelCalls(monkeypatch)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        assert calls.n["rms_norm"] > 0 and calls.n["apply_rotary_pos_emb"] > 0, "the prompt keeps the kernels"
        nxt = out.logits[:, -1:].argmax(-1)
        cache = copy.deepcopy(out.past_key_values)
        calls.reset()
        step = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        assert calls.total() == 0, calls.n
        with native():
            ref = model(input_ids=nxt, past_key_values=cache, use_cache=True)
    assert torch.equal(step.logits, ref.logits)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_generate_gives_native_tokens_and_only_the_prompt_runs_kernels(monkeypatch, decode_on, family):
    model = tiny(family).eval()
    ids, _ = random_batch(model, b=2, t=7, seed=_seed())
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False,
              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        model(input_ids=ids)  # the first calls probe each class (more kernel calls): not counted
    calls = KernelCalls(monkeypatch)
    got = model.generate(ids, **kw)
    in_generate = dict(calls.n)
    calls.reset()
    with torch.no_grad():
        model(input_ids=ids)  # the prompt alone
    assert in_generate == calls.n and calls.n["rms_norm"] > 0, (in_generate, calls.n)
    with native():
        want = model.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # fp32; the prompt's step ran the kernels


def test_training_and_whole_sequence_no_grad_forwards_keep_the_kernels(monkeypatch, decode_on):
    """Evaluation and a preference trainer's reference model (no grad, whole sequences) compute
    as the training forward does, so a policy and its reference agree at the start."""
    model = tiny("llama")
    ids, labels = random_batch(model, seed=_seed())
    calls = KernelCalls(monkeypatch)
    model(input_ids=ids, labels=labels)  # the first calls probe each class (more kernel calls)
    calls.reset()
    model(input_ids=ids, labels=labels)
    train = dict(calls.n)
    calls.reset()
    with torch.no_grad():
        model(input_ids=ids, labels=labels)
    assert train == calls.n and all(v > 0 for v in train.values()), (train, calls.n)
    calls.reset()
    x = torch.randn(2, 1, model.config.hidden_size, requires_grad=True)  # one position, with a graph
    model.model.norm(x).sum().backward()
    assert calls.n["rms_norm"] == 1


def test_the_switch_keeps_the_kernels_in_decode_steps(monkeypatch):
    model = tiny("llama").eval()
    ids, _ = random_batch(model, b=2, t=5, seed=_seed())
    calls = KernelCalls(monkeypatch)
    liger_compat.configure(decode_native=False)
    try:
        assert _config.settings.source["decode_native"] == "configure()"
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            calls.reset()
            model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
        assert calls.n["rms_norm"] > 0 and calls.n["apply_rotary_pos_emb"] > 0 and calls.n["gated_project"] > 0
    finally:
        liger_compat.configure(decode_native=True)
    with pytest.raises(ValueError, match="decode_native must be on or off"):
        liger_compat.configure(decode_native="sometimes")


def test_inference_mode_counts_as_a_decode_step_and_other_shapes_do_not(monkeypatch, decode_on):
    model = tiny("qwen2").eval()
    calls = KernelCalls(monkeypatch)
    norm, h = model.model.norm, model.config.hidden_size
    with torch.inference_mode():
        norm(torch.randn(4, 2, h))  # the first kernel call probes the class (more kernel calls): not counted
        calls.reset()
        norm(torch.randn(4, 1, h))
        assert calls.n["rms_norm"] == 0
        norm(torch.randn(4, 2, h))  # two positions: kernel
        norm(torch.randn(3, h))  # 2-D rows of tokens (no position axis to read): kernel
    assert calls.n["rms_norm"] == 2


def test_the_variable_is_read_as_on_off():
    assert _config._from_env({"LIGER_COMPAT_DECODE_NATIVE": "0"}).decode_native is False
    assert _config._from_env({"LIGER_COMPAT_DECODE_NATIVE": "yes"}).decode_native is True
    bad = _config._from_env({"LIGER_COMPAT_DECODE_NATIVE": "maybe"})
    assert bad.decode_native is True and "LIGER_COMPAT_DECODE_NATIVE must be on or off" in bad.source["decode_native"]
