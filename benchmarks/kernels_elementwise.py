"""Kernel benchmark sections of the elementwise kernels: ``norm`` (RMSNorm, SwiGLU, GeGLU, RoPE),
``elementwise_sweep`` and ``elem_profile``."""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F

from . import kernels_common as C
from .kernels_common import add, bench_graph_ms, log, measure_rounds, rel


#: the RoPE kernel (``variant=`` of apply_rotary_pos_emb) the sections time; elem_profile sets the fastest
ROPE_VARIANT = "flat"


# ---------------------------------------------------------------------------------------------
# elementwise kernels
# ---------------------------------------------------------------------------------------------


def _hf_rms(x, w, eps=1e-6):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rot_half(x):
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


def _hf_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rot_half(q) * sin, k * cos + _rot_half(k) * sin


def elementwise(which=("rms_norm", "swiglu", "geglu", "rope"), sizes=None, section="elementwise"):
    import liger_compat.kernels as K

    try:
        import liger_kernel.transformers.functional as LF
    except Exception as exc:
        LF = None
        log("liger-kernel unavailable:", exc)
    bw = C.RESULTS["meta"].get("copy_tbps", 3.0)
    g = torch.Generator(device="cuda").manual_seed(1)
    bf = torch.bfloat16

    def run(kind, shape_label, inputs, impls, grads_of, nbytes, **fields):
        floor = nbytes / (bw * 1e12) * 1e3
        first = impls["torch eager"](*inputs)
        first = first if isinstance(first, tuple) else (first,)
        dys = [torch.randn(o.shape, device="cuda", generator=g, dtype=o.dtype) for o in first]
        del first
        ref = None
        # liger-kernel's rms_norm writes dX over dY (in_place=True, its default): check and time it last
        order = sorted(impls, key=lambda k: k == "liger-kernel")
        steps, extras = {}, {}
        for impl in order:
            fn = impls[impl]
            if fn is None:
                continue

            def step(fn=fn):
                outs = fn(*inputs)
                outs = outs if isinstance(outs, tuple) else (outs,)
                return torch.autograd.grad(outs, grads_of, dys)

            errs = {}
            try:
                res = step()
                if ref is None:
                    ref = res  # eager first: the reference for the others
                else:
                    errs["grad_err_vs_eager"] = max(rel(a, b) for a, b in zip(res, ref))
                del res
            except Exception as exc:
                errs["check_error"] = str(exc)[:300]
            steps[impl], extras[impl] = step, errs
        ref = None
        measure_rounds(section, f"{kind} {shape_label}", steps, extras, preexisting=list(inputs) + dys, graph=True,
                       last=("liger-kernel",), floor_ms=floor, kernel=kind, **fields)

    sizes = sizes or {"rms_norm": [16384], "swiglu": [16384], "geglu": [16384], "rope": [2048, (2048, "transformers")]}
    for kind in [k for k in which if k in sizes]:
        for size in sizes[kind]:
            log(f"## {section}: {kind} {size}")
            if kind == "rms_norm":
                x = torch.randn(size, 4096, device="cuda", generator=g, dtype=bf).requires_grad_(True)
                wt = (torch.rand(4096, device="cuda", generator=g) + 0.5).to(bf).requires_grad_(True)
                impls = {
                    "torch eager": lambda x, w: _hf_rms(x, w),
                    "torch.compile": torch.compile(_hf_rms, dynamic=False),
                    "liger-kernel": (lambda x, w: LF.liger_rms_norm(x, w, 1e-6)) if LF else None,
                    "liger_compat": lambda x, w: K.rms_norm(x, w, 1e-6),
                }
                run(kind, f"{size}x4096", (x, wt), impls, (x, wt), 5 * x.numel() * 2, rows=size)
            elif kind in ("swiglu", "geglu"):
                a = torch.randn(size, 14336, device="cuda", generator=g, dtype=bf).requires_grad_(True)
                b = torch.randn(size, 14336, device="cuda", generator=g, dtype=bf).requires_grad_(True)
                if kind == "swiglu":
                    eager = lambda a, b: F.silu(a) * b  # noqa: E731
                    ours, lig = K.swiglu, (LF.liger_swiglu if LF else None)
                else:
                    eager = lambda a, b: F.gelu(a, approximate="tanh") * b  # noqa: E731
                    ours, lig = K.geglu, (LF.liger_geglu if LF else None)
                impls = {"torch eager": eager, "torch.compile": torch.compile(eager, dynamic=False),
                         "liger-kernel": lig, "liger_compat": ours}
                run(kind, f"{size}x14336", (a, b), impls, (a, b), 8 * a.numel() * 2, rows=size)
            else:  # size: a sequence length, or (length, "transformers") for that layout
                size, layout = (size, "contiguous") if isinstance(size, int) else size
                q = torch.randn(8, 32, size, 128, device="cuda", generator=g, dtype=bf).requires_grad_(True)
                k = torch.randn(8, 8, size, 128, device="cuda", generator=g, dtype=bf).requires_grad_(True)
                if layout == "transformers":  # [B, heads, T, D] views of [B, T, heads, D], as models pass them
                    q = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
                    k = k.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
                inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
                ang = torch.arange(size, device="cuda").float()[:, None] * inv[None]
                ang = torch.cat([ang, ang], -1)[None].expand(8, size, 128)
                cos, sin = ang.cos().to(bf).contiguous(), ang.sin().to(bf).contiguous()
                impls = {
                    "torch eager": lambda q, k: _hf_rope(q, k, cos, sin),
                    "torch.compile": torch.compile(lambda q, k: _hf_rope(q, k, cos, sin), dynamic=False),
                    "liger-kernel": (lambda q, k: LF.liger_rope(q, k, cos, sin)) if LF else None,
                    "liger_compat": lambda q, k: K.apply_rotary_pos_emb(q, k, cos, sin, variant=ROPE_VARIANT),
                }
                nbytes = 4 * (q.numel() + k.numel()) * 2 + 2 * 2 * cos.numel() * 2
                label = f"q[8,32,{size},128] k[8,8,{size},128]"
                if layout == "transformers":
                    label += ", transformers layout"
                run(kind, label, (q, k), impls, (q, k), nbytes, seq=size)
            gc.collect()
            torch.cuda.empty_cache()


def elem_profile():
    """Launch knobs of our RMSNorm and RoPE kernels, timed alone; the fastest become the
    settings for the rest of the run (recorded in meta)."""
    from liger_compat.kernels import _rms_norm_triton as R
    from liger_compat.kernels import _rope_triton as P
    import liger_compat.kernels as K

    g = torch.Generator(device="cuda").manual_seed(3)
    bf = torch.bfloat16
    x = torch.randn(16384, 4096, device="cuda", generator=g, dtype=bf)
    wt = (torch.rand(4096, device="cuda", generator=g) + 0.5).to(bf)
    dy = torch.randn_like(x)
    best_f = best_b = None
    for warps in (4, 8, 16):
        R.FWD_WARPS = warps
        ms = bench_graph_ms(lambda: R.rms_norm_forward_triton(x, wt, 1e-6, 0.0, "llama"))
        add(section="elem_profile", shape="rms_norm fwd 16384x4096", impl=f"fwd warps={warps}", ms=ms)
        best_f = min(best_f or (ms, warps), (ms, warps))
    R.FWD_WARPS = best_f[1]
    _, rstd = R.rms_norm_forward_triton(x, wt, 1e-6, 0.0, "llama")
    for warps in (4, 8, 16):
        for per_sm in (1, 2, 4):
            R.BWD_WARPS, R.BWD_PROGRAMS_PER_SM = warps, per_sm
            ms = bench_graph_ms(lambda: R.rms_norm_backward_triton(dy, x, wt, rstd, 0.0, "llama", True))
            add(section="elem_profile", shape="rms_norm bwd 16384x4096", impl=f"bwd warps={warps} programs/SM={per_sm}", ms=ms)
            best_b = min(best_b or (ms, (warps, per_sm)), (ms, (warps, per_sm)))
    R.BWD_WARPS, R.BWD_PROGRAMS_PER_SM = best_b[1]
    try:
        from liger_kernel.ops.rms_norm import rms_norm_backward, rms_norm_forward

        y, xs, rs, blk, nw, cm = rms_norm_forward(x, wt, 1e-6, 0.0, "llama", None)
        add(section="elem_profile", shape="rms_norm fwd 16384x4096", impl="liger-kernel fwd",
            ms=bench_graph_ms(lambda: rms_norm_forward(x, wt, 1e-6, 0.0, "llama", None)))
        add(section="elem_profile", shape="rms_norm bwd 16384x4096", impl="liger-kernel bwd (not in place)",
            ms=bench_graph_ms(lambda: rms_norm_backward(dy, xs, wt, rs, 0.0, cm, blk, nw, False, None)))
    except Exception as exc:
        add(section="elem_profile", shape="rms_norm 16384x4096", impl="liger-kernel kernels", error=str(exc)[:300])
    C.RESULTS["meta"]["rms_norm_knobs"] = dict(fwd_warps=best_f[1], bwd=best_b[1])
    del x, dy
    q = torch.randn(8, 32, 2048, 128, device="cuda", generator=g, dtype=bf).requires_grad_(True)
    k = torch.randn(8, 8, 2048, 128, device="cuda", generator=g, dtype=bf).requires_grad_(True)
    ang = torch.rand(8, 2048, 64, device="cuda", generator=g) * 100
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(bf), ang.sin().to(bf)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    best = None

    def set_rope(variant, block=P.FLAT_BLOCK_R, warps=P.FLAT_WARPS):
        global ROPE_VARIANT
        ROPE_VARIANT = variant
        P.FLAT_BLOCK_R, P.FLAT_WARPS = block, warps

    # a wider sweep (the flat kernel's row order x 4/8/16 rows x 1/2/4/8 warps) found heads-first
    # order never faster, 16 rows or 8 warps never the fastest (NOTES.md, RoPE)
    knobs = [("rows",)] + [("flat", br, nw) for br in (4, 8) for nw in (1, 2, 4)]
    compiled = torch.compile(lambda q, k: _hf_rope(q, k, cos, sin), dynamic=False)
    for knob in knobs:
        set_rope(*knob)
        ms = bench_graph_ms(lambda: torch.autograd.grad(K.apply_rotary_pos_emb(q, k, cos, sin, variant=ROPE_VARIANT),
                                                        (q, k), (gq, gk)))
        label = knob[0] if len(knob) == 1 else f"{knob[0]} block={knob[1]} warps={knob[2]}"
        add(section="elem_profile", shape="rope fwd+bwd q[8,32,2048,128]", impl=label, ms=ms)
        best = min(best or (ms, knob), (ms, knob))
    add(section="elem_profile", shape="rope fwd+bwd q[8,32,2048,128]", impl="torch.compile",
        ms=bench_graph_ms(lambda: torch.autograd.grad(compiled(q, k), (q, k), (gq, gk))))
    # the transformers layout: q/k as [B, heads, T, D] views of [B, T, heads, D]
    qt = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
    kt = k.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
    set_rope(*best[1])
    for label, fn in (("liger_compat (best knobs)", lambda: K.apply_rotary_pos_emb(qt, kt, cos, sin, variant=ROPE_VARIANT)),
                      ("torch eager", lambda: _hf_rope(qt, kt, cos, sin)),
                      ("torch.compile", lambda: compiled(qt, kt))):
        ms = bench_graph_ms(lambda: torch.autograd.grad(fn(), (qt, kt), (gq, gk)))
        add(section="elem_profile", shape="rope fwd+bwd, transformers layout", impl=label, ms=ms)
    C.RESULTS["meta"]["rope_knobs"] = best[1]
