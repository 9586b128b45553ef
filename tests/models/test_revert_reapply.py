"""revert / apply / configure on models patched with ``apply(model=...)``: the instance patches come
back with every later ``apply()`` and kernel selection, a wrapped-over instance forward of ours runs
nothing of ours after ``revert()``, and the signature caches do not grow with revert / apply cycles."""

from __future__ import annotations

import functools

import torch

import liger_compat
from liger_compat import kernels
from liger_compat.shims import _forward_args, causal_lm
from model_helpers import GatedMLP, LlamaStyleRMSNorm, random_batch, tiny


class RemoteRMSNorm(LlamaStyleRMSNorm):
    pass


class RemoteMLP(GatedMLP):
    pass


def _net():
    torch.manual_seed(4)
    return torch.nn.Sequential(RemoteRMSNorm(16), RemoteMLP(16, 24))


def _kernels_run(net, x):
    kernels.last_backend.clear()
    with torch.no_grad():
        out = net(x)
    return out, set(kernels.last_backend)


def test_apply_after_revert_patches_the_models_given_to_apply_again():
    net = _net()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        ref = net(x)
    liger_compat.apply(model=net)
    assert {"rms_norm", "swiglu"} <= _kernels_run(net, x)[1]
    assert liger_compat.revert() == []
    out, used = _kernels_run(net, x)
    assert not used & {"rms_norm", "swiglu"}
    liger_compat.apply()  # no model=: the one given before is patched again
    out, used = _kernels_run(net, x)
    assert {"rms_norm", "swiglu"} <= used, used
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_kernel_selection_keeps_the_instance_patches_of_the_selected_kernels():
    net = _net()
    x = torch.randn(2, 5, 16)
    liger_compat.apply(model=net)
    try:
        liger_compat.configure(kernels="rms_norm,fused_linear_cross_entropy")
        used = _kernels_run(net, x)[1]
        assert "rms_norm" in used and "swiglu" not in used, used
        assert "forward" not in vars(net[1])
    finally:
        liger_compat.configure(kernels="all")
    assert {"rms_norm", "swiglu"} <= _kernels_run(net, x)[1]


def test_an_instance_forward_wrapped_over_runs_nothing_of_ours_after_revert():
    net = _net()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        ref = net(x)
    liger_compat.apply(model=net)
    norm = net[0]
    ours = norm.forward
    # as accelerate's add_hook_to_module does: the instance forward replaced by one calling it
    norm.forward = functools.update_wrapper(functools.partial(lambda mod, *a, **k: ours(*a, **k), norm), ours)
    try:
        first = liger_compat.revert()
        assert first and "RemoteRMSNorm.forward" in first[0], first
        out, used = _kernels_run(net, x)
        assert not used & {"rms_norm", "swiglu"}, used
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        assert liger_compat.revert() == first, "the forward left in place is reported again"
        liger_compat.apply()  # ours again, under the other library's forward
        assert {"rms_norm", "swiglu"} <= _kernels_run(net, x)[1]
    finally:
        del norm.forward
        liger_compat.revert()
        liger_compat.apply()


def test_signature_caches_do_not_grow_with_revert_apply_cycles():
    model = tiny("llama")
    ids, labels = random_batch(model)

    def step():
        with torch.no_grad():
            model(ids, labels=labels)  # positional input_ids: the positional names are read too

    step()
    sizes = []
    for _ in range(3):
        liger_compat.revert()
        liger_compat.apply()
        step()
        sizes.append((len(_forward_args._param_cache), len(causal_lm._positional_cache)))
    assert sizes[0] == sizes[-1], sizes
