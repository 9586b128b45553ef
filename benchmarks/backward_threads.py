"""Host time of one gated-MLP autograd node through the autograd engine's device thread, against
the same backward run on the calling thread, on one GPU.

    python -m benchmarks.backward_threads [--out DIR] [--name backward_threads]

On CUDA tensors the autograd engine runs a backward on a thread of its own per device; a custom
``autograd.Function``'s backward is Python run on that thread. This times, host microseconds per
call with no synchronisation inside the loop (median of 5 batches of 100 calls), at the small
Llama's MLP shape (2048 rows, hidden 1024, intermediate 4096, bf16): the patched MLP's node
(``_GatedLinear``: SwiGLU and the down projection, its backward in Python) and native's
``linear(silu(gate) * up)``, each through ``.backward`` (gradients accumulated into leaves) and
``torch.autograd.grad``; a one-line identity ``Function`` and a plain view for the engine's own
cost; each with ``torch.autograd.set_multithreading_enabled`` on (the default) and off. Then a
``cProfile`` of the patched node's calls with the engine's threads off (the backward's Python
then runs on the profiled thread). Writes ``<name>.txt``.
"""

from __future__ import annotations

import argparse
import cProfile
import statistics
import sys
from pathlib import Path

import torch

from . import _results, module_host


class _Ident(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _per_call_us(fn, k: int = 100) -> float:
    """10 warm-up calls, then the median of 5 batches of ``k`` (``module_host``'s per-call timer)."""
    for _ in range(10):
        fn()
    return statistics.median(module_host._per_call_us(fn, k) for _ in range(5))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="backward_threads")
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import liger_compat  # noqa: F401
    from liger_compat.kernels import gated_mlp as GM

    torch.manual_seed(0)
    n, h, i = 2048, 1024, 4096
    bf = torch.bfloat16
    g = torch.randn(n, i, device="cuda", dtype=bf)
    u = torch.randn_like(g)
    w = torch.randn(h, i, device="cuda", dtype=bf) * 0.02
    dout = torch.randn(n, h, device="cuda", dtype=bf)
    gr, ur, wr = g.clone().requires_grad_(), u.clone().requires_grad_(), w.clone().requires_grad_()

    def ours():
        GM._GatedLinear.apply(gr, ur, wr, None, "silu", "triton", False).backward(dout)

    def ours_grad():
        torch.autograd.grad(GM._GatedLinear.apply(gr, ur, wr, None, "silu", "triton", False), (gr, ur, wr), dout)

    def native():
        torch.nn.functional.linear(torch.nn.functional.silu(gr) * ur, wr).backward(dout)

    def native_grad():
        out = torch.nn.functional.linear(torch.nn.functional.silu(gr) * ur, wr)
        torch.autograd.grad(out, (gr, ur, wr), dout)

    x = torch.randn(16, device="cuda", requires_grad=True)
    go = torch.ones(16, device="cuda")
    rows = {}
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        for name, fn in (("ours fwd+bwd", ours), ("native fwd+bwd", native), ("ours autograd.grad", ours_grad),
                         ("native autograd.grad", native_grad),
                         ("identity Function fwd+bwd", lambda: _Ident.apply(x).backward(go)),
                         ("view fwd+bwd", lambda: x.view_as(x).backward(go))):
            rows[f"{name}, multithreading={threads}"] = _per_call_us(fn)
    lines = [f"{k:55s} {v:8.1f} us" for k, v in rows.items()]
    torch.autograd.set_multithreading_enabled(False)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        ours()
    pr.disable()
    torch.autograd.set_multithreading_enabled(True)
    lines.append(_results.profile_text(pr, "tottime", 30))
    cmd = _results.command("benchmarks.backward_threads", sys.argv[1:] if argv is None else argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{ns.name}.txt").write_text(_results.md_line(cmd) + "\n".join(lines))
    print("\n".join(lines[:12]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
