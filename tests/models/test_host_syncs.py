"""The training hot path makes no host sync the native step does not make, and costs little host time.

* CPU, Triton's interpreter: the aten ops that read a value on the host (each a sync on the GPU)
  during a patched tiny-Llama step (forward with labels, backward), the fused loss in both modes
  and the log-prob head (trl's SFT NLL over masked rows in ``grad_mode="sum"`` among them), counted
  against the native step (``host_reads.py`` says what is counted).
* GPU (skipped here): the same steps under ``torch.cuda.set_sync_debug_mode("error")``.
* CPU wall time of a tiny model's step, patched against native, in one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from patch_helpers import native

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


@pytest.fixture(scope="module")
def interpreted_counts():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(HERE / "host_reads.py")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.interpret
@pytest.mark.parametrize("patched, reference", [
    ("llama_patched", "llama_native"),
    ("flce_chunked", "flce_native"),
    ("flce_lowmem", "flce_native"),
    ("logprob_uniform", "logprob_native"),
    ("logprob_sum", "logprob_native"),
    ("logprob_recompute", "logprob_native"),
])
def test_no_more_host_reads_than_native(interpreted_counts, patched, reference):
    counts = interpreted_counts
    # the Triton kernels ran (interpreted), not the torch reference
    assert {"fused_linear_cross_entropy", "rms_norm", "rope", "swiglu", "fused_linear_logprobs"} <= set(
        k for k, v in counts["backends"].items() if v == "triton"), counts["backends"]
    assert len(counts[patched]) <= len(counts[reference]), (counts[patched], counts[reference])


def test_the_counter_sees_host_reads():
    """The dispatch mode counts what it should: ``bool``, ``item``, ``nonzero``, masks, ``equal``."""
    sys.path.insert(0, str(HERE))
    try:
        from host_reads import count
    finally:
        sys.path.remove(str(HERE))
    pytest.importorskip("triton")
    x = torch.randn(5)
    reads = count(lambda: (bool(x.sum() > 0), x.max().item(), (x > 0).nonzero(), x[x > 0], torch.equal(x, x)))
    names = [r.split(" at ")[0] for r in reads]
    for op in ("aten::_local_scalar_dense", "aten::nonzero", "aten::equal"):
        assert op in names, reads
    assert count(lambda: (x * 2).sum()) == []


# --------------------------------------------------------------------------------------------
# GPU: no sync at all in the patched step (skipped without CUDA)
# --------------------------------------------------------------------------------------------


def _gpu_llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).to("cuda", dtype).train()
    ids = torch.randint(0, 32000, (2, 128), device="cuda")
    labels = ids.clone()
    labels[:, :17] = -100
    return model, ids, labels


def _syncs(fn) -> list[str]:
    """The synchronizing CUDA calls ``fn`` makes, as ``set_sync_debug_mode("warn")`` reports them."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # torch's sync warning ("called a synchronizing CUDA operation"), not the notice that the
    # debug mode is a prototype (warned once a process, at the first call that sets the mode)
    return [str(w.message).splitlines()[0] for w in caught if "synchronizing cuda operation" in str(w.message).lower()]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_patched_step_makes_no_more_host_syncs_than_native_on_gpu(dtype):
    """The tiny Llama's training step (with and without ``num_items_in_batch``): no more syncs
    than the same step unpatched. The fused loss in both modes and the log-prob head alone: none."""
    import liger_compat
    from liger_compat.kernels import fused_linear_cross_entropy, fused_linear_logprobs, raise_target_errors

    liger_compat.apply()
    model, ids, labels = _gpu_llama(dtype)
    h = torch.randn(300, 256, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(32000, 256, device="cuda", dtype=dtype) / 16).requires_grad_(True)
    t = torch.randint(0, 32000, (300,), device="cuda")
    t[::7] = -100
    weights = torch.rand(300, device="cuda")
    per_row = torch.full((300,), 1 / 257, device="cuda")
    count = torch.tensor(200, device="cuda")

    def model_steps():
        model(input_ids=ids, labels=labels).loss.backward()
        model(input_ids=ids, labels=labels, num_items_in_batch=count).loss.backward()

    def kernel_steps():
        for mode in ("chunked", "lowmem"):
            fused_linear_cross_entropy(h, w, t, mode=mode, return_token_accuracy=True).loss.backward()
            fused_linear_cross_entropy(h, w, t, mode=mode, num_items_in_batch=250).backward()
        out = fused_linear_logprobs(h, w, t, want=("log_probs", "entropy", "is_top1"), grad_mode="uniform")
        (-out.log_probs.sum() / 300).backward()
        out = fused_linear_logprobs(h, w, t, want=("log_probs", "entropy"), grad_mode="recompute")
        (-(out.log_probs * weights).sum() + out.entropy.mean()).backward()
        # trl's SFT NLL: one factor over the rows, not a stride-0 broadcast (no comparison on the host)
        out = fused_linear_logprobs(h, w, t, want=("log_probs", "entropy", "is_top1"), grad_mode="sum")
        (-(out.log_probs * per_row).sum()).backward()

    for _ in range(2):  # warm-up: Triton compiles, the structural probes run, auto picks its mode
        model_steps()
        kernel_steps()
    patched = _syncs(model_steps)
    assert _syncs(kernel_steps) == []
    with native():
        model_steps()
        reference = _syncs(model_steps)
    assert len(patched) <= len(reference), (patched, reference)
    torch.cuda.synchronize()
    raise_target_errors()  # good targets: nothing to report


@pytest.mark.gpu
def test_patched_step_under_sync_debug_error_on_gpu():
    """Where the native step makes no sync, the patched one runs under ``"error"``."""
    import liger_compat

    liger_compat.apply()
    model, ids, labels = _gpu_llama(torch.bfloat16)
    for _ in range(2):
        model(input_ids=ids, labels=labels).loss.backward()
    with native():
        model(input_ids=ids, labels=labels).loss.backward()
        if _syncs(lambda: model(input_ids=ids, labels=labels).loss.backward()):
            pytest.skip("the native step itself syncs on this transformers release")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(input_ids=ids, labels=labels).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


# --------------------------------------------------------------------------------------------
# CPU step time
# --------------------------------------------------------------------------------------------


#: a tiny model's patched CPU step against native's (per-call host work only): the goal, met on this
#: machine when nothing else runs (``python -m benchmarks.cpu_step``, ``benchmarks/results/cpu_step.md``)
CPU_STEP_RATIO_GOAL = 1.1
#: what a test run may assert beside other tests on two cores: a gross slowdown (a per-step cost
#: that doubles the step). Seconds on a shared machine cannot hold a finer bound: 1.15-1.18 was
#: measured in a CI cell where the step alone takes 1.08x. The finer guard is the call count below
#: (machine-independent: 224 extra calls now, 418 before the CPU path was trimmed)
CPU_STEP_RATIO_BOUND = 1.5
#: Python calls (profiler events) a patched step makes beyond native's: machine-independent, and about
#: the same on every transformers version (native's own count is not: 650 on 4.45, 1020 on 5.24); 420
#: before the CPU path was trimmed
CPU_STEP_EXTRA_CALLS_BOUND = 260


@pytest.mark.slow
@pytest.mark.cpu_native
def test_tiny_model_cpu_step_close_to_native():
    """Native and patched alternating in short batches in one process (``benchmarks.cpu_step``),
    the ratio of the median steps in the thread's own CPU time, which the other tests running
    beside this one move least; the best of up to three measurements."""
    from benchmarks.cpu_step import step_times

    runs = []
    for _ in range(3):
        res = step_times(steps=10, rounds=30)
        print(json.dumps(res))
        runs.append(res)
        if res["ratio_cpu_median"] <= CPU_STEP_RATIO_GOAL:
            break
    assert min(r["ratio_cpu_median"] for r in runs) <= CPU_STEP_RATIO_BOUND, runs


@pytest.mark.cpu_native
def test_tiny_model_cpu_step_python_calls_close_to_native():
    """The Python calls of one patched step against one native step (``benchmarks.cpu_step.call_counts``):
    the per-call work the shims add, counted rather than timed."""
    from benchmarks.cpu_step import call_counts

    res = call_counts()
    print(json.dumps(res))
    assert res["patched"] - res["native"] <= CPU_STEP_EXTRA_CALLS_BOUND, res
