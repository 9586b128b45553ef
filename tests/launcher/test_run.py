"""``liger-compat run``: liger_compat in every Python process of a command whose scripts never import it.

Each test runs real processes: the launcher (``python -m liger_compat run``), the command, and the
same command without the launcher as the native reference, on fresh random weights and batches.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import venv
from pathlib import Path

import pytest

from liger_compat import launcher

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCRIPT = HERE / "train_step.py"
LAUNCH = [sys.executable, "-m", "liger_compat", "run"]


def _env(**extra: str) -> dict[str, str]:
    """This test's environment without any LIGER_COMPAT_* setting, liger_compat importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGER_COMPAT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                     if p and p != str(ROOT)])
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: int = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env or _env(), timeout=timeout, cwd=kw.pop("cwd", ROOT),
                          **kw)


def _records(out_dir: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in out_dir.glob("rank*.json")), key=lambda r: r["rank"])


def _train(tmp_path: Path, name: str, prefix: list[str], seed: int, env: dict[str, str] | None = None) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    proc = _run(prefix + [str(SCRIPT), str(seed), str(out)], env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _records(out)


def _assert_fused_equals_native(fused: list[dict], native: list[dict]) -> None:
    import torch

    assert [r["rank"] for r in fused] == [r["rank"] for r in native]
    for f, n in zip(fused, native):
        # the launcher's process took the fused path; the same script alone is untouched
        assert f["liger_compat_loaded"] and f["activated_by"] == "launcher" and f["logits_none"], f["rank"]
        assert f["child_liger_compat_loaded"], "a Python child of the command is not activated"
        assert not n["liger_compat_loaded"] and not n["logits_none"] and not n["child_liger_compat_loaded"]
        torch.testing.assert_close(f["loss"], n["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(f["loss_sum"], n["loss_sum"], rtol=1e-5, atol=1e-6)
        for key in ("grad_lm_head", "grad_norm"):
            torch.testing.assert_close(torch.tensor(f[key]), torch.tensor(n[key]), rtol=1e-4, atol=1e-6)


def test_python_script_takes_the_fused_path_with_native_loss(tmp_path):
    seed = random.randrange(2**31)
    script = Path(sys.executable).with_name("liger-compat")  # the installed command, where there is one
    launch = [str(script), "run"] if script.exists() else LAUNCH
    fused = _train(tmp_path, "fused", launch + ["--", sys.executable], seed)
    native = _train(tmp_path, "native", [sys.executable], seed)
    assert len(fused) == len(native) == 1
    _assert_fused_equals_native(fused, native)


@pytest.mark.slow
def test_torchrun_every_rank_takes_the_fused_path_with_native_loss(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("no torchrun next to this Python")
    seed = random.randrange(2**31)
    # --standalone: the rendezvous binds a free port itself (a port drawn at random can be in use:
    # the draw overlapped the kernel's ephemeral range, where gloo's own sockets live)
    args = [str(torchrun), "--standalone", "--nproc_per_node", "2"]
    fused = _train(tmp_path, "fused", LAUNCH + ["--"] + args, seed)
    native = _train(tmp_path, "native", args, seed)
    assert [r["rank"] for r in fused] == [0, 1] and {r["world"] for r in fused} == {2}
    assert fused[0]["pid"] != fused[1]["pid"]
    _assert_fused_equals_native(fused, native)


def test_options_reach_every_process_as_settings(tmp_path):
    code = ("import json, sys; from liger_compat import _config; "
            "print(json.dumps({r['variable']: [r['value'], r['source']] for r in _config.describe()}))")
    proc = _run(LAUNCH + ["--kernels", "rms_norm,rope,fused_linear_cross_entropy", "--disable", "rope",
                          "--flce-mode", "lowmem", "--debug", "on", "--", sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert rows["LIGER_COMPAT_KERNELS"] == ["fused_linear_cross_entropy,rms_norm", "LIGER_COMPAT_KERNELS"]
    assert rows["LIGER_COMPAT_FLCE_MODE"] == ["lowmem", "LIGER_COMPAT_FLCE_MODE"]
    assert rows["LIGER_COMPAT_DEBUG"] == ["1", "LIGER_COMPAT_DEBUG"]
    assert rows["LIGER_COMPAT_DECODE_NATIVE"] == ["1", "default"]


@pytest.mark.parametrize("option, value, bad", [("--kernels", "rms_norm,bogus", "bogus"),
                                               ("--disable", "rope,nope", "nope"),
                                               ("--flce-mode", "fast", "fast"),
                                               ("--flce-chunk-mb", "-3", "-3"),
                                               ("--return-logits", "maybe", "maybe")])
def test_bad_option_is_a_usage_error_and_nothing_runs(tmp_path, option, value, bad):
    marker = tmp_path / "ran"
    proc = _run(LAUNCH + [option, value, "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    assert proc.returncode == 2
    assert f"liger-compat run: error: {option}: " in proc.stderr and repr(bad) in proc.stderr
    assert not marker.exists()


def test_exit_code_and_signals_pass_through(tmp_path):
    assert _run(LAUNCH + ["--", sys.executable, "-c", "import sys; sys.exit(7)"]).returncode == 7
    killed = _run(LAUNCH + ["--", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"])
    assert killed.returncode == -signal.SIGTERM
    assert _run(LAUNCH + ["--", "sh", "-c", "exit 5"]).returncode == 5
    missing = _run(LAUNCH + ["--", "liger-compat-test-no-such-command"])
    assert missing.returncode == 127 and "command not found: liger-compat-test-no-such-command" in missing.stderr

    # the command replaces the launcher: a signal sent to the launcher's pid reaches the command itself
    ready, got = tmp_path / "ready", tmp_path / "got"
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        signal.signal(signal.SIGUSR1, lambda *a: (open({str(got)!r}, "w").write(str(os.getpid())), sys.exit(3)))
        with open({str(ready) + ".part"!r}, "w") as f:
            f.write(str(os.getpid()))
        os.replace({str(ready) + ".part"!r}, {str(ready)!r})  # the test sees the whole pid or no file
        time.sleep(60)
    """)
    p = subprocess.Popen(LAUNCH + ["--", sys.executable, "-c", code], env=_env(), cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists()
        assert int(ready.read_text()) == p.pid
        p.send_signal(signal.SIGUSR1)
        assert p.wait(60) == 3
        assert int(got.read_text()) == p.pid
    finally:
        if p.poll() is None:
            p.kill()


def test_existing_sitecustomize_still_runs(tmp_path):
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "sitecustomize.py").write_text(textwrap.dedent("""
        import os, sys
        PROBE = "original"
        sys._probe_sitecustomize = (__name__, __file__, "liger_compat" in sys.modules)
    """))
    code = ("import json, sys, sitecustomize; "
            "print(json.dumps([sys._probe_sitecustomize, sitecustomize.PROBE, sitecustomize.__file__, "
            "sys.modules['liger_compat._activation'].how, sys.path]))")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(site_dir), env["PYTHONPATH"]])
    proc = _run(LAUNCH + ["--", sys.executable, "-c", code], env=env)
    assert proc.returncode == 0, proc.stderr
    (name, file, loaded_first), probe, module_file, how, path = json.loads(proc.stdout)
    assert (name, file, probe, module_file) == ("sitecustomize", str(site_dir / "sitecustomize.py"), "original",
                                                str(site_dir / "sitecustomize.py"))
    assert loaded_first and how == "launcher"
    assert str(launcher.BOOT_DIR) not in path  # only the start-up needed it
    assert proc.stderr == ""


def test_a_broken_sitecustomize_is_reported_as_python_does(tmp_path):
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "sitecustomize.py").write_text("raise RuntimeError('broken site customisation')\n")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(site_dir), env["PYTHONPATH"]])
    code = "print('ran')"
    native = _run([sys.executable, "-c", code], env=env)
    launched = _run(LAUNCH + ["--", sys.executable, "-c", code], env=env)
    assert native.returncode == launched.returncode == 0
    assert native.stdout == launched.stdout == "ran\n"
    assert "broken site customisation" in native.stderr and "broken site customisation" in launched.stderr


def _broken_package(tmp_path: Path) -> Path:
    """A directory whose ``liger_compat`` fails at import after the real package has activated its
    hooks (it runs the real ``__init__`` over the real submodules, then raises): a simulated broken
    activation (a bug, a missing dependency) in the processes that find it first."""
    broken = tmp_path / "broken"
    (broken / "liger_compat").mkdir(parents=True)
    real = ROOT / "liger_compat"
    (broken / "liger_compat" / "__init__.py").write_text(textwrap.dedent(f"""
        __path__[:] = [{str(real)!r}]
        _init = {str(real / "__init__.py")!r}
        exec(compile(open(_init).read(), _init, "exec"))
        assert _REGISTRY.active
        raise RuntimeError("simulated failure at import")
    """))
    return broken


def test_broken_activation_runs_natively_with_one_line(tmp_path):
    seed = random.randrange(2**31)
    broken = _broken_package(tmp_path)
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(broken), env["PYTHONPATH"]])
    # the launcher itself imports the real package; the command's Python finds the broken one first
    launch = [sys.executable, "-c", f"import sys; sys.path.remove({str(broken)!r}); "
                                    "from liger_compat.__main__ import main; sys.exit(main())", "run", "--"]
    out = tmp_path / "out"
    out.mkdir()
    proc = _run(launch + [sys.executable, str(SCRIPT), str(seed), str(out)], env=env)
    assert proc.returncode == 0, proc.stderr
    (rec,) = _records(out)
    native = _train(tmp_path, "native", [sys.executable], seed)[0]
    assert not rec["logits_none"] and rec["activated_by"] is None
    assert rec["loss"] == native["loss"] and rec["grad_lm_head"] == native["grad_lm_head"]
    assert not rec["child_liger_compat_loaded"]
    lines = [line for line in proc.stderr.splitlines() if "liger-compat" in line]
    # one line (the script's; its child's stderr is captured by the script), naming the failure
    assert len(lines) == 1, proc.stderr
    assert all("not active in this process" in line and "RuntimeError: simulated failure at import" in line
               for line in lines)


def test_bad_inherited_setting_is_reported_and_the_command_runs(tmp_path):
    code = "import sys; from liger_compat import _config; print(sorted(_config.settings.kernels) == sorted(_config.ALL_KERNELS))"
    proc = _run(LAUNCH + ["--", sys.executable, "-c", code], env=_env(LIGER_COMPAT_KERNELS="rms_norm,nonsense"))
    assert proc.returncode == 0 and proc.stdout.strip() == "True"  # ignored, as at import
    assert "liger-compat run: LIGER_COMPAT_KERNELS='rms_norm,nonsense': unknown kernel 'nonsense'" in proc.stderr


def test_non_python_and_python_without_the_package_are_left_alone(tmp_path):
    # a program that is not Python sees only the extra PYTHONPATH entry
    proc = _run(LAUNCH + ["--", "sh", "-c", 'echo "$PYTHONPATH"'])
    assert proc.returncode == 0 and proc.stdout.split(os.pathsep)[0] == str(launcher.BOOT_DIR)
    # a Python without liger_compat (a bare venv: it sees neither this environment's site-packages nor the
    # system's, wherever the package is installed) starts silently under the command's environment, without it
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False, symlinks=True)
    python = bare / "bin" / "python"
    probe = _run([str(python), "-c", "import importlib.util; print(importlib.util.find_spec('liger_compat'))"],
                 env={**_env(), "PYTHONPATH": ""}, cwd=tmp_path)
    assert probe.stdout.strip() == "None", probe.stdout + probe.stderr  # the premise: the package is not there
    env = launcher.command_env({}, {**_env(), "PYTHONPATH": ""})
    code = "import sys; print('liger_compat' in sys.modules, sys.modules['sitecustomize'].__file__)"
    proc = _run([str(python), "-c", code], env=env, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.split() == ["False", str(launcher.BOOT_FILE)]


def test_nested_runs_put_the_start_up_directory_once():
    proc = _run(LAUNCH + ["--"] + LAUNCH + ["--", sys.executable, "-c", "import os; print(os.environ['PYTHONPATH'])"])
    assert proc.returncode == 0, proc.stderr
    entries = proc.stdout.strip().split(os.pathsep)
    assert entries.count(str(launcher.BOOT_DIR)) == 1 and entries[0] == str(launcher.BOOT_DIR)
    assert entries[1:] == _env()["PYTHONPATH"].split(os.pathsep)


def test_check_reports_the_launcher_and_the_process():
    code = "import json, liger_compat; print(json.dumps(liger_compat.check(quiet=True).to_dict()['activation']))"
    proc = _run(LAUNCH + ["--", sys.executable, "-c", code], env=_env(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2"))
    assert proc.returncode == 0, proc.stderr
    act = json.loads(proc.stdout)
    assert act["how"] == "launcher" and act["pid"] == act["process"]["pid"]
    assert act["ranks"] == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    plain = _run([sys.executable, "-c", code], env=_env())
    assert json.loads(plain.stdout)["how"] == "import"


def test_usage_page_shows_the_current_help():
    proc = _run([sys.executable, "-m", "liger_compat", "run", "--help"], env=_env(COLUMNS="100"))
    assert proc.returncode == 0
    page = (ROOT / "docs" / "usage.md").read_text()
    assert f"```\n{proc.stdout.rstrip()}\n```" in page


def test_check_value_names_the_variable_and_changes_nothing():
    from liger_compat import _config

    settings = _config.settings
    before = repr(settings)
    assert _config.check_value("flce_mode", "LowMem") == "lowmem"
    assert _config.check_value("kernels", "rope,rmsnorm") == "rms_norm,rope"
    assert _config.check_value("flce_chunk_mb", "64") == "64"
    for attr, raw, variable in (("flce_mode", "fast", "LIGER_COMPAT_FLCE_MODE"),
                                ("flce_chunk_mb", "0", "LIGER_COMPAT_FLCE_CHUNK_MB"),
                                ("mlp_recompute", "weights", "LIGER_COMPAT_MLP_RECOMPUTE"),
                                ("debug", "sometimes", "LIGER_COMPAT_DEBUG")):
        with pytest.raises(ValueError, match=variable):
            _config.check_value(attr, raw)
    assert _config.settings is settings and repr(settings) == before
