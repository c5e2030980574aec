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

__all__ = ["Layout", "segments", "pieces_block"]


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
    window: int | None = None  # effective left window (None: none, or it covers every document)


def segments(lay: Layout, q_starts, q_end, k_starts, k_end, max_q, max_k, causal,
              split_q=False) -> Block:
    """A :class:`Block` from per-sequence segment starts (each a host ``[B]`` tensor).

    ``split_q``: see :attr:`Block.split_q`.
    """
    cu_q = torch.cat([torch.stack(q_starts, 1).flatten(), q_end.view(1)])
    cu_k = torch.cat([torch.stack(k_starts, 1).flatten(), k_end.view(1)])
    return _block(lay, cu_q, cu_k, max_q, max_k, causal, split_q=split_q)


def pieces_block(lay: Layout, chain, n_q: int, n_k: int, causal: bool, window) -> Block:
    """A :class:`Block` of ``chain``: ``[(q0, q1, k0, k1)]`` row ranges, both increasing
    (segments without keys fill the query rows between them and up to ``n_q``; segments
    without queries skip key rows, up to ``n_k``: flash's backward writes dK/dV = 0 only
    inside segments); ``window``: flash-attn's ``window_size`` or None."""
    cq, ck = [0], [0]
    for q0, q1, k0, k1 in chain:
        if q0 > cq[-1]:
            cq.append(q0)
            ck.append(ck[-1])
        if k0 > ck[-1]:
            cq.append(cq[-1])
            ck.append(k0)
        cq.append(q1)
        ck.append(k1)
    if cq[-1] < n_q:
        cq.append(n_q)
        ck.append(ck[-1])
    if ck[-1] < n_k:
        cq.append(cq[-1])
        ck.append(n_k)
    cu_q, cu_k = torch.tensor(cq, dtype=torch.int64), torch.tensor(ck, dtype=torch.int64)
    max_q = int((cu_q[1:] - cu_q[:-1]).max()) if len(cq) > 1 else 0
    max_k = int((cu_k[1:] - cu_k[:-1]).max()) if len(ck) > 1 else 0
    return _block(lay, cu_q, cu_k, max_q, max_k, causal, window=window)


def _block(lay, cu_q, cu_k, max_q, max_k, causal, split_q=False, window=None) -> Block:
    lq, lk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    keyless = (lq > 0) & (lk == 0)  # query rows of these segments see no key in this block
    rows = None
    if bool(keyless.any()):
        starts, lens = cu_q[:-1][keyless], lq[keyless]
        first = torch.repeat_interleave(starts - (lens.cumsum(0) - lens), lens)
        rows = to_device(first + torch.arange(int(lens.sum())), lay.device)
    cu_q32, cu_k32 = cu_q.to(torch.int32), cu_k.to(torch.int32)
    return Block(to_device(cu_q32, lay.device), to_device(cu_k32, lay.device), max_q, max_k,
                 causal, split_q=split_q, keyless_rows=rows, cu_q_host=cu_q32, cu_k_host=cu_k32,
                 window=window)

