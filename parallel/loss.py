"""Cross-entropy whose value and gradient match the single-process loss under CP x DP.

Normalisation (Megatron-core's "per-token loss" / torchtitan's global token
count): with ``S_r`` the sum of per-token CE over the non-ignored labels of
rank ``r`` and ``N = sum_r n_r`` the number of non-ignored labels of the whole
group,

    loss        = (sum_r S_r) / N                  (returned on every rank)
    d loss_r    = d S_r / N                        (what each rank back-propagates)

so that the gradient **SUM** over the same group (all-reduce SUM on CPU, or a
reduce-scatter AVG with the backward scaled by the group size, as FSDP2 does)
equals the gradient of the single-process mean over all N tokens. Dividing by
the *local* count instead would weight a rank holding one real token like a
rank holding thousands (the error Megatron-core fixed by moving to a global
token count). ``N`` comes from an all-reduce without gradient; ``N = 0`` (a
batch whose labels are all ignored) gives loss 0 and gradients exactly 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_rope.validation import (
    check_cu_seqlens,
    check_cu_seqlens_content,
    check_int,
    content_checks_enabled,
)

__all__ = ["cp_cross_entropy"]


class _GroupMean(torch.autograd.Function):
    """Forward: ``global_sum / count``; backward: ``grad / count`` into the local sum only."""

    @staticmethod
    def forward(ctx, local_sum, global_sum, count):
        ctx.save_for_backward(count)
        return global_sum / count

    @staticmethod
    def backward(ctx, grad):
        (count,) = ctx.saved_tensors
        return grad / count, None, None


def cp_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                     group: dist.ProcessGroup | None = None, *,
                     ignore_index: int = -100, cu_seqlens: torch.Tensor | None = None,
                     ) -> torch.Tensor:
    """Mean next-token cross-entropy over every non-ignored label of ``group``.

    Args:
        logits: ``[T, V]`` float (any float dtype; the CE is computed in at
            least float32), this rank's rows (a CP shard of a packed batch).
        labels: ``[T]`` integer, the matching targets; ``ignore_index`` marks
            rows without a target (a document's last token, padding).
        group: the process group whose tokens form the mean: the flattened
            dp x cp group (default: the world when ``torch.distributed`` is
            initialised, else this process alone).
        ignore_index: label value to skip.
        cu_seqlens: optional, the batch's *local* int32 ``[B + 1]`` cu_seqlens
            (``PackedBatch.cu_seqlens``). The loss does not depend on it; when
            given it is validated like everywhere else (:mod:`cp_rope.validation`:
            dtype and shape always, content for CPU tensors or with
            ``CP_ROPE_DEBUG=1``) and must end at most at ``T``, which catches
            logits or labels of another batch.

    Returns:
        0-dim tensor in the compute dtype: the same value on every rank of
        ``group``, equal to ``F.cross_entropy`` (mean) over the concatenated
        labels of all ranks. Its gradient is this rank's share (see the module
        docstring): gradients must be **summed** over ``group``.

    Raises:
        ValueError: shapes that do not match, labels on another device than
            logits, a label outside ``[0, V)`` that is not ``ignore_index``
            (checked for CPU tensors, and on devices with ``CP_ROPE_DEBUG=1``,
            as :func:`cp_rope.validation.content_checks_enabled`), or a bad
            ``cu_seqlens`` (not 1-D, not starting at 0, decreasing, ending
            beyond ``T``), naming the argument.
        TypeError: logits or labels not tensors, non-integer labels or
            ``ignore_index``, non-float logits, ``cu_seqlens`` not an int32 tensor.

    Cost: one all-reduce of two float64 scalars (the loss sum and the count).
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor, got {logits.dtype}")
    if labels.dim() != 1 or labels.shape[0] != logits.shape[0]:
        raise ValueError(f"labels must be [T] with T = logits.shape[0] = {logits.shape[0]}, "
                         f"got shape {tuple(labels.shape)}")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if labels.device != logits.device:
        raise ValueError(f"labels must be on logits' device {logits.device}, got {labels.device}")
    ignore_index = check_int("ignore_index", ignore_index)
    if content_checks_enabled(labels):  # reads labels on the host: CPU, or CP_ROPE_DEBUG=1
        n_classes = logits.shape[1]
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= n_classes))
        if bool(bad.any()):
            t = int(torch.nonzero(bad)[0])
            raise ValueError(f"labels must be in [0, {n_classes}) (logits.shape[1]) or "
                             f"ignore_index={ignore_index}; labels[{t}] = {int(labels[t])}")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, device=labels.device)
        if content_checks_enabled(cu_seqlens):
            check_cu_seqlens_content(cu_seqlens, n_tokens=labels.shape[0])
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    local_sum = F.cross_entropy(logits.to(compute_dtype), labels.long(), ignore_index=ignore_index,
                                reduction="sum")
    stats = torch.stack([local_sum.detach().to(torch.float64),
                         (labels != ignore_index).sum().to(torch.float64)])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    global_sum = stats[0].to(compute_dtype)
    count = stats[1].clamp(min=1.0).to(compute_dtype)
    return _GroupMean.apply(local_sum, global_sum, count)
