"""Helpers of the model-shim tests: tiny random models of each family, native references.

Everything runs on CPU against whatever transformers is installed; a family the installed release
lacks is skipped with the reason. ``native()`` reverts every liger_compat patch for the duration
of a block, so a test compares the patched model with the very same weights unpatched.
"""

from __future__ import annotations

import pytest
import torch

from liger_compat.compat import tiny_vlms
from liger_compat.compat.families import BY_NAME, FAMILIES
from liger_compat.compat.tiny_models import FamilyUnavailable, build
from patch_helpers import CORE_FAMILIES, native  # noqa: F401  (re-exported to the model tests)

FAMILY_NAMES = [f.name for f in FAMILIES if f.name in CORE_FAMILIES]


class LlamaStyleRMSNorm(torch.nn.Module):
    """A remote-code style Llama RMSNorm, in no transformers modeling module. Subclasses name it."""

    def __init__(self, h):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(h))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(x.dtype)


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




def module_kernel_entry(name: str):
    """``(owner, attribute)``: where the module shims reach the kernel ``name``: the unchecked entries
    they call after running the kernels' argument checks themselves."""
    from liger_compat import kernels

    if name == "rms_norm":
        return kernels.norm, "rms_norm_checked"
    if name == "gated_project":
        return kernels.gated_mlp, "gated_project_checked"
    if name == "apply_rotary_pos_emb":
        return kernels.rope, "apply_checked"
    return kernels, name


#: the module kernels the shims reach (:func:`module_kernel_entry`)
MODULE_KERNELS = ("rms_norm", "gated_project", "apply_rotary_pos_emb")


class KernelCalls:
    """Counts the calls of the module kernels the shims reach (:data:`MODULE_KERNELS`), in ``n``."""

    def __init__(self, monkeypatch):
        self.n = dict.fromkeys(MODULE_KERNELS, 0)
        for name in MODULE_KERNELS:
            owner, attr = module_kernel_entry(name)

            def spy(*a, _real=getattr(owner, attr), _name=name, **k):
                self.n[_name] += 1
                return _real(*a, **k)

            monkeypatch.setattr(owner, attr, spy)

    def total(self) -> int:
        return sum(self.n[k] for k in MODULE_KERNELS)

    def reset(self) -> None:
        for k in self.n:
            self.n[k] = 0


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


def family_model_and_batch(family: str, seed: int):
    """The family's tiny model (train mode), the forward's inputs, the labels and the unpatched
    model's output on them. The tiny configs are written against transformers 5.23; where the
    unpatched model itself cannot be built or run on them (an older release with other config
    fields), the family is skipped with that error."""
    try:
        model = tiny(family)
        if BY_NAME[family].vision:
            kw, labels = tiny_vlms.inputs(model, seed=seed)
        else:
            ids, labels = random_batch(model, seed=seed)
            kw = dict(input_ids=ids)
        with native(), torch.no_grad():
            ref = model(**kw, labels=labels)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, RuntimeError) as exc:
        pytest.skip(f"the unpatched {family} model does not run on its tiny config here: {type(exc).__name__}: {exc}")
    return model, kw, labels, ref
