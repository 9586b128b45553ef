"""A tiny model's training step on the CPU, native against patched, in one process.

    python -m benchmarks.cpu_step [--steps 200] [--rounds 5]

A tiny random Llama (2 layers, hidden 32, vocabulary 256, 2 x 16 tokens): forward with labels
and backward, so the step is almost all per-call host work (Python, dispatch), the regime where
wrappers cost the most. Native and patched (``liger_compat.revert()`` / ``apply()``) alternate in
batches of ``--steps`` steps, ``--rounds`` times; the figure is the ratio of the medians of the
per-step times, and of the fastest batches, in wall-clock time and in the thread's own CPU time
(``time.thread_time``: with one intra-op thread the step runs on this thread, and time the scheduler
gives a co-running process is not counted, so a loaded machine moves this figure least); and the
Python calls of one step of each (:func:`call_counts`, independent of the machine's load). Prints one JSON line per variant:
``default`` (``LIGER_COMPAT_CPU_NATIVE`` on: transformers' own module code and the native head's loss)
and ``references`` (off: the kernels' torch references, as the CPU path ran before that setting).

    python -m benchmarks.cpu_step --out benchmarks/results   # also writes cpu_step.json / cpu_step.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def tiny_llama(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed + 1))
    labels = ids.clone()
    labels[:, :3] = -100
    return model, ids, labels


def step_times(steps: int = 200, rounds: int = 5, seed: int = 0) -> dict:
    """Per-step seconds of native and patched steps, ``rounds`` alternating batches of ``steps``."""
    import torch

    import liger_compat

    model, ids, labels = tiny_llama(seed)

    def run(n: int) -> list[tuple[float, float]]:
        out = []
        for _ in range(n):
            t0, c0 = time.perf_counter(), time.thread_time()
            model(input_ids=ids, labels=labels).loss.backward()
            out.append((time.perf_counter() - t0, time.thread_time() - c0))
        model.zero_grad(set_to_none=True)
        return out

    torch.set_num_threads(1)  # the shared CI machine: fewer threads, less noise
    native, patched = [], []
    for _ in range(2):  # warm both up
        liger_compat.revert()
        run(20)
        liger_compat.apply()
        run(20)
    for _ in range(rounds):
        liger_compat.revert()
        native.append(run(steps))
        liger_compat.apply()
        patched.append(run(steps))
    def med(batches: list, k: int) -> float:
        return statistics.median(t[k] for b in batches for t in b)

    def best(batches: list, k: int) -> float:
        return min(statistics.median(t[k] for t in b) for b in batches)

    return {
        "steps": steps * rounds,
        "native_ms": med(native, 0) * 1e3,
        "patched_ms": med(patched, 0) * 1e3,
        "ratio_median": med(patched, 0) / med(native, 0),
        "ratio_best_batch": best(patched, 0) / best(native, 0),
        "native_cpu_ms": med(native, 1) * 1e3,
        "patched_cpu_ms": med(patched, 1) * 1e3,
        "ratio_cpu_median": med(patched, 1) / med(native, 1),
    }


def call_counts(seed: int = 0) -> dict:
    """Python function calls (``sys.setprofile``'s ``call`` and ``c_call`` events) of one native and
    one patched step, after a warm-up: a figure the machine's load does not move."""
    import liger_compat

    model, ids, labels = tiny_llama(seed)

    def one() -> int:
        n = [0]

        def prof(frame, event, arg):
            if event in ("call", "c_call"):
                n[0] += 1

        model.zero_grad(set_to_none=True)
        sys.setprofile(prof)
        try:
            model(input_ids=ids, labels=labels).loss.backward()
        finally:
            sys.setprofile(None)
        return n[0]

    out = {}
    for label, switch in (("native", liger_compat.revert), ("patched", liger_compat.apply)):
        switch()
        one()
        out[label] = one()
    out["ratio"] = out["patched"] / out["native"]
    return out


#: variant -> LIGER_COMPAT_CPU_NATIVE for it
VARIANTS = {"default": True, "references": False}


def _machine() -> str:
    import os
    import platform

    import torch
    import transformers

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (1 intra-op thread), "
            f"torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}")


def _markdown(rows: list[dict], machine: str) -> str:
    lines = [f"A tiny Llama's training step on the CPU (2 layers, hidden 32, vocabulary 256, 2 x 16 tokens: per-call "
             f"host work), native and patched alternating in one process; {machine}.", "",
             "| variant | native ms | patched ms | patched / native (median) | (fastest batches) | (thread CPU time) "
             "| Python calls native / patched |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        pc = r["python_calls"]
        lines.append(f"| {r['variant']} | {r['native_ms']:.3f} | {r['patched_ms']:.3f} | {r['ratio_median']:.3f} | "
                     f"{r['ratio_best_batch']:.3f} | {r['ratio_cpu_median']:.3f} | {pc['native']} / {pc['patched']} |")
    lines += ["", "default: `LIGER_COMPAT_CPU_NATIVE=1` (transformers' own RMSNorm, RoPE and MLP code, the loss as "
              "the model's head computes it); references: `LIGER_COMPAT_CPU_NATIVE=0` (the kernels' torch references)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from liger_compat import _config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write <name>.json and <name>.md there")
    ap.add_argument("--name", default="cpu_step")
    a = ap.parse_args(argv)
    rows = []
    saved = _config.settings.cpu_native
    try:
        for variant, on in VARIANTS.items():
            _config.settings.cpu_native = on
            row = {"variant": variant, **step_times(a.steps, a.rounds), "python_calls": call_counts()}
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        _config.settings.cpu_native = saved
    if a.out:
        from . import _results

        name = "" if a.name == "cpu_step" else f" --name {a.name}"
        command = f"python -m benchmarks.cpu_step --steps {a.steps} --rounds {a.rounds} --out {a.out}{name}"
        machine = _machine()
        _results.write(a.out, a.name, {"machine": machine, "rows": rows}, _markdown(rows, machine), command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
