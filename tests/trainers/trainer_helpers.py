"""Helpers of the trainer-shim tests: configs that work on every trl / transformers of the grid,
the tiny setup of :mod:`liger_compat.compat.tiny_text`, and a native (unpatched) context."""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from typing import Any

import pytest

import liger_compat
from liger_compat.compat import tiny_text as tiny
from liger_compat.compat.trl_trainer_locations import TrainerUnavailable, find_trainer
from patch_helpers import native  # noqa: F401  (re-exported to the trainer tests)


#: pass as a make_config override to leave a default out
OMIT = object()




def trainer_or_skip(name: str):
    try:
        return find_trainer(name)
    except TrainerUnavailable as exc:
        pytest.skip(str(exc))


def config_fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def make_config(cls: type, tmp_path: Any, raw: dict[str, Any] | None = None, **overrides: Any):
    """``cls(...)`` with CPU-friendly settings, passing only the fields this version has
    (and ``raw`` as given, whether the class has them or not)."""
    fields = config_fields(cls)
    base = dict(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=1,
        learning_rate=5e-2,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        dataset_num_proc=None,
        num_generations=2,
    )
    base.update(overrides)
    kwargs = {k: v for k, v in base.items() if k in fields and v is not OMIT}
    kwargs.update(raw or {})
    return cls(**kwargs)


def train_logs(trainer: Any) -> list[dict[str, float]]:
    """The per-step training logs (without the final summary entry)."""
    return [dict(h) for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]


def assert_logs_close(native_logs, patched_logs, keys, rtol=2e-4, atol=2e-5, later_rtol=1e-3):
    """Step 0 logs at ``rtol`` (same weights: only the kernels' float32 rounding differs); later steps at
    ``later_rtol``: Adam normalises each update by the gradient's running RMS, so an entry whose
    gradient is near zero moves by up to the learning rate on a float32 rounding difference, and the
    runs drift apart by more than the kernels' own error (observed: 2.5e-4 relative in the step-1
    entropy with lr 0.05; a wrong loss or a gradient off by a scale is off by far more)."""
    assert len(native_logs) == len(patched_logs) > 0, (native_logs, patched_logs)
    for step, (a, b) in enumerate(zip(native_logs, patched_logs)):
        tol = rtol if step == 0 else max(rtol, later_rtol)
        for key in keys:
            assert key in a, f"native run did not log {key!r} at step {step}: {sorted(a)}"
            assert key in b, f"patched run did not log {key!r} at step {step}: {sorted(b)}"
            va, vb = float(a[key]), float(b[key])
            assert math.isfinite(vb), (key, step, vb)
            assert math.isclose(va, vb, rel_tol=tol, abs_tol=atol), f"step {step} {key}: native {va} != patched {vb}"


def fresh_model(family: str, tokenizer: Any, seed: int = 0):
    return tiny.build_model(family, tokenizer, seed=seed)


def clone(model):
    return copy.deepcopy(model)


class FusedOutputCounter:
    """Counts forwards of ``model`` that came back fused (``logits`` None, ``token_accuracy`` set)
    and those that came back with real logits."""

    def __init__(self, model: Any) -> None:
        self.fused = 0
        self.with_logits = 0
        self._h = model.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        get = getattr(out, "get", None)
        if get is None:
            return
        if get("logits") is None and get("token_accuracy") is not None:
            self.fused += 1
        elif get("logits") is not None:
            self.with_logits += 1

    def close(self):
        self._h.remove()


def tokenizer_kwarg(trainer_cls: type, tokenizer: Any) -> dict[str, Any]:
    """The spelling the installed trainer takes natively."""
    from liger_compat.shims.renamed_kwargs import accepted_params
    from liger_compat.shims._patching import unwrap

    params = accepted_params(unwrap(trainer_cls.__init__))
    if params is not None and "processing_class" not in params and "tokenizer" in params:
        return {"tokenizer": tokenizer}
    return {"processing_class": tokenizer}


#: how trl < 0.13's trainers fail natively on transformers 4.46+: the loop's
#: get_batch_samples(epoch_iterator, n) lands in trl's (model, batch) one, or compute_loss is
#: called with num_items_in_batch
SIGNATURE_DRIFT = r"'generator' object has no attribute 'generate'|unexpected keyword argument 'num_items_in_batch'"


def _skip_if_signature_drift(trainer: Any, exc: BaseException) -> None:
    """An old trl trainer that cannot train natively on this transformers at all (trl < 0.13 on 4.46+),
    failing with exactly that drift: there is no native run to compare with; test_trainer_signatures
    covers that combination. Any other failure is the caller's to raise."""
    import re

    from liger_compat.shims import REGISTRY

    reason = REGISTRY.get("trl.trainer_signatures").status()["reason"]
    if f"{type(trainer).__name__}." in reason and re.search(SIGNATURE_DRIFT, str(exc)):
        pytest.skip(f"no native run to compare with: {type(trainer).__name__} of this trl cannot train on this "
                    f"transformers natively ({type(exc).__name__}: {exc}); see test_trainer_signatures")


def native_head_interpreted() -> bool:
    """Whether the unpatched trl's fused LM head runs through Triton's CPU interpreter in this pytest
    run (known issue trl-head-on-cpu applies: see ``tests/conftest.py``), which torch.compile cannot trace."""
    import torch

    from liger_compat.compat import known_issues

    return known_issues.by_id("trl-head-on-cpu").applies(cuda=torch.cuda.is_available())


def run_native_and_patched(build, base_model, recorder=None):
    """Train ``build(model)`` twice from the same weights: unpatched, then with liger_compat.

    ``recorder(model)`` (default :class:`FusedOutputCounter`) watches the forwards of each run and
    has ``close()``. Returns ``(native_trainer, patched_trainer, patched_record, native_record)``.
    """
    recorder = recorder or FusedOutputCounter

    def train(trainer):
        rec = recorder(trainer.model)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer.train()
        finally:
            rec.close()
        return rec

    failure = None
    with native():
        nat = build(clone(base_model))
        try:
            nat_rec = train(nat)
        except (TypeError, AttributeError) as exc:
            failure = exc
    if failure is not None:
        _skip_if_signature_drift(nat, failure)  # (liger_compat is back on here: its report is readable)
        raise failure
    model = clone(base_model)
    liger_compat.apply(model)
    pat = build(model)
    return nat, pat, train(pat), nat_rec


def code_file(fn: Any) -> str:
    """The source file of a function or bound method (``functools.wraps`` copies ``__module__``, not
    the code)."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    return code.co_filename if code is not None else ""


def trl_head_on(model: Any) -> bool:
    """Whether trl installed its own LM head (an instance-level forward from trl's code) on ``model``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    fwd = vars(base).get("forward")
    # liger_compat's shim may wrap trl's head forward (to pass the kernel a gradient hint)
    fwd = getattr(fwd, "_liger_compat_wraps", fwd)
    return fwd is not None and "/trl/" in code_file(fwd)


#: logged values that are not computed from the model (timing, counters, schedule)
NOT_COMPARED = {"epoch", "learning_rate", "step", "num_tokens", "total_flos"}


def comparable_keys(logs) -> list[str]:
    return sorted(k for k, v in logs[0].items()
                  if isinstance(v, (int, float)) and k not in NOT_COMPARED
                  and not any(t in k for t in ("time", "runtime", "per_second")))


def unsloth_style_get_batch_samples(self, epoch_iterator, num_batches, device=None, *args, **kwargs):
    """Like unsloth's replacement of ``Trainer.get_batch_samples``: reads ``batch["labels"]`` of every
    batch without looking first (preference batches have none)."""
    batches = []
    for _ in range(num_batches):
        try:
            batches.append(next(epoch_iterator))
        except StopIteration:
            break
    num_items = sum((x["labels"][..., 1:] != -100).sum() for x in batches)
    return batches, num_items
