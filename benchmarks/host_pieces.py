"""Host microseconds of each piece of a small training step, measured where it runs, native against patched.

    python -m benchmarks.host_pieces [--families llama,mllama,deepseek_v4] [--seq 1024] [--rounds 30]

Per family, at ``benchmarks.models_gpu``'s host-bound shape (2 layers, hidden 1024, vocabulary
128256, bf16): one model, its steps (forward with labels, backward) taken from a drained GPU, the
host's time to the loss and in ``backward()``; and, inside those steps, the inclusive host time of
each piece, through timing wrappers (``time.perf_counter``, about half a microsecond each) set on

- the forward of each module class whose name holds ``RMSNorm``, ``MLP``, ``Attention``,
  ``DecoderLayer`` or ``Model`` (``...ForCausalLM`` included): native's module code against the
  patched one, shims included;
- on the patched side, the shims' and kernels' entry points (:data:`PIECES`): the loss's path
  from the causal-LM forward to the CUDA graph's replay and the device-error queue, the RMSNorm
  and gated-MLP kernel entries and their argument checks.

Unlike a profiler's, these times are the real ones of code that runs cold between the model's
other work: a hot loop of one call (``benchmarks.module_host``) reads less. The two sides are
interleaved step by step (``--rounds`` rounds, the order alternating; each timed step after an
untimed one on the side just switched on), since the host's own speed drifts between blocks of
steps and between processes by more than these pieces differ. A wrapper on a module's forward makes
nothing take another path (no module hook is set: a hooked ``down_proj`` is no plain linear layer
for the MLP shim). Writes ``<name>.json`` and ``<name>.md``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch

import liger_compat

from . import _results
from .host_profile import _step, _sync, warm_model

#: module class name parts whose forward is timed on both sides
CLASS_PARTS = ("RMSNorm", "MLP", "Attention", "DecoderLayer", "Model", "ForCausalLM", "ForConditionalGeneration")

#: patched side: (module path, attribute, label) of the shims' and kernels' pieces timed
PIECES = (
    ("liger_compat.shims.causal_lm", "_decoder_and_head", "causal LM: decoder and head"),
    ("liger_compat.shims.causal_lm", "_loss", "causal LM: loss"),
    ("liger_compat.shims.causal_lm", "_targets", "loss: shifted targets"),
    ("liger_compat.shims.causal_lm", "_final_logit_quirks", "loss: softcap / logit scale"),
    ("liger_compat.shims.causal_lm", "_check_labels", "loss: label checks"),
    ("liger_compat.shims._sharded_head", "fused_head_loss", "loss: head call"),
    ("liger_compat.kernels", "fused_linear_cross_entropy", "loss: fused_linear_cross_entropy"),
    ("liger_compat.kernels.loss", "_graphed_pass", "loss: graphed pass"),
    ("liger_compat.kernels._device_errors", "watch", "loss: device-error watch"),
    ("liger_compat.kernels._device_errors", "poll", "loss: device-error poll"),
    ("liger_compat.kernels.norm", "rms_norm_checked", "rms_norm: kernel entry"),
    ("liger_compat.kernels.norm", "check_args", "rms_norm: argument checks"),
    ("liger_compat.kernels.gated_mlp", "gated_project_checked", "mlp: kernel entry"),
    ("liger_compat.kernels.gated_mlp", "check_args", "mlp: argument checks"),
    ("liger_compat.kernels.gated_mlp", "linear_params", "mlp: plain-linear check"),
    ("liger_compat.kernels.gated_mlp", "plain_linear", "mlp: plain-linear check"),
)


class Clock:
    """Timing wrappers set on functions and class forwards; each label's seconds and calls."""

    def __init__(self) -> None:
        self.secs: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, attr: str, label: str) -> None:
        fn = getattr(owner, attr)
        secs, calls = self.secs, self.calls

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                secs[label] = secs.get(label, 0.0) + time.perf_counter() - t0
                calls[label] = calls.get(label, 0) + 1

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn))

    def reset(self) -> None:
        self.secs.clear()
        self.calls.clear()

    def remove(self) -> None:
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)
        self._undo.clear()


def _wrap_side(clock: Clock, model, side: str) -> None:
    """Timing wrappers on the forwards of ``model``'s module classes named in :data:`CLASS_PARTS`,
    and on the patched side on :data:`PIECES` too."""
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: c.__name__):
        if any(p in cls.__name__ for p in CLASS_PARTS) and "forward" in vars(cls):
            clock.wrap(cls, "forward", f"class {cls.__name__}")
    if side == "patched":
        for module, attr, label in PIECES:
            owner = sys.modules.get(module)
            if owner is not None and hasattr(owner, attr):
                clock.wrap(owner, attr, label)


def measure(family: str, ns: argparse.Namespace) -> dict:
    """Both sides interleaved: each round, each side (the order alternating) is switched on, takes
    one untimed step, then one step timed with the wrappers set (and removed after it, before the
    other side's patches are switched)."""
    liger_compat.apply()
    model, kw, labels, switches = warm_model(family, ns)  # 4 warm-up steps a side
    sides = ("native", "patched")
    clocks = {s: Clock() for s in sides}
    times: dict[str, dict[str, list[float]]] = {s: {"forward": [], "backward": []} for s in sides}
    for r in range(ns.rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            switches[side]()
            _step(model, kw, labels)
            clock = clocks[side]
            _wrap_side(clock, model, side)
            try:
                _sync()
                t0 = time.perf_counter()
                model.zero_grad(set_to_none=True)
                out = model(**kw, labels=labels, use_cache=False)
                t1 = time.perf_counter()
                out.loss.backward()
                t2 = time.perf_counter()
                _sync()
            finally:
                clock.remove()
            times[side]["forward"].append((t1 - t0) * 1e6)
            times[side]["backward"].append((t2 - t1) * 1e6)
    liger_compat.apply()
    row: dict = {"family": family, "shape": f"{ns.batch}x{ns.seq}"}
    for side in sides:
        c = clocks[side]
        row[side] = {"forward_us": statistics.median(times[side]["forward"]),
                     "backward_us": statistics.median(times[side]["backward"]),
                     "pieces": {k: {"us": c.secs[k] / ns.rounds * 1e6, "calls": c.calls[k] / ns.rounds} for k in c.secs}}
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def _markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Host microseconds of a small training step's pieces, measured inside the step (timing wrappers, "
             f"one step a side in each of {meta['rounds']} interleaved rounds, from a drained GPU; host times "
             f"the medians over rounds, pieces the means); {meta['gpu']}, "
             f"torch {meta['torch']}, transformers {meta['transformers']}; {meta['layers']} layers, hidden "
             f"{meta['hidden']}, vocabulary {meta['vocab']}, bf16. Inclusive times: a piece's time holds the pieces "
             "it calls. Patched-only rows are the shims' and kernels' entry points.", ""]
    for r in rows:
        if "error" in r:
            lines += [f"## {r['family']}: {r['error']}", ""]
            continue
        n, p = r["native"], r["patched"]
        lines += [f"## {r['family']} {r['shape']}", "",
                  f"host us a step: forward (to the loss) native {n['forward_us']:.0f}, patched {p['forward_us']:.0f} "
                  f"({p['forward_us'] - n['forward_us']:+.0f}); backward() native {n['backward_us']:.0f}, patched "
                  f"{p['backward_us']:.0f} ({p['backward_us'] - n['backward_us']:+.0f})", "",
                  "| piece | calls a step | native us a step | patched us a step | patched - native | native us a call "
                  "| patched us a call |", "|---|---:|---:|---:|---:|---:|---:|"]
        names = sorted(set(n["pieces"]) | set(p["pieces"]),
                       key=lambda k: -max(n["pieces"].get(k, {}).get("us", 0.0), p["pieces"].get(k, {}).get("us", 0.0)))
        for k in names:
            a, b = n["pieces"].get(k), p["pieces"].get(k)
            calls = (b or a)["calls"]
            cells = [f"{a['us']:.0f}" if a else "", f"{b['us']:.0f}" if b else "",
                     f"{b['us'] - a['us']:+.0f}" if a and b else "",
                     f"{a['us'] / a['calls']:.1f}" if a and a["calls"] else "",
                     f"{b['us'] / b['calls']:.1f}" if b and b["calls"] else ""]
            lines.append(f"| {k} | {calls:g} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="llama,mllama,deepseek_v4")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=30, help="interleaved rounds: one timed step a side each")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (tiny sizes advised)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="host_pieces")
    ns = ap.parse_args(argv)
    if ns.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import transformers

    meta = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__,
                transformers=transformers.__version__, rounds=ns.rounds, layers=ns.layers, hidden=ns.hidden,
                vocab=ns.vocab)
    cmd = _results.command("benchmarks.host_pieces", sys.argv[1:] if argv is None else argv)
    rows = []
    for family in [f for f in ns.families.split(",") if f]:
        try:
            rows.append(measure(family, ns))
        except Exception as exc:  # one family failing must not hide the others
            rows.append({"family": family, "error": f"{type(exc).__name__}: {exc}"})
        # written after every family: a run cut short keeps what it measured
        _results.write(ns.out, ns.name, {"meta": meta, "rows": rows}, _markdown(rows, meta), cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
