"""Test knobs shared by the kernel tests.

The same test modules run twice: in a normal pytest run on the torch reference, and in a
subprocess with ``TRITON_INTERPRET=1`` (see ``test_interpret.py``) where the dispatch must pick
the Triton path. ``LIGER_COMPAT_TEST_EXAMPLES`` caps hypothesis examples in that subprocess.
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def expected_backend() -> str:
    return "triton" if interpreting() else "torch"


def examples(n: int) -> int:
    cap = os.environ.get("LIGER_COMPAT_TEST_EXAMPLES")
    return min(n, int(cap)) if cap else n


def tolerance(dtype, *, n: int = 1, ulps: float = 4.0) -> float:
    """Norm-relative error allowed for a kernel computing in ``dtype``, from the dtype alone.

    ``ulps`` roundings to ``dtype`` (inputs, intermediates, output: each off by at most half a unit
    in the last place, ``finfo(dtype).eps / 2`` relative) plus ``n`` fp32 roundings (terms of a sum,
    or operations of a chain such as an activation's formula), whose errors grow like ``sqrt(n)``
    when they are independent: the kernels accumulate reductions, matmuls and statistics and
    evaluate activations in fp32 whatever the input dtype. ``dtype="tf32"``: fp32 matmuls that
    round their inputs to TF32's 10-bit mantissa (CUDA with ``allow_tf32``).
    """
    import torch

    eps = 2.0 ** -10 if dtype == "tf32" else torch.finfo(dtype).eps
    return ulps * (eps + n ** 0.5 * torch.finfo(torch.float32).eps)


def record_ops(monkeypatch):
    """A ``TorchDispatchMode`` whose ``ops`` lists the torch operations run under it, by name and in
    order, those inside the Triton interpreter's launches left out."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    inside = [0]
    real_run = InterpretedFunction.run

    def run(self, *a, **k):
        inside[0] += 1
        try:
            return real_run(self, *a, **k)
        finally:
            inside[0] -= 1

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0]:
                self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(InterpretedFunction, "run", run)
    return Record()
