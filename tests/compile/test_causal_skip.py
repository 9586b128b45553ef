"""Flash attention under ``torch.compile``: a model called without a padding mask gets SDPA with
``is_causal=True`` and no mask tensor in the compiled graph, as in eager mode, and the same loss."""

from __future__ import annotations

import pytest
import torch

from liger_compat.shims import REGISTRY
from liger_compat.shims.compiled_causal_skip import SHIM_ID, skip_when_compiling
from liger_compat.compat.tiny_models import FamilyUnavailable, build

from test_compile import Recorder, _batch, _skip_if_native_breaks_too


def _sdpa_calls(rec: Recorder) -> list[dict]:
    """The mask and is_causal arguments of every SDPA call in the recorded dynamo graphs."""
    calls = []
    for gm in rec.graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and "scaled_dot_product_attention" in str(node.target):
                mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
                calls.append({"mask": mask is not None, "is_causal": node.kwargs.get("is_causal", False)})
    return calls


def _compiled_calls(model, ids, labels):
    torch._dynamo.reset()
    rec = Recorder("eager")
    out = torch.compile(model, backend=rec, fullgraph=True)(input_ids=ids, labels=labels)
    torch._dynamo.reset()
    return _sdpa_calls(rec), out.loss.detach()


def _model():
    try:
        model = build("llama", seed=0).train()
    except FamilyUnavailable as exc:
        pytest.skip(str(exc))
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("4.48"):
        pytest.skip(f"transformers {transformers.__version__} picks the attention class when the model is built "
                    "(the tiny model's is eager); the masking this shim adapts exists from 4.53")
    model.config._attn_implementation = "sdpa"
    _skip_if_native_breaks_too(model, *_batch(model, seed=0), "llama")  # (4.54: its output-capturing decorator)
    return model


def _has_masking_utils() -> bool:
    try:
        import transformers.masking_utils as mu
    except ImportError:
        return False
    return hasattr(mu, "_ignore_causal_mask_sdpa")


def test_compiled_model_without_padding_mask_runs_sdpa_causal_without_a_mask():
    model = _model()
    ids, labels = _batch(model, seed=3)
    calls, loss = _compiled_calls(model, ids, labels)
    assert calls and all(c == {"mask": False, "is_causal": True} for c in calls), calls
    with torch.no_grad():
        eager = model(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(loss, eager, rtol=1e-4, atol=1e-4 * eager.abs().item())


def test_native_compiled_masking_of_this_transformers():
    """Fails-without: with the shim suspended, the compiled graph of the installed transformers carries
    a materialised mask wherever its check does not skip under dynamo (4.53 - 5.2x, or torch < 2.13)."""
    model = _model()
    ids, labels = _batch(model, seed=4)
    with REGISTRY.suspended(SHIM_ID):
        native, native_loss = _compiled_calls(model, ids, labels)
    patched, loss = _compiled_calls(model, ids, labels)
    torch.testing.assert_close(loss, native_loss, rtol=1e-4, atol=1e-4 * native_loss.abs().item())
    if not any(c["mask"] for c in native):
        import transformers

        pytest.skip(f"transformers {transformers.__version__} with torch {torch.__version__} already skips the "
                    "mask under compile")
    assert not any(c["mask"] for c in patched), patched


def test_a_padding_mask_is_kept_under_compile():
    model = _model()
    ids, labels = _batch(model, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    torch._dynamo.reset()
    rec = Recorder("eager")
    out = torch.compile(model, backend=rec, fullgraph=True)(input_ids=ids, attention_mask=mask, labels=labels)
    torch._dynamo.reset()
    calls = _sdpa_calls(rec)
    assert calls and all(c["mask"] for c in calls), calls
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(out.loss.detach(), eager, rtol=1e-4, atol=1e-4 * eager.abs().item())


@pytest.mark.parametrize("case, expected", [
    (dict(padding_mask=None, q_length=8, kv_length=8), True),
    (dict(padding_mask=None, query_length=1, kv_length=9), True),
    (dict(padding_mask=None, q_length=4, kv_length=9, q_offset=5), False),
    (dict(padding_mask=None, q_length=4, kv_length=9, q_offset=0), True),
    (dict(padding_mask=torch.ones(1, 8, dtype=torch.bool), q_length=8, kv_length=8), False),
    (dict(padding_mask=None, q_length=8, kv_length=8, local_attention_size=4), False),
    (dict(padding_mask=None, q_length=8, kv_length=8, local_attention_size=16), True),
    (dict(padding_mask=None, q_length=8, kv_length=8, q_offset=torch.tensor(0)), False),
])
def test_skip_rule(case, expected):
    assert skip_when_compiling(case) is expected


def test_skip_rule_never_while_exporting(monkeypatch):
    monkeypatch.setattr(torch.compiler, "_is_exporting_flag", True, raising=False)
    assert skip_when_compiling(dict(padding_mask=None, q_length=8, kv_length=8)) is False


def test_eager_calls_get_upstreams_answer():
    mu = pytest.importorskip("transformers.masking_utils")
    if not _has_masking_utils():
        pytest.skip("no _ignore_causal_mask_sdpa in this transformers")
    fn = mu._ignore_causal_mask_sdpa
    original = fn.__wrapped__
    import inspect

    names = list(inspect.signature(original).parameters)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        q = int(torch.randint(1, 9, (1,), generator=g))
        kv = q + int(torch.randint(0, 3, (1,), generator=g))
        pad = None if torch.rand(1, generator=g) < 0.5 else torch.rand(2, kv, generator=g) < 0.9
        values = {"padding_mask": pad, "q_length": q, "query_length": q, "kv_length": kv, "q_offset": 0,
                  "kv_offset": 0, "local_attention_size": None}
        args = [values[n] for n in names if n in values]
        assert fn(*args) == original(*args)
