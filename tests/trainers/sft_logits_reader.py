"""An ``SFTTrainer.compute_loss`` that reads ``outputs.logits`` for its metrics, as trl 1.3 .. 1.14's does
with ``loss_type="nll"``, for the trl versions (1.15+) whose own compute_loss reads no logits.

Written here from trl's documented behaviour (not copied): the loss is ``transformers.Trainer.compute_loss``'s
(the labels go through the model's forward), then ``entropy`` (masked by the shifted labels: entropy sum over
valid tokens) and ``mean_token_accuracy`` (correct over valid tokens, summed over all ranks) come from
``outputs.logits``, unless ``self.args.use_liger_kernel`` says the model returns no logits: then the accuracy
is the plain mean over ranks of ``outputs.token_accuracy``, as trl's liger branch logs it.

Used by the F1 pair in ``test_known_failures.py`` and by the two-process SFT run in
``tests/distributed/_trainer_worker.py``. Plain module (no pytest), so a worker process can import it.
"""

from __future__ import annotations


def compute_loss_reading_logits(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    from transformers import Trainer
    from trl.trainer.utils import entropy_from_logits

    mode = "train" if self.model.training else "eval"
    inputs["use_cache"] = False
    loss, outputs = Trainer.compute_loss(self, model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
    metrics = self._metrics[mode]
    if self.args.use_liger_kernel:
        acc = self.accelerator.gather_for_metrics(outputs.token_accuracy.detach().float())
        metrics["mean_token_accuracy"].append(acc.mean().item())
    else:
        shift_logits = outputs.logits[..., :-1, :].detach()
        shift_labels = inputs["labels"][..., 1:]
        mask = shift_labels != -100
        entropy_sum = (entropy_from_logits(shift_logits) * mask).sum()
        entropy_sum = self.accelerator.gather_for_metrics(entropy_sum).sum()
        correct = ((shift_logits.argmax(-1) == shift_labels) & mask).sum()
        correct = self.accelerator.gather_for_metrics(correct).sum()
        total = self.accelerator.gather_for_metrics(mask.sum()).sum()
        metrics["entropy"].append((entropy_sum / total).item() if total > 0 else 0.0)
        metrics["mean_token_accuracy"].append((correct / total).item() if total > 0 else 0.0)
    return (loss, outputs) if return_outputs else loss


def reads_logits(trainer_cls) -> bool:
    """Whether the installed ``trainer_cls.compute_loss`` reads ``outputs.logits`` (trl 0.15 .. 1.14)."""
    from liger_compat.shims._patching import unwrap
    from liger_compat.shims.trl_sft_token_accuracy import read_style

    return not isinstance(read_style(unwrap(trainer_cls.compute_loss)), str)
