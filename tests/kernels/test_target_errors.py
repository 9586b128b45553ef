"""Targets outside the vocabulary give a clear error naming the value, never a silent NaN.

Runs twice (see ``test_interpret.py``): here on the torch reference, and under
``TRITON_INTERPRET=1`` on the Triton kernels, which report bad targets through the flag tensor
they write (``_device_errors.py``), the way they do on the GPU. The GPU reads that flag back
without a sync, so the error may come after the call returned; ``_not_ready_yet`` stands in
for a GPU that has not got there yet, so the later reporting points (backward, the next call,
``raise_target_errors``) are exercised on CPU too.
"""

from __future__ import annotations

import pytest
import torch

from liger_compat.kernels import (
    TargetOutOfRangeError,
    _device_errors,
    cross_entropy,
    fused_linear_cross_entropy,
    last_backend,
    raise_target_errors,
)
from harness import expected_backend, interpreting
from reference64 import ce64, rel_err

V = 37
IGNORE = -100


@pytest.fixture(autouse=True)
def _empty_queue():
    _device_errors._pending.clear()
    yield
    _device_errors._pending.clear()


def _inputs(seed, n=11, h=16, v=V, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hid = (torch.randn(n, h, generator=g) * 2.0).to(dtype)
    w = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[1] = IGNORE
    return hid, w, t


def _call(kind, hid, w, t, **kw):
    """The loss through ``kind`` plus the leaf tensors it is differentiable in."""
    if kind == "flce":
        hid, w = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
        return fused_linear_cross_entropy(hid, w, t, **kw), (hid, w)
    logits = (hid.double() @ w.double().T).to(hid.dtype).requires_grad_(True)
    return cross_entropy(logits, t, **kw), (logits,)


def _ref(kind, hid, w, t, reduction):
    """float64 loss (per row for "none") and the leaves, with the target rows ``t`` holds."""
    h64, w64 = hid.double().requires_grad_(True), w.double().requires_grad_(True)
    if kind == "flce":
        logits, leaves = h64 @ w64.T, (h64, w64)
        if hid.dtype != torch.float32:  # the logits as the head rounds them (gradients pass through)
            logits = logits + (logits.to(hid.dtype).double() - logits).detach()
    else:
        logits = (hid.double() @ w.double().T).to(hid.dtype).double().requires_grad_(True)
        leaves = (logits,)
    return ce64(logits, t, reduction=reduction)[0], leaves


def _check_good_call(kind, reduction, seed):
    hid, w, t = _inputs(seed)
    out, leaves = _call(kind, hid, w, t, reduction=reduction)
    assert last_backend["fused_linear_cross_entropy" if kind == "flce" else "cross_entropy"] == expected_backend()
    ref, leaves64 = _ref(kind, hid, w, t, reduction)
    g = torch.rand(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5
    (out.double() * g).sum().backward()
    (ref * g).sum().backward()
    assert rel_err(out, ref) <= 1e-5
    for a, b in zip(leaves, leaves64):
        assert rel_err(a.grad, b.grad) <= 1e-5


@pytest.mark.parametrize("kind", ["flce", "ce"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("bad", [V, V + 1000, -1, -7])
def test_bad_target_raises_naming_it_then_good_calls_work(kind, reduction, bad):
    hid, w, t = _inputs(3)
    t[4] = bad
    with pytest.raises(TargetOutOfRangeError, match=rf"holds {bad}, outside the vocabulary \[0, {V}\)") as err:
        _call(kind, hid, w, t, reduction=reduction)
    assert isinstance(err.value, ValueError) and f"ignore_index={IGNORE}" in str(err.value)
    assert last_backend["fused_linear_cross_entropy" if kind == "flce" else "cross_entropy"] == expected_backend()
    assert not _device_errors._pending
    _check_good_call(kind, reduction, seed=bad % 1000)
    raise_target_errors()  # nothing left to report


def test_both_kinds_of_bad_target_are_named():
    hid, w, t = _inputs(4)
    t[2], t[5], t[7] = V + 3, -2, V
    with pytest.raises(ValueError, match=rf"holds {V + 3},") as err:
        fused_linear_cross_entropy(hid, w, t)
    if interpreting():  # the kernels' report counts them and names the negative one too
        assert "3 such targets, also -2" in str(err.value)


class _FakeEvent:
    """A CUDA event stand-in: ``query()`` is False until ``done`` (a GPU still behind)."""

    def __init__(self):
        self.done = False
        self.waited = False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = True
        self.done = True


@pytest.fixture
def _not_ready_yet(monkeypatch):
    """Every flag watched from now on waits on a :class:`_FakeEvent`; the torch reference skips
    its up-front CPU check, so both backends report through the flag, as on the GPU."""
    from liger_compat.kernels import _checks

    events = []
    real_watch = _device_errors.watch

    def watch(flag, *args):
        real_watch(flag, *args)
        events.append(_FakeEvent())
        _device_errors._pending[-1] = _device_errors._pending[-1]._replace(event=events[-1])

    monkeypatch.setattr(_device_errors, "watch", watch)
    monkeypatch.setattr(_checks, "target_range", lambda *a, **k: None)
    return events


def _variants():
    if not interpreting():
        return [("reference", "flce"), ("reference", "ce")]
    # the split kernels, the row kernel, and the split combine fed by the logits GEMM's epilogue
    return [("split", "flce"), ("split", "ce"), ("row", "flce"), ("row", "ce"), ("gemm", "flce")]


@pytest.mark.parametrize("variant, kind", _variants())
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_deferred_report_bad_rows_nan_and_no_gradient(monkeypatch, _not_ready_yet, variant, kind, reduction):
    """While the report is in flight the call returns: bad rows' loss NaN, their gradient zero,
    every other row exact; the error then comes from the next call, before it does anything."""

    dtype = torch.float32
    knobs = {"ce_variant": variant} if variant in ("split", "row") else {}
    gemm_calls = []
    if variant == "gemm":
        import liger_compat.kernels._logits_triton as lt

        real = lt.logits_with_partials
        monkeypatch.setattr(lt, "logits_with_partials", lambda *a, **k: gemm_calls.append(1) or real(*a, **k))
        knobs = {"logits_impl": "triton"}
        dtype = torch.float16  # the interpreter's tensor descriptors: fp16 only
    hid, w, t = _inputs(5, n=13, h=24, v=40, dtype=dtype)
    bad_rows = torch.tensor([2, 6, 9])
    t[bad_rows] = torch.tensor([40, -1, 1234])
    out, leaves = _call(kind, hid, w, t, reduction=reduction, **knobs)
    assert len(_not_ready_yet) == 1 and len(_device_errors._pending) == 1
    assert bool(gemm_calls) == (variant == "gemm")

    good = t.clone()
    good[bad_rows] = IGNORE
    rows64, leaves64 = _ref(kind, hid, w, good, "none")
    keep = torch.ones(len(t), dtype=torch.bool)
    keep[bad_rows] = False
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    if reduction == "none":
        assert torch.isnan(out[bad_rows]).all()
        assert rel_err(out[keep], rows64[keep]) <= tol
        g = torch.rand(len(t), generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.5
        out.backward(g.to(out.dtype))  # a gradient for the NaN rows too: it must not reach the inputs
        (rows64 * g).sum().backward()
    else:
        assert torch.isnan(out)
        out.backward()
        (rows64.sum() / int((t != IGNORE).sum())).backward()  # bad rows count in the mean
    for a, b in zip(leaves, leaves64):
        assert rel_err(a.grad, b.grad) <= tol
    assert (leaves[0].grad[bad_rows] == 0).all()  # grad_hidden / grad_logits rows

    _not_ready_yet[0].done = True  # the GPU got there: the next call reports it before working
    hid2, w2, t2 = _inputs(6)
    with pytest.raises(TargetOutOfRangeError, match=r"holds 1234, outside the vocabulary \[0, 40\)"):
        _call(kind, hid2, w2, t2)
    assert not _device_errors._pending
    _check_good_call(kind, reduction, seed=8)


@pytest.mark.parametrize("kind", ["flce", "ce"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_deferred_report_raised_in_backward(_not_ready_yet, kind, reduction):
    hid, w, t = _inputs(7)
    t[3] = V + 5
    out, leaves = _call(kind, hid, w, t, reduction=reduction)
    _not_ready_yet[0].done = True
    with pytest.raises(TargetOutOfRangeError, match=rf"holds {V + 5}, outside the vocabulary \[0, {V}\)"):
        out.sum().backward()
    assert not _device_errors._pending
    _check_good_call(kind, reduction, seed=9)


def test_raise_target_errors_waits_for_the_report(_not_ready_yet):
    hid, w, t = _inputs(8)
    t[0] = -3
    out = fused_linear_cross_entropy(hid, w, t, reduction="none")
    assert torch.isnan(out[0]) and torch.isfinite(out[1:]).all()
    assert not _not_ready_yet[0].waited
    with pytest.raises(TargetOutOfRangeError, match=rf"holds -3, outside the vocabulary \[0, {V}\)"):
        raise_target_errors()
    assert _not_ready_yet[0].waited and not _device_errors._pending
    raise_target_errors()


def test_good_calls_in_flight_report_nothing(_not_ready_yet):
    hid, w, t = _inputs(9)
    fused_linear_cross_entropy(hid, w, t)
    cross_entropy(hid @ w.T, t)
    assert len(_device_errors._pending) == 2
    for e in _not_ready_yet:
        e.done = True
    _check_good_call("flce", "mean", seed=10)  # polls the finished good reports: no error
    assert len(_device_errors._pending) == 1  # only this call's own, still "in flight"


def test_several_bad_calls_reported_once():
    """Two finished bad reports: one error names the first and counts the other; both cleared."""
    flags = []
    for value in (V + 1, -9):
        flag = _device_errors.new_flag(torch.device("cpu"))
        flag[0] = 1
        flag[1 if value > 0 else 2] = value
        flags.append(flag)
    for f in flags:
        _device_errors._pending.append(_device_errors._Pending(f, _FakeEvent(), "cross_entropy", V, IGNORE))
    _device_errors.poll()  # neither has finished: no error, nothing dropped
    assert len(_device_errors._pending) == 2
    with pytest.raises(TargetOutOfRangeError, match=rf"holds {V + 1}, .*1 more call"):
        raise_target_errors()
    assert not _device_errors._pending
