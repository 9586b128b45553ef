"""The kernel benchmark's markdown report and plots, from its results."""

from __future__ import annotations

import json
from pathlib import Path


from . import kernels_common as C
from .kernels_common import log


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


def _spread(r, digits):
    ts = r.get("ms_rounds") or []
    return f"{min(ts):.{digits}f}-{max(ts):.{digits}f}" if len(ts) > 1 else ""


def _by_shape(rows: list[dict], ref_impl: str, lines: list[str], ncols: int):
    """``(shape, row, ms of ref_impl on that shape or None)`` for every measured row, shapes in the
    order first seen; a row without a time becomes an error line of ``ncols`` columns in ``lines``."""
    for shape in dict.fromkeys(r["shape"] for r in rows):
        rs = [r for r in rows if r["shape"] == shape]
        ref = next((r.get("ms") for r in rs if r["impl"] == ref_impl), None)
        for r in rs:
            if r.get("ms") is None:
                lines.append(f"| {shape} | {r['impl']} | error: {r.get('error', '')[:80]} |" + " |" * (ncols - 3))
                continue
            yield shape, r, ref


def _mib(r):
    return f"{r['extra_mib']:.0f}" if r.get("extra_mib") is not None else "-"


def _rows(section):
    return [r for r in C.RESULTS["rows"] if r.get("section") == section]


def report() -> str:
    m = C.RESULTS["meta"]
    lines = ([f"regenerate: `{C.RESULTS['regenerate']}`", ""] if C.RESULTS.get("regenerate") else []) + [
             "# liger_compat kernel benchmark", "",
             f"device: {m.get('device')}; torch {m.get('torch')}, triton {m.get('triton')}; "
             f"bf16 matmul {m.get('matmul_tflops', 0):.0f} TFLOP/s, copy {m.get('copy_tbps', 0):.2f} TB/s", ""]
    runs = {}
    for r in C.RESULTS["rows"]:
        if r.get("run"):
            runs.setdefault(r["run"], set()).add(r["section"])
    for run, secs in sorted(runs.items()):
        lines += [f"Sections {', '.join(sorted(secs))} come from {run}, measured separately (its own ceilings "
                  f"set their floors); every ratio compares rows measured together.", ""]
    fl = [r for r in C.RESULTS["rows"] if r.get("section") in ("flce", "flce_acc", "flce_softcap")]
    if fl:
        lines += ["## Fused linear cross-entropy: correctness (bf16 inputs)", "",
                  "| head | impl | loss diff vs eager | grad_h err vs eager (bf16 mm, fp32 CE) | grad_h err vs fp32 | grad_w err vs fp32 |",
                  "|---|---|---|---|---|---|"]
        for r in fl:
            if "gh_err_vs_eager" in r:
                lines.append(f"| {r['shape']} | {r['impl']} | {r['loss_absdiff_vs_eager']:.2e} | {r['gh_err_vs_eager']:.2e} | "
                             f"{r['gh_err_vs_fp32']:.2e} | {r['gw_err_vs_fp32']:.2e} |")
        lines += ["", "## Fused linear cross-entropy: forward+backward time and extra memory", "",
                  "ms: median of the rounds (each round times every implementation once, order rotated); "
                  "rounds: the fastest and slowest round.", "",
                  "| head | impl | ms | rounds | x floor | x liger_compat | extra MiB |", "|---|---|---|---|---|---|---|"]
        for shape in dict.fromkeys(r["shape"] for r in fl):
            rs = [r for r in fl if r["shape"] == shape]
            ours = next((r.get("ms") for r in rs if r["impl"] == "liger_compat"), None)
            for r in rs:
                if r.get("ms") is None:
                    lines.append(f"| {shape} | {r['impl']} | error: {r.get('error', '')[:80]} | | | | |")
                    continue
                lines.append(f"| {shape} | {r['impl']} | {r['ms']:.2f} | {_spread(r, 2)} | {r['ms'] / r['floor_ms']:.2f} | "
                             f"{r['ms'] / ours if ours else float('nan'):.2f} | {_mib(r)} |")
    lm = _rows("flce_lowmem")
    if lm:
        lines += ["", "## Low-memory fused linear cross-entropy (bf16, forward+backward, 10 % ignored targets)", "",
                  "ms: median of the rounds; x cce: time over cut-cross-entropy's `cce` (gradient filter on) "
                  "measured in the same rounds; errors: norm-relative against the all-fp32 head.", "",
                  "| head | impl | ms | rounds | x cce | x floor | extra MiB | grad_h err vs fp32 | grad_w err vs fp32 |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in lm:
            if r.get("ms") is None:
                lines.append(f"| {r['shape']} | {r['impl']} | error: {r.get('error', '')[:80]} | | | | | | |")
                continue
            xc = r.get("x_cce")
            ge, we = r.get("gh_err_vs_fp32"), r.get("gw_err_vs_fp32")
            lines.append(f"| {r['shape']} | {r['impl']} | {r['ms']:.2f} | {_spread(r, 2)} | "
                         f"{'' if xc is None else f'{xc:.2f}'} | {r['ms'] / r['floor_ms']:.2f} | {_mib(r)} | "
                         f"{'' if ge is None else f'{ge:.2e}'} | {'' if we is None else f'{we:.2e}'} |")
    for sec, title in (("flce_variants", "liger_compat FLCE variants (Llama-3-8B head)"),
                       ("flce_rows", "liger_compat FLCE rows per chunk (config -> rows x chunks)"),
                       ("flce_mib", "liger_compat FLCE at every head: chunk settings"),
                       ("flce_profile", "one chunk, step by step (Llama-3-8B head)"),
                       ("flce_gemm", "one chunk's matmuls: cuBLAS and the Triton logits GEMM"),
                       ("flce_gemm_whole", "the whole loss: cuBLAS logits vs the Triton logits GEMM"),
                       ("elem_profile", "RMSNorm / RoPE launch variants (kernels alone)")):
        rs = _rows(sec)
        if rs:
            lines += ["", f"## {title}", "", "| config | ms | extra MiB | x floor |", "|---|---|---|---|"]
            for r in rs:
                if r.get("ms") is None:
                    lines.append(f"| {r['shape']} {r['impl']} | error | | |")
                elif sec == "elem_profile":
                    lines.append(f"| {r['shape']}: {r['impl']} | {r['ms']:.3f} | | |")
                elif sec == "flce_profile":
                    lines.append(f"| {r['impl']} ({r['shape']}) | {r['ms']:.3f} (x chunks: {r['ms_times_chunks']:.2f}) | | |")
                elif sec == "flce_gemm":
                    lines.append(f"| {r['impl']} ({r['shape']}) | {r['ms']:.3f} (x ideal matmul: {r['x_ideal_mm']:.2f}) | | |")
                elif sec in ("flce_rows", "flce_gemm_whole", "flce_mib"):
                    lines.append(f"| {r['shape']}: {r['impl']} | {r['ms']:.2f} | {_mib(r)} | {r['ms'] / r['floor_ms']:.2f} |")
                else:
                    lines.append(f"| {r['shape']} | {r['ms']:.2f} | {_mib(r)} | {r['ms'] / r['floor_ms']:.2f} |")
    lp = _rows("logprob")
    if lp:
        lines += ["", "## Fused log-prob head (trl's add_fused_lm_head scoring): forward+backward, bf16, 10 % ignored", "",
                  "floor: 3 matmuls for the SFT loss, 4 with per-token weights, at the measured matmul rate; "
                  "x trl: time / trl head's time on the same rows; errors vs an fp32 head for the SFT loss.", "",
                  "| head | impl | ms | x floor | x trl head | extra MiB | grad_h err vs fp32 | grad_w err vs fp32 |",
                  "|---|---|---|---|---|---|---|---|"]
        for shape, r, trl in _by_shape(lp, "trl head", lines, 8):
            ge = (f"{r['gh_err_vs_fp32']:.2e} | {r['gw_err_vs_fp32']:.2e}" if "gh_err_vs_fp32" in r else " | ")
            lines.append(f"| {shape} | {r['impl']} | {r['ms']:.2f} | {r['ms'] / r['floor_ms']:.2f} | "
                         f"{r['ms'] / trl if trl else float('nan'):.2f} | {_mib(r)} | {ge} |")
    el = _rows("elementwise")
    if el:
        lines += ["", "## RMSNorm, SwiGLU, GeGLU, RoPE (bf16, forward+backward)", "",
                  "GPU ms: CUDA-graph replay (kernel time alone), median of the rounds; rounds: the fastest and "
                  "slowest; eager ms: ordinary launches from Python (first round).", "",
                  "| kernel | impl | GPU ms | rounds | eager ms | x bandwidth floor | x liger_compat | extra MiB | grad err vs eager |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for shape, r, ours in _by_shape(el, "liger_compat", lines, 9):
            ge = r.get("grad_err_vs_eager")
            le = r.get("ms_eager_launch")
            lines.append(f"| {shape} | {r['impl']} | {r['ms']:.3f} | {_spread(r, 3)} | {'' if le is None else f'{le:.3f}'} | "
                         f"{r['ms'] / r['floor_ms']:.2f} | {r['ms'] / ours if ours else float('nan'):.2f} | {_mib(r)} | "
                         f"{'' if ge is None else f'{ge:.1e}'} |")
    return "\n".join(lines) + "\n"


def plots(path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        log("matplotlib missing, no plots:", exc)
        return
    data = json.loads(path.read_text())
    rows = data["rows"]
    for sec, xkey, title in (("flce_sweep", "n", "FLCE, Llama-3-8B head: tokens"),
                             ("elementwise_sweep", None, "elementwise kernels")):
        rs = [r for r in rows if r.get("section") == sec and r.get("ms") is not None]
        if not rs:
            continue
        groups = {}
        for r in rs:
            kind = r.get("kernel", "flce")
            groups.setdefault(kind, []).append(r)
        for kind, krs in groups.items():
            x_key = xkey or ("seq" if kind == "rope" else "rows")
            fig, axes = plt.subplots(1, 2, figsize=(10, 4))
            for impl in dict.fromkeys(r["impl"] for r in krs):
                pts = sorted((r[x_key], r["ms"], r["extra_mib"]) for r in krs if r["impl"] == impl)
                axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
                axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=impl)
            axes[0].set_xlabel(x_key); axes[0].set_ylabel("fwd+bwd ms (median)")
            axes[1].set_xlabel(x_key); axes[1].set_ylabel("extra peak MiB")
            axes[1].set_yscale("symlog")
            axes[0].legend()
            fig.suptitle(f"{title}: {kind}" if kind != "flce" else title)
            fig.tight_layout()
            fig.savefig(path.parent / f"{path.stem}_{sec}_{kind}.png", dpi=110)
            plt.close(fig)
            log("plot", path.parent / f"{path.stem}_{sec}_{kind}.png")
