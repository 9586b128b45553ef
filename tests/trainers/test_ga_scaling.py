"""The fused loss under gradient accumulation is scaled as the native loss is, whichever way the
installed Trainer decides the scaling: counted tokens (``num_items_in_batch``, 4.46+), the division
by the accumulation steps also when no count reaches the model (4.53+), or
``Trainer.loss_is_scaled_for_ga`` (5.19+). Native and patched runs train the same tiny model from the
same weights on micro-batches with different numbers of label tokens (so a per-micro-batch mean and
a token-weighted mean differ), with plain SGD (which keeps the scale of the gradient in the update).
"""

from __future__ import annotations

import pytest
import torch

from trainer_helpers import assert_logs_close, fresh_model, make_config, run_native_and_patched, train_logs


def _rows(n=8, t=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(5, 60, (t,), generator=g)
        lab = ids.clone()
        lab[: 1 + (i * 5) % (t - 2)] = -100  # 1 .. 10 ignored positions: token counts differ per row
        rows.append({"input_ids": ids.tolist(), "attention_mask": [1] * t, "labels": lab.tolist()})
    return rows


def _build(tmp_path, cls, **trainer_attrs):
    from datasets import Dataset
    from transformers import TrainingArguments, default_data_collator

    def build(model):
        args = make_config(TrainingArguments, tmp_path, remove_unused_columns=False, gradient_accumulation_steps=2,
                           per_device_train_batch_size=2, max_steps=2, optim="sgd", learning_rate=0.5)
        trainer = cls(model=model, args=args, train_dataset=Dataset.from_list(_rows()),
                      data_collator=default_data_collator)
        for k, v in trainer_attrs.items():
            setattr(trainer, k, v)
        return trainer

    return build


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _compare(nat, pat, base):
    assert_logs_close(train_logs(nat), train_logs(pat), ["loss"], rtol=1e-4, atol=1e-6)
    a, b, start = _params(nat.model), _params(pat.model), _params(base)
    assert a.keys() == b.keys()
    moved = max((a[n] - start[n]).abs().max().item() for n in a)
    assert moved > 1e-3, "the runs did not train"
    for n in a:
        torch.testing.assert_close(b[n], a[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


def _ga_variants():
    from transformers import Trainer

    out = [("default", {}), ("no-count-reaches-the-model", {"model_accepts_loss_kwargs": False})]
    if "loss_is_scaled_for_ga" in vars(Trainer) or hasattr(Trainer, "loss_is_scaled_for_ga"):
        out += [("scaled-true", {"loss_is_scaled_for_ga": True}), ("scaled-false", {"loss_is_scaled_for_ga": False})]
    return out


@pytest.mark.parametrize("variant", ["default", "no-count-reaches-the-model", "scaled-true", "scaled-false"])
def test_fused_loss_scales_like_native_under_gradient_accumulation(tmp_path, tokenizer, variant):
    from transformers import Trainer

    variants = dict(_ga_variants())
    if variant not in variants:
        pytest.skip("this transformers' Trainer has no loss_is_scaled_for_ga (5.19+)")
    base = fresh_model("llama", tokenizer, seed=3)
    nat, pat, rec, _ = run_native_and_patched(_build(tmp_path, Trainer, **variants[variant]), base)
    assert rec.fused > 0, "the patched run never took the fused loss"
    _compare(nat, pat, base)


def test_the_variants_scale_differently_natively(tmp_path, tokenizer):
    """The comparison above can tell scalings apart: natively, a token-count-weighted loss and a
    per-micro-batch mean divided by the steps give different logged losses on these batches."""
    from transformers import Trainer

    if "get_batch_samples" not in vars(Trainer):
        pytest.skip("transformers < 4.46 counts no num_items_in_batch: one scaling only")
    base = fresh_model("llama", tokenizer, seed=3)
    from trainer_helpers import clone, native

    logs = {}
    with native():
        for name, attrs in _ga_variants()[:2]:
            t = _build(tmp_path / name, Trainer, **attrs)(clone(base))
            t.train()
            logs[name] = [h["loss"] for h in train_logs(t)]
    assert logs["default"] != pytest.approx(logs["no-count-reaches-the-model"], rel=1e-4), logs
