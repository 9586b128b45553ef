"""GPU benchmark of the liger_compat kernels against torch eager, torch.compile, liger-kernel and
cut-cross-entropy, in one run.

    python -m benchmarks.kernels [--out DIR] [--name kernels] [--sections ceilings,flce,logprob,variants,profile,norm,...]
    python -m benchmarks.kernels --plot DIR/kernels.json      # plots only (no GPU needed)

Prints a correctness table and a timing table (markdown, also written to ``<name>.md``),
writes every number to ``<name>.json`` (``--name``, default ``kernels``; both name the command
that regenerates them) and, where matplotlib exists, ``<name>_*.png``.
Times are ``triton.testing.do_bench`` medians of forward+backward; "extra MiB" is peak
allocated memory during forward+backward minus the inputs and the gradients returned.
Floors: the fused loss's three matmuls (6*N*H*V flop at the measured bf16 matmul rate); the
elementwise kernels' compulsory bytes (each input read once, each output written once, forward
and backward) at the measured device-copy rate.

The sections live in ``kernels_<topic>.py`` beside this file (``kernels_common.py``: the results
and the measurement helpers they share; ``kernels_report.py``: the markdown and the plots); this
module is the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from . import kernels_common as C
from . import kernels_flce, kernels_flce_profile, kernels_lowmem
from .kernels_ceilings import ceilings, ceilings_end
from .kernels_common import log, save
from .kernels_elementwise import elem_profile, elementwise
from .kernels_flce import ALL_HEADS, _chunk_setting, flce, flce_mib, flce_rows, flce_variants
from .kernels_flce_profile import flce_gemm, flce_profile, flce_sweep
from .kernels_logprob import logprob
from .kernels_lowmem import LOWMEM_PAIRS, flce_lowmem
from .kernels_report import plots, report


SECTIONS = {
    "ceilings": ceilings,
    "logprob": lambda: logprob(),
    "flce": lambda: flce(),
    "softcap": lambda: flce(("gemma2-9b-softcap",), section="flce_softcap"),
    "acc": lambda: flce(("llama3-8b",), acc_variants=(True,), section="flce_acc"),
    "variants": flce_variants,
    "lowmem": flce_lowmem,
    "flce_lowmem": flce_lowmem,
    "flce_mib": flce_mib,
    "elem_profile": elem_profile,
    "profile": flce_profile,
    "norm": lambda: elementwise(),
    "flce_sweep": flce_sweep,
    "flce_rows": flce_rows,
    "flce_gemm": flce_gemm,
    "elementwise_sweep": lambda: elementwise(
        sizes={"rms_norm": [2048, 8192, 32768], "swiglu": [2048, 8192, 16384],
               "rope": [1024, 2048, 4096]},
        section="elementwise_sweep"),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--sections", default="ceilings,elem_profile,norm,profile,variants,flce,softcap,acc,lowmem,flce_sweep,elementwise_sweep")
    p.add_argument("--name", default=C.NAME, help="result files <name>.json, <name>.md, <name>_*.png")
    p.add_argument("--plot", help="only draw plots from this kernels.json")
    p.add_argument("--merge", nargs="*", help="earlier kernels.json files whose rows to keep")
    p.add_argument("--flce-chunks", help="chunk settings for the flce_mib section, e.g. mib:512,rows:2048")
    p.add_argument("--flce-mib-heads", help=f"heads for the flce_mib section (of {', '.join(ALL_HEADS)})")
    p.add_argument("--rounds", type=int, default=C.ROUNDS,
                   help=f"timing rounds of the flce/softcap/acc and elementwise sections (default {C.ROUNDS})")
    p.add_argument("--gemm-chunk", help="head:rows of the chunk the flce_gemm section times (default llama3-8b:1024)")
    p.add_argument("--lowmem-configs",
                   help="tile configurations of the low-memory kernels that the flce_lowmem section also times "
                        "(comma-separated names of liger_compat.kernels._lowmem_triton.CONFIGS, or 'all')")
    args = p.parse_args(argv)
    if args.plot:
        plots(Path(args.plot))
        return 0
    # every argument checked before any module setting changes
    chunks = tuple(args.flce_chunks.split(",")) if args.flce_chunks else kernels_flce.FLCE_CHUNK_SETTINGS
    bad = []
    for x in chunks:
        try:
            _chunk_setting(x)
        except ValueError:
            bad.append(x)
    if bad:
        p.error(f"--flce-chunks: {', '.join(map(repr, bad))} not understood; use default, mib:N or rows:N "
                "with N a positive number (rows: a whole number)")
    heads = tuple(args.flce_mib_heads.split(",")) if args.flce_mib_heads else kernels_flce.FLCE_MIB_HEADS
    unknown = sorted(set(heads) - set(ALL_HEADS))
    if unknown:
        p.error(f"--flce-mib-heads: unknown {', '.join(unknown)}; choose from {', '.join(ALL_HEADS)}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    gemm_chunk = kernels_flce_profile.FLCE_GEMM_CHUNK
    if args.gemm_chunk:
        head, _, rows = args.gemm_chunk.partition(":")
        if head not in ALL_HEADS or not rows.isdigit() or int(rows) < 1:
            p.error(f"--gemm-chunk must be head:rows with a head of {', '.join(ALL_HEADS)}, got {args.gemm_chunk!r}")
        gemm_chunk = (head, int(rows))
    lowmem_configs = kernels_lowmem.LOWMEM_CONFIGS
    if args.lowmem_configs:
        from liger_compat.kernels._lowmem_triton import CONFIGS

        names = [c for c in CONFIGS if c != "interpret"]
        chosen = (names + list(LOWMEM_PAIRS) if args.lowmem_configs.strip() == "all"
                  else [x.strip() for x in args.lowmem_configs.split(",") if x.strip()])
        unknown = [x for x in chosen if not x.split("/")[0] in names or not x.split("/")[-1] in names or x.count("/") > 1]
        if unknown or not chosen:
            p.error(f"--lowmem-configs: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
                    f"choose from {', '.join(names)}, FORWARD/BACKWARD pairs of them, or 'all'")
        lowmem_configs = tuple(chosen)
    unknown = [x for x in args.sections.split(",") if x not in SECTIONS]
    if unknown:
        p.error(f"--sections: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(SECTIONS)}")
    C.OUT, C.NAME, C.ROUNDS = Path(args.out), args.name, args.rounds
    kernels_flce.FLCE_CHUNK_SETTINGS, kernels_flce.FLCE_MIB_HEADS = chunks, heads
    kernels_flce_profile.FLCE_GEMM_CHUNK = gemm_chunk
    kernels_lowmem.LOWMEM_CONFIGS = lowmem_configs
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to benchmark")
        return 1
    import triton

    from . import _results

    C.RESULTS["regenerate"] = _results.command("benchmarks.kernels", sys.argv[1:] if argv is None else argv)
    C.RESULTS["meta"].update(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           date=time.strftime("%Y-%m-%d %H:%M"))
    sections = args.sections.split(",")
    rerun = {"norm": "elementwise", "elementwise_sweep": "elementwise_sweep", "elem_profile": "elem_profile",
             "flce": "flce", "softcap": "flce_softcap", "acc": "flce_acc", "lowmem": "flce_lowmem",
             "flce_lowmem": "flce_lowmem",
             "variants": "flce_variants", "profile": "flce_profile", "flce_sweep": "flce_sweep",
             "flce_rows": "flce_rows", "flce_gemm": "flce_gemm", "flce_mib": "flce_mib", "logprob": "logprob"}
    for m in args.merge or []:
        old = json.loads(Path(m).read_text())
        skip = {rerun[x] for x in sections if x in rerun}
        kept = [dict(r, run=r.get("run", Path(m).name)) for r in old["rows"] if r.get("section") not in skip]
        C.RESULTS["rows"] += kept
        C.RESULTS["meta"].setdefault("merged_from", []).append(
            dict(file=Path(m).name, date=old["meta"].get("date"), matmul_tflops=old["meta"].get("matmul_tflops")))
    torch._dynamo.config.cache_size_limit = 64
    for name in sections:
        t0 = time.time()
        try:
            SECTIONS[name]()
        except Exception:
            traceback.print_exc()
        log(f"[section {name} took {time.time() - t0:.0f} s]")
        save()
        (C.OUT / f"{C.NAME}.md").write_text(report())
    if "ceilings" in sections:
        ceilings_end()
        save()
    md = report()
    (C.OUT / f"{C.NAME}.md").write_text(md)
    plots(C.OUT / f"{C.NAME}.json")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
