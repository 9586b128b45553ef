"""liger_compat next to real releases of peft and liger-kernel (their CPU paths), as the grid's cell
with those extras installs them; skipped where they are not installed.

peft: LoRA adapters wrap the attention projections (and, optionally, the LM head) of a patched model;
the fused forward must give the native loss and adapter gradients. liger-kernel: its
``apply_liger_kernel_to_llama`` replaces transformers' classes and functions (no kernel runs on CPU
for that); liger_compat must leave what it replaced alone, report the conflict, and check() must
advise which releases coexist where its data says they conflict.
"""

from __future__ import annotations

import sys

import pytest
import torch

import liger_compat
from liger_compat import kernels
from liger_compat.shims import REGISTRY, causal_lm
from liger_compat.compat.families import BY_NAME
from liger_compat.shims._patching import is_ours
from model_helpers import grads, native, random_batch, tiny


def _lora(model, targets):
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(0)
    return peft.get_peft_model(model, cfg)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "v_proj", "lm_head"]])
def test_lora_adapters_over_the_patched_model_train_like_native(targets):
    model = _lora(tiny("llama"), targets)
    ids, labels = random_batch(model, seed=41)
    model.zero_grad(set_to_none=True)
    kernels.last_backend.clear()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    g = grads(model)
    # a plain head gets the fused loss; a LoRA-wrapped head the unfused one (same contract)
    assert ("fused_linear_cross_entropy" in kernels.last_backend) == ("lm_head" not in targets)
    assert out.logits is None
    assert g and all("lora_" in n for n in g), sorted(g)[:4]  # only the adapters train
    with native():
        model.zero_grad(set_to_none=True)
        ref = model(input_ids=ids, labels=labels)
        ref.loss.backward()
        g_ref = grads(model)
    assert ref.logits is not None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_lora_model_without_labels_gives_the_native_logits():
    model = _lora(tiny("llama"), ["q_proj", "v_proj"])
    ids, _ = random_batch(model, seed=42)
    with torch.no_grad():
        out = model(input_ids=ids, logits_to_keep=3).logits
        with native():
            ref = model(input_ids=ids).logits[:, -3:]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_real_liger_kernel_patch_is_left_alone_reported_and_advised():
    lk = pytest.importorskip("liger_kernel.transformers")
    model = tiny("llama")
    cls = type(model)
    mod = sys.modules[BY_NAME["llama"].module]
    names = ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb")
    with native():
        original_forward = vars(cls)["forward"]
        originals = {n: getattr(mod, n) for n in names}
    liger_compat.revert()
    REGISTRY.conflicts.clear()
    try:
        lk.apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                       fused_linear_cross_entropy=True)
        liger_forward = vars(cls)["forward"]
        assert liger_forward is not original_forward  # liger-kernel replaced it (class level)
        liger_compat.apply()
        assert vars(cls)["forward"] is liger_forward and not is_ours(liger_forward, causal_lm._fused_forward)
        report = liger_compat.check()
        data = report.to_dict()
        assert any("liger-kernel" in c["by"] and "LlamaForCausalLM.forward" in c["what"] for c in data["conflicts"])
        from liger_compat.compat import known_issues

        inst = {k: v for k, v in (("liger-kernel", data["versions"].get("liger_kernel")),
                                  ("transformers", data["versions"].get("transformers")),
                                  ("trl", data["versions"].get("trl"))) if v}
        expected = {c.id for c in known_issues.KNOWN_CONFLICTS if c.applies(inst)}
        advised = {a["id"] for a in data["advice"] if a["kind"] == "conflict" and a["id"] in
                   {c.id for c in known_issues.KNOWN_CONFLICTS}}
        assert advised == expected
    finally:
        liger_compat.revert()
        cls.forward = original_forward
        for n, v in originals.items():
            setattr(mod, n, v)
        REGISTRY.conflicts.clear()
        liger_compat.apply()
    assert is_ours(vars(cls)["forward"], causal_lm._fused_forward)
