"""Scaling of one training step of a small Llama on 1 and 2 GPUs, native vs liger_compat.

    torchrun --nproc_per_node 1 -m benchmarks.distributed_scaling --out results/one.json
    torchrun --nproc_per_node 2 -m benchmarks.distributed_scaling --out results/two.json
    python -m benchmarks.distributed_scaling --table one.json two.json > distributed_scaling.md

(as a module, from the repository root: run as a file, ``benchmarks/`` would be first on ``sys.path``
and ``benchmarks/kernels.py`` would shadow the PyPI ``kernels`` package that transformers probes.)

(``benchmarks/distributed_gpu_run.sh`` runs these three; its command heads every result file.)

The model is the design's end-to-end anchor: Llama, 8 layers, hidden 2048 (GQA 32/8 heads,
MLP 8192), vocab 128256, bf16 weights, 4 x 2048 tokens per GPU, AdamW. One process runs the
single-GPU step (no wrapper); two processes run DDP and FSDP2 (each decoder layer and the root
as fully_shard units). For each, ``native`` is transformers with liger_compat switched off
(``configure(enabled=False)``: every patch reverted) and ``liger_compat`` is the same model after
``liger_compat.apply(model)``. Tokens/s counts the global batch; peak memory is
``torch.cuda.max_memory_allocated`` after the warm-up, the largest over ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path

from benchmarks import _results

SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
CONFIG = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
              num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
              rope_theta=500000.0, tie_word_embeddings=False)


def _helper_forward(self, input_ids=None, labels=None, **kwargs):
    """Used only when no fused forward shim is registered: decoder + fused head loss."""
    import torch
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from liger_compat.shims._sharded_head import fused_head_loss

    hidden = self.model(input_ids=input_ids).last_hidden_state
    target = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    return CausalLMOutputWithPast(loss=fused_head_loss(self.lm_head, hidden, target))


def _has_fused_forward_shim() -> bool:
    from liger_compat.shims import REGISTRY, load_all

    load_all()
    return any("fused_linear_cross_entropy" in s.kernels for s in REGISTRY.shims())


def build(mode: str, engine: str, device, liger_compat):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    liger_compat.configure(enabled=(mode == "liger_compat"))
    cfg = LlamaConfig(**(SMOKE if device.type == "cpu" else CONFIG))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    how = "native"
    if mode == "liger_compat":
        if _has_fused_forward_shim():
            liger_compat.apply(model)
            how = "liger_compat.apply(model)"
        else:
            model.forward = types.MethodType(_helper_forward, model)
            how = "fused head only (no fused forward shim in this build)"
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    elif engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model, how


def step_fn(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(mode, engine, device, world, rank, args, liger_compat, dist):
    import torch

    cuda = device.type == "cuda"
    vocab = (SMOKE if not cuda else CONFIG)["vocab_size"]
    model, how = build(mode, engine, device, liger_compat)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    batches = [torch.randint(0, vocab, (args.batch, args.seq), device=device, generator=g)
               for _ in range(2)]
    for i in range(args.warmup):
        step_fn(model, opt, batches[i % 2])
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    if dist is not None:
        dist.barrier()
    times = []
    for i in range(args.steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = step_fn(model, opt, batches[i % 2])
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    stats = torch.tensor([max(times), peak], device=device)
    if dist is not None:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        t_med = torch.tensor(sorted(times)[len(times) // 2], device=device)
        dist.all_reduce(t_med, op=dist.ReduceOp.MAX)
        med = float(t_med)
    else:
        med = sorted(times)[len(times) // 2]
    tokens = world * args.batch * args.seq
    res = {"mode": mode, "engine": engine, "gpus": world, "how": how, "step_ms_median": med * 1e3,
           "tokens_per_s": tokens / med, "tokens_per_s_per_gpu": tokens / med / world,
           "peak_mem_gib_max_rank": float(stats[1]), "final_loss": float(loss.detach())}
    del model, opt, batches
    if cuda:
        torch.cuda.empty_cache()
    return res


def run(args) -> None:
    import torch

    import liger_compat

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu") if args.smoke else torch.device(f"cuda:{local}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist = None
    if world > 1:
        import torch.distributed as dist

        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    engines = ["single"] if world == 1 else ["ddp", "fsdp2"]
    results = []
    for engine in engines:
        for mode in ("native", "liger_compat"):
            r = measure(mode, engine, device, world, rank, args, liger_compat, dist)
            if rank == 0:
                print(json.dumps(r), flush=True)
            results.append(r)
    if rank == 0:
        meta = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (smoke run)", "torch": torch.__version__,
                "transformers": __import__("transformers").__version__,
                "config": CONFIG if device.type == "cuda" else SMOKE,
                "batch_per_gpu": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup}
        with open(args.out, "w") as f:
            json.dump({"regenerate": _results.DISTRIBUTED, "meta": meta, "results": results}, f, indent=1)
    if dist is not None:
        dist.destroy_process_group()


def table(paths: list[str]) -> str:
    rows, meta = [], None
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        meta = meta or d["meta"]
        rows += d["results"]
    base = {r["mode"]: r["tokens_per_s"] for r in rows if r["gpus"] == 1}
    out = [_results.md_line(_results.DISTRIBUTED) + f"Device: {meta['device']}; torch {meta['torch']}, transformers {meta['transformers']}. "
           f"Llama {meta['config']['num_hidden_layers']} layers, hidden {meta['config']['hidden_size']}, vocab "
           f"{meta['config']['vocab_size']}, bf16, {meta['batch_per_gpu']} x {meta['seq']} tokens per GPU, AdamW; "
           f"median of {meta['steps']} steps after {meta['warmup']} warm-up.", "",
           "| GPUs | engine | forward | step ms | tokens/s (global) | tokens/s per GPU | scaling vs 1 GPU | "
           "peak memory per GPU (GiB) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sc = r["tokens_per_s"] / base[r["mode"]] if r["mode"] in base else float("nan")
        out.append(f"| {r['gpus']} | {r['engine']} | {r['mode']} | {r['step_ms_median']:.1f} | "
                   f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_gpu']:,.0f} | {sc:.2f}x | "
                   f"{r['peak_mem_gib_max_rank']:.2f} |")
    hows = sorted({r["how"] for r in rows if r["mode"] == "liger_compat"})
    out += ["", "liger_compat forward: " + "; ".join(hows)]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--table", nargs="+")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU with gloo: checks the script, times nothing")
    args = ap.parse_args()
    if args.table:
        sys.stdout.write(table(args.table))
    else:
        run(args)


if __name__ == "__main__":
    main()
