"""The command line (``liger-compat`` or ``python -m liger_compat``): ``check [--json] [--deep] [--verbose]``;
``run [OPTIONS] -- COMMAND``, ``enable`` and ``disable`` (:mod:`liger_compat.launcher`).

Exit codes of ``check``: 0 all is well, 1 an unmitigated known issue applies or a scenario failed,
2 usage error. ``run`` exits with the command's exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: libraries the CLI imports (when installed) so that their shims apply before reporting
_TARGETS = ("transformers", "trl")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="liger-compat", description="liger_compat diagnostics and launcher")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    c = sub.add_parser("check", help="report versions, shims, known issues and matrix status")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.add_argument("--deep", action="store_true",
                   help="also run the scenario smoke tests on a tiny random model")
    c.add_argument("--device", default=None, help="device for --deep (default: cuda if available, else cpu)")
    c.add_argument("-v", "--verbose", action="store_true",
                   help="print every shim, model family, setting and scenario as a row (default: one screen, "
                        "counted by state, with a row for each that needs attention)")
    c.add_argument("--no-import", action="store_true",
                   help="do not import transformers/trl first (shims then show as waiting)")
    from . import launcher

    r = sub.add_parser("run", usage="liger-compat run [OPTIONS] -- COMMAND [ARGS ...]", help="run a command with liger_compat active in every Python process it starts",
                       description="Run COMMAND with liger_compat active in every Python process it starts, "
                                   "children included (torchrun, accelerate, deepspeed workers, trl / axolotl "
                                   "command lines), without editing any script. The options set the "
                                   "LIGER_COMPAT_* variables; the exit code is the command's.",
                       epilog="example: liger-compat run --kernels fused_linear_cross_entropy,rms_norm -- "
                              "torchrun --nproc_per_node 8 train.py")
    launcher.add_run_arguments(r)
    r.set_defaults(subparser=r)
    target_help = "site-packages directory (default: this Python's, %s)"
    e = sub.add_parser("enable", help="activate liger_compat in every Python of this environment at start-up "
                                      "(writes a .pth file; undone by disable)")
    e.add_argument("--target", metavar="DIR", default=None, help=target_help % launcher.STARTUP_FILE)
    d = sub.add_parser("disable", help="remove the start-up file that enable wrote")
    d.add_argument("--target", metavar="DIR", default=None, help=target_help % launcher.STARTUP_FILE)
    return p


def _progress(i: int, n: int, sc) -> None:
    print(f"[{i + 1}/{n}] {sc.id}: {sc.title} ...", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)  # exits 2 on a usage error
    if args.command in ("run", "enable", "disable"):
        return _launcher_command(args, parser)
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
    report = liger_compat.check(deep=args.deep, device=args.device, quiet=args.json, verbose=args.verbose,
                                progress=None if args.json else _progress)  # prints the table itself
    if args.json:
        print(report.to_json())
    return report.exit_code


def _launcher_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from . import launcher

    if args.command == "run":
        return launcher.main_run(args, args.subparser)
    try:
        if args.command == "enable":
            path = launcher.enable(args.target)
            print(f"liger-compat: every Python reading {path.parent} now activates liger_compat at start-up "
                  f"({path.name}); liger-compat disable{' --target ' + args.target if args.target else ''} undoes it")
        else:
            removed = launcher.disable(args.target)
            print(f"liger-compat: removed {removed}" if removed else
                  "liger-compat: no start-up file there; nothing to do")
    except (ValueError, OSError) as exc:
        print(f"liger-compat {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
