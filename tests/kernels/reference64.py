"""Independent float64 references for the kernel tests (plain torch ops, autograd for gradients).

Written from the formulas in the issue, not from liger_compat's own reference code, so a test
compares two implementations. Also used by the Triton-interpreter worker subprocess.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


#: absolute scale below which a difference is not judged relative to the reference: a result
#: that underflows in fp16/bf16 (reference 3.7e-10, kernel 0) is right, not 100% wrong
ABS_FLOOR = 1e-6


def rel_err(a: torch.Tensor, b: torch.Tensor, unit: float = 0.0) -> float:
    """``|a - b| / |b|`` (norms). ``unit``: a larger denominator where ``b`` is a sum or difference
    of larger terms (their magnitudes' norm), so that cancellation in ``b`` is not charged to ``a``."""
    # below the smallest normal number of ``a``'s dtype the spacing of representable values is
    # fixed (fp16: 6e-8 under 6.1e-5), so values that small are compared in absolute terms
    floor = max(ABS_FLOOR, torch.finfo(a.dtype).tiny if a.is_floating_point() else 0.0)
    a, b = a.double(), b.double()
    den = max(b.norm().item(), unit, floor * max(b.numel(), 1) ** 0.5)
    num = (a - b).norm().item()
    return num / den


def ce64(logits, target, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
         lse_square_scale=0.0, softcap=None, num_items_in_batch=None):
    """Returns (loss, z_loss, token_accuracy) in float64 from float64 logits [N, V]."""
    z = logits
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    nll = F.cross_entropy(z, target.long(), ignore_index=ignore_index, reduction="none",
                          label_smoothing=label_smoothing)
    valid = target != ignore_index
    lse = torch.logsumexp(z, dim=-1)
    zl = torch.where(valid, lse_square_scale * lse * lse, torch.zeros_like(lse))
    rows = nll + zl
    n = valid.sum()
    correct = ((z.argmax(-1) == target) & valid).double()
    if reduction == "none":
        return rows, zl, correct
    if num_items_in_batch is not None:
        d = float(num_items_in_batch)
    elif reduction == "mean":
        d = max(int(n), 1)
    else:
        d = 1.0
    return rows.sum() / d, zl.sum() / d, correct.sum() / max(int(n), 1)


def rms_norm64(x, w, eps, offset=0.0):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.double())


def swiglu64(a, b):
    a = a.double()
    return a * torch.sigmoid(a) * b.double()


def geglu64(a, b):
    a = a.double()
    return 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3))) * b.double()


def rope64(x, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim).double()
    sin = sin.unsqueeze(unsqueeze_dim).double()
    rot = cos.shape[-1]
    xr, xp = x[..., :rot].double(), x[..., rot:].double()
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((xr * cos + rotated * sin, xp), dim=-1)


def ce_units(logits, target, *, ignore_index=-100, reduction="mean", lse_square_scale=0.0, softcap=None,
             num_items_in_batch=None, **_):
    """The size of the terms that :func:`ce64`'s loss and z-loss subtract, as ``(loss, z_loss)``
    denominators for :func:`rel_err`'s ``unit``.

    A row's loss ``lse - z[target]`` (smoothing: ``lse - mean(z)``) cancels when the row is
    confident: 2e-4 from logits of 8, where a rounding of the logits by ``eps * 8`` is the whole
    error. Each term is at most ``|lse| + max|z|``; the z-loss ``s * lse^2`` moves by ``2 s |lse|``
    times that. Reduced as ``ce64`` reduces its rows.
    """
    z = logits.detach().double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = (target != ignore_index).double()
    lse = torch.logsumexp(z, dim=-1)
    row = (lse.abs() + z.abs().amax(-1)) * valid
    zrow = 2 * lse_square_scale * lse.abs() * row
    if reduction == "none":
        return row.norm().item(), zrow.norm().item()
    if num_items_in_batch is not None:
        d = float(num_items_in_batch)
    elif reduction == "mean":
        d = max(int(valid.sum()), 1)
    else:
        d = 1.0
    return row.sum().item() / d, zrow.sum().item() / d


def ce_grad_terms(logits, target, gout, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                  lse_square_scale=0.0, softcap=None, num_items_in_batch=None):
    """``[N, V]`` magnitudes of the terms of d(loss * gout)/d logits, ``c * (p + y + 2 s |lse| p)``
    for softmax ``p``, (smoothed) one-hot ``y`` and the row's scale ``c``: where ``p ~ y`` the
    gradient ``p - y`` cancels (a confident row: 1e-8 from terms of 1), and an error relative to
    it measures that, not the kernel. The soft-cap's factor ``1 - tanh^2`` is at most 1."""
    z = logits.detach().double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    v = z.shape[-1]
    valid = target != ignore_index
    p = torch.softmax(z, -1)
    y = torch.zeros_like(z)
    y[valid] = F.one_hot(target[valid].long(), v).double() * (1 - label_smoothing)
    y = (y + label_smoothing / v) * valid[:, None]
    lse = torch.logsumexp(z, -1, keepdim=True)
    terms = (p * (1 + 2 * lse_square_scale * lse.abs()) + y) * valid[:, None]
    c = torch.as_tensor(gout, dtype=torch.float64).abs()
    c = c[:, None] if c.dim() == 1 else c
    if reduction != "none":
        if num_items_in_batch is not None:
            c = c / float(num_items_in_batch)
        elif reduction == "mean":
            c = c / max(int(valid.sum()), 1)
    return terms * c


def logprobs64(hidden, weight, bias, target, *, temperature=1.0, softcap=None, logit_scale=1.0, ignore_index=-100):
    """Per-row fields of the log-prob head in float64 from the inputs (differentiable):
    ``(log_probs, entropy, is_top1, log_sum_sq_probs, mean_logits)``, zeros on ignored rows."""
    x = hidden.double() @ weight.double().T
    if bias is not None:
        x = x + bias.double()
    x = x * logit_scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    z = x / temperature
    logp = torch.log_softmax(z, dim=-1)
    valid = target != ignore_index
    tgt = torch.where(valid, target, torch.zeros_like(target))
    zero = torch.zeros((), dtype=torch.float64)
    lp = torch.where(valid, logp.gather(1, tgt[:, None]).squeeze(1), zero)
    ent = torch.where(valid, -(logp.exp() * logp).sum(-1), zero)
    top1 = valid & (z.argmax(-1) == tgt)
    sq = torch.where(valid, torch.log((logp.exp() ** 2).sum(-1)), zero)
    mean = torch.where(valid, z.mean(-1), zero)
    return lp, ent, top1, sq, mean
