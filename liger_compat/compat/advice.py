"""What ``check()`` advises, derived from data only: the version grid and its recorded runs
(:mod:`liger_compat.matrix`), the known-issue registry's ``fixed_in`` releases, the known conflicts
with liger-kernel / unsloth / cut-cross-entropy, and the requirements those libraries declare in
their own package metadata.

Three kinds of advice, each a dict with ``kind``, ``subject``, ``text`` and the data it comes from:

* ``matrix``: the installed (transformers, trl) pair is not a verified cell: the nearest cells CI
  runs or with a passing run and the pins (``pins``, ``command``) that would put the user on one;
* ``torch``: the installed torch release is not one a cell verified: the nearest verified release
  and the pin that would put the user on it;
* ``known-issue``: an applying known issue, with the upstream release that fixes it (``fixed_in``),
  or, where no release does and it is not mitigated, the shims that would;
* ``conflict``: an installed liger-kernel / unsloth / cut-cross-entropy release known to conflict
  (or declaring requirements the installed releases miss), with the releases that coexist
  (``coexists``).

Builds nothing and imports no torch / transformers: package metadata only.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from . import known_issues, versions

#: libraries that patch or wrap the same models, whose declared requirements are checked
PATCHERS = ("liger-kernel", "unsloth", "cut-cross-entropy")
#: what their requirements are checked against
CHECKED = ("torch", "transformers", "trl", "peft", "accelerate", "datasets")


def installed_distributions(installed: dict[str, versions.PackageVersion] | None = None) -> dict[str, str | None]:
    """distribution name -> installed version (None when absent), for the packages advice looks at."""
    inst = installed or versions.all_installed()
    out: dict[str, str | None] = {}
    for name, pv in inst.items():
        dists = versions.TRACKED.get(name, (name,))
        out[dists[0]] = pv.raw
    return out


def _metadata_requires(dist: str) -> list[str] | None:
    import importlib.metadata as md

    try:
        return md.requires(dist)
    except md.PackageNotFoundError:
        return None


def declared_conflicts(installed: dict[str, str | None],
                       requires: Callable[[str], list[str] | None] = _metadata_requires) -> list[dict[str, Any]]:
    """Requirements that an installed liger-kernel / unsloth / cut-cross-entropy declares (its
    package metadata, extras left out) and the installed releases do not meet."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    out = []
    for dist in PATCHERS:
        have = installed.get(dist)
        if have is None:
            continue
        for line in requires(dist) or []:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            name = canonicalize_name(req.name)
            if name not in CHECKED or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
                continue
            got = installed.get(name)
            if got is None or not str(req.specifier) or versions.matches(got, req.specifier):
                continue
            out.append({"id": f"{dist}-requires-{name}", "package": dist, "installed": have,
                        "failure": f"{dist} {have} declares {name}{req.specifier}; {name} {got} is installed",
                        "coexists": [f"{name}{req.specifier}"],
                        "evidence": f"{dist} {have} package metadata (Requires-Dist)"})
    return out


def _join(items: Iterable[str]) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def matrix_advice(installed: dict[str, str | None], status: dict[str, Any], **grid_args: Any) -> list[dict[str, Any]]:
    """Advice for a pair that is not a verified cell (``status``: :func:`verification_status`)."""
    if status.get("state") == "verified" or installed.get("transformers") is None:
        return []
    from ..matrix.status import nearest_cells

    # a stale pair passed on older code: only a cell verified on this code is worth moving to
    cells = nearest_cells(installed, only_verified=status.get("state") == "stale", **grid_args)
    pair = f"transformers {installed.get('transformers')} + trl {installed.get('trl') or 'not installed'}"
    if not cells and status.get("state") == "stale":
        return []  # the matrix summary already says that its own cell passed on other code
    if not cells:
        return [{"kind": "matrix", "subject": pair, "cells": [],
                 "text": f"{pair}: no cell of the version grid has a passing recorded run to point to"}]
    parts = []
    for c in cells:
        how = c["command"] or "the releases already installed"
        parts.append(f"{c['cell']} ({c['state']}; {how})")
    return [{"kind": "matrix", "subject": pair, "cells": cells,
             "text": f"{pair} is {status.get('state', 'not a cell')}; nearest cells with a passing run: " + "; ".join(parts)}]


def torch_advice(status: dict[str, Any]) -> list[dict[str, Any]]:
    """Advice when the installed torch release is not one a cell verified (``status["torch"]``:
    :func:`liger_compat.matrix.status.torch_status`)."""
    ts = status.get("torch")
    if not ts or ts.get("verified") or ts.get("release") is None:
        return []
    subject = f"torch {ts['installed']}"
    verified = [t for t, names in ts["releases"].items() if names]
    if not ts.get("nearest"):
        return [{"kind": "torch", "subject": subject, "releases": verified, "nearest": None, "command": "",
                 "text": f"{subject}: no cell of the version grid has a passing run of this code on any torch release"}]
    command = f"pip install torch=={ts['nearest']}"
    return [{"kind": "torch", "subject": subject, "releases": verified, "nearest": ts["nearest"], "command": command,
             "text": f"{subject} is not a verified torch release (verified: {', '.join(verified)}); "
                     f"nearest: {ts['nearest']} ({command})"}]


def issue_advice(statuses: Iterable[Any]) -> list[dict[str, Any]]:
    """Advice for each applying known issue (``statuses``: objects with ``id``, ``applies``, ``mitigated``)."""
    out = []
    for st in statuses:
        if not st.applies:
            continue
        issue = known_issues.by_id(st.id)
        state = "mitigated by liger_compat" if st.mitigated else "NOT mitigated"
        if issue.fixed_in:
            reqs = [f"{pkg}>={ver}" for pkg, ver in issue.fixed_in.items()]
            text = f"{issue.id} ({state}): fixed upstream in {_join(f'{p} {v}' for p, v in issue.fixed_in.items())}"
            out.append({"kind": "known-issue", "subject": issue.id, "fixed_in": dict(issue.fixed_in),
                        "requirements": reqs, "command": "pip install " + " ".join(f"'{r}'" for r in reqs),
                        "text": f"{text} (pip install {' '.join(repr(r) for r in reqs)})"})
        elif not st.mitigated:  # (a mitigated issue without an upstream fix needs nothing from the user)
            out.append({"kind": "known-issue", "subject": issue.id, "fixed_in": {}, "requirements": [],
                        "command": "", "text": f"{issue.id} ({state}): no upstream release fixes it; "
                                               f"mitigation: {', '.join(issue.mitigated_by)}"})
    return out


def conflict_advice(installed: dict[str, str | None],
                    requires: Callable[[str], list[str] | None] = _metadata_requires) -> list[dict[str, Any]]:
    """Advice for each known or declared conflict of the installed liger-kernel / unsloth / cut-cross-entropy."""
    found = [{**c.to_dict(), "installed": installed.get(c.package)}
             for c in known_issues.KNOWN_CONFLICTS if c.applies(installed)]
    found += declared_conflicts(installed, requires)
    return [{"kind": "conflict", "subject": f"{c['package']} {c['installed']}", "id": c["id"],
             "coexists": list(c["coexists"]), "failure": c["failure"], "evidence": c["evidence"],
             "text": f"{c['package']} {c['installed']}: {c['failure']}; coexists with {_join(c['coexists'])}"}
            for c in found]


def advise(installed: dict[str, str | None], status: dict[str, Any], issue_statuses: Iterable[Any],
           requires: Callable[[str], list[str] | None] = _metadata_requires, **grid_args: Any) -> list[dict[str, Any]]:
    """Every piece of advice for these installed releases, matrix first."""
    return (matrix_advice(installed, status, **grid_args) + torch_advice(status) + issue_advice(issue_statuses)
            + conflict_advice(installed, requires))
