"""Token-budget batching over a map-style dataset.

* :class:`TokenBudgetBatchSampler`: batches of document spans that fit a token
  budget (first-fit-decreasing over a window), sharded over data-parallel ranks,
  resumable mid-epoch.
* :class:`SpanDataset`: wraps a map-style dataset so that it accepts the spans the
  sampler yields.

See :mod:`cp_rope.parallel.collator` for the DataLoader set-up.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from cp_rope.validation import check_bool, check_cp_args, check_int, check_size_rank

from .collator import _check_budget, _padded, _span_example, _to_int64

__all__ = ["TokenBudgetBatchSampler", "SpanDataset"]


def _check_dp(dp_size: Any, dp_rank: Any) -> tuple[int, int]:
    return check_size_rank(dp_size, dp_rank, names=("dp_size", "dp_rank"))



# --------------------------------------------------------------------------------------
# First-fit-decreasing (shared with streaming.py)
# --------------------------------------------------------------------------------------


def _first_fit_decreasing(costs: np.ndarray, budget: int) -> list[np.ndarray]:
    """Bins of item indices (into ``costs``), each summing to at most ``budget``.

    Items are placed in decreasing cost order (stable) into the first open bin
    with room (Johnson's FFD: at most 11/9 OPT + 6/9 bins). Every cost must be
    ``<= budget``. One numpy scan over the open bins per item.
    """
    if costs.size == 0:
        return []
    order = np.argsort(-costs, kind="stable")
    room = np.empty(costs.size, np.int64)
    assign = np.empty(costs.size, np.int64)
    n_bins = 0
    for item in order.tolist():
        c = costs[item]
        b = n_bins
        if n_bins:
            fits = room[:n_bins] >= c
            first = int(fits.argmax())
            if fits[first]:
                b = first
        if b == n_bins:
            room[b] = budget
            n_bins += 1
        room[b] -= c
        assign[item] = b
    by_bin = np.argsort(assign, kind="stable")
    return np.split(by_bin, np.cumsum(np.bincount(assign, minlength=n_bins))[:-1])


def _budget_pieces(length: int, cost: int, piece: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of a document cut so that each piece's padded cost fits a budget."""
    if cost <= piece:
        yield 0, length
    else:
        for s in range(0, length, piece):
            yield s, min(s + piece, length)


# --------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------


class TokenBudgetBatchSampler(Sampler[list[tuple[int, int, int]]]):
    """Batches of document spans whose padded lengths fit ``max_tokens``.

    Every document of padded length (``ceil(len / 2C) * 2C``, ``C = cp_size``) at
    most ``max_tokens`` is one item ``(index, 0, len)``; a longer document is
    split into items ``(index, start, end)`` of ``floor(max_tokens / 2C) * 2C``
    tokens (the last one shorter), never dropped. Each epoch, items are
    shuffled (``seed``, epoch), taken ``window`` at a time and packed by
    first-fit-decreasing; the batches are shuffled, then dealt round-robin to
    the ``dp_size`` data-parallel ranks.

    Every DP rank gets the same number of batches: with ``drop_last=False``
    (default) the epoch's batch count is raised to a multiple of ``dp_size`` by
    splitting the fullest batches in two (no example repeated or lost; an
    empty batch only when there are fewer items than ranks); with
    ``drop_last=True`` the last ``n % dp_size`` batches are dropped.

    Yields lists of ``(index, start, end)`` int tuples: wrap the dataset in
    :class:`SpanDataset` so that ``dataset[(index, start, end)]`` returns what
    :class:`PackingCollator` packs. Zero-length documents are items of cost 0
    (the collator drops them).

    Args:
        lengths: ``[N]`` non-negative token counts of the documents.
        max_tokens: token budget per batch, padding for ``cp_size`` included
            (the ``T`` of the global batch); at least ``2 * cp_size``.
        cp_size: CP degree; every sequence is padded to a multiple of ``2 * cp_size``.
        window: items packed together (larger: fuller batches, less randomness).
        shuffle, seed: shuffle items and batches with ``numpy`` seeded by ``(seed, epoch)``.
        dp_size, dp_rank: data-parallel degree and this rank (each CP rank of a
            group passes the same ``dp_rank``, so the group sees the same batches).
        drop_last: see above.

    Resume: :meth:`state_dict` / :meth:`load_state_dict` record the epoch and
    the batches consumed in it; iteration resumes at the next batch exactly.
    Every ``iter()`` of the loaded epoch starts there (also the repeated
    ``iter(batch_sampler)`` of a multi-process ``DataLoader``) until a pass
    finishes the epoch or :meth:`set_epoch` selects another one.

    Raises: ``TypeError``/``ValueError`` naming the argument.
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray | torch.Tensor, max_tokens: int, *,
                 cp_size: int = 1, window: int = 1024, shuffle: bool = True, seed: int = 0,
                 dp_size: int = 1, dp_rank: int = 0, drop_last: bool = False):
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.detach().cpu().numpy()
        lengths = np.asarray(lengths)
        if lengths.ndim != 1:
            raise ValueError(f"lengths must be 1-D, got shape {lengths.shape}")
        if lengths.size and lengths.dtype.kind not in "iu":
            raise TypeError(f"lengths must hold integers, got dtype {lengths.dtype}")
        lengths = _to_int64(lengths, "lengths hold").copy()
        if lengths.size and int(lengths.min()) < 0:
            raise ValueError(f"lengths must be >= 0, got {int(lengths.min())} at index "
                             f"{int(lengths.argmin())}")
        check_cp_args(cp_size, 0)
        max_tokens = _check_budget(max_tokens, cp_size)
        window = check_int("window", window, min_value=1)
        seed = check_int("seed", seed, min_value=0)
        shuffle, drop_last = check_bool("shuffle", shuffle), check_bool("drop_last", drop_last)
        dp_size, dp_rank = _check_dp(dp_size, dp_rank)
        m = 2 * cp_size
        self.lengths, self.max_tokens, self.cp_size = lengths, max_tokens, cp_size
        self.window, self.shuffle, self.seed = window, shuffle, seed
        self.dp_size, self.dp_rank, self.drop_last = dp_size, dp_rank, drop_last

        piece = max_tokens // m * m
        docs, starts, ends = [], [], []
        costs = _padded(lengths, m)
        for i in np.flatnonzero(costs > max_tokens).tolist():
            for s, e in _budget_pieces(int(lengths[i]), int(costs[i]), piece):
                docs.append(i)
                starts.append(s)
                ends.append(e)
        fits = np.flatnonzero(costs <= max_tokens)
        self._doc = np.concatenate([fits, np.asarray(docs, np.int64)])
        self._start = np.concatenate([np.zeros(fits.size, np.int64), np.asarray(starts, np.int64)])
        self._end = np.concatenate([lengths[fits], np.asarray(ends, np.int64)])
        order = np.lexsort((self._start, self._doc))  # items in document order
        self._doc, self._start, self._end = self._doc[order], self._start[order], self._end[order]
        self._cost = _padded(self._end - self._start, m)
        self._fingerprint = zlib.crc32(lengths.tobytes()) ^ zlib.crc32(
            repr((max_tokens, cp_size, window, shuffle, seed, dp_size, drop_last)).encode())
        self.epoch = 0
        self._resume_at = 0
        self._consumed = 0
        self._plan_cache: tuple[int, list[np.ndarray]] | None = None

    # -- epoch plan -------------------------------------------------------------------

    def _plan(self) -> list[np.ndarray]:
        """All batches of this epoch (item indices), before the DP split; cached."""
        if self._plan_cache is not None and self._plan_cache[0] == self.epoch:
            return self._plan_cache[1]
        rng = np.random.default_rng((self.seed, self.epoch))
        n = self._cost.size
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        batches = []
        for w in range(0, n, self.window):
            items = order[w:w + self.window]
            batches += [items[b] for b in _first_fit_decreasing(self._cost[items], self.max_tokens)]
        if self.shuffle:
            batches = [batches[k] for k in rng.permutation(len(batches))]
        short = -len(batches) % self.dp_size
        if short and self.drop_last:
            batches = batches[:len(batches) - (self.dp_size - short)]
        else:
            for _ in range(short):  # split the batch with the most items
                k = max(range(len(batches)), key=lambda i: batches[i].size, default=None)
                if k is None or batches[k].size < 2:
                    batches.append(np.empty(0, np.int64))
                else:
                    big = batches[k]
                    batches[k], extra = big[0::2], big[1::2]
                    batches.append(extra)
        self._plan_cache = (self.epoch, batches)
        return batches

    def __len__(self) -> int:
        """Batches per epoch on this DP rank (the same on every rank)."""
        return len(self._plan()) // self.dp_size

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        # Every iter() of an epoch starts at the epoch's start position (a loaded
        # state's, else 0) until a pass finishes the epoch or set_epoch changes
        # it: torch's multi-process DataLoader calls iter(batch_sampler) twice
        # (in __init__ and in _reset), so the position must not be used up by
        # the first call. Not a generator itself: the count is reset when
        # iteration is requested, not at the first batch.
        mine = self._plan()[self.dp_rank::self.dp_size]
        start = self._resume_at
        self._consumed = start
        return self._yield(mine[start:])

    def _yield(self, batches: list[np.ndarray]) -> Iterator[list[tuple[int, int, int]]]:
        doc, s, e = self._doc, self._start, self._end
        for items in batches:
            self._consumed += 1
            yield list(zip(doc[items].tolist(), s[items].tolist(), e[items].tolist(), strict=True))
        self._resume_at = 0  # the epoch is finished: the next pass starts afresh

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's shuffle. A different epoch than the one a loaded
        state is in starts that epoch from its first batch."""
        epoch = check_int("epoch", epoch, min_value=0)
        if epoch != self.epoch:
            self._resume_at = 0
            self._consumed = 0
        self.epoch = epoch

    @property
    def efficiency(self) -> float:
        """Real tokens / (batches * max_tokens) over this epoch's batches (all DP ranks)."""
        batches = self._plan()
        used = sum(int((self._end[b] - self._start[b]).sum()) for b in batches)
        return used / max(1, len(batches) * self.max_tokens)

    # -- resume -----------------------------------------------------------------------

    def state_dict(self, batches_consumed: int | None = None) -> dict[str, int]:
        """``{"epoch", "batches_consumed", "fingerprint"}`` for exact resume.

        ``batches_consumed`` defaults to the batches this sampler's iterator has
        yielded in the epoch: right when the sampler is iterated directly or by
        a ``DataLoader`` with ``num_workers=0``. Worker processes prefetch
        batches, so then pass the count the training loop has consumed.
        """
        n = self._consumed if batches_consumed is None else check_int(
            "batches_consumed", batches_consumed, min_value=0)
        return {"epoch": self.epoch, "batches_consumed": n, "fingerprint": self._fingerprint}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume: the next iteration starts after ``state["batches_consumed"]`` batches.

        Raises: TypeError if ``state`` is not a mapping or ``epoch`` /
        ``batches_consumed`` is not an int; ValueError if a key is missing, the
        fingerprint differs, ``epoch`` is negative, or ``batches_consumed`` is
        outside the epoch. The sampler is left unchanged when it raises.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping (from state_dict()), got {type(state).__name__}")
        for key in ("epoch", "batches_consumed", "fingerprint"):
            if key not in state:
                raise ValueError(f"state: missing key {key!r} (keys: {sorted(state)})")
        if state["fingerprint"] != self._fingerprint:
            raise ValueError("state: saved by a sampler with other lengths or settings "
                             "(lengths, max_tokens, cp_size, window, shuffle, seed, dp_size, "
                             "drop_last must match)")
        epoch = check_int("state['epoch']", state["epoch"], min_value=0)
        n = check_int("state['batches_consumed']", state["batches_consumed"], min_value=0)
        old_epoch, self.epoch = self.epoch, epoch
        n_batches = len(self)
        if not 0 <= n <= n_batches:
            self.epoch = old_epoch
            raise ValueError(f"state: batches_consumed={n} outside [0, {n_batches}]")
        self._resume_at = self._consumed = n



class SpanDataset(torch.utils.data.Dataset):
    """A map-style dataset that also accepts :class:`TokenBudgetBatchSampler`'s spans.

    ``ds[i]`` is ``dataset[i]``; ``ds[(i, start, end)]`` is the example with a
    ``"span"`` so that :class:`PackingCollator` packs tokens ``[start, end)``
    of document ``i`` and labels the last of them with the document's next
    token (only ``[start, end]`` is sliced out of ``input_ids``/``labels``).
    An example that already has a ``"span"`` is a document of that span:
    ``start``/``end`` are relative to it (and the sampler's ``lengths`` are
    span lengths).
    """

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int | tuple[int, int, int]) -> Any:
        if isinstance(key, tuple):
            if len(key) != 3:
                raise ValueError(f"key must be an index or (index, start, end), got {key!r}")
            i, start, end = key
            return _span_example(self.dataset[i], start, end)
        return self.dataset[key]
