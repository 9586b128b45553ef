"""Host time of one fused-loss call, layer by layer: the public function, the custom op the
compiled step calls, and the chunked pass under it, on one GPU.

    python -m benchmarks.op_host [--rows 2048] [--hidden 1024] [--vocab 128256] [--calls 50] [--out DIR]

Each is timed from a drained GPU to its return (no synchronisation inside: the host's own cost),
median over ``--calls``; then a ``cProfile`` of the custom op's calls and of the eager public calls shows
which of our functions (and Triton's launcher) the host time is spent in. bf16, 10 % ignored
targets, forward with the gradients formed in the same pass (what a training step's loss runs).
Writes ``<name>.txt`` under ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import statistics
import time
from pathlib import Path

from . import _results


def _host_ms(fn, calls: int) -> float:
    import torch

    out = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--name", default="op_host")
    a = ap.parse_args(argv)
    import torch

    import liger_compat  # noqa: F401
    from liger_compat.kernels import loss as L
    from liger_compat.kernels.loss import fused_linear_cross_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(a.rows, a.hidden, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(a.vocab, a.hidden, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
    t = torch.randint(0, a.vocab, (a.rows,), device="cuda", generator=g)
    t[torch.rand(a.rows, device="cuda", generator=g) < 0.1] = -100
    scale = torch.tensor(1.0 / a.rows, device="cuda")
    op = torch.ops.liger_compat.flce_with_grads
    hd, wd = h.detach(), w.detach()
    opt = L.CEOptions(-100, 0.0, 0.0, None)

    def public():
        fused_linear_cross_entropy(h, w, t).backward()

    def public_fwd():
        fused_linear_cross_entropy(h, w, t)

    def custom_op():
        op(hd, wd, None, t, scale, -100, 0.0, 0.0, None, True, True, False, "auto", "auto", False, "split")

    def plain_pass():
        L._flce_pass(hd, wd, None, t, opt, "triton", scale=scale, grads=(True, True, False), want_stats=True)

    def mm_only():
        torch.mm(hd, wd.t())

    def native():  # the model head's own loss: bf16 logits, upcast, cross_entropy
        logits = torch.nn.functional.linear(h, w).float()
        torch.nn.functional.cross_entropy(logits, t, ignore_index=-100).backward()

    settings = liger_compat._config.settings

    def graphs(on, fn):
        def run():
            settings.flce_graphs = on
            try:
                fn()
            finally:
                settings.flce_graphs = True
        return run

    rows = []
    for name, fn in (("public forward + backward", public), ("public forward", public_fwd),
                     ("public forward + backward, graphs off", graphs(False, public)),
                     ("public forward, graphs off", graphs(False, public_fwd)),
                     ("native linear + cross_entropy fwd + bwd", native),
                     ("custom op flce_with_grads", custom_op), ("_flce_pass (triton)", plain_pass),
                     ("one torch.mm (for scale)", mm_only)):
        for _ in range(5):
            fn()
        rows.append((name, _host_ms(fn, a.calls)))
    gpu = []
    for name, fn in (("public forward + backward", public), ("public forward + backward, graphs off", graphs(False, public)),
                     ("native linear + cross_entropy fwd + bwd", native)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            fn()
        torch.cuda.synchronize()
        gpu.append((name, (time.perf_counter() - t0) * 1e3 / a.calls))
    graph_counts = f"graphs captured {L._GRAPHS.captures}, replayed {L._GRAPHS.replays}, failures {L._GRAPHS.failures}"
    lines = [f"regenerate: `python -m benchmarks.op_host --rows {a.rows} --hidden {a.hidden} --vocab {a.vocab} "
             f"--calls {a.calls} --name {a.name}`", "", f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}", "",
             "host ms per call (GPU drained before, no sync inside), median:"]
    lines += [f"  {n:40s} {ms:8.3f}" for n, ms in rows]
    lines += ["", f"ms per call back to back (host and GPU overlapped), {a.calls} calls:"]
    lines += [f"  {n:40s} {ms:8.3f}" for n, ms in gpu]
    lines += ["", graph_counts]
    for what, fn in (("custom-op calls", custom_op), ("public forward + backward calls (eager)", public)):
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        lines += ["", f"cProfile of 20 {what}, by cumulative time:", _results.profile_text(pr, "cumulative", 45)]
        lines += ["", "by own time:", _results.profile_text(pr, "tottime", 30)]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:22]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
