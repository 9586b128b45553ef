"""The benchmarks' own logic: the end-to-end run order and merging of repeats, the kernel timing
rounds (no GPU needed)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

from liger_compat.compat import versions

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


def test_compiled_variants_wrap_the_model_in_torch_compile():
    """The compiled implementations run the step on ``torch.compile(model)`` (compiled lazily, on the
    first step), the others on the model itself; both are selectable and named in the report."""
    import torch

    model = torch.nn.Linear(3, 2)
    for impl in ("native_compiled", "liger_compat_compiled"):
        assert impl in e2e.IMPLS
        run = e2e.step_model(model, impl)
        assert run is not model and run._orig_mod is model
    assert e2e.step_model(model, "liger_compat") is model
    md = e2e._markdown([_row("liger_compat_compiled", 100.0, 10.0, 0), _row("native_compiled", 120.0, 11.0, 0)])
    assert md.count("| m | 4x2048 | liger_compat_compiled |") == 1
    assert "liger_compat_compiled: liger_compat with the model in `torch.compile(model)`" in md


def test_kernel_timing_rounds_rotate_the_order_and_keep_the_median(monkeypatch, tmp_path):
    """benchmarks.kernels_common.measure_rounds (timers replaced: no GPU): every implementation once
    per round, the order rotated by one place per round with ``last`` kept at the end; the row
    holds the median and every round; a failing implementation gives an error row and is not
    timed again."""
    from benchmarks import kernels_common as K
    from benchmarks.kernels_report import _spread

    calls = []
    times = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 7.0, 6.0]), "liger": iter([9.0, 8.0, 10.0])}

    def timer(fn):
        name = fn()
        calls.append(name)
        if name == "bad":
            raise RuntimeError("no kernel")
        return next(times[name])

    monkeypatch.setattr(K, "bench_ms", timer)
    monkeypatch.setattr(K, "extra_peak_mib", lambda fn, pre=(): 12.5)
    monkeypatch.setattr(K, "RESULTS", {"meta": {}, "rows": []})
    monkeypatch.setattr(K, "OUT", tmp_path)
    monkeypatch.setattr(K, "ROUNDS", 3)
    steps = {n: (lambda n=n: n) for n in ("a", "liger", "bad", "b")}
    out = K.measure_rounds("s", "shape", steps, {"a": {"err": 0.1}}, last=("liger",), floor_ms=1.0)
    assert calls == ["a", "bad", "b", "liger", "b", "a", "liger", "b", "a", "liger"]  # [a bad b], [bad b a], [b a bad]
    assert out == {"a": 2.0, "liger": 9.0, "b": 6.0}
    rows = {r["impl"]: r for r in K.RESULTS["rows"]}
    assert rows["a"]["ms_rounds"] == [3.0, 1.0, 2.0] and rows["a"]["err"] == 0.1 and rows["a"]["extra_mib"] == 12.5
    assert rows["b"]["ms_rounds"] == [5.0, 7.0, 6.0] and rows["b"]["floor_ms"] == 1.0
    assert "ms" not in rows["bad"] and "no kernel" in rows["bad"]["error"]
    assert _spread(rows["b"], 2) == "5.00-7.00"


@pytest.mark.parametrize("argv,message", [
    (["--flce-chunks", "mib:512,mib:0"], "'mib:0' not understood"),
    (["--flce-chunks", "rows:1.5"], "'rows:1.5' not understood"),
    (["--sections", "ceilings,flcee"], "unknown 'flcee'"),
    (["--gemm-chunk", "llama3-8b:x"], "--gemm-chunk must be head:rows"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--flce-mib-heads", "llama3-8b,gpt2"], "unknown gpt2"),
])
def test_kernel_benchmark_refuses_bad_arguments_before_touching_a_gpu(capsys, argv, message):
    from benchmarks import kernels as K
    from benchmarks import kernels_common, kernels_flce, kernels_flce_profile, kernels_lowmem

    def state():
        return (kernels_common.OUT, kernels_common.ROUNDS, kernels_flce.FLCE_CHUNK_SETTINGS, kernels_flce.FLCE_MIB_HEADS,
                kernels_flce_profile.FLCE_GEMM_CHUNK, kernels_lowmem.LOWMEM_CONFIGS)

    before = state()
    with pytest.raises(SystemExit) as exc:
        K.main(argv + ["--out", "/nonexistent/never-written"])
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert state() == before


def test_results_name_the_command_that_regenerates_them(tmp_path, capsys):
    """benchmarks._results: the command drops --out (the files' own folder), the JSON leads with it
    (a list of rows becomes {"regenerate", "rows"}), the markdown's first line names it."""
    import json

    from benchmarks import _results

    cmd = _results.command("benchmarks.e2e", ["--out", str(tmp_path), "--impls", "a;b", "--repeats", "2", "--out=x"])
    assert cmd == "python -m benchmarks.e2e --impls 'a;b' --repeats 2"
    rows = [{"impl": "a", "ms": 1.5}, {"impl": "b", "ms": 2.5}]
    _results.write(tmp_path, "e2e_x", rows, "# table\n", cmd)
    data = json.loads((tmp_path / "e2e_x.json").read_text())
    assert list(data) == ["regenerate", "rows"] and data["regenerate"] == cmd and _results.rows(data) == rows
    assert (tmp_path / "e2e_x.md").read_text() == f"regenerate: `{cmd}`\n\n# table\n"
    assert _results.rows(rows) == rows  # a bare list still reads
    _results.write(tmp_path, "o", {"regenerate": "old", "a": 1}, "", "python -m benchmarks.overhead")
    assert json.loads((tmp_path / "o.json").read_text()) == {"regenerate": "python -m benchmarks.overhead", "a": 1}
    capsys.readouterr()


def test_kernel_report_starts_with_the_regenerate_line(monkeypatch):
    from benchmarks import kernels_common as K
    from benchmarks.kernels_report import report

    rows = [{"section": "elementwise", "shape": "s", "impl": "liger_compat", "ms": 1.0, "floor_ms": 0.5,
             "extra_mib": 2.0, "run": "kernels_elementwise.json"}]
    monkeypatch.setattr(K, "RESULTS", {"regenerate": "python -m benchmarks.kernels --sections flce", "meta": {}, "rows": rows})
    md = report()
    assert md.startswith("regenerate: `python -m benchmarks.kernels --sections flce`\n\n# liger_compat kernel benchmark")
    assert "come from kernels_elementwise.json, measured separately" in md
    monkeypatch.setattr(K, "RESULTS", {"meta": {}, "rows": []})
    assert report().startswith("# liger_compat kernel benchmark")


def test_gpu_tests_record_reads_junit_counts_and_failures(tmp_path):
    from benchmarks import gpu_tests

    junit = tmp_path / "j.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.kernels.test_gpu" name="test_a"/>'
        '<testcase classname="tests.kernels.test_gpu" name="test_b"><failure message="assert 1 == 2">tb</failure></testcase>'
        '<testcase classname="tests.kernels.test_gpu" name="test_c"><skipped message="needs CUDA"/></testcase>'
        '<testcase classname="tests.kernels.test_gpu" name="test_d"/>'
        '</testsuite></testsuites>')
    d = gpu_tests.parse_junit(str(junit))
    assert d["counts"] == {"passed": 2, "failed": 1, "error": 0, "skipped": 1}
    assert [(r["test"], r["outcome"], r["detail"]) for r in d["not_passed"]] == [
        ("tests.kernels.test_gpu::test_b", "failed", "assert 1 == 2"),
        ("tests.kernels.test_gpu::test_c", "skipped", "needs CUDA")]
    md = gpu_tests.markdown({"commit": "abc1234", "device": "H100", "torch": "2.11", "triton": "3.6",
                             "transformers": "5.17", **d})
    assert "at commit `abc1234`" in md and "2 passed, 1 failed, 0 errors, 1 skipped" in md
    assert "| `tests.kernels.test_gpu::test_b` | failed | assert 1 == 2 |" in md


def test_trl_step_rejects_bad_arguments(capsys):
    from benchmarks import trl_step

    for argv, words in ((["--impls", "trl,nope"], "unknown implementation 'nope'"),
                        (["--models", "gpt9"], "unknown model 'gpt9'"),
                        (["--shapes", "4by2048"], "is not BATCHxSEQ"),
                        (["--trainers", "sft,ppo"], "unknown trainer 'ppo'"),
                        (["--trainers", "dpo", "--dpo-shapes", "2"], "'2' is not PAIRSxSEQ"),
                        (["--trainers", "dpo", "--dpo-shapes", "2x3"], "SEQ must be at least 4"),
                        (["--steps", "0"], "must be at least 1")):
        with pytest.raises(SystemExit):
            trl_step.main(argv)
        assert words in capsys.readouterr().err


@pytest.mark.slow
def test_trl_step_times_native_and_patched_sft_with_the_same_loss():
    """One CPU step of the tiny model through the benchmark's own SFTTrainer set-up: trl in a fresh
    process that never loads liger_compat, and under liger_compat here; the first logged loss the
    same, and the table built from both rows."""
    import inspect
    import json
    import subprocess

    trl = pytest.importorskip("trl")
    if "max_length" not in inspect.signature(trl.SFTConfig.__init__).parameters:
        pytest.skip(f"trl {trl.__version__}: SFTConfig has no max_length (the benchmark targets trl 0.20+)")
    from benchmarks import trl_step

    import torch

    from liger_compat.compat import known_issues

    env = dict(os.environ)
    if known_issues.by_id("trl-head-on-cpu").applies(cuda=torch.cuda.is_available()):
        env["TRITON_INTERPRET"] = "1"  # trl 1.15.0's own head on CPU runs only through Triton's interpreter
    p = subprocess.run([sys.executable, "-m", "benchmarks.trl_step", "--one", "tiny", "2x16", "trl", "--steps", "1",
                        "--warmup", "1"], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2],
                       env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, p.stderr[-2000:]
    base = json.loads(lines[-1][len("RESULT "):])
    assert base["liger_compat_loaded"] is False
    ours = trl_step._one("tiny", "2x16", "trl_liger_compat", steps=1, warmup=1)
    assert ours["liger_compat_loaded"] is True
    assert base["status"] == ours["status"] == "ok", (base, ours)
    assert base["step_ms"] > 0 and ours["step_ms"] > 0
    assert math.isclose(base["first_loss"], ours["first_loss"], rel_tol=1e-3), (base["first_loss"], ours["first_loss"])
    md = trl_step._markdown([base, ours])
    assert "| tiny | 2x16 | trl | " in md and "| tiny | 2x16 | trl_liger_compat | " in md


@pytest.mark.slow
@pytest.mark.skipif(not versions.matches(versions.installed("trl").raw, ">=1.16"),
                    reason="the benchmark's DPO step is written for trl 1.16 (the GPU machine's); older trl not covered")
def test_trl_step_times_native_and_patched_dpo_with_the_same_loss_and_log_probs():
    """One CPU DPOTrainer step of the tiny model (a reference model beside the policy, a text
    preference dataset trl tokenizes): trl in a fresh process that never loads liger_compat, and
    under liger_compat here; the same first loss and the same summed log-probability of the chosen
    completions (the loss alone is log 2 at the first step, whatever the log-probabilities), and
    a table per trainer built from the rows."""
    import json
    import subprocess

    trl = pytest.importorskip("trl")
    if not hasattr(trl, "DPOConfig"):
        pytest.skip(f"trl {trl.__version__} has no DPOConfig")
    from benchmarks import trl_step

    import torch

    from liger_compat.compat import known_issues

    env = dict(os.environ)
    if known_issues.by_id("trl-head-on-cpu").applies(cuda=torch.cuda.is_available()):
        env["TRITON_INTERPRET"] = "1"  # trl 1.15.0's own head on CPU runs only through Triton's interpreter
    p = subprocess.run([sys.executable, "-m", "benchmarks.trl_step", "--one", "tiny", "2x16", "trl", "--trainer", "dpo",
                        "--steps", "1", "--warmup", "1"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[2], env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, p.stderr[-2000:]
    base = json.loads(lines[-1][len("RESULT "):])
    assert base["liger_compat_loaded"] is False
    ours = trl_step._one("tiny", "2x16", "trl_liger_compat", steps=1, warmup=1, trainer_kind="dpo")
    assert ours["liger_compat_loaded"] is True
    assert base["status"] == ours["status"] == "ok", (base, ours)
    assert base["trainer"] == ours["trainer"] == "dpo" and base["tokens"] == 2 * 2 * 16
    assert base["step_ms"] > 0 and ours["step_ms"] > 0
    assert math.isclose(base["first_loss"], ours["first_loss"], rel_tol=1e-3), (base["first_loss"], ours["first_loss"])
    # 2 x 16 tokens per pair, 8 of them completion (7 words and EOS) under a 512-word vocabulary
    assert -8 * math.log(512) * 1.5 < base["first_logps_chosen"] < -8 * math.log(512) * 0.5, base
    assert math.isclose(base["first_logps_chosen"], ours["first_logps_chosen"], rel_tol=1e-3), (base, ours)
    sft = dict(base, trainer="sft", impl="trl")
    md = trl_step._markdown([sft, base, ours])
    assert "## SFTTrainer" in md and "## DPOTrainer" in md and "| model | pairs x seq |" in md
    dpo_part = md[md.index("## DPOTrainer"):]
    assert "| tiny | 2x16 | trl | " in dpo_part and "| tiny | 2x16 | trl_liger_compat | " in dpo_part


def test_paired_fresh_rows_take_the_median_of_each_process_ratio():
    """--fresh --paired: every process times both sides; the ratio is the median of the processes'
    own ratios (not the ratio of medians taken over different processes)."""
    from benchmarks import models_gpu

    runs = {"native": {"a": [10.0, 20.0, 12.0]}, "patched": {"a": [9.0, 22.0, 6.0]}}
    (row,) = models_gpu._fresh_rows(runs, {}, ["a"], paired=True)
    assert row["ratio"] == pytest.approx(0.9)  # per process 0.9, 1.1, 0.5
    (unpaired,) = models_gpu._fresh_rows(runs, {}, ["a"])
    assert unpaired["ratio"] == pytest.approx(9.0 / 12.0)
    meta = dict(transformers="t", torch="p", gpu="g", batch=2, seq=8, hidden=4, layers=1, vocab=9, fresh=1, steps=5,
                paired=True, rounds=2)
    md = models_gpu.timing_markdown([row], meta)
    assert "1 fresh process, each timing native and patched interleaved (2 rounds of 5 steps a side" in md
    assert "patched slower than native on 0 of 1 families" in md


def test_paired_timing_runs_both_sides_in_fresh_processes_on_cpu(tmp_path):
    """A CPU smoke run of --fresh --paired: one child process per round, both sides timed in it."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-m", "benchmarks.models_gpu", "--device", "cpu", "--seq", "8", "--hidden", "64",
                          "--vocab", "96", "--layers", "1", "--fresh", "1", "--paired", "--steps", "1", "--rounds", "2",
                          "--families", "llama,no_such_family", "--out", str(tmp_path), "--name", "p"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads((tmp_path / "p.json").read_text())
    rows = {r["family"]: r for r in data["rows"]}
    assert data["meta"]["paired"] and len(rows["llama"]["ms_native_runs"]) == 1
    assert rows["llama"]["ms_native"] > 0 and rows["llama"]["ms_patched"] > 0
    assert "skipped" in rows["no_such_family"]
    assert (tmp_path / "p.md").read_text().startswith("regenerate: `python -m benchmarks.models_gpu --device cpu")


def test_alternate_rows_take_the_median_of_the_rounds_ratios_with_an_interval():
    """--alternate: the ratio is the median over every round (of every process) of that round's own
    ratio, and the table names the families whose 95 % interval lies wholly above 1."""
    import random

    from benchmarks import models_gpu
    from benchmarks._stats import median_interval

    rng = random.Random()
    slow = [1.05 + 0.01 * rng.random() for _ in range(20)]  # every round above 1: resolved
    level = [0.9 + 0.2 * rng.random() for _ in range(20)]
    runs = {"native": {"s": [10.0], "l": [10.0]}, "patched": {"s": [10.5], "l": [9.0]},
            "ratio_rounds": {"s": slow, "l": level}}
    rows = {r["family"]: r for r in models_gpu._fresh_rows(runs, {}, ["s", "l"], paired=True)}
    srt = sorted(level)
    assert rows["l"]["ratio"] == pytest.approx((srt[9] + srt[10]) / 2)  # not the 9.0 / 10.0 of the medians
    lo, hi = rows["l"]["ratio_interval"]
    assert (lo, hi) == median_interval(level) and lo <= rows["l"]["ratio"] <= hi
    assert rows["s"]["ratio_interval"][0] > 1.0
    meta = dict(transformers="t", torch="p", gpu="g", batch=2, seq=8, hidden=4, layers=1, vocab=9, fresh=1, steps=1,
                paired=True, rounds=20, alternate=True)
    md = models_gpu.timing_markdown([rows["s"], rows["l"]], meta)
    assert "the sides alternating step by step (20 rounds" in md
    last = md.strip().splitlines()[-1]
    assert last.startswith("patched / native above 1 on ") and last.endswith("its interval wholly above 1 on 1: s")
    assert f"| {lo:.3f}-{hi:.3f} |" in md


def test_alternate_timing_alternates_the_sides_on_cpu(tmp_path):
    """A CPU smoke run of --fresh --paired --alternate: one round's ratio per round, an interval."""
    import json
    import subprocess

    cmd = [sys.executable, "-m", "benchmarks.models_gpu", "--device", "cpu", "--seq", "8", "--hidden", "64",
           "--vocab", "96", "--layers", "1", "--fresh", "1", "--paired", "--alternate", "--rounds", "3",
           "--families", "llama", "--out", str(tmp_path), "--name", "a"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads((tmp_path / "a.json").read_text())
    (row,) = data["rows"]
    assert data["meta"]["alternate"] and data["meta"]["steps"] == 1 and len(row["ratio_rounds"]) == 3
    lo, hi = row["ratio_interval"]
    assert lo <= row["ratio"] <= hi and lo > 0
    bad = subprocess.run(cmd[:-4] + ["--fresh", "0"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--alternate needs --fresh N --paired" in bad.stderr


def test_host_profile_writes_its_table_and_profiles_on_cpu(tmp_path):
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-m", "benchmarks.host_profile", "--device", "cpu", "--hidden", "64", "--vocab",
                          "96", "--seq", "8", "--steps", "2", "--rounds", "2", "--families", "llama", "--out",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    (row,) = json.loads((tmp_path / "host_profile.json").read_text())["rows"]
    assert row["family"] == "llama" and row["step_ms_native"] > 0 and row["step_ms_patched"] > 0
    assert row["ratio"] == pytest.approx(row["step_ms_patched"] / row["step_ms_native"])
    for side in ("native", "patched"):  # the collector's part: counts per generation, times with it off
        assert len(row[f"gc_per_step_{side}"]) == 3 and min(row[f"gc_per_step_{side}"]) >= 0
        assert row[f"step_ms_nogc_{side}"] > 0 and row[f"host_ms_nogc_{side}"] > 0
    text = (tmp_path / "host_profile_llama.txt").read_text()
    assert text.startswith("regenerate: `python -m benchmarks.host_profile --device cpu")
    assert "cProfile of 2 patched steps" in text and "torch.profiler, native" in text
    md = (tmp_path / "host_profile.md").read_text()
    assert "| llama | 2x8 |" in md


def test_host_pieces_times_module_forwards_and_our_entry_points_on_cpu(tmp_path):
    """The pieces' table on CPU (the shims forced onto the kernels' torch references): the native
    RMSNorm's forward on one side, our RMSNorm entry on the other, each called as often as the model
    has norms; inclusive times nest (a decoder layer holds its norms); and every wrapper is removed."""
    import json
    import subprocess

    env = {**os.environ, "LIGER_COMPAT_CPU_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-m", "benchmarks.host_pieces", "--device", "cpu", "--hidden", "64", "--vocab",
                          "96", "--seq", "8", "--rounds", "2", "--families", "llama", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads((tmp_path / "host_pieces.json").read_text())
    assert data["regenerate"].startswith("python -m benchmarks.host_pieces --device cpu")
    (row,) = data["rows"]
    native, patched = row["native"]["pieces"], row["patched"]["pieces"]
    norms = 2 * 2 + 1  # two per layer and the final one
    assert native["class LlamaRMSNorm"]["calls"] == norms and patched["class LlamaRMSNorm"]["calls"] == norms
    assert patched["rms_norm: kernel entry"]["calls"] == norms and "rms_norm: kernel entry" not in native
    assert patched["causal LM: loss"]["calls"] == 1 and patched["loss: fused_linear_cross_entropy"]["calls"] == 1
    for side in (native, patched):
        assert side["class LlamaDecoderLayer"]["us"] < side["class LlamaModel"]["us"] < side["class LlamaForCausalLM"]["us"]
    for side in ("native", "patched"):
        assert row[side]["forward_us"] > 0 and row[side]["backward_us"] > 0
    md = (tmp_path / "host_pieces.md").read_text()
    assert md.count("regenerate:") == 1 and "## llama 2x8" in md and "| rms_norm: kernel entry | 5 |" in md
    # the wrappers are gone: a fresh import of the module sees the kernels' own functions
    check = subprocess.run([sys.executable, "-c", "import sys; from benchmarks import host_pieces as h; "
                            "import liger_compat.kernels.norm as n; c = h.Clock(); f = n.check_args; "
                            "c.wrap(n, 'check_args', 'x'); assert n.check_args is not f; c.remove(); "
                            "assert n.check_args is f"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-2000:]


def test_no_script_or_doc_runs_a_benchmark_as_a_file():
    """Run as a file, a benchmark puts ``benchmarks/`` first on ``sys.path``, where ``kernels.py``
    shadows the PyPI ``kernels`` package that transformers probes (an ImportError on every rank of
    a torchrun): every command in the repository runs them as modules (``-m benchmarks.NAME``)."""
    import re

    root = Path(__file__).resolve().parents[2]
    as_file = re.compile(r"\b(python3?|torchrun|torch\.distributed\.run)\b[^\n`]*?\sbenchmarks/\w+\.py")
    found = []
    for path in [*root.glob("*.md"), *root.glob("docs/*.md"), *root.glob("benchmarks/*"), *root.glob(".ci/*")]:
        if path.is_file() and path.suffix in {".md", ".sh", ".py", ""}:
            found += [f"{path.relative_to(root)}: {m.group(0)}" for m in as_file.finditer(path.read_text())]
    assert not found, found


def _random_trace(gen, n_kernels: int):
    """Kernels at integer microseconds, overlapping at times as on two streams, each launched from
    a host op of its own at a random time before it starts (some after the previous kernel's end)."""
    import torch

    events, t = [], 0
    for i in range(n_kernels):
        t += int(torch.randint(0, 30, (1,), generator=gen))
        dur = int(torch.randint(1, 20, (1,), generator=gen))
        lead = int(torch.randint(0, 40, (1,), generator=gen))
        tid = i  # one thread per launch: the ranges of one thread nest, which the other test covers
        events.append({"ph": "X", "cat": "kernel", "name": f"k{i}", "ts": t, "dur": dur, "args": {"correlation": i}})
        events.append({"ph": "X", "cat": "cpu_op", "name": f"op{i}", "ts": t - lead - 1, "dur": 1, "pid": 0, "tid": tid})
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t - lead - 1, "dur": 1,
                       "pid": 0, "tid": tid, "args": {"correlation": i}})
    return events


def test_gpu_gaps_sum_to_the_idle_microseconds_of_the_timeline():
    import torch

    from benchmarks import gpu_gaps

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    for _ in range(20):
        events = _random_trace(gen, int(torch.randint(2, 60, (1,), generator=gen)))
        kernels = [e for e in events if e["cat"] == "kernel"]
        first = min(e["ts"] for e in kernels)
        last = max(e["ts"] + e["dur"] for e in kernels)
        busy = torch.zeros(last - first, dtype=torch.bool)
        for e in kernels:
            busy[e["ts"] - first:e["ts"] + e["dur"] - first] = True
        found = gpu_gaps.gaps(events, min_us=1)
        assert sum(g["us"] for g in found) == int((~busy).sum())
        launch_ts = {e["args"]["correlation"]: e["ts"] for e in events if e["cat"] == "cuda_runtime"}
        for g in found:  # each gap ends where a kernel starts; late: launched after the gap began
            k = next(e for e in kernels if e["name"] == g["next"])
            assert k["ts"] == g["start"] + g["us"] and not busy[g["start"] - first]
            assert g["late"] == (launch_ts[k["args"]["correlation"]] > g["start"])
            assert g["chain"] == [f"op{k['args']['correlation']}"]


def test_gpu_gaps_name_the_ranges_open_at_the_launch_and_the_wait_before_it():
    from benchmarks import gpu_gaps

    def x(cat, name, ts, dur, tid=1, corr=None):
        e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}
        if corr is not None:
            e["args"] = {"correlation": corr}
        return e

    events = [
        x("user_annotation", "phase:step", 0, 200), x("user_annotation", "phase:forward+loss", 5, 100),
        x("cpu_op", "aten::mm", 10, 3), x("cuda_runtime", "cudaLaunchKernel", 11, 1, corr=1),
        x("kernel", "mm_kernel", 20, 20, corr=1),
        x("cpu_op", "aten::item", 41, 20), x("cuda_runtime", "cudaStreamSynchronize", 42, 13),
        x("cpu_op", "MyHead", 65, 30), x("cpu_op", "aten::add", 70, 3), x("cuda_runtime", "cudaLaunchKernel", 71, 1, corr=2),
        x("kernel", "add_kernel", 75, 5, corr=2),
        x("cpu_op", "aten::mul", 150, 2), x("cuda_runtime", "cudaLaunchKernel", 74, 1, corr=3),
        x("kernel", "mul_kernel", 90, 5, corr=3),
        x("cpu_op", "autograd::engine", 100, 50, tid=2), x("cuda_runtime", "cudaLaunchKernel", 120, 1, tid=2, corr=4),
        x("kernel", "bwd_kernel", 130, 5, tid=2, corr=4),
    ]
    found = gpu_gaps.gaps(events, min_us=5)
    assert [(g["start"], g["us"], g["next"]) for g in found] == [(40, 35, "add_kernel"), (80, 10, "mul_kernel"),
                                                                   (95, 35, "bwd_kernel")]
    assert found[0]["chain"] == ["phase:step", "phase:forward+loss", "MyHead", "aten::add"]
    assert found[0]["late"] and found[0]["after_wait"]
    assert not found[1]["late"] and not found[1]["after_wait"]  # launched at 74, before the gap began
    assert found[2]["chain"] == ["autograd::engine"] and found[2]["late"]
    text, summary = gpu_gaps.summarize(events, n_steps=1, min_us=5)
    assert summary["idle_ms"] == pytest.approx(0.080)
    assert summary["by_phase_ms"] == pytest.approx({"forward+loss": 0.045, "outside the phases": 0.035})
    assert "| forward+loss | MyHead > aten::add | 0.035 | 1.0 | 0.035 | 0.035 |" in text
    with pytest.raises(SystemExit):
        gpu_gaps.main(["trace.json", "--steps", "0"])


def test_gpu_gaps_read_a_profilers_trace():
    """``from_profiler`` hands back a real profiler's events (CPU here: host ranges, no device
    activity, so no idle stretch)."""
    import torch

    from benchmarks import gpu_gaps

    x = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("phase:step"):
            (x @ x).sum()
    events = gpu_gaps.from_profiler(prof)
    names = {e.get("name") for e in events if e.get("ph") == "X"}
    assert {"phase:step", "aten::mm"} <= names
    assert gpu_gaps.gaps(events) == []
    assert gpu_gaps.is_wait("cudaMemcpy") and gpu_gaps.is_wait("cudaMemcpy2D")
    assert not gpu_gaps.is_wait("cudaMemcpyAsync") and not gpu_gaps.is_wait("cudaLaunchKernel")


def test_leave_out_interval_is_the_binomial_order_statistics_of_the_median():
    """The median's distribution-free 95 % interval: order statistics k and n + 1 - k with k the
    largest such that P(Binomial(n, 1/2) < k) <= 2.5 %, checked against the binomial sums."""
    import math

    import torch

    from benchmarks import kernel_leave_out

    def below(n, k):  # P(Binomial(n, 1/2) < k)
        return sum(math.comb(n, i) for i in range(k)) / 2 ** n

    for n in range(6, 90):
        xs = (torch.rand(n, dtype=torch.float64) + 0.5).tolist()  # distinct values (torch's seeded generator)
        lo, hi = kernel_leave_out.median_interval(xs)
        srt = sorted(xs)
        k = srt.index(lo) + 1  # 1-based order statistic of the lower end
        assert hi == srt[n - k], n
        assert below(n, k) <= 0.025 < below(n, k + 1), (n, k)
        assert lo <= sorted(xs)[(n - 1) // 2] <= hi
    assert kernel_leave_out.median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few for 95 %: the range


def test_leave_out_pairs_each_side_with_native_round_by_round():
    """A side's ratio is the median of its per-round ratios to native (host drift between rounds
    cancels), not the ratio of the two medians; every side leads one round in each len(sides)."""
    from benchmarks import kernel_leave_out

    row = {"family": "f", "ms_rounds": {"native": [10.0, 20.0, 40.0], "all": [12.0, 21.0, 44.0],
                                         "none": [10.0, 20.0, 40.0]}}
    assert kernel_leave_out.paired(row, "all") == pytest.approx(1.1)  # rounds: 1.2, 1.05, 1.1
    assert sorted(row["ms_rounds"]["all"])[1] / sorted(row["ms_rounds"]["native"])[1] == pytest.approx(1.05)
    names = list(kernel_leave_out.sides_of("llama"))
    assert names[:3] == ["native", "all", "none"] and "without swiglu" in names and "without geglu" not in names
    assert "without geglu" in kernel_leave_out.sides_of("gemma2")
    leads = {kernel_leave_out.rotated(names, r)[0] for r in range(len(names))}
    assert leads == set(names)
    assert all(sorted(kernel_leave_out.rotated(names, r)) == sorted(names) for r in range(10))


def test_leave_out_times_every_side_in_one_fresh_process_on_cpu(tmp_path):
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-m", "benchmarks.kernel_leave_out", "--device", "cpu", "--seq", "8",
                          "--hidden", "64", "--vocab", "96", "--layers", "1", "--rounds", "2", "--families",
                          "llama,gemma2,no_such_family", "--modules", "--out", str(tmp_path), "--name", "lo"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads((tmp_path / "lo.json").read_text())
    rows = {r["family"]: r for r in data["rows"]}
    assert set(rows["llama"]["ms_rounds"]) == {"native", "all", "none", "without fused_linear_cross_entropy",
                                               "without rms_norm", "without rope", "without swiglu"}
    assert all(len(v) == 2 and min(v) > 0 for v in rows["llama"]["ms_rounds"].values())
    phases = rows["llama"]["phases_rounds"]  # every side's phases, one value a round
    assert set(phases) == set(rows["llama"]["ms_rounds"])
    assert all(len(v) == 2 and min(v) >= 0 for side in phases.values() for v in side.values())
    assert all(min(side["forward"]) > 0 and min(side["backward"]) > 0 for side in phases.values())
    assert "without geglu" in rows["gemma2"]["ms_rounds"] and "skipped" in rows["no_such_family"]
    md = (tmp_path / "lo.md").read_text()
    assert md.startswith("regenerate: `python -m benchmarks.kernel_leave_out --device cpu")
    llama_line = next(line for line in md.splitlines() if line.startswith("| llama |"))
    skipped_line = next(line for line in md.splitlines() if line.startswith("| no_such_family |"))
    assert llama_line.count("|") == skipped_line.count("|") == 11 and llama_line.endswith("/ 2 |")
    phase_lines = [line for line in md.splitlines() if line.startswith("| llama | ")][1:]
    assert [line.split(" | ")[1] for line in phase_lines] == ["all", "none"] * 2  # phases, then modules
    mods = rows["llama"]["modules_rounds"]  # per side and round: each module class's forward ms a step
    assert set(mods) == set(rows["llama"]["ms_rounds"]) and all(len(v) == 2 for v in mods.values())
    for side in ("native", "all"):
        for per_round in mods[side]:
            assert per_round["LlamaForCausalLM"] >= per_round["LlamaModel"] >= per_round["LlamaRMSNorm"] > 0
    assert rows["llama"]["host_syncs"] == {s: {} for s in rows["llama"]["ms_rounds"]}  # CPU: none counted


def test_leave_out_compiled_gives_each_side_its_own_graph_on_cpu(tmp_path):
    """Under --compile the native and patched sides alternate on one compiled model: each side
    compiles a graph of its own in its warm-up and none is compiled while timing."""
    import json
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "benchmarks.kernel_leave_out", "--device", "cpu", "--seq", "8",
                          "--hidden", "64", "--vocab", "96", "--layers", "1", "--rounds", "2", "--families", "llama",
                          "--compile", "default", "--out", str(tmp_path), "--name", "lo"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads((tmp_path / "lo.json").read_text())["rows"][0]
    assert "error" not in row, row.get("error")
    assert set(row["ms_rounds"]) == {"native", "all"}
    assert row["graphs_in_warm_up"]["native"] >= 1 and row["graphs_in_warm_up"]["all"] >= 1
    assert row["graphs_after_warm_up"] == 0
    md = (tmp_path / "lo.md").read_text()
    assert "torch.compile(model, mode='default')" in md and "graphs compiled after the warm-up: 0" in md
