"""Put a real `liger-compat check --deep` report into docs/usage.md (between the sample-report markers).

    python tools/readme_sample.py [--device cpu]

Runs the installed CLI in a fresh interpreter and pastes its stdout verbatim, so the documented
sample is always output the code really produced.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

START, END = "<!-- sample-report:start -->", "<!-- sample-report:end -->"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--readme", default=str(Path(__file__).resolve().parents[1] / "docs" / "usage.md"))
    a = ap.parse_args(argv)
    p = subprocess.run([sys.executable, "-m", "liger_compat", "check", "--deep", "--device", a.device],
                       capture_output=True, text=True)
    if p.returncode not in (0, 1):
        print(p.stderr, file=sys.stderr)
        return p.returncode
    readme = Path(a.readme)
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme}: markers {START} / {END} not found")
    block = (f"{START}\n`liger-compat check --deep --device {a.device}` (exit code {p.returncode}):\n\n"
             f"```\n{p.stdout.rstrip()}\n```\n{END}")
    text = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    readme.write_text(text)
    print(f"wrote the sample report ({len(p.stdout.splitlines())} lines) into {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
