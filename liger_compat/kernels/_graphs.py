"""A pass of kernels replayed as one CUDA graph where a small step repeats it with the same key.

A small training step on a GPU is bound by its host: the GPU waits for the launches. The chunked
fused loss's forward pass is a dozen launches (Triton kernels through Triton's Python launcher,
cuBLAS products, allocations, the reduction's scalar ops), about 1.1-1.5 ms of host time a call
where native's logits and ``cross_entropy`` take a few tenths (``benchmarks/results/
op_host_h100.txt``). :class:`GraphCache` runs such a pass eagerly the first calls with a key (the
kernels compile there), captures it into a CUDA graph at call :data:`CAPTURE_AT`, and from then on
copies the call's inputs into the graph's input buffers and replays it: one launch.

The caller builds the key from everything the pass depends on besides the copied inputs (shapes,
dtypes, the address and layout of every tensor the graph reads where it lies, the options and
settings it reads). The graph's outputs are its own buffers, overwritten by the next replay, so a
replay hands out a :class:`Lease` with them: until the caller drops its reference (after reading or copying
the outputs it keeps) a call with the same key runs eagerly instead of replaying over them. The
lease is an object the caller holds (the autograd context); when it is freed without being
released (a loss never backpropagated) the graph is free again. A caller that cannot hold a lease
until its consumer is done (a custom op inside a compiled graph, whose outputs the compiled
backward keeps) hands on :func:`alias` of an output instead of a copy: the graph does not replay
while any tensor shares an output's storage (its storage use count, taken at capture, is exceeded).

Bounds: at most :data:`MAX_GRAPHS` graphs are kept (the least recently used one is dropped with its
memory; a leased one never); a key that failed to capture is never tried again; and once
:data:`CHURN_CAPTURES` graphs were captured with fewer than :data:`REPLAYS_PER_CAPTURE` replays
each (keys that keep changing) no new graph is captured in this process.

No CUDA work happens here without a caller: CPU tensors never reach it (the caller decides where a
graph applies); the graph factory is a parameter so that the bookkeeping is tested on CPU with a
stand-in that reruns the pass.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch

#: the call with a key that captures the graph (the calls before it run eagerly: Triton compiles
#: and tunes there, cuBLAS picks its kernels); later calls replay it
CAPTURE_AT = 3
#: graphs kept at once (each holds its pass's buffers, one chunk of logits and the gradients)
MAX_GRAPHS = 2
#: captures after which a process that replays little stops capturing
CHURN_CAPTURES = 4
#: replays each capture must have paid for by then
REPLAYS_PER_CAPTURE = 8
#: keys counted before the counts are cleared (shapes that never repeat)
MAX_SEEN = 256


class Lease:
    """Held by the caller while a replay's outputs are in use; freeing it ends the lease."""

    __slots__ = ("__weakref__",)


def storage_uses(t: torch.Tensor | None) -> int:
    """How many tensors (views, aliases, autograd's saved copies: every ``TensorImpl``) share the
    storage of ``t`` now, plus the one storage object this call makes (0 for None)."""
    return 0 if t is None else torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _Entry:
    __slots__ = ("graph", "inputs", "outputs", "lease", "uses")

    def __init__(self, graph: Any, inputs: tuple, outputs: tuple) -> None:
        self.graph, self.inputs, self.outputs = graph, inputs, outputs
        self.lease: weakref.ref | None = None
        #: each output's storage uses with nobody else holding it (taken at capture)
        self.uses = tuple(storage_uses(t) for t in outputs)

    def busy(self) -> bool:
        """A lease on the outputs is held, or a tensor outside the graph still shares an output's
        storage (an alias the caller handed on instead of a copy, :func:`alias`, or anything made
        from it: a view of a view keeps the storage, not the view it came from)."""
        if self.lease is not None and self.lease() is not None:
            return True
        return any(storage_uses(t) > n for t, n in zip(self.outputs, self.uses) if t is not None)


def alias(t: torch.Tensor | None) -> torch.Tensor | None:
    """A new tensor on the storage of graph output ``t``: the graph that wrote it does not replay
    while it, or any tensor made from it that shares its storage, is alive (:meth:`_Entry.busy`).
    Handed on in place of a copy where the caller cannot say when its consumer is done with it."""
    return None if t is None else t.detach()


class CudaGraph:
    """The real graph: captured on a side stream of the inputs' device (the caller's work queued so
    far is waited for, not the whole device), replayed on the current stream."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._graph = torch.cuda.CUDAGraph()

    def capture(self, body: Callable[..., tuple], inputs: tuple) -> tuple:
        cur = torch.cuda.current_stream(self._device)
        side = torch.cuda.Stream(self._device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            # thread_local: another thread's CUDA calls meanwhile (a DataLoader pinning memory)
            # neither break this capture nor are refused
            self._graph.capture_begin(capture_error_mode="thread_local")
            try:
                outputs = body(*inputs)
            except BaseException:
                try:
                    self._graph.capture_end()
                except Exception:
                    pass
                raise
            self._graph.capture_end()
        cur.wait_stream(side)
        return outputs

    def replay(self) -> None:
        self._graph.replay()


class GraphCache:
    """Graphs of one pass, by key (see the module docstring)."""

    def __init__(self, factory: Callable[[torch.device], Any] = CudaGraph) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._graphs: OrderedDict[Any, _Entry] = OrderedDict()
        self._seen: dict[Any, int] = {}
        self._failed: set = set()
        self.captures = 0
        self.replays = 0
        self.failures: list[str] = []

    def clear(self) -> None:
        """Drop every graph (their memory goes back to the allocator) and every count."""
        with self._lock:
            self._graphs.clear()
            self._seen.clear()
            self._failed.clear()
            self.captures = self.replays = 0
            self.failures = []

    def __len__(self) -> int:
        return len(self._graphs)

    def stopped(self) -> bool:
        """No new capture: keys kept changing (see the module docstring)."""
        return self.captures >= CHURN_CAPTURES and self.replays < REPLAYS_PER_CAPTURE * self.captures

    def _room(self) -> bool:
        """Room for one more graph, dropping the least recently used free one if needed."""
        if len(self._graphs) < MAX_GRAPHS:
            return True
        for k, e in self._graphs.items():
            if not e.busy():
                del self._graphs[k]
                return True
        return False

    def run(self, key: Any, body: Callable[..., tuple], args: Sequence[Any], device: torch.device
            ) -> tuple[tuple, Lease] | None:
        """The outputs of ``body(*args)`` from this key's graph, with the lease on them, or None:
        the caller runs the pass eagerly (a call before :data:`CAPTURE_AT`, the graph leased, no
        room, a capture that failed, the cache stopped). ``args`` are tensors copied into the
        graph's input buffers on ``device`` (their shapes and dtypes must be in ``key``), numbers
        filled into a 0-d fp32 buffer there, or None (``body`` gets None). ``body`` must be capturable
        (no host sync, no host read of device data)."""
        with self._lock:
            entry = self._graphs.get(key)
            if entry is not None:
                if entry.busy():
                    return None
                self._graphs.move_to_end(key)
            else:
                if key in self._failed or self.stopped():
                    return None
                count = self._seen.get(key, 0) + 1
                if len(self._seen) >= MAX_SEEN and key not in self._seen:
                    self._seen.clear()
                self._seen[key] = count
                if count < CAPTURE_AT or not self._room():
                    return None
                entry = self._capture(key, body, args, device)
                if entry is None:
                    return None
            for buf, a in zip(entry.inputs, args):
                if isinstance(a, torch.Tensor):
                    buf.copy_(a)
                elif a is not None:
                    buf.fill_(a)
            entry.graph.replay()
            self.replays += 1
            lease = Lease()
            entry.lease = weakref.ref(lease)
            return entry.outputs, lease

    def _capture(self, key, body, args, device) -> _Entry | None:
        # on ``device`` whatever the argument's: a CPU tensor (``num_items_in_batch``) is copied in
        # before the replay, as the eager pass's ``.to(device)`` would (a host-to-device copy inside
        # the capture would fail it)
        inputs = tuple(None if a is None else
                       torch.empty(tuple(a.shape), dtype=a.dtype, device=device) if isinstance(a, torch.Tensor)
                       else torch.empty((), dtype=torch.float32, device=device) for a in args)
        graph = self._factory(device)
        try:
            outputs = graph.capture(body, inputs)
        except Exception as exc:  # not capturable here: this key runs eagerly from now on
            self._failed.add(key)
            self.failures.append(f"{type(exc).__name__}: {exc}"[:300])
            return None
        self._seen.pop(key, None)
        entry = _Entry(graph, inputs, tuple(outputs))
        self._graphs[key] = entry
        self.captures += 1
        return entry
