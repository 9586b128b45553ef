"""2-D ``logits_to_keep`` (transformers 5.21 ``slice_logits_to_keep``) and the ``return_dict=False``
tuple with ``logits=None`` (transformers 4.51 ``@can_return_tuple``), against the unpatched model.

The references are built from the native model's full logits (every release computes those), with
the positions selected by plain indexing here; where the installed transformers slices 2-D
tensors itself, the patched model is also compared with the native forward given the same tensor.
"""

from __future__ import annotations

import pytest
import torch

from liger_compat.shims import causal_lm
from model_helpers import grads, native, random_batch, tiny

B, T = 3, 10
FAMILIES = ["llama", "gemma2", "granite", "mixtral"]


def _native_slices_2d() -> bool:
    """Whether this transformers' own forward takes a 2-D logits_to_keep (chooses the extra reference)."""
    import transformers.modeling_utils as mu

    return hasattr(mu, "slice_logits_to_keep")


def _keep(kind: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    if kind == "int":
        # (batch, k) positions, different per sample, unsorted, one repeated
        rows = [torch.randperm(T, generator=g)[:4] for _ in range(B)]
        rows[0][3] = rows[0][1]
        return torch.stack(rows)
    mask = torch.rand(B, T, generator=g) < 0.5
    mask[:, -1] = True  # no sample empty
    return mask


def _select(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The kept rows of ``t`` ([B, T, ...]) by plain indexing."""
    if keep.dtype == torch.bool:
        return torch.cat([t[b][keep[b]] for b in range(t.shape[0])])
    return torch.stack([t[b][keep[b]] for b in range(t.shape[0])])


def _ref_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """float64 causal-LM loss; labels shift by one along their last dimension (the flat kept
    sequence for a mask), ignored positions -100."""
    shift = torch.cat([labels[..., 1:], torch.full_like(labels[..., :1], -100)], dim=-1)
    flat, t = logits.double().reshape(-1, logits.shape[-1]), shift.reshape(-1)
    return torch.nn.functional.cross_entropy(flat, t, ignore_index=-100)


def _aux(model, ids):
    """Mixtral's router loss term as the native forward adds it (0 for dense families)."""
    if not getattr(model.config, "output_router_logits", False):
        return 0.0
    with native():
        out = model(input_ids=ids, labels=ids)
    return model.config.router_aux_loss_coef * out.aux_loss  # differentiable: the grads reference needs it


@pytest.mark.parametrize("kind", ["int", "bool"])
@pytest.mark.parametrize("family", FAMILIES)
def test_2d_keep_without_labels_gives_the_native_logits(family, kind):
    model = tiny(family)
    ids, _ = random_batch(model, b=B, t=T, seed=31)
    keep = _keep(kind, 32)
    with native(), torch.no_grad():
        full = model(input_ids=ids).logits
    with torch.no_grad():
        out = model(input_ids=ids, logits_to_keep=keep).logits
    ref = _select(full, keep)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if kind == "bool":
        assert out.shape == (int(keep.sum()), model.config.vocab_size)
    if _native_slices_2d():
        with native(), torch.no_grad():
            nat = model(input_ids=ids, logits_to_keep=keep).logits
        torch.testing.assert_close(out, nat, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["int", "bool"])
@pytest.mark.parametrize("family", FAMILIES)
def test_2d_keep_with_labels_in_training_is_the_fused_loss_of_the_kept_positions(family, kind):
    model = tiny(family)
    ids, labels = random_batch(model, b=B, t=T, seed=33)
    keep = _keep(kind, 34)
    lab = _select(labels, keep)
    # reference: native full logits, positions selected here, float64 loss; grads through it
    with native():
        model.zero_grad(set_to_none=True)
        full = model(input_ids=ids).logits
        ref = _ref_loss(_select(full, keep), lab)
        ref_aux = _aux(model, ids)
        (ref.float() + ref_aux).backward()
        g_ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=lab, logits_to_keep=keep)
    assert out.logits is None  # the fused path
    aux_value = ref_aux.detach() if torch.is_tensor(ref_aux) else ref_aux
    torch.testing.assert_close(out.loss.detach().double(), (ref.detach() + aux_value).double(), rtol=1e-5, atol=1e-5)
    out.loss.backward()
    g = grads(model)
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    if _native_slices_2d():
        with native(), torch.no_grad():
            nat = model(input_ids=ids, labels=lab, logits_to_keep=keep)
        torch.testing.assert_close(out.loss.detach(), nat.loss, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["int", "bool"])
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_2d_keep_with_labels_in_eval_mode_gives_loss_and_kept_logits(family, kind):
    model = tiny(family).eval()
    ids, labels = random_batch(model, b=B, t=T, seed=35)
    keep = _keep(kind, 36)
    lab = _select(labels, keep)
    with native(), torch.no_grad():
        full = model(input_ids=ids).logits
    with torch.no_grad():
        out = model(input_ids=ids, labels=lab, logits_to_keep=keep)
    ref_logits = _select(full, keep)
    torch.testing.assert_close(out.logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss.double(), _ref_loss(ref_logits, lab) + float(torch.as_tensor(_aux(model, ids)).detach()),
                               rtol=1e-5, atol=1e-5)
    assert "token_accuracy" not in out.keys()


@pytest.mark.parametrize("kind", ["int", "bool"])
def test_2d_keep_where_the_native_forward_cannot_slice_it(kind, monkeypatch):
    """Before transformers 5.21 the native forward indexes hidden_states[:, keep, :]: the decoder and
    head below it run instead, with and without labels."""
    model = tiny("llama")
    ids, labels = random_batch(model, b=B, t=T, seed=37)
    keep = _keep(kind, 38)
    with native(), torch.no_grad():
        full = model(input_ids=ids).logits
    monkeypatch.setattr(causal_lm, "native_slices_2d", lambda forward: False)
    with torch.no_grad():
        out = model(input_ids=ids, logits_to_keep=keep)
        torch.testing.assert_close(out.logits, _select(full, keep), rtol=1e-5, atol=1e-5)
        model.eval()
        lab = _select(labels, keep)
        out = model(input_ids=ids, labels=lab, logits_to_keep=keep)
    torch.testing.assert_close(out.logits, _select(full, keep), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss.double(), _ref_loss(_select(full, keep), lab), rtol=1e-5, atol=1e-5)


def test_2d_keep_bad_values_are_named():
    model = tiny("llama")
    ids, _ = random_batch(model, b=B, t=T)
    bad = [
        torch.ones(B, T + 1, dtype=torch.bool),  # mask of the wrong length
        torch.zeros(B + 1, 2, dtype=torch.long),  # one row per sample
        torch.zeros(B, 2, 2, dtype=torch.long),  # 3-D
        torch.rand(B, 2),  # float positions
    ]
    for keep in bad:
        with pytest.raises(ValueError, match="logits_to_keep"):
            model(input_ids=ids, logits_to_keep=keep)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids=ids, labels=ids[:, :2], logits_to_keep=torch.zeros(B + 1, 2, dtype=torch.long))


@pytest.mark.parametrize("family, router", [("llama", False), ("mixtral", False), ("mixtral", True)])
def test_return_dict_false_tuple_keeps_the_native_positions_with_logits_none(family, router):
    model = tiny(family)
    ids, labels = random_batch(model, seed=39)
    kw = dict(labels=labels, return_dict=False, use_cache=True)
    if router:
        kw["output_router_logits"] = True
    with torch.no_grad():
        out = model(input_ids=ids, **kw)
        with native():
            ref = model(input_ids=ids, **kw)
    assert isinstance(out, tuple) and isinstance(ref, tuple)
    assert len(out) == len(ref), ([type(x).__name__ for x in out], [type(x).__name__ for x in ref])
    vocab = model.config.vocab_size
    logit_pos = [i for i, x in enumerate(ref) if torch.is_tensor(x) and x.shape == (*ids.shape, vocab)]
    assert len(logit_pos) == 1
    for i, (a, b) in enumerate(zip(out, ref)):
        if i == logit_pos[0]:
            assert a is None  # the fused forward skipped the logits; the place stays
        elif torch.is_tensor(b):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"position {i}: {m}")
        else:
            assert type(a) is type(b), (i, type(a), type(b))
