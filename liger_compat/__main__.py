"""The command line: ``python -m liger_compat check [--json] [--deep]`` (also ``liger-compat``).

Exit codes: 0 all is well, 1 an unmitigated known issue applies or a scenario failed,
2 usage error.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: libraries the CLI imports (when installed) so that their shims apply before reporting
_TARGETS = ("transformers", "trl")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="liger-compat", description="liger_compat diagnostics")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    c = sub.add_parser("check", help="report versions, shims, known issues and matrix status")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.add_argument("--deep", action="store_true",
                   help="also run the scenario smoke tests on a tiny random model")
    c.add_argument("--device", default=None, help="device for --deep (default: cuda if available, else cpu)")
    c.add_argument("--no-import", action="store_true",
                   help="do not import transformers/trl first (shims then show as waiting)")
    return p


def _progress(i: int, n: int, sc) -> None:
    print(f"[{i + 1}/{n}] {sc.id}: {sc.title} ...", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)  # exits 2 on a usage error
    if args.command != "check":
        parser.print_help(sys.stderr)
        return 2
    import liger_compat
    from liger_compat.compat import versions

    if args.device is not None and args.device.split(":")[0] not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda[:N], not {args.device!r}")
    if not args.no_import:
        for name in _TARGETS:
            if versions.installed(name).installed:
                try:
                    importlib.import_module(name)
                except Exception as exc:  # report, do not crash: check must always answer
                    print(f"liger-compat: importing {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    report = liger_compat.check(deep=args.deep, device=args.device, quiet=args.json,
                                progress=None if args.json else _progress)  # prints the table itself
    if args.json:
        print(report.to_json())
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
