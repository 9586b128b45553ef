"""``LIGER_COMPAT_FLCE_FP32_GRAD_WEIGHT``: grad_weight's fp32 sum in the chunked fused loss, rounded
once, with its target terms exact (``kernels/_target_terms_triton.py``, the row kernel's
``target_res``).

Under ``TRITON_INTERPRET=1`` (``test_interpret.py`` re-runs this module so) on fp16 (the
interpreter converts to bf16 by truncation, to fp16 to nearest, as a GPU does to both): the kernel
against float64 sums, the residuals against the torch reference's fp32 gradient, and the loss's
grad_weight against a float64 head. In a normal pytest run there is no Triton path and the tests are
skipped.
"""

from __future__ import annotations

import pytest
import torch

from harness import interpreting
from reference64 import rel_err

pytestmark = pytest.mark.skipif(not interpreting(), reason="the Triton kernels run only under TRITON_INTERPRET=1")


def _seed() -> int:
    return int(torch.randint(0, 2**16, ()))


@pytest.mark.parametrize("dtype,deterministic", [(torch.float16, False), (torch.float32, False),
                                                 (torch.float32, True)])
@pytest.mark.parametrize("indexed", [False, True])
def test_add_target_terms_sums_each_target_once(dtype, deterministic, indexed):
    """``gw[t_i] += r_i * h_i`` over rows with repeated, ignored (-100) and out-of-range targets: each
    target row gets the float64 sum of its terms rounded once (fp16, one run of equal targets a
    program) or to fp32 precision (by atomics, or with torch's deterministic algorithms on by runs);
    every other row is untouched, bit for bit."""
    from liger_compat.kernels._target_terms_triton import add_target_terms

    g = torch.Generator().manual_seed(_seed())
    m, v, hdim = 41, 53, 37
    t = torch.randint(0, 9, (m,), generator=g) * 5  # repeated targets, spread over the rows
    t[torch.rand(m, generator=g) < 0.2] = -100
    t[3] = v + 2  # out of range: no term
    res = torch.randn(m, generator=g) * 1e-2
    gw = torch.randn(v, hdim, generator=g).to(dtype)
    if indexed:
        h = torch.randn(2 * m, hdim, generator=g).to(torch.float16)
        row_index = torch.randperm(2 * m, generator=g)[:m]
        hsel = h[row_index]
    else:
        h = hsel = torch.randn(m, hdim, generator=g).to(torch.float16)
        row_index = None
    ref = gw.double().clone()
    terms = torch.zeros(v, hdim, dtype=torch.float64)
    ok = (t >= 0) & (t < v)
    products = res[ok].double()[:, None] * hsel[ok].double()  # each row's term
    terms.index_add_(0, t[ok], products)
    ref += terms
    got = gw.clone()
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        add_target_terms(got, h, t, res, row_index)
    finally:
        torch.use_deterministic_algorithms(prev)
    touched = torch.zeros(v, dtype=torch.bool)
    touched[t[ok]] = True
    assert torch.equal(got[~touched], gw[~touched])
    if dtype == torch.float32:
        assert ((got[touched].double() - ref[touched]).abs() <= 1e-6 * (ref[touched].abs() + terms[touched].abs().sum())).all()
    else:  # one rounding: within half an fp16 unit of the float64 value, and fp32's summation error,
        # which is relative to the summands (where gw and the terms nearly cancel, not to the sum)
        r = ref[touched]
        summands = gw.double().abs()
        summands.index_add_(0, t[ok], products.abs())
        ulp = torch.finfo(torch.float16).eps * 2.0 ** torch.floor(torch.log2(r.abs().clamp_min(2.0**-14)))
        assert ((got[touched].double() - r).abs() <= 0.5 * ulp * (1 + 1e-3) + 1e-6 * summands[touched]).all()
        assert not torch.equal(got[touched], gw[touched])


@pytest.mark.parametrize("variant", ["split", "row"])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_row_kernel_hands_over_each_target_entrys_rounding(variant, softcap):
    """``target_res``: each row's target entry of the gradient in fp32 minus the value stored in
    fp16, 0 for ignored rows. The fp32 entry is the one the same kernel stores into an fp32 gradient
    (the difference of two values that close is exact in fp32), and it is the torch reference's from
    the same logits within fp32's evaluation error."""
    from liger_compat.kernels._ce_triton import ce_rows_triton
    from liger_compat.kernels.loss import CEOptions, ce_rows_torch

    g = torch.Generator().manual_seed(_seed())
    c, v = 29, 300
    logits = (torch.randn(c, v, generator=g) * 3).to(torch.float16)
    t = torch.randint(0, v, (c,), generator=g)
    t[torch.rand(c, generator=g) < 0.2] = -100
    opt = CEOptions(softcap=softcap)
    scale = torch.tensor(1.0 / 7)
    d_ref = torch.empty(c, v)
    ce_rows_torch(logits.clone(), t, opt, scale=scale, grad=d_ref)
    d32 = torch.empty(c, v)
    ce_rows_triton(logits.clone(), t, opt, scale=scale, grad=d32, variant=variant)
    grad = torch.empty_like(logits)
    res = torch.full((c,), float("nan"))
    ce_rows_triton(logits.clone(), t, opt, scale=scale, grad=grad, variant=variant, target_res=res)
    keep = t != -100
    rows = torch.arange(c)[keep]
    dt = d32[rows, t[keep]]
    stored = grad[rows, t[keep]].float()
    assert torch.equal(res[~keep], torch.zeros_like(res[~keep]))
    assert torch.equal(res[keep], dt - stored)
    assert (res[keep].abs() <= torch.finfo(torch.float16).eps * dt.abs()).all()  # a rounding's residual
    assert ((dt.double() - d_ref[rows, t[keep]].double()).abs() <= 1e-4 * dt.abs()).all()


def _init_like(seed, n, hdim, v, ignored=0.1):
    """Near-uniform logits (as at initialisation): the target entries ``p_t - 1`` are grad_weight's
    largest terms, and the logits' own fp16 rounding is negligible beside grad_weight's."""
    g = torch.Generator().manual_seed(seed)
    h = (0.5 * torch.randn(n, hdim, generator=g)).half()
    w = (0.02 * torch.randn(v, hdim, generator=g)).half()
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignored] = -100
    return h, w, t


def _grads(h, w, t, **kw):
    from liger_compat.kernels import fused_linear_cross_entropy

    a, b = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = fused_linear_cross_entropy(a, b, t, mode="chunked", **kw)
    return (loss.detach(), *torch.autograd.grad(loss, (a, b)))


def _gw64(h, w, t):
    b = w.double().requires_grad_(True)
    (gw,) = torch.autograd.grad(torch.nn.functional.cross_entropy(h.double() @ b.t(), t, ignore_index=-100), b)
    return gw


@pytest.mark.parametrize("compact", [False, True])
def test_fp32_grad_weight_is_one_rounding_of_exact_target_terms(monkeypatch, compact):
    """``LIGER_COMPAT_FLCE_FP32_GRAD_WEIGHT``: grad_weight over four chunks is one fp32 product of
    every chunk's kept gradient plus the exact target terms, rounded once: within 1.15x the error of
    rounding the float64 result itself (the default's one rounding a chunk and fp16 target entries
    are about 1.5x), the same bits as over one chunk, and as near over two products of two chunks
    each (:data:`EXACT_GW_ROWS` 96); loss and grad_hidden are the default's."""
    from liger_compat import _config
    from liger_compat.kernels import loss as loss_mod
    from liger_compat.kernels import last_backend

    n, hdim, v = 192, 128, 384
    h, w, t = _init_like(_seed(), n, hdim, v)
    gw64 = _gw64(h, w, t)
    out = {}
    for fp32, rows, kept in ((False, 48, n), (True, 48, n), (True, n, n), (True, 48, 96)):
        monkeypatch.setattr(_config.settings, "flce_fp32_grad_weight", fp32)
        monkeypatch.setattr(loss_mod, "FLCE_CHUNK_BYTES_CPU", 4 * v * rows)
        monkeypatch.setattr(loss_mod, "EXACT_GW_ROWS", kept)
        out[fp32, rows, kept] = _grads(h, w, t, compact_ignored=compact)
    if last_backend["fused_linear_cross_entropy"] != "triton":
        pytest.skip("the Triton path's (TRITON_INTERPRET=1 runs it on CPU)")
    one = out[True, 48, n]
    assert torch.equal(one[0], out[False, 48, n][0]) and torch.equal(one[1], out[False, 48, n][1])
    assert torch.equal(one[2], out[True, n, n][2])
    assert one[2].dtype == torch.float16
    floor = rel_err(gw64.half(), gw64)
    assert rel_err(one[2], gw64) <= 1.15 * floor
    # two products of 96 rows' kept gradients, summed in fp32: the same rounding once
    assert rel_err(out[True, 48, 96][2], gw64) <= 1.15 * floor
