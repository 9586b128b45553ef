"""trl 1.15+ ``add_fused_lm_head`` heads scored by liger_compat's fused log-prob kernel: the real SFT,
DPO, GRPO and KTO trainers log what the native run (trl's own ``ChunkedLogProbFunction``) logs on the
same weights and batches, trl's chunked function is not called on our path, ours is, and ``check()``
names the head per trainer."""

from __future__ import annotations

from unittest import mock

import pytest

import liger_compat
from liger_compat.compat import tiny_text as tiny
from liger_compat.shims import trl_fused_lm_head as head

from trainer_helpers import (assert_logs_close, clone, comparable_keys, fresh_model, make_config,
                             run_native_and_patched, tokenizer_kwarg, train_logs, trainer_or_skip, trl_head_on)


def _trl_chunked_function():
    try:
        import trl.trainer.utils as tu
        from trl.kernels import ChunkedLogProbFunction
    except ImportError:
        pytest.skip("the installed trl has no ChunkedLogProbFunction (trl < 1.15)")
    if not hasattr(tu, "add_fused_lm_head"):
        pytest.skip("the installed trl has no add_fused_lm_head (trl < 1.15)")
    return ChunkedLogProbFunction


class _HeadSpy:
    """Per run: calls of trl's chunked function (through the mock ``spy``) and of ours."""

    spy = None

    def __init__(self, model):
        self.trl0 = self.spy.call_count
        self.ours0 = head.calls["ours"]
        self.trl = self.ours = None

    def close(self):
        self.trl = self.spy.call_count - self.trl0
        self.ours = head.calls["ours"] - self.ours0


def _compare(build, base, rtol=2e-4, atol=2e-5, keys=None):
    fn = _trl_chunked_function()
    with mock.patch.object(fn, "apply", wraps=fn.apply) as spy:
        _HeadSpy.spy = spy
        nat, pat, spy_pat, spy_nat = run_native_and_patched(build, base, recorder=_HeadSpy)
    native_logs, patched_logs = train_logs(nat), train_logs(pat)
    assert_logs_close(native_logs, patched_logs, keys or comparable_keys(native_logs), rtol=rtol, atol=atol)
    assert trl_head_on(pat.model)
    # the native run went through trl's chunked function (so the spy can see it) ...
    assert spy_nat.trl > 0 and spy_nat.ours == 0, (spy_nat.trl, spy_nat.ours)
    # ... the patched run through ours only
    assert spy_pat.trl == 0 and spy_pat.ours > 0, (spy_pat.trl, spy_pat.ours)
    return nat, pat


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_sft_on_our_head(family, tokenizer, tmp_path):
    trainer_cls, config_cls = trainer_or_skip("sft")
    ds = tiny.dataset(tiny.sft_rows(8))

    def build(model):
        args = make_config(config_cls, tmp_path, max_length=32, dataset_text_field="text", packing=False,
                           gradient_accumulation_steps=2)
        return trainer_cls(model=model, args=args, train_dataset=ds, **tokenizer_kwarg(trainer_cls, tokenizer))

    nat, pat = _compare(build, fresh_model(family, tokenizer))
    logs = train_logs(pat)
    assert all(k in logs[0] for k in ("loss", "entropy", "mean_token_accuracy")), logs[0]
    reason = next(s for s in liger_compat.check().shims if s["id"] == head.SHIM_ID)["reason"]
    assert "sft" in reason and type(pat.model).__name__ in reason, reason


def test_sft_dft_loss_recomputes_and_matches(tokenizer, tmp_path):
    """DFT weights each token's loss by its probability: not the uniform upstream SFT's head is set up
    for, so the kernel must notice it at backward time and still match the native run."""
    trainer_cls, config_cls = trainer_or_skip("sft")
    ds = tiny.dataset(tiny.sft_rows(8))

    def build(model):
        args = make_config(config_cls, tmp_path, max_length=32, dataset_text_field="text", packing=False,
                           loss_type="dft")
        return trainer_cls(model=model, args=args, train_dataset=ds, **tokenizer_kwarg(trainer_cls, tokenizer))

    _compare(build, fresh_model("qwen2", tokenizer))


@pytest.mark.parametrize("name", ["dpo", "kto"])
def test_preference_on_our_head(name, tokenizer, tmp_path):
    from test_preference import _builder

    build, ref_base = _builder(name, tokenizer, tmp_path)
    base = fresh_model("llama", tokenizer)
    ref_base["model"] = clone(base)
    nat, _ = _compare(build, base)
    keys = comparable_keys(train_logs(nat))
    assert any("logps" in k for k in keys) and any("rewards" in k for k in keys), keys


def test_grpo_on_our_head(tokenizer, tmp_path):
    from test_grpo import _build

    base = fresh_model("qwen2", tokenizer)
    base_dir = tmp_path / "base"
    base.save_pretrained(base_dir)
    _compare(_build(tokenizer, tmp_path / "out", base_dir), base, rtol=1e-3, atol=1e-4)


def test_check_names_the_head_of_each_trainer():
    """check() says per trainer which head computes the loss: ours for the add_fused_lm_head trainers
    while liger_compat is applied, trl's chunked function once it is reverted, native logits for the
    trainers that score from full logits (ORPO / CPO here)."""
    _trl_chunked_function()
    from trainer_helpers import native

    heads = liger_compat.check().heads
    for trainer in ("SFTTrainer", "DPOTrainer", "GRPOTrainer", "KTOTrainer"):
        assert heads[trainer].startswith("liger_compat fused log-probs"), heads
    for trainer in ("ORPOTrainer", "CPOTrainer"):
        if trainer in heads:
            assert heads[trainer].startswith("native logits"), heads
    with native():
        off = liger_compat.check().heads
    assert off["SFTTrainer"].startswith("trl's ChunkedLogProbFunction"), off
    assert "LM heads" in str(liger_compat.check())


# ------------------------------------------------------------------------------------------------
# trl's head contract, call by call: our scoring against trl's own ChunkedLogProbFunction on the
# same model and inputs (trl's _fused_forward around both)
# ------------------------------------------------------------------------------------------------


def _head_pair(family, *, cast=False, temperature=1.0, config=None, outputs=head.ChunkedLogProbs.OPTIONAL_OUTPUTS):
    import torch
    import trl.trainer.utils as tu

    from liger_compat.compat import tiny_models

    fn = _trl_chunked_function()
    model = tiny_models.build(family, seed=3, vocab_size=96, **(config or {})).train()
    tu.add_fused_lm_head(model, temperature=temperature, cast_lm_head_to_fp32=cast,
                         outputs=("log_probs",) + tuple(outputs))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 96, (2, 11), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    labels[1, 7:] = -100

    def run(scoring, **kw):
        model.zero_grad(set_to_none=True)
        with mock.patch.object(tu, "_ChunkedLogProbFunction", scoring):
            out = model(input_ids=ids, fused_lm_head=True, **kw)
        w = torch.randn(out.log_probs.shape, generator=torch.Generator().manual_seed(9))
        total = out.loss + (out.log_probs * w).sum() * 0.1
        if out.entropy is not None:
            total = total + (out.entropy * w.flip(-1)).sum() * 0.05
        total.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out, grads

    return fn, run, labels


def _assert_same(ours, theirs, tol=1e-5):
    import torch

    (o, og), (t, tg) = ours, theirs
    for field in ("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "aux_loss"):
        a, b = getattr(o, field), getattr(t, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert a.shape == b.shape and a.dtype == b.dtype, field
            assert torch.allclose(a, b, rtol=tol, atol=tol), (field, (a - b).abs().max())
    for field in ("is_top1", "label_mask"):
        a, b = getattr(o, field), getattr(t, field)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), field
    assert og.keys() == tg.keys() and og
    for name in og:
        scale = tg[name].abs().max().clamp(min=1e-6)
        assert ((og[name] - tg[name]).abs().max() / scale) < 20 * tol, name


@pytest.mark.parametrize(
    "case",
    ["labels", "shift_labels", "num_items_in_batch", "cast_lm_head_to_fp32", "temperature", "softcap_and_scale",
     "few_outputs", "compact_rows"],
)
def test_head_contract_matches_trl(case, monkeypatch):
    import torch

    kw = {}
    if case == "cast_lm_head_to_fp32":
        kw["cast"] = True
    if case == "temperature":
        kw["temperature"] = 0.7
    if case == "softcap_and_scale":
        kw["config"] = {"final_logit_softcapping": 3.0, "logit_scale": 0.8}
    if case == "few_outputs":
        kw["outputs"] = ("is_top1",)
    fn, run, labels = _head_pair("llama", **kw)
    call = {"labels": labels}
    if case == "shift_labels":
        call = {"shift_labels": torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)}
    if case == "num_items_in_batch":
        call["num_items_in_batch"] = torch.tensor(23)
    if case == "compact_rows":
        # what trl does on Triton devices: only the unmasked rows are scored, then scattered back
        import trl.trainer.utils as tu

        if hasattr(tu, "_use_triton"):  # trl 1.16+; trl 1.15.0 always scores the unmasked rows only
            monkeypatch.setattr(tu, "_use_triton", lambda device: True)
    with mock.patch.object(fn, "apply", wraps=fn.apply) as spy:
        ours = run(head.ChunkedLogProbs, **call)
        assert spy.call_count == 0
        theirs = run(fn, **call)
        assert spy.call_count == 1
    _assert_same(ours, theirs)


def test_head_contract_moe_aux_loss_matches_trl():
    fn, run, labels = _head_pair("mixtral")
    ours = run(head.ChunkedLogProbs, labels=labels)
    theirs = run(fn, labels=labels)
    assert ours[0].aux_loss is not None
    _assert_same(ours, theirs)


def test_head_all_labels_masked_gives_a_differentiable_zero():
    import torch

    fn, run, labels = _head_pair("qwen2")
    labels[:] = -100
    ours = run(head.ChunkedLogProbs, labels=labels)
    theirs = run(fn, labels=labels)
    assert float(ours[0].loss.detach()) == 0.0 and torch.all(ours[0].log_probs == 0)
    _assert_same(ours, theirs)


@pytest.mark.parametrize("mode", ["uniform", "sum"])
def test_sft_uniform_mode_uses_the_forward_gradient_on_compact_rows(mode, monkeypatch):
    """SFT's loss (sum of log-probs over a count) on compacted rows: the head formed the gradient in its
    forward and the backward reuses it (one kernel pass), with trl's gradients; ``"sum"`` without
    comparing the upstream on the host."""
    import torch
    import trl.trainer.utils as tu

    import liger_compat.kernels.logprob as lpmod
    from liger_compat.compat import tiny_models

    fn = _trl_chunked_function()
    if hasattr(tu, "_use_triton"):  # trl 1.16+; trl 1.15.0 always scores the unmasked rows only
        monkeypatch.setattr(tu, "_use_triton", lambda device: True)
    model = tiny_models.build("qwen2", seed=4, vocab_size=96).train()
    tu.add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    ids = torch.randint(0, 96, (3, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :3] = -100
    passes = []
    real = lpmod._pass
    monkeypatch.setattr(lpmod, "_pass", lambda *a, **k: passes.append(k["grads"]) or real(*a, **k))

    def grads(scoring):
        model.zero_grad(set_to_none=True)
        token = head._GRAD_MODE.set(mode)
        try:
            with mock.patch.object(tu, "_ChunkedLogProbFunction", scoring):
                out = model(input_ids=ids, labels=labels, fused_lm_head=True, num_items_in_batch=torch.tensor(17))
        finally:
            head._GRAD_MODE.reset(token)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    if mode == "sum":
        real_common = lpmod._common_value

        def no_compare(*a, compare_on_host, **k):
            assert not compare_on_host, "compared the upstream on the host"
            return real_common(*a, compare_on_host=compare_on_host, **k)

        monkeypatch.setattr(lpmod, "_common_value", no_compare)
    loss, ours = grads(head.ChunkedLogProbs)
    assert len(passes) == 1 and any(passes[0]), passes
    loss_trl, theirs = grads(fn)
    assert torch.allclose(loss, loss_trl, rtol=1e-5, atol=1e-6)
    for name in theirs:
        scale = theirs[name].abs().max().clamp(min=1e-6)
        assert ((ours[name] - theirs[name]).abs().max() / scale) < 2e-4, name


@pytest.mark.parametrize("case", ["nll", "rows_not_compacted", "dft", "subclass"])
def test_sft_trainer_picks_the_sum_mode_for_its_own_nll_only(case, tokenizer, tmp_path, monkeypatch):
    """The real SFTTrainer: its own NLL over the compacted rows scores with ``grad_mode="sum"`` (no
    host read in our code during the step); every other case keeps the checking ``"uniform"``: trl
    scoring every row (masked ones as class 0, zero upstream), DFT's per-token weights, a subclass's
    own compute_loss."""
    import torch
    import trl.trainer.utils as tu

    import liger_compat.kernels.logprob as lpmod

    _trl_chunked_function()
    trainer_cls, config_cls = trainer_or_skip("sft")
    if hasattr(tu, "_use_triton"):  # trl 1.16+; trl 1.15.0 always scores the labelled rows only
        monkeypatch.setattr(tu, "_use_triton", lambda device: case != "rows_not_compacted")
    elif case == "rows_not_compacted":
        pytest.skip("trl 1.15.0 always scores the labelled rows only")
    modes, reads = [], []
    real = lpmod.fused_linear_logprobs
    monkeypatch.setattr(lpmod, "fused_linear_logprobs", lambda *a, **k: modes.append(k["grad_mode"]) or real(*a, **k))
    real_common = lpmod._common_value

    def common(*a, compare_on_host, **k):
        if compare_on_host:
            reads.append("compare")
        return real_common(*a, compare_on_host=compare_on_host, **k)

    monkeypatch.setattr(lpmod, "_common_value", common)
    cls = trainer_cls
    if case == "subclass":
        class MySFT(trainer_cls):
            def compute_loss(self, *args, **kwargs):
                return super().compute_loss(*args, **kwargs)
        cls = MySFT
    args = make_config(config_cls, tmp_path, max_length=32, dataset_text_field="text", packing=False, max_steps=2,
                       loss_type="dft" if case == "dft" else "nll")
    trainer = cls(model=fresh_model("llama", tokenizer), args=args, train_dataset=tiny.dataset(tiny.sft_rows(8)),
                  **tokenizer_kwarg(trainer_cls, tokenizer))
    trainer.train()
    losses = [log["loss"] for log in train_logs(trainer) if "loss" in log]
    assert losses and all(torch.isfinite(torch.tensor(losses))), losses
    want = "sum" if case == "nll" else "uniform"
    assert modes and set(modes) == {want}, modes
    assert (reads == []) == (case == "nll"), reads


def test_check_heads_rule_for_older_trl_sources(monkeypatch):
    """The per-trainer head as check() reads it from trl's sources, for the shapes older releases have:
    the trainer calls trl's _ChunkedLogProbFunction itself (trl 1.6 .. 1.14 DPO / GRPO / KTO), SFT's
    chunked_nll patch, a plain SFT loss through the model, and log-probs from full logits."""
    sources = {
        "sft": "def _patch_chunked_ce_lm_head(model, chunk_size): ...",
        "dpo": "logps, entropies = _ChunkedLogProbFunction.apply(hidden, w, b, labels, 1.0, 4096)",
        "grpo": "logps = selective_log_softmax(logits, input_ids)",
        "kto": "outputs = model(**inputs, labels=labels, fused_lm_head=True); add_fused_lm_head(model)",
    }
    monkeypatch.setattr(head, "_trainer_source", lambda name: sources.get(name))
    heads = head.trainer_heads()
    assert heads["SFTTrainer"].startswith("trl's chunked_nll head scored by liger_compat fused log-probs"), heads
    assert heads["DPOTrainer"].startswith("native logits") and "scored by liger_compat" in heads["DPOTrainer"], heads
    assert heads["GRPOTrainer"].startswith("native logits"), heads
    assert heads["KTOTrainer"].startswith("liger_compat fused log-probs"), heads
    assert set(heads) == {"SFTTrainer", "DPOTrainer", "GRPOTrainer", "KTOTrainer"}
    sources["sft"] = "loss = outputs.loss"
    assert head.trainer_heads()["SFTTrainer"].startswith("the model's forward with labels")
    from trainer_helpers import native

    with native():
        off = head.trainer_heads()
    assert off["DPOTrainer"].endswith("is trl's _ChunkedLogProbFunction"), off
    assert off["KTOTrainer"].startswith("trl's ChunkedLogProbFunction"), off


# ------------------------------------------------------------------------------------------------
# trl 1.6 .. 1.14: SFT's chunked_nll loss (and DPO / GRPO / KTO's use_liger_kernel paths) call trl's
# own _ChunkedLogProbFunction (log-probs, entropy) on the hidden states
# ------------------------------------------------------------------------------------------------


def test_legacy_chunked_function_replaced_by_ours():
    """Our stand-in for trl 1.6 .. 1.14's function against trl's own on the same inputs: log-probs,
    entropy and the gradients of a per-token weighted sum; a target outside the vocabulary (scored as
    logit 0 by trl) goes to trl's function."""
    import inspect

    import torch
    import trl.trainer.utils as tu

    fn = getattr(tu, "_ChunkedLogProbFunction", None)
    original = getattr(fn, "trl_function", fn)
    if not hasattr(original, "forward") or "outputs" in inspect.signature(original.forward).parameters:
        pytest.skip("the installed trl has no trl 1.6 .. 1.14 _ChunkedLogProbFunction")
    assert getattr(fn, "_liger_compat", False), "trl.trainer.utils._ChunkedLogProbFunction was not replaced"
    g = torch.Generator().manual_seed(2)
    hid = torch.randn(23, 16, generator=g)
    w = torch.randn(77, 16, generator=g) / 4
    b = torch.randn(77, generator=g)
    t = torch.randint(0, 77, (23,), generator=g)
    up = torch.randn(23, generator=g), torch.randn(23, generator=g)

    def run(f, targets):
        hh, ww = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp, ent = f.apply(hh, ww, b, targets, 0.8, 32, 5.0, 0.9)
        ((lp * up[0]).sum() + (ent * up[1]).sum()).backward()
        return lp.detach(), ent.detach(), hh.grad, ww.grad

    before = head.calls["ours"]
    ours = run(fn, t)
    assert head.calls["ours"] == before + 1
    theirs = run(original, t)
    for a, c in zip(ours, theirs):
        assert torch.allclose(a, c, rtol=1e-4, atol=1e-5), (a - c).abs().max()
    t_bad = t.clone()
    t_bad[3] = -100
    with mock.patch.object(original, "apply", wraps=original.apply) as spy:
        ours = run(fn, t_bad)
    assert spy.call_count == 1 and head.calls["ours"] == before + 1
