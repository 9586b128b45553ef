"""The end-to-end benchmark's run order and its merging of repeats (no GPU needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import e2e  # noqa: E402


def test_repeats_reverse_the_order_every_other_time():
    order = e2e.run_order(["m"], ["4x2048", "8x4096"], ["a", "b", "c"], 3)
    assert [(s, i, r) for _, s, i, r in order] == [
        ("4x2048", "a", 0), ("4x2048", "b", 0), ("4x2048", "c", 0),
        ("4x2048", "c", 1), ("4x2048", "b", 1), ("4x2048", "a", 1),
        ("4x2048", "a", 2), ("4x2048", "b", 2), ("4x2048", "c", 2),
        ("8x4096", "a", 0), ("8x4096", "b", 0), ("8x4096", "c", 0),
        ("8x4096", "c", 1), ("8x4096", "b", 1), ("8x4096", "a", 1),
        ("8x4096", "a", 2), ("8x4096", "b", 2), ("8x4096", "c", 2),
    ]
    assert e2e.run_order(["m"], ["s"], ["a", "b"], 1) == [("m", "s", "a", 0), ("m", "s", "b", 0)]


def _row(impl, step_ms, peak, repeat, status="ok"):
    r = {"model": "m", "shape": "4x2048", "impl": impl, "tokens": 8192, "status": status, "repeat": repeat}
    if status == "ok":
        r.update(step_ms=step_ms, tokens_per_s=8192 / step_ms * 1e3, peak_gib=peak, first_loss=12.0)
    return r


def test_combine_takes_the_median_over_repeats():
    rows = [_row("a", 100.0, 10.0, 0), _row("b", 90.0, 9.0, 0), _row("b", 80.0, 9.5, 1), _row("a", 120.0, 10.0, 1),
            _row("a", 104.0, 10.25, 2), _row("n", None, None, 0, "OOM"), _row("n", None, None, 1, "OOM")]
    out = {r["impl"]: r for r in e2e.combine(rows)}
    assert list(out) == ["a", "b", "n"]
    assert out["a"]["step_ms"] == 104.0 and out["a"]["repeats_step_ms"] == [100.0, 120.0, 104.0]
    assert out["a"]["tokens_per_s"] == pytest.approx(8192 / 0.104)
    assert out["a"]["peak_gib"] == 10.25 and out["a"]["repeats"] == 3
    assert out["b"]["step_ms"] == 85.0 and out["b"]["tokens_per_s"] == pytest.approx(8192 / 0.085)
    assert out["n"]["status"] == "OOM"
    one = e2e.combine([_row("a", 100.0, 10.0, 0)])
    assert one == [_row("a", 100.0, 10.0, 0)]


def test_markdown_reports_repeats_once_per_implementation():
    rows = [_row("liger_compat", 100.0, 10.0, 0), _row("liger_compat", 110.0, 10.0, 1)]
    md = e2e._markdown(rows)
    assert "2 repeats" in md
    assert md.count("| m | 4x2048 | liger_compat |") == 1 and "| 105.0 |" in md
