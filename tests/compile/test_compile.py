"""``torch.compile`` of patched models and of the kernels: one graph, our ops in it, native numbers.

Each family's tiny model is compiled with ``fullgraph=True`` (a graph break raises) and trained one
step (forward with labels, backward); the loss and every parameter gradient are compared with the
same weights run eagerly *without* liger_compat. A second step of the same shape must reuse the
compiled graph (``error_on_recompile``). The family tests use the ``aot_eager`` backend (TorchDynamo
and AOT autograd with fake tensors: everything but Inductor's code generation, ~10 s a family on
CPU); Inductor itself runs in the ``slow`` test.
"""

from __future__ import annotations

import math
import os
import subprocess

import pytest
import torch

import liger_compat
from liger_compat import kernels
from liger_compat.kernels import _dispatch
from liger_compat.compat.families import FAMILIES
from liger_compat.compat.tiny_models import FamilyUnavailable, build

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from reference64 import ce64, geglu64, rel_err, rms_norm64, rope64, swiglu64  # noqa: E402

from patch_helpers import CORE_FAMILIES  # noqa: E402

#: the op set each step must show is the core families' (the families added later have their own
#: module mix, checked eagerly by tests/models/test_families.py)
FAMILY_NAMES = [f.name for f in FAMILIES if f.name in CORE_FAMILIES]
ROOT = Path(__file__).resolve().parents[2]


def _expected_backend() -> str:
    """What the ops' real implementations must have run: the Triton kernels under
    ``TRITON_INTERPRET=1`` (:func:`test_compiled_kernels_under_interpreter`), else the torch reference."""
    return "triton" if _dispatch.interpret_mode() else "torch"
F32_TOL = 1000 * torch.finfo(torch.float32).eps  # ~1.2e-4: chunked sums in another order


class Recorder:
    """A torch.compile backend that keeps every FX graph it is given and then runs ``inner``."""

    def __init__(self, inner: str = "aot_eager") -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.inner = inner

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self.inner)(gm, example_inputs)

    def ops(self) -> set[str]:
        """``liger_compat::...`` ops called in the recorded graphs."""
        out = set()
        for gm in self.graphs:
            for node in gm.graph.nodes:
                name = str(getattr(node.target, "name", lambda: "")() if callable(getattr(node.target, "name", None))
                           else node.target)
                if "liger_compat" in name:
                    out.add(name.split("::")[-1].split(".")[0])
        return out


def _tiny(family: str, **kw):
    try:
        return build(family, seed=0, **kw).train()
    except FamilyUnavailable as exc:
        pytest.skip(str(exc))


def _batch(model, seed: int, b: int = 2, t: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (b, t), generator=g)
    labels = ids.clone()
    labels[torch.rand(b, t, generator=g) < 0.25] = -100
    return ids, labels


_OP_OF_KERNEL = {"fused_linear_cross_entropy": "flce_with_grads", "rms_norm": "rms_norm_fwd", "rope": "rope",
                 "swiglu": "gated_fwd", "geglu": "gated_fwd"}


def _ops_of_eager_kernels(model, ids, labels) -> set[str]:
    """The ops a compiled training step should contain: one per kernel an eager step of the patched
    model runs (Mixtral's transformers-5 experts are fused tensors with no MLP module to patch)."""
    from liger_compat.kernels import _dispatch

    _dispatch.last_backend.clear()
    _step(model, ids, labels)
    model.zero_grad(set_to_none=True)
    return {_OP_OF_KERNEL[k] for k in _dispatch.last_backend}


def _gated_linear_op(model, eager_ops: set[str]) -> set[str]:
    """``{"gated_linear_fwd"}`` where the compiled step should hold that op: the eager step ran the
    gated kernel and the model's MLPs have separate gate / up / down projections (the layout the
    compiled route takes; fused ``gate_up_proj`` and Mixtral 4.x's w1 / w3 / w2 stay native) and a
    forward that reads nothing else (``plain_gated_forward``, tested on its own below: transformers
    4.45's Llama MLP has a ``pretraining_tp`` branch and stays native)."""
    from liger_compat.shims import gated_mlp as shim

    split = [m for m in model.modules() if "MLP" in type(m).__name__
             and all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))]
    plain = any(shim.plain_gated_forward(type(m).forward.__wrapped__) for m in split)
    return {"gated_linear_fwd"} if "gated_fwd" in eager_ops and plain else set()


#: families tried, in order, for the tests that need an MLP the compiled route takes
_ROUTE_FAMILIES = ("llama", "mistral", "qwen2")


def _route_family() -> str:
    """The first of :data:`_ROUTE_FAMILIES` whose MLP forward, in the installed transformers, is
    exactly ``down(act(gate(x)) * up(x))`` (transformers 4.45's Llama is not: ``pretraining_tp``)."""
    from liger_compat.shims import gated_mlp as shim

    for family in _ROUTE_FAMILIES:
        mlp = _tiny(family).model.layers[0].mlp
        if shim.plain_gated_forward(type(mlp).forward.__wrapped__):
            return family
    pytest.skip(f"no MLP forward of {_ROUTE_FAMILIES} is a plain gated one in this transformers")


def _native_step(model, ids, labels):
    errors = liger_compat.revert()
    assert not errors, errors
    try:
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
    finally:
        liger_compat.apply()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), grads


def _step(model, ids, labels):
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out


def _assert_matches(loss, model, ref_loss, ref_grads, tol=F32_TOL):
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=tol, atol=tol * ref_loss.abs().item())
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(ref_grads)
    for name, ref in ref_grads.items():
        err = (got[name] - ref).abs().max().item()
        assert err <= tol * max(ref.abs().max().item(), 1e-6), (name, err, ref.abs().max().item())


#: what fullgraph compilation raises on a graph break: an unsupported construct, or a guard on a
#: data-dependent value (Mixtral's expert routing ``.nonzero().tolist()`` on transformers 4.52)
#: what a fullgraph compile of a training step raises on code it cannot take; TorchRuntimeError:
#: transformers 5.0's Mixtral grouped-mm path rejects float32 experts while tracing
_GRAPH_BREAKS = (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError, torch._dynamo.exc.TorchRuntimeError,
                 torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode)


def _skip_if_native_breaks_too(model, ids, labels, family):
    """Older transformers break the graph in their own code (phi3's attention logs through
    ``logger.warning_once`` on 4.45; Mixtral's data-dependent expert routing, in the forward or, on
    5.20-5.22, in the grouped-mm fallback's backward): not ours to fix, so the fullgraph test does
    not apply there (5.0's Mixtral grouped-mm refuses float32 experts while tracing). The native model
    is compiled the same way (fullgraph, a training step)."""
    import transformers

    torch._dynamo.reset()
    errors = liger_compat.revert()
    assert not errors, errors
    reason = None
    try:
        try:
            torch.compile(model, fullgraph=True, backend=Recorder())(input_ids=ids, labels=labels).loss.backward()
        except _GRAPH_BREAKS + (torch._dynamo.exc.BackendCompilerFailed,) as exc:
            reason = str(exc).strip().splitlines()[0][:160]
        finally:
            model.zero_grad(set_to_none=True)
    finally:
        liger_compat.apply()
        torch._dynamo.reset()
    if reason:
        pytest.skip(f"native {family} on transformers {transformers.__version__} breaks the graph too: {reason}")


@pytest.fixture
def route_tiny_mlps(monkeypatch):
    """The compiled MLP route taken at the tiny models' sizes too (below its size bound otherwise)."""
    from liger_compat.shims import gated_mlp as shim

    monkeypatch.setattr(shim, "COMPILED_ROUTE_MIN_BYTES", 0)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_fullgraph_training_step_matches_native(family, route_tiny_mlps):
    model = _tiny(family)
    batches = [_batch(model, seed=1), _batch(model, seed=2)]
    # native references first: reverting and re-applying the patches between compiled steps would
    # (rightly) recompile. Mixtral's native forward installs its router-logit capturing hooks on
    # the first call, under a lock dynamo cannot trace: a break of native code, not ours.
    refs = [_native_step(model, ids, labels) for ids, labels in batches]
    expected = _ops_of_eager_kernels(model, *batches[0])

    rec = Recorder()
    compiled = torch.compile(model, fullgraph=True, backend=rec)
    for i, ((ids, labels), (ref_loss, ref_grads)) in enumerate(zip(batches, refs)):
        # the second batch has the same shape: the graph of the first is reused, no recompile
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            try:
                out = _step(compiled, ids, labels)
            except _GRAPH_BREAKS + (torch._dynamo.exc.BackendCompilerFailed,):
                _skip_if_native_breaks_too(model, ids, labels, family)
                raise
        assert out.logits is None and out.token_accuracy is not None  # the fused forward ran
        _assert_matches(out.loss, model, ref_loss, ref_grads)
        model.zero_grad(set_to_none=True)
    assert len(rec.graphs) == 1
    assert {"flce_with_grads", "rms_norm_fwd", "rope"} <= expected  # every family's eager step: at least these
    # compiled, the layer kernels step aside (Inductor fuses the native ops); the fused loss stays,
    # and a gate / up / down MLP is one op that keeps no activation
    assert rec.ops() == {"flce_with_grads"} | _gated_linear_op(model, expected), (rec.ops(), expected)


def test_compiled_small_head_keeps_the_native_loss_where_a_kernel_would_run(monkeypatch):
    """Traced by torch.compile, a training forward whose head is at most
    ``COMPILED_NATIVE_LOSS_MAX_MACS`` rows x vocabulary x hidden runs the native forward (logits
    returned, no op of ours in the graph, native's loss and gradients) where a kernel would run (a
    forced backend stands for a GPU here); above the bound the fused loss's op, and on CPU tensors
    with no forced backend the bound does not apply. Eager calls never read it."""
    from liger_compat.kernels import _dispatch
    from liger_compat.shims import causal_lm

    model = _tiny("llama")
    ids, labels = _batch(model, seed=5)
    vocab, hidden = model.lm_head.weight.shape
    macs = labels.numel() * vocab * hidden
    ref_loss, ref_grads = _native_step(model, ids, labels)
    seen = {}
    for case, bound, forced in (("small", macs, True), ("above", macs - 1, True), ("cpu", macs, False)):
        monkeypatch.setattr(causal_lm, "COMPILED_NATIVE_LOSS_MAX_MACS", bound)
        torch._dynamo.reset()
        rec = Recorder()
        compiled = torch.compile(model, fullgraph=True, backend=rec)
        if forced:
            with _dispatch.use_backend("torch"):
                out = _step(compiled, ids, labels)
        else:
            out = _step(compiled, ids, labels)
        _assert_matches(out.loss, model, ref_loss, ref_grads)
        model.zero_grad(set_to_none=True)
        seen[case] = (out.logits is not None, rec.ops())
    assert seen["small"] == (True, set()), seen
    assert seen["above"][0] is False and "flce_with_grads" in seen["above"][1], seen
    assert seen["cpu"][0] is False, seen  # the fused forward's output: the bound does not apply on CPU

    class CudaGraphed(Recorder):  # what mode="reduce-overhead" hands dynamo: Inductor's wrapper, this config
        config = dict(torch._TorchCompileInductorWrapper("reduce-overhead", None, False).config)

    assert CudaGraphed.config.get("triton.cudagraphs") is True
    monkeypatch.setattr(causal_lm, "COMPILED_NATIVE_LOSS_MAX_MACS", macs)
    torch._dynamo.reset()
    rec = CudaGraphed()
    with _dispatch.use_backend("torch"):
        out = _step(torch.compile(model, fullgraph=True, backend=rec), ids, labels)
    _assert_matches(out.loss, model, ref_loss, ref_grads)
    model.zero_grad(set_to_none=True)
    assert out.logits is None and "flce_with_grads" in rec.ops()  # replayed as CUDA graphs: the op stays
    monkeypatch.setattr(causal_lm, "COMPILED_NATIVE_LOSS_MAX_MACS", 2**62)
    with _dispatch.use_backend("torch"):
        assert _step(model, ids, labels).logits is None  # eager: the fused forward, whatever the bound


@pytest.mark.cpu_native
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_fullgraph_default_cpu_step_is_native_code_in_one_graph(family):
    """The default CPU path (``LIGER_COMPAT_CPU_NATIVE``: transformers' own modules, the loss as the
    head computes it) under ``fullgraph=True``: one graph, reused by the second batch, none of the
    package's ops in it, and native's loss and gradients; the output is still the fused one."""
    from liger_compat import _config

    assert _config.settings.cpu_native
    model = _tiny(family)
    batches = [_batch(model, seed=3), _batch(model, seed=4)]
    refs = [_native_step(model, ids, labels) for ids, labels in batches]
    rec = Recorder()
    compiled = torch.compile(model, fullgraph=True, backend=rec)
    for i, ((ids, labels), (ref_loss, ref_grads)) in enumerate(zip(batches, refs)):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = _step(compiled, ids, labels)
        assert out.logits is None and out.token_accuracy is not None
        _assert_matches(out.loss, model, ref_loss, ref_grads)
        model.zero_grad(set_to_none=True)
    assert len(rec.graphs) == 1 and rec.ops() == set(), rec.ops()


@pytest.mark.slow
def test_inductor_training_steps_match_native():
    """Inductor's generated code (not only the traced graph) around our ops, three steps."""
    model = _tiny("gemma2")  # soft-capped head, offset norm, GeGLU
    batches = [_batch(model, seed=s) for s in (1, 2, 3)]
    refs = [_native_step(model, ids, labels) for ids, labels in batches]
    compiled = torch.compile(model, fullgraph=True)
    for i, ((ids, labels), (ref_loss, ref_grads)) in enumerate(zip(batches, refs)):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = _step(compiled, ids, labels)
        _assert_matches(out.loss, model, ref_loss, ref_grads)
        model.zero_grad(set_to_none=True)


def test_eval_forward_with_and_without_labels_under_compile():
    """No grad: the per-row loss op; without labels the native logits, all in one graph each."""
    model = _tiny("llama").eval()
    ids, labels = _batch(model, seed=3)
    _skip_if_native_breaks_too(model, ids, labels, "llama")
    with liger_compat_native():
        with torch.no_grad():
            ref = model(input_ids=ids, labels=labels)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        out = compiled(input_ids=ids, labels=labels)
        logits = compiled(input_ids=ids).logits
    torch.testing.assert_close(out.loss, ref.loss, rtol=F32_TOL, atol=F32_TOL)
    torch.testing.assert_close(logits, ref.logits, rtol=F32_TOL, atol=F32_TOL)


class liger_compat_native:
    def __enter__(self):
        assert not liger_compat.revert()

    def __exit__(self, *exc):
        liger_compat.apply()


# --------------------------------------------------------------------------------------------
# the kernels on their own
# --------------------------------------------------------------------------------------------


@pytest.mark.stack_only
@pytest.mark.parametrize("mode, shape", [("auto", (24, 16, 40)), ("lowmem", (37, 48, 70))])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fused_linear_cross_entropy_compiled_matches_float64(reduction, mode, shape):
    """Every option under compile against float64. ``mode="lowmem"``: the low-memory kernels' custom
    ops where the Triton path runs (the interpreter here), else the chunked ops of the torch reference."""
    g = torch.Generator().manual_seed(0 if mode == "auto" else 1)
    n, hdim, v = shape
    h = torch.randn(n, hdim, generator=g, requires_grad=True)
    w = (torch.randn(v, hdim, generator=g) * 0.4).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.1).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = -100
    opts = dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=4.0)
    grad_rows = torch.rand(n, generator=g)

    def f(h, w, b, t):
        out = kernels.fused_linear_cross_entropy(h, w, t, bias=b, reduction=reduction, return_z_loss=True,
                                                 return_token_accuracy=True, mode=mode, **opts)
        total = (out.loss * grad_rows).sum() if reduction == "none" else out.loss * 0.7
        return total, out.z_loss, out.token_accuracy

    rec = Recorder()
    _dispatch.last_backend.clear()
    total, z, acc = torch.compile(f, fullgraph=True, backend=rec)(h, w, b, t)
    total.backward()
    assert _dispatch.last_backend == {"fused_linear_cross_entropy": _expected_backend()}
    if mode == "lowmem" and _dispatch.interpret_mode():
        assert "flce_lowmem_rows" in rec.ops()
    else:
        assert ("flce_rows" if reduction == "none" else "flce_with_grads") in rec.ops()

    h64, w64, b64 = (x.detach().double().requires_grad_() for x in (h, w, b))
    loss64, z64, acc64 = ce64(h64 @ w64.T + b64, t, reduction=reduction, **opts)
    total64 = (loss64 * grad_rows.double()).sum() if reduction == "none" else loss64 * 0.7
    total64.backward()
    tol = 100 * torch.finfo(torch.float32).eps
    assert rel_err(total.detach(), total64.detach()) < tol
    assert rel_err(z, z64.detach()) < tol
    assert rel_err(acc, acc64) < tol
    for x, x64 in ((h, h64), (w, w64), (b, b64)):
        assert rel_err(x.grad, x64.grad) < tol


@pytest.mark.stack_only
def test_bad_target_under_compile_is_a_clear_error():
    h = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(10, 8, requires_grad=True)
    t = torch.tensor([1, 2, 3, 10, 4, -100])

    def f(h, w, t):
        return kernels.fused_linear_cross_entropy(h, w, t)

    with pytest.raises(ValueError, match=r"target holds 10, outside the vocabulary \[0, 10\)"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(h, w, t)


@pytest.mark.stack_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_elementwise_kernels_compiled_match_float64(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 16, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(16, generator=g)).to(dtype).requires_grad_()
    a = torch.randn(2, 5, 24, generator=g).to(dtype).requires_grad_()
    u = torch.randn(2, 5, 24, generator=g).to(dtype).requires_grad_()
    q = torch.randn(2, 4, 5, 8, generator=g).to(dtype).requires_grad_()
    k = torch.randn(2, 2, 5, 8, generator=g).to(dtype).requires_grad_()
    ang = torch.randn(2, 5, 4, generator=g)
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
    dy = [torch.randn(s, generator=g).to(dtype) for s in ((2, 5, 16), (2, 5, 24), (2, 5, 24), (2, 4, 5, 8), (2, 2, 5, 8))]

    def f(x, w, a, u, q, k):
        y = kernels.rms_norm(x, w, 1e-6)
        s = kernels.swiglu(a, u)
        ge = kernels.geglu(a, u)
        qe, ke = kernels.apply_rotary_pos_emb(q, k, cos, sin)
        return y, s, ge, qe, ke

    rec = Recorder()
    _dispatch.last_backend.clear()
    outs = torch.compile(f, fullgraph=True, backend=rec)(x, w, a, u, q, k)
    assert {"rms_norm_fwd", "gated_fwd", "rope"} <= rec.ops()
    sum(((o.float() * d.float()).sum() for o, d in zip(outs, dy))).backward()
    assert set(_dispatch.last_backend.values()) == {_expected_backend()}
    assert set(_dispatch.last_backend) == {"rms_norm", "swiglu", "geglu", "rope"}

    leaves = [t.detach().double().requires_grad_() for t in (x, w, a, u, q, k)]
    x6, w6, a6, u6, q6, k6 = leaves
    refs = (rms_norm64(x6, w6, 1e-6), swiglu64(a6, u6), geglu64(a6, u6), rope64(q6, cos.double(), sin.double()),
            rope64(k6, cos.double(), sin.double()))
    sum(((r * d.double()).sum() for r, d in zip(refs, dy))).backward()
    tol = 16 * torch.finfo(dtype).eps
    for o, r in zip(outs, refs):
        assert rel_err(o, r) < tol
    for t, r in zip((x, w, a, u, q, k), leaves):
        assert rel_err(t.grad, r.grad) < tol


@pytest.mark.stack_only
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_linear_compiled_matches_float64(activation):
    """``kernels.gated_mlp.gated_linear`` traced: one ``gated_linear_fwd`` op whose values and four
    gradients (gate, up, weight, bias) are float64's within float32 rounding."""
    from liger_compat.kernels import gated_mlp

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**16, ())))
    gate = torch.randn(2, 7, 24, generator=g).requires_grad_()
    up = torch.randn(2, 7, 24, generator=g).requires_grad_()
    w = (torch.randn(16, 24, generator=g) / 24**0.5).requires_grad_()
    b = torch.randn(16, generator=g).requires_grad_()
    dy = torch.randn(2, 7, 16, generator=g)
    rec = Recorder()
    out = torch.compile(lambda a, u, w, b: gated_mlp.gated_linear(a, u, w, b, activation), fullgraph=True,
                        backend=rec)(gate, up, w, b)
    assert rec.ops() == {"gated_linear_fwd"}
    (out * dy).sum().backward()
    leaves = [t.detach().double().requires_grad_() for t in (gate, up, w, b)]
    act64 = swiglu64 if activation == "silu" else geglu64
    ref = torch.nn.functional.linear(act64(leaves[0], leaves[1]), leaves[2], leaves[3])
    (ref * dy.double()).sum().backward()
    tol = 16 * torch.finfo(torch.float32).eps
    assert rel_err(out, ref) < tol
    for t, r in zip((gate, up, w, b), leaves):
        assert rel_err(t.grad, r.grad) < tol


def test_compiled_step_keeps_no_mlp_activation(monkeypatch):
    """What the compiled training step keeps for its backward (the forward graph's saved outputs
    under the default partitioner): natively (``LIGER_COMPAT_MLP_RECOMPUTE=0``, or an activation
    below the route's size bound) three ``[tokens, intermediate]`` tensors a layer, gate, up and
    ``act(gate) * up``; with the MLP as one ``gated_linear_fwd`` op two, gate and up (the activation
    is written again in the backward)."""
    from liger_compat.shims import gated_mlp as shim

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from liger_compat import _config

    inter = 56  # no other dimension of the model: the saved tensors of that width are the MLP's
    family = _route_family()
    counts = {}
    for case, recompute, bound in (("op", "1", 0), ("setting off", "0", 0), ("small", "1", 2**40)):
        monkeypatch.setattr(_config.settings, "mlp_recompute", recompute)
        monkeypatch.setattr(shim, "COMPILED_ROUTE_MIN_BYTES", bound)
        torch._dynamo.reset()
        model = _tiny(family, intermediate_size=inter)
        ids, labels = _batch(model, seed=3)
        saved: list[tuple[int, ...]] = []

        def keep_saved(gm, example_inputs):
            out = next(n for n in gm.graph.nodes if n.op == "output")
            saved.extend(tuple(a.meta["val"].shape) for a in out.args[0]
                         if hasattr(a, "meta") and hasattr(a.meta.get("val"), "shape"))
            return gm

        be = aot_autograd(fw_compiler=keep_saved, bw_compiler=lambda gm, ex: gm,
                          partition_fn=min_cut_rematerialization_partition)
        _step(torch.compile(model, fullgraph=True, backend=be), ids, labels)
        # [tokens, intermediate] activations (the down projection's [hidden, intermediate] weight is kept too)
        counts[case] = sum(1 for shape in saved if shape and shape[-1] == inter
                                and math.prod(shape[:-1]) == ids.numel())
    layers = model.config.num_hidden_layers
    assert counts == {"op": 2 * layers, "setting off": 3 * layers, "small": 3 * layers}, counts


def _guard_lines(model, ids, labels) -> list[str]:
    """The guards of one compiled training step's frame, one line each (each is evaluated at every
    call of the compiled step), with the objects' ids left out."""
    import re

    from torch._dynamo import eval_frame

    debug = getattr(eval_frame, "_debug_get_cache_entry_list", None)
    if debug is None:
        pytest.skip("this torch has no _debug_get_cache_entry_list to read a frame's guards")
    torch._dynamo.reset()
    _step(torch.compile(model, fullgraph=True, backend="eager"), ids, labels)
    model.zero_grad(set_to_none=True)
    forward = type(model).forward  # the frame TorchDynamo compiled: the class's forward, patched or not
    entries = debug(forward.__code__)
    assert len(entries) == 1, len(entries)
    lines = [line.split("+- ", 1)[1] for line in str(entries[0].guard_manager).splitlines() if "+- " in line]
    return [re.sub(r"\d{6,}", "ID", line.split("  #")[0].strip()) for line in lines if not line.startswith("GuardManager")]


def test_compiled_small_mlp_adds_no_guards_on_its_projections(monkeypatch):
    """Below the compiled route's size bound the patched MLP runs its native forward, and the
    compiled step's frame guards its projections exactly as native's does: the size is read from
    shapes the step's guards hold already, and the plain-layer checks (hooks, the parameters read
    from the layers' tables, their classes and ZeRO-3 attributes: a dozen guards a projection) run
    only where the route is taken. Every guard is evaluated at each call of the compiled step, a
    host-bound small step's time."""
    from liger_compat.shims import causal_lm
    from liger_compat.shims import gated_mlp as shim

    # a small head's compiled step on the kernels' device: the native head and loss
    monkeypatch.setattr(causal_lm, "COMPILED_NATIVE_LOSS_MAX_MACS", 2**39)
    monkeypatch.setattr(_dispatch, "reference_only", lambda device: False)
    model = _tiny(_route_family())
    ids, labels = _batch(model, seed=5)
    assert ids.numel() * model.config.intermediate_size * 4 < shim.COMPILED_ROUTE_MIN_BYTES
    patched = _guard_lines(model, ids, labels)
    errors = liger_compat.revert()
    assert not errors, errors
    try:
        native = _guard_lines(model, ids, labels)
    finally:
        liger_compat.apply()

    def on_projections(lines):
        return sorted(g.replace("L['args'][0]", "L['self']") for g in lines if "_proj']" in g and "L['" in g)

    assert on_projections(patched) == on_projections(native), sorted(set(on_projections(patched))
                                                                   ^ set(on_projections(native)))


def test_compiled_mlp_route_reads_the_forwards_source():
    """Under compile the MLP takes the gated linear op only where its native forward's source is
    exactly ``down_proj(act(gate_proj(x)) * up_proj(x))`` (any spelling through local names, the
    product either way round): a forward that reads anything else keeps its native code, as does a
    device without Triton kernels while ``LIGER_COMPAT_CPU_NATIVE`` is on."""
    from liger_compat import _config
    from liger_compat.shims import gated_mlp as shim

    model = _tiny(_route_family())
    native = type(model.model.layers[0].mlp).forward.__wrapped__  # the forward transformers defines
    assert shim.plain_gated_forward(native) == "act_fn"
    assert shim._compiled_route_eager(native, "cpu") == "act_fn"  # this suite runs with CPU_NATIVE off
    _config.settings.cpu_native = True
    try:
        assert shim._compiled_route_eager(native, "cpu") == ""
    finally:
        _config.settings.cpu_native = False

    def spelled_out(self, x):
        """A docstring."""
        up = self.up_proj(x)
        gated = self.activation_fn(self.gate_proj(x))
        return self.down_proj(up * gated)

    def scaled(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * self.multiplier

    def branch(self, x):
        if self.config.pretraining_tp > 1:
            x = x * 2
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def other_input(self, x, y=None):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def swapped(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    def gate_twice(self, x):
        x = self.gate_proj(x)
        return self.down_proj(self.act_fn(x) * self.up_proj(x))

    assert shim.plain_gated_forward(spelled_out) == "activation_fn"
    for fn in (scaled, branch, other_input, swapped, gate_twice):
        assert shim.plain_gated_forward(fn) is None, fn.__name__


def test_compiled_mlp_route_writes_no_global_the_trace_reads(monkeypatch):
    """The route runs eagerly in the middle of a trace (on torch 2.11, with ``is_compiling()``
    answering False there): had it filled the globals that traced code reads (``_config``'s
    ``is_compiling`` lookup, the shims' kept kernels module), dynamo could not build the guards
    on them and the compile failed (a first compiled call in a process)."""
    from liger_compat import _config
    from liger_compat.shims import _module_shims
    from liger_compat.shims import gated_mlp as shim

    model = _tiny(_route_family())
    native = type(model.model.layers[0].mlp).forward.__wrapped__
    monkeypatch.setattr(_config, "_is_compiling", None)
    monkeypatch.setattr(_module_shims, "_kernels", None)
    assert shim._compiled_route_eager(native, "cpu") == "act_fn"
    assert _config._is_compiling is None and _module_shims._kernels is None


def test_eager_calls_keep_their_autograd_functions():
    """Outside compile nothing changes: the eager nodes (which the MLP recompute reads) are built."""
    x = torch.randn(3, 8, requires_grad=True)
    y = kernels.rms_norm(x, torch.ones(8), 1e-6)
    assert type(y.grad_fn).__name__ == "_RMSNormBackward"


@pytest.mark.interpret
@pytest.mark.stack_only
def test_compiled_kernels_under_interpreter():
    """The kernel tests above with ``TRITON_INTERPRET=1`` in a fresh process: the ops' real
    implementations then run the Triton kernels (row compaction, the out-of-range flag and the
    kernels' bool views included), compiled around by torch.compile. Library-independent (``stack_only``):
    a grid cell on the torch and Triton of CI's passed main run skips it (tests/suite_scope.py)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W", "ignore", str(Path(__file__)),
         "-k", "compiled_match or bad_target"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,  # 20 s alone; only a hang stops it
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert "11 passed" in proc.stdout, tail


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_inductor_training_on_cuda_bf16_matches_native(family, route_tiny_mlps):
    """On the GPU the ops run the Triton kernels (row compaction and the out-of-range flag inside
    the fused loss's op) inside an Inductor graph: one graph, no recompile over three steps, and
    the loss and gradients of native eager bf16 within bf16 rounding of a 2-layer model."""
    model = _tiny(family, dtype=torch.bfloat16, device="cuda")
    batches = [tuple(t.cuda() for t in _batch(model, seed=s, b=4, t=64)) for s in (1, 2, 3)]
    refs = [_native_step(model, ids, labels) for ids, labels in batches]
    rec = Recorder("inductor")
    compiled = torch.compile(model, fullgraph=True, backend=rec)
    _dispatch.last_backend.clear()
    eps = torch.finfo(torch.bfloat16).eps
    for i, ((ids, labels), (ref_loss, ref_grads)) in enumerate(zip(batches, refs)):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = _step(compiled, ids, labels)
        assert rel_err(out.loss.detach().float(), ref_loss.float()) < 4 * eps
        for name, ref in ref_grads.items():
            got = dict(model.named_parameters())[name].grad
            assert rel_err(got.float(), ref.float()) < 16 * eps, name
        model.zero_grad(set_to_none=True)
    assert len(rec.graphs) == 1
    # the other layer kernels step aside under compile
    assert rec.ops() == {"flce_with_grads"} | _gated_linear_op(model, {"gated_fwd"})
    assert set(_dispatch.last_backend.values()) == {"triton"}


def test_patched_forwards_are_plain_functions_with_the_native_signature():
    """What the tracer needs (plain functions, no wrapt proxy) without losing what the rest of the
    package reads: the native signature, the wrapper chain (``is_ours`` / ``unwrap``), and revert
    putting the very same original back."""
    import inspect
    import types

    from liger_compat.shims import causal_lm, gated_mlp, logits_to_keep, rms_norm, rope
    from liger_compat.shims._patching import is_ours, unwrap
    from liger_compat.compat.tiny_models import modeling_module

    mod = modeling_module("llama")
    patched = {
        "LlamaForCausalLM": (vars(mod.LlamaForCausalLM)["forward"], causal_lm._fused_forward),
        "LlamaRMSNorm": (vars(mod.LlamaRMSNorm)["forward"], rms_norm.rms_forward),
        "LlamaMLP": (vars(mod.LlamaMLP)["forward"], gated_mlp.mlp_forward),
        "apply_rotary_pos_emb": (vars(mod)["apply_rotary_pos_emb"], rope.rope_forward),
    }
    for name, (fn, wrapper) in patched.items():
        assert type(fn) is types.FunctionType, name
        assert is_ours(fn, wrapper), name
    assert is_ours(patched["LlamaForCausalLM"][0], logits_to_keep.translate)  # stacked
    assert liger_compat.revert() == []
    try:
        originals = {"LlamaForCausalLM": vars(mod.LlamaForCausalLM)["forward"],
                     "LlamaRMSNorm": vars(mod.LlamaRMSNorm)["forward"],
                     "LlamaMLP": vars(mod.LlamaMLP)["forward"],
                     "apply_rotary_pos_emb": vars(mod)["apply_rotary_pos_emb"]}
    finally:
        liger_compat.apply()
    for name, (fn, _) in patched.items():
        assert unwrap(fn) is unwrap(originals[name]), name
        assert not is_ours(originals[name], patched[name][1]), name
        assert inspect.signature(fn) == inspect.signature(originals[name]), name


_FIRST_CALL_COMPILED = r"""
import torch, liger_compat
from liger_compat.compat.tiny_models import build
from liger_compat.shims import gated_mlp
gated_mlp.COMPILED_ROUTE_MIN_BYTES = 0  # the route at the tiny model's size
model = build(FAMILY, dtype=torch.float32)
model.train()
rec = []
def backend(gm, example_inputs):
    rec.append(gm)
    return torch._dynamo.backends.registry.lookup_backend("aot_eager")(gm, example_inputs)
compiled = torch.compile(model, fullgraph=True, backend=backend)
g = torch.Generator().manual_seed(0)
for i in range(2):
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
    with torch._dynamo.config.patch(error_on_recompile=i > 0):
        out = compiled(input_ids=ids, labels=ids)
    out.loss.backward()
    assert out.logits is None
native = liger_compat._config.settings.cpu_native
ops = {str(n.target) for gm in rec for n in gm.graph.nodes if "gated_linear" in str(n.target)}
assert len(rec) == 1 and bool(ops) is not native, (len(rec), ops)
print("ok")
"""


@pytest.mark.parametrize("cpu_native", ["1", "0"])
def test_a_first_call_under_compile_fills_no_cache_the_next_call_guards_on(cpu_native):
    """In a fresh process whose first patched call is compiled (no eager call before it), the second
    call of the same shape reuses the graph: nothing the wrappers cache per setting is written while
    the first call is traced (a cache entry made then fails the next call's guards). With
    ``LIGER_COMPAT_CPU_NATIVE=0`` the MLP's route (its probe, run eagerly during the trace, keeps its
    verdict) is taken as on a GPU."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "LIGER_COMPAT_CPU_NATIVE": cpu_native}
    script = _FIRST_CALL_COMPILED.replace("FAMILY", repr(_route_family()))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
