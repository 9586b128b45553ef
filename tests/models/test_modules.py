"""Module routing (RMSNorm / gated MLP / RoPE), exact revert, idempotence, instance patching, conflicts."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

import liger_compat
from liger_compat import kernels
from liger_compat.shims import REGISTRY, _module_shims, causal_lm, gated_mlp, rms_norm
from liger_compat.compat.families import BY_NAME
from liger_compat.shims._family_states import family_states
from liger_compat.shims._patching import is_ours
from liger_compat.shims.logits_to_keep import translate
from model_helpers import (FAMILY_NAMES, GatedMLP, KernelCalls, LlamaStyleRMSNorm, module_kernel_entry, native,
                           random_batch, tiny)


def _targets(family: str):
    """Every attribute the model shims may patch for a family: (owner, name) pairs."""
    fam = BY_NAME[family]
    mod = sys.modules[fam.module]
    out = [(getattr(mod, fam.causal_lm), "forward"), (mod, "apply_rotary_pos_emb")]
    for obj in list(vars(mod).values()):
        if isinstance(obj, type) and obj.__module__ == mod.__name__ and "forward" in vars(obj):
            if obj.__name__.endswith("RMSNorm") or "MLP" in obj.__name__:
                out.append((obj, "forward"))
    return out


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_revert_restores_the_exact_originals_and_apply_is_idempotent(family):
    tiny(family)  # imports the modeling module (or skips)
    targets = _targets(family)
    with native():
        originals = {(id(o), n): vars(o)[n] for o, n in targets}
        assert not any(is_ours(v, causal_lm._fused_forward) or is_ours(v, translate) for v in originals.values())
    patched = {(id(o), n): vars(o)[n] for o, n in targets}
    changed = [k for k in patched if patched[k] is not originals[k]]
    assert len(changed) >= 3, "forward, at least one norm and the rotary function should be patched"
    fam = BY_NAME[family]
    assert is_ours(vars(getattr(sys.modules[fam.module], fam.causal_lm))["forward"], causal_lm._fused_forward)
    liger_compat.apply()
    liger_compat.apply()
    again = {(id(o), n): vars(o)[n] for o, n in targets}
    assert all(again[k] is patched[k] for k in patched), "apply() twice must not wrap twice"
    assert liger_compat.revert() == []
    for o, n in targets:
        assert vars(o)[n] is originals[(id(o), n)], f"{o}.{n} not restored"
    liger_compat.apply()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_modules_run_our_kernels(family):
    model = tiny(family)
    ids, labels = random_batch(model)
    kernels.last_backend.clear()
    with torch.no_grad():
        model(input_ids=ids, labels=labels)
    used = set(kernels.last_backend)
    assert {"rms_norm", "rope", "fused_linear_cross_entropy"} <= used, used
    mlps = [m for m in model.modules() if gated_mlp.mlp_layout(m) is not None]
    if mlps:  # transformers 5 Mixtral has fused expert tensors, no per-expert MLP module
        assert ("geglu" if BY_NAME[family].mlp_act == "gelu_tanh" else "swiglu") in used, used


def test_kernel_selection_reverts_the_deselected_shims():
    model = tiny("llama")
    norm_cls = type(model.model.norm)
    with native():
        original = vars(norm_cls)["forward"]
    liger_compat.configure(kernels="fused_linear_cross_entropy,rope")
    try:
        assert vars(norm_cls)["forward"] is original
        assert REGISTRY.get("transformers.rms_norm").state.value == "disabled"
        kernels.last_backend.clear()
        ids, labels = random_batch(model)
        with torch.no_grad():
            model(input_ids=ids, labels=labels)
        assert "rms_norm" not in kernels.last_backend and "swiglu" not in kernels.last_backend
        assert "rope" in kernels.last_backend
    finally:
        liger_compat.configure(kernels="all")
    assert vars(norm_cls)["forward"] is not original


# -- instance-level patching of classes outside the families ---------------------------------


class MyRMSNorm(LlamaStyleRMSNorm):
    pass


class OddRMSNorm(MyRMSNorm):
    """Named like an RMSNorm, computes something else: the numeric check must leave it native."""

    def forward(self, x):
        return x * self.weight


class MyMLP(GatedMLP):
    pass


def test_apply_model_patches_structural_instances_and_revert_removes_them():
    torch.manual_seed(0)
    net = torch.nn.Sequential(MyRMSNorm(16), MyMLP(16, 24), OddRMSNorm(16))
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        ref = net(x)
        ref_norm = net[0](x)
    liger_compat.apply(model=net)
    assert all("forward" in vars(m) for m in net)
    kernels.last_backend.clear()
    with torch.no_grad():
        out = net(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert {"rms_norm", "swiglu"} <= set(kernels.last_backend)
    # the odd norm was checked against its native forward and kept it
    odd = [v for k, v in rms_norm._rms_modes.items() if k[0] is OddRMSNorm and k[-2:] == (torch.float32, torch.float32)]
    assert odd and all(isinstance(v, str) for v in odd), rms_norm._rms_modes
    # a deep copy (trl's reference model) runs on its own weights, not the original's
    import copy

    twin = copy.deepcopy(net)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
        torch.testing.assert_close(twin[0](x), 0.5 * ref_norm, rtol=1e-5, atol=1e-5)
    shim = REGISTRY.get("transformers.rms_norm")
    n_sets, first = len(shim.model_patches), vars(net[0])["forward"]
    liger_compat.apply(model=net)  # idempotent on instances too
    assert len(shim.model_patches) == n_sets and vars(net[0])["forward"] is first
    liger_compat.revert()
    assert not any("forward" in vars(m) for m in net)
    liger_compat.apply()


# -- coexistence -----------------------------------------------------------------------------


def _foreign(module: str, name: str = "forward"):
    def fn(self, *args, **kwargs):  # pragma: no cover - never called
        raise AssertionError("the foreign patch must not run in these tests")

    fn.__module__ = module
    fn.__name__ = fn.__qualname__ = name
    return fn


def test_class_patched_by_liger_kernel_first_is_left_alone_and_reported():
    model = tiny("qwen2")
    fam = BY_NAME["qwen2"]
    mod = sys.modules[fam.module]
    cls = type(model)
    with native():
        original_forward = vars(cls)["forward"]
        original_norm = mod.Qwen2RMSNorm
        original_rope = mod.apply_rotary_pos_emb
    liger_compat.revert()
    liger_forward = _foreign("liger_kernel.transformers.model.qwen2", "lce_forward")
    liger_rope = _foreign("liger_kernel.transformers.rope", "liger_rotary_pos_emb")
    liger_norm = type("LigerRMSNorm", (torch.nn.Module,), {"__module__": "liger_kernel.transformers.rms_norm",
                                                          "forward": lambda self, x: x})
    cls.forward, mod.apply_rotary_pos_emb, mod.Qwen2RMSNorm = liger_forward, liger_rope, liger_norm
    REGISTRY.conflicts.clear()
    try:
        liger_compat.apply()
        assert vars(cls)["forward"] is liger_forward  # nothing stacked on top
        assert mod.apply_rotary_pos_emb is liger_rope
        state = family_states()["qwen2"]
        assert "liger-kernel" in state and "fused forward" not in state, state
        by = {c.what: c.by for c in REGISTRY.conflicts}
        assert any("Qwen2ForCausalLM.forward" in w and "liger-kernel" in b for w, b in by.items()), by
        assert any("apply_rotary_pos_emb" in w for w in by), by
        assert any("Qwen2RMSNorm" in w for w in by), by
        report = liger_compat.check()
        assert any("liger-kernel" in c["by"] for c in report.to_dict()["conflicts"])
    finally:
        liger_compat.revert()
        cls.forward, mod.apply_rotary_pos_emb, mod.Qwen2RMSNorm = original_forward, original_rope, original_norm
        REGISTRY.conflicts.clear()
        liger_compat.apply()
    assert is_ours(vars(cls)["forward"], causal_lm._fused_forward)


def test_patched_over_after_us_is_reported_and_revert_does_not_drop_it():
    model = tiny("mistral")
    cls = type(model)
    with native():
        original = vars(cls)["forward"]
    mod = sys.modules[BY_NAME["mistral"].module]
    with native():
        original_rope = mod.apply_rotary_pos_emb
    unsloth_forward = _foreign("unsloth.models.mistral", "MistralForCausalLM_fast_forward")
    liger_rope = _foreign("liger_kernel.transformers.rope", "liger_rotary_pos_emb")
    cls.forward = unsloth_forward  # others patch after liger_compat
    mod.apply_rotary_pos_emb = liger_rope
    try:
        state = family_states()["mistral"]
        assert "unsloth" in state and "rope replaced afterwards by liger-kernel" in state, state
        errors = liger_compat.revert()
        assert any("replaced again" in e for e in errors), errors
        assert vars(cls)["forward"] is unsloth_forward and mod.apply_rotary_pos_emb is liger_rope
    finally:
        cls.forward, mod.apply_rotary_pos_emb = original, original_rope
        liger_compat.apply()
    assert is_ours(vars(cls)["forward"], causal_lm._fused_forward)


def test_instance_level_foreign_forward_is_reported_by_apply_model():
    model = tiny("llama")
    REGISTRY.conflicts.clear()
    model.forward = types.MethodType(_foreign("liger_kernel.transformers.model.llama", "lce_forward"), model)
    norm = model.model.norm
    norm.forward = types.MethodType(_foreign("kernels.layer", "forward"), norm)
    liger_compat.apply(model=model)
    whats = {c.what: c.by for c in REGISTRY.conflicts}
    assert any("LlamaForCausalLM.forward (instance)" == w and "liger-kernel" in b for w, b in whats.items()), whats
    assert any("RMSNorm.forward (instance)" in w and "hub kernels" in b for w, b in whats.items()), whats
    REGISTRY.conflicts.clear()


def test_inputs_the_kernels_refuse_run_natively(monkeypatch, caplog):
    """float64 activations are outside every kernel's dtypes: the shims see that from the kernels'
    own argument checks before calling them, log it, and run the native code (same numbers)."""
    monkeypatch.setattr(_module_shims, "_refused", set())  # each refusal is logged once per process
    model = tiny("qwen2").double()
    ids, _ = random_batch(model)
    with native(), torch.no_grad():
        ref = model(input_ids=ids).logits
    kernels.last_backend.clear()
    with torch.no_grad():
        out = model(input_ids=ids).logits
    assert torch.equal(out, ref)
    assert not {"rms_norm", "swiglu", "rope"} & set(kernels.last_backend)
    for name in ("rms_norm", "swiglu", "rope"):
        assert f"{name} kernel refuses an input, native code used: UnsupportedDtypeError: " in caplog.text
    assert "unsupported dtype torch.float64" in caplog.text


def test_a_gated_mlp_whose_first_call_has_no_rows_is_judged_on_its_first_call_with_rows(monkeypatch):
    """An MoE expert routed no token gets a ``[0, H]`` input; when that is its first call, the
    structural probe has nothing to compare: the call runs native (an empty result) and the
    verdict waits for rows (seen: mixtral's experts on transformers 4.48 with a one-token batch)."""
    monkeypatch.setattr(gated_mlp, "_mlp_verdicts", {})
    model = tiny("llama")
    mlp = model.model.layers[0].mlp
    hdim = model.config.hidden_size
    empty = torch.randn(0, hdim, requires_grad=True)
    out = mlp(empty)
    assert out.shape == (0, hdim) and not gated_mlp._mlp_verdicts
    out.sum().backward()
    x = torch.randn(2, 5, hdim)
    with native(), torch.no_grad():
        ref = mlp(x)
    kernels.last_backend.clear()
    with torch.no_grad():
        got = mlp(x)
    assert list(gated_mlp._mlp_verdicts.values()) == [True] and "swiglu" in kernels.last_backend
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert mlp(torch.randn(1, 0, hdim)).shape == (1, 0, hdim)  # with a verdict: the kernel path, no rows


@pytest.mark.parametrize("kernel", ["rms_norm", "gated_project", "apply_rotary_pos_emb"])
def test_an_error_inside_a_kernel_raises_instead_of_falling_back(monkeypatch, kernel):
    """Inputs the kernel accepts go to the kernel, unguarded: a TypeError / ValueError raised
    inside it (a kernel bug) reaches the caller instead of being hidden by the native result."""
    model = tiny("qwen2")
    ids, _ = random_batch(model)

    def broken(*a, **k):
        raise ValueError(f"{kernel}: simulated bug inside the kernel")

    monkeypatch.setattr(*module_kernel_entry(kernel), broken)
    rms_norm._rms_modes.clear()
    try:
        with torch.no_grad(), pytest.raises(ValueError, match=f"^{kernel}: simulated bug inside the kernel$"):
            model(input_ids=ids)
    finally:
        monkeypatch.undo()
        rms_norm._rms_modes.clear()


def test_patched_norm_and_mlp_keep_neither_activation_and_pass_down_projs_errors_on(caplog, monkeypatch):
    """RMSNorm -> MLP: gate/up_proj's input (the norm output) and down_proj's (act(gate) * up) are
    recomputed in the backward instead of kept; gradients match float64."""
    import gc
    import weakref

    from liger_compat.kernels import norm as norm_module

    monkeypatch.setattr(norm_module, "RECOMPUTE_INPUT_MIN_BYTES", 0)  # this norm output is 640 bytes

    torch.manual_seed(3)
    net = torch.nn.Sequential(MyRMSNorm(16), MyMLP(16, 24))
    mlp = net[1]
    x = torch.randn(2, 5, 16)
    gout = torch.randn(2, 5, 16)
    p64 = {n: p.detach().double().requires_grad_(True) for n, p in net.named_parameters()}
    x64 = x.double().requires_grad_(True)
    lin = torch.nn.functional.linear
    n64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * p64["0.weight"]
    h64 = torch.nn.functional.silu(lin(n64, p64["1.gate_proj.weight"], p64["1.gate_proj.bias"])) * lin(
        n64, p64["1.up_proj.weight"], p64["1.up_proj.bias"])
    ref = lin(h64, p64["1.down_proj.weight"], p64["1.down_proj.bias"])
    names = ["0.weight", "1.gate_proj.weight", "1.down_proj.weight"]
    ref_grads = torch.autograd.grad((ref * gout).sum(), [x64] + [p64[n] for n in names])
    seen = {}

    def record(name, module):
        inner = module.forward
        module.forward = lambda h: (seen.setdefault(name, weakref.ref(h.untyped_storage())), inner(h))[1]

    record("gate_proj", mlp.gate_proj)
    record("down_proj", mlp.down_proj)
    liger_compat.apply(model=net)
    try:
        xin = x.clone().requires_grad_(True)
        out = net(xin)
        gc.collect()
        assert set(seen) == {"gate_proj", "down_proj"}
        assert seen["gate_proj"]() is None, "the norm output is still kept for the backward"
        assert seen["down_proj"]() is None, "act(gate) * up is still kept for the backward"
        params = dict(net.named_parameters())
        grads = torch.autograd.grad((out * gout).sum(), [xin] + [params[n] for n in names])
        torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-6)
        for mine, want in zip(grads, ref_grads):
            torch.testing.assert_close(mine.double(), want, rtol=1e-5, atol=1e-6)

        def broken(h):
            raise ValueError("down_proj: boom")

        mlp.down_proj.forward = broken
        with pytest.raises(ValueError, match="down_proj: boom"):
            net(xin)
        assert "refused" not in caplog.text
    finally:
        liger_compat.revert()
        liger_compat.apply()


_DEFAULT_DEVICE_SCRIPT = """
import json, sys, torch, liger_compat, transformers
from liger_compat import kernels
from liger_compat.compat.tiny_models import build, modeling_module
from liger_compat.compat.families import BY_NAME
from liger_compat.shims import REGISTRY
how, family = sys.argv[1], sys.argv[2]
name = BY_NAME[family].module
if how == "context":
    with torch.device("meta"):
        __import__(name)
else:
    torch.set_default_device("meta")
    __import__(name)
    torch.set_default_device("cpu")
model = build(family).train()
g = torch.Generator().manual_seed(5)
ids = torch.randint(3, model.config.vocab_size, (2, 10), generator=g)
kernels.last_backend.clear()
model(input_ids=ids, labels=ids).loss.backward()
print(json.dumps({"errors": {s.id: s.module_errors for s in REGISTRY.shims() if s.module_errors},
                  "kernels": sorted(kernels.last_backend)}))
"""


@pytest.mark.parametrize("how", ["context", "set_default_device"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_modeling_module_imported_under_another_default_device_is_patched(how, family):
    """Models are often built inside ``with torch.device("cuda" / "meta")`` or after
    ``torch.set_default_device``, and that is where transformers first imports the modeling module:
    the patch-time probes must not make their tensors there (the RoPE probe did, and the module
    kept its native rotary function: about 8 % of a Llama-3.2-1B training step on an H100)."""
    import json
    import subprocess

    env = {**os.environ, "LIGER_COMPAT_CPU_NATIVE": "0"}  # the module kernels (references) run on CPU
    r = subprocess.run([sys.executable, "-c", _DEFAULT_DEVICE_SCRIPT, how, family], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["errors"] == {}, out["errors"]
    assert {"rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"} <= set(out["kernels"]), out["kernels"]


def test_an_autocast_call_leaves_the_plain_dtype_on_the_kernel(monkeypatch):
    """The gated-MLP probe decides once per class and dtype; under autocast the projections run in
    bf16 while the input is float32, so that call is judged on its own (at bf16's tolerance) and a
    float32 call afterwards still takes the kernel, with the native loss."""
    monkeypatch.setattr(gated_mlp, "_mlp_verdicts", {})
    model = tiny("llama")
    ids, labels = random_batch(model, seed=21)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=labels)
    kernels.last_backend.clear()
    out = model(input_ids=ids, labels=labels)
    assert "swiglu" in kernels.last_backend, sorted(kernels.last_backend)
    with native():
        ref = model(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert all(ok is True for key, ok in gated_mlp._mlp_verdicts.items() if key[0].__name__ == "LlamaMLP"), gated_mlp._mlp_verdicts


def test_the_module_shims_run_each_kernels_argument_checks_once_a_call(monkeypatch):
    """RMSNorm, MLP and RoPE: the shim runs the kernel's own argument checks (its refusal test) and
    then the kernel's unchecked entry, so every float-dtype check runs once a module call: two a norm
    (x, weight), two an MLP (gate, up), four a rotary call (q, k, cos, sin)."""
    from liger_compat import _config
    from liger_compat.kernels import _checks

    monkeypatch.setattr(_config.settings, "cpu_native", False)  # the kernels' path on CPU tensors
    model = tiny("llama")
    ids, labels = random_batch(model, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    with torch.no_grad():
        model(input_ids=ids)  # the first calls probe each class (more kernel calls): not counted
    kernel_calls = KernelCalls(monkeypatch)
    calls = kernel_calls.n
    calls["float_dtype"] = 0
    real_check = _checks.float_dtype

    def count_check(*a, **k):
        calls["float_dtype"] += 1
        return real_check(*a, **k)

    monkeypatch.setattr(_checks, "float_dtype", count_check)
    with torch.no_grad():
        model(input_ids=ids)
    layers = model.config.num_hidden_layers
    assert calls["rms_norm"] == 2 * layers + 1 and calls["gated_project"] == layers, calls
    assert calls["apply_rotary_pos_emb"] == layers, calls
    assert calls["float_dtype"] == 2 * calls["rms_norm"] + 2 * calls["gated_project"] + 4 * layers, calls


def test_registered_reads_what_getattr_reads():
    """The shims' fast attribute read gives ``getattr(m, name, None)`` in every case: parameters,
    buffers, submodules, names a module lacks, instance and class attributes that shadow a
    registered name, and classes with their own ``__getattr__``."""
    from liger_compat.shims._module_shims import registered

    m = torch.nn.Linear(4, 3)
    m.register_buffer("scale", torch.ones(3))
    m.add_module("act", torch.nn.SiLU())
    for name in ("weight", "bias", "scale", "act", "missing", "training", "forward"):
        assert registered(m, name) is getattr(m, name, None) or registered(m, name) == getattr(m, name, None), name

    class Shadowed(torch.nn.Module):
        gate_proj = None  # a class attribute: getattr finds it before the submodule table

        def __init__(self):
            super().__init__()
            self._modules["gate_proj"] = torch.nn.Linear(2, 2)

    s = Shadowed()
    assert registered(s, "gate_proj") is None and getattr(s, "gate_proj", None) is None

    class Forwarding(torch.nn.Module):  # a wrapper answering for what it wraps
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(2, 2)

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.inner, name)

    f = Forwarding()
    assert registered(f, "weight") is f.inner.weight
    assert registered(f, "inner") is f.inner
