"""F3 with the real GRPOTrainer: its per-token log-prob path gets ``[B, k, V]`` logits (or, on trl's
own fused head, none at all), never the full sequence, and the patched run logs what the native one
logs (loss, reward, KL ...). trl 0.14 passes ``num_logits_to_keep=``, 0.15+ ``logits_to_keep=``; on
transformers < 4.49 the new name is swallowed by ``**kwargs`` natively."""

from __future__ import annotations

import pytest

from liger_compat.compat import tiny_text as tiny

from trainer_helpers import (assert_logs_close, comparable_keys, fresh_model, make_config, native, run_native_and_patched,
                             tokenizer_kwarg, train_logs, trainer_or_skip, trl_head_on)

def words_reward(completions, **kwargs):
    """Depends on the words themselves, not only on their count: completions are all cut at the same
    length, and a reward with zero spread makes every advantage zero, leaving a gradient of pure
    rounding noise that Adam scales up to full steps (natively ~1e-8, patched exactly 0)."""
    return [float(sum(map(ord, str(c))) % 7) for c in completions]


class _KeepRecorder:
    """(requested k, input length, returned logits length) of every forward of ``model``."""

    def __init__(self, model):
        self.calls = []
        self._h = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, out):
        keep = kwargs.get("logits_to_keep", kwargs.get("num_logits_to_keep"))
        ids = args[0] if args else kwargs.get("input_ids")
        logits = out.get("logits") if hasattr(out, "get") else None
        self.calls.append((keep, None if ids is None else ids.shape[1], None if logits is None else logits.shape[1]))

    def close(self):
        self._h.remove()


def _build(tokenizer, tmp_path, base_dir):
    trainer_cls, config_cls = trainer_or_skip("grpo")
    ds = tiny.dataset(tiny.prompt_rows(8))

    def build(model):
        # trl 0.2x+ loads the reference model by name when beta > 0: point the name at a saved copy
        model.config._name_or_path = str(base_dir)
        args = make_config(config_cls, tmp_path, max_prompt_length=16, max_completion_length=6, num_generations=2,
                           per_device_train_batch_size=2, gradient_accumulation_steps=1, beta=0.04,
                           temperature=1.0, remove_unused_columns=False, log_completions=False)
        return trainer_cls(model=model, reward_funcs=words_reward, args=args, train_dataset=ds,
                           **tokenizer_kwarg(trainer_cls, tokenizer))

    return build


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_grpo_logits_to_keep_and_metrics(family, tokenizer, tmp_path):
    base = fresh_model(family, tokenizer)
    base_dir = tmp_path / "base"
    base.save_pretrained(base_dir)
    build = _build(tokenizer, tmp_path / "out", base_dir)

    nat, pat, rec, rec_native = run_native_and_patched(build, base, recorder=_KeepRecorder)

    native_logs, patched_logs = train_logs(nat), train_logs(pat)
    keys = comparable_keys(native_logs)
    assert_logs_close(native_logs, patched_logs, keys, rtol=1e-3, atol=1e-4)
    spread = [log["reward_std"] for log in native_logs if "reward_std" in log]
    assert not spread or max(spread) > 0, spread  # the advantages, and so the gradients, are not all zero

    asked = [c for c in rec.calls if c[0] is not None]
    if trl_head_on(pat.model):
        # trl's own fused head scores the completions: no logits are built at all on that path
        assert all(c[2] is None for c in rec.calls if c[0] is None or c[2] is None) and rec.calls
        return
    assert asked, rec.calls
    for keep, length, got in asked:
        assert got == keep, f"asked for {keep} positions of {length}, got {got}"
    native_asked = [c for c in rec_native.calls if c[0] is not None and c[0] > 1]  # not generate()'s k=1
    import inspect

    from liger_compat.shims._patching import unwrap

    with native():
        params = inspect.signature(unwrap(type(nat.model).forward)).parameters
    import trl

    from liger_compat.compat.versions import matches

    grpo_new_name = matches(trl.__version__, ">=0.15")  # trl 0.14 GRPO still sends num_logits_to_keep
    if "logits_to_keep" not in params and "num_logits_to_keep" in params and native_asked and grpo_new_name:
        # the upstream situation (F3): natively the full sequence came back for logits_to_keep=
        assert any(got == length != keep for keep, length, got in native_asked), native_asked
