"""Block-sparse gradient matmuls of the chunked fused loss, in Triton.

The chunked mode stores each chunk's ``d loss / d logits`` (``d``, ``[C, V]``) and multiplies it
by the weight (``grad_hidden = d @ W``) and by the chunk's hidden rows (``grad_weight += d.T @ h``).
In a trained-like softmax most of ``d`` is negligible, but not in whole columns or rows: the
entries worth computing are scattered over the (block of rows, vocabulary tile) grid, and only
once the vocabulary is sorted by each column's mean logit (:func:`column_order`: the columns every
row rules out then share tiles) do whole tiles of negligible entries appear. So the sparse chunk
runs on the sorted vocabulary: the caller computes the chunk's logits against the sorted weight
``Ws = W[order]`` and maps each target to its sorted position, and then

* :func:`tile_filter_stats` leaves a (block of ``BM`` rows, tile of ``BN`` columns) pair out where
  every non-target softmax entry is below ``skip_eps`` and no row holds there more than
  ``skip_share`` of its share (``BN / V``) of its softmax mass outside the target (the low-memory
  backward's rule, ``_lowmem_triton``), from per (row, tile) maxima and sums the row kernel wrote
  as it formed ``d``; a left-out pair's gradient mass is added per row to a table with one column
  per run of ``MEAN_TILES`` tiles (:func:`tile_filter` applies the same rule reading ``d`` itself);
* :func:`sparse_grad_hidden`: per block of rows, ``d @ Ws`` over the kept tiles only, plus that
  mass times the mean weight row of its run (what the left-out entries share: most of their
  product), plus the fp32 target term the caller passes (``d_t * W[target]``), rounded once;
* :func:`sparse_grad_weight`: per tile, ``d.T @ h`` over the kept blocks of rows only, plus each
  target's own entry ``d_t * h`` (from fp32 ``d_t``, so exact whatever is left out), added to the
  natural-order rows ``order[...]`` of ``grad_weight`` in its dtype (one rounding a chunk, as the
  dense chunk's ``addmm``) or into an fp32 buffer.

The targets' entries of ``d`` must be zero (the row kernel writes them as zero in this mode and
hands over ``d_t`` in fp32): they are the two matmuls' last terms instead, never left out.

Which chunks run so (:func:`probe`, :class:`SparseChunks`): the pass's first chunk runs dense, and
its first block of rows, gathered into the sorted order, goes through :func:`tile_filter` (one
host read of the count); only where that leaves out :data:`SPARSE_MIN_SHARE` of the pairs are the
weight sorted and copied and the later chunks run sparse, so that a near-uniform softmax costs the
sort key and the probe alone.
"""

from __future__ import annotations

import torch

from ._dispatch import cdiv, next_pow2, tl, triton
from ._lowmem_triton import MEAN_TILES, ROW_MASS_FLOOR, SKIP_EPS, SKIP_SHARE

__all__ = ["CONFIGS", "tile_filter", "tile_filter_stats", "sparse_grad_hidden", "sparse_grad_weight", "tile_lists",
           "probe", "SparseChunks", "SKIP_EPS", "SKIP_SHARE", "ROW_MASS_FLOOR", "MEAN_TILES"]

#: The filter's tile (BM rows, BN columns: the low-memory backward's, so that the two modes leave
#: out the same pairs) and the matmuls' blocks: grad_hidden (BH output columns of H, BK columns of
#: V a step), grad_weight (BNW output rows, a part of a tile; BHW columns of H; BKR rows a step),
#: warps and pipeline stages of each, and whether the programs that share a list (one block of rows,
#: one part of a tile) run side by side over the blocks of H (they then read their gradient block
#: from L2 rather than memory: 8-13 % faster). CUDA: the fastest of 13 configurations of grad_hidden
#: and 14 of grad_weight on one 4096-row chunk of the Llama-3-8B head, trained-like
#: (``benchmarks/sparse_grads_profile.py``, one H200): five pipeline stages, 10-14 % faster than four
#: or three.
CONFIGS = {
    "cuda": dict(BM=128, BN=256, BH=128, BK=64, gh_warps=4, gh_stages=5, gh_h_first=True, BNW=128, BHW=128, BKR=64,
                 gw_warps=4, gw_stages=5, gw_h_first=True),
    "interpret": dict(BM=16, BN=32, BH=16, BK=16, gh_warps=1, gh_stages=1, gh_h_first=False, BNW=16, BHW=16, BKR=16,
                      gw_warps=1, gw_stages=1, gw_h_first=True),
}
# The low-memory backward's rule and constants (``_lowmem_triton``): a pair is left out only where
# every non-target entry is below SKIP_EPS times the row's scale and each row's non-target mass in
# it is at most SKIP_SHARE times ``BN / V`` of the row's own, counted as at least ROW_MASS_FLOOR times
# ``|lse| + 1``; a left-out pair's mass is given back times the mean weight row of MEAN_TILES tiles.

def supported(h: torch.Tensor, w: torch.Tensor) -> bool:
    """The matmuls read through tensor descriptors (TMA on Hopper): a 16-bit float type (on the
    interpreter fp16: its bf16 ``tl.dot`` is not exact), rows 16-byte aligned (V and H multiples of
    8), Triton with host-side descriptors and on CUDA compute capability 9.0+
    (``_logits_triton.supported``, whose conditions these are), and a vocabulary of a tile or more."""
    from ._logits_triton import supported as logits_supported

    # (the row kernel's blocks of V hold whole tiles from one tile's width on)
    return logits_supported(h, w) and w.shape[0] >= config_for(w.device)["BN"]


def _desc(t: torch.Tensor, block):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, list(block))


def config_for(device: torch.device) -> dict:
    return CONFIGS["cuda" if device.type == "cuda" else "interpret"]


@triton.jit
def _decide(top, tile_mass, live, rest_ptr, lse_ptr, offs_m, mmask, skip_eps, skip_share, mass_floor, V,
            BN: tl.constexpr):
    """Whether a (block of rows, tile) pair is kept: its largest non-target softmax entry ``top``
    reaches ``skip_eps``, or a live row holds there more than ``skip_share`` of its share
    (``BN / V``) of its mass outside the target (``rest``, at least ``mass_floor * (|lse| + 1)``)."""
    rest = tl.load(rest_ptr + offs_m, mask=mmask, other=0.0)
    lse = tl.load(lse_ptr + offs_m, mask=mmask, other=0.0)
    row_mass = tl.maximum(rest, (tl.abs(lse) + 1.0) * mass_floor)
    heavy = tl.max(tl.where(live & (tile_mass > skip_share * row_mass * BN / V), 1, 0), axis=0)
    return (top >= skip_eps) | (heavy > 0)


@triton.jit
def _filter_stats_kernel(tq_ptr, ts_ptr, sc_ptr, rest_ptr, lse_ptr, keep_ptr, mass_ptr, cnt_ptr, C, V, T, n_means,
                         skip_eps, skip_share, mass_floor, MEAN_TILES: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr):
    """:func:`_filter_kernel`'s decision from the row kernel's per (row, tile) largest entry and sum
    of the softmax outside the target (``tq``, ``ts``: fp32 ``[C, T]``) instead of the tile itself."""
    pid = tl.program_id(0)
    t = pid % T
    rb = pid // T
    offs_m = rb * BM + tl.arange(0, BM)
    mmask = offs_m < C
    sc = tl.load(sc_ptr + offs_m, mask=mmask, other=0.0)
    live = mmask & (sc != 0.0)
    at = offs_m.to(tl.int64) * T + t
    top = tl.max(tl.load(tq_ptr + at, mask=live, other=0.0), axis=0)
    tile_mass = tl.load(ts_ptr + at, mask=live, other=0.0)
    keep = _decide(top, tile_mass, live, rest_ptr, lse_ptr, offs_m, mmask, skip_eps, skip_share, mass_floor, V, BN)
    tl.store(keep_ptr + pid, keep.to(tl.int32))
    if not keep:
        tl.atomic_add(cnt_ptr, 1, sem="relaxed")
        tl.atomic_add(mass_ptr + offs_m.to(tl.int64) * n_means + t // MEAN_TILES, tile_mass * sc, mask=mmask,
                      sem="relaxed")


def tile_filter_stats(tq, ts, sc, rest, lse, mass, counter, v):
    """:func:`tile_filter` of a chunk over a vocabulary of ``v`` from the row kernel's tile
    statistics (``ce_rows_triton(sparse=...)``: ``tq``, ``ts`` fp32 ``[C, T]``)."""
    c, t = tq.shape
    cfg = config_for(tq.device)
    bm = cfg["BM"]
    rb = cdiv(c, bm)
    keep = torch.empty((rb, t), dtype=torch.int32, device=tq.device)
    _filter_stats_kernel[(rb * t,)](tq, ts, sc, rest, lse, keep, mass, counter, c, v, t, mass.shape[1],
                                    float(SKIP_EPS), float(SKIP_SHARE), float(ROW_MASS_FLOOR), MEAN_TILES=MEAN_TILES,
                                    BM=bm, BN=cfg["BN"], num_warps=4 if tq.device.type == "cuda" else 1)
    return keep


@triton.jit
def _filter_kernel(d_ptr, stride_d, sc_ptr, rest_ptr, lse_ptr, keep_ptr, mass_ptr, cnt_ptr, C, V, T, n_means,
                   skip_eps, skip_share, mass_floor, MEAN_TILES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """One (block of rows, tile) pair: ``keep[rb, t]`` = 1 or 0; where 0, each row's sum of ``d``
    over the tile is added to ``mass[row, t // MEAN_TILES]`` and ``cnt`` counts the pair."""
    pid = tl.program_id(0)
    t = pid % T
    rb = pid // T
    offs_m = rb * BM + tl.arange(0, BM)
    mmask = offs_m < C
    cols = t * BN + tl.arange(0, BN)
    cmask = cols < V
    sc = tl.load(sc_ptr + offs_m, mask=mmask, other=0.0)
    live = mmask & (sc != 0.0)
    d = tl.load(d_ptr + offs_m[:, None].to(tl.int64) * stride_d + cols[None, :],
                mask=live[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    # the softmax entry (times the softcap's derivative) from the gradient entry and the row's scale
    q = d / tl.where(live, sc, 1.0)[:, None]
    keep = _decide(tl.max(tl.max(q, axis=1), axis=0), tl.sum(q, axis=1), live, rest_ptr, lse_ptr, offs_m, mmask,
                   skip_eps, skip_share, mass_floor, V, BN)
    tl.store(keep_ptr + pid, keep.to(tl.int32))
    if not keep:
        tl.atomic_add(cnt_ptr, 1, sem="relaxed")
        tl.atomic_add(mass_ptr + offs_m.to(tl.int64) * n_means + t // MEAN_TILES, tl.sum(d, axis=1), mask=mmask,
                      sem="relaxed")


def tile_filter(d, sc, rest, lse, mass, counter):
    """``keep`` int32 ``[cdiv(C, BM), cdiv(V, BN)]`` for the chunk's gradient ``d [C, V]`` (sorted
    vocabulary, targets' entries zero); ``sc`` fp32 ``[C]`` (0: the row has no gradient), ``rest``
    its softmax mass outside the target, ``lse``; adds left-out mass to ``mass`` (fp32
    ``[C, cdiv(T, MEAN_TILES)]``, zeroed by the caller) and their count to ``counter``."""
    c, v = d.shape
    cfg = config_for(d.device)
    bm, bn = cfg["BM"], cfg["BN"]
    rb, t = cdiv(c, bm), cdiv(v, bn)
    keep = torch.empty((rb, t), dtype=torch.int32, device=d.device)
    _filter_kernel[(rb * t,)](d, d.stride(0), sc, rest, lse, keep, mass, counter, c, v, t, mass.shape[1],
                              float(SKIP_EPS), float(SKIP_SHARE), float(ROW_MASS_FLOOR), MEAN_TILES=MEAN_TILES,
                              BM=bm, BN=bn, num_warps=8 if d.device.type == "cuda" else 1)
    return keep


@triton.jit
def _lists_kernel(keep_ptr, by_rows_ptr, cnt_rows_ptr, by_tiles_ptr, cnt_tiles_ptr, RB, T,
                  BT: tl.constexpr, BR: tl.constexpr):
    """Programs ``0 .. RB``: a block of rows' kept tiles in order and their count; the next ``T``:
    a tile's kept blocks of rows. Entries past the count are left as they were."""
    pid = tl.program_id(0)
    if pid < RB:
        tt = tl.arange(0, BT)
        m = tt < T
        k = tl.load(keep_ptr + pid * T + tt, mask=m, other=0)
        tl.store(by_rows_ptr + pid * T + tl.cumsum(k, 0) - k, tt, mask=m & (k != 0))
        tl.store(cnt_rows_ptr + pid, tl.sum(k, 0))
    else:
        tile = pid - RB
        rr = tl.arange(0, BR)
        rm = rr < RB
        kr = tl.load(keep_ptr + rr * T + tile, mask=rm, other=0)
        tl.store(by_tiles_ptr + tile * RB + tl.cumsum(kr, 0) - kr, rr, mask=rm & (kr != 0))
        tl.store(cnt_tiles_ptr + tile, tl.sum(kr, 0))


def tile_lists(keep):
    """From ``keep [RB, T]``: per block of rows its kept tiles, in order (``[RB, T]`` int32; the
    entries past the count unset) and their count, and per tile its kept blocks of rows
    (``[T, RB]``) and count. One launch, no host sync."""
    rb, t = keep.shape
    dev = keep.device
    by_rows = torch.empty((rb, t), dtype=torch.int32, device=dev)
    by_tiles = torch.empty((t, rb), dtype=torch.int32, device=dev)
    cnt_rows = torch.empty(rb, dtype=torch.int32, device=dev)
    cnt_tiles = torch.empty(t, dtype=torch.int32, device=dev)
    _lists_kernel[(rb + t,)](keep, by_rows, cnt_rows, by_tiles, cnt_tiles, rb, t, BT=next_pow2(t), BR=next_pow2(rb),
                             num_warps=4 if dev.type == "cuda" else 1)
    return by_rows, cnt_rows, by_tiles, cnt_tiles


@triton.jit
def _grad_hidden_kernel(d_desc, ws_desc, list_ptr, cnt_ptr, mass_ptr, mu_ptr, fix_ptr, stride_fix,
                        out_ptr, orow_ptr, stride_o, C, H, T, n_means,
                        HAS_MASS: tl.constexpr, HAS_FIX: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                        H_FIRST: tl.constexpr):
    # H_FIRST: the programs of one block of rows (one list of tiles) side by side, else those of
    # one block of H columns (the same weight columns)
    rb = tl.program_id(1) if H_FIRST else tl.program_id(0)
    offs_m = rb * BM + tl.arange(0, BM)
    mmask = offs_m < C
    off_h = (tl.program_id(0) if H_FIRST else tl.program_id(1)) * BH
    offs_h = off_h + tl.arange(0, BH)
    hmask = offs_h < H
    steps: tl.constexpr = BN // BK
    n = tl.load(cnt_ptr + rb) * steps
    acc = tl.zeros((BM, BH), tl.float32)
    for j in range(0, n):
        col = tl.load(list_ptr + rb * T + j // steps) * BN + (j % steps) * BK
        a = d_desc.load([rb * BM, col])  # tensor descriptors: out-of-range rows and columns read as 0
        b = ws_desc.load([col, off_h])
        acc = tl.dot(a, b, acc)
    if HAS_MASS:  # the left-out pairs: their rows' mass times the mean weight row of their run
        for t0 in range(0, n_means, BT):
            tt = t0 + tl.arange(0, BT)
            tmask = tt < n_means
            ms = tl.load(mass_ptr + offs_m[:, None].to(tl.int64) * n_means + tt[None, :],
                         mask=mmask[:, None] & tmask[None, :], other=0.0)
            mu = tl.load(mu_ptr + tt[:, None].to(tl.int64) * H + offs_h[None, :],
                         mask=tmask[:, None] & hmask[None, :], other=0.0).to(tl.float32)
            acc = tl.dot(ms, mu, acc)  # tf32 on the GPU: ~2^-11 of a correction that is a part of the gradient
    msk = mmask[:, None] & hmask[None, :]
    if HAS_FIX:
        acc += tl.load(fix_ptr + offs_m[:, None].to(tl.int64) * stride_fix + offs_h[None, :], mask=msk, other=0.0)
    orow = tl.load(orow_ptr + offs_m, mask=mmask, other=0).to(tl.int64)
    tl.store(out_ptr + orow[:, None] * stride_o + offs_h[None, :], acc.to(out_ptr.dtype.element_ty), mask=msk)


def sparse_grad_hidden(d, ws, by_rows, cnt_rows, mass, mu, fix, out, out_rows, *, cfg=None):
    """``out[out_rows[i]] = (d @ ws)[i]`` over the kept tiles, plus ``mass @ mu`` (``mu``: the
    mean row of each run of :data:`MEAN_TILES` tiles of ``ws``; both may be ``None``) and
    ``fix`` (fp32 ``[C, H]`` or ``None``), summed in fp32 and rounded once to ``out``'s dtype."""
    c, v = d.shape
    h = ws.shape[1]
    cfg = cfg or config_for(d.device)
    bm, bn, bh, bk = cfg["BM"], cfg["BN"], cfg["BH"], cfg["BK"]
    t = by_rows.shape[1]
    has_mass = mass is not None
    h_first = bool(cfg["gh_h_first"])
    grid = (cdiv(h, bh), cdiv(c, bm)) if h_first else (cdiv(c, bm), cdiv(h, bh))
    _grad_hidden_kernel[grid](
        _desc(d, [bm, bk]), _desc(ws, [bk, bh]), by_rows, cnt_rows, mass if has_mass else fix, mu if has_mass else d,
        fix if fix is not None else d, fix.stride(0) if fix is not None else 0, out, out_rows, out.stride(0),
        c, h, t, mass.shape[1] if has_mass else 0, HAS_MASS=has_mass, HAS_FIX=fix is not None,
        BM=bm, BN=bn, BH=bh, BK=bk, BT=16, H_FIRST=h_first, num_warps=cfg["gh_warps"], num_stages=cfg["gh_stages"])


@triton.jit
def _grad_weight_kernel(d_desc, h_desc, h_ptr, stride_h, list_ptr, cnt_ptr, trow_ptr, tstart_ptr, tpos_ptr, dt_ptr,
                        order_ptr, gw_ptr, stride_gw, C, V, H, RB,
                        BM: tl.constexpr, BN: tl.constexpr, BNW: tl.constexpr, BH: tl.constexpr,
                        BKR: tl.constexpr, BTR: tl.constexpr, H_FIRST: tl.constexpr):
    # H_FIRST: the programs of one part of a tile (one list of row blocks, the same gradient columns)
    # side by side, else those of one block of H columns
    sub_n: tl.constexpr = BN // BNW
    pid = tl.program_id(1) if H_FIRST else tl.program_id(0)
    hb = tl.program_id(0) if H_FIRST else tl.program_id(1)
    tile = pid // sub_n
    base = tile * BN + (pid % sub_n) * BNW
    pos = base + tl.arange(0, BNW)
    pmask = pos < V
    offs_h = hb * BH + tl.arange(0, BH)
    hmask = offs_h < H
    steps: tl.constexpr = BM // BKR
    n = tl.load(cnt_ptr + tile) * steps
    t_lo = tl.load(tstart_ptr + tile)
    t_hi = tl.load(tstart_ptr + tile + 1)
    if (n == 0) & (t_hi == t_lo):
        return  # nothing of this chunk reaches these rows of grad_weight
    acc = tl.zeros((BNW, BH), tl.float32)
    off_h = hb * BH
    for j in range(0, n):
        r0 = tl.load(list_ptr + tile * RB + j // steps) * BM + (j % steps) * BKR
        a = d_desc.load([r0, base])  # [BKR, BNW]; out-of-range rows and columns read as 0
        b = h_desc.load([r0, off_h])
        acc = tl.dot(a.T, b, acc)
    # the targets in these columns: d_t * h as a one-hot product, d_t in fp32 (hi + lo parts in 16 bits)
    for j0 in range(t_lo, t_hi, BTR):
        jj = j0 + tl.arange(0, BTR)
        jm = jj < t_hi
        r = tl.load(trow_ptr + jj, mask=jm, other=0).to(tl.int64)
        col = tl.load(tpos_ptr + r, mask=jm, other=-1).to(tl.int64) - base
        dt = tl.load(dt_ptr + r, mask=jm, other=0.0)
        e = tl.where((tl.arange(0, BNW)[:, None] == col[None, :]) & jm[None, :], dt[None, :], 0.0)
        hr = tl.load(h_ptr + r[:, None] * stride_h + offs_h[None, :], mask=jm[:, None] & hmask[None, :], other=0.0)
        hi = e.to(hr.dtype)
        lo = (e - hi.to(tl.float32)).to(hr.dtype)
        acc = tl.dot(hi, hr, acc)
        acc = tl.dot(lo, hr, acc)
    rows = tl.load(order_ptr + pos, mask=pmask, other=0).to(tl.int64)
    dst = gw_ptr + rows[:, None] * stride_gw + offs_h[None, :]
    msk = pmask[:, None] & hmask[None, :]
    acc += tl.load(dst, mask=msk, other=0.0).to(tl.float32)
    tl.store(dst, acc.to(gw_ptr.dtype.element_ty), mask=msk)


def sparse_grad_weight(d, hc, by_tiles, cnt_tiles, tpos, dt, order, gw, *, cfg=None):
    """``gw[order[j]] += (d.T @ hc)[j]`` over the kept blocks of rows, plus each row's target entry
    ``dt`` (fp32 ``[C]``, at sorted column ``tpos``; rows without a target: ``tpos`` out of
    ``[0, V)``) times its hidden row (16-bit ``d`` and ``hc``; ``gw`` in their dtype or fp32)."""
    c, v = d.shape
    h = hc.shape[1]
    cfg = cfg or config_for(d.device)
    bm, bn, bnw, bh, bkr = cfg["BM"], cfg["BN"], cfg["BNW"], cfg["BHW"], cfg["BKR"]
    t = by_tiles.shape[0]
    # the chunk's rows grouped by their target's tile (rows without one last): a start per tile
    tile_of = torch.where((tpos >= 0) & (tpos < v), tpos // bn, t)
    srt, trow = torch.sort(tile_of, stable=True)
    tstart = torch.searchsorted(srt, torch.arange(t + 1, device=d.device, dtype=srt.dtype)).to(torch.int32)
    h_first = bool(cfg["gw_h_first"])
    grid = (cdiv(h, bh), t * (bn // bnw)) if h_first else (t * (bn // bnw), cdiv(h, bh))
    _grad_weight_kernel[grid](
        _desc(d, [bkr, bnw]), _desc(hc, [bkr, bh]), hc, hc.stride(0), by_tiles, cnt_tiles, trow.to(torch.int32), tstart,
        tpos, dt, order, gw, gw.stride(0), c, v, h, by_tiles.shape[1], BM=bm, BN=bn, BNW=bnw, BH=bh, BKR=bkr, BTR=16,
        H_FIRST=h_first, num_warps=cfg["gw_warps"], num_stages=cfg["gw_stages"])


#: The later chunks run sparse only where the probe (the first chunk's first block of rows) left
#: out at least this share of its pairs; the pass runs dense otherwise.
SPARSE_MIN_SHARE = 0.15
#: The latest sparse pass's ``(left-out pairs, pairs tested)``: an int32 device tensor of one
#: element (read it when needed: no host sync here) and an int.
last_pairs: tuple[torch.Tensor, int] | None = None
#: The share of pairs the latest probe left out (a float; None before any).
last_probe: float | None = None


def _order(h, w, target, opt):
    """The vocabulary sorted by mean logit over the rows that get a gradient, and its inverse."""
    from ._lowmem_triton import column_order

    n, v, dev = h.shape[0], w.shape[0], h.device
    order = column_order(h, w, None, torch.arange(n, device=dev), (target != opt.ignore_index).to(torch.float32))
    inv = torch.empty(v, dtype=torch.int64, device=dev)
    inv[order.long()] = torch.arange(v, device=dev)
    return order, inv


def _live_scale(tc, sc, opt, v):
    """fp32 ``[C]``: each row's scale where it gets a gradient, else 0."""
    live = (tc != opt.ignore_index) & (tc >= 0) & (tc < v)
    sc = sc.float()
    return torch.where(live, sc if sc.dim() else sc.expand(tc.shape[0]), torch.zeros((), dtype=sc.dtype,
                                                                                      device=tc.device)).contiguous()


def probe(h, w, target, opt, grads, d, tc, sc, lse, *, rows):
    """After the first (dense) chunk: its first block of rows' gradient ``d`` (natural order, as the
    row kernel wrote it) gathered into the sorted order, its targets' entries zeroed, through the
    same filter as the sparse chunks (one host read of the count). A :class:`SparseChunks` for the
    later chunks where it left out at least :data:`SPARSE_MIN_SHARE` of its pairs, else None."""
    global last_probe
    v = w.shape[0]
    order, inv = _order(h, w, target, opt)
    pr = min(config_for(d.device)["BM"], d.shape[0])
    sub = d[:pr].index_select(1, order.long())
    tcp = tc[:pr]
    scp = _live_scale(tcp, sc if sc.dim() == 0 else sc[:pr], opt, v)
    tpos = inv[tcp.clamp(0, v - 1).long()]
    sub.scatter_(1, tpos[:, None], torch.zeros((pr, 1), dtype=sub.dtype, device=sub.device))
    rest = sub.float().sum(1) / torch.where(scp != 0, scp, torch.ones((), device=scp.device))
    counter = torch.zeros(1, dtype=torch.int32, device=d.device)
    mass = torch.zeros((pr, cdiv(cdiv(v, config_for(d.device)["BN"]), MEAN_TILES)), dtype=torch.float32,
                       device=d.device)
    keep = tile_filter(sub, scp, rest.contiguous(), lse[:pr].contiguous(), mass, counter)
    last_probe = int(counter.item()) / keep.numel()  # a host sync
    if last_probe < SPARSE_MIN_SHARE:
        return None
    return SparseChunks(h, w, target, opt, rows, grads, order=(order, inv))


class SparseChunks:
    """The state of a chunked pass whose later chunks run their gradient matmuls block-sparse: the
    vocabulary's order (``_lowmem_triton.column_order``, over the rows that get a gradient), its
    inverse, the sorted weight ``ws`` (a copy: ``[V, H]`` more memory while the pass runs), the mean
    row of each run of :data:`MEAN_TILES` tiles, and per-chunk buffers (:meth:`buffers`)."""

    def __init__(self, h, w, target, opt, rows, grads, *, order=None):
        from ._lowmem_triton import tile_means

        global last_pairs
        dev = h.device
        self.cfg = cfg = config_for(dev)
        self.v, self.opt = w.shape[0], opt
        self.need_gh, self.need_gw = bool(grads[0]), bool(grads[1])
        self.order, self.inv = order if order is not None else _order(h, w, target, opt)
        self.ws = w.index_select(0, self.order)
        self.mu = tile_means(w, self.order, MEAN_TILES * cfg["BN"]) if self.need_gh else None
        self.counter = torch.zeros(1, dtype=torch.int32, device=dev)
        self.tested = 0
        self.buffers(rows)
        last_pairs = (self.counter, 0)

    def buffers(self, rows):
        """Per-chunk buffers for chunks of up to ``rows`` rows."""
        dev, f32 = self.ws.device, torch.float32
        t = cdiv(self.v, self.cfg["BN"])
        self.mass = torch.empty((rows, cdiv(t, MEAN_TILES)), dtype=f32, device=dev)
        self.dt = torch.empty(rows, dtype=f32, device=dev)
        self.rest = torch.empty(rows, dtype=f32, device=dev)
        self.tq = torch.empty((rows, t), dtype=f32, device=dev)
        self.ts = torch.empty((rows, t), dtype=f32, device=dev)

    def sorted_targets(self, tc):
        """Each target's position in the sorted vocabulary (``ignore_index`` and out-of-range
        values as they are: the row kernel ignores or reports them)."""
        ok = (tc >= 0) & (tc < self.v)
        return torch.where(ok, self.inv[tc.clamp(0, self.v - 1).long()].to(tc.dtype), tc)

    def row_buffers(self, c):
        """``(dt, rest, tq, ts, BN)`` for the row kernel's ``sparse=``: the chunk's fp32 target
        entries, softmax mass outside the target (zeroed: the kernel adds to it), and per (row, tile
        of BN columns) the largest and the summed softmax entry outside the target."""
        return self.dt[:c], self.rest[:c].zero_(), self.tq[:c], self.ts[:c], self.cfg["BN"]

    def grads(self, d, hc, tpos, tc, sc, lse, fix, gh, gw, out_rows, start):
        """The chunk's two gradient matmuls from its gradient ``d`` (sorted columns, targets' entries
        zero; the row kernel has filled :meth:`row_buffers`): ``gh`` rows ``out_rows`` (or ``start``
        onwards) written, ``gw`` added to."""
        c = d.shape[0]
        sc_rows = _live_scale(tc, sc, self.opt, self.v)
        mass = self.mass[:c].zero_()
        keep = tile_filter_stats(self.tq[:c], self.ts[:c], sc_rows, self.rest[:c], lse, mass, self.counter, self.v)
        self.tested += keep.numel()
        by_rows, cnt_rows, by_tiles, cnt_tiles = tile_lists(keep)
        if self.need_gw:
            tpos_live = torch.where(sc_rows != 0, tpos, torch.full_like(tpos, -1))
            sparse_grad_weight(d, hc, by_tiles, cnt_tiles, tpos_live, self.dt[:c], self.order, gw)
        if self.need_gh:
            if out_rows is None:
                out_rows = torch.arange(start, start + c, device=d.device)
            sparse_grad_hidden(d, self.ws, by_rows, cnt_rows, mass, self.mu, fix, gh, out_rows)

    def finish(self):
        global last_pairs
        last_pairs = (self.counter, self.tested)
        self.ws = self.mu = self.mass = self.tq = self.ts = None
