"""Parallel degrees and the ``("dp", "cp")`` DeviceMesh (torchtitan's ParallelDims pattern)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cp_rope.validation import check_int

__all__ = ["ParallelDims"]


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelDims:
    """Data-parallel x context-parallel degrees of a job.

    Ranks are laid out row-major over ``(dp, cp)``: rank ``d * cp + c`` is
    data-parallel coordinate ``d`` and CP rank ``c``, so the ``cp`` ranks that
    share a sequence are neighbours (same node when ``cp`` divides the GPUs
    per node, where the ring's P2P traffic is cheapest).
    """

    dp: int
    """Data-parallel degree (groups that see different batches)."""
    cp: int
    """Context-parallel degree (ranks that share one sequence)."""
    world_size: int
    """Total number of ranks; must equal dp * cp."""

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "world_size"):
            # TypeError for a non-int, ValueError below 1 (cp_rope.validation).
            object.__setattr__(self, name, check_int(f"ParallelDims.{name}", getattr(self, name),
                                                     min_value=1))
        if self.dp * self.cp != self.world_size:
            raise ValueError(f"ParallelDims: dp * cp must equal world_size, got dp={self.dp} x "
                             f"cp={self.cp} = {self.dp * self.cp} != world_size={self.world_size}")

    @classmethod
    def from_world(cls, cp: int, world_size: int | None = None) -> ParallelDims:
        """dp = world_size / cp.

        Raises: TypeError if cp is not an int; ValueError if it is below 1 or
        does not divide the world size (with the arithmetic).
        """
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
        cp = check_int("cp_size", cp, min_value=1)
        if world_size % cp != 0:
            raise ValueError(f"cp_size={cp} must divide the world size {world_size}: "
                             f"dp = {world_size} / {cp} = {world_size / cp:g} is not an integer")
        return cls(dp=world_size // cp, cp=cp, world_size=world_size)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The 2-D DeviceMesh ``("dp", "cp")`` over all ranks (needs an initialised process group)."""
        if not dist.is_initialized() or dist.get_world_size() != self.world_size:
            got = dist.get_world_size() if dist.is_initialized() else "no process group"
            raise RuntimeError(f"build_mesh: expected an initialised process group of "
                               f"world_size={self.world_size}, got {got}")
        return init_device_mesh(device_type, (self.dp, self.cp), mesh_dim_names=("dp", "cp"))

    def build_flat_mesh(self, device_type: str) -> DeviceMesh:
        """The 1-D mesh ``("dp_cp",)`` over all ranks in the same (row-major) order.

        Gradients are reduced, FSDP2 shards, and the loss averages over this
        mesh. With dp * cp == world it is the world itself, so it reuses the
        default group instead of flattening with a private API.
        """
        return DeviceMesh(device_type, torch.arange(self.world_size), mesh_dim_names=("dp_cp",))
