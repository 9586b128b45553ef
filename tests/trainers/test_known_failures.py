"""The five upstream failures of the design card (F1 .. F5), each as a pair on the real libraries:

* ``..._fails_without_...``: liger_compat's relevant shim suspended (``REGISTRY.suspended``), the
  upstream situation is reproduced and its specific failure asserted (the exception and message, or
  the wrong shape);
* ``..._passes_with_...``: the same inputs with the shim on give what the unpatched library gives.

Where the installed library no longer has the upstream premise natively, the premise is rebuilt from
real library code (named in each test) so that the pair runs here too; where a version of the grid
cannot have the premise at all, the test skips with the reason.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings

import pytest
import torch

import liger_compat
from liger_compat.compat.versions import matches
from liger_compat.shims import REGISTRY
from liger_compat.compat import tiny_text as tiny
from liger_compat.shims._patching import PatchSet, unwrap

from sft_logits_reader import compute_loss_reading_logits
from trainer_helpers import (FusedOutputCounter, assert_logs_close, clone, config_fields, fresh_model, make_config,
                             native, run_native_and_patched, tokenizer_kwarg, train_logs, trainer_or_skip,
                             unsloth_style_get_batch_samples)

FUSED_FORWARD = "transformers.fused_causal_lm_forward"
KEEP_RENAME = "transformers.logits_to_keep"
SFT_ACCURACY = "trl.sft_token_accuracy"
LABEL_COUNT = "transformers.num_items_in_batch_labels"
RENAMES = ("transformers.renamed_kwargs", "trl.renamed_kwargs")


def _trl_version() -> str:
    import trl

    return trl.__version__


def _quiet_train(trainer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return trainer


@contextlib.contextmanager
def _class_forward(cls, wrapper):
    """``cls.forward`` wrapped by ``wrapper`` (a wrapt wrapper) inside the block, with liger_compat's fused
    forward suspended so that ``wrapper`` sits on the native forward alone."""
    with REGISTRY.suspended(FUSED_FORWARD):
        ps = PatchSet()
        ps.wrap(cls, "forward", wrapper)
        try:
            yield
        finally:
            assert not ps.revert()


def _decoder_hidden(instance, kwargs):
    """Last hidden states of the decoder, given the forward's kwargs minus what the decoder does not take."""
    params = inspect.signature(unwrap(type(instance.model).forward)).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    dec_kw = {k: v for k, v in kwargs.items() if takes_any or k in params}
    return instance.model(**dec_kw)[0]


# =============================================================================================
# F1: SFTTrainer reads outputs.logits for its token accuracy / entropy; the fused forward has none
# =============================================================================================

@contextlib.contextmanager
def _sft_reading_logits():
    """The installed SFTTrainer, made to read ``outputs.logits`` where its own compute_loss does not."""
    from liger_compat.shims.trl_sft_token_accuracy import read_style

    trainer_cls, _ = trainer_or_skip("sft")
    own = trainer_cls.__dict__.get("compute_loss")
    with native():
        style = read_style(unwrap(trainer_cls.compute_loss))
    if not isinstance(style, str):
        yield "the installed SFTTrainer.compute_loss"
        return
    if not matches(_trl_version(), ">=1.15"):
        pytest.skip(f"trl {_trl_version()}: {style}; token accuracy from outputs.logits came with trl 0.15, the "
                    "premise of F1 does not exist here")
    # both shims around SFTTrainer.compute_loss step aside while it is replaced (the accuracy shim
    # reads the new one when it is applied again)
    with _suspended_around_compute_loss():
        trainer_cls.compute_loss = compute_loss_reading_logits
    try:
        yield "trl 1.3 .. 1.14's compute_loss on the installed SFTTrainer (trl 1.15+ reads no logits)"
    finally:
        with _suspended_around_compute_loss():
            trainer_cls.compute_loss = own


@contextlib.contextmanager
def _suspended_around_compute_loss():
    from liger_compat.shims.trl_fused_lm_head import SHIM_ID as HEAD

    with REGISTRY.suspended(HEAD), REGISTRY.suspended(SFT_ACCURACY):
        yield


def _sft_builder(tokenizer, tmp_path, **cfg):
    trainer_cls, config_cls = trainer_or_skip("sft")
    fields = config_fields(config_cls)
    if "loss_type" in fields:
        cfg.setdefault("loss_type", "nll")
    ds = tiny.dataset(tiny.sft_rows(8))

    def build(model):
        args = make_config(config_cls, tmp_path, max_seq_length=32, max_length=32, dataset_text_field="text",
                           packing=False, gradient_accumulation_steps=2, **cfg)
        return trainer_cls(model=model, args=args, train_dataset=ds, **tokenizer_kwarg(trainer_cls, tokenizer))

    return build


@pytest.mark.slow
def test_f1_sft_token_accuracy_fails_without_the_shim(tokenizer, tmp_path):
    with _sft_reading_logits():
        model = fresh_model("llama", tokenizer)
        liger_compat.apply(model)
        trainer = _sft_builder(tokenizer, tmp_path)(model)
        with REGISTRY.suspended(SFT_ACCURACY):
            counter = FusedOutputCounter(trainer.model)
            try:
                # the trainer reads outputs.logits: indexing it (trl 0.15-0.2x) or its .shape (trl 0.28)
                with pytest.raises((TypeError, AttributeError),
                                   match=r"'NoneType' object (is not subscriptable|has no attribute 'shape')"):
                    _quiet_train(trainer)
            finally:
                counter.close()
    assert counter.fused >= 1  # the fused forward ran (logits None) and the trainer then read the logits


@pytest.mark.slow
def test_f1_sft_token_accuracy_passes_with_the_shim(tokenizer, tmp_path, capsys):
    with _sft_reading_logits() as what:
        nat, pat, counter, _ = run_native_and_patched(_sft_builder(tokenizer, tmp_path), fresh_model("llama", tokenizer))
    native_logs, patched_logs = train_logs(nat), train_logs(pat)
    keys = [k for k in ("loss", "mean_token_accuracy", "entropy") if k in native_logs[0]]
    assert "mean_token_accuracy" in keys, native_logs[0]
    assert_logs_close(native_logs, patched_logs, keys)
    assert counter.fused > 0 and counter.with_logits == 0, (counter.fused, counter.with_logits)
    with capsys.disabled():
        print(f"\nF1 ({what}): native mean_token_accuracy "
              f"{[round(h['mean_token_accuracy'], 4) for h in native_logs]}, patched "
              f"{[round(h['mean_token_accuracy'], 4) for h in patched_logs]}")


# =============================================================================================
# F2: DPOTrainer calls the model without labels and needs real logits
# =============================================================================================

def _labels_assuming_forward(wrapped, instance, args, kwargs):
    """A fused forward that assumes labels, as fused forwards written for SFT did: the decoder, then the fused
    loss on the shifted labels (``liger_compat.kernels.fused_linear_cross_entropy``); no logits."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from liger_compat.kernels import fused_linear_cross_entropy

    kw = dict(kwargs)
    if args:
        kw["input_ids"] = args[0]
    labels = kw.pop("labels", None)
    kw.pop("num_items_in_batch", None)
    hidden = _decoder_hidden(instance, kw)
    shift_labels = labels[..., 1:]
    loss = fused_linear_cross_entropy(hidden[:, :-1], instance.lm_head.weight, shift_labels)
    return CausalLMOutputWithPast(loss=loss, logits=None)


class _LabelsAndLogits:
    """Forwards of ``model``: how many came without labels, and whether each of those returned logits."""

    def __init__(self, model):
        self.without_labels: list[bool] = []
        self._h = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, out):
        if kwargs.get("labels") is None and not kwargs.get("fused_lm_head"):
            get = getattr(out, "get", None)
            self.without_labels.append(get is not None and get("logits") is not None)

    def close(self):
        self._h.remove()


def _dpo_builder(tokenizer, tmp_path, base):
    trainer_cls, config_cls = trainer_or_skip("dpo")
    ds = tiny.dataset(tiny.preference_rows(8))
    ref = clone(base)

    def build(model):
        args = make_config(config_cls, tmp_path, max_length=32, max_prompt_length=16, max_completion_length=16,
                           beta=0.1, gradient_accumulation_steps=2, remove_unused_columns=False)
        return trainer_cls(model=model, args=args, train_dataset=ds, eval_dataset=ds, ref_model=ref,
                           **tokenizer_kwarg(trainer_cls, tokenizer))

    return build


def _dpo_run(trainer):
    """Two training steps and an evaluation (trl < 1.15: ``concatenated_forward`` calls the model without
    labels); on trl 1.15+, whose steps go through trl's own LM head, also a prediction, which asks for the
    logits: ``compute_loss(return_outputs=True)`` recomputes them with ``model(**model_kwargs)``, without
    labels. (trl 0.15's own DPO ``prediction_step`` cannot return its logit metrics: not run there.)"""
    _quiet_train(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metrics = trainer.evaluate()
        pred = trainer.predict(trainer.eval_dataset) if matches(_trl_version(), ">=1.15") else None
    return metrics, pred


@pytest.mark.slow
def test_f2_dpo_without_labels_fails_on_a_labels_assuming_forward(tokenizer, tmp_path):
    base = fresh_model("llama", tokenizer)
    build = _dpo_builder(tokenizer, tmp_path, base)
    model = clone(base)
    with _class_forward(type(model), _labels_assuming_forward):
        trainer = build(model)
        with pytest.raises(TypeError, match="'NoneType' object is not subscriptable"):
            _dpo_run(trainer)


@pytest.mark.slow
def test_f2_dpo_without_labels_passes_with_the_shim(tokenizer, tmp_path):
    base = fresh_model("llama", tokenizer)
    build = _dpo_builder(tokenizer, tmp_path, base)
    with native():
        nat = build(clone(base))
        nat_metrics, nat_pred = _dpo_run(nat)
    model = clone(base)
    liger_compat.apply(model)
    pat = build(model)
    rec = _LabelsAndLogits(pat.model)
    try:
        pat_metrics, pat_pred = _dpo_run(pat)
    finally:
        rec.close()
    # DPO called the fused model without labels and got real logits every time
    assert rec.without_labels and all(rec.without_labels), rec.without_labels
    keys = [k for k in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
            if k in train_logs(nat)[0]]
    assert {"loss", "rewards/chosen"} <= set(keys), train_logs(nat)[0]
    assert_logs_close(train_logs(nat), train_logs(pat), keys)
    eval_keys = [k for k in nat_metrics if k.startswith("eval_") and isinstance(nat_metrics[k], float)
                 and not any(t in k for t in ("runtime", "per_second"))]
    # (trl 1.0 logs only the loss in evaluation; other releases add rewards and log-probs, compared too)
    assert "eval_loss" in eval_keys, nat_metrics
    for k in eval_keys:
        assert math.isclose(nat_metrics[k], pat_metrics[k], rel_tol=2e-4, abs_tol=2e-5), (k, nat_metrics[k], pat_metrics[k])
    if nat_pred is not None:  # the logits the prediction loop collected, [rows, T, V]
        want, got = nat_pred.predictions, pat_pred.predictions
        assert want.ndim == 3 and want.shape[-1] == base.config.vocab_size, want.shape
        # after two AdamW steps at lr 0.05: float32 rounding of the two gradients' summation orders,
        # amplified by the optimizer, reaches ~1.5e-4 in single logits (measured); the logs above
        # and the eval metrics hold the run to native's
        torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), rtol=1e-3, atol=5e-4)


# =============================================================================================
# F3: logits_to_keep on a forward that only knows num_logits_to_keep
# =============================================================================================

def _qwen2_module():
    return pytest.importorskip("transformers.models.qwen2.modeling_qwen2")


def _qwen2_448_class():
    """A real ``Qwen2ForCausalLM`` whose forward has transformers 4.48's signature: ``num_logits_to_keep: int
    = 0`` and a ``**kwargs`` that goes on to the decoder, so ``logits_to_keep=`` falls into it unnoticed.
    Defined in the installed modeling module (as 4.48 defined its class), where the shims look for classes."""
    mod = _qwen2_module()
    from transformers.modeling_outputs import CausalLMOutputWithPast

    decoder_params = inspect.signature(mod.Qwen2Model.forward).parameters
    decoder_takes_any = any(p.kind is p.VAR_KEYWORD for p in decoder_params.values())

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, cache_position=None, num_logits_to_keep: int = 0,
                **kwargs):
        if not decoder_takes_any:  # transformers 4.45 .. 4.46 decoders: no **kwargs to pass them on to
            kwargs = {k: v for k, v in kwargs.items() if k in decoder_params}
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             cache_position=cache_position, **kwargs)
        hidden = outputs[0]
        logits = self.lm_head(hidden[:, -num_logits_to_keep:, :])  # 0 keeps every position
        loss = None
        if labels is not None:
            flat = logits[:, :-1].float().reshape(-1, logits.shape[-1])
            loss = torch.nn.functional.cross_entropy(flat, labels[:, 1:].reshape(-1).to(flat.device))
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values)

    forward.__module__ = mod.__name__  # transformers' own code, not a foreign patch
    forward.__qualname__ = "Qwen2As448ForCausalLM.forward"
    cls = type("Qwen2As448ForCausalLM", (mod.Qwen2ForCausalLM,), {"forward": forward, "__module__": mod.__name__})
    return mod, cls


@contextlib.contextmanager
def _keep_shims_suspended():
    with REGISTRY.suspended(FUSED_FORWARD), REGISTRY.suspended(KEEP_RENAME):
        yield


def _qwen2(cls, seed=0):
    from liger_compat.compat.tiny_models import build

    src = build("qwen2", seed=seed)
    model = cls(src.config)
    model.load_state_dict(src.state_dict())
    return model.eval()


def _ids(model, seed=0, shape=(2, 16)):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, shape, generator=g)


@contextlib.contextmanager
def _class_in_module(monkeypatch, mod, cls):
    """``cls`` defined in ``mod``; the keep-name shim is applied again so that it finds it, and once more at
    the end so that it lets go of it."""
    with _keep_shims_suspended():  # (the fused forward wraps the keep-name wrapper: both go, in order)
        monkeypatch.setattr(mod, cls.__name__, cls, raising=False)
    try:
        yield
    finally:
        with _keep_shims_suspended():
            monkeypatch.delattr(mod, cls.__name__)


def test_f3_logits_to_keep_fails_without_the_shim_448_signature(monkeypatch):
    mod, cls = _qwen2_448_class()
    with _class_in_module(monkeypatch, mod, cls), _keep_shims_suspended():
        model = _qwen2(cls)
        ids = _ids(model)
        with torch.no_grad():
            out = model(ids, logits_to_keep=4).logits
    # the new name is swallowed by **kwargs: the full [B, T, V] comes back
    assert tuple(out.shape) == (2, 16, model.config.vocab_size), tuple(out.shape)


def test_f3_logits_to_keep_passes_with_the_shim_448_signature(monkeypatch):
    mod, cls = _qwen2_448_class()
    with _class_in_module(monkeypatch, mod, cls):
        model = _qwen2(cls)
        ids = _ids(model)
        with torch.no_grad():
            out = model(ids, logits_to_keep=4).logits
            old = model(ids, num_logits_to_keep=4).logits
    with native():
        ref_model = _qwen2(mod.Qwen2ForCausalLM)
        with torch.no_grad():
            ref = ref_model(ids).logits[:, -4:]
    assert tuple(out.shape) == (2, 4, model.config.vocab_size), tuple(out.shape)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(old, ref, rtol=1e-5, atol=1e-5)


def _native_keep_name(cls):
    with _keep_shims_suspended():
        params = inspect.signature(unwrap(cls.forward)).parameters
    return "logits_to_keep" in params, "num_logits_to_keep" in params


def _real_premise_or_skip():
    import transformers

    mod = _qwen2_module()
    new, old = _native_keep_name(mod.Qwen2ForCausalLM)
    if new or not old:
        pytest.skip(f"transformers {transformers.__version__}: Qwen2ForCausalLM.forward takes "
                    f"{'logits_to_keep' if new else 'neither name'} natively; only 4.45 .. 4.48 take num_logits_to_keep "
                    "alone (the 4.48 signature is tested on the installed class above)")
    return mod.Qwen2ForCausalLM


def test_f3_logits_to_keep_fails_without_the_shim_real_class():
    cls = _real_premise_or_skip()
    with _keep_shims_suspended():
        params = inspect.signature(unwrap(cls.forward)).parameters
        model = _qwen2(cls)
        ids = _ids(model)
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            # transformers 4.45: no **kwargs to swallow the new name, the call is refused
            with pytest.raises(TypeError, match="unexpected keyword argument 'logits_to_keep'"):
                model(ids, logits_to_keep=4)
            return
        with torch.no_grad():
            out = model(ids, logits_to_keep=4).logits
    # transformers 4.46 .. 4.48: swallowed by **kwargs, the full [B, T, V] comes back
    assert tuple(out.shape) == (2, 16, model.config.vocab_size), tuple(out.shape)


def test_f3_logits_to_keep_passes_with_the_shim_real_class():
    cls = _real_premise_or_skip()
    model = _qwen2(cls)
    ids = _ids(model)
    with torch.no_grad():
        out = model(ids, logits_to_keep=4).logits
    with native():
        with torch.no_grad():
            ref = _qwen2(cls)(ids, num_logits_to_keep=4).logits
    assert tuple(out.shape) == (2, 4, model.config.vocab_size), tuple(out.shape)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# =============================================================================================
# F4: padding-free SFT passes FlashAttention kwargs through **kwargs
# =============================================================================================

FA_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _kwargs_to_loss_forward(wrapped, instance, args, kwargs):
    """A fused forward that hands the loss every kwarg its decoder call did not name (transformers 4.47's
    ``self.loss_function(..., **kwargs)`` pattern), here into ``liger_compat.kernels.fused_linear_cross_entropy``."""
    from liger_compat.kernels import fused_linear_cross_entropy

    kw = dict(kwargs)
    if args:
        kw["input_ids"] = args[0]
    labels = kw.pop("labels")
    dec = {k: kw.pop(k) for k in ("input_ids", "attention_mask", "position_ids", "use_cache") if k in kw}
    hidden = instance.model(**dec)[0]
    return fused_linear_cross_entropy(hidden[:, :-1], instance.lm_head.weight, labels[:, 1:], **kw)


def _padding_free_sft(tokenizer, tmp_path):
    """The installed SFTTrainer, padding-free, with the loss of ``transformers.Trainer.compute_loss`` (labels
    through the model's forward, as trl <= 1.14 SFT computed it; trl 1.15+ would use its own LM head)."""
    from transformers import Trainer

    sft_cls, config_cls = trainer_or_skip("sft")
    if "padding_free" not in config_fields(config_cls):
        pytest.skip(f"{config_cls.__name__} of trl {_trl_version()} has no padding_free: this trl has no "
                    "padding-free SFT batches")

    class PaddingFreeSFT(sft_cls):
        compute_loss = Trainer.compute_loss

    ds = tiny.dataset(tiny.sft_rows(8))

    def build(model):
        # without packing, trl does not truncate padding-free rows (it refuses a max_length): the rows are short
        args = make_config(config_cls, tmp_path, max_seq_length=None, max_length=None, dataset_text_field="text",
                           packing=False, padding_free=True, gradient_accumulation_steps=2, per_device_train_batch_size=2)
        return PaddingFreeSFT(model=model, args=args, train_dataset=ds, **tokenizer_kwarg(sft_cls, tokenizer))

    return build


class _FAKwargsSeen:
    def __init__(self, model):
        self.calls = []
        self._h = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.calls.append(sorted(k for k in FA_KWARGS if k in kwargs))

    def close(self):
        self._h.remove()


def _batch_has_fa_kwargs_or_skip(build, tokenizer):
    trainer = build(fresh_model("llama", tokenizer))
    batch = next(iter(trainer.get_train_dataloader()))
    if "cu_seq_lens_q" not in batch:
        import transformers
        from transformers import DataCollatorWithFlattening

        tf_has = "return_flash_attn_kwargs" in inspect.signature(DataCollatorWithFlattening.__init__).parameters
        pytest.skip(f"the padding-free collator of trl {_trl_version()} emits no cu_seq_lens_q (keys {sorted(batch)})"
                    + ("" if tf_has else f", nor does DataCollatorWithFlattening of transformers "
                       f"{transformers.__version__}") + ": no padding-free batch of this pair carries the "
                    "FlashAttention kwargs")


@pytest.mark.slow
def test_f4_padding_free_sft_fails_without_the_filtering(tokenizer, tmp_path):
    build = _padding_free_sft(tokenizer, tmp_path)
    _batch_has_fa_kwargs_or_skip(build, tokenizer)
    model = fresh_model("llama", tokenizer)
    with _class_forward(type(model), _kwargs_to_loss_forward):
        trainer = build(model)
        with pytest.raises(TypeError, match="unexpected keyword argument 'cu_seq_lens_q'"):
            _quiet_train(trainer)


@pytest.mark.slow
def test_f4_padding_free_sft_passes_with_the_shim(tokenizer, tmp_path):
    build = _padding_free_sft(tokenizer, tmp_path)
    _batch_has_fa_kwargs_or_skip(build, tokenizer)

    class Both:
        def __init__(self, model):
            self.fused, self.fa = FusedOutputCounter(model), _FAKwargsSeen(model)

        def close(self):
            self.fused.close()
            self.fa.close()

    nat, pat, rec, _ = run_native_and_patched(build, fresh_model("llama", tokenizer), recorder=Both)
    assert_logs_close(train_logs(nat), train_logs(pat), ["loss", "grad_norm"])
    assert rec.fused.fused > 0 and rec.fused.with_logits == 0, (rec.fused.fused, rec.fused.with_logits)
    assert rec.fa.calls and all(c == sorted(FA_KWARGS) for c in rec.fa.calls), rec.fa.calls


# =============================================================================================
# F5: label-token counting on ORPO / CPO batches; tokenizer -> processing_class
# =============================================================================================

def _pref_builder(name, tokenizer, tmp_path, loop=None):
    trainer_cls, config_cls = trainer_or_skip(name)
    ds = tiny.dataset(tiny.preference_rows(8))
    cls = trainer_cls
    if loop is not None:
        cls = type(f"UnslothLike{trainer_cls.__name__}", (trainer_cls,), {"get_batch_samples": loop})

    def build(model):
        args = make_config(config_cls, tmp_path, max_length=32, max_prompt_length=16, max_completion_length=16,
                           beta=0.1, gradient_accumulation_steps=2, remove_unused_columns=False)
        return cls(model=model, args=args, train_dataset=ds, **tokenizer_kwarg(trainer_cls, tokenizer))

    return build


def _needs_counting():
    from transformers import Trainer

    if "get_batch_samples" not in vars(Trainer):
        pytest.skip("transformers < 4.46 has no Trainer.get_batch_samples: nothing counts label tokens")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["orpo", "cpo"])
def test_f5_label_counting_fails_without_the_shim(name, tokenizer, tmp_path):
    _needs_counting()
    build = _pref_builder(name, tokenizer, tmp_path, loop=unsloth_style_get_batch_samples)
    trainer = build(fresh_model("llama", tokenizer))
    with REGISTRY.suspended(LABEL_COUNT):
        with pytest.raises(KeyError, match="labels"):
            _quiet_train(trainer)


class _CountRecorder:
    """Every micro-batch's label tensors and the ``num_items_in_batch`` its compute_loss got."""

    def __init__(self, trainer):
        self.seen = []
        own = trainer.compute_loss

        def compute_loss(model, inputs, *args, **kwargs):
            n = kwargs.get("num_items_in_batch", args[1] if len(args) > 1 else None)
            labels = {k: v.detach().cpu().clone() for k, v in inputs.items() if k.endswith("labels") and torch.is_tensor(v)}
            self.seen.append((labels, n))
            return own(model, inputs, *args, **kwargs)

        trainer.compute_loss = compute_loss


@pytest.mark.slow
@pytest.mark.parametrize("name", ["orpo", "cpo"])
def test_f5_label_counting_passes_with_the_shim(name, tokenizer, tmp_path):
    _needs_counting()
    base = fresh_model("llama", tokenizer)
    with native():
        nat = _quiet_train(_pref_builder(name, tokenizer, tmp_path)(clone(base)))
    model = clone(base)
    liger_compat.apply(model)
    pat = _pref_builder(name, tokenizer, tmp_path, loop=unsloth_style_get_batch_samples)(model)
    rec = _CountRecorder(pat)
    _quiet_train(pat)
    keys = [k for k in train_logs(nat)[0] if k in ("loss", "rewards/chosen", "rewards/rejected", "nll_loss",
                                                 "log_odds_ratio", "logps/chosen", "logps/rejected")]
    assert "loss" in keys
    assert_logs_close(train_logs(nat), train_logs(pat), keys)
    # the count of each accumulation window: the non-ignored chosen + rejected labels of its micro-batches
    assert len(rec.seen) == 4, len(rec.seen)  # 2 steps x 2 micro-batches
    shift = bool(getattr(pat, "_loss_shifts_labels", False))
    for w in range(2):
        window = rec.seen[2 * w:2 * w + 2]
        expected = 0
        for labels, _ in window:
            assert {"chosen_labels", "rejected_labels"} <= set(labels), sorted(labels)
            assert "labels" not in labels
            for key in ("chosen_labels", "rejected_labels"):
                lab = labels[key][..., 1:] if shift else labels[key]
                expected += int((lab != -100).sum())
        assert expected > 0
        counts = [None if n is None else int(n) for _, n in window]
        if not pat.model_accepts_loss_kwargs:  # a loss that does not take it keeps None (and the division
            assert counts == [None, None], window  # by the accumulation steps)
        else:  # the count of the window, or None where this trl's compute_loss never reads it (trl < 0.14):
            assert counts in ([expected, expected], [None, None]), (window, expected)  # the logs above decide
        # the shim's count of these real batches, whether or not the trainer's loss takes it
        from liger_compat.shims.num_items_in_batch_labels import count_label_tokens

        assert sum(int(count_label_tokens(labels, shift=shift)) for labels, _ in window) == expected


def _rename_direction(trainer_cls):
    from liger_compat.shims.renamed_kwargs import accepted_params

    with REGISTRY.suspended(RENAMES[0]), REGISTRY.suspended(RENAMES[1]):
        params = accepted_params(unwrap(trainer_cls.__init__))
    if "processing_class" in params and "tokenizer" in params:
        pytest.skip(f"{trainer_cls.__name__} of trl {_trl_version()} takes both tokenizer= and processing_class=")
    return ("tokenizer", "processing_class") if "processing_class" in params else ("processing_class", "tokenizer")


def _pref_trainer(name, tok, tmp_path, **kw):
    trainer_cls, config_cls = trainer_or_skip(name)
    args = make_config(config_cls, tmp_path, max_length=32, max_prompt_length=16, max_completion_length=16,
                       remove_unused_columns=False)
    return trainer_cls(model=fresh_model("llama", tok), args=args,
                       train_dataset=tiny.dataset(tiny.preference_rows(4)), **kw)


@pytest.mark.parametrize("name", ["orpo", "cpo"])
def test_f5_renamed_tokenizer_kwarg_fails_without_the_shim(name, tokenizer, tmp_path):
    src, dst = _rename_direction(trainer_or_skip(name)[0])
    with REGISTRY.suspended(RENAMES[0]), REGISTRY.suspended(RENAMES[1]):
        try:
            trainer = _pref_trainer(name, tokenizer, tmp_path, **{src: tokenizer})
        except TypeError as exc:
            assert f"unexpected keyword argument '{src}'" in str(exc), exc
            return
    # some releases (trl 0.12, ORPO of 0.14) translate the old name themselves: no failure to reproduce
    assert getattr(trainer, dst, None) is tokenizer, f"{src}= accepted natively but {dst} not set"
    pytest.skip(f"{name} of trl {_trl_version()} translates {src}= to {dst} itself (no native failure)")


@pytest.mark.parametrize("name", ["orpo", "cpo"])
def test_f5_renamed_tokenizer_kwarg_passes_with_the_shim(name, tokenizer, tmp_path):
    from liger_compat.shims.renamed_kwargs import RenamedKwargWarning

    src, dst = _rename_direction(trainer_or_skip(name)[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _pref_trainer(name, tokenizer, tmp_path, **{src: tokenizer})
    ours = [w for w in caught if issubclass(w.category, RenamedKwargWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught if src in str(w.message)]
    assert src in str(ours[0].message) and dst in str(ours[0].message)
    assert getattr(trainer, "processing_class", getattr(trainer, "tokenizer", None)) is tokenizer
