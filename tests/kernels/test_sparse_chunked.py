"""The chunked fused loss's block-sparse gradient matmuls (``sparse_grads=True``,
``kernels/_sparse_grads_triton.py``).

Under ``TRITON_INTERPRET=1`` (``test_interpret.py`` re-runs this module so) the kernels run at the
interpreter's tiles (16 rows x 32 columns) on fp16 inputs (the interpreter's bf16 ``tl.dot`` is
not exact; the tensor descriptors take 16-bit types only): the pairs left out are compared with a
float64 simulation of the rule at the pass's column order, and the gradients with that simulation
and with a float64 head. In a normal pytest run there is no Triton path and the tests are skipped.
"""

from __future__ import annotations

import pytest
import torch

from harness import interpreting
from reference64 import rel_err

pytestmark = pytest.mark.skipif(not interpreting(), reason="the Triton kernels run only under TRITON_INTERPRET=1")

BM, BN = 16, 32


def _inputs(seed, n=64, h=32, v=512, ignored=0.15):
    """Rows peaked on targets among the first 32 tokens, token groups the model all but rules out
    (a log-prior of -25 or -12 through hidden feature 0, which every row has at 1): tiles without
    targets whose softmax is negligible, beside tiles that are not. fp16."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, h, generator=g) / h**0.5 * 2
    prior = torch.randn(v, generator=g) * 0.3
    prior[v // 2:] -= 25.0
    prior[v // 2 + 40:v // 2 + 70] += 13.0
    t = torch.randint(0, 32, (n,), generator=g)
    hid = 0.3 * torch.randn(n, h, generator=g) + torch.empty(n, 1).uniform_(1.0, 3.0, generator=g) * w[t]
    w[:, 0], hid[:, 0] = prior, 1.0
    t[torch.rand(n, generator=g) < ignored] = -100
    return hid.half(), w.half(), t


def _simulated(hid, w, t, chunk, eps):
    """float64 simulation, mean reduction: (grad_hidden, grad_weight, pairs left out). The first
    ``chunk`` rows dense (the pass's probe), then per chunk of ``2 * chunk`` rows, the vocabulary in
    the pass's order (``_lowmem_triton.column_order`` over all
    rows), a (block of 16 rows, tile of 32) pair whose non-target softmax entries are all below
    ``eps`` and whose rows each hold at most SKIP_SHARE x BN / V of their non-target mass there
    (counted as at least ROW_MASS_FLOOR x (|lse| + 1)) leaves its entries out of grad_weight, and out
    of grad_hidden but for their sum times the mean weight row of its run of MEAN_TILES tiles."""
    from liger_compat.kernels import _lowmem_triton
    from liger_compat.kernels import _sparse_grads_triton as sg

    n, v = hid.shape[0], w.shape[0]
    hd, wd = hid.double(), w.double()
    z = hd @ wd.t()
    p = torch.softmax(z, -1)
    lse = torch.logsumexp(z, -1)
    valid = t != -100
    d = torch.where(valid[:, None], p, 0.0) / valid.sum()
    rows = valid.nonzero().squeeze(1)
    d[rows, t[rows]] -= 1.0 / valid.sum()
    gh, gw = d @ wd, d.t() @ hd
    order = _lowmem_triton.column_order(hid, w, None, torch.arange(n), valid.float()).long()
    onehot = torch.zeros_like(p, dtype=torch.bool)
    onehot[rows, t[rows]] = True
    q = torch.where(onehot | ~valid[:, None], 0.0, p)
    row_mass = torch.maximum(q.sum(1), (lse.abs() + 1.0) * sg.ROW_MASS_FLOOR)
    span = sg.MEAN_TILES * BN
    count = 0
    for c0 in range(chunk, n, 2 * chunk):
        for r0 in range(c0, min(n, c0 + 2 * chunk), BM):
            rr = torch.arange(r0, min(r0 + BM, c0 + 2 * chunk, n))
            for k0 in range(0, v, BN):
                cols = order[k0:k0 + BN]
                block = q[rr][:, cols]
                if (block < eps).all() and (block.sum(1) <= sg.SKIP_SHARE * row_mass[rr] * BN / v).all():
                    count += 1
                    left = torch.where(onehot[rr][:, cols], 0.0, d[rr][:, cols])
                    gh[rr] -= left @ wd[cols]
                    around = order[k0 // span * span:k0 // span * span + span]
                    gh[rr] += left.sum(1, keepdim=True) * wd[around].mean(0, keepdim=True)
                    gw[cols] -= left.t() @ hd[rr]
    return gh, gw, count


def _grads(hid, w, t, **kw):
    from liger_compat.kernels import fused_linear_cross_entropy

    ins = [x.detach().clone().requires_grad_(True) for x in (hid, w)]
    out = fused_linear_cross_entropy(ins[0], ins[1], t, compact_ignored=False, **kw)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    return (loss.detach(), *torch.autograd.grad(loss, ins))


def _grads64(hid, w, t):
    ins = [x.detach().double().requires_grad_(True) for x in (hid, w)]
    loss = torch.nn.functional.cross_entropy(ins[0] @ ins[1].t(), t, ignore_index=-100)
    return (loss.detach(), *torch.autograd.grad(loss, ins))


def _chunks_of(monkeypatch, rows, v):
    from liger_compat.kernels import loss

    monkeypatch.setattr(loss, "FLCE_CHUNK_BYTES_CPU", rows * 4 * v)


@pytest.mark.parametrize("seed", [0, 1])
def test_sparse_pass_matches_its_float64_simulation(seed, monkeypatch):
    """A dense first chunk of 32 rows (the probe) and sparse chunks of 64 after it: the pairs left
    out are the simulation's, and so are the gradients (the targets' own entries exact, left-out
    mass given back through the mean rows)."""
    from liger_compat.kernels import _sparse_grads_triton as sg

    hid, w, t = _inputs(seed, n=112)
    _chunks_of(monkeypatch, 32, w.shape[0])
    want_gh, want_gw, expected = _simulated(hid, w, t, 32, sg.SKIP_EPS)
    monkeypatch.setattr(sg, "last_pairs", None)
    loss, gh, gw = _grads(hid, w, t, sparse_grads=True)
    left, tested = sg.last_pairs
    assert tested == 5 * (w.shape[0] // BN)  # 80 rows after the probe: five blocks of rows, sparse
    assert sg.last_probe >= sg.SPARSE_MIN_SHARE
    assert expected >= 20 and int(left) == expected  # the inputs have such pairs
    ref_loss, *_ = _grads64(hid, w, t)
    assert abs(float(loss) - float(ref_loss)) <= 1e-3 * abs(float(ref_loss))
    assert rel_err(gh, want_gh) <= 2e-3 and rel_err(gw, want_gw) <= 2e-3  # fp16 operands, fp32 sums


def test_left_out_pairs_cost_nothing_against_the_dense_pass(monkeypatch):
    """The ruled-out tokens' pairs hold no gradient worth an fp16 ulp: against a float64 head the
    sparse pass's gradients are as accurate as the dense pass's."""
    from liger_compat.kernels import _sparse_grads_triton as sg

    hid, w, t = _inputs(2, n=96)
    _chunks_of(monkeypatch, 32, w.shape[0])
    ref = _grads64(hid, w, t)
    dense = _grads(hid, w, t)
    monkeypatch.setattr(sg, "last_pairs", None)
    sparse = _grads(hid, w, t, sparse_grads=True)
    assert int(sg.last_pairs[0]) > 0
    for got, base, want in zip(sparse[1:], dense[1:], ref[1:]):
        assert rel_err(got, want) <= 1.1 * rel_err(base, want) + 1e-4


def test_a_near_uniform_probe_keeps_the_pass_dense(monkeypatch):
    """Initialisation-like rows (a near-uniform softmax): the probe (the first chunk's first block
    of rows) leaves nothing out, so no chunk runs sparse; the gradients are those of a float64 head."""
    from liger_compat.kernels import _sparse_grads_triton as sg

    g = torch.Generator().manual_seed(7)
    hid = (0.5 * torch.randn(64, 32, generator=g)).half()
    w = (0.02 * torch.randn(1024, 32, generator=g)).half()
    t = torch.randint(0, 1024, (64,), generator=g)
    _chunks_of(monkeypatch, 16, 1024)
    monkeypatch.setattr(sg, "last_pairs", None)
    loss, gh, gw = _grads(hid, w, t, sparse_grads=True)
    assert sg.last_probe == 0.0 and sg.last_pairs is None
    ref = _grads64(hid, w, t)
    assert rel_err(gh, ref[1]) <= 2e-3 and rel_err(gw, ref[2]) <= 2e-3


def test_reduction_none_and_compacted_rows(monkeypatch):
    """Per-row losses (the gradients recomputed in the backward, scaled by a grad_output with
    negative and zero entries) and ignored rows compacted away: the sparse pass's gradients match
    the dense pass's as closely as each matches a float64 head."""
    from liger_compat.kernels import _sparse_grads_triton as sg
    from liger_compat.kernels import fused_linear_cross_entropy

    hid, w, t = _inputs(3, n=80)
    _chunks_of(monkeypatch, 32, w.shape[0])
    g_out = torch.randn(80, generator=torch.Generator().manual_seed(4))
    g_out[::7] = 0.0

    def run(**kw):
        ins = [x.detach().clone().requires_grad_(True) for x in (hid, w)]
        rows = fused_linear_cross_entropy(ins[0], ins[1], t, reduction="none", compact_ignored=True, **kw)
        return torch.autograd.grad(rows, ins, g_out)

    h64, w64 = hid.double().requires_grad_(True), w.double().requires_grad_(True)
    rows64 = torch.nn.functional.cross_entropy(h64 @ w64.t(), t, ignore_index=-100, reduction="none")
    ref = torch.autograd.grad(rows64, (h64, w64), g_out.double())
    dense = run()
    monkeypatch.setattr(sg, "last_pairs", None)
    sparse = run(sparse_grads=True)
    assert int(sg.last_pairs[0]) > 0
    for got, base, want in zip(sparse, dense, ref):
        assert rel_err(got, want) <= 1.1 * rel_err(base, want) + 1e-4


@pytest.mark.parametrize("opts", [{"label_smoothing": 0.1}, {"lse_square_scale": 1e-3}, {"bias": True},
                                  {"return_token_accuracy": True}])
def test_the_dense_pass_runs_where_the_sparse_one_does_not_apply(opts, monkeypatch):
    """Label smoothing and z-loss (a dense gradient by definition), a bias, and token accuracy (the
    argmax's first index in the vocabulary's own order): no sparse pass runs."""
    from liger_compat.kernels import _sparse_grads_triton as sg
    from liger_compat.kernels import fused_linear_cross_entropy

    hid, w, t = _inputs(5)
    opts = dict(opts)
    if opts.pop("bias", False):
        opts["bias"] = torch.zeros(w.shape[0], dtype=w.dtype)
    monkeypatch.setattr(sg, "last_pairs", None)
    fused_linear_cross_entropy(hid.requires_grad_(True), w, t, sparse_grads=True, **opts)
    assert sg.last_pairs is None


def test_sparse_grads_must_be_a_bool_or_none():
    from liger_compat.kernels import fused_linear_cross_entropy

    hid, w, t = _inputs(6)
    with pytest.raises(ValueError, match="sparse_grads must be True, False or None"):
        fused_linear_cross_entropy(hid, w, t, sparse_grads="yes")


def test_the_setting_decides_a_call_that_names_no_sparse_grads(monkeypatch):
    """``LIGER_COMPAT_FLCE_SPARSE_GRADS`` (how a patched model's loss gets it: it names no
    ``sparse_grads``): on, the call runs the sparse pass of ``sparse_grads=True``, the same pairs
    left out and the same gradients; off, the dense pass of ``sparse_grads=False``. An explicit
    ``sparse_grads=False`` wins over the setting on (an explicit True with the setting off is what
    every other test here runs)."""
    from liger_compat import _config
    from liger_compat.kernels import _sparse_grads_triton as sg

    hid, w, t = _inputs(int(torch.randint(0, 2**16, ())), n=112)
    _chunks_of(monkeypatch, 32, w.shape[0])

    def run(setting, **kw):
        monkeypatch.setattr(_config.settings, "flce_sparse_grads", setting)
        monkeypatch.setattr(sg, "last_pairs", None)
        got = _grads(hid, w, t, **kw)
        return got, None if sg.last_pairs is None else int(sg.last_pairs[0])

    on, on_pairs = run(True)
    explicit, explicit_pairs = run(True, sparse_grads=True)
    dense, dense_pairs = run(True, sparse_grads=False)
    off, off_pairs = run(False)
    assert on_pairs is not None and on_pairs > 0  # the inputs have pairs to leave out
    assert on_pairs == explicit_pairs and dense_pairs is None and off_pairs is None
    for a, b in zip(on, explicit):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(off, dense):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_graphed_call_stays_dense_under_the_setting(monkeypatch):
    """A call whose pass may replay as a CUDA graph (a small, host-bound loss on a GPU) stays dense
    with the setting on: the sparse pass reads its probe on the host, which a graph cannot."""
    from liger_compat import _config
    from liger_compat.kernels import _sparse_grads_triton as sg
    from liger_compat.kernels import loss

    hid, w, t = _inputs(7, n=112)
    _chunks_of(monkeypatch, 32, w.shape[0])
    monkeypatch.setattr(_config.settings, "flce_sparse_grads", True)
    seen = []

    def graphable(h, w_, backend, knobs):
        seen.append(knobs.sparse_grads)
        return True

    monkeypatch.setattr(loss, "_graphable", graphable)
    monkeypatch.setattr(loss, "_graphed_pass", lambda *a, **k: None)  # runs eagerly: no CUDA here
    monkeypatch.setattr(sg, "last_pairs", None)
    _grads(hid, w, t)
    assert seen and sg.last_pairs is None


def test_tile_lists_match_the_kept_pairs():
    from liger_compat.kernels import _sparse_grads_triton as sg

    g = torch.Generator().manual_seed(8)
    keep = (torch.rand(5, 37, generator=g) < 0.3).to(torch.int32)
    by_rows, cnt_rows, by_tiles, cnt_tiles = sg.tile_lists(keep)
    for r in range(5):
        assert by_rows[r, :cnt_rows[r]].tolist() == keep[r].nonzero().squeeze(1).tolist()
    for c in range(37):
        assert by_tiles[c, :cnt_tiles[c]].tolist() == keep[:, c].nonzero().squeeze(1).tolist()
