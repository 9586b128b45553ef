"""rms_norm, swiglu, geglu and apply_rotary_pos_emb against float64 references (CPU path)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from liger_compat.kernels import HAS_TRITON, apply_rotary_pos_emb, geglu, last_backend, rms_norm, swiglu
from harness import examples, expected_backend, tolerance
from reference64 import geglu64, rel_err, rms_norm64, rope64, swiglu64

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
F32 = tolerance(torch.float32)


def _grads_close(pairs, tol):
    for mine, ref in pairs:
        err = rel_err(mine, ref)
        assert err <= tol, err


@settings(max_examples=examples(20), deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.sampled_from([(1,), (3,), (2, 5), (17,)]),
    h=st.integers(2, 300),  # H=1 makes d rms_norm / dx vanish (x / |x|)
    dt=st.sampled_from(list(DT)),
    wdt=st.sampled_from(["same", "fp32"]),
    flavour=st.sampled_from([("llama", 0.0), ("gemma", 1.0), ("llama", 1.0)]),
)
def test_rms_norm_matches_float64(seed, rows, h, dt, wdt, flavour):
    casting, offset = flavour
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*rows, h, generator=g) * 3 + 0.5).to(DT[dt]).requires_grad_(True)
    w = (torch.randn(h, generator=g) * 0.5 + (0.0 if offset else 1.0)).to(DT[dt] if wdt == "same" else torch.float32)
    w.requires_grad_(True)
    y = rms_norm(x, w, 1e-6, offset=offset, casting=casting)
    assert last_backend["rms_norm"] == expected_backend()
    expect_dtype = torch.promote_types(x.dtype, w.dtype) if casting == "llama" else x.dtype
    assert y.dtype == expect_dtype and y.shape == x.shape
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    ref = rms_norm64(x64, w64, 1e-6, offset)
    # the mean of squares sums h terms (the weight gradient sums the rows too)
    assert rel_err(y, ref) <= tolerance(DT[dt], n=h)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    (y.double() * dy).sum().backward()
    (ref * dy).sum().backward()
    assert x.grad.dtype == x.dtype and w.grad.dtype == w.dtype
    tol_d = tolerance(DT[dt], n=max(h, x.numel() // h), ulps=8)
    # dx = (w dy - x mean(x w dy) / ms) / rms subtracts two terms of size |w dy| / rms: it cancels
    # (h = 2: x / |x| has a one-dimensional derivative), so its error is judged against them
    xd = x64.detach()
    terms = 2 * ((offset + w64.detach()) * dy).abs() * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert rel_err(x.grad, x64.grad, terms.norm().item()) <= tol_d
    assert rel_err(w.grad, w64.grad) <= tol_d


@settings(max_examples=examples(20), deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.sampled_from([(1,), (7,), (3, 129), (2, 5, 33)]),
    dt=st.sampled_from(list(DT)),
    kind=st.sampled_from(["swiglu", "geglu"]),
)
def test_gated_mlp_matches_float64(seed, shape, dt, kind):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(*shape, generator=g) * 3).to(DT[dt]).requires_grad_(True)
    b = (torch.randn(*shape, generator=g) * 2).to(DT[dt]).requires_grad_(True)
    fn, ref_fn = (swiglu, swiglu64) if kind == "swiglu" else (geglu, geglu64)
    y = fn(a, b)
    assert last_backend[kind] == expected_backend()
    assert y.dtype == a.dtype and y.shape == a.shape
    a64 = a.detach().double().requires_grad_(True)
    b64 = b.detach().double().requires_grad_(True)
    ref = ref_fn(a64, b64)
    # the activation is a chain of ~8 fp32 operations, its derivative of ~16
    tol, tol_da = tolerance(DT[dt], n=8), tolerance(DT[dt], n=16)
    # GeGLU at a < -3 is 0.5 * a * (1 + tanh(..)) with tanh ~ -1: the value cancels, and its error
    # is measured against |a * b| (|act(a)| <= 1.13 |a| for both), the size of the terms
    assert rel_err(y, ref, unit=(a64 * b64).detach().norm().item()) <= tol
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    (y.double() * dy).sum().backward()
    (ref * dy).sum().backward()
    _grads_close([(b.grad, b64.grad)], tol)
    # d/da = dy * b * act'(a), and |act'| <= 1.13 for SiLU and tanh-GELU: the error is measured in
    # that natural unit (|dy * b|). Relative to d/da itself it would grow without bound where
    # act' crosses zero (a ~ -0.75 for GELU, -1.28 for SiLU) even in exact-to-fp32 arithmetic:
    # that measures the function's conditioning there, not the kernel (HYPOTHESIS_PROFILE=explore
    # found a one-element fp16 GeGLU case 0.025 off relative to a derivative of ~1e-5).
    unit = (dy * b64.detach()).norm().item()
    err_a = (a.grad.double() - a64.grad).norm().item() / max(a64.grad.norm().item(), unit, 1e-300)
    assert err_a <= tol_da, err_a


def _rope_inputs(g, b, hq, hk, t, d, rot, dt, layout, batch_cos):
    if layout == 1:
        q = torch.randn(b, hq, t, d, generator=g)
        k = torch.randn(b, hk, t, d, generator=g)
    else:
        q = torch.randn(b, t, hq, d, generator=g)
        k = torch.randn(b, t, hk, d, generator=g)
    ang = torch.rand(b if batch_cos else 1, t, rot // 2, generator=g) * 6.3
    ang = torch.cat([ang, ang + 0.1 * torch.randn(ang.shape, generator=g)], -1)  # halves need not repeat
    return q.to(dt).requires_grad_(True), k.to(dt).requires_grad_(True), ang.cos().to(dt), ang.sin().to(dt)


@settings(max_examples=examples(20), deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 2),
    heads=st.sampled_from([(1, 1), (4, 2), (3, 1)]),
    t=st.integers(1, 9),
    dims=st.sampled_from([(8, 8), (12, 12), (16, 8), (10, 4), (64, 32)]),
    dt=st.sampled_from(list(DT)),
    layout=st.sampled_from([1, 2]),
    batch_cos=st.booleans(),
)
def test_rope_matches_float64(seed, b, heads, t, dims, dt, layout, batch_cos):
    g = torch.Generator().manual_seed(seed)
    d, rot = dims
    q, k, cos, sin = _rope_inputs(g, b, heads[0], heads[1], t, d, rot, DT[dt], layout, batch_cos)
    qe, ke = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=layout)
    assert last_backend["rope"] == expected_backend()
    assert qe.shape == q.shape and ke.shape == k.shape and qe.dtype == q.dtype
    q64 = q.detach().double().requires_grad_(True)
    k64 = k.detach().double().requires_grad_(True)
    rq, rk = rope64(q64, cos, sin, layout), rope64(k64, cos, sin, layout)
    tol = tolerance(DT[dt])
    assert rel_err(qe, rq) <= tol and rel_err(ke, rk) <= tol
    gq = torch.randn(qe.shape, generator=g, dtype=torch.float64)
    gk = torch.randn(ke.shape, generator=g, dtype=torch.float64)
    ((qe.double() * gq).sum() + (ke.double() * gk).sum()).backward()
    ((rq * gq).sum() + (rk * gk).sum()).backward()
    _grads_close([(q.grad, q64.grad), (k.grad, k64.grad)], tol)


def test_rope_position_ids_with_table():
    """transformers < 4.38 passed a [max_pos, rot] table and position_ids; rows are selected."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 8, generator=g)
    k = torch.randn(2, 1, 5, 8, generator=g)
    ang = torch.rand(20, 4, generator=g) * 6
    ang = torch.cat([ang, ang], -1)
    pos = torch.randint(0, 20, (2, 5), generator=g)
    qe, ke = apply_rotary_pos_emb(q, k, ang.cos(), ang.sin(), position_ids=pos)
    ref = rope64(q, ang.cos()[pos], ang.sin()[pos])
    assert rel_err(qe, ref) <= F32


@pytest.mark.parametrize("path", ["eager", "op"])
@pytest.mark.parametrize("variant", ["flat", "rows"])
@pytest.mark.parametrize("layout", [1, 2])
@pytest.mark.parametrize("dims", [(12, 8), (16, 16)])
def test_rope_triton_kernel_variants(monkeypatch, path, variant, layout, dims):
    """Each Triton RoPE kernel (whole rows of q and k in one launch / half-row tiles), with and
    without pass-through channels, picked by ``variant=`` for the forward and the backward, from
    the public function and from the custom op that ``torch.compile`` traces."""
    if expected_backend() != "triton":
        pytest.skip("runs under TRITON_INTERPRET=1 (test_interpret.py)")
    from liger_compat.kernels import _ops, _rope_triton

    calls = {"flat": [], "rows": []}
    for name, attr in (("flat", "_rope_flat"), ("rows", "_rope_one")):
        real = getattr(_rope_triton, attr)
        monkeypatch.setattr(_rope_triton, attr, lambda *a, real=real, name=name: calls[name].append(1) or real(*a))
    g = torch.Generator().manual_seed(5)
    q, k, cos, sin = _rope_inputs(g, 2, 3, 1, 5, dims[0], dims[1], torch.float32, layout, True)
    if path == "eager":
        qe, ke = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=layout, variant=variant)
    else:
        cos_u, sin_u = cos.unsqueeze(layout), sin.unsqueeze(layout)
        qe, ke = _ops.rope(q, k, cos_u, sin_u, False, q.dtype, k.dtype, "auto", variant)
    assert [n for n, c in calls.items() if c] == [variant]
    assert rel_err(qe, rope64(q, cos, sin, layout)) <= F32 and rel_err(ke, rope64(k, cos, sin, layout)) <= F32
    forward_calls = len(calls[variant])
    gq, gk = torch.randn(qe.shape, generator=g), torch.randn(ke.shape, generator=g)
    dq, dk = torch.autograd.grad((qe * gq).sum() + (ke * gk).sum(), (q, k))
    assert [n for n, c in calls.items() if c] == [variant] and len(calls[variant]) == 2 * forward_calls
    q64, k64 = q.detach().double().requires_grad_(True), k.detach().double().requires_grad_(True)
    rq, rk = torch.autograd.grad((rope64(q64, cos, sin, layout) * gq).sum() + (rope64(k64, cos, sin, layout) * gk).sum(), (q64, k64))
    assert rel_err(dq, rq) <= F32 and rel_err(dk, rk) <= F32


@pytest.mark.parametrize("variant", ["half", "FLAT", None])
def test_rope_unknown_variant_raises(variant):
    """The torch reference ignores ``variant`` but still refuses one the Triton path has not."""
    g = torch.Generator().manual_seed(6)
    q, k, cos, sin = _rope_inputs(g, 1, 2, 1, 3, 8, 8, torch.float32, 1, False)
    with pytest.raises(ValueError, match=r"^variant must be one of flat, rows, got "):
        apply_rotary_pos_emb(q, k, cos, sin, variant=variant)
    if HAS_TRITON:
        from liger_compat.kernels._rope_triton import rope_triton

        with pytest.raises(ValueError, match=r"^variant must be one of flat, rows, got "):
            rope_triton(q, k, cos[:, None], sin[:, None], False, q.dtype, k.dtype, variant=variant)


def test_rope_on_slices_of_a_fused_qkv_projection(monkeypatch):
    """q/k cut from one qkv projection (Phi-3, GPT-NeoX) are not dense: the flat kernel's outputs
    could not share their strides, so the half-row kernel runs, with the same results."""
    if expected_backend() != "triton":
        pytest.skip("runs under TRITON_INTERPRET=1 (test_interpret.py)")
    from liger_compat.kernels import _rope_triton

    calls = []
    real = _rope_triton._rope_one
    monkeypatch.setattr(_rope_triton, "_rope_one", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(13)
    b, t, h, d = 2, 5, 3, 16
    qkv = torch.randn(b, t, 3 * h * d, generator=g, requires_grad=True)
    q = qkv[..., : h * d].view(b, t, h, d).transpose(1, 2)
    k = qkv[..., h * d: 2 * h * d].view(b, t, h, d).transpose(1, 2)
    ang = torch.rand(b, t, d // 2, generator=g) * 6.3
    ang = torch.cat([ang, ang + 0.3], -1)
    cos, sin = ang.cos(), ang.sin()
    qe, ke = apply_rotary_pos_emb(q, k, cos, sin)
    assert len(calls) == 2
    assert rel_err(qe, rope64(q, cos, sin, 1)) <= F32 and rel_err(ke, rope64(k, cos, sin, 1)) <= F32
    gq, gk = torch.randn(qe.shape, generator=g), torch.randn(ke.shape, generator=g)
    (dqkv,) = torch.autograd.grad((qe * gq).sum() + (ke * gk).sum(), (qkv,))
    x64 = qkv.detach().double().requires_grad_(True)
    q64 = x64[..., : h * d].view(b, t, h, d).transpose(1, 2)
    k64 = x64[..., h * d: 2 * h * d].view(b, t, h, d).transpose(1, 2)
    (ref,) = torch.autograd.grad((rope64(q64, cos, sin, 1) * gq).sum() + (rope64(k64, cos, sin, 1) * gk).sum(), (x64,))
    assert rel_err(dqkv, ref) <= F32


def test_rope_keeps_the_transformers_layout_of_q_and_k():
    """transformers hands q/k as [B, heads, T, D] views of [B, T, heads, D] projections; the
    kernel's outputs (and their gradients) keep that memory layout, as the native ops do."""
    if expected_backend() != "triton":
        pytest.skip("runs under TRITON_INTERPRET=1 (test_interpret.py)")
    g = torch.Generator().manual_seed(11)
    b, t, hq, hk, d = 2, 6, 4, 2, 16
    q = torch.randn(b, t, hq, d, generator=g).transpose(1, 2).requires_grad_(True)
    k = torch.randn(b, t, hk, d, generator=g).transpose(1, 2).requires_grad_(True)
    ang = torch.rand(b, t, d // 2, generator=g) * 6.3
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos(), ang.sin()
    qe, ke = apply_rotary_pos_emb(q, k, cos, sin)
    native_q = q * cos[:, None] + torch.cat([-q[..., d // 2:], q[..., : d // 2]], -1) * sin[:, None]
    assert qe.stride() == q.stride() == native_q.stride() and ke.stride() == k.stride()
    assert rel_err(qe, rope64(q, cos, sin, 1)) <= F32 and rel_err(ke, rope64(k, cos, sin, 1)) <= F32
    gq = torch.randn(b, t, hq, d, generator=g).transpose(1, 2)
    gk = torch.randn(b, t, hk, d, generator=g).transpose(1, 2)
    dq, dk = torch.autograd.grad((qe * gq).sum() + (ke * gk).sum(), (q, k))
    q64, k64 = q.detach().double().requires_grad_(True), k.detach().double().requires_grad_(True)
    rq, rk = torch.autograd.grad((rope64(q64, cos, sin, 1) * gq).sum() + (rope64(k64, cos, sin, 1) * gk).sum(), (q64, k64))
    assert rel_err(dq, rq) <= F32 and rel_err(dk, rk) <= F32

@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
def test_gated_inplace_backward_gives_the_same_gradients_and_refuses_a_second_backward(kind):
    fn, ref_fn = (swiglu, swiglu64) if kind == "swiglu" else (geglu, geglu64)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 40, generator=g, requires_grad=True)
    wg, wu = torch.randn(40, 24, generator=g), torch.randn(40, 24, generator=g)
    dy = torch.randn(6, 24, generator=g)

    def run(inplace):
        gate, up = x @ wg, x @ wu  # temporaries, as in the MLP shim
        y = fn(gate, up, inplace_backward=inplace)
        (dx,) = torch.autograd.grad((y * dy).sum(), x, retain_graph=True)
        return y, dx, gate, up

    y0, dx0, gate0, up0 = run(False)
    y1, dx1, _, _ = run(True)
    x64 = x.detach().double().requires_grad_(True)
    ref = ref_fn(x64 @ wg.double(), x64 @ wu.double())
    (dx64,) = torch.autograd.grad((ref * dy.double()).sum(), x64)
    tol = tolerance(torch.float32, n=40)  # x @ w sums 40 terms
    assert rel_err(y1, ref) <= tol and rel_err(dx1, dx64) <= tol
    assert torch.equal(dx0, dx1)
    # without inplace_backward the caller's tensors are never touched
    assert torch.equal(gate0, x.detach() @ wg) and torch.equal(up0, x.detach() @ wu)
    if expected_backend() == "triton":
        gate, up = x @ wg, x @ wu
        y = fn(gate, up, inplace_backward=True)
        loss = (y * dy).sum()
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="backward ran twice"):
            loss.backward()


@pytest.mark.parametrize("n,h,rows", [(8, 48, 8), (12, 33, 4), (6, 100, 2), (16, 1500, 2), (5, 16, 1)])
@pytest.mark.parametrize("dt,casting,offset", [("fp32", "llama", 0.0), ("bf16", "llama", 0.0), ("bf16", "gemma", 1.0)])
def test_rms_norm_forward_with_several_rows_per_program(monkeypatch, n, h, rows, dt, casting, offset):
    """The forward kernel's ROWS > 1 launch (CUDA, rows narrower than 4096 / ROWS): the row count
    CUDA would choose for this shape, run by the interpreter; values, and the gradients that read
    each row's saved rstd back, against float64."""
    if expected_backend() != "triton":
        pytest.skip("runs under TRITON_INTERPRET=1 (test_interpret.py)")
    from liger_compat.kernels import _rms_norm_triton as rt

    real, chosen = rt._rows_per_program, []

    def as_on_cuda(n_, block, device):
        assert device.type == "cpu"
        chosen.append(real(n_, block, torch.device("cuda")))  # only the device type is read
        return chosen[-1]

    monkeypatch.setattr(rt, "_rows_per_program", as_on_cuda)
    g = torch.Generator().manual_seed(n * h)
    x = (torch.randn(n, h, generator=g) * 2 + 0.3).to(DT[dt]).requires_grad_(True)
    w = (torch.randn(h, generator=g) * 0.3 + 1 - offset).to(DT[dt]).requires_grad_(True)
    y = rms_norm(x, w, 1e-6, offset=offset, casting=casting)
    assert chosen == [rows] and last_backend["rms_norm"] == "triton"
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    ref = rms_norm64(x64, w64, 1e-6, offset)
    assert rel_err(y, ref) <= tolerance(DT[dt], n=h)
    dy = torch.randn(n, h, generator=g, dtype=torch.float64)
    gx, gw = torch.autograd.grad((y.double() * dy).sum(), (x, w))
    rx, rw = torch.autograd.grad((ref * dy).sum(), (x64, w64))
    terms = 2 * ((offset + w64.detach()) * dy).abs() * torch.rsqrt(x64.detach().pow(2).mean(-1, keepdim=True) + 1e-6)
    tol = tolerance(DT[dt], n=max(h, n), ulps=8)
    assert rel_err(gx, rx, terms.norm().item()) <= tol and rel_err(gw, rw) <= tol


def _strided_rows(g, shape):
    """[..., T, D] with every other T row of a twice-as-long tensor: unit column stride, not dense."""
    *lead, t, d = shape
    return torch.randn(*lead, 2 * t, d, generator=g)[..., ::2, :]


def _strided_cols(g, shape):
    """[..., T, D] as the transpose of [..., D, T]: column stride T."""
    *lead, t, d = shape
    return torch.randn(*lead, d, t, generator=g).transpose(-1, -2)


def _five_d_permuted(g, shape):
    """5-D whose two leading dims cannot merge into a view (a copy when reshaped to 4-D)."""
    b, x, y, t, d = shape
    return torch.randn(b, t, y, x, d, generator=g).permute(0, 3, 2, 1, 4)


# name -> (q shape, k shape, cos shape, unsqueeze_dim, how the tensor is made)
ROPE_LAYOUTS = {
    "2d": ((6, 12), (6, 12), (8,), 0, None),  # one position's cos for every row, 4 pass-through channels
    "3d": ((5, 3, 16), (5, 1, 16), (5, 16), 1, None),  # [T, heads, D]
    "5d": ((2, 2, 3, 4, 16), (2, 2, 1, 4, 16), (2, 4, 16), 1, None),  # [B, groups, heads, T, D]
    "5d_permuted": ((2, 2, 3, 4, 16), (2, 2, 1, 4, 16), (2, 4, 16), 1, _five_d_permuted),
    "strided_rows": ((2, 3, 5, 16), (2, 1, 5, 16), (2, 5, 12), 1, _strided_rows),
    "strided_cols": ((2, 3, 5, 16), (2, 1, 5, 16), (2, 5, 16), 1, _strided_cols),
}


@pytest.mark.parametrize("layout", sorted(ROPE_LAYOUTS))
def test_rope_reshapes_other_ranks_and_strided_inputs(monkeypatch, layout):
    """q / k of 2, 3 and 5 dims, and 4-D ones that are not dense or have a column stride, go
    through the half-row kernel's reshaping to [B, X, Y, D] (a view where one exists, else a
    copy); values and gradients against float64, with the kernel that ran named."""
    qs, ks, cs, dim, make = ROPE_LAYOUTS[layout]
    g = torch.Generator().manual_seed(len(layout))
    q, k = ((make or (lambda g, shape: torch.randn(shape, generator=g)))(g, s) for s in (qs, ks))
    assert q.is_contiguous() == k.is_contiguous() == (make is None)
    q, k = q.requires_grad_(True), k.requires_grad_(True)
    ang = torch.rand(cs[:-1] + (cs[-1] // 2,), generator=g) * 6.3
    ang = torch.cat([ang, ang + 0.2], -1)
    cos, sin = ang.cos(), ang.sin()
    calls = []
    if expected_backend() == "triton":
        from liger_compat.kernels import _rope_triton

        real = _rope_triton._rope_one
        monkeypatch.setattr(_rope_triton, "_rope_one", lambda *a: calls.append(a[0].dim()) or real(*a))
    qe, ke = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=dim)
    assert last_backend["rope"] == expected_backend()
    assert qe.shape == q.shape and ke.shape == k.shape
    q64, k64 = q.detach().double().requires_grad_(True), k.detach().double().requires_grad_(True)
    rq, rk = rope64(q64, cos, sin, dim), rope64(k64, cos, sin, dim)
    assert rel_err(qe, rq) <= F32 and rel_err(ke, rk) <= F32
    gq, gk = torch.randn(qe.shape, generator=g), torch.randn(ke.shape, generator=g)
    dq, dk = torch.autograd.grad((qe * gq).sum() + (ke * gk).sum(), (q, k))
    rdq, rdk = torch.autograd.grad((rq * gq).sum() + (rk * gk).sum(), (q64, k64))
    assert rel_err(dq, rdq) <= F32 and rel_err(dk, rdk) <= F32
    if expected_backend() == "triton":
        # the half-row kernel for q and k in the forward, and in the backward where the gradients
        # have the same rank (4-D dense gradients of strided inputs take the flat kernel there)
        assert calls == [q.dim()] * (2 if q.dim() == 4 else 4), calls
