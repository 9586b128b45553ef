"""shims._sharded_head in one process: the fused head loss runs inside the head module's hooks when
an engine manages it, directly otherwise, and always equals the plain fused loss.

Engines are imitated by their observable traits: FSDP2 makes the head's class a subclass of
``FSDPModule`` and gathers the weight in a forward pre-hook; ZeRO-3 leaves ``ds_id`` /
``ds_status`` on a 0-element parameter and fetches it in a pre-hook; accelerate's hooks replace
``forward`` on the instance and keep the original in ``_old_forward``. The real engines run in
test_gloo.py (FSDP2, DDP, gloo) and test_multi_gpu.py (NCCL).
"""

from __future__ import annotations

import sys
import types

import pytest

torch = pytest.importorskip("torch")

from liger_compat.kernels import fused_linear_cross_entropy  # noqa: E402
from liger_compat.shims import _sharded_head as sd  # noqa: E402

V, H, N = 96, 24, 40


class FSDPModule:  # the name is what head_sharding() recognises, as for torch's FSDPModule
    pass


class FakeFSDP2Linear(FSDPModule, torch.nn.Linear):
    """Keeps a 'shard' outside forward; the pre-hook installs the full weight, the post-hook
    puts the shard back (like reshard_after_forward)."""

    def __init__(self, full: torch.Tensor):
        torch.nn.Linear.__init__(self, H, V, bias=False)
        self.full = torch.nn.Parameter(full.clone())
        self.events: list[str] = []
        self._shard()
        self.register_forward_pre_hook(self._pre)
        self.register_forward_hook(self._post)

    def _shard(self):
        del self.weight
        self.weight = self.full.detach()[: V // 2]  # wrong shape on purpose: reading it is a bug

    def _pre(self, mod, args):
        self.events.append("pre")
        del self.weight
        self.weight = self.full  # the gathered parameter, whose gradient the engine reduces

    def _post(self, mod, args, out):
        self.events.append("post")
        self._shard()


def data(seed: int):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g) * 0.3
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.rand(N, generator=g) < 0.2] = -100
    return h, w, t


def reference(h, w, t, **kw):
    h2 = h.detach().clone().requires_grad_(True)
    w2 = w.detach().clone().requires_grad_(True)
    out = fused_linear_cross_entropy(h2, w2, t, **kw)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return out, h2.grad, w2.grad


@pytest.mark.parametrize("seed", [0, 1])
def test_plain_head_is_a_direct_call(seed):
    h, w, t = data(seed)
    head = torch.nn.Linear(H, V, bias=True)
    with torch.no_grad():
        head.weight.copy_(w)
        # a bias of the logits' own size, from this test's seed (the layer's default init is small
        # and drawn from the global generator: its effect on the loss was within allclose's tolerance)
        head.bias.copy_(torch.randn(V, generator=torch.Generator().manual_seed(seed + 100)))
    calls = sd.engine_calls
    loss = sd.fused_head_loss(head, h, t, num_items_in_batch=17)
    loss.backward()
    ref, gh, gw = reference(h, w, t, bias=head.bias.detach(), num_items_in_batch=17)
    torch.testing.assert_close(loss.detach(), ref)
    torch.testing.assert_close(h.grad, gh)
    torch.testing.assert_close(head.weight.grad, gw)
    # the bias took part: without it the loss differs
    assert not torch.allclose(loss.detach(), fused_linear_cross_entropy(h.detach(), w, t, num_items_in_batch=17))
    assert sd.engine_calls == calls and sd.head_sharding(head) == "none"
    assert "forward" not in head.__dict__


@pytest.mark.parametrize("seed", [0, 3])
def test_fsdp2_like_head_goes_through_hooks(seed):
    h, w, t = data(seed)
    head = FakeFSDP2Linear(w)
    assert sd.head_sharding(head) == "fsdp2"
    with pytest.raises(ValueError):  # the bug this module exists for: the local shard reaches the kernel
        fused_linear_cross_entropy(h, head.weight, t)
    out = sd.fused_head_loss(head, h, t, return_token_accuracy=True, reduction="sum")
    assert head.events == ["pre", "post"]
    assert type(out).__name__ == "CrossEntropyOutput"
    out.loss.backward()
    ref, gh, gw = reference(h, w, t, return_token_accuracy=True, reduction="sum")
    torch.testing.assert_close(out.loss.detach(), ref.loss)
    torch.testing.assert_close(out.token_accuracy, ref.token_accuracy)
    torch.testing.assert_close(h.grad, gh)
    torch.testing.assert_close(head.full.grad, gw)  # the gradient reached the engine's parameter
    assert "forward" not in head.__dict__  # restored


def test_through_module_restores_forward_on_error():
    head = FakeFSDP2Linear(torch.randn(V, H))
    sentinel = head.forward

    def boom(inner, x):
        raise KeyError("inside")

    with pytest.raises(KeyError):
        sd.through_module(head, boom, torch.randn(2, H))
    assert "forward" not in head.__dict__ and head.forward == sentinel


def test_accelerate_hooked_forward_is_kept():
    """With accelerate's hooks, forward is an instance wrapper around _old_forward: swap the latter."""
    head = torch.nn.Linear(H, V, bias=False)
    seen = []
    head._old_forward = head.forward
    head._hf_hook = object()

    def new_forward(*a, **k):
        seen.append("hf pre")
        return head._old_forward(*a, **k)

    head.forward = new_forward
    out = sd.through_module(head, lambda inner, x: ("mine", x.shape), torch.randn(3, H))
    assert out == ("mine", (3, H)) and seen == ["hf pre"]
    assert head.forward is new_forward and head.__dict__["_old_forward"] is not None
    assert head(torch.randn(3, H)).shape == (3, V)  # the original forward is back


class FakeZero3Linear(torch.nn.Linear):
    def __init__(self, full: torch.Tensor, fetch: bool = True):
        super().__init__(H, V, bias=False)
        self.store = full.clone()
        with torch.no_grad():
            self.weight.data = torch.empty(0, dtype=full.dtype)
        self.weight.ds_id, self.weight.ds_status = 7, "NOT_AVAILABLE"
        if fetch:
            self.register_forward_pre_hook(self._fetch)

    def _fetch(self, mod, args):
        self.weight.data = self.store
        self.weight.ds_status = "AVAILABLE"


def test_zero3_like_head_fetched_by_its_hook():
    h, w, t = data(5)
    head = FakeZero3Linear(w)
    assert sd.head_sharding(head) == "zero3"
    loss = sd.fused_head_loss(head, h, t)
    loss.backward()
    ref, gh, gw = reference(h, w, t)
    torch.testing.assert_close(loss.detach(), ref)
    torch.testing.assert_close(h.grad, gh)
    torch.testing.assert_close(head.weight.grad, gw)


def test_zero3_like_head_not_fetched_names_the_problem():
    h, w, t = data(6)
    head = FakeZero3Linear(w, fetch=False)
    with pytest.raises(sd.ShardedHeadError, match="ZeRO-3"):
        sd.fused_head_loss(head, h, t)


def test_dtype_casts_the_gathered_weight():
    h, w, t = data(8)
    head = FakeFSDP2Linear(w)
    hb = h.detach().bfloat16()
    loss = sd.fused_head_loss(head, hb, t, dtype=torch.bfloat16)
    torch.testing.assert_close(loss.detach(), fused_linear_cross_entropy(hb, w.bfloat16(), t))


def test_head_weight():
    w = torch.randn(V, H)
    head = torch.nn.Linear(H, V, bias=False)
    with sd.head_weight(head) as (weight, bias):
        assert weight is head.weight and bias is None
    z3 = FakeZero3Linear(w)
    with pytest.raises(RuntimeError, match="fused_head_loss"):
        with sd.head_weight(z3):
            pass


def test_wired_sees_a_module_that_uses_the_helper(monkeypatch):
    monkeypatch.setattr(sd, "engine_calls", 0)
    before = sd.wired()
    fake = types.ModuleType("liger_compat.shims._fake_fused_forward")
    fake.fused_head_loss = sd.fused_head_loss
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    assert sd.wired()
    monkeypatch.delitem(sys.modules, fake.__name__)
    assert sd.wired() == before
    other = types.ModuleType("someone_else")  # outside liger_compat: does not count
    other.fused_head_loss = sd.fused_head_loss
    monkeypatch.setitem(sys.modules, "someone_else", other)
    assert sd.wired() == before


class FakeMixedPrecisionLinear(FSDPModule, torch.nn.Linear):
    """FSDP2 with MixedPrecisionPolicy(param_dtype=bf16): the shard stays fp32, the pre-hook casts
    floating forward inputs to bf16 and installs a bf16 gathered weight."""

    def __init__(self, full: torch.Tensor):
        torch.nn.Linear.__init__(self, H, V, bias=False)
        self.full = torch.nn.Parameter(full.clone())
        self.register_forward_pre_hook(self._pre)

    def _pre(self, mod, args):
        del self.weight
        self.weight = self.full.to(torch.bfloat16)
        return tuple(a.to(torch.bfloat16) if a.is_floating_point() else a for a in args)


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_dtype_follows_the_gathered_weight(dtype):
    """The caller sees an fp32 shard; inside the hook input and weight are bf16. Without a dtype
    the loss runs in the gathered weight's dtype; with one, in that dtype. Either way no mismatch."""
    h, w, t = data(9)
    head = FakeMixedPrecisionLinear(w)
    loss = sd.fused_head_loss(head, h, t, dtype=dtype)
    loss.backward()
    assert head.full.grad is not None and h.grad is not None
    wb = w.bfloat16()
    if dtype is None:
        expect = fused_linear_cross_entropy(h.detach().bfloat16(), wb, t)
    else:
        expect = fused_linear_cross_entropy(h.detach().bfloat16().float(), wb.float(), t)
    torch.testing.assert_close(loss.detach().float(), expect.float())
