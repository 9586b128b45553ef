"""Where a profiled step leaves the GPU idle, and which host code it was waiting for.

Reads a ``torch.profiler`` Chrome trace (CPU and CUDA activities). The GPU is idle wherever no
kernel, copy or memset runs on any stream. Each idle stretch (a *gap*) ends with some device
activity; its launch (the CUDA runtime call with the same correlation id) names the host code that
ended the gap: the ranges and operators open on the launching thread at that moment. A gap whose
launch came after the previous activity had finished is *host-late* (the host had not yet queued
the next work); otherwise the device was waiting on something else (a dependency, a copy's
completion). ``--help`` for the command line; ``summarize`` for the table a benchmark embeds.
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict

#: trace categories of device activity
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
#: trace categories of host ranges that can enclose a launch
HOST_CATS = ("cpu_op", "user_annotation", "python_function")
#: CUDA runtime calls that wait for the device (and every synchronous ``cudaMemcpy*``: :func:`is_wait`)
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def is_wait(name: str) -> bool:
    """Whether a CUDA runtime call of this name waits for the device."""
    return name in WAITS or (name.startswith("cudaMemcpy") and "Async" not in name)


class _Thread:
    """One host thread's ranges, each with the index of the range that encloses it."""

    def __init__(self, ranges: list[dict]):
        ranges.sort(key=lambda e: (e["ts"], -e["dur"]))
        self.ranges = ranges
        self.starts = [e["ts"] for e in ranges]
        self.parent: list[int] = []
        stack: list[int] = []
        for i, e in enumerate(ranges):
            while stack and ranges[stack[-1]]["ts"] + ranges[stack[-1]]["dur"] < e["ts"] + e["dur"]:
                stack.pop()
            self.parent.append(stack[-1] if stack else -1)
            stack.append(i)

    def open_at(self, t: float) -> list[dict]:
        """The ranges open at time ``t``, outermost first."""
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0 and self.ranges[i]["ts"] + self.ranges[i]["dur"] < t:
            i = self.parent[i]
        chain = []
        while i >= 0:
            chain.append(self.ranges[i])
            i = self.parent[i]
        return chain[::-1]


def gaps(events: list[dict], min_us: float = 5.0) -> list[dict]:
    """Every idle stretch of at least ``min_us`` between the first and the last device activity,
    with the host ranges open at the launch that ended it (outermost first), whether the launch was
    late, and whether a waiting runtime call returned inside the gap."""
    dev = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    launches = {}
    waits = []
    threads: dict = defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if cat in ("cuda_runtime", "cuda_driver"):
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = e
            if is_wait(e["name"]):
                waits.append(e["ts"] + e["dur"])
        elif cat in HOST_CATS:
            threads[(e.get("pid"), e.get("tid"))].append(e)
    index = {k: _Thread(v) for k, v in threads.items()}
    waits.sort()
    out = []
    busy_until = None
    for e in dev:
        end = e["ts"] + e["dur"]
        if busy_until is not None and e["ts"] - busy_until >= min_us:
            corr = (e.get("args") or {}).get("correlation")
            launch = launches.get(corr)
            chain, late = [], False
            if launch is not None:
                th = index.get((launch.get("pid"), launch.get("tid")))
                chain = th.open_at(launch["ts"]) if th else []
                late = launch["ts"] > busy_until
            k = bisect.bisect_left(waits, busy_until)
            waited = k < len(waits) and waits[k] <= e["ts"]
            out.append({"start": busy_until, "us": e["ts"] - busy_until, "next": e["name"], "late": late,
                        "after_wait": waited, "chain": [r["name"] for r in chain]})
        busy_until = end if busy_until is None else max(busy_until, end)
    return out


def _label(chain: list[str], depth: int) -> str:
    """A gap's host site: the innermost ``phase:`` range, then the next ``depth`` ranges below it."""
    phase = None
    below: list[str] = []
    for name in chain:
        if name.startswith("phase:"):
            phase, below = name[len("phase:"):], []
        else:
            below.append(name)
    site = " > ".join(n[:48] for n in below[:depth]) or "-"
    return f"{phase or 'outside the phases'} | {site}"


def summarize(events: list[dict], n_steps: int, *, depth: int = 2, rows: int = 20, min_us: float = 5.0
              ) -> tuple[str, dict]:
    """The idle time per step, by phase and by host site, as text lines and a summary dict."""
    found = gaps(events, min_us)
    per = lambda us: us / 1e3 / n_steps  # noqa: E731  (us in total -> ms per step)
    total = sum(g["us"] for g in found)
    by_phase: dict = defaultdict(float)
    by_site: dict = defaultdict(lambda: [0.0, 0, 0.0, 0.0])
    for g in found:
        key = _label(g["chain"], depth)
        by_phase[key.split(" | ")[0]] += g["us"]
        s = by_site[key]
        s[0] += g["us"]
        s[1] += 1
        s[2] += g["us"] if g["late"] else 0.0
        s[3] += g["us"] if g["after_wait"] else 0.0
    lines = [f"GPU idle (no kernel, copy or memset on any stream, stretches of at least {min_us:g} us): "
             f"{per(total):.2f} ms a step in {len(found) / n_steps:.0f} stretches",
             "", "idle by the phase whose code launched the work that ended it (ms a step):"]
    lines += [f"  {k:24s} {per(v):8.2f}" for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1])]
    lines += ["", "idle by host site (the phase, then the ranges open at the launch that ended the gap):", "",
              "| phase | host site | ms / step | gaps / step | host-late ms | after a wait ms |",
              "|---|---|---:|---:|---:|---:|"]
    for key, (us, n, late, waited) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:rows]:
        phase, site = key.split(" | ", 1)
        lines.append(f"| {phase} | {site.replace('|', '/')} | {per(us):.3f} | {n / n_steps:.1f} | {per(late):.3f} "
                     f"| {per(waited):.3f} |")
    summary = {"idle_ms": per(total), "gaps_per_step": len(found) / n_steps,
               "by_phase_ms": {k: per(v) for k, v in by_phase.items()},
               "top_sites_ms": {k: per(v[0]) for k, v in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:rows]}}
    return "\n".join(lines), summary


def load(path: str) -> list[dict]:
    """A Chrome trace's events."""
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def from_profiler(prof) -> list[dict]:
    """The events of a finished ``torch.profiler.profile``, through its Chrome trace."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tdir:
        path = os.path.join(tdir, "trace.json")
        prof.export_chrome_trace(path)
        return load(path)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a torch.profiler Chrome trace (export_chrome_trace)")
    ap.add_argument("--steps", type=int, default=1, help="steps the trace covers (figures are per step)")
    ap.add_argument("--depth", type=int, default=2, help="ranges below the phase that name a host site")
    ap.add_argument("--min-us", type=float, default=5.0)
    a = ap.parse_args(argv)
    if a.steps < 1 or a.depth < 1:
        ap.error("--steps and --depth: at least 1")
    print(summarize(load(a.trace), a.steps, depth=a.depth, min_us=a.min_us)[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
