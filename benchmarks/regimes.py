"""Inputs of a language-model head in four logit regimes, for the fused-loss benchmarks.

A fused loss's speed and error depend on the softmax it sees (a gradient filter skips tiles of
near-zero probabilities), so every head is measured in these regimes:

* ``init``: ``h ~ 0.5 N(0, 1)``, ``w ~ 0.02 N(0, 1)``: a near-uniform softmax, as at initialisation.
* ``spread``: ``h ~ N(0, 1)``, ``w ~ N(0, 4 / H)``: Gaussian logits of standard deviation 2.
* ``trained``: what a trained model shows on text. Targets follow a Zipf(1.1) unigram over a random
  permutation of the vocabulary; one weight column holds the log-prior of each token and the
  matching hidden feature is the constant 1 (a bias through the matmul); every hidden state is
  Gaussian noise plus ``alpha`` times its target's weight row, ``alpha`` found by bisection so that
  the mean softmax entropy is :data:`TRAINED_ENTROPY` nats.
* ``peaked``: the trained-like construction at :data:`PEAKED_ENTROPY` nats, where most rows give
  their target a probability above 0.99 (a model that has learnt most of its text): the rows whose
  ``p_t - 1`` is tiny, where the rounding of a stored target logit moves the whole gradient.

In every regime :data:`IGNORED` of the targets are ``-100``. :func:`make_inputs` returns bf16
``h [N, H]``, ``w [V, H]`` and int64 targets, and :func:`softmax_stats` the mean entropy and loss
that the benchmarks report beside each regime.
"""

from __future__ import annotations

import math

import torch

REGIMES = ("init", "spread", "trained", "peaked")
#: mean softmax entropy (nats) of the trained-like regime
TRAINED_ENTROPY = 2.5
#: mean softmax entropy (nats) of the peaked regime
PEAKED_ENTROPY = 0.05
#: exponent of the trained-like regime's unigram
ZIPF_EXPONENT = 1.1
#: share of targets set to the ignore index
IGNORED = 0.1
IGNORE_INDEX = -100
#: rows the bisection measures the entropy on
BISECT_ROWS = 1024
NOISE = 1.0


def _capped(z: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return z if softcap is None else softcap * torch.tanh(z / softcap)


@torch.no_grad()
def softmax_stats(h: torch.Tensor, w: torch.Tensor, target: torch.Tensor, softcap: float | None = None,
                  rows: int | None = None, chunk: int = 1024) -> dict[str, float]:
    """Mean softmax entropy (nats) and mean cross-entropy loss over the non-ignored rows among the
    first ``rows`` rows of ``h`` (all by default); fp32 logits of the given (rounded) inputs,
    ``chunk`` rows at a time."""
    n = h.shape[0] if rows is None else min(rows, h.shape[0])
    wf = w.float()
    ent = loss = 0.0
    count = 0
    for s in range(0, n, chunk):
        t = target[s:min(n, s + chunk)]
        keep = t != IGNORE_INDEX
        if not bool(keep.any()):
            continue
        z = _capped(h[s:s + t.shape[0]][keep].float() @ wf.t(), softcap)
        logp = torch.log_softmax(z, dim=-1)
        ent += float(-(logp.exp() * logp).sum(dim=-1).sum())
        loss += float(-logp.gather(1, t[keep].unsqueeze(1)).sum())
        count += int(keep.sum())
    return {"entropy": ent / max(count, 1), "loss": loss / max(count, 1)}


def zipf_prior(v: int, generator: torch.Generator, device, exponent: float = ZIPF_EXPONENT) -> torch.Tensor:
    """Probabilities ``[V]`` of a Zipf unigram over a random permutation of the vocabulary."""
    rank = torch.arange(1, v + 1, device=device, dtype=torch.float64)
    p = rank ** -exponent
    p /= p.sum()
    perm = torch.randperm(v, generator=generator, device=generator.device).to(device)
    return torch.empty_like(p).index_copy_(0, perm, p)


def _with_ignored(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    t = t.clone()
    t[torch.rand(t.shape[0], generator=g, device=g.device).to(t.device) < IGNORED] = IGNORE_INDEX
    return t


def make_inputs(regime: str, n: int, hdim: int, v: int, *, softcap: float | None = None, device="cuda",
                seed: int = 0, dtype=torch.bfloat16, entropy: float = TRAINED_ENTROPY,
                tol: float = 0.02) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """``(h, w, target, info)`` of one regime of :data:`REGIMES`; ``info`` holds the regime's
    parameters (``alpha`` for the trained-like and peaked ones) and its measured mean entropy and loss
    (``entropy``: the trained-like regime's target; the peaked one takes :data:`PEAKED_ENTROPY`)."""
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {', '.join(REGIMES)}, got {regime!r}")
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    info: dict = {"regime": regime}
    if regime == "init":
        h = (0.5 * torch.randn(n, hdim, generator=g, device=dev)).to(dtype)
        w = (0.02 * torch.randn(v, hdim, generator=g, device=dev)).to(dtype)
        t = _with_ignored(torch.randint(0, v, (n,), generator=g, device=dev), g)
    elif regime == "spread":
        h = torch.randn(n, hdim, generator=g, device=dev).to(dtype)
        w = (torch.randn(v, hdim, generator=g, device=dev) * (2.0 / math.sqrt(hdim))).to(dtype)
        t = _with_ignored(torch.randint(0, v, (n,), generator=g, device=dev), g)
    else:
        if regime == "peaked" and entropy == TRAINED_ENTROPY:
            entropy = PEAKED_ENTROPY
        prior = zipf_prior(v, g, dev)
        t = torch.multinomial(prior.float(), n, replacement=True, generator=g)
        w32 = torch.randn(v, hdim, generator=g, device=dev) * (2.0 / math.sqrt(hdim))
        w32[:, 0] = prior.log().float()  # the log-prior column; hidden feature 0 is the constant 1
        w = w32.to(dtype)
        wt = w.float()[t]
        wt[:, 0] = 0.0
        noise = NOISE * torch.randn(n, hdim, generator=g, device=dev)
        t = _with_ignored(t, g)

        def hidden(alpha: float, rows: int | None = None) -> torch.Tensor:
            m = n if rows is None else min(rows, n)
            x = noise[:m] + alpha * wt[:m]
            x[:, 0] = 1.0
            return x.to(dtype)

        def ent(alpha: float) -> float:
            return softmax_stats(hidden(alpha, BISECT_ROWS), w, t, softcap)["entropy"]

        lo, hi = 0.0, 1.0
        while ent(hi) > entropy and hi < 1e4:  # the entropy falls as alpha grows
            lo, hi = hi, 2 * hi
        alpha = hi
        for _ in range(40):
            alpha = 0.5 * (lo + hi)
            e = ent(alpha)
            if abs(e - entropy) <= tol / 4:
                break
            if e > entropy:
                lo = alpha
            else:
                hi = alpha
        info["alpha"] = alpha
        h = hidden(alpha)
        del noise, wt
    info.update(softmax_stats(h, w, t, softcap, rows=max(BISECT_ROWS, 2048)))
    return h, w, t, info
