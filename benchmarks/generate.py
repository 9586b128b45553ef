"""Greedy ``generate``: native transformers vs liger-kernel vs liger_compat, tokens/s and agreement.

    python -m benchmarks.generate [--models llama-3.2-1b,qwen2.5-1.5b] [--shapes 1x512,8x512]
                                  [--new-tokens 128] [--impls native,liger_kernel,liger_compat]
                                  [--repeats 2] [--out DIR] [--name generate]

Inference, where training-step tables say nothing: the patched model decodes one token per
step, so every RMSNorm, rotary and MLP kernel runs on a handful of rows and launch/wrapper
overhead shows. Models as in ``benchmarks.e2e`` (random weights from config, bf16, SDPA, eval
mode, the same seed everywhere), prompts of ``BxS`` random ids, ``model.generate`` greedy with
exactly ``--new-tokens`` new tokens (no EOS), the default dynamic cache. liger_compat runs the
decode steps' RMSNorm, RoPE and MLP natively by default (``LIGER_COMPAT_DECODE_NATIVE``);
``liger_compat_decode_kernels`` is liger_compat with its kernels there too. Each
(model, implementation) runs in a fresh interpreter (patches never leak), all shapes in it;
with ``--repeats R`` the implementations run R times, in the given order and then reversed.

Reported per (model, shape, implementation): the median wall time of ``generate`` after one
warm-up call, new tokens/s (batch x new tokens / time), and, against native in the same run,
the prefill's last-position logits (max abs difference, and relative to native's max abs
logit) and the share of generated tokens equal to native's up to the first divergence
(greedy decoding of a random model: near-ties in bf16 may flip a token and everything after it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import _results
from .e2e import MODELS as E2E_MODELS

IMPLS = ("native", "liger_kernel", "liger_compat", "liger_compat_decode_kernels")
DEFAULT_IMPLS = IMPLS[:3]
#: liger_compat under other settings: its kernels in the decode steps too (they run natively by default)
VARIANTS = {"liger_compat_decode_kernels": {"LIGER_COMPAT_DECODE_NATIVE": "0"}}
#: the e2e models, plus a tiny Llama to try the script on a CPU (``--models tiny-llama --device cpu``)
MODELS = {**E2E_MODELS, "tiny-llama": dict(family="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=512)}


def _build(model_name: str, impl: str, device: str):
    if impl.startswith("liger_compat"):
        os.environ.update(VARIANTS.get(impl, {}))
        import liger_compat  # noqa: F401  (first import, as a user would)
    import torch
    import transformers

    spec = dict(MODELS[model_name])
    family = spec.pop("family")
    if impl == "liger_kernel":
        import liger_kernel.transformers as lk

        getattr(lk, f"apply_liger_kernel_to_{family}")()
    cfg_cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    cfg = cfg_cls(max_position_embeddings=8192, bos_token_id=0, eos_token_id=None, pad_token_id=0, **spec)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    return model.eval(), cfg


def _per_call(model, cfg, bsz: int, device: str, sync, n: int = 300) -> dict:
    """Microseconds per call at a decode step ([bsz, 1, hidden]) of the first layer's modules,
    patched vs their native forward (``__wrapped__``) in the same process: the launch and wrapper
    cost that decoding pays 2-4 times per layer per token."""
    import sys as _sys

    import torch

    layer = model.model.layers[0]
    mod = _sys.modules[type(layer).__module__]
    x = torch.randn(bsz, 1, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    hd = cfg.hidden_size // cfg.num_attention_heads
    q = torch.randn(bsz, cfg.num_attention_heads, 1, hd, device=device, dtype=torch.bfloat16)
    k = torch.randn(bsz, cfg.num_key_value_heads, 1, hd, device=device, dtype=torch.bfloat16)
    cos = torch.randn(bsz, 1, hd, device=device, dtype=torch.bfloat16)
    sin = torch.randn(bsz, 1, hd, device=device, dtype=torch.bfloat16)
    norm, mlp, rope = layer.input_layernorm, layer.mlp, mod.apply_rotary_pos_emb
    cases = {}  # only what is patched (wrapped) in this process
    if hasattr(type(norm).forward, "__wrapped__"):
        cases["rms_norm"] = (lambda: norm(x), lambda: type(norm).forward.__wrapped__(norm, x))
    if hasattr(type(mlp).forward, "__wrapped__"):
        cases["gated_mlp"] = (lambda: mlp(x), lambda: type(mlp).forward.__wrapped__(mlp, x))
    if hasattr(rope, "__wrapped__"):
        cases["rope"] = (lambda: rope(q, k, cos, sin), lambda: rope.__wrapped__(q, k, cos, sin))
    out = {}
    with torch.no_grad():
        for name, (patched, native) in cases.items():
            res = []
            for fn in (patched, native):
                for _ in range(20):
                    fn()
                sync()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                sync()
                res.append((time.perf_counter() - t0) / n * 1e6)
            out[name] = {"patched_us": res[0], "native_us": res[1]}
    return out


def _one(model_name: str, shapes: list[str], impl: str, new_tokens: int, calls: int, dump: Path,
         device: str) -> list[dict]:
    import torch
    import transformers

    model, cfg = _build(model_name, impl, device)
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    applied = None
    if impl.startswith("liger_compat"):
        import liger_compat

        applied = sorted(s["id"] for s in liger_compat.check(quiet=True).shims if s["state"] == "applied")
    rows = []
    for shape in shapes:
        bsz, seq = (int(x) for x in shape.split("x"))
        g = torch.Generator(device=device).manual_seed(1)
        ids = torch.randint(1, cfg.vocab_size, (bsz, seq), device=device, generator=g)
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=0)
        res = {"model": model_name, "shape": shape, "impl": impl, "new_tokens": new_tokens,
               "torch": torch.__version__, "transformers": transformers.__version__,
               "gpu": torch.cuda.get_device_name(0) if cuda else device, "shims_applied": applied}
        try:
            with torch.no_grad():
                first = model.generate(ids, output_logits=True, return_dict_in_generate=True, **kw)
                times = []
                for _ in range(calls):
                    sync()
                    t0 = time.perf_counter()
                    model.generate(ids, **kw)
                    sync()
                    times.append(time.perf_counter() - t0)
            t = statistics.median(times)
            torch.save({"tokens": first.sequences[:, seq:].cpu(), "logits0": first.logits[0].float().cpu()},
                       dump / f"{model_name}_{shape}_{impl}.pt")
            res.update(status="ok", generate_ms=t * 1e3, times_ms=[x * 1e3 for x in times],
                       new_tokens_per_s=bsz * new_tokens / t)
        except torch.OutOfMemoryError:
            res.update(status="OOM")
        if impl.startswith("liger_compat") and res.get("status") == "ok":
            res["per_call_us"] = _per_call(model, cfg, bsz, device, sync)
        rows.append(res)
    return rows


def agreement(rows: list[dict], dump: Path) -> None:
    """Fill in each ok row's agreement with native's first call of the same (model, shape)."""
    import torch

    for r in rows:
        if r.get("status") != "ok" or r["impl"] == "native":
            continue
        a, b = (dump / f"{r['model']}_{r['shape']}_{i}.pt" for i in ("native", r["impl"]))
        if not a.exists() or not b.exists():
            continue
        na, nb = torch.load(a), torch.load(b)
        diff = (na["logits0"] - nb["logits0"]).abs().max().item()
        r["logits_max_abs_diff"] = diff
        r["logits_rel_diff"] = diff / na["logits0"].abs().max().item()
        same = (na["tokens"] == nb["tokens"]).int()
        # per sequence: tokens equal before the first differing one
        prefix = same.cumprod(dim=1).sum(dim=1)
        r["tokens_equal_prefix"] = prefix.tolist()
        r["tokens_equal_share"] = prefix.sum().item() / same.numel()


def combine(rows: list[dict]) -> list[dict]:
    """One row per (model, shape, impl): the median over repeats of generate_ms."""
    by: dict = {}
    for r in rows:
        by.setdefault((r["model"], r["shape"], r["impl"]), []).append(r)
    out = []
    for group in by.values():
        ok = [r for r in group if r.get("status") == "ok"]
        if not ok:
            out.append(group[0])
            continue
        r = dict(ok[0])
        r["generate_ms"] = statistics.median(x["generate_ms"] for x in ok)
        r["new_tokens_per_s"] = statistics.median(x["new_tokens_per_s"] for x in ok)
        r["repeats_ms"] = [x["generate_ms"] for x in ok]
        out.append(r)
    return out


def _markdown(rows: list[dict]) -> str:
    rows = combine(rows)
    r0 = next((r for r in rows if r.get("status") == "ok"), {})
    lines = [f"# Greedy generate ({r0.get('gpu', '?')}, torch {r0.get('torch', '?')}, "
             f"transformers {r0.get('transformers', '?')}, bf16, {r0.get('new_tokens', '?')} new tokens)", "",
             "Median over repeats of each process's median `generate` time (one warm-up call). "
             "Logits: the prefill's last-position logits against native's (max abs difference / native's "
             "max abs logit). Tokens equal: share of generated tokens equal to native's before the first "
             "difference in each sequence.", "",
             "| model | shape | impl | generate ms | new tokens/s | vs native | logits diff (rel) | tokens equal |",
             "|---|---|---|---:|---:|---:|---|---:|"]
    for line, r, d in _results.table_rows(rows, IMPLS, 8):
        if line:
            lines.append(line)
            continue
        nat = d.get("native")
        ratio = f"{nat['generate_ms'] / r['generate_ms']:.2f}x" if nat and nat.get("status") == "ok" else "-"
        diff = (f"{r['logits_max_abs_diff']:.3g} ({r['logits_rel_diff']:.1e})"
                if "logits_max_abs_diff" in r else "-")
        eq = f"{100 * r['tokens_equal_share']:.0f} %" if "tokens_equal_share" in r else "-"
        lines.append(f"| {r['model']} | {r['shape']} | {r['impl']} | {r['generate_ms']:.1f} | "
                     f"{r['new_tokens_per_s']:.0f} | {ratio} | {diff} | {eq} |")
    applied = next((r["shims_applied"] for r in rows if r.get("shims_applied")), None)
    per = [r for r in rows if r.get("per_call_us")]
    if per:
        lines += ["", "Per call at a decode step (`[batch, 1, hidden]`, bf16, no grad), the first layer's modules "
                  "in each liger_compat process: patched vs the same module's native forward, microseconds "
                  "(CPU-bound: launches and Python).", "",
                  "| model | batch | impl | RMSNorm patched / native | MLP patched / native | RoPE patched / native |",
                  "|---|---:|---|---|---|---|"]
        for r in per:
            c = r["per_call_us"]
            cell = lambda k: f"{c[k]['patched_us']:.0f} / {c[k]['native_us']:.0f}" if k in c else "-"  # noqa: E731
            lines.append(f"| {r['model']} | {r['shape'].split('x')[0]} | {r['impl']} | {cell('rms_norm')} | "
                         f"{cell('gated_mlp')} | {cell('rope')} |")
    if applied:
        lines += ["", "liger_compat shims applied: " + ", ".join(applied)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-3.2-1b,qwen2.5-1.5b", help=f"any of {', '.join(MODELS)}")
    ap.add_argument("--shapes", default="1x512,8x512", help="BATCHxPROMPT, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--calls", type=int, default=3, help="timed generate calls per shape (after one warm-up)")
    ap.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"any of {', '.join(IMPLS)}")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--name", default="generate")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "IMPL", "DUMP"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    shapes = a.shapes.split(",")
    if a.one:
        m, i, dump = a.one
        rows = _one(m, shapes, i, a.new_tokens, a.calls, Path(dump), a.device)
        print("RESULT " + json.dumps(rows), flush=True)
        return 0
    for m in a.models.split(","):
        if m not in MODELS:
            ap.error(f"--models: unknown model {m!r}; choose from {', '.join(MODELS)}")
    impls = a.impls.split(",")
    for i in impls:
        if i not in IMPLS:
            ap.error(f"--impls: unknown implementation {i!r}; choose from {', '.join(IMPLS)}")
    for s in shapes:
        parts = s.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            ap.error(f"--shapes: {s!r} is not BATCHxPROMPT")
    if a.repeats < 1 or a.calls < 1 or a.new_tokens < 1:
        ap.error("--repeats, --calls and --new-tokens must be at least 1")
    cmd = _results.command("benchmarks.generate", sys.argv[1:] if argv is None else argv)
    order = [(m, i, rep) for m in a.models.split(",") for rep in range(a.repeats)
             for i in (impls if rep % 2 == 0 else impls[::-1])]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp)
        for n, (m, i, rep) in enumerate(order, 1):
            print(f"[{n}/{len(order)}] {m} {i} (repeat {rep})", file=sys.stderr, flush=True)
            p = subprocess.run([sys.executable, "-m", "benchmarks.generate", "--one", m, i, str(dump),
                                "--shapes", a.shapes, "--new-tokens", str(a.new_tokens), "--calls", str(a.calls),
                                "--device", a.device],
                               capture_output=True, text=True)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                err = (p.stderr or p.stdout)[-1500:]
                rows += [{"model": m, "shape": s, "impl": i, "status": "error", "error": err} for s in shapes]
                print(err, file=sys.stderr)
            else:
                got = json.loads(line[7:])
                for r in got:
                    r["repeat"] = rep
                    print("   ", {k: r.get(k) for k in ("shape", "status", "generate_ms", "new_tokens_per_s")},
                          file=sys.stderr, flush=True)
                rows += got
            agreement(rows, dump)
            _results.write(a.out, a.name, rows, _markdown(rows), cmd)  # a cut-off run keeps its rows
    return 0


if __name__ == "__main__":
    sys.exit(main())
