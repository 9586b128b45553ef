"""The exception classes of bad input to the kernels and the patched models: each is the class the
check raised before (``TypeError`` or ``ValueError``, so ``except ValueError`` keeps working) and
also the class native torch / transformers raise for the same input, so code written against the
native path (``except IndexError``, ``except RuntimeError``) catches ours too. Our messages name the
argument; native's name a tensor position or a C++ function.

The native classes, measured on CPU (torch 2.13, transformers 5.24; the CUDA ones with torch 2.11 on
an H100) with the same inputs given to ``torch.nn.functional.cross_entropy`` on ``F.linear(hidden, weight, bias)``, to trl's log-probs
(``log_softmax(...).gather(...)``), ``F.rms_norm``, ``silu(gate) * up``, transformers'
``apply_rotary_pos_emb`` and the unpatched model (``tests/models/test_error_classes.py``):

======================  ============================  =============================================
class                   bases                         native's error for the same input
======================  ============================  =============================================
TargetOutOfRangeError   ValueError, IndexError,       ``IndexError: Target 99 is out of bounds``
                        RuntimeError                  (cross_entropy on CPU); ``RuntimeError`` from
                                                      gather (log-probs) and on CUDA (a device-side
                                                      assert: ``torch.AcceleratorError``, a
                                                      ``RuntimeError``); an empty vocabulary likewise
TargetDtypeError        TypeError,                    ``RuntimeError: expected target dtype to be
                        NotImplementedError           Long or Byte`` (float / bool labels on CPU);
                                                      ``NotImplementedError`` (a ``RuntimeError``) on
                                                      CUDA; gather's ``Expected dtype int64 for
                                                      index``
ShapeMismatchError      ValueError, RuntimeError      ``RuntimeError: mat1 and mat2 shapes cannot be
                                                      multiplied``, broadcast errors, ``0D or 1D
                                                      target tensor expected``; ``ValueError:
                                                      Expected input batch_size ...``
DtypeMismatchError      TypeError, RuntimeError       ``RuntimeError: expected m1 and m2 to have the
                                                      same dtype``
DeviceMismatchError     ValueError, RuntimeError      ``RuntimeError: Expected all tensors to be on
                                                      the same device``
UnsupportedDtypeError   TypeError,                    ``NotImplementedError: "..." not implemented
                        NotImplementedError           for 'Long'`` (integer tensors; float64 runs
                                                      natively, and is refused here all the same)
DimensionError          ValueError, IndexError        ``IndexError: Dimension out of range``
OptionRangeError        ValueError, RuntimeError      ``RuntimeError: label_smoothing must be between
                                                      0.0 and 1.0``
NotATensorError         TypeError, AttributeError     labels given as a list: ``AttributeError: 'list'
                                                      object has no attribute 'to'`` (transformers
                                                      4.46-4.50, the loss moves them), a ``TypeError``
                                                      from a torch op elsewhere
======================  ============================  =============================================

:class:`GradientContractError` (``grad_mode="sum"`` told a uniform upstream gradient that was not)
has no native counterpart: native log-probs take any upstream gradient. It stays a ``ValueError``.
"""

from __future__ import annotations

__all__ = [
    "TargetOutOfRangeError", "TargetDtypeError", "ShapeMismatchError", "DtypeMismatchError", "DeviceMismatchError",
    "UnsupportedDtypeError", "DimensionError", "OptionRangeError", "NotATensorError", "GradientContractError",
]


class TargetOutOfRangeError(ValueError, IndexError, RuntimeError):
    """A target that is neither a class id in ``[0, V)`` nor ``ignore_index`` (or a vocabulary of
    size 0, where none is). Native: ``IndexError`` from ``cross_entropy`` on CPU, ``RuntimeError``
    from ``gather`` and from CUDA's device-side assert."""


class TargetDtypeError(TypeError, NotImplementedError):
    """Targets (labels) that are not integer class ids: float, bool or complex. Native:
    ``RuntimeError`` on CPU (``cross_entropy``'s target dtype check, ``gather``'s index dtype
    check), ``NotImplementedError`` (a ``RuntimeError``) from ``cross_entropy`` on CUDA."""


class ShapeMismatchError(ValueError, RuntimeError):
    """Tensor shapes that do not fit together (weight and hidden, bias, targets and rows, gate and
    up, cos and sin, q and k). Native: ``RuntimeError`` from the matmul, a broadcast or the loss;
    ``ValueError`` for a batch-size mismatch in ``cross_entropy``."""


class DtypeMismatchError(TypeError, RuntimeError):
    """Tensors whose dtypes must match and do not (hidden, weight and bias of the fused loss).
    Native: ``RuntimeError`` from the matmul."""


class DeviceMismatchError(ValueError, RuntimeError):
    """Inputs on different devices. Native: ``RuntimeError: Expected all tensors to be on the same
    device``."""


class UnsupportedDtypeError(TypeError, NotImplementedError):
    """A tensor dtype the kernels do not take (float32, bfloat16 and float16 only). Native:
    ``NotImplementedError`` (a ``RuntimeError``) for integer tensors."""


class DimensionError(ValueError, IndexError):
    """A dimension that does not exist (``unsqueeze_dim`` out of range, 0-d logits). Native:
    ``IndexError: Dimension out of range``."""


class OptionRangeError(ValueError, RuntimeError):
    """An option outside the range native torch accepts (``label_smoothing`` above 1). Native:
    ``RuntimeError``."""


class NotATensorError(TypeError, AttributeError):
    """An argument that must be a tensor and is not (labels as a list). Native: the first tensor
    method called on it fails, ``AttributeError`` (``labels.to(...)`` in transformers' loss) or a
    ``TypeError`` from a torch op."""


class GradientContractError(ValueError):
    """An upstream gradient that breaks what the caller told a kernel about it (``grad_mode="sum"``
    of :func:`~liger_compat.kernels.fused_linear_logprobs`)."""
