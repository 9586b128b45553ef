"""The one dispatch point of the kernels: Triton code or the pure-torch reference.

Rules: CUDA tensors run Triton; CPU tensors run the torch reference; with
``TRITON_INTERPRET=1`` in the environment the Triton code runs on CPU tensors through Triton's
interpreter. The environment is read on every call, so a test can tell which path ran from
:data:`last_backend`. :func:`use_backend` forces one path (benchmarks, tests).

Triton decides between compiled and interpreted kernels when a ``@triton.jit`` function is
defined, so interpreted runs need ``TRITON_INTERPRET=1`` set before the kernel modules are
imported; the interpreter tests therefore run in a fresh subprocess.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from .. import _config

#: why ``import triton`` failed here (None when it worked): the report says so
TRITON_IMPORT_ERROR: str | None = None
try:  # Triton is optional (no wheels for every platform); the reference always works
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except Exception as _exc:  # pragma: no cover - depends on the platform
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False
    TRITON_IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}"

#: kernel name -> "triton" or "torch": the path the most recent call of that kernel took.
last_backend: dict[str, str] = {}

_forced: list[str] = []


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the host side of the kernels (``triton.cdiv`` is a constexpr
    function in newer Triton: ~5 us a call from Python)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (and 1 for ``n <= 1``), host side like :func:`cdiv`."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


#: True while TorchDynamo traces (the public functions then call the custom ops of :data:`OPS`)
compiling = _config.compiling


#: the kernels' custom ops, registered by ``_ops.py`` (which the package imports after the kernel
#: modules: they call the ops through this namespace and never import ``_ops`` back). Callers take
#: an op's ``.default`` overload, what the op objects of ``_ops.py`` call, so a traced graph holds
#: the same node either way.
OPS = torch.ops.liger_compat


#: True when ``TRITON_INTERPRET`` asks for Triton's CPU interpreter (the setting's one parser, read
#: on every call; an alias rather than a wrapper: it runs on every module call of a step)
interpret_mode = _config.triton_interpret


@contextlib.contextmanager
def use_backend(backend: str) -> Iterator[None]:
    """Force ``"triton"``, ``"torch"`` or ``"auto"`` inside the ``with`` block."""
    if backend not in ("triton", "torch", "auto"):
        raise ValueError(f"backend must be 'triton', 'torch' or 'auto', got {backend!r}")
    _forced.append(backend)
    try:
        yield
    finally:
        _forced.pop()


def reference_only(device: torch.device) -> bool:
    """Whether tensors on ``device`` get no Triton kernel by default: ``choose`` would take the torch
    reference there (CPU tensors without ``TRITON_INTERPRET=1``, or no importable Triton) and no
    backend is forced. Callers with a cheaper equivalent of the reference (the module shims: the
    native module code) use it there; a forced backend always runs the kernel code it names."""
    if _forced and _forced[-1] != "auto":
        return False
    kind = device.type
    if kind == "cuda":
        return not HAS_TRITON
    return not (HAS_TRITON and kind == "cpu" and interpret_mode())


def choose(kernel: str, device: torch.device) -> str:
    """Pick the backend for ``kernel`` on ``device`` and record it in :data:`last_backend`."""
    forced = _forced[-1] if _forced else "auto"
    if forced == "auto":
        if not HAS_TRITON:
            backend = "torch"
        elif device.type == "cuda":
            backend = "triton"
        elif device.type == "cpu" and interpret_mode():
            backend = "triton"
        else:
            backend = "torch"
    else:
        backend = forced
        if backend == "triton" and not HAS_TRITON:
            raise RuntimeError("use_backend('triton') but Triton is not importable")
        if backend == "triton" and device.type == "cpu" and not interpret_mode():
            raise RuntimeError("Triton on CPU tensors needs TRITON_INTERPRET=1 set before import")
    last_backend[kernel] = backend
    return backend
