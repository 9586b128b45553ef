"""Evaluation and prediction on a fused model give what the unpatched library gives.

``Trainer.prediction_step`` calls the model with labels and hands every output field but the loss to
``compute_metrics`` as the predictions. A forward that skipped the logits whenever labels came
handed over the token-accuracy scalars instead, and a metric indexing ``[N, T, V]`` logits failed with
``IndexError``. Outside training the fused forward returns the native loss and logits; in training it
keeps the fused loss (tests/models/test_causal_lm.py checks the forward itself).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from liger_compat.compat import tiny_text as tiny
from liger_compat.shims import causal_lm
from liger_compat.compat.families import FAMILIES
from liger_compat.shims._patching import is_ours
from liger_compat.compat.tiny_models import FamilyUnavailable, build
from patch_helpers import CORE_FAMILIES

from trainer_helpers import (assert_logs_close, fresh_model, make_config, native, run_native_and_patched,
                             tokenizer_kwarg, trainer_or_skip, trl_head_on)

#: float32 on CPU: logits of O(1..10) through two layers; our RMSNorm / RoPE / MLP kernels may
#: round differently from the native modules in the last few bits
RTOL, ATOL = 1e-5, 1e-5


def _logits_of(predictions):
    """The logits among the predictions (an MoE model's also hold its aux loss and router logits)."""
    if isinstance(predictions, tuple):
        return next(p for p in predictions if getattr(p, "ndim", 0) == 3)
    return predictions


def compute_metrics(pred):
    """A user's metric function that reads the logits: argmax accuracy over the shifted labels, the
    mean logit, and the mean log-probability of the label."""
    logits = _logits_of(pred.predictions)[:, :-1].astype(np.float64)
    labels = pred.label_ids[:, 1:]
    valid = labels != -100
    acc = (logits.argmax(-1) == labels)[valid].mean()
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    picked = np.take_along_axis(logits, np.where(valid, labels, 0)[..., None], -1)[..., 0]
    return {"acc": float(acc), "mean_logit": float(logits.mean()), "label_logprob": float((picked - lse)[valid].mean()),
            "valid": float(valid.sum())}


def _model(family: str):
    try:
        return build(family, seed=3)
    except FamilyUnavailable as exc:
        pytest.skip(str(exc))


def _data(model, n: int = 6, t: int = 10, seed: int = 0):
    """Random inputs; labels that agree with the model's own argmax at about half of the positions
    (so the accuracy is neither 0 nor 1), a quarter ignored."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (n, t), generator=g)
    with native(), torch.no_grad():
        guess = model.eval()(input_ids=ids).logits.argmax(-1)
    labels = torch.randint(3, model.config.vocab_size, (n, t), generator=g)
    agree = torch.rand(n, t - 1, generator=g) < 0.5
    labels[:, 1:] = torch.where(agree, guess[:, :-1], labels[:, 1:])
    labels[torch.rand(n, t, generator=g) < 0.25] = -100
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(),
                              "labels": labels.tolist()})


def _trainer(model, ds, tmp_path):
    from transformers import Trainer, TrainingArguments

    args = make_config(TrainingArguments, tmp_path, per_device_eval_batch_size=4)
    return Trainer(model=model, args=args, eval_dataset=ds, compute_metrics=compute_metrics)


def _evaluate_and_predict(model, ds, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _trainer(model, ds, tmp_path)
        return trainer.evaluate(), trainer.predict(ds)


def _assert_nested_close(a, b, path="predictions"):
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), (path, len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_nested_close(x, y, f"{path}[{i}]")
        return
    assert a.shape == b.shape, (path, a.shape, b.shape)
    np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL, err_msg=path)


def _assert_metrics_close(nat: dict, pat: dict, n_valid: float):
    for key in ("loss", "acc", "mean_logit", "label_logprob", "valid"):
        k = next(k for k in nat if k.endswith("_" + key))
        assert k in pat, (k, sorted(pat))
        # an argmax may flip on a near tie: one token of the accuracy
        atol = 1.0 / n_valid if key == "acc" else ATOL
        assert abs(pat[k] - nat[k]) <= atol + RTOL * abs(nat[k]), (k, nat[k], pat[k])


@pytest.mark.parametrize("family", [f.name for f in FAMILIES if f.name in CORE_FAMILIES])
def test_evaluate_and_predict_match_native(family, tmp_path):
    model = _model(family)
    model.config.use_cache = False  # (no KV cache: transformers 4.48.0's Gemma 2 cache fails natively here)
    assert is_ours(vars(type(model))["forward"], causal_lm._fused_forward)
    ds = _data(model)
    with native():
        nat_eval, nat_pred = _evaluate_and_predict(model, ds, tmp_path / "native")
    pat_eval, pat_pred = _evaluate_and_predict(model, ds, tmp_path / "patched")
    logits = _logits_of(nat_pred.predictions)
    assert logits.shape == (len(ds), 10, model.config.vocab_size)
    # the labels agree with the argmax at about half of the positions: a wrong logit shows
    assert 0.2 < nat_eval["eval_acc"] < 0.8, nat_eval
    _assert_metrics_close(nat_eval, pat_eval, nat_eval["eval_valid"])
    _assert_nested_close(nat_pred.predictions, pat_pred.predictions)
    np.testing.assert_array_equal(pat_pred.label_ids, nat_pred.label_ids)
    _assert_metrics_close(nat_pred.metrics, pat_pred.metrics, nat_eval["eval_valid"])


def test_evaluate_with_a_fused_forward_in_eval_mode_fails_like_upstream(tmp_path, monkeypatch):
    """The situation before: a forward that returns ``logits=None`` whenever labels come (here: ours
    made to believe the model is training) hands compute_metrics the token-accuracy scalars."""
    model = _model("llama")
    ds = _data(model)
    monkeypatch.setattr(causal_lm, "_reads_logits", lambda m: False)
    with pytest.raises(IndexError):
        _evaluate_and_predict(model, ds, tmp_path)


# --------------------------------------------------------------------------------------------
# trl SFTTrainer: training (fused) with evaluation (logits) in between
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_sft_eval_between_training_steps_matches_native(family, tokenizer, tmp_path):
    """Two SFT steps with an evaluation after each: the eval loss, trl's eval token accuracy and
    entropy, and a compute_metrics on the logits match a native run, and the training steps still
    took the fused loss."""
    trainer_cls, config_cls = trainer_or_skip("sft")
    train_ds = tiny.dataset(tiny.sft_rows(8))
    eval_ds = tiny.dataset(tiny.sft_rows(6, seed=1))

    def build_trainer(model):
        # loss_type="nll": trl 1.10-1.14 default to "chunked_nll", whose own head returns no logits
        # to evaluation natively either (trl's heads are tested in test_trl_head.py)
        args = make_config(config_cls, tmp_path, max_seq_length=32, max_length=32, dataset_text_field="text",
                           packing=False, eval_strategy="steps", evaluation_strategy="steps", eval_steps=1,
                           loss_type="nll")
        return trainer_cls(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                           compute_metrics=compute_metrics, **tokenizer_kwarg(trainer_cls, tokenizer))

    base = fresh_model(family, tokenizer)
    nat, pat, counter, _ = run_native_and_patched(build_trainer, base)

    def eval_logs(trainer):
        return [dict(h) for h in trainer.state.log_history if "eval_loss" in h]

    native_logs, patched_logs = eval_logs(nat), eval_logs(pat)
    assert len(native_logs) == 2, native_logs
    keys = [k for k in native_logs[0] if k.startswith("eval_") and isinstance(native_logs[0][k], float)
            and not any(t in k for t in ("runtime", "per_second", "preparation_time", "num_tokens"))]
    assert {"eval_loss", "eval_acc", "eval_mean_logit"} <= set(keys), keys
    # eval_acc is an argmax: allow one flipped token of the eval set's valid labels
    assert_logs_close(native_logs, patched_logs, [k for k in keys if k != "eval_acc"], rtol=RTOL, atol=ATOL)
    assert_logs_close(native_logs, patched_logs, ["eval_acc"], rtol=0, atol=1.0 / native_logs[0]["eval_valid"])
    # evaluation saw the logits; training went through the fused loss (unless trl's own head scored it)
    assert counter.with_logits > 0, (counter.fused, counter.with_logits)
    if not trl_head_on(pat.model):
        assert counter.fused > 0, (counter.fused, counter.with_logits)
