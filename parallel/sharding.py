"""The load-balanced (zigzag) context-parallel split of THD tensors.

One helper, :func:`cp_shard_indices`, defines which global rows a rank keeps;
production code (the collator, :func:`shard_batch`) and the tests all use it,
so nobody re-derives the layout by hand. The layout is TransformerEngine's /
Megatron-core's: every global sequence of padded length ``L`` (divisible by
``2 * cp_size``) is cut into ``2 * cp_size`` chunks of ``c = L / (2 * cp_size)``
tokens; rank ``r`` keeps chunk ``r`` then chunk ``2 * cp_size - 1 - r``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from cp_rope.positions import global_positions
from cp_rope.validation import (
    check_cp_args,
    check_cu_seqlens,
    check_cu_seqlens_content,
    check_max_seqlen,
)

from ._agree import agree_across_ranks
from .batch import PackedBatch
from .placement import check_placement, place_documents, shard_placed, unshard_placed

__all__ = ["cp_shard_indices", "rank_major_index", "shard_tensor", "shard_batch", "unshard",
           "local_cu_seqlens"]


def local_cu_seqlens(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Local cu_seqlens of every rank: the *global* cu_seqlens divided by ``cp_size``.

    Args:
        cu_seqlens: int32 ``[B + 1]`` global cumulative lengths (starting at
            0, non-decreasing); every sequence length must be divisible by
            ``2 * cp_size``.
        cp_size: CP degree.

    Returns: same dtype and device, ``[B + 1]``.

    Raises:
        TypeError: ``cu_seqlens`` is not an int32 tensor; cp_size not an int.
        ValueError: ``cu_seqlens`` not 1-D, not starting at 0, decreasing, or
            a global length not divisible by ``2 * cp_size``
            (:mod:`cp_rope.validation`).
    """
    cp_size, _ = check_cp_args(cp_size, 0)
    check_cu_seqlens(cu_seqlens)
    check_cu_seqlens_content(cu_seqlens)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    if cp_size > 1 and bool((lens % (2 * cp_size) != 0).any()):
        bad = int(torch.nonzero(lens % (2 * cp_size) != 0)[0])
        raise ValueError(
            f"cu_seqlens: sequence {bad} has length {int(lens[bad])}, not divisible by "
            f"2 * cp_size = {2 * cp_size}; pad sequences first (PackingCollator does)")
    return torch.div(cu_seqlens, cp_size, rounding_mode="floor")


def cp_shard_indices(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global row indices kept by ``cp_rank``, in local order.

    Args:
        cu_seqlens: int32 ``[B + 1]`` *global* cumulative lengths, each
            length divisible by ``2 * cp_size``. Rows at or beyond
            ``cu_seqlens[-1]`` belong to no sequence and are not sharded.
        cp_size: CP degree ``C``.
        cp_rank: ``0 <= cp_rank < C``.

    Returns:
        int64 ``[cu_seqlens[-1] / C]``: ``x_local = x_global[idx]``. Local row
        ``j`` of a sequence has position ``global_positions(local_cu, C, r)[j]``
        inside it.

    Raises: TypeError/ValueError naming the argument (see :func:`local_cu_seqlens`
    and :func:`cp_rope.global_positions`).
    """
    cp_size, cp_rank = check_cp_args(cp_size, cp_rank)
    local_cu = local_cu_seqlens(cu_seqlens, cp_size)
    cu = cu_seqlens.to(torch.int64)
    pos = global_positions(local_cu, cp_size, cp_rank)
    lens = (local_cu[1:] - local_cu[:-1]).to(torch.int64)
    starts = torch.repeat_interleave(cu[:-1], lens, output_size=pos.numel())
    return starts + pos


def rank_major_index(cu_seqlens: torch.Tensor, cp_size: int, ranks=None, *,
                     stride: int | None = None) -> torch.Tensor:
    """The inverse of the zigzag split: where each global row sits among the ranks' shards.

    The one definition of the zigzag order's inverse (``unshard``, the all-gather's
    K/V order and the Ulysses all-to-all's row order all use it).

    Args:
        cu_seqlens: int32 ``[B + 1]`` *global* cumulative lengths (each divisible by
            ``2 * cp_size``).
        cp_size: CP degree ``C``.
        ranks: the ranks whose shards are stacked (default ``range(C)``), in order.
        stride: rows per stacked shard (default: the local rows ``cu_seqlens[-1] / C``;
            larger when shards carry trailing padding rows).

    Returns: int64 ``[cu_seqlens[-1]]``: ``index[g] = j * stride + i`` where global row ``g``
    is local row ``i`` of ``ranks[j]``; ``-1`` for rows of no listed rank. So with every
    rank listed, ``x_global = stacked.view(-1, ...)[index]``.

    Raises: as :func:`cp_shard_indices`.
    """
    ranks = range(cp_size) if ranks is None else ranks
    total = int(cu_seqlens[-1])
    n_local = total // cp_size
    stride = n_local if stride is None else stride
    index = torch.full((total,), -1, dtype=torch.int64)
    for j, p in enumerate(ranks):
        index[cp_shard_indices(cu_seqlens, cp_size, p)] = j * stride + torch.arange(n_local)
    return index


def shard_tensor(x: torch.Tensor, cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int,
                 dim: int = 0) -> torch.Tensor:
    """This rank's zigzag shard of a global THD tensor (a new tensor).

    Args:
        x: ``[..., T, ...]`` global rows along ``dim`` (any dtype and device),
            ``T >= cu_seqlens[-1]``; rows from ``cu_seqlens[-1]`` on (trailing
            padding) belong to no sequence and are not kept.
        cu_seqlens: int32 ``[B + 1]`` *global* cu_seqlens, every length
            divisible by ``2 * cp_size``.
        cp_size, cp_rank: CP degree ``C`` and this rank.
        dim: the token dimension of ``x``.

    Returns: ``x.index_select(dim, cp_shard_indices(cu_seqlens, cp_size, cp_rank))``,
    ``cu_seqlens[-1] / C`` rows along ``dim``.

    Raises: TypeError/ValueError naming the argument: ``x`` not a tensor or with
    fewer than ``cu_seqlens[-1]`` rows along ``dim``, ``dim`` not a dimension of ``x``;
    see :func:`cp_shard_indices`.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim!r}: not a dimension of x (shape {tuple(x.shape)}); the "
                         "token dimension is meant (default 0)")
    idx = cp_shard_indices(cu_seqlens, cp_size, cp_rank)
    total = int(cu_seqlens[-1])
    if x.shape[dim] < total:
        raise ValueError(f"x: {x.shape[dim]} rows along dim {dim} but cu_seqlens[-1] = {total}")
    return x.index_select(dim, idx.to(x.device))


def shard_batch(batch: PackedBatch, cp_size: int, cp_rank: int, *, placement: str = "zigzag",
                split_threshold: int | None = None, pad_id: int = 0, ignore_index: int = -100,
                pad_to_multiple: int = 1) -> PackedBatch:
    """This rank's zigzag (or per-document) shard of a *global* :class:`~cp_rope.parallel.PackedBatch`.

    ``placement="per_document"`` (with ``split_threshold``, tokens): documents of at
    most ``split_threshold`` tokens stay whole on one rank, longer ones are
    zigzag-split; see :mod:`cp_rope.parallel.placement` for the layout, the balance
    bound and the trailing padding rows (``pad_id`` / ``ignore_index`` / position 0,
    up to a common row count rounded to ``pad_to_multiple``), which only this
    placement adds (zigzag shards have no padding rows, so these three do not apply to
    them). The rest of this docstring describes ``"zigzag"``.

    Per-token fields (``input_ids``, ``labels``, ``position_ids``) keep the rows
    :func:`cp_shard_indices` selects, so ``position_ids`` become
    ``global_positions(local cu_seqlens, cp_size, cp_rank)`` and labels stay
    those of the global batch. ``cu_seqlens`` becomes the local one (global /
    ``cp_size``), ``max_seqlen`` the longest local sequence (global max /
    ``cp_size``); ``seq_lens`` (true global lengths) is shared, not copied.

    Raises:
        TypeError: ``batch`` is not a PackedBatch; cp args or ``batch.max_seqlen``
            not ints; ``batch.cu_seqlens`` not an int32 tensor.
        ValueError: ``batch.cu_seqlens`` not 1-D, not starting at 0 or
            decreasing; ``batch.max_seqlen`` below the longest sequence;
            ``labels`` / ``position_ids`` not of ``input_ids``' shape; the batch is already a shard (``batch.cp_size != 1``), has
            trailing rows beyond ``cu_seqlens[-1]``, or a sequence length not
            divisible by ``2 * cp_size``; ``cp_rank`` out of range; an unknown
            ``placement``, a ``split_threshold`` with ``"zigzag"``, none or a negative
            one with ``"per_document"`` (:func:`~cp_rope.parallel.placement.check_placement`);
            with ``"per_document"``, only the lengths of *split* documents must be
            divisible by ``2 * cp_size``.
    """
    if not isinstance(batch, PackedBatch):
        raise TypeError(f"batch must be a PackedBatch, got {type(batch).__name__}")
    cp_size, cp_rank = check_cp_args(cp_size, cp_rank)
    check_cu_seqlens(batch.cu_seqlens, name="batch.cu_seqlens")
    max_seqlen = check_max_seqlen(batch.max_seqlen, allow_none=False)
    check_cu_seqlens_content(batch.cu_seqlens, max_seqlen=max_seqlen, name="batch.cu_seqlens")
    for name in ("labels", "position_ids"):
        field = getattr(batch, name)
        if not isinstance(field, torch.Tensor) or field.shape != batch.input_ids.shape:
            got = tuple(field.shape) if isinstance(field, torch.Tensor) else type(field).__name__
            raise ValueError(f"batch.{name}: {got}, but input_ids has shape "
                             f"{tuple(batch.input_ids.shape)}: every per-token field has one row "
                             f"per token")
    if batch.cp_size != 1:
        raise ValueError(f"batch: already a shard (cp_size={batch.cp_size}, "
                         f"cp_rank={batch.cp_rank}); shard the global batch")
    total = int(batch.cu_seqlens[-1])
    if total != batch.input_ids.numel():
        raise ValueError(f"batch: cu_seqlens[-1] = {total} but input_ids has "
                         f"{batch.input_ids.numel()} rows; trailing rows cannot be sharded")
    placement, split_threshold = check_placement(placement, split_threshold, cp_size)
    if placement == "per_document":
        placed = place_documents(batch.cu_seqlens, cp_size, split_threshold,
                                 pad_to_multiple=pad_to_multiple)
        return shard_placed(batch, placed, cp_rank, pad_id=pad_id, ignore_index=ignore_index)
    if cp_size == 1:
        return batch
    idx = cp_shard_indices(batch.cu_seqlens, cp_size, cp_rank).to(batch.input_ids.device)
    return dataclasses.replace(
        batch,
        input_ids=batch.input_ids.index_select(0, idx),
        labels=batch.labels.index_select(0, idx),
        position_ids=batch.position_ids.index_select(0, idx),
        cu_seqlens=torch.div(batch.cu_seqlens, cp_size, rounding_mode="floor"),
        max_seqlen=batch.max_seqlen // cp_size,
        cp_size=cp_size,
        cp_rank=cp_rank,
    )


def unshard(local: torch.Tensor, cu_seqlens: torch.Tensor, group: dist.ProcessGroup | None = None,
            *, placement=None) -> torch.Tensor:
    """Gather every rank's zigzag shard back into global order (dim 0).

    For a per-document shard pass its ``placement`` (``batch.placement``, a
    :class:`~cp_rope.parallel.DocumentPlacement`, not the string ``shard_batch`` takes):
    then :func:`cp_rope.parallel.placement.unshard_placed` gathers it (``local`` has
    ``placement.n_rows`` rows; the result has the global ``cu_seqlens[-1]``; its errors,
    agreed across the ranks, are listed there).

    Args:
        local: ``[T_local, ...]``, this rank's rows (any trailing shape, any
            dtype), laid out by :func:`cp_shard_indices`.
        cu_seqlens: the rank's *local* cu_seqlens ``[B + 1]`` (the same on every
            rank of the CP group).
        group: the CP process group (default: the world). Without an
            initialised process group the CP size is 1.

    Returns: ``[C * cu_seqlens[-1], ...]`` in global order (a new tensor). Rows
    of ``local`` at or beyond ``cu_seqlens[-1]`` (trailing padding) are
    dropped. Not differentiable. Collective: every rank of ``group`` must call
    it; a missing rank fails after the group's timeout.

    Raises: TypeError if ``local`` is not a tensor or ``cu_seqlens`` not an int32 tensor;
    ValueError if ``cu_seqlens`` is not 1-D, does not start at 0 or decreases, ``local`` has
    fewer rows than ``cu_seqlens[-1]``, or a local length is odd (with ``C > 1``). With
    ``C > 1`` the ranks first exchange their ``cu_seqlens`` (one ``all_gather_object``):
    a rank's bad input, or ``cu_seqlens`` / trailing shapes / dtypes that differ between
    ranks, raise on every rank (a ValueError naming the ranks on the others).
    """
    if placement is not None:
        return unshard_placed(local, cu_seqlens, placement, group)
    if not isinstance(local, torch.Tensor):
        raise TypeError(f"local must be a torch.Tensor, got {type(local).__name__}")
    cp_size = dist.get_world_size(group) if dist.is_initialized() else 1
    if cp_size == 1:
        return _unshard_rows(local, cu_seqlens, 1).clone()
    # Check before the data moves, and agree across ranks: a rank whose input fails
    # raises its own error, the others a ValueError naming it, instead of a hang or
    # a wrong gather.
    err, sig = None, None
    try:
        local = _unshard_rows(local, cu_seqlens, cp_size)
        sig = (cu_seqlens.tolist(), tuple(local.shape[1:]), str(local.dtype))
    except (TypeError, ValueError) as exc:
        err = exc
    agree_across_ranks(group, err, sig, what="unshard", describe=lambda sigs: (
        "cu_seqlens, local's trailing shape and dtype must be the same on every rank of the "
        "group; " + "; ".join(f"rank {r}: cu_seqlens={v[0]}, local.shape[1:]={v[1]}, {v[2]}"
                              for r, v in enumerate(sigs))))
    index = rank_major_index(cu_seqlens * cp_size, cp_size)
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts).index_select(0, index.to(local.device))


def _unshard_rows(local: torch.Tensor, cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """``local``'s first ``cu_seqlens[-1]`` rows after :func:`unshard`'s one-rank checks."""
    check_cu_seqlens(cu_seqlens)
    check_cu_seqlens_content(cu_seqlens, cp_size=cp_size)
    n_local = int(cu_seqlens[-1])
    if local.shape[0] < n_local:
        raise ValueError(f"local: {local.shape[0]} rows but cu_seqlens[-1] = {n_local}")
    return local[:n_local].contiguous()
