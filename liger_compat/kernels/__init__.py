"""Fused kernels with a pure-torch reference each. Imports no transformers or trl.

Public functional API:

- :func:`fused_linear_cross_entropy` and :func:`cross_entropy` (``CrossEntropyOutput``)
- :func:`fused_linear_logprobs` (``LogProbOutput``): per-token log-probs, entropy, top-1 and more of the LM head
- :func:`rms_norm`, :func:`project_norm_output` (projections of its output, which is rebuilt in the backward)
- :func:`swiglu`, :func:`geglu`, :func:`gated_project` (``down(act(gate) * up)``, activation rebuilt in the backward)
- :func:`apply_rotary_pos_emb`
- :func:`raise_target_errors`: wait for the GPU's report of targets outside the vocabulary
  (otherwise raised without a sync, see ``_device_errors.py``), :class:`TargetOutOfRangeError`;
  :class:`GradientContractError` (an upstream gradient that breaks ``grad_mode="sum"``)
- the classes of the argument checks' errors (``errors.py``): each a ``TypeError`` or ``ValueError``
  and also the class native torch raises for the same input (``TargetOutOfRangeError`` an
  ``IndexError``, ``TargetDtypeError`` a ``RuntimeError`` ...)

Every function dispatches through :mod:`liger_compat.kernels._dispatch`: CUDA tensors run the
Triton kernels, CPU tensors the torch reference, and with ``TRITON_INTERPRET=1`` the Triton
code runs on CPU. ``use_backend("torch" | "triton" | "auto")`` forces a path.
"""

from __future__ import annotations

from ._dispatch import HAS_TRITON, last_backend, use_backend
from .loss import CrossEntropyOutput, cross_entropy, fused_linear_cross_entropy
from .logprob import LogProbOutput, fused_linear_logprobs
from .gated_mlp import gated_project, geglu, swiglu
from .norm import project_norm_output, rms_norm
from .rope import apply_rotary_pos_emb
from ._device_errors import raise_target_errors
from .errors import (DeviceMismatchError, DimensionError, DtypeMismatchError, GradientContractError, NotATensorError,
                     OptionRangeError, ShapeMismatchError, TargetDtypeError, TargetOutOfRangeError, UnsupportedDtypeError)
from .vocab_parallel import vocab_parallel_cross_entropy
from . import _ops  # noqa: F401,E402  (registers the custom ops the functions above call under torch.compile)

__all__ = [
    "fused_linear_cross_entropy",
    "vocab_parallel_cross_entropy",
    "cross_entropy",
    "CrossEntropyOutput",
    "fused_linear_logprobs",
    "LogProbOutput",
    "rms_norm",
    "project_norm_output",
    "swiglu",
    "geglu",
    "gated_project",
    "apply_rotary_pos_emb",
    "raise_target_errors",
    "TargetOutOfRangeError",
    "GradientContractError",
    "TargetDtypeError",
    "ShapeMismatchError",
    "DtypeMismatchError",
    "DeviceMismatchError",
    "UnsupportedDtypeError",
    "DimensionError",
    "OptionRangeError",
    "NotATensorError",
    "use_backend",
    "last_backend",
    "HAS_TRITON",
]
