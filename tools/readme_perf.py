"""Write the performance tables of docs/performance.md and the README's headline table from the
committed benchmark results.

    python tools/readme_perf.py          # rewrite the blocks between the markers
    python tools/readme_perf.py --check  # exit 1 when a block is stale

Reads benchmarks/results/{kernels,e2e,e2e_settings,overhead,cpu_step}.json. Every ratio compares
implementations measured together.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import _results  # noqa: E402
from benchmarks.e2e import VARIANTS, combine  # noqa: E402  (stdlib only at import)
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- perf:start -->", "<!-- perf:end -->"
HEADLINE_START, HEADLINE_END = "<!-- perf-headline:start -->", "<!-- perf-headline:end -->"
FILES_START, FILES_END = "<!-- perf-files:start -->", "<!-- perf-files:end -->"
#: where each block lives
PERF_PAGE, README = ROOT / "docs" / "performance.md", ROOT / "README.md"
PEERS = ("torch eager", "torch.compile", "liger-kernel", "cut-cross-entropy")


def _load(name: str):
    p = RESULTS / name
    return json.loads(p.read_text()) if p.exists() else None


def _ratio_table(rows: list[dict], section: str, peers: tuple[str, ...], first: str, ours_head: str,
                 ours: Callable[[dict], str]) -> list[str]:
    """One row per shape of ``section``: our figures, then our time / each peer's time."""
    rows = [r for r in rows if r["section"] == section]
    n_ours = ours_head.count("|") + 1
    out = [f"| {first} | {ours_head} | " + " | ".join(f"x {p}" for p in peers) + " |",
           "|---|" + "---|" * n_ours + "---|" * len(peers)]
    for s in dict.fromkeys(r["shape"] for r in rows):
        by = {r["impl"]: r for r in rows if r["shape"] == s}
        me = by.get("liger_compat")
        if not me:
            continue
        ratios = [f"{me['ms'] / by[p]['ms']:.2f}" if p in by else "-" for p in peers]
        out.append(f"| {s} | {ours(me)} | " + " | ".join(ratios) + " |")
    return out


def _kernels(k: dict) -> list[str]:
    meta = k["meta"]
    samples = meta.get("matmul_tflops_samples") or []
    spread = (f", the fastest of {len(samples)} samples ({min(samples):.0f}-{max(samples):.0f}; "
              "the x-floor figures use it, see `benchmarks/NOTES.md` on its spread)" if len(samples) > 1 else "")
    rounds = max((len(r.get("ms_rounds") or []) for r in k["rows"]), default=0)
    how = (f" Times are medians of {rounds} rounds, each round timing every implementation once in an order "
           "rotated between rounds." if rounds > 1 else "")
    parts = sorted({r["run"] for r in k["rows"] if r.get("run") and r["section"] == "elementwise"})
    if parts:
        how += (f" The elementwise rows were measured separately (`benchmarks/results/"
                f"{parts[0].replace('.json', '.md')}`), with their own copy-rate measurement.")
    out = [f"Kernels, forward + backward, {meta['device']}, torch {meta['torch']}, triton {meta['triton']}; "
           f"measured ceilings: bf16 matmul {meta['matmul_tflops']:.0f} TFLOP/s{spread}, copy {meta['copy_tbps']:.2f} TB/s "
           f"(`benchmarks/results/kernels.md` has every row).{how}", ""]
    # the three heads, then Gemma-2's softcap head and token accuracy on, in one table
    flce_rows = [r for r in k["rows"] if r["section"] in ("flce", "flce_softcap", "flce_acc")]
    out += _ratio_table([dict(r, section="flce") for r in flce_rows], "flce", PEERS, "fused linear cross-entropy",
                        "liger_compat ms (x floor) | extra MiB",
                        lambda me: f"{me['ms']:.1f} ({me['ms'] / me['floor_ms']:.2f}) | {me['extra_mib']:.0f}")
    out += ["", "(x peer = our time / the peer's time in the same run: below 1 is faster.)", ""]
    out += _ratio_table(k["rows"], "elementwise", ("torch eager", "torch.compile", "liger-kernel"),
                        "kernel (GPU time)", "liger_compat ms (x bandwidth floor)",
                        lambda me: f"{me['ms']:.3f} ({me['ms'] / me['floor_ms']:.2f})")
    return out


#: where the other settings' end-to-end rows come from when e2e.json has none
E2E_SETTINGS = "e2e_settings.json"


def _ok(r) -> bool:
    return r is not None and r.get("status") == "ok"


def _x(a, b, key, digits=2) -> str:
    return f"{a[key] / b[key]:.{digits}f}" if _ok(a) and _ok(b) else "-"


def _by_shape(rows: list[dict]) -> dict:
    by: dict = {}
    for r in combine(rows):
        by.setdefault((r["model"], r["shape"]), {})[r["impl"]] = r
    return by


def _e2e(rows: list[dict], settings_rows: list[dict] | None = None, settings_file: str = "e2e.md",
         *, headline: bool = False) -> list[str]:
    """The training-step table; unless ``headline``, then the other settings' table."""
    by = _by_shape(rows)
    r0 = next((r for d in by.values() for r in d.values() if "gpu" in r), {})
    reps = max((r.get("repeats", 1) for d in by.values() for r in d.values()), default=1)
    how = f"; {reps} processes per row, the order reversed between them, median" if reps > 1 else ""
    out = ["", f"Training step (forward + backward + AdamW), bf16, random weights, {r0.get('gpu')}, "
           f"transformers {r0.get('transformers')} (`benchmarks/results/e2e.md`, plots `e2e_<model>.png`{how}):", "",
           "| model | batch x seq | native tokens/s | liger-kernel tokens/s | liger_compat tokens/s (x native, x liger-kernel) "
           "| peak GiB native / liger-kernel / liger_compat (x liger-kernel) |",
           "|---|---|---|---|---|---|"]

    def tps(r):
        return f"{r['tokens_per_s']:.0f}" if _ok(r) else (r or {}).get("status", "-")

    def peak(r):
        return f"{r['peak_gib']:.1f}" if _ok(r) else (r or {}).get("status", "-")

    for (m, s), d in by.items():
        n, lk, me = d.get("native"), d.get("liger_kernel"), d.get("liger_compat")
        out.append(f"| {m} | {s} | {tps(n)} | {tps(lk)} | {tps(me)} ({_x(me, n, 'tokens_per_s')}, "
                   f"{_x(me, lk, 'tokens_per_s')}) | {peak(n)} / {peak(lk)} / {peak(me)} ({_x(me, lk, 'peak_gib', 3)}) |")
    if headline:
        return out
    # other settings: from e2e.json when it has them, else from the settings file
    sby = by if any(v.startswith("liger_compat_") for d in by.values() for v in d) else _by_shape(settings_rows or [])
    labels = [v for v in _VARIANT_LABELS if any(v in d for d in sby.values())]
    if labels:
        src = "the same calls" if sby is by else f"`benchmarks/results/{settings_file}`, one process each"
        out += ["", f"liger_compat under other settings, x liger-kernel's tokens/s and peak memory ({src}):", "",
                "| model | batch x seq | " + " | ".join(_VARIANT_LABELS[v] for v in labels) + " |",
                "|---|---|" + "---|" * len(labels)]
        for (m, s), d in sby.items():
            lk = d.get("liger_kernel")
            out.append(f"| {m} | {s} | " + " | ".join(
                f"{_x(d.get(v), lk, 'tokens_per_s')}, {_x(d.get(v), lk, 'peak_gib', 3)}" for v in labels) + " |")
        env = {v: " ".join(f"{k}={val}" for k, val in VARIANTS[v].items()) for v in labels}
        out += ["", "Settings: " + "; ".join(f"{_VARIANT_LABELS[v]} = `{env[v]}`" for v in labels) + "."]
    return out


#: e2e implementation names of liger_compat under other settings -> short labels for the table
_VARIANT_LABELS = {"liger_compat_62mib": "62 MiB", "liger_compat_256mib": "256 MiB", "liger_compat_512mib": "512 MiB", "liger_compat_keep": "keep",
                   "liger_compat_act": "act only", "liger_compat_input": "input only"}


def _overhead(o: dict) -> list[str]:
    imp = o["import"]
    out = ["", "Shim overhead on the CPU (`python -m benchmarks.overhead`, `benchmarks/results/overhead.md`): "
           f"`import liger_compat` adds {imp['added_ms']:.0f} ms to a fresh interpreter (median of {imp['runs']})"]
    for path, r in o["wrapper"]["paths"].items():
        if "module_overhead_us" in r:
            out[-1] += (f"; a patched `model(...)` call costs {r['module_overhead_us']:.1f} us more than the native "
                        f"one ({path}; the wrapper body alone {r['overhead_us']:.1f} us)")
        else:
            out[-1] += f"; the forward wrapper costs {r['overhead_us']:.1f} us per call ({path})"
    out[-1] += "."
    return out


def _cpu_step(c: dict) -> list[str]:
    rows = {r["variant"]: r for r in c["rows"]}
    d, ref = rows.get("default"), rows.get("references")
    if d is None:
        return []
    text = (f"A tiny Llama's training step on the CPU (`python -m benchmarks.cpu_step`, `benchmarks/results/cpu_step.md`; "
            f"{c['machine']}): patched {d['patched_ms']:.2f} ms against native's {d['native_ms']:.2f} "
            f"({d['ratio_median']:.2f}x; transformers' own module code and the native head's loss, the default)")
    if ref is not None:
        text += (f"; with the kernels' torch references (`LIGER_COMPAT_CPU_NATIVE=0`) {ref['patched_ms']:.2f} ms "
                 f"against {ref['native_ms']:.2f} ({ref['ratio_median']:.2f}x)")
    return ["", text + "."]


def render() -> str:
    parts: list[str] = []
    k = _load("kernels.json")
    if k:
        parts += _kernels(k)
    e = _load("e2e.json")
    if e:
        settings = _load(E2E_SETTINGS)
        parts += _e2e(_results.rows(e), settings and _results.rows(settings), E2E_SETTINGS.replace(".json", ".md"))
    o = _load("overhead.json")
    if o:
        parts += _overhead(o)
    c = _load("cpu_step.json")
    if c:
        parts += _cpu_step(c)
    return START + "\n" + "\n".join(parts) + "\n" + END


def render_headline() -> str:
    """The README's one table: the training step of e2e.json."""
    e = _load("e2e.json")
    body = _e2e(_results.rows(e), headline=True)[1:] if e else []
    return HEADLINE_START + "\n" + "\n".join(body) + "\n" + HEADLINE_END


def _command(stem: str) -> str:
    md, js = RESULTS / f"{stem}.md", RESULTS / f"{stem}.json"
    if js.exists():
        return json.loads(js.read_text())["regenerate"]
    m = re.match(r"regenerate: `([^`]+)`", md.read_text())
    return m.group(1) if m else "-"


def _what(stem: str) -> str:
    """The first line of the result's markdown after its command: its title or set-up."""
    md = RESULTS / f"{stem}.md"
    if not md.exists():
        return "-"
    lines = [x.strip().lstrip("#").strip() for x in md.read_text().splitlines()[1:]]
    first = next((x for x in lines if x and not x.startswith(("`", "|"))), "-")
    what = first.split(". ")[0].rstrip(".:").replace("|", "/")
    device = _device(stem)
    return what if device is None or device in what else f"{what} ({device})"


def _device(stem: str) -> str | None:
    js = RESULTS / f"{stem}.json"
    if not js.exists():
        return None
    data = json.loads(js.read_text())
    rows = data.get("rows") or [{}]
    found = (data.get("meta") or {}).get("device") or data.get("device") or (rows[0] or {}).get("gpu")
    return found if isinstance(found, str) else None


def render_files() -> str:
    """Every result under benchmarks/results with the command that regenerates it; a plot
    ``<stem>_*.png`` belongs to the longest result stem it starts with."""
    stems = sorted({p.stem for p in RESULTS.iterdir() if p.suffix in (".json", ".md")})
    plots: dict[str, list[str]] = {}
    for png in sorted(RESULTS.glob("*.png")):
        owner = max((s for s in stems if png.stem.startswith(s + "_")), key=len, default=None)
        plots.setdefault(owner or png.stem, []).append(png.name)
    out = ["| result | what | regenerate |", "|---|---|---|"]
    for s in stems:
        files = " ".join(f"`{p.name}`" for p in sorted(RESULTS.glob(f"{s}.*")) if p.suffix in (".json", ".md"))
        files += "".join(f" `{x}`" for x in plots.get(s, []))
        out.append(f"| {files} | {_what(s)} | `{_command(s)}` |")
    return FILES_START + "\n" + "\n".join(out) + "\n" + FILES_END


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    stale = []
    blocks = ((PERF_PAGE, START, END, render), (PERF_PAGE, FILES_START, FILES_END, render_files),
              (README, HEADLINE_START, HEADLINE_END, render_headline))
    for path, start, end, block in blocks:
        text = path.read_text()
        if start not in text or end not in text:
            raise SystemExit(f"{path.relative_to(ROOT)} has no {start} / {end} markers")
        new = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: block(), text, flags=re.S)
        if new == text:
            continue
        stale.append(str(path.relative_to(ROOT)))
        if not a.check:
            path.write_text(new)
    if a.check and stale:
        print(f"performance tables are stale in {', '.join(stale)}: run python tools/readme_perf.py", file=sys.stderr)
        return 1
    print(f"performance tables written: {', '.join(stale) or 'none changed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
