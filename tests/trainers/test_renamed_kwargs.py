"""F5: renamed trainer / config keyword arguments are translated both ways with one warning.

Two layers of tests:

* every rename, in both directions, on stand-in classes that accept only one of the spellings (so
  both directions run on any installed version);
* every rename on the real transformers / trl class, in the direction the installed version needs;
  a class that takes both spellings (the library's own deprecation path) or neither is skipped with
  the reason. The other direction runs in the old-version environments of the grid.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest

import liger_compat
from liger_compat.shims import REGISTRY
from liger_compat.shims._patching import PatchSet
from liger_compat.shims.renamed_kwargs import RENAMES, Rename, RenamedKwargWarning, _init_wrapper, accepted_params

from trainer_helpers import OMIT, make_config, native, trainer_or_skip

#: a value for each spelling, and how it reads back on the object
VALUES: dict[str, Any] = {
    "tokenizer": "TOKENIZER", "processing_class": "TOKENIZER",
    "evaluation_strategy": "steps", "eval_strategy": "steps",
    "no_cuda": True, "use_cpu": True,
    "per_gpu_train_batch_size": 3, "per_device_train_batch_size": 3,
    "per_gpu_eval_batch_size": 5, "per_device_eval_batch_size": 5,
    "push_to_hub_token": "hf_x", "hub_token": "hf_x",
    "include_inputs_for_metrics": True, "include_for_metrics": ["inputs"],
    "group_by_length": True, "train_sampling_strategy": "group_by_length",
    "gradient_checkpointing": True, "activation_checkpointing": True,
    "gradient_checkpointing_kwargs": {"use_reentrant": False}, "activation_checkpointing_kwargs": {"use_reentrant": False},
    "max_seq_length": 17, "max_length": 17,
    "use_liger": True, "use_liger_kernel": True,
    "max_target_length": 7, "max_completion_length": 7,
    "use_num_logits_to_keep": True, "use_logits_to_keep": True,
    "wandb_log_unique_prompts": True, "log_unique_prompts": True,
    "vllm_guided_decoding_regex": "a+", "vllm_structured_outputs_regex": "a+",
    "vllm_max_model_len": 64, "vllm_max_model_length": 64,
}


def _ids(r: Rename) -> str:
    return f"{r.old}-{r.new}"


# ---------------------------------------------------------------------------------------------
# stand-in classes: both directions everywhere
# ---------------------------------------------------------------------------------------------

def _stand_in(scope: str, field_name: str) -> type:
    """A class named like the rename's scope whose __init__ takes only ``field_name``."""
    if scope == "Trainer":
        ns: dict[str, Any] = {}
        exec(f"def __init__(self, model=None, {field_name}=None):\n    self.{field_name} = {field_name}", ns)
        return type("Trainer", (), {"__init__": ns["__init__"]})
    return dataclasses.make_dataclass(scope, [("output_dir", Any, None), (field_name, Any, None)])


@pytest.fixture
def patches():
    ps = PatchSet()
    yield ps
    assert not ps.revert()


@pytest.mark.parametrize("direction", ["old->new", "new->old"])
@pytest.mark.parametrize("rename", RENAMES, ids=_ids)
def test_stand_in_translates(rename: Rename, direction: str, patches: PatchSet):
    src, dst = (rename.old, rename.new) if direction == "old->new" else (rename.new, rename.old)
    cls = _stand_in(rename.scope[0], dst)
    patches.wrap(cls, "__init__", _init_wrapper)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        obj = cls(**{src: VALUES[src]})
    ours = [w for w in caught if issubclass(w.category, RenamedKwargWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert src in str(ours[0].message) and dst in str(ours[0].message)
    assert getattr(obj, dst) == VALUES[dst]
    # the spelling the class takes passes untouched, without a warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        obj = cls(**{dst: VALUES[dst]})
    assert not [w for w in caught if issubclass(w.category, RenamedKwargWarning)]
    # both spellings at once is an error naming both
    with pytest.raises(TypeError, match=f"{src}.*{dst}|{dst}.*{src}"):
        cls(**{src: VALUES[src], dst: VALUES[dst]})


def test_stand_in_out_of_scope_is_left_alone(patches: PatchSet):
    cls = dataclasses.make_dataclass("DPOConfig", [("max_length", Any, None)])
    patches.wrap(cls, "__init__", _init_wrapper)
    with pytest.raises(TypeError, match="max_seq_length"):
        cls(max_seq_length=3)  # max_seq_length -> max_length is an SFTConfig rename only


def test_stand_in_unconvertible_value_is_an_error(patches: PatchSet):
    cls = dataclasses.make_dataclass("TrainingArguments", [("group_by_length", Any, None)])
    patches.wrap(cls, "__init__", _init_wrapper)
    with pytest.raises(ValueError, match="sequential"):
        cls(train_sampling_strategy="sequential")


@pytest.mark.parametrize("direction", ["old->new", "new->old"])
def test_stand_in_warmup(direction: str, patches: PatchSet):
    if direction == "old->new":  # transformers 5.23: warmup_ratio gone, warmup_steps a float
        cls = dataclasses.make_dataclass("TrainingArguments", [("warmup_steps", float, 0)])
        kwargs, expect = {"warmup_ratio": 0.1}, ("warmup_steps", 0.1)
    else:  # transformers 4.x: an int warmup_steps next to warmup_ratio
        cls = dataclasses.make_dataclass("TrainingArguments", [("warmup_steps", int, 0), ("warmup_ratio", float, 0.0)])
        kwargs, expect = {"warmup_steps": 0.1}, ("warmup_ratio", 0.1)
    patches.wrap(cls, "__init__", _init_wrapper)
    with pytest.warns(RenamedKwargWarning):
        obj = cls(**kwargs)
    assert getattr(obj, expect[0]) == expect[1]


def test_nested_translation_warns_once(patches: PatchSet):
    """An old trainer passing tokenizer= on to a Trainer that only takes processing_class= (trl 0.11 on
    transformers 5): the user's own translation warns, the library's internal one does not."""
    base = _stand_in("Trainer", "processing_class")

    class SFTTrainer(base):
        def __init__(self, model=None, tokenizer=None):
            super().__init__(model=model, tokenizer=tokenizer)

    patches.wrap(base, "__init__", _init_wrapper)
    patches.wrap(SFTTrainer, "__init__", _init_wrapper)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        obj = SFTTrainer(processing_class="TOK")
    assert obj.processing_class == "TOK"
    assert len([w for w in caught if issubclass(w.category, RenamedKwargWarning)]) == 1


# ---------------------------------------------------------------------------------------------
# the real classes of the installed libraries
# ---------------------------------------------------------------------------------------------

def _real_config(scope: str) -> type:
    if scope == "TrainingArguments":
        from transformers import TrainingArguments

        return TrainingArguments
    name = {"SFTConfig": "sft", "DPOConfig": "dpo", "GRPOConfig": "grpo"}[scope]
    return trainer_or_skip(name)[1]


def _direction(cls: type, rename: Rename) -> tuple[str, str]:
    with native():
        params = accepted_params(cls.__init__)
    assert params is not None
    has_old, has_new = rename.old in params, rename.new in params
    if has_old and has_new:
        pytest.skip(f"{cls.__name__} of the installed version takes both {rename.old}= and {rename.new}= "
                    "(its own deprecation path applies)")
    if not has_old and not has_new:
        pytest.skip(f"{cls.__name__} of the installed version takes neither {rename.old}= nor {rename.new}=")
    return (rename.old, rename.new) if has_new else (rename.new, rename.old)


CONFIG_RENAMES = [r for r in RENAMES if r.scope[0] != "Trainer"]


@pytest.mark.parametrize("rename", CONFIG_RENAMES, ids=_ids)
def test_real_config(rename: Rename, tmp_path):
    cls = _real_config(rename.scope[0])
    src, dst = _direction(cls, rename)
    extra = {"eval_steps": 5} if "eval_strategy" in (src, dst) or "evaluation_strategy" in (src, dst) else {}
    # the native class refuses the spelling it does not have
    with native(), pytest.raises(TypeError, match=src):
        make_config(cls, tmp_path, raw={src: VALUES[src]}, **{dst: OMIT}, **extra)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        obj = make_config(cls, tmp_path, raw={src: VALUES[src]}, **{dst: OMIT}, **extra)
    ours = [w for w in caught if issubclass(w.category, RenamedKwargWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    got = getattr(obj, dst)
    assert got == VALUES[dst] or str(got) == str(VALUES[dst]) or getattr(got, "value", None) == VALUES[dst], got


@pytest.mark.parametrize("direction", ["old->new", "new->old"])
def test_real_warmup(direction: str, tmp_path):
    from transformers import TrainingArguments

    with native():
        params = accepted_params(TrainingArguments.__init__)
    int_steps = next(f for f in dataclasses.fields(TrainingArguments) if f.name == "warmup_steps").type in (int, "int")
    if direction == "old->new":
        if "warmup_ratio" in params:
            pytest.skip("the installed TrainingArguments still takes warmup_ratio=")
        with pytest.warns(RenamedKwargWarning):
            args = make_config(TrainingArguments, tmp_path, raw={"warmup_ratio": 0.25}, warmup_steps=OMIT)
        assert args.warmup_steps == 0.25
    else:
        if not int_steps:
            pytest.skip("the installed TrainingArguments takes a float warmup_steps ratio")
        with pytest.warns(RenamedKwargWarning):
            args = TrainingArguments(output_dir=str(tmp_path), warmup_steps=0.25, report_to="none")
        assert args.warmup_ratio == 0.25 and args.warmup_steps == 0


# trainers: tokenizer <-> processing_class on the real classes

def _build_trainer(name: str, tok, tmp_path, **kwargs):
    from liger_compat.compat import tiny_text as tiny

    trainer_cls, config_cls = trainer_or_skip(name)
    model = tiny.build_model("llama", tok)
    rows = {"sft": tiny.sft_rows, "dpo": tiny.preference_rows, "orpo": tiny.preference_rows,
            "cpo": tiny.preference_rows, "kto": tiny.unpaired_rows}[name](4)
    extra = {"max_length": 32, "max_prompt_length": 16}
    if name == "sft":
        extra = {"max_seq_length": 32, "max_length": 32, "dataset_text_field": "text"}
    args = make_config(config_cls, tmp_path, **extra)
    if name in ("dpo", "kto"):  # trl 1.x loads the reference model by name when none is given
        kwargs["ref_model"] = tiny.build_model("llama", tok)
    return trainer_cls(model=model, args=args, train_dataset=tiny.dataset(rows), **kwargs)


TOKENIZER_RENAME = next(r for r in RENAMES if r.old == "tokenizer")


def _trainer_direction(cls: type) -> tuple[str, str]:
    return _direction(cls, TOKENIZER_RENAME)


def _native_refuses_or_deprecates(build, src: str) -> None:
    """Natively the old spelling is refused, goes through the library's own deprecation, or (trl
    0.12's ``@deprecate_kwarg`` before its warning version) is mapped onto the new name silently."""
    with native(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            obj = build()
        except TypeError as exc:
            assert src in str(exc)
            return
    if any(src in str(w.message) for w in caught):
        return
    assert getattr(obj, "processing_class", None) is not None, "natively accepted, warned nothing, mapped nothing"


def _assert_one_warning_about(caught, src: str) -> None:
    ours = [w for w in caught if issubclass(w.category, RenamedKwargWarning)]
    about = [w for w in caught if src in str(w.message)]
    assert len(ours) == 1 and len(about) == 1, [f"{w.category.__name__}: {w.message}" for w in about]


def test_real_transformers_trainer(tokenizer, tmp_path):
    from transformers import Trainer, TrainingArguments

    from liger_compat.compat import tiny_text as tiny

    src, dst = _trainer_direction(Trainer)
    args = make_config(TrainingArguments, tmp_path)
    build = lambda: Trainer(model=tiny.build_model("llama", tokenizer), args=args, **{src: tokenizer})  # noqa: E731
    _native_refuses_or_deprecates(build, src)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = build()
    _assert_one_warning_about(caught, src)
    assert getattr(trainer, "processing_class", None) is tokenizer or getattr(trainer, "tokenizer", None) is tokenizer


@pytest.mark.parametrize("name", ["sft", "dpo", "orpo", "kto"])
def test_real_trl_trainer(name: str, tokenizer, tmp_path):
    trainer_cls, _ = trainer_or_skip(name)
    src, dst = _trainer_direction(trainer_cls)
    build = lambda: _build_trainer(name, tokenizer, tmp_path, **{src: tokenizer})  # noqa: E731
    _native_refuses_or_deprecates(build, src)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = build()
    _assert_one_warning_about(caught, src)
    assert getattr(trainer, "processing_class", None) is tokenizer or getattr(trainer, "tokenizer", None) is tokenizer


def test_real_sft_trainer_options_moved_to_config(tokenizer, tmp_path):
    """trl 0.13 took max_seq_length= / packing= off SFTTrainer; they land on the config now."""
    trainer_cls, config_cls = trainer_or_skip("sft")
    with native():
        params = accepted_params(trainer_cls.__init__)
    if "dataset_text_field" in params:
        pytest.skip(f"{trainer_cls.__name__} of the installed trl still takes dataset_text_field=")
    from liger_compat.compat import tiny_text as tiny

    args = make_config(config_cls, tmp_path)
    tok_kw = {"processing_class": tokenizer} if "processing_class" in params else {"tokenizer": tokenizer}
    with native(), pytest.raises(TypeError, match="dataset_text_field"):
        trainer_cls(model=tiny.build_model("llama", tokenizer), args=args, train_dataset=tiny.dataset(tiny.sft_rows(4)),
                    dataset_text_field="text", **tok_kw)
    args = make_config(config_cls, tmp_path)
    with pytest.warns(RenamedKwargWarning, match="dataset_text_field"):
        trainer_cls(model=tiny.build_model("llama", tokenizer), args=args, train_dataset=tiny.dataset(tiny.sft_rows(4)),
                    dataset_text_field="text", **tok_kw)
    assert args.dataset_text_field == "text"


def test_check_lists_the_rename_shims():
    rep = liger_compat.check().to_dict()
    states = {s["id"]: s for s in rep["shims"]}
    for sid in ("transformers.renamed_kwargs", "trl.renamed_kwargs"):
        assert states[sid]["state"] in ("applied", "waiting"), states[sid]
    assert "TrainingArguments.__init__" in states["transformers.renamed_kwargs"]["reason"]
