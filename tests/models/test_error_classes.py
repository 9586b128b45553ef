"""Bad input raises an error of the class native transformers / torch raise for the same input.

Our checks give clearer messages than native (they name the argument), and their classes keep the
built-in class they always had (``TypeError`` / ``ValueError``), but code written against the
native path catches native's class (``except IndexError`` around a step whose labels may hold an
out-of-vocabulary id, ``except RuntimeError``): every error here is also of that class
(``liger_compat/kernels/errors.py``). Each case builds fresh random inputs, calls native (the
unpatched model; torch's functional ops for the kernels' API) and ours, and asserts
``isinstance(ours, type(native))`` and that our message names the argument. The patched model runs
on the kernel path (``LIGER_COMPAT_CPU_NATIVE=0``, what every GPU runs) and on the default CPU path.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from liger_compat import _config, kernels
from liger_compat.kernels import errors
from model_helpers import native, random_batch, tiny

PATHS = ("kernel", "cpu_native")


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    monkeypatch.setattr(_config.settings, "cpu_native", request.param == "cpu_native")
    return request.param


def _raised(fn) -> BaseException:
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - what is raised is what the test compares
        return exc
    loss = getattr(out, "loss", out)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        try:
            loss.sum().backward()
        except Exception as exc:  # noqa: BLE001
            return exc
    raise AssertionError(f"no error raised (returned {type(out).__name__})")


def _same_class(ours: BaseException, nat: BaseException, arg: str) -> None:
    assert isinstance(ours, type(nat)), (
        f"ours {type(ours).__mro__} is not a {type(nat).__name__} (native: {nat!r}); ours: {ours!r}")
    if str(ours) != str(nat):  # our own message (native's own error passes through unchanged)
        assert arg in str(ours), f"{ours!r} does not name {arg}"


# --------------------------------------------------------------------------------------------
# the patched model (labels of a training forward)
# --------------------------------------------------------------------------------------------


def _vocab_out(labels, v, rnd):
    labels[rnd.randrange(labels.shape[0]), rnd.randrange(1, labels.shape[1])] = v + rnd.randrange(0, 1000)
    return labels


def _negative(labels, v, rnd):
    labels[rnd.randrange(labels.shape[0]), rnd.randrange(1, labels.shape[1])] = -rnd.randrange(1, 100)
    return labels


def _below_ignore(labels, v, rnd):
    labels[rnd.randrange(labels.shape[0]), rnd.randrange(1, labels.shape[1])] = -100 - rnd.randrange(1, 1000)
    return labels


def _float(labels, v, rnd):
    return labels.float() + torch.rand(labels.shape)


def _bool(labels, v, rnd):
    return labels > v // 2


def _batch(labels, v, rnd):
    return torch.randint(0, v, (labels.shape[0] + rnd.randrange(1, 4), labels.shape[1]))


def _length(labels, v, rnd):
    return torch.randint(0, v, (labels.shape[0], labels.shape[1] - rnd.randrange(1, 4)))


def _not_a_tensor(labels, v, rnd):
    return labels.tolist()


LABEL_CASES = {
    "label >= vocab": _vocab_out,
    "negative label other than ignore_index": _negative,
    "label < -100": _below_ignore,
    "float labels": _float,
    "bool labels": _bool,
    "labels of another batch size": _batch,
    "labels of another length": _length,
    "labels not a tensor": _not_a_tensor,
}


@pytest.mark.parametrize("case", list(LABEL_CASES))
def test_bad_labels_raise_natives_class(case, path):
    seed = random.randrange(2**31)
    rnd = random.Random(seed)
    model = tiny("llama")
    ids, labels = random_batch(model, seed=seed)
    bad = LABEL_CASES[case](labels, model.config.vocab_size, rnd)
    with native():
        nat = _raised(lambda: model(input_ids=ids, labels=bad))
    ours = _raised(lambda: model(input_ids=ids, labels=bad))
    _same_class(ours, nat, "labels")
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("case", ["label >= vocab", "float labels", "labels of another length"])
def test_bad_shift_labels_raise_natives_class(case, path):
    seed = random.randrange(2**31)
    rnd = random.Random(seed)
    model = tiny("llama")
    ids, labels = random_batch(model, seed=seed)
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()  # native .view()s it
    bad = LABEL_CASES[case](shift, model.config.vocab_size, rnd)
    try:
        with native():
            nat = model(input_ids=ids, labels=labels, shift_labels=bad)
    except Exception as exc:  # noqa: BLE001 - what is raised is what the test compares
        nat = exc
    if not isinstance(nat, BaseException):
        # transformers 4.46-4.49: native's loss reads labels only, bad shift_labels and all: so do we
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids, labels=labels, shift_labels=bad).loss, nat.loss)
        return
    ours = _raised(lambda: model(input_ids=ids, labels=labels, shift_labels=bad))
    _same_class(ours, nat, "labels")  # "shift_labels" names it; before 4.46 both forwards refuse the kwarg


def test_trl_head_bad_labels_raise_natives_class(path):
    """trl's fused LM head (``fused_lm_head=True``), scored by our log-prob kernel under the shim."""
    utils = pytest.importorskip("trl.trainer.utils")
    if not hasattr(utils, "add_fused_lm_head"):
        pytest.skip("this trl has no add_fused_lm_head")
    seed = random.randrange(2**31)
    rnd = random.Random(seed)
    model = tiny("llama")
    utils.add_fused_lm_head(model)
    ids, labels = random_batch(model, seed=seed)
    for case in ("float labels", "labels of another batch size", "labels of another length"):
        bad = LABEL_CASES[case](labels.clone(), model.config.vocab_size, rnd)
        with native():
            nat = _raised(lambda: model(input_ids=ids, labels=bad, fused_lm_head=True).log_probs)
        if type(nat).__module__.startswith("triton"):
            # trl 1.15.0 on CPU: its head cannot run natively (known issue trl-head-on-cpu), so the suite
            # runs its Triton kernels through the interpreter (tests/conftest.py), whose errors are its own
            pytest.skip(f"native's head runs in Triton's interpreter here: {type(nat).__name__}")
        ours = _raised(lambda: model(input_ids=ids, labels=bad, fused_lm_head=True).log_probs)
        _same_class(ours, nat, "target")


# --------------------------------------------------------------------------------------------
# the kernels' API against torch's functional ops
# --------------------------------------------------------------------------------------------


def _head(seed, n=None, h=None, v=None):
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    n, h, v = n or rnd.randrange(3, 9), h or rnd.randrange(4, 12), v or rnd.randrange(8, 40)
    return (torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) / h**0.5,
            torch.randn(v, generator=g), torch.randint(0, v, (n,), generator=g), rnd)


def _native_ce(hidden, weight, target, bias=None, **kw):
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits.flatten(0, -2), target, **kw)


def _native_logprobs(hidden, weight, target, bias=None):
    logits = F.linear(hidden, weight, bias).float()
    return logits.log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)


def _flce_cases():
    """name -> (argument our message names, function of (hidden, weight, bias, target, rnd) giving
    the changed (hidden, weight, bias, target, options))."""

    def put(t, value, rnd):
        t = t.clone()
        t[rnd.randrange(t.shape[0])] = value
        return t

    return {
        "target >= V": ("target", lambda h, w, b, t, r: (h, w, b, put(t, w.shape[0] + r.randrange(1000), r), {})),
        "target negative": ("target", lambda h, w, b, t, r: (h, w, b, put(t, -r.randrange(1, 100), r), {})),
        "target < ignore_index": ("target", lambda h, w, b, t, r: (h, w, b, put(t, -101 - r.randrange(100), r), {})),
        "float target": ("target", lambda h, w, b, t, r: (h, w, b, t.float() + torch.rand(t.shape), {})),
        "bool target": ("target", lambda h, w, b, t, r: (h, w, b, t > w.shape[0] // 2, {})),
        "target longer than the rows": ("target", lambda h, w, b, t, r: (
            h, w, b, torch.randint(0, w.shape[0], (t.shape[0] + r.randrange(1, 4),)), {})),
        "target of two dimensions": ("target", lambda h, w, b, t, r: (h, w, b, t[:, None], {})),
        "hidden / weight dtype": ("weight", lambda h, w, b, t, r: (h.bfloat16(), w, None, t, {})),
        "bias dtype": ("bias", lambda h, w, b, t, r: (h, w, b.bfloat16(), t, {})),
        "hidden / weight shape": ("weight", lambda h, w, b, t, r: (
            h, torch.randn(w.shape[0], w.shape[1] + r.randrange(1, 4)), None, t, {})),
        "weight of three dimensions": ("weight", lambda h, w, b, t, r: (h, torch.stack([w, w]), None, t, {})),
        "bias shape": ("bias", lambda h, w, b, t, r: (h, w, torch.randn(w.shape[0] + r.randrange(1, 4)), t, {})),
        "0-d hidden": ("hidden", lambda h, w, b, t, r: (torch.randn(()), w, None, t, {})),
        "empty vocabulary": ("weight", lambda h, w, b, t, r: (h, w[:0], None, t, {})),
        "integer hidden and weight": ("hidden", lambda h, w, b, t, r: (
            torch.randint(-9, 9, h.shape), torch.randint(-9, 9, w.shape), None, t, {})),
        "hidden not a tensor": ("hidden", lambda h, w, b, t, r: (h.tolist(), w, None, t, {})),
        "label_smoothing > 1": ("label_smoothing", lambda h, w, b, t, r: (
            h, w, None, t, {"label_smoothing": 1.0 + r.random() + 1e-3})),
        "reduction": ("reduction", lambda h, w, b, t, r: (h, w, None, t, {"reduction": "avg"})),
    }


FLCE_CASES = _flce_cases()


@pytest.mark.parametrize("case", list(FLCE_CASES))
def test_fused_linear_cross_entropy_raises_cross_entropys_class(case, path):
    arg, change = FLCE_CASES[case]
    hidden, weight, bias, target, rnd = _head(random.randrange(2**31))
    h, w, b, t, kw = change(hidden, weight, bias, target, rnd)
    nat = _raised(lambda: _native_ce(h, w, t, b, **kw))
    ours = _raised(lambda: kernels.fused_linear_cross_entropy(h, w, t, bias=b, **kw))
    _same_class(ours, nat, arg)


CE_CASES = ("target >= V", "target negative", "target < ignore_index", "float target", "bool target",
            "target longer than the rows", "target of two dimensions", "label_smoothing > 1", "reduction")


@pytest.mark.parametrize("case", [*CE_CASES, "integer logits", "0-d logits", "empty vocabulary"])
def test_cross_entropy_raises_cross_entropys_class(case, path):
    hidden, weight, bias, target, rnd = _head(random.randrange(2**31))
    logits = F.linear(hidden, weight)
    kw = {}
    if case == "integer logits":
        arg, lg, t = "logits", torch.randint(-9, 9, logits.shape), target
    elif case == "0-d logits":
        arg, lg, t = "logits", torch.randn(()), target
    elif case == "empty vocabulary":
        arg, lg, t = "logits", logits[:, :0], target
    else:
        arg, change = FLCE_CASES[case]
        _, w, _, t, kw = change(hidden, weight, bias, target, rnd)
        lg = logits[:, : w.shape[0]]
    nat = _raised(lambda: F.cross_entropy(lg, t, **kw))
    ours = _raised(lambda: kernels.cross_entropy(lg, t, **kw))
    _same_class(ours, nat, arg)


#: (hidden and weight of two dtypes are no error there: the kernel computes in ``compute_dtype``)
LOGPROB_CASES = ("target >= V", "float target", "target longer than the rows", "hidden / weight shape", "bias shape",
                 "empty vocabulary", "hidden not a tensor")


@pytest.mark.parametrize("case", LOGPROB_CASES)
def test_fused_linear_logprobs_raises_the_class_of_natives_log_probs(case, path):
    """trl's native log-probs: ``log_softmax`` of the logits, ``gather`` at the targets."""
    arg, change = FLCE_CASES[case]
    hidden, weight, bias, target, rnd = _head(random.randrange(2**31))
    h, w, b, t, _ = change(hidden, weight, bias, target, rnd)
    nat = _raised(lambda: _native_logprobs(h, w, t, b))
    ours = _raised(lambda: kernels.fused_linear_logprobs(h, w, t, bias=b).log_probs)
    _same_class(ours, nat, arg)


def _module_cases():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as native_rope

    def rope(q, k, cos, sin, **kw):
        return lambda: native_rope(q, k, cos, sin, **kw), lambda: kernels.apply_rotary_pos_emb(q, k, cos, sin, **kw)

    def qkcs(r, d=8, rot=None, seq=None):
        s = seq or r.randrange(3, 7)
        rot = rot or d
        return (torch.randn(1, 2, s, d), torch.randn(1, 1, s, d), torch.randn(1, s, rot), torch.randn(1, s, rot))

    def norm(x, w):
        return lambda: F.rms_norm(x, (w.shape[-1],), w), lambda: kernels.rms_norm(x, w)

    def glu(gate, up, act, ours):
        return lambda: act(gate) * up, lambda: ours(gate, up)

    gelu = lambda x: F.gelu(x, approximate="tanh")  # noqa: E731
    return {
        "rms_norm weight shape": ("weight", lambda r: norm(torch.randn(3, 8), torch.randn(8 + r.randrange(1, 4)))),
        "rms_norm integer input": ("x", lambda r: norm(torch.randint(-9, 9, (3, 8)), torch.randint(-9, 9, (8,)))),
        "rms_norm 0-d input": ("x", lambda r: norm(torch.randn(()), torch.randn(1))),
        "swiglu shapes": ("gate", lambda r: glu(torch.randn(3, 8), torch.randn(3, 8 + r.randrange(1, 4)), F.silu,
                                                kernels.swiglu)),
        "swiglu integer": ("gate", lambda r: glu(torch.randint(-9, 9, (3, 8)), torch.randint(-9, 9, (3, 8)), F.silu,
                                                 kernels.swiglu)),
        "geglu shapes": ("gate", lambda r: glu(torch.randn(3, 8), torch.randn(3 + r.randrange(1, 4), 8), gelu,
                                               kernels.geglu)),
        "rope cos / sin shapes": ("cos", lambda r: rope(*qkcs(r)[:3], torch.randn(1, 4, 6))),
        "rope q / k head_dim": ("head_dim", lambda r: rope(qkcs(r)[0], torch.randn(1, 1, 4, 6), *qkcs(r, seq=4)[2:])),
        "rope rotary dim > head_dim": ("rotary dim", lambda r: rope(*qkcs(r, rot=10, seq=5))),
        "rope positions": ("cos", lambda r: rope(*qkcs(r, seq=5)[:2], *qkcs(r, seq=6)[2:])),
        "rope unsqueeze_dim": ("unsqueeze_dim", lambda r: rope(*qkcs(r), unsqueeze_dim=r.randrange(5, 9))),
    }


MODULE_CASES = _module_cases()


@pytest.mark.parametrize("case", list(MODULE_CASES))
def test_module_kernels_raise_natives_class(case, path):
    arg, build = MODULE_CASES[case]
    torch.manual_seed(random.randrange(2**31))
    run_native, run_ours = build(random.Random(random.randrange(2**31)))
    nat = _raised(run_native)
    ours = _raised(run_ours)
    _same_class(ours, nat, arg)


@pytest.mark.gpu
def test_inputs_on_two_devices_raise_natives_class():
    hidden, weight, _, target, _ = _head(random.randrange(2**31))
    nat = _raised(lambda: _native_ce(hidden.cuda(), weight, target.cuda()))
    ours = _raised(lambda: kernels.fused_linear_cross_entropy(hidden.cuda(), weight, target.cuda()))
    _same_class(ours, nat, "weight")


def test_every_error_class_keeps_its_old_base_and_adds_natives():
    """The classes' bases: the built-in class each check raised before, and native's."""
    want = {
        "TargetOutOfRangeError": (ValueError, IndexError, RuntimeError),
        "TargetDtypeError": (TypeError, NotImplementedError),  # CPU: RuntimeError, CUDA: NotImplementedError
        "ShapeMismatchError": (ValueError, RuntimeError),
        "DtypeMismatchError": (TypeError, RuntimeError),
        "DeviceMismatchError": (ValueError, RuntimeError),
        "UnsupportedDtypeError": (TypeError, NotImplementedError),
        "DimensionError": (ValueError, IndexError),
        "OptionRangeError": (ValueError, RuntimeError),
        "NotATensorError": (TypeError, AttributeError),  # AttributeError from labels.to(...) in 4.46-4.50
        "GradientContractError": (ValueError,),  # native log-probs take any upstream gradient: no counterpart
    }
    assert set(errors.__all__) == set(want)
    for name, bases in want.items():
        cls = getattr(errors, name)
        assert getattr(kernels, name) is cls
        assert cls.__bases__ == bases, (name, cls.__bases__)
    from liger_compat.kernels import _device_errors

    assert _device_errors.TargetOutOfRangeError is errors.TargetOutOfRangeError
