"""The hook of ``method="auto"`` / ``placement="auto"``: one function the plan builder calls.

:func:`cp_rope.parallel.attention_plan` calls :func:`choose_strategy` when its
``method`` or ``placement`` is ``"auto"``, with the batch's layout (host data,
equal on every rank) and the layer's shapes; it must return the same answer on
every rank (a pure function of its argument). Its answer then goes through the
builder's checks and the ranks' agreement like explicit arguments.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["LayoutInfo", "Strategy", "choose_strategy"]


@dataclasses.dataclass(frozen=True)
class LayoutInfo:
    """What the chooser sees (all host values, the same on every rank of the group).

    Fields:
        global_cu_seqlens: int64 CPU ``[B + 1]`` cumulative (padded) lengths of the global
            batch.
        local_cu_seqlens: int32 CPU ``[B_r + 1]`` this rank's local cu_seqlens.
        placement_fixed: the layout of the rows in hand (``"zigzag"`` or ``"per_document"``)
            when the batch is already sharded (the chooser must keep it), else None.
        cp_size: C; q_heads, kv_heads, head_dim, dtype, device, causal: the layer's.
        method, placement, split_threshold, ulysses_size: what the caller asked for
            (``"auto"`` where the chooser decides).
    """

    global_cu_seqlens: torch.Tensor
    local_cu_seqlens: torch.Tensor
    placement_fixed: str | None
    cp_size: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    causal: bool
    method: str
    placement: str | None
    split_threshold: int | None
    ulysses_size: int | None


@dataclasses.dataclass(frozen=True)
class Strategy:
    """The chooser's answer: concrete ``method`` (one of METHODS), ``placement`` (one of
    PLACEMENTS), ``split_threshold`` (per_document) and ``ulysses_size`` (hybrid)."""

    method: str
    placement: str
    split_threshold: int | None = None
    ulysses_size: int | None = None


def choose_strategy(info: LayoutInfo) -> Strategy:
    """The method / placement for one batch (placeholder until the cost model lands).

    Raises: NotImplementedError naming ``method`` / ``placement`` (``"auto"`` has no rule yet).
    """
    raise NotImplementedError(
        f"method={info.method!r}, placement={info.placement!r}: 'auto' has no cost model yet; "
        "pass a method and placement explicitly")
