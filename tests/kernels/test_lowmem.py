"""The low-memory mode of fused_linear_cross_entropy (no stored logits) against float64 torch.

Under ``TRITON_INTERPRET=1`` (``test_interpret.py`` re-runs this module so) the low-memory
Triton kernels run and the tests assert that they did; in a normal pytest run the dispatch has
only the torch reference, which always runs in chunks, and the same comparisons check that
``mode="lowmem"`` falls back to it. Shapes are small and not multiples of the interpreter's
tiles (16 rows, 32 columns, 16 of the hidden dimension).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from liger_compat import _config
from liger_compat.kernels import CrossEntropyOutput, TargetOutOfRangeError, fused_linear_cross_entropy, last_backend
from liger_compat.kernels import loss as loss_mod
from harness import expected_backend, interpreting, tolerance
from reference64 import ce64, rel_err

DT = {"fp32": torch.float32, "fp16": torch.float16}  # the interpreter's bf16 tl.dot is not exact


def _mode() -> str:
    return "lowmem" if interpreting() else "chunked"


def _inputs(seed, n, h, v, dtype, ignore_frac=0.3, with_bias=False):
    g = torch.Generator().manual_seed(seed)
    hid = (torch.randn(n, h, generator=g) * 2.0).to(dtype).requires_grad_(True)
    w = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_(True)
    b = (torch.randn(v, generator=g) * 0.5).to(dtype).requires_grad_(True) if with_bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignore_frac] = -100
    return hid, w, b, t


def _reference(hid, w, b, t, g_out, **opts):
    h64 = hid.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    b64 = b.detach().double().requires_grad_(True) if b is not None else None
    logits = h64 @ w64.t() + (b64 if b64 is not None else 0.0)
    loss, zl, acc = ce64(logits, t, **opts)
    ins = (h64, w64) + ((b64,) if b64 is not None else ())
    grads = torch.autograd.grad(loss, ins, g_out.double())
    return loss.detach(), zl.detach(), acc, grads


CASES = [
    ("fp32", 48, {"reduction": "mean"}, True),
    ("fp32", 45, {"reduction": "sum", "softcap": 4.0}, False),
    ("fp32", 48, {"reduction": "none", "label_smoothing": 0.1}, True),
    ("fp32", 45, {"reduction": "mean", "lse_square_scale": 1e-3, "label_smoothing": 0.1, "softcap": 4.0}, True),
    ("fp32", 48, {"reduction": "sum", "num_items_in_batch": 17}, False),
    ("fp16", 48, {"reduction": "mean", "softcap": 4.0, "lse_square_scale": 1e-3}, True),
    ("fp16", 48, {"reduction": "none"}, False),
]


@pytest.mark.parametrize("dt,h,opts,with_bias", CASES)
def test_lowmem_matches_float64(dt, h, opts, with_bias):
    n, v = 37, 300
    dtype = DT[dt]
    hid, w, b, t = _inputs(7, n, h, v, dtype, with_bias=with_bias)
    out = fused_linear_cross_entropy(hid, w, t, bias=b, mode="lowmem", return_token_accuracy=True,
                                     return_z_loss=True, **opts)
    assert last_backend["fused_linear_cross_entropy"] == expected_backend()
    assert loss_mod.last_flce_mode == _mode()
    assert isinstance(out, CrossEntropyOutput)
    g = torch.Generator().manual_seed(3)
    g_out = torch.rand(out.loss.shape, generator=g) + 0.5
    ins = (hid, w) + ((b,) if b is not None else ())
    grads = torch.autograd.grad(out.loss, ins, g_out.to(out.loss.dtype))
    ref_loss, ref_zl, ref_acc, ref_grads = _reference(hid, w, b, t, g_out, **opts)

    # the low-memory kernels compute the logits in fp32 from the dtype's inputs (whose rounding
    # the reference shares); the chunked torch path rounds them to the dtype first
    tol32 = tolerance(dtype, n=h * v)
    assert rel_err(out.loss.detach(), ref_loss) < tol32
    assert rel_err(out.z_loss, ref_zl) < tol32 + 1e-12
    assert torch.equal(out.token_accuracy.double(), ref_acc) if opts.get("reduction") == "none" \
        else abs(out.token_accuracy.item() - ref_acc.item()) < 1e-6
    # gradients: rounded to the dtype (once for grad_hidden; grad_weight a few atomic sums)
    tol = tolerance(dtype, n=h * v, ulps=8.0)
    for name, got, ref in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert got.dtype == dtype
        assert rel_err(got, ref) < tol, name
    ignored = t == -100
    assert torch.count_nonzero(grads[0][ignored]) == 0
    if opts.get("reduction") == "none":
        assert torch.count_nonzero(out.loss.detach()[ignored]) == 0


def test_lowmem_several_row_groups(monkeypatch):
    """grad_hidden summed in more than one fp32 scratch group (a 16-row scratch) gives the same."""
    import liger_compat.kernels._lowmem_triton as lm

    hid, w, _, t = _inputs(11, 53, 32, 97, torch.float32)
    monkeypatch.setattr(lm, "GH_SCRATCH_BYTES", 16 * 4 * 32)
    loss = fused_linear_cross_entropy(hid, w, t, mode="lowmem", reduction="sum")
    assert loss_mod.last_flce_mode == _mode()
    gh, gw = torch.autograd.grad(loss, (hid, w))
    ref_loss, _, _, (rh, rw) = _reference(hid, w, None, t, torch.tensor(1.0), reduction="sum")
    tol = tolerance(torch.float32, n=32 * 97, ulps=8.0)
    assert rel_err(loss.detach(), ref_loss) < tol
    assert rel_err(gh, rh) < tol and rel_err(gw, rw) < tol


def test_lowmem_all_rows_ignored():
    hid, w, b, t = _inputs(5, 21, 32, 70, torch.float32, with_bias=True)
    t[:] = -100
    out = fused_linear_cross_entropy(hid, w, t, bias=b, mode="lowmem", return_token_accuracy=True)
    assert loss_mod.last_flce_mode == _mode()
    assert out.loss.item() == 0.0 and out.token_accuracy.item() == 0.0
    gh, gw, gb = torch.autograd.grad(out.loss, (hid, w, b))
    assert gh.shape == hid.shape and gw.shape == w.shape and gb.shape == b.shape
    assert not gh.any() and not gw.any() and not gb.any()
    rows = fused_linear_cross_entropy(hid.detach(), w.detach(), t, mode="lowmem", reduction="none")
    assert rows.shape == (21,) and not rows.any()


def test_lowmem_target_out_of_range_raises():
    hid, w, _, t = _inputs(2, 9, 16, 40, torch.float32, ignore_frac=0.0)
    t[4] = 40
    with pytest.raises(TargetOutOfRangeError, match="40"):
        fused_linear_cross_entropy(hid, w, t, mode="lowmem")


def test_lowmem_forward_without_grad_matches_chunked():
    hid, w, _, t = _inputs(9, 37, 48, 300, torch.float32)
    with torch.no_grad():
        a = fused_linear_cross_entropy(hid, w, t, mode="lowmem", reduction="none", return_token_accuracy=True)
        m = loss_mod.last_flce_mode
        c = fused_linear_cross_entropy(hid, w, t, mode="chunked", reduction="none", return_token_accuracy=True)
    assert m == _mode() and loss_mod.last_flce_mode == "chunked"
    assert rel_err(a.loss, c.loss) < tolerance(torch.float32, n=48 * 300)
    assert torch.equal(a.token_accuracy, c.token_accuracy)


def _free(monkeypatch, value):
    """A free-memory probe reporting ``value``, with ``auto``'s per-shape choices forgotten."""
    monkeypatch.setattr(loss_mod, "_free_bytes", lambda device: value)
    monkeypatch.setattr(loss_mod, "_auto_modes", {})


def test_auto_takes_lowmem_when_a_chunk_does_not_fit(monkeypatch):
    """``auto``: the free-memory probe decides; with the Triton path (the interpreter here) a
    probe that reports less than one chunk picks the low-memory kernels, plenty picks chunks."""
    hid, w, _, t = _inputs(4, 37, 48, 300, torch.float32)
    monkeypatch.setattr(_config.settings, "flce_mode", "auto")
    _free(monkeypatch, 1024)
    small = fused_linear_cross_entropy(hid, w, t)
    assert loss_mod.last_flce_mode == _mode()
    _free(monkeypatch, 2**40)
    big = fused_linear_cross_entropy(hid, w, t)
    assert loss_mod.last_flce_mode == "chunked"
    assert rel_err(small.detach(), big.detach()) < tolerance(torch.float32, n=48 * 300)
    monkeypatch.setattr(_config.settings, "flce_mode", "lowmem")
    fused_linear_cross_entropy(hid, w, t)
    assert loss_mod.last_flce_mode == _mode()
    monkeypatch.setattr(_config.settings, "flce_mode", "chunked")
    _free(monkeypatch, 0)
    fused_linear_cross_entropy(hid, w, t)
    assert loss_mod.last_flce_mode == "chunked"


def test_auto_reads_free_memory_once_per_shape(monkeypatch):
    """The probe (``memory_stats`` on the GPU, ~0.3 ms) runs the first time a shape is seen; the
    same shape again reuses the choice, another shape or element size probes again."""
    reads = []
    monkeypatch.setattr(loss_mod, "_free_bytes", lambda device: reads.append(device) or 10 * 2**30)
    monkeypatch.setattr(loss_mod, "_auto_modes", {})
    monkeypatch.setattr(_config.settings, "flce_mode", "auto")
    dev = torch.device("cpu")
    for _ in range(3):
        assert loss_mod.flce_mode_for(8192, 128256, 4096, 2, "triton", dev) == "chunked"
    assert len(reads) == 1
    loss_mod.flce_mode_for(8192, 128256, 4096, 4, "triton", dev)
    loss_mod.flce_mode_for(4096, 128256, 4096, 2, "triton", dev)
    assert len(reads) == 3


def test_mode_choice_rules(monkeypatch):
    """flce_mode_for itself (no kernel runs): the setting, the probe and the backend."""
    dev = torch.device("cpu")
    monkeypatch.setattr(_config.settings, "flce_mode", "auto")
    _free(monkeypatch, 10 * 2**30)
    assert loss_mod.flce_mode_for(8192, 128256, 4096, 2, "triton", dev) == "chunked"
    _free(monkeypatch, 2**20)
    assert loss_mod.flce_mode_for(8192, 128256, 4096, 2, "triton", dev) == "lowmem"
    assert loss_mod.flce_mode_for(8192, 128256, 4096, 2, "torch", dev) == "chunked"  # no low-memory reference
    assert loss_mod.flce_mode_for(8192, 128256, 4096, 2, "triton", dev, "chunked") == "chunked"
    _free(monkeypatch, None)  # unknown: the fast path
    assert loss_mod.flce_mode_for(8192, 128256, 4096, 2, "triton", dev) == "chunked"
    monkeypatch.setattr(_config.settings, "flce_mode", "lowmem")
    assert loss_mod.flce_mode_for(10, 100, 16, 2, "triton", dev) == "lowmem"
    assert loss_mod._free_bytes(dev) is None


def test_bad_mode_setting_and_keyword_raise_naming_them(monkeypatch):
    hid, w, _, t = _inputs(1, 5, 16, 20, torch.float32)
    monkeypatch.setattr(_config.settings, "flce_mode", "fast")
    with pytest.raises(ValueError, match="LIGER_COMPAT_FLCE_MODE must be one of auto, chunked, lowmem, got 'fast'"):
        fused_linear_cross_entropy(hid, w, t)
    monkeypatch.setattr(_config.settings, "flce_mode", "auto")
    with pytest.raises(ValueError, match="mode must be one of auto, chunked, lowmem or None, got 'tiny'"):
        fused_linear_cross_entropy(hid, w, t, mode="tiny")
    for bad in ("m1", "m128n128k64w8s3/m1", "a/b/c"):
        with pytest.raises(ValueError, match=f"config must be a name of .*, got '{bad}'"):
            fused_linear_cross_entropy(hid, w, t, mode="lowmem", config=bad)


def test_mode_setting_read_from_the_environment():
    code = ("from liger_compat import _config as c; print(c.settings.flce_mode, c.settings.source.get('flce_mode'));"
            "print(c.flce_mode())")
    base = {k: x for k, x in os.environ.items() if k != "LIGER_COMPAT_FLCE_MODE"}
    env = dict(base, LIGER_COMPAT_FLCE_MODE=" LowMem ")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["lowmem", "LIGER_COMPAT_FLCE_MODE", "lowmem"]
    r = subprocess.run([sys.executable, "-c", "import liger_compat; from liger_compat import _config as c; c.flce_mode()"],
                       env=dict(base, LIGER_COMPAT_FLCE_MODE="huge"), capture_output=True, text=True)
    assert r.returncode != 0 and "LIGER_COMPAT_FLCE_MODE must be one of" in r.stderr  # import itself worked
    r = subprocess.run([sys.executable, "-c", "from liger_compat import _config as c; print(c.flce_mode())"],
                       env=base, capture_output=True, text=True)
    assert r.stdout.strip() == "auto"
