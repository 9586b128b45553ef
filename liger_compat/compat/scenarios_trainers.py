"""The ``check --deep`` scenarios of the trainer shims: F1 and F5 with the real trainers.

F1 runs one ``SFTTrainer`` step on a tiny Llama and compares the logged token accuracy with the one
computed from real logits; F5 passes the renamed ``TrainingArguments`` / ``Trainer`` kwargs the
installed transformers lacks and counts label tokens of micro-batches without ``"labels"``.
"""

from __future__ import annotations

from .scenarios import Context, Skip, scenario


@scenario("F1", "SFTTrainer logs mean_token_accuracy from the fused forward", issue="F1", requires=("trl",))
def _scenario_f1(ctx: Context) -> str:
    """One SFT step (learning rate 0) on a tiny Llama; the logged accuracy must equal the one computed
    from real logits of the same weights and batch."""
    import dataclasses
    import tempfile
    import warnings

    import torch

    import liger_compat

    from ..shims._patching import signature
    from ..shims.trl_sft_token_accuracy import read_style
    from . import tiny_text as tiny
    from .trl_trainer_locations import find_trainer

    trainer_cls, config_cls = find_trainer("sft")
    style = read_style(trainer_cls.compute_loss)
    if isinstance(style, str):
        import trl

        raise Skip(f"trl {trl.__version__}: {style}")
    tok = tiny.build_tokenizer()
    model = tiny.build_model("llama", tok, seed=ctx.seed)
    liger_compat.apply(model)
    fields = {f.name for f in dataclasses.fields(config_cls)}
    with tempfile.TemporaryDirectory() as out:
        want = dict(output_dir=out, max_steps=1, per_device_train_batch_size=4, learning_rate=0.0, logging_steps=1,
                    report_to="none", save_strategy="no", use_cpu=ctx.device == "cpu", bf16=False, fp16=False,
                    max_seq_length=32, max_length=32, dataset_text_field="text", packing=False, loss_type="nll",
                    disable_tqdm=True, dataset_num_proc=None)
        args = config_cls(**{k: v for k, v in want.items() if k in fields})
        tok_kw = ("processing_class" if "processing_class" in signature(trainer_cls.__init__).parameters
                  else "tokenizer")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = trainer_cls(model=model, args=args, train_dataset=tiny.dataset(tiny.sft_rows(4, seed=ctx.seed)),
                                  **{tok_kw: tok})
            from transformers.trainer_callback import PrinterCallback, ProgressCallback

            for cb in (PrinterCallback, ProgressCallback):
                trainer.remove_callback(cb)
            batch = next(iter(trainer.get_train_dataloader()))
            trainer.train()
    logged = [h for h in trainer.state.log_history if "mean_token_accuracy" in h]
    if not logged:
        raise AssertionError("SFTTrainer logged no mean_token_accuracy")
    got = float(logged[0]["mean_token_accuracy"])
    with torch.no_grad():
        m = trainer.model
        logits = m(input_ids=batch["input_ids"].to(m.device), attention_mask=batch["attention_mask"].to(m.device)).logits
        labels = batch["labels"][:, 1:].to(logits.device)
        mask = labels != -100
        want_acc = ((logits[:, :-1].argmax(-1) == labels) & mask).sum().item() / max(1, mask.sum().item())
    if abs(got - want_acc) > 1e-6:
        raise AssertionError(f"logged mean_token_accuracy {got} != {want_acc} from the logits")
    return f"mean_token_accuracy {got:.4f} (from logits: {want_acc:.4f}); switch {style.switch}"


@scenario("F5", "renamed trainer kwargs and label counting without 'labels'", issue="F5", requires=("transformers",))
def _scenario_f5(ctx: Context) -> str:
    """The renamed TrainingArguments / Trainer kwargs the installed transformers lacks are translated,
    and get_batch_samples survives micro-batches without "labels"."""
    import tempfile
    import warnings

    import torch
    from transformers import Trainer, TrainingArguments

    from ..shims._patching import signature
    from ..shims.renamed_kwargs import RENAMES, RenamedKwargWarning, accepted_params
    from . import tiny_text as tiny

    done = []
    params = accepted_params(TrainingArguments.__init__) or frozenset()
    values = {"eval_strategy": "no", "evaluation_strategy": "no", "use_cpu": True, "no_cuda": True}
    tok = tiny.build_tokenizer()
    with tempfile.TemporaryDirectory() as out:
        for r in RENAMES:
            if r.scope != ("TrainingArguments",) or r.old not in values:
                continue
            src = r.old if r.new in params and r.old not in params else r.new if r.old in params and r.new not in params else None
            if src is None:
                continue
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                TrainingArguments(output_dir=out, report_to="none", **{src: values[src]})
            if not any(issubclass(w.category, RenamedKwargWarning) for w in caught):
                raise AssertionError(f"TrainingArguments({src}=...) was not translated")
            done.append(src)
        args = TrainingArguments(output_dir=out, report_to="none", use_cpu=ctx.device == "cpu")
        tparams = accepted_params(Trainer.__init__) or frozenset()
        src = "tokenizer" if "processing_class" in tparams and "tokenizer" not in tparams else "processing_class"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = Trainer(model=tiny.build_model("llama", tok, seed=ctx.seed), args=args, **{src: tok})
        done.append(f"Trainer({src}=)")
        if "get_batch_samples" in vars(Trainer) or hasattr(Trainer, "get_batch_samples"):
            g = torch.Generator().manual_seed(ctx.seed)
            lab = torch.randint(3, 100, (2, 8), generator=g)
            lab[:, :2] = -100
            batches = [{"input_ids": lab.clamp(min=0), "labels": lab}, {"chosen_labels": lab}]
            extra = ["cpu"] if "device" in signature(trainer.get_batch_samples).parameters else []
            got, count = trainer.get_batch_samples(iter(batches), 2, *extra)
            if len(got) != 2:
                raise AssertionError(f"get_batch_samples returned {len(got)} batches")
            done.append(f"mixed micro-batches counted: {None if count is None else int(count)}")
        else:
            done.append("no get_batch_samples (transformers < 4.46)")
    if not done:
        raise Skip("nothing renamed between this transformers and the grid")
    return "; ".join(done)
