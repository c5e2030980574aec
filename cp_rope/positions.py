"""The load-balanced (zigzag) context-parallel position formula.

This is the one definition every part of cp-rope (packing, the RoPE kernel,
CP attention, tests) follows. It matches TransformerEngine's and
Megatron-core's load-balanced CP layout: every global sequence of padded
length ``L`` (divisible by ``2 * cp_size``) is cut into ``2 * cp_size`` chunks
of ``c = L / (2 * cp_size)`` tokens, and rank ``r`` keeps chunk ``r`` followed by
chunk ``2 * cp_size - 1 - r``.
"""

from __future__ import annotations

import numbers
import os

import torch

__all__ = ["global_positions", "check_cp_args", "check_cu_seqlens_content", "content_checks_enabled"]


def check_cp_args(cp_size: int, cp_rank: int) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument if (cp_size, cp_rank) is invalid."""
    for name, value in (("cp_size", cp_size), ("cp_rank", cp_rank)):
        # Python and numpy integers (numbers.Integral); bool and tensors are refused.
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must satisfy 0 <= cp_rank < cp_size={cp_size}, got {cp_rank}")


def content_checks_enabled(cu_seqlens: torch.Tensor) -> bool:
    """Whether :func:`check_cu_seqlens_content` runs: always for CPU tensors, and for
    device tensors when ``CP_ROPE_DEBUG=1`` (reading them syncs the device)."""
    return cu_seqlens.device.type == "cpu" or os.environ.get("CP_ROPE_DEBUG", "0") not in ("", "0")


def check_cu_seqlens_content(cu_seqlens: torch.Tensor, *, n_tokens: int | None = None,
                             cp_size: int = 1, max_seqlen: int | None = None,
                             n_positions: int | None = None) -> None:
    """Value checks of a local ``cu_seqlens`` ``[B + 1]`` (the one copy every API uses).

    Reads the tensor on the host (a device sync for device tensors: callers gate it
    with :func:`content_checks_enabled`). Checks: starts at 0, non-decreasing, ends
    at most at ``n_tokens``, every local length even when ``cp_size > 1`` (two
    zigzag chunks), the longest length at most ``max_seqlen``, and global
    positions (``cp_size`` x longest local length) within ``n_positions`` rows of
    a cos/sin cache. Each bound is skipped when its argument is None.

    Raises: ValueError naming cu_seqlens (or max_seqlen) and the offending entry.
    """
    cu = cu_seqlens.to("cpu", torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {int(cu[0])}")
    lens = cu[1:] - cu[:-1]
    if bool((lens < 0).any()):
        b = int(torch.nonzero(lens < 0)[0])
        raise ValueError(f"cu_seqlens must be non-decreasing; cu_seqlens[{b + 1}] < cu_seqlens[{b}]")
    if n_tokens is not None and int(cu[-1]) > n_tokens:
        raise ValueError(f"cu_seqlens[-1] = {int(cu[-1])} exceeds the number of tokens T = {n_tokens}")
    if cp_size > 1 and bool((lens % 2 != 0).any()):
        b = int(torch.nonzero(lens % 2 != 0)[0])
        raise ValueError(f"cu_seqlens: with cp_size={cp_size} every local sequence length must be "
                         f"even (two CP chunks); sequence {b} has {int(lens[b])}")
    longest = int(lens.max()) if lens.numel() else 0
    if max_seqlen is not None and longest > max_seqlen:
        raise ValueError(f"max_seqlen = {max_seqlen} is below the longest local sequence ({longest})")
    if n_positions is not None and cp_size * longest > n_positions:
        raise ValueError(f"cu_seqlens: the longest local sequence ({longest} rows, global length "
                         f"{cp_size * longest} with cp_size={cp_size}) needs positions beyond the "
                         f"cos/sin cache ({n_positions} rows)")


def global_positions(cu_seqlens: torch.Tensor, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """Global position of every local token under the zigzag CP layout.

    Args:
        cu_seqlens: int32 (or int64) ``[B + 1]``, the rank's *local* cumulative
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
        TypeError: cu_seqlens is not an integer tensor, or cp args not ints.
        ValueError: cu_seqlens not 1-D, not starting at 0, decreasing, odd
            local lengths with ``cp_size > 1``, or ``cp_rank`` out of range.

    This reference reads ``cu_seqlens[-1]`` on the host (one sync for device
    tensors); the kernels never call it on a hot path.
    """
    check_cp_args(cp_size, cp_rank)
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with at least one entry, got shape {tuple(cu_seqlens.shape)}")
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
