"""trl 1.15+ ``add_fused_lm_head`` heads scored by liger_compat's fused log-prob kernel: the real SFT,
DPO, GRPO and KTO trainers log what the native run (trl's own ``ChunkedLogProbFunction``) logs on the
same weights and batches, trl's chunked function is not called on our path, ours is, and ``check()``
names the head per trainer."""

from __future__ import annotations

from unittest import mock

import pytest

import liger_compat
from liger_compat.shims import _tiny_text as tiny
from liger_compat.shims import trl_fused_lm_head as head

from trainer_helpers import (assert_logs_close, clone, comparable_keys, fresh_model, make_config,
                             run_native_and_patched, tokenizer_kwarg, train_logs, trainer_or_skip, trl_head_on)


def _trl_chunked_function():
    try:
        import trl.trainer.utils as tu
        from trl.kernels import ChunkedLogProbFunction
    except ImportError:
        pytest.skip("the installed trl has no ChunkedLogProbFunction (trl < 1.15)")
    if not hasattr(tu, "add_fused_lm_head"):
        pytest.skip("the installed trl has no add_fused_lm_head (trl < 1.15)")
    return ChunkedLogProbFunction


class _HeadSpy:
    """Per run: calls of trl's chunked function (through the mock ``spy``) and of ours."""

    spy = None

    def __init__(self, model):
        self.trl0 = self.spy.call_count
        self.ours0 = head.calls["ours"]
        self.trl = self.ours = None

    def close(self):
        self.trl = self.spy.call_count - self.trl0
        self.ours = head.calls["ours"] - self.ours0


def _compare(build, base, rtol=2e-4, atol=2e-5, keys=None):
    fn = _trl_chunked_function()
    with mock.patch.object(fn, "apply", wraps=fn.apply) as spy:
        _HeadSpy.spy = spy
        nat, pat, spy_pat, spy_nat = run_native_and_patched(build, base, recorder=_HeadSpy)
    native_logs, patched_logs = train_logs(nat), train_logs(pat)
    assert_logs_close(native_logs, patched_logs, keys or comparable_keys(native_logs), rtol=rtol, atol=atol)
    assert trl_head_on(pat.model)
    # the native run went through trl's chunked function (so the spy can see it) ...
    assert spy_nat.trl > 0 and spy_nat.ours == 0, (spy_nat.trl, spy_nat.ours)
    # ... the patched run through ours only
    assert spy_pat.trl == 0 and spy_pat.ours > 0, (spy_pat.trl, spy_pat.ours)
    return nat, pat


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_sft_on_our_head(family, tokenizer, tmp_path):
    trainer_cls, config_cls = trainer_or_skip("sft")
    ds = tiny.dataset(tiny.sft_rows(8))

    def build(model):
        args = make_config(config_cls, tmp_path, max_length=32, dataset_text_field="text", packing=False,
                           gradient_accumulation_steps=2)
        return trainer_cls(model=model, args=args, train_dataset=ds, **tokenizer_kwarg(trainer_cls, tokenizer))

    nat, pat = _compare(build, fresh_model(family, tokenizer))
    logs = train_logs(pat)
    assert all(k in logs[0] for k in ("loss", "entropy", "mean_token_accuracy")), logs[0]
    reason = next(s for s in liger_compat.check().shims if s["id"] == head.SHIM_ID)["reason"]
    assert "sft" in reason and type(pat.model).__name__ in reason, reason


def test_sft_dft_loss_recomputes_and_matches(tokenizer, tmp_path):
    """DFT weights each token's loss by its probability: not the uniform upstream SFT's head is set up
    for, so the kernel must notice it at backward time and still match the native run."""
    trainer_cls, config_cls = trainer_or_skip("sft")
    ds = tiny.dataset(tiny.sft_rows(8))

    def build(model):
        args = make_config(config_cls, tmp_path, max_length=32, dataset_text_field="text", packing=False,
                           loss_type="dft")
        return trainer_cls(model=model, args=args, train_dataset=ds, **tokenizer_kwarg(trainer_cls, tokenizer))

    _compare(build, fresh_model("qwen2", tokenizer))


@pytest.mark.parametrize("name", ["dpo", "kto"])
def test_preference_on_our_head(name, tokenizer, tmp_path):
    from test_preference import _builder

    build, ref_base = _builder(name, tokenizer, tmp_path)
    base = fresh_model("llama", tokenizer)
    ref_base["model"] = clone(base)
    nat, _ = _compare(build, base)
    keys = comparable_keys(train_logs(nat))
    assert any("logps" in k for k in keys) and any("rewards" in k for k in keys), keys


def test_grpo_on_our_head(tokenizer, tmp_path):
    from test_grpo import _build

    base = fresh_model("qwen2", tokenizer)
    base_dir = tmp_path / "base"
    base.save_pretrained(base_dir)
    _compare(_build(tokenizer, tmp_path / "out", base_dir), base, rtol=1e-3, atol=1e-4)


def test_check_names_the_head_of_each_trainer():
    """check() says per trainer which head computes the loss: ours for the add_fused_lm_head trainers
    while liger_compat is applied, trl's chunked function once it is reverted, native logits for the
    trainers that score from full logits (ORPO / CPO here)."""
    _trl_chunked_function()
    from trainer_helpers import native

    heads = liger_compat.check().heads
    for trainer in ("SFTTrainer", "DPOTrainer", "GRPOTrainer", "KTOTrainer"):
        assert heads[trainer].startswith("liger_compat fused log-probs"), heads
    for trainer in ("ORPOTrainer", "CPOTrainer"):
        if trainer in heads:
            assert heads[trainer].startswith("native logits"), heads
    with native():
        off = liger_compat.check().heads
    assert off["SFTTrainer"].startswith("trl's ChunkedLogProbFunction"), off
    assert "LM heads" in str(liger_compat.check())
