"""The version matrix: grid well-formed, tox.ini generated from it, results recorded from real
junit xml, verification_status, README support table."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.version import Version

from liger_compat import matrix
from liger_compat.matrix import grid as grid_mod
from liger_compat.matrix import readme, results, toxgen
from liger_compat.matrix.grid import GridError
from liger_compat.matrix.status import distance, verification_status

ROOT = Path(__file__).resolve().parents[1]
CI_RUN = ROOT / ".ci" / "run"
GRID = matrix.load_grid()
#: the newest pinned cell on the grid's own torch
NEWEST_PINNED = [c for c in GRID.pinned if not c.own_torch][-1]


def _on_installed_torch(cell):
    """The cell as if the grid ran it on the torch this interpreter imports (env_check compares
    the imported torch with the cell's: these tests run on whatever torch their environment has)."""
    import dataclasses

    from liger_compat.compat import versions

    return dataclasses.replace(cell, torch=Version(versions.installed("torch").raw).base_version)


def _raw_grid() -> dict:
    return grid_mod._toml.loads(grid_mod.grid_text())


# -- the grid --------------------------------------------------------------------------------------

def test_every_boundary_has_a_cell_on_each_side():
    assert GRID.boundaries, "grid.toml lists no boundaries"
    assert GRID.uncovered() == []
    for b in GRID.boundaries:
        before = [c.name for c in GRID.pinned if b.before(c)]
        after = [c.name for c in GRID.pinned if not b.before(c)]
        assert before and after, b.id


def test_boundaries_the_shims_handle_are_all_listed():
    # the upstream changes named in the issue: each must be encoded as a boundary at the version
    # verified from the released wheels
    expected = {
        ("transformers", "4.46.1"),  # loss_kwargs / num_items_in_batch (4.46.0 is yanked)
        ("transformers", "4.47.0"),  # FlashAttention kwargs through **kwargs (Llama first)
        ("transformers", "4.49.0"),  # num_logits_to_keep -> logits_to_keep
        ("transformers", "4.50.0"),  # ForCausalLMLoss(shift_labels=)
        ("transformers", "4.51.0"),  # @can_return_tuple
        ("transformers", "4.52.1"),  # num_logits_to_keep alias gone (4.52.0 is yanked)
        ("transformers", "4.53.0"),  # GA division also without num_items_in_batch
        ("transformers", "4.54.0"),  # TransformersKwargs
        ("transformers", "5.0.0"),
        ("transformers", "5.4.0"),  # cache_position removed
        ("transformers", "5.19.0"),  # Trainer.loss_is_scaled_for_ga
        ("transformers", "5.21.0"),  # 2-D logits_to_keep
        ("trl", "0.12.0"),  # processing_class
        ("trl", "0.15.0"),  # token accuracy, GRPO logits_to_keep
        ("trl", "0.16.0"),  # use_liger -> use_liger_kernel
        ("trl", "0.22.0"),  # SFT entropy from outputs.logits
        ("trl", "0.24.0"),  # trl.experimental
        ("trl", "0.26.0"),  # return_token_accuracy / use_token_scaling into the forward
        ("trl", "0.29.0"),  # ORPO/CPO out of the top level
        ("trl", "1.0.0"),
        ("trl", "1.8.0"),  # KTO stable again
        ("trl", "1.15.0"),  # trl's own fused LM head
    }
    have = {(b.package, b.version) for b in GRID.boundaries}
    assert expected <= have, sorted(expected - have)


def test_uncovered_detects_a_missing_side():
    data = _raw_grid()
    # drop every cell older than transformers 4.46: the loss-kwargs boundary loses its "before" side
    # (the newest cell stays: it covers no boundary by number)
    data["cell"] = [c for c in data["cell"] if c.get("newest") or Version(c["transformers"]) >= Version("4.46.0")]
    data["cell"][0].setdefault("labels", [])
    g = grid_mod.parse(data)
    assert any(u.startswith("loss-kwargs") for u in g.uncovered())


def test_cells_are_ordered_distinct_and_explained():
    assert 20 <= len(GRID.cells) <= 30
    names = [c.name for c in GRID.cells]
    assert len(set(names)) == len(names)
    keys = [(Version(c.transformers), Version(c.trl), Version(c.torch)) for c in GRID.pinned]
    assert keys == sorted(keys), "cells must be listed oldest first"
    assert [c.newest for c in GRID.cells] == [False] * (len(GRID.cells) - 1) + [True], "one newest cell, listed last"
    for c in GRID.cells:
        assert len(c.why) > 30, f"{c.name}: say why the cell is there"
    short = {"peft": "peft", "liger-kernel": "liger", "cut-cross-entropy": "cce", "unsloth": "unsloth"}
    for c in GRID.pinned:
        t, r = Version(c.transformers), Version(c.trl)
        base = f"tf{t.major}.{t.minor}-trl{r.major}.{r.minor}"
        # a second cell on the same minor pair names its full transformers release
        full = f"tf{c.transformers}-trl{r.major}.{r.minor}"
        suffix = "".join(f"-{short[d]}" for d in sorted(dict(c.extras), key=list(short).index))
        if c.own_torch:  # a cell of the torch axis names its torch minor
            suffix += "-torch" + ".".join(c.torch.split(".")[:2])
        assert c.name in (base + suffix, full + suffix), c.name


def test_changes_touching_the_fused_loss_are_isolated_by_a_pair_of_cells():
    # each of these has a pair of cells across which it is the only change of the grid, so a
    # failure on one side can be pinned to it
    for bid in ("compute-loss-without-count", "can-return-tuple", "ga-division-without-count", "transformers-kwargs",
                "cache-position-removed", "loss-scaled-for-ga", "logits-to-keep-2d", "trl-fused-lm-head",
                "logits-to-keep", "flash-attn-kwargs"):
        b = next(x for x in GRID.boundaries if x.id == bid)
        pairs = GRID.isolating(b)
        assert pairs, bid
        for before, after in pairs:
            assert b.before(before) and not b.before(after)
    b = next(x for x in GRID.boundaries if x.id == "trl-fused-lm-head")
    assert any(x.transformers == y.transformers for x, y in GRID.isolating(b)), "trl 1.14.2 | 1.15.0 on one transformers"


def test_isolating_rejects_a_pair_with_a_second_change_between():
    # tf4.49-trl0.15 -> tf4.50-trl0.16 crosses the shift_labels loss (4.50) and use_liger (trl 0.16)
    b = next(x for x in GRID.boundaries if x.id == "shift-labels-loss")
    assert (GRID.cell("tf4.49-trl0.15"), GRID.cell("tf4.50-trl0.16")) not in GRID.isolating(b)
    assert all(x is not y for x, y in GRID.isolating(b))


def test_regression_boundary_with_only_needs_an_affected_and_an_unaffected_cell():
    data = _raw_grid()
    data["cell"] = [c for c in data["cell"] if c.get("transformers") != "4.48.0"]
    g = grid_mod.parse(data)
    assert any(u.startswith("compute-loss-without-count") and "on one of 4.47.0, 4.48.0" in u for u in g.uncovered())
    b = next(x for x in GRID.boundaries if x.id == "compute-loss-without-count")
    assert b.has(Version("4.48.0")) and b.has(Version("4.47.0"))
    assert not b.has(Version("4.47.1")) and not b.has(Version("4.48.3")) and not b.has(Version("4.49.0"))


def test_extras_cell_pins_peft_and_liger_kernel():
    cells = [c for c in GRID.pinned if c.extras]
    assert cells
    assert {d for c in cells for d, _ in c.extras} >= {"peft", "liger-kernel"}
    for c in cells:
        assert set(dict(c.extras)) <= set(c.pins())
        # a cell with extras is found only when they are installed at their pins
        assert GRID.find(c.transformers, c.trl, dict(c.extras)) is c
        assert GRID.find(c.transformers, c.trl, {}) is not c


def test_cells_respect_trl_requirements_known_from_metadata():
    # lower/upper bounds copied from the trl wheels' METADATA (see grid.toml header)
    bounds = [("0.12.0", "0.12.2", ">=4.46.0"), ("0.12.2", "0.12.3", "<4.47.0"), ("0.13.0", "0.18.0", ">=4.46.0"),
              ("0.18.0", "0.19.0", ">=4.50.0"), ("0.19.0", "0.20.0", ">=4.51.0"), ("0.20.0", "0.21.0", ">=4.53.2"),
              ("0.21.0", "0.23.0", ">=4.55.0"), ("0.23.0", "0.27.0", ">=4.56.1"), ("0.27.0", "99", ">=4.56.2")]
    from packaging.specifiers import SpecifierSet

    for c in GRID.pinned:
        for lo, hi, spec in bounds:
            if Version(lo) <= Version(c.trl) < Version(hi):
                assert Version(c.transformers) in SpecifierSet(spec), (c.name, spec)
        if Version(c.trl) >= Version("1.0.0"):
            assert Version(c.datasets) >= Version("4.7.0"), c.name
        if Version(c.trl) >= Version("0.19.0"):
            assert Version(c.accelerate) >= Version("1.4.0"), c.name


def test_ci_subset_covers_oldest_newest_and_the_4_48_to_4_50_window():
    ci = GRID.labelled("ci")
    # CI's 90 minutes: at most 4 minutes of tests (-n 2) plus about 2 of install per cell, after the main suite
    assert len(ci) <= 12
    b = next(x for x in GRID.boundaries if x.id == "can-return-tuple")
    assert any(x in ci and y in ci for x, y in GRID.isolating(b)), "CI runs both sides of can-return-tuple"
    b = next(x for x in GRID.boundaries if x.id == "trl-fused-lm-head")
    assert any(x in ci and y in ci for x, y in GRID.isolating(b)), "CI runs both sides of trl's own head"
    for bid in ("trl-fused-lm-head", "logits-to-keep-2d"):  # (and a cell on each side of the 2-D rename)
        b = next(x for x in GRID.boundaries if x.id == bid)
        version = lambda c: Version(getattr(c, b.package) if not c.newest else "999")  # noqa: E731
        assert any(version(c) < Version(b.version) for c in ci) and any(version(c) >= Version(b.version) for c in ci), bid
    assert any(c.extras for c in ci), "the cell with peft and liger-kernel runs in CI"
    assert GRID.cells[0] in ci and NEWEST_PINNED in ci
    # the unpinned newest cell's run is CI's main run: .ci/run installs the newest release of every
    # dependency (torch held) as that cell does, runs the whole suite, and does not repeat it as a cell
    assert not [c.name for c in ci if c.newest]
    install = next(line for line in CI_RUN.read_text().splitlines() if line.startswith("python3 -m pip install"))
    assert "--upgrade --upgrade-strategy eager" in install and f'"torch=={GRID.torch}"' in install, install
    newest_torch = max(GRID.torch_releases, key=Version)
    on_newest_torch = [c for c in ci if c.own_torch and c.torch == newest_torch]
    assert on_newest_torch, "CI runs a cell on the newest torch of the grid"
    assert all(GRID.find(c.transformers, c.trl, dict(c.extras)) in ci for c in on_newest_torch), \
        "... beside its twin on the grid's torch"
    # the 4.48.3-4.50 window (tf4.48.0-trl0.14 is there for a two-release regression, not CI)
    window = [c for c in GRID.pinned if Version("4.48.3") <= Version(c.transformers) < Version("4.51")]
    assert window and all(c in ci for c in window)
    assert any(Version(c.trl).release[:2] == (0, 15) for c in ci if not c.newest)
    assert any(Version(c.trl).release[:2] == (0, 14) for c in ci if not c.newest), "the before-side of trl 0.15"


def test_cells_run_by_ci_are_the_labelled_ones_and_the_newest():
    newest = GRID.cell("newest")
    assert newest.ci and "ci" not in newest.labels  # CI's main run installs what it installs
    assert {c.name for c in GRID.cells if c.ci} == {c.name for c in GRID.labelled("ci")} | {newest.name}
    assert not all(c.ci for c in GRID.pinned)  # some cells only run when someone runs them


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["cell"][0].update(transformers="4.48"), "plain released version"),
    (lambda d: d["cell"][0].update(trl="0.15.0.dev0"), "plain released version"),
    (lambda d: d["cell"][1].update(name=d["cell"][0]["name"]), "duplicate name"),
    (lambda d: d["cell"][0].pop("why"), "missing field 'why'"),
    (lambda d: d["cell"][0].update(name="bad name"), "tox env name"),
    (lambda d: d["boundary"][0].update(package="torch"), "package must be one of"),
    (lambda d: d["cell"][0].update(extra_field=1), "unknown field"),
    (lambda d: d.update(schema=2), "unsupported grid schema"),
    (lambda d: d["cell"][0].update(extras={"torch": "2.13.0"}), "extras may pin"),
    (lambda d: d["cell"][0].update(extras={"peft": "0.21"}), "plain released version"),
    (lambda d: d["cell"][0].update(extras=["peft"]), "extras must be a table"),
    (lambda d: d["boundary"][0].update(only=["4.48.0"]), "first release listed in only"),
    (lambda d: d["boundary"][0].update(fixed="4.48.0"), "unknown field"),
])
def test_grid_validation_names_the_problem(mutate, message):
    data = copy.deepcopy(_raw_grid())
    mutate(data)
    with pytest.raises(GridError, match=message):
        grid_mod.parse(data)


def test_find_matches_releases_only():
    c = GRID.cells[4]
    assert GRID.find(c.transformers, c.trl) is c
    assert GRID.find(c.transformers + ".dev0", c.trl) is c
    assert GRID.find(c.transformers, None) is None
    assert GRID.find("4.48.2", "0.15.2") is None


# -- tox.ini -------------------------------------------------------------------------------------

def test_tox_ini_is_generated_from_the_grid():
    assert (ROOT / "tox.ini").read_text(encoding="utf-8") == toxgen.render(GRID), \
        "tox.ini is stale: run `python -m liger_compat.matrix tox-ini`"
    assert (ROOT / toxgen.CONSTRAINTS).read_text(encoding="utf-8") == toxgen.constraints(GRID)
    files = toxgen.constraint_files(GRID)
    assert len(files) == len(GRID.torch_releases)
    for rel, text in files.items():
        assert (ROOT / rel).read_text(encoding="utf-8") == text, f"{rel} is stale"


def test_tox_ini_envs_pin_each_cell():
    import configparser

    cp = configparser.ConfigParser(interpolation=None)
    cp.read_string((ROOT / "tox.ini").read_text(encoding="utf-8"))
    envs = {s.split(":", 1)[1] for s in cp.sections() if s.startswith("testenv:")}
    assert envs == {c.name for c in GRID.cells}
    assert cp["testenv"]["system_site_packages"] == "true"
    for c in GRID.pinned:
        assert "install_command" not in cp[f"testenv:{c.name}"], "pinned cells use tox's default install"
        deps = cp[f"testenv:{c.name}"]["deps"].split()
        assert sorted(deps) == sorted(f"{k}=={v}" for k, v in c.pins().items())
        labels = cp[f"testenv:{c.name}"].get("labels", "")
        assert ("ci" in labels) == ("ci" in c.labels)
    assert "torch" not in " ".join(cp[s].get("deps", "") for s in cp.sections())
    assert f"torch=={GRID.torch}" in (ROOT / toxgen.CONSTRAINTS).read_text()


def test_tox_ini_check_cli_detects_drift(tmp_path):
    (tmp_path / "liger_compat" / "matrix").mkdir(parents=True)
    run = lambda *a: subprocess.run([sys.executable, "-m", "liger_compat.matrix", "tox-ini", "--root", str(tmp_path), *a],
                                    cwd=ROOT, capture_output=True, text=True)
    assert run("--check").returncode == 1  # nothing there yet
    assert run().returncode == 0
    assert run("--check").returncode == 0
    ini = tmp_path / "tox.ini"
    ini.write_text(ini.read_text().replace("trl==0.15.2", "trl==0.15.1", 1))
    r = run("--check")
    assert r.returncode == 1 and "STALE" in r.stderr


# -- recording real junit xml ----------------------------------------------------------------------

SAMPLE_TESTS = '''
import pytest

def test_ok():
    assert 1 + 1 == 2

@pytest.mark.parametrize("x", [1, 2, 3])
def test_param(x):
    assert x != 3

def test_skip():
    pytest.skip("no gpu")

class TestK:
    def test_in_class(self):
        assert True

@pytest.fixture
def broken():
    raise RuntimeError("setup boom")

def test_setup_error(broken):
    pass

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False
'''


@pytest.fixture(scope="module")
def junit_run(tmp_path_factory) -> Path:
    """Run a tiny real pytest session and return its junit xml."""
    d = tmp_path_factory.mktemp("junit")
    (d / "test_sample.py").write_text(SAMPLE_TESTS)
    xml = d / "junit.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(d / "test_sample.py"),
                        f"--junitxml={xml}"], cwd=d, capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr  # one failure, one error
    return xml


def test_parse_junit_counts_a_real_pytest_run(junit_run):
    res = results.parse_junit(junit_run)
    assert (res["passed"], res["failed"], res["errors"], res["skipped"]) == (4, 1, 1, 2)
    assert res["tests"] == 8
    assert any(f.endswith("test_param[3]") for f in res["failures"])
    assert any("test_setup_error" in f and "(error)" in f for f in res["failures"])
    assert res["date"][:2] == "20"


def test_parse_junit_rejects_garbage(tmp_path):
    bad = tmp_path / "junit.xml"
    bad.write_text("<html>not junit</html>")
    with pytest.raises(results.RecordError, match="testsuite"):
        results.parse_junit(bad)
    bad.write_text("<testsuites><testsuite")
    with pytest.raises(results.RecordError, match="cannot read"):
        results.parse_junit(bad)


def _fake_env(d: Path, grid_cell, **over) -> None:
    d.mkdir(parents=True, exist_ok=True)
    env = {"cell": grid_cell.name, "python": "3.11.7", "pins": grid_cell.pins(), "full_suite": True,
           "versions": {"torch": "2.13.0+cpu", **grid_cell.pins()}}
    env.update(over)
    (d / results.ENV_FILE).write_text(json.dumps(env))


def test_record_merges_results_into_verified_json(tmp_path, junit_run):
    out = tmp_path / "verified.json"
    runs = tmp_path / "matrix-results"
    old, new = GRID.cells[0], NEWEST_PINNED
    _fake_env(runs / new.name, new)
    (runs / new.name / "junit.xml").write_bytes(junit_run.read_bytes())
    _fake_env(runs / "not-a-result", old)  # env.json without junit: pytest never finished
    got, problems = results.record([runs], GRID, out)
    assert list(got) == [new.name]
    assert len(problems) == 1 and "no junit.xml" in problems[0] and old.name in problems[0]
    with pytest.raises(results.RecordError, match="no junit.xml"):  # nothing to record at all
        results.record([runs / "not-a-result"], GRID, tmp_path / "other.json")
    assert not (tmp_path / "other.json").exists()
    data = json.loads(out.read_text())
    entry = data["cells"][new.name]
    assert (entry["transformers"], entry["trl"]) == (new.transformers, new.trl)
    assert (entry["passed"], entry["failed"], entry["skipped"], entry["errors"]) == (4, 1, 2, 1)
    assert entry["versions"]["torch"] == "2.13.0+cpu" and entry["torch"] == "2.13.0"
    # a second record of another cell keeps the first, in grid order
    d2 = tmp_path / "r2" / old.name
    _fake_env(d2, old)
    (d2 / "junit.xml").write_bytes(junit_run.read_bytes())
    results.record([d2], GRID, out)
    assert list(json.loads(out.read_text())["cells"]) == [old.name, new.name]


def test_record_refuses_results_of_other_pins(tmp_path, junit_run):
    c = GRID.cells[3]
    d = tmp_path / c.name
    _fake_env(d, c, pins={**c.pins(), "trl": "0.15.1"})
    (d / "junit.xml").write_bytes(junit_run.read_bytes())
    with pytest.raises(results.RecordError, match="rerun"):
        results.record([d], GRID, tmp_path / "v.json")
    _fake_env(d, c, cell="tf9.9-trl9.9")
    with pytest.raises(results.RecordError, match="not in the grid"):
        results.record([d], GRID, tmp_path / "v.json")
    assert not (tmp_path / "v.json").exists()


def test_record_skips_partial_runs(tmp_path, junit_run):
    c = GRID.cells[2]
    d = tmp_path / "runs" / c.name
    _fake_env(d, c, full_suite=False, pytest_args=["-q", "tests/test_matrix.py"])
    (d / "junit.xml").write_bytes(junit_run.read_bytes())
    with pytest.raises(results.RecordError, match="partial run"):
        results.record([tmp_path / "runs"], GRID, tmp_path / "v.json")


@pytest.mark.parametrize("args, full", [
    (["-q", "tests"], True), (["tests/"], True), (["-q", "-n", "2", "tests"], True), (["tests", "-p", "no:cacheprovider"], True),
    (None, False), ([], False), (["-q", "tests/test_matrix.py"], False), (["tests", "-k", "matrix"], False),
    (["tests", "tests/test_matrix.py"], False), (["tests", "-x"], False), (["tests", "--deselect=tests/a.py::b"], False),
])
def test_full_suite_detection(args, full):
    assert results.full_suite(args) is full


def test_record_cli(tmp_path, junit_run):
    c = NEWEST_PINNED
    _fake_env(tmp_path / "runs" / c.name, c)
    (tmp_path / "runs" / c.name / "junit.xml").write_bytes(junit_run.read_bytes())
    out = tmp_path / "v.json"
    r = subprocess.run([sys.executable, "-m", "liger_compat.matrix", "record", str(tmp_path / "runs"), "--output", str(out)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert c.name in r.stdout and json.loads(out.read_text())["cells"][c.name]["failed"] == 1


def test_env_check_detects_that_the_pins_are_not_what_python_imports(tmp_path):
    # the installed transformers is what it is; a cell pinning something else must be refused
    from liger_compat.compat import versions

    installed = versions.installed("transformers").raw
    other = next(c for c in GRID.cells if c.transformers != installed)
    with pytest.raises(results.RecordError, match="transformers: pinned"):
        results.env_check(other, tmp_path / "out")
    assert not (tmp_path / "out" / results.ENV_FILE).exists()


def test_env_check_checks_the_extras_by_their_installed_distribution(tmp_path, monkeypatch):
    from liger_compat.compat import versions

    cell = _on_installed_torch(next(c for c in GRID.pinned if c.extras))
    # pretend the pair and the extra pins are what is installed, but one extra at another release
    have = {**cell.pins(), cell.extras[0][0]: "0.0.1"}
    monkeypatch.setattr(results, "_dist_version", lambda name: have.get(name, versions.installed(name).raw))
    import importlib

    real_import = importlib.import_module

    def fake_import(name, *a, **k):
        mod = real_import(name, *a, **k)
        if name in results.PACKAGES + results.EXTRA_PINS:
            return type("M", (), {"__version__": have[name], "__file__": mod.__file__})
        return mod

    monkeypatch.setattr(importlib, "import_module", fake_import)
    with pytest.raises(results.RecordError, match=f"{cell.extras[0][0]}: pinned {cell.extras[0][1]}, installed 0.0.1"):
        results.env_check(cell, tmp_path / "out")
    have[cell.extras[0][0]] = cell.extras[0][1]
    env = results.env_check(cell, tmp_path / "out")
    assert env["pins"] == cell.pins() and set(dict(cell.extras)) <= set(env["pins"])


def test_env_check_passes_on_the_installed_pair_if_it_is_a_cell(tmp_path):
    from liger_compat.compat import versions

    cell = GRID.find(versions.installed("transformers").raw, versions.installed("trl").raw, {},
                     versions.installed("torch").raw)
    if cell is None or any(versions.installed(k).raw != v for k, v in cell.pins().items()):
        pytest.skip("installed versions are not exactly a grid cell")
    (tmp_path / "junit.xml").write_text("stale")
    env = results.env_check(cell, tmp_path)
    assert env["cell"] == cell.name and not (tmp_path / "junit.xml").exists()
    written = json.loads((tmp_path / results.ENV_FILE).read_text())
    assert written["pins"] == cell.pins()
    assert len(written["source"]["commit"] or "") == 40


# -- verification_status -------------------------------------------------------------------------

#: the fingerprint of "the code as it is now" in these tests (status/readme take it as an argument)
NOW = {"package": "a" * 64}
OTHER = {"package": "b" * 64, "tests": "c" * 64}


def _result(passed=10, failed=0, skipped=1, errors=0, prints=NOW, commit="abc1234def" + "0" * 30, **extra):
    source = {"commit": commit, "dirty": False}
    if prints is not None:
        source["fingerprint"] = dict(prints)
    return {"passed": passed, "failed": failed, "skipped": skipped, "errors": errors, "date": "2026-11-20T10:00:00",
            "source": source, **extra}


def _status(t, r, v, now=NOW):
    return verification_status(t, r, GRID, v, current=now)


def _verified(**cells):
    return {"schema": 1, "cells": cells}


#: a pinned cell CI runs, and pinned cells on the grid's torch outside CI (their verdicts follow the
#: recorded fingerprint)
CI_CELL = GRID.cell("tf4.48-trl0.15")
OUTSIDE_CI = [c for c in GRID.pinned if not c.ci and not c.own_torch]


def test_status_verified_cell():
    c = GRID.cells[4]
    st = _status(c.transformers, c.trl, _verified(**{c.name: _result()}))
    assert st["verified"] is True and st["state"] == "verified" and st["stale"] is False and st["cell"] == c.name and st["nearest"] is None
    assert st["results"]["passed"] == 10
    assert st["summary"].startswith("verified:") and c.name in st["summary"] and "\n" not in st["summary"]


def test_ci_cell_is_verified_whatever_its_recorded_run():
    c = CI_CELL
    for res in (_result(prints=OTHER), _result(prints=None), _result(failed=2, prints=OTHER)):
        st = _status(c.transformers, c.trl, _verified(**{c.name: res}))
        assert st["verified"] is True and st["state"] == "verified" and st["ci"] is True and st["stale"] is False
        assert st["cell"] == c.name and st["results"] is res and st["nearest"] is None
    st = _status(c.transformers, c.trl, _verified(**{c.name: _result(prints=OTHER)}))
    assert st["summary"] == (f"verified by CI: transformers {c.transformers} + trl {c.trl} is grid cell {c.name}, run "
                             "and passed at every landed commit (last counted: 10 passed, 0 failed, 1 skipped at "
                             "abc1234 2026-11-20)")


def test_ci_cell_without_a_recorded_run_is_verified_with_unknown_counts():
    from liger_compat.matrix.status import nearest_cells

    c = CI_CELL
    st = verification_status(c.transformers, c.trl, GRID, _verified(), current=NOW, torch=c.torch)
    assert st["verified"] is True and st["state"] == "verified" and st["ci"] is True
    assert st["results"] is None and st["recorded_at"] is None
    assert st["summary"].startswith(f"verified by CI: transformers {c.transformers} + trl {c.trl} is grid cell "
                                    f"{c.name}, run and passed at every landed commit (no counts recorded); ")
    # its torch release is verified by it, and it is offered as a verified neighbour
    assert st["torch"]["verified"] is True and c.name in st["torch"]["cells"]
    near = nearest_cells({"transformers": "4.48.4", "trl": c.trl, "torch": c.torch}, GRID, _verified(), NOW)
    assert near[0]["cell"] == c.name and near[0]["state"] == "verified"


def test_cell_outside_ci_is_verified_or_stale_by_its_recorded_fingerprint():
    c = OUTSIDE_CI[0]
    assert not c.ci
    st = _status(c.transformers, c.trl, _verified(**{c.name: _result()}))
    assert st["state"] == "verified" and st["ci"] is False
    assert st["summary"].startswith(f"verified: transformers {c.transformers} + trl {c.trl} is grid cell {c.name} (")
    st = _status(c.transformers, c.trl, _verified(**{c.name: _result(prints=OTHER)}))
    assert st["state"] == "stale" and st["verified"] is False and st["ci"] is False
    st = _status(c.transformers, c.trl, _verified(**{c.name: _result(failed=1)}))
    assert st["state"] == "failing" and st["verified"] is False


def test_status_failing_cell_points_to_nearest_passing_one():
    a, b, far = GRID.cells[4], GRID.cells[5], GRID.pinned[-1]
    v = _verified(**{a.name: _result(failed=2), b.name: _result(), far.name: _result()})
    st = _status(a.transformers, a.trl, v)
    assert st["verified"] is False and st["cell"] == a.name and st["results"]["failed"] == 2
    assert st["nearest"]["cell"] == b.name
    assert "NOT verified" in st["summary"] and b.name in st["summary"]


def test_status_pair_outside_the_grid_gets_nearest():
    names = {c.name: c for c in GRID.cells}
    v = _verified(**{n: _result() for n, c in names.items() if not c.newest})
    st = _status("4.48.1", "0.15.0", v)
    assert st["verified"] is False and st["cell"] is None
    assert st["nearest"]["cell"] == "tf4.48-trl0.15"
    st = _status("5.24.0", "1.17.0", v)
    assert st["nearest"]["cell"] == NEWEST_PINNED.name
    st = _status("4.57.1", None, v)
    assert st["nearest"]["transformers"].startswith("4.57")
    assert "not a grid cell" in st["summary"]


def test_status_unknown_and_unrecorded():
    st = _status(None, None, _verified())
    assert st["verified"] is False and st["cell"] is None and st["nearest"] is None
    assert "not installed" in st["summary"]
    c = OUTSIDE_CI[0]
    st = _status(c.transformers, c.trl, _verified())
    assert st["cell"] == c.name and st["state"] == "not run" and "not run yet" in st["summary"]
    assert GRID.cell(st["nearest"]["cell"]).ci  # nothing recorded: the cells CI runs still speak
    st = _status("not-a-version", "0.15.2", _verified(**{c.name: _result()}))
    assert st["cell"] is None and st["verified"] is False


def test_distance_orders_by_release():
    c = GRID.cell("tf4.48-trl0.15")
    assert distance("4.48.3", "0.15.2", c) == 0
    assert distance("4.48.1", "0.15.2", c) < distance("4.49.0", "0.15.2", c) < distance("5.0.0", "0.15.2", c)


def test_status_with_shipped_files_is_cheap_and_consistent():
    code = textwrap.dedent("""
        import sys, json
        from liger_compat.matrix import verification_status
        st = verification_status("4.48.3", "0.15.2")
        assert not any(m in sys.modules for m in ("torch", "transformers", "trl")), sorted(
            m for m in ("torch", "transformers", "trl") if m in sys.modules)
        print(json.dumps(st))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert {"summary", "verified", "cell", "nearest", "results"} <= set(st)
    assert st["cell"] == "tf4.48-trl0.15"
    shipped = matrix.load_verified()
    assert set(shipped["cells"]) <= {c.name for c in GRID.cells}
    for name, r in shipped["cells"].items():
        cell = GRID.cell(name)
        if cell.newest:  # its releases are those its run installed
            assert (r["transformers"], r["trl"]) == (r["versions"]["transformers"], r["versions"]["trl"])
        else:
            assert (r["transformers"], r["trl"]) == (cell.transformers, cell.trl)
        assert r["tests"] == r["passed"] + r["failed"] + r["skipped"] + r["errors"]


def test_check_report_shows_the_matrix():
    from liger_compat.compat import report, versions

    m = report._matrix(versions.all_installed())
    assert not m["summary"].startswith(("matrix lookup failed", "no version matrix")), m["summary"]
    assert {"verified", "cell", "nearest", "results"} <= set(m)


# -- README support table --------------------------------------------------------------------------

def test_readme_block_rewrite_only_touches_the_block(tmp_path):
    text = f"# Title\n\nintro\n\n{readme.START}\nold table\n{readme.END}\n\n## After\nkeep me\n"
    v = _verified(**{OUTSIDE_CI[0].name: _result(failed=3), NEWEST_PINNED.name: _result(passed=99)})
    new = readme.render(text, GRID, v)
    assert new.startswith("# Title\n\nintro\n\n") and new.endswith(f"{readme.END}\n\n## After\nkeep me\n")
    assert "old table" not in new
    assert "| 5.23.0 | 1.16.0 | 2.13.0 |" in new and "| verified by CI | 99 / 0 / 1 |" in new
    assert "FAILING (3 tests)" in new and "not run yet" in new
    assert readme.is_current(new, GRID, v) and not readme.is_current(text, GRID, v)
    p = tmp_path / "README.md"
    p.write_text(text)
    assert readme.update(p, GRID, v) is True and readme.update(p, GRID, v) is False
    with pytest.raises(readme.ReadmeError):
        readme.render("no markers here", GRID, v)


def test_readme_support_table_is_current():
    assert set(readme.TARGETS) == {"README.md", "docs/version-matrix.md"}
    for rel, full in readme.TARGETS.items():
        text = (ROOT / rel).read_text(encoding="utf-8")
        assert readme.has_markers(text), f"{rel} has no support-table markers"
        assert readme.is_current(text, GRID, matrix.load_verified(), full), \
            f"the support table of {rel} is out of date: run `python -m liger_compat.matrix readme`"


def _table_rows(table: str) -> dict[str, list[str]]:
    """The rows of a support table by tox env, split into columns."""
    return {line.rsplit("`", 2)[1]: line.strip("| ").split(" | ") for line in table.splitlines() if line.endswith("` |")}


def test_readme_tables_do_not_depend_on_the_fingerprint(monkeypatch):
    from liger_compat.matrix import fingerprint

    c = OUTSIDE_CI[0]
    v = _verified(**{c.name: _result(), CI_CELL.name: _result(prints=OTHER)})
    text = f"{readme.START}\n{readme.END}\n"
    for full in (False, True):
        tables = []
        for now in (NOW, OTHER):  # the code as recorded, then other code (an edited test)
            monkeypatch.setattr(fingerprint, "current", lambda with_tests=False, now=now: dict(now))
            tables.append(readme.render(text, GRID, v, full))
        assert tables[0] == tables[1]
        assert "| passed at abc1234 2026-11-20 |" in tables[0] and "| verified by CI |" in tables[0]


def test_readme_states_of_each_kind():
    passed, failing, errors, unrun = OUTSIDE_CI[:4]
    v = _verified(**{passed.name: _result(commit="1234567" + "0" * 33), failing.name: _result(failed=1),
                     errors.name: _result(failed=1, errors=2), CI_CELL.name: _result(failed=4, prints=None)})
    rows = _table_rows(readme.table(GRID, v))
    state = readme.SHORT.index("state")
    assert rows[passed.name][state] == "passed at 1234567 2026-11-20"
    assert rows[failing.name][state] == "FAILING (1 test) at abc1234 2026-11-20"
    assert rows[errors.name][state] == "FAILING (3 tests) at abc1234 2026-11-20"
    assert rows[unrun.name][state] == "not run yet" and rows[unrun.name][state + 1:state + 3] == ["", ""]
    # CI passes it at every landed commit, whatever was recorded; the counts are the recorded ones
    assert rows[CI_CELL.name][state:] == ["verified by CI", "10 / 4 / 1", "abc1234 2026-11-20", f"`{CI_CELL.name}`"]
    assert all(rows[c.name][state] == "verified by CI" for c in GRID.cells if c.ci)
    assert rows["newest"][state] == "verified by CI"  # also when its run was never recorded


def test_readme_rows_are_grouped_by_transformers_series():
    lines = readme.table(GRID, _verified()).splitlines()
    groups = [i for i, line in enumerate(lines) if line.startswith("| **transformers ")]
    assert len(groups) == len({Version(c.transformers).major for c in GRID.pinned}) >= 2
    for start, end in zip(groups, groups[1:] + [len(lines)]):
        cells = [GRID.cell(line.rsplit("`", 2)[1]) for line in lines[start + 1:end] if line.endswith("` |")]
        majors = {Version(c.transformers).major for c in cells if not c.newest}
        assert len(majors) == 1, lines[start]
        assert lines[start].startswith(f"| **transformers {majors.pop()}.")
    assert "and the newest release**" in lines[groups[-1]] and lines[-1].endswith("`newest` |")


def test_docs_table_has_every_column_and_the_readme_fewer():
    v = _verified(**{c.name: _result() for c in GRID.pinned})
    full, short = readme.table(GRID, v, full=True), readme.table(GRID, v)
    header = full.splitlines()[4].strip("| ").split(" | ")
    assert header == list(readme.FULL)
    assert {"transformers", "trl", "torch", "accelerate", "datasets", "also installed", "state", "passed", "failed",
            "skipped", "recorded at", "tox env"} <= set(header)
    assert short.splitlines()[4].strip("| ").split(" | ") == list(readme.SHORT) and len(readme.SHORT) < len(header)
    assert "accelerate" not in readme.SHORT and "CI" not in header  # CI-ness is in the state
    rows = _table_rows(full)
    for c in GRID.pinned:
        assert [rows[c.name][header.index(k)] for k in ("transformers", "trl", "torch", "accelerate", "datasets")] == \
            [c.transformers, c.trl, c.torch, c.accelerate, c.datasets], c.name
        assert rows[c.name][header.index("passed"):header.index("recorded at")] == ["10", "0", "1"]
    assert full.splitlines()[2] == short.splitlines()[2]  # one intro for both


def test_readme_intro_says_what_verified_means():
    intro = readme.table(GRID, _verified()).splitlines()[2]
    assert "*verified by CI*" in intro and "nothing lands unless it passes" in intro and "`.ci/run`" in intro
    assert "every landed commit" in intro and "labelled `ci`" in intro
    assert "python -m liger_compat.matrix record" in intro and "fingerprint" not in intro


def test_readme_cli_rewrites_and_checks_both_tables(tmp_path, capsys):
    from liger_compat.matrix.__main__ import main

    for rel in readme.TARGETS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n\n{readme.START}\nold\n{readme.END}\n")
    assert main(["readme", "--check", "--root", str(tmp_path)]) == 1
    assert main(["readme", "--root", str(tmp_path)]) == 0
    assert main(["readme", "--check", "--root", str(tmp_path)]) == 0
    for rel, full in readme.TARGETS.items():
        assert (tmp_path / rel).read_text() == readme.render(f"# {rel}\n\n{readme.START}\n{readme.END}\n", GRID,
                                                             matrix.load_verified(), full)
    (tmp_path / "docs" / "version-matrix.md").write_text("no markers")
    assert main(["readme", "--root", str(tmp_path)]) == 2


# -- the newest cell: no pins, eager upgrade, versions recorded --------------------------------------

def test_newest_cell_parses_without_release_numbers():
    c = GRID.cell("newest")
    assert c.newest and c.pins() == {}
    assert (c.transformers, c.trl, c.accelerate, c.datasets) == (None, None, None, None)
    assert c not in GRID.pinned and len(GRID.pinned) == len(GRID.cells) - 1
    with pytest.raises(ValueError, match="pins no transformers"):
        c.release("transformers")
    assert c.to_dict()["newest"] is True


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["cell"].append({"name": "n2", "newest": True, "why": "x" * 40}), "already has a newest cell"),
    (lambda d: d["cell"][-1].update(transformers="5.23.0"), "pins nothing; remove transformers"),
    (lambda d: d["cell"][-1].update(newest="yes"), "'newest' must be true or false"),
    (lambda d: d.update(cell=[c for c in d["cell"] if c.get("newest")]), "no \\[\\[cell\\]\\] with pinned releases"),
])
def test_newest_cell_validation(mutate, message):
    data = copy.deepcopy(_raw_grid())
    assert data["cell"][-1].get("newest") is True
    mutate(data)
    with pytest.raises(GridError, match=message):
        grid_mod.parse(data)


def test_newest_cell_covers_no_boundary_and_matches_no_release():
    data = copy.deepcopy(_raw_grid())
    # only the newest cell and the newest pinned one: every boundary lacks a "before" side, and
    # the newest cell (whatever it installs) does not count as one
    data["cell"] = [c for c in data["cell"] if c["name"] in (NEWEST_PINNED.name, "newest")]
    g = grid_mod.parse(data)
    assert {u.split()[0] for u in g.uncovered()} == {b.id for b in g.boundaries}
    # find() only knows pinned cells: a pair past every pin is no cell, even if the newest cell ran on it
    assert GRID.find("99.0.0", "99.0.0") is None
    assert all(GRID.find(c.transformers, c.trl, dict(c.extras), c.torch) is c for c in GRID.pinned)


def test_tox_newest_env_upgrades_eagerly_under_the_torch_constraint():
    import configparser

    cp = configparser.ConfigParser(interpolation=None)
    cp.read_string(toxgen.render(GRID))
    env = cp["testenv:newest"]
    cmd = env["install_command"].split()
    assert cmd[:5] == ["python", "-I", "-m", "pip", "install"]
    assert "--upgrade" in cmd and cmd[cmd.index("--upgrade-strategy") + 1] == "eager"
    assert cmd[-2:] == ["{opts}", "{packages}"]
    assert sorted(env["deps"].split()) == ["accelerate", "datasets", "transformers", "trl"]  # no pins
    assert env["recreate"] == "true"  # never reuse last month's "newest"
    # inherited from [testenv]: system torch reused, held by the constraint file; the package
    # itself (and its test extra) is installed through the same upgrading install_command
    assert "PIP_CONSTRAINT" in cp["testenv"]["set_env"] and cp["testenv"]["extras"] == "test"
    assert "install_command" not in cp["testenv"]


def test_env_check_newest_records_what_it_imported(tmp_path, monkeypatch):
    import importlib.metadata as md

    from liger_compat.matrix import fingerprint

    # whatever this environment has installed counts as new enough (the floor is tested below)
    monkeypatch.setattr(results, "_newest_pins", lambda: {p: "0.0.1" for p in ("transformers", "trl", "accelerate", "datasets")})
    newest = _on_installed_torch(GRID.cell("newest"))
    env = results.env_check(newest, tmp_path, None, ["-q", "tests"])
    written = json.loads((tmp_path / results.ENV_FILE).read_text())
    assert written["newest"] is True and written["pins"] == {} and written["full_suite"] is True
    for pkg in ("transformers", "trl", "accelerate", "datasets", "wrapt", "packaging", "hypothesis", "pytest"):
        assert written["versions"][pkg] == md.version(pkg), pkg
    assert env["imported"]["transformers"]["version"] == md.version("transformers")
    assert written["source"]["fingerprint"] == fingerprint.current(with_tests=True)


def test_env_check_newest_refuses_releases_older_than_the_pins(tmp_path, monkeypatch):
    floor = {"transformers": "99.0.0", "trl": "0.1.0", "accelerate": "0.1.0", "datasets": "0.1.0"}
    monkeypatch.setattr(results, "_newest_pins", lambda: floor)
    with pytest.raises(results.RecordError, match="transformers: the newest cell imported .* older than .* 99.0.0"):
        results.env_check(GRID.cell("newest"), tmp_path / "out")
    assert not (tmp_path / "out" / results.ENV_FILE).exists()


def _newest_env(d: Path, **versions) -> None:
    got = {"transformers": "99.1.0", "trl": "98.2.0", "accelerate": "97.0.0", "datasets": "96.0.0",
           "torch": "2.13.0+cpu", "wrapt": "9.9.9"}
    got.update(versions)
    _fake_env(d, GRID.cell("newest"), newest=True, versions={k: v for k, v in got.items() if v is not None},
              source={"commit": "f" * 40, "dirty": False, "fingerprint": NOW})


def test_record_newest_takes_its_releases_from_the_run(tmp_path, junit_run):
    runs = tmp_path / "runs"
    _newest_env(runs / "newest")
    (runs / "newest" / "junit.xml").write_bytes(junit_run.read_bytes())
    out = tmp_path / "v.json"
    got, problems = results.record([runs], GRID, out)
    assert problems == [] and list(got) == ["newest"]
    entry = json.loads(out.read_text())["cells"]["newest"]
    assert (entry["transformers"], entry["trl"], entry["newest"]) == ("99.1.0", "98.2.0", True)
    assert entry["versions"]["wrapt"] == "9.9.9" and entry["source"]["fingerprint"] == NOW
    # a newest run that did not say what it installed cannot be recorded
    _newest_env(runs / "newest", transformers=None)
    with pytest.raises(results.RecordError, match="without recorded transformers"):
        results.record([runs], GRID, tmp_path / "w.json")


def test_status_and_readme_use_the_newest_cells_recorded_releases():
    rec = _result(passed=77, transformers="99.1.0", trl="98.2.0", newest=True,
                  versions={"transformers": "99.1.0", "trl": "98.2.0", "accelerate": "97.0.0", "datasets": "96.0.0"})
    v = _verified(newest=rec)
    st = _status("99.1.0", "98.2.0", v)
    assert st["cell"] == "newest" and st["verified"] is True and st["results"]["passed"] == 77
    st = _status("99.1.1", "98.2.0", v)  # a later patch release: not the recorded run, but nearest to it
    assert st["cell"] is None and st["nearest"]["cell"] == "newest" and st["nearest"]["transformers"] == "99.1.0"
    assert _status("99.1.0", "98.2.0", _verified())["cell"] is None  # never run: nothing to match
    table = readme.table(GRID, v, full=True)
    row = next(line for line in table.splitlines() if line.endswith("`newest` |"))
    assert row.startswith("| newest (99.1.0) | newest (98.2.0) | 2.13.0 | newest (97.0.0) | newest (96.0.0) | - | "
                          "verified by CI | 77 |")
    row = next(line for line in readme.table(GRID, _verified(), full=True).splitlines() if line.endswith("`newest` |"))
    assert row.startswith("| newest | newest | 2.13.0 | newest | newest | - | verified by CI |  |")


# -- content fingerprints: verified only for the code that ran ------------------------------------

def _copy_package(dst: Path) -> Path:
    import shutil

    from liger_compat.matrix import fingerprint

    shutil.copytree(fingerprint.package_dir(), dst / "liger_compat", ignore=shutil.ignore_patterns("__pycache__"))
    return dst / "liger_compat"


def test_package_fingerprint_follows_code_and_data_not_results(tmp_path):
    from liger_compat.matrix import fingerprint

    pkg = _copy_package(tmp_path)
    base = fingerprint.package_fingerprint(pkg)
    assert base == fingerprint.package_fingerprint() and len(base) == 64  # the copy has the same content
    (pkg / "matrix" / "verified.json").write_text('{"schema": 1, "cells": {}}\n')  # results: not code
    (pkg / "__pycache__").mkdir(exist_ok=True)
    (pkg / "__pycache__" / "junk.py").write_text("x = 1\n")
    (pkg / "notes.txt").write_text("not shipped\n")
    assert fingerprint.package_fingerprint(pkg) == base
    grid = pkg / "matrix" / "grid.toml"
    grid.write_text(grid.read_text() + "\n# a comment\n")
    changed_data = fingerprint.package_fingerprint(pkg)
    assert changed_data != base
    mod = pkg / "compat" / "report.py"
    mod.write_text(mod.read_text() + "\n")
    assert fingerprint.package_fingerprint(pkg) not in (base, changed_data)
    (pkg / "compat" / "report.py").rename(pkg / "compat" / "report2.py")  # same bytes, other path
    renamed = fingerprint.package_fingerprint(pkg)
    (pkg / "compat" / "report2.py").rename(pkg / "compat" / "report.py")
    assert renamed != fingerprint.package_fingerprint(pkg)
    with pytest.raises(FileNotFoundError, match="not a package"):
        fingerprint.package_fingerprint(tmp_path)


def test_tests_fingerprint(tmp_path):
    from liger_compat.matrix import fingerprint

    assert fingerprint.tests_fingerprint(tmp_path / "nowhere") is None  # an installed package has no tests
    assert fingerprint.tests_fingerprint(ROOT / "tests") == fingerprint.current(with_tests=True)["tests"]
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "test_a.py").write_text("def test_a():\n    assert 1\n")
    a = fingerprint.tests_fingerprint(tmp_path / "t")
    (tmp_path / "t" / "test_a.py").write_text("def test_a():\n    assert 2\n")
    assert fingerprint.tests_fingerprint(tmp_path / "t") != a


@pytest.mark.parametrize("source, now, ok", [
    ({"fingerprint": {"package": "p", "tests": "t"}}, {"package": "p", "tests": "t"}, True),
    ({"fingerprint": {"package": "p", "tests": "t"}}, {"package": "p"}, True),  # a user's install: package only
    ({"fingerprint": {"package": "p", "tests": "t"}}, {"package": "p", "tests": None}, True),
    ({"fingerprint": {"package": "p", "tests": "t"}}, {"package": "p", "tests": "u"}, False),
    ({"fingerprint": {"package": "p", "tests": "t"}}, {"package": "q"}, False),
    ({"fingerprint": {"package": "p"}}, {"package": "p", "tests": "t"}, False),  # tests not recorded
    ({"commit": "abc", "dirty": False}, {"package": "p"}, False),  # recorded before fingerprints
    (None, {"package": "p"}, False),
    ({"fingerprint": {"package": "p"}}, {"package": None}, False),
])
def test_fingerprint_matching(source, now, ok):
    from liger_compat.matrix import fingerprint

    assert fingerprint.matches(source, now) is ok


def test_status_verified_only_for_the_recorded_code():
    c = GRID.cell("tf4.53-trl0.20")  # outside CI: its verdict follows the recorded fingerprint
    assert not c.ci
    for res in (_result(prints=OTHER), _result(prints=None)):  # other code; recorded without a fingerprint
        st = _status(c.transformers, c.trl, _verified(**{c.name: res}))
        assert st["verified"] is False and st["stale"] is True and st["state"] == "stale" and st["cell"] == c.name
        assert st["summary"].startswith("stale (recorded at abc1234 2026-11-20): ")
        assert st["recorded_at"] == {"commit": res["source"]["commit"], "date": "2026-11-20T10:00:00"}
    st = _status(c.transformers, c.trl, _verified(**{c.name: _result(prints=OTHER)}), now=dict(OTHER))
    assert st["verified"] is True and st["summary"].startswith("verified: ")
    # a stale cell is named as such, a verified one as verified (cells outside CI, far from those CI runs)
    a, b = GRID.cell("tf4.53-trl0.20"), GRID.cell("tf4.54-trl0.20")
    assert not a.ci and not b.ci
    v = _verified(**{a.name: _result(), b.name: _result(prints=OTHER)})
    st = _status("4.53.9", "0.20.0", v)
    assert st["nearest"]["cell"] == a.name and st["nearest"]["state"] == "verified"
    assert "nearest verified cell: " + a.name in st["summary"]
    st = _status("4.53.9", "0.20.0", _verified(**{a.name: _result(prints=OTHER)}))
    assert st["nearest"]["state"] == "stale" and "nearest passing cell: " + a.name in st["summary"]
    assert "stale (recorded at abc1234" in st["summary"]


def _report_with(matrix_section):
    from liger_compat.compat import report

    return report.Report(liger_compat_version="0", python="3.11", versions={}, device={},
                         settings={"disabled": False, "kernels": [], "source": {}}, shims=[], issues=[],
                         families={}, matrix=matrix_section, conflicts=[])


def test_check_report_verified_line_and_json_follow_the_fingerprint(monkeypatch):
    from types import SimpleNamespace

    from liger_compat.compat import report
    from liger_compat.matrix import fingerprint, status

    c = GRID.cell("tf4.53-trl0.20")  # outside CI
    installed = {"transformers": SimpleNamespace(raw=c.transformers), "trl": SimpleNamespace(raw=c.trl)}
    here = fingerprint.current()  # what check() compares: the installed package, no tests
    assert set(here) == {"package"}
    for prints, state in ((here, "verified"), (OTHER, "stale")):
        monkeypatch.setattr(status, "load_verified", lambda prints=prints: _verified(**{c.name: _result(prints=prints)}))
        m = report._matrix(installed)
        r = _report_with(m)
        lines = str(r).splitlines()
        line = lines[lines.index("Version matrix") + 1].strip()
        data = json.loads(r.to_json())["matrix"]
        assert data["state"] == state and data["verified"] is (state == "verified")
        assert data["recorded_at"]["commit"].startswith("abc1234")
        if state == "verified":
            assert line.startswith(f"verified: transformers {c.transformers} + trl {c.trl} is grid cell {c.name}")
        else:
            assert line.startswith("stale (recorded at abc1234 2026-11-20): ")
            assert "verified" not in line.split(";")[0]  # only the nearest cell is (one CI runs)


def test_check_report_says_verified_by_ci_for_a_cell_ci_runs(monkeypatch):
    from types import SimpleNamespace

    from liger_compat.compat import report
    from liger_compat.matrix import status

    c = CI_CELL
    installed = {"transformers": SimpleNamespace(raw=c.transformers), "trl": SimpleNamespace(raw=c.trl)}
    for recorded in (_verified(**{c.name: _result(prints=OTHER)}), _verified()):
        monkeypatch.setattr(status, "load_verified", lambda recorded=recorded: recorded)
        r = _report_with(report._matrix(installed))
        lines = str(r).splitlines()
        line = lines[lines.index("Version matrix") + 1].strip()
        assert line.startswith(f"verified by CI: transformers {c.transformers} + trl {c.trl} is grid cell {c.name}, "
                               "run and passed at every landed commit (")
        data = json.loads(r.to_json())["matrix"]
        assert data["verified"] is True and data["ci"] is True and data["state"] == "verified"


def test_readme_table_says_what_else_is_installed():
    rows = _table_rows(readme.table(GRID, _verified()))
    assert set(rows) == {c.name for c in GRID.cells}
    extras = readme.SHORT.index("also installed")
    for c in GRID.cells:
        assert rows[c.name][extras] == (", ".join(f"{d} {v}" for d, v in c.extras) or "-"), c.name


# -- the torch axis: cells that install their own torch ----------------------------------------------

TORCH_AXIS = [c for c in GRID.pinned if c.own_torch]


def test_torch_axis_covers_the_newer_torch_releases_on_the_oldest_and_newest_pair():
    newer = [t for t in GRID.torch_releases if Version(t) > Version(GRID.torch)]
    assert newer, "no cell runs on a torch newer than the grid's"
    base = [c for c in GRID.pinned if not c.own_torch]
    for t in newer:
        on_t = [c for c in TORCH_AXIS if c.torch == t]
        assert {(c.transformers, c.trl) for c in on_t} >= {(base[0].transformers, base[0].trl),
                                                            (base[-1].transformers, base[-1].trl)}, t
    for c in TORCH_AXIS:
        # the same pair on the grid's torch: across the two only torch changes
        twin = GRID.find(c.transformers, c.trl, dict(c.extras))
        assert twin is not None and not twin.own_torch and twin.pins() == c.pins() and twin.torch == GRID.torch
        assert GRID.find(c.transformers, c.trl, dict(c.extras), c.torch) is c
        assert GRID.find(c.transformers, c.trl, dict(c.extras), c.torch + "+cu130") is c
        assert c in GRID.on_torch(c.torch) and c not in GRID.on_torch(None)
    assert GRID.find(base[-1].transformers, base[-1].trl, {}, "2.11.0") is None  # no cell on that torch


def test_isolating_pairs_never_mix_torch_releases():
    for b in GRID.boundaries:
        for x, y in GRID.isolating(b):
            assert x.torch == y.torch, (b.id, x.name, y.name)
    # the oldest pair on torch 2.15 and the next pair on the grid's torch differ by one boundary and by torch
    b = next(x for x in GRID.boundaries if x.id == "loss-kwargs")
    assert (GRID.cell("tf4.45-trl0.11-torch2.15"), GRID.cell("tf4.46-trl0.12")) not in GRID.isolating(b)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["cell"][0].update(torch="2.13.0"), "is the grid's own torch"),
    (lambda d: d["cell"][0].update(torch="2.15"), "plain released version"),
    (lambda d: d["cell"][-1].update(torch="2.15.0"), "pins nothing; remove torch"),
    (lambda d: d["cell"].insert(-1, {**d["cell"][-2], "name": "x-torch2.15", "torch": "2.15.0"}), "already a cell"),
    (lambda d: d.update(cell=[c for c in d["cell"] if not (c.get("transformers") == "4.45.2" and "torch" not in c)]),
     "needs the same pair on the grid's torch"),
])
def test_torch_axis_validation(mutate, message):
    data = copy.deepcopy(_raw_grid())
    mutate(data)
    with pytest.raises(GridError, match=message):
        grid_mod.parse(data)


def test_tox_envs_of_the_torch_axis_install_their_own_torch():
    import configparser

    cp = configparser.ConfigParser(interpolation=None)
    cp.read_string(toxgen.render(GRID))
    assert TORCH_AXIS
    for c in GRID.pinned:
        env = cp[f"testenv:{c.name}"]
        assert "system_site_packages" not in env, c.name  # every cell sees what its twin sees
        if not c.own_torch:
            assert "set_env" not in env, c.name  # the system torch, held by the grid's constraint
            continue
        set_env = dict(line.strip().split(" = ", 1) for line in env["set_env"].strip().splitlines()
                       if " = " in line)
        assert "{[testenv]set_env}" in env["set_env"]  # HF_HUB_OFFLINE, MATRIX_RESULTS ... kept
        assert set_env["PIP_CONFIG_FILE"] == "/dev/null"  # a machine-wide torch cap does not hold it back
        path = set_env["PIP_CONSTRAINT"].replace("{tox_root}/", "")
        assert path == toxgen.torch_constraints(c.torch)
        assert f"torch=={c.torch}\n" in (ROOT / path).read_text()
        assert "torch" not in env["deps"]
        assert f"on torch {c.torch}" in env["description"]


def test_record_keeps_the_torch_of_the_run_and_refuses_another(tmp_path, junit_run):
    c = next(x for x in TORCH_AXIS if x.torch == max(GRID.torch_releases, key=Version))
    runs = tmp_path / "runs"
    _fake_env(runs / c.name, c, versions={"torch": c.torch + "+cu130", **c.pins()})
    (runs / c.name / "junit.xml").write_bytes(junit_run.read_bytes())
    got, problems = results.record([runs], GRID, tmp_path / "v.json")
    assert problems == [] and got[c.name]["torch"] == c.torch
    assert json.loads((tmp_path / "v.json").read_text())["cells"][c.name]["torch"] == c.torch
    _fake_env(runs / c.name, c)  # the run imported the grid's torch, not the cell's
    with pytest.raises(results.RecordError, match=f"run on torch 2.13.0\\+cpu, grid cell {c.name} runs on torch {c.torch}"):
        results.record([runs], GRID, tmp_path / "w.json")


def test_env_check_refuses_a_torch_axis_cell_on_another_torch(tmp_path):
    import torch

    c = next(x for x in TORCH_AXIS if Version(x.torch) != Version(torch.__version__.split("+")[0]))
    with pytest.raises(results.RecordError, match=f"torch: cell {c.name} runs on torch {c.torch}, imported"):
        results.env_check(c, tmp_path / "out")


def test_status_prefers_the_cell_on_the_installed_torch_and_says_whether_torch_was_verified():
    axis = next(c for c in TORCH_AXIS if c.transformers == NEWEST_PINNED.transformers and not c.ci)
    v = _verified(**{NEWEST_PINNED.name: _result(passed=11), axis.name: _result(passed=22)})
    st = verification_status(axis.transformers, axis.trl, GRID, v, current=NOW, torch=axis.torch + "+cu130")
    assert st["cell"] == axis.name and st["verified"] and st["results"]["passed"] == 22
    assert st["torch"]["verified"] is True and st["torch"]["cells"] == [axis.name]
    assert st["summary"].endswith(f"; torch {axis.torch}+cu130: verified (1 cell)")
    # the grid's torch: the pair's own cell
    st = verification_status(axis.transformers, axis.trl, GRID, v, current=NOW, torch="2.13.0+cpu")
    assert st["cell"] == NEWEST_PINNED.name and st["torch"]["verified"] is True
    # a torch no cell runs on: the pair's cell on the grid's torch, and torch NOT verified
    st = verification_status(axis.transformers, axis.trl, GRID, v, current=NOW, torch="2.11.0")
    assert st["cell"] == NEWEST_PINNED.name and st["state"] == "verified"
    assert st["torch"]["verified"] is False and st["torch"]["nearest"] == "2.13.0"
    assert f"(its cell runs on torch {GRID.torch})" in st["summary"]
    ci_torch = sorted({c.torch for c in GRID.cells if c.ci} | {axis.torch}, key=Version)
    assert f"torch 2.11.0: NOT verified (no cell runs on it; verified torch releases: {', '.join(ci_torch)})" \
        in st["summary"]
    # a torch release of the grid whose cells have no passing run of this code
    v2 = _verified(**{NEWEST_PINNED.name: _result(), axis.name: _result(prints=OTHER)})
    st = verification_status(axis.transformers, axis.trl, GRID, v2, current=NOW, torch=axis.torch)
    assert st["cell"] == axis.name and st["state"] == "stale" and st["torch"]["verified"] is False
    assert "without a verified cell" in st["torch"]["summary"]
    # without torch, torch is not looked at (as before)
    st = verification_status(axis.transformers, axis.trl, GRID, v, current=NOW)
    assert st["cell"] == NEWEST_PINNED.name and st["torch"] is None and "torch" not in st["summary"]


def test_check_report_looks_at_the_installed_torch(monkeypatch):
    from types import SimpleNamespace

    from liger_compat.compat import report
    from liger_compat.matrix import fingerprint, status

    axis = next(c for c in TORCH_AXIS if c.transformers == NEWEST_PINNED.transformers)
    here = fingerprint.current()
    monkeypatch.setattr(status, "load_verified", lambda: _verified(**{axis.name: _result(prints=here)}))
    installed = {"transformers": SimpleNamespace(raw=axis.transformers), "trl": SimpleNamespace(raw=axis.trl),
                 "torch": SimpleNamespace(raw=axis.torch)}
    m = report._matrix(installed)
    assert m["cell"] == axis.name and m["verified"] is True and m["torch"]["verified"] is True


def test_readme_table_has_a_torch_column():
    table = readme.table(GRID, _verified())
    rows = _table_rows(table)
    assert table.splitlines()[4].split(" | ")[2] == "torch"
    for c in GRID.cells:
        assert rows[c.name][2] == c.torch, c.name
    intro = table.splitlines()[2]
    assert all(t in intro for t in GRID.torch_releases)


def test_pyproject_torch_bounds_follow_the_verified_torch_releases():
    from packaging.requirements import Requirement

    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    deps = grid_mod._toml.loads(text)["project"]["dependencies"]
    spec = next(Requirement(d) for d in deps if Requirement(d).name == "torch").specifier
    newest = Version(max(GRID.torch_releases, key=Version))
    assert all(Version(t) in spec for t in GRID.torch_releases)
    nxt = Version(f"{newest.major}.{newest.minor + 1}.0")
    assert nxt not in spec, f"torch {nxt} was never run: the requirement must stop below it"


def test_the_trl_extra_brings_what_the_oldest_trl_of_the_grid_imports():
    # trl 0.11.4 imports rich without requiring it (tyro brought it before tyro 1.0): a fresh
    # environment of the oldest cells (on any torch) has no rich unless the extra brings it
    from packaging.requirements import Requirement

    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    extra = [Requirement(r) for r in grid_mod._toml.loads(text)["project"]["optional-dependencies"]["trl"]]
    if min(Version(c.trl) for c in GRID.pinned) < Version("0.12.0"):
        assert "rich" in {r.name for r in extra}
