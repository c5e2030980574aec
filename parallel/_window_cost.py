"""What a sliding window leaves of each block, for the cost model (:mod:`cp_rope.parallel.cost_model`).

The window convention is :mod:`cp_rope.parallel._window`'s: the query at position ``p`` of a
document sees the keys ``p - W + 1 .. p``. A causal document of ``n`` tokens then has
:func:`causal_pairs` ``= sum_p min(p + 1, W)`` visible (query, key) pairs, and every count
below is a difference of that one function: the pairs of a query chunk against the key
chunk ``delta`` chunks before it (all of whose keys exist) are the second difference
``P((delta + 1) c) - 2 P(delta c) + P((delta - 1) c)`` of ``P = causal_pairs`` over chunk
lengths ``c``. A segment is ``(pairs, query rows, key rows, tiles)``: its rows are those
with at least one visible pair, its tiles the kernel's ``tile x tile`` tiles it touches
(a band of width W crosses about one more tile per tile row than it fills).
"""

from __future__ import annotations

import numpy as np

__all__ = ["causal_pairs", "ring_segments", "allgather_segments", "whole_segments"]


def causal_pairs(lens, window: int | None = None) -> np.ndarray:
    """Visible (query, key) pairs of causal documents of lengths ``lens`` (ints) under a left
    window ``W`` (None: none): ``n (n + 1) / 2`` when ``W >= n``, else ``W n - W (W - 1) / 2``.
    Returns int64 ``[len(lens)]``."""
    n = np.asarray(lens, dtype=np.int64)
    if window is None:
        return n * (n + 1) // 2
    w = np.minimum(np.int64(window), n)
    return w * n - w * (w - 1) // 2


def _ceil(a, b):
    return -(-np.asarray(a, dtype=np.int64) // b)


def _diag(c: np.ndarray, window: int, tile: int):
    """A chunk of ``c`` rows against itself: causal inside the window."""
    nq = _ceil(c, tile)
    band = nq * (_ceil(max(window - 1, 0), tile) + 1)
    return causal_pairs(c, window), c, c, np.minimum(nq * (nq + 1) // 2, band)


def _rect(pairs, lq, lk, tile: int):
    """A segment whose visible pairs are a corner or band of its ``lq x lk`` rectangle."""
    nq, nk = _ceil(lq, tile), _ceil(lk, tile)
    return pairs, lq, lk, np.minimum(nq * nk, _ceil(pairs, tile * tile) + nq + nk)


def _offdiag(c: np.ndarray, delta: int, window: int, tile: int):
    """A query chunk against the key chunk ``delta >= 1`` chunks before it (length ``c``)."""
    P = lambda m: causal_pairs(m * c, window)
    pairs = P(delta + 1) - 2 * P(delta) + P(delta - 1)
    rows = np.clip(window - 1 - (delta - 1) * c, 0, c)  # queries (and keys) that meet
    return _rect(pairs, rows, rows, tile)


def _cat(segs):
    if not segs:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, z
    return tuple(np.concatenate([np.asarray(s[k], dtype=np.int64) for s in segs])
                 for k in range(4))


def whole_segments(lens: np.ndarray, window: int, tile: int):
    """Whole documents of ``lens`` tokens run causally on one rank (C = 1, per-document
    placement, Ulysses after its all-to-all)."""
    return _diag(np.asarray(lens, dtype=np.int64), window, tile)


def ring_segments(lens: np.ndarray, C: int, r: int, i: int, window: int, tile: int):
    """Step ``i`` of rank ``r`` in a (windowed) ring of ``C > 1`` ranks over documents of
    *global* lengths ``lens`` (divisible by 2C): rank ``r``'s zigzag chunks ``r, 2C-1-r``
    against the chunks of rank ``(r - i) mod C`` (step 0: its own)."""
    c = np.asarray(lens, dtype=np.int64) // (2 * C)
    src = (r - i) % C
    segs = []
    for qi in (r, 2 * C - 1 - r):
        for ki in (src, 2 * C - 1 - src):
            if ki == qi:
                segs.append(_diag(c, window, tile))
            elif ki < qi:
                segs.append(_offdiag(c, qi - ki, window, tile))
    return _cat(segs)


def allgather_segments(lens: np.ndarray, C: int, r: int, window: int, tile: int):
    """``(local, global)`` segments of rank ``r`` in the (windowed) all-gather: each chunk
    against itself, and against every gathered key before it in the document."""
    c = np.asarray(lens, dtype=np.int64) // (2 * C)
    local, glob = [], []
    for qi in (r, 2 * C - 1 - r):
        local.append(_diag(c, window, tile))
        if qi == 0:
            continue
        pairs = (causal_pairs((qi + 1) * c, window) - causal_pairs(qi * c, window)
                 - causal_pairs(c, window))
        glob.append(_rect(pairs, np.minimum(c, window - 1), np.minimum(qi * c, window - 1), tile))
    return _cat(local), _cat(glob)
