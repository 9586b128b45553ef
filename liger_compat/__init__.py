"""liger_compat: fused Triton kernels for LLM training on whatever transformers / trl you have.

``import liger_compat`` as the first line of a training script installs post-import hooks:
shims for a library are applied when, and only when, that library is imported (before or
after liger_compat). Importing this package does not import torch, transformers or trl.
``liger-compat run -- COMMAND`` does the same in every Python process a command starts, for code
that cannot be edited (:mod:`liger_compat.launcher`).

Public API: :func:`check`, :func:`apply`, :func:`revert`, :func:`configure`, ``__version__``.
``LIGER_COMPAT_DISABLE=1`` turns everything off; ``LIGER_COMPAT_KERNELS`` picks kernels.
"""

from __future__ import annotations

from typing import Any, Iterable

__version__ = "0.1.0"
__all__ = ["check", "apply", "revert", "configure", "__version__"]

from . import _lazy

# before anything imports wrapt, whose wrapt.importer imports importlib.metadata (~25 ms): see _lazy
_lazy.defer("importlib.metadata")

from . import _config
from .compat import check
from .shims import REGISTRY as _REGISTRY
from .shims import load_all as _load_all


def configure(*, enabled: bool | None = None, kernels: str | Iterable[str] | None = None, debug: bool | None = None,
              return_logits: bool | None = None, decode_native: bool | None = None,
              cpu_native: bool | None = None, flce_sparse: bool | None = None,
              flce_fp32_grad_weight: bool | None = None, flce_graphs: bool | None = None,
              flce_sparse_grads: bool | None = None, rms_norm_small_torch: bool | None = None,
              mlp_small_native: bool | None = None) -> None:
    """Change settings at run time.

    ``enabled=False`` reverts every patch and keeps liger_compat off; ``enabled=True`` turns it
    back on. ``kernels`` is ``"all"``, ``"none"`` or names from ``rms_norm, rope, swiglu, geglu,
    fused_linear_cross_entropy``; shims whose kernels are deselected are reverted. ``debug=True``
    turns on input checks that need a host sync: targets outside the vocabulary then raise
    before the loss runs on the GPU, instead of being reported by the kernel after it.
    ``return_logits=True`` makes the fused causal-LM loss return the logits too, unless a call
    passes its own ``return_logits=`` (``LIGER_COMPAT_RETURN_LOGITS``). ``decode_native=False``
    keeps the RMSNorm, RoPE and MLP kernels in decode steps too (``LIGER_COMPAT_DECODE_NATIVE``:
    by default a call with no autograd graph and one position per sequence runs natively).
    ``cpu_native=False`` runs the kernels' torch references where no Triton kernel runs (CPU
    tensors without ``TRITON_INTERPRET=1``; ``LIGER_COMPAT_CPU_NATIVE``: by default transformers'
    own RMSNorm, RoPE and MLP code and, up to 2**24 logits, the loss as the model's head computes
    it: ``lm_head``'s call, then ``cross_entropy``; the fused loss function as plain torch ops).
    ``flce_sparse=False`` makes the low-memory fused loss compute every vocabulary tile in its
    backward (``LIGER_COMPAT_FLCE_SPARSE``: by default it leaves out the tiles whose softmax
    entries are all below 2^-10, which adds ~2e-3 to grad_hidden's error on trained-like logits).
    ``flce_fp32_grad_weight=True`` makes the chunked fused loss on a GPU round grad_weight once
    (``LIGER_COMPAT_FLCE_FP32_GRAD_WEIGHT``: by default it is summed in the weight's dtype, one
    rounding a chunk): the logits' gradients of up to 8192 rows are kept for each fp32-result
    product, each target's term is added exactly, and the fp32 sum is rounded once; it costs an
    fp32 buffer of twice the weight's size and up to 8192 rows of that gradient (2 GiB at a 128k
    vocabulary) while the loss runs. ``flce_sparse_grads=True`` makes the chunked fused loss on a GPU
    with tensor descriptors (compute capability 9.0+) run its two gradient matmuls block-sparse
    (``LIGER_COMPAT_FLCE_SPARSE_GRADS``: by default they are dense): a dense first chunk probes the
    softmax, and where it is sparse (trained-like logits) the later chunks leave out the pairs of
    (128 rows, 256 vocabulary columns) whose entries are all negligible, their mass given back to
    grad_hidden; 2 to 3 GiB of memory instead of 0.5 to 1 while the loss runs at a 7B-9B head.
    A call small enough to replay its pass as a CUDA graph stays dense. ``flce_graphs=False`` runs
    every call of the fused loss eagerly (``LIGER_COMPAT_FLCE_GRAPHS``: by default a scalar loss on a GPU of at most ~2**39
    rows x vocabulary x hidden, a host-bound small step's, replays its pass as a CUDA graph from
    the third call with the same shapes and weight; the graph keeps one chunk of logits and the
    gradients reserved). ``rms_norm_small_torch=False`` runs our RMSNorm kernel at every size
    (``LIGER_COMPAT_RMS_NORM_SMALL_TORCH``: by default an RMSNorm on a GPU whose output is below
    16 MiB runs torch's fused RMSNorm op, one C++ call forward and backward (Gemma's casting: in fp32,
    with native's casts around it), where a host-bound step waits for our kernel's Python launch).
    ``mlp_small_native=False`` runs our gated-MLP kernel at every size (``LIGER_COMPAT_MLP_SMALL_NATIVE``:
    by default an eager MLP call on a GPU whose activation ``act(gate) * up`` is below 64 MiB runs the
    module's native forward, where the kernel's launch costs a host-bound step more than it saves).
    """
    s = _config.settings
    if mlp_small_native is not None:
        s.mlp_small_native = _config.parse_bool(mlp_small_native, "mlp_small_native")
        s.source["mlp_small_native"] = "configure()"
    if rms_norm_small_torch is not None:
        s.rms_norm_small_torch = _config.parse_bool(rms_norm_small_torch, "rms_norm_small_torch")
        s.source["rms_norm_small_torch"] = "configure()"
    if flce_graphs is not None:
        s.flce_graphs = _config.parse_bool(flce_graphs, "flce_graphs")
        s.source["flce_graphs"] = "configure()"
    if flce_sparse_grads is not None:
        s.flce_sparse_grads = _config.parse_bool(flce_sparse_grads, "flce_sparse_grads")
        s.source["flce_sparse_grads"] = "configure()"
    if flce_fp32_grad_weight is not None:
        s.flce_fp32_grad_weight = _config.parse_bool(flce_fp32_grad_weight, "flce_fp32_grad_weight")
        s.source["flce_fp32_grad_weight"] = "configure()"
    if flce_sparse is not None:
        s.flce_sparse = _config.parse_bool(flce_sparse, "flce_sparse")
        s.source["flce_sparse"] = "configure()"
    if cpu_native is not None:
        s.cpu_native = _config.parse_bool(cpu_native, "cpu_native")
        s.source["cpu_native"] = "configure()"
    if decode_native is not None:
        s.decode_native = _config.parse_bool(decode_native, "decode_native")
        s.source["decode_native"] = "configure()"
    if kernels is not None:
        s.kernels = _config.parse_kernels(kernels)  # raises before anything changes
        s.source["kernels"] = "configure()"
    if return_logits is not None:
        s.return_logits = _config.parse_bool(return_logits, "return_logits")
        s.source["return_logits"] = "configure()"
    if debug is not None:
        s.debug = bool(debug)
        s.source["debug"] = "configure()"
    if enabled is not None:
        s.disabled = not enabled
        s.source["disabled"] = "configure()"
    if s.disabled:
        _REGISTRY.revert()
        return
    if kernels is not None or enabled:
        # re-apply under the new kernel selection
        if _REGISTRY.active:
            _REGISTRY.revert()
        _REGISTRY.apply()


def apply(model: Any = None, kernels: str | Iterable[str] | None = None) -> Any:
    """Apply every shim whose target library is imported, and patch ``model`` if given.

    Idempotent. Returns ``model`` so it can be used inline: ``model = apply(model)``. A model
    given here is remembered (weakly) and patched again by every later ``apply()`` and
    ``configure(kernels=... / enabled=True)``, after a ``revert()`` too.
    """
    if kernels is not None:
        _config.settings.kernels = _config.parse_kernels(kernels)
        _config.settings.source["kernels"] = "apply()"
    if _config.settings.disabled:
        return model
    _load_all()
    _REGISTRY.apply(model)
    return model


def revert() -> list[str]:
    """Undo every patch liger_compat made (classes and model instances). Returns any errors.

    A patch another library wrapped over cannot be removed without dropping theirs: it stays in
    place with our wrapper inert (it calls straight through to the native code), ``check()`` says
    so, and every later ``revert()`` tries it again and reports it while it stays.
    """
    return _REGISTRY.revert()


_load_all()
if not _config.settings.disabled:
    _REGISTRY.activate()
