"""The DataLoader ``collate_fn`` that packs documents into THD batches: :class:`PackingCollator`.

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
conversion per document). The example helpers here (reading ids, spans) are
shared with the sampler and the streaming packer.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from cp_rope.validation import check_cp_args, check_int

from .batch import PackedBatch
from .placement import check_placement
from .sharding import shard_batch

__all__ = ["PackingCollator"]


# --------------------------------------------------------------------------------------
# Examples -> arrays (shared with sampler.py and streaming.py)
# --------------------------------------------------------------------------------------


def _as_int_array(x: Any, field: str, i: int) -> np.ndarray:
    """One example's ``field`` as a 1-D int64 numpy array (a view where possible)."""
    if isinstance(x, torch.Tensor):
        if x.is_meta:
            raise ValueError(f"{field} of example {i} is on the meta device (no data to pack): "
                             "pass tensors that hold their values")
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


def _optional_positive(name: str, value: Any) -> int | None:
    """None, or ``value`` as an int >= 1 (:func:`cp_rope.validation.check_int`)."""
    return None if value is None else check_int(name, value, min_value=1)


def _check_budget(max_tokens: Any, cp_size: int) -> int:
    """``max_tokens`` must hold at least one CP-padded token group (``2 * cp_size``)."""
    max_tokens = check_int("max_tokens", max_tokens, min_value=1)
    if max_tokens < 2 * cp_size:
        raise ValueError(f"max_tokens={max_tokens} is smaller than 2 * cp_size = {2 * cp_size}: "
                         "no token fits")
    return max_tokens



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
        ignore_index: label of rows without a target (PyTorch's cross-entropy default); not a
            token id (refused within ``[0, vocab_size)``).
        pad_to_multiple: pad the global ``T`` to a multiple of this (a multiple
            of ``2 * cp_size``, and a divisor of ``max_tokens`` when both are set).
        max_tokens: cap on the global ``T`` (padding included). A batch over the
            cap raises ``ValueError`` rather than silently dropping or moving
            documents: size batches with :class:`TokenBudgetBatchSampler` (same
            ``cp_size``) and this never fires.
        max_seqlen: cut longer documents into pieces (a multiple of ``2 * cp_size``).
        vocab_size: if given, ids (and non-ignored labels) must be ``< vocab_size``.
        placement: how a shard is cut (with ``cp_rank`` set): ``"zigzag"`` (every
            sequence over all ranks) or ``"per_document"`` (sequences of at most
            ``split_threshold`` tokens whole on one rank, balanced by causal work;
            longer ones zigzag; shards padded to a common length with ``pad_id``
            rows: :mod:`cp_rope.parallel.placement`). The global batch is the
            same for both. With ``pad_to_multiple`` a per-document shard's rows are
            a multiple of ``pad_to_multiple / cp_size`` (with
            ``pad_to_multiple=max_tokens``: at most ``cp_size`` distinct shapes).
        split_threshold: tokens; required with ``"per_document"``, refused with
            ``"zigzag"`` (:func:`cp_rope.parallel.placement.default_split_threshold`).

    Raises (when called): ``TypeError`` for non-integer or wrongly typed ids or
    labels; ``ValueError`` for 2-D ids, negative ids, ids ``>= vocab_size``, tensors on the
    meta device, an ``ignore_index`` within ``[0, vocab_size)`` or equal to an id whose label
    it would be (labels from the ids), a
    ``labels`` length that differs from ``input_ids``, a bad ``span``, or a
    batch over ``max_tokens``. Each message names the field and the example.
    """

    def __init__(self, cp_size: int = 1, cp_rank: int | None = None, pad_id: int = 0,
                 ignore_index: int = -100, pad_to_multiple: int | None = None,
                 max_tokens: int | None = None, *, max_seqlen: int | None = None,
                 vocab_size: int | None = None, placement: str = "zigzag",
                 split_threshold: int | None = None):
        check_cp_args(cp_size, 0 if cp_rank is None else cp_rank)
        self.placement, self.split_threshold = check_placement(placement, split_threshold, cp_size)
        m = 2 * cp_size
        pad_to_multiple = _optional_positive("pad_to_multiple", pad_to_multiple)
        if pad_to_multiple is not None and pad_to_multiple % m:
            raise ValueError(f"pad_to_multiple={pad_to_multiple} must be a multiple of "
                             f"2 * cp_size = {m}")
        if max_tokens is not None:
            max_tokens = _check_budget(max_tokens, cp_size)
            if pad_to_multiple is not None and max_tokens % pad_to_multiple:
                raise ValueError(f"max_tokens={max_tokens} must be a multiple of pad_to_multiple="
                                 f"{pad_to_multiple}, or batches within the budget pad past it")
        max_seqlen = _optional_positive("max_seqlen", max_seqlen)
        if max_seqlen is not None and max_seqlen % m:
            raise ValueError(f"max_seqlen={max_seqlen} must be a multiple of 2 * cp_size = {m}")
        vocab_size = _optional_positive("vocab_size", vocab_size)
        pad_id, ignore_index = check_int("pad_id", pad_id), check_int("ignore_index", ignore_index)
        if pad_id < 0 or (vocab_size is not None and pad_id >= vocab_size):
            raise ValueError(f"pad_id={pad_id} must be in [0, vocab_size={vocab_size})")
        if vocab_size is not None and 0 <= ignore_index < vocab_size:
            raise ValueError(f"ignore_index={ignore_index} is a token id of the vocabulary "
                             f"[0, vocab_size={vocab_size}): a real label equal to it would be "
                             "ignored by the loss; use a negative one (the default -100)")
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
        return shard_batch(batch, self.cp_size, self.cp_rank, placement=self.placement,
                           split_threshold=self.split_threshold, pad_id=self.pad_id,
                           ignore_index=self.ignore_index,
                           pad_to_multiple=(self.pad_to_multiple or self.cp_size) // self.cp_size)

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

    def _check_not_ignored(self, flat: np.ndarray, doc_off: np.ndarray) -> None:
        """Labels from the ids: no id after a document's first may equal ``ignore_index``
        (its label would silently drop out of the loss)."""
        bad = flat == self.ignore_index
        bad[doc_off[:-1][doc_off[:-1] < flat.size]] = False  # a first token is no one's label
        if bad.any():
            t = int(np.argmax(bad))
            ex = int(np.searchsorted(doc_off, t, side="right")) - 1
            raise ValueError(f"ignore_index={self.ignore_index} is a token of input_ids of "
                             f"example {ex} (index {t - int(doc_off[ex])}): that label would be "
                             "ignored by the loss; use a negative ignore_index (the default -100)")

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
        elif self.ignore_index >= 0:
            self._check_not_ignored(flat_ids[:-1], doc_off)
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
