"""Process-wide settings, and the one place the package reads its environment variables.

Every ``LIGER_COMPAT_*`` variable (:data:`SETTINGS`) is read once, at import, into :data:`settings`
and changed afterwards with :func:`liger_compat.configure` (``enabled``, ``kernels``, ``debug``,
``return_logits``) or by assigning the attribute (the kernel tuning values). The tuning values are
kept as set and checked where they are used (:func:`flce_mode`, :func:`flce_chunk_mib`,
:func:`flce_logits`, :func:`mlp_recompute_parts`), so a bad value never breaks the import: it
raises a ``ValueError`` naming the variable and its allowed values when the kernel runs, and
``check()`` reports it. ``TRITON_INTERPRET`` (Triton's own variable) is read on every call of
:func:`triton_interpret`. Kept free of heavy imports: importing ``liger_compat`` must not import torch.
"""

from __future__ import annotations

import sys

import os

from typing import Any, NamedTuple

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

#: The one spelling of on / off for every on-off variable (compared stripped and lower-cased).
TRUE_VALUES: tuple[str, ...] = ("1", "true", "yes", "on")
FALSE_VALUES: tuple[str, ...] = ("0", "false", "no", "off", "")

#: Values of ``LIGER_COMPAT_FLCE_MODE``: how the fused linear cross-entropy runs. ``chunked``: rows
#: in chunks whose logits are stored (fastest; one chunk of logits in memory); ``lowmem``: no
#: logits stored (tens of MiB extra at most); ``auto`` (default): chunked unless one chunk would not
#: fit in the GPU's free memory.
FLCE_MODES: tuple[str, ...] = ("auto", "chunked", "lowmem")
#: Values of ``LIGER_COMPAT_FLCE_LOGITS``: how each chunk's logits are computed on the GPU.
FLCE_LOGITS: tuple[str, ...] = ("auto", "cublas", "triton")
#: What ``LIGER_COMPAT_MLP_RECOMPUTE`` can name.
MLP_RECOMPUTE_PARTS: tuple[str, ...] = ("activation", "input")


class Setting(NamedTuple):
    """One environment variable of the package: the :class:`Settings` attribute it sets, its
    value when unset (as the variable would spell it) and its allowed values in words."""

    attr: str
    env: str
    default: str
    allowed: str


_ONOFF = f"on: {', '.join(TRUE_VALUES)}; off: {', '.join(v for v in FALSE_VALUES if v)} or empty"

#: Every ``LIGER_COMPAT_*`` variable, in the order the report lists them.
SETTINGS: tuple[Setting, ...] = (
    Setting("disabled", "LIGER_COMPAT_DISABLE", "0", _ONOFF),
    Setting("kernels", "LIGER_COMPAT_KERNELS", "all",
            f"all, none, or comma-separated names from {', '.join(ALL_KERNELS)}"),
    Setting("debug", "LIGER_COMPAT_DEBUG", "0", _ONOFF),
    Setting("return_logits", "LIGER_COMPAT_RETURN_LOGITS", "0", _ONOFF),
    Setting("flce_mode", "LIGER_COMPAT_FLCE_MODE", "auto", ", ".join(FLCE_MODES)),
    Setting("flce_chunk_mb", "LIGER_COMPAT_FLCE_CHUNK_MB", "", "a positive number of MiB, or empty"),
    Setting("flce_logits", "LIGER_COMPAT_FLCE_LOGITS", "auto", ", ".join(FLCE_LOGITS)),
    Setting("flce_sparse", "LIGER_COMPAT_FLCE_SPARSE", "1", _ONOFF),
    Setting("flce_fp32_grad_weight", "LIGER_COMPAT_FLCE_FP32_GRAD_WEIGHT", "0", _ONOFF),
    Setting("flce_sparse_grads", "LIGER_COMPAT_FLCE_SPARSE_GRADS", "0", _ONOFF),
    Setting("flce_graphs", "LIGER_COMPAT_FLCE_GRAPHS", "1", _ONOFF),
    Setting("mlp_recompute", "LIGER_COMPAT_MLP_RECOMPUTE", "1",
            f"1, 0, or comma-separated names from {', '.join(MLP_RECOMPUTE_PARTS)}"),
    Setting("rms_norm_small_torch", "LIGER_COMPAT_RMS_NORM_SMALL_TORCH", "1", _ONOFF),
    Setting("mlp_small_native", "LIGER_COMPAT_MLP_SMALL_NATIVE", "1", _ONOFF),
    Setting("decode_native", "LIGER_COMPAT_DECODE_NATIVE", "1", _ONOFF),
    Setting("cpu_native", "LIGER_COMPAT_CPU_NATIVE", "1", _ONOFF),
)
_BY_ATTR = {s.attr: s for s in SETTINGS}
#: the on / off settings (parsed by :func:`parse_bool`)
_ONOFF_ATTRS: frozenset[str] = frozenset(s.attr for s in SETTINGS if s.allowed == _ONOFF)

#: Every environment variable the package reads: its own and Triton's interpreter switch.
ENV_VARS: tuple[str, ...] = tuple(s.env for s in SETTINGS) + ("TRITON_INTERPRET",)


def parse_bool(value: object, name: str) -> bool:
    """``value`` (a string from the environment, or a bool) as on / off; ``ValueError`` naming
    ``name`` and the allowed spellings for anything else."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE_VALUES:
        return True
    if text in FALSE_VALUES:
        return False
    raise ValueError(f"{name} must be on or off ({_ONOFF}), got {value!r}")


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
    _fields = ("disabled", "kernels", "debug", "return_logits", "flce_mode", "flce_chunk_mb", "flce_logits",
               "flce_sparse", "flce_fp32_grad_weight", "flce_sparse_grads", "flce_graphs", "mlp_recompute",
               "rms_norm_small_torch", "mlp_small_native", "decode_native", "cpu_native", "source")

    def __init__(self, disabled: bool = False, kernels: frozenset[str] | None = None, debug: bool = False,
                 source: dict[str, str] | None = None, flce_mode: str = "auto", return_logits: bool = False,
                 flce_chunk_mb: str = "", flce_logits: str = "auto", mlp_recompute: str = "1",
                 decode_native: bool = True, cpu_native: bool = True, flce_sparse: bool = True,
                 flce_fp32_grad_weight: bool = False, flce_graphs: bool = True,
                 flce_sparse_grads: bool = False, rms_norm_small_torch: bool = True,
                 mlp_small_native: bool = True) -> None:
        self.disabled = disabled
        self.kernels: frozenset[str] = frozenset(ALL_KERNELS) if kernels is None else kernels
        self.debug = debug
        #: the fused loss returns the logits too (``LIGER_COMPAT_RETURN_LOGITS``); a call's
        #: ``return_logits=`` overrides it
        self.return_logits = return_logits
        # the kernel tuning values, as set; checked where they are used (:func:`flce_mode` etc.)
        self.flce_mode = flce_mode
        self.flce_chunk_mb = flce_chunk_mb
        self.flce_logits = flce_logits
        #: the low-memory loss's backward leaves out vocabulary tiles of negligible softmax
        #: (``kernels/_lowmem_triton.py``); off: every tile is computed
        self.flce_sparse = flce_sparse
        #: the chunked fused loss on a GPU rounds grad_weight once, its target terms exact: up to
        #: 8192 rows' logits gradients kept for each fp32-result product into an fp32 sum (2x the
        #: weight's size plus those rows in memory while the loss runs), instead of a sum in the
        #: weight's dtype (one rounding a chunk)
        self.flce_fp32_grad_weight = flce_fp32_grad_weight
        #: the chunked fused loss on a GPU with tensor descriptors runs its two gradient matmuls
        #: block-sparse where a probe of its first chunk finds the softmax sparse (trained-like
        #: logits; ``kernels/_sparse_grads_triton.py``), in every call the pass of which is not a
        #: replayed CUDA graph; off: dense (exact) gradient matmuls
        self.flce_sparse_grads = flce_sparse_grads
        #: a small scalar fused loss on a GPU replays its pass as a CUDA graph from its third call
        #: with the same shapes and weight (``kernels/_graphs.py``): one launch instead of a dozen
        #: through Triton's and torch's host code; off: every call runs eagerly
        self.flce_graphs = flce_graphs
        self.mlp_recompute = mlp_recompute
        #: an RMSNorm whose output is below 16 MiB, on a GPU where torch has a fused RMSNorm kernel,
        #: runs that op (one C++ call forward and backward; Gemma's casting in fp32 with native's
        #: casts around it) instead of our Triton kernel: the host time a small step waits for
        #: (``shims/rms_norm.py``)
        self.rms_norm_small_torch = rms_norm_small_torch
        #: an eager gated MLP on a GPU whose activation ``act(gate) * up`` is below 64 MiB runs its
        #: native forward: the host time a small step waits for, where the kernel's launch and
        #: autograd Function cost more than the GPU time it saves (``shims/gated_mlp.py``)
        self.mlp_small_native = mlp_small_native
        #: a decode step (no grad, one position per sequence) runs the RMSNorm, RoPE and MLP natively
        self.decode_native = decode_native
        #: where no Triton kernel runs (CPU tensors without the interpreter), the RMSNorm, RoPE and
        #: MLP run transformers' own code and a small fused loss plain torch ops; off: the kernels'
        #: torch references (:func:`liger_compat.kernels._dispatch.reference_only`)
        self.cpu_native = cpu_native
        #: where a setting came from, for the report (absent: the default)
        self.source: dict[str, str] = {} if source is None else source


def _from_env(environ: Any = None) -> Settings:
    env = os.environ if environ is None else environ
    s = Settings()
    for spec in SETTINGS:
        raw = env.get(spec.env)
        if raw is None:
            continue
        if spec.attr in _ONOFF_ATTRS or spec.attr == "kernels":
            # used at import or on every call: a bad value is reported and ignored, never breaks the import
            try:
                value: Any = parse_kernels(raw) if spec.attr == "kernels" else parse_bool(raw, spec.env)
            except ValueError as exc:
                s.source[spec.attr] = f"default ({exc}; ignored)"
                continue
        elif not raw.strip():
            continue  # set but empty: the default
        else:
            # a bad value raises when the kernel runs, not here
            value = raw.strip().lower() if spec.attr == "flce_mode" else raw
        setattr(s, spec.attr, value)
        s.source[spec.attr] = spec.env
    return s


settings: Settings = _from_env()


def off_reason(source: dict[str, str] | None = None, word: str = "off") -> str:
    """While ``settings.disabled``: what turned liger_compat off, in words, for the report
    (``source``: where each setting came from, default this process's ``settings.source``)."""
    source = settings.source if source is None else source
    by = "configure(enabled=False)" if source.get("disabled") == "configure()" else "LIGER_COMPAT_DISABLE=1"
    return f"liger_compat is {word} ({by}): nothing is patched, every library runs natively"


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


def flce_chunk_mib() -> float | None:
    """``settings.flce_chunk_mb`` as a number of MiB (``None`` when unset); a ``ValueError`` naming
    ``LIGER_COMPAT_FLCE_CHUNK_MB`` for anything but a positive number."""
    value = str(settings.flce_chunk_mb).strip()
    if not value:
        return None
    try:
        mib = float(value)
    except ValueError:
        mib = float("nan")
    if not mib > 0 or mib == float("inf"):
        raise ValueError(f"LIGER_COMPAT_FLCE_CHUNK_MB must be a positive number of MiB, "
                         f"got {settings.flce_chunk_mb!r}")
    return mib


def check_flce_logits(value: object, name: str = "LIGER_COMPAT_FLCE_LOGITS") -> str:
    """``value`` if it is one of :data:`FLCE_LOGITS`, else a ``ValueError`` naming ``name``."""
    if value not in FLCE_LOGITS:
        raise ValueError(f"{name} must be one of {', '.join(FLCE_LOGITS)}, got {value!r}")
    return value  # type: ignore[return-value]


def flce_logits() -> str:
    """``settings.flce_logits``, checked: one of :data:`FLCE_LOGITS`."""
    return check_flce_logits(settings.flce_logits)


def mlp_recompute_parts() -> frozenset[str]:
    """The parts ``settings.mlp_recompute`` names (``1``/``all``: both, ``0``/``none``: neither);
    a ``ValueError`` naming ``LIGER_COMPAT_MLP_RECOMPUTE`` for anything else."""
    raw = settings.mlp_recompute
    key = (type(raw), raw)
    parts = _mlp_parts.get(key)  # parsed once per value: the MLP asks on every call
    if parts is not None:
        return parts
    value = str(raw).strip().lower()
    if value in TRUE_VALUES or value == "all":
        parts = frozenset(MLP_RECOMPUTE_PARTS)
    elif value in FALSE_VALUES or value == "none":
        parts = frozenset()
    else:
        parts = frozenset(p.strip() for p in value.split(",") if p.strip())
        if not parts <= set(MLP_RECOMPUTE_PARTS):
            raise ValueError(f"LIGER_COMPAT_MLP_RECOMPUTE must be 1, 0, or names from "
                             f"{', '.join(MLP_RECOMPUTE_PARTS)}; got {raw!r}")
    if not compiling():  # a cache entry made while torch.compile traces fails the next call's guards
        _mlp_parts[key] = parts
    return parts


def compiling() -> bool:
    """True while TorchDynamo traces (``torch.compiler.is_compiling``; False before torch is imported
    and on a torch without it). The package's one test for it: the kernels call their custom ops
    then, and no cache is written then (an entry made while tracing fails the next call's guards,
    which compiles again). It runs several times in every module call: ``is_compiling`` is looked up
    once, on the first call that finds it answering False (never while tracing)."""
    global _is_compiling
    fn = _is_compiling
    if fn is not None:
        return fn()
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    is_compiling = getattr(compiler, "is_compiling", None)
    try:
        now = bool(is_compiling is not None and is_compiling())
    except Exception:  # pragma: no cover - a torch whose is_compiling fails outside a trace
        return False
    if is_compiling is not None and not now:
        _is_compiling = is_compiling
    return now


#: ``torch.compiler.is_compiling`` once :func:`compiling` has found it (None before torch is imported)
_is_compiling: Any = None


_mlp_parts: dict[tuple, frozenset[str]] = {}
for _value in ("1", "0", "true", "false", "yes", "no", "on", "off", "", "all", "none", "activation", "input",
               "activation,input", "input,activation"):  # the common values, parsed before anything traces
    settings.mlp_recompute, _saved = _value, settings.mlp_recompute
    try:
        mlp_recompute_parts()
    finally:
        settings.mlp_recompute = _saved
del _value, _saved


def return_logits() -> bool:
    """``settings.return_logits``: whether the fused loss returns the logits when the call does not say."""
    return bool(settings.return_logits)


#: ``os.environ``'s own store and its key for ``TRITON_INTERPRET`` (CPython keeps the encoded
#: variables in ``_data``; None where it does not, and the mapping is read instead)
_ENV_STORE: Any = getattr(os.environ, "_data", None)
if not isinstance(_ENV_STORE, dict):  # pragma: no cover - not CPython's os.environ
    _ENV_STORE = None
try:
    _INTERPRET_KEY: Any = os.environ.encodekey("TRITON_INTERPRET")  # type: ignore[attr-defined]
except (AttributeError, TypeError):  # pragma: no cover - not CPython's os.environ
    _ENV_STORE = None
_interpret_values: dict[Any, bool] = {}


def triton_interpret() -> bool:
    """True when ``TRITON_INTERPRET`` (read now, on every call) asks for Triton's CPU interpreter.

    Read on every module call of a step, so read cheaply: one lookup in ``os.environ``'s store (its
    value parsed once per distinct value), not the mapping's Python-level ``get``."""
    if _ENV_STORE is None:
        raw = os.environ.get("TRITON_INTERPRET")
        return raw is not None and raw.strip().lower() in TRUE_VALUES
    raw = _ENV_STORE.get(_INTERPRET_KEY)
    if raw is None:
        return False
    on = _interpret_values.get(raw)
    if on is None:
        text = os.environ.decodevalue(raw) if hasattr(os.environ, "decodevalue") else str(raw)  # type: ignore[attr-defined]
        on = _interpret_values[raw] = text.strip().lower() in TRUE_VALUES
    return on


def describe() -> list[dict[str, str]]:
    """Every setting for the report: ``{"variable", "value", "source"}``, the value as checked
    (``invalid (...)`` when it would raise) and the source ``default``, the variable, or the
    call that set it."""
    rows = []
    for spec in SETTINGS:
        try:
            value = _shown(spec.attr)
        except ValueError as exc:
            value = f"invalid ({exc})"
        rows.append({"variable": spec.env, "value": value, "source": settings.source.get(spec.attr, "default")})
    rows.append({"variable": "TRITON_INTERPRET", "value": "1" if triton_interpret() else "0",
                 "source": "TRITON_INTERPRET" if "TRITON_INTERPRET" in os.environ else "default"})
    return rows


def _shown(attr: str) -> str:
    if attr == "kernels":
        return ",".join(k for k in ALL_KERNELS if k in settings.kernels) or "none"
    if attr in _ONOFF_ATTRS:
        return "1" if getattr(settings, attr) else "0"
    if attr == "flce_mode":
        return flce_mode()
    if attr == "flce_chunk_mb":
        mib = flce_chunk_mib()
        return "unset" if mib is None else f"{mib:g}"
    if attr == "flce_logits":
        return flce_logits()
    parts = mlp_recompute_parts()
    return "+".join(sorted(parts)) or "off"


def check_value(attr: str, raw: str) -> str:
    """``raw``, spelled as the variable of setting ``attr`` would be, checked as it is when used:
    the value in the report's words, or the ``ValueError`` naming the variable. Used to reject a
    bad value before a program starts (``liger-compat run``) rather than when a kernel runs."""
    global settings
    spec = _BY_ATTR[attr]
    if attr == "kernels":
        parse_kernels(raw)
    elif attr in _ONOFF_ATTRS:
        parse_bool(raw, spec.env)
    probe = _from_env({spec.env: raw})
    saved, settings = settings, probe
    try:
        return _shown(attr)
    finally:
        settings = saved
