"""Version ranges are declared once, by each shim (``Shim.versions``), and the other two places that
speak of versions are checked against them: the known issues (``affects``) and the grid (its cells).

* Wherever the grid says a known issue applies, every shim that mitigates it is in its own range
  there (a shim range narrower than its issue would leave users unprotected).
* Every bound of a shim's range has grid cells on both of its sides (or lies at or below the oldest
  supported release): the release where a shim starts or stops applying is run by a real tox cell.
"""

from __future__ import annotations

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from liger_compat.compat import known_issues, versions
from liger_compat.matrix import load_grid
from liger_compat.shims import REGISTRY, load_all

load_all()
GRID = load_grid()
RANGED = [s for s in REGISTRY.shims() if s.versions]


def _installed(cell) -> dict[str, versions.PackageVersion]:
    return {name: versions.PackageVersion(name, name, v) for name, v in cell.pins().items()}


def test_some_shims_declare_a_range():
    assert len(RANGED) >= 4, [s.id for s in RANGED]


@pytest.mark.parametrize("issue", known_issues.KNOWN_ISSUES, ids=lambda i: i.id)
def test_mitigating_shims_are_in_range_wherever_the_issue_applies(issue):
    shims = {s.id: s for s in REGISTRY.shims()}
    unknown = [sid for sid in issue.mitigated_by if sid not in shims]
    assert not unknown, f"{issue.id} names unregistered shims {unknown}"
    cells = [c for c in GRID.pinned if issue.applies(_installed(c), cuda=False)]
    for sid in issue.mitigated_by:
        shim = shims[sid]
        if not shim.versions:
            continue
        for c in cells:
            have = c.pins().get(shim.library)
            assert have is not None and versions.matches(have, shim.versions), (
                f"{issue.id} applies on {c.name}, but {sid} declares {shim.library}{shim.versions} "
                f"and {c.name} has {shim.library} {have}")


@pytest.mark.parametrize("shim", RANGED, ids=lambda s: s.id)
def test_each_bound_of_a_shim_range_has_cells_on_both_sides(shim):
    releases = sorted({Version(c.pins()[shim.library]) for c in GRID.pinned if shim.library in c.pins()})
    assert releases, f"no grid cell pins {shim.library}"
    for spec in SpecifierSet(shim.versions):
        bound = Version(spec.version)
        inside = [r for r in releases if r in SpecifierSet(str(spec))]
        outside = [r for r in releases if r not in SpecifierSet(str(spec))]
        if bound <= releases[0] and spec.operator in (">=", ">"):
            assert inside, (shim.id, str(spec))  # a floor at the oldest supported release
            continue
        assert inside and outside, (
            f"{shim.id} declares {shim.library}{spec}: the grid pins {', '.join(map(str, releases))}, "
            "which do not reach both sides of that bound")
        # and the first cell at or above the bound is of the bound's own minor release: the cell pair
        # brackets the change itself, not a wider span that hides where it happened
        above = min(r for r in releases if r >= bound)
        assert above.release[:2] == bound.release[:2], (
            f"{shim.id} declares {shim.library}{spec}, but the first grid cell at or above it pins {above}")
