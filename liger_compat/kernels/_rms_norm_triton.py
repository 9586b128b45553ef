"""Triton RMSNorm forward (one row per program, rstd saved) and backward (persistent programs
that each own a stride of rows and keep a private fp32 partial of ``dweight``, summed after)."""

from __future__ import annotations

import torch

from ._checks import norm_out_dtype
from ._dispatch import triton, tl, next_pow2

__all__ = ["rms_norm_forward_triton", "rms_norm_backward_triton"]


@triton.jit
def _rms_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, H, eps, offset,
             LLAMA: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    for i in tl.static_range(ROWS):
        row = tl.program_id(0).to(tl.int64) * ROWS + i
        x_raw = tl.load(x_ptr + row * H + cols, mask=cmask, other=0.0)
        x = x_raw.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
        n = x * rstd
        if LLAMA:
            n = n.to(x_raw.dtype).to(tl.float32)
        tl.store(y_ptr + row * H + cols, (n * w).to(y_ptr.dtype.element_ty), mask=cmask)
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_bwd(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, N, H, offset,
             LLAMA: tl.constexpr, NEED_DW: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + offset
    dw = tl.zeros([BLOCK_H], tl.float32)
    pid64 = pid.to(tl.int64)
    for r in range(pid, N, nprog):
        row = pid64 + (r - pid)  # int64 row index (works compiled and interpreted)
        x_raw = tl.load(x_ptr + row * H + cols, mask=cmask, other=0.0)
        x = x_raw.to(tl.float32)
        dy = tl.load(dy_ptr + row * H + cols, mask=cmask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        n = x * rstd
        g = dy * w
        dx = rstd * (g - n * (tl.sum(g * n, axis=0) / H))
        tl.store(dx_ptr + row * H + cols, dx.to(dx_ptr.dtype.element_ty), mask=cmask)
        if NEED_DW:
            if LLAMA:
                n = n.to(x_raw.dtype).to(tl.float32)
            dw += dy * n
    if NEED_DW:
        tl.store(dw_part_ptr + pid * H + cols, dw, mask=cmask)


#: launch knobs (None: by row width); measured variants are in benchmarks/NOTES.md
FWD_WARPS: int | None = None
BWD_WARPS: int | None = None
BWD_PROGRAMS_PER_SM = 2


def _warps(block_h: int, override: int | None) -> int:
    if override is not None:
        return override
    return 16 if block_h >= 8192 else 8 if block_h >= 2048 else 4


#: CUDA device index -> its multiprocessor count (``get_device_properties`` costs ~10 us a call)
_sm_counts: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _sm_counts.get(index)
    if count is None:
        count = _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def _programs(n: int, device: torch.device) -> int:
    if device.type == "cuda":
        return max(1, min(n, _sm_count(device) * BWD_PROGRAMS_PER_SM))
    return max(1, min(n, 4))


def _rows_per_program(n: int, block: int, device: torch.device) -> int:
    """Rows of the forward per program: on CUDA several small rows (up to 8, a power of two that
    divides ``n``) to amortise the weight load; one elsewhere."""
    rows = 1
    if device.type == "cuda":
        while rows < 8 and block * rows < 4096 and n % (rows * 2) == 0:
            rows *= 2
    return rows


def rms_norm_forward_triton(x2, w, eps, offset, casting):
    n, h = x2.shape
    y = torch.empty((n, h), dtype=norm_out_dtype(x2, w, casting), device=x2.device)
    rstd = torch.empty(n, dtype=torch.float32, device=x2.device)
    if n == 0:
        return y, rstd
    block = next_pow2(h)
    rows = _rows_per_program(n, block, x2.device)
    _rms_fwd[(n // rows,)](x2, w, y, rstd, h, eps, offset, LLAMA=casting == "llama", BLOCK_H=block,
                           ROWS=rows, num_warps=_warps(block, FWD_WARPS))
    return y, rstd


def rms_norm_backward_triton(dy, x2, w, rstd, offset, casting, need_dw=True):
    n, h = x2.shape
    dx = torch.empty_like(x2)
    progs = _programs(n, x2.device)
    part = torch.empty((progs, h), dtype=torch.float32, device=x2.device) if need_dw else rstd
    if n > 0:
        block = next_pow2(h)
        _rms_bwd[(progs,)](dy, x2, w, rstd, dx, part, n, h, offset, LLAMA=casting == "llama",
                           NEED_DW=need_dw, BLOCK_H=block, num_warps=_warps(block, BWD_WARPS))
    dw = None
    if need_dw:
        dw = part.sum(0) if n > 0 else torch.zeros(h, dtype=torch.float32, device=x2.device)
    return dx, dw
