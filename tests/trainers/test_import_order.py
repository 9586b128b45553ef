"""Trainer shims patch trl / transformers whatever the import order, including a trainer module imported
directly (``import trl.trainer.sft_trainer``), which imports transformers from inside itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys
order = sys.argv[1]
if order == "liger_compat first":
    import liger_compat
    import trl.trainer.sft_trainer
else:
    import trl.trainer.sft_trainer
    import liger_compat
from liger_compat.shims import REGISTRY
ids = ["trl.renamed_kwargs", "trl.trainer_liger_switch", "transformers.trainer_liger_switch",
       "transformers.renamed_kwargs", "transformers.num_items_in_batch_labels"]
print(json.dumps({i: REGISTRY.get(i).status() for i in ids}))
"""


@pytest.mark.parametrize("order", ["liger_compat first", "trainer module first"])
def test_trainer_module_patched_in_any_import_order(order):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p))
    out = subprocess.run([sys.executable, "-c", SCRIPT, order], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    st = json.loads(out.stdout.strip().splitlines()[-1])
    assert "SFTTrainer.__init__" in st["trl.renamed_kwargs"]["reason"], st
    assert "SFTConfig.__init__" in st["trl.renamed_kwargs"]["reason"], st
    assert "SFTTrainer.__init__" in st["trl.trainer_liger_switch"]["reason"], st
    assert "Trainer.__init__" in st["transformers.trainer_liger_switch"]["reason"], st
    assert "TrainingArguments.__init__" in st["transformers.renamed_kwargs"]["reason"], st
