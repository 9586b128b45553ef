"""CUDA tests (skipped without a GPU): the compiled Triton kernels at model-like shapes.

Compared with float64 references on fresh random bf16/fp32 inputs, and the fused loss with the
eager bf16 LM head (materialised logits, fp32 cross-entropy), which is what it replaces.
"""

from __future__ import annotations

import pytest
import torch

from liger_compat import _config
from liger_compat.kernels import (
    TargetOutOfRangeError,
    _device_errors,
    apply_rotary_pos_emb,
    cross_entropy,
    fused_linear_cross_entropy,
    geglu,
    last_backend,
    raise_target_errors,
    rms_norm,
    swiglu,
)
from harness import tolerance
from reference64 import ce64, ce_units, geglu64, rel_err, rms_norm64, rope64, swiglu64

pytestmark = pytest.mark.gpu


def _flce_inputs(n, h, v, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hid = (torch.randn(n, h, device="cuda", generator=g)).to(dtype)
    w = (torch.randn(v, h, device="cuda", generator=g) / h**0.5).to(dtype)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[torch.rand(n, device="cuda", generator=g) < 0.1] = -100
    return hid, w, t


@pytest.mark.parametrize("n,h,v", [(1, 64, 1000), (1031, 1000, 32011), (4096, 2048, 128256)])
@pytest.mark.parametrize("opts", [{}, {"softcap": 30.0, "label_smoothing": 0.1, "lse_square_scale": 1e-4}])
@pytest.mark.parametrize("logits_impl", ["cublas", "triton"])
def test_flce_bf16_vs_eager(n, h, v, opts, logits_impl, monkeypatch):
    import liger_compat.kernels._logits_triton as lt

    calls = []
    real = lt.logits_with_partials
    monkeypatch.setattr(lt, "logits_with_partials", lambda *a, **k: calls.append(1) or real(*a, **k))
    hid, w, t = _flce_inputs(n, h, v, torch.bfloat16, n + v)
    a, b = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = fused_linear_cross_entropy(a, b, t, return_token_accuracy=True, logits_impl=logits_impl, **opts)
    out.loss.backward()
    assert last_backend["fused_linear_cross_entropy"] == "triton"
    # the Triton GEMM runs where its tensor descriptors apply (rows of 16-byte multiples)
    assert bool(calls) == (logits_impl == "triton" and v % 8 == 0 and h % 8 == 0)
    # eager LM head in fp32 (the precision reference)
    h32, w32 = hid.float().requires_grad_(True), w.float().requires_grad_(True)
    logits32 = h32 @ w32.T
    ref, _, acc = ce64(logits32, t, **opts)
    ref.backward()
    # bf16 logits (h products each), rows of v of them; the loss judged against its terms' size
    tol = tolerance(torch.bfloat16, n=max(h, v))
    assert rel_err(out.loss, ref, ce_units(logits32, t, **opts)[0]) <= tol
    assert abs(out.token_accuracy.item() - acc.item()) <= 2.0 / max(1, n)  # bf16 argmax ties
    assert rel_err(a.grad, h32.grad) <= tol
    assert rel_err(b.grad, w32.grad) <= tol


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_flce_fp32_exact_options(reduction):
    hid, w, t = _flce_inputs(300, 96, 5003, torch.float32, 7)
    bias = torch.randn(5003, device="cuda")
    opts = dict(reduction=reduction, softcap=20.0, label_smoothing=0.05, lse_square_scale=1e-3)
    ps = [x.clone().requires_grad_(True) for x in (hid, w, bias)]
    out = fused_linear_cross_entropy(ps[0], ps[1], t, bias=ps[2], return_z_loss=True, **opts)
    p64 = [x.double().requires_grad_(True) for x in (hid, w, bias)]
    ref, zref, _ = ce64(p64[0] @ p64[1].T + p64[2], t, **opts)
    gout = torch.rand(ref.shape, device="cuda", dtype=torch.float64) + 0.5
    (out.loss.double() * gout).sum().backward()
    (ref * gout).sum().backward()
    # fp32 matmuls on the GPU may use TF32: allow its rounding; logits of 96 products, rows of 5003
    tol = tolerance("tf32" if torch.backends.cuda.matmul.allow_tf32 else torch.float32, n=5003)
    assert rel_err(out.loss, ref, ce_units(p64[0] @ p64[1].T + p64[2], t, **opts)[0]) <= tol
    for mine, theirs in zip(ps, p64):
        assert rel_err(mine.grad, theirs.grad) <= tol


def test_flce_all_ignored_and_bad_targets_on_gpu(monkeypatch):
    hid, w, t = _flce_inputs(64, 32, 1000, torch.bfloat16, 3)
    t[:] = -100
    a, b = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = fused_linear_cross_entropy(a, b, t)
    loss.backward()
    assert loss.item() == 0.0 and a.grad.abs().max().item() == 0 and b.grad.abs().max().item() == 0
    t[5] = 1000
    monkeypatch.setattr(_config.settings, "debug", True)
    with pytest.raises(ValueError, match="target"):
        fused_linear_cross_entropy(hid, w, t)
    monkeypatch.setattr(_config.settings, "debug", False)
    with pytest.raises(TargetOutOfRangeError, match=r"holds 1000, outside the vocabulary \[0, 1000\)"):
        assert torch.isnan(fused_linear_cross_entropy(hid, w, t))  # masked: no illegal access
        raise_target_errors()
    torch.cuda.synchronize()


def _graphed_calls(w, calls, seed, n=1024, graphs=True, compiled=False, reset_grad=True, **kw):
    """``calls`` scalar fused losses of fresh bf16 rows against the one weight ``w``, each
    backpropagated, eagerly or in a ``torch.compile``d function (the custom op path); ``w.grad`` set
    to None before each (``reset_grad``) or accumulated over them. Per call: rows, targets, loss,
    grad_hidden, ``w.grad`` and the replays so far; the tensors copies (a compiled backward may hand
    a graph buffer on as a gradient, and a held one keeps the graph from replaying)."""
    from liger_compat.kernels import loss as L

    def loss_of(a, t):
        return fused_linear_cross_entropy(a, w, t, **kw)

    step = torch.compile(loss_of, fullgraph=True) if compiled else loss_of
    old = _config.settings.flce_graphs
    _config.settings.flce_graphs = graphs
    out = []
    try:
        w.grad = None
        for i in range(calls):
            hid, _, t = _flce_inputs(n, w.shape[1], w.shape[0], torch.bfloat16, seed + i)
            a = hid.clone().requires_grad_(True)
            if reset_grad:
                w.grad = None
            loss = step(a, t)
            loss.backward()
            out.append((hid, t, loss.detach().clone(), a.grad.clone(), w.grad.clone(), L._GRAPHS.replays))
            del a, loss
    finally:
        _config.settings.flce_graphs = old
    return out


def test_flce_graph_replays_equal_the_eager_pass_on_gpu():
    """From the third call with one weight and shape the pass is a replayed CUDA graph: each call's
    loss and gradients are those of the eager pass on the same inputs (the same kernels), and within
    bf16 tolerance of float64; a replayed step makes no host sync."""
    from liger_compat.kernels import loss as L

    L._GRAPHS.clear()
    _, w, _ = _flce_inputs(8, 512, 32000, torch.bfloat16, 41)
    w.requires_grad_(True)
    got = _graphed_calls(w, 5, 100)
    assert [r[-1] for r in got] == [0, 0, 1, 2, 3] and L._GRAPHS.captures == 1, L._GRAPHS.failures
    eager = _graphed_calls(w, 5, 100, graphs=False)
    assert L._GRAPHS.replays == 3
    for (hid, t, loss, gh, gw, _), (_, _, loss_e, gh_e, gw_e, _) in zip(got, eager):
        assert rel_err(loss, loss_e) <= 1e-6 and rel_err(gh, gh_e) <= 1e-3 and rel_err(gw, gw_e) <= 1e-3
        h64, w64 = hid.double().requires_grad_(True), w.detach().double().requires_grad_(True)
        ref, _, _ = ce64(h64 @ w64.T, t)
        ref.backward()
        tol = tolerance(torch.bfloat16, n=512)
        assert rel_err(loss, ref) <= tol and rel_err(gh, h64.grad) <= tol and rel_err(gw, w64.grad) <= tol
    hid, _, t = _flce_inputs(1024, 512, 32000, torch.bfloat16, 7)
    a = hid.clone().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_linear_cross_entropy(a, w, t).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert L._GRAPHS.replays == 4


def test_flce_graph_shifts_labels_and_sets_the_empty_nan_inside_the_replay_on_gpu():
    """A patched causal LM's call (``shift_target=True``, ``empty_mean="nan"``, labels ``[B, T]``)
    replays from its third call: each call's loss and gradients are within bf16 tolerance of float64
    on targets shifted here, a replayed call makes no host sync, a call whose labels are all ignored
    replays to NaN with zero gradients, and a bad label at position 1 or later raises as eagerly
    while one at position 0 (no position's target) does not."""
    from liger_compat.kernels import loss as L

    L._GRAPHS.clear()
    _device_errors._pending.clear()
    b, s, hd, v = 2, 512, 256, 8000
    _, w, _ = _flce_inputs(8, hd, v, torch.bfloat16, 51)
    w.requires_grad_(True)
    for call in range(6):
        hid, _, t = _flce_inputs(b * s, hd, v, torch.bfloat16, 500 + call)
        labels = t.view(b, s).clone()
        labels[:, 0] = v + 5  # never a target
        if call == 4:
            labels[:, 1:] = -100
        a = hid.view(b, s, hd).clone().requires_grad_(True)
        w.grad = None
        torch.cuda.synchronize()
        if call >= 3:
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss = fused_linear_cross_entropy(a, w, labels, shift_target=True, empty_mean="nan")
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert L._GRAPHS.replays == max(0, call - 1), L._GRAPHS.failures
        if call == 4:
            assert torch.isnan(loss) and a.grad.abs().max() == 0 and w.grad.abs().max() == 0
            continue
        tgt = torch.full_like(labels, -100)
        tgt[:, :-1] = labels[:, 1:]
        h64, w64 = hid.double().requires_grad_(True), w.detach().double().requires_grad_(True)
        ref, _, _ = ce64(h64 @ w64.T, tgt.reshape(-1))
        ref.backward()
        tol = tolerance(torch.bfloat16, n=hd)
        assert rel_err(loss, ref) <= tol and rel_err(a.grad.view(-1, hd), h64.grad) <= tol
        assert rel_err(w.grad, w64.grad) <= tol
    raise_target_errors()  # the first labels were out of range: no position scores them
    hid, _, t = _flce_inputs(b * s, hd, v, torch.bfloat16, 600)
    labels = t.view(b, s).clone()
    labels[1, 7] = v
    with pytest.raises(TargetOutOfRangeError, match=rf"holds {v}, outside the vocabulary \[0, {v}\)"):
        loss = fused_linear_cross_entropy(hid.view(b, s, hd).requires_grad_(True), w, labels, shift_target=True,
                                          empty_mean="nan")
        assert L._GRAPHS.replays == 5
        loss.backward()
        raise_target_errors()


def test_flce_graph_accumulates_micro_batches_and_reports_bad_labels_on_gpu():
    """Two micro-batches forwarded before one backward (the second finds the graph leased and runs
    eagerly) sum into the weight's gradient as eagerly; a bad label in a replayed call raises as the
    eager pass does, and the next call replays again."""
    from liger_compat.kernels import loss as L

    L._GRAPHS.clear()
    _device_errors._pending.clear()
    _, w, _ = _flce_inputs(8, 256, 8000, torch.bfloat16, 43)
    w.requires_grad_(True)
    _graphed_calls(w, 3, 200, n=512)
    batches = [(x[0].requires_grad_(True), x[2]) for x in (_flce_inputs(512, 256, 8000, torch.bfloat16, 300 + i) for i in range(2))]
    sums = []
    for graphs in (True, False):
        _config.settings.flce_graphs = graphs
        try:
            w.grad = None
            losses = [fused_linear_cross_entropy(h, w, t) for h, t in batches]
            (losses[0] + 0.25 * losses[1]).backward()
        finally:
            _config.settings.flce_graphs = True
        sums.append(w.grad.clone())
    assert L._GRAPHS.replays == 2  # the graph's last call of the three, then the first micro-batch
    assert rel_err(sums[0], sums[1]) <= 1e-3
    h64, w64 = [x.double() for x in (batches[0][0], batches[1][0])], w.detach().double().requires_grad_(True)
    (ce64(h64[0] @ w64.T, batches[0][1])[0] + 0.25 * ce64(h64[1] @ w64.T, batches[1][1])[0]).backward()
    assert rel_err(sums[0], w64.grad) <= tolerance(torch.bfloat16, n=256)
    hid, _, t = _flce_inputs(512, 256, 8000, torch.bfloat16, 44)
    t[3] = 8000
    with pytest.raises(TargetOutOfRangeError, match=r"holds 8000, outside the vocabulary \[0, 8000\)"):
        loss = fused_linear_cross_entropy(hid.requires_grad_(True), w, t)
        assert L._GRAPHS.replays == 3
        loss.backward()
        raise_target_errors()
    assert not _device_errors._pending
    got = _graphed_calls(w, 1, 400, n=512)
    assert got[0][-1] == 4 and torch.isfinite(got[0][2])


@pytest.mark.parametrize("reset_grad", [True, False])
def test_flce_graph_under_torch_compile_equals_the_eager_pass_on_gpu(reset_grad):
    """Under torch.compile the loss's custom op replays the same graph and hands its gradients on
    without copying them: with ``w.grad`` reset before each step every call from the third replays;
    accumulated over the steps (where the weight's gradient may keep the op's buffer alive) the
    calls that find it held run eagerly. Either way each step's loss, grad_hidden and ``w.grad`` are
    those of the same steps with the graphs off, and within bf16 tolerance of float64."""
    from liger_compat.kernels import loss as L

    L._GRAPHS.clear()
    _, w, _ = _flce_inputs(8, 512, 32000, torch.bfloat16, 61)
    w.requires_grad_(True)
    got = _graphed_calls(w, 6, 500, compiled=True, reset_grad=reset_grad)
    replays = got[-1][-1]
    assert L._GRAPHS.captures == 1 and replays >= 1, L._GRAPHS.failures
    if reset_grad:
        assert [r[-1] for r in got] == [0, 0, 1, 2, 3, 4]
    eager = _graphed_calls(w, 6, 500, graphs=False, compiled=True, reset_grad=reset_grad)
    assert L._GRAPHS.replays == replays
    acc = None
    for (hid, t, loss, gh, gw, _), (_, _, loss_e, gh_e, gw_e, _) in zip(got, eager):
        assert rel_err(loss, loss_e) <= 1e-6 and rel_err(gh, gh_e) <= 1e-3 and rel_err(gw, gw_e) <= 1e-3
        h64, w64 = hid.double().requires_grad_(True), w.detach().double().requires_grad_(True)
        ref, _, _ = ce64(h64 @ w64.T, t)
        ref.backward()
        acc = w64.grad if (reset_grad or acc is None) else acc + w64.grad
        tol = tolerance(torch.bfloat16, n=512)
        assert rel_err(loss, ref) <= tol and rel_err(gh, h64.grad) <= tol and rel_err(gw, acc) <= tol


def _bad_label_call(kind, hid, w, t, reduction, compact_ignored=False):
    if kind == "flce":
        a, b = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
        return fused_linear_cross_entropy(a, b, t, reduction=reduction, compact_ignored=compact_ignored), (a, b)
    logits = (hid @ w.T).requires_grad_(True)
    return cross_entropy(logits, t, reduction=reduction), (logits,)


@pytest.mark.parametrize("kind", ["flce", "ce"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("bad", [32000, 10**9, -1, -77])
def test_bad_labels_on_gpu_raise_without_sync_and_context_survives(kind, reduction, bad, monkeypatch):
    """A label outside the vocabulary: the error names it by the backward, or at the latest when
    the pending reports are waited for; the CUDA context is fine afterwards, and a good call's
    forward+backward makes no host sync (the fused loss's opt-in ignored-row compaction aside);
    the bad call itself also runs with the compaction."""
    _device_errors._pending.clear()
    v = 32000
    hid, w, t = _flce_inputs(700, 256, v, torch.float32, 11)
    t[17] = bad
    with pytest.raises(TargetOutOfRangeError, match=rf"holds {bad}, outside the vocabulary \[0, {v}\)"):
        out, _ = _bad_label_call(kind, hid, w, t, reduction, compact_ignored=True)
        out.backward(torch.ones_like(out))
        raise_target_errors()
    assert not _device_errors._pending
    torch.cuda.synchronize()  # no sticky error: the context is usable

    hid, w, t = _flce_inputs(700, 256, v, torch.float32, 12)
    gout = torch.rand(700, device="cuda") + 0.5
    _bad_label_call(kind, hid, w, t, reduction)  # warm-up (compiles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, leaves = _bad_label_call(kind, hid, w, t, reduction)
        out.backward(gout if reduction == "none" else torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    raise_target_errors()  # good labels: nothing to report
    h64, w64 = hid.double().requires_grad_(True), w.double().requires_grad_(True)
    ref, _, _ = ce64(h64 @ w64.T, t, reduction=reduction)
    ref.backward(gout.double() if reduction == "none" else None)
    tol = 1e-2 if torch.backends.cuda.matmul.allow_tf32 else 1e-4
    assert rel_err(out, ref) <= tol
    if kind == "flce":
        assert rel_err(leaves[0].grad, h64.grad) <= tol and rel_err(leaves[1].grad, w64.grad) <= tol


@pytest.mark.parametrize("kept", [700, 4100, 5000])
def test_flce_compaction_behind_queued_work_on_gpu(kept):
    """The compacting pass on the GPU (5000 rows, 2048 a chunk) with fewer kept rows than a chunk,
    several chunks' worth, and every row: the loss and both gradients as the uncompacted pass's
    and the float64 reference's; the ignored rows' gradient exactly 0; the count is read through an
    event behind work still queued (no ``nonzero``, which torch's sync debug mode reports)."""
    n, hdim, v = 5000, 256, 32000
    hid, w, t = _flce_inputs(n, hdim, v, torch.bfloat16, int(torch.randint(0, 2**31, ())))
    t[:] = torch.randint(0, v, (n,), device="cuda")
    ignored = torch.ones(n, dtype=torch.bool, device="cuda")
    ignored[torch.randperm(n, device="cuda")[:kept]] = False
    t[ignored] = -100
    a = torch.randn(2048, 2048, device="cuda")
    outs = {}
    for compact in (True, False, True):  # the first: compiles
        leaves = [x.clone().requires_grad_(True) for x in (hid, w)]
        torch.cuda.synchronize()
        for _ in range(20):  # work still queued when the loss starts
            a = a @ a / a.norm()
        torch.cuda.set_sync_debug_mode("error" if compact else 0)
        try:
            loss = fused_linear_cross_entropy(*leaves, t, compact_ignored=compact)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        loss.backward()
        outs[compact] = (loss, *(x.grad for x in leaves))
    h64, w64 = hid.double().requires_grad_(True), w.double().requires_grad_(True)
    ref, _, _ = ce64(h64 @ w64.T, t)
    ref.backward()
    tol = tolerance(torch.bfloat16, n=v)
    for got in outs.values():
        assert rel_err(got[0], ref) <= tol
        assert rel_err(got[1], h64.grad) <= tol and rel_err(got[2], w64.grad) <= tol
        assert not got[1][ignored].any()


def test_cross_entropy_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(777, 50257, device="cuda", generator=g) * 4).bfloat16().requires_grad_(True)
    t = torch.randint(0, 50257, (777,), device="cuda", generator=g)
    out = cross_entropy(logits, t, softcap=30.0)
    out.backward()
    l64 = logits.detach().double().requires_grad_(True)
    ref = ce64(l64, t, softcap=30.0)[0]
    ref.backward()
    # the same bf16 logits on both sides: an fp32 loss over rows of 50257, a bf16 gradient
    unit = ce_units(l64, t, softcap=30.0)[0]
    assert rel_err(out, ref, unit) <= tolerance(torch.float32, n=50257)
    assert rel_err(logits.grad, l64.grad) <= tolerance(torch.bfloat16, n=50257)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_elementwise_kernels_gpu(dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    tol = tolerance(dtype, n=4097)  # the norm sums 4097 channels (the weight gradient 4099 rows)
    x = (torch.randn(4099, 4097, device="cuda", generator=g) * 2).to(dtype).requires_grad_(True)
    w = torch.randn(4097, device="cuda", generator=g).to(dtype).requires_grad_(True)
    for casting, off in (("llama", 0.0), ("gemma", 1.0)):
        y = rms_norm(x, w, 1e-6, offset=off, casting=casting)
        x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
        r = rms_norm64(x64, w64, 1e-6, off)
        dy = torch.randn_like(r)
        gx, gw = torch.autograd.grad((y.double() * dy).sum(), (x, w))
        rx, rw = torch.autograd.grad((r * dy).sum(), (x64, w64))
        assert last_backend["rms_norm"] == "triton"
        assert rel_err(y, r) <= tol and rel_err(gx, rx) <= 2 * tol and rel_err(gw, rw) <= 2 * tol
    for fn, ref in ((swiglu, swiglu64), (geglu, geglu64)):
        a = (torch.randn(3, 1001, 14337, device="cuda", generator=g) * 3).to(dtype).requires_grad_(True)
        b = torch.randn_like(a).requires_grad_(True)
        y = fn(a, b)
        a64, b64 = a.detach().double().requires_grad_(True), b.detach().double().requires_grad_(True)
        r = ref(a64, b64)
        dy = torch.randn_like(r)
        ga, gb = torch.autograd.grad((y.double() * dy).sum(), (a, b))
        ra, rb = torch.autograd.grad((r * dy).sum(), (a64, b64))
        # the activation is a chain of ~8 fp32 operations, its derivative of ~16
        tol_y, tol_d = tolerance(dtype, n=8), tolerance(dtype, n=16)
        assert rel_err(y, r) <= tol_y and rel_err(ga, ra) <= tol_d and rel_err(gb, rb) <= tol_y


@pytest.mark.parametrize("d,rot,layout", [(128, 128, 1), (128, 64, 2), (80, 40, 1)])
def test_rope_gpu(d, rot, layout):
    g = torch.Generator(device="cuda").manual_seed(2)
    shape_q = (2, 8, 333, d) if layout == 1 else (2, 333, 8, d)
    shape_k = (2, 2, 333, d) if layout == 1 else (2, 333, 2, d)
    q = torch.randn(shape_q, device="cuda", generator=g).bfloat16().requires_grad_(True)
    k = torch.randn(shape_k, device="cuda", generator=g).bfloat16().requires_grad_(True)
    ang = torch.rand(2, 333, rot // 2, device="cuda", generator=g) * 100
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    qe, ke = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=layout)
    assert last_backend["rope"] == "triton"
    rq, rk = rope64(q.detach(), cos, sin, layout), rope64(k.detach(), cos, sin, layout)
    tol = tolerance(torch.bfloat16)
    assert rel_err(qe, rq) <= tol and rel_err(ke, rk) <= tol
    gq, gk = torch.randn_like(rq), torch.randn_like(rk)
    dq, dk = torch.autograd.grad((qe.double() * gq).sum() + (ke.double() * gk).sum(), (q, k))
    q64, k64 = q.detach().double().requires_grad_(True), k.detach().double().requires_grad_(True)
    rdq, rdk = torch.autograd.grad((rope64(q64, cos, sin, layout) * gq).sum() + (rope64(k64, cos, sin, layout) * gk).sum(), (q64, k64))
    assert rel_err(dq, rdq) <= tol and rel_err(dk, rdk) <= tol


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_project_gpu_frees_the_activation(activation):
    """bf16 MLP shape: down(act(gate) * up) keeps one [N, I] buffer less until the backward and
    gives the plain graph's gradients bit for bit."""
    from liger_compat.kernels import gated_project

    n, h, i = 4096, 1024, 4096
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(n, h, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_(True)
    wg = (torch.randn(i, h, device="cuda", generator=g) / h**0.5).to(torch.bfloat16)
    wu = (torch.randn(i, h, device="cuda", generator=g) / h**0.5).to(torch.bfloat16)
    down = torch.nn.Linear(i, h, bias=False, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(n, h, device="cuda", generator=g, dtype=torch.bfloat16)
    fn = swiglu if activation == "silu" else geglu

    def step(fused):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        gate, up = x @ wg.t(), x @ wu.t()
        if fused:
            out = gated_project(gate, up, down, activation=activation, inplace_backward=True)
        else:
            out = down(fn(gate, up, inplace_backward=True))
        del gate, up
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        grads = torch.autograd.grad((out * dy).float().sum(), (x, down.weight))
        return out.detach(), grads, held

    step(False), step(True)  # warm-up: kernels compiled, cuBLAS workspaces allocated (counted as allocated)
    out0, g0, held0 = step(False)
    out1, g1, held1 = step(True)
    assert torch.equal(out0, out1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))  # the same kernels and matmuls on the same inputs
    assert n * i * 2 <= held0 - held1 < n * i * 2 + 2**20, (held0, held1)


def _fp32_head_grads(hid, w, t, softcap=None):
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        h32 = hid.detach().float().requires_grad_(True)
        w32 = w.detach().float().requires_grad_(True)
        z = h32 @ w32.t()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        loss = torch.nn.functional.cross_entropy(z, t, ignore_index=-100)
        gh, gw = torch.autograd.grad(loss, (h32, w32))
        return loss.detach(), gh, gw
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


@pytest.mark.parametrize("config", [None, "m128n256k64w8s3", "m64n256k64w8s3"])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_flce_lowmem_bf16_vs_fp32(softcap, config):
    """The low-memory kernels in bf16 against the all-fp32 head: grad_hidden within 4e-3 (its
    fp32 sum is rounded to bf16 once), grad_weight (bf16 atomic sums) and the loss close too."""
    import liger_compat.kernels.loss as loss_mod

    hid, w, t = _flce_inputs(2053, 2048, 32011, torch.bfloat16, 0)
    hid.requires_grad_(True)
    w.requires_grad_(True)
    w.data *= 2.0
    loss = fused_linear_cross_entropy(hid, w, t, softcap=softcap, mode="lowmem", config=config)
    assert loss_mod.last_flce_mode == "lowmem"
    gh, gw = torch.autograd.grad(loss, (hid, w))
    ref_loss, rh, rw = _fp32_head_grads(hid, w, t, softcap)
    assert abs(loss.item() - ref_loss.item()) < 1e-4 * abs(ref_loss.item())
    assert rel_err(gh, rh) < 4e-3
    assert rel_err(gw, rw) < 2e-2
    assert not gh[t == -100].any()


def test_flce_lowmem_fp32_exact_options():
    """fp32 inputs (IEEE dots) with every option: the float64 reference within fp32 tolerance."""
    g = torch.Generator(device="cuda").manual_seed(1)
    n, h, v = 517, 320, 5003
    hid = torch.randn(n, h, device="cuda", generator=g).requires_grad_(True)
    w = (torch.randn(v, h, device="cuda", generator=g) / h**0.5).requires_grad_(True)
    b = (torch.randn(v, device="cuda", generator=g) * 0.5).requires_grad_(True)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[::7] = -100
    opts = dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=20.0)
    out = fused_linear_cross_entropy(hid, w, t, bias=b, mode="lowmem", return_z_loss=True, return_token_accuracy=True, **opts)
    gh, gw, gb = torch.autograd.grad(out.loss, (hid, w, b))
    h64, w64, b64 = (x.detach().double().requires_grad_(True) for x in (hid, w, b))
    ref, zl, acc = ce64(h64 @ w64.t() + b64, t, **opts)
    rgh, rgw, rgb = torch.autograd.grad(ref, (h64, w64, b64))
    tol = tolerance(torch.float32, n=h * v, ulps=8.0)
    assert rel_err(out.loss.detach(), ref.detach()) < tol
    assert rel_err(out.z_loss, zl.detach()) < tol
    assert abs(out.token_accuracy.item() - acc.item()) < 1e-6
    for got, exp in ((gh, rgh), (gw, rgw), (gb, rgb)):
        assert rel_err(got, exp) < tol


@pytest.mark.parametrize("n,h,v", [(8192, 4096, 128256), (32768, 4096, 128256), (8192, 3584, 256000)])
def test_flce_lowmem_extra_memory_at_most_16_mib(n, h, v):
    """Peak memory of forward + backward beyond the inputs and the returned gradients."""
    import gc

    hid, w, t = _flce_inputs(n, h, v, torch.bfloat16, 0)
    hid.requires_grad_(True)
    w.requires_grad_(True)
    for _ in range(2):  # the second time without first-call allocations (Triton compile, caches)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        gh, gw = torch.autograd.grad(fused_linear_cross_entropy(hid, w, t, mode="lowmem"), (hid, w))
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base - gh.untyped_storage().nbytes() - gw.untyped_storage().nbytes()
        del gh, gw
    assert extra <= 16 * 2**20, f"{extra / 2**20:.1f} MiB"


def test_flce_auto_mode_takes_lowmem_when_the_chunk_does_not_fit(monkeypatch):
    import liger_compat.kernels.loss as loss_mod

    hid, w, t = _flce_inputs(1024, 512, 32000, torch.bfloat16, 2)
    monkeypatch.setattr(_config.settings, "flce_mode", "auto")
    assert loss_mod._free_bytes(hid.device) > 0
    fused_linear_cross_entropy(hid, w, t)
    assert loss_mod.last_flce_mode == "chunked"
    monkeypatch.setattr(loss_mod, "_free_bytes", lambda device: 2**20)
    fused_linear_cross_entropy(hid, w, t)
    assert loss_mod.last_flce_mode == "chunked"  # the free memory is read once per shape
    monkeypatch.setattr(loss_mod, "_auto_modes", {})
    fused_linear_cross_entropy(hid, w, t)
    assert loss_mod.last_flce_mode == "lowmem"


@pytest.mark.parametrize("logits_impl", ["cublas", "triton"])
@pytest.mark.parametrize("n,kept", [(8192, 2048), (2048, 8192)])
def test_flce_fp32_grad_weight_rounds_once_on_gpu(logits_impl, n, kept, monkeypatch):
    """``LIGER_COMPAT_FLCE_FP32_GRAD_WEIGHT``: grad_weight over chunks of 512 rows is one rounding of
    an fp32 sum whose target terms are exact: every ``kept`` rows' gradients (four products of 2048
    at 8192 rows, one of all 2048) go into one fp32-result product. Its error against float64 on the
    same bf16 inputs is within 1.2x that of rounding the float64 result itself and under the
    default's (one rounding a chunk); the loss and grad_hidden are the default's, bit for bit."""
    from liger_compat.kernels import loss as loss_mod

    hid, w, t = _flce_inputs(n, 1024, 16384, torch.bfloat16, int(torch.randint(0, 2**16, ())))
    monkeypatch.setattr(_config.settings, "flce_chunk_mb", "16")  # 512 rows of V=16384 a chunk
    monkeypatch.setattr(loss_mod, "EXACT_GW_ROWS", kept)
    out = {}
    for fp32 in (False, True):
        monkeypatch.setattr(_config.settings, "flce_fp32_grad_weight", fp32)
        a, b = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = fused_linear_cross_entropy(a, b, t, logits_impl=logits_impl)
        out[fp32] = (loss.detach(), *torch.autograd.grad(loss, (a, b)))
    b64 = w.double().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(hid.double() @ b64.t(), t, ignore_index=-100)
    (gw64,) = torch.autograd.grad(ref, b64)
    assert torch.equal(out[False][0], out[True][0]) and torch.equal(out[False][1], out[True][1])
    assert out[True][2].dtype == torch.bfloat16
    got = rel_err(out[True][2], gw64)
    assert got <= 1.2 * rel_err(gw64.to(torch.bfloat16), gw64)
    assert got <= 0.75 * rel_err(out[False][2], gw64)


def test_flce_tile_relative_logits_under_a_shared_offset_on_gpu(monkeypatch):
    """bf16 logits of spread 4 sharing an offset of 256 (a constant hidden feature times a weight
    column of 256), 2048 rows, hidden 1024, 32000 columns, the Triton logits GEMM: stored tile-relative
    (``_logits_triton.SHIFT_LOGITS``), grad_hidden (less the offset's column, 0 in exact arithmetic)
    and grad_weight are within 2x the error of rounding their float64 values to bf16; stored as a
    bf16 product (bf16's spacing at 256 is 2), at least 4x further off."""
    import liger_compat.kernels._logits_triton as lt

    g = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**16, ())))
    n, hd, v = 2048, 1024, 32000
    hid = torch.randn(n, hd, device="cuda", generator=g)
    hid[:, 0] = 1.0
    w = torch.randn(v, hd, device="cuda", generator=g) * (4 / hd**0.5)  # logits of spread 4: mass on a few
    w[:, 0] = 256.0
    hid, w = hid.bfloat16(), w.bfloat16()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[torch.rand(n, device="cuda", generator=g) < 0.1] = -100
    p64 = [x.double().requires_grad_(True) for x in (hid, w)]
    g64 = torch.autograd.grad(torch.nn.functional.cross_entropy(p64[0] @ p64[1].t(), t, ignore_index=-100), p64)
    g64 = (g64[0][:, 1:], g64[1])
    floor = [rel_err(x.to(torch.bfloat16), x) for x in g64]

    def errors():
        a, b = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
        ga, gb = torch.autograd.grad(fused_linear_cross_entropy(a, b, t, logits_impl="triton"), (a, b))
        return [rel_err(ga[:, 1:], g64[0]), rel_err(gb, g64[1])]

    shifted = errors()
    monkeypatch.setattr(lt, "SHIFT_LOGITS", False)
    rounded = errors()
    for got, fl, off in zip(shifted, floor, rounded):
        assert got <= 2 * fl and off >= 4 * got, (shifted, floor, rounded)


@pytest.mark.parametrize("logits_impl", ["cublas", "triton"])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_flce_bf16_peaked_rows_past_the_rounding_of_their_logits_on_gpu(logits_impl, softcap):
    """bf16 peaked rows at a real vocabulary (``test_peaked_rows``'s construction at 512 rows, hidden
    1024, 32000 columns): the chunked loss takes each target logit in fp32, so grad_hidden's error
    against float64 is at most half of a head that stores its logits in bf16."""
    from test_peaked_rows import _peaked_apart, _rounded_head_grad64

    x16, w16, t = _peaked_apart(int(torch.randint(0, 2**16, ())), torch.bfloat16, n=512, h=1024, v=32000,
                                device="cuda")
    a = x16.clone().requires_grad_(True)
    loss = fused_linear_cross_entropy(a, w16, t, reduction="sum", softcap=softcap, logits_impl=logits_impl,
                                      mode="chunked")
    (gh,) = torch.autograd.grad(loss, a)
    x64 = x16.double().requires_grad_(True)
    z = x64 @ w16.double().t()
    zc = z if softcap is None else softcap * torch.tanh(z / softcap)
    (g64,) = torch.autograd.grad(torch.nn.functional.cross_entropy(zc, t, reduction="sum"), x64)
    assert rel_err(gh, g64) <= 0.5 * rel_err(_rounded_head_grad64(x16, w16, t, softcap), g64)


@pytest.mark.parametrize("logits_impl", ["cublas", "triton"])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("compact", [True, False])
def test_flce_bf16_peaked_rows_grad_hidden_rounded_once_on_gpu(logits_impl, softcap, compact):
    """The exact-target correction on the GPU (cuBLAS sums each chunk's ``d @ W`` in fp32 onto it):
    ``test_peaked_rows``'s construction at 512 rows, hidden 1024, 32000 columns, with 64 ignored rows
    among them: grad_hidden's error against float64 is close to that of rounding the float64 result to
    bf16 (1.24x it at softcap 30 on an H100, where the 32000 columns' bf16 logits add their share; at
    most 1.2x it in the 260-column interpreter test), and ignored rows get exact zeros."""
    from test_peaked_rows import _grad_hidden64, _peaked_apart

    x16, w16, t = _peaked_apart(int(torch.randint(0, 2**16, ())), torch.bfloat16, n=512, h=1024, v=32000,
                                device="cuda")
    g = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**16, ())))
    order = torch.randperm(512 + 64, device="cuda", generator=g)
    x_all = torch.cat([x16, torch.randn(64, 1024, device="cuda", generator=g).to(torch.bfloat16)])[order]
    t_all = torch.cat([t, torch.full((64,), -100, device="cuda")])[order]
    a = x_all.clone().requires_grad_(True)
    loss = fused_linear_cross_entropy(a, w16, t_all, reduction="sum", softcap=softcap, logits_impl=logits_impl,
                                      mode="chunked", compact_ignored=compact)
    (gh,) = torch.autograd.grad(loss, a)
    keep = t_all != -100
    assert torch.equal(gh[~keep], torch.zeros_like(gh[~keep]))
    g64 = _grad_hidden64(x_all[keep], w16, t_all[keep], softcap)
    assert rel_err(gh[keep], g64) <= 1.5 * rel_err(g64.to(torch.bfloat16), g64)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_flce_block_sparse_chunks_on_gpu(softcap, monkeypatch):
    """``sparse_grads=True`` at a bf16 head with trained-like logits (``benchmarks.regimes``, 2048 rows,
    hidden 1024, 128256 columns, 256-row chunks): the probe sends the later chunks sparse, they leave
    out more than a quarter of their pairs (about 60 % measured at the Llama-3-8B head), and the
    gradients are about as close to a float64 head as the dense pass's: grad_hidden within 1.5x (the
    left-out pairs' mass given back through mean weight rows adds its own error, ~1.3x at this
    hidden size, 1.0x at the 8B head's), grad_weight within 1.1x; the loss is the dense pass's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.regimes import make_inputs
    from liger_compat.kernels import _sparse_grads_triton as sg

    hid, w, t, _ = make_inputs("trained", 2048, 1024, 128256, softcap=softcap, device="cuda",
                               seed=int(torch.randint(0, 2**16, ())))
    monkeypatch.setattr(_config.settings, "flce_chunk_mb", "64")  # 256 rows a chunk
    out = {}
    for sparse in (False, True):
        monkeypatch.setattr(sg, "last_pairs", None)
        a, b = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = fused_linear_cross_entropy(a, b, t, softcap=softcap, sparse_grads=sparse)
        out[sparse] = (loss.detach(), *torch.autograd.grad(loss, (a, b)))
    left, tested = sg.last_pairs
    assert sg.last_probe >= sg.SPARSE_MIN_SHARE and int(left) > 0.25 * tested
    a64, b64 = hid.double().requires_grad_(True), w.double().requires_grad_(True)
    z = a64 @ b64.t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    ref = torch.nn.functional.cross_entropy(z, t, ignore_index=-100)
    g64 = torch.autograd.grad(ref, (a64, b64))
    assert abs(float(out[True][0]) - float(out[False][0])) <= 1e-5 * abs(float(ref.detach()))
    assert rel_err(out[True][1], g64[0]) <= 1.5 * rel_err(out[False][1], g64[0])
    assert rel_err(out[True][2], g64[1]) <= 1.1 * rel_err(out[False][2], g64[1])


def test_flce_sparse_grads_setting_on_gpu(monkeypatch):
    """``LIGER_COMPAT_FLCE_SPARSE_GRADS`` on, a call naming no ``sparse_grads`` (as a patched model's
    loss calls it): with the loss's CUDA graphs off it runs the sparse pass of ``sparse_grads=True``
    (the same pairs left out, the same gradients); with them on, the same call (small enough to be
    graphed: 2048 x 128256 x 1024) stays dense in every call, the eager first two included."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.regimes import make_inputs
    from liger_compat.kernels import _sparse_grads_triton as sg

    hid, w, t, _ = make_inputs("trained", 2048, 1024, 128256, device="cuda", seed=int(torch.randint(0, 2**16, ())))
    monkeypatch.setattr(_config.settings, "flce_chunk_mb", "64")  # 256 rows a chunk

    def run(**kw):
        monkeypatch.setattr(sg, "last_pairs", None)
        a, b = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = fused_linear_cross_entropy(a, b, t, **kw)
        grads = torch.autograd.grad(loss, (a, b))
        return loss.detach(), grads, None if sg.last_pairs is None else int(sg.last_pairs[0])

    explicit = run(sparse_grads=True)
    assert explicit[2] is not None and explicit[2] > 0
    monkeypatch.setattr(_config.settings, "flce_sparse_grads", True)
    monkeypatch.setattr(_config.settings, "flce_graphs", False)
    by_setting = run()
    assert by_setting[2] == explicit[2]
    assert abs(float(by_setting[0]) - float(explicit[0])) <= 1e-6 * abs(float(explicit[0]))
    for g, g_explicit in zip(by_setting[1], explicit[1]):
        assert rel_err(g, g_explicit) <= 1e-3
    monkeypatch.setattr(_config.settings, "flce_graphs", True)
    assert [run()[2] for _ in range(3)] == [None, None, None]
