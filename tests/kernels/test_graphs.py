"""The fused loss's pass replayed as a CUDA graph (``kernels/_graphs.py``): the bookkeeping on CPU.

A CUDA graph cannot be captured on CPU, so these tests put a stand-in graph into the cache: it
records the pass at capture and reruns it into the same output buffers at each replay, which is
what a replayed graph does with its buffers. The loss then runs the real cache, the real key,
lease and backward through the torch reference; every result is compared with a float64 loss
computed independently on the same inputs. The CUDA graph itself is tested in ``test_gpu.py``.
"""

from __future__ import annotations

import gc

import pytest
import torch

from liger_compat import _config
from liger_compat.kernels import _graphs, fused_linear_cross_entropy
from liger_compat.kernels import loss as L

N, H, V = 48, 16, 37


class RerunGraph:
    """Stands in for a CUDA graph: capture records the pass and hands out its outputs; replay
    reruns it on the input buffers and writes the results into those same outputs."""

    captured = 0

    def __init__(self, device):
        self.body = self.inputs = self.outputs = None

    def capture(self, body, inputs):
        RerunGraph.captured += 1
        self.body, self.inputs = body, inputs
        self.outputs = body(*inputs)
        return self.outputs

    def replay(self):
        for buf, new in zip(self.outputs, self.body(*self.inputs)):
            if buf is not None:
                buf.copy_(new)


class FailingGraph(RerunGraph):
    def capture(self, body, inputs):
        raise RuntimeError("operation not permitted when stream is capturing")


@pytest.fixture
def graphs(monkeypatch):
    """The loss's graph cache with the stand-in graph, graphs allowed on CPU tensors."""
    cache = _graphs.GraphCache(factory=RerunGraph)
    monkeypatch.setattr(L, "_GRAPHS", cache)
    real = L._graphable
    monkeypatch.setattr(L, "_graphable", lambda h, w, backend, knobs: _config.settings.flce_graphs and
                        not knobs.compact_ignored and not knobs.sparse_grads)
    monkeypatch.setattr(_config.settings, "flce_graphs", True)
    yield cache
    assert real is not None


def _inputs(ignore_frac=0.25):
    h = torch.randn(N, H)
    w = torch.randn(V, H) / H**0.5
    t = torch.randint(0, V, (N,))
    t[torch.rand(N) < ignore_frac] = -100
    t[0] = 3  # at least one labelled row
    return h, w, t


def _ref64(h, w, t, num_items=None, ignore_index=-100):
    """Loss, grad_hidden, grad_weight in float64 (plain torch, no liger_compat code)."""
    h64 = h.double().requires_grad_(True)
    w64 = w.double().requires_grad_(True)
    rows = torch.nn.functional.cross_entropy(h64 @ w64.T, t, ignore_index=ignore_index, reduction="none")
    valid = t != ignore_index
    loss = rows.sum() / (num_items if num_items is not None else valid.sum().clamp(min=1))
    loss.backward()
    return loss.detach(), h64.grad, w64.grad


def _fused(h, w, t, **kw):
    hh = h.clone().requires_grad_(True)
    out = fused_linear_cross_entropy(hh, w, t, mode="chunked", **kw)
    return hh, out


def _close(a, b):
    torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def test_replays_from_the_third_call_and_matches_float64_each_call(graphs):
    w = (torch.randn(V, H) / H**0.5).requires_grad_(True)
    for call in range(6):
        h, _, t = _inputs()
        w.grad = None
        hh, loss = _fused(h, w, t)
        loss.backward()
        ref, gh, gw = _ref64(h, w.detach(), t)
        _close(loss.detach(), ref)
        _close(hh.grad, gh)
        _close(w.grad, gw)
        assert graphs.captures == (call >= 2) and graphs.replays == max(0, call - 1)


def test_the_kept_loss_is_not_overwritten_by_the_next_replay(graphs):
    w = torch.randn(V, H) / H**0.5
    for _ in range(3):
        h, _, t = _inputs()
        hh, loss = _fused(h, w, t)
        loss.backward()
    h1, _, t1 = _inputs()
    _, kept = _fused(h1, w, t1)
    kept.backward()
    h2, _, t2 = _inputs()
    _, loss2 = _fused(h2, w, t2)
    loss2.backward()
    assert graphs.replays == 3
    _close(kept.detach(), _ref64(h1, w, t1)[0])
    _close(loss2.detach(), _ref64(h2, w, t2)[0])


def test_two_forwards_before_a_backward_do_not_share_the_graph(graphs):
    """The second forward finds the graph leased (its gradients not yet read) and runs eagerly;
    both backwards get their own gradients (two micro-batches summed into one backward)."""
    w = (torch.randn(V, H) / H**0.5).requires_grad_(True)
    for _ in range(3):
        h, _, t = _inputs()
        _fused(h, w, t)[1].backward()
    replays = graphs.replays
    (ha, ta), (hb, tb) = [(x[0], x[2]) for x in (_inputs(), _inputs())]
    w.grad = None
    hha, la = _fused(ha, w, ta)
    hhb, lb = _fused(hb, w, tb)
    assert graphs.replays == replays + 1  # the first replayed, the second ran eagerly
    (la + 0.5 * lb).backward()
    ra, gha, gwa = _ref64(ha, w.detach(), ta)
    rb, ghb, gwb = _ref64(hb, w.detach(), tb)
    _close(hha.grad, gha)
    _close(hhb.grad, 0.5 * ghb)
    _close(w.grad, gwa + 0.5 * gwb)
    # the lease ended with the backward: the next call replays again
    h, _, t = _inputs()
    _fused(h, w, t)[1].backward()
    assert graphs.replays == replays + 2


def test_a_loss_dropped_without_backward_frees_the_graph(graphs):
    w = (torch.randn(V, H) / H**0.5).requires_grad_(True)
    for _ in range(3):
        h, _, t = _inputs()
        _fused(h, w, t)[1].backward()
    h, _, t = _inputs()
    _, unused = _fused(h, w, t)
    replays = graphs.replays
    h, _, t = _inputs()
    _fused(h, w, t)  # leased by `unused`: eager
    assert graphs.replays == replays
    del unused
    gc.collect()
    h, _, t = _inputs()
    hh, loss = _fused(h, w, t)
    loss.backward()
    assert graphs.replays == replays + 1
    _close(hh.grad, _ref64(h, w.detach(), t)[1])


@pytest.mark.parametrize("change", ["weight", "ignore_index", "num_items", "chunk_mb", "dtype_of_target",
                                    "shift_target", "empty_mean"])
def test_the_key_holds_what_the_pass_reads(graphs, change, monkeypatch):
    """A call that differs in anything the captured pass reads besides its copied inputs does not
    replay the earlier graph: a new weight tensor, an option, the number of items (its value is an
    input, its kind is in the key), the chunk setting, the targets' dtype, the shift of the targets
    (same shape, one sequence) and the empty mean's NaN (every row ignored). Each result matches
    float64."""
    w = torch.randn(V, H) / H**0.5
    kw = {}
    for _ in range(4):
        h, _, t = _inputs()
        _fused(h, w, t)[1].backward()
    assert graphs.captures == 1 and graphs.replays == 2
    h, _, t = _inputs()
    num_items, ignore = None, -100
    if change == "weight":
        w = torch.randn(V, H) / H**0.5
    elif change == "ignore_index":
        ignore = 5
        kw["ignore_index"] = ignore
        t = torch.where(t == -100, torch.full_like(t, ignore), t)
    elif change == "num_items":
        num_items = 7.0
        kw["num_items_in_batch"] = 7
    elif change == "chunk_mb":
        monkeypatch.setattr(_config.settings, "flce_chunk_mb", "1")
    elif change == "shift_target":
        kw["shift_target"] = True
    elif change == "empty_mean":
        kw["empty_mean"] = "nan"
        t = torch.full_like(t, -100)
    else:
        t = t.int()
    hh, loss = _fused(h, w, t, **kw)
    loss.backward()
    assert graphs.replays == 2
    if change == "empty_mean":
        assert torch.isnan(loss) and hh.grad.abs().max() == 0
        return
    ref_t = torch.cat([t[1:], t.new_full((1,), -100)]) if change == "shift_target" else t
    ref, gh, _ = _ref64(h, w, ref_t.long(), num_items=num_items, ignore_index=ignore)
    _close(loss.detach(), ref)
    _close(hh.grad, gh)


def test_the_key_holds_how_the_triton_logits_are_stored(monkeypatch):
    """On the Triton path the key holds whether the logits GEMM stores tile-relative logits
    (``_logits_triton.SHIFT_LOGITS``): a graph captured one way never replays for the other."""
    pytest.importorskip("triton")
    from liger_compat.kernels import _logits_triton
    from liger_compat.kernels import loss as loss_mod

    h, w, t = torch.randn(4, H), torch.randn(V, H), torch.randint(0, V, (4,))
    opt = loss_mod.CEOptions()

    def key(backend):
        return loss_mod.graph_key(h, w, None, t, opt, backend, loss_mod.DEFAULT_KNOBS)

    shifted, torch_key = key("triton"), key("torch")
    monkeypatch.setattr(_logits_triton, "SHIFT_LOGITS", not _logits_triton.SHIFT_LOGITS)
    assert key("triton") != shifted and key("torch") == torch_key


def test_the_shift_and_the_empty_mean_run_inside_the_replayed_graph(graphs):
    """A causal LM's call (``shift_target=True``, ``empty_mean="nan"``) replays from its third call:
    each replay's loss and gradients are those of its own labels shifted (float64 of targets
    shifted here), and a call whose labels are all ignored replays to NaN with zero gradients."""
    w = (torch.randn(V, H) / H**0.5).requires_grad_(True)
    b, s = 4, N // 4
    for call in range(7):
        h = torch.randn(b, s, H)
        labels = torch.randint(0, V, (b, s))
        labels[torch.rand(b, s) < 0.25] = -100
        if call == 5:
            labels[:, 1:] = -100  # the first labels are no position's targets: nothing is labelled
        w.grad = None
        hh = h.clone().requires_grad_(True)
        loss = fused_linear_cross_entropy(hh, w, labels, mode="chunked", shift_target=True, empty_mean="nan")
        loss.backward()
        assert graphs.captures == (call >= 2) and graphs.replays == max(0, call - 1)
        if call == 5:
            assert torch.isnan(loss) and hh.grad.abs().max() == 0 and w.grad.abs().max() == 0
            continue
        t = torch.full_like(labels, -100)
        t[:, :-1] = labels[:, 1:]
        ref, gh, gw = _ref64(h.reshape(-1, H), w.detach(), t.reshape(-1))
        _close(loss.detach(), ref)
        _close(hh.grad.reshape(-1, H), gh)
        _close(w.grad, gw)


def test_num_items_in_batch_is_an_input_of_the_graph(graphs):
    """Gradient accumulation's divisor changes each step: a number or a tensor, copied in, never
    captured as a constant."""
    w = torch.randn(V, H) / H**0.5
    for i, items in enumerate([5, 9, 11, 13.0, torch.tensor(17), torch.tensor(19), torch.tensor(23), 29]):
        h, _, t = _inputs()
        hh, loss = _fused(h, w, t, num_items_in_batch=items)
        loss.backward()
        ref, gh, _ = _ref64(h, w, t, num_items=float(items))
        _close(loss.detach(), ref)
        _close(hh.grad, gh)
    # a number and a tensor are two keys, each captured at its third call and replayed from then
    # on: the numbers 11, 13.0 and 29, the tensor 23
    assert graphs.captures == 2 and graphs.replays == 4


def test_extras_are_copied_out_and_match(graphs):
    w = torch.randn(V, H) / H**0.5
    outs = []
    for _ in range(5):
        h, _, t = _inputs()
        out = fused_linear_cross_entropy(h.clone().requires_grad_(True), w, t, mode="chunked",
                                         return_token_accuracy=True, return_z_loss=True, lse_square_scale=1e-3)
        out.loss.backward()
        outs.append((out, h, t))
    assert graphs.replays == 3
    for out, h, t in outs:  # every call's extras are its own, after later replays
        logits = h.double() @ w.double().T
        valid = t != -100
        lse = torch.logsumexp(logits, -1)
        acc = ((logits.argmax(-1) == t) & valid).sum().double() / valid.sum()
        z = (1e-3 * lse * lse * valid).sum() / valid.sum()
        _close(out.token_accuracy, acc)
        _close(out.z_loss, z)
        assert not out.token_accuracy.requires_grad and not out.z_loss.requires_grad


def test_setting_off_and_failed_capture_run_eagerly(graphs, monkeypatch):
    w = torch.randn(V, H) / H**0.5
    monkeypatch.setattr(_config.settings, "flce_graphs", False)
    for _ in range(4):
        h, _, t = _inputs()
        _fused(h, w, t)[1].backward()
    assert graphs.captures == 0 and graphs.replays == 0
    monkeypatch.setattr(_config.settings, "flce_graphs", True)
    failing = _graphs.GraphCache(factory=FailingGraph)
    monkeypatch.setattr(L, "_GRAPHS", failing)
    for _ in range(5):
        h, _, t = _inputs()
        hh, loss = _fused(h, w, t)
        loss.backward()
        _close(hh.grad, _ref64(h, w, t)[1])
    assert failing.captures == 0 and len(failing.failures) == 1  # tried once, at the third call
    assert "not permitted" in failing.failures[0]


def test_reduction_none_and_no_gradient_are_not_graphed(graphs):
    w = torch.randn(V, H) / H**0.5
    for _ in range(4):
        h, _, t = _inputs()
        hh = h.clone().requires_grad_(True)
        rows = fused_linear_cross_entropy(hh, w, t, mode="chunked", reduction="none")
        rows.sum().backward()
        with torch.no_grad():
            fused_linear_cross_entropy(h, w, t, mode="chunked")
    assert graphs.captures == 0


def _body(x):
    return (x * 2,)


def test_cache_keeps_at_most_max_graphs_and_never_drops_a_leased_one():
    cache = _graphs.GraphCache(factory=RerunGraph)
    dev = torch.device("cpu")
    x = torch.randn(3)
    leases = {}
    for key in range(_graphs.MAX_GRAPHS):
        for _ in range(_graphs.CAPTURE_AT):
            got = cache.run(key, _body, (x,), dev)
        leases[key] = got[1]
    assert len(cache) == _graphs.MAX_GRAPHS
    # every graph leased: a new key cannot capture
    new = _graphs.MAX_GRAPHS
    assert all(cache.run(new, _body, (x,), dev) is None for _ in range(_graphs.CAPTURE_AT))
    del leases[0]
    got = cache.run(new, _body, (x,), dev)
    assert got is not None and len(cache) == _graphs.MAX_GRAPHS
    torch.testing.assert_close(got[0][0], x * 2)
    # key 0 was dropped; key 1 is still there and still leased
    assert cache.run(1, _body, (x,), dev) is None
    assert cache.run(0, _body, (x,), dev) is None  # counted again from the start


def test_cache_stops_capturing_when_keys_keep_changing():
    cache = _graphs.GraphCache(factory=RerunGraph)
    dev = torch.device("cpu")
    x = torch.randn(3)
    key = 0
    while not cache.stopped():
        for _ in range(_graphs.CAPTURE_AT):
            got = cache.run(key, _body, (x,), dev)
        assert got is not None
        del got
        key += 1
    assert cache.captures == _graphs.CHURN_CAPTURES
    assert all(cache.run(key, _body, (x,), dev) is None for _ in range(2 * _graphs.CAPTURE_AT))
    # graphs already there are still replayed
    assert cache.run(key - 1, _body, (x,), dev) is not None


def test_inputs_are_copied_each_replay():
    cache = _graphs.GraphCache(factory=RerunGraph)
    dev = torch.device("cpu")
    for _ in range(_graphs.CAPTURE_AT + 3):
        x = torch.randn(5)
        got = cache.run("k", lambda a, s: (a * s,), (x, 3.0), dev)
        if got is not None:
            torch.testing.assert_close(got[0][0], x * 3)
        del got  # the lease: while it is held, the graph is not replayed over its outputs
    assert cache.replays == 4


def test_a_backward_that_raises_frees_the_graph(graphs, monkeypatch):
    """A bad label found on the GPU raises at the start of the backward; the loss object kept by
    the caller (an exception's frame) must not hold the graph from then on."""
    from liger_compat.kernels import _device_errors

    w = (torch.randn(V, H) / H**0.5).requires_grad_(True)
    for _ in range(3):
        h, _, t = _inputs()
        _fused(h, w, t)[1].backward()
    replays = graphs.replays

    def fail():
        raise _device_errors.TargetOutOfRangeError("target holds 99, outside the vocabulary")

    h, _, t = _inputs()
    _, kept = _fused(h, w, t)
    monkeypatch.setattr(_device_errors, "poll", fail)
    with pytest.raises(_device_errors.TargetOutOfRangeError, match="holds 99"):
        kept.backward()
    monkeypatch.undo()
    monkeypatch.setattr(L, "_GRAPHS", graphs)
    monkeypatch.setattr(L, "_graphable", lambda *a: True)
    h, _, t = _inputs()
    hh, loss = _fused(h, w, t)
    loss.backward()
    assert graphs.replays == replays + 2
    _close(hh.grad, _ref64(h, w.detach(), t)[1])


def _op_call(w):
    """One ``flce_with_grads`` call (what a compiled step calls) on fresh rows: (outputs, h, t)."""
    h, _, t = _inputs()
    scale = (1.0 / (t != -100).sum()).float().reshape(())
    out = torch.ops.liger_compat.flce_with_grads(h, w, None, t, scale, -100, 0.0, 0.0, None, True, True, False, "auto",
                                                 "auto", False, "split")
    return out, h, t


def _check_op(out, h, w, t):
    loss, zl, hits, gh, gw, gb = out
    ref, rgh, rgw = _ref64(h, w, t)
    _close(loss, ref)
    _close(gh, rgh)
    _close(gw, rgw)
    torch.testing.assert_close(hits, ((h @ w.T).argmax(-1) == t).float() * (t != -100))
    assert gb.numel() == 0 and not zl.any()


def _graph_buffers(graphs):
    (entry,) = graphs._graphs.values()
    return entry.outputs


def test_the_compiled_paths_op_hands_on_its_gradients_without_a_copy(graphs):
    """``flce_with_grads`` replays the same graphs. Its gradients (read by its backward alone) are
    the graph's own buffers, not copies; its loss and per-row outputs are copies. Dropped before the
    next call, as a compiled step's backward drops them, every call from the third replays."""
    w = torch.randn(V, H) / H**0.5
    for i in range(5):
        out, h, t = _op_call(w)
        _check_op(out, h, w, t)
        if i >= 2:
            bufs = _graph_buffers(graphs)
            assert out[4].untyped_storage().data_ptr() == bufs[4].untyped_storage().data_ptr()  # grad_weight
            assert out[3].untyped_storage().data_ptr() == bufs[3].untyped_storage().data_ptr()  # grad_hidden
            assert out[0].untyped_storage().data_ptr() != bufs[0].untyped_storage().data_ptr()  # the loss: a copy
        del out
    assert graphs.captures == 1 and graphs.replays == 3


def test_the_compiled_paths_op_never_replays_over_gradients_still_held(graphs):
    """A compiled graph keeps the op's gradients until its backward: while any of them (or a tensor
    made from one, sharing its storage) is alive, a call runs eagerly and what is held keeps its
    values; once they are gone the graph replays again."""
    w = torch.randn(V, H) / H**0.5
    held = [_op_call(w) for _ in range(5)]  # two forwards before a backward, and more
    assert graphs.captures == 1 and graphs.replays == 1  # the third call; the 4th and 5th ran eagerly
    for out, h, t in held:
        _check_op(out, h, w, t)
    # only a view of a view of the replayed call's grad_weight kept: its storage still counts
    out, h, t = held[2]
    want = _ref64(h, w, t)[2]
    kept = out[4][1:][:, :4]
    del held, out
    after, h2, t2 = _op_call(w)
    assert graphs.replays == 1
    _check_op(after, h2, w, t2)
    _close(kept, want[1:, :4])
    del after, kept
    again, h3, t3 = _op_call(w)
    assert graphs.replays == 2
    _check_op(again, h3, w, t3)


def test_a_kept_loss_does_not_hold_the_graph(graphs):
    """The loss a caller keeps past the next step (``loss = model(...).loss`` is bound after the next
    forward has run) and the per-row outputs are copies: the next call replays and the kept loss
    keeps its value."""
    w = torch.randn(V, H) / H**0.5
    for _ in range(2):
        _op_call(w)
    out, h, t = _op_call(w)
    loss, zl, hits = out[:3]
    ref = _ref64(h, w, t)[0]
    del out
    nxt, h2, t2 = _op_call(w)
    assert graphs.replays == 2
    _close(loss, ref)
    _check_op(nxt, h2, w, t2)


def test_input_buffers_live_on_the_pass_device():
    """A tensor argument elsewhere (a CPU ``num_items_in_batch`` for a GPU pass) gets its buffer on
    the pass's device: it is copied in before the replay instead of inside the captured pass. The
    meta device stands in for the GPU."""
    made = []

    class Recording(RerunGraph):
        def capture(self, body, inputs):
            made.append(inputs)
            return super().capture(body, inputs)

    cache = _graphs.GraphCache(factory=Recording)
    meta = torch.device("meta")
    x = torch.randn(4)
    for _ in range(_graphs.CAPTURE_AT):
        got = cache.run("k", lambda a, s: (a * 2,), (x, 7.0), meta)
    assert got is not None and [t.device for t in made[0]] == [meta, meta]
    assert made[0][0].shape == x.shape and made[0][0].dtype == x.dtype
