"""What liger_compat itself costs on the CPU: the import, and the forward wrapper per call.

    python -m benchmarks.overhead [--runs 30] [--calls 20000] [--out benchmarks/results]

* import: wall time of ``python -c "import liger_compat"`` minus ``python -c "pass"``, both in
  fresh interpreters, interleaved, median over ``--runs`` pairs (and the cumulative figure of
  ``-X importtime`` for the package itself).
* wrapper: a tiny Llama whose decoder and head are replaced by trivial modules, so the native
  forward costs next to nothing. Timed two ways, same inputs, interleaved batches, per
  call: ``model(...)`` with the patches toggled (``revert()`` / ``apply()``) between batches, as
  a user calls it; and the patched forward already bound against the native function
  transformers defines (the wrapper's own work). Per-call figures are the fastest batch of
  200 calls (medians are kept in the JSON). Paths: no ``logits_to_keep``;
  ``logits_to_keep=k`` (translated to the name the forward knows).

Writes ``overhead.json`` and ``overhead.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time

from . import _results


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
    """Per-call cost of the patched forward, two ways: ``model(...)`` (what a user calls:
    nn.Module's ``__call__``, then the class attribute ``forward`` bound to the instance, which
    for a wrapt wrapper builds a bound wrapper each time) with patches toggled by ``revert()`` /
    ``apply()`` between batches; and the already-bound forward (the wrapper's own work only)."""
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
    per_batch = 200
    batches = max(1, calls // per_batch)

    def batch(fn, kw):
        t0 = time.perf_counter_ns()
        for _ in range(per_batch):
            fn(input_ids=ids, **kw)
        return (time.perf_counter_ns() - t0) / per_batch

    results = {}
    with torch.no_grad():
        for label, kw in (("plain", {}), ("logits_to_keep=1", {"logits_to_keep": 1})):
            for _ in range(200):  # warm up
                patched(**kw, input_ids=ids)
                native(**kw, input_ids=ids)
            n, p = [], []
            for _ in range(batches):
                n.append(batch(native, kw))
                p.append(batch(patched, kw))
            mn, mp = [], []
            for _ in range(batches):
                liger_compat.revert()
                mn.append(batch(model, kw))
                liger_compat.apply()
                mp.append(batch(model, kw))
            # the fastest batch of each: on a shared machine the median moves with other load
            # by more than the difference measured here (timeit's advice for micro-benchmarks)
            results[label] = {
                "native_us": min(n) / 1e3,
                "patched_us": min(p) / 1e3,
                "overhead_us": (min(p) - min(n)) / 1e3,
                "module_native_us": min(mn) / 1e3,
                "module_patched_us": min(mp) / 1e3,
                "module_overhead_us": (min(mp) - min(mn)) / 1e3,
                "median_overhead_us": (statistics.median(p) - statistics.median(n)) / 1e3,
                "median_module_overhead_us": (statistics.median(mp) - statistics.median(mn)) / 1e3,
            }
    if cls.__dict__["forward"] is native.__func__:
        raise SystemExit("patches were not re-applied after the module-call batches")
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
        lines.append(f"| `model(...)`, {path} | {r['module_overhead_us']:.2f} us per call "
                     f"(native {r['module_native_us']:.1f} us, patched {r['module_patched_us']:.1f} us) | < 10 us |")
        lines.append(f"| bound forward (wrapper body only), {path} | {r['overhead_us']:.2f} us per call "
                     f"(native {r['native_us']:.1f} us, patched {r['patched_us']:.1f} us) | |")
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
    _results.write(a.out, "overhead", res, to_markdown(res),
                   _results.command("benchmarks.overhead", sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
