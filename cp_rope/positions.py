"""The load-balanced (zigzag) context-parallel position formula.

This is the one definition every part of cp-rope (packing, the RoPE kernel,
CP attention, tests) follows. It matches TransformerEngine's and
Megatron-core's load-balanced CP layout: every global sequence of padded
length ``L`` (divisible by ``2 * cp_size``) is cut into ``2 * cp_size`` chunks
of ``c = L / (2 * cp_size)`` tokens, and rank ``r`` keeps chunk ``r`` followed by
chunk ``2 * cp_size - 1 - r``.
"""

from __future__ import annotations

import torch

from cp_rope.validation import check_cp_args, check_cu_seqlens, check_cu_seqlens_content

__all__ = ["global_positions"]


def global_positions(cu_seqlens: torch.Tensor, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """Global position of every local token under the zigzag CP layout.

    Args:
        cu_seqlens: int32 ``[B + 1]``, the rank's *local* cumulative
            sequence lengths (global cu_seqlens divided by ``cp_size``).
            Starts at 0, non-decreasing; with ``cp_size > 1`` every local
            length is even (two chunks of ``c`` tokens).
        cp_size: context-parallel degree ``C >= 1``.
        cp_rank: this rank, ``0 <= cp_rank < C``.

    Returns:
        int64 ``[cu_seqlens[-1]]`` on ``cu_seqlens.device``. For local row ``j``
        of a local sequence of length ``2c``::

            position = r * c + j                   if j < c
            position = (2C - 1 - r) * c + (j - c)  otherwise

        With ``C = 1`` this is ``position = j`` (TransformerEngine / Megatron-core
        load-balanced CP).

    Raises:
        TypeError: cu_seqlens is not an int32 tensor, or cp args not ints.
        ValueError: cu_seqlens not 1-D, not starting at 0, decreasing, odd
            local lengths with ``cp_size > 1``, or ``cp_rank`` out of range.

    This reference reads ``cu_seqlens[-1]`` on the host (one sync for device
    tensors); the kernels never call it on a hot path.
    """
    cp_size, cp_rank = check_cp_args(cp_size, cp_rank)
    check_cu_seqlens(cu_seqlens)
    check_cu_seqlens_content(cu_seqlens, cp_size=cp_size)
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    total = int(cu[-1])
    device = cu.device
    seq_id = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens, output_size=total)
    j = torch.arange(total, device=device, dtype=torch.int64) - cu[:-1][seq_id]
    if cp_size == 1:
        return j
    c = (lens // 2)[seq_id]
    return torch.where(j < c, cp_rank * c + j, (2 * cp_size - 1 - cp_rank) * c + (j - c))
