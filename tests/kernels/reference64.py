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


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    # below the smallest normal number of ``a``'s dtype the spacing of representable values is
    # fixed (fp16: 6e-8 under 6.1e-5), so values that small are compared in absolute terms
    floor = max(ABS_FLOOR, torch.finfo(a.dtype).tiny if a.is_floating_point() else 0.0)
    a, b = a.double(), b.double()
    den = max(b.norm().item(), floor * max(b.numel(), 1) ** 0.5)
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
