"""The low-memory backward leaves out (row block, vocabulary tile) pairs of negligible gradient.

Under ``TRITON_INTERPRET=1`` (``test_interpret.py`` re-runs this module so) the Triton backward
runs at the interpreter's tiles (16 rows x 32 columns): the tiles it leaves out are counted and
compared with the same criterion evaluated in float64, and its gradients with a float64 head.
In a normal pytest run there is no Triton backward and the tests are skipped.
"""

from __future__ import annotations

import pytest
import torch

from harness import interpreting, tolerance
from reference64 import rel_err

pytestmark = pytest.mark.skipif(not interpreting(), reason="the Triton backward runs only under TRITON_INTERPRET=1")

BM, BN = 16, 32


def _peaked_inputs(seed, n=40, h=32, v=300, dtype=torch.float32):
    """Rows peaked on targets among the first 32 tokens, and token groups the model all but rules out
    (a bias of -25 or -12): tiles without targets whose softmax is negligible, beside tiles that are not."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, h, generator=g) / h**0.5 * 2
    b = torch.randn(v, generator=g) * 0.3
    b[160:] -= 25.0
    b[200:230] += 13.0
    t = torch.randint(0, 32, (n,), generator=g)
    hid = 0.3 * torch.randn(n, h, generator=g) + torch.empty(n, 1).uniform_(1.0, 4.0, generator=g) * w[t]
    t[torch.rand(n, generator=g) < 0.15] = -100
    return hid.to(dtype), w.to(dtype), b.to(dtype), t


def _expected_skips(hid, w, b, t, skip_rel):
    """Tiles the criterion leaves out, in float64: every non-target softmax entry below
    ``skip_rel / V`` of its row's non-target mass."""
    v = w.shape[0]
    z = hid.double() @ w.double().t() + b.double()
    p = torch.softmax(z, -1)
    valid = t != -100
    rows = valid.nonzero().squeeze(1)
    pt = p[rows, t[rows]]
    mass = (1 - pt).clamp(min=0)
    count = 0
    for r0 in range(0, rows.numel(), BM):
        rr = rows[r0:r0 + BM]
        pn = p[rr].clone()
        pn[torch.arange(rr.numel()), t[rr]] = 0.0
        for c0 in range(0, v, BN):
            if (pn[:, c0:c0 + BN] < skip_rel * mass[r0:r0 + BM, None] / v).all():
                count += 1
    return count


def _grads(hid, w, b, t, **opts):
    from liger_compat.kernels import fused_linear_cross_entropy

    ins = [x.detach().clone().requires_grad_(True) for x in (hid, w, b)]
    loss = fused_linear_cross_entropy(ins[0], ins[1], t, bias=ins[2], mode="lowmem", **opts)
    return torch.autograd.grad(loss, ins)


def _grads64(hid, w, b, t, **opts):
    ins = [x.detach().double().requires_grad_(True) for x in (hid, w, b)]
    z = ins[0] @ ins[1].t() + ins[2]
    loss = torch.nn.functional.cross_entropy(z, t, ignore_index=-100, **opts)
    return torch.autograd.grad(loss, ins)


@pytest.mark.parametrize("seed", [0, 1])
def test_negligible_tiles_are_left_out_and_the_gradient_stays_exact(seed, monkeypatch):
    from liger_compat.kernels import _lowmem_triton

    hid, w, b, t = _peaked_inputs(seed)
    ref = _grads64(hid, w, b, t)
    expected = _expected_skips(hid, w, b, t, _lowmem_triton.SKIP_REL)
    assert expected >= 5  # the inputs have such tiles

    sparse = _grads(hid, w, b, t)
    skipped = int(_lowmem_triton.last_skipped)
    assert skipped == expected
    monkeypatch.setattr(_lowmem_triton, "SKIP_REL", 0.0)
    dense = _grads(hid, w, b, t)
    assert int(_lowmem_triton.last_skipped) == 0
    tol = tolerance(torch.float32, n=hid.shape[1])
    for got, full, want in zip(sparse, dense, ref):
        # what the skipped tiles held is at most SKIP_REL of each row's non-target mass
        assert rel_err(got, want) <= rel_err(full, want) + _lowmem_triton.SKIP_REL + tol


def test_a_looser_threshold_skips_more_and_its_error_stays_within_the_dropped_mass(monkeypatch):
    from liger_compat.kernels import _lowmem_triton

    hid, w, b, t = _peaked_inputs(2)
    ref = _grads64(hid, w, b, t)
    counts, errs = [], []
    for rel in (2.0 ** -9, 2.0 ** 8):
        monkeypatch.setattr(_lowmem_triton, "SKIP_REL", rel)
        got = _grads(hid, w, b, t)
        counts.append(int(_lowmem_triton.last_skipped))
        assert counts[-1] == _expected_skips(hid, w, b, t, rel)
        errs.append(rel_err(got[0], ref[0]))
    assert counts[1] > counts[0]
    assert errs[1] < 0.5  # bounded by the dropped share of each row's mass


@pytest.mark.parametrize("opts", [{"label_smoothing": 0.1}, {"lse_square_scale": 1e-3}])
def test_no_tile_is_left_out_with_smoothing_or_z_loss(opts):
    from liger_compat.kernels import _lowmem_triton

    hid, w, b, t = _peaked_inputs(3)
    got = _grads(hid, w, b, t, **opts)
    assert int(_lowmem_triton.last_skipped) == 0
    if "label_smoothing" in opts:
        ref = _grads64(hid, w, b, t, **opts)
        for g, r in zip(got, ref):
            assert rel_err(g, r) <= tolerance(torch.float32, n=hid.shape[1])


def test_target_logits_match_float64():
    from liger_compat.kernels import _lowmem_triton
    from liger_compat.kernels.loss import CEOptions

    hid, w, b, t = _peaked_inputs(4, h=45)
    t[3] = 299
    idx = torch.arange(hid.shape[0])
    for softcap in (None, 7.0):
        got = _lowmem_triton.target_logits(hid, w, b, t, idx, CEOptions(softcap=softcap))
        z = hid.double() @ w.double().t() + b.double()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        valid = t != -100
        want = torch.where(valid, z[idx, t.clamp(min=0)], torch.zeros((), dtype=torch.float64))
        assert rel_err(got, want) <= tolerance(torch.float32, n=45)
