"""The optimizer side of a step: AdamW parameter groups, the LR schedule, gradient reduction and clipping."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from .config import OptimConfig

__all__ = ["build_optimizer", "lr_lambda", "all_reduce_gradients", "clip_gradients"]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW; decoupled weight decay on the matrices only (no decay for norms and embeddings).

    On CUDA parameters it is PyTorch's fused AdamW (one kernel per parameter chunk, as
    torchtitan's default; the same update as the ``foreach`` one elsewhere, to float32 rounding).
    """
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "tok_embeddings" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "tok_embeddings" not in n)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in model.parameters()) or None  # None: torch's default (foreach)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=fused)


def lr_lambda(cfg: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """LR multiplier for optimizer step ``s`` (0-based): linear warmup to 1 over
    ``warmup_steps``, then cosine down to ``min_lr_ratio`` at ``total_steps``."""

    def fn(s: int) -> float:
        if s < cfg.warmup_steps:
            return (s + 1) / cfg.warmup_steps
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (s - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def all_reduce_gradients(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """SUM every parameter's gradient over ``group`` with one flat all-reduce (the CPU path).

    Together with :func:`cp_rope.parallel.cp_cross_entropy`'s normalisation this gives every rank
    the gradient of the single-process mean loss.
    """
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    if any(g is None for g in grads):
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        raise RuntimeError(f"parameters without a gradient: {missing[:5]}")
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_gradients(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient L2 norm over all ranks (DTensor shards included); clip when ``max_norm > 0``.

    Returns: the norm before clipping (a scalar tensor, the same on every rank).
    """
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    if hasattr(norm, "full_tensor"):  # DTensor with a Partial placement under FSDP2
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm
