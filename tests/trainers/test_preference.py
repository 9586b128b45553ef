"""F2 (and F5 label keys): the real DPO / ORPO / CPO / KTO trainers on the fused model log the losses,
rewards and log-probs a native run with the same weights and batches logs.

DPO calls the model without labels (``concatenated_forward``) and needs real logits (F2); ORPO / CPO
batches carry ``chosen_labels`` / ``rejected_labels`` instead of ``labels`` (F5). Trainers the installed
trl does not have are skipped with the reason; ORPO / CPO / KTO are taken from wherever trl keeps them.
"""

from __future__ import annotations

import pytest

from liger_compat.compat import tiny_text as tiny

from trainer_helpers import (assert_logs_close, comparable_keys, config_fields, fresh_model, make_config, native, run_native_and_patched,
                             tokenizer_kwarg, train_logs, trainer_or_skip)

def _rows(name):
    return tiny.unpaired_rows(8) if name == "kto" else tiny.preference_rows(8)


def _builder(name, tokenizer, tmp_path, **cfg):
    trainer_cls, config_cls = trainer_or_skip(name)
    fields = config_fields(config_cls)
    for key in cfg:
        if key not in fields:
            pytest.skip(f"{config_cls.__name__} of the installed trl has no {key}")
    ds = tiny.dataset(_rows(name))
    ref_base = {}

    def build(model):
        args = make_config(config_cls, tmp_path, max_length=32, max_prompt_length=16, max_completion_length=16,
                           beta=0.1, gradient_accumulation_steps=2, remove_unused_columns=False,
                           desirable_weight=1.0, undesirable_weight=1.0, **cfg)
        kwargs = tokenizer_kwarg(trainer_cls, tokenizer)
        if name in ("dpo", "kto"):
            # a frozen copy of the starting weights; trl 1.x would load one by name otherwise
            kwargs["ref_model"] = ref_base["model"]
        return trainer_cls(model=model, args=args, train_dataset=ds, **kwargs)

    return build, ref_base


def _run(name, family, tokenizer, tmp_path, **cfg):
    build, ref_base = _builder(name, tokenizer, tmp_path, **cfg)
    base = fresh_model(family, tokenizer)
    from trainer_helpers import clone

    ref_base["model"] = clone(base)
    nat, pat, counter, _ = run_native_and_patched(build, base)
    native_logs, patched_logs = train_logs(nat), train_logs(pat)
    assert_logs_close(native_logs, patched_logs, comparable_keys(native_logs))
    return nat, pat, counter


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_dpo(family, tokenizer, tmp_path):
    _run("dpo", family, tokenizer, tmp_path)


def _logits_to_keep_option():
    _, config_cls = trainer_or_skip("dpo")
    fields = config_fields(config_cls)
    for name in ("use_logits_to_keep", "use_num_logits_to_keep"):
        if name in fields:
            return name
    pytest.skip(f"{config_cls.__name__} of the installed trl has no use_logits_to_keep / use_num_logits_to_keep")


def test_dpo_logits_to_keep(tokenizer, tmp_path):
    """DPO asks for the completion logits only; natively on transformers < 4.49 the new name is swallowed
    and trl's slicing breaks (F3 inside DPO). Patched it must equal the native run, with the option
    when the native model can run it, without it otherwise (the kept logits are the same numbers)."""
    option = _logits_to_keep_option()
    build, ref_base = _builder("dpo", tokenizer, tmp_path, **{option: True})
    plain_build, plain_ref = _builder("dpo", tokenizer, tmp_path)
    base = fresh_model("qwen2", tokenizer)
    from trainer_helpers import clone

    ref_base["model"] = plain_ref["model"] = clone(base)
    import warnings

    from liger_compat.shims._forward_args import NEW, OLD, forward_params

    with native():
        # natively the option works only where the model's forward names the keyword trl passes
        # (before transformers 4.49 logits_to_keep is swallowed and trl's slicing breaks): there the
        # native run asks too, elsewhere it runs without the option (the kept logits are the same numbers)
        kwarg = {"use_logits_to_keep": NEW, "use_num_logits_to_keep": OLD}[option]
        params = forward_params(type(base).forward)
        nat = (build if params.keep == kwarg or params.both else plain_build)(clone(base))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            nat.train()
    import liger_compat

    model = clone(base)
    liger_compat.apply(model)
    pat = build(model)
    seen = []

    def hook(module, args, kwargs, out):
        keep = kwargs.get("logits_to_keep", kwargs.get("num_logits_to_keep"))
        ids = args[0] if args else kwargs.get("input_ids")
        seen.append((keep, tuple(ids.shape), None if out.get("logits") is None else tuple(out["logits"].shape)))

    h = pat.model.register_forward_hook(hook, with_kwargs=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pat.train()
    finally:
        h.remove()
    assert_logs_close(train_logs(nat), train_logs(pat), ["loss", "rewards/chosen", "rewards/rejected"])
    asked = [x for x in seen if x[0] is not None]
    assert asked, seen
    # [B, k, V] for every call that asked for k positions, never the full [B, T, V]
    assert all(out is None or out[1] == keep for keep, _, out in asked), asked
    assert any(keep < ids[1] for keep, ids, _ in asked), asked


def test_dpo_padding_free(tokenizer, tmp_path):
    _run("dpo", "llama", tokenizer, tmp_path, padding_free=True)


@pytest.mark.parametrize("family", tiny.FAMILIES)
@pytest.mark.parametrize("name", ["orpo", "cpo"])
def test_orpo_cpo(name, family, tokenizer, tmp_path):
    _run(name, family, tokenizer, tmp_path)


def test_kto(tokenizer, tmp_path):
    _run("kto", "llama", tokenizer, tmp_path)
