"""One rank of a two-process ``transformers.Trainer`` or trl ``SFTTrainer`` run with their defaults
(DDP, ``ddp_find_unused_parameters`` left unset: the Trainer then asks DDP to find unused
parameters, which flattens and rebuilds every output with torch's pytree; ``SFTConfig``'s default
gradient checkpointing is turned off, as the Trainer's default has it, so that SFT takes that path too).

Used by ``test_trainers_gloo.py``; not a test itself. liger_compat is imported first; the native
run is the same command under ``LIGER_COMPAT_DISABLE=1``.

    python -m torch.distributed.run --nproc_per_node 2 _trainer_worker.py trainer --seed S --out O
"""

from __future__ import annotations

import argparse
import os
import warnings

import liger_compat  # noqa: F401  (first, as a training script would)


def _quiet() -> None:
    import logging

    warnings.simplefilter("ignore")
    for name in ("transformers", "trl", "accelerate", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)


class OutputRecorder:
    """Which outputs the model returned, seen from inside DDP (before its rebuild)."""

    def __init__(self, model) -> None:
        self.kinds: dict[str, int] = {}
        self._h = model.register_forward_hook(self._hook)

    def _hook(self, module, args, out) -> None:
        get = getattr(out, "get", None)
        fused = get is not None and get("logits") is None and get("token_accuracy") is not None
        key = f"{type(out).__module__}.{type(out).__name__}" + (" fused" if fused else "")
        self.kinds[key] = self.kinds.get(key, 0) + 1


def _args(cls, out_dir: str, **extra):
    import dataclasses

    fields = {f.name for f in dataclasses.fields(cls)}
    want = dict(output_dir=out_dir, max_steps=3, per_device_train_batch_size=2, learning_rate=5e-2,
                lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                bf16=False, fp16=False, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
                dataset_num_proc=None, **extra)
    return cls(**{k: v for k, v in want.items() if k in fields})


def _trainer(seed: int, out_dir: str):
    import torch
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from liger_compat.compat.tiny_models import build

    model = build("llama", seed=seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (12, 16), generator=g)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) < 0.3] = -100
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(),
                            "labels": labels.tolist()})
    return Trainer(model=model, args=_args(TrainingArguments, out_dir), train_dataset=ds)


def _install_logits_reader(trainer_cls) -> None:
    """Give ``trainer_cls`` a compute_loss that reads ``outputs.logits`` (trl 1.3 .. 1.14's, see
    ``tests/trainers/sft_logits_reader.py``) where the installed one reads none; the token-accuracy
    shim is applied to it afresh, as an import of such a trl would."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainers"))
    from sft_logits_reader import compute_loss_reading_logits, reads_logits

    from liger_compat.shims import REGISTRY

    if reads_logits(trainer_cls):
        return
    if os.environ.get("LIGER_COMPAT_DISABLE") == "1":  # the native run: no shim to apply afresh
        trainer_cls.compute_loss = compute_loss_reading_logits
        return
    # both shims around SFTTrainer.compute_loss step aside while it is replaced
    with REGISTRY.suspended("trl.fused_lm_head"), REGISTRY.suspended("trl.sft_token_accuracy"):
        trainer_cls.compute_loss = compute_loss_reading_logits


def _sft(seed: int, out_dir: str, logits_reader: bool = False):
    from liger_compat.compat import tiny_text as tiny
    from liger_compat.compat.trl_trainer_locations import find_trainer
    from liger_compat.shims._patching import signature

    trainer_cls, config_cls = find_trainer("sft")
    if logits_reader:
        _install_logits_reader(trainer_cls)
    tok = tiny.build_tokenizer()
    model = tiny.build_model("llama", tok, seed=seed)
    # loss_type="nll": the model computes the loss (trl >= 1.10 defaults to its own chunked head);
    # gradient checkpointing off (trl >= 0.20 turns it on by default): DDP then finds unused parameters
    args = _args(config_cls, out_dir, max_seq_length=32, max_length=32, dataset_text_field="text", packing=False,
                 loss_type="nll", gradient_checkpointing=False)
    tok_kw = "processing_class" if "processing_class" in signature(trainer_cls.__init__).parameters else "tokenizer"
    return trainer_cls(model=model, args=args, train_dataset=tiny.dataset(tiny.sft_rows(12, seed=seed)),
                       **{tok_kw: tok})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["trainer", "sft"])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--logits-reader", action="store_true",
                    help="sft: an SFTTrainer.compute_loss that reads outputs.logits, where the installed one does not")
    a = ap.parse_args()
    from _harness import enable_fault_stacks  # this script's folder is first on sys.path

    enable_fault_stacks()
    _quiet()
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(a.seed, tmp) if a.kind == "trainer" else _sft(a.seed, tmp, a.logits_reader)
        rec = OutputRecorder(trainer.model)
        init = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        trainer.train()
    ddp = trainer.model_wrapped
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        import liger_compat as lc
        from liger_compat.shims._patching import unwrap

        torch.save({
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
            "wrapper": type(ddp).__name__,
            "find_unused_parameters": getattr(ddp, "find_unused_parameters", None),
            "outputs": rec.kinds,
            "logs": [h for h in trainer.state.log_history if "loss" in h],
            "state": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "init": init,
            "patched": not lc._config.settings.disabled,
            "compute_loss": unwrap(type(trainer).compute_loss).__name__,
        }, a.out)
    # the process group ends before the interpreter does: a gloo group left to interpreter finalization
    # can abort a rank that has finished its work ("terminate called without an active exception")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
