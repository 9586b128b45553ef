"""check --deep scenarios F2/F3/F4, the families in the report, import-order hooks, non-table models."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from liger_compat.compat import scenarios
from liger_compat.shims import causal_lm
from liger_compat.compat.families import FAMILIES
from liger_compat.shims._family_states import family_states
from liger_compat.shims._forward_args import forward_params
from liger_compat.shims._patching import is_ours
from liger_compat.shims.logits_to_keep import translate
from liger_compat.compat.tiny_models import FamilyUnavailable, modeling_module
from model_helpers import CORE_FAMILIES, native

import transformers


def _scenario(sid: str) -> scenarios.Scenario:
    return next(s for s in scenarios.registered() if s.id == sid)


@pytest.mark.parametrize("sid", ["F2", "F3", "F4"])
def test_scenarios_pass_with_the_shims(sid, monkeypatch):
    import warnings

    from liger_compat.shims import training_output
    from liger_compat.shims.training_output import LogitsSkippedWarning

    monkeypatch.setattr(training_output, "_hinted", False)  # the hint shows once a process

    sc = _scenario(sid)
    assert sc.issue == sid
    try:
        with warnings.catch_warnings():  # the report's own checks never trip the user's hint
            warnings.simplefilter("error", LogitsSkippedWarning)
            detail = sc.func(scenarios.Context())
    except scenarios.Skip as exc:
        # only F4 may not apply: decoders before transformers 4.47 take no attention kwargs
        assert sid == "F4", exc
        assert not forward_params(modeling_module("llama").LlamaModel.forward).varkw
        return
    assert detail


def test_f3_scenario_fails_without_the_shims():
    """The F3 scenario can fail: unpatched, one of the two spellings is ignored on every grid release
    except the 4.49 transition (which knew both names)."""
    from liger_compat.compat.versions import matches

    mod = modeling_module("qwen2")
    if forward_params(mod.Qwen2ForCausalLM.forward).both:
        pytest.skip("this transformers knows both spellings natively")
    if matches(transformers.__version__, ">=4.49,<4.52"):
        # 4.49-4.51 map num_logits_to_keep onto logits_to_keep with @deprecate_kwarg, which the
        # signature does not show (the alias is gone in 4.52)
        pytest.skip(f"transformers {transformers.__version__} accepts both spellings natively (@deprecate_kwarg)")
    # the scenario's own check (a spelling swallowed: full logits), or a forward without **kwargs
    # refusing the spelling it does not know
    with native(), pytest.raises((AssertionError, TypeError), match=r"logits_to_keep=4\)\.logits has shape|"
                                 r"unexpected keyword argument '(num_)?logits_to_keep'"):
        _scenario("F3").func(scenarios.Context())


def test_family_states_cover_every_family():
    states = family_states()
    tf = transformers.__version__
    for fam in FAMILIES:
        try:
            modeling_module(fam)
        except FamilyUnavailable:
            assert states[fam.name].startswith(f"not in transformers {tf}"), states[fam.name]
            continue
        state = family_states()[fam.name]
        if fam.why_native():  # the table says why the generic forward is not used: the report says it too
            assert state.startswith(f"native forward ({fam.why_native()})"), state
        elif fam.name in CORE_FAMILIES:
            assert state.startswith("fused forward; rms_norm"), state
        else:
            assert state.startswith("fused forward"), state


def test_a_causal_lm_outside_the_table_keeps_its_forward_and_gets_the_name_translation():
    from transformers.models.phi import modeling_phi
    from transformers.models.phi.configuration_phi import PhiConfig

    cls = modeling_phi.PhiForCausalLM
    assert not is_ours(vars(cls)["forward"], causal_lm._fused_forward)
    assert family_states()["PhiForCausalLM"] == "native forward (family not in the table)"
    cfg = PhiConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                    max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    params = forward_params(vars(cls)["forward"])
    if params.keep is None:
        pytest.skip(f"PhiForCausalLM.forward knows {'both' if params.both else 'neither'} of the names here")
    assert is_ours(vars(cls)["forward"], translate)
    ids = torch.randint(3, 96, (2, 10))
    with torch.no_grad():
        full = model(ids).logits
        for name in ("logits_to_keep", "num_logits_to_keep"):
            torch.testing.assert_close(model(ids, **{name: 3}).logits, full[:, -3:], rtol=1e-5, atol=1e-5)
        idx = torch.tensor([1, 6])
        torch.testing.assert_close(model(ids, logits_to_keep=idx).logits, full[:, idx], rtol=1e-5, atol=1e-5)


def test_hooks_patch_modeling_modules_imported_before_and_after_liger_compat():
    code = textwrap.dedent(
        """
        import transformers.models.llama.modeling_llama as before   # imported before liger_compat
        import liger_compat
        from liger_compat.shims import causal_lm, rms_norm, rope
        from liger_compat.shims._patching import is_ours
        import transformers.models.qwen2.modeling_qwen2 as after    # imported after
        for mod, prefix in ((before, "Llama"), (after, "Qwen2")):
            assert is_ours(vars(getattr(mod, prefix + "ForCausalLM"))["forward"], causal_lm._fused_forward), prefix
            assert is_ours(vars(getattr(mod, prefix + "RMSNorm"))["forward"], rms_norm.rms_forward), prefix
            assert is_ours(vars(mod)["apply_rotary_pos_emb"], rope.rope_forward), prefix
        print("ok")
        """
    )
    env = dict(os.environ)
    env.pop("LIGER_COMPAT_DISABLE", None)
    env.pop("LIGER_COMPAT_KERNELS", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
