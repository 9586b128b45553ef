"""Kernel benchmark section ``ceilings``: the measured bf16 matmul rate and device-copy rate that the
floors of the other sections use."""

from __future__ import annotations

import time

import torch

from . import kernels_common as C
from .kernels_common import bench_ms, log, save


# ---------------------------------------------------------------------------------------------
# ceilings
# ---------------------------------------------------------------------------------------------


def _matmul_tflops(samples=3):
    """bf16 8192^3 matmul rate: ``samples`` medians after ~2 s of the same matmul. It moves by up
    to ~10 % within a run and between machines (685-797 TFLOP/s, NOTES.md), so the floor uses the
    fastest sample the run saw."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(8192, 8192, device="cuda", generator=g, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", generator=g, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 2.0:
        torch.mm(a, b)
        torch.cuda.synchronize()
    rates = [2 * 8192**3 / bench_ms(lambda: torch.mm(a, b)) / 1e9 for _ in range(samples)]
    del a, b
    return rates


def ceilings():
    log("## ceilings")
    rates = _matmul_tflops()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2**29, device="cuda", generator=g, dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    cms = bench_ms(lambda: y.copy_(x))
    tbps = 2 * x.numel() * 2 / cms / 1e9
    C.RESULTS["meta"].update(matmul_tflops=max(rates), matmul_tflops_samples=rates, copy_tbps=tbps)
    log(f"bf16 matmul {max(rates):.0f} TFLOP/s (samples {', '.join(f'{r:.0f}' for r in rates)}), copy {tbps:.2f} TB/s")
    del x, y
    save()


def ceilings_end():
    """The matmul rate again after the other sections; where it is higher, this run's matmul
    floors are rescaled to it (the floor is the fastest rate the run saw)."""
    rates = _matmul_tflops()
    meta = C.RESULTS["meta"]
    meta["matmul_tflops_samples"] = meta.get("matmul_tflops_samples", []) + rates
    old = meta.get("matmul_tflops")
    new = max(meta["matmul_tflops_samples"])
    log(f"bf16 matmul at the end: {', '.join(f'{r:.0f}' for r in rates)} TFLOP/s; ceiling {old} -> {new:.0f}")
    if old and new > old:
        for r in C.RESULTS["rows"]:
            if "run" not in r and r.get("section", "").startswith("flce") and r.get("floor_ms"):
                r["floor_ms"] *= old / new
        meta["matmul_tflops"] = new
