"""Fused linear log-probabilities: per-token statistics of ``softmax(hidden @ weight.T)`` without
``[N, V]`` logits.

``fused_linear_logprobs(hidden, weight, target)`` returns, per row, the log-probability of the
target and on request the entropy, whether the target is the (first) argmax, ``log sum_v p_v^2``
and the mean logit, of the distribution over ``z = softcap * tanh(logits * logit_scale / softcap)
/ temperature`` (``logits = hidden @ weight.T + bias``; the softcap only when given). Rows are
processed in chunks like :func:`~liger_compat.kernels.loss.fused_linear_cross_entropy`: one
matmul makes a chunk's logits, the row kernel (Triton in ``_logprob_triton.py``, the torch
reference :func:`lp_rows_torch` here) reduces them, and only one chunk of logits exists at a time.
With 16-bit logits the row kernel takes each target logit in fp32 from the row's hidden state and
the target's weight row (:data:`EXACT_TARGET`): a 16-bit store rounds it by up to 2^-9 of its size,
and where the row's mass is spread that rounding is most of the log-prob's error.

Backward takes arbitrary per-row upstream gradients of ``log_probs`` and ``entropy``: it
recomputes each chunk's logits, turns them in place into ``d / d logits`` and makes that chunk's
``grad_hidden`` rows and share of ``grad_weight`` (4 matmuls for forward and backward). Where the
whole ``[N, V]`` gradient fits :data:`KEEP_GRAD_MAX_BYTES` (Triton path), the forward instead keeps
``d sum(log_probs) / d logits``, made in place of each chunk's logits, and a backward without an
entropy gradient scales it row by row into its two matmuls (3 in all, no row kernel in the backward;
with an entropy gradient it recomputes as above).
``grad_mode="uniform"`` is for losses that weight every row's log-prob alike (a mean or sum of
the log-probs, SFT): the forward then also forms the gradients of ``sum(log_probs)`` (3 matmuls
in all). Its backward scales ``grad_hidden`` row by row by the upstream gradient, which is exact
for any upstream (a frozen head, LoRA, needs nothing more), and ``grad_weight`` / ``grad_bias`` by
the upstream's common value when it is the same for every non-ignored row and no entropy gradient
arrives; otherwise it recomputes as above, so the result is the same either way. An upstream
broadcast from one value (the gradient of ``sum``) is seen to be uniform without a host sync; any
other upstream is compared on the device and read once. ``grad_mode="sum"`` is the same with that
comparison left to the device: the caller guarantees a uniform upstream (trl's SFT loss, which the
trl shim knows), the backward reads nothing on the host, and an upstream that breaks the guarantee
raises :class:`~liger_compat.kernels._device_errors.GradientContractError` at the next poll (from
the backward itself on CPU tensors), the ``grad_weight`` of that backward having been scaled by the
first non-ignored row's value.
A target outside ``[0, V)`` (not ``ignore_index``) raises :class:`TargetOutOfRangeError` naming
it: on CPU tensors from the call, on the GPU without a host sync, as the fused loss does
(``raise_target_errors``); its row is scored as ignored meanwhile. ``is_top1``, ``log_sum_sq_probs`` and ``mean_logits`` carry no gradient.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, ContextManager, NamedTuple, Sequence

import torch

from . import _checks, _dispatch, _device_errors
from .errors import ShapeMismatchError, TargetOutOfRangeError
from .loss import FLCE_CHUNK_BYTES_CPU, _chunk_rows, target_logits_torch

__all__ = ["fused_linear_logprobs", "LogProbOutput", "FIELDS", "lp_rows_torch"]

#: per-token fields, in the order of :class:`LogProbOutput`
FIELDS = ("log_probs", "entropy", "is_top1", "log_sum_sq_probs", "mean_logits")
GRAD_MODES = ("recompute", "uniform", "sum")
#: the statistics pass takes each target logit in fp32 from the row's hidden state and the target's
#: weight row when the chunk's logits are 16-bit (off: as stored, the benchmarks' and tests' A/B)
EXACT_TARGET = True


class LogProbOutput(NamedTuple):
    """Per-row results (fp32, ``is_top1`` bool), each shaped like ``target``; a field not asked
    for is ``None``. Every field is 0 (``False``) on rows whose target is ``ignore_index``."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    is_top1: torch.Tensor | None
    log_sum_sq_probs: torch.Tensor | None
    mean_logits: torch.Tensor | None


@dataclass(frozen=True)
class LPOptions:
    ignore_index: int = -100
    inv_t: float = 1.0
    softcap: float | None = None
    logit_scale: float = 1.0
    entropy: bool = False
    is_top1: bool = False
    log_sum_sq: bool = False
    mean_logits: bool = False


# --------------------------------------------------------------------------------------------
# the row kernel, torch reference
# --------------------------------------------------------------------------------------------


def _transform_torch(x: torch.Tensor, opt: LPOptions):
    y = x.float() * opt.logit_scale
    t = None
    if opt.softcap is not None:
        t = torch.tanh(y / opt.softcap)
        y = opt.softcap * t
    return y * opt.inv_t, t


def lp_rows_torch(logits, target, opt, *, grad=None, g_lp=None, g_ent=None, lse=None, entropy=None, head=None):
    """Reference for the row kernel on ``logits[C, V]`` (the matmul's output, before the transform).

    Without ``lse``: returns ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1, lse)``
    per row (fp32 / bool; fields not asked for in ``opt`` are ``None``; ignored rows 0). With
    ``grad``: writes ``d (g_lp * log_probs + g_ent * entropy) / d logits`` into ``grad`` (which may
    be ``logits`` itself); ``g_lp`` is a 0-d or ``[C]`` tensor, ``g_ent`` ``[C]``, either ``None``.
    ``head`` = ``(hidden rows, weight, bias or None)``, without ``lse``: each valid row's target
    logit is taken in fp32 from them instead of as stored (the argmax stays the stored logits').
    """
    c, v = logits.shape
    z, t = _transform_torch(logits, opt)
    valid = (target != opt.ignore_index) & (target >= 0) & (target < v)
    tgt = torch.where(valid, target, torch.zeros_like(target)).long()
    stats = None
    if lse is None:
        # the statistics' logits: with ``head`` each valid target's in fp32, out of place (the
        # gradient below reads the stored ones)
        zs = z
        if head is not None:
            ze, _ = _transform_torch(target_logits_torch(head, tgt), opt)
            zs = z.scatter(1, tgt[:, None], torch.where(valid, ze, z.gather(1, tgt[:, None]).squeeze(1))[:, None])
        lse = torch.logsumexp(zs, dim=-1)
        zero = torch.zeros((), dtype=torch.float32, device=z.device)
        lp = torch.where(valid, zs.gather(1, tgt[:, None]).squeeze(1) - lse, zero)
        log_p = zs - lse[:, None]
        ent = sq = mean = top1 = None
        if opt.entropy:
            entropy = -(log_p.exp() * log_p).sum(-1)
            ent = torch.where(valid, entropy, zero)
        if opt.log_sum_sq:
            sq = torch.where(valid, torch.logsumexp(2.0 * log_p, dim=-1), zero)
        if opt.mean_logits:
            mean = torch.where(valid, zs.mean(-1), zero)
        if opt.is_top1:  # the stored logits' argmax, as the Triton path's
            top1 = valid & (z.argmax(-1) == tgt)
        stats = (lp, ent, sq, mean, top1, lse)
    if grad is not None:
        log_p = z - lse[:, None]
        p = log_p.exp()
        d = torch.zeros_like(z)
        if g_lp is not None:
            g = g_lp.float()
            g = g[:, None] if g.dim() else g
            d = d - g * p
            # the target's entry g * (1 - p_t), its 1 - p_t as the mass outside the target (precise near p_t = 1)
            rest = p.scatter(1, tgt[:, None], 0.0).sum(dim=1, keepdim=True)
            d.scatter_(1, tgt[:, None], (g if g.dim() else g.reshape(1, 1)) * rest)
        if g_ent is not None:
            d = d - g_ent.float()[:, None] * p * (log_p + entropy[:, None])
        d = d * opt.inv_t
        if t is not None:
            d = d * (1.0 - t * t)
        d = d * opt.logit_scale
        d = d * valid[:, None].float()
        grad.copy_(d)
    return stats


def _lp_rows(backend, *args, **kwargs):
    if backend == "triton":
        from ._logprob_triton import lp_rows_triton

        return lp_rows_triton(*args, **kwargs)
    return lp_rows_torch(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# the chunked passes
# --------------------------------------------------------------------------------------------


def _watch_targets(t1: torch.Tensor, v: int, ignore_index: int) -> None:
    """Targets outside ``[0, V)`` (not ``ignore_index``) recorded in a flag that
    ``_device_errors`` reads back without a host sync (the row kernels score such rows as
    ignored); on CPU tensors (the interpreter) it is read at once."""
    t64 = t1.long()
    oob = ((t64 < 0) | (t64 >= v)) & (t64 != ignore_index)
    zero = t64.new_zeros(())
    flag = torch.stack((oob.sum(), torch.where(oob & (t64 >= v), t64, zero).max(),
                        torch.where(oob & (t64 < 0), t64, zero).min()))
    _device_errors.watch(flag, "fused_linear_logprobs", v, ignore_index)
    if flag.device.type != "cuda":
        _device_errors.poll()


def _rows_per_chunk(n, v, h, elem, backend, device):
    if device.type == "cpu":
        return max(1, min(n, FLCE_CHUNK_BYTES_CPU // (4 * v)))
    return _chunk_rows(n, v, h, elem, backend, device)


def _pass(h, w, b, target, opt, backend, cdt, idx, *, stats, grads, g_lp=None, g_ent=None, lse=None, entropy=None,
          keep=None):
    """One chunked pass over the non-ignored rows ``idx`` (all rows when ``None``).

    ``stats``: compute the per-row statistics (returns them, full length, zeros on ignored rows);
    ``grads`` = (hidden, weight, bias) flags: compute those gradients for the upstream ``g_lp``
    (0-d or [N]) / ``g_ent`` ([N]) with the row ``lse`` / ``entropy`` (from this pass when
    ``stats``). ``keep`` (``[N, V]`` in ``cdt``, with ``stats``, no ``grads``, every row): each
    chunk's logits are made in its rows and turned in place into ``d log_probs / d logits``, which
    stays there (:func:`_kept_grads` finishes the gradients from it). Returns ``(stats or None,
    grad_hidden, grad_weight, grad_bias)``.
    """
    n, hdim = h.shape
    v = w.shape[0]
    dev = h.device
    f32 = torch.float32
    need_gh, need_gw, need_gb = grads
    any_grad = need_gh or need_gw or need_gb
    wc = w if w.dtype == cdt else w.to(cdt)
    bc = None if b is None else (b if b.dtype == cdt else b.to(cdt))
    m = n if idx is None else idx.numel()
    rows = _rows_per_chunk(max(m, 1), v, hdim, torch.finfo(cdt).bits // 8, backend, dev)
    out = None
    # the Triton row kernel writes each chunk's statistics into these rows' slices (every row when no
    # row is skipped: no fill, no copy launches)
    direct = stats and backend == "triton" and idx is None
    if stats:
        new = torch.empty if direct else torch.zeros
        z = lambda: new(n, dtype=f32, device=dev)  # noqa: E731
        out = [z(), z() if opt.entropy else None, z() if opt.log_sum_sq else None,
               z() if opt.mean_logits else None,
               new(n, dtype=torch.bool, device=dev) if opt.is_top1 else None, z()]
    # every row of grad_hidden is written when no row is skipped; the first chunk writes grad_weight
    gh = (torch.empty if idx is None else torch.zeros)((n, hdim), dtype=cdt, device=dev) if need_gh else None
    # grad_weight sums every chunk's product: in fp32 on the torch path and for fp32 weights (e.g. an
    # fp32 master copy under bf16 autocast), in the compute dtype otherwise (an fp32 copy of a bf16
    # weight would be 2x the weight in extra memory)
    acc_dtype = f32 if (backend == "torch" or w.dtype == f32) else cdt
    gw = (torch.empty if acc_dtype == cdt and m else torch.zeros)((v, hdim), dtype=acc_dtype, device=dev) if need_gw else None
    gb = torch.zeros(v, dtype=f32, device=dev) if need_gb else None
    buf = keep if keep is not None else torch.empty((min(rows, max(m, 1)), v), dtype=cdt, device=dev)
    wt = wc.t()
    for start in range(0, m, rows):
        end = min(m, start + rows)
        if idx is None:
            sl = slice(start, end)
            hc, tc = h[sl], target[sl]
        else:
            sl = idx[start:end]
            hc, tc = h.index_select(0, sl), target.index_select(0, sl)
        if hc.dtype != cdt:
            hc = hc.to(cdt)
        logits = buf[start:end] if keep is not None else buf[: end - start]
        if bc is not None:
            torch.addmm(bc, hc, wt, out=logits)
        else:
            torch.mm(hc, wt, out=logits)
        pick = lambda x: None if x is None else (x if x.dim() == 0 else x[sl])  # noqa: E731
        ent_c = pick(entropy)
        if stats:
            # each target logit in fp32 from its rows (a 16-bit store rounds it by up to 2^-9)
            head = (hc, wc, bc) if (EXACT_TARGET and logits.element_size() < 4 and hc.stride(-1) == 1
                                    and wc.stride(-1) == 1) else None
            if direct:
                st = _lp_rows(backend, logits, tc, opt, head=head, out=[None if x is None else x[sl] for x in out])
            else:
                st = _lp_rows(backend, logits, tc, opt, head=head)
                for i, x in enumerate(st):
                    if x is not None:
                        out[i][sl] = x
            lse_c = st[5]
            if st[1] is not None:
                ent_c = st[1]
        else:
            lse_c = pick(lse)
        if keep is not None:  # the gradient of sum(log_probs), kept for the backward
            _lp_rows(backend, logits, tc, opt, grad=logits, g_lp=_unit(dev), lse=lse_c)
        if any_grad:
            if g_ent is not None and ent_c is None:
                raise RuntimeError("an entropy gradient needs the entropy; ask for it in want")
            _lp_rows(backend, logits, tc, opt, grad=logits, g_lp=pick(g_lp), g_ent=pick(g_ent), lse=lse_c, entropy=ent_c)
            d = logits
            if need_gw:
                if acc_dtype != d.dtype:
                    gw += (d.t() @ hc).to(acc_dtype)
                elif start == 0:
                    torch.mm(d.t(), hc, out=gw)
                else:
                    gw.addmm_(d.t(), hc)
            if need_gb:
                gb += d.float().sum(0)
            if need_gh:
                if idx is None:
                    torch.mm(d, wc, out=gh[sl])
                else:
                    gh.index_copy_(0, sl, d @ wc)
        hc = tc = None
    buf = None
    gh = None if gh is None else gh.to(h.dtype)
    gw = None if gw is None else gw.to(w.dtype)
    gb = None if gb is None else gb.to(b.dtype)
    return out, gh, gw, gb


def _unit(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


#: ``grad_mode="recompute"`` keeps the logits' gradient of ``sum(log_probs)`` (``[N, V]`` in the
#: compute dtype) from the forward to the backward, instead of computing the logits again there,
#: when it takes at most this many bytes: the size of the chunked passes' own logits buffer at a
#: 128k vocabulary (``loss._chunk_rows``), held until the backward. The backward then runs two
#: matmuls instead of three and no row kernel (a DPO policy head of 4096 scored rows x 2048 x
#: 128256: one 2.2 TFLOP matmul less a step, ``benchmarks/NOTES.md``).
KEEP_GRAD_MAX_BYTES = 2**30


def _keeps_gradient(n: int, v: int, cdt: torch.dtype, backend: str) -> bool:
    """Whether a ``grad_mode="recompute"`` call of ``n`` rows over ``v`` classes keeps the logits'
    gradient (:data:`KEEP_GRAD_MAX_BYTES`): on the Triton path (the GPU, and the interpreter that
    tests it); the torch reference (CPU tensors) recomputes in chunks of a few MiB."""
    return backend == "triton" and 0 < n * v * (torch.finfo(cdt).bits // 8) <= KEEP_GRAD_MAX_BYTES


def _kept_grads(d0, h, w, b, target, g_lp, opt, cdt, needs):
    """The gradients of ``sum(g_lp * log_probs)`` from the kept ``d0 = d sum(log_probs) / d logits``
    (``[N, V]``, zero on ignored rows): each row's upstream scales ``grad_hidden``'s row after the
    product, and the hidden row (``d0``'s rows) in ``grad_weight``'s (``grad_bias``'s) product. An
    ignored row's upstream counts as 0 (whatever it is: a NaN there must not reach the gradients)."""
    need_gh, need_gw, need_gb = needs
    v = w.shape[0]
    valid = (target != opt.ignore_index) & (target >= 0) & (target < v)
    g = g_lp.float()
    g = torch.where(valid, g, g.new_zeros(()))[:, None]
    wc = w if w.dtype == cdt else w.to(cdt)
    gh = gw = gb = None
    if need_gh:
        gh = (torch.mm(d0, wc).float() * g).to(h.dtype)
    if need_gw:
        gw = torch.mm(d0.t(), (h.float() * g).to(cdt)).to(w.dtype)
    if need_gb:
        gb = torch.mv(d0.t(), g[:, 0].to(cdt)).to(b.dtype)
    return gh, gw, gb


def _contract_message(values: list[int]) -> str:
    return (f"fused_linear_logprobs(grad_mode='sum'): the upstream gradient of log_probs differed between "
            f"non-ignored rows ({values[0]} row(s) other than the first one's value), a per-token weighting "
            "that grad_mode='sum' is not for; grad_weight and grad_bias of that backward were scaled by the "
            "first row's value (grad_hidden row by row, exact). Use grad_mode='uniform' (compares at backward "
            "time, one host read) or 'recompute' for such a loss")


def _common_value(g: torch.Tensor, target: torch.Tensor, ignore_index: int, *,
                  compare_on_host: bool) -> torch.Tensor | None:
    """The upstream's value at the first non-ignored row, as a 0-d tensor, where every non-ignored
    row has it. An upstream broadcast from one value (the gradient of a sum: stride 0) has it by its
    layout, read without a host sync. Any other: with ``compare_on_host`` (``grad_mode="uniform"``)
    compared on the device and read once, ``None`` when the rows differ; without it
    (``grad_mode="sum"``, no host read) the rows that differ are counted on the device and reported
    by ``_device_errors.poll``."""
    if g.numel() == 0:
        return g.new_zeros(())
    if g.numel() == 1 or g.stride(0) == 0:
        return g.reshape(-1)[0]
    valid = target != ignore_index
    first = g.gather(0, valid.to(torch.uint8).argmax().reshape(1)).reshape(())  # row 0 when none is valid
    differ = valid & (g != first)
    if compare_on_host:
        return None if bool(differ.any()) else first
    off = differ.sum()
    _device_errors.watch_contract(torch.stack((off, off.new_zeros(()), off.new_zeros(()))),
                                  "fused_linear_logprobs", _contract_message)
    return first


def _scale_unit(unit, g: torch.Tensor, target: torch.Tensor, ignore_index: int, common: torch.Tensor | None):
    """The forward's gradients of ``sum(log_probs)`` (``(gh, gw, gb)``, in place: the forward's own
    buffers) for the upstream ``g``: ``grad_hidden`` row by row (exact for any ``g``; ignored rows,
    zero already, stay zero), ``grad_weight`` and ``grad_bias`` by ``common``."""
    gh, gw, gb = unit
    if gh is not None:
        if g.numel() == 1 or g.stride(0) == 0:
            gh.mul_(g.reshape(-1)[0].to(gh.dtype))
        else:
            rows = torch.where(target != ignore_index, g, g.new_zeros(()))
            gh.mul_(rows.to(gh.dtype)[:, None])
    for x in (gw, gb):
        if x is not None:
            x.mul_(common.to(x.dtype))
    return gh, gw, gb


class _FusedLinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, b, target, opt, backend, cdt, grad_mode, backward_context):
        ctx.set_materialize_grads(False)
        ctx.backward_context = backward_context
        idx = None  # every row: skipping ignored ones would need their count on the host
        needs = tuple(ctx.needs_input_grad[:3])
        needs = (needs[0], needs[1], needs[2] and b is not None)
        ctx.opt, ctx.backend, ctx.cdt, ctx.needs, ctx.idx = opt, backend, cdt, needs, idx
        ctx.unit = ctx.kept = None
        ctx.grad_mode = grad_mode
        if grad_mode in ("uniform", "sum") and any(needs):
            out, gh, gw, gb = _pass(h, w, b, target, opt, backend, cdt, idx, stats=True, grads=needs,
                                    g_lp=_unit(h.device))
            ctx.unit = (gh, gw, gb)
        else:
            if any(needs) and _keeps_gradient(h.shape[0], w.shape[0], cdt, backend):
                ctx.kept = torch.empty((h.shape[0], w.shape[0]), dtype=cdt, device=h.device)
            out, *_ = _pass(h, w, b, target, opt, backend, cdt, idx, stats=True, grads=(False,) * 3, keep=ctx.kept)
        lp, ent, sq, mean, top1, lse = out
        ctx.save_for_backward(h, w, b, target, lse, ent)
        extra = [x for x in (sq, mean, top1) if x is not None]
        if extra:
            ctx.mark_non_differentiable(*extra)
        return lp, ent, top1, sq, mean

    @staticmethod
    def backward(ctx, g_lp, g_ent, *_):
        _device_errors.poll()
        if not any(ctx.needs) or (g_lp is None and g_ent is None):
            ctx.unit = ctx.kept = None
            return (None,) * 9
        idx = ctx.idx
        kept, ctx.kept = ctx.kept, None
        if kept is not None and g_ent is None:  # the forward's gradient of sum(log_probs), row-scaled
            h, w, b, target = ctx.saved_tensors[:4]
            with (ctx.backward_context() if ctx.backward_context is not None else contextlib.nullcontext()):
                gh, gw, gb = _kept_grads(kept, h, w, b, target, g_lp, ctx.opt, ctx.cdt, ctx.needs)
            return gh, gw, gb, None, None, None, None, None, None
        kept = None  # an entropy gradient: recomputed below
        if ctx.unit is not None and g_ent is None:
            target, ii = ctx.saved_tensors[3], ctx.opt.ignore_index
            _, need_gw, need_gb = ctx.needs
            if need_gw or need_gb:
                c = _common_value(g_lp, target, ii, compare_on_host=ctx.grad_mode == "uniform")
            else:
                c = g_lp  # grad_hidden alone: scaled row by row, exact for any upstream
            if c is not None:
                unit, ctx.unit = ctx.unit, None
                gh, gw, gb = _scale_unit(unit, g_lp, target, ii, c)
                if ctx.grad_mode == "sum" and g_lp.device.type != "cuda":
                    _device_errors.poll()  # CPU: this backward's own contract flag, readable now
                return gh, gw, gb, None, None, None, None, None, None
        ctx.unit = None
        h, w, b, target, lse, ent = ctx.saved_tensors
        g_lp = None if g_lp is None else g_lp.float().contiguous()
        g_ent = None if g_ent is None else g_ent.float().contiguous()
        with (ctx.backward_context() if ctx.backward_context is not None else contextlib.nullcontext()):
            _, gh, gw, gb = _pass(h, w, b, target, ctx.opt, ctx.backend, ctx.cdt, idx, stats=False,
                                  grads=ctx.needs, g_lp=g_lp, g_ent=g_ent, lse=lse, entropy=ent)
        return gh, gw, gb, None, None, None, None, None, None


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    want: Sequence[str] = FIELDS,
    ignore_index: int = -100,
    grad_mode: str = "recompute",
    compute_dtype: torch.dtype | None = None,
    backward_context: Callable[[], ContextManager] | None = None,
) -> LogProbOutput:
    """Per-row log-probabilities of ``target`` under ``hidden @ weight.T (+ bias)``, without
    ``[N, V]`` logits, and the other fields of :class:`LogProbOutput` named in ``want``.

    ``hidden`` is ``[..., H]``, ``weight`` ``[V, H]``, ``target`` ``hidden.shape[:-1]`` (or flat)
    class ids; rows whose target is ``ignore_index`` get all fields 0 and no gradient. The
    distribution is over ``softcap * tanh(logits * logit_scale / softcap) / temperature``.
    ``log_probs`` and ``entropy`` are differentiable in hidden, weight and bias with any upstream
    gradient; ``grad_mode="uniform"`` forms the gradient of ``sum(log_probs)`` in the forward,
    ``grad_mode="sum"`` too for a caller that guarantees a uniform upstream (see the module
    docstring). ``compute_dtype`` (default: hidden's dtype) is the dtype of the
    matmuls and of each chunk's logits (e.g. the autocast dtype); gradients come back in each
    input's own dtype. ``backward_context``: called for a context manager the backward's
    recomputation runs in (e.g. one that gathers a sharded head weight again).
    """
    _checks.tensor("hidden", hidden)
    _checks.tensor("weight", weight)
    _checks.tensor("target", target)
    _checks.float_dtype("hidden", hidden)
    _checks.float_dtype("weight", weight)
    if bias is not None:
        _checks.tensor("bias", bias)
        _checks.float_dtype("bias", bias)
    _checks.integer_target("target", target)
    if hidden.dim() < 1:
        raise ShapeMismatchError("hidden must have at least one dimension [..., H]")
    if weight.dim() != 2:
        raise ShapeMismatchError(f"weight must be 2-D [V, H], got shape {tuple(weight.shape)}")
    hdim, v = hidden.shape[-1], weight.shape[0]
    if weight.shape[1] != hdim:
        raise ShapeMismatchError(f"weight has shape {tuple(weight.shape)} but hidden's last dimension is {hdim}")
    if v == 0:  # no target is a class of an empty vocabulary (native: gather's RuntimeError)
        raise TargetOutOfRangeError("weight has 0 rows (vocabulary size 0): no target is in [0, 0)")
    if bias is not None and tuple(bias.shape) != (v,):
        raise ShapeMismatchError(f"bias must have shape ({v},) to match weight, got {tuple(bias.shape)}")
    rows_shape = tuple(hidden.shape[:-1])
    n = math.prod(rows_shape)
    if tuple(target.shape) != rows_shape and not (target.dim() == 1 and target.numel() == n):
        raise ShapeMismatchError(f"target has shape {tuple(target.shape)} but hidden needs {rows_shape} (or a flat [{n}])")
    device = _checks.same_device(hidden=hidden, weight=weight, bias=bias, target=target)
    temperature = float(temperature)
    if not temperature > 0 or math.isinf(temperature):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    if softcap is not None and not float(softcap) > 0.0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap}")
    logit_scale = float(logit_scale)
    if not math.isfinite(logit_scale):
        raise ValueError(f"logit_scale must be a finite number, got {logit_scale}")
    if isinstance(want, str):
        want = (want,)
    unknown = [f for f in want if f not in FIELDS]
    if unknown:
        raise ValueError(f"want names unknown fields {unknown}; choose from {FIELDS}")
    if grad_mode not in GRAD_MODES:
        raise ValueError(f"grad_mode must be one of {GRAD_MODES}, got {grad_mode!r}")
    if not torch.is_grad_enabled():
        grad_mode = "recompute"  # nothing to form in the forward
    cdt = hidden.dtype if compute_dtype is None else compute_dtype
    _checks.float_dtype("compute_dtype", torch.empty((), dtype=cdt))
    t1 = target.reshape(-1)
    backend = _dispatch.choose("fused_linear_logprobs", device)
    _device_errors.poll()
    _checks.target_range("target", t1, v, ignore_index, kernel_reports=backend == "triton")
    if t1.numel() and (backend == "triton" or device.type == "cuda"):
        _watch_targets(t1, v, int(ignore_index))
    opt = LPOptions(
        ignore_index=int(ignore_index), inv_t=1.0 / temperature,
        softcap=None if softcap is None else float(softcap), logit_scale=logit_scale,
        entropy="entropy" in want, is_top1="is_top1" in want,
        log_sum_sq="log_sum_sq_probs" in want, mean_logits="mean_logits" in want,
    )
    h2 = hidden.reshape(-1, hdim)
    if not h2.is_contiguous():
        h2 = h2.contiguous()
    lp, ent, top1, sq, mean = _FusedLinearLogProbs.apply(
        h2, weight, bias, t1, opt, backend, cdt, grad_mode, backward_context
    )
    view = lambda x: None if x is None else x.view(rows_shape)  # noqa: E731
    return LogProbOutput(view(lp), view(ent), view(top1), view(sq), view(mean))
