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

Tensor parallelism (``--engines tp,fsdp2_tp,tp_trainer``): the model is saved once and loaded with
transformers' own ``from_pretrained(..., tp_plan="auto")`` (``tp``: every rank one tensor-parallel
group; ``fsdp2_tp``: a (dp, tp) mesh with tp 2, the loaded model then ``fully_shard``-ed over dp), so
``lm_head`` is a vocabulary-sharded DTensor and liger_compat takes its vocabulary-parallel loss.
The ranks of a tensor-parallel group share a batch, so the global batch is dp x batch x seq.
``tp_trainer`` is the ``tp`` model under ``transformers.Trainer`` (accelerate's tensor parallelism),
timed between its step callbacks. ``--hidden/--layers/--intermediate`` set the model (Llama-3-8B's
head is hidden 4096, vocab 128256).
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


TP_ENGINES = ("tp", "fsdp2_tp", "tp_trainer")


def model_config(device, args) -> dict:
    cfg = dict(SMOKE if device.type == "cpu" else CONFIG)
    for key, arg in (("hidden_size", args.hidden), ("num_hidden_layers", args.layers),
                     ("intermediate_size", args.intermediate)):
        if arg:
            cfg[key] = arg
    return cfg


def save_for_tp(device, args, dist) -> str:
    """Rank 0 writes the model once (bf16, seed 0); every engine of tensor parallelism loads it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(args.model_dir, "llama")
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**model_config(device, args))).to(torch.bfloat16).save_pretrained(path)
    dist.barrier()
    return path


def fsdp_tp_via(args) -> str:
    """How FSDP2 x TP is built: ``DistributedConfig(tp_size, fsdp_size)`` where transformers builds both
    dimensions itself (5.18 on: 5.17's builds an fsdp-only mesh and fails natively, "Cannot slice a
    DeviceMesh without mesh_dim_names"), else a 2-D mesh passed as ``device_mesh``."""
    if args.fsdp_tp_via:
        return args.fsdp_tp_via
    from packaging.version import Version
    import transformers

    return "config" if Version(transformers.__version__) >= Version("5.18") else "mesh"


def build_tp(mode: str, engine: str, device, liger_compat, args, dist):
    import torch
    from transformers import LlamaForCausalLM

    liger_compat.configure(enabled=(mode == "liger_compat"))
    path = save_for_tp(device, args, dist)
    kwargs = dict(tp_plan="auto", dtype=torch.bfloat16, attn_implementation="sdpa")
    mesh = None
    dist_config = None
    if engine == "fsdp2_tp":
        if fsdp_tp_via(args) == "config":  # transformers' own FSDP2 x TP
            from transformers.distributed import DistributedConfig

            dist_config = DistributedConfig(tp_size=2, fsdp_size=dist.get_world_size() // 2)
            kwargs = dict(distributed_config=dist_config, dtype=torch.bfloat16, attn_implementation="sdpa")
        else:  # a (dp, tp) mesh: transformers shards over its "tp" dimension, fully_shard over "dp"
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
            kwargs["device_mesh"] = mesh
    model = LlamaForCausalLM.from_pretrained(path, **kwargs).train()
    how = "native"
    if mode == "liger_compat":
        liger_compat.apply(model)
        how = "liger_compat.apply(model)"
    dp, dp_rank = 1, 0
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    elif dist_config is not None:
        head_mesh = model.lm_head.weight.device_mesh
        dp, dp_rank = head_mesh["fsdp"].size(), head_mesh.get_local_rank("fsdp")
    return model, how, dp, dp_rank


def build(mode: str, engine: str, device, liger_compat, args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    liger_compat.configure(enabled=(mode == "liger_compat"))
    cfg = LlamaConfig(**model_config(device, args))
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


def trainer_steps(model, device, args, batches):
    """``transformers.Trainer`` over the tensor-parallel model: step times from its callbacks."""
    import tempfile

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    rows = [{"input_ids": b[i], "labels": b[i]} for b in batches for i in range(b.shape[0])]
    n = args.warmup + args.steps
    data = [rows[i % len(rows)] for i in range(n * args.batch)]
    times, starts = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            _sync(device)
            starts.append(time.perf_counter())

        def on_step_end(self, a, state, control, **kw):
            _sync(device)
            times.append(time.perf_counter() - starts[-1])
            if state.global_step == args.warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)

    with tempfile.TemporaryDirectory() as tmp:
        targs = TrainingArguments(output_dir=tmp, per_device_train_batch_size=args.batch, max_steps=n,
                                  learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to=[],
                                  bf16=device.type == "cuda", use_cpu=device.type == "cpu",
                                  dataloader_pin_memory=False)
        trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[Clock()])
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return times[args.warmup:], losses


def measure(mode, engine, device, world, rank, args, liger_compat, dist):
    import torch

    cuda = device.type == "cuda"
    vocab = model_config(device, args)["vocab_size"]
    dp, dp_rank = world, rank
    if engine in TP_ENGINES:
        from liger_compat.shims import _sharded_head

        _sharded_head.tensor_parallel_calls = 0
        model, how, dp, dp_rank = build_tp(mode, engine, device, liger_compat, args, dist)
    else:
        model, how = build(mode, engine, device, liger_compat, args)
    g = torch.Generator(device=device).manual_seed(1000 + dp_rank)  # a tensor-parallel group shares its batch
    batches = [torch.randint(0, vocab, (args.batch, args.seq), device=device, generator=g)
               for _ in range(2)]
    losses = []
    if engine == "tp_trainer":
        times, losses = trainer_steps(model, device, args, batches)
        opt = None
    else:
        # tp_plan="auto" leaves some parameters plain tensors: foreach cannot mix them with DTensors
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=engine not in TP_ENGINES)
        for i in range(args.warmup):
            losses.append(float(step_fn(model, opt, batches[i % 2]).detach()))
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
            losses.append(float(loss.detach()))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    stats = torch.tensor([max(times), peak], device=device)
    if dist is not None:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        t_med = torch.tensor(sorted(times)[len(times) // 2], device=device)
        dist.all_reduce(t_med, op=dist.ReduceOp.MAX)
        med = float(t_med)
    else:
        med = sorted(times)[len(times) // 2]
    tokens = dp * args.batch * args.seq
    res = {"mode": mode, "engine": engine, "gpus": world, "how": how, "step_ms_median": med * 1e3,
           "tokens_per_s": tokens / med, "tokens_per_s_per_gpu": tokens / med / world,
           "peak_mem_gib_max_rank": float(stats[1]), "final_loss": losses[-1] if losses else float("nan"),
           "losses": losses, "config": model_config(device, args)}
    if engine in TP_ENGINES:
        res["tensor_parallel"] = tp_route(model)
    del model, opt, batches
    if cuda:
        torch.cuda.empty_cache()
    return res


def tp_route(model) -> dict:
    """The head's placement and whether liger_compat's vocabulary-parallel loss ran (its call count)."""
    from liger_compat.shims import _sharded_head as sd

    w = model.lm_head.weight
    return {"head_placements": [str(p) for p in getattr(w, "placements", ())],
            "vocabulary_parallel_calls": int(getattr(sd, "tensor_parallel_calls", 0))}


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
    engines = args.engines.split(",") if args.engines else (["single"] if world == 1 else ["ddp", "fsdp2"])
    results = []
    for engine in engines:
        for mode in ("native", "liger_compat"):
            try:
                r = measure(mode, engine, device, world, rank, args, liger_compat, dist)
            except Exception as exc:  # one engine's failure is a result; the others still run
                r = {"mode": mode, "engine": engine, "gpus": world, "error": f"{type(exc).__name__}: {exc}"[:600]}
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if rank == 0:
                print(json.dumps(r), flush=True)
            results.append(r)
    if rank == 0:
        meta = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (smoke run)", "torch": torch.__version__,
                "transformers": __import__("transformers").__version__,
                "config": model_config(device, args),
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
           "speed vs native (same GPUs and engine) | peak memory per GPU (GiB) |",
           "|---|---|---|---|---|---|---|---|---|"]
    errors = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    native = {(r["gpus"], r["engine"]): r["tokens_per_s"] for r in rows if r["mode"] == "native"}
    for r in rows:
        sc = f"{r['tokens_per_s'] / base[r['mode']]:.2f}x" if r["mode"] in base else "-"
        vs = native.get((r["gpus"], r["engine"]))
        vs = f"{r['tokens_per_s'] / vs:.2f}x" if vs else "-"
        out.append(f"| {r['gpus']} | {r['engine']} | {r['mode']} | {r['step_ms_median']:.1f} | "
                   f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_gpu']:,.0f} | {sc} | {vs} | "
                   f"{r['peak_mem_gib_max_rank']:.2f} |")
    hows = sorted({r["how"] for r in rows if r["mode"] == "liger_compat"})
    out += ["", "liger_compat forward: " + "; ".join(hows)]
    tp = [r for r in rows if "tensor_parallel" in r]
    if tp:
        out += ["", "Tensor parallelism (model per row; losses of every step, native beside liger_compat):", "",
                "| GPUs | engine | forward | model | head placements | vocabulary-parallel loss calls | losses |",
                "|---|---|---|---|---|---|---|"]
        for r in tp:
            c = r["config"]
            out.append(f"| {r['gpus']} | {r['engine']} | {r['mode']} | {c['num_hidden_layers']} layers, hidden "
                       f"{c['hidden_size']}, vocab {c['vocab_size']} | {', '.join(r['tensor_parallel']['head_placements'])} "
                       f"| {r['tensor_parallel']['vocabulary_parallel_calls']} | "
                       f"{', '.join(f'{x:.4f}' for x in r['losses'])} |")
    for r in errors:
        out += ["", f"{r['gpus']} GPUs, {r['engine']}, {r['mode']}: failed: `{r['error']}`"]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--table", nargs="+")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--engines", help="comma-separated: single, ddp, fsdp2, tp, fsdp2_tp, tp_trainer "
                    "(default: single on one process, ddp,fsdp2 on several)")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--fsdp-tp-via", choices=("config", "mesh"), help="how fsdp2_tp is built (default: by the "
                    "transformers release, see fsdp_tp_via)")
    ap.add_argument("--model-dir", default="/tmp/liger_compat_tp_model", help="where the tensor-parallel engines' "
                    "model is saved once")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU with gloo: checks the script, times nothing")
    args = ap.parse_args()
    if args.table:
        sys.stdout.write(table(args.table))
    else:
        run(args)


if __name__ == "__main__":
    main()
