"""Installed versions of the libraries liger_compat cares about, read from package metadata.

Nothing here imports the libraries themselves: ``importlib.metadata`` reads the
installed ``*.dist-info``, which costs milliseconds where ``import transformers`` costs
seconds.

Version comparisons use the *release* of a version (``4.48.0.dev0`` and
``4.48.0+cpu`` both count as ``4.48.0``): a dev build of a library already carries the
features of the release it leads to, which is what the shims' version gates ask about.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # imported lazily: `import liger_compat` must stay cheap
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

#: import name -> distribution names to try, first found wins
TRACKED: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "triton": ("triton", "pytorch-triton"),
    "transformers": ("transformers",),
    "trl": ("trl",),
    "peft": ("peft",),
    "accelerate": ("accelerate",),
    "datasets": ("datasets",),
    "liger_kernel": ("liger-kernel", "liger-kernel-nightly"),
    "unsloth": ("unsloth",),
    "flash_attn": ("flash-attn", "flash_attn"),
    "deepspeed": ("deepspeed",),
    "cut_cross_entropy": ("cut-cross-entropy", "cut_cross_entropy"),
}


class PackageVersion(NamedTuple):
    """One installed package as the report shows it."""

    name: str
    distribution: str | None
    raw: str | None

    @property
    def installed(self) -> bool:
        return self.raw is not None

    @property
    def version(self) -> Version | None:
        return parse_version(self.raw)

    @property
    def release(self) -> Version | None:
        return release_of(self.raw)

    def __str__(self) -> str:
        return self.raw if self.raw is not None else "not installed"


def parse_version(raw: str | None) -> Version | None:
    """``packaging`` Version of ``raw``, or None when absent or not PEP 440."""
    if raw is None:
        return None
    from packaging.version import InvalidVersion, Version

    try:
        return Version(raw)
    except InvalidVersion:
        return None


def release_of(raw: str | Version | None) -> Version | None:
    """The release part only: ``4.48.0.dev0`` -> ``4.48.0``, ``2.13.0+cpu`` -> ``2.13.0``."""
    from packaging.version import Version

    v = raw if isinstance(raw, Version) else parse_version(raw)
    if v is None:
        return None
    return Version(".".join(str(p) for p in v.release))


def matches(raw: str | Version | None, spec: str | SpecifierSet) -> bool:
    """Whether the release of ``raw`` satisfies ``spec`` (empty spec: any installed version).

    Raises ``ValueError`` on a malformed specifier, naming it.
    """
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    rel = release_of(raw)
    if rel is None:
        return False
    if isinstance(spec, str):
        try:
            spec = SpecifierSet(spec)
        except InvalidSpecifier as exc:
            raise ValueError(f"invalid version specifier {spec!r}: {exc}") from None
    return spec.contains(rel, prereleases=True)


@lru_cache(maxsize=None)
def _lookup(name: str) -> PackageVersion:
    import importlib.metadata as _md

    for dist in TRACKED.get(name, (name,)):
        try:
            return PackageVersion(name, dist, _md.version(dist))
        except _md.PackageNotFoundError:
            continue
    return PackageVersion(name, None, None)


def installed(name: str) -> PackageVersion:
    """Installed version of ``name`` (an import name from :data:`TRACKED` or any distribution)."""
    return _lookup(name)


def all_installed() -> dict[str, PackageVersion]:
    return {name: _lookup(name) for name in TRACKED}
