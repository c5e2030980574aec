"""Apply the job's parallelism to the model: :func:`parallelize` (torchtitan's shape).

One function per concern, applied by :func:`parallelize` in this order:

1. :func:`apply_cp` -- context parallelism: every attention layer runs
   :func:`cp_rope.parallel.context_parallel_attention` over the mesh's ``"cp"``
   group (and the RoPE positions of the zigzag shard). First, because it only
   sets how attention runs, on the plain modules.
2. :func:`apply_activation_checkpointing` -- each layer (cp_rope's
   :class:`~cp_rope.launch.model.TransformerBlock` or a transformers decoder
   layer) recomputes its activations in backward (``model.activation_checkpointing``:
   ``full``, or ``selective``, which keeps the attention outputs), and/or keeps
   what it saves in pinned host memory (``model.offload_activations``); see
   :mod:`cp_rope.launch.offload`. Before FSDP2, so that each FSDP unit holds a
   checkpointed layer: its parameters are gathered once per forward and once per
   backward, and the recomputation (the CP collectives included) runs inside
   that backward.
3. :func:`apply_fsdp` -- FSDP2 ``fully_shard`` over all dp x cp ranks, one unit
   per block plus the root (ZeRO-3, bf16 compute on fp32 master weights), or,
   without FSDP (the CPU default), a plain cast to the compute dtype; the
   gradients are then all-reduced by the step
   (:func:`cp_rope.launch.pretrain.all_reduce_gradients`). Last, as FSDP2
   wraps what the steps above built.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from cp_rope.parallel.calibrate import Calibration
from cp_rope.parallel.mesh import ParallelDims

from .config import PretrainConfig
from .model import Transformer
from .offload import CHECKPOINT_MODES, ActivationOffloader, wrap_layer

__all__ = ["parallelize", "apply_cp", "apply_activation_checkpointing", "apply_fsdp",
           "compute_dtype", "uses_fsdp", "flat_mesh", "checkpoint_mode"]


def compute_dtype(cfg: PretrainConfig, device_type: str) -> torch.dtype:
    """``train.dtype`` resolved: auto = bfloat16 on cuda, float32 elsewhere."""
    if cfg.train.dtype == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.train.dtype]


def uses_fsdp(cfg: PretrainConfig, device_type: str) -> bool:
    """``parallel.fsdp`` resolved: auto = on for cuda, off (gradient all-reduce) elsewhere."""
    return cfg.parallel.fsdp == "on" or (cfg.parallel.fsdp == "auto" and device_type == "cuda")


def flat_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D ``("dp_cp",)`` mesh over every rank of the ``("dp", "cp")`` ``mesh``, in its order:
    FSDP2 shards, gradients are reduced and the loss averages over it."""
    dims = ParallelDims(dp=mesh.size(0), cp=mesh.size(1), world_size=mesh.size())
    return dims.build_flat_mesh(mesh.device_type)


def apply_cp(model: Transformer, mesh: DeviceMesh, cfg: PretrainConfig, *,
             calibration: Calibration | None = None) -> None:
    """Attention over ``mesh["cp"]`` with ``parallel.cp_method``, the kernel backends and
    ``calibration`` (``--cp-calibration``'s constants: every plan the model builds carries
    them; None: the shipped defaults)."""
    p = cfg.parallel
    model.configure_attention(cp_group=mesh["cp"].get_group(), cp_method=p.cp_method,
                              attn_backend=p.attn_backend, rope_backend=p.rope_backend,
                              ulysses_size=p.ulysses_size if p.cp_method == "hybrid" else None,
                              calibration=calibration)


def checkpoint_mode(value: str | bool) -> str:
    """``model.activation_checkpointing`` as a mode of :data:`~cp_rope.launch.offload.CHECKPOINT_MODES`
    (the former boolean: True = ``"full"``, False = ``"none"``).

    Raises: ValueError naming the field for anything else.
    """
    if isinstance(value, bool):
        return "full" if value else "none"
    if value not in CHECKPOINT_MODES:
        raise ValueError(f"model.activation_checkpointing={value!r}: expected one of "
                         f"{list(CHECKPOINT_MODES)}")
    return value


def apply_activation_checkpointing(model: Transformer, mode: str | bool = "full", *,
                                   offload: bool = False) -> ActivationOffloader | None:
    """Checkpoint every layer of ``model.layers`` with ``mode`` and, with ``offload``, keep what
    each layer saves in (pinned) host memory (:func:`cp_rope.launch.offload.wrap_layer`).

    ``"full"`` keeps each layer's inputs, ``"selective"`` also the attention
    kernels' outputs (out and LSE; norms, projections and the MLP are recomputed),
    ``"none"`` everything autograd saves. Gradients are the same in every mode.
    Parameter names do not change, so checkpoints load with or without it.

    With ``offload`` the last layer's tensors stay on the GPU (``keep_from``): backward needs
    them first, right after the loss, so copying them out and back only made backward start by
    waiting for them (Megatron-core likewise offloads fewer layers than the model has). Measured
    +3.4 % tokens/s at the same peak (docs/benchmarks.md, round 13).

    Returns: the :class:`~cp_rope.launch.offload.ActivationOffloader` (``offload``) or None.
    """
    mode = checkpoint_mode(mode)
    offloader = ActivationOffloader(keep_from=len(model.layers) - 1) if offload else None
    for i, layer in enumerate(model.layers):
        wrap_layer(layer, i, mode, offloader)
    return offloader


def apply_fsdp(model: Transformer, mesh: DeviceMesh, param_dtype: torch.dtype) -> None:
    """FSDP2 over the 1-D ``mesh`` (all ranks): one unit per block plus the root.

    Parameters are sharded over all dp x cp ranks (ZeRO-3); with a bf16
    ``param_dtype`` compute runs in bf16 on fp32 master weights and gradients
    are reduce-scattered in fp32 (torchtitan's default policy). The
    reduce-scatter averages: scale the loss by the world size for a SUM.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def parallelize(model: Transformer, mesh: DeviceMesh, cfg: PretrainConfig, *,
                calibration: Calibration | None = None) -> None:
    """CP wiring, then activation checkpointing, then FSDP2 (or a cast), in place.

    Args:
        model: the freshly built, unsharded model (fp32, on the mesh's device).
        mesh: the 2-D ``("dp", "cp")`` DeviceMesh of the job
            (:meth:`cp_rope.parallel.mesh.ParallelDims.build_mesh`).
        cfg: ``parallel`` (CP method, backends, fsdp), ``model.activation_checkpointing``,
            ``model.offload_activations`` and ``train.dtype`` are read.
        calibration: the CP cost model's constants for the model's plans (:func:`apply_cp`).

    The order and the reasons are in this module's docstring.
    """
    apply_cp(model, mesh, cfg, calibration=calibration)
    mode = checkpoint_mode(cfg.model.activation_checkpointing)
    if mode != "none" or cfg.model.offload_activations:
        apply_activation_checkpointing(model, mode, offload=cfg.model.offload_activations)
    dtype = compute_dtype(cfg, mesh.device_type)
    model.compute_dtype = dtype  # the dtype of the batch's attention plan (model.attention_plan)
    if uses_fsdp(cfg, mesh.device_type):
        apply_fsdp(model, flat_mesh(mesh), dtype)
    else:
        model.to(dtype)
