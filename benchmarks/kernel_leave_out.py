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

Where a side's extra time goes: each timed step also records the host's time in the forward (to the
loss), in ``backward()`` and waiting for the GPU after it (``time.perf_counter``, the GPU drained
before the step), and the caching allocator's device allocations and frees in the step; a second
table gives ``all`` and ``none`` minus native in milliseconds per phase, medians over rounds.

``--modules``: also each module class's forward host time a step (inclusive: a class's time
contains its children's; forward hooks on every module, on every side alike), and, after the timed
rounds, one step a side under ``torch.cuda.set_sync_debug_mode("warn")``: the host syncs it makes
and the lines of code that make them. A hooked ``down_proj`` is no plain linear layer to the MLP
shim, which then takes its other route: the MLP's times read high; ``benchmarks.host_pieces``
times the pieces without hooks.

``--mlp-every-size``: also the side with every kernel and the gated-MLP kernel at every size
(``LIGER_COMPAT_MLP_SMALL_NATIVE`` off: by default a small eager MLP on a GPU runs its native forward),
with its own 95 % interval.

``--compile default`` or ``--compile reduce-overhead``: the step runs on ``torch.compile(model,
mode=...)`` and the sides are native and all only (a compiled graph does not read the ``kernels``
setting at each call); each side compiles in its warm-up (TorchDynamo keeps one entry per side: the
patched and native forwards are different functions), and the row counts the graphs compiled
after the warm-up (0 when every timed step ran the graph of its side). ``--compile-leave-out`` adds
the other sides; one that compiles no graph of its own in its warm-up (the traced code does not
guard on the setting it changes) is left out rather than timed on another side's graph.

Writes ``<name>.json`` and ``<name>.md`` under ``--out`` (default benchmarks/results), each naming
the command that regenerates it, after every family.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import liger_compat
from benchmarks import models_gpu
from benchmarks._stats import median_interval
from liger_compat import _config

#: the kernels whose leaving out is timed: the layer kernels and the loss (the MLP's activation
#: kernel by family: GeGLU for the Gemmas, SwiGLU for the others)
LOSS, NORM, ROPE = "fused_linear_cross_entropy", "rms_norm", "rope"


def kernels_of(family: str) -> tuple[str, ...]:
    return (LOSS, NORM, ROPE, "geglu" if family.startswith("gemma") else "swiglu")


#: the side with every kernel and the gated-MLP kernel at every size (``LIGER_COMPAT_MLP_SMALL_NATIVE``
#: off; ``--mlp-every-size``): against ``all``, what the small MLPs' native forward gives
MLP_EVERY_SIZE = "all, MLP kernel at every size"


def sides_of(family: str, mlp_every_size: bool = False) -> dict[str, frozenset[str] | None]:
    """Side name -> the kernels it runs (None: native, liger_compat reverted)."""
    every = frozenset(_config.ALL_KERNELS)
    sides: dict[str, frozenset[str] | None] = {"native": None, "all": every, "none": frozenset()}
    if mlp_every_size:
        sides[MLP_EVERY_SIZE] = every
    for k in kernels_of(family):
        sides[f"without {k}"] = every - {k}
    return sides


def rotated(names: list[str], r: int) -> list[str]:
    """The sides' order in round ``r``: rotated by ``r`` (each side leads once every len rounds)."""
    k = r % len(names)
    return names[k:] + names[:k]


#: a step's phases (host milliseconds unless named otherwise), recorded beside its time
PHASES = ("forward", "backward", "wait", "device_allocs", "device_frees")


def _alloc_counts() -> tuple[int, int]:
    if not torch.cuda.is_available():
        return 0, 0
    st = torch.cuda.memory_stats()
    return st.get("num_device_alloc", 0), st.get("num_device_free", 0)


def timed_phases(step_model, kw, labels, steps: int) -> tuple[float, dict[str, float]]:
    """Median ms of ``steps`` steps after one untimed (CUDA events on the GPU, wall time on the CPU)
    and the median of each of :data:`PHASES`: the host's time to the loss, in ``backward()`` and
    waiting for the GPU after it (the GPU drained before each step), and the device allocations
    and frees of the caching allocator during the step."""
    times, phases = [], {k: [] for k in PHASES}
    cuda = labels.is_cuda
    for i in range(steps + 1):
        step_model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            a0, f0 = _alloc_counts()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        loss = step_model(**kw, labels=labels, use_cache=False).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if cuda:
            end.record()
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        if i == 0:
            continue
        if cuda:
            times.append(start.elapsed_time(end))
            a1, f1 = _alloc_counts()
            phases["device_allocs"].append(a1 - a0)
            phases["device_frees"].append(f1 - f0)
        else:
            times.append((t3 - t0) * 1e3)
            phases["device_allocs"].append(0)
            phases["device_frees"].append(0)
        phases["forward"].append((t1 - t0) * 1e3)
        phases["backward"].append((t2 - t1) * 1e3)
        phases["wait"].append((t3 - t2) * 1e3)
    return statistics.median(times), {k: statistics.median(v) for k, v in phases.items()}


class ModuleClock:
    """Forward hooks on every module of a model: each class's inclusive host milliseconds since the
    last :meth:`take`."""

    def __init__(self, model):
        self.ms: dict[str, float] = {}
        self._starts: list[float] = []
        self._handles = []
        for m in model.modules():
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))

    def _pre(self, module, args):
        self._starts.append(time.perf_counter())

    def _post(self, module, args, out):
        name = type(module).__name__
        self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - self._starts.pop()) * 1e3

    def take(self) -> dict[str, float]:
        got, self.ms, self._starts = self.ms, {}, []
        return got

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def host_syncs(model, kw, labels) -> dict[str, int]:
    """One step under ``torch.cuda.set_sync_debug_mode("warn")``: ``file:line`` of each host sync's
    call site -> count (every thread's: the warnings filter is the process's)."""
    import warnings

    if not labels.is_cuda:
        return {}
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model(**kw, labels=labels, use_cache=False).loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    where: dict[str, int] = {}
    for w in caught:
        if "synchronizing cuda operation" in str(w.message).lower():  # not the prototype notice
            key = f"{Path(w.filename).name}:{w.lineno}"
            where[key] = where.get(key, 0) + 1
    return where


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def time_sides(family: str, args) -> dict:
    """In this process: each side's median step time (ms) over ``args.rounds`` interleaved rounds."""
    got = models_gpu._timing_model(family, args)
    if isinstance(got, dict):
        return got
    model, kw, labels = got
    sides = sides_of(family, getattr(args, "mlp_every_size", False))
    step_model = model
    if args.compile:
        if not args.compile_leave_out:
            sides = {k: v for k, v in sides.items() if k in ("native", "all")}
        dyn = torch._dynamo.config  # one cache entry a side at most
        for limit in ("cache_size_limit", "recompile_limit"):
            if hasattr(dyn, limit):
                setattr(dyn, limit, max(getattr(dyn, limit), 4 * len(sides)))
        step_model = torch.compile(model, mode=None if args.compile == "default" else args.compile)
    settings = _config.settings
    saved = settings.kernels
    saved_small = settings.mlp_small_native

    def switch(kernels, name=None):
        if kernels is None:
            errors = liger_compat.revert()
            if errors:
                raise RuntimeError(f"revert failed: {errors}")
            return
        liger_compat.apply()
        settings.kernels = kernels
        settings.mlp_small_native = saved_small and name != MLP_EVERY_SIZE

    times: dict[str, list[float]] = {s: [] for s in sides}
    phases: dict[str, dict[str, list[float]]] = {s: {k: [] for k in PHASES} for s in sides}
    modules: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
    syncs: dict[str, dict[str, int]] = {}
    clock = None
    warm_graphs: dict[str, int] = {}
    try:
        for _ in range(2 if args.compile else 1):  # compiled: every side's graph exists before any timing
            for name, kernels in sides.items():  # every side compiles and warms its kernels first
                switch(kernels, name)
                before = _compiled_graphs()
                models_gpu._warm_up(step_model, kw, labels)
                warm_graphs.setdefault(name, _compiled_graphs() - before)
        if args.compile and not (warm_graphs["native"] and warm_graphs["all"]):  # one ran the other's graph
            raise RuntimeError(f"a side compiled no graph of its own in its warm-up: {warm_graphs}")
        # a kernels setting that the traced code does not guard on gives a side no graph of its own:
        # it would time another side's graph, so it is left out
        shared = [name for name, n in warm_graphs.items() if args.compile and not n]
        for name in shared:
            del sides[name], times[name], phases[name], modules[name]
        graphs = _compiled_graphs()
        if args.modules:
            clock = ModuleClock(model)
        for r in range(args.rounds):
            for name in rotated(list(sides), r):
                switch(sides[name], name)
                if clock is not None:
                    clock.take()
                ms, ph = timed_phases(step_model, kw, labels, args.steps)
                times[name].append(ms)
                for k, v in ph.items():
                    phases[name][k].append(v)
                if clock is not None:  # the untimed step's and the timed steps' forwards: per step
                    modules[name].append({k: v / (args.steps + 1) for k, v in clock.take().items()})
        graphs = _compiled_graphs() - graphs
        if clock is not None:  # the sync probe's step runs without the hooks
            clock.remove()
            clock = None
        if args.modules:
            for name, kernels in sides.items():
                switch(kernels, name)
                syncs[name] = host_syncs(step_model, kw, labels)
    finally:
        if clock is not None:
            clock.remove()
        liger_compat.apply()
        settings.kernels = saved
        settings.mlp_small_native = saved_small
    del model, step_model, got
    models_gpu._release()
    row = {"family": family, "ms": {s: statistics.median(v) for s, v in times.items()},
           "ms_rounds": times, "phases_rounds": phases}
    if args.modules:
        row["modules_rounds"], row["host_syncs"] = modules, syncs
    if args.compile:
        row["graphs_after_warm_up"] = graphs
        row["graphs_in_warm_up"] = warm_graphs
        row["sides_without_own_graph"] = shared
    return row


def _child(family: str, args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.kernel_leave_out", "--child", "--families", family,
           *models_gpu.model_argv(args), "--steps", str(args.steps), "--rounds", str(args.rounds),
           "--device", args.device, *(["--compile", args.compile] if args.compile else []), *(["--modules"] if args.modules else []),
           *(["--compile-leave-out"] if args.compile_leave_out else []),
           *(["--mlp-every-size"] if args.mlp_every_size else [])]
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


#: the table's columns of kernels left out: the header, and the kernels a family's side may name
_LEFT_OUT = (("loss", (LOSS,)), ("rms_norm", (NORM,)), ("rope", (ROPE,)), ("swiglu / geglu", ("swiglu", "geglu")))


def _median_diff(side: list, native: list) -> float:
    """The median over rounds of a side's value minus native's in the same round."""
    return statistics.median(a - b for a, b in zip(side, native))


def markdown(rows: list[dict], meta: dict) -> str:
    """One table: per family each side's time against native's, paired by round."""
    every = any(MLP_EVERY_SIZE in r.get("ms_rounds", {}) for r in rows)
    out = [f"A family's small training step with each of our kernels left out in turn, against native, in one "
           f"process; transformers {meta['transformers']}, torch {meta['torch']}, {meta['gpu']}; batch {meta['batch']} x "
           f"{meta['seq']}, hidden {meta['hidden']}, {meta['layers']} layers, vocab {meta['vocab']}, bf16; one fresh "
           f"process a family, its sides interleaved ({meta['rounds']} rounds of {meta['steps']} "
           f"step{'s' if meta['steps'] != 1 else ''} a side, the order rotating every round)"
           + (f"; each side's step on `torch.compile(model, mode={meta['compile']!r})`, "
              + ("each side a graph of its own (a side without one left out)" if meta.get("compile_leave_out")
                 else "native against all only") if meta.get("compile") else ""), "",
           "Each ratio is a side's time over native's, the median over rounds of the two sides' times in the same "
           "round, with a distribution-free 95 % interval for the `all` one. A kernel with `without K` below `all` costs this family more than it gives at this shape; "
           "`none` is patched with every kernel off (the shims' dispatch alone).", "",
           "| family | ms native | all | none | "
           + " | ".join(f"without {label}" for label, _ in _LEFT_OUT) + " | all: 95 % interval | rounds all < native |"
           + (" MLP kernel at every size | its 95 % interval |" if every else ""),
           "|---|---:|---:|---:|" + "---:|" * len(_LEFT_OUT) + "---|---:|" + ("---:|---|" if every else "")]
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
        none = f"{paired(r, 'none'):.3f}" if "none" in ms else ""
        extra = ""
        if every and MLP_EVERY_SIZE in ms:
            er = [a / b for a, b in zip(ms[MLP_EVERY_SIZE], ms["native"])]
            elo, ehi = median_interval(er)
            extra = f" {statistics.median(er):.3f} | {elo:.3f}-{ehi:.3f} |"
        elif every:
            extra = "  |  |"
        out.append(f"| {r['family']} | {statistics.median(ms['native']):.2f} | {statistics.median(ratios):.3f} | "
                   f"{none} | " + " | ".join(cells)
                   + f" | {lo:.3f}-{hi:.3f} | {sum(x < 1 for x in ratios)} / {len(ratios)} |" + extra
                   + (f" graphs compiled after the warm-up: {r['graphs_after_warm_up']}"
                      if "graphs_after_warm_up" in r else ""))
    phased = [r for r in rows if "phases_rounds" in r]
    if phased:
        out += ["", "Where the difference goes: a side's time minus native's in the same round, median over rounds, in "
                "ms: the step (GPU events), the host's forward (to the loss), its `backward()` call and its wait for "
                "the GPU after it (the GPU drained before each step); and the caching allocator's device "
                "allocations + frees a step (median), the side's against native's.", "",
                "| family | side | step | forward | backward | wait | device allocs + frees a step |",
                "|---|---|---:|---:|---:|---:|---|"]
        for r in phased:
            ms, ph = r["ms_rounds"], r["phases_rounds"]
            for side in ("all", "none"):
                if side not in ph:
                    continue
                diff = [f"{_median_diff(ms[side], ms['native']):+.2f}"]
                diff += [f"{_median_diff(ph[side][k], ph['native'][k]):+.2f}" for k in ("forward", "backward", "wait")]
                allocs = [statistics.median(a + f for a, f in zip(ph[s]['device_allocs'], ph[s]['device_frees']))
                          for s in (side, "native")]
                out.append(f"| {r['family']} | {side} | " + " | ".join(diff) + f" | {allocs[0]:g} against {allocs[1]:g} |")
    moduled = [r for r in rows if "modules_rounds" in r]
    if moduled:
        out += ["", "Forward host time by module class (inclusive of its children), the side's minus native's in the "
                "same round, median over rounds, ms a step: the classes whose difference is largest. Host syncs: one "
                "step a side under `torch.cuda.set_sync_debug_mode(\"warn\")`, each sync's call site.", "",
                "| family | side | largest differences by module class, ms | host syncs a step: side (native) | where, side |",
                "|---|---|---|---|---|"]
        for r in moduled:
            mods = r["modules_rounds"]
            for side in ("all", "none"):
                if side not in mods:
                    continue
                names = set().union(*mods[side], *mods["native"])
                diffs = {n: _median_diff([a.get(n, 0.0) for a in mods[side]], [b.get(n, 0.0) for b in mods["native"]])
                         for n in names}
                top = sorted(diffs.items(), key=lambda kv: -abs(kv[1]))[:6]
                syncs = r["host_syncs"]
                where = ", ".join(f"{k} x{v}" for k, v in sorted(syncs.get(side, {}).items(), key=lambda kv: -kv[1])[:4])
                out.append(f"| {r['family']} | {side} | " + ", ".join(f"{n} {d:+.2f}" for n, d in top)
                           + f" | {sum(syncs.get(side, {}).values())} ({sum(syncs.get('native', {}).values())}) | {where} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    models_gpu.add_model_args(ap, "qwen3_5_text,qwen3_5,qwen3_5_moe_text,deepseek_v4,llama")
    ap.add_argument("--steps", type=int, default=1, help="timed steps a side and round (after one untimed)")
    ap.add_argument("--rounds", type=int, default=40, help="interleaved rounds a side")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (tiny sizes advised)")
    ap.add_argument("--compile", choices=("default", "reduce-overhead"), default=None,
                    help="the step on torch.compile(model, mode=...): native against all only")
    ap.add_argument("--compile-leave-out", action="store_true",
                    help="under --compile, also the sides with kernels left out (each needs a graph of its own)")
    ap.add_argument("--mlp-every-size", action="store_true",
                    help="also the side with every kernel and the gated-MLP kernel at every size "
                         "(LIGER_COMPAT_MLP_SMALL_NATIVE off)")
    ap.add_argument("--modules", action="store_true",
                    help="also each module class's forward host time, and one step's host syncs a side")
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
    if args.mlp_every_size:
        meta["mlp_every_size"] = True
    if args.compile:
        meta["compile"] = args.compile
        if args.compile_leave_out:
            meta["compile_leave_out"] = True
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
