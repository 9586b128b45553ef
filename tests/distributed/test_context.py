"""compat.distributed: the distributed context check() reports, from environment variables,
TrainingArguments-like objects and models, and the warnings on known bad combinations."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from liger_compat.compat import distributed as cdist
from liger_compat.compat import versions
from liger_compat.shims import _sharded_head as sd

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}
ACCELERATE = {**TORCHRUN, "ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_DYNAMO_BACKEND": "NO"}


@pytest.fixture
def fused_active(monkeypatch):
    """Pretend a fused forward is active and not routed through shims._sharded_head."""
    monkeypatch.setattr(cdist, "_fused_head_active", lambda: True)
    monkeypatch.setattr(sd, "wired", lambda: False)


def codes(info):
    return sorted(w.code for w in info.warnings)


def test_single_process_defaults():
    info = cdist.detect(env={})
    assert (info.world_size, info.rank, info.local_rank, info.engine, info.launcher) == (1, 0, 0, "none", None)
    assert not info.distributed and info.warnings == []
    assert "single process" in info.summary()


def test_torchrun_env_means_ddp():
    info = cdist.detect(env=TORCHRUN)
    assert (info.world_size, info.rank, info.local_rank, info.local_world_size) == (4, 3, 1, 2)
    assert info.launcher == "torchrun" and info.engine == "DDP" and "assumed" in info.engine_source
    assert info.distributed and "world size 4, rank 3" in info.summary()


@pytest.mark.parametrize("env,engine,version,orig", [
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, "FSDP2", 2, None),
    ({"ACCELERATE_USE_FSDP": "True", "FSDP_VERSION": "1", "FSDP_USE_ORIG_PARAMS": "false"}, "FSDP", 1, False),
    ({"ACCELERATE_USE_FSDP": "1"}, "FSDP", 1, None),  # accelerate's plugin defaults to version 1
])
def test_accelerate_fsdp(env, engine, version, orig):
    info = cdist.detect(env={**ACCELERATE, **env})
    assert info.launcher == "accelerate"
    assert (info.engine, info.fsdp_version, info.fsdp_use_orig_params) == (engine, version, orig)


def test_fsdp1_without_orig_params_warns():
    info = cdist.detect(env={**ACCELERATE, "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1",
                             "FSDP_USE_ORIG_PARAMS": "false"})
    assert "D4" in codes(info)
    ok = cdist.detect(env={**ACCELERATE, "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1",
                           "FSDP_USE_ORIG_PARAMS": "true"})
    assert "D4" not in codes(ok)


def test_zero3_without_gather_warns(fused_active):
    env = {**ACCELERATE, "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
    info = cdist.detect(env=env)
    assert info.engine == "DeepSpeed ZeRO-3" and info.zero_stage == 3
    assert "D1" in codes(info) and info.head_gather == "NOT wired"
    assert any(w.code == "D1" and w.level == "warning" for w in info.warnings)
    zero2 = cdist.detect(env={**env, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"})
    assert zero2.engine == "DeepSpeed ZeRO-2" and "D1" not in codes(zero2)


def test_zero3_with_gather_wired_is_fine(monkeypatch):
    monkeypatch.setattr(cdist, "_fused_head_active", lambda: True)
    monkeypatch.setattr(sd, "wired", lambda: True)
    info = cdist.detect(env={**ACCELERATE, "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"})
    assert "D1" not in codes(info) and info.head_gather == "wired"


def test_no_fused_forward_no_head_warnings(monkeypatch):
    monkeypatch.setattr(cdist, "_fused_head_active", lambda: False)
    info = cdist.detect(env={**ACCELERATE, "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"})
    assert "D1" not in codes(info) and info.head_gather.startswith("n/a")


def test_deepspeed_configured_but_missing():
    info = cdist.detect(env={**ACCELERATE, "ACCELERATE_USE_DEEPSPEED": "true"})
    assert ("D5" in codes(info)) == (not versions.installed("deepspeed").installed)


def test_fsdp2_env_unwired_warns(fused_active):
    info = cdist.detect(env={**ACCELERATE, "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"})
    assert "D3" in codes(info) and all(w.level == "warning" for w in info.warnings)


def test_more_ranks_than_gpus():
    info = cdist.detect(env={**TORCHRUN, "LOCAL_WORLD_SIZE": "4"}, device_count=2)
    assert "D7" in codes(info)
    assert "D7" not in codes(cdist.detect(env=TORCHRUN, device_count=2))
    assert "D7" not in codes(cdist.detect(env={**TORCHRUN, "LOCAL_WORLD_SIZE": "4"}, device_count=0))


def test_other_launchers():
    mpi = cdist.detect(env={"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert (mpi.launcher, mpi.world_size, mpi.rank, mpi.local_rank) == ("mpi", 8, 5, 1)
    slurm = cdist.detect(env={"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1"})
    assert (slurm.launcher, slurm.world_size, slurm.rank, slurm.local_rank) == ("slurm", 2, 1, 1)
    one_task = cdist.detect(env={"SLURM_NTASKS": "1", "SLURM_PROCID": "0"})
    assert not one_task.distributed
    ds = cdist.detect(env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "CROSS_RANK": "0"})
    assert ds.launcher == "deepspeed"


def test_training_args(tmp_path, fused_active):
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"zero_optimization": {"stage": 3}}')
    args = types.SimpleNamespace(deepspeed=str(cfg), fsdp="", fsdp_config=None, average_tokens_across_devices=True)
    info = cdist.detect(env=TORCHRUN, training_args=args)
    assert info.engine == "DeepSpeed ZeRO-3" and info.engine_source == "TrainingArguments.deepspeed"
    assert "D1" in codes(info) and "D8" not in codes(info)
    args = types.SimpleNamespace(deepspeed=None, fsdp="full_shard auto_wrap",
                                 fsdp_config={"version": 1, "use_orig_params": "false"},
                                 average_tokens_across_devices=False)
    info = cdist.detect(env=TORCHRUN, training_args=args)
    assert (info.engine, info.fsdp_use_orig_params) == ("FSDP", False)
    assert {"D4", "D8"} <= set(codes(info))
    # a single process is never told about cross-device token averaging
    assert "D8" not in codes(cdist.detect(env={}, training_args=args))


def test_model_inspection_plain_and_fake_zero3(fused_active):
    torch = pytest.importorskip("torch")

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 4)
            self.lm_head = torch.nn.Linear(4, 8, bias=False)

    plain = Tiny()
    info = cdist.detect(plain, env={})
    assert info.engine == "none" and info.head.startswith("ordinary module") and info.warnings == []
    z3 = Tiny()
    for p in z3.parameters():  # what DeepSpeed ZeRO-3 leaves on a partitioned parameter
        p.ds_id, p.ds_status = 0, "NOT_AVAILABLE"
    info = cdist.detect(z3, env=TORCHRUN)
    assert info.engine == "DeepSpeed ZeRO-3" and info.engine_source == "model" and info.head == "ZeRO-3 partitioned"
    assert {"D1", "D2"} <= set(codes(info))
    # a wrapper keeps the model in .module
    wrapper = type("DistributedDataParallel", (torch.nn.Module,), {})()
    wrapper.module = plain
    info = cdist.detect(wrapper, env=TORCHRUN)
    assert info.engine == "DDP" and info.head.startswith("ordinary module")


def test_report_has_distributed_section(monkeypatch):
    import liger_compat

    for k, v in {**ACCELERATE, "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1",
                 "FSDP_USE_ORIG_PARAMS": "false"}.items():
        monkeypatch.setenv(k, v)
    r = liger_compat.check()
    d = r.to_dict()["distributed"]
    assert d["world_size"] == 4 and d["rank"] == 3 and d["engine"] == "FSDP" and d["launcher"] == "accelerate"
    assert any(w["code"] == "D4" for w in d["warnings"])
    text = str(r)
    assert "\nDistributed\n" in text and "engine FSDP" in text and "D4 (warning)" in text
    for k in list(ACCELERATE) + ["ACCELERATE_USE_FSDP", "FSDP_VERSION", "FSDP_USE_ORIG_PARAMS"]:
        monkeypatch.delenv(k)
    assert liger_compat.check().to_dict()["distributed"]["distributed"] is False


def test_no_torch_distributed_at_import_or_env_detection():
    code = (
        "import sys, liger_compat\n"
        "from liger_compat.compat import distributed\n"
        "from liger_compat.shims import _sharded_head as sd\n"
        "info = distributed.detect(env={'WORLD_SIZE': '2', 'RANK': '1', 'ACCELERATE_USE_FSDP': 'true'})\n"
        "assert info.engine == 'FSDP' and info.world_size == 2, info\n"
        "bad = [m for m in ('torch', 'torch.distributed', 'transformers', 'deepspeed') if m in sys.modules]\n"
        "print('imported:', bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "imported: []", out.stdout


def _d0(info):
    return [w.message for w in info.warnings if w.code == "D0"]


def test_a_zero3_flag_that_raises_is_reported_not_lost(monkeypatch):
    """transformers' ZeRO-3 flag raising (a half-built DeepSpeed config) used to leave the engine
    at "none" without a word; now check() says which source could not be read."""
    import liger_compat

    fake = types.ModuleType("transformers.integrations.deepspeed")

    def broken():
        raise RuntimeError("HfDeepSpeedConfig is gone")

    fake.is_deepspeed_zero3_enabled = broken
    monkeypatch.setitem(sys.modules, "transformers.integrations.deepspeed", fake)
    info = cdist.detect(env={})
    assert _d0(info) == ["transformers' DeepSpeed ZeRO-3 flag (is_deepspeed_zero3_enabled) could not be read "
                         "(RuntimeError: HfDeepSpeedConfig is gone); the engine shown may be incomplete."]
    assert all(w.level == "warning" for w in info.warnings if w.code == "D0")
    text = str(liger_compat.check())
    assert "D0 (warning): transformers' DeepSpeed ZeRO-3 flag" in text and "HfDeepSpeedConfig is gone" in text
    fake.is_deepspeed_zero3_enabled = lambda: True  # read fine: the engine, and no D0
    info = cdist.detect(env={})
    assert info.engine == "DeepSpeed ZeRO-3" and not _d0(info)


def test_a_torn_down_process_group_is_reported(monkeypatch):
    fake = types.ModuleType("torch.distributed")
    fake.is_available = lambda: True
    fake.is_initialized = lambda: True

    def gone():
        raise RuntimeError("Default process group has not been initialized")

    fake.get_world_size = fake.get_rank = fake.get_backend = gone
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    info = cdist.detect(env={})
    (msg,) = _d0(info)
    assert msg.startswith("the torch.distributed process group could not be read (RuntimeError: Default process")


def test_a_deepspeed_engine_whose_stage_cannot_be_read_is_reported():
    torch = pytest.importorskip("torch")

    class DeepSpeedEngine(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(4, 8, bias=False)

        def zero_optimization_stage(self):
            raise AttributeError("'DeepSpeedEngine' object has no attribute '_config'")

    info = cdist.detect(DeepSpeedEngine(), env={})
    assert info.engine == "DeepSpeed" and info.zero_stage is None
    (msg,) = _d0(info)
    assert msg.startswith("DeepSpeedEngine.zero_optimization_stage() could not be read (AttributeError: ")


def test_output_embeddings_not_implemented_means_no_head_and_other_errors_surface():
    torch = pytest.importorskip("torch")

    class Backbone(torch.nn.Module):
        def __init__(self, exc):
            super().__init__()
            self.body, self.exc = torch.nn.Linear(4, 4), exc

        def get_output_embeddings(self):
            raise self.exc

    info = cdist.detect(Backbone(NotImplementedError()), env={})
    assert info.head is None and info.warnings == []
    with pytest.raises(RuntimeError, match="lm_head storage"):
        cdist.detect(Backbone(RuntimeError("lm_head storage")), env={})


def test_the_search_for_a_tensor_parallel_model_reads_no_attribute_of_other_objects():
    """check() without a model looks for a live module with a DTensor head among the process's
    objects: it reads attributes of modules only, never through another object's __getattr__ (a
    deprecated alias that warns, a lazy proxy that imports)."""
    import torch
    import torch.distributed.tensor  # noqa: F401 - the search runs only once DTensor is imported

    reads = []

    class Lazy:
        def __getattr__(self, name):
            reads.append(name)
            raise AttributeError(name)

    import weakref

    lazy = Lazy()
    plain = torch.nn.Linear(2, 2)
    gone = torch.nn.Linear(2, 2)
    dead = weakref.proxy(gone)  # a proxy whose module is gone: any read through it raises
    live = weakref.proxy(plain)
    del gone
    assert cdist._tensor_parallel_model() is None  # no module with a DTensor head here
    assert reads == [], reads
    del lazy, plain, dead, live


def test_a_distributed_run_past_its_time_is_killed_with_every_process_below_it():
    """The harness's wait on a torchrun: past its limit it kills the run and the ranks below it; a
    rank left alive would hold the output pipe, and the wait would never return."""
    import threading
    import time

    import _harness as h

    parent = ("import subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              "print(c.pid, flush=True); time.sleep(600)")
    p = h._start([sys.executable, "-c", parent])
    got: list[str] = []
    waiter = threading.Thread(target=lambda: got.append(h._wait(p, 3)), daemon=True)
    t0 = time.monotonic()
    waiter.start()
    waiter.join(120)
    assert got, "the wait did not return: a process below the run still holds its output"
    assert "timed out after 3 s" in got[0] and time.monotonic() - t0 < 120
    child = int(got[0].split()[0])

    def gone() -> bool:  # no such process, or a zombie waiting to be reaped
        try:
            return open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not gone():
        time.sleep(0.1)
    assert gone(), "the rank below the run lives on"
