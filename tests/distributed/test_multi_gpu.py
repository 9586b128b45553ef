"""Two GPUs (torchrun, NCCL): DDP, FSDP2 (lm_head its own unit; tied embeddings in the root unit),
FSDP1 (lm_head its own unit, use_orig_params=False) and, where deepspeed is installed, ZeRO-3,
each through liger_compat's fused head, against one plain-transformers process on one GPU over
the same global batch. fp32 with TF32 off, so the comparison is tight.

Skipped where fewer than 2 GPUs are visible. With ``LIGER_COMPAT_DIST_RESULTS=<dir>`` the result
tables are written there as JSON and markdown (benchmarks/results/distributed_2gpu*).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import _harness as h  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

TOL = dict(loss_tol=1e-4, grad_rel=1e-3, weight_tol=1e-4)


def _write(name: str, rows, seed: int, title: str, **meta) -> None:
    out = os.environ.get("LIGER_COMPAT_DIST_RESULTS")
    if not out:
        return
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    from importlib.metadata import PackageNotFoundError, version

    try:
        ds = version("deepspeed")
    except PackageNotFoundError:
        ds = None
    info = dict(device=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(), torch=torch.__version__,
                transformers=__import__("transformers").__version__, deepspeed=ds, seed=seed, **meta)
    cmd = "OUT=benchmarks/results WITH_ZERO3=1 bash benchmarks/distributed_gpu_run.sh"  # what writes these files
    (d / f"{name}.json").write_text(h.to_json(rows, regenerate=cmd, **info))
    head = ", ".join(f"{k} {v}" for k, v in info.items())
    (d / f"{name}.md").write_text(f"regenerate: `{cmd}`\n\n" + h.markdown(rows, title) + f"\n{head}\n")


def _run(tmp_path, configs, extra, title, name):
    seed = h.make_spec(tmp_path / "spec.pt", world=2)
    dist, ref = h.run(tmp_path, device="cuda", configs=",".join(configs + extra), timeout=400, allow_errors=True)
    ok = [c for c in configs if "error" not in dist[c]]
    rows = h.compare(dist, ref, ok)
    h.vs_single(dist, rows)
    errors = {c: dist[c]["error"] for c in configs + extra if "error" in dist[c]}
    _write(name, rows, seed, title, errors=errors, naive_step0_loss=ref["naive_step0_loss"],
           ref_step0_loss=ref["untied"]["losses"][0])
    assert not [c for c in configs if c not in ok], errors
    h.assert_close(rows, ref, **TOL)
    return dist, ref, rows


def test_ddp_fsdp2_fsdp1_on_two_gpus(tmp_path):
    patched = ["ddp@patched", "fsdp2_head@patched", "fsdp2_tied@patched", "fsdp1_head@patched"]
    configs = ["ddp", "fsdp2_head", "fsdp2_tied", "fsdp1_head", "single"]
    if h.has_fused_forward_shim():
        configs += patched
    dist, ref, rows = _run(tmp_path, configs, ["fsdp2_head_bypass"], "2 x GPU, NCCL", "distributed_2gpu")
    c = dist["fsdp2_head"]["checks"]
    assert c["head_sharding"] == "fsdp2" and c["head_weight_is_dtensor_outside_forward"] and c["engine_route_calls"] == 3
    assert dist["fsdp1_head"]["checks"]["head_sharding"] == "fsdp1"
    bypass = h.compare(dist, ref, ["fsdp2_head_bypass"])[0]
    assert bypass["grad_max_abs_diff"] > 1e-2 * bypass["grad_max_abs"]


def test_zero3_on_two_gpus(tmp_path):
    pytest.importorskip("deepspeed")
    configs = ["zero3", "zero3_tied", "zero3_outside"] + (["zero3@patched"] if h.has_fused_forward_shim() else [])
    dist, ref, rows = _run(tmp_path, configs, ["zero3_outside_bypass"], "2 x GPU, NCCL, DeepSpeed ZeRO-3",
                           "distributed_2gpu_zero3")
    for row in rows:
        assert row["checks"]["head_sharding"] == "zero3" and row["checks"]["engine_route_calls"] == 3
    assert "got shape (0,)" in dist["zero3_outside_bypass"].get("error", "")
