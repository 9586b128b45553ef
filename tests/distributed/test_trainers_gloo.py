"""Two CPU processes (torchrun, gloo) train a tiny model with ``transformers.Trainer`` and trl's
``SFTTrainer`` (gradient checkpointing off, as the Trainer has it) on their defaults: DDP with ``find_unused_parameters`` (the Trainer's choice without
gradient checkpointing), which flattens every forward's output with torch's pytree and builds it again.
The losses and final weights must be those of the same run under ``LIGER_COMPAT_DISABLE=1``.

A fused training output whose ``token_accuracy`` was an extra key of the native class failed that
rebuild on the first step (``TypeError: ... unexpected keyword argument 'token_accuracy'``).
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import _harness as h  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainers"))
from sft_logits_reader import reads_logits  # noqa: E402

if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

WORKER = Path(__file__).with_name("_trainer_worker.py")


def _run_both(tmp_path: Path, kind: str, *extra: str) -> tuple[dict, dict, int]:
    seed = random.randrange(2**31)
    pat_out, nat_out = tmp_path / "patched.pt", tmp_path / "native.pt"
    args = [kind, "--seed", str(seed), *extra]
    h.torchrun_many([(WORKER, args + ["--out", str(pat_out)], None),
                     (WORKER, args + ["--out", str(nat_out)], {"LIGER_COMPAT_DISABLE": "1"})], timeout=300)
    return torch.load(pat_out, weights_only=False), torch.load(nat_out, weights_only=False), seed


def _assert_same_training(pat: dict, nat: dict, seed: int) -> None:
    msg = f"seed {seed}: patched {pat['logs']}\nnative {nat['logs']}"
    assert pat["patched"] and not nat["patched"]
    for res in (pat, nat):
        assert res["world_size"] == 2 and res["backend"] == "gloo", res
        # the Trainer's default: DDP that rebuilds the outputs
        assert res["wrapper"] == "DistributedDataParallel" and res["find_unused_parameters"] is True, res
    assert len(pat["logs"]) == len(nat["logs"]) == 3, msg
    for a, b in zip(nat["logs"], pat["logs"]):
        assert math.isclose(a["loss"], b["loss"], rel_tol=2e-4, abs_tol=2e-5), msg
    keys = nat["state"].keys()
    assert pat["state"].keys() == keys == nat["init"].keys() == pat["init"].keys()
    for k in keys:  # both runs started from the same weights
        assert torch.equal(pat["init"][k], nat["init"][k]), k
    # AdamW (the default) moves a weight by about lr a step whatever its gradient's size: where a gradient
    # is near zero (|g| ~ its eps, 1e-8), a rounding difference turns into a step of a different size, so a
    # few single weights may differ by up to 2 lr a step (seen: 1 to 3 of ~27k weights by 2e-3 to 2.2e-2 in
    # 3 of 21 seeds, 3 steps at lr 5e-2). A wrong gradient moves whole tensors instead: the difference,
    # measured against how far training moved the weights, stays small, and so does the count of outliers.
    diff = {k: pat["state"][k] - nat["state"][k] for k in keys}
    moved = {k: nat["state"][k] - nat["init"][k] for k in keys}
    rel = math.sqrt(sum(float(d.square().sum()) for d in diff.values())) / math.sqrt(
        sum(float(m.square().sum()) for m in moved.values()))
    assert rel < 1e-2, (rel, msg)  # seen: 7e-7 to 1.5e-3
    total = sum(d.numel() for d in diff.values())
    outliers = {k: int((d.abs() > 1e-3).sum()) for k, d in diff.items() if bool((d.abs() > 1e-3).any())}
    assert sum(outliers.values()) <= total // 1000, (outliers, msg)
    biggest = max(float(d.abs().max()) for d in diff.values())
    lr = nat["logs"][0]["learning_rate"]  # constant
    assert biggest <= 2 * lr * len(nat["logs"]), (biggest, msg)  # AdamW's own reach: 2 lr a step


def _skip_without_a_native_sft_run() -> None:
    pytest.importorskip("trl")
    from liger_compat.compat import known_issues

    if known_issues.by_id("trl-head-on-cpu").applies(cuda=torch.cuda.is_available()):
        pytest.skip("trl 1.15.0's own head fails on CPU natively (known issue trl-head-on-cpu): no native run to compare")


def test_two_process_trainer_with_its_defaults_trains_as_natively(tmp_path):
    pat, nat, seed = _run_both(tmp_path, "trainer")
    # the fused forward ran (its output went through DDP's rebuild), and the native one natively
    assert any(k.endswith(" fused") for k in pat["outputs"]), pat["outputs"]
    assert not any(k.endswith(" fused") for k in nat["outputs"]), nat["outputs"]
    _assert_same_training(pat, nat, seed)


def test_two_process_sft_trainer_with_its_defaults_trains_as_natively(tmp_path):
    _skip_without_a_native_sft_run()
    pat, nat, seed = _run_both(tmp_path, "sft")
    # trl < 1.15: liger_compat's fused output (F1 metrics from its token_accuracy); 1.15+: trl's own
    # fused head output (its head run by liger_compat's kernel): either goes through DDP's rebuild
    assert sum(pat["outputs"].values()) == 3, pat["outputs"]
    _assert_same_training(pat, nat, seed)
    for a, b in zip(nat["logs"], pat["logs"]):  # the token accuracy reaches trl's logs (F1)
        if "mean_token_accuracy" in a:
            assert math.isclose(a["mean_token_accuracy"], b["mean_token_accuracy"], abs_tol=1e-6), (a, b)


def _assert_same_sft_metrics(pat: dict, nat: dict, seed: int) -> None:
    logged = 0
    for a, b in zip(nat["logs"], pat["logs"]):
        for key in ("mean_token_accuracy", "entropy"):
            if key in a:
                assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (seed, key, a, b)
                logged += key == "mean_token_accuracy"
    assert logged == len(nat["logs"]), (seed, nat["logs"])


def test_two_process_sft_token_accuracy_is_weighted_by_tokens_as_natively(tmp_path):
    """trl 0.26 .. 1.14 read ``outputs.logits`` for the token accuracy (correct over valid tokens of all
    ranks); given a model without logits, their own branch logs the plain mean of the ranks' fractions,
    which differs whenever the ranks hold different numbers of valid tokens. Run on that compute_loss
    (trl 1.15+: the same reads, written in ``tests/trainers/sft_logits_reader.py``)."""
    _skip_without_a_native_sft_run()
    import trl

    from liger_compat.compat.trl_trainer_locations import find_trainer
    from liger_compat.compat.versions import matches

    if not reads_logits(find_trainer("sft")[0]) and not matches(trl.__version__, ">=1.15"):
        pytest.skip(f"trl {trl.__version__}: SFTTrainer reads no logits for its metrics (trl < 0.15): no premise")
    pat, nat, seed = _run_both(tmp_path, "sft", "--logits-reader")
    assert pat["compute_loss"] == nat["compute_loss"], (pat["compute_loss"], nat["compute_loss"])
    assert any(k.endswith(" fused") for k in pat["outputs"]), pat["outputs"]  # logits None reached compute_loss
    _assert_same_training(pat, nat, seed)
    _assert_same_sft_metrics(pat, nat, seed)
