"""Version parsing and matching, including odd versions seen in the wild."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from liger_compat.compat import versions


@pytest.mark.parametrize(
    "raw, release",
    [
        ("4.48.0.dev0", "4.48.0"),
        ("2.13.0+cpu", "2.13.0"),
        ("2.11.0+cu130", "2.11.0"),
        ("0.15.0rc1", "0.15.0"),
        ("1.0.0.post2", "1.0.0"),
        ("3.6.0", "3.6.0"),
        ("5", "5"),
    ],
)
def test_release_of_odd_versions(raw, release):
    assert str(versions.release_of(raw)) == release


@pytest.mark.parametrize("raw", ["unknown", "", "main", "4.x"])
def test_non_pep440_versions_do_not_raise(raw):
    assert versions.parse_version(raw) is None
    assert versions.release_of(raw) is None
    assert versions.matches(raw, ">=0") is False


@pytest.mark.parametrize(
    "raw, spec, expected",
    [
        ("4.48.0.dev0", ">=4.48", True),  # a dev build carries its release's features
        ("4.48.0.dev0", "<4.48", False),
        ("4.48.3", ">=4.45,<4.49", True),
        ("4.49.0", ">=4.45,<4.49", False),
        ("2.13.0+cpu", "==2.13.0", True),
        ("0.15.0rc1", ">=0.15", True),
        ("1.16.0", "", True),
        (None, "", False),
    ],
)
def test_matches(raw, spec, expected):
    assert versions.matches(raw, spec) is expected


def test_bad_specifier_names_it():
    with pytest.raises(ValueError, match="not-a-spec"):
        versions.matches("1.0", "not-a-spec")


@given(st.tuples(*[st.integers(0, 60)] * 3), st.sampled_from(["", ".dev0", "rc2", "+cpu", ".post1", "+cu130"]))
def test_release_strips_only_the_suffix(parts, suffix):
    base = ".".join(map(str, parts))
    assert versions.release_of(base + suffix) == versions.release_of(base)
    assert versions.matches(base + suffix, f"=={base}")


def test_installed_reads_metadata_for_present_and_absent_packages():
    from importlib.metadata import version

    pv = versions.installed("packaging")
    assert pv.installed and pv.raw == version("packaging")
    absent = versions.installed("definitely-not-a-real-package-xyz")
    assert not absent.installed and str(absent) == "not installed" and absent.version is None


def test_all_installed_covers_tracked_names():
    got = versions.all_installed()
    assert set(got) == set(versions.TRACKED)
    for name, pv in got.items():
        assert pv.name == name
