"""fused_linear_cross_entropy and cross_entropy against a float64 torch reference (CPU path)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from liger_compat import _config
from liger_compat.kernels import CrossEntropyOutput, cross_entropy, fused_linear_cross_entropy, last_backend
from harness import examples, expected_backend, record_ops, tolerance
from reference64 import ce64, ce_grad_terms, ce_units, rel_err

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
F32_EPS = torch.finfo(torch.float32).eps


def _inputs(seed, n, h, v, dtype, ignore_frac, with_bias):
    g = torch.Generator().manual_seed(seed)
    hid = (torch.randn(n, h, generator=g) * 2.0).to(dtype)
    w = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    b = (torch.randn(v, generator=g) * 0.5).to(dtype) if with_bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignore_frac] = -100
    return hid, w, b, t


options = st.fixed_dictionaries(
    {
        "reduction": st.sampled_from(["mean", "sum", "none"]),
        "label_smoothing": st.sampled_from([0.0, 0.1]),
        "lse_square_scale": st.sampled_from([0.0, 1e-3]),
        "softcap": st.sampled_from([None, 4.0]),
    }
)


@settings(max_examples=examples(25), deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 37),
    h=st.integers(1, 45),
    v=st.integers(2, 301),
    dt=st.sampled_from(list(DT)),
    opts=options,
    with_bias=st.booleans(),
    ignore_frac=st.sampled_from([0.0, 0.3]),
    cpu_native=st.booleans(),
)
def test_flce_matches_float64(seed, n, h, v, dt, opts, with_bias, ignore_frac, cpu_native):
    """Both CPU paths (``LIGER_COMPAT_CPU_NATIVE``: on, the dense torch ops; off, the chunked reference;
    under the interpreter the Triton kernels either way)."""
    hid, w, b, t = _inputs(seed, n, h, v, DT[dt], ignore_frac, with_bias)
    hid.requires_grad_(True)
    w.requires_grad_(True)
    if b is not None:
        b.requires_grad_(True)
    saved, _config.settings.cpu_native = _config.settings.cpu_native, cpu_native
    try:
        out = fused_linear_cross_entropy(hid, w, t, bias=b, return_token_accuracy=True, return_z_loss=True, **opts)
    finally:
        _config.settings.cpu_native = saved
    assert last_backend["fused_linear_cross_entropy"] == expected_backend()
    assert not (out.z_loss.requires_grad or out.token_accuracy.requires_grad)
    assert isinstance(out, CrossEntropyOutput)

    h64 = hid.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    b64 = b.detach().double().requires_grad_(True) if b is not None else None
    logits = h64 @ w64.T + (b64 if b64 is not None else 0)
    if dt != "fp32":
        # the head as transformers computes it in this dtype: logits rounded to it, the loss in
        # float64 from there (gradients pass the rounding unchanged). Without this, the 1/256
        # rounding of bf16 logits decides tiny-gradient corner cases (one row, two classes,
        # label smoothing: softmax - smoothed target ~ 0) that HYPOTHESIS_PROFILE=explore finds
        logits = logits + (logits.to(DT[dt]).double() - logits).detach()
    logits.retain_grad()
    ref, zref, acc_ref = ce64(logits, t, **opts)

    # logits sum h products, the loss and its statistics sum v terms per row
    tol = tolerance(DT[dt], n=max(h, v))
    unit, z_unit = ce_units(logits, t, **opts)
    assert torch.isfinite(out.loss).all()
    assert rel_err(out.loss, ref, unit) <= tol
    assert rel_err(out.z_loss, zref, z_unit) <= tol
    if dt == "fp32":  # argmax ties are not a concern with fp32 random data
        assert torch.allclose(out.token_accuracy.double(), acc_ref, rtol=0, atol=F32_EPS)  # a ratio of counts

    g = torch.randn(ref.shape, dtype=torch.float64) if opts["reduction"] == "none" else torch.tensor(1.7, dtype=torch.float64)
    (out.loss.double() * g).sum().backward()
    (ref * g).sum().backward()
    # Each gradient is a sum over rows or classes of d loss / d logits times an input; where its
    # terms cancel, an error relative to the (small) sum measures the cancellation, not the kernel.
    # So the error is taken relative to the sum of the terms' magnitudes (the usual componentwise
    # bound for sums; it equals the plain relative error when nothing cancels), d loss / d logits
    # itself included (softmax - target: see ce_grad_terms).
    d = ce_grad_terms(logits, t, g, **opts)
    units = {"hidden": d @ w64.detach().abs(), "weight": d.T @ h64.detach().abs(), "bias": d.sum(0)}
    for name, mine, theirs in (("hidden", hid, h64), ("weight", w, w64), ("bias", b, b64)):
        if mine is None:
            continue
        assert mine.grad.dtype == mine.dtype
        unit = max(units[name].norm().item(), theirs.grad.norm().item(), 1e-300)
        err = (mine.grad.double() - theirs.grad).norm().item() / unit
        assert err <= tol, (name, err, rel_err(mine.grad, theirs.grad))


def test_flce_chunked_equals_single_chunk(monkeypatch):
    """Many chunks (rows split across the chunk loop) give the same loss and gradients."""
    import liger_compat.kernels.loss as ce_mod

    hid, w, _, t = _inputs(3, 50, 16, 97, torch.float32, 0.2, False)
    res = []
    for budget in (4 * 97 * 7, 2**24):  # 7 rows per chunk vs all rows at once
        monkeypatch.setattr(ce_mod, "FLCE_CHUNK_BYTES_CPU", budget)
        hh = hid.clone().requires_grad_(True)
        ww = w.clone().requires_grad_(True)
        loss = fused_linear_cross_entropy(hh, ww, t)
        loss.backward()
        res.append((loss.detach(), hh.grad, ww.grad))
    for a, b in zip(*res):  # the same fp32 sums in another order: rows of 97 logits, 50 rows
        assert rel_err(a, b) <= tolerance(torch.float32, n=97 + 50)


def test_flce_num_items_in_batch_and_3d_shapes():
    hid, w, _, t = _inputs(5, 24, 8, 33, torch.float32, 0.25, False)
    hid3, t2 = hid.view(2, 12, 8), t.view(2, 12)
    loss = fused_linear_cross_entropy(hid3, w, t2, num_items_in_batch=torch.tensor(40))
    ref, _, _ = ce64(hid.double() @ w.double().T, t, num_items_in_batch=40)
    assert rel_err(loss, ref) <= tolerance(torch.float32, n=33)
    per_row = fused_linear_cross_entropy(hid3, w, t2, reduction="none")
    assert per_row.shape == (2, 12)


@pytest.mark.parametrize("cpu_native", [False, True])
def test_flce_all_ignored_is_zero_not_nan(monkeypatch, cpu_native):
    monkeypatch.setattr(_config.settings, "cpu_native", cpu_native)
    hid, w, b, t = _inputs(7, 9, 6, 13, torch.float32, 0.0, True)
    t[:] = -100
    hid.requires_grad_(True)
    w.requires_grad_(True)
    b.requires_grad_(True)
    out = fused_linear_cross_entropy(hid, w, t, bias=b, return_token_accuracy=True, lse_square_scale=1e-3)
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert out.token_accuracy.item() == 0.0
    for x in (hid, w, b):
        assert torch.isfinite(x.grad).all() and x.grad.abs().max() == 0


@pytest.mark.parametrize("cpu_native", [False, True])
def test_flce_no_grad_inputs(monkeypatch, cpu_native):
    monkeypatch.setattr(_config.settings, "cpu_native", cpu_native)
    hid, w, _, t = _inputs(11, 6, 5, 17, torch.float32, 0.0, False)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hid, w, t)
    ref, _, _ = ce64(hid.double() @ w.double().T, t)
    assert rel_err(loss, ref) <= tolerance(torch.float32, n=17)


@settings(max_examples=examples(15), deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 29),
    v=st.integers(2, 513),
    dt=st.sampled_from(list(DT)),
    opts=options,
    ignore_frac=st.sampled_from([0.0, 0.3]),
)
def test_cross_entropy_matches_float64(seed, n, v, dt, opts, ignore_frac):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * 3).to(DT[dt]).requires_grad_(True)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignore_frac] = -100
    out = cross_entropy(logits, t, return_z_loss=True, return_token_accuracy=True, **opts)
    assert last_backend["cross_entropy"] == expected_backend()
    l64 = logits.detach().double().requires_grad_(True)
    ref, zref, acc = ce64(l64, t, **opts)
    tol = tolerance(DT[dt], n=v)
    unit, z_unit = ce_units(l64, t, **opts)
    assert rel_err(out.loss, ref, unit) <= tol
    assert rel_err(out.z_loss, zref, z_unit) <= tol
    if dt == "fp32":
        assert torch.allclose(out.token_accuracy.double(), acc, rtol=0, atol=F32_EPS)  # a ratio of counts
    gout = torch.rand(ref.shape, dtype=torch.float64) + 0.5
    (out.loss.double() * gout).sum().backward()
    (ref * gout).sum().backward()
    assert logits.grad.dtype == logits.dtype
    err = rel_err(logits.grad, l64.grad, ce_grad_terms(l64, t, gout, **opts).norm().item())
    assert err <= tol, err


def test_out_of_range_target_unchecked_gives_nan_not_a_crash():
    """Without the (debug / CPU) range check the row kernel masks the bad target: NaN loss, zero
    gradient, and the target recorded in the flag (count, largest >= V, smallest negative)."""
    from liger_compat.kernels.loss import CEOptions, _ce_rows

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 19, generator=g)
    t = torch.tensor([3, 19, -100, -7])
    bad = torch.zeros(3, dtype=torch.int64)
    loss, zl, lse, correct = _ce_rows(expected_backend(), logits, t, CEOptions(), bad=bad)
    assert torch.isnan(loss[1]) and torch.isnan(loss[3])
    assert loss[2] == 0 and torch.isfinite(loss[0])
    assert bad.tolist() == [2, 19, -7]
    assert rel_err(lse, torch.logsumexp(logits.double(), -1)) <= tolerance(torch.float32, n=19)
    grad = torch.empty_like(logits)
    _ce_rows(expected_backend(), logits, t, CEOptions(), scale=torch.tensor(1.0), grad=grad, lse=lse)
    assert torch.isfinite(grad).all() and grad[1:].abs().max() == 0
    assert grad[0].abs().max() > 0


@pytest.mark.parametrize("variant", ["row", "split"])
def test_triton_row_kernel_variants_agree_with_reference(variant):
    """Both Triton CE row kernels (one program per row / rows split over programs)."""
    if expected_backend() != "triton":
        pytest.skip("runs under TRITON_INTERPRET=1 (test_interpret.py)")
    from liger_compat.kernels._ce_triton import ce_rows_triton
    from liger_compat.kernels.loss import CEOptions, ce_rows_torch

    g = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 1100, generator=g) * 4
    t = torch.tensor([3, 1099, -100, 0, 512])
    opt = CEOptions(label_smoothing=0.1, lse_square_scale=1e-3, softcap=7.0)
    scale = torch.rand(5, generator=g)
    mine = ce_rows_triton(logits, t, opt, variant=variant)
    ref = ce_rows_torch(logits, t, opt)
    tol = tolerance(torch.float32, n=1100)  # two fp32 reductions over the 1100 logits of a row
    for a, b in zip(mine, ref):
        assert a.dtype == b.dtype and rel_err(a, b) <= tol
    ga, gb = torch.empty_like(logits), torch.empty_like(logits)
    ce_rows_triton(logits, t, opt, scale=scale, grad=ga, lse=mine[2], variant=variant)
    ce_rows_torch(logits, t, opt, scale=scale, grad=gb, lse=ref[2])
    assert rel_err(ga, gb) <= tol


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_flce_triton_driver_chunks_and_compaction(monkeypatch, reduction, compact):
    """The GPU driver: several chunks, ignored rows computed (the default) or compacted away
    (``compact_ignored=True``); fp32: the cuBLAS logits."""
    if expected_backend() != "triton":
        pytest.skip("runs under TRITON_INTERPRET=1 (test_interpret.py)")
    import liger_compat.kernels.loss as ce_mod

    monkeypatch.setattr(ce_mod, "FLCE_CHUNK_BYTES_CPU", 4 * 70 * 9)  # 9 rows per chunk
    hid, w, b, t = _inputs(13, 40, 24, 70, torch.float32, 0.3, True)
    ps = [x.clone().requires_grad_(True) for x in (hid, w, b)]
    loss = fused_linear_cross_entropy(ps[0], ps[1], t, bias=ps[2], reduction=reduction, lse_square_scale=1e-3,
                                      compact_ignored=compact)
    p64 = [x.double().requires_grad_(True) for x in (hid, w, b)]
    ref, _, _ = ce64(p64[0] @ p64[1].T + p64[2], t, reduction=reduction, lse_square_scale=1e-3)
    gout = torch.rand(ref.shape, dtype=torch.float64) + 0.5
    (loss.double() * gout).sum().backward()
    (ref * gout).sum().backward()
    tol = tolerance(torch.float32, n=70)
    assert rel_err(loss, ref) <= tol
    for mine, theirs in zip(ps, p64):
        assert rel_err(mine.grad, theirs.grad) <= tol
    assert (ps[0].grad[t == -100] == 0).all()


#: torch operations the eager fused loss issues from Python for each chunk beyond the first (forward
#: and backward, Triton launches not counted): each costs the host ~5-20 us on a GPU, which a
#: host-bound small step pays in full. 23 with the statistics written in place; 33 when each chunk's
#: loss, z-loss and hit rows were copied out of new tensors and the kernel's scratch was indexed
#: row by row.
FLCE_OPS_PER_CHUNK = 23
#: the same for what a call issues once (checks, reduction scale, output, backward scaling); 30 when
#: unasked z-loss and accuracy outputs were filled with zeros and grad_output was converted first
FLCE_OPS_PER_CALL = 24


def _flce_host_ops(monkeypatch, chunks: int, rows: int, **kw):
    """The torch operations (by name) of one warm eager fused-loss forward + backward of ``chunks``
    chunks of ``rows`` rows on the Triton path, those inside the Triton interpreter's launches left out."""
    import collections

    import liger_compat.kernels.loss as ce_mod

    v = 64
    monkeypatch.setattr(ce_mod, "FLCE_CHUNK_BYTES_CPU", 4 * v * rows)
    hid, w, _, t = _inputs(5, rows * chunks, 16, v, torch.float16, 0.0, False)
    hid.requires_grad_(True)
    w.requires_grad_(True)
    fused_linear_cross_entropy(hid, w, t, compact_ignored=False, **kw).backward()  # warm: first-call work
    with record_ops(monkeypatch) as rec:
        fused_linear_cross_entropy(hid, w, t, compact_ignored=False, **kw).backward()
    return collections.Counter(rec.ops)


def test_flce_host_operations_per_chunk(monkeypatch):
    """The eager fused loss's host work on the Triton path is bounded: a fixed number of torch
    operations per extra chunk (no copy of its statistics, no per-row indexing) and per call (no
    operation for an output nobody asked for)."""
    if expected_backend() != "triton":
        pytest.skip("runs under TRITON_INTERPRET=1 (test_interpret.py)")
    two, three = (_flce_host_ops(monkeypatch, k, 9) for k in (2, 3))
    per_chunk = sum(three.values()) - sum(two.values())
    per_call = sum(two.values()) - 2 * per_chunk
    assert per_chunk <= FLCE_OPS_PER_CHUNK, (three - two)
    assert per_call <= FLCE_OPS_PER_CALL, two
    # the chunks' statistics land in their rows: the only copy a chunk makes is its grad_hidden rows'
    assert three["copy_"] - two["copy_"] == 1, (three - two)
    # zeros: the out-of-range flag, and one scratch per chunk
    assert three["zeros"] == 1 + 3 and not three["new_zeros"] and not three["fill_"], three


#: torch operations that launch nothing on a GPU (allocation without a fill, views)
_NO_LAUNCH = {"empty", "empty_strided", "view", "_unsafe_view", "slice", "select", "t", "transpose", "squeeze",
              "unsqueeze", "as_strided", "detach", "alias", "expand", "reshape", "lift_fresh"}


def test_flce_compaction_queues_the_logits_gemm_before_it_reads_the_count(monkeypatch):
    """With ``compact_ignored=True`` the pass reads the kept rows' count on the host. It sorts the
    kept rows first and queues the first chunk's gathered rows and logits GEMM before that read, so
    a GPU waits on no small launch (``nonzero`` first, as before, drained its queue and left it idle
    while the host caught up); the zero fills of the skipped rows come after the GEMM."""
    if expected_backend() != "triton":
        pytest.skip("runs under TRITON_INTERPRET=1 (test_interpret.py)")
    import liger_compat.kernels.loss as ce_mod

    v = 64
    monkeypatch.setattr(ce_mod, "FLCE_CHUNK_BYTES_CPU", 4 * v * 8)  # 8 rows a chunk
    hid, w, _, t = _inputs(int(torch.randint(0, 2**31, ())), 30, 16, v, torch.float32, 0.0, False)
    t[torch.randperm(30)[:7]] = -100
    hid.requires_grad_(True)
    w.requires_grad_(True)
    with record_ops(monkeypatch) as rec:
        out = fused_linear_cross_entropy(hid, w, t, compact_ignored=True, return_token_accuracy=True,
                                         reduction="none")
    ops = rec.ops
    assert "nonzero" not in ops, ops
    first_mm, read = ops.index("mm"), ops.index("_local_scalar_dense", ops.index("sort"))
    assert first_mm < read, ops[:read + 1]
    # between the sort and the GEMM: the count's subtraction and the first chunk's gather, no fill
    launched = [o for o in ops[ops.index("sort") + 1:first_mm] if o not in _NO_LAUNCH]
    assert launched == ["sum", "rsub", "index_select"], launched
    assert "zero_" in ops[first_mm:] and "zeros" not in ops[ops.index("sort"):first_mm]
    # the skipped rows still read 0, the kept ones as the uncompacted pass has them
    ref = fused_linear_cross_entropy(hid.detach(), w.detach(), t, compact_ignored=False, return_token_accuracy=True,
                                     reduction="none")
    ignored = t == -100
    assert torch.equal(out.loss[ignored], torch.zeros(7)) and not out.token_accuracy[ignored].any()
    assert torch.allclose(out.loss[~ignored], ref.loss[~ignored], rtol=1e-5, atol=1e-6)
    out.loss.sum().backward()
    assert torch.equal(hid.grad[ignored], torch.zeros(7, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kept", ["none", "fewer_than_the_first_gemm", "fewer_than_a_chunk", "several_chunks", "all"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_flce_compaction_by_number_of_kept_rows(monkeypatch, dtype, kept, reduction):
    """The compacting pass queues its first chunk's first rows' GEMM before it knows how many rows
    are kept, then the chunk's other rows as far as the kept ones reach. With none kept, fewer than
    that first GEMM's rows, fewer than a chunk, several chunks, or every row: loss, z-loss, accuracy
    and both gradients match the float64 reference; the ignored rows' loss and grad_hidden are
    exactly 0. fp32: cuBLAS's logits with a bias; fp16: the Triton logits GEMM, whose per-tile
    partials the two GEMMs write in one buffer, cut with the chunk."""
    if expected_backend() != "triton":
        pytest.skip("runs under TRITON_INTERPRET=1 (test_interpret.py)")
    import liger_compat.kernels.loss as ce_mod

    v, n, hdim, rows, first = 96, 40, 32, 16, 6
    monkeypatch.setattr(ce_mod, "FLCE_CHUNK_BYTES_CPU", 4 * v * rows)
    monkeypatch.setattr(ce_mod, "FIRST_GEMM_ROWS", first)
    hid, w, bias, t = _inputs(int(torch.randint(0, 2**31, ())), n, hdim, v, dtype, 0.0, dtype == torch.float32)
    count = {"none": 0, "fewer_than_the_first_gemm": int(torch.randint(1, first, ())),
             "fewer_than_a_chunk": int(torch.randint(first + 1, rows, ())),
             "several_chunks": int(torch.randint(rows + 1, n, ())), "all": n}[kept]
    ignored = torch.ones(n, dtype=torch.bool)
    ignored[torch.randperm(n)[:count]] = False
    t[ignored] = -100
    from liger_compat.kernels import _logits_triton

    gemms = []
    real = _logits_triton.logits_with_partials
    monkeypatch.setattr(_logits_triton, "logits_with_partials", lambda hc, *a, **k: gemms.append(len(hc)) or real(hc, *a, **k))
    ps = [x.clone().requires_grad_(True) for x in (hid, w, bias) if x is not None]
    out = fused_linear_cross_entropy(ps[0], ps[1], t, bias=ps[2] if bias is not None else None, reduction=reduction, lse_square_scale=1e-3,
                                     return_z_loss=True, return_token_accuracy=True, compact_ignored=True)
    if dtype == torch.float16:  # the first chunk's GEMM: its first rows, then the others up to the kept ones
        assert gemms[:2] == ([first, min(count, rows) - first] if count > first else [first]), gemms
    else:
        assert not gemms
    p64 = [x.double().requires_grad_(True) for x in (hid, w, bias) if x is not None]
    ref, zl, acc = ce64(p64[0] @ p64[1].T + (p64[2] if bias is not None else 0), t, reduction=reduction, lse_square_scale=1e-3)
    if count == 0:  # no kept row: what the uncompacted pass gives (its mean over none is 0), no gradient
        dense = fused_linear_cross_entropy(hid, w, t, bias=bias, reduction=reduction, lse_square_scale=1e-3,
                                           return_z_loss=True, return_token_accuracy=True, compact_ignored=False)
        assert all(torch.equal(a, b) for a, b in zip(out, dense)), (out, dense)
        out.loss.sum().backward()
        assert not any(x.grad.any() for x in ps)
        return
    gout = torch.rand(ref.shape, dtype=torch.float64) + 0.5
    (out.loss.double() * gout).sum().backward()
    (ref * gout).sum().backward()
    tol = tolerance(dtype, n=v)
    assert rel_err(out.loss, ref) <= tol and rel_err(out.z_loss, zl) <= tol
    assert (out.token_accuracy.double() - acc).abs().sum().item() <= (1.0 if reduction == "none" else 1.0 / max(count, 1))
    for mine, theirs in zip(ps, p64):
        if theirs.grad.abs().max() == 0:
            assert torch.equal(mine.grad, torch.zeros_like(mine.grad))
        else:
            assert rel_err(mine.grad, theirs.grad) <= tol
    assert torch.equal(ps[0].grad[ignored], torch.zeros(int(ignored.sum()), hdim, dtype=dtype))
    if reduction == "none":
        assert torch.equal(out.loss[ignored], torch.zeros(int(ignored.sum())))


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_flce_statistics_written_in_place_over_chunks(monkeypatch, reduction):
    """Several uncompacted chunks on the Triton path: each row's loss, z-loss and token accuracy
    (written into the whole batch's rows by the row kernel) against the float64 reference."""
    if expected_backend() != "triton":
        pytest.skip("runs under TRITON_INTERPRET=1 (test_interpret.py)")
    import liger_compat.kernels.loss as ce_mod

    monkeypatch.setattr(ce_mod, "FLCE_CHUNK_BYTES_CPU", 4 * 70 * 7)  # 7 rows per chunk
    hid, w, _, t = _inputs(31, 30, 20, 70, torch.float32, 0.3, False)
    out = fused_linear_cross_entropy(hid, w, t, reduction=reduction, lse_square_scale=1e-2,
                                     return_token_accuracy=True, return_z_loss=True, compact_ignored=False)
    ref, zl, acc = ce64(hid.double() @ w.double().T, t, reduction=reduction, lse_square_scale=1e-2)
    tol = tolerance(torch.float32, n=70)
    assert rel_err(out.loss, ref) <= tol and rel_err(out.z_loss, zl) <= tol
    kept = int((t != -100).sum())
    assert (out.token_accuracy.double() - acc).abs().sum().item() <= (1.0 if reduction == "none" else 1.0 / kept)


def _bf16_dot_under_the_interpreter(monkeypatch):
    """Let the bf16 logits GEMM run under TRITON_INTERPRET=1 on CPU.

    Triton's interpreter (3.9) evaluates ``tl.dot`` with numpy on the operands' storage, and
    stores bf16 as uint16 (numpy has no bf16): only fp8 operands are converted first, so a bf16
    dot multiplies the raw bit patterns as integers (1e10 for products of ~1). That is why
    ``_logits_triton.supported`` takes fp16 only on CPU. Here the interpreter's dot widens bf16
    operands to fp32 (exact: bf16 is fp32's upper half) before the fp32-accumulating matmul, as
    the GPU's tensor cores do; everything else of the bf16 path (tensor descriptors, bf16 loads,
    the rounding of the accumulator to bf16, its store, the statistics from the stored values)
    runs as the interpreter has it. ``supported`` is asked about the same tensors viewed as fp16
    (same element size, strides and addresses), so its alignment rules still decide.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    import liger_compat.kernels._logits_triton as lt

    real_dot, real_supported = ti.InterpreterBuilder.create_dot, lt.supported

    def widen(h):
        return (h.data.astype(np.uint32) << 16).view(np.float32) if h.dtype == tl.bfloat16 else h.data

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (a.dtype, b.dtype):
            return real_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        return ti.TensorHandle(np.matmul(widen(a), widen(b), dtype=d.data.dtype) + d.data, d.dtype.scalar)

    def supported(hc, w):
        if hc.dtype == w.dtype == torch.bfloat16:
            return real_supported(hc.view(torch.float16), w.view(torch.float16))
        return real_supported(hc, w)

    monkeypatch.setattr(ti.InterpreterBuilder, "create_dot", dot)
    monkeypatch.setattr(lt, "supported", supported)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.1}, {"softcap": 3.0, "label_smoothing": 0.1}])
def test_logits_gemm_kernel_values_and_row_statistics(monkeypatch, dtype, opts):
    """The Triton logits GEMM alone: ``out = hidden @ weight.T`` against float64, and its per-tile
    statistics (max, sum of exp(z - max), argmax, row sum) against the same statistics computed
    in float64 from ``out`` as stored. 20 x 72 logits over K = 24: partial row, column and K tiles
    (the interpreter's tiles are 16 x 32 x 16). Without softcap the tiles are stored tile-relative:
    each row of a tile less its maximum (the max partial), whose entry there is exactly 0."""
    if expected_backend() != "triton":
        pytest.skip("runs under TRITON_INTERPRET=1 (test_interpret.py)")
    import liger_compat.kernels._logits_triton as lt
    from liger_compat.kernels.loss import CEOptions

    if dtype == torch.bfloat16:
        _bf16_dot_under_the_interpreter(monkeypatch)
    g = torch.Generator().manual_seed(31)
    m, n, k, bn = 20, 72, 24, 32
    hc = (torch.randn(m, k, generator=g) * 2).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    assert lt.supported(hc, w)
    pm, ps, pi, pz, shift = lt.logits_with_partials(hc, w, out, CEOptions(**opts))
    ref = hc.double() @ w.double().T
    assert shift == (0 if "softcap" in opts else bn)
    z_abs = lt.absolute_logits(out, (pm, ps, pi, pz, shift)).double()
    assert rel_err(z_abs, ref) <= tolerance(dtype, n=k, ulps=1)  # one rounding to dtype (of a smaller value)
    z = out.double()
    if "softcap" in opts:
        z = opts["softcap"] * torch.tanh(z / opts["softcap"])
    else:  # tile-relative: each tile's row maximum is stored as 0, and the max partial is the fp32 one
        for j in range(pm.shape[1]):
            blk = out[:, j * bn:(j + 1) * bn].double()
            assert torch.equal(blk.amax(1), torch.zeros(m, dtype=torch.float64))
            assert rel_err(pm[:, j], ref[:, j * bn:(j + 1) * bn].amax(1)) <= tolerance(torch.float32, n=k)
    tol = tolerance(torch.float32, n=bn)
    for j in range(pm.shape[1]):
        blk = z[:, j * bn:(j + 1) * bn]
        mx = blk.amax(1)
        assert rel_err(ps[:, j], torch.exp(blk - mx[:, None]).sum(1)) <= tol
        picked = (pi[:, j].long() - j * bn)[:, None]
        assert bool(((picked >= 0) & (picked < blk.shape[1])).all())
        if "softcap" in opts:
            assert rel_err(pm[:, j], mx) <= tol
            # the index of a maximum as stored (16-bit rounding makes ties likely: any of them is right)
            assert torch.equal(blk.gather(1, picked)[:, 0], mx)
        else:  # tile-relative: the argmax and the row sum of the fp32 accumulator
            exact = ref[:, j * bn:(j + 1) * bn]
            # within the fp32 accumulation's error of the exact maximum (k terms of |h| |w|)
            slack = k * torch.finfo(torch.float32).eps * (hc.double().abs() @ w.double().abs().T)[:, j * bn:(j + 1) * bn]
            assert bool((exact.gather(1, picked)[:, 0] >= exact.amax(1) - slack.amax(1)).all())
            blk = exact
        if "label_smoothing" in opts:
            assert rel_err(pz[:, j], blk.sum(1), blk.abs().sum(1).norm().item()) <= tol


@pytest.mark.parametrize("impl", ["auto", "triton"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.1, "lse_square_scale": 1e-3},
                                  {"softcap": 3.0, "label_smoothing": 0.1, "lse_square_scale": 1e-3}])
def test_flce_triton_logits_gemm_with_fused_statistics(monkeypatch, opts, dtype, impl):
    """Each chunk's logits come from the Triton GEMM whose epilogue writes the row statistics
    ("auto": not with softcap); loss, token accuracy and gradients still match float64. bf16:
    with the interpreter's dot made right for bf16 (see _bf16_dot_under_the_interpreter)."""
    if expected_backend() != "triton":
        pytest.skip("runs under TRITON_INTERPRET=1 (test_interpret.py)")
    import liger_compat.kernels._logits_triton as lt
    import liger_compat.kernels.loss as ce_mod

    if dtype == torch.bfloat16:
        _bf16_dot_under_the_interpreter(monkeypatch)
    calls = []
    real = lt.logits_with_partials
    monkeypatch.setattr(lt, "logits_with_partials", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    monkeypatch.setattr(ce_mod, "FLCE_CHUNK_BYTES_CPU", 4 * 72 * 11)  # 11 rows per chunk
    hid, w, _, t = _inputs(21, 40, 24, 72, dtype, 0.3, False)
    ps = [x.clone().requires_grad_(True) for x in (hid, w)]
    out = fused_linear_cross_entropy(ps[0], ps[1], t, return_token_accuracy=True, logits_impl=impl, **opts)
    out.loss.backward()
    kept = int((t != -100).sum())
    fused = impl == "triton" or "softcap" not in opts
    assert calls == ([dtype] * -(-kept // 11) if fused else []) and kept > 11
    p64 = [x.double().requires_grad_(True) for x in (hid, w)]
    ref, _, acc = ce64(p64[0] @ p64[1].T, t, **opts)
    ref.backward()
    tol = tolerance(dtype, n=72)
    assert rel_err(out.loss, ref) <= tol
    assert abs(out.token_accuracy.item() - acc.item()) <= 1.0 / kept  # one 16-bit argmax tie may flip
    for mine, theirs in zip(ps, p64):
        assert rel_err(mine.grad, theirs.grad) <= tol


@pytest.mark.parametrize("dtype, offset", [(torch.float16, 1000.0), (torch.bfloat16, 256.0)])
def test_tile_relative_logits_keep_the_softmax_under_a_shared_offset(monkeypatch, dtype, offset):
    """The softmax is blind to an offset every logit of a row shares (a trained head's log-prior
    feature is one), but a 16-bit store of the logits is not: at a logit of ``offset`` its rounding
    moves each one by up to 0.25 (fp16 at 1000) or 1 (bf16 at 256), and every softmax entry by that
    factor of e. Stored tile-relative (``_logits_triton.SHIFT_LOGITS``), the entries that hold
    the mass sit near 0, so the loss's gradients stay within the dtype's tolerance of float64;
    stored as the product rounds them, they do not (checked here too, so the premise holds)."""
    if expected_backend() != "triton":
        pytest.skip("runs under TRITON_INTERPRET=1 (test_interpret.py)")
    import liger_compat.kernels._logits_triton as lt

    if dtype == torch.bfloat16:
        _bf16_dot_under_the_interpreter(monkeypatch)
    g = torch.Generator().manual_seed(int(offset) + 7)
    n, hd, v = 24, 32, 96
    hid = torch.randn(n, hd, generator=g)
    hid[:, 0] = 1.0  # the constant feature that carries the offset
    w = torch.randn(v, hd, generator=g) / hd**0.5
    w[:, 0] = offset
    hid, w = hid.to(dtype), w.to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = -100
    p64 = [x.double().requires_grad_(True) for x in (hid, w)]
    ref, _, _ = ce64(p64[0] @ p64[1].T, t)
    ref.backward()
    tol = tolerance(dtype, n=v)

    def errors():
        ps = [x.clone().requires_grad_(True) for x in (hid, w)]
        loss = fused_linear_cross_entropy(ps[0], ps[1], t, logits_impl="triton")
        loss.backward()
        # grad_hidden's offset column is sum_j d_j * offset, 0 in exact arithmetic: what is left of
        # the 16-bit gradient's roundings there is no matter of the logits' store, so it is left out
        return [rel_err(loss, ref), rel_err(ps[0].grad[:, 1:], p64[0].grad[:, 1:]), rel_err(ps[1].grad, p64[1].grad)]

    shifted = errors()
    assert max(shifted) <= tol, shifted
    monkeypatch.setattr(lt, "SHIFT_LOGITS", False)
    rounded = errors()
    assert max(rounded[1:]) > 2 * tol, rounded  # the logits as a 16-bit product stores them


@pytest.mark.parametrize("v", [8, 16, 40])
def test_tile_relative_logits_narrower_than_a_tile(v):
    """A vocabulary narrower than the logits GEMM's tile (the interpreter's is 32 columns), or
    ending in a partial one: the gradient pass takes whole tiles a block, so each column gets its
    own tile's maximum back. Loss and gradients against float64."""
    if expected_backend() != "triton":
        pytest.skip("runs under TRITON_INTERPRET=1 (test_interpret.py)")
    hid, w, _, t = _inputs(v, 12, 16, v, torch.float16, 0.2, False)
    ps = [x.clone().requires_grad_(True) for x in (hid, w)]
    loss = fused_linear_cross_entropy(ps[0], ps[1], t, logits_impl="triton")
    loss.backward()
    p64 = [x.double().requires_grad_(True) for x in (hid, w)]
    ref, _, _ = ce64(p64[0] @ p64[1].T, t)
    ref.backward()
    tol = tolerance(torch.float16, n=v)
    assert rel_err(loss, ref) <= tol
    for mine, theirs in zip(ps, p64):
        assert rel_err(mine.grad, theirs.grad) <= tol


def test_flce_logits_setting_and_the_kernel_knobs_are_checked(monkeypatch):
    """A bad ``LIGER_COMPAT_FLCE_LOGITS`` names the variable; a bad ``logits_impl=``,
    ``compact_ignored=`` or ``ce_variant=`` names the argument and the allowed values; a good
    ``logits_impl=`` wins over a bad setting."""
    hid, w, _, t = _inputs(1, 4, 8, 16, torch.float32, 0.0, False)
    monkeypatch.setattr(_config.settings, "flce_logits", "cuBLAS ")
    with pytest.raises(ValueError, match="LIGER_COMPAT_FLCE_LOGITS must be one of auto, cublas, triton, got 'cuBLAS '"):
        fused_linear_cross_entropy(hid, w, t)
    ref, _, _ = ce64(hid.double() @ w.double().T, t)
    assert rel_err(fused_linear_cross_entropy(hid, w, t, logits_impl="cublas"), ref) <= tolerance(torch.float32, n=16)
    monkeypatch.setattr(_config.settings, "flce_logits", "auto")
    for kw, match in (({"logits_impl": "gemm"}, "logits_impl must be one of auto, cublas, triton, got 'gemm'"),
                      ({"compact_ignored": 1}, "compact_ignored must be True, False or None, got 1"),
                      ({"ce_variant": "rows"}, "ce_variant must be one of split, row, got 'rows'")):
        with pytest.raises(ValueError, match=match):
            fused_linear_cross_entropy(hid, w, t, **kw)
    with pytest.raises(ValueError, match="ce_variant must be one of split, row"):
        cross_entropy(hid @ w.T, t, ce_variant="block")


def test_flce_chunk_rows_on_an_accelerator(monkeypatch):
    """The GPU chunk size: unset, 2048 rows (the whole input when shorter) with the chunk's logits
    capped at 1 GiB, so the same at Llama-3's V=128256, Qwen2's 152064 and Gemma-2's 256000 and
    fewer at a larger vocabulary; fp32 logits hit the cap sooner. With
    ``LIGER_COMPAT_FLCE_CHUNK_MB`` the size in MiB sets the rows instead, in whole 128-row tiles
    unless that adds a chunk: 1024 rows at V=128256 under 256 (8 chunks, not 9) and 880 at Qwen2's
    V (768 would take 10 chunks, not 9); under 64 MiB extra (logits plus the gathered hidden rows)
    with 62; at a small vocabulary the cap holds many more rows. Anything but a positive number
    of MiB raises, naming the setting."""
    import liger_compat.kernels.loss as ce_mod

    cuda = torch.device("cuda")  # only the device type is read; nothing is allocated
    v, h = 128256, 4096
    assert _config.settings.flce_chunk_mb == "" and _config.flce_chunk_mib() is None
    assert ce_mod._chunk_rows(8192, v, h, 2, "triton", cuda) == 2048
    assert ce_mod._chunk_rows(300, v, h, 2, "triton", cuda) == 300
    assert ce_mod._chunk_rows(7373, 152064, 3584, 2, "triton", cuda) == 2048
    assert ce_mod._chunk_rows(8192, 256000, 3584, 2, "triton", cuda) == 2048
    big = ce_mod._chunk_rows(8192, 400000, 4096, 2, "triton", cuda)
    assert big * 400000 * 2 <= 2**30 < (big + 128) * 400000 * 2 and big % 128 == 0
    fp32 = ce_mod._chunk_rows(8192, 256000, 3584, 4, "triton", cuda)
    assert fp32 * 256000 * 4 <= 2**30 and fp32 < 2048
    assert ce_mod._chunk_rows(8192, 32000, h, 2, "triton", cuda) == 2048
    monkeypatch.setattr(_config.settings, "flce_chunk_mb", "256")
    rows = ce_mod._chunk_rows(8192, v, h, 2, "triton", cuda)
    assert rows == 1024 and -(-8192 // rows) == 8
    assert ce_mod._chunk_rows(7373, 152064, 3584, 2, "triton", cuda) == 880
    assert ce_mod._chunk_rows(8192, 32000, h, 2, "triton", cuda) == 4096
    monkeypatch.setattr(_config.settings, "flce_chunk_mb", " 62 ")
    rows = ce_mod._chunk_rows(8192, v, h, 2, "triton", cuda)
    assert rows % 8 == 0 and rows * (v + h) * 2 < 64 * 2**20 and (rows + 8) * v * 2 > 62 * 2**20
    monkeypatch.setattr(_config.settings, "flce_chunk_mb", "1024")
    assert ce_mod._chunk_rows(8192, v, h, 2, "triton", cuda) == 4096
    for bad in ("lots", "0", "-5", "nan", "inf"):
        monkeypatch.setattr(_config.settings, "flce_chunk_mb", bad)
        with pytest.raises(ValueError, match="LIGER_COMPAT_FLCE_CHUNK_MB must be a positive number"):
            ce_mod._chunk_rows(8192, v, h, 2, "triton", cuda)
        assert ce_mod._chunk_rows(8192, v, h, 4, "torch", torch.device("cpu")) >= 1  # unused on CPU


def test_logits_gemm_only_where_it_applies(monkeypatch):
    """The Triton logits GEMM is chosen only for 16-bit, 16-byte-aligned rows on a capable
    setup (Triton with tensor descriptors; on CUDA compute capability 9.0+)."""
    pytest.importorskip("triton")
    import liger_compat.kernels._logits_triton as lt

    h, w = torch.zeros(4, 8, dtype=torch.float16), torch.zeros(16, 8, dtype=torch.float16)
    monkeypatch.setitem(lt._CAPABLE, ("cpu", None), True)
    assert lt.supported(h, w)
    assert not lt.supported(h.float(), w.float())
    assert not lt.supported(torch.zeros(4, 9, dtype=torch.float16)[:, :8], w)  # 18-byte rows
    monkeypatch.setitem(lt._CAPABLE, ("cpu", None), False)
    assert not lt.supported(h, w)


def test_logits_gemm_capability_probe(monkeypatch):
    """A Triton without host tensor descriptors (< 3.4: the import fails) or without
    ``range(warp_specialize=)`` is not capable; the installed one is (on CPU: the interpreter)."""
    pytest.importorskip("triton")
    import sys

    import liger_compat.kernels._logits_triton as lt

    monkeypatch.setattr(lt, "_CAPABLE", {})
    assert lt._capable(torch.device("cpu")) is True  # triton 3.4+ here
    monkeypatch.setattr(lt, "_CAPABLE", {})
    monkeypatch.setitem(sys.modules, "triton.tools.tensor_descriptor", None)  # import now raises ImportError
    assert lt._capable(torch.device("cpu")) is False
    monkeypatch.setattr(lt, "_CAPABLE", {})
    monkeypatch.delitem(sys.modules, "triton.tools.tensor_descriptor")
    monkeypatch.setattr(lt.tl, "range", type("range", (), {"__init__": lambda self, *a, **k: None}))
    assert lt._capable(torch.device("cpu")) is False  # a range() without warp_specialize


def test_ignored_rows_are_compacted_only_for_a_large_loss():
    """``compact_ignored=None`` (the default) compacts, at one host sync, only a loss whose rows x
    vocabulary x hidden reaches COMPACT_MIN_MACS: a host-bound small step makes no sync, a large
    head skips the ignored rows' matmuls; True / False force it, anything else is refused."""
    from liger_compat.kernels import loss as loss_mod

    assert loss_mod.compact_for(8192, 128256, 4096, None) is True       # Llama-3-8B head
    assert loss_mod.compact_for(2048, 128256, 1024, None) is False      # 2 x 1024 tokens, small model
    assert loss_mod.compact_for(2048, 128256, 1024, True) is True
    assert loss_mod.compact_for(8192, 128256, 4096, False) is False
    edge = loss_mod.COMPACT_MIN_MACS
    assert loss_mod.compact_for(edge, 1, 1, None) and not loss_mod.compact_for(edge - 1, 1, 1, None)
    h, w = torch.randn(4, 8), torch.randn(16, 8)
    t = torch.randint(0, 16, (4,))
    with pytest.raises(ValueError, match="compact_ignored"):
        loss_mod.fused_linear_cross_entropy(h, w, t, compact_ignored="yes")
