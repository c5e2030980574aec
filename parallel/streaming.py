"""The same packing for streams whose lengths are not known up front (bounded buffer).

* :func:`pack_iterable`: a stream of examples -> lists of examples that fit a token budget.
* :class:`PackedIterableDataset`: an ``IterableDataset`` of :class:`PackedBatch`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from cp_rope.validation import check_cp_args, check_int

from .batch import PackedBatch
from .collator import PackingCollator, _check_budget, _doc_length, _padded, _span_example
from .sampler import _budget_pieces, _check_dp, _first_fit_decreasing

__all__ = ["pack_iterable", "PackedIterableDataset"]


def pack_iterable(examples: Iterable[Any], max_tokens: int, *, cp_size: int = 1,
                  buffer_size: int = 1024) -> Iterator[list[Any]]:
    """Pack a stream of examples into lists that :class:`PackingCollator` turns into
    batches of at most ``max_tokens`` tokens (padding for ``cp_size`` included).

    Up to ``buffer_size`` items are buffered; when full, they are packed by
    first-fit-decreasing and every batch but the last-opened one (usually
    the emptiest) is yielded; its items stay for the next round. A document longer
    than the budget is split into spans (as :class:`TokenBudgetBatchSampler`
    does). Memory: at most ``buffer_size`` examples plus one document's pieces.
    Order is deterministic for a given stream. Empty documents are passed on
    (the collator drops and counts them).

    Args:
        examples: any iterable of examples (what :class:`PackingCollator` takes).
        max_tokens: token budget per yielded list, padding for ``cp_size`` included.
        cp_size: CP degree the collator will pad for.
        buffer_size: examples (or pieces) held before packing.

    Yields: lists of examples (or spans of them, see :class:`SpanDataset`).

    Raises: ``TypeError`` for non-int arguments; ``ValueError`` for
    ``max_tokens < 2 * cp_size`` or ``buffer_size < 1``.
    """
    check_cp_args(cp_size, 0)
    max_tokens = _check_budget(max_tokens, cp_size)
    buffer_size = check_int("buffer_size", buffer_size, min_value=1)
    m = 2 * cp_size
    piece = max_tokens // m * m
    buf: list[Any] = []
    costs: list[int] = []

    def flush(final: bool) -> Iterator[list[Any]]:
        bins = _first_fit_decreasing(np.asarray(costs, np.int64), max_tokens)
        keep = [] if final or len(bins) == 1 else bins[-1].tolist()
        for b in bins if final or len(bins) == 1 else bins[:-1]:
            yield [buf[k] for k in b.tolist()]
        buf[:] = [buf[k] for k in keep]
        costs[:] = [costs[k] for k in keep]

    for ex in examples:
        n = _doc_length(ex)
        cost = int(_padded(n, m))
        for s, e in _budget_pieces(n, cost, piece):
            buf.append(ex if cost <= piece else _span_example(ex, s, e))
            costs.append(int(_padded(e - s, m)))
        if len(buf) >= buffer_size:
            yield from flush(final=False)
    if buf:
        yield from flush(final=True)


class PackedIterableDataset(IterableDataset):
    """An ``IterableDataset`` of :class:`PackedBatch` built from a stream of examples.

    Use with ``DataLoader(ds, batch_size=None, num_workers=W, pin_memory=True)``.
    Example ``k`` of ``source`` goes to data-parallel rank ``k % dp_size`` and,
    within it, to DataLoader worker ``(k // dp_size) % W``; each worker packs
    its share with :func:`pack_iterable` and collates with ``collator`` (whose
    ``cp_size`` sets the padding). Every CP rank of a group passes the same
    ``dp_rank``, so it sees the same batches. ``source`` must be re-iterable
    (a list, a Hugging Face dataset, an object whose ``__iter__`` restarts the
    stream). With a finite stream, DP ranks can end with different numbers of
    batches: bound training by steps. Every worker of every DP rank reads the
    whole stream and keeps its share.

    Args:
        source: re-iterable examples.
        collator: the :class:`PackingCollator` that builds each batch.
        max_tokens, buffer_size: see :func:`pack_iterable`.
        dp_size, dp_rank: data-parallel degree and this rank.

    Raises: ``TypeError`` for a one-shot ``source`` (a generator or iterator), a
    ``collator`` that is not a :class:`PackingCollator` or non-int arguments;
    ``ValueError`` for out-of-range ones (see :func:`pack_iterable`).
    """

    def __init__(self, source: Iterable[Any], collator: PackingCollator, max_tokens: int, *,
                 buffer_size: int = 1024, dp_size: int = 1, dp_rank: int = 0):
        if isinstance(source, Iterator):
            raise TypeError(f"source must be re-iterable (a list, a dataset), got the one-shot "
                            f"{type(source).__name__}: it would be empty after the first epoch")
        if not isinstance(collator, PackingCollator):
            raise TypeError(f"collator must be a PackingCollator, got {type(collator).__name__}")
        dp_size, dp_rank = _check_dp(dp_size, dp_rank)
        max_tokens = _check_budget(max_tokens, collator.cp_size)
        buffer_size = check_int("buffer_size", buffer_size, min_value=1)
        self.source, self.collator, self.max_tokens = source, collator, max_tokens
        self.buffer_size, self.dp_size, self.dp_rank = buffer_size, dp_size, dp_rank

    def __iter__(self) -> Iterator[PackedBatch]:
        info = get_worker_info()
        n_workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        stride = self.dp_size * n_workers
        first = self.dp_rank + self.dp_size * worker
        mine = (ex for k, ex in enumerate(self.source) if k % stride == first)
        for group in pack_iterable(mine, self.max_tokens, cp_size=self.collator.cp_size,
                                   buffer_size=self.buffer_size):
            yield self.collator(group)
