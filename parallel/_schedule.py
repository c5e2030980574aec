"""What a CP method's schedule builder sees, and the block constructor they share.

Each method module (:mod:`.ring`, :mod:`.allgather`, :mod:`.ulysses`) has a
``*_schedule(layout) -> (blocks, indices, terms)``: a dict of block tuples by phase,
a dict of device index tensors by name, and how many partials one output row sums.
:class:`~cp_rope.parallel.plan.CPAttentionPlan` calls the method's builder once per
batch.
"""

from __future__ import annotations

import dataclasses

import torch

from ._blocks import Block
from ._device import to_device

__all__ = ["Layout", "segments"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a schedule builder sees: host int64 ``cu`` [B + 1], sizes, CP position."""

    cu: torch.Tensor
    max_seqlen: int
    n_rows: int
    cp_size: int
    cp_rank: int
    causal: bool
    seq_lens: torch.Tensor | None  # host int64 [B] true global lengths (causal=False only)
    device: torch.device
    ulysses_size: int = 1  # all-to-all group size U (ulysses / hybrid)


def segments(lay: Layout, q_starts, q_end, k_starts, k_end, max_q, max_k, causal,
              split_q=False) -> Block:
    """A :class:`Block` from per-sequence segment starts (each a host ``[B]`` tensor).

    ``split_q``: see :attr:`Block.split_q`.
    """
    cu_q = torch.cat([torch.stack(q_starts, 1).flatten(), q_end.view(1)])
    cu_k = torch.cat([torch.stack(k_starts, 1).flatten(), k_end.view(1)])
    lq, lk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    keyless = (lq > 0) & (lk == 0)  # query rows of these segments see no key in this block
    rows = None
    if bool(keyless.any()):
        starts, lens = cu_q[:-1][keyless], lq[keyless]
        first = torch.repeat_interleave(starts - (lens.cumsum(0) - lens), lens)
        rows = to_device(first + torch.arange(int(lens.sum())), lay.device)
    cu_q32, cu_k32 = cu_q.to(torch.int32), cu_k.to(torch.int32)
    return Block(to_device(cu_q32, lay.device), to_device(cu_k32, lay.device), max_q, max_k,
                 causal, split_q=split_q, keyless_rows=rows, cu_q_host=cu_q32, cu_k_host=cu_k32)

