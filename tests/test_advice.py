"""check() advises, from the grid, its recorded runs, the known-issue data and package metadata:
nearest verified cells with their pins, the upstream release fixing an applying issue, and the
releases that coexist with a conflicting liger-kernel / unsloth / cut-cross-entropy."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from liger_compat import matrix
from liger_compat.compat import advice, known_issues, versions
from liger_compat.matrix.status import distance, nearest_cells, verification_status

GRID = matrix.load_grid()
NOW = {"package": "a" * 64}
OTHER = {"package": "b" * 64}


def _result(prints=NOW, failed=0):
    return {"passed": 10, "failed": failed, "skipped": 1, "errors": 0, "date": "2026-11-20T10:00:00",
            "source": {"commit": "abc1234" + "0" * 33, "dirty": False, "fingerprint": dict(prints)}}


def _all_verified(**override):
    cells = {c.name: _result() for c in GRID.pinned}
    cells.update(override)
    return {"schema": 1, "cells": {k: v for k, v in cells.items() if v is not None}}


def _installed(cell, transformers=None, trl=None, extras=True):
    out = {"transformers": transformers or cell.transformers, "trl": trl or cell.trl,
           "accelerate": cell.accelerate, "datasets": cell.datasets, "torch": cell.torch}
    if extras:
        out.update(dict(cell.extras))
    return out


def _neighbour(cell):
    """A transformers patch release next to the cell's that is no cell of the grid."""
    v = Version(cell.transformers)
    t = f"{v.major}.{v.minor}.{v.micro + 1}"
    assert GRID.find(t, cell.trl, dict(cell.extras)) is None
    return t


def _advise_matrix(inst, verified):
    st = verification_status(inst["transformers"], inst["trl"], GRID, verified, current=NOW, extras=inst,
                             torch=inst.get("torch"))
    return st, advice.matrix_advice(inst, st, grid=GRID, verified=verified, current=NOW)


def _apply(inst, pins):
    return {**inst, **pins}


@pytest.mark.parametrize("cell", GRID.pinned, ids=lambda c: c.name)
def test_a_neighbour_of_each_cell_is_pointed_to_that_cell_with_its_pins(cell):
    v = _all_verified()
    inst = _installed(cell, transformers=_neighbour(cell))
    st, adv = _advise_matrix(inst, v)
    assert st["verified"] is False and st["cell"] is None
    [a] = adv
    first = a["cells"][0]
    assert first["cell"] == cell.name and first["state"] == "verified"
    assert first["pins"] == {"transformers": cell.transformers}  # only what differs
    assert first["command"] == f"pip install transformers=={cell.transformers}"
    assert cell.name in a["text"] and first["command"] in a["text"]
    # the pins put the user on the cell: it is then found and verified
    moved = _apply(inst, first["pins"])
    assert GRID.find(moved["transformers"], moved["trl"], moved, moved["torch"]) is cell
    st2 = verification_status(moved["transformers"], moved["trl"], GRID, v, current=NOW, extras=moved,
                              torch=moved["torch"])
    assert st2["verified"] and advice.matrix_advice(moved, st2, grid=GRID, verified=v, current=NOW) == []


@pytest.mark.parametrize("cell", GRID.pinned, ids=lambda c: c.name)
def test_without_a_run_of_the_cell_the_advice_names_the_nearest_other_verified_cell(cell):
    v = _all_verified(**{cell.name: None})
    inst = _installed(cell, transformers=_neighbour(cell))
    _, [a] = _advise_matrix(inst, v)
    names = [c["cell"] for c in a["cells"]]
    if cell.ci:  # CI passes it at every landed commit: still verified, still the nearest
        assert names[0] == cell.name and a["cells"][0]["state"] == "verified"
        return
    assert cell.name not in names and names
    candidates = [c for c in GRID.pinned if c is not cell and all(inst.get(d) for d, _ in c.extras)
                  and c.torch == cell.torch]  # cells on the installed torch speak for it
    best = min(distance(inst["transformers"], inst["trl"], c) for c in candidates)
    for entry in a["cells"]:
        named = GRID.cell(entry["cell"])
        assert entry["state"] == "verified"
        assert GRID.find(*(_apply(inst, entry["pins"])[k] for k in ("transformers", "trl")),
                         _apply(inst, entry["pins"]), cell.torch) is named
    assert a["cells"][0]["distance"] == best


def test_cells_with_extras_are_advised_only_to_those_who_have_the_extras():
    cell = next(c for c in GRID.pinned if c.extras)
    inst = _installed(cell, transformers=_neighbour(cell), extras=False)
    _, [a] = _advise_matrix(inst, _all_verified())
    assert cell.name not in [c["cell"] for c in a["cells"]]
    # a different release of the extra is pinned by the advice
    inst = {**_installed(cell, transformers=_neighbour(cell)), cell.extras[0][0]: "0.0.1"}
    _, [a] = _advise_matrix(inst, _all_verified())
    assert a["cells"][0]["cell"] == cell.name and a["cells"][0]["pins"][cell.extras[0][0]] == cell.extras[0][1]


def test_stale_pair_is_pointed_only_to_verified_cells():
    cell, stale = GRID.cell("tf4.54-trl0.20"), GRID.cell("tf4.53-trl0.20")  # cells CI does not run
    assert not cell.ci and not stale.ci
    inst = _installed(cell)
    v = _all_verified(**{cell.name: _result(prints=OTHER), stale.name: _result(prints=OTHER)})
    st, [a] = _advise_matrix(inst, v)
    assert st["state"] == "stale"
    assert all(c["state"] == "verified" for c in a["cells"]) and stale.name not in [c["cell"] for c in a["cells"]]
    # no recorded run of this code at all: the cells CI runs are verified all the same
    st, [a] = _advise_matrix(inst, {"schema": 1, "cells": {c.name: _result(prints=OTHER) for c in GRID.pinned}})
    assert st["state"] == "stale" and a["cells"] and all(GRID.cell(c["cell"]).ci for c in a["cells"])


def test_failing_cell_is_pointed_to_a_passing_one():
    cell = GRID.cell("tf4.53-trl0.20")  # a cell CI runs is verified whatever was recorded
    v = _all_verified(**{cell.name: _result(failed=2)})
    st, [a] = _advise_matrix(_installed(cell), v)
    assert st["state"] == "failing" and a["cells"] and cell.name not in [c["cell"] for c in a["cells"]]


# -- known issues: the release that fixes them --------------------------------------------------

def _as_package_versions(inst):
    return {k: versions.PackageVersion(k, k, v) for k, v in inst.items()}


FIXED = [i for i in known_issues.KNOWN_ISSUES if i.fixed_in]


def test_some_known_issues_name_a_fixing_release():
    assert {i.id for i in FIXED} >= {"F1", "F3"}


@pytest.mark.parametrize("issue", FIXED, ids=lambda i: i.id)
def test_applying_issue_names_the_release_that_fixes_it(issue):
    cells = [c for c in GRID.pinned if issue.applies(_as_package_versions(_installed(c)))]
    assert cells, f"no grid cell where {issue.id} applies"
    for c in cells:
        st = SimpleNamespace(id=issue.id, applies=True, mitigated=True)
        [a] = advice.issue_advice([st])
        assert a["fixed_in"] == issue.fixed_in
        for pkg, ver in issue.fixed_in.items():
            assert f"{pkg}>={ver}" in a["requirements"] and f"{pkg} {ver}" in a["text"]
        # the data is coherent: on the fixing releases the issue no longer applies
        fixed = {**_installed(c), **issue.fixed_in}
        assert not issue.applies(_as_package_versions(fixed)), (issue.id, c.name)


def test_issue_without_a_fix_is_advised_only_when_not_mitigated():
    issue = next(i for i in known_issues.KNOWN_ISSUES if not i.fixed_in)
    assert advice.issue_advice([SimpleNamespace(id=issue.id, applies=True, mitigated=True)]) == []
    [a] = advice.issue_advice([SimpleNamespace(id=issue.id, applies=True, mitigated=False)])
    assert a["fixed_in"] == {} and all(s in a["text"] for s in issue.mitigated_by)
    assert advice.issue_advice([SimpleNamespace(id=issue.id, applies=False, mitigated=False)]) == []


# -- conflicts: which releases coexist ------------------------------------------------------------

#: releases to try per distribution: the grid's own, plus liger-kernel releases read from PyPI wheels
TRIES = {
    "transformers": sorted({c.transformers for c in GRID.pinned}, key=Version),
    "trl": sorted({c.trl for c in GRID.pinned}, key=Version),
    "liger-kernel": ["0.5.9", "0.5.10", "0.8.5"],
}


def _satisfying(req: str) -> list[str]:
    r = Requirement(req)
    return [v for v in TRIES[r.name] if Version(v) in r.specifier]


@pytest.mark.parametrize("conflict", known_issues.KNOWN_CONFLICTS, ids=lambda c: c.id)
def test_known_conflict_names_releases_that_coexist(conflict):
    hits = 0
    for cell in GRID.pinned:
        for lib in TRIES[conflict.package]:
            inst = {**_installed(cell), conflict.package: lib}
            if not conflict.applies(inst):
                continue
            hits += 1
            [a] = [x for x in advice.conflict_advice(inst, requires=lambda d: []) if x["id"] == conflict.id]
            assert a["coexists"] == list(conflict.coexists)
            assert all(c in a["text"] for c in conflict.coexists)
            # each coexisting requirement, met, ends the conflict
            for req in conflict.coexists:
                name = Requirement(req).name
                options = _satisfying(req)
                assert options, req
                for v in options:
                    assert not conflict.applies({**inst, name: v}), (conflict.id, cell.name, req, v)
    assert hits, f"{conflict.id} applies to no grid cell"


def test_conflict_not_installed_gives_no_advice():
    assert advice.conflict_advice(_installed(GRID.pinned[-1], extras=False), requires=lambda d: []) == []


#: unsloth 2026.10.9's Requires-Dist lines for these packages, as its wheel's METADATA has them
UNSLOTH_REQUIRES = [
    "unsloth_zoo>=2026.10.9",
    "peft!=0.11.0,>=0.18.0",
    "transformers!=4.53.0,!=4.54.0,!=4.55.0,!=4.55.1,!=4.57.0,!=4.57.4,!=4.57.5,!=5.0.0,!=5.1.0,<=5.17.0,>=4.52.4",
    "trl!=0.19.0,<=1.15.0,>=0.18.2",
    "torch",
    'pytest; extra == "test"',
    'transformers>=99; extra == "huggingface"',
]


def test_declared_requirements_of_unsloth_are_checked_against_the_installed_releases():
    req = {"unsloth": UNSLOTH_REQUIRES}.get
    inst = {"unsloth": "2026.10.9", "transformers": "5.23.0", "trl": "1.16.0", "peft": "0.21.2", "torch": "2.13.0"}
    got = {a["id"]: a for a in advice.conflict_advice(inst, requires=req)}
    assert set(got) == {"unsloth-requires-transformers", "unsloth-requires-trl"}
    spec = Requirement(UNSLOTH_REQUIRES[2]).specifier
    assert got["unsloth-requires-transformers"]["coexists"] == [f"transformers{spec}"]
    # a release inside the declared range coexists; the extras' requirements are not read
    ok = {**inst, "transformers": "5.17.0", "trl": "1.15.0"}
    assert advice.conflict_advice(ok, requires=req) == []
    assert advice.conflict_advice({**ok, "transformers": "5.0.0"}, requires=req)[0]["id"] == "unsloth-requires-transformers"


# -- in the report ------------------------------------------------------------------------------

def test_report_carries_the_advice_in_text_and_json(monkeypatch):
    from liger_compat.compat import report
    from liger_compat.matrix import fingerprint, status

    cell = GRID.cell("tf4.48-trl0.15")
    here = fingerprint.current()
    monkeypatch.setattr(status, "load_verified", lambda: {"schema": 1, "cells": {cell.name: _result(prints=here)}})
    t = _neighbour(cell)
    installed = {"transformers": versions.PackageVersion("transformers", "transformers", t),
                 "trl": versions.PackageVersion("trl", "trl", cell.trl)}
    m = report._matrix(installed)
    issues = [report.IssueStatus("F3", "x", True, True, "")]
    adv = report._advice(installed, m, issues)
    kinds = [a["kind"] for a in adv]
    assert kinds[:2] == ["matrix", "known-issue"]
    r = report.Report(liger_compat_version="0", python="3.11", versions={}, device={},
                      settings={"disabled": False, "kernels": [], "source": {}}, shims=[], issues=issues,
                      families={}, matrix=m, conflicts=[], advice=adv)
    lines = str(r).splitlines()
    block = lines[lines.index("Advice") + 1:]
    assert block[0].startswith("  - matrix: ") and cell.name in block[0] and f"transformers=={cell.transformers}" in block[0]
    assert block[1].startswith("  - known-issue: F3") and "transformers 4.49.0" in block[1]
    data = json.loads(r.to_json())["advice"]
    assert data[0]["cells"][0]["cell"] == cell.name and data[1]["fixed_in"] == {"transformers": "4.49.0"}


# -- torch: was the installed release verified? --------------------------------------------------

def test_torch_advice_points_to_the_nearest_verified_torch_release():
    newest = [c for c in GRID.pinned if not c.own_torch][-1]
    axis = [c for c in GRID.pinned if c.own_torch and (c.transformers, c.trl) == (newest.transformers, newest.trl)]
    assert axis
    v = _all_verified()
    for torch, nearest in (("2.11.0", GRID.torch), ("2.99.1", max(GRID.torch_releases, key=Version))):
        inst = {**_installed(newest), "torch": torch}
        st = verification_status(inst["transformers"], inst["trl"], GRID, v, current=NOW, extras=inst, torch=torch)
        adv = advice.advise(inst, st, [], requires=lambda d: [], grid=GRID, verified=v, current=NOW)
        assert [a["kind"] for a in adv] == ["torch"]  # the pair itself is verified: nothing to say about it
        [a] = adv
        assert a["nearest"] == nearest and a["command"] == f"pip install torch=={nearest}"
        assert a["releases"] == list(GRID.torch_releases)
        assert f"torch {torch} is not a verified torch release" in a["text"]
    # each torch release of the grid is verified: no torch advice, the cell on it is found
    for c in axis:
        inst = _installed(c)
        st = verification_status(inst["transformers"], inst["trl"], GRID, v, current=NOW, extras=inst, torch=c.torch)
        assert st["cell"] == c.name and advice.torch_advice(st) == []
    # runs on that torch only of other code (and no cell CI runs on it): advised to a verified torch release
    c = next(x for x in axis if not any(y.ci for y in GRID.on_torch(x.torch)))
    v2 = _all_verified(**{x.name: _result(prints=OTHER) for x in GRID.on_torch(c.torch)})
    inst = _installed(c)
    st = verification_status(inst["transformers"], inst["trl"], GRID, v2, current=NOW, extras=inst, torch=c.torch)
    [a] = advice.torch_advice(st)
    assert a["nearest"] != c.torch and c.torch not in a["releases"]
    # the pair's own cell on that torch is stale and no cell on that torch is verified: the pair
    # advice has nothing to move to on this torch (moving torch is the torch advice's)
    st, m = _advise_matrix(inst, v2)
    assert st["state"] == "stale" and st["cell"] == c.name and m == []
    # nothing recorded: the torch releases of the cells CI runs are verified all the same
    st = verification_status(newest.transformers, newest.trl, GRID, {"schema": 1, "cells": {}}, current=NOW,
                             torch="2.11.0")
    [a] = advice.torch_advice(st)
    assert a["releases"] == sorted({x.torch for x in GRID.cells if x.ci}, key=Version)
    assert a["nearest"] == GRID.torch and a["command"] == f"pip install torch=={GRID.torch}"
    # a grid without cells CI runs and nothing recorded: nothing verified anywhere, said so, no command
    from liger_compat.matrix import grid as grid_mod

    data = grid_mod._toml.loads(grid_mod.grid_text())
    data["cell"] = [{**x, "labels": []} for x in data["cell"] if not x.get("newest")]
    st = verification_status(newest.transformers, newest.trl, grid_mod.parse(data), {"schema": 1, "cells": {}},
                             current=NOW, torch="2.11.0")
    [a] = advice.torch_advice(st)
    assert a["command"] == "" and "no cell" in a["text"]
