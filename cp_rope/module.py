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

    Owns float32 cos/sin tables ``[max_positions, rotary_dim // 2]``
    (:attr:`cos`, :attr:`sin`), built by :func:`cp_rope.rope_cache` on
    ``device``. They are a cache, as in flash-attn's ``RotaryEmbedding``, not
    buffers: no ``state_dict`` entry, no gradient, and module casts
    (``model.bfloat16()``, ``.to(dtype)``) never reach them, since bf16 angles
    are wrong by whole radians at long positions. ``.to(device)`` does not move
    them either: ``forward`` uses tables on the inputs' device, moving the
    cache there once on first use (one copy per device change, then reused).
    ``forward(q, k, cu_seqlens, ...)`` calls :func:`cp_rope.apply_rotary_emb_qk`
    (one kernel launch for q and k).

    Args:
        rotary_dim: rotated dims per head (even, <= head_dim).
        max_positions: largest *global* sequence length supported.
        base: RoPE base (``None``: ``scaling['rope_theta']`` if present, else 10000).
        scaling: HF-style ``rope_scaling`` dict (see :func:`cp_rope.rope_cache`).
        interleaved: GPT-J pairing instead of GPT-NeoX / Llama halves.
        device: where the cache is built.
    """

    def __init__(self, rotary_dim: int, max_positions: int, base: float | None = None,
                 scaling: Mapping[str, Any] | None = None, interleaved: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if scaling is not None and not isinstance(scaling, Mapping):
            raise TypeError(f"scaling must be a mapping (HF rope_scaling) or None, got "
                            f"{type(scaling).__name__} {scaling!r}")
        if not isinstance(interleaved, bool):
            raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__} "
                            f"{interleaved!r}")
        self.rotary_dim = rotary_dim
        self.max_positions = max_positions
        self.base = base
        self.scaling = dict(scaling) if scaling is not None else None
        self.interleaved = interleaved
        # Plain attributes (not buffers): nn.Module's casts and moves skip them.
        self._cos, self._sin = rope_cache(max_positions, rotary_dim, base, scaling, device=device)

    @property
    def cos(self) -> torch.Tensor:
        """float32 ``[max_positions, rotary_dim // 2]``, on the device last used."""
        return self._cos

    @property
    def sin(self) -> torch.Tensor:
        """float32 ``[max_positions, rotary_dim // 2]``, on the device last used."""
        return self._sin

    def tables(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` float32 on ``device``; the cache moves there on first use."""
        device = torch.device(device)
        if self._cos.device != device:
            self._cos, self._sin = self._cos.to(device), self._sin.to(device)
        return self._cos, self._sin

    def forward(self, q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, *,
                max_seqlen: int | None = None, cp_size: int = 1, cp_rank: int = 0,
                inplace: bool = False, backend: str = "auto",
                position_ids: torch.Tensor | None = None,
                max_position_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]``, k ``[T, Hk, D]``, local cu_seqlens int32 ``[B + 1]`` -> rotated (q, k).

        ``position_ids`` (int32/int64 ``[T]``, global positions built once per batch, e.g.
        ``plan.rope_args()``) replace the CP formula (then ``cp_size`` stays 1): the kernel
        loads one position per row and does no search over ``cu_seqlens``.
        ``max_position_id``: host bound on those positions. Errors as
        :func:`cp_rope.apply_rotary_emb_qk`."""
        cos, sin = self.tables(q.device)
        return apply_rotary_emb_qk(q, k, cos, sin, cu_seqlens, max_seqlen=max_seqlen,
                                   cp_size=cp_size, cp_rank=cp_rank, interleaved=self.interleaved,
                                   inplace=inplace, backend=backend, position_ids=position_ids,
                                   max_position_id=max_position_id)

    def extra_repr(self) -> str:
        return (f"rotary_dim={self.rotary_dim}, max_positions={self.max_positions}, "
                f"base={self.base}, scaling={self.scaling}, interleaved={self.interleaved}")
