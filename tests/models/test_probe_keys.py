"""Probe verdicts are keyed on what the native forward reads: two instances of one class that
differ in an attribute (Falcon-H1's ``mlp_multipliers``, an RMSNorm's offset) are each checked
against their own native forward, and a module the probe turned down runs its native forward
alone."""

from __future__ import annotations

import pytest
import torch

import liger_compat
from liger_compat import kernels
from liger_compat.shims import gated_mlp, rms_norm
from liger_compat.shims._patching import unwrap
from model_helpers import GatedMLP


def _falcon_mlp_class():
    mod = pytest.importorskip("transformers.models.falcon_h1.modeling_falcon_h1")
    return mod.FalconH1Config, mod.FalconH1MLP


def _falcon_mlp(config_cls, mlp_cls, multipliers):
    cfg = config_cls(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                     hidden_act="silu", mlp_multipliers=multipliers)
    return mlp_cls(cfg)


def _falcon_formula64(m, x):
    """Falcon-H1's MLP written out in float64: down(up(x) * silu(gate(x) * g)) * d."""
    g, d = m.config.mlp_multipliers
    w = {n: p.detach().double() for n, p in m.named_parameters()}
    x = x.double()
    lin = lambda name, t: torch.nn.functional.linear(t, w[f"{name}.weight"], w.get(f"{name}.bias"))
    y = lin("up_proj", x) * torch.nn.functional.silu(lin("gate_proj", x) * g)
    return lin("down_proj", y) * d


def test_falcon_h1_mlps_with_different_multipliers_each_match_their_native_forward():
    config_cls, mlp_cls = _falcon_mlp_class()
    assert unwrap(mlp_cls.forward) is not mlp_cls.forward, "FalconH1MLP.forward should be patched"
    torch.manual_seed(0)
    plain = _falcon_mlp(config_cls, mlp_cls, [1.0, 1.0])
    scaled = _falcon_mlp(config_cls, mlp_cls, [2.0, 0.5])
    x = torch.randn(2, 10, 32)
    kernels.last_backend.clear()
    with torch.no_grad():
        out_plain = plain(x)  # passes the probe: the kernel
    assert "swiglu" in kernels.last_backend
    with torch.no_grad():
        out_scaled = scaled(x)  # same class and dtype, other multipliers: its own probe
    for m, out in ((plain, out_plain), (scaled, out_scaled)):
        ref = _falcon_formula64(m, x)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            native = unwrap(mlp_cls.forward)(m, x)
        torch.testing.assert_close(out, native, rtol=1e-5, atol=1e-5)


class ScaledRMSNorm(torch.nn.Module):
    """A remote-code RMSNorm whose weight offset is an attribute: ``(offset + w) * norm(x)``."""

    def __init__(self, h, offset):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(h) * 0.5)
        self.variance_epsilon = 1e-6
        self.offset = offset

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.offset + self.weight) * xf.to(x.dtype)


def _norm64(m, x):
    x = x.double()
    return (m.offset + m.weight.detach().double()) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_rms_norms_of_one_class_with_different_offsets_each_match_their_native_forward():
    torch.manual_seed(1)
    plain, offset = ScaledRMSNorm(16, 0.0), ScaledRMSNorm(16, 1.0)
    net = torch.nn.Sequential(plain, offset)
    liger_compat.apply(model=net)
    assert "forward" in vars(plain) and "forward" in vars(offset)
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        outs = [plain(x), offset(x)]
    for m, out in zip((plain, offset), outs):
        torch.testing.assert_close(out.double(), _norm64(m, x), rtol=1e-5, atol=1e-5)
    modes = {k: v for k, v in rms_norm._rms_modes.items() if k[0] is ScaledRMSNorm}
    assert sorted(v for v in modes.values() if isinstance(v, tuple)) == [(0.0, "llama"), (1.0, "llama")], modes


class ClampedMLP(GatedMLP):
    """Gate / up / down with SiLU, but clamped: not ``down(act(gate) * up)``, refused by the probe."""

    def forward(self, x):
        return self.down_proj((self.act_fn(self.gate_proj(x)) * self.up_proj(x)).clamp(-0.05, 0.05))


def test_a_refused_mlp_makes_no_more_linear_calls_than_native():
    torch.manual_seed(2)
    mlp = ClampedMLP(16, 24)
    x = torch.randn(2, 6, 16)
    calls = []
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        lin.register_forward_hook(lambda mod, args, out: calls.append(mod))
    with torch.no_grad():
        ref = mlp(x)
    native_calls = len(calls)
    assert native_calls == 3
    liger_compat.apply(model=mlp)
    assert "forward" in vars(mlp)
    with torch.no_grad():
        mlp(x)  # the first call probes (and is turned down)
    assert any(v is False for k, v in gated_mlp._mlp_verdicts.items() if k[0] is ClampedMLP)
    calls.clear()
    with torch.no_grad():
        out = mlp(x)
    assert len(calls) == native_calls, f"{len(calls)} Linear calls, native makes {native_calls}"
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
