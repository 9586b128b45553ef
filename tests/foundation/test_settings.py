"""The package's settings: every environment variable is parsed in ``_config``, documented in the
docs/usage.md, shown by ``check()`` with its source, and a bad value gives an error naming the variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import liger_compat
from liger_compat import _config
from liger_compat.compat import device
from liger_compat.compat.report import format_text
from liger_compat.kernels import _dispatch

ROOT = Path(__file__).resolve().parents[2]
_ENV_OF = {s.attr: s.env for s in _config.SETTINGS}


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _config.ENV_VARS}
    return {**env, **extra}


def test_docs_document_every_variable():
    readme = (ROOT / "docs" / "usage.md").read_text()
    assert len(_config.ENV_VARS) == len(set(_config.ENV_VARS)) == len(_config.SETTINGS) + 1
    # each variable in the settings table of the usage page
    missing = [v for v in _config.ENV_VARS if f"| `{v}` |" not in readme]
    assert missing == []


def test_check_shows_every_setting_with_its_value_and_source():
    code = ("import json, liger_compat; from liger_compat.compat.report import format_text; r = liger_compat.check(quiet=True);"
            "print(json.dumps(r.settings['variables'])); print(format_text(r))")
    env = _clean_env(LIGER_COMPAT_FLCE_CHUNK_MB="62", LIGER_COMPAT_RETURN_LOGITS="Yes", LIGER_COMPAT_DEBUG="maybe",
                     LIGER_COMPAT_KERNELS="rope,rmsnorm", LIGER_COMPAT_MLP_RECOMPUTE="sometimes")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    rows = {x["variable"]: x for x in json.loads(lines[0])}
    assert list(rows) == list(_config.ENV_VARS)
    assert rows["LIGER_COMPAT_FLCE_CHUNK_MB"] == {"variable": "LIGER_COMPAT_FLCE_CHUNK_MB", "value": "62",
                                                  "source": "LIGER_COMPAT_FLCE_CHUNK_MB"}
    assert rows["LIGER_COMPAT_RETURN_LOGITS"]["value"] == "1"
    assert rows["LIGER_COMPAT_RETURN_LOGITS"]["source"] == "LIGER_COMPAT_RETURN_LOGITS"
    assert rows["LIGER_COMPAT_KERNELS"]["value"] == "rms_norm,rope"
    # a bad on/off value: the default, and the source says why
    assert rows["LIGER_COMPAT_DEBUG"]["value"] == "0"
    assert "LIGER_COMPAT_DEBUG must be on or off" in rows["LIGER_COMPAT_DEBUG"]["source"]
    assert "'maybe'" in rows["LIGER_COMPAT_DEBUG"]["source"] and "ignored" in rows["LIGER_COMPAT_DEBUG"]["source"]
    # a bad tuning value: shown as invalid, naming the variable and its allowed values
    mlp = rows["LIGER_COMPAT_MLP_RECOMPUTE"]["value"]
    assert mlp.startswith("invalid (LIGER_COMPAT_MLP_RECOMPUTE must be 1, 0, or names from activation, input")
    for name in ("LIGER_COMPAT_DISABLE", "LIGER_COMPAT_FLCE_MODE", "LIGER_COMPAT_FLCE_LOGITS", "TRITON_INTERPRET"):
        assert rows[name]["source"] == "default", name
    # the default report lists the variables not at their default; --verbose (verbose=True) every one
    set_here = [name for name, row in rows.items() if row["source"] != "default"]
    assert set_here and len(set_here) < len(rows)
    for verbose in (False, True):
        text = "\n".join(lines[1:]) if not verbose else subprocess.run(
            [sys.executable, "-c", code.replace("format_text(r)", "format_text(r, verbose=True)")], env=env,
            capture_output=True, text=True, timeout=600).stdout
        section = text[text.index("\nSettings\n"):text.index("\nShims\n")]
        for name in _config.ENV_VARS:
            assert (name in section) == (verbose or name in set_here), (verbose, name)
        assert [ln.split()[:3] for ln in section.splitlines() if "LIGER_COMPAT_FLCE_CHUNK_MB" in ln] == [
            ["LIGER_COMPAT_FLCE_CHUNK_MB", "62", "LIGER_COMPAT_FLCE_CHUNK_MB"]]
    assert f"the other {len(rows) - len(set_here)} variables at their defaults" in "\n".join(lines[1:])


def test_the_report_follows_configure(monkeypatch):
    monkeypatch.setattr(_config.settings, "return_logits", False)
    monkeypatch.setattr(_config.settings, "source", dict(_config.settings.source))
    liger_compat.configure(return_logits=True)
    r = liger_compat.check()
    row = next(x for x in r.settings["variables"] if x["variable"] == "LIGER_COMPAT_RETURN_LOGITS")
    assert row == {"variable": "LIGER_COMPAT_RETURN_LOGITS", "value": "1", "source": "configure()"}
    assert "configure()" in format_text(r)
    with pytest.raises(ValueError, match=r"return_logits must be on or off .*, got 'perhaps'"):
        liger_compat.configure(return_logits="perhaps")
    assert _config.settings.return_logits is True  # unchanged by the refused call


@pytest.mark.parametrize("text, value", [(t, True) for t in ("1", "true", "YES", " on ")]
                         + [(t, False) for t in ("0", "False", "no", "OFF", "", "  ")])
def test_on_off_values(text, value):
    assert _config.parse_bool(text, "LIGER_COMPAT_DEBUG") is value
    settings = _config._from_env({"LIGER_COMPAT_DEBUG": text, "LIGER_COMPAT_DISABLE": text,
                                  "LIGER_COMPAT_RETURN_LOGITS": text})
    assert (settings.debug, settings.disabled, settings.return_logits) == (value, value, value)
    assert settings.source["debug"] == "LIGER_COMPAT_DEBUG"


@pytest.mark.parametrize("name", ["LIGER_COMPAT_DISABLE", "LIGER_COMPAT_DEBUG", "LIGER_COMPAT_RETURN_LOGITS"])
def test_a_bad_on_off_value_is_ignored_and_named(name):
    with pytest.raises(ValueError, match=rf"{name} must be on or off \(on: 1, true, yes, on; off: 0, false, no, "
                                         rf"off or empty\), got '2'"):
        _config.parse_bool("2", name)
    attr = next(s.attr for s in _config.SETTINGS if s.env == name)
    settings = _config._from_env({name: "2"})
    assert getattr(settings, attr) is False
    assert settings.source[attr].startswith(f"default ({name} must be on or off") and "ignored" in settings.source[attr]


def test_a_bad_kernel_name_is_ignored_and_named():
    settings = _config._from_env({"LIGER_COMPAT_KERNELS": "rope,flash"})
    assert settings.kernels == frozenset(_config.ALL_KERNELS)
    assert "unknown kernel 'flash'" in settings.source["kernels"]
    assert _config._from_env({"LIGER_COMPAT_KERNELS": "none"}).kernels == frozenset()


@pytest.mark.parametrize("attr, good, parsed, bad, message", [
    ("flce_mode", " LowMem ", "lowmem", "fast", "LIGER_COMPAT_FLCE_MODE must be one of auto, chunked, lowmem, got 'fast'"),
    ("flce_chunk_mb", " 62 ", 62.0, "-3", "LIGER_COMPAT_FLCE_CHUNK_MB must be a positive number of MiB, got '-3'"),
    ("flce_logits", "cublas", "cublas", "CUBLAS", "LIGER_COMPAT_FLCE_LOGITS must be one of auto, cublas, triton, got 'CUBLAS'"),
    ("mlp_recompute", "input", frozenset({"input"}), "activations",
     "LIGER_COMPAT_MLP_RECOMPUTE must be 1, 0, or names from activation, input; got 'activations'"),
])
def test_tuning_values_are_checked_where_used(monkeypatch, attr, good, parsed, bad, message):
    """Read at import as set (a bad one never breaks the import); the accessor checks it."""
    read = {"flce_mode": _config.flce_mode, "flce_chunk_mb": _config.flce_chunk_mib, "flce_logits": _config.flce_logits,
            "mlp_recompute": _config.mlp_recompute_parts}[attr]
    env = _ENV_OF[attr]
    monkeypatch.setattr(_config, "settings", _config._from_env({env: good}))
    assert _config.settings.source[attr] == env
    assert read() == parsed
    monkeypatch.setattr(_config, "settings", _config._from_env({env: bad}))
    assert _config.settings.source[attr] == env
    with pytest.raises(ValueError) as info:
        read()
    assert str(info.value) == message
    row = next(x for x in _config.describe() if x["variable"] == env)
    assert row["value"] == f"invalid ({message})" and row["source"] == env


def test_defaults_when_nothing_is_set():
    settings = _config._from_env({})
    assert settings.source == {}
    defaults = {s.attr: s.default for s in _config.SETTINGS}
    assert (settings.flce_mode, settings.flce_chunk_mb, settings.flce_logits, settings.mlp_recompute) == (
        defaults["flce_mode"], defaults["flce_chunk_mb"], defaults["flce_logits"], defaults["mlp_recompute"])
    assert (settings.disabled, settings.debug, settings.return_logits) == (False, False, False)
    assert settings.kernels == frozenset(_config.ALL_KERNELS)


@pytest.mark.parametrize("text, on", [("1", True), ("True", True), ("yes", True), ("on", True),
                                      ("0", False), ("", False), ("false", False), ("2", False)])
def test_triton_interpret_is_parsed_one_way(monkeypatch, text, on):
    monkeypatch.setenv("TRITON_INTERPRET", text)
    assert _config.triton_interpret() is on
    assert _dispatch.interpret_mode() is on and device.interpret_mode() is on


def test_return_logits_read_from_the_environment_at_import():
    code = "from liger_compat import _config as c; print(c.return_logits(), c.settings.source.get('return_logits'))"
    r = subprocess.run([sys.executable, "-c", code], env=_clean_env(LIGER_COMPAT_RETURN_LOGITS="on"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "LIGER_COMPAT_RETURN_LOGITS"]
    r = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert r.stdout.split() == ["False", "None"]


@pytest.mark.parametrize("attr,default", [("flce_sparse", True), ("flce_sparse_grads", False),
                                          ("flce_fp32_grad_weight", False)])
def test_a_fused_loss_switch_from_the_environment_and_configure(attr, default, monkeypatch):
    """``LIGER_COMPAT_FLCE_SPARSE`` (on by default), ``..._SPARSE_GRADS`` and ``..._FP32_GRAD_WEIGHT``
    (off): the variable flips the default and is named as the source, a bad value is ignored and
    named; ``configure(<attr>=...)`` sets it and the report names configure() as its source, and a
    bad value raises naming the keyword."""
    import liger_compat

    env = _ENV_OF[attr]
    assert getattr(_config._from_env({}), attr) is default
    flipped = _config._from_env({env: "0" if default else "on"})
    assert getattr(flipped, attr) is (not default) and flipped.source[attr] == env
    bad = _config._from_env({env: "often"})
    assert getattr(bad, attr) is default and "ignored" in bad.source[attr]
    monkeypatch.setattr(_config.settings, attr, default)
    monkeypatch.setattr(_config.settings, "source", dict(_config.settings.source))
    liger_compat.configure(**{attr: not default})
    row = next(x for x in _config.describe() if x["variable"] == env)
    assert getattr(_config.settings, attr) is (not default)
    assert row["value"] == ("0" if default else "1") and row["source"] == "configure()"
    with pytest.raises(ValueError, match=f"{attr} must be on or off"):
        liger_compat.configure(**{attr: "sometimes"})
