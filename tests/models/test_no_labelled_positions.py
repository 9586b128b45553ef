"""A batch without a labelled position (every label ``-100``, or a one-token sequence): the loss
and gradients are native's in training and evaluation, with and without ``num_items_in_batch``.

Native: transformers' causal-LM loss is a mean over the labelled positions, 0 / 0 = NaN, with zero
gradients; with ``num_items_in_batch`` a sum (0) over that count. The fused forward agrees.
"""

from __future__ import annotations

import math

import pytest
import torch

from model_helpers import grads, native, tiny


def _batch(model, case, seed):
    g = torch.Generator().manual_seed(seed)
    t = 1 if case == "one_token" else 9
    ids = torch.randint(3, model.config.vocab_size, (2, t), generator=g)
    labels = ids.clone() if case == "one_token" else torch.full_like(ids, -100)
    return ids, labels


def _takes_num_items(forward) -> bool:
    import inspect

    from liger_compat.shims._patching import unwrap

    params = inspect.signature(unwrap(forward)).parameters
    return "num_items_in_batch" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _step(model, ids, labels, kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    return out.loss.detach(), grads(model)


@pytest.mark.parametrize("family", ["llama", "gemma2", "mixtral"])
@pytest.mark.parametrize("case", ["all_ignored", "one_token"])
@pytest.mark.parametrize("num_items", [None, 7, "tensor"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_loss_and_grads_are_natives(family, case, num_items, mode):
    model = tiny(family)
    if num_items is not None and not _takes_num_items(type(model).forward):
        pytest.skip("the native forward takes no num_items_in_batch (transformers < 4.46): it raises TypeError")
    model.train(mode == "train")
    ids, labels = _batch(model, case, seed=len(case) + (num_items == 7))
    kw = {} if num_items is None else {"num_items_in_batch": torch.tensor(5) if num_items == "tensor" else num_items}
    loss, g = _step(model, ids, labels, kw)
    with native():
        ref, g_ref = _step(model, ids, labels, kw)
    assert math.isnan(ref) == (num_items is None)  # what native gives, so the test means something
    # NaN as native's, or its 0; a MoE family adds its router's auxiliary loss where its config asks
    # (transformers 4.48's tiny Mixtral), from hidden states the kernels computed: equal up to an ulp
    torch.testing.assert_close(loss, ref, equal_nan=True, rtol=1e-6, atol=0)
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert all(bool(torch.isfinite(x).all()) for x in g.values())


def test_a_labelled_batch_after_an_empty_one_is_finite():
    """The NaN belongs to the empty batch only: the next, labelled one trains as native does."""
    model = tiny("llama")
    ids, labels = _batch(model, "all_ignored", seed=3)
    assert math.isnan(_step(model, ids, labels, {})[0])
    labels = ids.clone()
    labels[:, :2] = -100
    loss, _ = _step(model, ids, labels, {})
    with native():
        ref, _ = _step(model, ids, labels, {})
    assert math.isfinite(loss)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
