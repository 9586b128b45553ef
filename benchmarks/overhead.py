"""What liger_compat itself costs on the CPU: the import, and the forward wrapper per call.

    python -m benchmarks.overhead [--runs 30] [--calls 20000] [--out benchmarks/results]

* import: wall time of ``python -c "import liger_compat"`` minus ``python -c "pass"``, both in
  fresh interpreters, interleaved, median over ``--runs`` pairs (and the cumulative figure of
  ``-X importtime`` for the package itself).
* wrapper: a tiny Llama whose decoder and head are replaced by trivial modules, so the native
  forward costs next to nothing; the patched class forward is timed against the native function
  transformers defines (taken after ``revert()``), same inputs, interleaved batches, median per call. Paths: no
  ``logits_to_keep``; ``logits_to_keep=k`` (translated to the name the forward knows).

Writes ``overhead.json`` and ``overhead.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _env() -> dict:
    # bytecode caching on, as on a user's machine: with PYTHONDONTWRITEBYTECODE every import
    # recompiles the sources and the figure measures the compiler
    import os

    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _wall(code: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())
    return time.perf_counter() - t0


def measure_import(runs: int) -> dict:
    _wall("import liger_compat")  # warm the file cache and write the bytecode
    base, lc = [], []
    for _ in range(runs):
        base.append(_wall("pass"))
        lc.append(_wall("import liger_compat"))
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import liger_compat"],
                         capture_output=True, text=True, check=True, env=_env()).stderr
    cumulative_us = None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 3 and parts[2] == "liger_compat":
            cumulative_us = int(parts[1])
    return {
        "runs": runs,
        "python_pass_ms": statistics.median(base) * 1e3,
        "import_liger_compat_ms": statistics.median(lc) * 1e3,
        "added_ms": (statistics.median(lc) - statistics.median(base)) * 1e3,
        "added_ms_paired_median": statistics.median(b - a for a, b in zip(base, lc)) * 1e3,
        "importtime_cumulative_ms": None if cumulative_us is None else cumulative_us / 1e3,
    }


def _hollow_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_outputs import BaseModelOutputWithPast

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    hidden = torch.randn(1, 4, 16)
    logits = torch.randn(1, 4, 64)

    class Decoder(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return BaseModelOutputWithPast(last_hidden_state=hidden)

    class Head(torch.nn.Module):
        weight = torch.nn.Parameter(torch.randn(64, 16))

        def forward(self, h):
            return logits[:, -h.shape[1]:]

    model.model = Decoder()
    model.lm_head = Head()
    return model


def measure_wrapper(calls: int) -> dict:
    import torch

    import liger_compat

    model = _hollow_llama()
    cls = type(model)
    liger_compat.revert()
    native = cls.__dict__["forward"]  # exactly what transformers defines, its decorators included
    liger_compat.apply()
    patched = cls.__dict__["forward"]
    if patched is native:
        raise SystemExit("LlamaForCausalLM.forward is not patched: nothing to measure")
    native = native.__get__(model, cls)
    patched = patched.__get__(model, cls)
    ids = torch.randint(0, 64, (1, 4))
    results = {}
    for label, kw in (("plain", {}), ("logits_to_keep=1", {"logits_to_keep": 1})):
        native_kw = dict(kw)
        with torch.no_grad():
            for _ in range(200):  # warm up
                patched(input_ids=ids, **kw)
                native(input_ids=ids, **native_kw)
            per_batch = 200
            p, n = [], []
            for _ in range(max(1, calls // per_batch)):
                t0 = time.perf_counter_ns()
                for _ in range(per_batch):
                    native(input_ids=ids, **native_kw)
                t1 = time.perf_counter_ns()
                for _ in range(per_batch):
                    patched(input_ids=ids, **kw)
                t2 = time.perf_counter_ns()
                n.append((t1 - t0) / per_batch)
                p.append((t2 - t1) / per_batch)
        results[label] = {
            "native_us": statistics.median(n) / 1e3,
            "patched_us": statistics.median(p) / 1e3,
            "overhead_us": (statistics.median(p) - statistics.median(n)) / 1e3,
        }
    return {"calls": calls, "paths": results}


def to_markdown(res: dict) -> str:
    imp, wr = res["import"], res["wrapper"]
    lines = [
        "# liger_compat overhead (CPU)",
        "",
        f"machine: {res['machine']}; python {res['python']}",
        "",
        "| what | measured | goal |",
        "|---|---|---|",
        f"| `import liger_compat` added wall time (median of {imp['runs']} fresh interpreters) | "
        f"{imp['added_ms']:.1f} ms (paired median {imp['added_ms_paired_median']:.1f} ms) | < 50 ms |",
        f"| `-X importtime` cumulative for liger_compat | {imp['importtime_cumulative_ms']:.1f} ms | |",
    ]
    for path, r in wr["paths"].items():
        lines.append(f"| forward wrapper, {path} | {r['overhead_us']:.2f} us per call "
                     f"(native {r['native_us']:.1f} us, patched {r['patched_us']:.1f} us) | < 10 us |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    res = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "python": platform.python_version(),
        "import": measure_import(a.runs),
        "wrapper": measure_wrapper(a.calls),
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(res, indent=2))
    md = to_markdown(res)
    (out / "overhead.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
