"""Start-up cost of ``liger-compat run`` in each Python process: ``python -c pass`` natively, under the
launcher's environment, and with ``import liger_compat``; plus ``-X importtime``'s figure for the
start-up ``sitecustomize`` (liger_compat's import included) and for the ``sitecustomize`` file alone.

    python -m benchmarks.launcher_startup [--runs 30]

Wall times are the minimum over the runs, the three cases interleaved (the machine's noise only adds); modules load from cached
bytecode, as in an installed package (a first run writes it). CPU only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from liger_compat import launcher  # noqa: E402


def _walls(cases: dict[str, tuple[list[str], dict[str, str]]], runs: int) -> dict[str, float]:
    """Best wall milliseconds of each case, the cases interleaved so that load changes hit them alike."""
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(runs):
        for name, (cmd, env) in cases.items():
            t0 = time.perf_counter()
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: t * 1e3 for name, t in best.items()}


def _importtime(env: dict[str, str], runs: int) -> tuple[float, float]:
    """Best cumulative microseconds of ``sitecustomize`` and of ``liger_compat`` under ``env``."""
    site_us = lc_us = float("inf")
    for _ in range(runs):
        err = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], env=env, check=True,
                             capture_output=True, text=True).stderr
        for line in err.splitlines():
            parts = [p.strip() for p in line.split("|")]
            if len(parts) == 3 and parts[2] in ("sitecustomize", "liger_compat"):
                us = float(parts[1])
                if parts[2] == "sitecustomize":
                    site_us = min(site_us, us)
                else:
                    lc_us = min(lc_us, us)
    return site_us / 1e3, lc_us / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args()
    base = {k: v for k, v in os.environ.items() if not k.startswith("LIGER_COMPAT_")}
    base["PYTHONPATH"] = str(ROOT)
    # as installed: from cached bytecode (written by a first run here)
    base.pop("PYTHONDONTWRITEBYTECODE", None)
    launched = launcher.command_env({}, base)
    subprocess.run([sys.executable, "-c", "import liger_compat"], env=launched, check=True)
    walls = _walls({"native": ([sys.executable, "-c", "pass"], base),
                    "under": ([sys.executable, "-c", "pass"], launched),
                    "import": ([sys.executable, "-c", "import liger_compat"], base)}, args.runs)
    native, under, plain_import = walls["native"], walls["under"], walls["import"]
    site_ms, lc_ms = _importtime(launched, args.runs)
    print(f"python -c pass, native:                    {native:7.1f} ms")
    print(f"python -c pass, under liger-compat run:    {under:7.1f} ms  (+{under - native:.1f} ms)")
    print(f"python -c 'import liger_compat', native:   {plain_import:7.1f} ms  (+{plain_import - native:.1f} ms)")
    print(f"-X importtime: sitecustomize {site_ms:.1f} ms, of which import liger_compat {lc_ms:.1f} ms "
          f"(the start-up file itself: {site_ms - lc_ms:.1f} ms)")


if __name__ == "__main__":
    main()
