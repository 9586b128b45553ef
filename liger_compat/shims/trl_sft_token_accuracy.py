"""SFTTrainer's token-accuracy and entropy metrics when the fused forward returns no logits (F1).

Upstream: trl 0.15 ``SFTTrainer.compute_loss`` started logging ``mean_token_accuracy`` from
``outputs.logits[..., :-1, :]`` unless ``args.use_liger`` (0.16+: ``use_liger_kernel``) is set;
trl 0.22 added ``entropy`` from ``entropy_from_logits(outputs.logits)`` (masked by the attention
mask; from 1.3 by the shifted labels); trl 0.26 reads ``outputs.token_accuracy`` on its liger path.
trl 1.10 .. 1.14 default to ``loss_type="chunked_nll"`` (trl's own head; affected with ``"nll"``) and
trl 1.15+ scores SFT through its own fused LM head and reads no logits (not needed there).

Failure prevented: with liger_compat's fused causal-LM forward the model returns ``logits=None``
together with a ``token_accuracy`` computed inside the kernel, and ``compute_loss`` died with
``TypeError: 'NoneType' object is not subscriptable`` after the loss was computed.

What the shim does, per ``compute_loss`` call, without copying trl's metric code:

* a forward hook on the trainer's model sees the output; when it is a fused one (``logits`` None,
  ``token_accuracy`` present), the trainer's own liger switch is turned on *for the rest of that
  call*, so trl takes the branch it has for a logits-free model (no input kwargs are added: the
  switch is off while trl prepares the inputs). The switch is restored before ``compute_loss`` returns.
* the metrics trl's liger branch does not log are then logged exactly as the native branch would:
  ``mean_token_accuracy`` as correct / valid tokens over all ranks (``correct`` recovered from the
  fused fraction and the number of valid shifted labels), and ``entropy`` from the decoder's last
  hidden state (captured by a second hook) through the LM head in row chunks under ``no_grad``,
  with the version's own masking. trl 0.26 .. 1.14's liger branch logs an accuracy of its own, the
  plain mean of the ranks' ``token_accuracy`` fractions; on more than one rank with different
  numbers of valid tokens that is not the native figure, so the shim takes that value back and
  logs the native one in its place.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

from ._patching import ShimPatches, unwrap
from ._registry import register


SHIM_ID = "trl.sft_token_accuracy"
_ROWS_BYTES = 1 << 28  # logits of one entropy chunk: at most 256 MiB in float32


class SFTMetricStyle(NamedTuple):
    """What the installed ``SFTTrainer.compute_loss`` does, read from its source."""

    switch: str  # "use_liger_kernel" (0.16+) or "use_liger" (0.15)
    logs_accuracy_on_switch: bool  # 0.26+: reads outputs.token_accuracy on the liger branch
    entropy: str | None  # None, "attention_mask" (0.22 .. 1.2) or "labels" (1.3+)
    mode_from_control: bool  # 0.16 .. 0.21 pick train/eval from control.should_evaluate
    metrics_by_mode: bool  # 0.16+: self._metrics[mode][key]


def read_style(compute_loss: Any) -> SFTMetricStyle | str:
    """The metric style of a ``compute_loss``, or the reason the shim is not needed for it."""
    try:
        src = inspect.getsource(unwrap(compute_loss))
    except (OSError, TypeError) as exc:
        return f"cannot read SFTTrainer.compute_loss: {exc}"
    if "outputs.logits" not in src:
        return "SFTTrainer.compute_loss reads no logits (trl < 0.15, or trl's own fused LM head)"
    if "self.args.use_liger_kernel" in src:
        switch = "use_liger_kernel"
    elif "self.args.use_liger" in src:
        switch = "use_liger"
    else:
        raise RuntimeError("SFTTrainer.compute_loss reads outputs.logits without a liger switch to steer it")
    entropy = None
    if "entropy_from_logits" in src:
        entropy = "labels" if "entropy_sum" in src else "attention_mask"
    return SFTMetricStyle(
        switch=switch,
        logs_accuracy_on_switch="outputs.token_accuracy" in src,
        entropy=entropy,
        mode_from_control="self.control.should_evaluate" in src,
        metrics_by_mode="self._metrics[mode]" in src,
    )


def _is_fused_output(out: Any) -> bool:
    getter = out.get if hasattr(out, "get") and not isinstance(out, tuple) else None
    if getter is None:
        return False
    return getter("logits") is None and getter("token_accuracy") is not None


def _base_model(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT wrappers


class _Capture:
    def __init__(self) -> None:
        self.fused_out: Any = None
        self.hidden: Any = None

    def on_model(self, module: Any, args: Any, out: Any) -> None:
        if _is_fused_output(out):
            self.fused_out = out

    def on_decoder(self, module: Any, args: Any, out: Any) -> None:
        h = out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", None)
        if h is None and hasattr(out, "__getitem__"):
            h = out[0]
        self.hidden = h.detach() if h is not None else None


def _head_logits(model: Any, hidden: Any) -> Any:
    """Final logits of ``hidden`` rows, with the family's soft-cap / divisor when it has one."""
    from ..compat import families
    from . import causal_lm

    fam = families.family_of(type(model))
    if fam is not None:  # the family's own head, soft-cap and divisor (the fused forward's)
        return causal_lm._logits(model, fam, hidden)
    import torch  # a model outside the families: the plain head plus the usual config quirks

    logits = model.get_output_embeddings()(hidden)
    cfg = model.config
    if getattr(cfg, "logits_scaling", None):
        logits = logits / cfg.logits_scaling
    if getattr(cfg, "final_logit_softcapping", None):
        c = cfg.final_logit_softcapping
        logits = torch.tanh(logits / c) * c
    return logits


def row_entropy(model: Any, rows: Any) -> Any:
    """Entropy of the next-token distribution of each row of hidden states ``[N, H]``, in chunks."""
    import torch

    vocab = model.get_output_embeddings().weight.shape[0]
    step = max(1, _ROWS_BYTES // (4 * vocab))
    out = []
    with torch.no_grad():
        for i in range(0, rows.shape[0], step):
            logits = _head_logits(model, rows[i:i + step]).float()
            logp = torch.log_softmax(logits, dim=-1)
            out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out) if out else rows.new_zeros(0, dtype=torch.float32)


def _shifted_labels(inputs: Any) -> Any:
    if inputs.get("shift_labels") is not None:
        return inputs["shift_labels"]
    labels = inputs.get("labels")
    return None if labels is None else labels[..., 1:]


def _log_accuracy(trainer: Any, metrics: Any, out: Any, inputs: Any) -> None:
    import torch

    acc = out.get("token_accuracy")
    labels = _shifted_labels(inputs)
    if labels is None:
        return
    valid = (labels != -100).sum()
    correct = torch.round(acc.detach().float().to(valid.device) * valid).to(valid.dtype)
    correct = trainer.accelerator.gather_for_metrics(correct)
    valid = trainer.accelerator.gather_for_metrics(valid)
    total = valid.sum()
    metrics["mean_token_accuracy"].append((correct.sum() / total).item() if total > 0 else 0.0)


def _log_entropy(trainer: Any, metrics: Any, style: SFTMetricStyle, hidden: Any, inputs: Any) -> None:
    import torch

    model = _base_model(trainer.model)
    if style.entropy == "labels":
        labels = _shifted_labels(inputs)
        h = hidden if inputs.get("shift_labels") is not None else hidden[:, :-1]
        mask = labels != -100
        ent_sum = row_entropy(model, h[mask]).sum() if mask.any() else hidden.new_zeros((), dtype=torch.float32)
        ent_sum = trainer.accelerator.gather_for_metrics(ent_sum).sum()
        total = trainer.accelerator.gather_for_metrics(mask.sum()).sum()
        metrics["entropy"].append((ent_sum / total).item() if total > 0 else 0.0)
        return
    am = inputs.get("attention_mask")
    if am is not None:
        sel = am.bool()
        ent = row_entropy(model, hidden[sel])
        weights = am[sel].to(ent.dtype)
        value = (ent * weights).sum() / am.sum()
    elif inputs.get("position_ids") is not None:
        value = row_entropy(model, hidden.reshape(-1, hidden.shape[-1])).mean()
    else:
        return
    metrics["entropy"].append(trainer.accelerator.gather_for_metrics(value).mean().item())


def _metrics_for(trainer: Any, style: SFTMetricStyle) -> Any:
    if not style.metrics_by_mode:
        return trainer._metrics
    if style.mode_from_control:
        mode = "eval" if trainer.control.should_evaluate else "train"
    else:
        mode = "train" if trainer.model.training else "eval"
    return trainer._metrics[mode]


def _make_wrapper(style: SFTMetricStyle):
    def compute_loss(wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
        targs = getattr(instance, "args", None)
        if instance is None or targs is None or getattr(targs, style.switch, False) or not hasattr(inputs, "get"):
            return wrapped(*args, **kwargs)
        if getattr(instance, "num_virtual_tokens", 0):
            return wrapped(*args, **kwargs)  # prompt-learning PEFT: trl's own path (needs the logits)
        cap = _Capture()
        model = instance.model
        handles = []
        switched = False

        def on_model(module: Any, a: Any, out: Any) -> None:
            nonlocal switched
            cap.on_model(module, a, out)
            if cap.fused_out is not None and not switched:
                setattr(targs, style.switch, True)  # trl now takes its logits-free branch
                switched = True

        logged = len(_metrics_for(instance, style).get("mean_token_accuracy", ()))
        handles.append(model.register_forward_hook(on_model))
        if style.entropy is not None:
            decoder = getattr(_base_model(model), "model", None)
            if decoder is not None and hasattr(decoder, "register_forward_hook"):
                handles.append(decoder.register_forward_hook(cap.on_decoder))
        try:
            result = wrapped(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()
            if switched:
                setattr(targs, style.switch, False)
        if cap.fused_out is None:
            return result
        metrics = _metrics_for(instance, style)
        if style.logs_accuracy_on_switch and len(metrics.get("mean_token_accuracy", ())) == logged + 1:
            metrics["mean_token_accuracy"].pop()  # trl's unweighted mean over ranks: the native one replaces it
        _log_accuracy(instance, metrics, cap.fused_out, inputs)
        if style.entropy is not None and cap.hidden is not None:
            _log_entropy(instance, metrics, style, cap.hidden, inputs)
        return result

    return compute_loss


def _patch_sft_module(module: Any, patches: ShimPatches) -> list[str]:
    trainer = getattr(module, "SFTTrainer", None)
    if trainer is None or "compute_loss" not in trainer.__dict__:
        return []
    style = read_style(trainer.__dict__["compute_loss"])
    if isinstance(style, str):
        return [f"not needed: {style}"]
    wrapper = _make_wrapper(style)

    def middleware(call_next: Any, wrapped: Any, instance: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        return wrapper(lambda *a, **k: call_next(a, k), instance, args, kwargs)

    # a middleware: the trl head shim has one on the same method, each revertible in any order
    patches.middleware(trainer, "compute_loss", middleware)
    extra = ["accuracy"] + (["entropy"] if style.entropy else [])
    return [f"SFTTrainer.compute_loss (switch {style.switch}; logs {', '.join(extra)})"]


register(
    id=SHIM_ID,
    library="trl",
    trigger="trl",
    target="SFTTrainer.compute_loss (mean_token_accuracy, entropy)",
    versions=">=0.15",  # the upper end (1.15) is found by reading compute_loss: it reads no logits there
    upstream="trl 0.15 SFTTrainer.compute_loss logs mean_token_accuracy from outputs.logits; "
             "0.22 adds entropy_from_logits(outputs.logits)",
    fixes=("F1",),
    description=__doc__.split("\n\n")[0],
    modules=("trl.trainer.sft_trainer",),
    patch_module=_patch_sft_module,
)
