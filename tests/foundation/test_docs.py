"""The generated sections of the README and docs/ match what the generators produce from committed data."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_performance_section_is_current():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "readme_perf.py"), "--check"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_readme_set_up_commands_match_ci():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = "python -m pytest -q -n 2 tests"
    assert test_cmd in readme
    assert "python3 -m pytest -q -n 2 tests" in ci
    assert "liger-compat check --deep" in readme and "liger-compat check --deep" in ci


# issue, session or run numbers, and result files named after runs: history that belongs in git
_HISTORY = re.compile(r"\b(issue|session)\s*#?\d+|\brun\s*\d+[a-z]?\b|_run_?\d+", re.I)


def _prose_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "benchmarks" / "NOTES.md"] + sorted((ROOT / "docs").glob("*.md"))
    files += sorted((ROOT / "liger_compat").rglob("*.py"))
    files += sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "tools").glob("*.py"))
    files += sorted((ROOT / "benchmarks" / "results").glob("*.md"))
    return files


def test_history_pattern_catches_run_and_issue_numbers():
    for bad in ("(issue 8)", "Issue #3", "session 7's final", "run 12", "Run 16a", "kernels_run16a.md", "e2e_run_9"):
        assert _HISTORY.search(bad), bad
    for fine in ("run-to-run spread", "the same run", "--runs 30", "runs the fused loss", "F1..F5", "rows 2048"):
        assert not _HISTORY.search(fine), fine


def test_docs_and_code_name_no_issue_session_or_run_numbers():
    hits = []
    for f in _prose_files():
        for n, line in enumerate(f.read_text().splitlines(), 1):
            m = _HISTORY.search(line)
            if m:
                hits.append(f"{f.relative_to(ROOT)}:{n}: {m.group(0)!r}")
    assert not hits, "history wording (keep it in git):\n" + "\n".join(hits)


def _results() -> list[Path]:
    return sorted(p for p in (ROOT / "benchmarks" / "results").iterdir() if p.suffix in (".md", ".json"))


def test_every_result_file_names_its_regenerating_command():
    files = _results()
    assert any(p.name == "kernels.json" for p in files) and any(p.name == "e2e.md" for p in files)
    bad = []
    for p in files:
        if p.suffix == ".json":
            data = json.loads(p.read_text())
            cmd = data.get("regenerate") if isinstance(data, dict) else None
        else:
            first = p.read_text().splitlines()[0]
            m = re.match(r"regenerate: `([^`]+)`", first)
            cmd = m and m.group(1)
        if not (isinstance(cmd, str) and ("python -m benchmarks." in cmd or "bash benchmarks/" in cmd)):
            bad.append(p.name)
    assert not bad, f"no `regenerate` command: {bad}"


def test_benchmark_commands_name_the_files_they_write():
    """A benchmark's command writes the file it is in: another name than the script's default is
    given with --name, and the markdown of the same name starts with the same command."""
    files = _results()
    stems = {p.stem for p in files if p.suffix == ".json"}
    defaults = {"benchmarks.kernels": "kernels", "benchmarks.e2e": "e2e", "benchmarks.models_gpu": "models_gpu",
                "benchmarks.e2e_memory": "e2e_memory", "benchmarks.overhead": "overhead",
                "benchmarks.compile_families": "compile_families", "benchmarks.gpu_tests": "gpu_tests",
                "benchmarks.trl_step": "trl_step", "benchmarks.cpu_step": "cpu_step",
                "benchmarks.module_host": "module_host", "benchmarks.host_profile": "host_profile",
                "benchmarks.host_pieces": "host_pieces",
                "benchmarks.skip_analysis": "skip_analysis", "benchmarks.compiled_profile": "compiled_profile",
                "benchmarks.op_launch": "op_launch", "benchmarks.gh_gemm": "gh_gemm",
                "benchmarks.sparse_grads_profile": "sparse_grads_profile",
                "benchmarks.upstream_model_tests": "upstream_model_tests",
                "benchmarks.step_phases": "step_phases", "benchmarks.logprob_precision": "logprob_precision",
                "benchmarks.logprob_rows": "logprob_rows", "benchmarks.kernel_leave_out": "kernel_leave_out"}
    for stem in stems:
        cmd = json.loads((ROOT / "benchmarks" / "results" / f"{stem}.json").read_text())["regenerate"]
        m = re.match(r"python -m (benchmarks\.\w+)", cmd)
        if m is None:  # the multi-GPU script writes several files
            continue
        named = re.search(r"--name (\S+)", cmd)
        assert (named.group(1) if named else defaults[m.group(1)]) == stem, (stem, cmd)
        md = ROOT / "benchmarks" / "results" / f"{stem}.md"
        assert md.read_text().splitlines()[0] == f"regenerate: `{cmd}`", stem


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_readme_and_docs_links_resolve():
    """Every relative link of the README and docs/ names a file that exists and, with ``#``, one of
    its headings."""
    pages = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    assert len(pages) > 5
    bad = []
    for page in pages:
        for link in _links(page.read_text()):
            if re.match(r"[a-z]+:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                bad.append(f"{page.name}: {link} (no such file)")
            elif anchor and anchor not in {_slug(h) for h in re.findall(r"^#+ (.+)$", target.read_text(), re.M)}:
                bad.append(f"{page.name}: {link} (no such heading)")
    assert not bad, bad


def test_link_and_anchor_parsing():
    assert _links("see [a](docs/usage.md#settings) and [b](http://x.org)") == ["docs/usage.md#settings", "http://x.org"]
    assert _slug("Labels outside the vocabulary") == "labels-outside-the-vocabulary"
    assert _slug("trl's LM heads") == "trls-lm-heads"
