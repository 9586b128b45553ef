"""Process-wide settings: which kernels are enabled and whether liger_compat is active.

Read once from the environment (``LIGER_COMPAT_DISABLE``, ``LIGER_COMPAT_KERNELS``,
``LIGER_COMPAT_DEBUG``, ``LIGER_COMPAT_FLCE_MODE``) and changed afterwards with
:func:`liger_compat.configure` (the first three) or by assigning ``settings.flce_mode``.
Kept free of heavy imports: importing ``liger_compat`` must not import torch.
"""

from __future__ import annotations

import os

from ._record import Record

#: Every kernel the package provides, by the name used in ``LIGER_COMPAT_KERNELS``
#: and ``configure(kernels=...)``.
ALL_KERNELS: tuple[str, ...] = (
    "fused_linear_cross_entropy",
    "rms_norm",
    "rope",
    "swiglu",
    "geglu",
)

_ALIASES = {
    "flce": "fused_linear_cross_entropy",
    "cross_entropy": "fused_linear_cross_entropy",
    "rmsnorm": "rms_norm",
    "rotary": "rope",
}

_TRUE = {"1", "true", "yes", "on"}

#: Values of ``LIGER_COMPAT_FLCE_MODE``: how the fused linear cross-entropy runs. ``chunked``: rows
#: in chunks whose logits are stored (fastest; one chunk of logits in memory); ``lowmem``: no
#: logits stored (at most 16 MiB extra); ``auto`` (default): chunked unless one chunk would not
#: fit in the GPU's free memory.
FLCE_MODES: tuple[str, ...] = ("auto", "chunked", "lowmem")


def parse_kernels(value: str | list[str] | tuple[str, ...] | set[str] | None) -> frozenset[str]:
    """Turn ``"all"``, ``"none"``, ``"rms_norm,rope"`` or a list of names into a set.

    Raises ``ValueError`` naming the unknown kernel and the valid names.
    """
    if value is None:
        return frozenset(ALL_KERNELS)
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    else:
        items = [str(v).strip() for v in value]
    if len(items) == 1 and items[0].lower() == "all":
        return frozenset(ALL_KERNELS)
    if len(items) == 0 or (len(items) == 1 and items[0].lower() == "none"):
        return frozenset()
    chosen = set()
    for item in items:
        name = _ALIASES.get(item.lower(), item.lower())
        if name not in ALL_KERNELS:
            raise ValueError(
                f"unknown kernel {item!r} in kernels=; valid names: {', '.join(ALL_KERNELS)}, 'all', 'none'"
            )
        chosen.add(name)
    return frozenset(chosen)


class Settings(Record):
    _fields = ("disabled", "kernels", "debug", "flce_mode", "source")

    def __init__(self, disabled: bool = False, kernels: frozenset[str] | None = None, debug: bool = False,
                 source: dict[str, str] | None = None, flce_mode: str = "auto") -> None:
        self.disabled = disabled
        self.kernels: frozenset[str] = frozenset(ALL_KERNELS) if kernels is None else kernels
        self.debug = debug
        #: ``LIGER_COMPAT_FLCE_MODE`` as set (checked when the fused loss runs: :func:`flce_mode`)
        self.flce_mode = flce_mode
        #: where a setting came from, for the report
        self.source: dict[str, str] = {} if source is None else source


def _from_env() -> Settings:
    s = Settings()
    if os.environ.get("LIGER_COMPAT_DISABLE", "").strip().lower() in _TRUE:
        s.disabled = True
        s.source["disabled"] = "LIGER_COMPAT_DISABLE"
    env_kernels = os.environ.get("LIGER_COMPAT_KERNELS")
    if env_kernels is not None:
        try:
            s.kernels = parse_kernels(env_kernels)
            s.source["kernels"] = "LIGER_COMPAT_KERNELS"
        except ValueError as exc:  # a bad env var must not break the import
            s.source["kernels"] = f"default (ignored LIGER_COMPAT_KERNELS: {exc})"
    if os.environ.get("LIGER_COMPAT_DEBUG", "").strip().lower() in _TRUE:
        s.debug = True
        s.source["debug"] = "LIGER_COMPAT_DEBUG"
    mode = os.environ.get("LIGER_COMPAT_FLCE_MODE")
    if mode is not None and mode.strip():
        s.flce_mode = mode.strip().lower()  # a bad value raises when the fused loss runs, not here
        s.source["flce_mode"] = "LIGER_COMPAT_FLCE_MODE"
    return s


settings: Settings = _from_env()


def kernel_enabled(name: str) -> bool:
    """True when liger_compat is active and kernel ``name`` is selected."""
    return (not settings.disabled) and name in settings.kernels


def flce_mode() -> str:
    """``settings.flce_mode``, checked: one of :data:`FLCE_MODES`, else a ``ValueError`` naming
    ``LIGER_COMPAT_FLCE_MODE``."""
    mode = str(settings.flce_mode).strip().lower()
    if mode not in FLCE_MODES:
        raise ValueError(
            f"LIGER_COMPAT_FLCE_MODE must be one of {', '.join(FLCE_MODES)}, got {settings.flce_mode!r}")
    return mode
