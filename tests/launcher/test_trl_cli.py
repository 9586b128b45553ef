"""``liger-compat run -- trl sft ...``: trl's own command line (which re-launches its training script
through ``accelerate launch`` in a child Python) trains a tiny local model through liger_compat, with
the losses of the same command without the launcher."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from liger_compat.compat import versions

from liger_compat.shims.trl_fused_lm_head import SHIM_ID

ROOT = Path(__file__).resolve().parents[2]

#: a sitecustomize that was there before: at exit it records, per process, whether liger_compat was
#: active and the state of trl's head shim (the launcher runs it after activating)
PROBE = textwrap.dedent("""
    import atexit, json, os, sys

    def _record():
        lc = sys.modules.get("liger_compat")
        state = None
        if lc is not None and "trl" in sys.modules:
            from liger_compat.shims import REGISTRY
            state = {s.id: s.status()["state"] for s in REGISTRY.shims()}.get(%r)
        with open(os.path.join(os.environ["LAUNCHER_PROBE_DIR"], "%%d.json" %% os.getpid()), "w") as f:
            json.dump({"argv": sys.argv, "liger_compat": lc is not None, "trl": "trl" in sys.modules,
                       "head_shim": state,
                       "how": getattr(sys.modules.get("liger_compat._activation"), "how", None)}, f)

    atexit.register(_record)
""") % SHIM_ID


def _tiny_setup(tmp_path: Path, seed: int) -> tuple[Path, Path]:
    import torch

    from liger_compat.compat import tiny_text

    torch.manual_seed(seed)
    tok = tiny_text.build_tokenizer()
    model = tiny_text.build_model("llama", tok, seed=seed)
    model_dir, data_dir = tmp_path / "model", tmp_path / "data"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data_dir.mkdir()
    rows = tiny_text.sft_rows(16, seed=seed)
    (data_dir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, data_dir


def _trl_script(tmp_path: Path) -> Path:
    """trl's console script for this interpreter: the one pip installed beside it, else (trl seen
    through another environment's site-packages, as tox's cells see the system's) the same script
    written here from trl's entry point, as pip writes it."""
    beside = Path(sys.executable).with_name("trl")
    if beside.exists():
        return beside
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "trl"]
    module, func = ep.value.split(":")
    script = tmp_path / "trl"
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
    script.chmod(0o755)
    return script


def _sft(tmp_path: Path, name: str, prefix: list[str], model_dir: Path, data_dir: Path, seed: int):
    trl = _trl_script(tmp_path)
    out, probes, site = tmp_path / name, tmp_path / f"{name}-probes", tmp_path / f"{name}-site"
    probes.mkdir()
    site.mkdir()
    (site / "sitecustomize.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGER_COMPAT_")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), LAUNCHER_PROBE_DIR=str(probes),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / f"{name}-cache"),
               TOKENIZERS_PARALLELISM="false")
    cmd = prefix + [str(trl), "sft", "--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir),
                    "--output_dir", str(out), "--max_steps", "3", "--logging_steps", "1",
                    "--per_device_train_batch_size", "4", "--max_length", "32", "--learning_rate", "0.01",
                    "--seed", str(seed), "--report_to", "none", "--save_strategy", "steps", "--save_steps", "3",
                    "--use_cpu", "--bf16", "false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    history = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["log_history"]
    steps = [h for h in history if "loss" in h]
    records = [json.loads(p.read_text()) for p in probes.glob("*.json")]
    return steps, records


@pytest.mark.slow
@pytest.mark.skipif(not versions.matches(versions.installed("trl").raw, ">=1.16"),
                    reason="run against the trl 1.16 command line (`trl sft` arguments, dataset loading, a head "
                           "that runs natively on CPU); older command lines are not covered")
def test_trl_sft_command_line_trains_through_the_launcher_with_native_losses(tmp_path):
    seed = random.randrange(2**31)
    model_dir, data_dir = _tiny_setup(tmp_path, seed)
    fused, fused_procs = _sft(tmp_path, "launched", [sys.executable, "-m", "liger_compat", "run", "--"],
                              model_dir, data_dir, seed)
    native, native_procs = _sft(tmp_path, "native", [], model_dir, data_dir, seed)

    # the trainer runs in a child of `trl` (accelerate launch): every Python was activated, and in the one
    # that trained, trl's head is ours
    trainers = [r for r in fused_procs if any(a.endswith("sft.py") for a in r["argv"])]
    assert len(trainers) == 1 and len(fused_procs) >= 2
    assert all(r["liger_compat"] and r["how"] == "launcher" for r in fused_procs)
    assert trainers[0]["head_shim"] == "applied"
    assert not any(r["liger_compat"] for r in native_procs) and len(native_procs) == len(fused_procs)

    assert [h["step"] for h in fused] == [h["step"] for h in native] == [1, 2, 3]
    for f, n in zip(fused, native):
        for key in ("loss", "grad_norm", "mean_token_accuracy", "entropy"):
            assert f[key] == pytest.approx(n[key], rel=1e-4, abs=1e-6), (f["step"], key)
    assert len({h["loss"] for h in native}) == 3  # the steps differ: the comparison can see a wrong step
