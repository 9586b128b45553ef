"""A small RMSNorm on a device with torch's fused RMSNorm kernel runs that op
(``LIGER_COMPAT_RMS_NORM_SMALL_TORCH``, ``shims/rms_norm.py``): Llama's casting on one dtype as it
is, Gemma's casting (Gemma's and Qwen3.5's ``1 + w``, Gemma3n's plain weight) in fp32 with native's
casts around it; everything else runs our kernel.

CPU tensors have no fused kernel (torch's op is a composite there), so the tests say the CPU has one
(``rms_norm._fused_ops``): the route is the same code, torch's composite computes the same math.
Outputs and gradients are compared with a float64 evaluation of the native module's formula.
"""

from __future__ import annotations

import pytest
import torch

import liger_compat
from liger_compat import _config, configure
from liger_compat.kernels import norm as norm_module
from liger_compat.shims import rms_norm as shim

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402


@pytest.fixture
def fused_on_cpu(monkeypatch):
    shim._fused_op(torch.device("cpu"))  # torch's names read, as on a first call
    monkeypatch.setitem(shim._fused_ops, "cpu", torch.nn.functional.rms_norm)
    monkeypatch.setattr(_config.settings, "rms_norm_small_torch", True)


def _llama64(x, w, eps):
    """transformers' LlamaRMSNorm in float64 (its cast to the input dtype left out)."""
    x64 = x.double()
    return w.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps))


def _norm(h: int, dtype, seed: int):
    torch.manual_seed(seed)
    m = LlamaRMSNorm(h, eps=1e-6).to(dtype)
    with torch.no_grad():
        m.weight.copy_(torch.randn(h) * 0.5 + 1.0)
    return m


def _node(y) -> str:
    return type(y.grad_fn).__name__


def _rel(a, b) -> float:
    """``a``'s largest difference from the float64 reference ``b``, relative to ``b``'s largest value."""
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def _count_fused_calls(monkeypatch) -> list:
    """The argument tuples of every call of the route's op (torch's op on CPU, counted)."""
    calls = []
    monkeypatch.setitem(shim._fused_ops, "cpu", lambda *a: calls.append(a) or torch.nn.functional.rms_norm(*a))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_llama_norm_runs_torchs_op_and_matches_native(fused_on_cpu, dtype):
    m = _norm(96, dtype, seed=int(torch.randint(0, 2**31, ())))  # the suite's per-test seed
    x = (torch.randn(3, 7, 96) * 2).to(dtype).requires_grad_(True)
    g = torch.randn(3, 7, 96).to(dtype)
    y = m(x)
    assert _node(y) != "_RMSNormBackward"  # our kernel's autograd node is not in the graph
    assert y.dtype == dtype and y.shape == x.shape
    dx, dw = torch.autograd.grad(y, (x, m.weight), g)
    x64 = x.detach().double().requires_grad_(True)
    w64 = m.weight.detach().double().requires_grad_(True)
    ref = _llama64(x64, w64, 1e-6)
    rdx, rdw = torch.autograd.grad(ref, (x64, w64), g.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # one rounding of the output's dtype (bf16: 2^-8)
    errs = (_rel(y, ref), _rel(dx, rdx), _rel(dw, rdw))
    assert max(errs) < tol, errs


def test_our_kernel_runs_at_and_above_the_bound_off_the_setting_and_on_mixed_dtypes(fused_on_cpu, monkeypatch):
    m = _norm(64, torch.float32, seed=1)
    x = torch.randn(4, 64, requires_grad=True)
    assert _node(m(x)) != "_RMSNormBackward"
    # at the bound (4 x 64 fp32 = 1024 bytes): our kernel, whose output the MLP's recompute rebuilds
    monkeypatch.setattr(norm_module, "RECOMPUTE_INPUT_MIN_BYTES", x.numel() * x.element_size())
    assert _node(m(x)) == "_RMSNormBackward"
    monkeypatch.setattr(norm_module, "RECOMPUTE_INPUT_MIN_BYTES", x.numel() * x.element_size() + 1)
    assert _node(m(x)) != "_RMSNormBackward"
    configure(rms_norm_small_torch=False)
    try:
        assert _config.settings.source["rms_norm_small_torch"] == "configure()"
        assert _node(m(x)) == "_RMSNormBackward"
    finally:
        configure(rms_norm_small_torch=True)
    assert _node(m(x)) != "_RMSNormBackward"
    # a tensor subclass (a DTensor's sharding, another subclass's dispatch): our kernel's path
    class Marked(torch.Tensor):
        pass

    calls = _count_fused_calls(monkeypatch)
    m(torch.randn(4, 64, requires_grad=True))
    assert len(calls) == 1
    m(torch.randn(4, 64).as_subclass(Marked).requires_grad_(True))
    assert len(calls) == 1
    # a bf16 input into an fp32 weight: native promotes the output to fp32; our kernel does too
    y = m(x.detach().to(torch.bfloat16).requires_grad_(True))
    assert _node(y) == "_RMSNormBackward" and y.dtype == torch.float32


def _gemma64(x, w, eps, offset):
    """Gemma's casting in float64: native's fp32 steps (normalise, multiply by ``offset + w``) exact."""
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)) * (offset + w.double())


def _gemma_casting_norm(kind: str, h: int, dtype):
    """(module, weight offset) of a Gemma-casting norm class of transformers, its weight random."""
    if kind == "gemma":  # stores w - 1
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as cls
        off = 1.0
    elif kind == "qwen3_5":  # stores w - 1 too, zero-initialised
        mod = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
        cls, off = mod.Qwen3_5RMSNorm, 1.0
    else:  # Gemma3n: the plain weight, multiplied in fp32 (OLMo2's casting since 4.5x as well)
        mod = pytest.importorskip("transformers.models.gemma3n.modeling_gemma3n")
        cls, off = mod.Gemma3nRMSNorm, 0.0
    m = cls(h, eps=1e-6).to(dtype)
    with torch.no_grad():
        m.weight.copy_(torch.randn(h) * 0.5 + (1.0 - off))
    return m, off


@pytest.mark.parametrize("kind", ["gemma", "qwen3_5", "gemma3n"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_gemma_casting_norms_run_torchs_op_in_fp32_and_match_native(fused_on_cpu, monkeypatch, kind, dtype):
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    m, off = _gemma_casting_norm(kind, 80, dtype)
    calls = _count_fused_calls(monkeypatch)
    x = (torch.randn(2, 9, 80) * 2).to(dtype).requires_grad_(True)
    g = torch.randn(2, 9, 80).to(dtype)
    y = m(x)
    assert len(calls) == 1 and calls[0][0].dtype == torch.float32 and calls[0][2].dtype == torch.float32
    assert _node(y) != "_RMSNormBackward" and y.dtype == dtype and y.shape == x.shape
    dx, dw = torch.autograd.grad(y, (x, m.weight), g)
    x64 = x.detach().double().requires_grad_(True)
    w64 = m.weight.detach().double().requires_grad_(True)
    ref = _gemma64(x64, w64, 1e-6, off)
    rdx, rdw = torch.autograd.grad(ref, (x64, w64), g.double())
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # fp32 math, one rounding of the output (bf16: 2^-8)
    errs = (_rel(y, ref), _rel(dx, rdx), _rel(dw, rdw))
    assert max(errs) < tol, errs
    assert dx.dtype == dtype and dw.dtype == dtype
    # a bf16 input into an fp32 weight: native's output keeps the input's dtype; so does the route
    m32, _ = _gemma_casting_norm(kind, 80, torch.float32)
    xb = torch.randn(3, 80).to(torch.bfloat16)
    assert m32(xb).dtype == torch.bfloat16 and len(calls) == 2


def test_under_autocast_a_half_precision_llama_norm_keeps_our_kernel(fused_on_cpu, monkeypatch):
    """torch's op runs in fp32 under autocast (CUDA's autocast lists it) and returns fp32, where
    native's Llama norm returns the input's dtype: a bf16 Llama norm keeps our kernel there, an fp32
    one and a Gemma-casting one (cast back to the input's dtype) still take torch's op."""
    calls = _count_fused_calls(monkeypatch)
    llama16 = _norm(48, torch.bfloat16, seed=3)
    llama32 = _norm(48, torch.float32, seed=4)
    gemma16, _ = _gemma_casting_norm("gemma", 48, torch.bfloat16)
    x16 = torch.randn(4, 48).to(torch.bfloat16).requires_grad_(True)
    x32 = torch.randn(4, 48, requires_grad=True)
    y = llama16(x16)
    assert len(calls) == 1 and y.dtype == torch.bfloat16  # outside autocast: torch's op
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = llama16(x16)
        assert len(calls) == 1 and _node(y) == "_RMSNormBackward" and y.dtype == torch.bfloat16
        assert _node(llama32(x32)) != "_RMSNormBackward" and len(calls) == 2
        y = gemma16(x16)
        assert len(calls) == 3 and y.dtype == torch.bfloat16


def test_a_device_without_the_fused_kernel_and_other_modes_keep_our_kernel(monkeypatch):
    monkeypatch.setattr(_config.settings, "rms_norm_small_torch", True)
    assert shim._fused_op(torch.device("cpu")) is None  # torch's CPU op is a composite
    m = _norm(32, torch.float32, seed=2)
    assert _node(m(torch.randn(5, 32, requires_grad=True))) == "_RMSNormBackward"
    gemma, _ = _gemma_casting_norm("gemma", 32, torch.float32)
    assert _node(gemma(torch.randn(5, 32, requires_grad=True))) == "_RMSNormBackward"

    monkeypatch.setitem(shim._fused_ops, "cpu", torch.nn.functional.rms_norm)
    assert _node(gemma(torch.randn(5, 32, requires_grad=True))) != "_RMSNormBackward"
    liger_compat.revert()
    try:
        native = LlamaRMSNorm(32)  # unpatched: transformers' own ops
        assert _node(native(torch.randn(5, 32, requires_grad=True))) != "_RMSNormBackward"
    finally:
        liger_compat.apply()


def test_the_setting_reads_from_the_environment_and_the_report_lists_it():
    env = {"LIGER_COMPAT_RMS_NORM_SMALL_TORCH": "0"}
    s = _config._from_env(env)
    assert s.rms_norm_small_torch is False and s.source["rms_norm_small_torch"] == "LIGER_COMPAT_RMS_NORM_SMALL_TORCH"
    assert _config._from_env({}).rms_norm_small_torch is True
    bad = _config._from_env({"LIGER_COMPAT_RMS_NORM_SMALL_TORCH": "maybe"})
    assert bad.rms_norm_small_torch is True and "ignored" in bad.source["rms_norm_small_torch"]
    assert "LIGER_COMPAT_RMS_NORM_SMALL_TORCH" in _config.ENV_VARS
