"""``RotaryEmbedding``: an ``nn.Module`` that owns the cos/sin cache."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from cp_rope.cache import rope_cache
from cp_rope.ops import apply_rotary_emb_qk

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """RoPE for packed THD q/k with the CP position formula.

    Owns float32 cos/sin buffers ``[max_positions, rotary_dim // 2]`` (not
    persistent: rebuilt from the arguments; they get no gradient). ``.to()``,
    ``.cuda()`` and friends move them but never cast them: ``model.bfloat16()``
    keeps the tables in float32, since bf16 angles are wrong by whole radians
    at long positions. ``forward(q, k, cu_seqlens, ...)`` calls
    :func:`cp_rope.apply_rotary_emb_qk` (one kernel launch for q and k).

    Args:
        rotary_dim: rotated dims per head (even, <= head_dim).
        max_positions: largest *global* sequence length supported.
        base: RoPE base.
        scaling: HF-style ``rope_scaling`` dict (see :func:`cp_rope.rope_cache`).
        interleaved: GPT-J pairing instead of GPT-NeoX / Llama halves.
        device: where the cache is built.
    """

    def __init__(self, rotary_dim: int, max_positions: int, base: float = 10000.0,
                 scaling: Mapping[str, Any] | None = None, interleaved: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.max_positions = max_positions
        self.base = base
        self.scaling = dict(scaling) if scaling is not None else None
        self.interleaved = interleaved
        cos, sin = rope_cache(max_positions, rotary_dim, base, scaling, device=device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, *,
                max_seqlen: int | None = None, cp_size: int = 1, cp_rank: int = 0,
                inplace: bool = False, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]``, k ``[T, Hk, D]``, local cu_seqlens int32 ``[B + 1]`` -> rotated (q, k)."""
        return apply_rotary_emb_qk(q, k, self.cos, self.sin, cu_seqlens, max_seqlen=max_seqlen,
                                   cp_size=cp_size, cp_rank=cp_rank, interleaved=self.interleaved,
                                   inplace=inplace, backend=backend)

    def _apply(self, fn, recurse=True):
        cos, sin = self.cos, self.sin
        super()._apply(fn, recurse)
        # Keep the float32 tables: take only the device of what fn made.
        self.cos = cos.to(self.cos.device)
        self.sin = sin.to(self.sin.device)
        return self

    def extra_repr(self) -> str:
        return (f"rotary_dim={self.rotary_dim}, max_positions={self.max_positions}, "
                f"base={self.base}, scaling={self.scaling}, interleaved={self.interleaved}")
