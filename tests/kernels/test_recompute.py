"""gated_project: ``down(act(gate) * up)`` whose activation is rebuilt in the backward, not kept.

Checked against float64 references and against the plain ``down(swiglu(gate, up))`` graph (which
keeps the activation alive until the backward: that is what these tests tell apart).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from liger_compat import _config
from liger_compat.kernels import gated_mlp, gated_project, geglu, last_backend, project_norm_output, rms_norm, swiglu
from liger_compat.kernels import _recompute
from liger_compat.kernels import norm as norm_module
from harness import expected_backend, tolerance
from reference64 import geglu64, rel_err, rms_norm64, swiglu64

KINDS = {"silu": (swiglu, swiglu64), "gelu_tanh": (geglu, geglu64)}
#: fp32 through two projections (h = 24 and i <= 48 terms) and the activation's formula
F32 = tolerance(torch.float32, n=24 + 48 + 16)


class _Recorder(torch.nn.Module):
    """A linear projection that remembers (weakly) the tensor it was called with."""

    def __init__(self, lin: torch.nn.Linear) -> None:
        super().__init__()
        self.lin, self.seen = lin, []

    def forward(self, h):
        self.seen.append(weakref.ref(h.untyped_storage()))
        return self.lin(h)


@pytest.fixture(autouse=True)
def _rebuild_norm_outputs_of_any_size(monkeypatch):
    """These tests' norm outputs are a few KiB: below the size the default rebuilds."""
    monkeypatch.setattr(norm_module, "RECOMPUTE_INPUT_MIN_BYTES", 0)


def _setup(seed, rows=(3, 5), h=24, i=40, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*rows, h, generator=g)).to(dtype).requires_grad_(True)
    wg = (torch.randn(h, i, generator=g) / h**0.5).to(dtype)
    wu = (torch.randn(h, i, generator=g) / h**0.5).to(dtype)
    lin = torch.nn.Linear(i, h, bias=True).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(h, i, generator=g) / i**0.5)
        lin.bias.copy_(torch.randn(h, generator=g))
    dy = torch.randn(*rows, h, generator=g, dtype=torch.float64)
    return x, wg, wu, lin, dy


def _grads(x, lin, out, dy):
    return torch.autograd.grad((out.double() * dy).sum(), (x, lin.weight, lin.bias))


@pytest.mark.parametrize("activation", sorted(KINDS))
@pytest.mark.parametrize("inplace", [False, True])
def test_gated_project_matches_float64_and_drops_the_activation(activation, inplace):
    fn, ref_fn = KINDS[activation]
    x, wg, wu, lin, dy = _setup(11 if inplace else 12)
    rec = _Recorder(lin)
    out = gated_project(x @ wg, x @ wu, rec, activation=activation, inplace_backward=inplace)
    assert last_backend[{"silu": "swiglu", "gelu_tanh": "geglu"}[activation]] == expected_backend()
    gc.collect()
    assert rec.seen[0]() is None, "the activation is still alive after the forward"
    dx, dw, db = _grads(x, lin, out, dy)

    x64 = x.detach().double().requires_grad_(True)
    w64, b64 = lin.weight.detach().double().requires_grad_(True), lin.bias.detach().double().requires_grad_(True)
    ref = torch.nn.functional.linear(ref_fn(x64 @ wg.double(), x64 @ wu.double()), w64, b64)
    assert rel_err(out, ref) <= F32
    rdx, rdw, rdb = torch.autograd.grad((ref * dy).sum(), (x64, w64, b64))
    assert rel_err(dx, rdx) <= F32 and rel_err(dw, rdw) <= F32 and rel_err(db, rdb) <= F32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_project_gives_the_plain_graphs_gradients_bit_for_bit(dtype):
    x, wg, wu, lin, dy = _setup(21, rows=(2, 7), dtype=dtype)
    rec = _Recorder(lin)
    plain = rec(swiglu(x @ wg, x @ wu))
    gc.collect()
    assert rec.seen[0]() is not None  # the plain graph keeps it: what gated_project removes
    g_plain = _grads(x, lin, plain, dy)
    fused = gated_project(x @ wg, x @ wu, lin, inplace_backward=True)
    g_fused = _grads(x, lin, fused, dy)
    assert torch.equal(plain, fused)
    for a, b in zip(g_plain, g_fused):
        assert torch.equal(a, b)


def test_every_saved_view_of_the_activation_is_rebuilt():
    """A projection that saves its input twice, one of them a slice (LoRA-like)."""
    x, wg, wu, lin, dy = _setup(31)
    lin2 = torch.nn.Linear(17, 24, bias=False)

    def project(h):
        return lin(h) + lin2(h[..., 3:20]) * torch.sigmoid(h[..., :24])

    out = gated_project(x @ wg, x @ wu, project)
    dx, dw = torch.autograd.grad((out.double() * dy).sum(), (x, lin.weight))
    x64 = x.detach().double().requires_grad_(True)
    w64 = lin.weight.detach().double().requires_grad_(True)
    h64 = swiglu64(x64 @ wg.double(), x64 @ wu.double())
    ref = (torch.nn.functional.linear(h64, w64, lin.bias.detach().double())
           + torch.nn.functional.linear(h64[..., 3:20], lin2.weight.detach().double()) * torch.sigmoid(h64[..., :24]))
    rdx, rdw = torch.autograd.grad((ref * dy).sum(), (x64, w64))
    assert rel_err(out, ref) <= F32 and rel_err(dx, rdx) <= F32 and rel_err(dw, rdw) <= F32


def test_steps_aside_under_other_saved_tensor_hooks_and_without_grad(monkeypatch):
    x, wg, wu, lin, dy = _setup(41)
    seen = []

    def pack(t):
        seen.append(t.shape)
        return t

    rec = _Recorder(lin)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = gated_project(x @ wg, x @ wu, rec)
    gc.collect()
    assert rec.seen[0]() is not None  # the outer hooks saw and kept the activation
    assert torch.Size([3, 5, 40]) in seen
    dx, _, _ = _grads(x, lin, out, dy)
    x64 = x.detach().double().requires_grad_(True)
    ref = torch.nn.functional.linear(swiglu64(x64 @ wg.double(), x64 @ wu.double()),
                                     lin.weight.detach().double(), lin.bias.detach().double())
    (rdx,) = torch.autograd.grad((ref * dy).sum(), x64)
    assert rel_err(dx, rdx) <= F32

    with torch.no_grad():
        assert torch.equal(gated_project(x @ wg, x @ wu, lin), lin(swiglu(x @ wg, x @ wu)))

    monkeypatch.setattr(_config.settings, "mlp_recompute", "input")  # the activation is kept
    rec = _Recorder(lin)
    kept = gated_project(x @ wg, x @ wu, rec)  # noqa: F841 - its graph holds what was saved
    gc.collect()
    assert rec.seen[0]() is not None


def test_bad_activation_and_a_second_backward_are_refused():
    x, wg, wu, lin, dy = _setup(51)
    with pytest.raises(ValueError, match="activation must be one of"):
        gated_project(x @ wg, x @ wu, lin, activation="relu")
    out = gated_project(x @ wg, x @ wu, lin, inplace_backward=True)
    loss = (out.double() * dy).sum()
    loss.backward(retain_graph=True)
    if expected_backend() == "triton":  # the in-place backward overwrote gate / up
        w_grad = lin.weight.grad.clone()
        with pytest.raises(RuntimeError, match="backward ran twice"):
            loss.backward()
        assert torch.equal(lin.weight.grad, w_grad)  # refused before anything was accumulated


def test_applies_only_to_a_whole_contiguous_storage():
    base = torch.randn(4, 6, requires_grad=True) * 1.0
    assert _recompute.applies(base)
    assert not _recompute.applies(base[1:])
    assert not _recompute.applies(base.t())
    assert not _recompute.applies(base.detach())


@pytest.mark.parametrize("casting,offset,wdt", [("llama", 0.0, torch.float32), ("gemma", 1.0, torch.bfloat16),
                                               ("llama", 0.0, torch.bfloat16)])
def test_project_norm_output_drops_the_norm_output(casting, offset, wdt):
    g = torch.Generator().manual_seed(61)
    x = (torch.randn(3, 5, 32, generator=g) * 2).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(32, generator=g) * 0.3 + 1 - offset).to(wdt).requires_grad_(True)
    out_dt = torch.promote_types(x.dtype, w.dtype) if casting == "llama" else x.dtype
    lin_a, lin_b = torch.nn.Linear(32, 16).to(out_dt), torch.nn.Linear(32, 8).to(out_dt)
    dy = torch.randn(3, 5, 24, generator=g, dtype=torch.float64)
    seen = []

    def project(t):
        seen.append(weakref.ref(t.untyped_storage()))
        return torch.cat([lin_a(t), lin_b(t)], -1)

    def run(rebuilt):
        y = rms_norm(x, w, 1e-6, offset=offset, casting=casting)
        out = project_norm_output(y, project) if rebuilt else project(y)
        del y
        gc.collect()
        alive = seen[-1]() is not None
        grads = torch.autograd.grad((out.double() * dy).sum(), (x, w, lin_a.weight))
        return out, grads, alive

    out0, g0, alive0 = run(False)
    out1, g1, alive1 = run(True)
    assert alive0 and not alive1
    assert torch.equal(out0, out1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    ref = rms_norm64(x64, w64, 1e-6, offset)
    wa64 = lin_a.weight.detach().double().requires_grad_(True)
    ref_out = torch.cat([torch.nn.functional.linear(ref, wa64, lin_a.bias.detach().double()),
                         torch.nn.functional.linear(ref, lin_b.weight.detach().double(), lin_b.bias.detach().double())], -1)
    r = torch.autograd.grad((ref_out * dy).sum(), (x64, w64, wa64))
    tol = tolerance(torch.bfloat16, n=32 + 24)  # bf16: the norm sums 32 channels, the projections 32 terms, the weight gradient 15 rows
    assert rel_err(out1, ref_out) <= tol
    assert all(rel_err(a, b) <= tol for a, b in zip(g1, r))


def test_norm_outputs_below_the_size_floor_are_kept(monkeypatch):
    """A norm output smaller than RECOMPUTE_INPUT_MIN_BYTES is kept (its rebuild would cost the host
    more than the buffer is worth); from that size on it is dropped, with the same gradients."""
    g = torch.Generator().manual_seed(83)
    x = torch.randn(6, 32, generator=g, requires_grad=True)
    w = torch.randn(32, generator=g)
    lin = torch.nn.Linear(32, 8)
    dy = torch.randn(6, 8, generator=g)
    nbytes = 6 * 32 * 4

    def run(floor):
        monkeypatch.setattr(norm_module, "RECOMPUTE_INPUT_MIN_BYTES", floor)
        seen = []

        def project(t):
            seen.append(weakref.ref(t.untyped_storage()))
            return lin(t)

        out = project_norm_output(rms_norm(x, w), project)
        gc.collect()
        alive = seen[0]() is not None
        return alive, torch.autograd.grad((out * dy).sum(), (x, lin.weight))

    kept, g_kept = run(nbytes + 1)
    dropped, g_dropped = run(nbytes)
    assert kept and not dropped
    assert all(torch.equal(a, b) for a, b in zip(g_kept, g_dropped))


def test_project_norm_output_leaves_other_tensors_alone():
    g = torch.Generator().manual_seed(71)
    x = torch.randn(4, 16, generator=g, requires_grad=True)
    w = torch.randn(16, generator=g)
    lin = torch.nn.Linear(16, 8)
    seen = []

    def project(t):
        seen.append(weakref.ref(t.untyped_storage()))
        return lin(t)

    kept = [project_norm_output(x * 2.0, project), project_norm_output(rms_norm(x, w)[1:], project)]
    gc.collect()
    assert all(r() is not None for r in seen) and len(kept) == 2


@pytest.mark.parametrize("bias,train_w", [(True, True), (False, True), (False, False)])
@pytest.mark.parametrize("activation", sorted(KINDS))
def test_plain_linear_runs_as_one_node_with_the_plain_graphs_gradients(bias, train_w, activation):
    fn, ref_fn = KINDS[activation]
    x, wg, wu, lin, dy = _setup(81, rows=(2, 9), i=48)
    if not bias:
        lin.bias = None
    lin.weight.requires_grad_(train_w)
    wanted = [x] + ([lin.weight] if train_w else []) + ([lin.bias] if bias else [])
    out = gated_project(x @ wg, x @ wu, lin, activation=activation, inplace_backward=True)
    assert type(out.grad_fn).__name__ == "_GatedLinearBackward"
    got = torch.autograd.grad((out.double() * dy).sum(), wanted)
    plain = lin(fn(x @ wg, x @ wu))
    want = torch.autograd.grad((plain.double() * dy).sum(), wanted)
    # the same fp32 operations; the weight gradient's sum over the 18 rows may run in another order
    assert rel_err(out, plain) <= F32
    for a, b in zip(got, want):
        assert rel_err(a, b) <= F32
    x64 = x.detach().double().requires_grad_(True)
    ref = torch.nn.functional.linear(ref_fn(x64 @ wg.double(), x64 @ wu.double()), lin.weight.detach().double(),
                                     None if lin.bias is None else lin.bias.detach().double())
    (rdx,) = torch.autograd.grad((ref * dy).sum(), x64)
    assert rel_err(got[0], rdx) <= F32


def test_hooked_or_instance_patched_linear_is_called_not_bypassed():
    x, wg, wu, lin, dy = _setup(91)
    calls = []
    handle = lin.register_forward_hook(lambda m, i, o: calls.append("hook"))
    out = gated_project(x @ wg, x @ wu, lin)
    handle.remove()
    assert calls == ["hook"] and type(out.grad_fn).__name__ != "_GatedLinearBackward"
    rec = _Recorder(torch.nn.Linear(40, 24))
    lin2 = rec.lin
    lin2.forward = lambda h: calls.append("forward") or torch.nn.functional.linear(h, lin2.weight, lin2.bias)
    gated_project(x @ wg, x @ wu, lin2)
    assert calls[-1] == "forward"


def test_a_projection_error_is_marked_as_not_a_refusal():
    x, wg, wu, _, _ = _setup(95)

    def broken(h):
        raise ValueError("projection: boom")

    with pytest.raises(ValueError, match="projection: boom") as info:
        gated_project(x @ wg, x @ wu, broken)
    assert info.value.liger_compat_passed_on
    with pytest.raises(ValueError, match="must match") as info:
        gated_project(x @ wg, (x @ wu)[..., :5], broken)
    assert not getattr(info.value, "liger_compat_passed_on", False)


def test_views_saved_by_several_consumers_share_one_rebuild():
    g = torch.Generator().manual_seed(97)
    a = torch.randn(6, 16, generator=g, requires_grad=True)
    lin1, lin2 = torch.nn.Linear(16, 8), torch.nn.Linear(16, 4)
    calls = []

    def remake():
        calls.append(1)
        return (a * 3.0).detach()

    out = _recompute.call_recomputing(lambda t: torch.cat([lin1(t), lin2(t)], -1), a * 3.0, remake)
    gw1, gw2, ga = torch.autograd.grad(out.pow(2).sum(), (lin1.weight, lin2.weight, a))
    assert len(calls) == 1
    a64 = a.detach().double().requires_grad_(True)
    w1, w2 = lin1.weight.detach().double().requires_grad_(True), lin2.weight.detach().double().requires_grad_(True)
    ref = torch.cat([torch.nn.functional.linear(a64 * 3, w1, lin1.bias.detach().double()),
                     torch.nn.functional.linear(a64 * 3, w2, lin2.bias.detach().double())], -1)
    r1, r2, ra = torch.autograd.grad(ref.pow(2).sum(), (w1, w2, a64))
    assert rel_err(gw1, r1) <= F32 and rel_err(gw2, r2) <= F32 and rel_err(ga, ra) <= F32


def test_the_setting_picks_the_parts_and_names_itself_when_wrong(monkeypatch):
    for value, parts in (("1", {"activation", "input"}), ("0", set()), ("off", set()),
                         ("activation", {"activation"}), (" input , activation", {"activation", "input"})):
        monkeypatch.setattr(_config.settings, "mlp_recompute", value)
        assert gated_mlp.recompute_parts() == parts
    monkeypatch.setattr(_config.settings, "mlp_recompute", "activations")
    x, wg, wu, lin, _ = _setup(99)
    with pytest.raises(ValueError, match="LIGER_COMPAT_MLP_RECOMPUTE") as info:
        gated_project(x @ wg, x @ wu, lin)
    assert info.value.liger_compat_passed_on  # the MLP shim passes it on instead of falling back
    monkeypatch.setattr(_config.settings, "mlp_recompute", "activation")
    seen, lin2 = [], torch.nn.Linear(24, 3)
    kept = project_norm_output(rms_norm(x, torch.ones(24)),
                               lambda t: seen.append(weakref.ref(t.untyped_storage())) or lin2(t))
    gc.collect()
    assert seen[0]() is not None and kept is not None  # "input" not named: the norm output is kept


def test_linear_params_accepts_exactly_a_plain_layer():
    """The plain-linear test reads the layer's own tables: the same answer as reading its
    attributes, for every way a layer stops being ``F.linear(x, weight, bias)``."""
    import torch.nn.modules.module as module_globals

    from liger_compat.kernels.gated_mlp import linear_params, plain_linear

    x = torch.randn(3, 8)
    lin = torch.nn.Linear(8, 4)
    assert linear_params(lin, x) == (lin.weight, lin.bias) and plain_linear(lin, x)
    lin.bias = None  # registered as None: a layer without a bias
    assert linear_params(lin, x) == (lin.weight, None)
    assert linear_params(lin, x.double()) is None  # another dtype than the input's
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear_params(lin, x) is None
    handle = lin.register_forward_pre_hook(lambda m, a: None)
    assert linear_params(lin, x) is None
    handle.remove()
    handle = module_globals.register_module_forward_hook(lambda m, a, o: None)
    try:
        assert linear_params(lin, x) is None  # a global hook runs on every module call
    finally:
        handle.remove()
    assert linear_params(lin, x) is not None
    lin.weight.ds_id = 7  # a DeepSpeed ZeRO-3 partition
    assert linear_params(lin, x) is None
    del lin.weight.ds_id
    sub = type("MyLinear", (torch.nn.Linear,), {})(8, 4)  # a subclass may compute anything
    assert linear_params(sub, x) is None
    plain_weight = torch.nn.Linear(8, 4)
    w = plain_weight.weight.detach().clone()
    del plain_weight.weight
    plain_weight.weight = w  # a plain tensor attribute, no parameter
    assert linear_params(plain_weight, x) is None
    own_forward = torch.nn.Linear(8, 4)
    own_forward.forward = lambda h: h
    assert linear_params(own_forward, x) is None
