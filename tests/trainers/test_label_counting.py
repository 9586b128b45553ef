"""F5: gradient-accumulation token counting for batches whose labels are not under "labels"."""

from __future__ import annotations

import pytest
import torch

from liger_compat.shims import REGISTRY
from liger_compat.shims.num_items_in_batch_labels import count_label_tokens, label_keys

from trainer_helpers import make_config, native, unsloth_style_get_batch_samples


def _labels(shape, gen, p_ignore=0.3):
    t = torch.randint(0, 50, shape, generator=gen)
    t[torch.rand(shape, generator=gen) < p_ignore] = -100
    return t


@pytest.mark.parametrize("seed", range(3))
def test_count_label_tokens_matches_manual(seed):
    g = torch.Generator().manual_seed(seed)
    lab = _labels((3, 11), g)
    assert count_label_tokens({"labels": lab}).item() == int((lab != -100).sum())
    assert count_label_tokens({"labels": lab}, shift=True).item() == int((lab[:, 1:] != -100).sum())
    sl = _labels((3, 10), g)
    assert count_label_tokens({"labels": lab, "shift_labels": sl}, shift=True).item() == int((sl != -100).sum())
    ch, rj = _labels((2, 9), g), _labels((2, 7), g)
    batch = {"chosen_input_ids": ch.clamp(min=0), "chosen_labels": ch, "rejected_labels": rj}
    assert label_keys(batch) == ["chosen_labels", "rejected_labels"]
    assert count_label_tokens(batch).item() == int((ch != -100).sum() + (rj != -100).sum())
    assert count_label_tokens(batch, shift=True).item() == int((ch[:, 1:] != -100).sum() + (rj[:, 1:] != -100).sum())
    mask = (torch.rand(4, 6, generator=g) < 0.6).long()
    assert count_label_tokens({"completion_mask": mask, "prompt_ids": mask}).item() == int(mask.sum())
    assert count_label_tokens([{"labels": lab}]) is None  # GRPO's list batches
    assert count_label_tokens({"input_ids": lab}) is None


def _trainer(tmp_path, tokenizer, cls=None, **kw):
    from transformers import Trainer, TrainingArguments

    from liger_compat.compat import tiny_text as tiny

    args = make_config(TrainingArguments, tmp_path, remove_unused_columns=False, **kw)
    return (cls or Trainer)(model=tiny.build_model("llama", tokenizer), args=args)


def _needs_counting():
    from transformers import Trainer

    if "get_batch_samples" not in vars(Trainer):
        pytest.skip("transformers < 4.46 does not count num_items_in_batch")


def _count_withheld() -> bool:
    """Whether the installed Trainer calls compute_loss without the count when the model takes loss
    kwargs (transformers 4.47.0 and 4.48.0 only: the grid's compute-loss-without-count boundary)."""
    import transformers
    from packaging.version import Version

    from liger_compat.matrix import load_grid

    b = next(x for x in load_grid().boundaries if x.id == "compute-loss-without-count")
    return b.has(Version(transformers.__version__))


def _expected(trainer, batches):
    shift = bool(getattr(trainer, "_loss_shifts_labels", False))
    total = 0
    for b in batches:
        if "labels" in b:
            lab = b["labels"][..., 1:] if shift else b["labels"]
            total += int((lab != -100).sum())
    return total


def test_mixed_micro_batches(tmp_path, tokenizer):
    """The first micro-batch has labels, a later one does not: natively KeyError: 'labels'."""
    _needs_counting()
    g = torch.Generator().manual_seed(1)
    labeled = {"input_ids": torch.randint(5, 100, (2, 8), generator=g), "labels": _labels((2, 8), g)}
    unlabeled = {"input_ids": torch.randint(5, 100, (2, 8), generator=g)}
    batches = [labeled, unlabeled, dict(labeled)]

    def call(trainer):
        import inspect

        extra = ["cpu"] if "device" in inspect.signature(trainer.get_batch_samples).parameters else []
        return trainer.get_batch_samples(iter(batches), 3, *extra)

    with native():
        trainer = _trainer(tmp_path, tokenizer)
        if not trainer.model_accepts_loss_kwargs:
            pytest.skip("the model does not take loss kwargs here: nothing is counted")
        with pytest.raises(KeyError, match="labels"):
            call(trainer)
    trainer = _trainer(tmp_path, tokenizer)
    got, count = call(trainer)
    assert [id(b) for b in got] == [id(b) for b in batches]
    assert int(count) == _expected(trainer, batches)


class _PreferenceLikeTrainer:
    """Mixin: a loss over chosen_labels only (an ORPO-style batch) that records num_items_in_batch."""

    seen: list

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.seen.append(num_items_in_batch)
        out = model(input_ids=inputs["chosen_input_ids"])
        logits = out.logits[:, :-1].float()
        labels = inputs["chosen_labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        return (loss, out) if return_outputs else loss


def _preference_dataset(n=8, seed=0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(7, 100, (10,), generator=g)
        lab = ids.clone()
        lab[:3] = -100
        rows.append({"chosen_input_ids": ids.tolist(), "chosen_labels": lab.tolist(),
                     "rejected_labels": lab.tolist()})
    return Dataset.from_list(rows)


def _collate(rows):
    return {k: torch.tensor([r[k] for r in rows]) for k in rows[0]}


def test_unsloth_style_loop_with_preference_batches(tmp_path, tokenizer):
    """A get_batch_samples installed after liger_compat (as unsloth does) that reads batch["labels"]:
    natively KeyError on ORPO-style batches; patched, training runs and the count follows the trainer's
    rule (counted from chosen/rejected labels when the loss takes it)."""
    _needs_counting()
    from transformers import Trainer, TrainingArguments

    from liger_compat.compat import tiny_text as tiny

    class UnslothLike(_PreferenceLikeTrainer, Trainer):
        get_batch_samples = unsloth_style_get_batch_samples

    def build():
        args = make_config(TrainingArguments, tmp_path, remove_unused_columns=False, gradient_accumulation_steps=2,
                           max_steps=2)
        t = UnslothLike(model=tiny.build_model("llama", tokenizer), args=args, train_dataset=_preference_dataset(),
                        data_collator=_collate)
        t.seen = []
        return t

    with native():
        with pytest.raises(KeyError, match="labels"):
            build().train()
    trainer = build()
    trainer.train()
    assert len(trainer.seen) == 4  # 2 steps x 2 micro-batches
    ds = _preference_dataset()
    shift = bool(getattr(trainer, "_loss_shifts_labels", False))
    if trainer.model_accepts_loss_kwargs and not _count_withheld():
        per_row = sum(1 for x in ds[0]["chosen_labels"][int(shift):] if x != -100) * 2  # chosen + rejected
        expected = per_row * 2 * 2  # rows per micro-batch x micro-batches
        assert [int(x) for x in trainer.seen] == [expected] * 4
    else:
        assert trainer.seen == [None] * 4
    # the replacement is left as it was after training
    assert "get_batch_samples" not in vars(trainer)


def test_trainer_that_does_not_take_the_count_keeps_none(tmp_path, tokenizer):
    """trl's preference trainers set model_accepts_loss_kwargs = False: they must keep getting None, which
    keeps the loss divided by the accumulation steps."""
    _needs_counting()
    from transformers import Trainer

    from liger_compat.shims.num_items_in_batch_labels import recount

    trainer = _trainer(tmp_path, tokenizer)
    trainer.model_accepts_loss_kwargs = False
    trainer.compute_loss_func = None
    batch = {"chosen_labels": torch.tensor([[1, 2, -100]])}
    assert recount(trainer, [batch]) is None
    trainer.model_accepts_loss_kwargs = True
    assert int(recount(trainer, [batch])) == (1 if getattr(trainer, "_loss_shifts_labels", False) else 2)


def test_a_compute_loss_that_never_reads_the_count_gets_none(tmp_path, tokenizer):
    """trl 0.12/0.13 ORPO/CPO/DPO take num_items_in_batch and ignore it while model_accepts_loss_kwargs
    stays True; handing them a count made transformers 4.46 log the loss times the accumulation steps."""
    _needs_counting()
    from liger_compat.shims.num_items_in_batch_labels import reads_count, recount

    def ignores(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs).loss

    def reads(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs).loss / num_items_in_batch

    def forwards(self, model, inputs, **kwargs):
        return super_loss(model, inputs, **kwargs)

    def in_closure(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return (lambda: num_items_in_batch)()

    def no_param(self, model, inputs, return_outputs=False):
        return model(**inputs).loss

    super_loss = None
    assert [reads_count(f) for f in (ignores, reads, forwards, in_closure, no_param)] == [False, True, True, True, False]
    from transformers import Trainer

    batch = {"chosen_labels": torch.tensor([[1, 2, -100, 4]])}
    for body in (ignores, reads):
        trainer = _trainer(tmp_path, tokenizer, cls=type("T", (Trainer,), {"compute_loss": body}))
        trainer.model_accepts_loss_kwargs, trainer.compute_loss_func = True, None
        expected = None if body is ignores else (2 if getattr(trainer, "_loss_shifts_labels", False) else 3)
        got = recount(trainer, [batch])
        assert (None if got is None else int(got)) == expected, body.__name__


def test_list_batches_with_a_get_reading_loop(tmp_path, tokenizer):
    """GRPO collates with identity: a batch is a list of rows; `.get` on it raised AttributeError."""
    _needs_counting()

    def reads_get(self, epoch_iterator, num_batches, device=None):
        batches = [next(epoch_iterator) for _ in range(num_batches)]
        return batches, batches[0].get("labels")

    from liger_compat.shims.num_items_in_batch_labels import _get_batch_samples_wrapper
    import wrapt

    trainer = _trainer(tmp_path, tokenizer)
    rows = [[{"prompt": "a"}, {"prompt": "b"}], [{"prompt": "c"}, {"prompt": "d"}]]
    with pytest.raises(AttributeError):
        reads_get(trainer, iter(rows), 2)
    wrapped = wrapt.FunctionWrapper(reads_get, _get_batch_samples_wrapper).__get__(trainer, type(trainer))
    got, count = wrapped(iter(rows), 2)
    assert got == rows and count is None


def test_shim_state():
    import transformers
    from packaging.version import Version
    from transformers import Trainer  # noqa: F401  (imports transformers.trainer)

    st = REGISTRY.get("transformers.num_items_in_batch_labels").status()
    if Version(transformers.__version__).release >= (4, 46):
        assert st["state"] == "applied" and "Trainer.get_batch_samples" in st["reason"], st
    else:
        assert st["state"] == "not needed" and "4.46" in st["reason"], st
