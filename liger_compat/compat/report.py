"""The ``check()`` report: what is installed, what is patched, what is known to break.

The report is plain data (``to_dict()`` / ``to_json()``) with a printable text form.
Building it patches nothing.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any

from .. import _config
from . import device as _device
from . import distributed as _distributed
from . import known_issues, scenarios, versions


@dataclass
class IssueStatus:
    id: str
    title: str
    applies: bool
    mitigated: bool
    detail: str

    @property
    def unmitigated(self) -> bool:
        return self.applies and not self.mitigated

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "title": self.title, "applies": self.applies,
                "mitigated": self.mitigated, "detail": self.detail}


@dataclass(repr=False)
class Report:
    liger_compat_version: str
    python: str
    versions: dict[str, str | None]
    device: dict[str, Any]
    settings: dict[str, Any]
    shims: list[dict[str, Any]]
    issues: list[IssueStatus]
    families: dict[str, str]
    matrix: dict[str, Any]
    conflicts: list[dict[str, str]]
    load_errors: list[str] = field(default_factory=list)
    scenarios: list[scenarios.ScenarioResult] | None = None
    distributed: dict[str, Any] | None = None  # compat.distributed.detect(): launcher, engine, warnings
    heads: dict[str, str] = field(default_factory=dict)  # trl trainer -> the head that computes its loss
    advice: list[dict[str, Any]] = field(default_factory=list)  # compat.advice.advise()
    activation: dict[str, Any] = field(default_factory=dict)  # how and in which process liger_compat was activated

    # -- verdict ----------------------------------------------------------------------------
    @property
    def unmitigated(self) -> list[IssueStatus]:
        """The known issues that apply and are not mitigated, while liger_compat is on: turned off
        (LIGER_COMPAT_DISABLE=1, ``configure(enabled=False)``) it patches nothing, by choice, and
        the report says so instead of failing."""
        if self.settings.get("disabled"):
            return []
        return [i for i in self.issues if i.unmitigated]

    @property
    def failed_scenarios(self) -> list[scenarios.ScenarioResult]:
        return [s for s in (self.scenarios or []) if s.outcome == "failed"]

    @property
    def ok(self) -> bool:
        return not self.unmitigated and not self.failed_scenarios

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    # -- output -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "liger_compat": self.liger_compat_version,
            "python": self.python,
            "versions": self.versions,
            "device": self.device,
            "settings": self.settings,
            "shims": self.shims,
            "known_issues": [i.to_dict() for i in self.issues],
            "families": self.families,
            "matrix": self.matrix,
            "conflicts": self.conflicts,
            "load_errors": self.load_errors,
            "scenarios": None if self.scenarios is None else [s.to_dict() for s in self.scenarios],
            "distributed": self.distributed,
            "heads": self.heads,
            "advice": self.advice,
            "activation": self.activation,
            "ok": self.ok,
        }

    def to_json(self, **kw: Any) -> str:
        kw.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **kw)

    def __str__(self) -> str:
        return format_text(self)

    def __repr__(self) -> str:
        # short: check() has printed the table already, and an interactive prompt echoes the result
        return f"<liger_compat check report: {verdict(self)}; print(report) for the table>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython
        p.text(repr(self))

    def print(self, file: Any = None, verbose: bool = False) -> None:
        """The text report (:func:`format_text`: one screen; ``verbose``: every row)."""
        print(format_text(self, verbose=verbose), file=file or sys.stdout)


#: the width the text report wraps long free text and summary lines at
WIDTH = 120


def _cell_lines(text: Any, width: int) -> list[str]:
    """A table cell as lines of at most ``width`` characters: wrapped at spaces, never cut."""
    text = str(text)
    if len(text) <= width:
        return [text]
    return textwrap.wrap(text, width, break_on_hyphens=False) or [text]


def _table(headers: list[str], rows: list[list[str]], max_width: int = 60) -> list[str]:
    """A text table; a cell longer than ``max_width`` goes on over continuation lines (the other
    columns blank there), so nothing is cut."""
    cells = [[_cell_lines(c, max_width) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in cells:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], *(len(x) for x in c))
    line = lambda parts: "  " + "  ".join(c.ljust(w) for c, w in zip(parts, widths)).rstrip()
    out = [line(headers), "  " + "  ".join("-" * w for w in widths)]
    for r in cells:
        for k in range(max(len(c) for c in r)):
            out.append(line([c[k] if k < len(c) else "" for c in r]))
    return out


def _wrap(text: str, indent: str = "  ", hang: str = "    ") -> list[str]:
    """``text`` as lines of at most :data:`WIDTH` characters, continuation lines indented ``hang``."""
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=hang, break_on_hyphens=False) or [indent]


def _counted(kinds: dict[str, list[str]], names_of: tuple[str, ...] = ()) -> str:
    """``"13 applied, 2 not needed"``; the kinds in ``names_of`` also name their members."""
    parts = []
    for kind, members in kinds.items():
        part = f"{len(members)} {kind}"
        if kind in names_of:
            part += f" ({', '.join(members)})"
        parts.append(part)
    return ", ".join(parts)


def _off_line(r: Report) -> str | None:
    """The report's statement that everything is off, or None while liger_compat is active."""
    s = r.settings
    if not s.get("disabled"):
        return None
    return _config.off_reason(s.get("source", {}), word="OFF")


#: shim states that need no row of their own in the summary (counted only)
_QUIET_SHIM_STATES = ("applied", "waiting", "not needed", "disabled", "reverted")


def _shim_needs_attention(x: dict[str, Any]) -> bool:
    reason = x.get("reason") or ""
    return x["state"] not in _QUIET_SHIM_STATES or "failed" in reason or "could not remove" in reason


#: a family whose fused forward needs a newer transformers (compat/families.py words it so)
_VERSION_GATED = re.compile(r"native forward \(the fused forward matches the native one from transformers ([^;]+); not on ")


def _family_kind(state: str) -> str:
    """What a family's state line amounts to, for the summary; ``""``: it needs a row of its own
    (failed, conflicting, replaced, native for a reason)."""
    if any(w in state for w in ("failed", "conflict", "replaced", "error")):
        return ""
    if state.startswith("fused forward"):
        return "patched"
    if state.startswith("waiting"):
        return "waiting (patched when their modeling module is imported)"
    if state.startswith("not in transformers"):
        return "not in this transformers"
    if state == "native forward (family not in the table)":
        return "other causal LMs (not in the family table: native forward)"
    if state.startswith("native forward (") and state.endswith(" not selected)"):  # LIGER_COMPAT_KERNELS
        return state
    gated = _VERSION_GATED.match(state)
    if gated:  # the fused forward needs a newer transformers: expected, not a problem
        return f"native forward here, fused from transformers {gated.group(1)}"
    if state.startswith("off"):
        return "off"
    if state == "transformers not installed":
        return "transformers not installed"
    return ""


def format_text(r: Report, verbose: bool = False) -> str:
    """The report as text. By default it fits a screen: shims, model families, known issues, trl's
    heads and the scenarios are counted by state on one line each, with a row for each one that
    needs attention (failed, conflicting, not mitigated); ``verbose`` prints every row. Long cells
    are wrapped, never cut."""
    out = [f"liger_compat {r.liger_compat_version}  (python {r.python})"]
    off = _off_line(r)
    if off:
        out.append(off)
    out.append("")
    out.append("Installed")
    if verbose:
        out += _table(["package", "version"], [[k, v or "not installed"] for k, v in r.versions.items()])
    else:
        have = [f"{k} {v}" for k, v in r.versions.items() if v]
        missing = [k for k, v in r.versions.items() if not v]
        out += _wrap(", ".join(have)) if have else []
        if missing:
            out += _wrap("not installed: " + ", ".join(missing))
    d = r.device
    out += ["", "Device"]
    if d.get("cuda_available"):
        out.append(f"  GPU: {d.get('gpu_name')} (capability {d.get('capability')}, {d.get('device_count')} visible)")
    else:
        out.append("  GPU: none")
    out += _wrap(f"kernels run on: {d.get('kernel_backend')}" + (f"  ({d['reason']})" if d.get("reason") else ""))
    s = r.settings
    out.append(f"  liger_compat: {'DISABLED' if s['disabled'] else 'active'}; kernels: {', '.join(s['kernels']) or 'none'}")
    tuning = s.get("tuning") or {}
    if tuning:
        out += _wrap("tuning: " + ", ".join(f"{k} {v}" for k, v in tuning.items()))
    if r.activation and verbose:
        out += ["", "Activation"] + _activation_lines(r.activation)
    elif r.activation:
        out += _wrap("activation: " + "; ".join(x.strip() for x in _activation_lines(r.activation)))
    variables = s.get("variables") or []
    if variables:
        out += ["", "Settings"]
        shown = variables if verbose else [x for x in variables if x["source"] != "default"]
        if shown:
            out += _table(["variable", "value", "source"], [[x["variable"], x["value"], x["source"]] for x in shown])
        if len(shown) < len(variables):
            rest = len(variables) - len(shown)
            out.append(f"  {'the other ' if shown else ''}{rest} variable{'s' if rest != 1 else ''} at "
                       f"{'their defaults' if rest != 1 else 'its default'} (--verbose lists them)")
    out += ["", "Shims"]
    if r.shims and verbose:
        out += _table(["shim", "state", "fixes", "reason"],
                      [[x["id"], x["state"], ",".join(x["fixes"]) or "-", x["reason"] or "-"] for x in r.shims])
    elif r.shims:
        kinds: dict[str, list[str]] = {}
        for x in r.shims:
            kinds.setdefault(x["state"], []).append(x["id"])
        out += _wrap(f"{len(r.shims)} shims: {_counted(kinds)}")
        attention = [x for x in r.shims if _shim_needs_attention(x)]
        if attention:
            out += _table(["shim", "state", "fixes", "reason"],
                          [[x["id"], x["state"], ",".join(x["fixes"]) or "-", x["reason"] or "-"] for x in attention])
    else:
        out.append("  (none registered)")
    for e in r.load_errors:
        out.append(f"  shim module failed to load: {e}")
    out += ["", "Known issues"]

    def issue_state(i: IssueStatus) -> str:
        if not i.applies:
            return "-"
        if i.mitigated:
            return "mitigated"
        return "off" if off else "NOT MITIGATED"

    issue_rows = [[i.id, "yes" if i.applies else "no", issue_state(i), i.title] for i in r.issues]
    if verbose:
        out += _table(["id", "applies here", "state", "issue"], issue_rows)
    else:
        mitigated = [i.id for i in r.issues if i.applies and i.mitigated]
        elsewhere = [i.id for i in r.issues if not i.applies]
        if mitigated:
            out += _wrap(f"{', '.join(mitigated)}: apply here, mitigated")
        left = [row for row, i in zip(issue_rows, r.issues) if i.applies and not i.mitigated]
        if left and off:
            out += _wrap(f"{', '.join(row[0] for row in left)}: apply here, not mitigated while liger_compat is off")
        elif left:
            out += _table(["id", "applies here", "state", "issue"], left)
        if elsewhere:
            out += _wrap(f"{', '.join(elsewhere)}: not on these versions")
    if not off:
        for i in r.issues:
            if i.unmitigated:
                out += _wrap(f"! {i.id}: {i.detail}")
    if r.families:
        out += ["", "Model families"]
        if verbose:
            out += _table(["family", "state"], [[k, v] for k, v in r.families.items()])
        else:
            kinds = {}
            for name, state in r.families.items():
                kinds.setdefault(_family_kind(state), []).append(name)
            rows = kinds.pop("", [])
            named = ("patched",) + tuple(k for k in kinds if k.startswith("native forward here"))
            out += _wrap(f"{len(r.families)} families: " + _counted(kinds, names_of=named))
            if rows:
                out += _table(["family", "state"], [[k, r.families[k]] for k in rows], max_width=WIDTH - 22)
    if r.heads:
        out += ["", "LM heads (what computes each trl trainer's loss)"]
        if verbose:
            out += _table(["trainer", "head"], [[k, v] for k, v in r.heads.items()], max_width=110)
        else:
            by_head: dict[str, list[str]] = {}
            for trainer, head in r.heads.items():
                by_head.setdefault(head, []).append(trainer)
            for head, trainers in by_head.items():
                out += _wrap(f"{', '.join(trainers)}: {head}")
    if r.distributed is not None:
        out += ["", "Distributed", f"  {r.distributed.get('summary', '')}"]
        if r.distributed.get("distributed"):
            out.append(f"  fused LM head through the sharding engine: {r.distributed.get('head_gather')}")
        out += [f"  ! {w['code']} ({w['level']}): {w['message']}" for w in r.distributed.get("warnings", [])]
    out += ["", "Version matrix"]
    m = r.matrix
    out.append(f"  {m.get('summary', 'unavailable')}")
    if r.conflicts:
        out += ["", "Conflicts"]
        out += _table(["target", "patched by", "detail"], [[c["what"], c["by"], c["detail"]] for c in r.conflicts])
    if r.advice:
        out += ["", "Advice"]
        out += [f"  - {a['kind']}: {a['text']}" for a in r.advice]
    if r.scenarios is not None:
        out += ["", "Scenarios (--deep)"]
        shown = r.scenarios if verbose else [x for x in r.scenarios if x.outcome != "passed"]
        if r.scenarios and not verbose:
            kinds = {}
            for x in r.scenarios:
                kinds.setdefault(x.outcome, []).append(x.id)
            seconds = sum(x.seconds for x in r.scenarios)
            out += _wrap(f"{len(r.scenarios)} scenarios in {seconds:.1f} s: {_counted(kinds, names_of=('passed',))}")
        if shown:
            out += _table(["scenario", "issue", "outcome", "seconds", "detail"],
                          [[x.id, x.issue or "-", x.outcome, f"{x.seconds:.2f}", x.detail or "-"] for x in shown],
                          max_width=80)
        elif not r.scenarios:
            out.append("  (none registered)")
    out += ["", "Verdict: " + verdict(r)]
    return "\n".join(out)


def _activation_lines(a: dict[str, Any]) -> list[str]:
    if "error" in a:
        return [f"  unknown: {a['error']}"]
    proc = a["process"]
    line = f"  by {a['by']}, in pid {a['pid']}"
    if proc["pid"] != a["pid"]:
        line += f"; this process (pid {proc['pid']}) inherited it from there"
    out = [line]
    if a["ranks"]:
        out.append("  rank variables: " + ", ".join(f"{k}={v}" for k, v in a["ranks"].items()))
    files = a.get("startup_files") or []
    out.append("  start-up file (liger-compat enable): " + (", ".join(files) if files else "none"))
    return out


def _activation() -> dict[str, Any]:
    try:
        from .. import _activation as activation, launcher

        return {**activation.describe(), "startup_files": launcher.startup_files()}
    except Exception as exc:  # the report always answers
        return {"error": f"{type(exc).__name__}: {exc}"}


def verdict(r: Report) -> str:
    if r.ok and r.settings.get("disabled"):
        return "OK (liger_compat is off: native behaviour everywhere)"
    return "OK" if r.ok else "PROBLEMS: " + ", ".join([f"{i.id} not mitigated" for i in r.unmitigated] +
                                                       [f"scenario {x.id} failed" for x in r.failed_scenarios])


def _issue_status(issue: known_issues.KnownIssue, shim_states: dict[str, str],
                  installed: dict[str, versions.PackageVersion], cuda: bool | None = None) -> IssueStatus:
    applies = issue.applies(installed, cuda=cuda)
    states = {sid: shim_states.get(sid, "not registered") for sid in issue.mitigated_by}
    # "waiting": the shim applies when its trigger module is imported; "not needed": its
    # feature probe found the installed library already behaves
    mitigated = bool(states) and all(st in ("applied", "waiting", "not needed") for st in states.values())
    detail = "; ".join(f"{sid}: {st}" for sid, st in states.items())
    if applies and not mitigated:
        detail = f"affects {', '.join(f'{k} {installed[k].raw}' for k in issue.affects if k in installed)}; {detail}"
    return IssueStatus(issue.id, issue.title, applies, mitigated, detail)


def _families() -> dict[str, str]:
    """Each family's patch state, as the model shims describe it."""
    try:
        from ..shims._family_states import family_states
    except ImportError:
        return {}
    try:
        return dict(family_states())
    except Exception as exc:
        return {"(error)": f"{type(exc).__name__}: {exc}"}


def _matrix(installed: dict[str, versions.PackageVersion]) -> dict[str, Any]:
    try:
        from ..matrix import verification_status
    except ImportError:
        return {"summary": "no version matrix in this build"}
    try:
        from .advice import installed_distributions

        torch = installed.get("torch")
        return dict(verification_status(installed["transformers"].raw, installed["trl"].raw,
                                        extras=installed_distributions(installed),
                                        torch=torch.raw if torch is not None else None))
    except Exception as exc:
        return {"summary": f"matrix lookup failed: {type(exc).__name__}: {exc}"}


def build(deep: bool = False, ctx: scenarios.Context | None = None, progress: Any = None) -> Report:
    from .. import __version__
    from ..shims import REGISTRY, load_all

    load_all()
    installed = versions.all_installed()
    scen = scenarios.run_all(ctx, progress) if deep else None
    shim_list = [s.status() for s in REGISTRY.shims()]
    shim_states = {s["id"]: s["state"] for s in shim_list}
    st = _config.settings
    dev = _device.detect()
    issues = [_issue_status(i, shim_states, installed, cuda=dev.cuda_available) for i in known_issues.KNOWN_ISSUES]
    matrix = _matrix(installed)
    return Report(
        liger_compat_version=__version__,
        python=sys.version.split()[0],
        versions={k: v.raw for k, v in installed.items()},
        device=dev.to_dict(),
        settings={"disabled": st.disabled, "kernels": sorted(st.kernels), "debug": st.debug, "source": dict(st.source),
                  "tuning": _tuning(), "variables": _config.describe()},
        shims=shim_list,
        issues=issues,
        families=_families(),
        matrix=matrix,
        conflicts=[c.to_dict() for c in REGISTRY.conflicts],
        load_errors=list(REGISTRY.load_errors),
        scenarios=scen,
        distributed=_distributed_section(),
        heads=_heads(),
        advice=_advice(installed, matrix, issues),
        activation=_activation(),
    )


def _heads() -> dict[str, str]:
    try:
        from ..shims import trl_fused_lm_head
    except ImportError:
        return {}
    try:
        return trl_fused_lm_head.trainer_heads()
    except Exception as exc:
        return {"(error)": f"{type(exc).__name__}: {exc}"}


def _advice(installed: dict[str, versions.PackageVersion], matrix: dict[str, Any],
            issues: list[IssueStatus]) -> list[dict[str, Any]]:
    try:
        from . import advice

        return advice.advise(advice.installed_distributions(installed), matrix, issues)
    except Exception as exc:  # advice never breaks the report
        return [{"kind": "error", "subject": "advice", "text": f"advice failed: {type(exc).__name__}: {exc}"}]


def _tuning() -> dict[str, str]:
    """The kernels' speed / memory settings in effect (the environment at import, or what a
    script set since), in words."""
    out: dict[str, str] = {}
    try:
        from ..kernels import loss

        try:
            mib = _config.flce_chunk_mib()
            out["LIGER_COMPAT_FLCE_CHUNK_MB"] = (
                f"{mib:g} MiB" if mib is not None
                else f"unset ({loss.FLCE_CHUNK_ROWS_DEFAULT} rows, at most {loss.FLCE_CHUNK_MB_MAX_DEFAULT} MiB)")
        except ValueError as exc:
            out["LIGER_COMPAT_FLCE_CHUNK_MB"] = f"invalid ({exc})"
    except Exception as exc:  # pragma: no cover - a build without the kernels
        out["error"] = f"{type(exc).__name__}: {exc}"
    for name, read in (("LIGER_COMPAT_FLCE_LOGITS", _config.flce_logits), ("LIGER_COMPAT_FLCE_MODE", _config.flce_mode),
                       ("LIGER_COMPAT_MLP_RECOMPUTE", lambda: "+".join(sorted(_config.mlp_recompute_parts())) or "off")):
        try:
            out[name] = read()
        except ValueError as exc:
            out[name] = f"invalid ({exc})"
    return out


def _distributed_section() -> dict[str, Any]:
    try:
        info = _distributed.detect(device_count=_device.detect().device_count)
        return {**info.to_dict(), "summary": info.summary()}
    except Exception as exc:
        return {"summary": f"distributed detection failed: {type(exc).__name__}: {exc}", "warnings": []}
