"""Trainers with ``torch_compile=True`` on the patched model: the compiled step runs our custom ops,
breaks no graph, and logs the loss (and trl's token accuracy) a native compiled run logs.

The compile backend is ``aot_eager`` (TorchDynamo plus AOT autograd: the whole tracing path, without
Inductor's code generation, which ``tests/compile`` runs).
"""

from __future__ import annotations

import pytest
import torch

from liger_compat import _config
from liger_compat.compat import tiny_text as tiny

from trainer_helpers import (assert_logs_close, fresh_model, make_config, native_head_interpreted,
                             run_native_and_patched, tokenizer_kwarg, train_logs, trainer_or_skip)

class _OpsOnly:
    """Counts the real implementations' calls of the fused loss's chunked pass and the RMSNorm
    forward; the eager ``autograd.Function`` s must not run (under compile the fused loss goes
    through its custom op, whose real implementation runs the same code, and the layer shims call
    the native code, which Inductor fuses: no RMSNorm kernel runs)."""

    def __init__(self, monkeypatch):
        from liger_compat.kernels import loss, norm

        self.loss_passes = self.norms = 0
        real_pass, real_norm = loss._flce_pass, norm._forward_fn

        def counting_pass(*a, **k):
            self.loss_passes += 1
            return real_pass(*a, **k)

        def counting_norm(*a, **k):
            self.norms += 1
            return real_norm(*a, **k)

        def refuse(*a, **k):
            raise AssertionError("an eager autograd.Function ran inside the compiled step")

        monkeypatch.setattr(loss, "_flce_pass", counting_pass)
        monkeypatch.setattr(norm, "_forward_fn", counting_norm)
        monkeypatch.setattr(loss._FusedLinearCrossEntropy, "apply", refuse)
        monkeypatch.setattr(norm._RMSNorm, "apply", refuse)


class _NoRecord:
    def __init__(self, model):
        pass

    def close(self):
        pass


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _compile_args():
    return dict(torch_compile=True, torch_compile_backend="aot_eager", max_steps=3)


def _breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_trainer_torch_compile_matches_native(tokenizer, tmp_path, monkeypatch):
    from transformers import Trainer, TrainingArguments

    monkeypatch.setattr(_config.settings, "cpu_native", False)  # the kernels' ops on CPU tensors too

    enc = tokenizer([r["text"] for r in tiny.sft_rows(12)], padding="max_length", truncation=True, max_length=24)
    rows = []
    for ids, mask in zip(enc["input_ids"], enc["attention_mask"]):
        rows.append({"input_ids": ids, "attention_mask": mask,
                     "labels": [t if m else -100 for t, m in zip(ids, mask)]})

    built = []  # the graph count when each run's trainer is built: native first, then ours

    def build(model):
        built.append(_graphs())
        args = make_config(TrainingArguments, tmp_path, remove_unused_columns=False, **_compile_args())
        return Trainer(model=model, args=args, train_dataset=rows)

    ops = _OpsOnly(monkeypatch)
    nat, pat, _, _ = run_native_and_patched(build, fresh_model("llama", tokenizer), recorder=_NoRecord)
    native_logs, patched_logs = train_logs(nat), train_logs(pat)
    assert len(patched_logs) == 3
    assert_logs_close(native_logs, patched_logs, ["loss"])
    assert ops.loss_passes == 3  # one fused pass per step, through the op
    assert ops.norms == 0  # the norms are Inductor's (the layer shims step aside under compile)
    native_graphs, ours = built[1] - built[0], _graphs() - built[1]
    assert native_graphs >= 1 and ours == native_graphs, (native_graphs, ours)  # one each on 5.x: no recompile
    assert _breaks() == 0, dict(torch._dynamo.utils.counters["graph_break"])


@pytest.mark.slow
@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_sft_trainer_torch_compile_matches_native(family, tokenizer, tmp_path, monkeypatch):
    """trl >= 1.15 scores the labels with its own fused head (``add_fused_lm_head``), so our loss is
    not on this path there; under compile the decoder's layers are Inductor's, so what runs of ours
    there is the shims' compiled paths, checked against native's. Where the unpatched trl's head runs
    through Triton's interpreter (trl 1.15.0 on CPU, which cannot run it otherwise), the native
    reference trains eagerly."""
    monkeypatch.setattr(_config.settings, "cpu_native", False)  # the kernels' ops on CPU tensors too
    trainer_cls, config_cls = trainer_or_skip("sft")
    ds = tiny.dataset(tiny.sft_rows(8))
    builds = []

    def build(model):
        compile_args = _compile_args()
        if not builds and native_head_interpreted():  # the first build is the native run
            compile_args = {"max_steps": compile_args["max_steps"]}  # (a backend alone turns compiling on)
        builds.append(model)
        args = make_config(config_cls, tmp_path, max_seq_length=32, max_length=32, dataset_text_field="text",
                           packing=False, **compile_args)
        return trainer_cls(model=model, args=args, train_dataset=ds, **tokenizer_kwarg(trainer_cls, tokenizer))

    ops = _OpsOnly(monkeypatch)
    nat, pat, _, _ = run_native_and_patched(build, fresh_model(family, tokenizer), recorder=_NoRecord)
    native_logs, patched_logs = train_logs(nat), train_logs(pat)
    assert len(patched_logs) == 3
    keys = [k for k in ("loss", "mean_token_accuracy", "entropy") if k in native_logs[0]]
    assert_logs_close(native_logs, patched_logs, keys)
    assert ops.norms == 0  # the layer shims step aside under compile
    assert _graphs() >= (1 if native_head_interpreted() else 2)
