"""The benchmarks' logit regimes (``benchmarks/regimes.py``) have the properties they claim, checked
against an independent float64 softmax at a small vocabulary on CPU."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import regimes  # noqa: E402

N, H, V = 384, 64, 3000


def _entropy64(h, w, t, softcap=None):
    keep = t != regimes.IGNORE_INDEX
    z = h[keep].double() @ w.double().t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z, -1)
    ent = float(-(logp.exp() * logp).sum(-1).mean())
    loss = float(-logp.gather(1, t[keep].unsqueeze(1)).mean())
    return ent, loss


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_trained_like_regime_hits_its_entropy(softcap):
    h, w, t, info = regimes.make_inputs("trained", N, H, V, softcap=softcap, device="cpu", seed=4)
    assert h.shape == (N, H) and w.shape == (V, H) and h.dtype == torch.bfloat16
    ent, loss = _entropy64(h, w, t, softcap)
    assert abs(ent - regimes.TRAINED_ENTROPY) < 0.1, ent  # the bisection's rows are a subset of the rows
    assert info["alpha"] > 0
    assert math.isclose(info["entropy"], ent, abs_tol=1e-3) and math.isclose(info["loss"], loss, abs_tol=1e-3)
    # the constant hidden feature carries the log-prior through weight column 0
    assert torch.all(h[:, 0] == 1)
    assert float(w[:, 0].float().max()) < 0 < float(w[:, 0].float().std())


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_peaked_regime_gives_most_targets_nearly_all_the_probability(softcap):
    h, w, t, info = regimes.make_inputs("peaked", N, H, V, softcap=softcap, device="cpu", seed=5)
    ent, _ = _entropy64(h, w, t, softcap)
    assert abs(ent - regimes.PEAKED_ENTROPY) < 0.04, ent
    keep = t != regimes.IGNORE_INDEX
    z = h[keep].double() @ w.double().t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    pt = torch.softmax(z, -1).gather(1, t[keep][:, None]).squeeze(1)
    assert float((pt > 0.99).double().mean()) > 0.75
    assert info["alpha"] > regimes.make_inputs("trained", N, H, V, softcap=softcap, device="cpu", seed=5)[3]["alpha"]


def test_trained_like_targets_follow_the_permuted_zipf_prior():
    g = torch.Generator().manual_seed(0)
    prior = regimes.zipf_prior(V, g, "cpu")
    assert math.isclose(float(prior.sum()), 1.0, rel_tol=1e-9)
    ranked = prior.sort(descending=True).values
    assert torch.allclose(ranked[:3] / ranked[0], torch.tensor([1.0, 2 ** -1.1, 3 ** -1.1], dtype=torch.float64))
    assert int(prior.argmax()) != 0  # a permutation, not token 0 first (with this seed)
    _, w, t, _ = regimes.make_inputs("trained", 4096, 16, V, device="cpu", seed=1)
    kept = t[t != regimes.IGNORE_INDEX]
    top = int(w[:, 0].float().argmax())  # the most likely token by the log-prior column
    counts = torch.bincount(kept, minlength=V).double()
    assert int(counts.argmax()) == top
    assert abs(counts[top] / kept.numel() - float(ranked[0])) < 0.03
    ignored = float((t == regimes.IGNORE_INDEX).double().mean())
    assert abs(ignored - regimes.IGNORED) < 0.03


def test_init_and_spread_regimes_are_near_uniform_and_spread():
    hi, wi, ti, info_i = regimes.make_inputs("init", N, H, V, device="cpu")
    hs, ws, ts, info_s = regimes.make_inputs("spread", N, H, V, device="cpu")
    ent_i, _ = _entropy64(hi, wi, ti)
    ent_s, _ = _entropy64(hs, ws, ts)
    assert math.log(V) - 0.05 < ent_i <= math.log(V)
    # Gaussian logits of standard deviation 2: entropy about log V - 2
    assert abs(ent_s - (math.log(V) - 2.0)) < 0.4, ent_s
    assert info_i["entropy"] > info_s["entropy"] > regimes.TRAINED_ENTROPY


def test_unknown_regime_is_refused():
    with pytest.raises(ValueError, match="regime"):
        regimes.make_inputs("saturated", 4, 4, 4, device="cpu")


def test_regime_benchmark_refuses_bad_arguments_and_reports_rows(tmp_path, capsys):
    from benchmarks import kernels_regimes as kr

    for argv, msg in ((["--heads", "llama3-9b"], "--heads"), (["--regimes", "saturated"], "--regimes"),
                      (["--reps", "0"], "--reps")):
        with pytest.raises(SystemExit):
            kr.main(argv + ["--out", str(tmp_path)])
        assert msg in capsys.readouterr().err
    rows = [dict(section="flce_regimes", shape="h N=1", regime="trained", entropy=2.5, regime_loss=1.5, floor_ms=10.0,
                 impl="liger_compat lowmem", status="ok", ms=12.0, x_floor=1.2, extra_mib=15.0, gh_err_vs_fp32=3e-3,
                 gw_err_vs_fp32=4e-3, tiles_skipped=5, tiles_skipped_share=0.25, gh_peaked_rows_err_vs_fp32=2e-3,
                 peaked_rows=7),
            dict(section="flce_regimes", shape="h N=1", regime="trained", impl="cce", status="error", error="OOM")]
    kr._append(tmp_path / "r.json", rows[0])
    kr._append(tmp_path / "r.json", rows[1])
    kr.main(["--report", "--out", str(tmp_path), "--name", "r"])
    md = (tmp_path / "r.md").read_text()
    assert "### trained: entropy 2.50 nats, loss 1.50; dense 3-matmul floor 10.0 ms" in md
    assert ("| liger_compat lowmem | 12.00 | 1.20 | 15 | 3.0e-03 | 4.0e-03 | 2.0e-03 (7 rows) "
            "| 25.0 % of tiles skipped |") in md
    assert "| cce | | | | | | | error OOM |" in md


def test_regime_benchmark_appends_a_second_call_and_stops_at_its_budget(tmp_path, capsys):
    import json

    from benchmarks import kernels_regimes as kr

    path = tmp_path / "r.json"
    path.write_text(json.dumps({"regenerate": "python -m benchmarks.kernels_regimes --heads qwen2-7b --name r",
                                "meta": {}, "rows": [{"section": "flce_regimes", "head": "qwen2-7b", "impl": "cce"},
                                                     {"section": "flce_regimes", "head": "llama3-8b", "impl": "old"}]}))
    # a budget already spent: no worker starts, every regime of the head is recorded as not run
    kr.main(["--heads", "llama3-8b", "--append", "--budget-s", "1e-9", "--out", str(tmp_path), "--name", "r"])
    data = json.loads(path.read_text())
    assert [r.get("impl") for r in data["rows"] if r["head"] == "qwen2-7b"] == ["cce"]
    mine = [r for r in data["rows"] if r["head"] == "llama3-8b"]
    assert [r["regime"] for r in mine] == list(kr.REGIMES) and {r["status"] for r in mine} == {"not run (budget)"}
    assert data["regenerate"] == ("python -m benchmarks.kernels_regimes --heads qwen2-7b --name r; "
                                  "python -m benchmarks.kernels_regimes --heads llama3-8b --append --budget-s 1e-9 --name r")
    capsys.readouterr()


def test_skip_analysis_counts_left_out_tiles_and_their_error_as_float64_does():
    """benchmarks.skip_analysis against a direct float64 evaluation of one rule, on trained-like
    inputs: the share of (row block, tile) pairs left out, and the grad_hidden error of leaving
    them out without and with the tile-mean correction."""
    from benchmarks import skip_analysis
    from liger_compat.kernels import _lowmem_triton

    bm, bn = 16, 32
    span = _lowmem_triton.MEAN_TILES * bn
    h, w, t, _ = regimes.make_inputs("trained", 256, 32, 2048, device="cpu", seed=3)
    n, rows = skip_analysis.analyse(h, w, t, None, [10, 60], bm, bn, ordered=True, share=0.5, floor=2.4e-7)
    got = {(r["eps"], r["rule"]): r for r in rows}
    keep = t != regimes.IGNORE_INDEX
    hd, tk = h[keep][:n].double(), t[keep][:n]
    order = skip_analysis.column_order(h[keep][:n].float(), w.float())  # the order analyse() tiles by
    wd = w.double()[order]
    tk = torch.argsort(order)[tk]  # targets in the sorted order
    p = torch.softmax(hd @ wd.t(), -1)
    d = p.clone()
    d[torch.arange(n), tk] -= 1.0
    gh = d @ wd
    total = done = 0
    err = torch.zeros_like(gh)
    err_c = torch.zeros_like(gh)
    for r0 in range(0, n, bm):
        for c0 in range(0, w.shape[0], bn):
            blk = p[r0:r0 + bm, c0:c0 + bn].clone()
            own = tk[r0:r0 + bm, None] == torch.arange(c0, c0 + blk.shape[1])[None, :]
            blk[own] = 0.0
            total += 1
            if (blk < 2.0 ** -10).all():
                done += 1
                part = blk @ wd[c0:c0 + bn]
                err[r0:r0 + bm] += part
                s0 = c0 // span * span  # the run of MEAN_TILES tiles the kernel's mean row covers
                mean_row = wd[s0:s0 + span].mean(0, keepdim=True)
                err_c[r0:r0 + bm] += part - blk.sum(1, keepdim=True) * mean_row
    row = got[("2^-10", "max")]
    assert done > 0 and math.isclose(row["skipped_pct"], 100.0 * done / total, rel_tol=1e-6)
    assert math.isclose(row["grad_h_err"], float(err.norm() / gh.norm()), rel_tol=1e-3)
    assert math.isclose(row["grad_h_err_corrected"], float(err_c.norm() / gh.norm()), rel_tol=1e-3)
    assert row["grad_h_err_corrected"] < row["grad_h_err"]
    # the kernel's rule leaves out a subset; an eps no entry reaches leaves out nothing
    assert got[("2^-10", "max+share")]["skipped_pct"] <= row["skipped_pct"]
    assert got[("2^-60", "max")]["skipped_pct"] == 0.0 and got[("2^-60", "max")]["grad_h_err"] == 0.0


def test_skip_analysis_prefix_cut_as_float64_does():
    """The prefix-cut table against a direct float64 evaluation: per group of rows, the cut is one
    column past the last sorted column where a non-target softmax entry reaches eps."""
    from benchmarks import skip_analysis

    h, w, t, _ = regimes.make_inputs("trained", 96, 24, 700, device="cpu", seed=5)
    rows = skip_analysis.prefix_cut(h, w, t, None, [9, 60], [32, 7])
    got = {(r["eps"], r["rows_per_group"]): r for r in rows}
    keep = t != regimes.IGNORE_INDEX
    hk, tk = h[keep], t[keep]
    order = skip_analysis.column_order(hk.float(), w.float())
    p = torch.softmax(hk.double() @ w.double()[order].t(), -1)
    p[torch.arange(p.shape[0]), torch.argsort(order)[tk]] = 0.0
    v = w.shape[0]
    for g in (32, 7):
        cuts = []
        for a in range(0, p.shape[0], g):
            cols = (p[a:a + g] >= 2.0 ** -9).any(0).nonzero()
            cuts.append(int(cols.max()) + 1 if cols.numel() else 0)
        want = 100.0 * (1 - sum(cuts) / (len(cuts) * v))
        assert 0.0 < want < 100.0
        assert math.isclose(got[("2^-9", g)]["left_out_pct"], want, rel_tol=1e-9, abs_tol=1e-9)
        assert got[("2^-60", g)]["left_out_pct"] == 0.0  # every column's entry reaches 2^-60
    assert got[("2^-9", 7)]["left_out_pct"] >= got[("2^-9", 32)]["left_out_pct"]  # smaller groups cut earlier


def test_regimes_runs_only_the_cut_cross_entropy_variants_the_installed_release_has(monkeypatch):
    """cut-cross-entropy 25.1.1 (the newest release) knows ``cce`` and ``torch_compile`` only: the
    Kahan and exact variants are then left out of the table as absent, not timed as errors."""
    import enum
    import types

    from benchmarks import kernels_regimes as kr

    impls = types.ModuleType("cut_cross_entropy.linear_cross_entropy")

    class LinearCrossEntropyImpl(enum.IntEnum):
        CCE = enum.auto()
        TORCH_COMPILE = enum.auto()

    def linear_cross_entropy(*a, **k):
        raise AssertionError("not called while building the table")

    linear_cross_entropy.__module__ = impls.__name__
    impls.LinearCrossEntropyImpl = LinearCrossEntropyImpl
    impls.linear_cross_entropy = linear_cross_entropy
    package = types.ModuleType("cut_cross_entropy")
    package.linear_cross_entropy = linear_cross_entropy
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", package)
    monkeypatch.setitem(sys.modules, impls.__name__, impls)
    assert kr.cce_implements("cce") and not kr.cce_implements("cce_exact")
    got = kr._impls(None)
    assert "cce" in got and "cce filter_eps=None" in got
    assert "cce_exact" not in got and "cce_kahan_full_c" not in got
    LinearCrossEntropyImpl2 = enum.IntEnum("LinearCrossEntropyImpl", ["CCE", "CCE_EXACT", "CCE_KAHAN_FULL_C"])
    monkeypatch.setattr(impls, "LinearCrossEntropyImpl", LinearCrossEntropyImpl2)
    assert {"cce_exact", "cce_kahan_full_c"} <= set(kr._impls(None))
