"""Train a tiny Llama a few steps, as one rank of ``torchrun`` or as the single-process reference.

Used by ``test_gloo.py`` (CPU, gloo) and ``test_multi_gpu.py`` (CUDA, NCCL); not a test itself.

    python -m torch.distributed.run --nproc_per_node 2 _worker.py dist --spec S --out O --configs ddp,fsdp2_head
    python _worker.py reference --spec S --out O        # native transformers, never imports liger_compat

Every rank takes its slice of each global batch, counts its label tokens, all-reduces the count
(transformers' ``average_tokens_across_devices``), and calls the model with that global
``num_items_in_batch``, multiplying the loss by the world size as ``Trainer.compute_loss`` does;
the engine averages gradients over ranks. That must equal one process over the global batch.

Configs: ``ddp``; ``fsdp2_head`` (each layer, lm_head and the root are fully_shard units: the
head's weight is a sharded DTensor outside lm_head.forward); ``fsdp2_tied`` (tied embeddings,
layers + root); ``fsdp1_head`` (FSDP1, use_orig_params=False, lm_head its own unit); ``single``
(rank 0 alone, the liger_compat forward without any engine); ``zero3`` / ``zero3_tied``
(DeepSpeed ZeRO-3, every parameter partitioned, SGD through deepspeed.initialize; needs
deepspeed; ``zero3_outside`` computes the loss outside the model's forward, decoder then head,
as trl's fused-loss paths do); ``*_bypass`` (negative
control: the head gathered by hand, outside its hooks; its gradients must come out wrong). ``--forward helper`` runs the loss
through ``liger_compat.shims._sharded_head.fused_head_loss`` from an instance forward (what the
fused forward does once wired); ``--forward patched`` uses ``liger_compat.apply(model)`` (the
model shims' fused forward; on CPU with ``cpu_native`` off, so that the fused loss takes the engine's
route as on the GPU). A config may name its own forward: ``fsdp2_head@patched``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _clean(name: str) -> str:
    for junk in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(junk, "")
    return name[len("module."):] if name.startswith("module.") else name


def build_model(spec, tied: bool, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**spec["config"], tie_word_embeddings=tied)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(spec["state_tied" if tied else "state"], strict=True)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.to(device=device, dtype=torch.float32)


def helper_forward(self, input_ids=None, labels=None, num_items_in_batch=None, **kwargs):
    """A minimal fused CausalLM forward: decoder, then the fused loss through the head helper."""
    import torch
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from liger_compat.shims._sharded_head import fused_head_loss

    hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
    target = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    loss = fused_head_loss(self.lm_head, hidden, target, num_items_in_batch=num_items_in_batch)
    return CausalLMOutputWithPast(loss=loss)


def bypass_forward(self, input_ids=None, labels=None, num_items_in_batch=None, **kwargs):
    """Negative control: the fused loss on ``lm_head.weight`` read in the parent's forward, gathered
    by hand (``full_tensor()``) instead of through lm_head's FSDP2 hooks. The loss is right; the
    head's gradient skips FSDP2's reduce-scatter, so the weights drift from the reference."""
    import torch
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from liger_compat.kernels import fused_linear_cross_entropy

    hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
    target = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    w = self.lm_head.weight
    w = w.full_tensor() if is_dtensor(w) else w
    loss = fused_linear_cross_entropy(hidden, w, target, num_items_in_batch=num_items_in_batch)
    return CausalLMOutputWithPast(loss=loss)


def _is_deepspeed(model) -> bool:
    return any(c.__name__ == "DeepSpeedEngine" for c in type(model).__mro__)


def outside_loss(model, ids, labels, n, *, bypass: bool):
    """The loss computed outside the model's forward, as trl's fused-loss paths do: the decoder
    (``model.model``), then the head. ``bypass`` reads ``lm_head.weight`` directly."""
    import torch

    from liger_compat.kernels import fused_linear_cross_entropy
    from liger_compat.shims._sharded_head import fused_head_loss

    m = model.module if _is_deepspeed(model) else model
    hidden = m.model(input_ids=ids).last_hidden_state
    target = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    if bypass:
        return fused_linear_cross_entropy(hidden, m.lm_head.weight, target, num_items_in_batch=n)
    return fused_head_loss(m.lm_head, hidden, target, num_items_in_batch=n)


def train(model, spec, *, rank: int, world: int, device, collect_grads: bool = True, dist=None,
          outside: str | None = None):
    """SGD steps over the spec's global batches; this rank's rows; returns losses, step-1 grads.

    A DeepSpeed engine brings its own optimizer (SGD, given to deepspeed.initialize) and steps
    through ``engine.backward`` / ``engine.step``. ``outside`` ("helper" / "bypass") computes the
    loss with :func:`outside_loss` instead of calling the model."""
    import torch

    ds = _is_deepspeed(model)
    opt = None if ds else torch.optim.SGD(model.parameters(), lr=spec["lr"])
    losses, grads = [], None
    for step, (ids, labels) in enumerate(spec["batches"]):
        rows = ids.shape[0] // world
        ids_r = ids[rank * rows:(rank + 1) * rows].to(device)
        lab_r = labels[rank * rows:(rank + 1) * rows].to(device)
        n = (lab_r[:, 1:] != -100).sum()
        if dist is not None and world > 1:
            dist.all_reduce(n)
        if outside:
            loss = outside_loss(model, ids_r, lab_r, n, bypass=outside == "bypass") * world
        else:
            loss = model(input_ids=ids_r, labels=lab_r, num_items_in_batch=n).loss * world
        if ds:
            model.backward(loss)
            if step == 0 and collect_grads:
                grads = zero3_full_grads(model)
            model.step()
        else:
            loss.backward()
            if step == 0 and collect_grads:
                grads = full_grads(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
        logged = loss.detach().clone()
        if dist is not None and world > 1:
            dist.all_reduce(logged)
        losses.append(float(logged) / world)
    return losses, grads


def is_dtensor(t) -> bool:  # local: the reference process must not import liger_compat
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def full_grads(model):
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if is_dtensor(p.grad) else p.grad
        out[_clean(name)] = g.detach().float().cpu()
    return out


def zero3_full_grads(engine):
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for name, p in engine.module.named_parameters():
        g = safe_get_full_grad(p)
        if g is not None:
            out[_clean(name)] = g.detach().float().cpu().reshape(p.ds_shape)
    return out


def full_state(model, engine: str):
    if engine.startswith("zero3"):
        import deepspeed

        module = model.module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {_clean(k): v.detach().float().cpu().clone() for k, v in module.state_dict(keep_vars=True).items()}
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType

        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True)):
            sd = model.state_dict()
    else:
        sd = model.state_dict()
    return {_clean(k): (v.full_tensor() if is_dtensor(v) else v).detach().float().cpu() for k, v in sd.items()}


def wrap(model, engine: str, device, spec=None):
    import torch

    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if engine in ("fsdp2_head", "fsdp2_tied", "fsdp2_head_bypass"):
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        if engine in ("fsdp2_head", "fsdp2_head_bypass"):
            fully_shard(model.lm_head)
        fully_shard(model)
        return model
    if engine.startswith("zero3"):
        import deepspeed

        rows = spec["batches"][0][0].shape[0] // spec["world_size"]
        config = {
            "train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1,
            # partition every parameter, however small (the default keeps small ones whole)
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
            "gradient_clipping": 0.0, "steps_per_print": 10**9,
        }
        opt = torch.optim.SGD(model.parameters(), lr=spec["lr"])
        ds_engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        return ds_engine
    if engine == "fsdp1_head":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        kw = dict(use_orig_params=False, device_id=device if device.type == "cuda" else None)
        model.lm_head = FSDP(model.lm_head, **kw)
        return FSDP(model, **kw)
    raise ValueError(f"unknown engine {engine!r}")


def run_dist(args) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import liger_compat
    from liger_compat.compat import distributed as cdist
    from liger_compat.shims import _sharded_head as sd

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    # a short timeout: a rank that fails alone must end the run, not hang it
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=90))
    spec = torch.load(args.spec, weights_only=False)
    results = {"world_size": world, "backend": dist.get_backend()}
    for config in args.configs.split(","):
        engine, _, forward = config.partition("@")
        forward = forward or args.forward
        if engine.endswith("_bypass"):
            forward = "bypass"
        t0 = time.perf_counter()
        if engine == "single":  # rank 0 alone, no engine, full global batch
            if rank == 0:
                model = build_model(spec, False, device)
                _install_forward(model, forward, liger_compat)
                losses, grads = train(model, spec, rank=0, world=1, device=device)
                results[config] = {"losses": losses, "grads": grads, "state": full_state(model, "none"),
                                   "checks": {"forward": forward}}
            dist.barrier()
            continue
        model = build_model(spec, engine.endswith("_tied"), device)
        _install_forward(model, forward, liger_compat)
        wrapped = wrap(model, engine, device, spec)
        info = cdist.detect(wrapped)
        head = model.lm_head
        checks = {"forward": forward, "engine": info.engine, "head": info.head, "world_size": info.world_size,
                  "warnings": [w.code for w in info.warnings], "wired": sd.wired(),
                  "head_sharding": sd.head_sharding(head),
                  "head_weight_is_dtensor_outside_forward": sd.is_dtensor(sd.head_module(head).weight),
                  "head_weight_numel_outside_forward": sd.head_module(head).weight.numel()}
        if engine.startswith(("fsdp2", "zero3")):
            with torch.no_grad(), sd.head_weight(head) as (w, _b):
                checks["head_weight_full_shape"] = list(w.shape)
            checks["head_resharded_after_read"] = sd.is_dtensor(sd.head_module(head).weight) == \
                checks["head_weight_is_dtensor_outside_forward"]
        calls0 = sd.engine_calls
        try:
            losses, grads = train(wrapped, spec, rank=rank, world=world, device=device,
                                  collect_grads=engine != "fsdp1_head", dist=dist,
                                  outside=("bypass" if engine.endswith("_bypass") else "helper")
                                  if "_outside" in engine else None)
            state = full_state(wrapped, "fsdp1" if engine == "fsdp1_head" else engine)
            if engine.startswith("zero3"):
                checks["head_partitioned_after_training"] = sd.head_module(head).weight.numel() == 0
        except Exception as exc:  # recorded: the test decides whether this config may fail
            if not args.allow_errors:
                raise
            results[config] = {"error": f"{type(exc).__name__}: {exc}"[:500], "checks": checks}
            del wrapped, model
            dist.barrier()
            continue
        checks["engine_route_calls"] = sd.engine_calls - calls0
        if rank == 0:
            results[config] = {"losses": losses, "grads": grads, "state": state, "checks": checks,
                               "seconds": time.perf_counter() - t0}
        del wrapped, model
        dist.barrier()
    if rank == 0:
        torch.save(results, args.out)
    dist.destroy_process_group()


def _install_forward(model, forward: str, liger_compat) -> None:
    import types

    if forward == "helper":
        model.forward = types.MethodType(helper_forward, model)
    elif forward == "bypass":
        model.forward = types.MethodType(bypass_forward, model)
    elif forward == "patched":
        liger_compat.apply(model)
        # the fused loss through the engine's route, as on the GPU: by default CPU tensors compute the
        # loss as the native head does (lm_head's own call), which needs no route of its own
        liger_compat.configure(cpu_native=False)
    else:
        raise ValueError(forward)


def run_reference(args) -> None:
    """Native transformers, one process, the whole global batch; liger_compat is never imported."""
    assert "liger_compat" not in sys.modules
    import torch

    device = torch.device(args.device if args.device == "cpu" else "cuda:0")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    spec = torch.load(args.spec, weights_only=False)
    out = {}
    for tied in (False, True):
        model = build_model(spec, tied, device)
        losses, grads = train(model, spec, rank=0, world=1, device=device)
        state = full_state(model, "none")
        init = spec["state_tied" if tied else "state"]
        moved = max(float((state[k] - init[k].float()).abs().max()) for k in state)
        out["tied" if tied else "untied"] = {"losses": losses, "grads": grads, "state": state, "moved": moved}
    # what per-rank mean losses would log without num_items_in_batch: must differ, or the data
    # would not tell a right normalisation from a wrong one
    model = build_model(spec, False, device)
    ids, labels = spec["batches"][0]
    world = spec["world_size"]
    rows = ids.shape[0] // world
    with torch.no_grad():
        per_rank = [float(model(input_ids=ids[r * rows:(r + 1) * rows].to(device),
                                labels=labels[r * rows:(r + 1) * rows].to(device)).loss) for r in range(world)]
    out["naive_step0_loss"] = sum(per_rank) / world
    assert "liger_compat" not in sys.modules
    torch.save(out, args.out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["dist", "reference"])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--configs", default="ddp,fsdp2_head,fsdp2_tied,fsdp1_head,single")
    ap.add_argument("--forward", default="helper", choices=["helper", "patched"],
                    help="default forward; a config may name its own as config@forward")
    ap.add_argument("--allow-errors", action="store_true", help="record a config's exception instead of failing")
    args = ap.parse_args()
    from _harness import enable_fault_stacks  # this script's folder is first on sys.path

    enable_fault_stacks()
    if args.mode == "reference":
        os.environ["LIGER_COMPAT_DISABLE"] = "1"
        run_reference(args)
    else:
        run_dist(args)


if __name__ == "__main__":
    main()
