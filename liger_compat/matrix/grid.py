"""The version grid as Python objects, loaded from ``grid.toml`` beside this file.

Cheap to import: reads one small TOML file; imports no torch, transformers or trl.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from packaging.version import Version

try:  # Python >= 3.11
    import tomllib as _toml
except ImportError:  # pragma: no cover - Python 3.10
    try:
        import tomli as _toml  # type: ignore[no-redef]
    except ImportError:
        _toml = None  # type: ignore[assignment]

PACKAGES = ("transformers", "trl")
#: extra distributions pinned per cell, besides the pair itself
EXTRA_PINS = ("accelerate", "datasets")
#: distributions a cell may add under ``extras`` (libraries that patch or wrap the same models)
OPTIONAL_PINS = ("peft", "liger-kernel", "cut-cross-entropy", "unsloth")


class GridError(ValueError):
    """grid.toml is malformed; the message names the entry and the field."""


@dataclass(frozen=True)
class Boundary:
    """An upstream change a shim handles: ``package`` >= ``version`` behaves differently."""

    id: str
    package: str
    version: str
    what: str
    evidence: str
    #: a regression confined to these releases (empty: every release from ``version`` on)
    only: tuple[str, ...] = ()

    def before(self, cell: "Cell") -> bool:
        """Whether a pinned cell is on the old side of this change (the newest cell is on neither).

        For a boundary with ``only``, "before" means on none of the affected releases."""
        if self.only:
            return not self.has(cell.release(self.package))
        return cell.release(self.package) < Version(self.version)

    def has(self, release: Version) -> bool:
        """Whether a release of ``package`` shows the change."""
        if self.only:
            return any(release == Version(v) for v in self.only)
        return release >= Version(self.version)


@dataclass(frozen=True)
class Cell:
    """One (transformers, trl) pair, pinned exactly, on one torch release, and why the grid has it.

    A ``newest`` cell pins nothing: its environment installs the newest release of every
    dependency at the time it runs (torch excepted), so its release numbers are known only from
    a recorded run (verified.json), never from the grid.
    """

    name: str
    transformers: str | None
    trl: str | None
    accelerate: str | None
    datasets: str | None
    why: str
    labels: tuple[str, ...] = ()
    newest: bool = False
    #: (distribution, release) of optional libraries installed beside the pair (peft, liger-kernel ...)
    extras: tuple[tuple[str, str], ...] = ()
    #: the torch release the cell runs on: the grid's own (reused from the system-wide install) or,
    #: for a cell of the torch axis, one its environment installs
    torch: str = ""
    #: whether the cell names its own torch (a cell of the torch axis: its environment installs that
    #: torch instead of reusing the system-wide one)
    own_torch: bool = False

    @property
    def ci(self) -> bool:
        """Whether CI runs this cell at every landed commit: a cell labelled ``ci`` (``.ci/run``
        runs them all) or the newest cell (``.ci/run``'s main suite installs what it installs).
        Nothing lands unless they pass, so each of them is verified at every landed commit."""
        return self.newest or "ci" in self.labels

    def pins(self) -> dict[str, str]:
        """The exact releases this cell installs; empty for the newest cell."""
        if self.newest:
            return {}
        return {"transformers": self.transformers, "trl": self.trl,  # type: ignore[dict-item]
                "accelerate": self.accelerate, "datasets": self.datasets, **dict(self.extras)}

    def release(self, package: str) -> Version:
        if self.newest:
            raise ValueError(f"cell {self.name!r} installs the newest releases: it pins no {package} release")
        return Version(self.pins()[package])

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.pins(), "torch": self.torch, "newest": self.newest, "labels": list(self.labels),
                "why": self.why, "extras": dict(self.extras)}


@dataclass(frozen=True)
class Grid:
    python: str
    torch: str
    boundaries: tuple[Boundary, ...]
    cells: tuple[Cell, ...]

    def cell(self, name: str) -> Cell:
        for c in self.cells:
            if c.name == name:
                return c
        raise KeyError(f"no cell named {name!r} in the grid (cells: {', '.join(c.name for c in self.cells)})")

    @property
    def pinned(self) -> tuple[Cell, ...]:
        """The cells with exact release pins (all but the newest cell)."""
        return tuple(c for c in self.cells if not c.newest)

    def labelled(self, label: str) -> tuple[Cell, ...]:
        return tuple(c for c in self.cells if label in c.labels)

    @property
    def torch_releases(self) -> tuple[str, ...]:
        """Every torch release some cell runs on, oldest first (the grid's own among them)."""
        return tuple(sorted({c.torch for c in self.cells}, key=Version))

    def on_torch(self, torch: str | None) -> tuple[Cell, ...]:
        """The cells that run on this torch release (``2.15.0+cu130`` counts as ``2.15.0``;
        None: the grid's own torch)."""
        want = _release(torch) if torch is not None else Version(self.torch)
        return tuple(c for c in self.cells if Version(c.torch) == want)

    def find(self, transformers: str | None, trl: str | None,
             extras: dict[str, str | None] | None = None, torch: str | None = None) -> Cell | None:
        """The cell pinning exactly these releases (``4.48.3.dev0`` counts as ``4.48.3``) on this
        torch release (None: the grid's own torch, where every pair has a cell).

        ``extras`` (distribution -> installed release or None) picks between cells of the same
        pair: a cell with extras matches only when each of them is installed at its pin; a
        cell without extras matches whatever else is installed. The most specific match wins.
        Only pinned cells: the newest cell has no release numbers of its own (see
        :func:`liger_compat.matrix.status.verification_status` for matching its recorded run)."""
        t, r = _release(transformers), _release(trl)
        if t is None or r is None:
            return None
        have = extras or {}
        found = [c for c in self.on_torch(torch) if not c.newest
                 and Version(c.transformers) == t and Version(c.trl) == r
                 and all(_release(have.get(d)) == Version(v) for d, v in c.extras)]
        return max(found, key=lambda c: len(c.extras), default=None)

    def isolating(self, boundary: Boundary) -> list[tuple[Cell, Cell]]:
        """Pairs of pinned cells (before, at or after) across which ``boundary`` is the only
        boundary of the grid that changes sides, so that a failure on one and not the other
        points to that change alone (boundaries of the same release count as one change)."""
        pairs = []
        for a in self.pinned:
            if not boundary.before(a):
                continue
            for b in self.pinned:
                if boundary.before(b) or a.extras != b.extras or a.torch != b.torch:
                    continue
                if all(o.before(a) == o.before(b) for o in self.boundaries
                       if (o.package, o.version, o.only) != (boundary.package, boundary.version, boundary.only)):
                    pairs.append((a, b))
        return pairs

    def uncovered(self) -> list[str]:
        """Boundaries without a pinned cell on each side; empty when the grid is well-formed.

        The newest cell covers nothing: what it installs changes with every upstream release."""
        out = []
        for b in self.boundaries:
            sides = {b.before(c) for c in self.pinned}
            if sides != {True, False}:
                side = ("before" if False in sides else "at or after") if not b.only else \
                    ("on one of " + ", ".join(b.only) if True in sides else "on none of " + ", ".join(b.only))
                out.append(f"{b.id} ({b.package} {b.version}): no cell {side}" + ("" if b.only else " it"))
        return out


def _release(raw: str | None) -> Version | None:
    if raw is None:
        return None
    try:
        v = Version(raw)
    except Exception:
        return None
    return Version(".".join(str(p) for p in v.release))


def _req(entry: dict[str, Any], key: str, where: str, typ: type = str) -> Any:
    if key not in entry:
        raise GridError(f"{where}: missing field {key!r}")
    val = entry[key]
    if not isinstance(val, typ):
        raise GridError(f"{where}: field {key!r} must be {typ.__name__}, got {type(val).__name__}")
    if typ is str and not val.strip():
        raise GridError(f"{where}: field {key!r} is empty")
    return val


def _version(entry: dict[str, Any], key: str, where: str) -> str:
    raw = _req(entry, key, where)
    try:
        v = Version(raw)
    except Exception:
        raise GridError(f"{where}: {key} = {raw!r} is not a version") from None
    if str(v) != raw or v.local or v.is_prerelease or v.is_devrelease or len(v.release) != 3:
        raise GridError(f"{where}: {key} = {raw!r} must be a plain released version with three parts (like 4.48.3)")
    return raw


def parse(data: dict[str, Any]) -> Grid:
    """Validate parsed TOML and build the :class:`Grid`; raises :class:`GridError`."""
    if data.get("schema") != 1:
        raise GridError(f"unsupported grid schema {data.get('schema')!r} (expected 1)")
    grid_torch = _version(data, "torch", "grid")
    boundaries = []
    seen_b: set[str] = set()
    for i, b in enumerate(data.get("boundary", [])):
        where = f"boundary #{i + 1}"
        bid = _req(b, "id", where)
        where = f"boundary {bid!r}"
        if bid in seen_b:
            raise GridError(f"{where}: duplicate id")
        seen_b.add(bid)
        pkg = _req(b, "package", where)
        if pkg not in PACKAGES:
            raise GridError(f"{where}: package must be one of {PACKAGES}, got {pkg!r}")
        version = _version(b, "version", where)
        only = b.get("only", [])
        if not isinstance(only, list):
            raise GridError(f"{where}: only must be a list of releases")
        only = tuple(_version({"only": v}, "only", where) for v in only)
        if only and (min(only, key=Version) != version):
            raise GridError(f"{where}: version must be the first release listed in only")
        unknown = set(b) - {"id", "package", "version", "what", "evidence", "only"}
        if unknown:
            raise GridError(f"{where}: unknown field(s) {sorted(unknown)}")
        boundaries.append(Boundary(bid, pkg, version, _req(b, "what", where), _req(b, "evidence", where), only))
    cells = []
    seen_c: set[str] = set()
    seen_pair: set[tuple[Any, ...]] = set()
    for i, c in enumerate(data.get("cell", [])):
        where = f"cell #{i + 1}"
        name = _req(c, "name", where)
        where = f"cell {name!r}"
        if name in seen_c:
            raise GridError(f"{where}: duplicate name")
        if not all(ch.isalnum() or ch in ".-_" for ch in name):
            raise GridError(f"{where}: name may only use letters, digits, '.', '-', '_' (it is a tox env name)")
        seen_c.add(name)
        labels = c.get("labels", [])
        if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
            raise GridError(f"{where}: labels must be a list of strings")
        newest = c.get("newest", False)
        if not isinstance(newest, bool):
            raise GridError(f"{where}: field 'newest' must be true or false, got {newest!r}")
        extras = c.get("extras", {})
        if not isinstance(extras, dict):
            raise GridError(f"{where}: extras must be a table of distribution = \"release\"")
        for dist in extras:
            if dist not in OPTIONAL_PINS:
                raise GridError(f"{where}: extras may pin {', '.join(OPTIONAL_PINS)}, not {dist!r}")
        extra_pins = tuple((d, _version(extras, d, f"{where} extras")) for d in sorted(extras))
        own_torch = "torch" in c
        torch = _version(c, "torch", where) if own_torch else grid_torch
        if own_torch and torch == grid_torch:
            raise GridError(f"{where}: torch {torch} is the grid's own torch; name a torch only for a cell of the torch axis")
        if newest:
            pinned = sorted(k for k in (*PACKAGES, *EXTRA_PINS, "torch") if k in c) + (["extras"] if extras else [])
            if pinned:
                raise GridError(f"{where}: a newest cell installs the newest releases and pins nothing; "
                                f"remove {', '.join(pinned)}")
            if any(x.newest for x in cells):
                raise GridError(f"{where}: the grid already has a newest cell")
            cell = Cell(name=name, transformers=None, trl=None, accelerate=None, datasets=None,
                        why=_req(c, "why", where), labels=tuple(labels), newest=True, torch=torch)
        else:
            cell = Cell(name=name, **{k: _version(c, k, where) for k in (*PACKAGES, *EXTRA_PINS)},
                        why=_req(c, "why", where), labels=tuple(labels), extras=extra_pins,
                        torch=torch, own_torch=own_torch)
            pair = (cell.transformers, cell.trl, extra_pins, torch)
            if pair in seen_pair:
                more = f" with extras {dict(extra_pins)}" if extra_pins else ""
                raise GridError(f"{where}: transformers {pair[0]} + trl {pair[1]}{more} on torch {torch} is already a cell")
            seen_pair.add(pair)
        unknown = set(c) - {"name", "labels", "why", "newest", "extras", "torch", *PACKAGES, *EXTRA_PINS}
        if unknown:
            raise GridError(f"{where}: unknown field(s) {sorted(unknown)}")
        cells.append(cell)
    if not any(not c.newest for c in cells):
        raise GridError("the grid has no [[cell]] with pinned releases")
    base = {(c.transformers, c.trl, c.extras) for c in cells if not c.own_torch}
    for c in cells:
        if c.own_torch and (c.transformers, c.trl, c.extras) not in base:
            raise GridError(f"cell {c.name!r}: a cell of the torch axis needs the same pair on the grid's torch "
                            f"{grid_torch} as a cell too (the pair beside it isolates the torch change)")
    return Grid(python=_req(data, "python", "grid"), torch=grid_torch,
                boundaries=tuple(boundaries), cells=tuple(cells))


def loads(text: str) -> Grid:
    if _toml is None:  # pragma: no cover
        raise GridError("reading grid.toml needs Python >= 3.11 or the tomli package")
    try:
        return parse(_toml.loads(text))
    except _toml.TOMLDecodeError as exc:
        raise GridError(f"grid.toml is not valid TOML: {exc}") from None


def grid_text() -> str:
    return resources.files(__package__).joinpath("grid.toml").read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def load() -> Grid:
    """The grid shipped with this package."""
    return loads(grid_text())
