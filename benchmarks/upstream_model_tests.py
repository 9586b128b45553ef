"""transformers' own model tests, run natively and with liger_compat, outcome by outcome.

    python -m benchmarks.upstream_model_tests [--families llama,gemma2,...|all] [--sides native,patched,kernels]
        [--sdist transformers-X.tar.gz] [--seed 0] [--workers 1] [--timeout 1800] [--name upstream_model_tests]
        [--out DIR]

transformers' source distribution on PyPI carries the common model test mixin of its release
(``tests/test_modeling_common.py``: ``ModelTesterMixin``, about 160 tests a model: save and load,
batching, attention masks, output tuples and dicts, training and gradient-checkpointing steps with
labels, resized embeddings, ...), not the per-model test files. This script downloads the sdist of
the installed release (or takes ``--sdist``), writes one test module per family that runs the mixin
on the family's tiny config (``liger_compat.compat.tiny_models``: the configs ``check --deep`` and
the suite use) and its decoder and ``*ForCausalLM`` classes, and runs it in fresh pytest processes,
one per side, every test seeded by its id and ``--seed`` (each side draws the same inputs and
weights):

* ``native``: liger_compat is never imported;
* ``patched``: ``import liger_compat`` first, as a user writes it (on a CPU: transformers' modules,
  the fused loss path in training);
* ``kernels``: the same with ``LIGER_COMPAT_CPU_NATIVE=0``: on a CPU the kernels' torch references
  run in place of RMSNorm, RoPE, the MLP and the loss (on a GPU the Triton kernels run on every side
  but ``native``).

Modules the sdist's mixin imports but does not ship (the generation and export test mixins) are
written as empty classes, so their tests do not run; the report lists them. A test that passes
natively and fails (or errors) on a patched side is a regression: the report lists each with its
message and the script exits 1; so it does when a patched side ran none of our kernels (read from
``liger_compat.kernels.last_backend`` at the end of the run). Writes ``<name>.json`` and
``<name>.md``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from . import _results

#: a representative set: Llama's casting and SwiGLU, Gemma 2's offset norm, GeGLU and soft-cap,
#: Qwen3-MoE's experts and router loss, Phi3's fused gate/up
DEFAULT_FAMILIES = ("llama", "gemma2", "qwen3_moe", "phi3")
SIDES = ("native", "patched", "kernels")
_SIDE_ENV = {"native": {}, "patched": {"UPSTREAM_TESTS_PATCHED": "1"},
             "kernels": {"UPSTREAM_TESTS_PATCHED": "1", "LIGER_COMPAT_CPU_NATIVE": "0"}}

_CONFTEST = '''"""Written by benchmarks/upstream_model_tests.py: liger_compat first on the patched sides; every
test starts from generators seeded by its id and the run's seed (the same inputs and weights on
every side); the kernels that ran are written when the tests are done."""
import json
import os
import random
import zlib

if os.environ.get("UPSTREAM_TESTS_PATCHED") == "1":
    import liger_compat  # noqa: F401  (first, as a user writes it)

import numpy
import pytest
import torch


@pytest.fixture(autouse=True)
def _seeded(request):
    seed = zlib.crc32(request.node.nodeid.encode()) ^ int(os.environ.get("UPSTREAM_TESTS_SEED", "0"))
    random.seed(seed)
    numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    yield


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("UPSTREAM_TESTS_KERNELS")
    if path:
        ran = {}
        if os.environ.get("UPSTREAM_TESTS_PATCHED") == "1":
            from liger_compat import kernels

            ran = dict(kernels.last_backend)
        # one file a process: each pytest-xdist worker runs tests of its own
        with open(f"{path}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}", "w") as f:
            json.dump(ran, f)
'''

_MODULE = '''"""Written by benchmarks/upstream_model_tests.py: transformers' ModelTesterMixin on {family}'s tiny
config (liger_compat.compat.tiny_models)."""
import importlib
import unittest

from .test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask

CONFIG = ({config_module!r}, {config_class!r})
CONFIG_KW = {config_kw!r}
MODELS = ({modeling_module!r}, {model_classes!r})


def _config():
    cfg = getattr(importlib.import_module(CONFIG[0]), CONFIG[1])(**CONFIG_KW)
    cfg._attn_implementation = "eager"
    return cfg


class _Tester:
    batch_size, seq_length, is_training = 2, 7, True

    def __init__(self, parent):
        self.parent = parent
        cfg = _config()
        self.vocab_size, self.hidden_size = cfg.vocab_size, cfg.hidden_size
        self.num_hidden_layers, self.num_attention_heads = cfg.num_hidden_layers, cfg.num_attention_heads

    def get_config(self):
        return _config()

    def prepare_config_and_inputs_for_common(self):
        ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), {{"input_ids": ids, "attention_mask": mask}}


class {cls_name}(ModelTesterMixin, unittest.TestCase):
    all_model_classes = tuple(getattr(importlib.import_module(MODELS[0]), n) for n in MODELS[1])
    # the generation mixin is not in the sdist (see the script's docstring)
    all_generative_model_classes = ()
    # off in transformers' own test files of these families (4.x mixins run them by default)
    test_pruning = test_head_masking = False

    def setUp(self):
        self.model_tester = _Tester(self)
'''


def _installed_transformers() -> str:
    import transformers

    return transformers.__version__


def fetch_sdist(version: str, cache: Path) -> Path:
    """transformers' sdist of ``version`` from the package index (pip's own configuration), cached."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"transformers-{version}.tar.gz"
    if path.exists():
        return path
    print(f"downloading transformers {version}'s source distribution (its test mixins) ...", flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
           f"transformers=={version}", "-d", str(cache)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode or not path.exists():
        raise SystemExit(f"could not download transformers {version}'s sdist ({' '.join(cmd)}):\n"
                         f"{done.stderr[-2000:]}\nPass --sdist PATH to use a local copy.")
    return path


def extract_tests(sdist: Path, dest: Path) -> list[str]:
    """The sdist's ``tests/*.py`` as package ``uptests`` under ``dest``; modules its common mixin
    imports relatively but the sdist lacks are written as empty classes. Returns what was stubbed."""
    pkg = dest / "uptests"
    pkg.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if len(parts) == 3 and parts[1] == "tests" and parts[2].endswith(".py") and m.isfile():
                (pkg / parts[2]).write_bytes(tar.extractfile(m).read())
    common = pkg / "test_modeling_common.py"
    if not common.exists():
        raise SystemExit(f"{sdist.name} has no tests/test_modeling_common.py: this release's sdist ships no "
                         "model test mixin")
    (pkg / "__init__.py").write_text("")
    stubbed = []
    for node in ast.walk(ast.parse(common.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            target = pkg.joinpath(*node.module.split(".")).with_suffix(".py")
            if target.exists():
                continue
            for d in [pkg.joinpath(*node.module.split(".")[:i]) for i in range(1, len(node.module.split(".")))]:
                d.mkdir(exist_ok=True)
                (d / "__init__.py").touch()
            names = [a.name for a in node.names]
            target.write_text("".join(f"class {n}:\n    pass\n\n\n" for n in names))
            stubbed += [f"{node.module}.{n}" for n in names]
    (pkg / "conftest.py").write_text(_CONFTEST)
    return stubbed


def test_class(family: str) -> str:
    """The name of the family's test class in its written module (``qwen3_moe`` -> ``TestQwen3Moe``)."""
    return "Test" + "".join(p.capitalize() for p in family.split("_"))


def family_module(family: str) -> tuple[str, str] | str:
    """``(file name, source)`` of the family's test module, or why it cannot be written here."""
    import importlib

    from liger_compat.compat import families, tiny_models

    fam = families.BY_NAME[family]
    if fam.vision:
        return "a vision-language family: its tester would need pixel inputs"
    try:
        cfg = tiny_models.config_for(fam)
    except tiny_models.FamilyUnavailable as exc:
        return str(exc)
    mod = importlib.import_module(fam.module)
    # the decoder the head wraps: the class of the family's module built on the same config
    # (Gemma 3's Gemma3TextModel, not its vision-language Gemma3Model)
    bases = [n for n in (f"{fam.prefix}TextModel", fam.causal_lm.replace("ForCausalLM", "Model"))
             if getattr(getattr(mod, n, None), "config_class", None) is type(cfg)]
    classes = bases[:1] + [fam.causal_lm]
    kw = {**tiny_models.BASE, **tiny_models.EXTRA.get(fam.name, {})}
    src = _MODULE.format(family=family, config_module=type(cfg).__module__, config_class=type(cfg).__name__,
                         config_kw=kw, modeling_module=mod.__name__, model_classes=tuple(classes),
                         cls_name=test_class(family))
    return f"test_{family}_upstream.py", src


def read_junit(path: Path) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, message) of a pytest junit file. A test with subtests can appear more
    than once: failed over passed over skipped."""
    rank = {"failed": 2, "passed": 1, "skipped": 0}
    out: dict[str, tuple[str, str]] = {}
    for tc in ET.parse(path).iter("testcase"):
        key = f"{tc.get('classname', '').rsplit('.', 1)[-1]}::{tc.get('name')}"
        state, msg = "passed", ""
        for ch in tc:
            if ch.tag in ("failure", "error"):
                text = (ch.get("message") or ch.text or "").strip()
                state, msg = "failed", text.splitlines()[0][:300] if text else ""
            elif ch.tag == "skipped" and state == "passed":
                state = "skipped"
        if key not in out or rank[state] > rank[out[key][0]]:
            out[key] = (state, msg)
    return out


def run_side(side: str, root: Path, modules: list[str], timeout: float, seed: int = 0,
             workers: int = 1) -> tuple[dict, dict, float]:
    """One side's fresh pytest process over ``modules`` (the written test modules, not the sdist's
    own ``test_*.py``): (outcomes, kernels that ran, seconds)."""
    junit, kernels = root / f"{side}.xml", root / f"{side}.kernels.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UPSTREAM_TESTS_", "PYTEST_"))}
    env.pop("LIGER_COMPAT_CPU_NATIVE", None)
    env.update(_SIDE_ENV[side], UPSTREAM_TESTS_KERNELS=str(kernels), UPSTREAM_TESTS_SEED=str(seed),
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           f"--junitxml={junit}", *(["-n", str(workers)] if workers > 1 else []), *(f"uptests/{m}" for m in modules)]
    t0 = time.perf_counter()
    print(f"{side}: running transformers' model tests ...", flush=True)
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    dt = time.perf_counter() - t0
    if not junit.exists() or done.returncode not in (0, 1):  # 1: some tests failed; else it did not run them
        raise SystemExit(f"{side}: pytest wrote no results (exit {done.returncode}):\n{done.stdout[-3000:]}"
                         f"\n{done.stderr[-3000:]}")
    ran = {}
    for part in sorted(root.glob(f"{kernels.name}.*")):
        ran.update(json.loads(part.read_text()))
    print(f"{side}: {done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ''} ({dt:.0f} s)", flush=True)
    return read_junit(junit), ran, dt


def compare(outcomes: dict[str, dict], sides: list[str]) -> list[dict]:
    """Per test where a patched side's outcome differs from native's: what each side got."""
    diffs = []
    for key in sorted(set().union(*outcomes.values())):
        got = {s: outcomes[s].get(key, ("missing", "")) for s in sides}
        if any(got[s][0] != got["native"][0] for s in sides):
            diffs.append({"test": key, **{s: got[s][0] for s in sides},
                          "messages": {s: got[s][1] for s in sides if got[s][1]},
                          "regression": got["native"][0] == "passed"
                          and any(got[s][0] in ("failed", "missing") for s in sides if s != "native")})
    return diffs


def markdown(report: dict) -> str:
    sides = report["sides"]
    lines = ["# transformers' own model tests, natively and with liger_compat", "",
             f"transformers {report['transformers']}, torch {report['torch']}, device {report['device']}; "
             f"the common `ModelTesterMixin` of the release's sdist on each family's tiny config, one fresh "
             f"pytest process a side, every test seeded by its id and {report['seed']} (the same inputs and "
             f"weights on every side). Not run (absent from the sdist, written as empty classes): "
             f"{', '.join(report['stubbed']) or 'none'}.", "",
             "| family | tests | " + " | ".join(f"{s}: passed / skipped / failed" for s in sides) + " | differ |",
             "|---|---|" + "---|" * len(sides) + "---|"]
    for fam, row in report["families"].items():
        if "unavailable" in row:
            lines.append(f"| {fam} | not run: {row['unavailable']} |" + " |" * len(sides) + " |")
            continue
        cells = [f"{c['passed']} / {c['skipped']} / {c['failed']}" for c in (row["counts"][s] for s in sides)]
        lines.append(f"| {fam} | {row['tests']} | " + " | ".join(cells) + f" | {row['differ']} |")
    lines += ["", "Seconds per side: " + ", ".join(f"{s} {report['seconds'][s]:.0f}" for s in sides) + ".", ""]
    for s in sides[1:]:
        ran = report["kernels_ran"].get(s, {})
        lines.append(f"Kernels that ran on the {s} side: "
                     + (", ".join(f"{k} ({v})" for k, v in sorted(ran.items())) or "none") + ".")
    lines.append("")
    if report["differences"]:
        lines += ["## Tests whose outcome differs from native's", "",
                  "| test | " + " | ".join(sides) + " | regression | message |", "|---|" + "---|" * (len(sides) + 2)]
        for d in report["differences"]:
            msg = "; ".join(f"{s}: {m}" for s, m in d["messages"].items()).replace("|", "\\|")
            lines.append(f"| {d['test']} | " + " | ".join(d[s] for s in sides)
                         + f" | {'yes' if d['regression'] else 'no'} | {msg[:400]} |")
    else:
        lines.append("Every test has the same outcome on every side.")
    return "\n".join(lines) + "\n"


def run(families: list[str], sides: list[str], sdist: Path | None, timeout: float, seed: int = 0,
        workers: int = 1) -> dict:
    """The report: each side's outcomes per family, the tests that differ, the kernels that ran.
    Every test draws its inputs and weights from generators seeded by its id and ``seed``: each
    side sees the same numbers."""
    with tempfile.TemporaryDirectory(prefix="upstream_tests_") as root:
        return _run(families, sides, sdist, timeout, seed, workers, Path(root))


def _run(families: list[str], sides: list[str], sdist: Path | None, timeout: float, seed: int, workers: int,
         root: Path) -> dict:
    import torch

    version = _installed_transformers()
    if sdist is None:
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "liger_compat" / "sdists"
        sdist = fetch_sdist(version, cache)
    stubbed = extract_tests(sdist, root)
    report: dict = {"transformers": version, "torch": torch.__version__,
                    "device": "cuda" if torch.cuda.is_available() else "cpu", "sdist": sdist.name,
                    "sides": sides, "seed": seed, "stubbed": stubbed, "families": {}, "seconds": {}, "kernels_ran": {}}
    modules = []
    for fam in families:
        made = family_module(fam)
        if isinstance(made, str):
            report["families"][fam] = {"unavailable": made}
            continue
        (root / "uptests" / made[0]).write_text(made[1])
        report["families"][fam] = {}
        modules.append(made[0])
    if not modules:
        raise SystemExit(f"none of {families} can run here: {report['families']}")
    outcomes = {}
    for side in sides:
        outcomes[side], report["kernels_ran"][side], report["seconds"][side] = run_side(side, root, modules, timeout,
                                                                                         seed, workers)
    report["differences"] = compare(outcomes, sides)
    for fam, row in report["families"].items():
        if "unavailable" in row:
            continue
        cls = test_class(fam)
        keys = [k for k in outcomes["native"] if k.startswith(f"{cls}::")]
        row["tests"] = len(keys)
        row["counts"] = {s: {o: sum(outcomes[s].get(k, ("missing",))[0] == o for k in keys)
                             for o in ("passed", "skipped", "failed")} for s in sides}
        row["differ"] = sum(d["test"].startswith(f"{cls}::") for d in report["differences"])
    report["regressions"] = [d["test"] for d in report["differences"] if d["regression"]]
    # on a CPU the patched side runs transformers' modules (LIGER_COMPAT_CPU_NATIVE): only the
    # kernels side must have run ours there
    must = [s for s in sides if s == "kernels" or (s == "patched" and report["device"] == "cuda")]
    report["no_kernels"] = [s for s in must if not report["kernels_ran"].get(s)]
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(DEFAULT_FAMILIES), help="comma-separated, or 'all'")
    p.add_argument("--sides", default="native,patched,kernels", help=f"comma-separated of {', '.join(SIDES)}")
    p.add_argument("--sdist", type=Path, default=None, help="transformers' sdist (default: downloaded)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a side may take")
    p.add_argument("--seed", type=int, default=0, help="mixed into each test's seed (the same on every side)")
    p.add_argument("--workers", type=int, default=1, help="pytest-xdist processes a side (1: none)")
    p.add_argument("--name", default="upstream_model_tests")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    from liger_compat.compat import families as fams

    names = list(fams.BY_NAME) if args.families == "all" else [f for f in args.families.split(",") if f]
    unknown = [f for f in names if f not in fams.BY_NAME]
    sides = [s for s in args.sides.split(",") if s]
    if unknown or "native" not in sides or any(s not in SIDES for s in sides):
        p.error(f"unknown families {unknown}" if unknown else f"--sides: native and any of {', '.join(SIDES[1:])}")
    sides = ["native"] + [s for s in sides if s != "native"]
    report = run(names, sides, args.sdist, args.timeout, args.seed, args.workers)
    _results.write(args.out, args.name, report, markdown(report), _results.command("benchmarks.upstream_model_tests", argv))
    if report["regressions"] or report["no_kernels"]:
        print(f"regressions: {report['regressions']}; patched sides that ran no kernel: {report['no_kernels']}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
