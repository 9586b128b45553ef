"""An eager gated MLP on a GPU whose activation is below ``EAGER_NATIVE_MAX_BYTES`` runs the module's
native forward (``LIGER_COMPAT_MLP_SMALL_NATIVE``, ``shims/gated_mlp.py``); at and above the bound,
with the setting off, on other devices and under torch.compile's own route, the gated kernel runs.

The route is keyed on the device type (``SMALL_NATIVE_DEVICES``: CUDA), so these CPU tests name the
CPU as such a device. Outputs and gradients are compared with the unpatched model on the same
weights and inputs.
"""

from __future__ import annotations

import pytest
import torch

from liger_compat import _config, configure
from liger_compat.shims import gated_mlp as shim
from model_helpers import KernelCalls, grads, native, random_batch, tiny


@pytest.fixture
def cpu_routes(monkeypatch):
    monkeypatch.setattr(shim, "SMALL_NATIVE_DEVICES", ("cpu",))
    monkeypatch.setattr(_config.settings, "mlp_small_native", True)


def _step(model, ids, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), grads(model)


def _mlp_calls(model) -> int:
    return sum(1 for m in model.modules() if type(m).__name__.endswith("MLP"))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_a_small_mlp_runs_native_and_trains_as_native(family, cpu_routes, monkeypatch):
    model = tiny(family)
    ids, labels = random_batch(model, seed=31)
    calls = KernelCalls(monkeypatch)
    loss, g = _step(model, ids, labels)
    assert calls.n["gated_project"] == 0 and calls.n["rms_norm"] > 0  # the other kernels still run
    with native():
        ref, g_ref = _step(model, ids, labels)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("why", ["setting off", "at the bound", "other device", "configure"])
def test_the_kernel_runs_where_the_route_does_not_apply(why, cpu_routes, monkeypatch):
    model = tiny("llama")
    ids, labels = random_batch(model, seed=32)
    if why == "setting off":
        monkeypatch.setattr(_config.settings, "mlp_small_native", False)
    elif why == "at the bound":
        # the tiny model's activation (tokens x intermediate x 4 bytes) is exactly the bound
        tokens = ids.numel()
        width = model.config.intermediate_size
        monkeypatch.setattr(shim, "EAGER_NATIVE_MAX_BYTES", tokens * width * 4)
    elif why == "other device":
        monkeypatch.setattr(shim, "SMALL_NATIVE_DEVICES", ("cuda",))
    else:
        configure(mlp_small_native=False)
    try:
        calls = KernelCalls(monkeypatch)
        loss, g = _step(model, ids, labels)
        if why == "configure":
            assert _config.settings.source["mlp_small_native"] == "configure()"
    finally:
        if why == "configure":
            configure(mlp_small_native=True)
    assert calls.n["gated_project"] >= model.config.num_hidden_layers  # (and the verdict probe's, on a first call)
    with native():
        ref, g_ref = _step(model, ids, labels)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_the_bound_is_on_the_activation_bytes(monkeypatch):
    """Tokens x the down projection's input width x the input's element size, strictly below the
    bound; without an integer ``in_features`` (a wrapped or quantised projection) the kernel keeps it."""
    monkeypatch.setattr(shim, "SMALL_NATIVE_DEVICES", ("meta",))
    monkeypatch.setattr(_config.settings, "mlp_small_native", True)
    down = torch.nn.Linear(2816, 1024, device="meta", dtype=torch.bfloat16)
    bound = shim.EAGER_NATIVE_MAX_BYTES
    tokens_at = bound // (2816 * 2)  # not a whole number of tokens: the bound lies between two counts
    for shape, small in (((2, 1024, 1024), True), ((1, tokens_at, 1024), True), ((1, tokens_at + 1, 1024), False),
                         ((8, 2048, 1024), False), ((1024,), True)):
        x = torch.empty(shape, device="meta", dtype=torch.bfloat16)
        assert shim._small_native(x, down) is small, shape
    x = torch.empty((4, 1024), device="meta", dtype=torch.bfloat16)
    assert shim._small_native(x, object()) is False
    assert shim._small_native(torch.empty((4, 1024)), down) is False  # a CPU tensor: not a listed device
    monkeypatch.setattr(_config.settings, "mlp_small_native", False)
    assert shim._small_native(x, down) is False


def test_the_setting_from_the_environment():
    s = _config._from_env({"LIGER_COMPAT_MLP_SMALL_NATIVE": "0"})
    assert s.mlp_small_native is False and s.source["mlp_small_native"] == "LIGER_COMPAT_MLP_SMALL_NATIVE"
    assert _config._from_env({}).mlp_small_native is True
    bad = _config._from_env({"LIGER_COMPAT_MLP_SMALL_NATIVE": "maybe"})
    assert bad.mlp_small_native is True and "ignored" in bad.source["mlp_small_native"]
    with pytest.raises(ValueError, match="mlp_small_native"):
        configure(mlp_small_native="maybe")
