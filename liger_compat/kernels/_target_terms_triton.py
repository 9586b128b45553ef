"""The targets' own terms of grad_weight in the chunked fused loss, added exactly.

The chunked mode stores ``d loss / d logits`` in the input's dtype for its two gradient matmuls.
Each row's target entry ``d_t`` is that row's largest (``p_t - 1``), so its bf16 rounding (up to
2^-9 of it) is most of what grad_weight's rows at the batch's targets lose once the products are
summed in fp32 (``LIGER_COMPAT_FLCE_FP32_GRAD_WEIGHT``): on an H200 at the Llama-3-8B head that
sum's error against fp32 was 2.3e-3 to 2.8e-3 on near-uniform, spread and trained-like logits, and
1.7e-3 to 1.8e-3 (one rounding of the exact result: 1.7e-3) once these terms were added. The row
kernel hands over each row's residual ``r_i = d_t - stored d_t`` in fp32 (``_ce_triton``'s
``target_res``), and :func:`add_target_terms` adds ``r_i * h_i`` to row ``t_i`` of the fp32 sum
before it is rounded into the weight's dtype.

The terms are at most 2^-9 of the entries they correct, so the order they are summed in moves the
result by about 2^-24 of that: fp32 atomics, one program per (row, block of H), do it in a few
hundredths of a millisecond. Where torch's deterministic algorithms are on, or into a 16-bit
grad_weight (each row rounded once), one program per run of equal targets sums the run in a fixed
order instead (slower: a frequent token's run is hundreds of rows).
"""

from __future__ import annotations

import torch

from ._dispatch import cdiv, next_pow2, tl, triton


@triton.jit
def _target_terms_kernel(gw_ptr, stride_gw, h_ptr, stride_h, sorted_t_ptr, rows_ptr, hrows_ptr, ends_ptr, res_ptr,
                         M, V, H, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program ``(j, k)``: if position ``j`` of the sorted targets starts a run of target ``t`` in
    ``[0, V)``, adds ``sum r[rows[i]] * h[hrows[i], block k]`` over the run (positions ``j`` to
    ``ends[j]``, ``BLOCK_R`` at a time: a frequent token's run is hundreds of rows) to
    ``gw[t, block k]``."""
    j = tl.program_id(0)
    k = tl.program_id(1)
    t = tl.load(sorted_t_ptr + j)
    prev = tl.load(sorted_t_ptr + tl.maximum(j - 1, 0))
    starts = (j == 0) | (prev != t)
    if starts & (t >= 0) & (t < V):
        cols = k * BLOCK_H + tl.arange(0, BLOCK_H)
        cm = cols < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        end = tl.load(ends_ptr + j)
        for i in range(j, end, BLOCK_R):
            pos = i + tl.arange(0, BLOCK_R)
            pm = pos < end
            r = tl.load(res_ptr + tl.load(rows_ptr + pos, mask=pm, other=0), mask=pm, other=0.0)
            hrow = tl.load(hrows_ptr + pos, mask=pm, other=0)
            hv = tl.load(h_ptr + hrow[:, None] * stride_h + cols[None, :], mask=pm[:, None] & cm[None, :],
                         other=0.0).to(tl.float32)
            acc += tl.sum(r[:, None] * hv, axis=0)
        g = gw_ptr + t.to(tl.int64) * stride_gw + cols
        old = tl.load(g, mask=cm, other=0.0).to(tl.float32)
        tl.store(g, (old + acc).to(gw_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _target_terms_atomic_kernel(gw_ptr, stride_gw, h_ptr, stride_h, t_ptr, hrows_ptr, res_ptr, V, H,
                                HAS_INDEX: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program ``(i, k)``: ``gw[t_i, block k] += r_i * h[row_i, block k]`` by fp32 atomics, where
    ``t_i`` is in ``[0, V)``."""
    i = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    t = tl.load(t_ptr + i)
    if (t >= 0) & (t < V):
        if HAS_INDEX:
            hrow = tl.load(hrows_ptr + i)
        else:
            hrow = i
        cols = k * BLOCK_H + tl.arange(0, BLOCK_H)
        cm = cols < H
        r = tl.load(res_ptr + i)
        hv = tl.load(h_ptr + hrow * stride_h + cols, mask=cm, other=0.0).to(tl.float32)
        tl.atomic_add(gw_ptr + t.to(tl.int64) * stride_gw + cols, r * hv, mask=cm, sem="relaxed")


def add_target_terms(gw: torch.Tensor, h: torch.Tensor, target: torch.Tensor, res: torch.Tensor,
                     row_index: torch.Tensor | None = None) -> None:
    """``gw[target[i]] += res[i] * h[row_index[i]]`` (``h[i]`` without ``row_index``) for every ``i``
    whose target is in ``[0, V)``: by fp32 atomics into an fp32 ``gw``; into a 16-bit one (or with
    torch's deterministic algorithms on) each row of ``gw`` touched once, its terms summed in fp32 in
    a fixed order first. ``gw`` ``[V, H]``, ``target`` int ``[M]``, ``res`` fp32 ``[M]``, ``h``
    ``[M, H]`` or, with ``row_index`` (int ``[M]``), any rows; no host sync."""
    m = target.shape[0]
    hdim = h.shape[1]
    if m == 0:
        return
    assert gw.shape[1] == hdim and gw.stride(-1) == 1 and h.stride(-1) == 1
    assert res.shape == (m,) and res.dtype == torch.float32
    assert (row_index is None and h.shape[0] == m) or (row_index is not None and row_index.shape == (m,))
    cuda = gw.device.type == "cuda"
    if gw.dtype == torch.float32 and not torch.are_deterministic_algorithms_enabled():
        block = min(next_pow2(hdim), 1024 if cuda else 64)
        index = row_index if row_index is not None else target
        _target_terms_atomic_kernel[(m, cdiv(hdim, block))](
            gw, gw.stride(0), h, h.stride(0), target, index, res.contiguous(), gw.shape[0], hdim,
            HAS_INDEX=row_index is not None, BLOCK_H=block, num_warps=4 if cuda else 1,
        )
        return
    sorted_t, rows = torch.sort(target.long(), stable=True)  # stable: a fixed summation order
    hrows = rows if row_index is None else row_index.long().index_select(0, rows)
    ends = torch.searchsorted(sorted_t, sorted_t, right=True)
    block = min(next_pow2(hdim), 256 if cuda else 64)
    _target_terms_kernel[(m, cdiv(hdim, block))](
        gw, gw.stride(0), h, h.stride(0), sorted_t, rows, hrows, ends, res.contiguous(), m, gw.shape[0], hdim,
        BLOCK_R=16 if cuda else 4, BLOCK_H=block, num_warps=4 if cuda else 1,
    )
