"""``liger-compat run``: liger_compat active in every Python process a command starts, for code
that cannot be edited to ``import liger_compat`` (``torchrun``, ``accelerate launch``,
``deepspeed``, ``trl sft`` ...), as ``opentelemetry-instrument`` does for tracing; and the opt-in
for environments whose command line cannot change (``liger-compat enable`` / ``disable``).

``run`` puts the directory of ``_boot/sitecustomize.py`` first on the command's ``PYTHONPATH``
and turns its options into the ``LIGER_COMPAT_*`` variables, then replaces itself with the
command (``os.execvpe``: the exit code and signals are the command's own). Every Python started
under it, at any depth, imports that ``sitecustomize`` at start-up, which imports liger_compat
and then runs the ``sitecustomize`` it shadows. A program that is not Python, or a Python
without liger_compat, is left alone; Python started with ``-S``, ``-E`` or ``-I`` reads no
``PYTHONPATH`` or no ``sitecustomize`` and runs natively.

``enable`` writes a ``.pth`` file into a site-packages directory whose one line runs the same
start-up file in every Python of that environment; ``disable`` removes it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Mapping, Sequence

from . import _config

#: the directory ``run`` puts first on ``PYTHONPATH``: it holds nothing but ``sitecustomize.py``
BOOT_DIR = Path(__file__).resolve().with_name("_boot")
BOOT_FILE = BOOT_DIR / "sitecustomize.py"
#: the file ``enable`` writes into site-packages
STARTUP_FILE = "liger_compat_startup.pth"
_STARTUP_HEADER = "# written by liger-compat enable; liger-compat disable removes it"

#: settings with a ``run`` option of their own: ``--flce-mode`` for ``LIGER_COMPAT_FLCE_MODE`` ...
#: (``LIGER_COMPAT_DISABLE`` has none: without liger_compat, run the command without ``run``)
_OPTION_SETTINGS = tuple(s for s in _config.SETTINGS if s.attr not in ("disabled", "kernels"))


def _option(spec: _config.Setting) -> str:
    return "--" + spec.env[len("LIGER_COMPAT_"):].lower().replace("_", "-")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options and the command of ``liger-compat run``."""
    names = ", ".join(_config.ALL_KERNELS)
    parser.add_argument("--kernels", metavar="NAMES",
                        help=f"kernels to use: all (default), none, or comma-separated names from {names} "
                             "(LIGER_COMPAT_KERNELS)")
    parser.add_argument("--disable", metavar="NAMES",
                        help="kernels to leave out of that selection, comma-separated")
    for spec in _OPTION_SETTINGS:
        parser.add_argument(_option(spec), metavar="VALUE", dest=spec.attr,
                            help=f"{spec.env}: {spec.allowed} (default: {spec.default or 'unset'})")
    parser.add_argument("run_command", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS ...]",
                        help="the command to run, e.g. -- torchrun --nproc_per_node 8 train.py")


def settings_env(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``LIGER_COMPAT_*`` variables ``run``'s options set, checked; a ``ValueError`` naming the
    option for a bad value."""
    env = os.environ if environ is None else environ
    out: dict[str, str] = {}
    if args.kernels is not None or args.disable is not None:
        base = args.kernels if args.kernels is not None else env.get("LIGER_COMPAT_KERNELS", "all")
        try:
            chosen = _config.parse_kernels(base)
        except ValueError as exc:
            raise ValueError(f"--kernels: {exc}" if args.kernels is not None
                             else f"LIGER_COMPAT_KERNELS: {exc}") from None
        if args.disable is not None:
            try:
                chosen -= _config.parse_kernels(args.disable)
            except ValueError as exc:
                raise ValueError(f"--disable: {exc}") from None
        out["LIGER_COMPAT_KERNELS"] = ",".join(k for k in _config.ALL_KERNELS if k in chosen) or "none"
    for spec in _OPTION_SETTINGS:
        value = getattr(args, spec.attr, None)
        if value is None:
            continue
        try:
            _config.check_value(spec.attr, value)
        except ValueError as exc:
            raise ValueError(f"{_option(spec)}: {exc}") from None
        out[spec.env] = value
    return out


def inherited_problems(environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``LIGER_COMPAT_*`` variables already set to a value liger_compat would ignore or
    refuse, in words."""
    env = os.environ if environ is None else environ
    problems = []
    for spec in _config.SETTINGS:
        raw = env.get(spec.env)
        if raw is None:
            continue
        try:
            _config.check_value(spec.attr, raw)
        except ValueError as exc:
            problems.append(f"{spec.env}={raw!r}: {exc}")
    return problems


def command_env(settings: Mapping[str, str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the command: ``environ`` with ``settings`` set and the start-up
    directory first on ``PYTHONPATH`` (once, however deep ``run`` is nested)."""
    env = dict(os.environ if environ is None else environ)
    env.update(settings)
    boot = str(BOOT_DIR)
    existing = env.get("PYTHONPATH", "")
    # an unset or empty PYTHONPATH adds no empty entry (which would put the working directory on sys.path)
    rest = [p for p in existing.split(os.pathsep) if p != boot] if existing else []
    env["PYTHONPATH"] = os.pathsep.join([boot, *rest])
    return env


def run(command: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``command`` with ``env``: replace this process with it (POSIX), else wait for it and
    return its exit code. Returns 127 / 126 (as a shell does) when it cannot be started."""
    if not command:
        raise ValueError("no command given: liger-compat run [OPTIONS] -- COMMAND [ARGS ...]")
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        if os.name == "posix":
            os.execvpe(command[0], list(command), dict(env))
        import subprocess

        return subprocess.call(list(command), env=dict(env))
    except FileNotFoundError:
        print(f"liger-compat run: command not found: {command[0]}", file=sys.stderr)
        return 127
    except PermissionError as exc:
        print(f"liger-compat run: cannot run {command[0]}: {exc}", file=sys.stderr)
        return 126


def main_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command = list(args.run_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.error("no command given: liger-compat run [OPTIONS] -- COMMAND [ARGS ...]")
    try:
        settings = settings_env(args)
    except ValueError as exc:
        parser.error(str(exc))
    for problem in inherited_problems({**os.environ, **settings}):
        print(f"liger-compat run: {problem}", file=sys.stderr)
    return run(command, command_env(settings))


# ---------------------------------------------------------------------------------------------
# the start-up file opt-in
# ---------------------------------------------------------------------------------------------

def default_site_dir() -> Path:
    """This Python's site-packages (``purelib``): where ``enable`` writes by default."""
    import sysconfig

    return Path(sysconfig.get_paths()["purelib"])


def startup_line(boot_file: Path = BOOT_FILE) -> str:
    """The ``.pth`` line: run ``boot_file`` as ``liger_compat_startup`` if it still exists (it is
    gone once liger_compat is uninstalled: the line then does nothing)."""
    return ("import os; p = %r; os.path.isfile(p) and exec(compile(open(p).read(), p, 'exec'), "
            "{'__name__': 'liger_compat_startup', '__file__': p})" % str(boot_file))


def enable(target: str | os.PathLike[str] | None = None) -> Path:
    """Write :data:`STARTUP_FILE` into ``target`` (default: :func:`default_site_dir`), so every
    Python that reads that directory's ``.pth`` files activates liger_compat at start-up.
    Returns the file written."""
    directory = Path(target) if target is not None else default_site_dir()
    if not directory.is_dir():
        raise ValueError(f"target {str(directory)!r} is not a directory")
    path = directory / STARTUP_FILE
    path.write_text(f"{_STARTUP_HEADER}\n{startup_line()}\n", encoding="utf-8")
    return path


def disable(target: str | os.PathLike[str] | None = None) -> Path | None:
    """Remove the file :func:`enable` wrote into ``target`` (default: :func:`default_site_dir`).
    Returns its path, or ``None`` when there was none. A file of that name that ``enable`` did
    not write raises ``ValueError`` and stays."""
    directory = Path(target) if target is not None else default_site_dir()
    path = directory / STARTUP_FILE
    if not path.is_file():
        return None
    if not path.read_text(encoding="utf-8", errors="replace").startswith(_STARTUP_HEADER):
        raise ValueError(f"{str(path)!r} was not written by liger-compat enable; left in place")
    path.unlink()
    return path


def startup_files() -> list[str]:
    """The start-up files of ``enable`` in the site-packages directories this Python reads."""
    import site

    dirs = list(getattr(site, "getsitepackages", lambda: [])())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    found = []
    for d in dict.fromkeys(dirs):
        path = os.path.join(d, STARTUP_FILE)
        if os.path.isfile(path):
            found.append(path)
    return found
