"""Host time of one RMSNorm call, forward and forward + backward, in a tight loop on a GPU:
transformers' ``LlamaRMSNorm`` (native), our Triton kernel (``liger_compat.kernels.rms_norm``) and
torch's fused op (``torch.nn.functional.rms_norm``, what a patched small norm runs:
``LIGER_COMPAT_RMS_NORM_SMALL_TORCH``), with each one's largest error against the native formula.

    python -m benchmarks.rms_norm_host [--tokens 2048] [--hidden 1024] [--out DIR]

A warm loop's host time is a lower bound of what the call costs inside a training step (there the
host's caches are cold); the ratios between the three are what it shows.
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
    ap.add_argument("--out", default=None, help="also write rms_norm_host.md there")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    import liger_compat
    from liger_compat import kernels
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    liger_compat.revert()  # the native module's own forward
    torch.manual_seed(0)
    h = args.hidden
    x = torch.randn(args.tokens, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    native = LlamaRMSNorm(h).cuda().to(torch.bfloat16)
    w = native.weight
    grad = torch.randn_like(x)
    xf = x.detach().float()
    ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16).float() * w.float()
    sides = {"native": lambda: native(x), "ours (Triton)": lambda: kernels.rms_norm(x, w, 1e-6),
             "torch fused": lambda: torch.nn.functional.rms_norm(x, (h,), w, 1e-6)}
    fused = torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CUDA")
    lines = [f"RMSNorm host time a call, warm tight loop, best of 5 x 200 calls; {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__} (fused CUDA kernel: {fused}); [{args.tokens}, {h}] bf16", "",
             "| implementation | forward us | forward + backward us | max error against native's formula |",
             "|---|---:|---:|---:|"]
    for name, fn in sides.items():
        for _ in range(20):
            fn().backward(grad)
        err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
        lines.append(f"| {name} | {host_us(fn, grad, False):.1f} | {host_us(fn, grad, True):.1f} | {err:.2e} |")
    md = "\n".join(lines)
    print(md)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "rms_norm_host.md").write_text(
            f"regenerate: `python -m benchmarks.rms_norm_host --tokens {args.tokens} --hidden {h}`\n\n{md}\n")
    liger_compat.apply()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
