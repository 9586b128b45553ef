"""fused_linear_cross_entropy's causal-LM options: ``shift_target=True`` (the labels shifted inside
the loss, each sequence's last position scored against nothing) and ``empty_mean="nan"`` (the
mean over no labelled row is NaN, as ``cross_entropy``'s), against float64 losses of targets
shifted here by plain indexing, on fresh random inputs. Both CPU paths (the dense torch ops and
the chunked reference); under ``TRITON_INTERPRET=1`` (test_interpret.py) the Triton kernels."""

from __future__ import annotations

import pytest
import torch

from liger_compat import _config
from liger_compat.kernels import fused_linear_cross_entropy, last_backend
from liger_compat.kernels.errors import ShapeMismatchError
from harness import expected_backend, tolerance
from reference64 import ce64, rel_err


def _shifted64(labels, ignore_index):
    """labels [..., T] -> the flat targets a causal LM scores: label t + 1 at position t, nothing at the last."""
    t = torch.full_like(labels, ignore_index)
    t[..., :-1] = labels[..., 1:]
    return t.reshape(-1)


def _inputs(seed, batch, seq, h, v, ignore_frac, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(batch, seq, h, generator=g) * 2.0
    w = torch.randn(v, h, generator=g) / h**0.5
    b = torch.randn(v, generator=g) * 0.5
    labels = torch.randint(0, v, (batch, seq), generator=g)
    labels[torch.rand(batch, seq, generator=g) < ignore_frac] = ignore_index
    return hid, w, b, labels


@pytest.mark.parametrize("mode", [None, "lowmem"])
@pytest.mark.parametrize("cpu_native", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("seed", [3, 101])
def test_shift_target_scores_each_position_against_the_next_label(monkeypatch, mode, cpu_native, reduction, seed):
    """Every path: the chunked Function (which shifts inside its pass), the dense torch ops, the
    low-memory kernels (Triton only: under the interpreter)."""
    if mode == "lowmem" and expected_backend() != "triton":
        pytest.skip("the low-memory mode runs the Triton kernels (TRITON_INTERPRET=1: test_interpret.py)")
    monkeypatch.setattr(_config.settings, "cpu_native", cpu_native)
    hid, w, b, labels = _inputs(seed, 3, 11, 12, 29, 0.25)
    # a bad first label is no position's target: it must not fail the call
    labels[:, 0] = 10**6
    ps = [x.clone().requires_grad_(True) for x in (hid, w, b)]
    out = fused_linear_cross_entropy(ps[0], ps[1], labels, bias=ps[2], reduction=reduction, shift_target=True,
                                     return_token_accuracy=True, lse_square_scale=1e-3, mode=mode)
    assert last_backend["fused_linear_cross_entropy"] == expected_backend()
    t = _shifted64(labels, -100)
    p64 = [x.double().requires_grad_(True) for x in (hid, w, b)]
    logits = p64[0].reshape(-1, 12) @ p64[1].T + p64[2]
    ref, _, acc = ce64(logits, t, reduction=reduction, lse_square_scale=1e-3)
    if reduction == "none":
        ref = ref.view(3, 11)
        assert out.loss.shape == (3, 11)
        assert (out.loss[:, -1] == 0).all()  # the last position predicts nothing
    gout = torch.rand(ref.shape, dtype=torch.float64) + 0.5
    (out.loss.double() * gout).sum().backward()
    (ref * gout).sum().backward()
    tol = tolerance(torch.float32, n=29)
    assert rel_err(out.loss, ref) <= tol
    for mine, theirs in zip(ps, p64):
        assert rel_err(mine.grad, theirs.grad) <= tol
    assert (ps[0].grad[:, -1] == 0).all()
    acc_ref = acc.view(3, 11) if reduction == "none" else acc
    assert rel_err(out.token_accuracy, acc_ref) <= tol


@pytest.mark.parametrize("cpu_native", [True, False])
def test_shift_target_equals_the_loss_of_shifted_targets_with_num_items(monkeypatch, cpu_native):
    monkeypatch.setattr(_config.settings, "cpu_native", cpu_native)
    hid, w, _, labels = _inputs(17, 2, 9, 8, 31, 0.3, ignore_index=7)
    loss = fused_linear_cross_entropy(hid, w, labels, ignore_index=7, num_items_in_batch=13, shift_target=True,
                                      empty_mean="nan")
    ref, _, _ = ce64(hid.double().reshape(-1, 8) @ w.double().T, _shifted64(labels, 7), ignore_index=7,
                     num_items_in_batch=13)
    assert rel_err(loss, ref) <= tolerance(torch.float32, n=31)


@pytest.mark.parametrize("cpu_native", [True, False])
@pytest.mark.parametrize("shift", [False, True])
def test_empty_mean_nan_where_no_row_is_labelled(monkeypatch, cpu_native, shift):
    """Every label ignored (and, shifted, sequences of one token, whose only position predicts
    nothing): NaN with ``empty_mean="nan"``, 0 by default, 0 with ``num_items_in_batch``; the
    gradients are zero in every case."""
    monkeypatch.setattr(_config.settings, "cpu_native", cpu_native)
    hid, w, b, labels = _inputs(5, 4, 1 if shift else 6, 10, 23, 0.0)
    if not shift:
        labels[:] = -100
    for kw, expect in (({"empty_mean": "nan"}, "nan"), ({}, 0.0),
                       ({"empty_mean": "nan", "num_items_in_batch": 3}, 0.0),
                       ({"empty_mean": "nan", "reduction": "sum"}, 0.0)):
        ps = [x.clone().requires_grad_(True) for x in (hid, w, b)]
        loss = fused_linear_cross_entropy(ps[0], ps[1], labels, bias=ps[2], shift_target=shift, **kw)
        loss.backward()
        if expect == "nan":
            assert torch.isnan(loss), kw
        else:
            assert loss.item() == expect, kw
        for p in ps:
            assert torch.isfinite(p.grad).all() and p.grad.abs().max() == 0, kw
    # one labelled row: the NaN setting changes nothing
    labels2 = labels.clone()
    labels2.view(-1)[-1 if not shift else 0] = 4
    if shift:
        hid, w, b, labels2 = _inputs(6, 2, 3, 10, 23, 0.0)
        labels2[:, 1:] = -100
        labels2[0, 1] = 4
    got = fused_linear_cross_entropy(hid, w, labels2, bias=b, shift_target=shift, empty_mean="nan")
    t = _shifted64(labels2, -100) if shift else labels2.reshape(-1)
    ref, _, _ = ce64(hid.double().reshape(-1, 10) @ w.double().T + b.double(), t)
    assert torch.isfinite(got) and rel_err(got, ref) <= tolerance(torch.float32, n=23)


def test_bad_shift_and_empty_mean_arguments_name_them():
    hid, w, _, labels = _inputs(9, 2, 5, 6, 11, 0.0)
    with pytest.raises(ValueError, match="shift_target"):
        fused_linear_cross_entropy(hid, w, labels, shift_target="yes")
    with pytest.raises(ValueError, match="empty_mean"):
        fused_linear_cross_entropy(hid, w, labels, empty_mean="inf")
    # a flat target cannot be shifted per sequence
    with pytest.raises(ShapeMismatchError, match="shift_target"):
        fused_linear_cross_entropy(hid, w, labels.reshape(-1), shift_target=True)
    with pytest.raises(ShapeMismatchError, match="shift_target"):
        fused_linear_cross_entropy(hid[0, 0], w, labels[0, 0], shift_target=True)
    with pytest.raises(TypeError):
        fused_linear_cross_entropy(hid, w, labels.float(), shift_target=True)
