"""Triton kernel for the fused loss's weight-gradient update ``gw (+)= dlogits.T @ hidden_chunk``.

In the chunked loss this update is memory-bound: K (the chunk's rows, ~256) is small, while the
``[V, H]`` bf16 accumulator is read and written once per chunk. cuBLAS's ``addmm`` reads the old
tile only in its epilogue; this kernel issues that load before the K loop so it overlaps the
matrix work. Which one is faster is measured by ``benchmarks/kernels.py`` (see NOTES.md).
"""

from __future__ import annotations

import torch

from ._dispatch import triton, tl

__all__ = ["grad_weight_update"]

#: (BLOCK_V, BLOCK_H, BLOCK_K, num_warps, num_stages) on CUDA
GW_CONFIG = (128, 128, 64, 8, 3)


@triton.jit
def _gw_kernel(dl_ptr, h_ptr, gw_ptr, V, H, K, stride_dl, stride_h, stride_gw,
               ACCUM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(H, BN)
    pid_m = pid // num_n  # consecutive programs share a V block of dlogits (stays in L2)
    pid_n = pid % num_n
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mmask = offs_m < V
    nmask = offs_n < H
    cmask = mmask[:, None] & nmask[None, :]
    c_ptrs = gw_ptr + offs_m[:, None].to(tl.int64) * stride_gw + offs_n[None, :]
    if ACCUM:
        c_old = tl.load(c_ptrs, mask=cmask, other=0.0)  # issued before the K loop
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + offs_k
        kmask = kk < K
        a = tl.load(dl_ptr + kk[None, :] * stride_dl + offs_m[:, None], mask=kmask[None, :] & mmask[:, None], other=0.0)
        b = tl.load(h_ptr + kk[:, None] * stride_h + offs_n[None, :], mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    if ACCUM:
        acc += c_old.to(tl.float32)
    tl.store(c_ptrs, acc.to(gw_ptr.dtype.element_ty), mask=cmask)


def grad_weight_update(gw: torch.Tensor, dl: torch.Tensor, hc: torch.Tensor, accumulate: bool, config=None) -> None:
    """``gw = dl.T @ hc`` (or ``+=`` when ``accumulate``); dl ``[K, V]``, hc ``[K, H]``, gw ``[V, H]``."""
    k, v = dl.shape
    h = hc.shape[1]
    assert dl.stride(1) == 1 and hc.stride(1) == 1 and gw.stride(1) == 1
    if gw.device.type == "cuda":
        bm, bn, bk, warps, stages = config or GW_CONFIG
    else:  # interpreter
        bm, bn, bk, warps, stages = 32, 32, 16, 1, 1
    grid = (triton.cdiv(v, bm) * triton.cdiv(h, bn),)
    _gw_kernel[grid](dl, hc, gw, v, h, k, dl.stride(0), hc.stride(0), gw.stride(0),
                     ACCUM=accumulate, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
