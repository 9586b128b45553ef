"""Input validation shared by the kernels: clear ``TypeError``/``ValueError`` naming the argument.

The design rule is "a Python error, never a CUDA illegal memory access". Checks that need a
host sync (target values in range) run always on CPU tensors, and on GPU tensors only when
``liger_compat._config.settings.debug`` is on; without it the Triton kernels mask bad targets
so nothing reads out of bounds, and the affected rows give a NaN loss.
"""

from __future__ import annotations

import torch

from .._config import settings

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def float_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} has unsupported dtype {t.dtype}; supported: float32, bfloat16, float16"
        )


def same_device(**tensors: torch.Tensor | None) -> torch.device:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                "all inputs must be on one device"
            )
    return first.device


def same_dtype(**tensors: torch.Tensor | None) -> None:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; they must match")


def integer_target(name: str, t: torch.Tensor) -> None:
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{name} must hold integer class indices (int64/int32), got dtype {t.dtype}")


def target_range(name: str, target: torch.Tensor, num_classes: int, ignore_index: int) -> None:
    """Raise ``ValueError`` if any target is outside ``[0, num_classes)`` and not ``ignore_index``.

    Runs on CPU tensors always (no sync to speak of) and on accelerator tensors under
    ``settings.debug`` only, because it needs a host sync there.
    """
    if target.numel() == 0:
        return
    if target.device.type != "cpu" and not settings.debug:
        return
    bad = ((target < 0) | (target >= num_classes)) & (target != ignore_index)
    if bool(bad.any()):
        first = target[bad].flatten()[0].item()
        raise ValueError(
            f"{name} holds {first}, outside [0, {num_classes}) and not ignore_index={ignore_index}"
        )


def reduction(value: str) -> str:
    if value not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {value!r}")
    return value
