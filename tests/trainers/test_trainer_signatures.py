"""Old trl trainers (< 0.13) driven by newer transformers Trainer loops: compute_loss(num_items_in_batch=),
log(logs, start_time), get_batch_samples(epoch_iterator, num_batches[, device])."""

from __future__ import annotations

import inspect
import re
import types
import warnings

import pytest
import torch

import liger_compat
from liger_compat.shims import REGISTRY
from liger_compat.compat import tiny_text as tiny
from liger_compat.shims._patching import PatchSet
from liger_compat.shims.trl_trainer_signatures import _patch

from trainer_helpers import (SIGNATURE_DRIFT, clone, fresh_model, make_config, native, tokenizer_kwarg, train_logs,
                             trainer_or_skip)


def _old_style_trainer_module():
    from transformers import Trainer

    mod = types.ModuleType("fake_trl_old_trainer")

    class OldTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False):
            self.calls.append(("compute_loss", inputs))
            return torch.tensor(1.5)

        def log(self, logs):
            self.calls.append(("log", logs))

        def get_batch_samples(self, model, batch):
            self.calls.append(("generate", batch))
            return ["sample"]

    OldTrainer.__module__ = mod.__name__
    mod.OldTrainer = OldTrainer
    return mod, OldTrainer


def test_stand_in_old_trainer(tokenizer, tmp_path):
    from transformers import Trainer, TrainingArguments

    mod, cls = _old_style_trainer_module()
    ps = PatchSet()
    done = _patch(mod, ps)
    try:
        trainer = cls(model=fresh_model("llama", tokenizer), args=make_config(TrainingArguments, tmp_path))
        trainer.calls = []
        base = inspect.signature(Trainer.compute_loss).parameters
        if "num_items_in_batch" in base:
            assert "OldTrainer.compute_loss" in done
            assert trainer.compute_loss(None, {"x": 1}, num_items_in_batch=7).item() == 1.5
        if "start_time" in inspect.signature(Trainer.log).parameters:
            assert "OldTrainer.log" in done
            trainer.log({"a": 1.0}, 123.0)
            trainer.log({"b": 2.0}, start_time=5.0)
        if "get_batch_samples" in vars(Trainer):
            assert "OldTrainer.get_batch_samples" in done
            extra = ["cpu"] if "device" in inspect.signature(Trainer.get_batch_samples).parameters else []
            batches, _ = trainer.get_batch_samples(iter([{"input_ids": torch.ones(1, 3)}] * 2), 2, *extra)
            assert len(batches) == 2
            assert trainer.get_batch_samples("model", {"prompt": 1}) == ["sample"]  # trl's own call still works
        if not done:
            pytest.skip("the installed transformers Trainer has none of the newer signatures")
        kinds = [c[0] for c in trainer.calls]
        assert "generate" in kinds or "get_batch_samples" not in vars(Trainer)
    finally:
        assert not ps.revert()


def trl_version() -> str:
    import trl

    return trl.__version__


def _needs_old_trl_on_new_transformers():
    import trl
    import transformers
    from packaging.version import Version

    if Version(trl.__version__).release >= (0, 13):
        pytest.skip(f"trl {trl.__version__} already has the newer signatures")
    if Version(transformers.__version__).release < (4, 46):
        pytest.skip(f"transformers {transformers.__version__} calls the old signatures")


@pytest.mark.parametrize("name", ["dpo", "orpo"])
def test_old_trl_trainer_trains_on_new_transformers(name, tokenizer, tmp_path):
    """Natively the loop's call dies (AttributeError / TypeError); patched, training runs and the first logged loss is
    the one the trainer's own compute_loss gives for the same weights and (whole-dataset) batch."""
    _needs_old_trl_on_new_transformers()
    trainer_cls, config_cls = trainer_or_skip(name)
    rows = tiny.preference_rows(4)
    base = fresh_model("llama", tokenizer)

    def build(model):
        args = make_config(config_cls, tmp_path, max_length=32, max_prompt_length=16, beta=0.1, max_steps=1,
                           per_device_train_batch_size=4, remove_unused_columns=False)
        kw = tokenizer_kwarg(trainer_cls, tokenizer)
        if name == "dpo":
            kw["ref_model"] = clone(base)
        return trainer_cls(model=model, args=args, train_dataset=tiny.dataset(rows), **kw)

    with native(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nat = build(clone(base))
        # 4.46+: the loop's get_batch_samples(epoch_iterator, n) lands in trl's (model, batch) one
        # ("'generator' object has no attribute 'generate'"), then compute_loss(num_items_in_batch=)
        try:
            nat.train()
        except (TypeError, AttributeError) as exc:
            assert re.search(SIGNATURE_DRIFT, str(exc)), f"{type(exc).__name__}: {exc}"
        else:  # trl 0.12.2 already adapted its preference trainers to transformers 4.46
            pytest.skip(f"{trainer_cls.__name__} of trl {trl_version()} trains natively on this transformers")
        batch = nat._prepare_inputs(next(iter(nat.get_train_dataloader())))
        nat.model.train()
        want = float(nat.compute_loss(nat.model, batch))
    pat = build(clone(base))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pat.train()
    got = train_logs(pat)[0]["loss"]
    assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), (got, want)
    reason = REGISTRY.get("trl.trainer_signatures").status()["reason"]
    assert f"{trainer_cls.__name__}.compute_loss" in reason, reason
