"""One set of kernels: the trainers' own liger switch while liger_compat is active, and trl's own fused
LM heads (trl 1.6+ ``chunked_nll``, trl 1.15+ ``add_fused_lm_head``) next to liger_compat's kernels."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest

import liger_compat
from liger_compat import _config, kernels
from liger_compat.shims import REGISTRY
from liger_compat.compat import tiny_text as tiny
from liger_compat.shims.trainer_liger_switch import LigerSwitchWarning

from trainer_helpers import (assert_logs_close, clone, code_file, config_fields, fresh_model, make_config, native,
                             run_native_and_patched, tokenizer_kwarg, train_logs, trainer_or_skip, trl_head_on)


def _liger_kernel_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def _foreign_instance_forwards(model) -> list[str]:
    """Modules whose forward was replaced on the instance by someone other than trl / liger_compat
    (liger-kernel's instance patching would show up here)."""
    out = []
    for name, m in model.named_modules():
        fwd = vars(m).get("forward")
        if fwd is None:
            continue
        path = code_file(fwd)
        if not any(f"/{pkg}/" in path for pkg in ("trl", "liger_compat", "accelerate")):
            out.append(f"{name}: {path}")
    return out


def test_transformers_trainer_switch(tokenizer, tmp_path):
    from transformers import Trainer, TrainingArguments

    if "use_liger_kernel" not in config_fields(TrainingArguments):
        pytest.skip("TrainingArguments of the installed transformers has no use_liger_kernel")
    if not _liger_kernel_installed():
        # natively: transformers 4.45 .. 4.5x refuse (ImportError), 5.x warn and go on without kernels
        with native(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                Trainer(model=fresh_model("llama", tokenizer),
                        args=make_config(TrainingArguments, tmp_path, use_liger_kernel=True))
            except ImportError as exc:
                assert "liger" in str(exc).lower()
    args = make_config(TrainingArguments, tmp_path, use_liger_kernel=True)
    model = fresh_model("llama", tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(model=model, args=args)
    ours = [w for w in caught if issubclass(w.category, LigerSwitchWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert args.use_liger_kernel is False
    assert not _foreign_instance_forwards(model)
    rep = liger_compat.check()
    reason = next(s for s in rep.shims if s["id"] == "transformers.trainer_liger_switch")["reason"]
    assert "Trainer: use_liger_kernel turned off" in reason
    assert any(c["what"] == "Trainer args.use_liger_kernel" for c in rep.conflicts)


def test_switch_left_alone_when_disabled(tokenizer, tmp_path):
    from transformers import Trainer, TrainingArguments

    if "use_liger_kernel" not in config_fields(TrainingArguments):
        pytest.skip("TrainingArguments of the installed transformers has no use_liger_kernel")
    liger_compat.configure(enabled=False)
    try:
        args = make_config(TrainingArguments, tmp_path, use_liger_kernel=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                Trainer(model=fresh_model("llama", tokenizer), args=args)
            except ImportError:
                assert not _liger_kernel_installed()
        assert not [w for w in caught if issubclass(w.category, LigerSwitchWarning)]
        assert args.use_liger_kernel is True
    finally:
        liger_compat.configure(enabled=True)


def _sft_switch_name(config_cls) -> str:
    fields = config_fields(config_cls)
    # trl 0.15 steers SFT with its own use_liger (use_liger_kernel is transformers' switch there)
    return "use_liger" if "use_liger" in fields and "use_liger_kernel" in fields and _trl_minor() < (0, 16) \
        else "use_liger_kernel"


def _trl_minor():
    import trl
    from packaging.version import Version

    return Version(trl.__version__).release[:2]


def test_sft_with_the_trainers_switch_on(tokenizer, tmp_path):
    """SFT with the trainer's liger switch on and liger_compat active trains with liger_compat's kernels
    only, and logs what a native run without the switch logs."""
    trainer_cls, config_cls = trainer_or_skip("sft")
    switch = _sft_switch_name(config_cls)
    if switch not in config_fields(config_cls):
        pytest.skip(f"{config_cls.__name__} has no {switch}")
    ds = tiny.dataset(tiny.sft_rows(8))

    def build(model, **extra):
        args = make_config(config_cls, tmp_path, max_seq_length=32, max_length=32, dataset_text_field="text",
                           packing=False, **extra)
        return trainer_cls(model=model, args=args, train_dataset=ds, **tokenizer_kwarg(trainer_cls, tokenizer))

    base = fresh_model("llama", tokenizer)
    with native():
        nat = build(clone(base))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            nat.train()
    model = clone(base)
    liger_compat.apply(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pat = build(model, **{switch: True})
        pat.train()
    assert len([w for w in caught if issubclass(w.category, LigerSwitchWarning)]) == 1
    assert getattr(pat.args, switch) is False
    assert not _foreign_instance_forwards(pat.model)
    # trl 1.10 .. 1.14 pick loss_type "nll" when the switch is on at config time: that is not the native
    # run's default there, so compare the loss only where both runs used the same loss path
    keys = [k for k in ("loss", "mean_token_accuracy", "entropy") if k in train_logs(nat)[0]]
    if getattr(nat.args, "loss_type", None) == getattr(pat.args, "loss_type", None):
        assert_logs_close(train_logs(nat), train_logs(pat), keys)


def test_trl_head_reported_and_layer_kernels_run(tokenizer, tmp_path, monkeypatch):
    """trl's own fused head (1.15+ for every SFT run, 1.6 .. 1.14 with loss_type chunked_nll) runs the
    backbone; liger_compat's RMSNorm kernel runs inside the decoder, and check() says that liger_compat's
    log-prob kernel scores the labels (trl 1.15+'s add_fused_lm_head; trl 1.6 .. 1.14's chunked function)."""
    monkeypatch.setattr(_config.settings, "cpu_native", False)  # the RMSNorm kernel on CPU tensors too
    trainer_cls, config_cls = trainer_or_skip("sft")
    extra = {}
    import trl.trainer.utils as tu
    import trl.trainer.sft_trainer as st

    if not hasattr(tu, "add_fused_lm_head"):
        if not hasattr(st, "_patch_chunked_ce_lm_head"):
            pytest.skip("the installed trl has no fused LM head of its own")
        extra["loss_type"] = "chunked_nll"
    ds = tiny.dataset(tiny.sft_rows(4))
    model = fresh_model("qwen2", tokenizer)
    liger_compat.apply(model)
    args = make_config(config_cls, tmp_path, max_length=32, dataset_text_field="text", packing=False, max_steps=1,
                       **extra)
    trainer = trainer_cls(model=model, args=args, train_dataset=ds, **tokenizer_kwarg(trainer_cls, tokenizer))
    assert trl_head_on(trainer.model)
    # the unchecked entry the RMSNorm shim calls once it has run the kernel's argument checks
    with mock.patch.object(kernels.norm, "rms_norm_checked", wraps=kernels.norm.rms_norm_checked) as spy, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert spy.call_count > 0, "liger_compat's RMSNorm did not run inside the decoder"
    rep = liger_compat.check()
    head = [c for c in rep.conflicts if c["what"] == "Qwen2ForCausalLM LM head"]
    reason = next(s for s in rep.shims if s["id"] == "trl.fused_lm_head")["reason"]
    assert "Qwen2ForCausalLM" in reason and "in use" in reason, reason
    assert not head, rep.conflicts
    assert "liger_compat's fused log-prob kernel" in reason, reason
