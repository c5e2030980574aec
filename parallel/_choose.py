"""The hook of ``method="auto"`` / ``placement="auto"``: one function the plan builder calls.

:func:`cp_rope.parallel.attention_plan` calls :func:`choose_strategy` when its
``method`` or ``placement`` is ``"auto"`` and the batch carries no choice yet
(``batch.choice``, set by :class:`~cp_rope.parallel.cost_model.AutoPlacement`), with the
batch's layout (host data, equal on every rank), the layer's shapes and the plan's
calibration; it must return the same answer on every rank (a pure function of its
argument). Its answer then goes through the builder's checks and the ranks' agreement like
explicit arguments, and the plan carries it (``plan.choice``). Nothing is kept here: the
decision travels on the plan (and the batch) it describes.
"""

from __future__ import annotations

import dataclasses

import torch

from ._calibration import Calibration
from .cost_model import Choice, choose
from .placement import default_split_threshold

__all__ = ["LayoutInfo", "choose_strategy"]


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
        calibration: the cost model's constants (the plan's ``calibration``).
        window: the plan's ``window`` argument (an int, None, or every layer's list): the
            cost model counts what the window leaves of the work and the bytes.
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
    calibration: Calibration
    window: int | None | list = None


def choose_strategy(info: LayoutInfo) -> Choice:
    """The method / placement for one batch by the cost model
    (:func:`cp_rope.parallel.cost_model.choose`, constants ``info.calibration``): a
    :class:`~cp_rope.parallel.cost_model.Choice` (``.method``, ``.placement``,
    ``.split_threshold``, ``.ulysses_size``, the predicted times, ``.summary()``).

    A pure function of ``info``: every rank that passes the same calibration gets the same
    answer (and the plan's agreement covers the chosen method). The rows' layout
    (``placement_fixed``) is kept; per-document rows are modelled with ``split_threshold``
    (the library default when None).

    Raises: ValueError naming ``method='auto'`` / ``placement='auto'`` and the setting it
    cannot honour (e.g. a ``ulysses_size`` that does not divide the heads or cp_size; a
    placement no batch layout allows).
    """
    placement = info.placement_fixed or (info.placement if info.placement not in (None, "auto")
                                         else "auto")
    threshold = info.split_threshold
    if placement == "per_document" and threshold is None:
        threshold = default_split_threshold(info.head_dim, info.cp_size)
    # the throughput of backend "auto" (cudnn, or cudnn + fa4 by the crossover table)
    backend = "auto" if info.device.type == "cuda" else "reference"
    try:
        return choose(info.global_cu_seqlens, cp_size=info.cp_size, q_heads=info.q_heads,
                        kv_heads=info.kv_heads, head_dim=info.head_dim, dtype=info.dtype,
                        backend=backend, method=info.method, placement=placement,
                        split_threshold=threshold,
                        ulysses_size=info.ulysses_size, calibration=info.calibration,
                        window=info.window)
    except ValueError as exc:
        raise ValueError(f"method={info.method!r}, placement={info.placement!r} (auto) cannot "
                         f"honour the other settings: {exc}") from exc
