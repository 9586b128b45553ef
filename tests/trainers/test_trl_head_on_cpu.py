"""Known issue ``trl-head-on-cpu``: trl 1.15.0's fused LM head launches its Triton kernels on CPU
tensors, so an unpatched ``SFTTrainer`` step on CPU fails; with ``import liger_compat`` first the head
is scored by our kernel (torch on CPU) and trains, with the loss trl's own kernels give when Triton's
CPU interpreter runs them.

Each run is a fresh process: whether trl's kernels are compiled or interpreted is decided when trl
imports them (``tests/conftest.py`` interprets them for the in-process references).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from liger_compat.compat import known_issues

ISSUE = known_issues.by_id("trl-head-on-cpu")

_STEP = textwrap.dedent("""
    import json, logging, sys, warnings
    warnings.simplefilter("ignore")
    if sys.argv[1] == "patched":
        import liger_compat  # first line of a training script
    from liger_compat.compat import tiny_text as tiny
    from liger_compat.shims import REGISTRY
    import torch
    from trl import SFTConfig, SFTTrainer
    for name in ("transformers", "trl", "accelerate", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.manual_seed(0)
    tok = tiny.build_tokenizer()
    model = tiny.build_model("llama", tok, seed=3)
    args = SFTConfig(output_dir=sys.argv[2], max_steps=1, per_device_train_batch_size=4, learning_rate=1e-3,
                     logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
                     max_length=32, dataset_text_field="text", packing=False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=tiny.dataset(tiny.sft_rows(8)), processing_class=tok)
    try:
        trainer.train()
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        raise SystemExit(0)
    logs = [r for r in trainer.state.log_history if "loss" in r]
    applied = [s["id"] for s in (x.status() for x in REGISTRY.shims()) if s["state"] == "applied"]
    print(json.dumps({"loss": logs[0]["loss"], "applied": applied}))
""")


def _step(mode: str, tmp_path, interpret: bool = False) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.pop("LIGER_COMPAT_DISABLE", None)
    if mode == "native":
        env["LIGER_COMPAT_DISABLE"] = "1"  # the tiny-model helpers import the package: keep it off
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-c", _STEP, mode, str(tmp_path / mode)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available()


@pytest.mark.skipif(not ISSUE.applies(cuda=not _cpu_only()),
                    reason="known issue trl-head-on-cpu applies only to trl 1.15.0 without CUDA "
                           "(grid cells tf5.20-trl1.15, tf5.21-trl1.15)")
def test_sft_step_on_cpu_fails_natively_and_trains_patched(tmp_path):
    native = _step("native", tmp_path)
    assert "error" in native and "active drivers" in native["error"], native
    patched = _step("patched", tmp_path)
    assert "error" not in patched, patched
    assert "trl.fused_lm_head" in patched["applied"], patched
    reference = _step("native", tmp_path, interpret=True)  # trl's own kernels, interpreted on CPU
    assert "error" not in reference, reference
    assert abs(patched["loss"] - reference["loss"]) <= 1e-4 * abs(reference["loss"]), (patched, reference)


def test_known_issue_data_matches_where_it_applies():
    """The issue's version range holds exactly where the grid says trl 1.15.0 is installed, and never
    where a CUDA device is visible."""
    from liger_compat.compat import versions
    from liger_compat.matrix import load_grid

    def inst(trl: str) -> dict:
        return {"trl": versions.PackageVersion("trl", "trl", trl)}

    for cell in load_grid().pinned:
        expected = cell.trl == "1.15.0"
        assert ISSUE.applies(inst(cell.trl), cuda=False) is expected, cell.name
        assert ISSUE.applies(inst(cell.trl), cuda=True) is False, cell.name
    assert not ISSUE.applies(inst(ISSUE.fixed_in["trl"]), cuda=False)
