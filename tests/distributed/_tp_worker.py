"""One rank of the tensor-parallel tests (torchrun, gloo on CPU). Not a test module.

``python -m torch.distributed.run --nproc_per_node N _tp_worker.py MODE SEED OUT``:

* ``kernel``: the vocabulary-parallel loss on this rank's rows of a random head against a float64
  reference of the whole head computed in this process (pure torch), for every option; writes the
  largest errors.
* ``fsdp_tp``: the same model on four ranks, FSDP2 x TP (``DistributedConfig(tp_size=2,
  fsdp_size=2)``): losses and final weights.
* ``model``: a tiny Llama saved by the test, loaded with ``from_pretrained(..., tp_plan="auto")``,
  a few SGD steps; writes losses, gradient norms and the final weights (gathered). Under
  ``LIGER_COMPAT_TP_PATCHED=1`` liger_compat is imported first (the kernel path:
  ``LIGER_COMPAT_CPU_NATIVE=0``), else never.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if os.environ.get("LIGER_COMPAT_TP_PATCHED") == "1":
    import liger_compat  # noqa: F401  (first, as a user writes it)

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

sys.path.pop(0)


def _reference(h, w, b, t, *, ignore_index, smoothing, z_scale, softcap, reduction, num_items):
    """float64, pure torch: the loss of the whole head (and, through autograd, its gradients)."""
    z = h @ w.t()
    if b is not None:
        z = z + b
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = t != ignore_index
    lse = torch.logsumexp(z, dim=-1)
    ce = F.cross_entropy(z, t, ignore_index=ignore_index, label_smoothing=smoothing, reduction="none")
    rows = torch.where(valid, ce + z_scale * lse * lse, 0.0)
    # the accuracy as an interval: a row whose target logit is within float32 rounding of its best
    # other logit (the kernel scores in float32) may count either way
    zd, col = z.detach(), t.clamp(min=0).unsqueeze(1)
    zt = zd.gather(1, col).squeeze(1)
    other = zd.scatter(1, col, float("-inf")).amax(-1)
    tie = 1e-5 * zd.abs().amax().clamp(min=1.0)
    count = valid.sum().clamp(min=1)
    acc = (((zt > other + tie) & valid).sum() / count, ((zt >= other - tie) & valid).sum() / count)
    if reduction == "none":
        return rows, acc
    if num_items is not None:
        return rows.sum() / num_items, acc
    if reduction == "mean":
        return rows.sum() / valid.sum().clamp(min=1), acc
    return rows.sum(), acc


CASES = [
    dict(),
    dict(softcap=3.0),
    dict(smoothing=0.1),
    dict(z_scale=1e-3),
    dict(reduction="sum"),
    dict(reduction="none"),
    dict(num_items=37),
    dict(bias=True),
    dict(ignore_index=-1),
    dict(softcap=5.0, smoothing=0.05, z_scale=1e-4, bias=True, num_items=11),
]


def kernel(seed: int, out: Path) -> None:
    from liger_compat.kernels import vocab_parallel, vocab_parallel_cross_entropy

    rank, world = dist.get_rank(), dist.get_world_size()
    errs = []
    for i, case in enumerate(CASES):
        g = torch.Generator().manual_seed(seed * 1000 + i)  # the same inputs on every rank
        n, hdim, vocab = 29, 16, 53 + i  # uneven splits: torch.chunk's rows a rank
        ignore = case.get("ignore_index", -100)
        h = torch.randn(n, hdim, generator=g, dtype=torch.float64) * 2
        w = torch.randn(vocab, hdim, generator=g, dtype=torch.float64)
        b = torch.randn(vocab, generator=g, dtype=torch.float64) if case.get("bias") else None
        t = torch.randint(0, vocab, (n,), generator=g)
        t[torch.rand(n, generator=g) < 0.2] = ignore
        opts = dict(ignore_index=ignore, smoothing=case.get("smoothing", 0.0), z_scale=case.get("z_scale", 0.0),
                    softcap=case.get("softcap"), reduction=case.get("reduction", "mean"),
                    num_items=case.get("num_items"))
        hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
        br = None if b is None else b.clone().requires_grad_()
        ref, ref_acc = _reference(hr, wr, br, t, **opts)
        up = torch.rand(ref.shape, generator=g, dtype=torch.float64) + 0.5  # a non-uniform upstream gradient
        (ref * up).sum().backward()
        rows = -(-vocab // world)
        lo, hi = min(rank * rows, vocab), min((rank + 1) * rows, vocab)
        hs = h.float().clone().requires_grad_()
        ws = w[lo:hi].float().clone().requires_grad_()
        bs = None if b is None else b[lo:hi].float().clone().requires_grad_()
        # odd cases a few rows a block: the loops over blocks of rows, as at real sizes
        vocab_parallel.BLOCK_ELEMENTS = 4 * (vocab // world + 1) if i % 2 else 1 << 24
        res = vocab_parallel_cross_entropy(
            hs, ws, t, vocab_offset=lo, vocab_size=vocab, group=None, bias=bs, ignore_index=ignore,
            reduction=opts["reduction"], label_smoothing=opts["smoothing"], lse_square_scale=opts["z_scale"],
            softcap=opts["softcap"], num_items_in_batch=opts["num_items"], return_token_accuracy=True)
        (res.loss.double() * up).sum().backward()
        e = dict(case=i, loss=float((res.loss.detach().double() - ref.detach()).abs().max()),
                 loss_scale=float(ref.detach().abs().max()),
                 grad_hidden=float((hs.grad.double() - hr.grad).abs().max()),
                 grad_hidden_scale=float(hr.grad.abs().max()),
                 grad_weight=float((ws.grad.double() - wr.grad[lo:hi]).abs().max()) if hi > lo else 0.0,
                 grad_weight_scale=float(wr.grad.abs().max()))
        if bs is not None:
            e["grad_bias"] = float((bs.grad.double() - br.grad[lo:hi]).abs().max()) if hi > lo else 0.0
        if opts["reduction"] != "none":
            lo_acc, hi_acc = (float(a) for a in ref_acc)  # 0 inside [lo_acc, hi_acc]
            got = float(res.token_accuracy)
            e["accuracy"] = max(lo_acc - got, got - hi_acc, 0.0)
        errs.append(e)
    (out / f"kernel{rank}.json").write_text(json.dumps(errs))


class _FullVocabTensors(TorchDispatchMode):
    """Records every op whose output spans the whole vocabulary for every token of the batch (a
    dimension of ``vocab`` and at least ``tokens * vocab`` elements: the ``[N, V]`` logits or their
    gradient), as ``[op, shape]`` into ``found``. The model's parameters are far smaller
    (``V x H`` with ``H`` < ``N``)."""

    def __init__(self, vocab: int, tokens: int, found: list):
        super().__init__()
        self.vocab, self.tokens, self.found = vocab, tokens, found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if (isinstance(t, torch.Tensor) and self.vocab in t.shape
                    and t.numel() >= self.tokens * self.vocab):
                self.found.append([str(func), list(t.shape)])
        return out


def model(seed: int, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    rank = dist.get_rank()
    spec = torch.load(out / "spec.pt", weights_only=False)
    tag = os.environ.get("LIGER_COMPAT_TP_PATCHED", "0")
    try:
        m = AutoModelForCausalLM.from_pretrained(str(out / "tiny"), tp_plan="auto").train()  # loaded in eval mode
    except TypeError as exc:  # before transformers' tensor parallelism
        if "tp_plan" not in str(exc):
            raise
        (out / f"model_{tag}_{rank}.json").write_text(json.dumps(dict(unsupported=f"{type(exc).__name__}: {exc}")))
        return
    head = m.lm_head.weight
    info = dict(placements=[str(p) for p in getattr(head, "placements", ())],
                local_rows=int(head.to_local().shape[0] if hasattr(head, "to_local") else head.shape[0]))
    opt = torch.optim.SGD(m.parameters(), lr=spec["lr"])
    losses, norms = [], []
    if tag == "1":
        from liger_compat import kernels

        kernels.last_backend.clear()  # every kernel the steps below reach records itself here
    vocab = m.config.vocab_size
    logits_like: list[list] = []
    for ids, labels in spec["batches"]:
        opt.zero_grad(set_to_none=True)
        with _FullVocabTensors(vocab, ids.numel(), logits_like):
            o = m(input_ids=ids, labels=labels)
            o.loss.backward()
        losses.append(float(o.loss))
        g = m.lm_head.weight.grad
        norms.append(float(g.full_tensor().norm() if hasattr(g, "full_tensor") else g.norm()))
        opt.step()
    final = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in m.state_dict().items()}
    if os.environ.get("LIGER_COMPAT_TP_PATCHED") == "1":
        from liger_compat.shims import _sharded_head as sd

        info["tensor_parallel_calls"] = sd.tensor_parallel_calls
        info["kernels_run"] = sorted(kernels.last_backend)
        from liger_compat.compat import distributed as cd

        for key, d in (("given", cd.detect(model=m)), ("found", cd.detect())):  # check() with and without the model
            info[key] = dict(engine=d.engine, head=d.head, head_gather=d.head_gather,
                             warnings=[w.code for w in d.warnings])
    info["full_vocab_tensors"] = logits_like[:5]
    (out / f"model_{tag}_{rank}.json").write_text(json.dumps(dict(losses=losses, norms=norms, **info)))
    if rank == 0:
        torch.save(final, out / f"final_{tag}.pt")


def fsdp_tp(seed: int, out: Path) -> None:
    """FSDP2 x TP: transformers' own ``DistributedConfig(tp_size=2, fsdp_size=2)`` on four ranks; the
    two ranks of a tensor-parallel pair take the same half of each batch."""
    from transformers import AutoModelForCausalLM

    rank = dist.get_rank()
    tag = os.environ.get("LIGER_COMPAT_TP_PATCHED", "0")
    try:
        from transformers.distributed import DistributedConfig
    except ImportError as exc:
        (out / f"fsdp_tp_{tag}_{rank}.json").write_text(json.dumps(dict(unsupported=f"{type(exc).__name__}: {exc}")))
        return
    spec = torch.load(out / "spec.pt", weights_only=False)
    m = AutoModelForCausalLM.from_pretrained(str(out / "tiny"),
                                             distributed_config=DistributedConfig(tp_size=2, fsdp_size=2)).train()
    head = m.lm_head.weight
    mesh = head.device_mesh
    dp = mesh.get_local_rank("fsdp")
    opt = torch.optim.SGD(m.parameters(), lr=spec["lr"])
    losses = []
    for ids, labels in spec["batches"]:
        rows = ids.shape[0] // 2
        opt.zero_grad(set_to_none=True)
        o = m(input_ids=ids[dp * rows:(dp + 1) * rows], labels=labels[dp * rows:(dp + 1) * rows])
        o.loss.backward()
        losses.append(float(o.loss))
        opt.step()
    info = dict(losses=losses, placements=[str(p) for p in head.placements], mesh=list(mesh.mesh_dim_names))
    if tag == "1":
        from liger_compat.shims import _sharded_head as sd

        info.update(tensor_parallel_calls=sd.tensor_parallel_calls, engine_calls=sd.engine_calls)
    final = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in m.state_dict().items()}
    (out / f"fsdp_tp_{tag}_{rank}.json").write_text(json.dumps(info))
    if rank == 0:
        torch.save(final, out / f"fsdp_tp_final_{tag}.pt")


if __name__ == "__main__":
    _harness.enable_fault_stacks()
    mode, seed, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo")
    try:
        {"kernel": kernel, "model": model, "fsdp_tp": fsdp_tp}[mode](seed, out)
    finally:
        dist.destroy_process_group()
