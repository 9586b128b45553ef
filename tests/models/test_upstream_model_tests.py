"""transformers' own model tests pass the same with liger_compat as without.

``benchmarks/upstream_model_tests.py`` runs the common ``ModelTesterMixin`` of the installed
release's sdist (downloaded from the package index) on tiny Llama and Gemma 2 configs in fresh
pytest processes: natively, patched (``import liger_compat`` first) and on the kernels' path
(``LIGER_COMPAT_CPU_NATIVE=0``: the kernels' torch references run on CPU tensors), every test
seeded by its id and ``LIGER_COMPAT_TEST_SEED`` so that each side draws the same inputs and weights.
No test that passes natively may fail on a patched side, and the kernels side must have run our
kernels.
Its comparison is checked on its own below, on outcomes written for it.
"""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("parameterized")  # the mixin's own import

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import upstream_model_tests as up  # noqa: E402

sys.path.pop(0)


def test_transformers_model_tests_pass_the_same_with_liger_compat():
    # every side draws the same inputs and weights (each test seeded by its id and this seed)
    seed = int(os.environ.get("LIGER_COMPAT_TEST_SEED", "0"))
    report = up.run(["llama", "gemma2"], ["native", "patched", "kernels"], sdist=None, timeout=1200, seed=seed)
    diffs = "\n".join(f"{d['test']}: {d}" for d in report["differences"])
    assert report["regressions"] == [], f"seed {seed}: passes natively, fails patched:\n{diffs}"
    for fam in ("llama", "gemma2"):
        row = report["families"][fam]
        assert "unavailable" not in row, row
        # the mixin ran: 73 of its tests pass natively on these two configs with transformers
        # 4.45.2's mixin, 192 with 5.24.0's
        assert row["counts"]["native"]["passed"] >= 30, (fam, row)
    ran = report["kernels_ran"]["kernels"]
    assert {"rms_norm", "rope", "swiglu", "geglu", "fused_linear_cross_entropy"} <= set(ran), ran
    assert report["no_kernels"] == []


def _junit(path: Path, cases: dict[str, str]) -> Path:
    suite = ET.Element("testsuite")
    for name, state in cases.items():
        case = ET.SubElement(suite, "testcase", classname=f"uptests.test_x_upstream.{name.split('::')[0]}",
                             name=name.split("::")[1])
        if state == "failed":
            ET.SubElement(case, "failure", message=f"AssertionError: {name} broke")
        elif state == "skipped":
            ET.SubElement(case, "skipped", message="not here")
    ET.ElementTree(suite).write(path)
    return path


def test_the_comparison_flags_a_test_that_passes_natively_and_fails_patched(tmp_path):
    native = up.read_junit(_junit(tmp_path / "n.xml", {"T::a": "passed", "T::b": "passed", "T::c": "skipped",
                                                       "T::d": "failed", "T::e": "passed"}))
    patched = up.read_junit(_junit(tmp_path / "p.xml", {"T::a": "passed", "T::b": "failed", "T::c": "passed",
                                                        "T::d": "failed"}))
    assert native["T::d"] == ("failed", "AssertionError: T::d broke") and native["T::c"][0] == "skipped"
    diffs = {d["test"]: d for d in up.compare({"native": native, "patched": patched}, ["native", "patched"])}
    assert set(diffs) == {"T::b", "T::c", "T::e"}
    assert diffs["T::b"]["regression"] and diffs["T::b"]["messages"] == {"patched": "AssertionError: T::b broke"}
    assert diffs["T::e"]["regression"] and diffs["T::e"]["patched"] == "missing"  # not run is not a pass
    assert not diffs["T::c"]["regression"]  # skipped natively, passes patched


def test_a_subtest_failure_is_the_tests_outcome(tmp_path):
    """pytest's junit file can hold a test more than once (its subtests): any failure wins."""
    path = tmp_path / "s.xml"
    suite = ET.Element("testsuite")
    for fail in (False, True, False):
        case = ET.SubElement(suite, "testcase", classname="uptests.m.T", name="t")
        if fail:
            ET.SubElement(case, "failure", message="AssertionError: subtest")
    ET.ElementTree(suite).write(path)
    assert up.read_junit(path) == {"T::t": ("failed", "AssertionError: subtest")}
