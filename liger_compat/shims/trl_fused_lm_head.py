"""trl's fused LM heads scored by liger_compat's fused log-prob kernel (trl 1.15+), reported (trl 1.6+).

Upstream: trl 1.15+ ``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``, ``KTOTrainer`` (and RLOO,
distillation) call ``trl.trainer.utils.add_fused_lm_head(model, outputs=(...))`` in ``__init__``;
it replaces ``model.forward`` on the instance, and a call with ``fused_lm_head=True`` runs the
backbone and scores the labels through ``trl.trainer.utils._ChunkedLogProbFunction`` (log-probs,
entropy, is_top1, ...) without building the logits. trl 1.6 .. 1.14 ``SFTConfig(loss_type=
"chunked_nll")`` (the default from 1.10) patches the forward with ``_patch_chunked_ce_lm_head``.

Failure prevented: with trl's head in charge, liger_compat's fused loss never runs on the newest
trl (its own kernels are slower and use more memory than ours), and a ``check()`` that cannot say
which head computed the loss. This shim keeps trl's head function (``_fused_forward``: backbone
call, label shift or ``shift_labels``, compact scoring of unmasked rows, ``num_items_in_batch``,
the MoE aux loss, FSDP2 DTensor gathering, ZeRO-3 gathering, PEFT, ``cast_lm_head_to_fp32``,
``FusedCausalLMOutput``) and replaces only the chunked scoring function it calls with
:func:`liger_compat.kernels.logprob.fused_linear_logprobs` behind the same call contract, so
trl's ``ChunkedLogProbFunction`` is never called. Models given a head by ``SFTTrainer`` score with
``grad_mode="uniform"`` (the SFT loss is a plain sum of the log-probs over a token count; the
kernel checks that at backward time, one host read, and recomputes otherwise), and with
``grad_mode="sum"`` (no host read) inside ``SFTTrainer``'s own ``compute_loss`` (not overridden by a
subclass) with ``loss_type="nll"`` where trl scores the labelled rows only (``_use_triton`` true,
or trl 1.15.0, which always does): that loss is ``-sum(log_probs) / count`` over exactly those rows
(trl 1.15.0 .. 1.16.0's ``compute_loss``), so the guarantee holds; the kernel still counts on the
device any row that breaks it and raises. The other trainers weight tokens (DPO, GRPO, KTO) and
recompute in the backward. trl 1.6 .. 1.14 define an older
``_ChunkedLogProbFunction`` (returns log-probs and entropy; used by SFT's ``chunked_nll`` loss in
``trl.trainer.utils`` and by the DPO / GRPO / KTO modules that import it): where its signature is
trl 1.14's, it is replaced the same way in every module holding it, and calls with a target outside the
vocabulary (which those releases score as logit 0) go to trl's function.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any

from ._patching import ShimPatches, signature
from ._registry import REGISTRY, register
from ..compat import trl_trainer_locations as locations


SHIM_ID = "trl.fused_lm_head"
#: trl's own heads still in use (``chunked_nll``), as the report names them
heads: list[str] = []
#: trainer -> model class names whose trl head liger_compat's kernel scores
routed: dict[str, list[str]] = {}
#: scoring calls made through liger_compat's kernel (tests read it)
calls = {"ours": 0}

#: the ``grad_mode`` of the head call under way (set by the model forward of a trainer's head)
_GRAD_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("liger_compat_trl_head_grad_mode", default="recompute")
#: trainer modules whose loss is a plain sum of the log-probs over a count
_UNIFORM_TRAINERS = ("sft_trainer",)
#: set (True) while SFTTrainer's own compute_loss computes trl's NLL from the head's log-probs
_SUM_LOSS: contextvars.ContextVar[bool] = contextvars.ContextVar("liger_compat_trl_sft_sum_loss", default=False)


def _trl_version() -> str:
    from ..compat import versions

    return versions.installed("trl").raw or "?"


class ChunkedLogProbs:
    """Drop-in for trl's ``ChunkedLogProbFunction``: ``apply(hidden, weight, bias, targets,
    temperature, chunk_size, final_logit_softcapping=None, logit_scale=1.0, outputs=...)`` returning
    ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)`` (``None`` for fields not in
    ``outputs``), computed by :func:`~liger_compat.kernels.logprob.fused_linear_logprobs`.
    ``chunk_size`` (trl's vocabulary tile width) has no meaning for the kernel, which chunks rows."""

    OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    _liger_compat = True

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size=None, final_logit_softcapping=None,
              logit_scale=1.0, outputs=OPTIONAL_OUTPUTS):
        import torch

        from ..kernels.logprob import fused_linear_logprobs

        dev = hidden.device.type
        cdt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
        want = ("log_probs",) + tuple(f for f in outputs if f != "log_probs")
        grad_mode = _GRAD_MODE.get()
        if grad_mode == "sum" and not _scores_labelled_rows_only(hidden.device):
            grad_mode = "uniform"  # masked rows are scored too (as class 0) and get a zero upstream
        out = fused_linear_logprobs(
            hidden, weight, targets, bias=bias, temperature=temperature, softcap=final_logit_softcapping,
            logit_scale=1.0 if logit_scale is None else logit_scale, want=want, grad_mode=grad_mode,
            compute_dtype=cdt, backward_context=_gather_context(weight, bias),
        )
        calls["ours"] += 1
        return out.log_probs, out.entropy, out.log_sum_sq_probs, out.mean_logits, out.is_top1


def _scores_labelled_rows_only(device: Any) -> bool:
    """Whether trl's ``_fused_forward`` passes the scoring function the labelled rows only on
    ``device``: trl 1.16 decides with ``_use_triton(device)`` (Triton devices: compact rows; others:
    every row, masked ones as class 0); trl 1.15.0 has no such switch and always compacts."""
    import sys

    decide = getattr(sys.modules.get("trl.trainer.utils"), "_use_triton", None)
    return True if decide is None else bool(decide(device))


#: the forward parameters of trl 1.6 .. 1.14's _ChunkedLogProbFunction (read from trl 1.14) that the
#: legacy adapter implements; another signature is left to trl
_LEGACY_PARAMS = ("ctx", "last_hidden", "weight", "bias", "targets", "temperature", "chunk_size",
                  "final_logit_softcapping", "logit_scale")


def _legacy_adapter(original: Any) -> type:
    """Drop-in for trl 1.6 .. 1.14's ``_ChunkedLogProbFunction``: ``apply(hidden, weight, bias, targets,
    temperature, chunk_size, final_logit_softcapping=None, logit_scale=1.0)`` returning ``(log_probs,
    entropy)``. Those releases score a target outside the vocabulary (an unfiltered ``-100``) as logit 0
    (log-prob ``-logsumexp``); calls with such targets go to ``original`` so that stays exact."""

    class LegacyChunkedLogProbs:
        trl_function = original
        _liger_compat = True

        @staticmethod
        def apply(hidden, weight, bias, targets, temperature, chunk_size=None, final_logit_softcapping=None,
                  logit_scale=1.0):
            import torch

            from ..kernels.logprob import fused_linear_logprobs

            v = weight.shape[0]
            if targets.numel() and bool(((targets < 0) | (targets >= v)).any()):
                return original.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                      final_logit_softcapping, logit_scale)
            dev = hidden.device.type
            cdt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
            out = fused_linear_logprobs(
                hidden, weight, targets, bias=bias, temperature=temperature, softcap=final_logit_softcapping,
                logit_scale=1.0 if logit_scale is None else logit_scale, want=("log_probs", "entropy"),
                grad_mode=_GRAD_MODE.get(), compute_dtype=cdt, backward_context=_gather_context(weight, bias),
            )
            calls["ours"] += 1
            return out.log_probs, out.entropy

    return LegacyChunkedLogProbs


def _gather_context(weight, bias):
    """trl's ZeRO-3 gather of the head for the backward's recomputation (a no-op elsewhere)."""
    try:
        from trl.trainer.utils import maybe_gather_lm_head_ctx
    except ImportError:
        return None
    return lambda: maybe_gather_lm_head_ctx(weight, bias)


def _short(module: Any) -> str:
    return module.__name__.rsplit(".", 1)[-1]


#: nesting of the add_fused_lm_head wrappers (a trainer module's name for it wraps utils' wrapped one)
_depth = [0]


def _head_wrapper(trainer_module: str):
    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        _depth[0] += 1
        try:
            result = wrapped(*args, **kwargs)
        finally:
            _depth[0] -= 1
        if _depth[0]:  # the outermost wrapper (the trainer module's) names the trainer
            return result
        model = args[0] if args else kwargs.get("model")
        try:
            _route(model, trainer_module)
        except Exception:  # reporting and the speed hint are extras: never break the trainer
            pass
        return result

    return wrapper


def _route(model: Any, trainer_module: str) -> None:
    name = type(model).__name__
    trainer = trainer_module.replace("_trainer", "") if trainer_module != "utils" else "add_fused_lm_head"
    names = routed.setdefault(trainer, [])
    if name not in names:
        names.append(name)
    if trainer_module in _UNIFORM_TRAINERS:
        fwd = vars(model).get("forward")
        if fwd is not None and not getattr(fwd, "_liger_compat_head", False):
            model.forward = _with_grad_mode(fwd)


def _with_grad_mode(fwd: Any) -> Any:
    """``fwd`` (trl's head forward of one model) running its ``fused_lm_head=True`` calls with the
    kernel's ``grad_mode`` set to ``"sum"`` inside trl's own SFT NLL (:data:`_SUM_LOSS`), else
    ``"uniform"``; keeps the signature ``generate`` validates against."""

    @functools.wraps(fwd)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("fused_lm_head"):
            return fwd(*args, **kwargs)
        token = _GRAD_MODE.set("sum" if _SUM_LOSS.get() else "uniform")
        try:
            return fwd(*args, **kwargs)
        finally:
            _GRAD_MODE.reset(token)

    forward._liger_compat_head = True  # type: ignore[attr-defined]
    forward._liger_compat_wraps = fwd  # type: ignore[attr-defined]
    return forward


def _sft_sum_loss(trainer: type) -> Any:
    """Middleware on ``trainer.compute_loss`` (trl's ``SFTTrainer``): sets :data:`_SUM_LOSS` while
    trl's own method, not a subclass's, computes the NLL (``loss_type="nll"``, no
    ``compute_loss_func``)."""

    def middleware(call_next: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        own = next((klass for klass in type(instance).__mro__ if "compute_loss" in vars(klass)), None)
        if (own is not trainer or getattr(getattr(instance, "args", None), "loss_type", None) != "nll"
                or getattr(instance, "compute_loss_func", None) is not None):
            return call_next(args, kwargs)
        token = _SUM_LOSS.set(True)
        try:
            return call_next(args, kwargs)
        finally:
            _SUM_LOSS.reset(token)

    return middleware


def _chunked_nll_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    model = args[0] if args else kwargs.get("model")
    name = type(model).__name__
    import sys

    utils = sys.modules.get("trl.trainer.utils")
    ours = getattr(getattr(utils, "_ChunkedLogProbFunction", None), "_liger_compat", False)
    if not ours:
        REGISTRY.report_conflict(
            f"{name} LM head",
            f"trl {_trl_version()} SFT loss_type='chunked_nll'",
            "trl's chunked head computes the loss and metrics for every SFT forward with labels; liger_compat's "
            "fused linear cross-entropy stays off that path, its RMSNorm / RoPE / SwiGLU kernels still run "
            "inside the decoder",
        )
    entry = (f"trl's SFT loss_type='chunked_nll' head on {name}"
             + (" (scored by liger_compat's fused log-prob kernel)" if ours else ""))
    if entry not in heads:
        heads.append(entry)
    return result


def _in_use() -> str:
    parts = []
    if routed:
        parts.append("in use: trl's add_fused_lm_head scored by liger_compat's fused log-prob kernel for "
                     + ", ".join(f"{t} ({', '.join(m)})" for t, m in routed.items()))
    if heads:
        parts.append("in use: " + "; ".join(heads) + " (liger_compat layer kernels inside the decoder)")
    return "; ".join(parts)


def _patch(module: Any, patches: ShimPatches) -> list[str]:
    done = []
    short = _short(module)
    # the chunked scoring function, looked up in the module's globals on every call: trl 1.15+ in
    # trl.trainer.utils (add_fused_lm_head); trl 1.6 .. 1.14 also in the DPO / GRPO / KTO modules that
    # import it, with an older signature (no `outputs`, returns log-probs and entropy)
    fn = getattr(module, "_ChunkedLogProbFunction", None)
    if isinstance(fn, type) and hasattr(fn, "apply") and not getattr(fn, "_liger_compat", False):
        try:
            params = tuple(signature(fn.forward).parameters)
        except (TypeError, ValueError):
            params = ()
        if "outputs" in params:
            patches.set(module, "_ChunkedLogProbFunction", ChunkedLogProbs)
            done.append(f"{short}._ChunkedLogProbFunction")
        elif params == _LEGACY_PARAMS:
            patches.set(module, "_ChunkedLogProbFunction", _legacy_adapter(fn))
            done.append(f"{short}._ChunkedLogProbFunction")
        else:
            done.append(f"not needed: {short}._ChunkedLogProbFunction has an unknown signature, left to trl")
    # trl 1.6 .. 1.14: SFTConfig(loss_type="chunked_nll"), the default from 1.10, patches the forward
    if callable(getattr(module, "_patch_chunked_ce_lm_head", None)):
        patches.wrap(module, "_patch_chunked_ce_lm_head", _chunked_nll_wrapper)
        done.append(f"{short}._patch_chunked_ce_lm_head")
    if callable(getattr(module, "add_fused_lm_head", None)):
        patches.wrap(module, "add_fused_lm_head", _head_wrapper(short))
        done.append(f"{short}.add_fused_lm_head")
        trainer = getattr(module, "SFTTrainer", None)
        if short in _UNIFORM_TRAINERS and isinstance(trainer, type) and "compute_loss" in vars(trainer):
            patches.middleware(trainer, "compute_loss", _sft_sum_loss(trainer))
            done.append(f"{short}.SFTTrainer.compute_loss")
    return done


register(
    id=SHIM_ID,
    library="trl",
    trigger="trl",
    target="trl add_fused_lm_head (trl.trainer.utils._ChunkedLogProbFunction, and every trainer module "
           "importing add_fused_lm_head)",
    upstream="trl 1.15+ trainers install their own chunked fused LM head with add_fused_lm_head",
    fixes=(),
    description=__doc__.split("\n\n")[0],
    modules=("trl.trainer.utils",) + locations.all_trainer_modules(),
    patch_module=_patch,
    in_use=_in_use,
)


# --------------------------------------------------------------------------------------------
# check(): which head computes each trainer's loss
# --------------------------------------------------------------------------------------------

#: trainers whose loss comes from the LM head's log-probs, as check() lists them
_LM_TRAINERS = ("sft", "dpo", "grpo", "kto", "rloo", "orpo", "cpo")


def _trainer_source(name: str) -> str | None:
    """The source text of trl's module for trainer ``name`` (newest location first), read from the
    installed distribution's files without importing trl."""
    from importlib import metadata

    try:
        dist = metadata.distribution("trl")
    except metadata.PackageNotFoundError:
        return None
    for mod in locations.TRAINER_MODULES.get(name, ()):
        path = dist.locate_file(mod.replace(".", "/") + ".py")
        try:
            return open(path, encoding="utf-8").read()
        except OSError:
            continue
    return None


def trainer_heads() -> dict[str, str]:
    """Trainer -> which head computes its loss on the installed trl, with liger_compat as it is now
    (active or disabled, this shim applied or not): ``liger_compat fused log-probs``, ``trl's ...``
    or ``native logits``. Read from trl's sources (feature probes on the text), importing nothing."""
    from .._config import settings

    shim = next((s for s in REGISTRY.shims() if s.id == SHIM_ID), None)
    ours = (not settings.disabled and shim is not None
            and getattr(shim.state, "value", str(shim.state)) in ("applied", "waiting"))
    out: dict[str, str] = {}
    for name in _LM_TRAINERS:
        text = _trainer_source(name)
        if text is None:
            continue
        label = locations.PREFIX[name] + "Trainer"
        if "add_fused_lm_head(" in text:
            out[label] = ("liger_compat fused log-probs (trl's add_fused_lm_head contract)" if ours
                          else "trl's ChunkedLogProbFunction (add_fused_lm_head)")
        elif "_ChunkedLogProbFunction" in text:
            # trl 1.6 .. 1.14: only with use_liger_kernel does the trainer call trl's chunked log-prob function
            # (read from trl 1.14's DPO / KTO); liger_compat turns that switch off while it applies its kernels
            out[label] = ("native logits: per-token log-probs from the model's full logits (not fused); trl's "
                          "chunked path (use_liger_kernel) " + ("scored by liger_compat fused log-probs" if ours
                                                                else "is trl's _ChunkedLogProbFunction"))
        elif name == "sft" and "_patch_chunked_ce_lm_head" in text:
            head = ("trl's chunked_nll head scored by liger_compat fused log-probs" if ours
                    else "trl's chunked_nll head")
            out[label] = (head + " (loss_type='chunked_nll', the default from trl 1.10); with loss_type='nll': "
                          "the model's forward with labels (liger_compat fused cross-entropy on patched models)")
        elif name == "sft":
            out[label] = "the model's forward with labels (liger_compat fused cross-entropy on patched models)"
        elif name in ("orpo", "cpo"):
            out[label] = "native logits: log-probs and NLL from the model's full logits (not fused)"
        else:
            out[label] = "native logits: per-token log-probs from the model's full logits (not fused)"
    return out
