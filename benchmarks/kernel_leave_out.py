"""Which of our kernels a family's small training step gains or loses from, one left out at a time.

    python -m benchmarks.kernel_leave_out [--families qwen3_5_text,llama,...] [--batch 2] [--seq 2048]
                                          [--hidden 1024] [--layers 2] [--vocab 128256]
                                          [--steps 1] [--rounds 40] [--name kernel_leave_out]
    python -m benchmarks.kernel_leave_out --device cpu --seq 8 --hidden 64 --vocab 96 --layers 1 --steps 1 --rounds 1

Each family runs in a fresh process that builds its bf16 model once (``benchmarks.models_gpu``'s
sizes and batch) and times, interleaved in ``--rounds`` rounds of ``--steps`` steps each, the
sides: native (``liger_compat.revert()``), every kernel, none (patched, every kernel off: what the
shims' dispatch costs), and every kernel but one, for each kernel
the family's step runs (the fused loss, RMSNorm, RoPE, and SwiGLU, or GeGLU for the Gemmas). The
kernels a side runs are set through ``liger_compat``'s ``kernels`` setting, which the shims read at
every call, so all sides share the model, its inputs and the process's state; the order of the
sides rotates by one every round. Each side's ratio to native is the median over rounds of the two
sides' times in the same round: with ``--steps 1`` and many rounds the sides alternate step by step,
and the host's drift (a host-bound step moves 10-25 % between rounds of one process) cancels.

A kernel whose leaving out makes the step faster costs this family more than it gives at this
shape: its ``without K`` ratio is below the ``all`` one.

Writes ``<name>.json`` and ``<name>.md`` under ``--out`` (default benchmarks/results), each naming
the command that regenerates it, after every family.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import liger_compat
from benchmarks import models_gpu
from liger_compat import _config

#: the kernels whose leaving out is timed: the layer kernels and the loss (the MLP's activation
#: kernel by family: GeGLU for the Gemmas, SwiGLU for the others)
LOSS, NORM, ROPE = "fused_linear_cross_entropy", "rms_norm", "rope"


def kernels_of(family: str) -> tuple[str, ...]:
    return (LOSS, NORM, ROPE, "geglu" if family.startswith("gemma") else "swiglu")


def sides_of(family: str) -> dict[str, frozenset[str] | None]:
    """Side name -> the kernels it runs (None: native, liger_compat reverted)."""
    every = frozenset(_config.ALL_KERNELS)
    sides: dict[str, frozenset[str] | None] = {"native": None, "all": every, "none": frozenset()}
    for k in kernels_of(family):
        sides[f"without {k}"] = every - {k}
    return sides


def rotated(names: list[str], r: int) -> list[str]:
    """The sides' order in round ``r``: rotated by ``r`` (each side leads once every len rounds)."""
    k = r % len(names)
    return names[k:] + names[:k]


def time_sides(family: str, args) -> dict:
    """In this process: each side's median step time (ms) over ``args.rounds`` interleaved rounds."""
    got = models_gpu._timing_model(family, args)
    if isinstance(got, dict):
        return got
    model, kw, labels = got
    sides = sides_of(family)
    settings = _config.settings
    saved = settings.kernels

    def switch(kernels):
        if kernels is None:
            errors = liger_compat.revert()
            if errors:
                raise RuntimeError(f"revert failed: {errors}")
            return
        liger_compat.apply()
        settings.kernels = kernels

    times: dict[str, list[float]] = {s: [] for s in sides}
    try:
        for name, kernels in sides.items():  # every side compiles and warms its kernels first
            switch(kernels)
            models_gpu._warm_up(model, kw, labels)
        for r in range(args.rounds):
            for name in rotated(list(sides), r):
                switch(sides[name])
                times[name].append(models_gpu.timed(model, kw, labels, args.steps))
    finally:
        liger_compat.apply()
        settings.kernels = saved
    del model, got
    models_gpu._release()
    return {"family": family, "ms": {s: statistics.median(v) for s, v in times.items()},
            "ms_rounds": times}


def _child(family: str, args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.kernel_leave_out", "--child", "--families", family,
           *models_gpu.model_argv(args), "--steps", str(args.steps), "--rounds", str(args.rounds),
           "--device", args.device]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"family": family, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-800:]}"}


def paired(row: dict, side: str) -> float:
    """The median over rounds of ``side``'s time over native's in the same round: drift of the
    host between rounds (a host-bound step moves 10-25 % within a process) cancels in each ratio."""
    ms = row["ms_rounds"]
    return statistics.median(a / b for a, b in zip(ms[side], ms["native"]))


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``values``: the order statistics k and
    n + 1 - k, k the largest with P(Binomial(n, 1/2) < k) <= (1 - level) / 2 (the whole range
    where n is too small for the level)."""
    xs, n = sorted(values), len(values)
    k, below = 0, 0.0
    while k < n // 2:
        below += math.comb(n, k) / 2 ** n  # P(X = k) added: P(X < k + 1)
        if below > (1 - level) / 2:
            break
        k += 1
    return (xs[k - 1], xs[n - k]) if k else (xs[0], xs[-1])


#: the table's columns of kernels left out: the header, and the kernels a family's side may name
_LEFT_OUT = (("loss", (LOSS,)), ("rms_norm", (NORM,)), ("rope", (ROPE,)), ("swiglu / geglu", ("swiglu", "geglu")))


def markdown(rows: list[dict], meta: dict) -> str:
    """One table: per family each side's time against native's, paired by round."""
    out = [f"A family's small training step with each of our kernels left out in turn, against native, in one "
           f"process; transformers {meta['transformers']}, torch {meta['torch']}, {meta['gpu']}; batch {meta['batch']} x "
           f"{meta['seq']}, hidden {meta['hidden']}, {meta['layers']} layers, vocab {meta['vocab']}, bf16; one fresh "
           f"process a family, its sides interleaved ({meta['rounds']} rounds of {meta['steps']} "
           f"step{'s' if meta['steps'] != 1 else ''} a side, the order rotating every round)", "",
           "Each ratio is a side's time over native's, the median over rounds of the two sides' times in the same "
           "round, with a distribution-free 95 % interval for the `all` one. A kernel with `without K` below `all` costs this family more than it gives at this shape; "
           "`none` is patched with every kernel off (the shims' dispatch alone).", "",
           "| family | ms native | all | none | "
           + " | ".join(f"without {label}" for label, _ in _LEFT_OUT) + " | all: 95 % interval | rounds all < native |",
           "|---|---:|---:|---:|" + "---:|" * len(_LEFT_OUT) + "---|---:|"]
    for r in rows:
        if "ms_rounds" not in r:
            out.append(f"| {r['family']} | {r.get('skipped') or r.get('error', '?')} |" + " |" * (len(_LEFT_OUT) + 4))
            continue
        ms = r["ms_rounds"]
        cells = []
        for _, names in _LEFT_OUT:
            side = next((f"without {k}" for k in names if f"without {k}" in ms), None)
            cells.append(f"{paired(r, side):.3f}" if side else "")
        ratios = [a / b for a, b in zip(ms["all"], ms["native"])]
        lo, hi = median_interval(ratios)
        out.append(f"| {r['family']} | {statistics.median(ms['native']):.2f} | {statistics.median(ratios):.3f} | "
                   f"{paired(r, 'none'):.3f} | " + " | ".join(cells)
                   + f" | {lo:.3f}-{hi:.3f} | {sum(x < 1 for x in ratios)} / {len(ratios)} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    models_gpu.add_model_args(ap, "qwen3_5_text,qwen3_5,qwen3_5_moe_text,deepseek_v4,llama")
    ap.add_argument("--steps", type=int, default=1, help="timed steps a side and round (after one untimed)")
    ap.add_argument("--rounds", type=int, default=40, help="interleaved rounds a side")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (tiny sizes advised)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="kernel_leave_out", help="result files <name>.json and <name>.md")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one family, this process
    args = ap.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    if args.child:
        try:
            row = time_sides(families[0], args)
        except Exception as exc:  # the parent reports it in the family's row
            row = {"family": families[0], "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(row), flush=True)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu for a smoke run)")
        return 2
    import transformers

    from benchmarks import _results

    cmd = _results.command("benchmarks.kernel_leave_out", sys.argv[1:] if argv is None else argv)
    meta = dict(transformers=transformers.__version__, torch=torch.__version__,
                gpu=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", batch=args.batch,
                seq=args.seq, hidden=args.hidden, layers=args.layers, vocab=args.vocab, steps=args.steps,
                rounds=args.rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    md = ""
    for i, family in enumerate(families):
        t0 = time.perf_counter()
        rows.append(_child(family, args))
        (out / f"{args.name}.json").write_text(json.dumps({"regenerate": cmd, "meta": meta, "rows": rows}, indent=2))
        md = _results.md_line(cmd) + markdown(rows, meta)
        (out / f"{args.name}.md").write_text(md + "\n")
        print(f"[{i + 1}/{len(families)}] {family}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
