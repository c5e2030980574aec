"""One fused LSE merge of CP attention partials on the GPU (Triton).

``merge_rows_(acc, acc_lse, o, lse)`` updates, in place, an output accumulator
and its log-sum-exp with a block's partial over disjoint keys (the online
softmax merge of FlashAttention; :func:`~cp_rope.parallel._blocks.merge_weights`
states the rules):

    lse' = logaddexp(acc_lse, lse),
    acc' = exp(acc_lse - lse') acc + exp(lse - lse') o,

in fp32, rounded once into ``acc``'s dtype. A -inf partial gets weight 0 and the
other weight exactly 1; both -inf: weights 0, LSE -inf. One pass reads acc and o
and writes acc (the PyTorch path, used on the CPU and for float64, makes three
output-sized passes with an fp32 temporary).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["merge_rows_", "fused_merge_supported"]


@triton.jit
def _merge_rows_kernel(
    # pointers
    acc_ptr, acc_lse_ptr, o_ptr, lse_ptr,
    # sizes
    n_rows, head_dim,
    # strides (elements; the head_dim stride is 1)
    stride_acc_t, stride_acc_h, stride_o_t, stride_o_h,
    stride_acc_lse_h, stride_acc_lse_t, stride_lse_h, stride_lse_t,
    # meta: tile sizes (they shape the generated code)
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    rmask = rows < n_rows
    l1 = tl.load(acc_lse_ptr + h * stride_acc_lse_h + rows * stride_acc_lse_t, mask=rmask,
                 other=float("-inf"))
    l2 = tl.load(lse_ptr + h * stride_lse_h + rows * stride_lse_t, mask=rmask,
                 other=float("-inf"))
    m = tl.maximum(l1, l2)
    m = tl.where(m == float("-inf"), 0.0, m)
    e1 = tl.exp(l1 - m)  # 0 for a -inf partial
    e2 = tl.exp(l2 - m)
    s = e1 + e2
    s_safe = tl.where(s > 0, s, 1.0)
    lse_out = tl.where(s > 0, m + tl.log(s_safe), float("-inf"))
    inv = tl.where(s > 0, 1.0 / s_safe, 0.0)
    w1 = (e1 * inv)[:, None]
    w2 = (e2 * inv)[:, None]
    d = tl.arange(0, BLOCK_D)
    mask = rmask[:, None] & (d < head_dim)[None, :]
    acc_off = rows[:, None] * stride_acc_t + h * stride_acc_h + d[None, :]
    o_off = rows[:, None] * stride_o_t + h * stride_o_h + d[None, :]
    a = tl.load(acc_ptr + acc_off, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + o_off, mask=mask, other=0.0).to(tl.float32)
    tl.store(acc_ptr + acc_off, (a * w1 + o * w2).to(acc_ptr.dtype.element_ty), mask=mask)
    tl.store(acc_lse_ptr + h * stride_acc_lse_h + rows * stride_acc_lse_t, lse_out, mask=rmask)


def fused_merge_supported(acc: torch.Tensor, acc_lse: torch.Tensor, o: torch.Tensor,
                          lse: torch.Tensor) -> bool:
    """Whether :func:`merge_rows_` serves these tensors (CUDA; fp16/bf16/fp32 outputs; fp32
    LSE; unit head_dim stride)."""
    return (acc.is_cuda and o.device == acc.device
            and acc.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and o.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and acc_lse.dtype == torch.float32 and lse.dtype == torch.float32
            and acc.stride(-1) == 1 and o.stride(-1) == 1)


def merge_rows_(acc: torch.Tensor, acc_lse: torch.Tensor, o: torch.Tensor,
                lse: torch.Tensor) -> None:
    """Merge the partial ``(o, lse)`` into ``(acc, acc_lse)`` in place.

    Args:
        acc: ``[n, H, D]`` accumulator (fp16/bf16/fp32, unit last stride), updated.
        acc_lse: ``[H, n]`` float32, updated.
        o: ``[n, H, D]`` the partial (any float dtype, unit last stride).
        lse: ``[H, n]`` float32 (any strides).
    """
    n, heads, d = acc.shape
    if n == 0 or heads == 0:
        return
    block_d = triton.next_power_of_2(d)
    block_t = max(1, min(32, 4096 // block_d))
    grid = (triton.cdiv(n, block_t), heads)
    _merge_rows_kernel[grid](
        acc, acc_lse, o, lse,
        n, d,
        acc.stride(0), acc.stride(1), o.stride(0), o.stride(1),
        acc_lse.stride(0), acc_lse.stride(1), lse.stride(0), lse.stride(1),
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4,
    )
