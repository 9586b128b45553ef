"""Bad input gives a ValueError/TypeError that names the argument (never a crash deep inside)."""

from __future__ import annotations

import pytest
import torch

from liger_compat import _config
from liger_compat.kernels import apply_rotary_pos_emb, cross_entropy, fused_linear_cross_entropy, rms_norm, swiglu


def _flce_args():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 8, generator=g), torch.randn(10, 8, generator=g), torch.randint(0, 10, (4,), generator=g)


@pytest.mark.parametrize(
    "change, exc, word",
    [
        (lambda h, w, t: (h, w[:, :5], t), ValueError, "weight"),
        (lambda h, w, t: (h, w, t[:3]), ValueError, "target"),
        (lambda h, w, t: (h, w, t.float()), TypeError, "target"),
        (lambda h, w, t: (h, w, t.bool()), TypeError, "target"),
        (lambda h, w, t: (h.double(), w.double(), t), TypeError, "hidden"),
        (lambda h, w, t: (h.half(), w, t), TypeError, "weight"),
        (lambda h, w, t: (h, w.to("meta"), t), ValueError, "weight"),
        (lambda h, w, t: (h, w, torch.tensor([0, 1, 10, 2])), ValueError, "target"),
        (lambda h, w, t: (h, w, torch.tensor([0, -1, 3, 2])), ValueError, "target"),
        (lambda h, w, t: (h, list(w), t), TypeError, "weight"),
    ],
)
def test_flce_bad_inputs(change, exc, word):
    h, w, t = change(*_flce_args())
    with pytest.raises(exc, match=word):
        fused_linear_cross_entropy(h, w, t)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"reduction": "avg"}, "reduction"),
        ({"label_smoothing": 1.5}, "label_smoothing"),
        ({"softcap": 0.0}, "softcap"),
        ({"lse_square_scale": -1.0}, "lse_square_scale"),
        ({"reduction": "none", "num_items_in_batch": 3}, "num_items_in_batch"),
    ],
)
def test_flce_bad_options(kwargs, word):
    h, w, t = _flce_args()
    with pytest.raises(ValueError, match=word):
        fused_linear_cross_entropy(h, w, t, **kwargs)


def test_bias_shape_and_target_range_on_logits():
    h, w, t = _flce_args()
    with pytest.raises(ValueError, match="bias"):
        fused_linear_cross_entropy(h, w, t, bias=torch.randn(9))
    with pytest.raises(ValueError, match="target"):
        cross_entropy(torch.randn(4, 10), torch.tensor([0, 1, 99, -100]))
    # ignore_index itself is fine even though it is outside [0, V)
    assert torch.isfinite(cross_entropy(torch.randn(4, 10), torch.tensor([0, 1, 9, -100])))


class _OnAccelerator(torch.Tensor):
    """CPU data that reports an accelerator device: what the range check looks at to decide."""

    @property
    def device(self):
        return torch.device("cuda")


def test_range_check_skipped_on_accelerators_without_debug(monkeypatch):
    """On accelerator tensors the sync-needing range check runs under settings.debug only."""
    from liger_compat.kernels import _checks

    t = torch.tensor([0, 50, -100]).as_subclass(_OnAccelerator)
    assert t.device.type == "cuda"
    monkeypatch.setattr(_config.settings, "debug", False)
    assert _checks.target_range("target", t, 10, -100) is None  # no sync, no check: 50 passes
    monkeypatch.setattr(_config.settings, "debug", True)
    with pytest.raises(ValueError, match=r"^target holds 50, outside the vocabulary \[0, 10\) and not ignore_index=-100$"):
        _checks.target_range("target", t, 10, -100)
    # the CPU check does not wait for debug
    monkeypatch.setattr(_config.settings, "debug", False)
    with pytest.raises(ValueError, match=r"^labels holds 50, outside the vocabulary \[0, 10\)"):
        _checks.target_range("labels", torch.tensor([0, 50]), 10, -100)


def test_other_kernels_bad_inputs():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="casting"):
        rms_norm(x, torch.randn(8), 1e-6, casting="t5")
    with pytest.raises(TypeError, match="x"):
        rms_norm(x.long(), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="gate"):
        swiglu(torch.randn(3, 8), torch.randn(3, 9))
    with pytest.raises(TypeError, match="up"):
        swiglu(torch.randn(3, 8), torch.randn(3, 8).half())
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8)
    with pytest.raises(ValueError, match="rotary dim"):
        apply_rotary_pos_emb(q, k, torch.randn(1, 5, 10), torch.randn(1, 5, 10))
    with pytest.raises(ValueError, match="cos"):
        apply_rotary_pos_emb(q, k, torch.randn(1, 6, 8), torch.randn(1, 6, 8))
    with pytest.raises(ValueError, match="sin"):
        apply_rotary_pos_emb(q, k, torch.randn(1, 5, 8), torch.randn(1, 5, 6))
