"""Errors the kernels find on the device, raised as Python errors without a host sync.

Two kinds, each recorded by the kernels' launches in a small int64 tensor instead of being read
at once:

* targets outside the vocabulary. A target outside ``[0, V)`` that is not ``ignore_index`` cannot
  be a class. The cross-entropy row kernels (Triton, and the torch reference) never address
  memory with it: the row's loss is NaN, its gradient zero, and the kernel records it in a
  three-element tensor from :func:`new_flag` (``[number of bad rows, largest bad target >= V or 0,
  smallest negative bad target or 0]``), folded into the launch that already reads the target;
  raised as :class:`TargetOutOfRangeError` (a ``ValueError``, and an ``IndexError`` / ``RuntimeError`` as
  native ``cross_entropy`` raises on CPU / CUDA);
* a gradient contract broken by the caller (:func:`watch_contract`): the log-prob head's
  ``grad_mode="sum"`` is told that every non-ignored row gets the same upstream gradient, and
  counts on the device the rows that do not; raised as :class:`GradientContractError`.

Reading such a tensor on the host as soon as the call returns would wait for the GPU. Instead
:func:`watch` copies it without blocking into pinned host memory and records a CUDA event (both
reused: a small pool, one buffer and event per call still in flight, usually one or two);
:func:`poll` reads the copies whose event has completed (``event.query()``, which never waits)
and raises. The loss functions poll when they are entered and at the start of their backward. So
a bad target on the GPU raises in that call's backward when the GPU has caught up by then, and at
the latest in a later call of a loss. On CPU tensors the flag is read at once (no sync to save):
the call itself raises. :func:`raise_target_errors` waits for the pending copies (their events
only) and raises; ``settings.debug`` still checks the targets up front, synchronously.

Inside CUDA graph capture nothing is watched (a replay could not report it): bad rows there
give NaN rows and zero gradients only.
"""

from __future__ import annotations

import threading
from typing import Callable, NamedTuple

import torch

# defined with the other input errors, each also of native's class for the same input (errors.py)
from .errors import GradientContractError, TargetOutOfRangeError

__all__ = ["TargetOutOfRangeError", "GradientContractError", "new_flag", "watch", "watch_contract", "poll",
           "raise_target_errors"]


class _Pending(NamedTuple):
    flag: torch.Tensor  # on the host: a pinned copy (CUDA) or the flag itself (CPU)
    event: object  # torch.cuda.Event, or None when the flag is readable now
    op: str
    num_classes: int
    ignore_index: int
    pooled: bool = False  # flag and event belong to _spare: handed back once read
    contract: Callable[[list[int]], str] | None = None  # a broken contract's message, from the flag


_pending: list[_Pending] = []
_lock = threading.Lock()
#: pinned host buffers and their events, free for the next :func:`watch`
_spare: list[tuple[torch.Tensor, object]] = []


def new_flag(device: torch.device) -> torch.Tensor:
    """The zeroed ``int64[3]`` tensor the kernels write bad targets into."""
    return torch.zeros(3, dtype=torch.int64, device=device)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def watch(flag: torch.Tensor, op: str, num_classes: int, ignore_index: int) -> None:
    """Queue ``flag`` (written by the kernels of one call of ``op``) for :func:`poll`."""
    _queue(flag, op, num_classes, ignore_index, None)


def watch_contract(flag: torch.Tensor, op: str, message: Callable[[list[int]], str]) -> None:
    """Queue ``flag`` (an int64 tensor of :func:`new_flag`'s shape, its first element the number of
    rows that broke a contract of ``op``) for :func:`poll`, which raises
    :class:`GradientContractError` with ``message(flag values)`` when it is not 0."""
    _queue(flag, op, 0, 0, message)


def _queue(flag, op, num_classes, ignore_index, contract) -> None:
    device = flag.device
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return
        with _lock:  # one lock for the spare buffer and the queue (a small step's host time)
            host, event = _spare.pop() if _spare else (None, None)
            if host is None:
                host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
                event = torch.cuda.Event()
            host.copy_(flag, non_blocking=True)
            event.record(torch.cuda.current_stream(device))  # where the copy was queued
            _pending.append(_Pending(host, event, op, num_classes, ignore_index, True, contract))
    elif device.type == "cpu":
        with _lock:
            _pending.append(_Pending(flag, None, op, num_classes, ignore_index, contract=contract))
    # other accelerators run the torch reference; settings.debug checks up front there


def _message(bad: list[tuple[_Pending, list[int]]]) -> str:
    p, (count, high, low) = bad[0]
    values = [x for x in (high, low) if x != 0]
    msg = (
        f"target holds {values[0]}, outside the vocabulary [0, {p.num_classes}) and not ignore_index={p.ignore_index} "
        f"({p.op}: {count} such target{'s' if count != 1 else ''}"
    )
    if len(values) > 1:
        msg += f", also {values[1]}"
    if p.op == "fused_linear_logprobs":
        msg += "; their rows are scored as ignored: zero, with no gradient)"
    else:
        msg += "; their loss rows are NaN and their gradient rows zero)"
    if p.event is not None:
        msg += "; found on the GPU and read back without a sync, so raised after that call returned"
    if len(bad) > 1:
        msg += f"; {len(bad) - 1} more call(s) had bad targets too"
    return msg


def poll() -> None:
    """Raise :class:`GradientContractError` for finished calls whose contract was broken, else
    :class:`TargetOutOfRangeError` for those that met a bad target; never waits.

    Every finished entry is taken off the queue, so one error reports (and clears) them all."""
    if not _pending:
        return
    with _lock:
        done, waiting = [], []
        capturing = None
        for p in _pending:
            if p.event is None:
                done.append(p)
                continue
            if capturing is None:  # an event is not queried while the stream is being captured
                capturing = _capturing()
                if capturing:
                    return
            (done if p.event.query() else waiting).append(p)
        if not done:
            return
        _pending[:] = waiting
        bad = []
        for p in done:
            values = p.flag.tolist()  # host memory: the copy (its event has completed) or a CPU flag
            if values[0] > 0:
                bad.append((p, values))
            if p.pooled:
                _spare.append((p.flag, p.event))
    broken = [(p, values) for p, values in bad if p.contract is not None]
    if broken:
        p, values = broken[0]
        more = len(bad) - 1
        raise GradientContractError(p.contract(values) + (f" ({more} more finished call(s) reported errors too)"
                                                           if more else ""))
    if bad:
        raise TargetOutOfRangeError(_message(bad))


def raise_target_errors() -> None:
    """Wait for the target checks of earlier loss calls still in flight and raise
    :class:`TargetOutOfRangeError` if any met a target outside ``[0, V)`` that is not
    ``ignore_index`` (:class:`GradientContractError` first, for a broken gradient contract).
    This waits for the GPU (up to those calls' events), so call it where a
    sync is acceptable, e.g. before logging or at the end of an epoch."""
    with _lock:
        events = [p.event for p in _pending if p.event is not None]
    for event in events:
        event.synchronize()
    poll()
