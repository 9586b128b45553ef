"""Cross-entropy of a linear head whose weight is split over the vocabulary across a process group.

Tensor parallelism shards the LM head by rows (``Shard(0)``): each rank of the group holds rows
``[offset, offset + V_local)`` of the ``[V, H]`` weight and the same (replicated) hidden states.
:func:`vocab_parallel_cross_entropy` computes the loss of the whole head from the shards without
any rank holding ``[N, V]`` logits: each rank computes its shard's logits a block of rows at a time
(``[rows, V_local]`` at most), keeps a few floats a row (its shard's log-sum-exp and maximum,
the target's logit where the target is in its shard, the sum of logits for label smoothing,
whether its shard's argmax is the target), and the group combines them with two all-reduces of
``[N]``-sized tensors. The backward recomputes each block's logits, forms ``softmax - one_hot`` on
the shard with the global log-sum-exp, keeps the weight's gradient local and all-reduces the
hidden states' gradient (each rank's is the part its shard contributes).

Pure torch (matmuls and ``torch.distributed``), so it runs on any device and backend (gloo on
CPU tensors, NCCL on GPUs). The options are those of
:func:`liger_compat.kernels.fused_linear_cross_entropy` and mean the same: a loss computed here
equals that function's on the gathered weight. A target outside ``[0, V)`` that is not
``ignore_index`` raises :class:`TargetOutOfRangeError` where the check needs no host sync (CPU
tensors, or ``LIGER_COMPAT_DEBUG``); elsewhere its row's loss is NaN.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _checks
from .errors import ShapeMismatchError
from .loss import (CEOptions, CrossEntropyOutput, _check_options, _check_target_options, _finish, _nan_if_empty,
                   _reduction_scale, next_token_targets)

__all__ = ["vocab_parallel_cross_entropy"]

#: the largest block of logits a rank forms at once, in elements (fp32: 2 GiB, the rank's whole
#: [N, V / tp] at 8192 tokens of a 128k vocabulary over two ranks): few, large blocks keep the
#: matmuls efficient and the weight gradient's fp32 sums over blocks few
BLOCK_ELEMENTS = 1 << 29


def _block_rows(v_local: int) -> int:
    return max(1, BLOCK_ELEMENTS // max(1, v_local))


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    """One block's fp32 logits (softcapped), computed in place after the matmul."""
    z = (h @ w.t()).float()
    if b is not None:
        z += b.float()
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, offset, vocab, group, ignore_index, smoothing, z_scale, softcap):
        n, v_local = hidden.shape[0], weight.shape[0]
        dev = hidden.device
        local = target - offset
        inside = (local >= 0) & (local < v_local) & (target != ignore_index)
        idx = local.clamp(0, max(v_local - 1, 0)).unsqueeze(1)
        lse_l = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev)  # an empty shard adds nothing
        m_l = torch.full_like(lse_l, float("-inf"))
        zt_l = torch.zeros_like(lse_l)
        sz_l = torch.zeros_like(lse_l)
        hit_l = torch.zeros(n, dtype=torch.bool, device=dev)
        step = _block_rows(v_local)
        for r0 in range(0, n if v_local else 0, step):
            r1 = min(n, r0 + step)
            z = _logits(hidden[r0:r1], weight, bias, softcap)
            lse_l[r0:r1] = torch.logsumexp(z, dim=1)
            m, arg = z.max(dim=1)
            m_l[r0:r1] = m
            zt_l[r0:r1] = torch.where(inside[r0:r1], z.gather(1, idx[r0:r1]).squeeze(1), 0.0)
            if smoothing:
                sz_l[r0:r1] = z.sum(dim=1)
            hit_l[r0:r1] = inside[r0:r1] & (arg == idx[r0:r1].squeeze(1))
            del z
        # one all-reduce of the maxima (each shard's log-sum-exp and its largest logit), one of the sums
        maxima = torch.stack([lse_l, m_l])
        torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX, group=group)
        m_g, top = maxima
        # the argmax is the target where the target's shard holds it and that shard holds the maximum
        packed = torch.stack([torch.exp(lse_l - m_g), zt_l, sz_l, (hit_l & (m_l >= top)).float(), inside.float()])
        torch.distributed.all_reduce(packed, group=group)
        s_g, zt, sz, correct, found = packed
        lse = m_g + torch.log(s_g)
        valid = target != ignore_index
        bad = valid & (found < 0.5)  # in no rank's shard: outside the vocabulary
        rows = (1.0 - smoothing) * (lse - zt)
        if smoothing:
            rows = rows + smoothing * (lse - sz / vocab)
        if z_scale:
            rows = rows + z_scale * lse * lse
        rows = torch.where(valid, rows, 0.0)
        rows = torch.where(bad, float("nan"), rows)
        z_rows = torch.where(valid, z_scale * lse * lse, 0.0)
        ctx.save_for_backward(hidden, weight, bias, target, lse)
        ctx.meta = (offset, vocab, group, ignore_index, smoothing, z_scale, softcap)
        ctx.mark_non_differentiable(z_rows, correct)
        return rows, z_rows, correct > 0.5

    @staticmethod
    def backward(ctx, grad_rows, _gz, _gc):
        hidden, weight, bias, target, lse = ctx.saved_tensors
        offset, vocab, group, ignore_index, smoothing, z_scale, softcap = ctx.meta
        n, v_local = hidden.shape[0], weight.shape[0]
        valid = target != ignore_index
        g = torch.where(valid, grad_rows.float(), 0.0)
        local = target - offset
        inside = (local >= 0) & (local < v_local) & valid
        idx = local.clamp(0, max(v_local - 1, 0)).unsqueeze(1)
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        grad_w = None  # the first block's product; fp32 sums from the second block on
        grad_b = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        step = _block_rows(v_local)
        for r0 in range(0, n if v_local else 0, step):
            r1 = min(n, r0 + step)
            h = hidden[r0:r1]
            z = _logits(h, weight, bias, softcap)
            # d softcap * tanh(x / softcap) / dx = 1 - (z / softcap)^2, from the capped logits
            cap = (z / softcap).square_().neg_().add_(1.0) if softcap is not None else None
            dz = z.sub_(lse[r0:r1].unsqueeze(1)).exp_()  # the softmax, in place of the logits
            if z_scale:
                dz.mul_((1.0 + 2.0 * z_scale * lse[r0:r1]).unsqueeze(1))
            if smoothing:
                dz.sub_(smoothing / vocab)
            dz.scatter_add_(1, idx[r0:r1], torch.where(inside[r0:r1], -(1.0 - smoothing), 0.0).unsqueeze(1))
            dz.mul_(g[r0:r1].unsqueeze(1))
            if cap is not None:
                dz.mul_(cap)
                del cap
            if grad_b is not None:
                grad_b += dz.sum(dim=0)
            # the two matmuls in the inputs' dtype (tensor cores for bf16 / fp16, as native's
            # backward of its logits); the weight's gradient summed over blocks in fp32
            dz = dz.to(hidden.dtype)
            grad_h[r0:r1] = dz @ weight
            part = dz.t() @ h
            if grad_w is None:
                grad_w = part
            elif grad_w.dtype != torch.float32:
                grad_w = grad_w.float().add_(part)
            else:
                grad_w.add_(part)
        if grad_w is None:  # an empty shard
            grad_h.zero_()
            grad_w = torch.zeros_like(weight)
        # every rank's hidden states are the same tensor; each contributed its shard's part
        torch.distributed.all_reduce(grad_h, group=group)
        return (grad_h, grad_w.to(weight.dtype), None if grad_b is None else grad_b.to(bias.dtype),
                None, None, None, None, None, None, None, None)


def vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_offset: int,
    vocab_size: int,
    group: Any = None,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    return_token_accuracy: bool = False,
    return_z_loss: bool = False,
    shift_target: bool = False,
    empty_mean: str = "zero",
):
    """The fused linear cross-entropy of a head split over the vocabulary across ``group``.

    ``weight`` is this rank's ``[V_local, H]`` rows of the ``[vocab_size, H]`` weight, starting
    at row ``vocab_offset`` (``bias`` the matching ``[V_local]``); ``hidden`` ``[..., H]`` and
    ``target`` (class ids of the whole vocabulary) are the same on every rank of ``group``. Every
    rank returns the same loss; the weight's gradient is this rank's rows, the hidden states'
    gradient is the whole head's. Options as :func:`~liger_compat.kernels.fused_linear_cross_entropy`
    (``shift_target`` and ``empty_mean`` included).
    """
    _checks.tensor("hidden", hidden)
    _checks.tensor("weight", weight)
    _checks.float_dtype("hidden", hidden)
    _checks.float_dtype("weight", weight)
    _check_options(label_smoothing, lse_square_scale, softcap, reduction, num_items_in_batch)
    _check_target_options(target, hidden.shape[:-1], "hidden", shift_target, empty_mean)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ShapeMismatchError(f"weight has shape {tuple(weight.shape)} but hidden's last dimension is "
                                 f"{hidden.shape[-1]}")
    if not (0 <= vocab_offset and vocab_offset + weight.shape[0] <= vocab_size):
        raise ShapeMismatchError(f"rows [{vocab_offset}, {vocab_offset + weight.shape[0]}) of the weight do not fit "
                                 f"a vocabulary of {vocab_size}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ShapeMismatchError(f"bias has shape {tuple(bias.shape)}, the weight's shard {weight.shape[0]} rows")
    _checks.target_range("target", target[..., 1:] if shift_target else target, vocab_size, ignore_index)
    h = hidden.reshape(-1, hidden.shape[-1])
    t = (next_token_targets(target, int(ignore_index)) if shift_target else target.reshape(-1))
    t = t.to(device=h.device, dtype=torch.long)
    if weight.dtype != h.dtype:
        weight = weight.to(h.dtype)
    if bias is not None and bias.dtype != h.dtype:
        bias = bias.to(h.dtype)

    rows, z_rows, correct = _VocabParallelCE.apply(
        h, weight, bias, t, int(vocab_offset), int(vocab_size), group, int(ignore_index), float(label_smoothing),
        float(lse_square_scale), None if softcap is None else float(softcap))
    # ``correct`` is False on ignored rows: the accuracy is over the labelled ones, as the fused loss's
    n_valid, scale = _reduction_scale(t, CEOptions(ignore_index=int(ignore_index)), reduction, num_items_in_batch,
                                      h.device)
    loss, z, acc = _finish(rows, z_rows, correct, n_valid, scale, reduction, target.shape, return_z_loss,
                           return_token_accuracy)
    if empty_mean == "nan" and reduction == "mean" and num_items_in_batch is None:
        loss = _nan_if_empty(loss, n_valid)
    if return_token_accuracy or return_z_loss:
        return CrossEntropyOutput(loss, z, acc)
    return loss
