"""Where a training step's peak memory goes: liger-kernel vs liger_compat, kernel by kernel.

    python -m benchmarks.e2e_memory [--model llama-3.2-1b] [--shape 4x2048]
                                    [--impls "liger_kernel;liger_compat;..."] [--out DIR]

An implementation is ``native``, ``liger_kernel`` or ``liger_compat``, optionally with the kernels
it may use after a colon (``liger_compat:rope,rms_norm`` sets ``LIGER_COMPAT_KERNELS``;
``liger_kernel:rope,rms_norm`` passes only those switches to ``apply_liger_kernel_to_<family>``;
names: fused_linear_cross_entropy, rms_norm, rope, swiglu). Each runs in a fresh interpreter:
the model of ``benchmarks.e2e`` is built, one full step (forward, backward, fused AdamW) warms
the optimizer state up, then a second step is measured phase by phase: memory allocated after
the forward, peak during forward, backward and the optimizer step, and every tensor that
autograd saves during the forward (through ``saved_tensors_hooks``), grouped by the op that
produced it (``grad_fn``; parameters and inputs as ``leaf``), each storage counted once.
Those census hooks make liger_compat's rebuild of the norm output feeding the MLP step aside (it
does under any outer saved-tensor hooks); the activation rebuild of a plain ``nn.Linear``
down_proj needs no hooks and still applies. ``benchmarks.e2e`` measures peaks without hooks.

Writes ``e2e_memory.json`` and ``e2e_memory.md`` under ``--out``, each naming the command that
regenerates it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from . import _results
from .e2e import MODELS, setup

LIGER_SWITCHES = {"fused_linear_cross_entropy": "fused_linear_cross_entropy", "rms_norm": "rms_norm",
                  "rope": "rope", "swiglu": "swiglu"}


def _one(model_name: str, shape: str, impl: str) -> dict:
    base, _, only = impl.partition(":")
    switches = None
    if only and base == "liger_compat":
        os.environ["LIGER_COMPAT_KERNELS"] = only
    elif only and base == "liger_kernel":
        chosen = set(only.split(","))
        switches = {sw: (name in chosen) for name, sw in LIGER_SWITCHES.items()}
        switches["cross_entropy"] = False
    model, opt, ids, labels = setup(model_name, shape, base, switches)
    import torch

    def step():
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    gib = 2**30
    base_mem = torch.cuda.memory_allocated()
    groups: dict[str, dict] = {}
    seen: set[int] = set()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in seen and ptr not in params:
            seen.add(ptr)
            fn = t.grad_fn
            name = type(fn).__name__ if fn is not None else "leaf"
            key = f"{name} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
            gr = groups.setdefault(key, {"count": 0, "mib": 0.0})
            gr["count"] += 1
            gr["mib"] += st.nbytes() / 2**20
        return t

    torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=labels)
    torch.cuda.synchronize()
    after_fwd = torch.cuda.memory_allocated()
    peak_fwd = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.loss.backward()
    torch.cuda.synchronize()
    peak_bwd = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peak_opt = torch.cuda.max_memory_allocated()
    return {
        "model": model_name, "shape": shape, "impl": impl, "loss": float(out.loss),
        "before_gib": base_mem / gib, "after_forward_gib": after_fwd / gib, "peak_forward_gib": peak_fwd / gib,
        "peak_backward_gib": peak_bwd / gib, "peak_optimizer_gib": peak_opt / gib,
        "saved_gib": sum(gr["mib"] for gr in groups.values()) / 1024,
        "saved": dict(sorted(groups.items(), key=lambda kv: -kv[1]["mib"])),
    }


def _markdown(rows: list[dict]) -> str:
    ok = [r for r in rows if "saved" in r]
    lines = ["# Training-step memory by phase (GiB, allocated; one step after a warm-up step)", ""]
    if ok:
        lines += [f"model {ok[0]['model']}, {ok[0]['shape']} tokens, bf16", ""]
    lines += ["| impl | before step | after forward | peak forward | peak backward | peak optimizer | saved by autograd |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "saved" not in r:
            lines.append(f"| {r['impl']} | error | | | | | |")
            continue
        lines.append(f"| {r['impl']} | {r['before_gib']:.2f} | {r['after_forward_gib']:.2f} | {r['peak_forward_gib']:.2f} | "
                     f"{r['peak_backward_gib']:.2f} | {r['peak_optimizer_gib']:.2f} | {r['saved_gib']:.2f} |")
    for r in ok:
        lines += ["", f"## saved tensors, {r['impl']} (producer, shape, dtype: count, MiB)", ""]
        lines += [f"- {k}: {v['count']} x, {v['mib']:.0f} MiB" for k, v in list(r["saved"].items())[:14]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(MODELS))
    ap.add_argument("--shape", default="4x2048")
    ap.add_argument("--impls", default="liger_kernel;liger_compat", help="';'-separated")
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print("RESULT " + json.dumps(_one(*a.one)), flush=True)
        return 0
    rows = []
    for one in [i.strip() for i in a.impls.split(";") if i.strip()]:
        if one.partition(":")[0] not in ("native", "liger_kernel", "liger_compat"):
            ap.error(f"--impls: unknown implementation {one!r}")
        print(f"[{one}]", file=sys.stderr, flush=True)
        p = subprocess.run([sys.executable, "-m", "benchmarks.e2e_memory", "--one", a.model, a.shape, one],
                           capture_output=True, text=True)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            rows.append({"impl": one, "error": (p.stderr or p.stdout)[-1500:]})
            print(p.stderr[-1500:], file=sys.stderr)
        else:
            rows.append(json.loads(line[7:]))
            r = rows[-1]
            print(f"    peak fwd {r['peak_forward_gib']:.2f} bwd {r['peak_backward_gib']:.2f} "
                  f"saved {r['saved_gib']:.2f} GiB", file=sys.stderr, flush=True)
    _results.write(a.out, "e2e_memory", rows, _markdown(rows),
                   _results.command("benchmarks.e2e_memory", sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
