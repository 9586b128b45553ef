"""check() says what is true: shims whose targets are not imported show as waiting (and building the
report imports nothing), the kernel backend is the one the dispatch takes (a Triton that is installed
but does not import runs the torch reference), and ``check()`` as a statement prints the report."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=300)


def test_shims_wait_for_their_targets_and_the_report_imports_none():
    pytest.importorskip("transformers")
    r = _run("""
        import json, sys
        import liger_compat
        from liger_compat.compat import report

        first = report.build()  # what check() returns
        imported = "transformers" in sys.modules
        import transformers

        second = report.build()
        print(json.dumps({"imported_by_check": imported,
                          "before": {s["id"]: [s["state"], s["reason"]] for s in first.shims},
                          "after": {s["id"]: [s["state"], s["reason"]] for s in second.shims},
                          "ok": [first.ok, second.ok], "exit": [first.exit_code, second.exit_code]}))
        """)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["imported_by_check"] is False, "building the report imported transformers"
    for sid in ("transformers.rms_norm", "transformers.fused_causal_lm_forward", "transformers.logits_to_keep"):
        assert d["before"][sid] == ["waiting", "waiting for transformers"], d["before"][sid]
        state, reason = d["after"][sid]
        # transformers imported, no modeling module yet: still waiting, now for those
        assert state == "waiting" and reason.startswith("waiting for ") and "transformers.models." in reason, (
            sid, state, reason)
    assert d["ok"] == [True, True] and d["exit"] == [0, 0]


def _shim_rows(text: str) -> dict[str, list[str]]:
    """The Shims table of a --verbose report: id -> [state, fixes and reason] (wrapped reasons joined)."""
    rows: dict[str, list[str]] = {}
    last = None
    for line in text.split("\nShims\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]:
        if line.startswith("   "):  # a continuation line of the reason
            rows[last][1] += " " + line.strip()
        else:
            last, *rest = line.split(None, 2)
            rows[last] = rest
    return rows


def test_cli_prints_the_table_once_and_shows_waiting_shims():
    """The CLI imports transformers and trl first: the module shims then wait for a modeling module."""
    pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, "-m", "liger_compat", "check", "--verbose"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("Verdict: OK") == 1, r.stdout[-2000:]
    rows = _shim_rows(r.stdout)
    # a shim with no target module imported yet waits for one, and says which; whatever trl imports
    # of transformers' modeling modules, nothing claims "applied" for a patch it has not made
    assert not [sid for sid, (state, rest) in rows.items() if "no target imported" in rest], rows
    waiting = {sid: rest for sid, (state, rest) in rows.items() if state == "waiting"}
    assert all("waiting for " in rest for rest in waiting.values()), waiting
    assert any("waiting for one of" in rest and "transformers." in rest for rest in waiting.values()), rows
    # the default report counts them by state on one line
    short = subprocess.run([sys.executable, "-m", "liger_compat", "check"], capture_output=True, text=True, timeout=600)
    full = subprocess.run([sys.executable, "-m", "liger_compat", "check", "--json"], capture_output=True, text=True,
                          timeout=600)
    states = [s["state"] for s in json.loads(full.stdout)["shims"]]
    counts = ", ".join(f"{states.count(st)} {st}" for st in dict.fromkeys(states))
    assert f"\nShims\n  {len(rows)} shims: {counts}\n" in short.stdout, short.stdout
    j = subprocess.run([sys.executable, "-m", "liger_compat", "check", "--no-import", "--json"], capture_output=True,
                       text=True, timeout=300)
    assert j.returncode == 0 and json.loads(j.stdout)["ok"] is True  # nothing but the JSON on stdout


def test_a_broken_triton_import_on_cuda_is_reported_as_the_torch_reference():
    pytest.importorskip("torch")
    r = _run("""
        import json, sys
        sys.modules["triton"] = None  # `import triton` raises ImportError, as a broken install does
        import torch

        # a CUDA machine as far as torch's queries go
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 1
        torch.cuda.get_device_name = lambda i=0: "Simulated GPU"
        torch.cuda.get_device_capability = lambda i=0: (9, 0)
        from liger_compat.compat import device
        from liger_compat.kernels import _dispatch

        info = device.detect()
        print(json.dumps({"backend": info.kernel_backend, "reason": info.reason,
                          "dispatch": _dispatch.choose("rms_norm", torch.device("cuda"))}))
        """)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["dispatch"] == "torch"
    assert d["backend"] == "transformers' modules + torch loss", d  # LIGER_COMPAT_CPU_NATIVE's default
    assert "import triton" in d["reason"] or "not installed" in d["reason"], d


def test_check_as_a_statement_prints_the_report_and_quiet_does_not():
    bare = _run("""
        import liger_compat

        liger_compat.check()
        """)
    assert bare.returncode == 0, bare.stderr[-3000:]
    assert bare.stdout.count("Verdict: ") == 1 and "\nShims\n" in bare.stdout, bare.stdout[-2000:]
    quiet = _run("""
        import liger_compat

        report = liger_compat.check(quiet=True)
        print(report.ok, report.exit_code, "Verdict: " in str(report))
        """)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert quiet.stdout.split() == ["True", "0", "True"], quiet.stdout[-2000:]
