"""The fused causal-LM forward against the unpatched model with the same weights, per family."""

from __future__ import annotations

import re

import pytest
import torch

import liger_compat
from liger_compat import _config, kernels
from liger_compat.shims import causal_lm
from liger_compat.shims._forward_args import forward_params
from liger_compat.shims._patching import is_ours
from model_helpers import FAMILY_NAMES, grads, manual_accuracy, manual_loss, native, random_batch, tiny


def _run(model, ids, labels, **kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    return out, grads(model)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_loss_and_grads_match_native_fp32(family):
    model = tiny(family)
    ids, labels = random_batch(model, seed=1)
    assert is_ours(vars(type(model))["forward"], causal_lm._fused_forward)
    kernels.last_backend.clear()
    out, g = _run(model, ids, labels)
    # the loss really came from the fused kernel and the modules from ours
    assert "fused_linear_cross_entropy" in kernels.last_backend
    assert "rms_norm" in kernels.last_backend and "rope" in kernels.last_backend
    assert out.logits is None
    with native():
        ref, g_ref = _run(model, ids, labels)
    assert ref.logits is not None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    # token accuracy on the output, both spellings, equal to argmax over the native logits
    torch.testing.assert_close(out.token_accuracy, out["token_accuracy"])
    torch.testing.assert_close(out.token_accuracy, manual_accuracy(ref.logits.detach(), labels))


def _flat(g: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g[k].float().reshape(-1) for k in sorted(g)])


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_loss_and_grads_bf16_as_close_to_fp32_as_native_bf16(family):
    """bf16 tolerance judged against the fp32 truth: ours may not be much worse than native bf16."""
    model = tiny(family)
    ids, labels = random_batch(model, seed=2)
    with native():
        truth, g_truth = _run(model, ids, labels)
        model.to(torch.bfloat16)
        ref, g_ref = _run(model, ids, labels)
    out, g = _run(model, ids, labels)
    assert out.loss.dtype == ref.loss.dtype == torch.float32  # transformers' loss upcasts the bf16 logits
    # slack of one bf16 unit in the last place (relative), for a native run that happens to land close
    ulp = torch.finfo(torch.bfloat16).eps
    t = _flat(g_truth)
    err_native = ((_flat(g_ref) - t).norm() / t.norm()).item()
    err_ours = ((_flat(g) - t).norm() / t.norm()).item()
    assert err_ours <= 2 * err_native + ulp, (err_ours, err_native)
    loss_err_native = abs(ref.loss.float().item() - truth.loss.item())
    loss_err_ours = abs(out.loss.float().item() - truth.loss.item())
    assert loss_err_ours <= 2 * loss_err_native + ulp * abs(truth.loss.item()), (loss_err_ours, loss_err_native)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_labels_free_returns_real_logits_and_honours_logits_to_keep(family):
    model = tiny(family)
    ids, _ = random_batch(model, seed=3)
    with native(), torch.no_grad():
        full = model(input_ids=ids).logits
    idx = torch.tensor([0, 4, 11])
    with torch.no_grad():
        out = model(input_ids=ids)
        torch.testing.assert_close(out.logits, full, rtol=1e-5, atol=1e-5)
        assert getattr(out, "token_accuracy", None) is None
        for name in ("logits_to_keep", "num_logits_to_keep"):
            k = model(input_ids=ids, **{name: 5}).logits
            assert k.shape == (2, 5, model.config.vocab_size), (name, k.shape)
            torch.testing.assert_close(k, full[:, -5:], rtol=1e-5, atol=1e-5)
            k0 = model(input_ids=ids, **{name: 0}).logits
            torch.testing.assert_close(k0, full, rtol=1e-5, atol=1e-5)
            t = model(input_ids=ids, **{name: idx}).logits
            assert t.shape == (2, 3, model.config.vocab_size), (name, t.shape)
            torch.testing.assert_close(t, full[:, idx], rtol=1e-5, atol=1e-5)


def test_logits_to_keep_bad_values_are_named():
    model = tiny("llama")
    ids, _ = random_batch(model)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids=ids, logits_to_keep=-1)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids=ids, logits_to_keep=torch.tensor([0.5]))
    with pytest.raises(ValueError, match="both"):
        model(input_ids=ids, logits_to_keep=2, num_logits_to_keep=3)


@pytest.mark.parametrize("family", ["llama", "gemma2", "granite"])
def test_logits_to_keep_with_labels_covers_the_kept_positions(family):
    model = tiny(family)
    ids, labels = random_batch(model, seed=4)
    with native(), torch.no_grad():
        full = model(input_ids=ids).logits
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels[:, -6:], logits_to_keep=6)
    torch.testing.assert_close(out.loss, manual_loss(full[:, -6:], labels[:, -6:]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="kept positions"):
        model(input_ids=ids, labels=labels, logits_to_keep=6)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "mixtral"])
def test_flash_attention_kwargs_reach_the_decoder_not_the_loss(family):
    model = tiny(family)
    if not forward_params(model.model.forward).varkw:
        pytest.skip("this transformers' decoder takes no FlashAttention kwargs (added in 4.47)")
    ids, labels = random_batch(model, seed=5)
    b, t = ids.shape
    cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32)
    fa = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=t, max_length_k=t)
    seen = {}

    def spy(module, args, kwargs):
        seen.update(kwargs)

    handle = model.model.register_forward_pre_hook(spy, with_kwargs=True)
    calls = []
    real = kernels.fused_linear_cross_entropy

    def loss_spy(*a, **k):
        calls.append(set(k))
        return real(*a, **k)

    try:
        causal_lm_kernels = pytest.MonkeyPatch()
        causal_lm_kernels.setattr(kernels, "fused_linear_cross_entropy", loss_spy)
        with torch.no_grad():
            packed = model(input_ids=ids, labels=labels, **fa)
            plain = model(input_ids=ids, labels=labels)
    finally:
        causal_lm_kernels.undo()
        handle.remove()
    for k in fa:
        assert k in seen, f"{k} did not reach the decoder"
    assert calls and not (set(fa) & calls[0]), calls
    torch.testing.assert_close(packed.loss, plain.loss)


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3"])
def test_num_items_in_batch_shift_labels_and_ignore_index(family):
    model = tiny(family)
    ids, labels = random_batch(model, seed=6)
    with native(), torch.no_grad():
        full = model(input_ids=ids).logits
    with torch.no_grad():
        n = torch.tensor(37)
        out = model(input_ids=ids, labels=labels, num_items_in_batch=n)
        torch.testing.assert_close(out.loss, manual_loss(full, labels, num_items=37), rtol=1e-5, atol=1e-5)
        out = model(input_ids=ids, labels=labels, num_items_in_batch=11)
        torch.testing.assert_close(out.loss, manual_loss(full, labels, num_items=11), rtol=1e-5, atol=1e-5)
        # shift_labels given: from transformers 4.50 the targets as they are (context / sequence
        # parallel); before it native's loss ignores them (4.46-4.49) or its forward refuses them (4.45)
        shifted = torch.roll(labels, -1, dims=1)
        try:
            with native():
                ref = model(input_ids=ids, labels=labels, shift_labels=shifted).loss
        except TypeError as exc:
            assert "shift_labels" in str(exc), exc
            with pytest.raises(TypeError, match="shift_labels"):
                model(input_ids=ids, labels=labels, shift_labels=shifted)
        else:
            reads = not torch.allclose(ref, manual_loss(full, labels), rtol=1e-5, atol=1e-5)
            want = manual_loss(full, labels, shift_labels=shifted) if reads else manual_loss(full, labels)
            torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)
            out = model(input_ids=ids, labels=labels, shift_labels=shifted)
            torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-5)
        # another ignore index
        lab = labels.masked_fill(labels == -100, -1)
        out = model(input_ids=ids, labels=lab, ignore_index=-1)
        torch.testing.assert_close(out.loss, manual_loss(full, lab, ignore_index=-1), rtol=1e-5, atol=1e-5)


def test_native_loss_kwargs_agree_where_transformers_has_them():
    model = tiny("qwen2")
    if not forward_params(type(model).forward).varkw:
        pytest.skip("this transformers' forward takes no num_items_in_batch (added in 4.46)")
    ids, labels = random_batch(model, seed=7)
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(29))
        with native():
            ref = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(29))
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)


def test_return_logits_kwarg_and_setting(monkeypatch):
    model = tiny("gemma2")
    ids, labels = random_batch(model, seed=8)
    with native(), torch.no_grad():
        ref = model(input_ids=ids, labels=labels)
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels, return_logits=True)
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
        assert model(input_ids=ids, labels=labels).logits is None
        # the setting (LIGER_COMPAT_RETURN_LOGITS at import, or configure()); a call's own flag wins
        monkeypatch.setattr(_config.settings, "return_logits", False)
        monkeypatch.setattr(_config.settings, "source", dict(_config.settings.source))
        liger_compat.configure(return_logits=True)
        assert _config.settings.source["return_logits"] == "configure()"
        torch.testing.assert_close(model(input_ids=ids, labels=labels).logits, ref.logits, rtol=1e-5, atol=1e-5)
        assert model(input_ids=ids, labels=labels, return_logits=False).logits is None
        # return_logits is ours: without labels it is dropped before the native forward sees it
        assert model(input_ids=ids, return_logits=True).logits.shape == ref.logits.shape


def test_return_dict_false_gives_the_native_tuple():
    model = tiny("mistral")
    ids, labels = random_batch(model, seed=9)
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels, return_dict=False, use_cache=False)
        with native():
            ref = model(input_ids=ids, labels=labels, return_dict=False, use_cache=False)
    assert isinstance(out, tuple) and isinstance(ref, tuple)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)


def test_positional_arguments_are_bound_by_the_native_signature():
    model = tiny("llama")
    ids, labels = random_batch(model, seed=10)
    with torch.no_grad():
        a = model(ids, None, None, None, None, labels)
        b = model(input_ids=ids, labels=labels)
    torch.testing.assert_close(a.loss, b.loss)
    assert a.logits is None


def test_mixtral_router_loss_is_added_like_native():
    model = tiny("mixtral")
    ids, labels = random_batch(model, seed=11)
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
        with native():
            ref = model(input_ids=ids, labels=labels)
    assert out.aux_loss is not None and ref.aux_loss is not None
    torch.testing.assert_close(out.aux_loss, ref.aux_loss)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
    assert type(out).__name__ == type(ref).__name__ == "MoeCausalLMOutputWithPast"


def test_fused_loss_deselected_gives_native_loss_with_logits():
    import liger_compat

    model = tiny("qwen2")
    ids, labels = random_batch(model, seed=12)
    liger_compat.configure(kernels="rms_norm,rope,swiglu,geglu")
    try:
        assert not is_ours(vars(type(model))["forward"], causal_lm._fused_forward)
        with torch.no_grad():
            out = model(input_ids=ids, labels=labels)
            assert out.logits is not None
            # F3 translation still applies without the fused loss
            assert model(input_ids=ids, num_logits_to_keep=3).logits.shape[1] == 3
            assert model(input_ids=ids, logits_to_keep=3).logits.shape[1] == 3
    finally:
        liger_compat.configure(kernels="all")
    assert is_ours(vars(type(model))["forward"], causal_lm._fused_forward)


def test_autocast_bf16_over_fp32_weights():
    model = tiny("llama")
    ids, labels = random_batch(model, seed=13)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=labels)
        with native():
            ref = model(input_ids=ids, labels=labels)
    # both under bf16 autocast: a few bf16 roundings apart, relative to the loss
    torch.testing.assert_close(out.loss.float(), ref.loss.float(), rtol=4 * torch.finfo(torch.bfloat16).eps, atol=0)


def test_output_is_the_family_output_class_and_indexable():
    model = tiny("phi3")
    ids, labels = random_batch(model, seed=14)
    out = model(input_ids=ids, labels=labels)
    assert type(out).__name__ == "CausalLMOutputWithPast"
    assert "token_accuracy" in out.keys() and out["loss"] is out.loss
    assert out.token_accuracy.dim() == 0
    with native(), torch.no_grad():
        ref_logits = model(input_ids=ids).logits
    torch.testing.assert_close(out.token_accuracy, manual_accuracy(ref_logits, labels), rtol=0, atol=0)


class _WrappedHead(torch.nn.Module):
    """A head that is not a plain nn.Linear (as a LoRA or quantised head): the loss must still match."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 1.0


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_non_linear_head_gets_the_unfused_loss_with_the_same_contract(family):
    model = tiny(family)
    model.lm_head = _WrappedHead(model.lm_head)
    ids, labels = random_batch(model, seed=15)
    kernels.last_backend.clear()
    out, g = _run(model, ids, labels, num_items_in_batch=19)
    assert "fused_linear_cross_entropy" not in kernels.last_backend
    assert out.logits is None
    with native():
        with torch.no_grad():
            full = model(input_ids=ids).logits
    torch.testing.assert_close(out.loss, manual_loss(full, labels, num_items=19), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.token_accuracy, manual_accuracy(full, labels))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_generate_is_unchanged(family):
    model = tiny(family).eval()
    ids, _ = random_batch(model, b=2, t=6, seed=16)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        with native():
            try:
                ref = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            # transformers 4.46 Mixtral: its router loss during generation (RuntimeError); 4.48.0 Gemma 2:
            # HybridCache.update indexes past the sliding window (IndexError); 5.4.0 OLMo 2 with
            # huggingface_hub 1.33: a config copy fails its own strict validation
            except Exception as exc:
                ref = exc
        if isinstance(ref, Exception):  # then the patched model fails the same way, no other
            with pytest.raises(type(ref), match=re.escape(str(ref))):
                model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            return
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert torch.equal(out, ref)


def test_gradient_checkpointing_in_train_mode():
    model = tiny("qwen2")
    # transformers 5.2x renamed it; older releases only have the first name
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()
    ids, labels = random_batch(model, seed=17)
    out, g = _run(model, ids, labels, use_cache=False)
    with native():
        ref, g_ref = _run(model, ids, labels, use_cache=False)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-5)


def test_hot_path_calls_below_the_translation_wrapper_and_caches_by_a_stable_key(monkeypatch):
    """Per-call cost (benchmarks/overhead.py): with an int ``logits_to_keep`` the fused forward
    already passes the name the native forward knows, so it calls below our translation
    wrapper (which still handles index tensors); the signature cache is keyed by an object
    that is the same on every attribute access of the wrapt-bound forward."""
    from liger_compat.shims import _forward_args
    from liger_compat.shims import logits_to_keep as ltk

    model = tiny("llama")
    ids, _ = random_batch(model, seed=4)
    assert _forward_args.stable_key(model.forward) is _forward_args.stable_key(model.forward)
    calls = []
    real = ltk.forward_params
    monkeypatch.setattr(ltk, "forward_params", lambda f: calls.append(f) or real(f))
    with torch.no_grad():
        assert model(input_ids=ids, logits_to_keep=5).logits.shape[1] == 5
        assert not calls  # translate looks the signature up first thing; it was not entered
        assert model(input_ids=ids, logits_to_keep=torch.tensor([1, 3])).logits.shape[1] == 2


# --------------------------------------------------------------------------------------------
# labels outside training: the caller reads the logits (Trainer.evaluate / predict)
# --------------------------------------------------------------------------------------------


def _loss_and_logits(model, ids, labels, **kw):
    kernels.last_backend.clear()
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels, **kw)
    return out, "fused_linear_cross_entropy" in kernels.last_backend


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_labels_in_eval_mode_give_native_loss_and_logits_and_training_stays_fused(family):
    """The same model and batch, switched train -> eval -> train: eval gets the native loss and
    logits and nothing extra; training gets the fused loss, logits=None and a token accuracy."""
    model = tiny(family)
    model.config.use_cache = False  # (no KV cache: transformers 4.48.0's Gemma 2 cache fails natively here)
    ids, labels = random_batch(model, seed=18)
    with native(), torch.no_grad():
        ref = model.eval()(input_ids=ids, labels=labels)
    for mode in ("train", "eval", "train"):
        getattr(model, mode)()
        out, fused = _loss_and_logits(model, ids, labels)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
        if mode == "train":
            assert fused and out.logits is None, (mode, fused)
            torch.testing.assert_close(out.token_accuracy, manual_accuracy(ref.logits, labels))
        else:
            assert not fused and out.logits is not None, (mode, fused)
            torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
            assert list(out.keys()) == list(ref.keys()), (list(out.keys()), list(ref.keys()))


def _native_kept(model, ids, labels, keep):
    """What the native forward returns with labels and ``keep``, built from its full logits, so the
    reference exists on releases whose forward takes no index tensor (or knows neither keep name):
    the kept logits, the loss of the labels on them (shifted within the kept positions, as the
    native loss does; plus the router loss for MoE models) and the native output's keys."""
    with native(), torch.no_grad():
        full = model(input_ids=ids)
    if isinstance(keep, int):
        logits = full.logits if keep == 0 else full.logits[:, -keep:]
    else:
        logits = full.logits[:, keep]
    v = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, v).float(), labels[:, 1:].reshape(-1),
                                             ignore_index=-100)
    aux = getattr(full, "aux_loss", None)
    if aux is not None:
        loss = loss + model.config.router_aux_loss_coef * aux
    return logits, loss, ["loss"] + list(full.keys())


@pytest.mark.parametrize("family", ["llama", "gemma2", "granite", "mixtral"])
def test_labels_in_eval_mode_honour_logits_to_keep_under_both_names(family):
    model = tiny(family).eval()
    model.config.use_cache = False  # (no KV cache: transformers 4.48.0's Gemma 2 cache fails natively here)
    ids, labels = random_batch(model, seed=19)
    idx = torch.tensor([1, 5, 8, 11])
    for keep, lab in ((4, labels[:, -4:]), (idx, labels[:, idx]), (0, labels)):
        ref_logits, ref_loss, _ = _native_kept(model, ids, lab, keep)
        for name in ("logits_to_keep", "num_logits_to_keep"):
            out, fused = _loss_and_logits(model, ids, lab, **{name: keep})
            assert out.logits.shape == ref_logits.shape, (name, out.logits.shape, ref_logits.shape)
            torch.testing.assert_close(out.logits, ref_logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=1e-5)
            assert "token_accuracy" not in out.keys()


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_labels_in_eval_mode_where_the_native_forward_cannot_keep(family, monkeypatch):
    """transformers 4.45 .. 4.48 take no index tensor: the decoder and head below the native forward
    run instead, and in eval mode they also return the logits, without a token accuracy."""
    model = tiny(family).eval()
    ids, labels = random_batch(model, seed=20)
    idx = torch.tensor([0, 3, 7])
    ref_logits, ref_loss, ref_keys = _native_kept(model, ids, labels[:, idx], idx)
    monkeypatch.setattr(causal_lm, "_native_takes", lambda known, keep: False)
    out, fused = _loss_and_logits(model, ids, labels[:, idx], logits_to_keep=idx)
    assert fused  # the loss came from our kernel on this path
    assert "token_accuracy" not in out.keys() and list(out.keys()) == ref_keys, list(out.keys())
    torch.testing.assert_close(out.logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_return_dict_false_in_eval_mode_is_the_native_tuple(family):
    model = tiny(family).eval()
    ids, labels = random_batch(model, seed=21)
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels, return_dict=False, use_cache=False)
        with native():
            ref = model(input_ids=ids, labels=labels, return_dict=False, use_cache=False)
    assert isinstance(out, tuple) and len(out) == len(ref) >= 2
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert out[1].shape == (*ids.shape, model.config.vocab_size)  # the loss first, then the logits


def test_labels_reach_the_fused_loss_unshifted_with_its_shift_and_nan(monkeypatch):
    """The label shift and the empty mean's NaN run inside the fused loss (inside its CUDA graph on
    a GPU, where a small step's host would otherwise launch them): the loss gets the labels
    themselves with ``shift_target=True`` and ``empty_mean="nan"``; ``shift_labels`` are passed as
    they are. The loss is native's either way."""
    model = tiny("llama")
    ids, labels = random_batch(model, seed=9)
    seen = []
    real = kernels.fused_linear_cross_entropy

    def spy(hidden, weight, target, **kw):
        seen.append((target, kw))
        return real(hidden, weight, target, **kw)

    monkeypatch.setattr(kernels, "fused_linear_cross_entropy", spy)
    out = model(input_ids=ids, labels=labels)
    with native(), torch.no_grad():
        ref = model(input_ids=ids, labels=labels)
    (target, kw), = seen
    assert torch.equal(target, labels) and kw["shift_target"] is True and kw["empty_mean"] == "nan"
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
    if causal_lm._native_loss_reads_shift_labels() and forward_params(type(model).forward).varkw:
        seen.clear()
        shifted = torch.roll(labels, -1, dims=1)
        out = model(input_ids=ids, labels=labels, shift_labels=shifted)
        (target, kw), = seen
        assert torch.equal(target, shifted) and kw["shift_target"] is False
        torch.testing.assert_close(out.loss, manual_loss(ref.logits.detach(), labels, shift_labels=shifted),
                                   rtol=1e-5, atol=1e-5)
