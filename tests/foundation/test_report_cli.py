"""check() report, the known-issue registry, scenarios and the CLI's exit codes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import liger_compat
from liger_compat.__main__ import main
from liger_compat.compat import known_issues, report, scenarios, versions
from liger_compat.compat.known_issues import KnownIssue
from liger_compat.shims._registry import REGISTRY


def _run(*args: str, env: dict | None = None, code: str | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "liger_compat", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=600)


def test_report_structure_and_text():
    r = liger_compat.check()
    d = r.to_dict()
    assert d["liger_compat"] == liger_compat.__version__
    assert set(d["versions"]) == set(versions.TRACKED)
    assert d["versions"]["torch"] == versions.installed("torch").raw
    assert [i["id"] for i in d["known_issues"]] == [i.id for i in known_issues.KNOWN_ISSUES]
    assert d["scenarios"] is None  # not deep
    assert json.loads(r.to_json()) == json.loads(json.dumps(d))
    text = str(r)
    for heading in ("Installed", "Device", "Shims", "Known issues", "Version matrix", "Verdict"):
        assert heading in text
    assert r.exit_code == (0 if r.ok else 1)


def test_known_issue_applies_follows_installed_versions():
    fake = {"transformers": versions.PackageVersion("transformers", "transformers", "4.48.3"),
            "trl": versions.PackageVersion("trl", "trl", "0.15.2")}
    f3 = known_issues.by_id("F3")
    assert f3.applies(fake)
    fake["transformers"] = versions.PackageVersion("transformers", "transformers", "4.49.0")
    assert not f3.applies(fake)
    fake["trl"] = versions.PackageVersion("trl", "trl", None)
    assert not known_issues.by_id("F1").applies(fake)
    with pytest.raises(KeyError, match="F1"):
        known_issues.by_id("F99")


def test_issue_mitigation_reads_shim_states():
    inst = {"transformers": versions.PackageVersion("transformers", "transformers", "4.48.3")}
    issue = KnownIssue("T1", "t", "f", {"transformers": ">=4.45"}, ("s.a", "s.b"), "u")
    st = report._issue_status(issue, {"s.a": "applied", "s.b": "waiting"}, inst)
    assert st.applies and st.mitigated and not st.unmitigated
    st = report._issue_status(issue, {"s.a": "applied", "s.b": "failed"}, inst)
    assert st.unmitigated and "s.b: failed" in st.detail
    st = report._issue_status(issue, {"s.a": "applied"}, inst)
    assert st.unmitigated and "not registered" in st.detail


@pytest.fixture
def fake_issues(monkeypatch):
    """Replace the known issues with two controlled ones."""
    def install(*issues):
        monkeypatch.setattr(known_issues, "KNOWN_ISSUES", tuple(issues))
    return install


def test_cli_exit_code_0_when_nothing_applies(fake_issues, capsys):
    fake_issues(KnownIssue("T0", "never", "f", {"definitely-not-installed-pkg": ">=0"}, (), "u"))
    assert main(["check", "--no-import"]) == 0
    out = capsys.readouterr().out
    assert "Verdict: OK" in out and "T0" in out


def test_cli_exit_code_1_on_unmitigated_issue(fake_issues, capsys):
    fake_issues(KnownIssue("T1", "always", "f", {"packaging": ">=0"}, ("no.such.shim",), "u"))
    assert main(["check", "--no-import", "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] is False
    assert d["known_issues"][0]["applies"] and not d["known_issues"][0]["mitigated"]


def test_cli_usage_errors_exit_2():
    assert _run("check", "--bogus").returncode == 2
    assert _run("frobnicate").returncode == 2
    assert _run().returncode == 2
    r = _run("check", "--device", "tpu")
    assert r.returncode == 2 and "--device" in r.stderr


def test_deep_runs_scenarios_and_fails_on_a_failing_one(fake_issues, capsys):
    fake_issues()
    calls = []

    @scenarios.scenario("T-pass", "passes", issue="T")
    def _ok(ctx):
        calls.append(ctx.device)
        return "fine"

    @scenarios.scenario("T-skip", "skips")
    def _skip(ctx):
        raise scenarios.Skip("not here")

    @scenarios.scenario("T-need", "needs a missing package", requires=("definitely-not-installed-pkg",))
    def _need(ctx):
        raise AssertionError("must not run")

    try:
        assert main(["check", "--deep", "--no-import", "--device", "cpu"]) == 0
        out = capsys.readouterr()
        assert calls == ["cpu"]
        assert "T-pass" in out.out and "passed" in out.out and "not here" in out.out
        assert "needs definitely-not-installed-pkg" in out.out
        assert "[1/" in out.err  # progress on stderr

        @scenarios.scenario("T-fail", "fails")
        def _bad(ctx):
            raise RuntimeError("boom")

        assert main(["check", "--deep", "--no-import", "--json"]) == 1
        d = json.loads(capsys.readouterr().out)
        failed = [s for s in d["scenarios"] if s["outcome"] == "failed"]
        assert [s["id"] for s in failed] == ["T-fail"] and "boom" in failed[0]["detail"]
    finally:
        for sid in ("T-pass", "T-skip", "T-need", "T-fail"):
            scenarios.unregister(sid)


def test_check_without_transformers_and_trl_reports_them_absent():
    code = textwrap.dedent(
        """
        import importlib.metadata as md, sys, json
        HIDDEN = {"transformers", "trl"}
        real = md.version
        def version(name):
            if name in HIDDEN:
                raise md.PackageNotFoundError(name)
            return real(name)
        md.version = version
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in HIDDEN:
                    raise ImportError(f"{name} hidden by the test")
        sys.meta_path.insert(0, Block())
        from liger_compat.__main__ import main
        rc = main(["check", "--json"])
        print("RC", rc)
        """
    )
    r = _run(code=code)
    assert r.returncode == 0, r.stderr
    body, rc_line = r.stdout.rsplit("RC", 1)
    d = json.loads(body)
    assert d["versions"]["transformers"] is None and d["versions"]["trl"] is None
    assert not any(i["applies"] for i in d["known_issues"])
    assert int(rc_line) == 0


def test_import_does_not_import_torch_or_transformers():
    r = _run(code="import sys, liger_compat; print(sorted(m for m in ('torch','transformers','trl','triton') if m in sys.modules))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_import_imports_no_dependency_and_no_costly_stdlib():
    """``import liger_compat`` stays cheap: it imports none of its dependencies (wrapt is paid for when
    a target library is imported), no dataclasses / logging / traceback of its own, and
    importlib.metadata stays a not-yet-executed module."""
    code = textwrap.dedent(
        """
        import json, sys
        before = set(sys.modules)
        import liger_compat
        md = sys.modules["importlib.metadata"]
        print(json.dumps({
            "added": sorted(set(sys.modules) - before),
            "metadata_was_loaded": "importlib.metadata" in before,
            "metadata_ran": "version" in vars(md),
            "hooks_active": liger_compat._REGISTRY.active,
        }))
        """
    )
    r = _run(code=code)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    added_top = {m.split(".")[0] for m in d["added"]}
    assert added_top & {"wrapt", "torch", "triton", "transformers", "trl", "numpy", "packaging"} == set()
    costly = ("dataclasses", "email", "csv", "zipfile", "socket", "asyncio", "datetime", "logging", "traceback")
    assert [m for m in costly if m in d["added"]] == []
    if not d["metadata_was_loaded"]:  # a .pth file of this environment may have loaded it already
        assert not d["metadata_ran"]
    assert d["hooks_active"]


def test_the_lazy_logger_is_the_package_logger(caplog):
    import logging

    from liger_compat._log import log

    assert log.name == "liger_compat" and log.getEffectiveLevel() == logging.getLogger("liger_compat").getEffectiveLevel()
    with caplog.at_level(logging.WARNING, logger="liger_compat"):
        log.warning("liger_compat: probe %d", 7)
    assert [(r.name, r.getMessage()) for r in caplog.records] == [("liger_compat", "liger_compat: probe 7")]


def test_disable_env_turns_everything_off():
    code = "import liger_compat, json; r = liger_compat.check(quiet=True); print(json.dumps([r.settings['disabled'], liger_compat._REGISTRY.active]))"
    r = _run(code=code, env={"LIGER_COMPAT_DISABLE": "1"})
    assert json.loads(r.stdout) == [True, False]
    r = _run(code=code, env={"LIGER_COMPAT_DISABLE": "0"})
    assert json.loads(r.stdout) == [False, True]


def test_kernels_env_and_configure():
    code = "import liger_compat; print(sorted(liger_compat.check(quiet=True).settings['kernels']))"
    r = _run(code=code, env={"LIGER_COMPAT_KERNELS": "rms_norm, rope"})
    assert r.stdout.strip() == "['rms_norm', 'rope']"
    r = _run(code=code, env={"LIGER_COMPAT_KERNELS": "rms_norm,warp_drive"})
    assert r.returncode == 0  # a bad env var never breaks the import
    with pytest.raises(ValueError, match="warp_drive"):
        liger_compat.configure(kernels="warp_drive")


def test_report_lists_registered_shims():
    ids = {s["id"] for s in liger_compat.check().shims}
    assert ids == {s.id for s in REGISTRY.shims()}


def test_report_shows_the_tuning_settings_in_effect():
    code = ("import liger_compat, json; from liger_compat.compat.report import format_text; r = liger_compat.check(quiet=True); "
            "print(json.dumps(r.settings['tuning'])); print(format_text(r))")
    r = _run(code=code, env={"LIGER_COMPAT_FLCE_CHUNK_MB": "62", "LIGER_COMPAT_MLP_RECOMPUTE": "activation"})
    tuning = json.loads(r.stdout.splitlines()[0])
    assert tuning["LIGER_COMPAT_FLCE_CHUNK_MB"] == "62 MiB"
    assert tuning["LIGER_COMPAT_MLP_RECOMPUTE"] == "activation"
    assert tuning["LIGER_COMPAT_FLCE_LOGITS"] == "auto"
    assert tuning["LIGER_COMPAT_FLCE_MODE"] == "auto"
    assert "tuning: LIGER_COMPAT_FLCE_CHUNK_MB 62 MiB, LIGER_COMPAT_FLCE_LOGITS auto, LIGER_COMPAT_FLCE_MODE auto" in r.stdout
    r = _run(code=code, env={"LIGER_COMPAT_FLCE_MODE": "lowmem"})
    assert json.loads(r.stdout.splitlines()[0])["LIGER_COMPAT_FLCE_MODE"] == "lowmem"
    r = _run(code=code, env={"LIGER_COMPAT_FLCE_MODE": "tiny"})
    assert r.returncode == 0  # reported, not raised
    mode = json.loads(r.stdout.splitlines()[0])["LIGER_COMPAT_FLCE_MODE"]
    assert mode.startswith("invalid") and "'tiny'" in mode
    r = _run(code=code, env={"LIGER_COMPAT_MLP_RECOMPUTE": "bogus"})
    assert r.returncode == 0  # reported, not raised
    tuning = json.loads(r.stdout.splitlines()[0])
    assert tuning["LIGER_COMPAT_MLP_RECOMPUTE"].startswith("invalid")
    assert tuning["LIGER_COMPAT_FLCE_CHUNK_MB"] == "unset (2048 rows, at most 1024 MiB)"
    r = _run(code=code, env={"LIGER_COMPAT_FLCE_CHUNK_MB": "lots"})
    assert r.returncode == 0
    tuning = json.loads(r.stdout.splitlines()[0])
    assert tuning["LIGER_COMPAT_FLCE_CHUNK_MB"].startswith("invalid") and "'lots'" in tuning["LIGER_COMPAT_FLCE_CHUNK_MB"]
    assert tuning["LIGER_COMPAT_MLP_RECOMPUTE"] == "activation+input"


# -- the text report fits a screen; --verbose prints every row; nothing is cut ---------------------

#: the screen the default text report must fit, in lines (with --deep)
SCREEN_LINES = 60


def _families_from_verbose(text: str) -> dict[str, str]:
    """The Model families table of a --verbose report: family -> state (continuation lines joined)."""
    block = text.split("\nModel families\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    rows: dict[str, str] = {}
    last = None
    for line in block:
        if line.startswith("  ") and not line.startswith("   "):
            last, _, state = line.strip().partition(" ")
            rows[last] = state.strip()
        else:
            rows[last] += " " + line.strip()
    return rows


def test_deep_report_fits_a_screen_and_cuts_nothing():
    """``liger-compat check --deep`` on this machine's transformers / trl: at most 60 lines on stdout,
    no cell cut at "…"; every family and shim is still counted."""
    r = _run("check", "--deep", "--device", "cpu")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert len(lines) <= SCREEN_LINES, f"{len(lines)} lines:\n{r.stdout}"
    assert "…" not in r.stdout
    assert r.stdout.count("Verdict: OK") == 1
    d = json.loads(_run("check", "--json").stdout)
    assert f"{len(d['shims'])} shims: " in r.stdout
    # the deep run may see more families than a plain one (a scenario, or peft / liger-kernel, imports
    # a causal LM outside the table, counted as another family)
    families = re.search(r"\n  (\d+) families: ", r.stdout)
    assert families and int(families.group(1)) >= len(d["families"]), r.stdout
    assert "Scenarios (--deep)" in r.stdout and "scenarios in " in r.stdout


def _big_healthy_report() -> report.Report:
    """This process's report with every family patched, every shim applied with a long reason, many
    scenarios passed with long details: the most a healthy set-up shows."""
    r = liger_compat.check(quiet=True)
    fams = {f"family_{i}": "fused forward; rms_norm, gated_mlp, rope" for i in range(80)}
    fams.update({f"OtherForCausalLM{i}": "native forward (family not in the table)" for i in range(20)})
    # families whose fused forward needs a newer transformers (as on a 4.x release): expected, counted
    fams.update({f"vlm_{i}": f"native forward (the fused forward matches the native one from transformers 5.0; "
                             f"not on 4.51.3)" for i in range(12)})
    long = "patched " + ", ".join(f"Family{i}ForCausalLM.forward" for i in range(60))
    shims = [{**s, "state": "applied", "reason": long} for s in r.shims]
    scen = [scenarios.ScenarioResult(f"S{i}", "t", None, "passed", "detail " * 60, 0.5) for i in range(12)]
    return report.Report(**{**{k: getattr(r, k) for k in report.Report.__dataclass_fields__},
                            "families": fams, "shims": shims, "scenarios": scen})


def test_the_report_stays_on_a_screen_however_many_families_and_shims():
    r = _big_healthy_report()
    text = report.format_text(r)
    assert len(text.splitlines()) <= SCREEN_LINES, text
    assert "80 patched (family_0, family_1" in text.replace("\n    ", " ")
    assert "12 passed" in text and "…" not in text
    full = report.format_text(r, verbose=True)
    assert set(_families_from_verbose(full)) == set(r.families)  # every row there, none here
    assert "\n  family_79 " not in text and "\n  OtherForCausalLM0 " not in text  # counted, not listed
    assert "20 other causal LMs" in text
    assert "12 native forward here, fused from transformers 5.0 (vlm_0, vlm_1" in text.replace("\n    ", " ")
    assert "\n  vlm_0 " not in text  # in the summary line, not a row each


def test_verbose_prints_every_family_shim_setting_and_scenario_row(capsys):
    r = liger_compat.check(quiet=True)
    assert main(["check", "--no-import", "--verbose"]) == r.exit_code
    out = capsys.readouterr().out
    families = _families_from_verbose(out)
    assert set(families) == set(r.families)
    assert all(families[k] == v for k, v in r.families.items()), families  # wrapped, not cut
    for s in r.shims:
        assert f"\n  {s['id']} " in out, s["id"]
    for v in r.settings["variables"]:
        assert f"\n  {v['variable']} " in out, v["variable"]
    assert "…" not in out
    import io

    buf = io.StringIO()
    again = liger_compat.check(verbose=True, file=buf)
    assert set(_families_from_verbose(buf.getvalue())) == set(again.families)
    # the default report counts them instead: one line, rows only for those needing attention
    assert main(["check", "--no-import"]) == r.exit_code
    short = capsys.readouterr().out
    assert len(short.splitlines()) < len(out.splitlines())
    assert f"  {len(r.families)} families: " in short and f"  {len(r.shims)} shims: " in short


def test_rows_that_need_attention_are_listed_and_long_cells_wrapped_not_cut():
    reason = "ImportError: " + " ".join(f"word{i}" for i in range(90))
    r = report.Report(
        liger_compat_version="0", python="3", versions={"torch": "2.13.0", "peft": None}, device={},
        settings={"disabled": False, "kernels": [], "source": {}},
        shims=[{"id": "a.ok", "state": "applied", "fixes": [], "reason": "patched A.forward"},
               {"id": "a.broken", "state": "failed", "fixes": ["F9"], "reason": reason},
               {"id": "a.stuck", "state": "reverted", "fixes": [], "reason": "could not remove X.y (another "
                                                                               "library wrapped over it)"}],
        issues=[report.IssueStatus("F9", "a title", True, False, "a.broken: failed")],
        families={"fine": "fused forward; rms_norm", "odd": "native forward (replaced by other_lib) " + reason,
                  "later": "waiting (patched when its modeling module is imported)"},
        matrix={"summary": "m"}, conflicts=[],
        scenarios=[scenarios.ScenarioResult("S1", "t", "F9", "failed", "boom " + reason, 1.0),
                   scenarios.ScenarioResult("S2", "t", None, "passed", "fine", 1.0)])
    for verbose in (False, True):
        text = report.format_text(r, verbose=verbose)
        assert "…" not in text
        flat = " ".join(text.split())
        assert reason in flat  # every word, in order, across the wrapped lines
        assert max(len(line) for line in text.splitlines()) <= 130
        for row in ("a.broken", "a.stuck", "odd", "S1", "NOT MITIGATED"):
            assert f"\n  {row} " in text or f"  {row}  " in text, (verbose, row)
        assert "Verdict: PROBLEMS: F9 not mitigated, scenario S1 failed" in text
    short = report.format_text(r)
    assert "\n  a.ok " not in short and "\n  fine " not in short and "\n  later " not in short and "\n  S2 " not in short
    assert "3 shims: 1 applied, 1 failed, 1 reverted" in short
    assert "3 families: 1 patched (fine), 1 waiting" in short
    assert "2 scenarios in 2.0 s: 1 failed, 1 passed (S2)" in short


def test_disabled_report_says_everything_is_off_and_nothing_waits():
    """LIGER_COMPAT_DISABLE=1, with transformers and trl imported (the CLI imports them): no shim or
    family is "waiting" for an import that will never patch anything."""
    env = {"LIGER_COMPAT_DISABLE": "1"}
    for args in (("check",), ("check", "--verbose")):
        r = _run(*args, env=env)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "waiting" not in r.stdout.lower(), r.stdout
        assert "liger_compat is OFF (LIGER_COMPAT_DISABLE=1): nothing is patched" in r.stdout
        assert "Verdict: OK (liger_compat is off" in r.stdout
    assert "  transformers.fused_causal_lm_forward   " in r.stdout and " disabled " in r.stdout  # --verbose's row
    d = json.loads(_run("check", "--json", env=env).stdout)
    assert {s["state"] for s in d["shims"]} == {"disabled"}
    assert all("liger_compat is off" in s["reason"] for s in d["shims"])
    assert all(v.startswith("off") for v in d["families"].values()), d["families"]
    assert d["ok"] is True
