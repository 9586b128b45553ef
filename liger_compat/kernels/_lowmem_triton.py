"""Low-memory fused linear cross-entropy in Triton: no chunk of logits is ever stored.

Forward (:func:`lowmem_stats`): programs over (block of rows, share of the vocabulary) compute
each logits tile ``h[rows] @ W[cols].T`` over a loop on the hidden dimension, in fp32, apply
bias and softcap, and keep only per-row running statistics over their share of the columns:
max and sum of ``exp(z - max)`` (online log-sum-exp), argmax (first index on ties), the target
logit and the row sum (label smoothing). Each program writes those five numbers per row; a few
``[rows, shares]`` torch ops combine them into lse, loss, z-loss and the argmax hit.

Backward (:func:`lowmem_grads`): the same tiles are computed again, turned into
``scale_row * d loss / d logits`` from the saved lse, and multiplied straight away by the
weight tile (``grad_hidden``) and the hidden tile (``grad_weight``), added with atomics. The
targets' own entries ``p_t - 1`` are not part of the tiles: every tile adds its rows' softmax mass
outside the target, and a last small kernel adds ``-(that mass)`` times the target's weight row and
hidden row (exact where ``p_t`` is near 1, whatever tiles were left out).

Sparse backward (:data:`SKIP_EPS`, :data:`SKIP_SHARE`): the backward walks the vocabulary sorted by
each column's mean logit over the rows (``W @ mean(h)``, computed from the inputs), so that the
columns the rows all but rule out share tiles. A tile whose non-target softmax entries are all
below ``SKIP_EPS`` skips its two matmuls, unless one of its rows holds there more than
``SKIP_SHARE`` of that row's share of its non-target mass (a near-uniform softmax leaves out
nothing). What a left-out tile takes from ``grad_hidden`` is given back as its rows' left-out
gradient mass times the mean weight row of the run of :data:`MEAN_TILES` tiles (in that order) it
is in (one small matmul a group of rows, from a table of those means in the weight's dtype): the
part of the left-out gradient that all those columns share, which is most of it
(``benchmarks/skip_analysis.py`` measures both). ``grad_weight`` leaves those entries out;
``grad_bias`` keeps them. The first group is one block of rows, a probe that runs the sparse
kernel; the later groups go on with it while it has left out at least :data:`SPARSE_MIN_SHARE` of
the tiles so far, and with the dense one otherwise (decided on the device, with no host sync: both
kernels are launched and one returns at once), so that logits with nothing to leave out run the
dense kernel past the probe.

``grad_hidden`` is summed in an fp32 scratch of one group of rows at a time (at most
:data:`GH_SCRATCH_BYTES`), so every element is rounded to the output dtype once;
``grad_weight`` is added in its own dtype, in the output tensor itself; ``grad_bias`` in fp32
(``[V]``). Extra memory: the scratch, the per-share statistics, a few ``[rows]`` vectors, and for
the sparse backward the column order (int32 ``[V]``), the table of mean rows
(``[tiles / MEAN_TILES, H]``) and a ``[group, tiles / MEAN_TILES]`` fp32 table of left-out masses.

Rows are read through an index vector, so ignored rows can be left out of all the work.
Tile sizes come from :data:`CONFIGS`, picked by name with the ``config`` keyword (one name for
both kernels, or ``"FORWARD/BACKWARD"``). The default was checked by compiling both kernels for
sm_90 ahead of time (no register spills, pipelined loads); the wider tiles spill in the forward
kernel, and 128x256 backward tiles need fewer pipeline stages to fit in shared memory.
"""

from __future__ import annotations

import math

import torch

from ._ce_triton import _tanh
from ._dispatch import cdiv, tl, triton

__all__ = ["CONFIGS", "DEFAULT_CONFIG", "lowmem_stats", "lowmem_grads", "target_logits", "GH_SCRATCH_BYTES", "SKIP_EPS",
           "MEAN_TILES", "SPARSE_MIN_SHARE"]

#: name -> (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), for CUDA; the interpreter uses
#: small tiles (``"interpret"``) so that tests cover several tiles and ragged edges.
CONFIGS = {
    "m128n128k64w8s3": (128, 128, 64, 8, 3),
    "m128n128k64w8s4": (128, 128, 64, 8, 4),
    "m128n256k64w8s3": (128, 256, 64, 8, 3),
    "m64n256k64w8s3": (64, 256, 64, 8, 3),
    "m128n64k64w4s4": (128, 64, 64, 4, 4),
    "m128n256k32w8s4": (128, 256, 32, 8, 4),
    "m128n128k32w4s4": (128, 128, 32, 4, 4),
    "interpret": (16, 32, 16, 1, 1),
}
#: Measured over every configuration and three forward/backward pairs at the Llama-3-8B, Qwen2-7B and
#: Llama-3.2-1B heads (bf16, one H200 run, ``benchmarks.kernels --sections flce_lowmem --lowmem-configs
#: all``): 128 x 256 tiles with 32-wide K steps were fastest at all three (95-97 ms against 103-107 ms for
#: m128n128k64w8s3, the next best), in both kernels.
DEFAULT_CONFIG = "m128n256k32w8s4"
#: The fp32 scratch ``grad_hidden`` is summed in (rows per group = this / (4 * H)).
GH_SCRATCH_BYTES = 8 * 2**20
#: At most this many bytes of per-share statistics in the forward (5 fp32/int32 per row and share).
STATS_BYTES = 4 * 2**20

#: The sparse backward leaves out the matmuls of a tile whose non-target softmax entries are all
#: below this (0: every tile computed) and whose rows each hold at most :data:`SKIP_SHARE` of their
#: share of their non-target mass there. See the module's docstring for what replaces them.
SKIP_EPS = 2.0 ** -10
#: A tile of ``BN`` columns is left out only where each row's non-target mass in it is at most this
#: times ``BN / V`` of the row's whole non-target mass: the rows' mass is not spread over it as over
#: the rest of the vocabulary (a near-uniform softmax keeps every tile).
SKIP_SHARE = 0.5
#: times ``|lse| + 1``: the least non-target mass the sparse backward takes a row to have. The
#: backward reads a row's mass from its target logit (a sum of its own) beside the forward's lse:
#: their difference is good to ~1e-4 in bf16 at H = 4096, so that a row as peaked as that cannot
#: tell its tail from the noise. With this floor such rows stop keeping every tile of their block
#: (``benchmarks/skip_analysis.py`` at the Llama-3-8B head, trained-like, 1e-4..3e-4 of noise in
#: ``log p_t``: 58-60 % of tiles left out against 42-47 % with a floor at fp32's resolution, the
#: error the same); what a row left at the floor leaves out is below this share of its tile mass.
ROW_MASS_FLOOR = 2e-5
#: A left-out tile's gradient mass is given back times the mean weight row of the run of this
#: many consecutive tiles (in the column order) it is in: the columns the order puts together share
#: that row's large entries (``benchmarks/skip_analysis.py``: at the Llama-3-8B head, trained-like,
#: 7.64e-4 error with the tile's own mean row, 7.67e-4 with 8 tiles' and 16 tiles'), and the table
#: is that many times smaller.
MEAN_TILES = 8
#: The groups of rows after the first (one block of rows: the probe) run the sparse kernel while
#: at least this share of the tiles so far was left out, else the dense one (the sparse kernel
#: costs a few % more than the dense one where it leaves out nothing).
SPARSE_MIN_SHARE = 0.15
#: Tiles the latest :func:`lowmem_grads` call left out (int32 device tensor of one element).
last_skipped: torch.Tensor | None = None
#: Groups of rows of the latest :func:`lowmem_grads` call that ran the sparse kernel (int32
#: device tensor of one element; ``None`` where the sparse backward was off).
last_sparse_groups: torch.Tensor | None = None

_NUM_SMS: dict[int, int] = {}


def check_config(config: str | None) -> None:
    """``ValueError`` naming ``config`` unless it is ``None``, a name of :data:`CONFIGS`, or
    ``"FORWARD/BACKWARD"``: two names, one for each kernel."""
    if config is None:
        return
    parts = str(config).split("/")
    if len(parts) > 2 or any(p not in CONFIGS for p in parts):
        raise ValueError(f"config must be a name of {', '.join(CONFIGS)} or 'FORWARD/BACKWARD' of two, got {config!r}")


def _config(device: torch.device, config: str | None, backward: bool = False):
    check_config(config)
    if device.type != "cuda":
        name = "interpret"
    else:
        parts = (config or DEFAULT_CONFIG).split("/")
        name = parts[-1] if backward else parts[0]
    return CONFIGS[name]


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


@triton.jit
def _logits_tile(h_ptr, w_ptr, b_ptr, rows, mmask, offs_n, nmask, K, stride_h, stride_w, softcap,
                 HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """fp32 ``[BM, BN]`` tile of ``h[rows] @ W[offs_n].T (+ bias)`` and, with a softcap, the
    capped tile and ``tanh`` (else the tile twice)."""
    offs_k = tl.arange(0, BK)
    a_ptrs = h_ptr + rows[:, None] * stride_h + offs_k[None, :]
    b_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_w + offs_k[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=nmask[None, :], other=0.0)
        else:
            kmask = (k + offs_k) < K
            a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=nmask[None, :] & kmask[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    t = acc
    if HAS_SOFTCAP:
        t = _tanh(acc / softcap)
        acc = softcap * t
    return acc, t


@triton.jit
def _stats_kernel(h_ptr, w_ptr, b_ptr, t_ptr, idx_ptr, pm_ptr, ps_ptr, pi_ptr, pt_ptr, pz_ptr,
                  M, V, K, S, tiles_per_share, stride_h, stride_w, softcap,
                  HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                  IEEE: tl.constexpr, EVEN_K: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    pid_m = pid % num_m  # row blocks of one share side by side: they read the same weight tiles
    share = pid // num_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    mmask = offs_m < M
    rows = tl.load(idx_ptr + offs_m, mask=mmask, other=0).to(tl.int64)
    tgt = tl.load(t_ptr + rows, mask=mmask, other=-1).to(tl.int64)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    s_i = tl.zeros((BM,), tl.float32)
    a_i = tl.zeros((BM,), tl.int32)
    zt_i = tl.zeros((BM,), tl.float32)
    zs_i = tl.zeros((BM,), tl.float32)
    first = share * tiles_per_share
    last = tl.minimum(first + tiles_per_share, tl.cdiv(V, BN))
    for nt in range(first, last):
        offs_n = nt * BN + tl.arange(0, BN)
        nmask = offs_n < V
        z, _t = _logits_tile(h_ptr, w_ptr, b_ptr, rows, mmask, offs_n, nmask, K, stride_h, stride_w, softcap,
                             HAS_BIAS, HAS_SOFTCAP, IEEE, EVEN_K, BM, BN, BK)
        zm = tl.where(nmask[None, :], z, float("-inf"))
        tile_max = tl.max(zm, axis=1)
        # first column holding the tile's max (a min over indices: lighter than an argmax pair reduction)
        tile_arg = tl.min(tl.where(zm == tile_max[:, None], offs_n[None, :], 2147483647), axis=1)
        new_m = tl.maximum(m_i, tile_max)
        s_i = s_i * tl.exp(m_i - new_m) + tl.sum(tl.exp(zm - new_m[:, None]), axis=1)
        a_i = tl.where(tile_max > m_i, tile_arg, a_i)  # strictly greater: the first index wins ties
        m_i = new_m
        zt_i += tl.sum(tl.where(offs_n[None, :] == tgt[:, None], z, 0.0), axis=1)
        if HAS_SMOOTHING:
            zs_i += tl.sum(tl.where(nmask[None, :], z, 0.0), axis=1)
    out = offs_m.to(tl.int64) * S + share
    tl.store(pm_ptr + out, m_i, mask=mmask)
    tl.store(ps_ptr + out, s_i, mask=mmask)
    tl.store(pi_ptr + out, a_i, mask=mmask)
    tl.store(pt_ptr + out, zt_i, mask=mmask)
    if HAS_SMOOTHING:
        tl.store(pz_ptr + out, zs_i, mask=mmask)


@triton.jit
def _grads_kernel(h_ptr, w_ptr, b_ptr, t_ptr, idx_ptr, lse_ptr, scale_ptr, gh_ptr, gw_ptr, gb_ptr, cnt_ptr, rest_ptr,
                  order_ptr, mass_ptr, zt_ptr, gate_ptr, gate_min, groups_ptr, row0, M, V, K, stride_h, stride_w,
                  stride_gw, softcap, label_smoothing, lse_square_scale, skip_eps, skip_share, mass_floor, n_means,
                  HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                  HAS_ZLOSS: tl.constexpr, NEED_GH: tl.constexpr, NEED_GW: tl.constexpr, NEED_GB: tl.constexpr,
                  SKIP: tl.constexpr, GATED: tl.constexpr, MEAN_TILES: tl.constexpr, IEEE: tl.constexpr,
                  EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Rows ``row0 .. row0 + M`` of the (index) rows; ``gh_ptr`` is their fp32 scratch ``[M, K]``.
    ``SKIP``: the tiles walk the vocabulary in the order ``order_ptr`` gives, and a tile whose
    non-target softmax entries are all below ``skip_eps``, and whose non-target mass in each row is
    at most ``skip_share`` of the row's share (``BN / V`` of the row's non-target mass, from its
    target logit ``zt_ptr``, at least ``mass_floor * (|lse| + 1)``), is left out of the matmuls:
    its rows' gradient mass is added to ``mass_ptr`` (``[M, n_means]`` fp32, one column per
    ``MEAN_TILES`` tiles: the caller adds it times their mean weight row) and ``cnt_ptr`` counts it.
    ``GATED``: the kernel runs only if ``gate_ptr`` (a copy of the count) is at least ``gate_min``
    (the sparse kernel, which then counts the group in ``groups_ptr``), or only if it is below (the
    dense one). The targets' own entries are left to
    :func:`_target_grads_kernel`; ``rest_ptr`` sums each row's softmax mass outside its target."""
    if GATED:
        sparse = tl.load(gate_ptr) >= gate_min
        if SKIP:
            if not sparse:
                return
            if tl.program_id(0) == 0:
                tl.atomic_add(groups_ptr, 1, sem="relaxed")
        else:
            if sparse:
                return
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    pid_m = pid % num_m
    pid_n = pid // num_m
    local = pid_m * BM + tl.arange(0, BM)
    mmask = local < M
    offs_m = row0 + local
    rows = tl.load(idx_ptr + offs_m, mask=mmask, other=0).to(tl.int64)
    tgt = tl.load(t_ptr + rows, mask=mmask, other=-1).to(tl.int64)
    lse = tl.load(lse_ptr + offs_m, mask=mmask, other=0.0)
    sc = tl.load(scale_ptr + offs_m, mask=mmask, other=0.0)  # 0 for ignored / out-of-range rows
    pos = pid_n * BN + tl.arange(0, BN)
    nmask = pos < V
    if SKIP:
        offs_n = tl.load(order_ptr + pos, mask=nmask, other=0).to(tl.int64)
    else:
        offs_n = pos
    z, t = _logits_tile(h_ptr, w_ptr, b_ptr, rows, mmask, offs_n, nmask, K, stride_h, stride_w, softcap,
                        HAS_BIAS, HAS_SOFTCAP, IEEE, EVEN_K, BM, BN, BK)
    # the softmax outside the targets (0 there and outside the tile): the only tile kept from here
    p = tl.where(mmask[:, None] & nmask[None, :] & (offs_n[None, :] != tgt[:, None]), tl.exp(z - lse[:, None]), 0.0)
    # every tile, left out or not, adds its softmax mass outside the targets: the targets' entries
    # (_target_grads_kernel) are exact whatever is left out
    rest = tl.sum(p, axis=1)
    tl.atomic_add(rest_ptr + offs_m, rest, mask=mmask, sem="relaxed")
    keep = True
    if SKIP:
        live = mmask & (sc != 0.0)
        # the row's softmax mass outside its target, 1 - p_t as -expm1(log p_t), at least what fp32
        # resolves of it beside lse (the dense gradient of a peaked row is no more accurate)
        x = tl.minimum(tl.load(zt_ptr + offs_m, mask=mmask, other=0.0) - lse, 0.0)
        row_mass = tl.maximum(tl.where(x > -1e-3, -x * (1.0 + 0.5 * x), 1.0 - tl.exp(x)),
                              (tl.abs(lse) + 1.0) * mass_floor)
        # a row whose mass is spread over the vocabulary (near-uniform) keeps its tiles: there the
        # left-out entries' gradient is coherent within a tile, beyond what its mean row restores
        heavy = tl.max(tl.where(live & (rest > skip_share * row_mass * BN / V), 1, 0), axis=0)
        top = tl.max(tl.max(tl.where(live[:, None], p, 0.0), axis=1), axis=0)
        keep = (top >= skip_eps) | (heavy > 0)
        if not keep:
            tl.atomic_add(cnt_ptr, 1, sem="relaxed")
            # the left-out gradient entries are sc * p (times the softcap's derivative): no
            # smoothing or z-loss here (SKIP excludes them)
            if HAS_SOFTCAP:
                q = p * (1.0 - t * t)
                row_left = tl.sum(q, axis=1) * sc
            else:
                q = p
                row_left = rest * sc
            if NEED_GB:
                tl.atomic_add(gb_ptr + offs_n, tl.sum(q * sc[:, None], axis=0), mask=nmask, sem="relaxed")
            if NEED_GH:
                tl.atomic_add(mass_ptr + local.to(tl.int64) * n_means + pid_n // MEAN_TILES, row_left, mask=mmask,
                              sem="relaxed")
    if keep:
        _tile_grads(h_ptr, w_ptr, gh_ptr, gw_ptr, gb_ptr, p, t, rows, local, tgt, sc, offs_n, mmask, nmask, K, V,
                    stride_h, stride_w, stride_gw, label_smoothing, lse_square_scale, lse,
                    HAS_SOFTCAP, HAS_SMOOTHING, HAS_ZLOSS, NEED_GH, NEED_GW, NEED_GB, IEEE, BM, BN, BK)


@triton.jit
def _tile_means_kernel(w_ptr, order_ptr, mu_ptr, V, K, stride_w, SPAN: tl.constexpr, RB: tl.constexpr,
                       BK: tl.constexpr):
    """``mu[s, k]``: the mean (fp32 sum, stored in mu's dtype) of the weight rows
    ``order[s * SPAN .. s * SPAN + SPAN]`` (those below V) over columns ``k`` of one block of ``BK``."""
    tile = tl.program_id(0)
    kk = tl.program_id(1) * BK + tl.arange(0, BK)
    kmask = kk < K
    acc = tl.zeros((BK,), tl.float32)
    for r in range(0, SPAN, RB):
        pos = tile * SPAN + r + tl.arange(0, RB)
        pmask = pos < V
        cols = tl.load(order_ptr + pos, mask=pmask, other=0).to(tl.int64)
        wk = tl.load(w_ptr + cols[:, None] * stride_w + kk[None, :], mask=pmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.sum(wk.to(tl.float32), axis=0)
    count = tl.minimum(V - tile * SPAN, SPAN).to(tl.float32)
    tl.store(mu_ptr + tile.to(tl.int64) * K + kk, (acc / count).to(mu_ptr.dtype.element_ty), mask=kmask)


@triton.jit
def _add_left_out_kernel(gh_ptr, mass_ptr, mu_ptr, gate_ptr, gate_min, M, T, K, BR: tl.constexpr, BT: tl.constexpr,
                         BK: tl.constexpr):
    """``gh[r, k] += sum_t mass[r, t] * mu[t, k]`` for the ``M`` rows of a group: fp32 ``gh`` and
    ``mass`` (``[M, K]``, ``[M, T]``), ``mu`` ``[T, K]`` in the weight's dtype; products in tf32 on
    the GPU (an fp32 dot spills there), summed in fp32. Nothing where ``gate_ptr`` is below
    ``gate_min`` (the group ran the dense kernel: no mass)."""
    if tl.load(gate_ptr) < gate_min:
        return
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    kk = tl.program_id(1) * BK + tl.arange(0, BK)
    rmask = offs_r < M
    kmask = kk < K
    acc = tl.zeros((BR, BK), tl.float32)
    for t0 in range(0, T, BT):
        tt = t0 + tl.arange(0, BT)
        tmask = tt < T
        a = tl.load(mass_ptr + offs_r[:, None].to(tl.int64) * T + tt[None, :], mask=rmask[:, None] & tmask[None, :],
                    other=0.0)
        b = tl.load(mu_ptr + tt[:, None].to(tl.int64) * K + kk[None, :], mask=tmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        acc = tl.dot(a, b, acc)  # tf32 on the GPU: ~2^-11 of a correction that is a part of the gradient
    dst = gh_ptr + offs_r[:, None].to(tl.int64) * K + kk[None, :]
    msk = rmask[:, None] & kmask[None, :]
    tl.store(dst, tl.load(dst, mask=msk, other=0.0) + acc, mask=msk)


def column_order(h, w, b, idx, sc):
    """int32 ``[V]``: the vocabulary sorted by each column's mean logit over the index rows that get
    a gradient (``W @ mean(h) + b``; the softcap, monotone, left out), largest first. Two
    matrix-vector products and a sort; it only decides which columns share a tile."""
    wts = torch.zeros(h.shape[0], dtype=h.dtype, device=h.device)
    wts.index_copy_(0, idx, (sc != 0).to(h.dtype))
    hsum = (wts @ h).to(w.dtype)
    key = (w @ hsum).float()
    if b is not None:
        key = key + b.float() * (sc != 0).sum()
    return torch.argsort(key, descending=True).to(torch.int32)


def tile_means(w, order, span):
    """``[cdiv(V, span), H]`` in the weight's dtype: the mean weight row of each run of ``span``
    columns in ``order`` (summed in fp32)."""
    v, k = w.shape
    nmeans = cdiv(v, span)
    mu = torch.empty((nmeans, k), dtype=w.dtype, device=w.device)
    bk, rb = (16, 8) if w.device.type != "cuda" else (128, 32)
    _tile_means_kernel[(nmeans, cdiv(k, bk))](w, order, mu, v, k, w.stride(0), SPAN=span, RB=min(rb, span),
                                               BK=bk, num_warps=4)
    return mu


def add_left_out(gh, mass, mu, gate, gate_min):
    """``gh += mass @ mu`` in place, summed in fp32 (``gh`` fp32 ``[M, K]``, ``mass`` fp32
    ``[M, T]``, ``mu`` ``[T, K]``); nothing where the int32 device scalar ``gate`` is below
    ``gate_min``."""
    m, k = gh.shape
    t = mass.shape[1]
    br, bt, bk = (16, 16, 16) if gh.device.type != "cuda" else (64, 32, 64)
    _add_left_out_kernel[(cdiv(m, br), cdiv(k, bk))](gh, mass, mu, gate, int(gate_min), m, t, k, BR=br, BT=bt, BK=bk,
                                                     num_warps=4)


@triton.jit
def _tile_grads(h_ptr, w_ptr, gh_ptr, gw_ptr, gb_ptr, p, t, rows, local, tgt, sc, offs_n, mmask, nmask, K, V,
                stride_h, stride_w, stride_gw, label_smoothing, lse_square_scale, lse,
                HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr,
                NEED_GH: tl.constexpr, NEED_GW: tl.constexpr, NEED_GB: tl.constexpr, IEEE: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The tile's ``d loss / d logits`` from its softmax ``p`` (0 at the targets and outside the
    tile), multiplied by the weight tile into ``grad_hidden`` and by the hidden tile into
    ``grad_weight`` (atomics), summed into ``grad_bias``."""
    if HAS_ZLOSS:
        p = p * (1.0 + 2.0 * lse_square_scale * lse)[:, None]
    if HAS_SMOOTHING:
        p = p - label_smoothing / V
        # the target's entry is _target_grads_kernel's; nothing outside the tile
        p = tl.where(mmask[:, None] & nmask[None, :] & (offs_n[None, :] != tgt[:, None]), p, 0.0)
    d = p * sc[:, None]
    if HAS_SOFTCAP:
        d = d * (1.0 - t * t)
    if NEED_GB:
        tl.atomic_add(gb_ptr + offs_n, tl.sum(d, axis=0), mask=nmask, sem="relaxed")
    dd = d.to(h_ptr.dtype.element_ty)
    offs_k = tl.arange(0, BK)
    for k in range(0, K, BK):
        kk = k + offs_k
        kmask = kk < K
        if NEED_GH:
            wk = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_w + kk[None, :],
                         mask=nmask[:, None] & kmask[None, :], other=0.0)
            if IEEE:
                part = tl.dot(dd, wk, input_precision="ieee")
            else:
                part = tl.dot(dd, wk)
            tl.atomic_add(gh_ptr + local[:, None].to(tl.int64) * K + kk[None, :], part,
                          mask=mmask[:, None] & kmask[None, :], sem="relaxed")
        if NEED_GW:
            hk = tl.load(h_ptr + rows[:, None] * stride_h + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            if IEEE:
                part_w = tl.dot(tl.trans(dd), hk, input_precision="ieee")
            else:
                part_w = tl.dot(tl.trans(dd), hk)
            tl.atomic_add(gw_ptr + offs_n[:, None].to(tl.int64) * stride_gw + kk[None, :],
                          part_w.to(gw_ptr.dtype.element_ty), mask=nmask[:, None] & kmask[None, :], sem="relaxed")


@triton.jit
def _target_grads_kernel(h_ptr, w_ptr, t_ptr, idx_ptr, lse_ptr, scale_ptr, zt_ptr, rest_ptr, gh_ptr, gw_ptr, gb_ptr,
                         row0, M, V, K, stride_h, stride_w, stride_gw, softcap, label_smoothing, lse_square_scale,
                         HAS_SOFTCAP: tl.constexpr, NEED_GH: tl.constexpr, NEED_GW: tl.constexpr,
                         NEED_GB: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """The target entries of ``d loss / d logits`` (``p_t - 1`` formed as minus the row's softmax
    mass outside the target, which keeps its precision where ``p_t`` is near 1) times the target's
    weight row into ``grad_hidden`` (the group's fp32 scratch ``gh_ptr``) and times the hidden row
    into the target's ``grad_weight`` row, and into ``grad_bias``; rows ``row0 .. row0 + M``."""
    local = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_m = row0 + local
    mmask = local < M
    rows = tl.load(idx_ptr + offs_m, mask=mmask, other=0).to(tl.int64)
    tgt = tl.load(t_ptr + rows, mask=mmask, other=0).to(tl.int64)
    sc = tl.load(scale_ptr + offs_m, mask=mmask, other=0.0)
    ok = mmask & (sc != 0.0) & (tgt >= 0) & (tgt < V)
    tgt = tl.where(ok, tgt, 0)
    lse = tl.load(lse_ptr + offs_m, mask=mmask, other=0.0)
    rest = tl.load(rest_ptr + offs_m, mask=mmask, other=0.0)
    c = (-rest + (1.0 - rest) * 2.0 * lse_square_scale * lse + label_smoothing * (1.0 - 1.0 / V)) * sc
    if HAS_SOFTCAP:
        tt = tl.load(zt_ptr + offs_m, mask=mmask, other=0.0) / softcap
        c = c * (1.0 - tt * tt)
    c = tl.where(ok, c, 0.0)
    if NEED_GB:
        tl.atomic_add(gb_ptr + tgt, c, mask=ok, sem="relaxed")
    for k in range(0, K, BK):
        kk = k + tl.arange(0, BK)
        msk = ok[:, None] & (kk < K)[None, :]
        if NEED_GH:
            wt = tl.load(w_ptr + tgt[:, None] * stride_w + kk[None, :], mask=msk, other=0.0).to(tl.float32)
            dst = gh_ptr + local[:, None].to(tl.int64) * K + kk[None, :]
            tl.store(dst, tl.load(dst, mask=msk, other=0.0) + c[:, None] * wt, mask=msk)
        if NEED_GW:
            hr = tl.load(h_ptr + rows[:, None] * stride_h + kk[None, :], mask=msk, other=0.0).to(tl.float32)
            tl.atomic_add(gw_ptr + tgt[:, None] * stride_gw + kk[None, :], (c[:, None] * hr).to(gw_ptr.dtype.element_ty),
                          mask=msk, sem="relaxed")


@triton.jit
def _target_logits_kernel(h_ptr, w_ptr, b_ptr, t_ptr, idx_ptr, out_ptr, M, V, K, stride_h, stride_w, softcap,
                          HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """fp32 (capped) target logit of each index row; 0 for rows whose target is out of range."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    mmask = offs_m < M
    rows = tl.load(idx_ptr + offs_m, mask=mmask, other=0).to(tl.int64)
    tgt = tl.load(t_ptr + rows, mask=mmask, other=0).to(tl.int64)
    ok = mmask & (tgt >= 0) & (tgt < V)
    tgt = tl.where(ok, tgt, 0)
    acc = tl.zeros((BM,), tl.float32)
    for k in range(0, K, BK):
        kk = k + tl.arange(0, BK)
        msk = ok[:, None] & (kk < K)[None, :]
        a = tl.load(h_ptr + rows[:, None] * stride_h + kk[None, :], mask=msk, other=0.0).to(tl.float32)
        b = tl.load(w_ptr + tgt[:, None] * stride_w + kk[None, :], mask=msk, other=0.0).to(tl.float32)
        acc += tl.sum(a * b, axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + tgt, mask=ok, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        acc = softcap * _tanh(acc / softcap)
    tl.store(out_ptr + offs_m, tl.where(ok, acc, 0.0), mask=mmask)


def target_logits(h, w, b, target, idx, opt):
    """fp32 ``[M]``: the (softcapped) logit of each index row's target (0 where out of range)."""
    m = idx.numel()
    out = torch.empty(m, dtype=torch.float32, device=h.device)
    if m:
        bm, bk = (16, 16) if h.device.type != "cuda" else (16, 128)
        _target_logits_kernel[(cdiv(m, bm),)](
            h, w, b if b is not None else h, target, idx, out, m, w.shape[0], h.shape[1], h.stride(0), w.stride(0),
            opt.softcap if opt.softcap is not None else 1.0, HAS_BIAS=b is not None,
            HAS_SOFTCAP=opt.softcap is not None, BM=bm, BK=bk, num_warps=4)
    return out


def _shares(mblocks: int, ntiles: int, sms: int, most: int) -> tuple[int, int]:
    """How many shares of the vocabulary's tiles the statistics kernel splits each block of rows
    into, and tiles per share: at least ~4 programs per SM, at most ``most`` shares, and of the
    counts up to 4x that the one whose last wave of programs (one per SM: the kernel uses the
    whole register file) is fullest."""
    lo = max(1, min(ntiles, most, cdiv(4 * sms, mblocks)))
    best = None
    for want in range(lo, max(lo, min(ntiles, most, 4 * lo)) + 1):
        per = cdiv(ntiles, want)
        shares = cdiv(ntiles, per)
        programs = mblocks * shares
        fill = programs / (cdiv(programs, sms) * sms)
        if best is None or fill > best[0] + 1e-9:
            best = (fill, shares, per)
    return best[1], best[2]


def _launch(kernel, grid, args, stages, **kw):
    """``kernel[grid](*args, num_stages=stages, **kw)``; where the GPU's shared memory is too
    small for that many pipeline stages, again with fewer."""
    while True:
        try:
            return kernel[grid](*args, num_stages=stages, **kw)
        except Exception as exc:  # triton.runtime.errors.OutOfResources
            if type(exc).__name__ != "OutOfResources" or stages <= 1:
                raise
            stages -= 1


def _flags(h, w, b, opt, bk):
    return dict(
        HAS_BIAS=b is not None, HAS_SOFTCAP=opt.softcap is not None,
        HAS_SMOOTHING=opt.label_smoothing != 0.0, IEEE=h.dtype == torch.float32,
        EVEN_K=h.shape[1] % bk == 0,
    )


def lowmem_stats(h, w, b, target, idx, opt, *, config: str | None = None):
    """Per index row ``idx[i]`` of ``h [N, H]``: ``(lse, target logit, row sum, argmax)`` of its
    logits (fp32; argmax int64; the row sum is 0 without label smoothing). ``target`` is ``[N]``,
    ``idx`` int32/int64 ``[M]``."""
    m = idx.numel()
    v, k = w.shape
    dev = h.device
    f32 = torch.float32
    bm, bn, bk, warps, stages = _config(dev, config)
    ntiles = cdiv(v, bn)
    mblocks = cdiv(max(m, 1), bm)
    shares, per = _shares(mblocks, ntiles, _num_sms(dev), max(1, STATS_BYTES // (20 * max(m, 1))))
    pm = torch.empty((m, shares), dtype=f32, device=dev)
    ps = torch.empty_like(pm)
    pt = torch.empty_like(pm)
    pz = torch.zeros_like(pm) if opt.label_smoothing != 0.0 else pm
    pi = torch.empty((m, shares), dtype=torch.int32, device=dev)
    if m:
        args = (h, w, b if b is not None else h, target, idx, pm, ps, pi, pt, pz,
                m, v, k, shares, per, h.stride(0), w.stride(0), opt.softcap if opt.softcap is not None else 1.0)
        _launch(_stats_kernel, (mblocks * shares,), args, stages, BM=bm, BN=bn, BK=bk, num_warps=warps,
                **_flags(h, w, b, opt, bk))
    gmax = pm.max(dim=1).values if m else pm.new_zeros(0)
    lse = gmax + torch.log((ps * torch.exp(pm - gmax[:, None])).sum(dim=1))
    big = torch.iinfo(torch.int32).max
    arg = torch.where(pm == gmax[:, None], pi, torch.full_like(pi, big)).min(dim=1).values.long() if m else pi.new_zeros(0).long()
    zt = pt.sum(dim=1)
    zsum = pz.sum(dim=1) if opt.label_smoothing != 0.0 else torch.zeros_like(zt)
    return lse, zt, zsum, arg


def lowmem_grads(h, w, b, target, idx, lse, scale, opt, grads, *, config: str | None = None,
                 scratch_bytes: int | None = None, skip_eps: float | None = None):
    """``(grad_hidden, grad_weight, grad_bias)`` (``None`` where ``grads`` says not needed) of
    ``sum_i scale[i] * loss(row idx[i])``; ``lse`` and ``scale`` fp32 ``[M]`` (scale 0 for rows
    that get no gradient). Rows not in ``idx`` get zero ``grad_hidden``.

    ``skip_eps`` (default :data:`SKIP_EPS`; 0 turns it off): the sparse backward of the module's
    docstring, a (row block, vocabulary tile) pair whose non-target softmax entries are all below
    it is left out of the gradient matmuls; the targets' own entries are always added (a separate
    kernel). Without label smoothing and z-loss only. :data:`last_skipped` counts such tiles of
    the latest call, :data:`last_sparse_groups` the groups of rows that ran the sparse kernel
    (device tensors)."""
    global last_skipped, last_sparse_groups
    need_gh, need_gw, need_gb = grads
    n, k = h.shape
    v = w.shape[0]
    m = idx.numel()
    dev = h.device
    bm, bn, bk, warps, stages = _config(dev, config, backward=True)
    gh = torch.zeros_like(h) if need_gh else None
    gw = torch.zeros_like(w) if need_gw else None
    gb = torch.zeros(v, dtype=torch.float32, device=dev) if need_gb else None
    if m == 0 or not (need_gh or need_gw or need_gb):
        return gh, gw, (gb.to(b.dtype) if gb is not None else None)
    flags = _flags(h, w, b, opt, bk)
    ntiles = cdiv(v, bn)
    skip_eps = SKIP_EPS if skip_eps is None else float(skip_eps)
    skip = skip_eps > 0.0 and opt.label_smoothing == 0.0 and opt.lse_square_scale == 0.0
    nmeans = cdiv(ntiles, MEAN_TILES)
    zt = target_logits(h, w, b, target, idx, opt) if (skip or opt.softcap is not None) else lse
    if skip:  # before the scratch: the sort's temporaries are gone when it is allocated
        order = column_order(h, w, b, idx, scale)
        mu = tile_means(w, order, MEAN_TILES * bn) if need_gh else None
    else:
        order = mu = None
    scratch_bytes = GH_SCRATCH_BYTES if scratch_bytes is None else scratch_bytes
    group = max(bm, scratch_bytes // (4 * k) // bm * bm)
    group = min(group, cdiv(m, bm) * bm)
    scratch = torch.empty((group, k), dtype=torch.float32, device=dev) if need_gh else None
    mass = torch.empty((group, nmeans), dtype=torch.float32, device=dev) if skip and need_gh else None
    whole = m == n  # idx is then every row in order
    rest = torch.zeros(m, dtype=torch.float32, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    last_skipped = counter
    # the count of left-out tiles as a group starts: after the first group (one block of rows, the
    # probe) the sparse kernel goes on while it is at least SPARSE_MIN_SHARE of the tiles so far
    gate = torch.zeros(1, dtype=torch.int32, device=dev) if skip else counter
    last_sparse_groups = torch.zeros(1, dtype=torch.int32, device=dev) if skip else None
    tiles_done = 0
    starts = [0] + list(range(bm, m, group)) if skip else list(range(0, m, group))
    for gi, row0 in enumerate(starts):
        rows = (starts[gi + 1] if gi + 1 < len(starts) else m) - row0
        gate_min = math.ceil(SPARSE_MIN_SHARE * tiles_done)
        if skip:
            if row0 > 0:
                gate.copy_(counter)
        if scratch is not None:
            scratch.zero_()
        if mass is not None:
            mass.zero_()
        args = (h, w, b if b is not None else h, target, idx, lse, scale,
                scratch if scratch is not None else h, gw if gw is not None else h, gb if gb is not None else lse,
                counter, rest, order if order is not None else idx, mass if mass is not None else lse, zt, gate,
                gate_min, last_sparse_groups if skip else counter, row0, rows, v, k, h.stride(0), w.stride(0),
                gw.stride(0) if gw is not None else 0,
                opt.softcap if opt.softcap is not None else 1.0, opt.label_smoothing, opt.lse_square_scale, skip_eps,
                float(SKIP_SHARE), float(ROW_MASS_FLOOR), nmeans)
        grid = (cdiv(rows, bm) * ntiles,)
        common = dict(HAS_ZLOSS=opt.lse_square_scale != 0.0, NEED_GH=need_gh, NEED_GW=need_gw, NEED_GB=need_gb,
                      MEAN_TILES=MEAN_TILES, BM=bm, BN=bn, BK=bk, num_warps=warps, **flags)
        if skip:  # both kernels; the gate lets one of them run
            _launch(_grads_kernel, grid, args, stages, SKIP=True, GATED=True, **common)
            if row0 > 0:
                _launch(_grads_kernel, grid, args, stages, SKIP=False, GATED=True, **common)
        else:
            _launch(_grads_kernel, grid, args, stages, SKIP=False, GATED=False, **common)
        tiles_done += cdiv(rows, bm) * ntiles
        tbm, tbk = (16, 16) if dev.type != "cuda" else (16, 128)
        _target_grads_kernel[(cdiv(rows, tbm),)](
            h, w, target, idx, lse, scale, zt, rest, scratch if scratch is not None else h,
            gw if gw is not None else h, gb if gb is not None else lse,
            row0, rows, v, k, h.stride(0), w.stride(0), gw.stride(0) if gw is not None else 0,
            opt.softcap if opt.softcap is not None else 1.0, opt.label_smoothing, opt.lse_square_scale,
            HAS_SOFTCAP=opt.softcap is not None, NEED_GH=need_gh, NEED_GW=need_gw, NEED_GB=need_gb,
            BM=tbm, BK=tbk, num_warps=4)
        if scratch is not None:
            part = scratch[:rows]
            if mass is not None:
                # what the left-out tiles took from grad_hidden: their gradient mass x mean weight row
                add_left_out(part, mass[:rows], mu, gate, gate_min)
            if whole:
                gh[row0:row0 + rows].copy_(part)
            else:
                gh.index_copy_(0, idx[row0:row0 + rows].long(), part.to(gh.dtype))
    return gh, gw, (gb.to(b.dtype) if gb is not None else None)
