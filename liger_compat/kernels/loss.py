"""Cross-entropy and fused linear cross-entropy (the LM-head loss without ``[N, V]`` logits).

``fused_linear_cross_entropy(hidden, weight, target)`` is the loss of ``hidden @ weight.T (+ bias)``
computed chunk by chunk over the rows: each chunk's logits are produced by one matmul (on the
GPU a Triton GEMM that also writes per-tile row statistics, ``_logits_triton.py``), one
row kernel turns them *in place* into the gradient of the loss with respect to them (while
computing log-sum-exp, loss, z-loss, argmax for token accuracy and the softcap), and two more
matmuls turn that into the chunk's ``grad_hidden`` rows and its share of ``grad_weight``. Only
one chunk of logits ever exists. For a scalar loss the gradients are therefore computed in the
forward pass and only scaled by ``grad_output`` in backward; for ``reduction="none"`` the
backward recomputes the chunks with the per-row ``grad_output``.

The row kernel has two implementations behind the one dispatch point
(:func:`liger_compat.kernels._dispatch.choose`): the Triton kernel in ``_ce_triton.py`` and the
torch reference :func:`ce_rows_torch` here. Gemma 2/3 final-logit softcapping, label smoothing,
z-loss (``lse_square_scale * lse**2``, PaLM) and ``num_items_in_batch`` (transformers' gradient
accumulation fix, 4.46) are options of both.

A second mode stores no logits at all (``_lowmem_triton.py``): the forward keeps per-row
statistics only and the backward computes the logits tiles again, for about a third more matmul
work: an 8 MiB scratch, per-row vectors and the sparse backward's tables (tile means and column
order: 5-10 MiB at 128k-256k vocabularies) instead of a chunk of logits. Which mode runs
is ``LIGER_COMPAT_FLCE_MODE`` (:func:`flce_mode_for`): ``auto`` takes the chunked mode unless one
chunk would not fit in the GPU's free memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import _config
from . import _checks, _dispatch, _device_errors, _graphs
from .errors import DimensionError, OptionRangeError, ShapeMismatchError, TargetOutOfRangeError

__all__ = ["fused_linear_cross_entropy", "cross_entropy", "CrossEntropyOutput"]

#: Rows per chunk on an accelerator. Each chunk reads the weight twice and reads+writes the bf16
#: grad_weight once (~4*V*H*2 bytes) for 6*rows*H*V flop, so that fixed traffic is the same
#: share of the time at every head for a given number of rows; ~1000 rows are needed before the
#: three matmuls set the time. 2048 rows (rather than a fixed 512 MiB, which gave 1664 rows at
#: Qwen2's vocabulary and 1024 at Gemma-2's) made those heads 4-8 % faster and faster than
#: torch.compile at all four heads measured (NOTES.md, "2048-row default"). The chunk's logits (``rows * V * 2`` bytes in
#: bf16) are capped at FLCE_CHUNK_MB_MAX_DEFAULT MiB; a gathered copy of the chunk's hidden rows
#: (``rows * H * 2``, 16 MiB at 2048 x 4096) comes on top when targets are ignored.
FLCE_CHUNK_ROWS_DEFAULT = 2048
FLCE_CHUNK_MB_MAX_DEFAULT = 1024
#: ``LIGER_COMPAT_FLCE_CHUNK_MB`` (:func:`liger_compat._config.flce_chunk_mib`; unset: the rows
#: default above): the size of one chunk's logits in MiB instead, i.e. speed against memory.
#: Measured at the Llama-3-8B head: 62 -> under 64 MiB extra (248 rows, ~1.75x the time);
#: 256 -> 1024 rows, ~1.1x the time (NOTES.md, "62 MiB setting" and "512 MiB default").


#: The same for the torch reference on CPU (fp32 logits plus a few temporaries of that size).
FLCE_CHUNK_BYTES_CPU = 8 * 2**20


class CrossEntropyOutput(NamedTuple):
    """Returned when ``return_z_loss`` or ``return_token_accuracy`` is set.

    ``z_loss`` and ``token_accuracy`` are detached diagnostics (the z-loss is already part of
    ``loss``); each is ``None`` unless asked for. Token accuracy is the fraction of non-ignored
    positions whose argmax equals the target (0 when every position is ignored); with
    ``reduction="none"`` both are per position.
    """

    loss: torch.Tensor
    z_loss: torch.Tensor | None
    token_accuracy: torch.Tensor | None


@dataclass(frozen=True)
class CEOptions:
    ignore_index: int = -100
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0
    softcap: float | None = None


# --------------------------------------------------------------------------------------------
# the row kernel, torch reference
# --------------------------------------------------------------------------------------------


def target_logits_torch(head: tuple, tgt: torch.Tensor) -> torch.Tensor:
    """Each row's raw target logit in fp32 from ``head`` = (hidden rows, weight, bias or None):
    the torch reference of ``_ce_triton._target_logit``."""
    hh, hw, hb = head
    zt = (hh.float() * hw.index_select(0, tgt).float()).sum(-1)
    return zt if hb is None else zt + hb.index_select(0, tgt).float()


def ce_rows_torch(
    logits: torch.Tensor,
    target: torch.Tensor,
    opt: CEOptions,
    *,
    scale: torch.Tensor | None = None,
    grad: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    bad: torch.Tensor | None = None,
    head: tuple | None = None,
):
    """Reference for the row kernel on ``logits[C, V]``.

    Without ``lse``: returns ``(loss, z_loss, lse, correct)`` per row (fp32; ``loss`` includes the
    z-loss; ignored rows give 0, rows whose target is outside ``[0, V)`` and not ignored NaN) and
    adds those targets to ``bad`` (``_device_errors.new_flag``) when given. With ``grad``: writes
    ``scale * d loss_row / d logits`` into ``grad`` (which may be ``logits`` itself; zero for
    ignored and out-of-range rows); ``scale`` is a 0-d or ``[C]`` fp32 tensor. ``head`` =
    ``(hidden rows, weight, bias or None)`` of the fused loss: the statistics then take each target
    logit in fp32 from them instead of its stored (rounded) value, which sets the lse of a row
    whose target has nearly all the probability (``_ce_triton._exact_target``).
    """
    C, V = logits.shape
    valid = target != opt.ignore_index
    in_range = (target >= 0) & (target < V)
    tgt = torch.where(valid & in_range, target, torch.zeros_like(target)).long()
    z = logits.float()
    t = None
    if opt.softcap is not None:
        t = torch.tanh(z / opt.softcap)
        z = t * opt.softcap
    z_exact = None
    if lse is None and head is not None:
        zt_raw = target_logits_torch(head, tgt)
        if opt.softcap is not None:
            zt_raw = opt.softcap * torch.tanh(zt_raw / opt.softcap)
        z_exact = z.scatter(1, tgt[:, None], zt_raw[:, None])  # out of place: z may be logits itself
    eps = opt.label_smoothing
    s = opt.lse_square_scale
    stats = None
    if lse is None:
        ze = z if z_exact is None else z_exact
        lse = torch.logsumexp(ze, dim=-1)
        zt = ze.gather(1, tgt[:, None]).squeeze(1)
        loss = lse - (1.0 - eps) * zt
        if eps:
            loss = loss - eps * z.mean(dim=-1)
        zl = s * lse * lse
        loss = loss + zl
        zero = torch.zeros((), dtype=torch.float32, device=z.device)
        loss = torch.where(valid, loss, zero)
        loss = torch.where(valid & ~in_range, torch.full_like(loss, math.nan), loss)
        zl = torch.where(valid, zl, zero)
        correct = (z.argmax(dim=-1) == tgt) & valid
        stats = (loss, zl, lse, correct)
        if bad is not None and C:
            oob = valid & ~in_range
            t64 = target.long()
            bad[0] += oob.sum()
            bad[1] = torch.maximum(bad[1], torch.where(oob & (t64 >= V), t64, 0).max())
            bad[2] = torch.minimum(bad[2], torch.where(oob & (t64 < 0), t64, 0).min())
    if grad is not None:
        d = torch.exp(z - lse[:, None])
        # the target's entry p_t - 1 as minus the softmax mass outside it (precise where p_t is near 1)
        d.scatter_(1, tgt[:, None], 0.0)
        rest = d.sum(dim=1)
        if s:
            d = d * (1.0 + 2.0 * s * lse)[:, None]
        if eps:
            d = d - eps / V
        d_t = -rest + (1.0 - rest) * 2.0 * s * lse + eps * (1.0 - 1.0 / V)
        d.scatter_(1, tgt[:, None], d_t[:, None])
        row = (valid & in_range).float()
        if scale is not None:
            row = row * scale.float()
        d = d * row[:, None]
        if t is not None:
            d = d * (1.0 - t * t)
        grad.copy_(d)
    return stats


def _ce_rows(backend: str, *args, **kwargs):
    if backend == "triton":
        from ._ce_triton import ce_rows_triton

        return ce_rows_triton(*args, **kwargs)
    return ce_rows_torch(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# argument checks
# --------------------------------------------------------------------------------------------


def _check_options(label_smoothing, lse_square_scale, softcap, reduction, num_items_in_batch):
    _checks.reduction(reduction)
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise OptionRangeError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if float(lse_square_scale) < 0.0:
        raise ValueError(f"lse_square_scale must be >= 0, got {lse_square_scale}")
    if softcap is not None and not float(softcap) > 0.0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap}")
    if num_items_in_batch is not None and reduction == "none":
        raise ValueError("num_items_in_batch divides a summed loss; it cannot be used with reduction='none'")


def _check_target(target, rows_shape, name_of_rows: str):
    _checks.tensor("target", target)
    _checks.integer_target("target", target)
    rows_shape = tuple(rows_shape)
    n = math.prod(rows_shape)
    if tuple(target.shape) != rows_shape and not (target.dim() == 1 and target.numel() == n):
        raise ShapeMismatchError(
            f"target has shape {tuple(target.shape)} but {name_of_rows} needs {rows_shape} (or a flat [{n}])"
        )


def _check_target_options(target, rows_shape, name_of_rows: str, shift_target, empty_mean) -> None:
    """:func:`_check_target` and the causal-LM options (``shift_target``, ``empty_mean``) of the
    fused losses; a shifted target must have the rows' shape exactly (no flat form: a sequence is
    its last dimension)."""
    if not isinstance(shift_target, bool):
        raise ValueError(f"shift_target must be True or False, got {shift_target!r}")
    if empty_mean not in ("zero", "nan"):
        raise ValueError(f"empty_mean must be 'zero' or 'nan', got {empty_mean!r}")
    _check_target(target, rows_shape, name_of_rows)
    if shift_target and (target.dim() == 0 or tuple(target.shape) != tuple(rows_shape)):
        raise ShapeMismatchError(
            f"with shift_target=True target must have {name_of_rows}'s leading shape {tuple(rows_shape)} "
            f"(sequences of at least one dimension), got {tuple(target.shape)}"
        )


def _reduction_scale(target, opt, reduction, num_items_in_batch, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(number of non-ignored rows, the factor that turns summed row losses into the loss)."""
    n_valid = (target != opt.ignore_index).sum()
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            n = num_items_in_batch.to(device=device, dtype=torch.float32)
        else:
            # filled on the device: torch.tensor(x, device=cuda) would copy from pageable memory (a sync)
            n = torch.full((), float(num_items_in_batch), dtype=torch.float32, device=device)
        return n_valid, 1.0 / n
    if reduction == "mean":
        return n_valid, n_valid.clamp(min=1).reciprocal()  # an integer's reciprocal is float32
    return n_valid, torch.ones((), dtype=torch.float32, device=device)


def _finish(loss_rows, zl_rows, correct, n_valid, scale, reduction, target_shape, want_z, want_acc):
    if reduction == "none":
        loss = loss_rows.view(target_shape)
        z = zl_rows.view(target_shape) if want_z else None
        acc = correct.float().view(target_shape) if want_acc else None
    else:
        loss = loss_rows.sum() * scale
        z = zl_rows.sum() * scale if want_z else None
        acc = correct.sum() / n_valid.clamp(min=1) if want_acc else None  # true division: float32
    return loss, z, acc


def next_token_targets(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The flat targets of ``shift_target=True``: row ``t`` of each sequence (``target``'s last
    dimension) is scored against ``target[..., t + 1]``, each sequence's last row against nothing
    (``ignore_index``), as transformers' causal-LM loss shifts its labels."""
    return torch.nn.functional.pad(target, (0, 1), value=ignore_index)[..., 1:].reshape(-1)


def _nan_if_empty(loss: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    """``empty_mean="nan"``: the mean over no labelled row is NaN (0 / 0, as ``cross_entropy``'s)
    instead of 0; the gradients stay zero (every row is ignored)."""
    return torch.where(n_valid > 0, loss, float("nan"))


def _forward_tail(ctx, stats, n_valid, scale, reduction, want_z, want_acc):
    """The loss Functions' outputs from per-row ``stats`` = (loss, z-loss, hit): the loss as
    ``reduction`` asks, then z-loss and token accuracy, ``None`` where not asked for (no launch
    for an output nobody reads; neither is differentiable)."""
    loss_rows, zl_rows, correct = stats
    loss, z, acc = _finish(loss_rows, zl_rows, correct, n_valid, scale, reduction, (loss_rows.shape[0],), want_z,
                           want_acc)
    extra = [t for t in (z, acc) if t is not None]
    if extra:
        ctx.mark_non_differentiable(*extra)
    return loss, z, acc


def _backward_tail(grads_of, g_loss, reduction, scale, n_inputs):
    """The loss Functions' gradients: ``grads_of(row_scale)`` for the first inputs, where
    ``row_scale`` weighs each row's loss (``grad_output`` per row, ``[N]``, for
    ``reduction="none"``, else the 0-d ``grad_output * scale``), and None for the rest of the
    ``n_inputs``."""
    g = g_loss.float()
    row_scale = g.reshape(-1) if reduction == "none" else (g * scale).reshape(())
    grads = tuple(grads_of(row_scale))
    return grads + (None,) * (n_inputs - len(grads))


# --------------------------------------------------------------------------------------------
# fused linear cross-entropy
# --------------------------------------------------------------------------------------------


def _chunk_rows(n: int, v: int, h: int, elem: int, backend: str, device: torch.device) -> int:
    if device.type == "cpu":
        rows = FLCE_CHUNK_BYTES_CPU // (4 * v)
    else:
        mib = _config.flce_chunk_mib()
        if mib is None:
            cap = min(FLCE_CHUNK_ROWS_DEFAULT, FLCE_CHUNK_MB_MAX_DEFAULT * 2**20 // (elem * v))
        else:
            cap = int(mib * 2**20) // (elem * v)
        # whole 128-row matmul tiles where that costs no extra chunk (1040 rows = 8 tiles + 16
        # rows was 3-8 % slower than 1024, NOTES.md, "128-row tiles"), else a multiple of 8
        tiles = cap // 128 * 128
        if tiles and _dispatch.cdiv(n, tiles) == _dispatch.cdiv(n, cap):
            rows = tiles
        else:
            rows = cap // 8 * 8 if cap >= 16 else cap
    return int(max(1, min(n, rows)))


#: How the GPU path computes each chunk's logits: ``"cublas"`` (``torch.mm``, then a Triton pass
#: over the logits for the row statistics), ``"triton"`` (``_logits_triton``: a Triton GEMM whose
#: epilogue writes those statistics, wherever its tensor descriptors apply and there is no bias)
#: or ``"auto"``: the Triton GEMM except with softcap, whose tanh in the epilogue made it slower
#: than cuBLAS plus the pass (NOTES.md, "logits GEMM epilogue"). ``LIGER_COMPAT_FLCE_LOGITS`` sets it
#: (:func:`liger_compat._config.flce_logits`); ``logits_impl=`` of :func:`fused_linear_cross_entropy` overrides it.
#:
#: ``compact_ignored``: skip ignore_index rows on the Triton path. That needs their count on the
#: host, one host sync a call, which a host-bound step pays for in full; without it every row is
#: computed and ignored rows get zero gradient rows from the row kernel, as native's logits cost
#: them too. The pass sorts the kept rows first and reads their count once the logits GEMM of its
#: first chunk's first :data:`FIRST_GEMM_ROWS` rows is queued (:func:`_kept_rows_first`), so the GPU
#: is not left idle while the host waits; where fewer rows are kept than that, that GEMM also computes
#: the ignored rows behind them (the rest of the chunk's work takes the kept rows only). With ``sparse_grads`` or
#: ``LIGER_COMPAT_FLCE_FP32_GRAD_WEIGHT``, whose buffers are sized by the count, it is read first
#: (``nonzero``), which drains the GPU's queue. ``None`` (the default) decides by the work:
#: rows x vocabulary x hidden of at least :data:`COMPACT_MIN_MACS` (a loss of several ms on an
#: H100, where the skipped rows' matmuls outweigh the sync; the Llama-3-8B head measured 37.2 ms
#: with every row computed against 35.4 compacted at 10 % ignored) compacts, anything smaller
#: (a host-bound small step) makes no sync. True / False force it. Under
#: ``torch.compile`` the sync happens inside the custom op's real implementation, where the tracer
#: does not see it; while a CUDA graph is captured all rows are computed instead.
#:
#: ``ce_variant``: the Triton cross-entropy kernel's launch layout (``_ce_triton.CE_KERNEL_VARIANTS``).


class FlceKnobs(NamedTuple):
    """How the fused loss's Triton path runs, checked at :func:`fused_linear_cross_entropy`
    (the defaults are the fastest measured; the benchmarks compare the others)."""

    logits_impl: str = "auto"
    compact_ignored: bool = False
    ce_variant: str = "split"
    #: block-sparse gradient matmuls over the sorted vocabulary (:func:`_sparse_ok`); the eager
    #: path only (the custom ops for ``torch.compile`` take the first three knobs)
    sparse_grads: bool = False


#: rows x vocabulary x hidden from which ``compact_ignored=None`` compacts ignored rows (2^40: the
#: Llama-3-8B head at 8192 rows is 4.3e12, a 2 x 1024-token step of a 128k-vocabulary, 1024-hidden
#: model 2.7e11)
COMPACT_MIN_MACS = 2**40


def compact_for(n: int, v: int, hdim: int, compact_ignored: bool | None) -> bool:
    """Whether a fused loss of ``n`` rows compacts its ignored rows: ``compact_ignored``, or when
    None whether ``n * v * hdim`` reaches :data:`COMPACT_MIN_MACS`."""
    if compact_ignored is None:
        return n * v * hdim >= COMPACT_MIN_MACS
    return compact_ignored


DEFAULT_KNOBS = FlceKnobs()
_CE_VARIANTS = ("split", "row")  # the same as _ce_triton.CE_KERNEL_VARIANTS (kept here: Triton is optional)


def _knobs(logits_impl, compact_ignored, ce_variant) -> FlceKnobs:
    """The keyword arguments of the entry point, checked (``logits_impl=None``: the setting;
    ``compact_ignored`` already resolved by :func:`compact_for`); ``sparse_grads`` is off here, the
    entry point sets it (``_replace``) where it applies."""
    impl = _config.flce_logits() if logits_impl is None else _config.check_flce_logits(logits_impl, "logits_impl")
    if not isinstance(compact_ignored, bool):
        raise ValueError(f"compact_ignored must be True, False or None, got {compact_ignored!r}")
    if ce_variant not in _CE_VARIANTS:
        raise ValueError(f"ce_variant must be one of {', '.join(_CE_VARIANTS)}, got {ce_variant!r}")
    return FlceKnobs(impl, compact_ignored, ce_variant)


def _sparse_chunks():
    from . import _sparse_grads_triton

    return _sparse_grads_triton


def _sparse_chunk_rows(rows: int, v: int, elem: int, device: torch.device) -> int:
    """Rows of a block-sparse chunk: twice the dense chunk's (its grad_weight matmul's inner
    dimension is the chunk's rows, and each chunk reads and writes grad_weight once), within
    :data:`FLCE_CHUNK_MB_MAX_DEFAULT` of logits on a GPU, unless ``LIGER_COMPAT_FLCE_CHUNK_MB``
    sets the chunk."""
    if device.type != "cuda":
        return 2 * rows
    if _config.flce_chunk_mib() is not None:
        return rows
    cap = FLCE_CHUNK_MB_MAX_DEFAULT * 2**20 // (elem * v) // 128 * 128
    return max(rows, min(2 * rows, cap))


def _sparse_ok(backend, h, w, b, opt, grads, n) -> bool:
    """Whether a chunked pass can run its gradient matmuls block-sparse (``_sparse_grads_triton``):
    the Triton path with tensor descriptors (``_sparse_grads_triton.supported``), a gradient of
    hidden or weight and none of a bias, no label smoothing or z-loss (their gradient is dense by
    definition), some rows, and not while a CUDA graph is captured (the pass reads the first
    chunk's count on the host)."""
    return (backend == "triton" and b is None and opt.label_smoothing == 0.0 and opt.lse_square_scale == 0.0
            and (grads[0] or grads[1]) and not grads[2] and n > 0 and not _capturing(h.device)
            and _sparse_chunks().supported(h, w))


def _capturing(device: torch.device) -> bool:
    """A CUDA graph is being captured (``torch.compile(mode="reduce-overhead")``): no host sync then."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class _KeptCount:
    """A row count made on the device, read on the host later: on CUDA copied without blocking
    into pinned memory behind an event, so that :meth:`read` waits for the GPU up to where it was
    counted only, not for the work queued after it (as ``nonzero`` or ``.item()`` would)."""

    __slots__ = ("_host", "_event")

    def __init__(self, count: torch.Tensor):
        self._event = None
        if count.device.type == "cuda":
            self._host = torch.empty((), dtype=count.dtype, pin_memory=True)
            self._host.copy_(count, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(count.device))
        else:
            self._host = count

    def read(self) -> int:
        if self._event is not None:
            self._event.synchronize()
        return int(self._host)


def _kept_rows_first(target: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, _KeptCount]:
    """Every row's index, the kept rows' (target != ``ignore_index``) first in their order, and
    their count, still to be read. The compacting pass takes its first chunk from the front of this
    order and queues the logits GEMM of that chunk's first rows before it reads the count: the GPU then has work
    while the host waits, where counting first (``nonzero``) drained its queue. Any prefix of the
    order that holds every kept row is a correct set of rows to compute (an ignored row's loss
    and gradient are zero), so the count only says where to stop."""
    ignored = target == ignore_index
    order = torch.argsort(ignored.to(torch.uint8), stable=True)
    return order, _KeptCount(target.numel() - ignored.sum())


_FP32_ACCUMULATE: dict[str, bool] = {}


def _fp32_accumulate_supported(device: torch.device) -> bool:
    """Whether ``torch.addmm(..., out_dtype=torch.float32)`` takes 16-bit operands into an fp32
    result on ``device`` (CUDA in torch >= 2.8; not on CPU)."""
    if device.type not in _FP32_ACCUMULATE:
        try:
            a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
            c = torch.zeros(2, 2, dtype=torch.float32, device=device)
            torch.addmm(c, a, a, out_dtype=torch.float32, out=c)  # no host sync: may run in a CUDA graph capture
            ok = True
        except (TypeError, RuntimeError, NotImplementedError):
            ok = False
        _FP32_ACCUMULATE[device.type] = ok
    return _FP32_ACCUMULATE[device.type]


def _target_fix_mode(backend: str, h: torch.Tensor, device: torch.device) -> str | None:
    """How the chunked pass adds the exact-target correction to grad_hidden (``_ce_triton``'s
    ``target_fix``): ``"out_dtype"`` (cuBLAS sums ``d @ W`` in fp32 onto it, torch >= 2.8 on CUDA; as
    fast as the bf16 product at the 8B, Qwen2-7B, Gemma-2 and small heads, ``benchmarks/results/
    gh_gemm.md``), ``"float"`` (the Triton interpreter on CPU: the same sum from fp32 copies), or None
    (the torch reference, CPU's path, left as it was; fp32 inputs, whose entries are not rounded; a GPU
    without the fp32-output product: the target entry stays as stored). In a peaked row (``p_t`` near 1) the target's term is
    nearly all of the row's grad_hidden, and the bf16 rounding of its entry was most of the error."""
    if backend != "triton" or h.element_size() >= 4:
        return None
    if device.type == "cpu":
        return "float"
    return "out_dtype" if _fp32_accumulate_supported(device) else None


def _target_terms():
    from . import _target_terms_triton

    return _target_terms_triton


def _rows_targets(target: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    """The targets of the pass's rows (the kept ones where ignored rows are compacted)."""
    return target if idx is None else target.index_select(0, idx)


#: rows of the logits' gradient that ``LIGER_COMPAT_FLCE_FP32_GRAD_WEIGHT`` keeps for each
#: fp32-result product (rounded down to whole chunks; at least one chunk): each product re-reads and
#: re-writes the fp32 sum, 8 bytes per weight element, what the default's 16-bit sum costs over the
#: same rows in its two chunks of 4096 (1 GiB of logits at a 128k vocabulary); the kept rows are 2 GiB
#: of bf16 gradients there
EXACT_GW_ROWS = 8192


def _exact_gw_rows(backend, h, w, m, rows, need_gw, knobs) -> int:
    """Rows of the logits' gradient each fp32-result product of ``LIGER_COMPAT_FLCE_FP32_GRAD_WEIGHT``
    takes (0: off). On the Triton path with 16-bit operands and an fp32-result product (cuBLAS's
    ``out_dtype=torch.float32``, torch >= 2.8 on CUDA, or the interpreter's fp32 copies on CPU), the
    pass keeps that many rows' gradients (:data:`EXACT_GW_ROWS`, whole chunks, at most all ``m``)
    and sums their products into an fp32 grad_weight that the targets' exact terms are added to and
    that is rounded once into the weight's dtype. Fewer products than chunks: fewer passes over the
    fp32 sum. (A 16-bit ``addmm`` onto a 16-bit grad_weight is not one rounding: on an H200 one such
    product of every row's gradient, onto the target terms, kept the default's error against fp32.)
    Not with the block-sparse gradient matmuls, which write their own."""
    if not (need_gw and _config.settings.flce_fp32_grad_weight and m > 0 and w.element_size() < 4
            and not knobs.sparse_grads):
        return 0
    if _target_fix_mode(backend, h, h.device) is None:  # no fp32-result product (grad_hidden's correction's)
        return 0
    return min(m, max(rows, EXACT_GW_ROWS // rows * rows))


#: rows of a compacting pass's first chunk whose logits GEMM is queued before the kept rows' count is
#: read (:func:`_kept_rows_first`): enough GPU work to cover the host's wait and its next launch
#: (256 rows at the Llama-3-8B head: ~0.35 ms on an H200), few enough that where fewer rows are kept
#: little is computed for nothing; the chunk's other rows are computed once the count says they are kept
FIRST_GEMM_ROWS = 256


def _chunk_logits(hc, wc, b, wt, logits, opt, fused_stats, lo, hi, parts, extra) -> int:
    """Rows ``lo:hi`` of a chunk's logits (``hc @ wc.T``, plus the bias), with the Triton GEMM's
    partials into ``parts`` (the whole chunk's, from ``_logits_triton.new_partials``; None: the
    GEMM makes them, ``lo`` 0 and ``hi`` the chunk), kept in ``extra["partials"]``; returns ``hi``."""
    if hi <= lo:
        return lo
    if fused_stats is not None:
        if parts is None:
            extra["partials"] = fused_stats(hc, wc, logits, opt)
        else:
            sl = slice(lo, hi)
            got = fused_stats(hc[sl], wc, logits[sl], opt, parts=tuple(x[sl] for x in parts))
            extra["partials"] = (*parts, got[4])
    elif b is not None:
        torch.addmm(b, hc[lo:hi], wt, out=logits[lo:hi])
    else:
        torch.mm(hc[lo:hi], wc.t(), out=logits[lo:hi])
    return hi


def _flce_pass(h, w, b, target, opt, backend, *, scale, grads, want_stats, bad=None, knobs=DEFAULT_KNOBS):
    """One chunked pass. ``grads`` = (hidden, weight, bias) flags; ``scale`` 0-d or [N] fp32;
    ``bad``: the flag out-of-range targets are recorded in (with ``want_stats``); ``knobs``: a
    checked :class:`FlceKnobs`.

    Returns (stats per row or None, grad_hidden, grad_weight, grad_bias).
    """
    n, hdim = h.shape
    v = w.shape[0]
    need_gh, need_gw, need_gb = grads
    any_grad = need_gh or need_gw or need_gb
    dev = h.device
    f32 = torch.float32
    idx = None
    # with the compaction: the kept rows' count, read on the host once the first logits GEMM is queued
    pending = None
    if backend == "triton" and knobs.compact_ignored and n > 0 and not _capturing(dev):
        if knobs.sparse_grads or _config.settings.flce_fp32_grad_weight:  # their buffers need the count first
            idx = (target != opt.ignore_index).nonzero().squeeze(1)  # a host sync that drains the queue
            if idx.numel() == n:
                idx = None
        else:
            idx, pending = _kept_rows_first(target, opt.ignore_index)
    m = n if idx is None else idx.numel()  # with ``pending``: at most, until the count is read
    rows = _chunk_rows(max(m, 1), v, hdim, h.element_size(), backend, dev)
    # one chunk of every row: its statistics are the rows' own (no buffers to copy them into)
    single = idx is None and 0 < m <= rows
    gather = want_stats and not single
    # the Triton row kernel writes each chunk's statistics into these rows' slices (no copy launches)
    direct = gather and backend == "triton" and idx is None
    loss = torch.empty(n, dtype=f32, device=dev) if gather else None
    zl = torch.empty(n, dtype=f32, device=dev) if gather else None
    correct = torch.empty(n, dtype=torch.bool, device=dev) if gather else None
    gh = torch.empty(h.shape, dtype=h.dtype, device=dev) if need_gh else None
    # with ``idx`` the skipped rows of these must read 0: they are zeroed once the first chunk's logits
    # GEMM is queued, so that the GPU gets its first large launch before the small ones
    unzeroed = [x for x in (loss, zl, correct, gh) if x is not None] if idx is not None else []
    # grad_weight summed over the chunks: in fp32 by the torch reference; on the GPU in the weight's
    # dtype (one rounding a chunk). With LIGER_COMPAT_FLCE_FP32_GRAD_WEIGHT (:func:`_exact_gw_rows`)
    # ``keep`` rows' gradients stay in the buffer for each product, summed in fp32 with each row's
    # target term made exact (``_target_terms_triton``: the row kernel hands over what the rounding
    # of its target entry lost) and rounded once.
    keep = _exact_gw_rows(backend, h, w, m, rows, need_gw, knobs)
    res = torch.empty(m, dtype=f32, device=dev) if keep else None
    acc_dtype = f32 if backend == "torch" else w.dtype
    gw = None  # with ``keep``, the first product makes it
    if need_gw and not keep:  # the first chunk writes it in the weight's dtype; the others add to it
        gw = (torch.empty if m > 0 and acc_dtype == w.dtype else torch.zeros)(w.shape, dtype=acc_dtype, device=dev)
    gb = torch.zeros(v, dtype=f32, device=dev) if need_gb else None
    buf = torch.empty(keep or rows, v, dtype=h.dtype, device=dev)
    kept = 0  # first row of the gradients kept in ``buf``
    # grad_hidden with the exact-target correction (:func:`_target_fix_mode`): each chunk's
    # ``d @ W`` summed in fp32 onto the row kernel's correction, then rounded once
    fix_mode = _target_fix_mode(backend, h, dev) if need_gh else None
    fixbuf = torch.empty(min(rows, max(m, 1)), hdim, dtype=f32, device=dev) if fix_mode else None
    w32 = w.float() if fix_mode == "float" else None  # the interpreter's fp32 copy, made once a pass
    wt = w.t()
    # the block-sparse gradient matmuls (``_sparse_grads_triton``): the first chunk runs dense and
    # probes whether its first block of rows leaves out enough pairs; the later chunks then run sparse
    probe = knobs.sparse_grads and m > rows and _sparse_ok(backend, h, w, b, opt, grads, m)
    sp = None
    fused_stats = None
    logits_impl = knobs.logits_impl
    if backend == "triton" and b is None and (logits_impl == "triton" or (logits_impl == "auto" and opt.softcap is None)):
        from . import _logits_triton

        if _logits_triton.supported(h, w):
            fused_stats = _logits_triton.logits_with_partials
    start = 0
    while start < m:
        end = min(m, start + rows)
        if idx is None:
            ic, hc, tc = None, h[start:end], target[start:end]
            sc = scale if scale.dim() == 0 else scale[start:end]
        else:  # the rows' targets and scales gathered once the GEMM is queued
            ic = idx[start:end]
            hc = h.index_select(0, ic)
        logits = buf[start - kept:end - kept] if keep else buf[: end - start]
        extra = {}
        sparse = sp is not None
        wc = sp.ws if sparse else w  # the sparse chunk's columns are in the sorted order
        # with ``pending`` (the first chunk of a compacting pass) the GEMM's first rows go first
        head = min(end - start, FIRST_GEMM_ROWS) if pending is not None else end - start
        parts = None
        if fused_stats is not None and head < end - start:
            parts = _logits_triton.new_partials(end - start, v, opt, dev)
        done = _chunk_logits(hc, wc, b, wt, logits, opt, fused_stats, 0, head, parts, extra)
        for x in unzeroed:
            x.zero_()
        unzeroed = []
        if pending is not None:  # the GEMM's first rows keep the GPU busy while the host waits for the count
            m, pending = pending.read(), None
            if m == 0:  # every row ignored: the outputs are zeroed; no product wrote grad_weight
                if gw is not None:
                    gw.zero_()
                break
            if m == n:  # nothing to skip: the later chunks take their rows in place
                idx = None
            end = min(end, m)  # the chunk's rows past the kept ones are ignored ones
            _chunk_logits(hc, wc, b, wt, logits, opt, fused_stats, done, end - start, parts, extra)
            k = end - start
            if k < logits.shape[0]:  # the chunk cut to its kept rows (the GEMM's first rows may pass them)
                ic, hc, logits = ic[:k], hc[:k], logits[:k]
                if "partials" in extra:
                    extra["partials"] = tuple(x[:k] if isinstance(x, torch.Tensor) else x for x in extra["partials"])
        if ic is not None:
            tc = target.index_select(0, ic)
            sc = scale if scale.dim() == 0 else scale.index_select(0, ic)
        if sparse:
            tc_head, tc = tc, sp.sorted_targets(tc)
        if want_stats:
            extra["bad"] = bad
        if logits.element_size() < 4:  # each target logit in fp32, not as stored (peaked rows' lse)
            extra["head"] = (hc, wc, b)
        if backend == "triton":
            extra["variant"] = "split" if sparse else knobs.ce_variant
        # (the buffer made for the sparse chunks alone is not the dense chunks' correction)
        fix = fixbuf[: end - start] if fixbuf is not None and (sparse or fix_mode != "sparse") else None
        if fix is not None:
            extra["target_fix"] = (fix, wc)
        if sparse:
            extra["sparse"] = sp.row_buffers(end - start)
        if res is not None:
            extra["target_res"] = res[start:end]
        if direct:
            extra["out"] = (loss[start:end], zl[start:end], correct[start:end])
        st = _ce_rows(backend, logits, tc, opt, scale=sc, grad=logits if any_grad else None, **extra)
        if want_stats and not direct:
            if single:
                loss, zl, correct = st[0], st[1], st[3]
            elif ic is None:
                loss[start:end], zl[start:end], _, correct[start:end] = st
            else:
                loss[ic], zl[ic], correct[ic] = st[0], st[1], st[3]
        if sparse:
            # both gradient matmuls block-sparse; grad_weight's rows back in the vocabulary's order
            out_rows = ic
            sp.grads(logits, hc, tc, tc_head, sc, st[2], fix, gh, gw, out_rows, start)
        elif any_grad:
            d = logits  # now holds d loss / d logits, in the input dtype
            if need_gw and not keep:
                if acc_dtype != d.dtype:
                    gw += (d.t() @ hc).to(acc_dtype)
                elif start == 0:  # first chunk: write, no read-modify-write of a zeroed buffer
                    torch.mm(d.t(), hc, out=gw)
                else:
                    gw.addmm_(d.t(), hc)
            if need_gb:
                gb += d.float().sum(0)
            if need_gh:  # after grad_weight, so a gathered hc can take the result
                if fix is not None:
                    if fix_mode == "out_dtype":  # cuBLAS: bf16 operands, fp32 sum onto the correction
                        torch.addmm(fix, d, w, out_dtype=f32, out=fix)
                    else:  # the interpreter on CPU: the same sum from fp32 copies
                        fix.addmm_(d.float(), w32)
                    if ic is None:
                        gh[start:end].copy_(fix)
                    else:
                        gh.index_copy_(0, ic, fix.to(gh.dtype))
                elif ic is None:
                    torch.mm(d, w, out=gh[start:end])
                else:
                    torch.mm(d, w, out=hc)
                    gh.index_copy_(0, ic, hc)
        if keep and (end - kept == keep or end == m):  # the kept gradients' fp32 product, into the fp32 sum
            d_kept = buf[: end - kept]
            hk = h[kept:end] if idx is None else h.index_select(0, idx[kept:end])
            if dev.type != "cuda":  # the interpreter on CPU: the same from fp32 copies
                prod = d_kept.t().float() @ hk.float()
                gw = prod if gw is None else gw.add_(prod)
            elif gw is None:
                gw = torch.mm(d_kept.t(), hk, out_dtype=f32)
            else:
                torch.addmm(gw, d_kept.t(), hk, out_dtype=f32, out=gw)
            d_kept = hk = None
            kept = end
        if probe:  # one host read: the later chunks sparse, in chunks twice as long where memory allows
            probe = False
            sp = _sparse_chunks().probe(h, w, target, opt, grads, logits, tc, sc, st[2], rows=min(rows, max(m, 1)))
            if sp is not None:
                longer = _sparse_chunk_rows(rows, v, h.element_size(), dev)
                if longer > rows:
                    del buf, logits
                    rows = longer
                    buf = torch.empty(rows, v, dtype=h.dtype, device=dev)
                    fixbuf = None if fixbuf is None else torch.empty(min(rows, m), hdim, dtype=f32, device=dev)
                sp.buffers(min(rows, m))
                if need_gh and fixbuf is None:  # the targets' terms of grad_hidden go through it
                    fixbuf = torch.empty(min(rows, m), hdim, dtype=f32, device=dev)
                    fix_mode = "sparse"
        hc = tc = sc = st = None  # free this chunk's gathered rows before the next gather
        start = end
    del buf
    for x in unzeroed:  # no chunk ran (every row ignored)
        x.zero_()
    if keep:  # the targets' exact terms into the fp32 sum (rounded once below)
        _target_terms().add_target_terms(gw, h, _rows_targets(target, idx), res, idx)
    if sp is not None:
        sp.finish()
    if gw is not None and gw.dtype != w.dtype:
        gw = gw.to(w.dtype)
    if gb is not None and b is not None:
        gb = gb.to(b.dtype)
    stats = (loss, zl, correct) if want_stats else None
    return stats, gh, gw, gb


def _saved_pass(h, w, b, target, num_items, opt, reduction, backend, needs, want_z, want_acc, knobs,
                shift=False, nan_empty=False):
    """A scalar loss's forward with every gradient formed in it: (loss, z-loss, accuracy, grad_hidden,
    grad_weight, grad_bias, the out-of-range flag), the gradients those of the loss (times its
    scale), z-loss and accuracy None where not asked for. ``shift``: ``target`` holds each sequence's
    own tokens (:func:`next_token_targets`); ``nan_empty``: the loss is NaN where no row is labelled
    (:func:`_nan_if_empty`). Capturable as a CUDA graph (:data:`_GRAPHS`), the shift and the NaN
    included: a replay launches neither."""
    if shift:
        target = next_token_targets(target, opt.ignore_index)
    n_valid, scale = _reduction_scale(target, opt, reduction, num_items, h.device)
    bad = _device_errors.new_flag(h.device)
    stats, gh, gw, gb = _flce_pass(h, w, b, target, opt, backend, scale=scale, grads=needs, want_stats=True, bad=bad,
                                   knobs=knobs)
    loss, z, acc = _finish(*stats, n_valid, scale, reduction, (stats[0].shape[0],), want_z, want_acc)
    if nan_empty:
        loss = _nan_if_empty(loss, n_valid)
    return loss, z, acc, gh, gw, gb, bad


#: The chunked pass of a small scalar loss as CUDA graphs (``_graphs``; :func:`_graphed_pass`).
_GRAPHS = _graphs.GraphCache()
#: rows x vocabulary x hidden up to which a scalar loss's pass is replayed as a CUDA graph: a step
#: this small is host-bound (2 x 2048 tokens of a 128k-vocabulary, 1024-hidden model: 5.4e11);
#: above it the launches hide behind the GPU's work, and a graph would keep a chunk of logits and
#: the gradients reserved for nothing
GRAPH_MAX_MACS = 2**39


def _graphable(h, w, backend, knobs) -> bool:
    """Whether a scalar loss's pass may run as a CUDA graph: ``LIGER_COMPAT_FLCE_GRAPHS`` on, the
    Triton path on a GPU, at most :data:`GRAPH_MAX_MACS`, no host sync or host read in the pass
    (``compact_ignored``, ``sparse_grads``), no CUDA graph being captured by the caller, no
    autocast (its cast cache would be captured)."""
    n, hdim = h.shape
    return (_config.settings.flce_graphs and backend == "triton" and h.device.type == "cuda"
            and not knobs.compact_ignored and not knobs.sparse_grads and 0 < n * w.shape[0] * hdim <= GRAPH_MAX_MACS
            and not torch.cuda.is_current_stream_capturing() and not torch.is_autocast_enabled("cuda"))


def _layout(t):
    """Where and how a tensor the graph reads in place lies (None: no tensor)."""
    return None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def graph_key(h, w, b, target, opt, backend, knobs) -> tuple:
    """The part of a graphed pass's key that every caller shares (the eager Function's and the
    compiled path's op, :func:`_graphed_pass` and ``_ops._graphed_with_grads``): the shapes and
    dtypes of the rows and targets copied in, where and how the weight and bias lie, the options,
    the knobs, the settings :func:`_flce_pass` reads (``LIGER_COMPAT_FLCE_CHUNK_MB``,
    ``LIGER_COMPAT_FLCE_FP32_GRAD_WEIGHT``) and, on the Triton path, whether the logits GEMM
    stores tile-relative logits (``_logits_triton.SHIFT_LOGITS``)."""
    settings = _config.settings
    shift = None
    if backend == "triton":
        from . import _logits_triton

        shift = _logits_triton.SHIFT_LOGITS
    return (tuple(h.shape), h.dtype, h.device, tuple(target.shape), target.dtype, _layout(w), _layout(b), opt,
            backend, knobs, settings.flce_chunk_mb, settings.flce_fp32_grad_weight, shift)


def _graphed_pass(h, w, b, target, num_items, opt, reduction, backend, needs, want_z, want_acc, knobs,
                  shift=False, nan_empty=False):
    """:func:`_saved_pass`'s outputs from a replayed CUDA graph, with the lease on them, or None
    (run it eagerly). The key: :func:`graph_key`, the reduction, the gradients and extras asked for,
    the kind of ``num_items_in_batch`` (its value is copied in), the target shift and the empty
    mean's NaN."""
    if not _graphable(h, w, backend, knobs):
        return None
    if isinstance(num_items, torch.Tensor):
        items = ("tensor", tuple(num_items.shape), num_items.dtype)
    elif num_items is None:
        items = None
    else:
        items, num_items = "number", float(num_items)
    key = ("saved_pass", graph_key(h, w, b, target, opt, backend, knobs), reduction, items, needs, want_z, want_acc,
           shift, nan_empty)

    def body(hs, ts, ns):
        return _saved_pass(hs, w, b, ts, ns, opt, reduction, backend, needs, want_z, want_acc, knobs, shift, nan_empty)

    return _GRAPHS.run(key, body, (h, target, num_items), h.device)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, b, target, opt, reduction, num_items, backend, want_z, want_acc, knobs, shift, nan_empty):
        # ``shift``: ``target`` is [..., T], each sequence's own tokens (next_token_targets), else flat
        needs = tuple(ctx.needs_input_grad[:3])
        needs = (needs[0], needs[1], needs[2] and b is not None)
        ctx.opt, ctx.backend, ctx.reduction, ctx.knobs = opt, backend, reduction, knobs
        ctx.mode = None
        ctx.lease = None
        if reduction != "none" and any(needs):
            # scalar loss: all gradients now, scaled by grad_output in backward
            got = _graphed_pass(h, w, b, target, num_items, opt, reduction, backend, needs, want_z, want_acc, knobs,
                                shift, nan_empty)
            if got is None:
                loss, z, acc, gh, gw, gb, bad = _saved_pass(h, w, b, target, num_items, opt, reduction, backend, needs,
                                                            want_z, want_acc, knobs, shift, nan_empty)
            else:
                # the graph's buffers: the loss and its extras copied out (a caller may keep them),
                # the gradients read by the backward under the lease
                (loss, z, acc, gh, gw, gb, bad), ctx.lease = got
                loss = loss.clone()
                z = None if z is None else z.clone()
                acc = None if acc is None else acc.clone()
            ctx.mode = "saved"
            ctx.grads = (gh, gw, gb)
            _device_errors.watch(bad, "fused_linear_cross_entropy", w.shape[0], opt.ignore_index)
            extra = [t for t in (z, acc) if t is not None]
            if extra:
                ctx.mark_non_differentiable(*extra)
            return loss, z, acc
        if shift:
            target = next_token_targets(target, opt.ignore_index)
        n_valid, scale = _reduction_scale(target, opt, reduction, num_items, h.device)
        bad = _device_errors.new_flag(h.device)
        stats, *_ = _flce_pass(h, w, b, target, opt, backend, scale=scale, grads=(False,) * 3, want_stats=True, bad=bad,
                               knobs=knobs)
        if any(needs):
            ctx.mode = "recompute"
            ctx.needs = needs
            ctx.save_for_backward(h, w, b, target)
        _device_errors.watch(bad, "fused_linear_cross_entropy", w.shape[0], opt.ignore_index)
        loss, z, acc = _forward_tail(ctx, stats, n_valid, scale, reduction, want_z, want_acc)
        return (_nan_if_empty(loss, n_valid) if nan_empty else loss), z, acc

    @staticmethod
    def backward(ctx, g_loss, _g_z, _g_acc):
        try:
            _device_errors.poll()
        except BaseException:
            ctx.grads = ctx.lease = None  # a failed backward frees the gradients and the graph
            raise
        if ctx.mode is None:
            return (None,) * 13
        if ctx.mode == "saved":
            gh, gw, gb = ctx.grads
            ctx.grads = None
            if ctx.lease is not None:
                # a replayed graph's buffers: the products are new tensors, then the graph is free
                out = tuple(None if g is None else torch.mul(g, g_loss) for g in (gh, gw, gb))
                ctx.lease = None
                return out + (None,) * 10
            # always scaled (in place: the buffers are this forward's own); comparing grad_output
            # with 1 first would read it on the host. The fp32 0-d grad_output multiplies each
            # 16-bit entry in fp32 and rounds once, with no conversion launch before it.
            for g in (gh, gw, gb):
                if g is not None:
                    g.mul_(g_loss)
            return (gh, gw, gb) + (None,) * 10
        h, w, b, target = ctx.saved_tensors

        def grads_of(row_scale):
            return _flce_pass(h, w, b, target, ctx.opt, ctx.backend, scale=row_scale, grads=ctx.needs,
                              want_stats=False, knobs=ctx.knobs)[1:]

        # recomputing is for reduction="none" only: no reduction scale
        return _backward_tail(grads_of, g_loss, ctx.reduction, None, 13)


# --------------------------------------------------------------------------------------------
# the low-memory mode
# --------------------------------------------------------------------------------------------

#: The mode the most recent eager call of :func:`fused_linear_cross_entropy` ran ("chunked" or "lowmem").
last_flce_mode: str | None = None


def _free_bytes(device: torch.device) -> int | None:
    """Memory a new allocation could get on ``device`` (the driver's free memory plus what
    PyTorch's allocator holds unused); ``None`` where unknown (CPU)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def flce_mode_for(n: int, v: int, hdim: int, elem: int, backend: str, device: torch.device,
                  mode: str | None = None) -> str:
    """``"chunked"`` or ``"lowmem"`` for a fused loss of ``n`` rows: ``mode``, or when ``None``
    ``LIGER_COMPAT_FLCE_MODE`` (``ValueError`` naming it for a bad value); under ``auto``, low-memory when the Triton path
    runs and one chunk's logits, gathered rows and fp32 grad_hidden rows would not fit in :func:`_free_bytes` (read the
    first time a shape is seen, :data:`_auto_modes`). The low
    memory mode needs the Triton path; the torch reference (CPU) always runs in chunks."""
    if mode is None:
        mode = _config.flce_mode()
    if backend != "triton":
        return "chunked"
    if mode != "auto":
        return mode
    rows = _chunk_rows(max(n, 1), v, hdim, elem, backend, device)
    key = (rows, n, v, hdim, elem, device)
    chosen = _auto_modes.get(key)
    if chosen is None:
        free = _free_bytes(device)
        # a chunk's logits and gathered rows, and the fp32 grad_hidden rows of the exact-target correction
        chunk = rows * (v + hdim) * elem + (rows * hdim * 4 if elem < 4 else 0)
        chosen = "lowmem" if free is not None and chunk > free else "chunked"
        _auto_modes[key] = chosen
    return chosen


#: ``auto``'s choice per (chunk rows, rows, vocabulary, hidden, element size, device): the free
#: memory is read once per shape (``torch.cuda.mem_get_info`` and the allocator's statistics
#: cost ~0.3 ms, more than a small step's loss); the chunk rows carry the chunk-size setting.
_auto_modes: dict[tuple, str] = {}


def _lowmem_rows_index(target, opt, dev, compact_ignored=False):
    """The rows the low-memory kernels work on: all of them, or with ``compact_ignored`` the
    non-ignored ones (one host sync; all rows while a CUDA graph is captured)."""
    n = target.shape[0]
    if n and compact_ignored and not _capturing(dev):
        return (target != opt.ignore_index).nonzero().squeeze(1)  # a host sync (opt-in)
    return torch.arange(n, device=dev)


def _lowmem_forward(h, w, b, target, opt, config, compact_ignored=False):
    """Per row of ``h``: loss, z-loss, argmax hit (``[N]``), and for the backward the row index,
    the rows' lse and whether each row gets a gradient (the last three per index row)."""
    from ._lowmem_triton import lowmem_stats

    n, v, dev = h.shape[0], w.shape[0], h.device
    idx = _lowmem_rows_index(target, opt, dev, compact_ignored)
    tc = target.index_select(0, idx)
    lse, zt, zsum, arg = lowmem_stats(h, w, b, target, idx, opt, config=config)
    eps, s = opt.label_smoothing, opt.lse_square_scale
    vc = tc != opt.ignore_index
    in_range = (tc >= 0) & (tc < v)
    zl_c = s * lse * lse
    loss_c = lse - (1.0 - eps) * zt + zl_c
    if eps:
        loss_c = loss_c - eps * zsum / v
    zero = torch.zeros((), dtype=torch.float32, device=dev)
    loss_c = torch.where(vc & in_range, loss_c, zero)
    loss_c = torch.where(vc & ~in_range, torch.full_like(loss_c, math.nan), loss_c)
    zl_c = torch.where(vc, zl_c, zero)
    hit_c = (arg == tc) & vc & in_range
    bad = _device_errors.new_flag(dev)
    if idx.numel():
        oob = vc & ~in_range
        t64 = tc.long()
        bad[0] += oob.sum()
        bad[1] = torch.maximum(bad[1], torch.where(oob & (t64 >= v), t64, 0).max())
        bad[2] = torch.minimum(bad[2], torch.where(oob & (t64 < 0), t64, 0).min())
    _device_errors.watch(bad, "fused_linear_cross_entropy", v, opt.ignore_index)
    loss_rows = torch.zeros(n, dtype=torch.float32, device=dev).index_copy_(0, idx, loss_c)
    zl_rows = torch.zeros(n, dtype=torch.float32, device=dev).index_copy_(0, idx, zl_c)
    correct = torch.zeros(n, dtype=torch.bool, device=dev).index_copy_(0, idx, hit_c)
    return loss_rows, zl_rows, correct, idx, lse, vc & in_range


def _lowmem_backward(h, w, b, target, opt, idx, lse, ok, row_scale, needs, config):
    """Gradients of ``sum_i row_scale[i] * loss_i`` over the index rows (``row_scale``: ``[N]``
    per row, or 0-d for all)."""
    from ._lowmem_triton import lowmem_grads

    if row_scale.dim():
        sc = row_scale.float().reshape(-1).index_select(0, idx)
    else:
        sc = row_scale.float().reshape(()).expand(idx.numel())
    sc = torch.where(ok, sc, torch.zeros((), dtype=torch.float32, device=sc.device)).contiguous()
    # LIGER_COMPAT_FLCE_SPARSE: read when the backward runs
    return lowmem_grads(h, w, b, target, idx, lse, sc, opt, needs, config=config,
                        skip_eps=None if _config.settings.flce_sparse else 0.0)


class _LowMemFusedLinearCrossEntropy(torch.autograd.Function):
    """The fused loss without stored logits: statistics in the forward, every gradient recomputed
    in the backward (``_lowmem_triton``)."""

    @staticmethod
    def forward(ctx, h, w, b, target, opt, reduction, num_items, want_z, want_acc, config, compact_ignored):
        n_valid, scale = _reduction_scale(target, opt, reduction, num_items, h.device)
        loss_rows, zl_rows, correct, idx, lse, ok = _lowmem_forward(h, w, b, target, opt, config, compact_ignored)
        needs = tuple(ctx.needs_input_grad[:3])
        ctx.needs = (needs[0], needs[1], needs[2] and b is not None)
        ctx.opt, ctx.reduction, ctx.config = opt, reduction, config
        ctx.save_for_backward(h, w, b, target, idx, lse, ok, scale)
        return _forward_tail(ctx, (loss_rows, zl_rows, correct), n_valid, scale, reduction, want_z, want_acc)

    @staticmethod
    def backward(ctx, g_loss, _g_z, _g_acc):
        _device_errors.poll()
        if not any(ctx.needs):
            return (None,) * 11
        h, w, b, target, idx, lse, ok, scale = ctx.saved_tensors

        def grads_of(row_scale):
            return _lowmem_backward(h, w, b, target, ctx.opt, idx, lse, ok, row_scale, ctx.needs, ctx.config)

        return _backward_tail(grads_of, g_loss, ctx.reduction, scale, 11)


def _pick_mode(mode, h2, weight, backend) -> str:
    global last_flce_mode
    chosen = flce_mode_for(h2.shape[0], weight.shape[0], h2.shape[1], h2.element_size(), backend, h2.device, mode)
    last_flce_mode = chosen
    return chosen


def _flce_ops(h, w, b, target, opt, reduction, num_items, want_z, want_acc, lowmem=False, config=None,
              knobs=DEFAULT_KNOBS):
    """:class:`_FusedLinearCrossEntropy` as custom ops (``_ops``), for ``torch.compile``: the same
    two modes (scalar loss: gradients formed in the forward; ``"none"``: recomputed in backward);
    ``lowmem``: the low-memory kernels' ops (per-row losses, gradients in the backward)."""
    n_valid, scale = _reduction_scale(target, opt, reduction, num_items, h.device)
    args = (opt.ignore_index, opt.label_smoothing, opt.lse_square_scale, opt.softcap)
    if lowmem:
        loss_rows, zl, hits, _lse = _dispatch.OPS.flce_lowmem_rows.default(h, w, b, target, *args, config, knobs.compact_ignored)
        loss, z, acc = _finish(loss_rows, zl, hits, n_valid, scale, reduction, (target.numel(),), want_z, want_acc)
        zero = loss.new_zeros(())
        return loss, z if z is not None else zero, acc if acc is not None else zero
    grad_on = torch.is_grad_enabled()
    needs = (grad_on and h.requires_grad, grad_on and w.requires_grad, grad_on and b is not None and b.requires_grad)
    if reduction != "none" and any(needs):
        loss, zl, hits, _, _, _ = _dispatch.OPS.flce_with_grads.default(h, w, b, target, scale, *args, *needs, "auto", *knobs[:3])
        z = zl.sum() * scale if want_z else None
        acc = hits.sum() / n_valid.clamp(min=1).float() if want_acc else None
    else:
        loss_rows, zl, hits = _dispatch.OPS.flce_rows.default(h, w, b, target, *args, "auto", *knobs[:3])
        loss, z, acc = _finish(loss_rows, zl, hits, n_valid, scale, reduction, (target.numel(),), want_z, want_acc)
    zero = loss.new_zeros(())
    return loss, z if z is not None else zero, acc if acc is not None else zero


#: the most logits (rows x vocabulary) the dense torch path computes at once (:func:`dense_for`)
DENSE_MAX_LOGITS = 2**24


def dense_for(n: int, v: int, device: torch.device) -> bool:
    """Whether a fused loss of ``n`` rows over ``v`` classes runs :func:`_dense_torch`: on tensors no
    Triton kernel runs on by default (``_dispatch.reference_only``: CPU tensors without the
    interpreter), with at most :data:`DENSE_MAX_LOGITS` logits, while ``LIGER_COMPAT_CPU_NATIVE`` is
    on (the default). There the chunked reference would save memory the native head spends anyway,
    at the price of more ops and Python a call (the regime of small models on CPU, where a step is
    per-call host work); above it the chunked reference keeps the ``[N, V]`` logits from existing.
    The same rule decides whether a patched model's loss is computed as its own head computes it
    (``shims.causal_lm._native_head_loss``)."""
    return n * v <= DENSE_MAX_LOGITS and _config.settings.cpu_native and _dispatch.reference_only(device)


def _dense_torch(h, w, b, target, opt, reduction, num_items, want_z, want_acc):
    """The fused loss as plain differentiable torch ops over the whole ``[N, V]`` logits (what the
    native head computes, without returning them), same definitions as :func:`ce_rows_torch`:
    label smoothing as torch's ``cross_entropy`` has it, the z-loss inside the loss, z-loss and
    token accuracy not differentiable. The target range was checked before (CPU: raised there)."""
    n_valid, scale = _reduction_scale(target, opt, reduction, num_items, h.device)
    z = torch.nn.functional.linear(h, w, b).float()
    if opt.softcap is not None:
        z = torch.tanh(z / opt.softcap) * opt.softcap
    loss_rows = torch.nn.functional.cross_entropy(z, target.long(), ignore_index=opt.ignore_index, reduction="none",
                                                  label_smoothing=opt.label_smoothing)
    valid = target != opt.ignore_index
    zl_rows = None
    if opt.lse_square_scale:
        lse = torch.logsumexp(z, dim=-1)
        zl_rows = torch.where(valid, opt.lse_square_scale * lse * lse, lse.new_zeros(()))
        loss_rows = loss_rows + zl_rows
        zl_rows = zl_rows.detach()
    elif want_z:
        zl_rows = loss_rows.new_zeros(loss_rows.shape)
    correct = None
    if want_acc:
        with torch.no_grad():
            correct = (z.argmax(dim=-1) == target) & valid
    loss, zl, acc = _finish(loss_rows, zl_rows, correct, n_valid, scale, reduction, (target.numel(),), want_z,
                            want_acc)
    zero = loss.new_zeros(())
    return loss, zl if zl is not None else zero, acc if acc is not None else zero


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    return_token_accuracy: bool = False,
    return_z_loss: bool = False,
    mode: str | None = None,
    config: str | None = None,
    logits_impl: str | None = None,
    compact_ignored: bool | None = None,
    ce_variant: str = "split",
    sparse_grads: bool | None = None,
    shift_target: bool = False,
    empty_mean: str = "zero",
):
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``target`` without ``[N, V]`` logits.

    ``hidden`` is ``[..., H]``, ``weight`` ``[V, H]``, ``target`` ``hidden.shape[:-1]`` (or flat)
    integer class ids, ``ignore_index`` rows excluded. ``reduction`` is ``"mean"`` (over
    non-ignored rows; 0 when all are ignored), ``"sum"`` or ``"none"`` (per row, shaped like
    ``target``). ``num_items_in_batch`` divides the summed loss instead (gradient accumulation).
    ``softcap`` applies ``softcap * tanh(logits / softcap)`` first; ``lse_square_scale`` adds the
    z-loss ``scale * lse**2`` per row. Returns the loss, or :class:`CrossEntropyOutput` when
    ``return_z_loss`` or ``return_token_accuracy`` is set. Differentiable in hidden, weight, bias.

    ``shift_target=True`` takes ``target`` (shaped exactly ``hidden.shape[:-1]``) as each
    sequence's own tokens, the labels of a causal LM: position ``t`` is scored against
    ``target[..., t + 1]`` and each sequence's last position against nothing, as transformers
    shifts its labels (the shift runs inside the loss's CUDA graph where one replays).
    ``empty_mean="nan"`` makes the ``"mean"`` of no labelled row NaN (0 / 0, as
    ``torch.nn.functional.cross_entropy`` gives) instead of 0; it changes nothing with
    ``num_items_in_batch`` or another reduction. Neither changes a gradient.

    A target outside ``[0, V)`` that is not ``ignore_index`` raises :class:`TargetOutOfRangeError`
    (a ``ValueError``): on CPU tensors from this call; on the GPU, where checking at once would
    need a host sync, once the GPU has got there: in this call's backward or the next fused-loss
    call at the latest (``raise_target_errors()`` waits for it). Until then its row's loss is NaN
    and its gradient zero.

    How the GPU (Triton) path runs, for benchmarks and tests: ``logits_impl`` (``"auto"``,
    ``"cublas"``, ``"triton"``; ``None``: ``LIGER_COMPAT_FLCE_LOGITS``) computes each chunk's
    logits; ``compact_ignored=True`` skips ignored rows instead of computing them (one host sync
    a call to count them), ``False`` computes them, ``None`` (default) compacts only a loss of at
    least :data:`COMPACT_MIN_MACS` rows x vocabulary x hidden (:func:`compact_for`);
    ``ce_variant`` (``"split"``, ``"row"``) is the cross-entropy kernel's launch layout;
    ``sparse_grads=True`` (``None``, the default: ``LIGER_COMPAT_FLCE_SPARSE_GRADS``, off unless set,
    and never for a call whose pass replays as a CUDA graph; experimental: 0.69-0.90x the dense
    pass's time on trained-like and peaked logits, 0.99-1.06x on near-uniform ones, 2.1-2.9 GiB of extra memory instead of
    0.55-1.0 at 8192 rows of 7B-9B heads; one H200, ``benchmarks/NOTES.md``) runs the chunked
    mode's two gradient matmuls block-sparse over the vocabulary sorted by mean logit after a dense
    first chunk whose first rows probe the softmax (``_sparse_grads_triton``; eager calls on a GPU
    with tensor descriptors, without a bias, label smoothing, z-loss or token accuracy).

    On a GPU a scalar loss (``mean`` or ``sum``, with a gradient) of at most :data:`GRAPH_MAX_MACS`
    rows x vocabulary x hidden replays its pass as a CUDA graph from the third call with the same
    shapes, options and weight (``kernels/_graphs.py``; ``LIGER_COMPAT_FLCE_GRAPHS=0`` turns it off):
    a host-bound small step's launches become one.
    """
    if not _dispatch.compiling():  # while tracing, the ops' real implementations poll
        _device_errors.poll()
    _checks.tensor("hidden", hidden)
    _checks.tensor("weight", weight)
    _checks.float_dtype("hidden", hidden)
    _checks.float_dtype("weight", weight)
    if bias is not None:
        _checks.tensor("bias", bias)
        _checks.float_dtype("bias", bias)
    _check_options(label_smoothing, lse_square_scale, softcap, reduction, num_items_in_batch)
    if hidden.dim() < 1:
        raise ShapeMismatchError("hidden must have at least one dimension [..., H]")
    if weight.dim() != 2:
        raise ShapeMismatchError(f"weight must be 2-D [V, H], got shape {tuple(weight.shape)}")
    hdim = hidden.shape[-1]
    v = weight.shape[0]
    if weight.shape[1] != hdim:
        raise ShapeMismatchError(f"weight has shape {tuple(weight.shape)} but hidden's last dimension is {hdim}")
    if bias is not None and tuple(bias.shape) != (v,):
        raise ShapeMismatchError(f"bias must have shape ({v},) to match weight, got {tuple(bias.shape)}")
    _check_target_options(target, hidden.shape[:-1], "hidden", shift_target, empty_mean)
    device = _checks.same_device(hidden=hidden, weight=weight, bias=bias, target=target)
    _checks.same_dtype(hidden=hidden, weight=weight, bias=bias)
    if v == 0:  # no target is a class of an empty vocabulary (native: cross_entropy's IndexError)
        raise TargetOutOfRangeError("weight has 0 rows (vocabulary size 0): no target is in [0, 0)")
    compiling = _dispatch.compiling()
    if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.numel() != 1:
        raise ValueError("num_items_in_batch must be a number or a one-element tensor")

    opt = CEOptions(int(ignore_index), float(label_smoothing), float(lse_square_scale), None if softcap is None else float(softcap))
    if not compiling:  # under torch.compile the op's real implementation runs these checks
        backend = _dispatch.choose("fused_linear_cross_entropy", device)
        # with the shift, a sequence's first token is no position's target
        _checks.target_range("target", target[..., 1:] if shift_target else target, v, ignore_index,
                             kernel_reports=backend == "triton")
    h2 = hidden.reshape(-1, hdim)
    if not h2.is_contiguous():
        h2 = h2.contiguous()
    nan_empty = empty_mean == "nan" and reduction == "mean" and num_items_in_batch is None
    want_z, want_acc = bool(return_z_loss), bool(return_token_accuracy)
    if mode is not None and mode not in _config.FLCE_MODES:
        raise ValueError(f"mode must be one of {', '.join(_config.FLCE_MODES)} or None, got {mode!r}")
    if config is not None:
        from ._lowmem_triton import check_config

        check_config(config)
    if compact_ignored is not None and not isinstance(compact_ignored, bool):
        raise ValueError(f"compact_ignored must be True, False or None, got {compact_ignored!r}")
    if sparse_grads is not None and not isinstance(sparse_grads, bool):
        raise ValueError(f"sparse_grads must be True, False or None, got {sparse_grads!r}")
    knobs = _knobs(logits_impl, compact_for(h2.shape[0], v, hdim, compact_ignored), ce_variant)
    if sparse_grads is None:  # the setting, but a graphed pass (a small, host-bound loss) stays dense
        sparse_grads = (_config.settings.flce_sparse_grads and not compiling
                        and not _graphable(h2, weight, backend, knobs))
    if sparse_grads and not want_acc:  # token accuracy needs the argmax's first index in the vocabulary's own order
        knobs = knobs._replace(sparse_grads=True)
    # the chunked mode's Function shifts the targets and sets the NaN itself (inside its CUDA
    # graph where one replays); every other path gets shifted targets and sets it here
    dense = not compiling and mode is None and backend == "torch" and dense_for(h2.shape[0], v, device)
    if not compiling and not dense and _pick_mode(mode, h2, weight, backend) == "chunked":
        loss, z, acc = _FusedLinearCrossEntropy.apply(
            h2, weight, bias, target if shift_target else target.reshape(-1), opt, reduction, num_items_in_batch,
            backend, want_z, want_acc, knobs, shift_target, nan_empty
        )
    else:
        t1 = next_token_targets(target, opt.ignore_index) if shift_target else target.reshape(-1)
        if compiling:
            # the setting or the keyword decide at trace time; ``auto`` keeps the chunked ops (the
            # free memory of the moment of tracing says nothing about the runs)
            triton_path = device.type == "cuda" or (device.type == "cpu" and _dispatch.interpret_mode())
            lowmem = (mode or _config.flce_mode()) == "lowmem" and triton_path and _dispatch.HAS_TRITON
            loss, z, acc = _flce_ops(h2, weight, bias, t1, opt, reduction, num_items_in_batch, want_z, want_acc,
                                     lowmem=lowmem, config=config, knobs=knobs)
        elif dense:
            loss, z, acc = _dense_torch(h2, weight, bias, t1, opt, reduction, num_items_in_batch, want_z, want_acc)
        else:
            loss, z, acc = _LowMemFusedLinearCrossEntropy.apply(
                h2, weight, bias, t1, opt, reduction, num_items_in_batch, want_z, want_acc, config,
                knobs.compact_ignored
            )
        if nan_empty:
            loss = _nan_if_empty(loss, (t1 != opt.ignore_index).sum())
    if not compiling and device.type != "cuda":
        _device_errors.poll()  # this call's own flag, readable now (the GPU's: at the next poll)
    if reduction == "none":
        shape = tuple(hidden.shape[:-1])
        loss = loss.view(shape)
        z, acc = z.view(shape) if want_z else z, acc.view(shape) if want_acc else acc
    if not (want_z or want_acc):
        return loss
    return CrossEntropyOutput(loss, z if want_z else None, acc if want_acc else None)


# --------------------------------------------------------------------------------------------
# cross-entropy on given logits
# --------------------------------------------------------------------------------------------


def _ce_row_chunks(n, v, backend, device):
    if backend == "torch":
        return max(1, min(n, FLCE_CHUNK_BYTES_CPU // (4 * v)))
    return n  # the Triton kernel streams each row; no chunking needed


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, opt, reduction, num_items, backend, want_z, want_acc, variant):
        n, v = logits.shape
        n_valid, scale = _reduction_scale(target, opt, reduction, num_items, logits.device)
        f32 = torch.float32
        loss = torch.empty(n, dtype=f32, device=logits.device)
        zl = torch.empty_like(loss)
        lse = torch.empty_like(loss)
        correct = torch.empty(n, dtype=torch.bool, device=logits.device)
        bad = _device_errors.new_flag(logits.device)
        rows = _ce_row_chunks(n, v, backend, logits.device)
        extra = {"variant": variant} if backend == "triton" else {}
        for s in range(0, n, rows):
            e = min(n, s + rows)
            loss[s:e], zl[s:e], lse[s:e], correct[s:e] = _ce_rows(backend, logits[s:e], target[s:e], opt, bad=bad, **extra)
        _device_errors.watch(bad, "cross_entropy", v, opt.ignore_index)
        ctx.save_for_backward(logits, target, lse, scale)
        ctx.opt, ctx.backend, ctx.reduction, ctx.extra = opt, backend, reduction, extra
        return _forward_tail(ctx, (loss, zl, correct), n_valid, scale, reduction, want_z, want_acc)

    @staticmethod
    def backward(ctx, g_loss, _g_z, _g_acc):
        _device_errors.poll()
        logits, target, lse, scale = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return (None,) * 9
        n, v = logits.shape

        def grads_of(sc):
            grad = torch.empty_like(logits)
            rows = _ce_row_chunks(n, v, ctx.backend, logits.device)
            for s in range(0, n, rows):
                e = min(n, s + rows)
                _ce_rows(
                    ctx.backend, logits[s:e], target[s:e], ctx.opt,
                    scale=sc if sc.dim() == 0 else sc[s:e], grad=grad[s:e], lse=lse[s:e], **ctx.extra,
                )
            return (grad,)

        return _backward_tail(grads_of, g_loss, ctx.reduction, scale, 9)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    return_token_accuracy: bool = False,
    return_z_loss: bool = False,
    ce_variant: str = "split",
):
    """Cross-entropy on ``logits[..., V]`` with the options of :func:`fused_linear_cross_entropy`
    (and its handling of targets outside ``[0, V)``); ``ce_variant`` as there."""
    _device_errors.poll()
    _checks.tensor("logits", logits)
    _checks.float_dtype("logits", logits)
    _check_options(label_smoothing, lse_square_scale, softcap, reduction, num_items_in_batch)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        # native: IndexError (no class dimension: "Dimension out of range"; V = 0: "Target 0 is out of bounds")
        error = DimensionError if logits.dim() < 1 else TargetOutOfRangeError
        raise error(f"logits must be [..., V] with V > 0, got shape {tuple(logits.shape)}")
    v = logits.shape[-1]
    _check_target(target, logits.shape[:-1], "logits")
    device = _checks.same_device(logits=logits, target=target)
    if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.numel() != 1:
        raise ValueError("num_items_in_batch must be a number or a one-element tensor")
    knobs = _knobs("auto", True, ce_variant)
    opt = CEOptions(int(ignore_index), float(label_smoothing), float(lse_square_scale), None if softcap is None else float(softcap))
    backend = _dispatch.choose("cross_entropy", device)
    _checks.target_range("target", target, v, ignore_index, kernel_reports=backend == "triton")
    l2 = logits.reshape(-1, v)
    if l2.stride(-1) != 1:
        l2 = l2.contiguous()
    want_z, want_acc = bool(return_z_loss), bool(return_token_accuracy)
    loss, z, acc = _CrossEntropy.apply(l2, target.reshape(-1), opt, reduction, num_items_in_batch, backend, want_z, want_acc,
                                       knobs.ce_variant)
    if device.type != "cuda":
        _device_errors.poll()  # this call's own flag, readable now (the GPU's: at the next poll)
    if reduction == "none":
        shape = tuple(logits.shape[:-1])
        loss = loss.view(shape)
        z, acc = z.view(shape) if want_z else z, acc.view(shape) if want_acc else acc
    if not (want_z or want_acc):
        return loss
    return CrossEntropyOutput(loss, z if want_z else None, acc if want_acc else None)
