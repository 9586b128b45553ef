"""Two CPU processes (torchrun, gloo) train a tiny Llama with DDP and FSDP2 through liger_compat's
fused head; losses, step-1 gradients and final weights must match one plain-transformers process
over the same global batch. FSDP2 with ``lm_head`` as its own ``fully_shard`` unit is
the sharded-head path: outside its forward the weight is a ``[V/2, H]`` DTensor shard.

The reference is a separate process that never imports liger_compat. Each run draws fresh random
weights and batches (the seed is in the failure message). ``fsdp2_head_bypass`` is the negative
control: gathering the head by hand outside its hooks must give wrong gradients, which shows the
comparison can fail. FSDP1 needs an accelerator, so it runs only in test_multi_gpu.py.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import _harness as h  # noqa: E402

if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

CONFIGS = ["ddp", "fsdp2_head", "fsdp2_tied", "single"]
#: the model shims' fused forward (liger_compat.apply), where this build has it
PATCHED = ["ddp@patched", "fsdp2_tied@patched"]


def _skip_before_loss_kwargs() -> None:
    """The reference process runs native transformers, whose CausalLM forward takes no
    ``num_items_in_batch`` before the loss-kwargs change of 4.46."""
    import transformers

    from liger_compat.compat.versions import matches

    if matches(transformers.__version__, "<4.46"):
        pytest.skip(f"transformers {transformers.__version__}: native forward takes no num_items_in_batch (< 4.46)")


def test_two_rank_training_matches_one_process(tmp_path):
    _skip_before_loss_kwargs()
    seed = h.make_spec(tmp_path / "spec.pt", world=2)
    patched = PATCHED if h.has_fused_forward_shim() else []
    # fsdp2_head@patched last: it may raise (see below), which must not disturb the others
    extra = ["fsdp2_head_bypass"] + patched + (["fsdp2_head@patched"] if patched else [])
    dist, ref = h.run(tmp_path, device="cpu", configs=",".join(CONFIGS + extra), timeout=240, allow_errors=True)
    rows = h.compare(dist, ref, CONFIGS + patched)
    msg = f"seed {seed}\n" + h.markdown(rows, "gloo")
    assert dist["world_size"] == 2 and dist["backend"] == "gloo", msg
    h.assert_close(rows, ref, loss_tol=1e-5, grad_rel=1e-4, weight_tol=2e-5)

    checks = {r["config"]: r["checks"] for r in rows}
    assert checks["ddp"]["engine"] == "DDP" and checks["ddp"]["head_sharding"] == "none"
    head = checks["fsdp2_head"]
    assert head["engine"] == "FSDP2" and head["head_sharding"] == "fsdp2", msg
    assert head["head_weight_is_dtensor_outside_forward"], "the sharded-head path was not exercised"
    assert head["head_weight_full_shape"] == [h.TINY["vocab_size"], h.TINY["hidden_size"]]
    assert head["engine_route_calls"] == 3, "the loss did not go through lm_head's hooks once per step"
    tied = checks["fsdp2_tied"]
    assert tied["head"].startswith("in its parent's FSDP2 unit") and tied["engine_route_calls"] == 0

    bypass = h.compare(dist, ref, ["fsdp2_head_bypass"])[0]
    assert bypass["grad_max_abs_diff"] > 1e-2 * bypass["grad_max_abs"], (
        "negative control: bypassing lm_head's FSDP2 hooks should leave its gradient unreduced\n" + msg)

    if patched:
        # the model shims' forward with lm_head as its own FSDP2 unit: it must never be silently
        # wrong. Until it routes the loss through shims._sharded_head it raises (the shard reaches
        # the kernel) and check() flags it (D2); once routed it must match the reference.
        res = dist["fsdp2_head@patched"]
        if "error" in res:
            assert not res["checks"]["wired"], res["error"]
            assert "D2" in res["checks"]["warnings"], res["checks"]
        else:
            h.assert_close(h.compare(dist, ref, ["fsdp2_head@patched"]), ref,
                           loss_tol=1e-5, grad_rel=1e-4, weight_tol=2e-5)


@pytest.mark.slow
def test_two_rank_zero3_matches_one_process(tmp_path):
    """DeepSpeed ZeRO-3 on CPU (its CPU accelerator, gloo): every parameter partitioned, the head's
    weight a 0-element tensor outside lm_head.forward. Also the loss computed outside the model's
    forward (decoder, then head: trl's fused-loss pattern), where reading lm_head.weight directly
    gets the empty partition (negative control). Skipped where deepspeed is not installed."""
    pytest.importorskip("deepspeed")
    _skip_before_loss_kwargs()
    seed = h.make_spec(tmp_path / "spec.pt", world=2)
    configs = ["zero3", "zero3_tied", "zero3_outside"] + (["zero3@patched"] if h.has_fused_forward_shim() else [])
    dist, ref = h.run(tmp_path, device="cpu", configs=",".join(configs + ["zero3_outside_bypass"]), timeout=500,
                      allow_errors=True)
    rows = h.compare(dist, ref, configs)
    msg = f"seed {seed}\n" + h.markdown(rows, "ZeRO-3, gloo")
    h.assert_close(rows, ref, loss_tol=1e-5, grad_rel=1e-4, weight_tol=2e-5)
    for row in rows:
        c = row["checks"]
        assert c["engine"] == "DeepSpeed ZeRO-3" and c["head_sharding"] == "zero3", msg
        assert c["head_weight_numel_outside_forward"] == 0 and c["head_partitioned_after_training"], c
        assert c["head_weight_full_shape"] == [h.TINY["vocab_size"], h.TINY["hidden_size"]], c
        assert c["engine_route_calls"] == 3, c
    err = dist["zero3_outside_bypass"].get("error", "")
    assert "got shape (0,)" in err, "reading lm_head.weight outside the model's forward should see the partition"


def test_only_a_native_abort_before_any_worker_error_is_started_again():
    abort = "terminate called without an active exception\nfailed (exitcode: -6) local_rank: 1"
    worker_error = (f'Traceback (most recent call last):\n  File "{h.WORKER}", line 10, in <module>\n'
                    "ValueError: boom\nterminate called without an active exception")
    assert h._native_abort(abort)
    assert not h._native_abort(worker_error)
    assert not h._native_abort("ValueError: boom")
    # the stacks faulthandler wrote for the aborting rank name the worker's frames: still an abort
    stacks = f'\n[faulthandler, rank1]\nFatal Python error: Aborted\n  File "{h.WORKER}", line 10 in train\n'
    assert h._native_abort(abort + stacks)
    # a run killed past its limit: started again unless the worker raised first
    timed_out = f"step 1\n{h.TIMED_OUT} 300 s: the run and its ranks were killed]"
    assert h._native_abort(timed_out)
    assert not h._native_abort(worker_error.replace("terminate called without an active exception", timed_out))


def test_an_aborting_run_is_started_again_and_its_stacks_are_kept(tmp_path, monkeypatch):
    """A stand-in for torchrun whose 'ranks' abort natively on the first two runs and pass on the
    third: the harness starts it three times, and the log keeps each attempt and the stacks that
    faulthandler wrote (a real worker writes them through ``enable_fault_stacks``)."""
    script = tmp_path / "flaky.py"
    count = tmp_path / "count"
    script.write_text(textwrap.dedent(f"""
        import os, sys, pathlib
        sys.path.insert(0, {str(h.WORKER.parent)!r})
        from _harness import enable_fault_stacks
        enable_fault_stacks()
        c = pathlib.Path({str(count)!r})
        n = int(c.read_text()) + 1 if c.exists() else 1
        c.write_text(str(n))
        if n < 3:
            print("terminate called without an active exception", flush=True)
            os.abort()
        print("done", n)
    """))
    monkeypatch.setattr(h.time, "sleep", lambda s: None)

    def start():
        faults = tmp_path / f"faults{len(list(tmp_path.glob('faults*')))}"
        faults.mkdir()
        return h._start([sys.executable, str(script)], {h.FAULT_DIR_ENV: str(faults)}), faults

    p, log = h._with_retries(start(), start, timeout=60, script=script)
    assert p.returncode == 0 and count.read_text() == "3", log
    assert log.count("terminate called") == 2 and "[attempt 3]" in log and "done 3" in log, log
    assert log.count("Fatal Python error: Aborted") == 2 and f'File "{script}"' in log, log

    # a Python error is not started again
    count.unlink()
    script.write_text("print('terminate called without an active exception')\nraise ValueError('boom')\n")
    p, log = h._with_retries(start(), start, timeout=60, script=script)
    assert p.returncode != 0 and "[attempt" not in log and "ValueError: boom" in log, log
