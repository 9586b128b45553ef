"""fused_linear_logprobs against a float64 torch reference (CPU path; the Triton row kernels
under the interpreter through test_interpret.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from liger_compat.kernels import last_backend
from liger_compat.kernels.logprob import FIELDS, fused_linear_logprobs
from harness import examples, expected_backend, record_ops, tolerance
from reference64 import logprobs64, rel_err

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _inputs(seed, n, h, v, dtype, ignore_frac, with_bias):
    g = torch.Generator().manual_seed(seed)
    hid = (torch.randn(n, h, generator=g) * 2.0).to(dtype)
    w = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    b = (torch.randn(v, generator=g) * 0.5).to(dtype) if with_bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignore_frac] = -100
    glp = torch.randn(n, generator=g)
    gent = torch.randn(n, generator=g)
    return hid, w, b, t, glp, gent


def _top1_agrees(ours, hid, w, b, t, opts, dtype):
    """is_top1 equals the float64 argmax test except on rows whose best two logits are closer
    than the dtype's rounding of the logits can resolve."""
    x = hid.double() @ w.double().T + (0 if b is None else b.double())
    x = x * opts["logit_scale"]
    if opts["softcap"] is not None:
        x = opts["softcap"] * torch.tanh(x / opts["softcap"])
    z = x / opts["temperature"]
    top2 = z.topk(min(2, z.shape[1]), dim=-1).values
    gap = (top2[:, 0] - top2[:, -1]) if z.shape[1] > 1 else torch.full((z.shape[0],), float("inf"), dtype=z.dtype)
    resolvable = gap > 8 * torch.finfo(dtype).eps * z.abs().amax(-1).clamp(min=1) * max(opts["logit_scale"], 1.0) / opts["temperature"]
    return resolvable


options = st.fixed_dictionaries(
    {
        "temperature": st.sampled_from([1.0, 0.7, 1.9]),
        "softcap": st.sampled_from([None, 5.0]),
        "logit_scale": st.sampled_from([1.0, 0.5]),
    }
)


@settings(max_examples=examples(25), deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 37),
    h=st.integers(1, 40),
    v=st.integers(2, 301),
    dt=st.sampled_from(list(DT)),
    opts=options,
    with_bias=st.booleans(),
    ignore_frac=st.sampled_from([0.0, 0.3]),
    grads=st.sampled_from(["lp", "ent", "both"]),
    grad_mode=st.sampled_from(["recompute", "uniform"]),
)
def test_logprobs_match_float64(seed, n, h, v, dt, opts, with_bias, ignore_frac, grads, grad_mode):
    dtype = DT[dt]
    hid, w, b, t, glp, gent = _inputs(seed, n, h, v, dtype, ignore_frac, with_bias)
    hid.requires_grad_(True)
    w.requires_grad_(True)
    if b is not None:
        b.requires_grad_(True)
    out = fused_linear_logprobs(hid, w, t, bias=b, grad_mode=grad_mode, **opts)
    assert last_backend["fused_linear_logprobs"] == expected_backend()

    h64 = hid.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    b64 = None if b is None else b.detach().double().requires_grad_(True)
    ref = logprobs64(h64, w64, b64, t, **opts)

    tol = tolerance(dtype, n=h + v, ulps=16.0)
    valid = t != -100
    for name, ours, theirs in zip(FIELDS, out, ref):
        if name == "is_top1":
            assert ours.dtype == torch.bool and not ours[~valid].any()
            ok = _top1_agrees(ours, hid.detach(), w.detach(), None if b is None else b.detach(), t, opts, dtype)
            assert torch.equal(ours[ok & valid], theirs[ok & valid]), name
            continue
        assert ours.shape == theirs.shape and ours.dtype == torch.float32
        assert torch.all(ours[~valid] == 0), name
        unit = 0.0
        if name in ("log_probs", "mean_logits", "log_sum_sq_probs"):
            # a difference of logits of size |z|: judged against that size
            unit = float((hid.detach().double() @ w.detach().double().T).abs().amax()) * n**0.5 * opts["logit_scale"] / opts["temperature"] + 1.0
        assert rel_err(ours, theirs, unit) < tol, (name, rel_err(ours, theirs, unit))

    up_lp = glp if grads in ("lp", "both") else None
    up_ent = gent if grads in ("ent", "both") else None
    terms = []
    refs = []
    if up_lp is not None:
        terms.append((out.log_probs * up_lp).sum())
        refs.append((ref[0] * up_lp.double()).sum())
    if up_ent is not None:
        terms.append((out.entropy * up_ent).sum())
        refs.append((ref[1] * up_ent.double()).sum())
    sum(terms).backward()
    sum(refs).backward()
    gtol = tolerance(dtype, n=h + v, ulps=32.0)
    for ours, theirs, name in ((hid.grad, h64.grad, "hidden"), (w.grad, w64.grad, "weight"),
                               (None if b is None else b.grad, b64, "bias")):
        if theirs is None:
            continue
        if name == "bias":
            theirs = b64.grad
        assert ours.dtype == dtype
        assert rel_err(ours, theirs) < gtol, (name, rel_err(ours, theirs))


@pytest.mark.parametrize("mode", ["recompute", "uniform"])
def test_uniform_upstream_and_non_uniform_give_the_reference(mode, monkeypatch):
    """A mean of the log-probs (uniform upstream) and then a per-row weighting on the same kind of
    inputs: both modes give the float64 gradient (the uniform mode recomputes when the upstream is
    not uniform, and uses the forward's gradient scaled when it is)."""
    import liger_compat.kernels.logprob as lpmod

    passes = []
    real = lpmod._pass
    monkeypatch.setattr(lpmod, "_pass", lambda *a, **k: passes.append(k["grads"]) or real(*a, **k))
    hid, w, b, t, glp, _ = _inputs(7, 29, 24, 173, torch.float32, 0.3, True)
    for upstream in ("mean", "weights"):
        passes.clear()
        hh = hid.clone().requires_grad_(True)
        ww = w.clone().requires_grad_(True)
        out = fused_linear_logprobs(hh, ww, t, bias=b, want=("log_probs", "entropy"), grad_mode=mode)
        valid = t != -100
        loss = -out.log_probs.sum() / valid.sum() if upstream == "mean" else (out.log_probs * glp).sum()
        loss.backward()
        h64 = hid.double().requires_grad_(True)
        w64 = w.double().requires_grad_(True)
        lp = logprobs64(h64, w64, b, t)[0]
        ref = -lp.sum() / valid.sum() if upstream == "mean" else (lp * glp.double()).sum()
        ref.backward()
        tol = tolerance(torch.float32, n=24 + 173, ulps=32.0)
        assert rel_err(hh.grad, h64.grad) < tol
        assert rel_err(ww.grad, w64.grad) < tol
        # the uniform mode forms the gradient in its one pass and reuses it for the mean; the
        # recompute mode keeps its forward's logits gradient on the Triton path; otherwise the
        # backward makes a second, recomputing pass
        kept = mode == "recompute" and lpmod._keeps_gradient(29, 173, torch.float32, expected_backend())
        assert len(passes) == (1 if (mode, upstream) == ("uniform", "mean") or kept else 2), passes


def _count_passes(monkeypatch):
    import liger_compat.kernels.logprob as lpmod

    passes = []
    real = lpmod._pass
    monkeypatch.setattr(lpmod, "_pass", lambda *a, **k: passes.append(k["grads"]) or real(*a, **k))
    return passes


def _no_host_read(monkeypatch):
    """Fail on the host read the uniform mode's comparison makes (``bool`` of a device tensor)."""
    import liger_compat.kernels.logprob as lpmod

    real = lpmod._common_value

    def no_compare(*a, compare_on_host, **k):
        assert not compare_on_host, "the backward compared the upstream on the host"
        return real(*a, compare_on_host=compare_on_host, **k)

    monkeypatch.setattr(lpmod, "_common_value", no_compare)


def test_sum_mode_takes_a_masked_mean_without_a_host_read(monkeypatch):
    """trl's SFT NLL on its compacted rows: the upstream comes through a masked scatter (uniform in
    value, not a stride-0 broadcast). ``grad_mode="sum"`` reuses the forward's gradient (one pass),
    compares nothing on the host, and gives the float64 gradients."""
    passes = _count_passes(monkeypatch)
    _no_host_read(monkeypatch)
    hid, w, b, t, _, _ = _inputs(13, 31, 24, 157, torch.float32, 0.3, True)
    mask = torch.rand(40, generator=torch.Generator().manual_seed(2)) < 0.8
    mask[:31] = True
    mask[31:] = False
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(3))
    mask = mask[perm]  # 31 scored rows scattered over 40 positions
    hh, ww, bb = (x.clone().requires_grad_(True) for x in (hid, w, b))
    out = fused_linear_logprobs(hh, ww, t, bias=bb, want=("log_probs", "entropy"), grad_mode="sum")
    scattered = out.log_probs.new_zeros(40).masked_scatter(mask, out.log_probs)
    (-scattered.sum() / 29).backward()
    h64, w64, b64 = (x.double().requires_grad_(True) for x in (hid, w, b))
    (-logprobs64(h64, w64, b64, t)[0].sum() / 29).backward()
    tol = tolerance(torch.float32, n=24 + 157, ulps=32.0)
    for ours, ref in ((hh.grad, h64.grad), (ww.grad, w64.grad), (bb.grad, b64.grad)):
        assert rel_err(ours, ref) < tol
    assert len(passes) == 1, passes


def test_sum_mode_raises_naming_the_mode_on_a_per_row_weighting():
    from liger_compat.kernels import GradientContractError

    hid, w, _, t, glp, _ = _inputs(14, 23, 16, 90, torch.float32, 0.2, False)
    hh, ww = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = fused_linear_logprobs(hh, ww, t, grad_mode="sum")
    with pytest.raises(GradientContractError, match=r"grad_mode='sum'.*differed between non-ignored rows.*'uniform'"):
        (out.log_probs * glp).sum().backward()


def test_uniform_mode_with_a_frozen_head_scales_rows_without_recompute_or_host_read(monkeypatch):
    """A frozen head (LoRA): only grad_hidden is needed, and the forward's rows scaled by any per-row
    upstream are exact: one pass, no comparison, the float64 gradient."""
    passes = _count_passes(monkeypatch)
    _no_host_read(monkeypatch)
    hid, w, _, t, glp, _ = _inputs(15, 27, 20, 111, torch.float32, 0.25, False)
    hh = hid.clone().requires_grad_(True)
    out = fused_linear_logprobs(hh, w, t, want=("log_probs", "entropy"), grad_mode="uniform")
    (out.log_probs * glp).sum().backward()
    h64 = hid.double().requires_grad_(True)
    (logprobs64(h64, w.double(), None, t)[0] * glp.double()).sum().backward()
    assert rel_err(hh.grad, h64.grad) < tolerance(torch.float32, n=20 + 111, ulps=32.0)
    assert len(passes) == 1, passes


def test_all_rows_ignored_gives_zeros_and_zero_gradient():
    hid, w, _, t, _, _ = _inputs(3, 9, 16, 50, torch.float32, 0.0, False)
    t[:] = -100
    hid.requires_grad_(True)
    out = fused_linear_logprobs(hid, w, t, grad_mode="uniform")
    assert torch.all(out.log_probs == 0) and torch.all(out.entropy == 0) and not out.is_top1.any()
    out.log_probs.sum().backward()
    assert hid.grad is not None and torch.all(hid.grad == 0)


def test_statistics_over_chunks_are_written_in_place(monkeypatch):
    """Several chunks on the Triton path: every field of every row (ignored rows 0) against float64,
    each chunk's statistics written by its combine launch into the batch's rows: no fill of the
    outputs and no copy of a chunk's rows into them."""
    if expected_backend() != "triton":
        pytest.skip("runs under TRITON_INTERPRET=1 (test_interpret.py)")
    from liger_compat.kernels import logprob as lp_mod

    v = 70
    monkeypatch.setattr(lp_mod, "FLCE_CHUNK_BYTES_CPU", 4 * v * 7)  # 7 rows a chunk
    hid, w, _, t, _, _ = _inputs(int(torch.randint(0, 2**31, ())), 31, 24, v, torch.float32, 0.3, False)
    want = ("log_probs", "entropy", "is_top1", "log_sum_sq_probs", "mean_logits")
    with record_ops(monkeypatch) as rec:
        out = fused_linear_logprobs(hid, w, t, want=want, temperature=0.7)
    ref = logprobs64(hid, w, None, t, temperature=0.7)
    tol = tolerance(torch.float32, n=v)
    for name, r in zip(("log_probs", "entropy", "is_top1", "log_sum_sq_probs", "mean_logits"), ref):
        got = getattr(out, name)
        if name == "is_top1":  # where float64's best two logits are further apart than fp32 resolves
            ok = _top1_agrees(got, hid, w, None, t, {"temperature": 0.7, "softcap": None, "logit_scale": 1.0},
                              torch.float32)
            assert torch.equal(got[ok], r.bool()[ok]), name
        else:
            assert rel_err(got, r) <= tol, name
    ignored = t == -100
    assert not out.log_probs[ignored].any() and not out.entropy[ignored].any()
    assert not {"zeros", "zero_", "fill_", "copy_"} & set(rec.ops), sorted(set(rec.ops))


def test_batched_shape_and_flat_target():
    hid, w, _, t, _, _ = _inputs(5, 12, 8, 40, torch.float32, 0.2, False)
    a = fused_linear_logprobs(hid.view(3, 4, 8), w, t.view(3, 4), want=("log_probs",))
    c = fused_linear_logprobs(hid.view(3, 4, 8), w, t, want="log_probs")
    assert a.log_probs.shape == (3, 4) and a.entropy is None and a.is_top1 is None
    assert torch.equal(a.log_probs, c.log_probs)
    ref = logprobs64(hid, w, None, t)[0].view(3, 4)
    assert rel_err(a.log_probs, ref) < tolerance(torch.float32, n=48)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"softcap": -1.0}, "softcap"),
        ({"want": ("log_probs", "perplexity")}, "want"),
        ({"grad_mode": "fast"}, "grad_mode"),
        ({"logit_scale": float("nan")}, "logit_scale"),
    ],
)
def test_bad_options_name_the_argument(kwargs, match):
    hid, w, _, t, _, _ = _inputs(1, 4, 8, 20, torch.float32, 0.0, False)
    with pytest.raises(ValueError, match=match):
        fused_linear_logprobs(hid, w, t, **kwargs)


def test_bad_inputs_name_the_argument():
    hid, w, _, t, _, _ = _inputs(1, 4, 8, 20, torch.float32, 0.0, False)
    with pytest.raises(ValueError, match="target"):
        fused_linear_logprobs(hid, w, torch.tensor([0, 1, 20, 3]))
    with pytest.raises(ValueError, match="weight"):
        fused_linear_logprobs(hid, w[:, :5], t)
    with pytest.raises(TypeError, match="target"):
        fused_linear_logprobs(hid, w, t.float())


@pytest.mark.parametrize("kept", [False, True])
def test_backward_context_is_entered_by_the_backward(kept, monkeypatch):
    """The backward's products with the head (of the recomputed logits, or of the kept gradient; a
    frozen head, LoRA's case, needs grad_hidden alone) run inside the backward context (a ZeRO-3
    gather of the head, say), and give float64's gradient."""
    import contextlib

    import liger_compat.kernels.logprob as lpmod

    monkeypatch.setattr(lpmod, "_keeps_gradient", lambda *a: kept)
    passes = _count_passes(monkeypatch)
    hid, w, _, t, glp, _ = _inputs(11, 23, 12, 61, torch.float32, 0.25, False)
    hid.requires_grad_(True)
    entered = []

    @contextlib.contextmanager
    def ctx():
        entered.append(True)
        yield

    out = fused_linear_logprobs(hid, w, t, want="log_probs", backward_context=ctx)
    assert not entered
    (out.log_probs * glp).sum().backward()
    assert entered == [True] and len(passes) == (1 if kept else 2), passes
    h64 = hid.detach().double().requires_grad_(True)
    (logprobs64(h64, w.double(), None, t)[0] * glp.double()).sum().backward()
    assert rel_err(hid.grad, h64.grad) < tolerance(torch.float32, n=12 + 61, ulps=32.0)


def test_compute_dtype_under_fp32_weights_matches_bf16_head():
    """fp32 hidden and weight computed in bf16 (what trl's head does under bf16 autocast): the result is
    the bf16 head's, gradients come back in fp32."""
    hid, w, b, t, glp, _ = _inputs(13, 21, 16, 90, torch.float32, 0.2, True)
    a, c = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = fused_linear_logprobs(a, c, t, bias=b, want="log_probs", compute_dtype=torch.bfloat16)
    (out.log_probs * glp).sum().backward()
    assert a.grad.dtype == torch.float32 and c.grad.dtype == torch.float32
    hb, wb, bb = hid.bfloat16().double(), w.bfloat16().double(), b.bfloat16().double()
    hb.requires_grad_(True)
    wb.requires_grad_(True)
    ref = logprobs64(hb, wb, bb, t)[0]
    (ref * glp.double()).sum().backward()
    tol = tolerance(torch.bfloat16, n=16 + 90, ulps=16.0)
    unit = float((hb @ wb.T).detach().abs().amax()) * 21**0.5
    assert rel_err(out.log_probs, ref.detach(), unit) < tol
    assert rel_err(a.grad, hb.grad) < tol and rel_err(c.grad, wb.grad) < tol


@pytest.mark.parametrize("upstream", ["log_probs", "log_probs+entropy"])
@pytest.mark.parametrize("seed", [3, 17])
def test_kept_gradient_gives_the_float64_gradient(seed, upstream, monkeypatch):
    """``grad_mode="recompute"`` with the forward's logits gradient kept (forced here on the torch
    reference; the Triton path keeps it below ``KEEP_GRAD_MAX_BYTES``): a per-row weighting of the
    log-probs (DPO's kind of upstream, random values on the ignored rows too, which must not count),
    with a bias, softcap, temperature and logit scale, gives the float64 gradient from one pass; an
    entropy gradient as well makes the backward recompute (a second pass), with the same result."""
    import liger_compat.kernels.logprob as lpmod

    monkeypatch.setattr(lpmod, "_keeps_gradient", lambda *a: True)
    passes = _count_passes(monkeypatch)
    kept = []
    real_kept = lpmod._kept_grads
    monkeypatch.setattr(lpmod, "_kept_grads", lambda *a: kept.append(a[0].shape) or real_kept(*a))
    opts = dict(temperature=0.7, softcap=5.0, logit_scale=0.5)
    hid, w, b, t, glp, gent = _inputs(seed, 31, 20, 157, torch.float32, 0.3, True)
    hh, ww, bb = (x.clone().requires_grad_(True) for x in (hid, w, b))
    out = fused_linear_logprobs(hh, ww, t, bias=bb, want=("log_probs", "entropy"), grad_mode="recompute", **opts)
    loss = (out.log_probs * glp).sum()
    if upstream != "log_probs":
        loss = loss + (out.entropy * gent).sum()
    loss.backward()
    h64, w64, b64 = (x.double().requires_grad_(True) for x in (hid, w, b))
    lp, ent = logprobs64(h64, w64, b64, t, **opts)[:2]
    ref = (lp * glp.double()).sum() + (0 if upstream == "log_probs" else (ent * gent.double()).sum())
    ref.backward()
    tol = tolerance(torch.float32, n=20 + 157, ulps=32.0)
    for ours, theirs in ((hh.grad, h64.grad), (ww.grad, w64.grad), (bb.grad, b64.grad)):
        assert rel_err(ours, theirs) < tol, rel_err(ours, theirs)
    assert len(passes) == (1 if upstream == "log_probs" else 2), passes
    assert kept == ([(31, 157)] if upstream == "log_probs" else []), kept


def test_kept_gradient_is_bounded_and_triton_only():
    """The forward keeps the logits gradient only where it fits ``KEEP_GRAD_MAX_BYTES`` (its dtype's
    bytes counted) and only on the Triton path."""
    from liger_compat.kernels.logprob import KEEP_GRAD_MAX_BYTES, _keeps_gradient

    v = 128256
    rows_bf16 = KEEP_GRAD_MAX_BYTES // (2 * v)
    assert _keeps_gradient(rows_bf16, v, torch.bfloat16, "triton")
    assert not _keeps_gradient(rows_bf16 + 1, v, torch.bfloat16, "triton")
    assert not _keeps_gradient(rows_bf16, v, torch.float32, "triton")
    assert not _keeps_gradient(rows_bf16 // 2, v, torch.bfloat16, "torch")
    assert not _keeps_gradient(0, v, torch.bfloat16, "triton")



def test_log_probs_past_the_rounding_of_their_target_logits(monkeypatch):
    """bf16 logits sharing an offset of 24 (a constant hidden feature times a weight column of 24:
    bf16's spacing there is 2^-3) over a spread softmax: a log-prob is ``z_t - lse``, and where the
    mass is spread the rounding of the stored ``z_t`` (up to 2^-4) is nearly all of its error, the
    rest's roundings averaging out in ``lse``. Taken in fp32 from the hidden row and the target's
    weight row, the log-probs' RMS error against float64 is under 1e-2 and under 0.3x that of the
    target logits as stored (``logprob.EXACT_TARGET`` off; 0.09-0.11x over 12 seeds)."""
    from liger_compat.kernels import logprob as lp_mod

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**16, ())))
    n, hd, v = 128, 48, 260
    x = torch.randn(n, hd, generator=g)
    x[:, 0] = 1.0
    w = torch.randn(v, hd, generator=g) / hd**0.5
    w[:, 0] = 24.0
    x, w = x.bfloat16(), w.bfloat16()
    t = torch.randint(0, v, (n,), generator=g)
    ref = logprobs64(x.double(), w.double(), None, t)[0]

    def rms():
        out = fused_linear_logprobs(x, w, t, want=("log_probs",))
        assert last_backend["fused_linear_logprobs"] == expected_backend()
        return float((out.log_probs.double() - ref).pow(2).mean().sqrt())

    exact = rms()
    monkeypatch.setattr(lp_mod, "EXACT_TARGET", False)
    stored = rms()
    assert exact <= 1e-2 and exact <= 0.3 * stored, (exact, stored)
