"""torch.compile of a patched model, family by family: graph breaks, recompiles, loss and gradients.

    python -m benchmarks.compile_families [--families llama,qwen2,...] [--steps 3] [--backend inductor]
                                          [--out DIR]

For every family of the table that the installed transformers has, a tiny random model (the
``check --deep`` configuration) is compiled twice, natively (every liger_compat patch reverted) and
patched, on CUDA in bf16 when there is a GPU, else on the CPU in float32. Each is counted by
``torch._dynamo.explain`` (graphs, graph breaks and their first reasons) for a training forward
with labels, then trained ``--steps`` steps of one shape under ``torch.compile(fullgraph=...)``
(``fullgraph=True`` for the patched model): the table gives the frames compiled after the first
step (0 = no recompile), and the compiled patched loss and hidden-state gradient against the eager
native ones, relative error. Writes ``compile_families.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from . import _results


def _batch(model, torch, device):
    g = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (2, 24), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return ids.to(device), labels.to(device)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _step(model, ids, labels):
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach()


def _grads(model):
    return model.get_input_embeddings().weight.grad.detach().clone()


def one_family(name: str, steps: int, device: str, backend: str = "inductor") -> dict:
    import torch
    import torch._dynamo

    import liger_compat
    from liger_compat.compat import tiny_models

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    row: dict = {"family": name, "device": device, "dtype": str(dtype).replace("torch.", ""), "backend": backend}

    def build():
        m = tiny_models.build(name, dtype=dtype, device=device)
        m.train()
        return m

    # eager native reference, then native compiled, then patched compiled: same weights (seeded)
    liger_compat.revert()
    ref = build()
    ids, labels = _batch(ref, torch, device)
    ref_loss = _step(ref, ids, labels)
    ref_grad = _grads(ref)
    for label, patched in (("native", False), ("patched", True)):
        if patched:
            liger_compat.apply()
        else:
            liger_compat.revert()
        torch._dynamo.reset()
        m = build()
        try:
            ex = torch._dynamo.explain(m)(input_ids=ids, labels=labels)
            row[f"{label}_graphs"] = ex.graph_count
            row[f"{label}_breaks"] = ex.graph_break_count
            row[f"{label}_break_reasons"] = [str(r.reason)[:200] for r in ex.break_reasons[:3]]
        except Exception as exc:  # recorded in the table: the point of the benchmark
            row[f"{label}_explain_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        torch._dynamo.reset()
        m.zero_grad(set_to_none=True)
        compiled = torch.compile(m, fullgraph=patched, backend=backend)
        try:
            loss = _step(compiled, ids, labels)
            row[f"{label}_loss_rel_err"] = _rel(loss, ref_loss)
            row[f"{label}_grad_rel_err"] = _rel(_grads(m), ref_grad)
            frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            for _ in range(steps - 1):
                m.zero_grad(set_to_none=True)
                _step(compiled, ids, labels)
            row[f"{label}_recompiles"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames
        except Exception as exc:
            row[f"{label}_train_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
    liger_compat.apply()
    return row


def _fmt(v, spec="{:.1e}") -> str:
    return "-" if v is None else spec.format(v)


def markdown(rows: list[dict]) -> str:
    lines = ["torch.compile of tiny models per family: native vs patched (liger_compat). Breaks from "
             "torch._dynamo.explain of a training forward; loss / grad errors of the compiled step "
             "against the eager native step (relative); recompiles over the later steps of one shape.", "",
             "| family | device, backend | native graphs / breaks | patched graphs / breaks | patched recompiles "
             "| loss err native / patched | grad err native / patched | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = "; ".join(str(r[k]) for k in r if k.endswith("_error"))
        lines.append(
            f"| {r['family']} | {r['device']} {r['dtype']} {r.get('backend', '')} | {r.get('native_graphs', '-')} / {r.get('native_breaks', '-')} "
            f"| {r.get('patched_graphs', '-')} / {r.get('patched_breaks', '-')} | {r.get('patched_recompiles', '-')} "
            f"| {_fmt(r.get('native_loss_rel_err'))} / {_fmt(r.get('patched_loss_rel_err'))} "
            f"| {_fmt(r.get('native_grad_rel_err'))} / {_fmt(r.get('patched_grad_rel_err'))} | {err[:200]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="", help="comma-separated; default: every family installed")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager, ...)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2 (recompiles are counted after the first step)")
    import liger_compat  # noqa: F401  (first, as a user would)
    import torch

    from liger_compat.compat import families, tiny_models

    names = [f for f in args.families.split(",") if f] or [f.name for f in families.FAMILIES]
    unknown = [n for n in names if n not in families.BY_NAME]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(families.BY_NAME)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for name in names:
        try:
            tiny_models.modeling_module(name)
        except tiny_models.FamilyUnavailable as exc:
            rows.append({"family": name, "device": device, "dtype": "-", "unavailable_error": str(exc)})
            continue
        rows.append(one_family(name, args.steps, device, args.backend))
        print(rows[-1], flush=True)
        _write(args, argv, torch, device, rows)  # after every family: a run cut short keeps its rows
    _write(args, argv, torch, device, rows)
    return 0


def _write(args, argv, torch, device, rows) -> None:
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    _results.write(args.out, "compile_families", {"meta": meta, "rows": rows}, markdown(rows),
                   _results.command("benchmarks.compile_families", argv))


if __name__ == "__main__":
    sys.exit(main())
