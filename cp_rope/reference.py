"""The pure-PyTorch RoPE path: the CPU backend and the tests' reference.

It computes exactly what the Triton kernel computes, the same way: every row
finds its sequence in ``cu_seqlens`` by binary search (``torch.searchsorted``),
applies the CP position formula, gathers cos/sin and rotates. Vectorized (no
Python loop over sequences or tokens), token-linear, no device sync. Run with
float64 inputs and caches it is the float64 reference of the tests.
"""

from __future__ import annotations

import torch

__all__ = ["token_positions", "rotary_torch"]


def token_positions(cu_seqlens: torch.Tensor, n_tokens: int, cp_size: int = 1, cp_rank: int = 0,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Position of each of ``n_tokens`` local rows, and which rows belong to a sequence.

    Same numbers as :func:`cp_rope.global_positions` for rows below
    ``cu_seqlens[-1]``; rows at or beyond it (trailing padding) get position 0
    and ``valid = False``. Arguments are not checked here (the public API does).

    Returns:
        (int64 ``[n_tokens]`` positions, bool ``[n_tokens]`` valid), on ``cu_seqlens.device``.
    """
    cu = cu_seqlens.to(torch.int64)
    n_seqs = cu.numel() - 1
    t = torch.arange(n_tokens, device=cu.device, dtype=torch.int64)
    # largest b in [0, n_seqs] with cu[b] <= t (skips zero-length sequences)
    seq = torch.searchsorted(cu, t, right=True) - 1
    valid = seq < n_seqs
    seq = seq.clamp(max=max(n_seqs - 1, 0))
    start = cu[seq] if n_seqs else torch.zeros_like(t)
    c = (cu[seq + 1] - start) // 2 if n_seqs else torch.zeros_like(t)
    j = t - start
    pos = torch.where(j < c, cp_rank * c + j, (2 * cp_size - 1 - cp_rank) * c + (j - c))
    return torch.where(valid, pos, 0), valid


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                 cp_size: int = 1, cp_rank: int = 0, interleaved: bool = False,
                 conjugate: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, D]`` by the positions of its rows; write into ``out`` (or a new tensor).

    Math in float32 (float64 when ``x`` is float64), result in ``x``'s dtype.
    ``conjugate=True`` rotates by ``-theta`` (the backward). Rows at or beyond
    ``cu_seqlens[-1]`` and dims from ``rotary_dim = 2 * cos.shape[1]`` on are
    copied unchanged. ``out`` may be ``x`` itself (in place).
    """
    n_tokens, _, head_dim = x.shape
    half = cos.shape[1]
    rot = 2 * half
    pos, valid = token_positions(cu_seqlens, n_tokens, cp_size, cp_rank)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = cos.to(compute).index_select(0, pos)[:, None, :]
    s = sin.to(compute).index_select(0, pos)[:, None, :]
    if conjugate:
        s = -s
    xr = x[..., :rot].to(compute)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    y = torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)
    y = torch.where(valid[:, None, None], y, xr).to(x.dtype)
    if out is None:
        out = torch.empty_like(x)
    out[..., :rot] = y
    if rot < head_dim and out.data_ptr() != x.data_ptr():
        out[..., rot:] = x[..., rot:]
    return out
