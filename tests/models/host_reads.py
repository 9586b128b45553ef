"""Count the aten ops that read a tensor's value on the host during a training step (each one a
host sync on the GPU): a patched step must make no more of them than the native one.

Run as a script under ``TRITON_INTERPRET=1`` (the Triton kernels on CPU, as on the GPU) by
``test_host_syncs.py``; prints one JSON object of counts (and where each read came from).

What is counted, and what is not:

* counted: every dispatch of an op in :data:`HOST_READS` (``bool(t)``, ``t.item()``,
  ``nonzero``, boolean-mask indexing, ``torch.equal`` ...) outside a Triton launch;
* not counted: what happens inside a Triton launch. The interpreter emulates the GPU on CPU and
  reads its arguments to do so; on the GPU a launch is queued and reads nothing back;
* the target-error flags (``_device_errors.poll``) are read on the host by design: on the GPU
  from a pinned copy whose CUDA event has completed (no wait), on CPU directly. Those reads do
  not dispatch an aten op (``tolist``), so there is nothing to exclude; the count would show it.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops whose result is read on the host (a device sync on CUDA tensors)
HOST_READS = frozenset({
    "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal", "aten::allclose",
    "aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim",
    "aten::repeat_interleave", "aten::bincount", "aten::histc", "aten::_assert_async",
})


class HostReads(TorchDispatchMode):
    """Records host-reading ops, except inside Triton launches (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if not self.paused and name in HOST_READS:
            here = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            where = f"{os.path.basename(here[-1].filename)}:{here[-1].lineno}" if here else "?"
            self.reads.append(f"{name} at {where}")
        return func(*args, **(kwargs or {}))


def _pause_in_triton_launches(mode: HostReads) -> None:
    from triton.runtime import interpreter

    launch = interpreter.GridExecutor.__call__

    def paused(self, *args, **kwargs):
        mode.paused += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            mode.paused -= 1

    interpreter.GridExecutor.__call__ = paused


def count(fn) -> list[str]:
    mode = HostReads()
    _pause_in_triton_launches(mode)
    with mode:
        fn()
    return mode.reads


def _llama_step():
    from benchmarks.cpu_step import tiny_llama

    model, ids, labels = tiny_llama(seed=3)

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=labels).loss.backward()

    return step


def _flce_step(mode):
    from liger_compat.kernels import fused_linear_cross_entropy

    g = torch.Generator().manual_seed(11)
    h = torch.randn(24, 16, generator=g, requires_grad=True)
    w = (torch.randn(40, 16, generator=g) / 4).requires_grad_(True)
    t = torch.randint(0, 40, (24,), generator=g)
    t[::5] = -100
    if mode is None:  # native: the logits, then torch's cross-entropy
        return lambda: torch.nn.functional.cross_entropy(h @ w.T, t).backward()
    return lambda: fused_linear_cross_entropy(h, w, t, mode=mode, return_token_accuracy=True).loss.backward()


def _logprob_step(grad_mode):
    from liger_compat.kernels import fused_linear_logprobs

    g = torch.Generator().manual_seed(12)
    h = torch.randn(20, 16, generator=g, requires_grad=True)
    w = (torch.randn(40, 16, generator=g) / 4).requires_grad_(True)
    t = torch.randint(0, 40, (20,), generator=g)
    t[::4] = -100
    weights = torch.rand(20, generator=g)

    if grad_mode is None:  # native: log-softmax of the logits, gathered at the targets
        def step():
            lp = torch.log_softmax((h @ w.T).float(), -1).gather(1, t.clamp(min=0)[:, None]).squeeze(1)
            lp = torch.where(t != -100, lp, 0.0)
            (-(lp.sum()) / 15 - (lp * weights).sum()).backward()
        return step

    mask = torch.zeros(24, dtype=torch.bool)
    mask[torch.randperm(24, generator=g)[:20]] = True

    def step():
        out = fused_linear_logprobs(h, w, t, want=("log_probs", "entropy", "is_top1"), grad_mode=grad_mode)
        if grad_mode == "uniform":  # SFT: a sum of the log-probs over a count
            (-out.log_probs.sum() / 15).backward()
        elif grad_mode == "sum":  # trl's SFT NLL: the scored rows scattered back over a mask, summed
            (-out.log_probs.new_zeros(24).masked_scatter(mask, out.log_probs).sum() / 15).backward()
        else:  # a per-token weighting (DPO, GRPO)
            (-(out.log_probs * weights).sum()).backward()
    return step


def main() -> int:
    import liger_compat

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    torch.set_num_threads(1)
    result = {}
    step = _llama_step()
    liger_compat.revert()
    step()  # warm-up: one-time work (transformers' caches)
    result["llama_native"] = count(step)
    liger_compat.apply()
    step()  # warm-up: the structural probes run once per class
    result["llama_patched"] = count(step)
    for name, fn in (("flce_native", _flce_step(None)), ("flce_chunked", _flce_step("chunked")),
                     ("flce_lowmem", _flce_step("lowmem")), ("logprob_native", _logprob_step(None)),
                     ("logprob_uniform", _logprob_step("uniform")), ("logprob_sum", _logprob_step("sum")),
                     ("logprob_recompute", _logprob_step("recompute"))):
        fn()
        result[name] = count(fn)
    from liger_compat.kernels import last_backend

    result["backends"] = dict(last_backend)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
