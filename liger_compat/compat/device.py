"""Device facts for the report: accelerator, capability, and whether Triton can run kernels.

This imports torch (and triton, when present), so only ``check()`` calls it, never the
import of ``liger_compat``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .. import _config
from . import versions

#: Triton's NVIDIA backend targets compute capability 7.5 and newer (Turing+); 8.0+ for bf16.
MIN_TRITON_CAPABILITY = (7, 5)


@dataclass
class DeviceInfo:
    torch_available: bool
    cuda_available: bool = False
    device_count: int = 0
    gpu_name: str | None = None
    capability: str | None = None
    cuda_runtime: str | None = None
    hip: bool = False
    triton_installed: bool = False  # per package metadata; whether it imports is in kernel_backend / reason
    triton_interpret: bool = False
    kernel_backend: str = "torch reference"
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def interpret_mode() -> bool:
    return _config.triton_interpret()


def _no_triton_path(where: str) -> tuple[str, str]:
    """(backend, what runs) on ``where``'s tensors when no Triton kernel runs there, as
    ``LIGER_COMPAT_CPU_NATIVE`` decides (``shims._module_shims.native_call``,
    ``shims.causal_lm._native_head_loss``, ``kernels.loss.dense_for``)."""
    if _config.settings.cpu_native:
        return ("transformers' modules + torch loss",
                f"{where} tensors run transformers' own RMSNorm, RoPE and MLP code and a model's loss as its "
                "head computes it (up to 2**24 logits; the fused loss's chunked reference beyond); "
                "LIGER_COMPAT_CPU_NATIVE=0: the kernels' torch references")
    return "torch reference", f"{where} tensors use the kernels' torch references (chunked for the fused loss)"


def detect() -> DeviceInfo:
    info = DeviceInfo(torch_available=versions.installed("torch").installed)
    info.triton_installed = versions.installed("triton").installed
    info.triton_interpret = interpret_mode()
    if not info.torch_available:
        info.kernel_backend = "none"
        info.reason = "torch is not installed"
        return info
    import torch

    from ..kernels import _dispatch  # what the kernels' dispatch found: Triton importable or not

    importable = _dispatch.HAS_TRITON
    broken = (f"triton is installed but `import triton` fails ({_dispatch.TRITON_IMPORT_ERROR})"
              if info.triton_installed and not importable else "")
    info.cuda_available = bool(torch.cuda.is_available())
    info.hip = getattr(torch.version, "hip", None) is not None
    info.cuda_runtime = getattr(torch.version, "hip", None) or getattr(torch.version, "cuda", None)
    if info.cuda_available:
        info.device_count = torch.cuda.device_count()
        info.gpu_name = torch.cuda.get_device_name(0)
        major, minor = torch.cuda.get_device_capability(0)
        info.capability = f"{major}.{minor}"
        # the backend is the one _dispatch.choose takes for GPU tensors: Triton whenever it imports
        if broken:
            info.kernel_backend, what = _no_triton_path("GPU")
            info.reason = f"{broken}: {what}"
        elif not importable:
            info.kernel_backend, what = _no_triton_path("GPU")
            info.reason = f"triton is not installed: {what}"
        else:
            info.kernel_backend = "triton (HIP)" if info.hip else "triton (CUDA)"
            if not info.hip and (major, minor) < MIN_TRITON_CAPABILITY:
                info.reason = (f"compute capability {major}.{minor} is below Triton's minimum "
                               f"{MIN_TRITON_CAPABILITY[0]}.{MIN_TRITON_CAPABILITY[1]}: its kernels may fail here")
    elif info.triton_interpret and importable:
        info.kernel_backend = "triton interpreter (TRITON_INTERPRET=1)"
        info.reason = "no GPU: Triton kernels run in the interpreter on CPU tensors"
    else:
        info.kernel_backend, what = _no_triton_path("CPU")
        info.reason = f"no GPU: {what}"
        if broken:
            info.reason += f"; {broken}"
    return info
