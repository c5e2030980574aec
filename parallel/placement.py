"""Per-document context-parallel placement: short documents whole on one rank, long ones zigzag.

With the zigzag layout (:mod:`cp_rope.parallel.sharding`) every document,
however short, is cut into ``2 * cp_size`` chunks over all ranks, and its
attention needs the ring / all-gather. :func:`place_documents` instead keeps
every document of at most ``split_threshold`` tokens **whole** on one rank
(attended locally, no communication) and zigzag-splits only the longer ones.
Balancing attention work across documents is what Megatron-core's hybrid /
dynamic CP, WLB-LLM and ByteScale do; this is a simple, exact form of it with a
stated balance bound.

Layout of rank ``r``'s shard (:meth:`DocumentPlacement.indices`):

1. the zigzag shares of the *split* documents, in global order: rows
   ``[0, split_rows)``, local sequences ``0 .. num_split - 1``; the same
   local lengths (global / ``cp_size``) on every rank, so this prefix is an
   ordinary zigzag shard that the ring / all-gather CP attention runs;
2. the *whole* documents placed on ``r``, in global order, positions
   ``0 .. L - 1``;
3. trailing padding rows up to :attr:`DocumentPlacement.n_rows`, the same on
   every rank (a multiple of ``pad_to_multiple``, so that batches take few
   distinct shapes, for CUDA graphs and ``torch.compile``): they
   belong to no sequence (``local cu_seqlens[-1] <= n_rows``), which every part
   (RoPE, attention, loss) already handles.

Lengths are the *padded* lengths in the global ``cu_seqlens`` (what the
kernels compute on). A split document's length must be divisible by
``2 * cp_size`` (the collator pads every sequence so); whole ones may have any
length.

Balance. The causal work of a sequence of ``L`` rows is ``w(L) = L (L + 1) / 2``
(query-key pairs). A split document gives every rank exactly
``w(L) / cp_size = c (L + 1)`` pairs (``c = L / (2 cp_size)``: rank ``r``'s
chunks ``r`` and ``2 cp_size - 1 - r`` see ``(2 cp_size - 1) c^2 + c (c + 1)``
keys), so it never unbalances. Whole documents are placed by LPT (longest
processing time first, Graham 1969): in order of decreasing work (ties: the
earlier document first), each goes to the rank with the least whole-document
work so far, ties broken by the fewest tokens, then the lowest rank. With
``W_r`` the total work of rank ``r`` (its whole documents plus its share of
the split ones) and ``w_max`` the largest whole document's work:

    max_r W_r <= (sum_r W_r) / cp_size + (1 - 1 / cp_size) * w_max

(Graham's list-scheduling argument: when the last document ``d`` of the
busiest rank was placed, that rank had the least work, at most the mean of the
work placed before ``d``.) LPT is also within ``4/3 - 1/(3 cp_size)`` of the
best possible assignment of the whole documents (Graham 1969, "Bounds on
multiprocessing timing anomalies").
Token counts are balanced second (the tie-break): when all whole documents
have the same length, ranks' token counts differ by at most one document. A
rank may get no document at all (fewer whole documents than ranks and no
split one): its shard is padding rows only (``n_rows`` of them, local
``cu_seqlens == [0]``), its attention output and gradients are 0 and its loss
term is empty; that is legal, not an error.

Choosing ``split_threshold``: :func:`default_split_threshold`.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np
import torch
import torch.distributed as dist

from cp_rope.positions import global_positions
from cp_rope.validation import (
    check_choice,
    check_cp_args,
    check_cu_seqlens,
    check_cu_seqlens_content,
    check_int,
)

from ._agree import agree_across_ranks
from .choices import PLACEMENTS, PlacementName

__all__ = [
    "PLACEMENTS",
    "DocumentPlacement",
    "Placement",
    "check_placement",
    "default_split_threshold",
    "place_documents",
    "shard_placed",
    "unshard_placed",
]

Placement = PlacementName

# Rows of one flash-attention tile; a zigzag chunk should fill several of them.
_TILE_ROWS = 128


def default_split_threshold(head_dim: int, cp_size: int) -> int:
    """The default ``split_threshold`` for ``head_dim`` and ``cp_size`` (tokens).

    ``2 * cp_size * max(4 * 128, 65536 // head_dim)``: a document is split only
    when each of its ``2 * cp_size`` zigzag chunks has at least
    ``max(512, 65536 / head_dim)`` rows. Reasoning (a heuristic, to be tuned
    with ``scripts/bench_cp_attention.py --placement``): a split document's
    per-rank attention runs as blocks of one chunk of queries, so a chunk should
    fill several 128-row tiles of the flash / cuDNN kernels; and a ring step's
    compute per exchanged K/V byte grows with the chunk length while its FLOPs
    per row grow with ``head_dim``, so smaller heads need longer chunks before a
    step hides its exchange (``65536 / head_dim`` is 512 rows at head_dim 128,
    1024 at 64). Examples: head_dim 128 -> 2048 at cp_size 2, 8192 at cp_size 8.

    Raises: TypeError / ValueError naming ``head_dim`` (int >= 1) or ``cp_size``
    (int >= 1).
    """
    head_dim = check_int("head_dim", head_dim, min_value=1)
    cp_size, _ = check_cp_args(cp_size, 0)
    return 2 * cp_size * max(4 * _TILE_ROWS, 65536 // head_dim)


def check_placement(placement, split_threshold, cp_size: int) -> tuple[str, int | None]:
    """Validate a ``(placement, split_threshold)`` pair; returns them as ``(str, int | None)``.

    ``"zigzag"`` takes no threshold (``None``); ``"per_document"`` needs an int
    ``>= 0`` (0 splits every non-empty document; see
    :func:`default_split_threshold`).

    Raises:
        ValueError: unknown ``placement``; a threshold with ``"zigzag"``; no
            threshold or a negative one with ``"per_document"``.
        TypeError: ``split_threshold`` not an int (bools refused).
    """
    placement = check_choice("placement", placement, PLACEMENTS)
    if placement == "zigzag":
        if split_threshold is not None:
            raise ValueError(f"split_threshold={split_threshold!r} is only used with "
                             "placement='per_document'; pass None with placement='zigzag'")
        return placement, None
    if split_threshold is None:
        raise ValueError("split_threshold: placement='per_document' needs a threshold in tokens "
                         f"(e.g. default_split_threshold(head_dim, cp_size={cp_size}))")
    return placement, check_int("split_threshold", split_threshold, min_value=0)


@dataclasses.dataclass(frozen=True, eq=False)
class DocumentPlacement:
    """Where every document of one global batch goes (host data, the same on every rank).

    Built by :func:`place_documents`; a :class:`~cp_rope.parallel.PackedBatch`
    shard carries it as ``placement``. Per-rank views are computed on demand
    from the per-document arrays (``O(B)`` host memory, ``O(T / cp_size)`` work
    per rank).

    Fields:
        cp_size: the CP degree ``C``.
        split_threshold: documents longer than this are split.
        cu_seqlens: int64 numpy ``[B + 1]`` global (padded) cumulative lengths.
        owner: int64 numpy ``[B]``: the rank holding whole document ``b``, or
            ``-1`` for a split document.
        n_rows: rows of every rank's shard (the largest rank's tokens, rounded
            up to ``pad_to_multiple``).
    """

    cp_size: int
    split_threshold: int
    cu_seqlens: np.ndarray
    owner: np.ndarray
    n_rows: int

    # -- per document ------------------------------------------------------------------

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[B]`` global (padded) document lengths."""
        return np.diff(self.cu_seqlens)

    @property
    def split_ids(self) -> np.ndarray:
        """int64 global ids of the split documents, in global order."""
        return np.flatnonzero(self.owner < 0)

    @property
    def num_split(self) -> int:
        """Split documents: the first ``num_split`` local sequences of every rank."""
        return int((self.owner < 0).sum())

    @property
    def split_rows(self) -> int:
        """Rows of every rank's split prefix (``sum L / C`` over split documents)."""
        return int(self.lengths[self.owner < 0].sum()) // self.cp_size

    @property
    def split_max_seqlen(self) -> int:
        """Longest local split sequence (``max L / C``; 0 without split documents)."""
        lens = self.lengths[self.owner < 0]
        return int(lens.max()) // self.cp_size if lens.size else 0

    def seq_ids(self, cp_rank: int) -> np.ndarray:
        """int64 global ids of rank ``cp_rank``'s local sequences, in local order."""
        self._rank(cp_rank)
        return np.concatenate([self.split_ids, np.flatnonzero(self.owner == cp_rank)])

    def whole_max_seqlen(self, cp_rank: int) -> int:
        """Longest whole document on ``cp_rank`` (0 without one)."""
        lens = self.lengths[self.owner == self._rank(cp_rank)]
        return int(lens.max()) if lens.size else 0

    def max_seqlen(self, cp_rank: int) -> int:
        """Longest local sequence of ``cp_rank`` (split shares and whole documents)."""
        return max(self.split_max_seqlen, self.whole_max_seqlen(cp_rank))

    def max_position_id(self, cp_rank: int) -> int:
        """A bound on ``cp_rank``'s ``position_ids``: the longest *global* length among its
        local sequences, minus 1 (0 without one); RoPE's ``max_position_id``."""
        lens = self.lengths[self.seq_ids(cp_rank)]
        return max(int(lens.max()) - 1, 0) if lens.size else 0

    def n_valid(self, cp_rank: int) -> int:
        """Rows of ``cp_rank`` that belong to a sequence (``local cu_seqlens[-1]``)."""
        return self.split_rows + int(self.lengths[self.owner == self._rank(cp_rank)].sum())

    def work(self, cp_rank: int) -> int:
        """Causal query-key pairs of ``cp_rank``: ``sum w(L)`` over its whole documents plus
        ``w(L) / C`` of every split one (``w(L) = L (L + 1) / 2``, see the module docstring)."""
        lens = self.lengths
        whole = lens[self.owner == self._rank(cp_rank)]
        split = lens[self.owner < 0]
        return int((whole * (whole + 1) // 2).sum() + (split // (2 * self.cp_size) * (split + 1)).sum())

    # -- per rank, tensors -------------------------------------------------------------

    def local_cu_seqlens(self, cp_rank: int) -> torch.Tensor:
        """int32 ``[B_r + 1]`` local cu_seqlens of ``cp_rank`` (split shares first)."""
        ids = self.seq_ids(cp_rank)
        lens = self.lengths[ids]
        lens[: self.num_split] //= self.cp_size
        cu = np.zeros(ids.size + 1, np.int64)
        np.cumsum(lens, out=cu[1:])
        return torch.from_numpy(cu.astype(np.int32))

    def indices(self, cp_rank: int) -> torch.Tensor:
        """int64 ``[n_valid(cp_rank)]``: the global rows of ``cp_rank``'s shard, in local order
        (``x_local[:n_valid] = x_global[idx]``; rows from ``n_valid`` to ``n_rows`` are padding)."""
        rows, _ = self._rows_positions(cp_rank)
        return rows

    def position_ids(self, cp_rank: int) -> torch.Tensor:
        """int64 ``[n_valid(cp_rank)]``: each local row's position in its global sequence (the
        zigzag formula for split shares, ``0 .. L - 1`` for whole documents)."""
        _, pos = self._rows_positions(cp_rank)
        return pos

    def _rows_positions(self, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        cp_rank = self._rank(cp_rank)
        cu, lens = self.cu_seqlens, self.lengths
        # split documents: the zigzag shard of their compacted cu_seqlens, mapped back
        sid = self.split_ids
        ccu = np.zeros(sid.size + 1, np.int64)
        np.cumsum(lens[sid], out=ccu[1:])
        lcu = ccu // self.cp_size  # the zigzag shard's local cu_seqlens (sharding's layout)
        split_pos = global_positions(torch.from_numpy(lcu.astype(np.int32)), self.cp_size,
                                     cp_rank).numpy()
        seq = np.repeat(np.arange(sid.size), np.diff(lcu))
        split_rows = cu[sid][seq] + split_pos
        # whole documents: their rows in order
        wid = np.flatnonzero(self.owner == cp_rank)
        wlen = lens[wid]
        wcu = np.zeros(wid.size + 1, np.int64)
        np.cumsum(wlen, out=wcu[1:])
        wseq = np.repeat(np.arange(wid.size), wlen)
        whole_pos = np.arange(int(wcu[-1]), dtype=np.int64) - wcu[:-1][wseq]
        whole_rows = cu[wid][wseq] + whole_pos
        return (torch.from_numpy(np.concatenate([split_rows, whole_rows])),
                torch.from_numpy(np.concatenate([split_pos, whole_pos])))

    def _rank(self, cp_rank) -> int:
        return check_cp_args(self.cp_size, cp_rank)[1]

    def __repr__(self) -> str:
        return (f"DocumentPlacement(cp_size={self.cp_size}, split_threshold={self.split_threshold}, "
                f"documents={self.owner.size}, split={self.num_split}, n_rows={self.n_rows})")


def place_documents(cu_seqlens: torch.Tensor, cp_size: int, split_threshold: int, *,
                    pad_to_multiple: int = 1) -> DocumentPlacement:
    """Place the documents of a global batch on the ranks of a CP group (a pure function).

    Args:
        cu_seqlens: int32 ``[B + 1]`` *global* cumulative (padded) lengths,
            a tensor on any device (read on the host once). Zero-length
            documents are legal (placed whole, they cost nothing).
        cp_size: CP degree ``C >= 1``.
        split_threshold: int ``>= 0``: documents of at most this many tokens
            stay whole on one rank; longer ones are zigzag-split over all ranks
            (their length must then be divisible by ``2 * C``).
        pad_to_multiple: every shard has ``n_rows`` rows, the largest rank's
            token count rounded up to a multiple of this (int ``>= 1``).

    Returns: a :class:`DocumentPlacement`; deterministic from the arguments (the
    same object contents on every rank). Balance: see the module docstring
    (``max_r work <= mean + (1 - 1/C) * largest whole document's work``).

    Raises:
        TypeError: ``cu_seqlens`` not an int32 tensor; an int argument not an int.
        ValueError: ``cu_seqlens`` not 1-D, not starting at 0 or decreasing;
            ``cp_size < 1``; ``split_threshold < 0``; ``pad_to_multiple < 1``; a
            document to split whose length is not divisible by ``2 * cp_size``.
    """
    check_cu_seqlens(cu_seqlens)
    check_cu_seqlens_content(cu_seqlens)
    cp_size, _ = check_cp_args(cp_size, 0)
    split_threshold = check_int("split_threshold", split_threshold, min_value=0)
    pad_to_multiple = check_int("pad_to_multiple", pad_to_multiple, min_value=1)
    cu = cu_seqlens.detach().to("cpu", torch.int64).numpy().copy()
    lens = np.diff(cu)
    split = lens > split_threshold
    bad = split & (lens % (2 * cp_size) != 0)
    if bad.any():
        b = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"cu_seqlens: document {b} has length {int(lens[b])} > split_threshold="
            f"{split_threshold}, so it is split, but {int(lens[b])} is not divisible by "
            f"2 * cp_size = {2 * cp_size}; pad sequences first (PackingCollator does)")
    owner = np.full(lens.size, -1, np.int64)
    whole = np.flatnonzero(~split)
    work = lens * (lens + 1) // 2
    # LPT: decreasing work, ties by document index (a stable sort keeps index order)
    order = whole[np.argsort(-work[whole], kind="stable")]
    heap = [(0, 0, r) for r in range(cp_size)]  # (whole-document work, tokens, rank)
    for b in order.tolist():
        w, t, r = heapq.heappop(heap)
        owner[b] = r
        heapq.heappush(heap, (w + int(work[b]), t + int(lens[b]), r))
    split_rows = int(lens[split].sum()) // cp_size
    per_rank = np.bincount(owner[whole], weights=lens[whole], minlength=cp_size) if whole.size \
        else np.zeros(cp_size)
    n_rows = split_rows + int(per_rank.max())
    n_rows = -(-n_rows // pad_to_multiple) * pad_to_multiple
    return DocumentPlacement(cp_size=cp_size, split_threshold=split_threshold, cu_seqlens=cu,
                             owner=owner, n_rows=n_rows)


def shard_placed(batch, placement: DocumentPlacement, cp_rank: int, *, pad_id: int = 0,
                 ignore_index: int = -100):
    """Rank ``cp_rank``'s shard of a *global* :class:`~cp_rope.parallel.PackedBatch` under
    ``placement`` (what ``shard_batch(..., placement="per_document")`` returns).

    Per-token fields keep the rows of :meth:`DocumentPlacement.indices` (labels are the
    global batch's), then ``n_rows - n_valid`` trailing padding rows: ``input_ids = pad_id``,
    ``labels = ignore_index``, ``position_ids = 0``. ``cu_seqlens`` is the rank's local one
    (:meth:`DocumentPlacement.local_cu_seqlens`, ``cu_seqlens[-1] = n_valid <= n_rows``),
    ``max_seqlen`` its longest local sequence, ``position_ids`` the positions in the global
    sequences; ``seq_lens`` stays the global one; ``placement`` is set.

    Raises: ValueError if ``batch.cu_seqlens`` is not the one ``placement`` was built from;
    TypeError / ValueError for ``cp_rank``, ``pad_id``, ``ignore_index`` (ints).
    """
    cp_rank = placement._rank(cp_rank)
    pad_id, ignore_index = check_int("pad_id", pad_id), check_int("ignore_index", ignore_index)
    cu = batch.cu_seqlens.detach().to("cpu", torch.int64).numpy()
    if not np.array_equal(cu, placement.cu_seqlens):
        raise ValueError("placement: built from other cu_seqlens than batch.cu_seqlens")
    rows, pos = placement._rows_positions(cp_rank)
    n_pad = placement.n_rows - rows.numel()
    dev = batch.input_ids.device
    rows = rows.to(dev)

    def take(t, fill):
        return torch.cat([t.index_select(0, rows), t.new_full((n_pad,), fill)])

    return dataclasses.replace(
        batch,
        input_ids=take(batch.input_ids, pad_id),
        labels=take(batch.labels, ignore_index),
        position_ids=torch.cat([pos, pos.new_zeros(n_pad)]).to(dev, batch.position_ids.dtype),
        cu_seqlens=placement.local_cu_seqlens(cp_rank).to(batch.cu_seqlens.device),
        max_seqlen=placement.max_seqlen(cp_rank),
        cp_size=placement.cp_size,
        cp_rank=cp_rank,
        placement=placement,
    )


def unshard_placed(local: torch.Tensor, cu_seqlens: torch.Tensor, placement: DocumentPlacement,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Gather every rank's per-document shard back into global order (dim 0).

    Args:
        local: ``[n_rows, ...]`` this rank's rows (any trailing shape and dtype),
            laid out by ``placement``; rows from ``n_valid`` on (padding) are dropped.
        cu_seqlens: this rank's *local* cu_seqlens (checked against ``placement``
            for CPU tensors).
        placement: the batch's :class:`DocumentPlacement` (the same on every rank).
        group: the CP process group (default: the world); its size must be
            ``placement.cp_size``.

    Returns: ``[placement.cu_seqlens[-1], ...]`` in global order (a new tensor). Not
    differentiable. Collective over ``group`` (a missing rank fails after its timeout).

    Raises: TypeError if ``local`` is not a tensor or ``placement`` not a DocumentPlacement;
    ValueError if the group size is not ``placement.cp_size``, ``local`` does not have
    ``n_rows`` rows, or ``cu_seqlens`` is not this rank's local cu_seqlens. With a group
    of more than one rank the ranks first exchange a signature (one ``all_gather_object``):
    a rank's bad input, or placements / trailing shapes / dtypes that differ between
    ranks, raise on every rank (a ValueError naming the ranks on the others), before
    any data moves.
    """
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    err, sig = None, None
    try:
        _check_unshard_placed(local, cu_seqlens, placement, size, rank)
        sig = (placement.cp_size, placement.n_rows, placement.cu_seqlens.tobytes(),
               placement.owner.tobytes(), tuple(local.shape[1:]), str(local.dtype))
    except (TypeError, ValueError) as exc:
        err = exc
    if size > 1:  # agree before the data moves: a rank that raised alone would hang the rest
        agree_across_ranks(group, err, sig, what="unshard", describe=lambda sigs: (
            "placement (the same batch), local's trailing shape and dtype must be the same on "
            "every rank of the group; " + "; ".join(
                f"rank {r}: n_rows={v[1]}, local.shape[1:]={v[4]}, {v[5]}"
                for r, v in enumerate(sigs))))
    elif err is not None:
        raise err
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(size)] if size > 1 else [local]
    if size > 1:
        dist.all_gather(parts, local, group=group)
    out = local.new_empty((int(placement.cu_seqlens[-1]), *local.shape[1:]))
    for r, part in enumerate(parts):
        idx = placement.indices(r).to(out.device)
        out[idx] = part[: idx.numel()]
    return out


def _check_unshard_placed(local, cu_seqlens, placement, size: int, rank: int) -> None:
    """:func:`unshard_placed`'s one-rank checks (raise TypeError / ValueError)."""
    if not isinstance(local, torch.Tensor):
        raise TypeError(f"local must be a torch.Tensor, got {type(local).__name__}")
    if not isinstance(placement, DocumentPlacement):
        raise TypeError(f"placement must be a DocumentPlacement (batch.placement), got "
                        f"{type(placement).__name__}; unshard of a zigzag shard takes "
                        f"placement=None")
    check_cu_seqlens(cu_seqlens)
    check_group_size(placement, size)
    if local.shape[0] != placement.n_rows:
        raise ValueError(f"local: {local.shape[0]} rows, the placement's shards have "
                         f"{placement.n_rows}")
    check_local_cu_seqlens(placement, cu_seqlens, rank)


def check_group_size(placement: DocumentPlacement, size: int) -> None:
    """ValueError unless the CP group has ``placement.cp_size`` ranks."""
    if size != placement.cp_size:
        raise ValueError(f"placement: built for cp_size={placement.cp_size}, the group has "
                         f"{size} rank(s)")


def check_local_cu_seqlens(placement: DocumentPlacement, cu_seqlens: torch.Tensor,
                           rank: int) -> None:
    """ValueError if a CPU ``cu_seqlens`` is not rank ``rank``'s local cu_seqlens under
    ``placement`` (a device tensor is not read: no sync)."""
    if cu_seqlens.device.type == "cpu" and not torch.equal(
            cu_seqlens, placement.local_cu_seqlens(rank)):
        raise ValueError(f"cu_seqlens: not rank {rank}'s local cu_seqlens under placement")
