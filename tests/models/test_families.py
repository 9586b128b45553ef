"""Every family of the table, text and vision-language, against the unpatched model with the same
weights and inputs: fused loss and gradients, the labels-free path, ``logits_to_keep``, revert.

Tiny random models (``liger_compat.compat.tiny_models`` / ``tiny_vlms``), fp32 on CPU; a family the
installed transformers lacks is skipped with the reason. Vision-language models run their own
forward with random pixel inputs (and ``image_grid_thw`` / ``image_sizes`` / ``token_type_ids``
where the model takes them).
"""

from __future__ import annotations

import pytest
import torch

import liger_compat
from liger_compat import kernels
from liger_compat.shims import causal_lm
from liger_compat.compat.families import BY_NAME, FAMILIES
from liger_compat.shims._family_states import family_states
from liger_compat.shims._patching import is_ours
from model_helpers import family_model_and_batch, grads, manual_accuracy, native

ALL = [f.name for f in FAMILIES]
FUSED = [f.name for f in FAMILIES if not f.why_native()]
NATIVE = [f.name for f in FAMILIES if f.why_native()]
VISION = [f.name for f in FAMILIES if f.vision and not f.why_native()]

#: fp32 on both sides: the loss is a sum of a few hundred terms, the gradients pass a few matmuls
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-5)


def _model_and_batch(family: str, seed: int):
    model, kw, labels, _ = family_model_and_batch(family, seed)
    return model, kw, labels


def _step(model, kw, labels, **extra):
    model.zero_grad(set_to_none=True)
    out = model(**kw, labels=labels, **extra)
    out.loss.backward()
    return out, grads(model)


@pytest.mark.parametrize("family", FUSED)
def test_fused_loss_and_gradients_equal_native(family):
    model, kw, labels = _model_and_batch(family, seed=31)
    assert is_ours(vars(type(model))["forward"], causal_lm._fused_forward)
    kernels.last_backend.clear()
    out, g = _step(model, kw, labels)
    assert "fused_linear_cross_entropy" in kernels.last_backend  # the loss came from our kernel
    assert out.logits is None
    with native():
        ref, g_ref = _step(model, kw, labels)
    assert ref.logits is not None
    assert type(out).__name__ == type(ref).__name__
    torch.testing.assert_close(out.loss, ref.loss, **LOSS_TOL)
    if getattr(ref, "aux_loss", None) is not None:  # the router loss, added to the loss as native adds it
        torch.testing.assert_close(out.aux_loss, ref.aux_loss, **LOSS_TOL)
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], **GRAD_TOL, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(out.token_accuracy, manual_accuracy(ref.logits.detach(), labels))


@pytest.mark.parametrize("family", FUSED)
def test_labels_free_and_eval_give_native_logits_and_honour_logits_to_keep(family):
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("4.52"):
        pytest.skip(f"transformers {transformers.__version__}: the native forwards differ in how they take "
                    "logits_to_keep (tests/models/test_causal_lm.py covers these releases)")
    model, kw, labels = _model_and_batch(family, seed=32)
    with native(), torch.no_grad():
        full = model(**kw).logits
        kept_ref = model(**kw, labels=labels[:, -5:], logits_to_keep=5)
        evaluated = model.eval()(**kw, labels=labels)
    model.train()
    with torch.no_grad():
        out = model(**kw)
        torch.testing.assert_close(out.logits, full, **LOSS_TOL)
        assert getattr(out, "token_accuracy", None) is None
        k = model(**kw, logits_to_keep=5).logits
        assert k.shape == (*labels.shape[:1], 5, full.shape[-1])
        torch.testing.assert_close(k, full[:, -5:], **LOSS_TOL)
        # labels of the kept positions in training: the fused loss over them, as native computes it
        kept = model(**kw, labels=labels[:, -5:], logits_to_keep=5)
        assert kept.logits is None
        torch.testing.assert_close(kept.loss, kept_ref.loss, **LOSS_TOL)
        # evaluation with labels: the native loss and logits
        ev = model.eval()(**kw, labels=labels)
        torch.testing.assert_close(ev.loss, evaluated.loss, **LOSS_TOL)
        torch.testing.assert_close(ev.logits, evaluated.logits, **LOSS_TOL)


@pytest.mark.parametrize("family", FUSED)
def test_revert_restores_the_native_forward_and_apply_brings_it_back(family):
    model, kw, labels = _model_and_batch(family, seed=33)
    cls = type(model)
    try:
        assert not liger_compat.revert()
        assert not is_ours(vars(cls)["forward"], causal_lm._fused_forward)
        with torch.no_grad():
            out = model(**kw, labels=labels)
        assert out.logits is not None and getattr(out, "token_accuracy", None) is None
        assert family_states()[family].startswith("native forward")
    finally:
        liger_compat.apply()
    assert is_ours(vars(cls)["forward"], causal_lm._fused_forward)
    assert family_states()[family].startswith("fused forward")
    with torch.no_grad():
        again = model(**kw, labels=labels)
    assert again.logits is None
    torch.testing.assert_close(again.loss, out.loss, **LOSS_TOL)


@pytest.mark.parametrize("family", VISION)
def test_vision_inputs_reach_the_language_model_through_the_fused_forward(family):
    """The pixels change the fused loss exactly as they change the native one (the image features
    are merged by the model's own forward before the head)."""
    model, kw, labels = _model_and_batch(family, seed=34)
    other = dict(kw, pixel_values=torch.randn_like(kw["pixel_values"]) * 2)
    with torch.no_grad():
        a = model(**kw, labels=labels).loss
        b = model(**other, labels=labels).loss
        with native():
            b_ref = model(**other, labels=labels).loss
    assert not torch.allclose(a, b)
    torch.testing.assert_close(b, b_ref, **LOSS_TOL)


@pytest.mark.parametrize("family", NATIVE)
def test_families_the_generic_forward_cannot_honour_stay_native_and_say_why(family):
    fam = BY_NAME[family]
    from liger_compat.compat.tiny_models import FamilyUnavailable, modeling_module

    try:
        module = modeling_module(fam)
    except FamilyUnavailable as exc:
        pytest.skip(str(exc))
    cls = getattr(module, fam.causal_lm)
    assert not is_ours(vars(cls)["forward"], causal_lm._fused_forward)
    assert family_states()[family].startswith(f"native forward ({fam.why_native()})")


def test_the_report_lists_every_family_of_the_table():
    states = family_states()
    assert set(ALL) <= set(states)
    for name in ALL:
        assert states[name], name


@pytest.mark.parametrize("family, refused", [
    ("gpt_oss", "apply_rotary_pos_emb"),  # halves rotated with a half-width cos
    ("glm4", "apply_rotary_pos_emb"),  # interleaved pairs, partial
    ("cohere", "apply_rotary_pos_emb"),  # interleaved pairs
    ("falcon_h1", "FalconH1MLP"),  # gate / down multipliers
    ("gpt_oss", "GptOssMLP"),  # router and experts, no gated MLP module
    ("llama", None),  # everything is the kernels'
])
def test_structural_probes_keep_what_the_kernels_do_not_reproduce_native(family, refused):
    """The probes compare native code and kernel on the first call: a mismatch keeps the native
    code (the parity tests above hold because of it) and the report names what was kept."""
    model, kw, labels = _model_and_batch(family, seed=35)
    with torch.no_grad():
        out = model(**kw, labels=labels)
        with native():
            ref = model(**kw, labels=labels)
    torch.testing.assert_close(out.loss, ref.loss, **LOSS_TOL)
    state = family_states()[family]
    if refused is None:
        assert "native after probe" not in state, state
    else:
        assert "native after probe: " in state and refused in state.split("native after probe: ", 1)[1], state


@pytest.mark.parametrize("family", ["gpt_oss", "glm4", "cohere", "llama"])
def test_layer_kernels_step_aside_while_torch_compile_traces(family, monkeypatch):
    """Under torch.compile the rotary, RMSNorm and gated-MLP shims call the native code, which
    Inductor fuses with its neighbours (our custom ops would stop that: docs/torch-compile.md); the
    fused loss stays. Simulated here: the tracer flag the module shims read (``native_call``) forced on."""
    from liger_compat.shims import _module_shims

    model, kw, labels = _model_and_batch(family, seed=36)
    with native(), torch.no_grad():
        ref = model(**kw, labels=labels).loss
    eager = _module_shims.compiling
    monkeypatch.setattr(_module_shims, "compiling", lambda: True)
    kernels.last_backend.clear()
    with torch.no_grad():
        out = model(**kw, labels=labels)
    assert set(kernels.last_backend) == {"fused_linear_cross_entropy"}, sorted(kernels.last_backend)
    assert out.logits is None  # the fused forward ran
    torch.testing.assert_close(out.loss, ref, **LOSS_TOL)
    monkeypatch.setattr(_module_shims, "compiling", eager)
    kernels.last_backend.clear()
    with torch.no_grad():
        model(**kw, labels=labels)
    # eager: layer kernels run beside the loss (which ones depends on the family)
    assert set(kernels.last_backend) - {"fused_linear_cross_entropy"}, sorted(kernels.last_backend)


def test_a_family_stays_native_before_the_release_it_was_checked_on():
    fam = next(f for f in FAMILIES if f.fused_from)
    older = f"{fam.fused_from.split('.')[0]}.{int(fam.fused_from.split('.')[1]) - 1}.0"
    assert fam.why_native(fam.fused_from) is None
    reason = fam.why_native(older)
    assert reason and fam.fused_from in reason and older in reason
    assert all(f.why_native("99.0") == f.native_reason for f in FAMILIES)
