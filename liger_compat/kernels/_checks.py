"""Input validation shared by the kernels: clear ``TypeError``/``ValueError`` naming the argument,
each of a class in ``errors.py`` that is also the class native torch raises for the same input.

The design rule is "a Python error, never a CUDA illegal memory access". Checks that need a
host sync (target values in range) run up front on CPU tensors taking the torch reference, and
everywhere when ``liger_compat._config.settings.debug`` is on. Otherwise the kernels mask bad
targets so nothing reads out of bounds, and report them themselves (``_device_errors.py``).
"""

from __future__ import annotations

import torch

from .._config import settings
from .errors import (DeviceMismatchError, DtypeMismatchError, TargetDtypeError, TargetOutOfRangeError,
                     UnsupportedDtypeError)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: the RoPE kernel's launches (described at ``rope.ROPE_VARIANTS``)
ROPE_VARIANTS = ("flat", "rows")


def rope_variant(variant) -> str:
    if variant not in ROPE_VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(ROPE_VARIANTS)}, got {variant!r}")
    return variant


def norm_out_dtype(x: torch.Tensor, w: torch.Tensor, casting: str) -> torch.dtype:
    """The RMSNorm output's dtype: Llama's casting promotes to the weight's, Gemma's keeps the input's."""
    return torch.promote_types(x.dtype, w.dtype) if casting == "llama" else x.dtype


def tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def float_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise UnsupportedDtypeError(
            f"{name} has unsupported dtype {t.dtype}; supported: float32, bfloat16, float16"
        )


def same_device(**tensors: torch.Tensor | None) -> torch.device:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        same_device2(first_name, first, name, t)
    return first.device


def same_device2(first_name: str, first: torch.Tensor, name: str, t: torch.Tensor) -> torch.device:
    """``t`` on ``first``'s device, else the error naming both: :func:`same_device` of two tensors,
    without its argument dictionary (the module shims check two tensors on every call)."""
    device = first.device
    if t.device != device:
        raise DeviceMismatchError(f"{name} is on {t.device} but {first_name} is on {device}; "
                                  "all inputs must be on one device")
    return device


def same_dtype(**tensors: torch.Tensor | None) -> None:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise DtypeMismatchError(f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}; they must match")


def integer_target(name: str, t: torch.Tensor) -> None:
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TargetDtypeError(f"{name} must hold integer class indices (int64/int32), got dtype {t.dtype}")


def target_range(name: str, target: torch.Tensor, num_classes: int, ignore_index: int,
                 *, kernel_reports: bool = False) -> None:
    """Raise ``TargetOutOfRangeError`` (a ``ValueError``, ``IndexError`` and ``RuntimeError``) if any target is outside
    ``[0, num_classes)`` and not ``ignore_index``.

    Runs on CPU tensors (no sync to speak of) unless ``kernel_reports`` (the Triton kernels,
    which report bad targets themselves: under ``TRITON_INTERPRET=1`` that path is tested on
    CPU), and on accelerator tensors under ``settings.debug`` only, because it needs a host sync
    there.
    """
    if target.numel() == 0:
        return
    if not settings.debug and (kernel_reports or target.device.type != "cpu"):
        return
    bad = ((target < 0) | (target >= num_classes)) & (target != ignore_index)
    if bool(bad.any()):
        first = target[bad].flatten()[0].item()
        raise TargetOutOfRangeError(
            f"{name} holds {first}, outside the vocabulary [0, {num_classes}) and not ignore_index={ignore_index}"
        )


def reduction(value: str) -> str:
    if value not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {value!r}")
    return value
