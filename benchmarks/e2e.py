"""End-to-end training step: native transformers vs liger-kernel vs liger_compat, eager or compiled.

    python -m benchmarks.e2e [--models llama-3.2-1b,qwen2.5-1.5b] [--shapes 4x2048,8x4096]
                             [--impls native,liger_kernel,liger_compat,...] [--steps 6]
                             [--repeats 2] [--out DIR] [--name e2e]

Models are built from config with random weights (no hub), bf16 on the GPU, SDPA attention,
AdamW (fused). A step is forward with labels, backward and the optimizer step. Every
(model, shape, implementation) runs in its own fresh interpreter, so patches never leak from
one implementation into another. Reports tokens/s (median step time after warm-up) and peak
allocated memory, plus the first-step loss (same seed and weights across implementations, so
the losses must agree to bf16 precision). Out-of-memory is recorded as such.

Processes run one after another, and the order matters: in paired runs of two settings the
second process measured ~3 % faster whichever it was (NOTES.md, end-to-end: "repeats in
alternating order"). With
``--repeats R`` every (model, shape) runs its implementations R times, in the given order and
then reversed, alternately, and the tables report the median over repeats of each process's
median step.

``native_compiled`` and ``liger_compat_compiled`` run the same step on ``torch.compile(model)``
(``--impls native_compiled,liger_compat_compiled``); compilation happens in the warm-up steps.

Writes ``<name>.json`` and ``<name>.md`` (``--name``, default ``e2e``) and the plots
``<name>_<model>.png`` under ``--out``; both files name the command that regenerates them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from . import _results

MODELS = {
    # Llama-3.2-1B shape (tied embeddings)
    "llama-3.2-1b": dict(family="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5),
    # the Llama-3.2-1B layer shape with 8 layers and an untied head: the design card's end-to-end model
    "llama-8l": dict(family="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                     rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5),
    # a small, host-bound step (the shape of most LoRA fine-tunes of models up to ~1B): 2 layers,
    # hidden 1024, the Llama-3 vocabulary
    "llama-small": dict(family="llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                        num_attention_heads=16, num_key_value_heads=8, vocab_size=128256,
                        rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5),
    # Qwen2.5-1.5B shape (tied embeddings)
    "qwen2.5-1.5b": dict(family="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6),
}
#: liger_compat under other settings: the fused loss's logits chunk capped at 62 MiB (its
#: low-memory operating point), 256 MiB or 512 MiB (earlier defaults, before the 2048-row
#: default); the MLP keeping its norm output and
#: activation for the backward (no recompute), or rebuilding only one of them
VARIANTS = {
    "liger_compat_62mib": {"LIGER_COMPAT_FLCE_CHUNK_MB": "62"},
    "liger_compat_256mib": {"LIGER_COMPAT_FLCE_CHUNK_MB": "256"},
    "liger_compat_512mib": {"LIGER_COMPAT_FLCE_CHUNK_MB": "512"},
    "liger_compat_keep": {"LIGER_COMPAT_MLP_RECOMPUTE": "0"},
    "liger_compat_act": {"LIGER_COMPAT_MLP_RECOMPUTE": "activation"},
    "liger_compat_input": {"LIGER_COMPAT_MLP_RECOMPUTE": "input"},
    # the fused loss only: norms, rotary and MLP activations left to transformers (or to Inductor)
    "liger_compat_flce": {"LIGER_COMPAT_KERNELS": "fused_linear_cross_entropy"},
    # no kernel at all: only the shims (under compile, the causal-mask skip that keeps flash attention)
    "liger_compat_shims": {"LIGER_COMPAT_KERNELS": "none"},
    # every kernel but the fused loss: the loss left to transformers (or to Inductor)
    "liger_compat_noflce": {"LIGER_COMPAT_KERNELS": "rms_norm,rope,swiglu,geglu"},
    # every kernel but the gated-MLP activations: the MLP left to transformers
    "liger_compat_nomlp": {"LIGER_COMPAT_KERNELS": "rms_norm,rope,fused_linear_cross_entropy"},
    # the fused loss's chunk logits from cuBLAS (no Triton logits kernel with tensor descriptors)
    "liger_compat_cublas": {"LIGER_COMPAT_FLCE_LOGITS": "cublas"},
    # every fused-loss call eager: no CUDA graph of the small loss's pass
    "liger_compat_nographs": {"LIGER_COMPAT_FLCE_GRAPHS": "0"},
}
#: the same step on the model wrapped in ``torch.compile(model)`` (Inductor, default mode), the
#: patched one through the kernels' custom ops: compiled liger_compat against compiled native
COMPILED = {"native_compiled": "native", "liger_compat_compiled": "liger_compat",
            "liger_compat_flce_compiled": "liger_compat_flce", "liger_compat_shims_compiled": "liger_compat_shims",
            "liger_compat_noflce_compiled": "liger_compat_noflce", "liger_compat_cublas_compiled": "liger_compat_cublas",
            "liger_compat_nographs_compiled": "liger_compat_nographs",
            "native_compiled_ro": "native", "liger_compat_compiled_ro": "liger_compat",
            # the MLP as transformers writes it (no gated linear op keeping gate / up only)
            "liger_compat_keep_compiled": "liger_compat_keep", "liger_compat_keep_compiled_ro": "liger_compat_keep"}
#: compiled with ``mode="reduce-overhead"`` (CUDA graphs): what a host-bound small step is run with
REDUCE_OVERHEAD = ("native_compiled_ro", "liger_compat_compiled_ro", "liger_compat_keep_compiled_ro")
IMPLS = ("native", "liger_kernel", "liger_compat", *VARIANTS, *COMPILED)
DEFAULT_IMPLS = ("native", "liger_kernel", "liger_compat", "liger_compat_62mib")


def setup(model_name: str, shape: str, impl: str, liger_kernel_switches: dict | None = None):
    """The patched library as a user would set it up, then the model (random weights, bf16,
    SDPA, train mode), fused AdamW and one batch of ids and labels (10 % ignored), on CUDA.
    ``liger_kernel_switches``: keyword switches for ``apply_liger_kernel_to_<family>``."""
    os.environ.update(VARIANTS.get(COMPILED.get(impl, impl), {}))
    if impl.startswith("liger_compat"):
        import liger_compat  # noqa: F401  (first import, as a user would)
    import torch
    import transformers

    spec = dict(MODELS[model_name])
    family = spec.pop("family")
    if impl.startswith("liger_kernel"):
        import liger_kernel.transformers as lk

        getattr(lk, f"apply_liger_kernel_to_{family}")(**(liger_kernel_switches or {}))
    cfg_cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    cfg = cfg_cls(max_position_embeddings=8192, **spec)
    cfg._attn_implementation = "sdpa"
    bsz, seq = (int(x) for x in shape.split("x"))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (bsz, seq), device="cuda", generator=g)
    labels = ids.clone()
    labels[torch.rand(bsz, seq, device="cuda", generator=g) < 0.1] = -100
    return model, opt, ids, labels


def step_model(model, impl: str):
    """What a step calls: ``torch.compile(model)`` for the :data:`COMPILED` variants (compiled on
    the first call, inside the warm-up steps), else the model itself."""
    if impl in COMPILED:
        import torch

        if impl in REDUCE_OVERHEAD:
            return torch.compile(model, mode="reduce-overhead")
        return torch.compile(model)
    return model


def _one(model_name: str, shape: str, impl: str, steps: int, warmup: int) -> dict:
    import torch
    import transformers

    model, opt, ids, labels = setup(model_name, shape, impl)
    run = step_model(model, impl)
    bsz, seq = ids.shape
    res = {"model": model_name, "shape": shape, "impl": impl, "tokens": bsz * seq,
           "torch": torch.__version__, "transformers": transformers.__version__,
           "gpu": torch.cuda.get_device_name(0)}
    if impl.startswith("liger_compat"):
        import liger_compat

        rep = liger_compat.check(quiet=True)
        res["shims_applied"] = sorted(s["id"] for s in rep.shims if s["state"] == "applied")
    try:
        times, first_loss = [], None
        for i in range(warmup + steps):
            if i == warmup:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.reset_accumulated_memory_stats()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if impl in REDUCE_OVERHEAD:
                torch.compiler.cudagraph_mark_step_begin()
            out = run(input_ids=ids, labels=labels)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if first_loss is None:
                first_loss = float(out.loss)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        step = statistics.median(times)
        stats = torch.cuda.memory_stats()
        res.update(status="ok", first_loss=first_loss, step_ms=step * 1e3,
                   tokens_per_s=bsz * seq / step,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                   # the spread of the timed steps, and whether the caching allocator had to
                   # free its cache and retry (a synchronising cudaFree/cudaMalloc) during them
                   steps_ms=[t * 1e3 for t in times], reserved_peak_gib=torch.cuda.max_memory_reserved() / 2**30,
                   alloc_retries=stats.get("num_alloc_retries", 0), cuda_mallocs=stats.get("num_device_alloc", 0))
    except torch.OutOfMemoryError:
        res.update(status="OOM")
    return res


def run_order(models: list[str], shapes: list[str], impls: list[str], repeats: int) -> list[tuple]:
    """(model, shape, impl, repeat) in the order the processes run: per (model, shape), the
    implementations as given, then reversed on every other repeat."""
    return [(m, s, i, r) for m in models for s in shapes for r in range(repeats)
            for i in (impls if r % 2 == 0 else impls[::-1])]


def combine(rows: list[dict]) -> list[dict]:
    """One row per (model, shape, impl): repeats merged (median step over repeats, the step
    medians in ``repeats_step_ms``, the largest peak); a lone row as it is."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["shape"], r["impl"]), []).append(r)
    out = []
    for group in groups.values():
        ok = [r for r in group if r.get("status") == "ok"]
        if len(group) == 1 or not ok:
            out.append(group[0])
            continue
        step = statistics.median(r["step_ms"] for r in ok)
        out.append(dict(ok[0], step_ms=step, tokens_per_s=ok[0]["tokens"] / step * 1e3,
                        peak_gib=max(r["peak_gib"] for r in ok), repeats_step_ms=[r["step_ms"] for r in ok],
                        repeats=len(group)))
    return out


def _markdown(rows: list[dict]) -> str:
    rows = combine(rows)
    repeats = max((r.get("repeats", 1) for r in rows), default=1)
    lines = ["# End-to-end training step (forward + backward + AdamW), bf16, random weights", ""]
    if rows:
        r0 = next((r for r in rows if "gpu" in r), rows[0])
        lines += [f"GPU: {r0.get('gpu')}; torch {r0.get('torch')}; transformers {r0.get('transformers')}", ""]
    present = dict.fromkeys(r["impl"] for r in rows)
    notes = [f"{v}: liger_compat with " + ", ".join(f"`{k}={val}`" for k, val in VARIANTS[v].items())
             for v in VARIANTS if v in present]
    notes += [f"{v}: {base} with the model in `torch.compile(model"
              + (', mode="reduce-overhead"' if v in REDUCE_OVERHEAD else "") + ")` (compiled in the warm-up steps)"
              for v, base in COMPILED.items() if v in present]
    lines += ["Median step after warm-up steps; every (model, shape, implementation) in a fresh process"
              + (f"; {repeats} repeats, the order reversed every other one, median over repeats" if repeats > 1 else "")
              + ". " + "; ".join(notes) + ("." if notes else ""), ""]
    lines += ["| model | batch x seq | impl | step ms | tokens/s | x native tokens/s | x liger-kernel tokens/s | peak GiB | "
              "x liger-kernel peak | first loss |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for failed, r, d in _results.table_rows(rows, IMPLS, 10):
        if failed:
            lines.append(failed)
            continue
        m, s, impl = r["model"], r["shape"], r["impl"]
        nat, lk = d.get("native", {}), d.get("liger_kernel", {})
        xn = (f"{r['tokens_per_s'] / nat['tokens_per_s']:.2f}" if nat.get("status") == "ok"
              else "native OOM" if nat else "-")
        xt = (f"{r['tokens_per_s'] / lk['tokens_per_s']:.3f}" if lk.get("status") == "ok" else "-")
        xm = (f"{r['peak_gib'] / lk['peak_gib']:.3f}" if lk.get("status") == "ok" else "-")
        lines.append(f"| {m} | {s} | {impl} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {xn} | {xt} | "
                     f"{r['peak_gib']:.2f} | {xm} | {r['first_loss']:.4f} |")
    return "\n".join(lines) + "\n"


def plots(rows: list[dict], out: Path, name: str = "e2e") -> list[Path]:
    """``<name>_<model>.png``: tokens/s and peak memory against tokens per step, one line per
    implementation (out-of-memory points left out)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots", file=sys.stderr)
        return []
    written = []
    rows = combine(rows)
    for model in dict.fromkeys(r["model"] for r in rows):
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
        for impl in IMPLS:
            pts = sorted((r["tokens"], r) for r in rows
                         if r["model"] == model and r["impl"] == impl and r.get("status") == "ok")
            if not pts:
                continue
            xs = [t for t, _ in pts]
            ax_t.plot(xs, [r["tokens_per_s"] for _, r in pts], marker="o", label=impl)
            ax_m.plot(xs, [r["peak_gib"] for _, r in pts], marker="o", label=impl)
        for ax, ylabel in ((ax_t, "tokens/s"), (ax_m, "peak allocated GiB")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens per step (batch x seq)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        ax_t.legend(fontsize=8)
        fig.suptitle(f"{model}: training step (forward, backward, AdamW), bf16; missing points = OOM")
        fig.tight_layout()
        path = out / f"{name}_{model}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-3.2-1b,qwen2.5-1.5b", help=f"any of {', '.join(MODELS)}")
    ap.add_argument("--shapes", default="4x2048,8x4096")
    ap.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"any of {', '.join(IMPLS)}")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each (model, shape) this many times, reversing the implementations' order every other time")
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--name", default="e2e", help="result files <name>.json, <name>.md, <name>_<model>.png")
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "SHAPE", "IMPL"), help=argparse.SUPPRESS)
    ap.add_argument("--plot", metavar="E2E_JSON", help="only draw the plots from this e2e.json")
    a = ap.parse_args(argv)
    if a.one:
        print("RESULT " + json.dumps(_one(*a.one, steps=a.steps, warmup=a.warmup)), flush=True)
        return 0
    if a.plot:
        src = Path(a.plot)
        for path in plots(_results.rows(json.loads(src.read_text())), src.parent, src.stem):
            print(path)
        return 0
    for m in a.models.split(","):
        if m not in MODELS:
            ap.error(f"--models: unknown model {m!r}; choose from {', '.join(MODELS)}")
    for i in a.impls.split(","):
        if i not in IMPLS:
            ap.error(f"--impls: unknown implementation {i!r}; choose from {', '.join(IMPLS)}")
    if a.repeats < 1:
        ap.error("--repeats must be at least 1")
    rows = []
    cmd = _results.command("benchmarks.e2e", sys.argv[1:] if argv is None else argv)
    impls = a.impls.split(",")
    combos = run_order(a.models.split(","), a.shapes.split(","), impls, a.repeats)
    for n, (m, s, i, rep) in enumerate(combos, 1):
        print(f"[{n}/{len(combos)}] {m} {s} {i}", file=sys.stderr, flush=True)
        p = subprocess.run([sys.executable, "-m", "benchmarks.e2e", "--one", m, s, i,
                            "--steps", str(a.steps), "--warmup", str(a.warmup)],
                           capture_output=True, text=True)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            rows.append({"model": m, "shape": s, "impl": i, "status": "error",
                         "error": (p.stderr or p.stdout)[-1500:]})
            print(p.stderr[-1500:], file=sys.stderr)
        else:
            rows.append(json.loads(line[7:]))
        if a.repeats > 1:
            rows[-1]["repeat"] = rep
        print("   ", {k: rows[-1].get(k) for k in ("status", "step_ms", "tokens_per_s", "peak_gib", "first_loss")},
              file=sys.stderr, flush=True)
        _results.write(a.out, a.name, rows, _markdown(rows), cmd)  # after every run: a cut-off run keeps its rows
    plots(rows, Path(a.out), a.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
