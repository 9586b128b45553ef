"""The LM head's loss under tensor parallelism: native (the head split over the vocabulary with
torch's ``ColwiseParallel(output_layouts=Replicate())``, what transformers' ``colwise_gather_output``
plan does: every rank all-gathers the full ``[N, V]`` logits, then ``cross_entropy``) against
liger_compat's vocabulary-parallel fused loss on the same DTensor head (``fused_head_loss``).
Forward + backward of the head alone, bf16, one process a GPU; step time (median of CUDA events)
and peak memory above the inputs, per rank.

    python -m torch.distributed.run --nproc_per_node 2 -m benchmarks.tp_head --out DIR

writes ``DIR/tp_head.json`` and ``DIR/tp_head.md`` (rank 0). On CPU (gloo) it runs at a tiny size
as a smoke test of the script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

#: (name, tokens, hidden, vocabulary)
SHAPES = [
    ("Llama-3-8B head, 4 x 2048 tokens", 8192, 4096, 128256),
    ("Llama-3-8B head, 1 x 32768 tokens", 32768, 4096, 128256),
    ("Gemma-2-9B-like head, 4 x 2048 tokens", 8192, 3584, 256000),
]
TINY = [("tiny (CPU smoke test)", 64, 32, 1000)]
#: the results' command: this script's step in the multi-GPU run
REGENERATE = "OUT=benchmarks/results WITH_ZERO3=1 bash benchmarks/distributed_gpu_run.sh"


def _head(hdim: int, vocab: int, dev: torch.device, dtype: torch.dtype, mesh):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    head = torch.nn.Linear(hdim, vocab, bias=False, device=dev, dtype=dtype)
    with torch.no_grad():
        head.weight.normal_(0, hdim ** -0.5)
    return parallelize_module(head, mesh, ColwiseParallel(output_layouts=Replicate()))


def _native(head, h, t):
    logits = head(h)
    return F.cross_entropy(logits.float(), t, ignore_index=-100)


def _ours(head, h, t):
    from liger_compat.shims import _sharded_head as sd

    return sd.fused_head_loss(head, h, t)


def _time(fn, head, h, t, warmup: int, steps: int, dev) -> tuple[float, float, float]:
    """(median ms, peak MiB above the inputs, loss)."""
    cuda = dev.type == "cuda"
    for _ in range(warmup):
        h.grad = None
        fn(head, h, t).backward()
    head.weight.grad = None
    h.grad = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    loss = 0.0
    for _ in range(steps):
        head.weight.grad = None
        h.grad = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            import time

            t0 = time.perf_counter()
        out = fn(head, h, t)
        out.backward()
        if cuda:
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            times.append((time.perf_counter() - t0) * 1e3)
        loss = float(out.detach())
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else float("nan")
    return statistics.median(times), peak, loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("tp",))
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for name, n, hdim, vocab in (SHAPES if cuda else TINY):
        g = torch.Generator(device="cpu").manual_seed(1)
        h = (torch.randn(n, hdim, generator=g) * 1.5).to(dev, dtype).requires_grad_()
        t = torch.randint(0, vocab, (n,), generator=g)
        t[torch.rand(n, generator=g) < 0.1] = -100
        t = t.to(dev)
        head = _head(hdim, vocab, dev, dtype, mesh)
        row = dict(shape=name, tokens=n, hidden=hdim, vocab=vocab)
        for label, fn in (("native", _native), ("liger_compat", _ours)):
            try:
                ms, peak, loss = _time(fn, head, h, t, a.warmup, a.steps, dev)
                row[label] = dict(ms=ms, peak_mib=peak, loss=loss)
            except torch.OutOfMemoryError as exc:
                row[label] = dict(error=f"out of memory: {str(exc)[:120]}")
            if cuda:
                torch.cuda.empty_cache()
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        del head, h
    if rank == 0:
        env = dict(device=torch.cuda.get_device_name(0) if cuda else "cpu", world=world, torch=torch.__version__,
                   dtype=str(dtype))
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tp_head.json").write_text(json.dumps(dict(env=env, rows=rows, regenerate=REGENERATE), indent=1))
        lines = [f"regenerate: `{REGENERATE}`", "",
                 f"# LM-head loss under tensor parallelism ({world} x {env['device']}, torch {env['torch']}, "
                 f"{env['dtype']})", "",
                 "Forward + backward of the head's loss alone, vocabulary split over the ranks; native: "
                 "ColwiseParallel(output_layouts=Replicate()) + cross_entropy (every rank gathers [N, V] logits); "
                 "liger_compat: the vocabulary-parallel fused loss. Median of "
                 f"{a.steps} steps after {a.warmup}; peak memory above the inputs on rank 0.", "",
                 "Its step in that run: `python -m torch.distributed.run --nproc_per_node 2 -m benchmarks.tp_head "
                 "--out DIR`.", "",
                 "| head | native ms | ours ms | speed-up | native peak MiB | ours peak MiB | loss native / ours |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in rows:
            nat, ours = r["native"], r["liger_compat"]
            if "error" in nat or "error" in ours:
                lines.append(f"| {r['shape']} | {nat.get('error', round(nat.get('ms', 0), 1))} | "
                             f"{ours.get('error', round(ours.get('ms', 0), 1))} | | | | |")
                continue
            lines.append(f"| {r['shape']} | {nat['ms']:.1f} | {ours['ms']:.1f} | {nat['ms'] / ours['ms']:.2f}x | "
                         f"{nat['peak_mib']:.0f} | {ours['peak_mib']:.0f} | {nat['loss']:.4f} / {ours['loss']:.4f} |")
        (out / "tp_head.md").write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
