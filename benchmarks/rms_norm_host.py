"""Host time of one RMSNorm call, forward and forward + backward, in a tight loop on a GPU:
transformers' ``LlamaRMSNorm`` or ``GemmaRMSNorm`` (``--norm``; native), our Triton kernel
(``liger_compat.kernels.rms_norm``), torch's fused op (``torch.nn.functional.rms_norm``; for Gemma's
norm with native's casts and offset around it) and the patched module (what a patched small norm
runs: ``LIGER_COMPAT_RMS_NORM_SMALL_TORCH``), with each one's largest error against the native
formula.

    python -m benchmarks.rms_norm_host [--norm llama|gemma] [--tokens 2048] [--hidden 1024] [--out DIR]

A warm loop's host time is a lower bound of what the call costs inside a training step (there the
host's caches are cold); the ratios between the rows are what it shows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .module_host import _per_call_us


def host_us(fn, grad, backward: bool, calls: int = 200, reps: int = 5) -> float:
    """The best of ``reps`` loops of ``module_host``'s per-call timer: host microseconds a call."""
    def call():
        y = fn()
        if backward:
            y.backward(grad)
    return min(_per_call_us(call, calls) for _ in range(reps))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--norm", choices=("llama", "gemma"), default="llama")
    ap.add_argument("--out", default=None, help="also write rms_norm_host.md (rms_norm_host_gemma.md) there")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    import liger_compat
    from liger_compat import kernels
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    liger_compat.revert()  # the native module's own forward
    torch.manual_seed(0)
    h, eps, bf16 = args.hidden, 1e-6, torch.bfloat16
    x = torch.randn(args.tokens, h, device="cuda", dtype=bf16, requires_grad=True)
    native = (LlamaRMSNorm if args.norm == "llama" else GemmaRMSNorm)(h, eps=eps).cuda().to(bf16)
    with torch.no_grad():
        native.weight.normal_(0.0 if args.norm == "gemma" else 1.0, 0.3)
    w = native.weight
    grad = torch.randn_like(x)
    xf = x.detach().float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    rms = torch.nn.functional.rms_norm
    if args.norm == "llama":
        ref = n.to(bf16).float() * w.float()
        sides = {"ours (Triton)": lambda: kernels.rms_norm(x, w, eps),
                 "torch fused": lambda: rms(x, (h,), w, eps)}
    else:
        ref = n * (1.0 + w.float())
        sides = {"ours (Triton)": lambda: kernels.rms_norm(x, w, eps, offset=1.0, casting="gemma"),
                 "torch fused, fp32 with native's casts": lambda: rms(x.float(), (h,), 1.0 + w.float(), eps).to(bf16)}
    fused = torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CUDA")
    lines = [f"{type(native).__name__} host time a call, warm tight loop, best of 5 x 200 calls; "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__} (fused CUDA kernel: {fused}); "
             f"[{args.tokens}, {h}] bf16", "",
             "| implementation | forward us | forward + backward us | max error against native's formula |",
             "|---|---:|---:|---:|"]

    def row(name, fn):
        for _ in range(20):
            fn().backward(grad)
        err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
        lines.append(f"| {name} | {host_us(fn, grad, False):.1f} | {host_us(fn, grad, True):.1f} | {err:.2e} |")

    row("native", lambda: native(x))
    for name, fn in sides.items():
        row(name, fn)
    liger_compat.apply()
    row("patched module (liger_compat)", lambda: native(x))
    md = "\n".join(lines)
    print(md)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = "rms_norm_host" + ("" if args.norm == "llama" else "_gemma")
        (Path(args.out) / f"{name}.md").write_text(
            f"regenerate: `python -m benchmarks.rms_norm_host --norm {args.norm} --tokens {args.tokens} --hidden {h}`"
            f"\n\n{md}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
