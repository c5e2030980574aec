"""The data side of :func:`cp_rope.hf.prepare`: a Trainer batch -> this rank's packed CP rows.

:class:`TrainerCollator` replaces the Trainer's ``data_collator``. Every rank of a CP
group receives the same examples (the DP rank of the data loader is the group's index,
:func:`regroup_loader`), runs the Trainer's own collator on them, turns its batch into
documents (:func:`documents_of`), packs them with :class:`~cp_rope.parallel.PackingCollator`
(each document padded to a multiple of ``2 * cp_size``, labels shifted inside each
document on the global batch) and keeps its shard (zigzag or per-document). The result is
:func:`cp_rope.hf.model_inputs` of the shard plus ``"shift_labels"`` (``[1, T_local]``,
already the next token: transformers' name for pre-shifted labels).

Batches it reads, from any collator (TRL's ``DataCollatorForLanguageModeling``,
transformers' ``DataCollatorWithFlattening``, a padding collator with position ids):

* padding-free: ``input_ids`` ``[1, T]``, ``position_ids`` ``[1, T]`` restarting at 0 at
  every document (and/or ``cu_seq_lens_q``), ``labels`` ``[1, T]`` aligned with the ids
  (Hugging Face's convention: the model shifts them);
* padded: ``input_ids`` / ``attention_mask`` / ``position_ids`` ``[B, L]``: the tokens
  where the mask is 1, split where the positions restart;
* no mask, no positions: every row one document.

A padded batch without ``position_ids`` is refused: cp_rope cannot tell the documents of a
row apart, nor the positions the model would give left-padded tokens.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from cp_rope.parallel import PackedBatch, PackingCollator

from .patch import model_inputs

try:  # accelerate comes with transformers' Trainer (and with the `trl` extra)
    from accelerate.data_loader import BatchSamplerShard
except ImportError as _exc:
    raise ImportError("cp_rope.hf.prepare needs accelerate (transformers' Trainer runs on it): "
                      "pip install 'cp-rope[trl]' or pip install accelerate") from _exc

__all__ = ["LABELS", "NUM_ITEMS", "FINGERPRINT", "TrainerCollator", "documents_of",
           "trainer_inputs", "fingerprint", "regroup_loader"]

LABELS = "shift_labels"
"""Key of the shard's labels ``[1, T_local]`` (already shifted) in a prepared batch."""
NUM_ITEMS = "cp_rope_num_items"
"""Key of the micro-batch's real-label count over the whole world (set per optimizer step)."""
FINGERPRINT = "cp_rope_fingerprint"
"""Key of the global batch's :func:`fingerprint` (int64 0-dim): equal on every rank of a CP group."""

# Keys of a collator's batch that documents_of reads or may safely drop (seq_idx: TRL's
# per-token sequence index for linear attention, derived from the same boundaries).
_KNOWN = frozenset({"input_ids", "labels", "position_ids", "attention_mask", "cu_seq_lens_q",
                    "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})
_FIX = ("use TRL's padding-free batches (SFTConfig(packing=True) or padding_free=True), "
        "transformers' DataCollatorWithFlattening(return_position_ids=True), or cp_rope's "
        "PackingCollator as the Trainer's data_collator")


def _rows(batch: Mapping, key: str) -> np.ndarray | None:
    value = batch.get(key)
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    value = np.asarray(value)
    if value.ndim == 1:
        value = value[None]
    if value.ndim != 2 or value.dtype.kind not in "iub":
        raise ValueError(f"data_collator: batch[{key!r}] must be an integer [B, L] tensor, got "
                         f"{value.dtype} of shape {value.shape}")
    return value


def _starts(pos: np.ndarray, row: int) -> np.ndarray:
    """Where documents start in one row's positions (they must count 0, 1, 2, ... in each)."""
    if pos.size == 0:
        return np.zeros(0, np.int64)
    starts = np.flatnonzero(pos == 0)
    if starts.size == 0 or starts[0] != 0:
        raise ValueError(f"data_collator: position_ids of row {row} start at {int(pos[0])}, not "
                         "0: cp_rope restarts the positions at every document and cannot "
                         "reproduce a row that continues an earlier one")
    seg_start = np.repeat(starts, np.diff(np.append(starts, pos.size)))
    bad = np.flatnonzero(pos != np.arange(pos.size) - seg_start)
    if bad.size:
        t = int(bad[0])
        raise ValueError(f"data_collator: position_ids of row {row} are not 0, 1, 2, ... inside "
                         f"each document (position {int(pos[t])} at index {t}): cp_rope packs "
                         "documents whose positions count from 0")
    return starts


def documents_of(batch: Mapping) -> list[dict]:
    """A collator's batch (see the module docstring) -> one example per document.

    Returns: a list of ``{"input_ids": int64 [n], "labels": int64 [n]}`` (numpy; labels
    aligned with the ids, as the collator gave them, or the ids themselves), in order.

    Raises: TypeError for a batch that is not a mapping; ValueError naming
    ``data_collator`` for unknown keys, a padded batch without ``position_ids``, positions
    that do not count from 0 in each document, ``cu_seq_lens_q`` that disagrees with them,
    or shapes that do not match.
    """
    if isinstance(batch, PackedBatch) or not isinstance(batch, Mapping):
        raise TypeError(f"data_collator must return a mapping of tensors, got "
                        f"{type(batch).__name__}")
    unknown = sorted(set(batch) - _KNOWN)
    if unknown:
        raise ValueError(f"data_collator: its batches hold {unknown}, which cp_rope's packed "
                         f"rows do not carry (known: {sorted(_KNOWN)}); {_FIX}")
    if "input_ids" not in batch:
        raise ValueError(f"data_collator: its batches have no 'input_ids' (keys: {sorted(batch)})")
    ids = _rows(batch, "input_ids")
    labels, pos, mask = (_rows(batch, k) for k in ("labels", "position_ids", "attention_mask"))
    labels = ids if labels is None else labels
    for name, x in (("labels", labels), ("position_ids", pos), ("attention_mask", mask)):
        if x is not None and x.shape != ids.shape:
            raise ValueError(f"data_collator: batch[{name!r}] has shape {x.shape}, input_ids "
                             f"{ids.shape}")
    if mask is not None and pos is None and not mask.all():
        raise ValueError("data_collator: it pads (attention_mask with zeros) without "
                         "position_ids, so cp_rope cannot tell the documents of a row apart nor "
                         f"the positions of its tokens; {_FIX}")
    cu = batch.get("cu_seq_lens_q")
    docs = []
    for r in range(ids.shape[0]):
        keep = slice(None) if mask is None else mask[r].astype(bool)
        row_ids, row_lab = ids[r][keep].astype(np.int64), labels[r][keep].astype(np.int64)
        starts = np.zeros(1 if row_ids.size else 0, np.int64) if pos is None \
            else _starts(pos[r][keep].astype(np.int64), r)
        if cu is not None and ids.shape[0] == 1 and pos is not None:
            given = np.asarray(torch.as_tensor(cu).cpu().numpy(), np.int64)
            if not np.array_equal(given, np.append(starts, row_ids.size)):
                raise ValueError(f"data_collator: cu_seq_lens_q {given.tolist()[:8]}... does not "
                                 "match the documents of position_ids")
        ends = np.append(starts[1:], row_ids.size)
        docs += [{"input_ids": row_ids[s:e], "labels": row_lab[s:e]}
                 for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]
    return docs


def fingerprint(docs: Sequence[Any]) -> int:
    """CRC-32 of the documents' lengths and ids, in order (examples as mappings with
    ``input_ids`` or the ids themselves): the same global batch gives the same number."""
    crc = 0
    for d in docs:
        ids = np.ascontiguousarray(d["input_ids"] if isinstance(d, Mapping) else d, np.int64)
        crc = zlib.crc32(ids.tobytes(), zlib.crc32(np.int64(ids.size).tobytes(), crc))
    return crc


def trainer_inputs(batch: PackedBatch) -> dict:
    """This rank's :class:`PackedBatch` -> the Trainer's batch: :func:`model_inputs` plus
    ``"shift_labels"`` int64 ``[1, T_local]`` (the shard's labels, already shifted)."""
    return {**model_inputs(batch), LABELS: batch.labels.unsqueeze(0)}


class TrainerCollator:
    """The ``data_collator`` that :func:`cp_rope.hf.prepare` installs.

    Args:
        inner: the Trainer's collator, or None when it was cp_rope's ``PackingCollator``
            (the examples are then packed directly).
        packer: a :class:`PackingCollator` with this rank's ``cp_size`` / ``cp_rank``.

    Calling it: a list of examples -> :func:`trainer_inputs` of this rank's shard, plus
    the global batch's :func:`fingerprint` under ``FINGERPRINT``.
    Raises: as :func:`documents_of` and :class:`PackingCollator`.
    """

    def __init__(self, inner, packer: PackingCollator):
        self.inner, self.packer = inner, packer

    def __call__(self, examples: Sequence[Any]) -> dict:
        docs = examples if self.inner is None else documents_of(self.inner(examples))
        crc = torch.tensor(fingerprint(docs), dtype=torch.int64)
        return {**trainer_inputs(self.packer(docs)), FINGERPRINT: crc}


def regroup_loader(loader, dp_size: int, dp_rank: int, world_size: int):
    """Make an accelerate-prepared DataLoader hand out batches by DP group, not by rank.

    accelerate shards a map-style loader with a ``BatchSamplerShard`` over every process;
    under CP the ``cp_size`` ranks of a group must draw the same batch, so the shard is set
    to ``dp_size`` processes with this group's index (what transformers' Trainer itself
    does for its rank-aware ``BatchRebalanceSampler``).

    Returns: ``loader``. Raises: RuntimeError if a multi-process loader has no
    ``BatchSamplerShard`` (an iterable dataset, ``dispatch_batches``).
    """
    shard = getattr(loader, "batch_sampler", None)
    if isinstance(shard, BatchSamplerShard):
        shard.num_processes, shard.process_index = dp_size, dp_rank
    elif world_size > 1:
        raise RuntimeError(f"cp_rope.hf.prepare: the Trainer's data loader "
                           f"({type(loader).__name__}) is not sharded by a BatchSamplerShard, "
                           "so its CP ranks cannot be given the same batches")
    return loader
