"""The PyTorch backend of the RoPE ops (the production path on CPU tensors).

``apply_rotary_emb(..., backend="torch")`` (and ``"auto"`` on CPU) runs this
module; on CUDA the Triton kernel (:mod:`cp_rope.kernel`) computes exactly the
same numbers the same way: every row finds its sequence in ``cu_seqlens`` by
binary search (``torch.searchsorted``), applies the CP position formula (or
reads its explicit ``position_ids``, adds its sequence's ``start_positions``),
gathers cos/sin and rotates. Vectorized (no Python loop over sequences or
tokens), token-linear, no device sync. Arguments are checked by
:mod:`cp_rope.ops`, not here.

The tests' float64 reference is written independently (``tests/rope_utils.py``).
"""

from __future__ import annotations

import torch

__all__ = ["token_positions", "rotary_torch", "rotary_torch_qk"]


def token_positions(cu_seqlens: torch.Tensor, n_tokens: int, cp_size: int = 1, cp_rank: int = 0,
                    *, position_ids: torch.Tensor | None = None,
                    start_positions: torch.Tensor | None = None, start_offset: int = 0,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Position of each of ``n_tokens`` local rows, and which rows belong to a sequence.

    Rows below ``cu_seqlens[-1]``: ``position_ids[t]`` when given, else the CP
    formula of :func:`cp_rope.global_positions` plus ``start_positions[b]`` (the
    row's sequence ``b``, when given) plus ``start_offset``. Rows at or beyond
    ``cu_seqlens[-1]`` (trailing padding) get position 0 and ``valid = False``.

    Returns:
        (int64 ``[n_tokens]`` positions, bool ``[n_tokens]`` valid), on ``cu_seqlens.device``.
    """
    cu = cu_seqlens.to(torch.int64)
    n_seqs = cu.numel() - 1
    t = torch.arange(n_tokens, device=cu.device, dtype=torch.int64)
    if position_ids is not None:
        valid = t < cu[-1]
        return torch.where(valid, position_ids.to(torch.int64), 0), valid
    # largest b in [0, n_seqs] with cu[b] <= t (skips zero-length sequences)
    seq = torch.searchsorted(cu, t, right=True) - 1
    valid = seq < n_seqs
    seq = seq.clamp(max=max(n_seqs - 1, 0))
    start = cu[seq] if n_seqs else torch.zeros_like(t)
    c = (cu[seq + 1] - start) // 2 if n_seqs else torch.zeros_like(t)
    j = t - start
    pos = torch.where(j < c, cp_rank * c + j, (2 * cp_size - 1 - cp_rank) * c + (j - c))
    if start_positions is not None and n_seqs:
        pos = pos + start_positions.to(torch.int64)[seq]
    if start_offset:
        pos = pos + start_offset
    return torch.where(valid, pos, 0), valid


def _rows(cos, sin, cu_seqlens, n_tokens, dtype, cp_size, cp_rank, conjugate, position_ids,
          start_positions, start_offset):
    """The cos/sin rows of every token (``[T, 1, rotary_dim // 2]``, the compute dtype) and
    the valid-row mask, for inputs of ``dtype``."""
    pos, valid = token_positions(cu_seqlens, n_tokens, cp_size, cp_rank, position_ids=position_ids,
                                 start_positions=start_positions, start_offset=start_offset)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    c = cos.to(compute).index_select(0, pos)[:, None, :]
    s = sin.to(compute).index_select(0, pos)[:, None, :]
    return c, (-s if conjugate else s), valid


def _rotate(x, out, c, s, valid, interleaved):
    half = c.shape[-1]
    rot = 2 * half
    xr = x[..., :rot].to(c.dtype)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    y = torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)
    out[..., :rot] = torch.where(valid[:, None, None], y, xr).to(x.dtype)
    if rot < x.shape[2] and out.data_ptr() != x.data_ptr():
        out[..., rot:] = x[..., rot:]


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                 cp_size: int = 1, cp_rank: int = 0, interleaved: bool = False,
                 conjugate: bool = False, out: torch.Tensor | None = None, *,
                 position_ids: torch.Tensor | None = None,
                 start_positions: torch.Tensor | None = None, start_offset: int = 0,
                 ) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, D]`` by the positions of its rows; write into ``out`` (or a new tensor).

    Positions as :func:`token_positions`. Math in float32 (float64 when ``x``
    is float64), result in ``x``'s dtype. ``conjugate=True`` rotates by
    ``-theta`` (the backward). Rows at or beyond ``cu_seqlens[-1]`` and dims
    from ``rotary_dim = 2 * cos.shape[1]`` on are copied unchanged. ``out``
    may be ``x`` itself (in place).
    """
    c, s, valid = _rows(cos, sin, cu_seqlens, x.shape[0], x.dtype, cp_size, cp_rank, conjugate,
                        position_ids, start_positions, start_offset)
    if out is None:
        out = torch.empty_like(x)
    _rotate(x, out, c, s, valid, interleaved)
    return out


def rotary_torch_qk(q: torch.Tensor, k: torch.Tensor | None, out_q: torch.Tensor,
                    out_k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                    cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, interleaved: bool,
                    conjugate: bool, *, position_ids: torch.Tensor | None = None,
                    start_positions: torch.Tensor | None = None, start_offset: int = 0) -> None:
    """:func:`rotary_torch` of q ``[T, Hq, D]`` into out_q and k ``[T, Hk, D]`` into out_k
    (k and out_k may be None or have 0 heads; same dtype as q), with the positions and
    the cos/sin rows found once for both (the Triton launcher's signature)."""
    pairs = [(x, out) for x, out in ((q, out_q), (k, out_k)) if x is not None and x.shape[1]]
    if not pairs:
        return
    c, s, valid = _rows(cos, sin, cu_seqlens, q.shape[0], q.dtype, cp_size, cp_rank, conjugate,
                        position_ids, start_positions, start_offset)
    for x, out in pairs:
        _rotate(x, out, c, s, valid, interleaved)
