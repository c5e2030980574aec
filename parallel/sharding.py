"""The load-balanced (zigzag) context-parallel split of THD tensors.

One helper, :func:`cp_shard_indices`, defines which global rows a rank keeps;
production code (the collator, :func:`shard_batch`) and the tests all use it,
so nobody re-derives the layout by hand. The layout is TransformerEngine's /
Megatron-core's: every global sequence of padded length ``L`` (divisible by
``2 * cp_size``) is cut into ``2 * cp_size`` chunks of ``c = L / (2 * cp_size)``
tokens; rank ``r`` keeps chunk ``r`` then chunk ``2 * cp_size - 1 - r``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cp_rope.positions import check_cp_args, global_positions

__all__ = ["cp_shard_indices", "shard_tensor", "unshard", "local_cu_seqlens"]


def local_cu_seqlens(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Local cu_seqlens of every rank: the *global* cu_seqlens divided by ``cp_size``.

    Args:
        cu_seqlens: int32/int64 ``[B + 1]`` global cumulative lengths; every
            sequence length must be divisible by ``2 * cp_size``.
        cp_size: CP degree.

    Returns: same dtype and device, ``[B + 1]``.

    Raises: ValueError if a global length is not divisible by ``2 * cp_size``.
    """
    check_cp_args(cp_size, 0)
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    if cp_size > 1 and bool((lens % (2 * cp_size) != 0).any()):
        bad = int(torch.nonzero(lens % (2 * cp_size) != 0)[0])
        raise ValueError(
            f"cu_seqlens: sequence {bad} has length {int(lens[bad])}, not divisible by "
            f"2 * cp_size = {2 * cp_size}; pad sequences first (PackingCollator does)")
    return torch.div(cu_seqlens, cp_size, rounding_mode="floor")


def cp_shard_indices(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global row indices kept by ``cp_rank``, in local order.

    Args:
        cu_seqlens: int32/int64 ``[B + 1]`` *global* cumulative lengths, each
            length divisible by ``2 * cp_size``. Rows at or beyond
            ``cu_seqlens[-1]`` belong to no sequence and are not sharded.
        cp_size: CP degree ``C``.
        cp_rank: ``0 <= cp_rank < C``.

    Returns:
        int64 ``[cu_seqlens[-1] / C]``: ``x_local = x_global[idx]``. Local row
        ``j`` of a sequence has position ``global_positions(local_cu, C, r)[j]``
        inside it.

    Raises: TypeError/ValueError naming the argument (see :func:`local_cu_seqlens`).
    """
    check_cp_args(cp_size, cp_rank)
    cu = cu_seqlens.to(torch.int64)
    local_cu = local_cu_seqlens(cu, cp_size)
    pos = global_positions(local_cu, cp_size, cp_rank)
    lens = local_cu[1:] - local_cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lens, output_size=pos.numel())
    return starts + pos


def shard_tensor(x: torch.Tensor, cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int,
                 dim: int = 0) -> torch.Tensor:
    """``x`` (global rows along ``dim``) -> this rank's zigzag shard (a new tensor)."""
    idx = cp_shard_indices(cu_seqlens, cp_size, cp_rank).to(x.device)
    return x.index_select(dim, idx)


def unshard(local: torch.Tensor, cu_seqlens: torch.Tensor, group: dist.ProcessGroup | None = None,
            ) -> torch.Tensor:
    """Gather every rank's zigzag shard back into global order (dim 0).

    Args:
        local: ``[T_local, ...]``, this rank's rows (any trailing shape, any
            dtype), laid out by :func:`cp_shard_indices`.
        cu_seqlens: the rank's *local* cu_seqlens ``[B + 1]`` (the same on every
            rank of the CP group).
        group: the CP process group (default: the world).

    Returns: ``[C * T_local, ...]`` in global order. Rows of ``local`` at or
    beyond ``cu_seqlens[-1]`` (trailing padding) are dropped. Not differentiable.

    Raises: ValueError if ``local`` has fewer rows than ``cu_seqlens[-1]``.
    """
    cp_size = dist.get_world_size(group) if dist.is_initialized() else 1
    n_local = int(cu_seqlens[-1])
    if local.shape[0] < n_local:
        raise ValueError(f"local: {local.shape[0]} rows but cu_seqlens[-1] = {n_local}")
    local = local[:n_local].contiguous()
    if cp_size == 1:
        return local.clone()
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local, group=group)
    global_cu = cu_seqlens.to(torch.int64) * cp_size
    out = local.new_empty((n_local * cp_size, *local.shape[1:]))
    for r, part in enumerate(parts):
        out[cp_shard_indices(global_cu, cp_size, r).to(out.device)] = part
    return out
