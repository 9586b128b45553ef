"""What a Triton kernel costs the host inside a compiled function, by how it is wrapped, on one GPU.

    python -m benchmarks.op_launch [--launches 4] [--calls 200] [--out DIR]

One compiled function (``torch.compile``, default mode) applies ``--launches`` Triton launches of a
small elementwise kernel to a 2048 x 1024 bf16 tensor, wrapped three ways:

- ``custom_op``: a ``torch.library.custom_op`` whose real implementation launches the kernels
  through Triton's Python launcher (how our kernels run under compile today);
- ``triton_op``: ``torch.library.triton_op`` with ``wrap_triton`` (torch >= 2.6), so that Inductor
  sees the kernels and launches them from its generated code;
- ``inductor``: the same arithmetic as plain torch ops, for Inductor to generate and fuse.

Per wrapping: the host time of one call from a drained GPU (median over ``--calls``), and the
synchronised wall time. Writes ``<name>.json`` and ``<name>.md`` under ``--out``.
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch  # at module level: the ops' schemas read their annotations as types


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def scale_add(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m).to(tl.float32)
        tl.store(y_ptr + offs, (x * alpha + 1.0).to(y_ptr.dtype.element_ty), mask=m)

    return scale_add


def _build(launches: int):
    import torch
    import triton

    k = _kernel()
    block = 1024

    def body(x, launch):
        y = x
        for i in range(launches):
            out = torch.empty_like(y)
            launch(k, (triton.cdiv(y.numel(), block),))(y, out, y.numel(), 1.0 + i * 1e-3, BLOCK=block)
            y = out
        return y

    @torch.library.custom_op("op_launch_bench::chain_custom", mutates_args=())
    def chain_custom(x: torch.Tensor) -> torch.Tensor:
        return body(x, lambda kern, grid: kern[grid])

    @chain_custom.register_fake
    def _(x):
        return torch.empty_like(x)

    impls = {"custom_op": torch.compile(lambda x: chain_custom(x) * 2.0)}
    triton_op = getattr(torch.library, "triton_op", None)
    wrap = getattr(torch.library, "wrap_triton", None)
    if triton_op is not None and wrap is not None:
        @triton_op("op_launch_bench::chain_triton", mutates_args=())
        def chain_triton(x: torch.Tensor) -> torch.Tensor:
            return body(x, lambda kern, grid: wrap(kern)[grid])

        impls["triton_op"] = torch.compile(lambda x: chain_triton(x) * 2.0)

    def plain(x):
        y = x
        for i in range(launches):
            y = (y.float() * (1.0 + i * 1e-3) + 1.0).to(x.dtype)
        return y * 2.0

    impls["inductor"] = torch.compile(plain)
    return impls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--name", default="op_launch")
    a = ap.parse_args(argv)
    import torch

    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    rows = []
    for name, fn in _build(a.launches).items():
        for _ in range(5):
            fn(x)
        host, wall = [], []
        for _ in range(a.calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(x)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            host.append((t1 - t0) * 1e3)
            wall.append((time.perf_counter() - t0) * 1e3)
        rows.append({"wrapping": name, "launches": a.launches, "host_ms": statistics.median(host),
                     "wall_ms": statistics.median(wall), "gpu": torch.cuda.get_device_name(0),
                     "torch": torch.__version__})
        print(rows[-1], flush=True)
    cmd = f"python -m benchmarks.op_launch --launches {a.launches} --calls {a.calls}" + (
        f" --name {a.name}" if a.name != "op_launch" else "")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps({"regenerate": cmd, "rows": rows}, indent=1))
    md = [f"regenerate: `{cmd}`", "", "# A Triton kernel's host cost in a compiled function, by its wrapping", "",
          f"GPU: {rows[0]['gpu']}; torch {rows[0]['torch']}", "",
          f"One compiled call: {a.launches} launches of a small elementwise Triton kernel on 2048 x 1024 bf16, then "
          "one torch multiply. host: from a drained GPU to the call's return; wall: synchronised. Medians over "
          f"{a.calls} calls.", "", "| wrapping | host ms | wall ms |", "|---|---:|---:|"]
    md += [f"| {r['wrapping']} | {r['host_ms']:.3f} | {r['wall_ms']:.3f} |" for r in rows]
    (out / f"{a.name}.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
