"""Triton GEMM for the fused loss's logits, ``logits = hidden_chunk @ weight.T``, whose epilogue
also writes the row statistics the cross-entropy needs (per output tile: max, sum of
``exp(z - max)``, argmax, and the row sum for label smoothing), so the row kernel no longer
reads the chunk once just to find each row's log-sum-exp.

Persistent programs (one per SM) walk the output tiles column-block by column-block, all row
blocks of one weight block in a row, so each ``[BLOCK_N, H]`` slice of the weight comes from
DRAM once and is reused from L2 by the row blocks. Operands and the result move through tensor
descriptors (TMA on Hopper). The statistics are taken from the logits as stored (rounded to
the output dtype, softcap applied), i.e. exactly what the gradient pass reads back.

Tile-relative logits (:data:`SHIFT_LOGITS`, without softcap): each row of a tile is stored less
its fp32 maximum over the tile, which is that tile's max partial, so a logit is ``stored + max``
(``_ce_triton`` adds it back). A 16-bit store of ``z`` loses up to 2^-9 of ``|z|`` (0.06 at a
logit of 30), and ``exp`` turns that absolute error into the relative error of every softmax
entry; stored less the tile's maximum, the entries that carry the tile's softmax mass are within
a few units of 0, where the rounding is finer by the ratio of the magnitudes, whatever offset
the row's logits share. The argmax and the row sum then come from the fp32 accumulator, as the
low-memory mode's do: the index of the largest logit, where a 16-bit store could tie it with a
neighbour (``torch.argmax`` of 16-bit logits takes the first of tied ones).
"""

from __future__ import annotations

import torch

from ._ce_triton import _tanh
from ._dispatch import triton, tl, cdiv

__all__ = ["logits_with_partials", "new_partials", "supported", "absolute_logits"]

#: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, warp_specialize) on CUDA
CONFIG = (128, 256, 64, 8, 3, False)
#: store each tile's logits less their fp32 row maximum (without softcap; see the module's doc).
#: Off: the logits as a 16-bit product stores them (the benchmarks' A/B)
SHIFT_LOGITS = True


@triton.jit
def _logits_kernel(
    a_desc, b_desc, c_desc, pm_ptr, ps_ptr, pi_ptr, pz_ptr, M, N, K, NB, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, SHIFT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    num_m = tl.cdiv(M, BM)
    tiles = num_m * tl.cdiv(N, BN)
    k_steps = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGRAMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
        pid_n = tile // num_m  # row blocks of one weight block run side by side
        off_m = (tile % num_m) * BM
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), tl.float32)
        for ks in range(k_steps):
            a = a_desc.load([off_m, ks * BK])
            b = b_desc.load([off_n, ks * BK])
            acc = tl.dot(a, b.T, acc)
        cols = off_n + tl.arange(0, BN)
        cmask = (cols < N)[None, :]
        if SHIFT:  # the tile less its fp32 row maximum (the max partial): stored + max is the logit
            # argmax and row sum from the fp32 accumulator, taken before the store (fewer live registers)
            z = tl.where(cmask, acc, float("-inf"))
            m = tl.max(z, axis=1)
            best = tl.argmax(z, axis=1)
            zsum = m
            if HAS_SMOOTHING:
                zsum = tl.sum(tl.where(cmask, acc, 0.0), axis=1)
            c = (acc - m[:, None]).to(c_desc.dtype)
            c_desc.store([off_m, off_n], c)
            s = tl.sum(tl.where(cmask, tl.exp(c.to(tl.float32)), 0.0), axis=1)
        else:
            c = acc.to(c_desc.dtype)
            c_desc.store([off_m, off_n], c)
            z = c.to(tl.float32)
            if HAS_SOFTCAP:
                z = softcap * _tanh(z / softcap)
            z = tl.where(cmask, z, float("-inf"))
            m = tl.max(z, axis=1)
            s = tl.sum(tl.exp(z - m[:, None]), axis=1)
            best = tl.argmax(z, axis=1)
            zsum = m
            if HAS_SMOOTHING:
                zsum = tl.sum(tl.where(cmask, z, 0.0), axis=1)
        rows = off_m + tl.arange(0, BM)
        out = rows.to(tl.int64) * NB + pid_n
        rmask = rows < M
        tl.store(pm_ptr + out, m, mask=rmask)
        tl.store(ps_ptr + out, s, mask=rmask)
        tl.store(pi_ptr + out, best.to(tl.int32) + off_n, mask=rmask)
        if HAS_SMOOTHING:
            tl.store(pz_ptr + out, zsum, mask=rmask)


_CAPABLE: dict[object, bool] = {}


def _capable(device: torch.device) -> bool:
    """Triton with host-side tensor descriptors, and on CUDA a Hopper-class GPU (compute
    capability 9.0+: TMA; the kernel was measured on an H100 only)."""
    key = (device.type, device.index)
    if key not in _CAPABLE:
        try:
            from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401  (Triton >= 3.4)

            ok = "warp_specialize" in tl.range.__init__.__code__.co_varnames
            if ok and device.type == "cuda":
                ok = torch.cuda.get_device_capability(device) >= (9, 0)
        except (ImportError, AttributeError):  # Triton < 3.4: no tensor_descriptor module / no range(warp_specialize=)
            ok = False
        _CAPABLE[key] = ok
    return _CAPABLE[key]


def supported(hc: torch.Tensor, w: torch.Tensor) -> bool:
    """Tensor descriptors need 16-byte aligned rows and a 16-bit float type. (Triton's CPU
    interpreter multiplies bf16 ``tl.dot`` operands as their raw uint16 bits, so there only fp16
    qualifies; tests/kernels/test_cross_entropy.py runs the bf16 path with that dot corrected.)"""
    es = hc.element_size()
    types = (torch.bfloat16, torch.float16) if hc.device.type != "cpu" else (torch.float16,)
    return (
        hc.dtype in types and w.dtype == hc.dtype
        and hc.stride(1) == 1 and w.stride(1) == 1
        and (hc.stride(0) * es) % 16 == 0 and (w.stride(0) * es) % 16 == 0
        and (w.shape[0] * es) % 16 == 0 and hc.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
        and _capable(hc.device)
    )


_NUM_SMS: dict[int, int] = {}


def _config_for(dev, config):
    """(BM, BN, BK, warps, stages, warp specialization, programs) on ``dev``."""
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        if idx not in _NUM_SMS:
            _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        return (*(config or CONFIG), _NUM_SMS[idx])
    return 16, 32, 16, 1, 1, False, 4  # interpreter


def new_partials(rows, n, opt, dev, config=None):
    """Unfilled ``(pm, ps, pi, pz)`` partials of ``rows`` rows against ``n`` columns, for
    :func:`logits_with_partials`' ``parts`` (written a slice of rows at a time)."""
    nb = cdiv(n, _config_for(dev, config)[1])
    pm = torch.empty((rows, nb), dtype=torch.float32, device=dev)
    ps = torch.empty_like(pm)
    pz = torch.empty_like(pm) if opt.label_smoothing != 0.0 else pm
    pi = torch.empty((rows, nb), dtype=torch.int32, device=dev)
    return pm, ps, pi, pz


def logits_with_partials(hc, w, out, opt, config=None, parts=None):
    """``out[:] = hc @ w.T``, each tile of ``BN`` columns less its rows' maxima where the logits are
    shifted (:data:`SHIFT_LOGITS`, no softcap); returns the partials ``(pm, ps, pi, pz, shift)``,
    the first four ``[rows, NB]`` (``parts``: those of :func:`new_partials` to write, else new ones),
    ``shift`` the tile width ``BN`` when ``out`` holds tile-relative logits (logit ``[r, j]`` =
    ``out[r, j] + pm[r, j // BN]``), else 0."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = hc.shape
    n = w.shape[0]
    dev = hc.device
    bm, bn, bk, warps, stages, ws, programs = _config_for(dev, config)
    nb = cdiv(n, bn)
    pm, ps, pi, pz = parts if parts is not None else new_partials(m, n, opt, dev, config)
    a_desc = TensorDescriptor.from_tensor(hc, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    c_desc = TensorDescriptor.from_tensor(out, [bm, bn])
    tiles = cdiv(m, bm) * nb
    grid = (min(programs, tiles),)
    shift = SHIFT_LOGITS and opt.softcap is None
    _logits_kernel[grid](
        a_desc, b_desc, c_desc, pm, ps, pi, pz, m, n, k, nb,
        opt.softcap if opt.softcap is not None else 1.0,
        HAS_SOFTCAP=opt.softcap is not None, HAS_SMOOTHING=opt.label_smoothing != 0.0, SHIFT=shift,
        BM=bm, BN=bn, BK=bk, NUM_PROGRAMS=grid[0], WARP_SPECIALIZE=ws,
        num_warps=warps, num_stages=stages,
    )
    return pm, ps, pi, pz, bn if shift else 0


def absolute_logits(out: torch.Tensor, partials) -> torch.Tensor:
    """The logits themselves (fp32) from ``out`` and the partials that :func:`logits_with_partials`
    wrote with it: ``out`` plus each tile's max partial where the tiles are stored tile-relative."""
    pm, shift = partials[0], partials[4]
    z = out.float()
    if shift:
        z += pm.repeat_interleave(shift, dim=1)[:, : out.shape[1]]
    return z
