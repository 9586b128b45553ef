"""F1: the real SFTTrainer on the fused model logs the loss, mean_token_accuracy and entropy a native
run with the same weights and batches logs (trl 0.15 .. 1.13 read them from outputs.logits)."""

from __future__ import annotations

import pytest

from liger_compat.compat import tiny_text as tiny

from trainer_helpers import (assert_logs_close, config_fields, fresh_model, make_config, run_native_and_patched,
                             tokenizer_kwarg, train_logs, trainer_or_skip, trl_head_on)


def _build(tokenizer, tmp_path, **cfg):
    trainer_cls, config_cls = trainer_or_skip("sft")
    if cfg.get("loss_type") == "nll" and "loss_type" not in config_fields(config_cls):
        pytest.skip(f"{config_cls.__name__} of the installed trl has no loss_type (its loss is the plain nll)")
    ds = tiny.dataset(tiny.sft_rows(8))

    def build(model):
        args = make_config(config_cls, tmp_path, max_seq_length=32, max_length=32, dataset_text_field="text",
                           packing=False, gradient_accumulation_steps=2, **cfg)
        return trainer_cls(model=model, args=args, train_dataset=ds, **tokenizer_kwarg(trainer_cls, tokenizer))

    return build


@pytest.mark.parametrize("loss_type", ["default", "nll"])
@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_sft_metrics_match_native(family, loss_type, tokenizer, tmp_path):
    """loss_type "nll" forces the labels through the model's forward where trl would otherwise use its
    own chunked head (trl 1.10 .. 1.14 default to "chunked_nll")."""
    base = fresh_model(family, tokenizer)
    cfg = {} if loss_type == "default" else {"loss_type": loss_type}
    build = _build(tokenizer, tmp_path, **cfg)
    nat, pat, counter, _ = run_native_and_patched(build, base)
    native_logs, patched_logs = train_logs(nat), train_logs(pat)
    keys = [k for k in ("loss", "mean_token_accuracy", "entropy") if k in native_logs[0]]
    assert_logs_close(native_logs, patched_logs, keys)
    if trl_head_on(pat.model):
        assert counter.fused == 0  # trl's own head computed loss and metrics: nothing for F1 to do
        return
    # the run really went through the fused forward (logits None), not a native fallback
    assert counter.fused > 0, (counter.fused, counter.with_logits)

