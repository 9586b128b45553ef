"""The low-memory backward leaves out (row block, vocabulary tile) pairs of negligible gradient.

Under ``TRITON_INTERPRET=1`` (``test_interpret.py`` re-runs this module so) the Triton backward
runs at the interpreter's tiles (16 rows x 32 columns): the tiles it leaves out are counted and
compared with the same criterion evaluated in float64 at the kernel's column order, and its
gradients with a float64 simulation of the sparse backward and with a float64 head.
In a normal pytest run there is no Triton backward and the tests are skipped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from harness import interpreting, tolerance
from reference64 import rel_err

pytestmark = pytest.mark.skipif(not interpreting(), reason="the Triton backward runs only under TRITON_INTERPRET=1")

BM, BN = 16, 32
ROOT = Path(__file__).resolve().parents[2]  # benchmarks.regimes makes the trained-like inputs


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


def _uniform_inputs(seed, n=64, v=2048):
    """Initialisation-like rows: a near-uniform softmax over ``v`` tokens, no bias."""
    g = torch.Generator().manual_seed(seed)
    hid = 0.5 * torch.randn(n, 32, generator=g)
    w = 0.02 * torch.randn(v, 32, generator=g)
    return hid, w, torch.zeros(v), torch.randint(0, v, (n,), generator=g)


def _simulated(hid, w, b, t, eps, order, corrected=True, share=None):
    """float64 simulation of the sparse backward (mean reduction) with the kernel's column order:
    ``(grad_hidden, grad_weight, grad_bias, tiles left out)``. A (row block, tile) pair whose
    non-target softmax entries are all below ``eps``, and whose non-target mass in each row is at
    most ``share`` (default: the kernel's SKIP_SHARE) times BN / V of the row's, leaves its entries
    out of grad_weight, and out of grad_hidden except for its rows' left-out mass times the mean
    weight row of its run of MEAN_TILES tiles (not even that with ``corrected=False``)."""
    v = w.shape[0]
    hd, wd, bd = hid.double(), w.double(), b.double()
    p = torch.softmax(hd @ wd.t() + bd, -1)
    valid = t != -100
    rows = valid.nonzero().squeeze(1)
    d = torch.zeros_like(p)
    d[rows] = p[rows] / rows.numel()
    d[rows, t[rows]] -= 1.0 / rows.numel()
    gh, gw, gb = d @ wd, d.t() @ hd, d.sum(0)
    from liger_compat.kernels import _lowmem_triton

    if share is None:
        share = _lowmem_triton.SKIP_SHARE
    lse = torch.logsumexp(hd @ wd.t() + bd, -1)
    # the kernel's floor: what fp32 resolves of 1 - p_t beside lse
    row_mass = torch.maximum(1.0 - p[torch.arange(t.shape[0]), t.clamp(min=0)],
                             (lse.abs() + 1.0) * _lowmem_triton.ROW_MASS_FLOOR)
    count = 0
    span = _lowmem_triton.MEAN_TILES * BN
    for r0 in range(0, t.shape[0], BM):  # blocks of every row (ignored ones get no gradient): no compaction
        rr = rows[(rows >= r0) & (rows < r0 + BM)]
        for c0 in range(0, v, BN):
            cols = order[c0:c0 + BN].long()
            block = p[rr][:, cols].clone()
            block[t[rr][:, None] == cols[None, :]] = 0.0
            if (block < eps).all() and (block.sum(1) <= share * row_mass[rr] * BN / v).all():
                count += 1
                left = d[rr][:, cols].clone()
                left[t[rr][:, None] == cols[None, :]] = 0.0
                gh[rr] -= left @ wd[cols]
                if corrected:
                    around = order[c0 // span * span:c0 // span * span + span].long()
                    gh[rr] += left.sum(1, keepdim=True) * wd[around].mean(0, keepdim=True)
                gw[cols] -= left.t() @ hd[rr]
    return gh, gw, gb, count


def _grads(hid, w, b, t, **opts):
    from liger_compat.kernels import fused_linear_cross_entropy

    ins = [x.detach().clone().requires_grad_(True) for x in (hid, w, b)]
    loss = fused_linear_cross_entropy(ins[0], ins[1], t, bias=ins[2], mode="lowmem", compact_ignored=False, **opts)
    return torch.autograd.grad(loss, ins)


def _grads64(hid, w, b, t, **opts):
    ins = [x.detach().double().requires_grad_(True) for x in (hid, w, b)]
    z = ins[0] @ ins[1].t() + ins[2]
    loss = torch.nn.functional.cross_entropy(z, t, ignore_index=-100, **opts)
    return torch.autograd.grad(loss, ins)


def test_column_order_sorts_by_mean_logit():
    from liger_compat.kernels import _lowmem_triton

    hid, w, b, t = _peaked_inputs(5)
    idx = torch.arange(hid.shape[0])
    sc = (t != -100).float()
    order = _lowmem_triton.column_order(hid, w, b, idx, sc).long()
    assert order.dtype == torch.int64 and sorted(order.tolist()) == list(range(w.shape[0]))
    key = w.double() @ hid.double()[t != -100].mean(0) + b.double()
    ranked = key[order]
    assert bool((ranked[:-1] >= ranked[1:] - 1e-5 * key.abs().max()).all())


@pytest.mark.parametrize("span", [BN, 3 * BN])
def test_tile_means_match_float64(span):
    from liger_compat.kernels import _lowmem_triton

    g = torch.Generator().manual_seed(6)
    w = torch.randn(300, 45, generator=g)  # 300 = 9 runs of 32 and one of 12 (3 of 96 and one of 12)
    order = torch.randperm(300, generator=g).to(torch.int32)
    mu = _lowmem_triton.tile_means(w, order, span)
    want = torch.stack([w.double()[order[c:c + span].long()].mean(0) for c in range(0, 300, span)])
    assert mu.shape == (-(-300 // span), 45) and rel_err(mu, want) <= tolerance(torch.float32, n=span)


@pytest.mark.parametrize("seed", [0, 1])
def test_sparse_backward_matches_its_float64_simulation(seed):
    """Tiles left out as the criterion says, at the kernel's column order, and gradients those of
    the float64 simulation: left-out entries replaced by mass x mean weight row in grad_hidden,
    left out of grad_weight, kept in grad_bias."""
    from liger_compat.kernels import _lowmem_triton

    hid, w, b, t = _peaked_inputs(seed)
    eps = _lowmem_triton.SKIP_EPS
    valid = t != -100
    order = _lowmem_triton.column_order(hid, w, b, torch.arange(hid.shape[0]), valid.float())
    *want, expected = _simulated(hid, w, b, t, eps, order)
    assert expected >= 5  # the inputs have such tiles
    got = _grads(hid, w, b, t)
    assert int(_lowmem_triton.last_skipped) == expected
    tol = tolerance(torch.float32, n=hid.shape[1])
    for g, r in zip(got, want):
        assert rel_err(g, r) <= tol


def test_ruled_out_tiles_are_left_out_without_error(monkeypatch):
    """Tiles of tokens the model rules out (the peaked inputs' -25 bias) hold no gradient worth a
    float32 ulp: leaving them out costs nothing."""
    from liger_compat.kernels import _lowmem_triton

    hid, w, b, t = _peaked_inputs(2)
    ref = _grads64(hid, w, b, t)
    monkeypatch.setattr(_lowmem_triton, "SKIP_EPS", 0.0)
    dense = _grads(hid, w, b, t)
    assert int(_lowmem_triton.last_skipped) == 0
    monkeypatch.setattr(_lowmem_triton, "SKIP_EPS", 2.0 ** -12)
    got = _grads(hid, w, b, t)
    skipped = int(_lowmem_triton.last_skipped)
    assert skipped > 0
    for g, full, want in zip(got, dense, ref):
        assert rel_err(g, want) <= rel_err(full, want) + 10 * tolerance(torch.float32, n=hid.shape[1])


@pytest.mark.parametrize("e", [10, 8])
def test_the_mean_weight_row_keeps_what_left_out_tiles_share(e, monkeypatch):
    """Trained-like logits (a Zipf prior through a constant hidden feature: every tail token's
    weight row shares a large log-prior entry): leaving tiles out without the correction would
    take 1.5-10 % out of grad_hidden at this size; with it the error is under a tenth of that (a
    sixteenth to a twentieth measured), and the kernel matches the corrected simulation."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.regimes import make_inputs
    from liger_compat.kernels import _lowmem_triton

    hid, w, t, _ = make_inputs("trained", 128, 64, 2048, device="cpu", dtype=torch.float32, seed=e)
    b = 0.1 * torch.randn(w.shape[0], generator=torch.Generator().manual_seed(e))
    eps = 2.0 ** -e
    monkeypatch.setattr(_lowmem_triton, "SKIP_EPS", eps)
    # every group runs the sparse kernel however few tiles it leaves out (at this small vocabulary
    # e=10 leaves out 5 %; the switch to the dense kernel has its own test below)
    monkeypatch.setattr(_lowmem_triton, "SPARSE_MIN_SHARE", 0.0)
    ref = _grads64(hid, w, b, t)
    got = _grads(hid, w, b, t)
    skipped = int(_lowmem_triton.last_skipped)
    order = _lowmem_triton.column_order(hid, w, b, torch.arange(hid.shape[0]), (t != -100).float())
    *sim, count = _simulated(hid, w, b, t, eps, order)
    plain, *_ = _simulated(hid, w, b, t, eps, order, corrected=False)
    assert skipped == count and skipped >= 20  # of 8 x 64 pairs
    for g, r in zip(got, sim):
        assert rel_err(g, r) <= 1e-4  # the float32 kernel against its float64 simulation
    assert rel_err(got[0], ref[0]) <= 0.1 * rel_err(plain, ref[0])


def test_a_near_uniform_softmax_leaves_out_nothing(monkeypatch):
    """Initialisation-like logits: every softmax entry is far below eps, but each row's mass is spread
    over the whole vocabulary, where the left-out gradient (the softmax's covariance times h) is
    not what a tile's mean row restores: no tile is left out and the gradient is the dense one's.
    Without the mass rule every tile would be."""
    from liger_compat.kernels import _lowmem_triton

    hid, w, b, t = _uniform_inputs(7)
    order = _lowmem_triton.column_order(hid, w, b, torch.arange(64), torch.ones(64))
    assert _simulated(hid, w, b, t, _lowmem_triton.SKIP_EPS, order, share=float("inf"))[3] == 4 * 64
    ref = _grads64(hid, w, b, t)
    got = _grads(hid, w, b, t)
    assert int(_lowmem_triton.last_skipped) == 0
    for g_, r in zip(got, ref):
        assert rel_err(g_, r) <= tolerance(torch.float32, n=32)


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


def test_near_uniform_logits_run_the_dense_kernel_past_the_probe(monkeypatch):
    """Near-uniform logits over four groups of rows: the first (one block of rows, the probe) runs
    the sparse kernel and leaves nothing out, so the other three run the dense one (the gates are
    read on the device). Gradients those of a float64 head."""
    from liger_compat.kernels import _lowmem_triton

    hid, w, b, t = _uniform_inputs(8)
    monkeypatch.setattr(_lowmem_triton, "GH_SCRATCH_BYTES", 16 * 4 * 32)  # 16 rows a group
    got = _grads(hid, w, b, t)
    assert int(_lowmem_triton.last_skipped) == 0
    assert int(_lowmem_triton.last_sparse_groups) == 1
    for g_, r in zip(got, _grads64(hid, w, b, t)):
        assert rel_err(g_, r) <= tolerance(torch.float32, n=32)


def test_groups_go_on_sparse_while_tiles_are_left_out(monkeypatch):
    """Peaked rows over three groups: every group runs the sparse kernel, the tiles left out and the
    gradients are those of the one-group run and of the float64 simulation."""
    from liger_compat.kernels import _lowmem_triton

    hid, w, b, t = _peaked_inputs(0, n=48)
    order = _lowmem_triton.column_order(hid, w, b, torch.arange(hid.shape[0]), (t != -100).float())
    *want, expected = _simulated(hid, w, b, t, _lowmem_triton.SKIP_EPS, order)
    monkeypatch.setattr(_lowmem_triton, "GH_SCRATCH_BYTES", 16 * 4 * 32)  # 16 rows a group
    got = _grads(hid, w, b, t)
    assert int(_lowmem_triton.last_sparse_groups) == 3
    assert int(_lowmem_triton.last_skipped) == expected and expected >= 3 * 5
    for g_, r in zip(got, want):
        assert rel_err(g_, r) <= tolerance(torch.float32, n=hid.shape[1])


def test_a_group_turns_dense_when_too_few_tiles_were_left_out(monkeypatch):
    """A first group of peaked rows (whose hidden feature 0 carries the -25 bias of the tokens the
    model rules out), then near-uniform rows (feature 0 off, small logits): the sparse kernel goes
    on while the share of tiles left out so far is at least SPARSE_MIN_SHARE, then the dense one."""
    from liger_compat.kernels import _lowmem_triton

    hid, w, b, t = _peaked_inputs(1, n=16, v=2048)
    w = w.clone()
    w[:, 0] = b  # the bias through a hidden feature that only the peaked rows have
    hid[:, 0] = 1.0
    b = torch.zeros_like(b)
    g = torch.Generator().manual_seed(9)
    flat = 0.05 * torch.randn(48, 32, generator=g)
    flat[:, 0] = 0.0
    hid = torch.cat([hid, flat])
    t = torch.cat([t, torch.randint(0, 2048, (48,), generator=g)])
    monkeypatch.setattr(_lowmem_triton, "GH_SCRATCH_BYTES", 16 * 4 * 32)  # 16 rows a group
    ntiles = 2048 // BN
    _grads(hid[:16], w, b, t[:16])  # the first group alone: the share it leaves out
    first = int(_lowmem_triton.last_skipped) / ntiles
    assert first > 0.5
    # the second group leaves nothing out: it runs sparse (first >= the share), the third does not
    monkeypatch.setattr(_lowmem_triton, "SPARSE_MIN_SHARE", 0.75 * first)
    got = _grads(hid, w, b, t)
    assert int(_lowmem_triton.last_sparse_groups) == 2
    assert int(_lowmem_triton.last_skipped) == round(first * ntiles)
    for g_, r in zip(got, _grads64(hid, w, b, t)):
        assert rel_err(g_, r) <= 1e-3


def test_flce_sparse_off_computes_every_tile(monkeypatch):
    """``configure(flce_sparse=False)`` (``LIGER_COMPAT_FLCE_SPARSE=0``): the peaked inputs, whose
    ruled-out tiles the sparse backward leaves out, get every tile computed; the gradients are
    the float64 head's to float32 tolerance."""
    import liger_compat
    from liger_compat import _config
    from liger_compat.kernels import _lowmem_triton

    hid, w, b, t = _peaked_inputs(0)
    _grads(hid, w, b, t)
    assert int(_lowmem_triton.last_skipped) > 0  # on by default
    monkeypatch.setattr(_config.settings, "flce_sparse", True)
    monkeypatch.setitem(_config.settings.source, "flce_sparse", "test")
    liger_compat.configure(flce_sparse=False)
    got = _grads(hid, w, b, t)
    assert int(_lowmem_triton.last_skipped) == 0 and _lowmem_triton.last_sparse_groups is None
    for g_, r in zip(got, _grads64(hid, w, b, t)):
        assert rel_err(g_, r) <= tolerance(torch.float32, n=hid.shape[1])
