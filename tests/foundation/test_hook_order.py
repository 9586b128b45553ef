"""Shims apply whether transformers is imported before or after liger_compat.

Runs in fresh interpreters: the order of imports is the thing under test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("transformers")

REGISTER = textwrap.dedent(
    """
    from liger_compat.shims import register
    def _apply(module, patches):
        patches.wrap(module.LlamaForCausalLM, "get_output_embeddings",
                     lambda wrapped, inst, args, kw: ("hooked", wrapped(*args, **kw)))
    shim = register(id="test.hook_order", library="transformers",
                    trigger="transformers.models.llama.modeling_llama",
                    target="LlamaForCausalLM.get_output_embeddings", upstream="test", _apply=_apply)
    """
)

CHECK = textwrap.dedent(
    """
    import sys
    from transformers import LlamaConfig, LlamaForCausalLM
    m = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    out = m.get_output_embeddings()
    print(shim.state.value, isinstance(out, tuple) and out[0] == "hooked")
    import liger_compat
    liger_compat.revert()
    print(shim.state.value, m.get_output_embeddings() is m.lm_head)
    """
)

ORDERS = {
    "liger_compat first": "import liger_compat\n" + REGISTER + "import transformers\n",
    "transformers first": "import transformers\nimport liger_compat\n" + REGISTER,
    "model module first": "import transformers.models.llama.modeling_llama\nimport liger_compat\n" + REGISTER,
    "registered before import": "import liger_compat\n" + REGISTER,
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_shim_applies_in_any_import_order(order):
    code = ORDERS[order] + CHECK
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[-3:-1] == ["applied True", "reverted True"], r.stdout
