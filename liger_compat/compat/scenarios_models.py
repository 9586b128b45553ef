"""The ``check --deep`` scenarios of the model shims: F2, F3 and F4 on a tiny random model.

Each builds a tiny model of a family (:mod:`.tiny_models`) with the shims applied and checks the
behaviour the known issue breaks: a call without labels returns real logits (F2, trl's DPO),
``logits_to_keep`` under either name returns ``[B, k, V]`` (F3, GRPO), FlashAttention kwargs of
a packed batch leave the loss unchanged (F4); a fused training output comes back from a torch
pytree round trip (what DDP does to outputs), pickle and deepcopy as the same class ("outputs").
"""

from __future__ import annotations

import sys

from . import families
from .scenarios import Context, Skip, scenario


def _tiny(ctx: Context, family: str = "llama"):
    import torch

    from .tiny_models import FamilyUnavailable, build

    try:
        model = build(family, seed=ctx.seed, device=ctx.device, dtype=getattr(torch, ctx.dtype))
    except FamilyUnavailable as exc:
        raise Skip(str(exc)) from None
    from ..shims import causal_lm

    if not causal_lm.is_fused(type(model)):
        fam = families.BY_NAME[family]
        raise AssertionError(f"{type(model).__name__}.forward is not the fused forward "
                             f"({causal_lm.describe(fam, sys.modules[type(model).__module__])})")
    g = torch.Generator().manual_seed(ctx.seed)
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=g).to(ctx.device)
    return model, ids


@scenario("F2", "DPO-style call without labels returns real logits", issue="F2", requires=("transformers",))
def _scenario_f2(ctx: Context) -> str:
    import torch

    model, ids = _tiny(ctx)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
        if out.logits is None or tuple(out.logits.shape) != (*ids.shape, model.config.vocab_size):
            raise AssertionError(f"no labels: logits {None if out.logits is None else tuple(out.logits.shape)}")
        last = model(input_ids=ids, attention_mask=mask, logits_to_keep=3).logits
        torch.testing.assert_close(last, out.logits[:, -3:], rtol=1e-4, atol=1e-4)
        evaluated = model(input_ids=ids, attention_mask=mask, labels=ids)  # eval mode: logits and the loss
        if evaluated.loss is None or evaluated.logits is None or evaluated.logits.shape != out.logits.shape:
            raise AssertionError("labels given in eval mode: expected the loss and the logits")
        model.train()
        fused = model(input_ids=ids, attention_mask=mask, labels=ids)
        # the key, not the attribute: reading a skipped ``logits`` warns the user (LogitsSkippedWarning)
        if fused.get("logits") is not None or fused.loss is None or not hasattr(fused, "token_accuracy"):
            raise AssertionError("labels given in train mode: expected a fused loss, logits=None and token_accuracy")
        tol = 1e-4 if fused.loss.dtype == torch.float32 and model.dtype == torch.float32 else 3e-2
        torch.testing.assert_close(fused.loss.float(), evaluated.loss.float(), rtol=tol, atol=tol)
    loss = fused.loss.item()
    return f"no labels -> logits {tuple(out.logits.shape)}; labels -> fused loss {loss:.4f}, eval: + logits"


@scenario("F3", "GRPO-style logits_to_keep on a causal LM returns [B, k, V]", issue="F3",
          requires=("transformers",))
def _scenario_f3(ctx: Context) -> str:
    import torch

    from ..shims._forward_args import NEW, OLD

    from .tiny_models import FamilyUnavailable, build

    try:
        model = build("qwen2", seed=ctx.seed, device=ctx.device, dtype=getattr(torch, ctx.dtype))
    except FamilyUnavailable as exc:
        raise Skip(str(exc)) from None
    v = model.config.vocab_size
    g = torch.Generator().manual_seed(ctx.seed)
    ids = torch.randint(3, v, (2, 16), generator=g).to(ctx.device)
    with torch.no_grad():
        full = model(ids).logits
        shapes = {}
        for name in (NEW, OLD):
            out = model(ids, **{name: 4}).logits
            shapes[name] = tuple(out.shape)
            if tuple(out.shape) != (2, 4, v):
                raise AssertionError(f"model(ids, {name}=4).logits has shape {tuple(out.shape)}, expected (2, 4, {v})")
            torch.testing.assert_close(out, full[:, -4:], rtol=1e-4, atol=1e-4)
        idx = torch.tensor([0, 7, 15], device=ctx.device)
        out = model(ids, logits_to_keep=idx).logits
        if tuple(out.shape) != (2, 3, v):
            raise AssertionError(f"logits_to_keep=<index tensor of 3> gave shape {tuple(out.shape)}")
        torch.testing.assert_close(out, full[:, idx], rtol=1e-4, atol=1e-4)
    return f"Qwen2ForCausalLM: logits_to_keep=4 and num_logits_to_keep=4 -> {shapes[NEW]}; index tensor -> (2, 3, {v})"


@scenario("F4", "FlashAttention kwargs of packed batches reach the decoder, not the loss", issue="F4",
          requires=("transformers",))
def _scenario_f4(ctx: Context) -> str:
    import torch

    model, ids = _tiny(ctx)
    from ..shims._forward_args import forward_params

    varkw = forward_params(model.model.forward).varkw
    if not varkw:
        raise Skip("this transformers' decoder takes no FlashAttention kwargs (added in 4.47)")
    b, t = ids.shape
    cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=ids.device)
    fa = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=t, max_length_k=t)
    with torch.no_grad():
        plain = model(input_ids=ids, labels=ids)
        packed = model(input_ids=ids, labels=ids, **fa)
    torch.testing.assert_close(packed.loss, plain.loss, rtol=1e-4, atol=1e-4)
    return f"loss with cu_seq_lens_q/k, max_length_q/k = {packed.loss.item():.4f} (same as without)"


@scenario("outputs", "a fused training output survives the pytree rebuild of DDP / FSDP, pickle and deepcopy",
          requires=("transformers",))
def _scenario_outputs(ctx: Context) -> str:
    """DDP with ``find_unused_parameters`` (the Trainer's default) flattens every output with torch's
    pytree and builds it again as ``cls(**dict(keys, values))``: the rebuilt output must be the same
    class with the same keys and values, and still carry ``token_accuracy``."""
    import copy
    import pickle

    import torch
    import torch.utils._pytree as pytree

    seen = []
    for family in ("llama", "mixtral"):
        try:
            model, ids = _tiny(ctx, family)
        except Skip:
            continue
        model.train()
        out = model(input_ids=ids, labels=ids)
        if out.get("token_accuracy") is None:
            raise AssertionError(f"{family}: the fused training output carries no token_accuracy")
        leaves, spec = pytree.tree_flatten(out)
        back = pytree.tree_unflatten(leaves, spec)  # DDP's _post_forward
        if type(back) is not type(out) or list(back.keys()) != list(out.keys()):
            raise AssertionError(f"{family}: rebuilt as {type(back).__name__} {list(back.keys())}, "
                                 f"not {type(out).__name__} {list(out.keys())}")
        if back.loss is not out.loss or back.token_accuracy is not out.token_accuracy:
            raise AssertionError(f"{family}: the rebuilt output holds other values")
        if pytree.treespec_loads(pytree.treespec_dumps(spec)) != spec:
            raise AssertionError(f"{family}: the output's tree spec does not serialise back to its class")
        with torch.no_grad():
            plain = model(input_ids=ids, labels=ids)
        for copied in (pickle.loads(pickle.dumps(plain)), copy.deepcopy(plain)):
            if type(copied) is not type(plain) or not torch.equal(copied.token_accuracy, plain.token_accuracy):
                raise AssertionError(f"{family}: pickle / deepcopy gave {type(copied).__name__} {list(copied.keys())}")
        seen.append(type(out).__name__)
    if not seen:
        raise Skip("no tiny model of llama or mixtral on this transformers")
    return f"{', '.join(seen)}: pytree round trip, spec serialisation, pickle and deepcopy keep class and keys"
