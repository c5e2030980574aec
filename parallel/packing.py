"""Packing variable-length documents into THD batches for context-parallel training.

* :class:`PackedBatch`: one packed batch (global, or one CP rank's zigzag shard).
* :class:`PackingCollator`: a DataLoader ``collate_fn``: list of examples -> :class:`PackedBatch`.
* :class:`TokenBudgetBatchSampler`: batches of document spans that fit a token
  budget (first-fit-decreasing over a window), sharded over data-parallel ranks,
  resumable mid-epoch.
* :class:`SpanDataset`: wraps a map-style dataset so that it accepts the spans the
  sampler yields.
* :func:`pack_iterable` / :class:`PackedIterableDataset`: the same packing for
  streams whose lengths are not known up front (bounded buffer).

Typical use on one rank of a ``("dp", "cp")`` mesh (every rank of a CP group
builds the same global batch from the same sampler state and keeps its shard)::

    sampler = TokenBudgetBatchSampler(lengths, max_tokens=65536, cp_size=C,
                                      dp_size=D, dp_rank=dp_rank, seed=0)
    collate = PackingCollator(cp_size=C, cp_rank=cp_rank)
    loader = DataLoader(SpanDataset(dataset), batch_sampler=sampler,
                        collate_fn=collate, num_workers=2, pin_memory=True)
    for epoch in range(n_epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = batch.to("cuda", non_blocking=True)
            ...  # batch.position_ids -> RoPE, batch.cu_seqlens/max_seqlen -> CP attention

The work is vectorised: one ``np.concatenate`` of the documents, then index
arithmetic over all tokens at once (no Python loop per token; one cheap
conversion per document).
"""

from __future__ import annotations

import dataclasses
import operator
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, Sampler, get_worker_info

from cp_rope.positions import check_cp_args

from .sharding import shard_batch

__all__ = [
    "PackedBatch",
    "PackingCollator",
    "TokenBudgetBatchSampler",
    "SpanDataset",
    "pack_iterable",
    "PackedIterableDataset",
]


# --------------------------------------------------------------------------------------
# PackedBatch
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class PackedBatch:
    """One packed THD batch: the global batch (``cp_size == 1`` layout) or one CP rank's shard.

    All tensors live on the same device (CPU out of the collator). On a shard
    (``cp_size = C > 1``) every per-token field holds this rank's rows only,
    in the zigzag order of :func:`cp_rope.parallel.cp_shard_indices` (chunk
    ``cp_rank`` then chunk ``2C - 1 - cp_rank`` of every sequence).

    Fields:
        input_ids: int64 ``[T]`` token ids; ``pad_id`` on padding rows.
        labels: int64 ``[T]`` next-token targets, computed on the global batch
            before sharding: ``labels[t]`` is the token after ``input_ids[t]`` in
            the same document; ``ignore_index`` on each document's last token
            and on every padding row. On a shard, the labels of the local rows.
        position_ids: int64 ``[T]`` position of each row inside its sequence.
            Equals ``cp_rope.global_positions(cu_seqlens, cp_size, cp_rank)``;
            padding rows continue their sequence's positions.
        cu_seqlens: int32 ``[B + 1]``; on a shard the *local* cu_seqlens (the
            global padded cu_seqlens divided by ``cp_size``);
            ``cu_seqlens[-1] == T``. Every global sequence length is a multiple
            of ``2 * cp_size`` (of the collator that built it).
        max_seqlen: host int, the longest sequence in ``cu_seqlens`` (padded):
            on a shard the longest *local* sequence (global max / ``cp_size``).
        seq_lens: int32 ``[B]`` true (unpadded) length of every global sequence,
            the same on every rank; 0 for the padding sequence that
            ``pad_to_multiple`` appends. Use it for non-causal masks.
        cp_size, cp_rank: the layout of the per-token fields (1, 0: global).
        num_empty_dropped: empty documents (or spans) the collator dropped
            while building this batch.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    seq_lens: torch.Tensor
    cp_size: int = 1
    cp_rank: int = 0
    num_empty_dropped: int = 0

    _TENSORS = ("input_ids", "labels", "position_ids", "cu_seqlens", "seq_lens")

    @property
    def num_tokens(self) -> int:
        """Rows in this (local) batch, ``T``, padding included."""
        return self.input_ids.numel()

    @property
    def num_sequences(self) -> int:
        """``B``, padding sequence included."""
        return self.cu_seqlens.numel() - 1

    @property
    def global_cu_seqlens(self) -> torch.Tensor:
        """int32 ``[B + 1]`` cu_seqlens of the global (unsharded) batch."""
        return self.cu_seqlens * self.cp_size

    def _map(self, fn) -> PackedBatch:
        return dataclasses.replace(self, **{k: fn(getattr(self, k)) for k in self._TENSORS})

    def to(self, device: torch.device | str | int, non_blocking: bool = False) -> PackedBatch:
        """A copy with every tensor on ``device`` (dtypes unchanged).

        Raises: TypeError if ``device`` is not a ``torch.device``, str or int
        (e.g. a dtype: the fields keep their integer dtypes).
        """
        if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
            raise TypeError(f"device must be a torch.device, str or int, got "
                            f"{type(device).__name__} (PackedBatch.to keeps dtypes)")
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PackedBatch:
        """A copy in page-locked host memory (what ``DataLoader(pin_memory=True)`` calls)."""
        return self._map(lambda t: t.pin_memory())


# --------------------------------------------------------------------------------------
# Examples -> arrays
# --------------------------------------------------------------------------------------


def _as_int_array(x: Any, field: str, i: int) -> np.ndarray:
    """One example's ``field`` as a 1-D int64 numpy array (a view where possible)."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{field} of example {i} must hold integers, got {x.dtype}")
        x = x.detach().cpu().numpy()
    elif isinstance(x, (list, tuple, np.ndarray)):
        x = np.asarray(x)
    else:
        raise TypeError(
            f"{field} of example {i} must be a list, tuple, 1-D tensor or numpy array, "
            f"got {type(x).__name__}")
    if x.ndim != 1:
        raise ValueError(f"{field} of example {i} must be 1-D, got shape {tuple(x.shape)}")
    if x.size == 0:
        return np.empty(0, np.int64)
    if x.dtype.kind not in "iu":
        raise TypeError(f"{field} of example {i} must hold integers, got dtype {x.dtype}")
    return _to_int64(x, f"{field} of example {i} holds")


def _doc_length(example: Any) -> int:
    """Tokens of an example that enter a batch: its ``span`` if it has one, else all ids."""
    if isinstance(example, Mapping):
        if example.get("span") is not None:
            return int(example["span"][1]) - int(example["span"][0])
        return len(example["input_ids"])
    return len(example)


def _span_example(example: Any, start: int, end: int) -> dict:
    """Tokens ``[start, end)`` of an example's document, as an example whose ``span`` marks them.

    The document is the example's own ``span`` when it has one (offsets are
    relative to it). The returned ids run one token past ``end`` (when the
    example has one), so the collator labels the span's last token with the
    next token, as it would in the whole example.
    """
    ex = example if isinstance(example, Mapping) else {"input_ids": example}
    base = 0 if ex.get("span") is None else int(ex["span"][0])
    lo, stop = base + start, base + end + 1
    out = {"input_ids": ex["input_ids"][lo:stop], "span": (0, end - start)}
    if ex.get("labels") is not None:
        out["labels"] = ex["labels"][lo:stop]
    return out


def _read_span(span: Any, i: int) -> tuple[int, int]:
    """An example's ``span`` as ``(start, end)`` ints (Python, numpy or 0-d tensor ints)."""
    try:
        start, end = span
    except (TypeError, ValueError):
        raise ValueError(f"span of example {i} must be a pair (start, end), got {span!r}") from None
    try:
        return operator.index(start), operator.index(end)
    except TypeError:
        raise TypeError(f"span of example {i} must hold ints, got {span!r}") from None


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.size + 1, np.int64)
    np.cumsum(x, out=out[1:])
    return out


def _padded(n: np.ndarray | int, multiple: int):
    return -(-n // multiple) * multiple


def _int_arg(value: Any, name: str, min_value: int | None = None) -> int:
    """``value`` (a Python or numpy int, not a bool) as a Python int, else TypeError/ValueError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if min_value is not None and value < min_value:
        raise ValueError(f"{name} must be >= {min_value}, got {value}")
    return int(value)


def _positive_int(value: Any, name: str, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    return _int_arg(value, name, 1)


def _bool_arg(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def _check_budget(max_tokens: Any, cp_size: int) -> int:
    """``max_tokens`` must hold at least one CP-padded token group (``2 * cp_size``)."""
    max_tokens = _positive_int(max_tokens, "max_tokens")
    if max_tokens < 2 * cp_size:
        raise ValueError(f"max_tokens={max_tokens} is smaller than 2 * cp_size = {2 * cp_size}: "
                         "no token fits")
    return max_tokens


def _check_dp(dp_size: Any, dp_rank: Any) -> tuple[int, int]:
    dp_size, dp_rank = _positive_int(dp_size, "dp_size"), _int_arg(dp_rank, "dp_rank")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must satisfy 0 <= dp_rank < dp_size={dp_size}, got {dp_rank}")
    return dp_size, dp_rank


_INT64_MAX = np.iinfo(np.int64).max


def _to_int64(x: np.ndarray, what: str) -> np.ndarray:
    """Integer array -> int64; uint64 values beyond int64 raise (instead of wrapping negative)."""
    if x.dtype == np.uint64 and x.size and int(x.max()) > _INT64_MAX:
        t = int(np.argmax(x > _INT64_MAX))
        raise ValueError(f"{what} value {int(x[t])} at index {t}, beyond int64")
    return x.astype(np.int64, copy=False)


# --------------------------------------------------------------------------------------
# Collator
# --------------------------------------------------------------------------------------


class PackingCollator:
    """DataLoader ``collate_fn``: a list of examples -> one :class:`PackedBatch`.

    An example is a mapping with ``"input_ids"`` (list, tuple, 1-D tensor or
    numpy array of non-negative ints), optionally ``"labels"`` (same length,
    aligned with ``input_ids`` like Hugging Face's ``labels``; shifted here the
    same way as the ids) and ``"span"`` (``(start, end)``: only tokens
    ``[start, end)`` enter the batch, while labels still come from the whole
    example: :class:`SpanDataset` uses it), or the ids themselves.

    Per document (after the span): labels = next token of the same document
    (``ignore_index`` on its last token); documents longer than ``max_seqlen``
    are cut into pieces of ``max_seqlen`` tokens, each its own sequence whose
    positions restart at 0, and a piece's last token keeps the document's next
    token as its label (Megatron-style); empty documents are dropped and
    counted (``PackedBatch.num_empty_dropped``, :attr:`num_empty_dropped`).
    Each sequence is padded at its end to a multiple of ``2 * cp_size`` with
    ``pad_id`` (labels ``ignore_index``, positions that continue). With
    ``pad_to_multiple`` one padding sequence (true length 0; cut into pieces of
    at most ``max_seqlen`` when that is set) is appended so that ``T`` is a
    positive multiple of it (``pad_to_multiple=max_tokens`` gives static
    shapes, even for an empty batch). With ``cp_rank`` set the result is that rank's zigzag shard
    (:func:`cp_rope.parallel.shard_batch`); labels are computed on the global
    batch first.

    Args:
        cp_size: CP degree ``C`` the batch is laid out for.
        cp_rank: ``None``: return the global batch (padded for ``C``); an int in
            ``[0, C)``: return that rank's shard.
        pad_id: token id of padding rows.
        ignore_index: label of rows without a target (PyTorch's cross-entropy default).
        pad_to_multiple: pad the global ``T`` to a multiple of this (a multiple
            of ``2 * cp_size``, and a divisor of ``max_tokens`` when both are set).
        max_tokens: cap on the global ``T`` (padding included). A batch over the
            cap raises ``ValueError`` rather than silently dropping or moving
            documents: size batches with :class:`TokenBudgetBatchSampler` (same
            ``cp_size``) and this never fires.
        max_seqlen: cut longer documents into pieces (a multiple of ``2 * cp_size``).
        vocab_size: if given, ids (and non-ignored labels) must be ``< vocab_size``.

    Raises (when called): ``TypeError`` for non-integer or wrongly typed ids or
    labels; ``ValueError`` for 2-D ids, negative ids, ids ``>= vocab_size``, a
    ``labels`` length that differs from ``input_ids``, a bad ``span``, or a
    batch over ``max_tokens``. Each message names the field and the example.
    """

    def __init__(self, cp_size: int = 1, cp_rank: int | None = None, pad_id: int = 0,
                 ignore_index: int = -100, pad_to_multiple: int | None = None,
                 max_tokens: int | None = None, *, max_seqlen: int | None = None,
                 vocab_size: int | None = None):
        check_cp_args(cp_size, 0 if cp_rank is None else cp_rank)
        m = 2 * cp_size
        pad_to_multiple = _positive_int(pad_to_multiple, "pad_to_multiple", allow_none=True)
        if pad_to_multiple is not None and pad_to_multiple % m:
            raise ValueError(f"pad_to_multiple={pad_to_multiple} must be a multiple of "
                             f"2 * cp_size = {m}")
        if max_tokens is not None:
            max_tokens = _check_budget(max_tokens, cp_size)
            if pad_to_multiple is not None and max_tokens % pad_to_multiple:
                raise ValueError(f"max_tokens={max_tokens} must be a multiple of pad_to_multiple="
                                 f"{pad_to_multiple}, or batches within the budget pad past it")
        max_seqlen = _positive_int(max_seqlen, "max_seqlen", allow_none=True)
        if max_seqlen is not None and max_seqlen % m:
            raise ValueError(f"max_seqlen={max_seqlen} must be a multiple of 2 * cp_size = {m}")
        vocab_size = _positive_int(vocab_size, "vocab_size", allow_none=True)
        pad_id, ignore_index = _int_arg(pad_id, "pad_id"), _int_arg(ignore_index, "ignore_index")
        if pad_id < 0 or (vocab_size is not None and pad_id >= vocab_size):
            raise ValueError(f"pad_id={pad_id} must be in [0, vocab_size={vocab_size})")
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self.pad_id, self.ignore_index = pad_id, ignore_index
        self.pad_to_multiple, self.max_tokens = pad_to_multiple, max_tokens
        self.max_seqlen, self.vocab_size = max_seqlen, vocab_size
        self.num_empty_dropped = 0
        """Empty documents dropped by this collator object (per DataLoader worker)."""

    def __call__(self, examples: Sequence[Any]) -> PackedBatch:
        batch = self.pack(examples)
        if self.cp_rank is None:
            return batch
        return shard_batch(batch, self.cp_size, self.cp_rank)

    # -- the global batch ---------------------------------------------------------------

    def _read(self, examples: Sequence[Any]):
        """Per example: ids, label source, span; validated."""
        ids, lab_src, starts, ends = [], [], [], []
        for i, ex in enumerate(examples):
            if isinstance(ex, Mapping):
                if "input_ids" not in ex:
                    raise ValueError(f"example {i} has no 'input_ids' (keys: {sorted(ex)})")
                x = _as_int_array(ex["input_ids"], "input_ids", i)
                lab = ex.get("labels")
                span = ex.get("span")
            else:
                x, lab, span = _as_int_array(ex, "input_ids", i), None, None
            if lab is not None:
                lab = _as_int_array(lab, "labels", i)
                if lab.size != x.size:
                    raise ValueError(f"labels of example {i} has length {lab.size}, "
                                     f"input_ids has {x.size}")
            s, e = (0, x.size) if span is None else _read_span(span, i)
            if not 0 <= s <= e <= x.size:
                raise ValueError(f"span of example {i} is {tuple(span)}, not within "
                                 f"[0, {x.size}] with start <= end")
            ids.append(x)
            lab_src.append(x if lab is None else lab)
            starts.append(s)
            ends.append(e)
        return ids, lab_src, np.asarray(starts, np.int64), np.asarray(ends, np.int64)

    def _check_values(self, flat: np.ndarray, doc_off: np.ndarray, field: str) -> None:
        """Ids must be ``>= 0``; labels ``>= 0`` or ``ignore_index``; both ``< vocab_size``
        (``ignore_index`` itself exempt)."""
        if flat.size == 0:
            return
        target = flat != self.ignore_index if field == "labels" else None
        bad = None
        if int(flat.min()) < 0:
            bad = flat < 0 if target is None else (flat < 0) & target
            what = "negative" if target is None else f"negative and not ignore_index={self.ignore_index}"
        if (bad is None or not bad.any()) and self.vocab_size is not None and (
                int(flat.max()) >= self.vocab_size):
            bad = flat >= self.vocab_size if target is None else (flat >= self.vocab_size) & target
            what = f">= vocab_size={self.vocab_size}"
        if bad is not None and bad.any():
            t = int(np.argmax(bad))
            ex = int(np.searchsorted(doc_off, t, side="right")) - 1
            raise ValueError(f"{field} of example {ex} holds {what} value {int(flat[t])} "
                             f"at index {t - int(doc_off[ex])}")

    def pack(self, examples: Sequence[Any]) -> PackedBatch:
        """The global batch (``cp_size == 1`` layout, sequences padded for ``cp_size``)."""
        if isinstance(examples, Mapping):
            raise TypeError(
                "examples must be a sequence of examples (each a mapping with 'input_ids', or the "
                f"ids), got a {type(examples).__name__} with keys {sorted(examples)}; split a "
                "columnar batch into examples first")
        if not isinstance(examples, Sequence):
            examples = list(examples)
        ids, lab_src, start, end = self._read(examples)
        n_docs = len(ids)
        doc_len = np.fromiter((x.size for x in ids), np.int64, count=n_docs)
        doc_off = _exclusive_cumsum(doc_len)
        # One trailing sentinel so that gathers for padding rows stay in bounds.
        flat_ids = np.concatenate([*ids, np.zeros(1, np.int64)])
        self._check_values(flat_ids[:-1], doc_off, "input_ids")
        has_labels = any(a is not b for a, b in zip(lab_src, ids, strict=True))
        src = np.concatenate([*lab_src, np.zeros(1, np.int64)]) if has_labels else flat_ids
        if has_labels:
            self._check_values(src[:-1], doc_off, "labels")
        # Next-token labels over the flat documents, ignore_index at each document's end.
        flat_lab = np.empty_like(src)
        flat_lab[:-1] = src[1:]
        flat_lab[doc_off[1:][doc_len > 0] - 1] = self.ignore_index

        # Spans -> pieces of at most max_seqlen tokens; empty spans dropped.
        span_len = end - start
        keep = span_len > 0
        n_dropped = int(n_docs - keep.sum())
        self.num_empty_dropped += n_dropped
        span_len, span_src = span_len[keep], (doc_off[:-1] + start)[keep]
        if self.max_seqlen is not None and span_len.size and int(span_len.max()) > self.max_seqlen:
            m_len = self.max_seqlen
            n_pieces = _padded(span_len, m_len) // m_len
            piece_doc = np.repeat(np.arange(span_len.size), n_pieces)
            k = np.arange(piece_doc.size) - _exclusive_cumsum(n_pieces)[:-1][piece_doc]
            piece_len = np.minimum(span_len[piece_doc] - k * m_len, m_len)
            piece_src = span_src[piece_doc] + k * m_len
        else:
            piece_len, piece_src = span_len, span_src

        # Pad every sequence to a multiple of 2 * cp_size, then T to pad_to_multiple.
        padded = _padded(piece_len, 2 * self.cp_size)
        total = int(padded.sum())
        if self.pad_to_multiple is not None and (total % self.pad_to_multiple or not total):
            extra = self.pad_to_multiple - total % self.pad_to_multiple
            # One padding sequence, cut at max_seqlen so its positions stay in range.
            step = self.max_seqlen or extra
            pad_seqs = np.minimum(np.arange(extra, 0, -step), step)
            padded = np.concatenate([padded, pad_seqs])
            piece_len = np.concatenate([piece_len, np.zeros_like(pad_seqs)])
            piece_src = np.concatenate([piece_src, np.zeros_like(pad_seqs)])
            total += extra
        if self.max_tokens is not None and total > self.max_tokens:
            raise ValueError(
                f"batch of {total} tokens (after padding for cp_size={self.cp_size}) exceeds "
                f"max_tokens={self.max_tokens}; build batches with TokenBudgetBatchSampler("
                f"max_tokens={self.max_tokens}, cp_size={self.cp_size})")

        cu = _exclusive_cumsum(padded)
        seq_id = np.repeat(np.arange(padded.size), padded)
        j = np.arange(total, dtype=np.int64) - cu[:-1][seq_id]
        valid = j < piece_len[seq_id]
        rows = np.where(valid, piece_src[seq_id] + j, flat_ids.size - 1)
        input_ids = flat_ids[rows]
        input_ids[~valid] = self.pad_id
        labels = flat_lab[rows]
        labels[~valid] = self.ignore_index
        return PackedBatch(
            input_ids=torch.from_numpy(input_ids),
            labels=torch.from_numpy(labels),
            position_ids=torch.from_numpy(j),
            cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
            max_seqlen=int(padded.max()) if padded.size else 0,
            seq_lens=torch.from_numpy(piece_len.astype(np.int32)),
            num_empty_dropped=n_dropped,
        )


# --------------------------------------------------------------------------------------
# First-fit-decreasing
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
# Sampler over a map-style dataset
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
        window = _positive_int(window, "window")
        seed = _int_arg(seed, "seed", 0)
        shuffle, drop_last = _bool_arg(shuffle, "shuffle"), _bool_arg(drop_last, "drop_last")
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
        epoch = _int_arg(epoch, "epoch", 0)
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
        n = self._consumed if batches_consumed is None else _int_arg(
            batches_consumed, "batches_consumed", 0)
        return {"epoch": self.epoch, "batches_consumed": n, "fingerprint": self._fingerprint}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume: the next iteration starts after ``state["batches_consumed"]`` batches.

        Raises: TypeError if ``state`` is not a mapping; ValueError if a key is
        missing, the fingerprint differs, or ``batches_consumed`` is outside the
        epoch (the sampler is left unchanged).
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
        epoch, n = int(state["epoch"]), int(state["batches_consumed"])
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


# --------------------------------------------------------------------------------------
# Streaming
# --------------------------------------------------------------------------------------


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
    buffer_size = _positive_int(buffer_size, "buffer_size")
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
        buffer_size = _positive_int(buffer_size, "buffer_size")
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
