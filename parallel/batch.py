"""The packed THD batch type, :class:`PackedBatch`.

Built by :class:`~cp_rope.parallel.PackingCollator` (the global batch) and
cut into CP shards by :func:`~cp_rope.parallel.shard_batch`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from .placement import DocumentPlacement

if TYPE_CHECKING:
    from .cost_model import Choice

__all__ = ["PackedBatch"]


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
        placement: ``None`` for the global batch and zigzag shards; for a
            per-document shard (``shard_batch(..., placement="per_document")``)
            the batch's :class:`~cp_rope.parallel.placement.DocumentPlacement`:
            ranks then hold different local ``cu_seqlens`` (split shares
            first, then whole documents), ``position_ids`` are the positions
            in the global sequences, and every rank has ``placement.n_rows``
            rows, ``cu_seqlens[-1] <= T`` (trailing padding). The batch's
            attention plan (``cp_rope.parallel.attention_plan(batch, ...)``) and
            ``unshard(..., placement=)`` read it.
        choice: ``None``, or the :class:`~cp_rope.parallel.cost_model.Choice` that placed
            this shard (:class:`~cp_rope.parallel.cost_model.AutoPlacement`,
            ``placement="auto"``): its placement, split threshold and the method picked
            with them. ``attention_plan(batch, method="auto")`` takes the method from it
            (the batch's one decision, not a second one) and the plan carries it
            (``plan.choice``).
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
    placement: DocumentPlacement | None = None
    choice: Choice | None = None

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
        if self.placement is not None:
            return torch.from_numpy(self.placement.cu_seqlens.astype("int32")).to(
                self.cu_seqlens.device)
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
