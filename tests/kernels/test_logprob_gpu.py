"""CUDA tests (skipped without a GPU): fused_linear_logprobs' compiled Triton kernels at model-like
shapes, bf16 against an fp32 head on the same (bf16-rounded) inputs, and fp32 against float64."""

from __future__ import annotations

import pytest
import torch

from liger_compat.kernels import last_backend
from liger_compat.kernels.logprob import fused_linear_logprobs
from harness import tolerance
from reference64 import logprobs64, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _inputs(n, h, v, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hid = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v, h, device="cuda", generator=g) / h**0.5).to(dtype)
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[torch.rand(n, device="cuda", generator=g) < 0.1] = -100
    glp = torch.randn(n, device="cuda", generator=g)
    gent = torch.randn(n, device="cuda", generator=g)
    return hid, w, t, glp, gent


def _fp32_head(hid, w, t, **opts):
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        h32 = hid.detach().float().requires_grad_(True)
        w32 = w.detach().float().requires_grad_(True)
        x = h32 @ w32.T * opts.get("logit_scale", 1.0)
        if opts.get("softcap") is not None:
            x = opts["softcap"] * torch.tanh(x / opts["softcap"])
        z = x / opts.get("temperature", 1.0)
        logp = torch.log_softmax(z, -1)
        valid = t != -100
        tgt = torch.where(valid, t, 0)
        lp = torch.where(valid, logp.gather(1, tgt[:, None]).squeeze(1), 0.0)
        ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
        top1 = valid & (z.argmax(-1) == tgt)
        return h32, w32, z.detach(), lp, ent, top1
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


@pytest.mark.parametrize("n,h,v", [(1, 64, 1000), (1031, 1000, 32011), (4096, 2048, 128256)])
@pytest.mark.parametrize("opts", [{}, {"temperature": 0.7, "softcap": 30.0, "logit_scale": 0.9}])
@pytest.mark.parametrize("upstream", ["sft", "weights"])
def test_logprobs_bf16_vs_fp32_head(n, h, v, opts, upstream):
    hid, w, t, glp, gent = _inputs(n, h, v, torch.bfloat16, n + v)
    a, b = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = fused_linear_logprobs(a, b, t, want=("log_probs", "entropy", "is_top1"),
                                grad_mode="uniform" if upstream == "sft" else "recompute", **opts)
    assert last_backend["fused_linear_logprobs"] == "triton"
    h32, w32, z, lp, ent, top1 = _fp32_head(hid, w, t, **opts)
    valid = t != -100
    nv = valid.sum().clamp(min=1)
    if upstream == "sft":
        (-out.log_probs.sum() / nv).backward()
        (-lp.sum() / nv).backward()
    else:
        ((out.log_probs * glp).sum() + (out.entropy * gent).sum()).backward()
        ((lp * glp).sum() + (ent * gent).sum()).backward()
    tol = tolerance(torch.bfloat16, n=max(h, v))
    unit = float(z.abs().amax()) * max(1, int(valid.sum())) ** 0.5
    assert rel_err(out.log_probs, lp.detach(), unit) <= tol
    assert rel_err(out.entropy, ent.detach(), unit) <= tol
    # bf16 logits can tie or swap near-equal top logits: a few rows may differ
    assert (out.is_top1 != top1).sum().item() <= max(2, n // 100)
    assert rel_err(a.grad, h32.grad) <= tol
    assert rel_err(b.grad, w32.grad) <= tol


def test_logprobs_fp32_vs_float64_all_fields():
    hid, w, t, glp, gent = _inputs(300, 96, 5003, torch.float32, 3)
    bias = torch.randn(5003, device="cuda")
    opts = dict(temperature=1.3, softcap=20.0, logit_scale=0.7)
    ps = [x.clone().requires_grad_(True) for x in (hid, w, bias)]
    out = fused_linear_logprobs(ps[0], ps[1], t, bias=ps[2], **opts)
    p64 = [x.double().requires_grad_(True) for x in (hid, w, bias)]
    ref = logprobs64(p64[0], p64[1], p64[2], t, **opts)
    ((out.log_probs * glp).sum() + (out.entropy * gent).sum()).backward()
    ((ref[0] * glp.double()).sum() + (ref[1] * gent.double()).sum()).backward()
    tol = tolerance("tf32" if torch.backends.cuda.matmul.allow_tf32 else torch.float32, n=5003)
    unit = float((p64[0] @ p64[1].T).abs().amax()) * 300**0.5
    for name, mine, theirs in zip(("log_probs", "entropy"), out[:2], ref[:2]):
        assert rel_err(mine, theirs, unit) <= tol, name
    assert rel_err(out.log_sum_sq_probs, ref[3], unit) <= tol
    assert rel_err(out.mean_logits, ref[4], unit) <= tol
    assert (out.is_top1 != ref[2]).sum().item() <= 1
    for mine, theirs in zip(ps, p64):
        assert rel_err(mine.grad, theirs.grad) <= tol
