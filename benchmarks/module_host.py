"""Host time per module call on the GPU, native against patched: what each shim costs the host.

    python -m benchmarks.module_host [--calls 300] [--out DIR]

A small Llama (hidden 1024, vocabulary 128256, bf16, SDPA) and 2 x 1024 tokens, the host-bound
shape of ``benchmarks.models_gpu --small``. For each piece the patches replace (one RMSNorm, the
rotary embedding of q and k, one MLP) and for the whole step, the host's own microseconds per
call (``time.perf_counter`` over ``--calls`` calls, no synchronisation inside the loop; the GPU
work of these calls is a fraction of their host time, so the loop never waits on the GPU),
forward alone (with autograd recording) and forward + backward, native (``liger_compat.revert()``)
and patched, interleaved batches, median of the batches. Also the floor: one Triton launch of the
RMSNorm kernel, and one small torch op. Writes ``module_host.json`` and ``module_host.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import liger_compat

from . import _results


def _per_call_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / calls * 1e6


def _pieces(model, kw, labels):
    from transformers.models.llama import modeling_llama as ml

    layer = model.model.layers[0]
    x = torch.randn(2, 1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    heads, kv, d = 16, 4, 64
    q = torch.randn(2, heads, 1024, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, kv, 1024, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(1024, device="cuda")[None].expand(2, -1)
    cos, sin = model.model.rotary_emb(x, pos)
    gy = torch.randn_like(x)

    def norm_f():
        return layer.input_layernorm(x)

    def norm_fb():
        layer.input_layernorm(x).backward(gy)

    def rope_f():
        return ml.apply_rotary_pos_emb(q, k, cos, sin)

    def rope_fb():
        a, b = ml.apply_rotary_pos_emb(q, k, cos, sin)
        torch.autograd.backward((a, b), (torch.ones_like(a), torch.ones_like(b)))

    def mlp_f():
        return layer.mlp(x)

    def mlp_fb():
        layer.mlp(x).backward(gy)

    def step():
        model(**kw, labels=labels, use_cache=False).loss.backward()

    def fwd():
        return model(**kw, labels=labels, use_cache=False).loss

    def with_recompute_off(fn):
        from liger_compat import _config

        def run():
            saved = _config.settings.mlp_recompute
            _config.settings.mlp_recompute = "0"
            try:
                return fn()
            finally:
                _config.settings.mlp_recompute = saved
        return run

    return {"mlp forward+backward, LIGER_COMPAT_MLP_RECOMPUTE=0": with_recompute_off(mlp_fb),
            "model forward+backward, LIGER_COMPAT_MLP_RECOMPUTE=0": with_recompute_off(step),
            "rms_norm forward": norm_f, "rms_norm forward+backward": norm_fb, "rope forward": rope_f,
            "rope forward+backward": rope_fb, "mlp forward": mlp_f, "mlp forward+backward": mlp_fb,
            "model forward (labels)": fwd, "model forward+backward": step}


def _floors():
    from liger_compat.kernels import _rms_norm_triton as rt

    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    r = torch.empty(2048, device="cuda", dtype=torch.float32)

    def launch():
        rt._rms_fwd[(2048 // 2,)](x, w, y, r, 1024, 1e-6, 0.0, LLAMA=True, BLOCK_H=1024, ROWS=2, num_warps=4)

    def op():
        torch.mul(x, 2.0)

    def empty():
        torch.empty((2048, 1024), device="cuda", dtype=torch.bfloat16)

    out = {"one Triton launch (RMSNorm kernel)": launch, "one torch op (mul)": op, "torch.empty": empty}
    try:  # the compiled kernel's own launcher, without the JIT's argument binding and cache lookup
        compiled = rt._rms_fwd[(2048 // 2,)](x, w, y, r, 1024, 1e-6, 0.0, LLAMA=True, BLOCK_H=1024, ROWS=2, num_warps=4)
        runner = compiled[(2048 // 2, 1, 1)]
        ref = y.clone()
        y.zero_()
        runner(x, w, y, r, 1024, 1e-6, 0.0, True, 1024, 2)
        torch.cuda.synchronize()
        if torch.equal(ref, y):
            out["one launch through the compiled kernel's runner"] = lambda: runner(x, w, y, r, 1024, 1e-6, 0.0, True, 1024, 2)
        else:
            print("compiled runner: wrong result", flush=True)
    except Exception as exc:
        print(f"compiled runner: {type(exc).__name__}: {exc}", flush=True)
    return out


def _profile(pieces, ns, cmd: str) -> None:
    """cProfile of each piece, native and patched (own time, then cumulative), into
    ``<out>/<name>_profile.txt``: which Python functions a patched call spends its host time in."""
    import cProfile
    from pathlib import Path

    out = []
    for name, fn in pieces.items():
        if "RECOMPUTE=0" in name:
            continue
        calls = 50 if "model" not in name else 10
        for side, switch in (("native", liger_compat.revert), ("patched", liger_compat.apply)):
            switch()
            _per_call_us(fn, 5)
            pr = cProfile.Profile()
            pr.enable()
            _per_call_us(fn, calls)
            pr.disable()
            for order, n in (("tottime", 30), ("cumulative", 40)):
                out.append(f"## {name}, {side}, {calls} calls, by {order}\n{_results.profile_text(pr, order, n)}")
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    (Path(ns.out) / f"{ns.name}_profile.txt").write_text(_results.md_line(cmd) + "\n".join(out))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="module_host")
    ap.add_argument("--profile", action="store_true",
                    help="also write <name>_profile.txt: a cProfile of each piece, native and patched")
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import argparse as _a

    import transformers

    from .models_gpu import batch, make_model

    liger_compat.apply()
    margs = _a.Namespace(layers=2, hidden=1024, vocab=128256, batch=2, seq=1024, intermediate=0, device="cuda")
    model = make_model("llama", margs, torch.bfloat16)
    kw, labels = batch(model, margs, "llama")
    pieces = _pieces(model, kw, labels)
    rows = []
    for name, fn in pieces.items():
        calls = ns.calls if "model" not in name else max(10, ns.calls // 20)
        got: dict[str, list[float]] = {"native": [], "patched": []}
        for side, switch in (("native", liger_compat.revert), ("patched", liger_compat.apply)):
            switch()
            _per_call_us(fn, 5)  # warm-up: kernels compile, probes run
        for r in range(ns.rounds):
            for side in (("native", "patched") if r % 2 == 0 else ("patched", "native")):
                (liger_compat.revert if side == "native" else liger_compat.apply)()
                got[side].append(_per_call_us(fn, calls))
        model.zero_grad(set_to_none=True)
        row = {"what": name, "native_us": statistics.median(got["native"]),
               "patched_us": statistics.median(got["patched"])}
        row["delta_us"] = row["patched_us"] - row["native_us"]
        print(row, flush=True)
        rows.append(row)
    cmd = _results.command("benchmarks.module_host", sys.argv[1:] if argv is None else argv)
    if ns.profile:
        _profile(pieces, ns, cmd)
    liger_compat.apply()
    for name, fn in _floors().items():
        _per_call_us(fn, 5)
        row = {"what": name, "us": statistics.median(_per_call_us(fn, ns.calls) for _ in range(ns.rounds))}
        print(row, flush=True)
        rows.append(row)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__}
    lines = [f"Host microseconds per call, {meta['gpu']}, torch {meta['torch']}, transformers {meta['transformers']}; "
             "small Llama (hidden 1024, vocabulary 128256, bf16), 2 x 1024 tokens; median of interleaved batches.", "",
             "| call | native us | patched us | patched - native |", "|---|---|---|---|"]
    for r in rows:
        if "us" in r:
            lines.append(f"| {r['what']} | {r['us']:.1f} | | |")
        else:
            lines.append(f"| {r['what']} | {r['native_us']:.1f} | {r['patched_us']:.1f} | {r['delta_us']:+.1f} |")
    _results.write(ns.out, ns.name, {"meta": meta, "rows": rows}, "\n".join(lines) + "\n", cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
