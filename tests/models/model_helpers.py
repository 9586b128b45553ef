"""Helpers of the model-shim tests: tiny random models of each family, native references.

Everything runs on CPU against whatever transformers is installed; a family the installed release
lacks is skipped with the reason. ``native()`` reverts every liger_compat patch for the duration
of a block, so a test compares the patched model with the very same weights unpatched.
"""

from __future__ import annotations

import pytest
import torch

from liger_compat.compat.families import FAMILIES
from liger_compat.compat.tiny_models import FamilyUnavailable, build
from patch_helpers import CORE_FAMILIES, native  # noqa: F401  (re-exported to the model tests)

FAMILY_NAMES = [f.name for f in FAMILIES if f.name in CORE_FAMILIES]


class GatedMLP(torch.nn.Module):
    """A gated MLP outside the families (as remote code defines one): ``down(silu(gate(x)) * up(x))``.
    Subclasses name it (the module shims match classes whose name ends in ``MLP``)."""

    def __init__(self, h, i):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(h, i), torch.nn.Linear(h, i)
        self.down_proj = torch.nn.Linear(i, h)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))




def tiny(family: str, **kw):
    """The family's tiny model in train mode, where a forward with labels takes the fused loss
    (the configs have no dropout, so train and eval mode compute the same numbers); ``.eval()`` it
    to test what evaluation and prediction get."""
    try:
        return build(family, **kw).train()
    except FamilyUnavailable as exc:
        pytest.skip(str(exc))


def random_batch(model, b: int = 2, t: int = 12, seed: int = 0, ignore_frac: float = 0.25):
    g = torch.Generator().manual_seed(seed)
    v = model.config.vocab_size
    ids = torch.randint(3, v, (b, t), generator=g)
    labels = ids.clone()
    labels[torch.rand(b, t, generator=g) < ignore_frac] = -100
    return ids, labels


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def manual_loss(logits, labels, *, ignore_index=-100, num_items=None, shift_labels=None):
    """transformers' causal-LM loss written out: shift, fp32 cross-entropy, mean or sum / n."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat = logits.float().reshape(-1, logits.shape[-1])
    t = shift_labels.reshape(-1)
    if num_items is None:
        return torch.nn.functional.cross_entropy(flat, t, ignore_index=ignore_index)
    return torch.nn.functional.cross_entropy(flat, t, ignore_index=ignore_index, reduction="sum") / num_items


def manual_accuracy(logits, labels, ignore_index=-100):
    shift = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    valid = shift != ignore_index
    return ((logits.argmax(-1) == shift) & valid).sum().float() / valid.sum().float()


__all__ = ["CORE_FAMILIES", "FAMILY_NAMES", "native", "tiny", "random_batch", "grads", "manual_loss", "manual_accuracy"]
