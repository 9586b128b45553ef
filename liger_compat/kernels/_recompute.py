"""Run a consumer on a cheap-to-rebuild tensor without its autograd graph keeping that tensor.

A training step's peak sits at the end of the forward, where every tensor saved for the backward
is alive. Some of them are the outputs of our elementwise kernels: the gated MLP's
``act(gate) * up`` is saved by ``down_proj`` for its weight gradient, although the gated kernel
already keeps ``gate`` and ``up``, from which it is one elementwise launch away (an ``[N, I]``
buffer per layer: 2 GiB for Llama-3.2-1B at 8192 tokens).

:func:`call_recomputing` runs ``consumer(x)`` under ``torch.autograd.graph.saved_tensors_hooks``:
a tensor the consumer's graph would save that lies in ``x``'s storage is stored as its view
geometry only, and ``remake()`` rebuilds ``x`` when the backward unpacks it (the same kernel on
the same inputs: bit for bit the tensor that was dropped). Any other saved tensor is kept as is.
The hooks hold no reference to ``x``, so ``x`` is freed once the caller drops it.

It steps aside (plain ``consumer(x)``) where it could cost memory or break something: no grad,
``torch.compile`` tracing, ``x`` not a whole contiguous storage, or other saved-tensor hooks
already active (``save_on_cpu`` offloading, non-reentrant activation checkpointing), whose
packing would otherwise be bypassed while ``remake``'s inputs stay on the device.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ._dispatch import compiling

__all__ = ["call_recomputing", "applies"]


def _outer_hooks_active() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # pragma: no cover - a torch without the query: assume the worst
        return True
    return top(False) is not None


def applies(x: torch.Tensor) -> bool:
    """Whether :func:`call_recomputing` would drop ``x`` (else it just calls the consumer)."""
    if not (torch.is_grad_enabled() and x.requires_grad) or compiling() or _outer_hooks_active():
        return False
    return x.is_contiguous() and x.storage_offset() == 0 and x.untyped_storage().nbytes() == x.numel() * x.element_size()


class _Recipe:
    """What a pack hook stores instead of a view of ``x``."""

    __slots__ = ("size", "stride", "offset")

    def __init__(self, t: torch.Tensor) -> None:
        self.size, self.stride, self.offset = tuple(t.size()), tuple(t.stride()), t.storage_offset()


def call_recomputing(consumer: Callable[[torch.Tensor], Any], x: torch.Tensor,
                     remake: Callable[[], torch.Tensor]) -> Any:
    """``consumer(x)``, with saved views of ``x`` rebuilt from ``remake()`` in the backward.

    ``remake()`` must return a tensor equal to ``x`` (same shape, dtype, device, contiguous) and may
    only read tensors that are still intact when the consumer's backward runs. The caller must not
    keep ``x`` itself alive after the call, or nothing is saved.
    """
    if not applies(x):
        return consumer(x)
    ptr, dtype, device, shape = x.untyped_storage().data_ptr(), x.dtype, x.device, tuple(x.shape)
    # several saved views (gate_proj and up_proj both keep the norm output) share one rebuild:
    # it is kept from the first unpack until the last of the views packed here is unpacked
    state: dict[str, Any] = {"pending": 0, "rebuilt": None}

    def pack(t: torch.Tensor) -> Any:
        if t.dtype != dtype or t.device != device or t.numel() == 0:
            return t
        try:
            same = t.untyped_storage().data_ptr() == ptr
        except (RuntimeError, NotImplementedError):  # no plain storage (a DTensor, a fake tensor)
            return t
        if not same:
            return t
        state["pending"] += 1
        return _Recipe(t)

    def unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Recipe):
            return saved
        y = state["rebuilt"]
        if y is None:
            y = remake()
            if tuple(y.shape) != shape or y.dtype != dtype or not y.is_contiguous():
                raise RuntimeError(
                    f"liger_compat: the recomputed activation has shape {tuple(y.shape)} / {y.dtype}, "
                    f"expected {shape} / {dtype}; the inputs it is rebuilt from changed after the forward"
                )
        state["pending"] -= 1
        state["rebuilt"] = y if state["pending"] > 0 else None
        return y.as_strided(saved.size, saved.stride, saved.offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return consumer(x)
