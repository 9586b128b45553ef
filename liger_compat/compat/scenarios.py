"""Scenario smoke tests that ``check --deep`` runs on a tiny randomly initialised model.

A scenario reproduces one known situation (F1..F5 and later ones) with the real
installed libraries and says whether liger_compat handles it. The modules of
:data:`SCENARIO_MODULES` register them with :func:`scenario` when the report first asks for
them; the function body imports what it needs.

A scenario function takes a :class:`Context` and returns a short detail string on success,
raises :class:`Skip` when it cannot run here (a library missing, say), and raises anything
else on failure.
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Callable

from .._record import Record
from . import versions


class Skip(Exception):
    """Raised by a scenario that cannot run on this installation; the message says why."""


class Context(Record):
    _fields = ("device", "dtype", "seed")

    def __init__(self, device: str = "cpu", dtype: str = "float32", seed: int = 0) -> None:
        self.device = device
        self.dtype = dtype
        self.seed = seed


class Scenario(Record):
    _fields = ("id", "title", "func", "issue", "requires")

    def __init__(self, id: str, title: str, func: Callable[[Context], str | None], issue: str | None = None,
                 requires: tuple[str, ...] = ()) -> None:
        self.id = id
        self.title = title
        self.func = func
        self.issue = issue
        self.requires = requires


class ScenarioResult(Record):
    _fields = ("id", "title", "issue", "outcome", "detail", "seconds", "extra")

    def __init__(self, id: str, title: str, issue: str | None, outcome: str, detail: str = "", seconds: float = 0.0,
                 extra: dict[str, Any] | None = None) -> None:
        self.id = id
        self.title = title
        self.issue = issue
        self.outcome = outcome  # passed / failed / skipped
        self.detail = detail
        self.seconds = seconds
        self.extra: dict[str, Any] = {} if extra is None else extra

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "issue": self.issue,
            "outcome": self.outcome,
            "detail": self.detail,
            "seconds": round(self.seconds, 3),
        }


_SCENARIOS: dict[str, Scenario] = {}


def scenario(id: str, title: str, *, issue: str | None = None, requires: tuple[str, ...] = ()):
    """Decorator registering a scenario under ``id``."""

    def deco(func: Callable[[Context], str | None]) -> Callable[[Context], str | None]:
        if id in _SCENARIOS:
            raise ValueError(f"scenario id {id!r} registered twice")
        _SCENARIOS[id] = Scenario(id, title, func, issue, tuple(requires))
        return func

    return deco


#: the modules beside this one whose scenarios ``check --deep`` runs
SCENARIO_MODULES = ("scenarios_models", "scenarios_trainers")


def registered() -> list[Scenario]:
    """Every scenario, by id."""
    for name in SCENARIO_MODULES:
        importlib.import_module(f"{__package__}.{name}")
    return sorted(_SCENARIOS.values(), key=lambda sc: sc.id)


def unregister(id: str) -> None:
    _SCENARIOS.pop(id, None)


def run_all(ctx: Context | None = None, progress: Callable[[int, int, Scenario], None] | None = None) -> list[ScenarioResult]:
    ctx = ctx or Context()
    results = []
    items = registered()
    for i, sc in enumerate(items):
        if progress is not None:
            progress(i, len(items), sc)
        missing = [r for r in sc.requires if not versions.installed(r).installed]
        if missing:
            results.append(ScenarioResult(sc.id, sc.title, sc.issue, "skipped", f"needs {', '.join(missing)}"))
            continue
        t0 = time.perf_counter()
        try:
            detail = sc.func(ctx) or ""
            outcome = "passed"
        except Skip as exc:
            detail, outcome = str(exc), "skipped"
        except Exception as exc:
            import traceback  # only when a scenario fails

            tb = traceback.extract_tb(exc.__traceback__)
            where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
            detail, outcome = f"{type(exc).__name__}: {exc}{where}", "failed"
        results.append(ScenarioResult(sc.id, sc.title, sc.issue, outcome, detail, time.perf_counter() - t0))
    return results
