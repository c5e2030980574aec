"""Fused RMSNorm ``y = round(round(x * rstd) * w)``: one Triton kernel forward, one backward.

RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", Eq. 4) with the
rounding of transformers' Llama / Qwen / Mistral / Phi3 norms (``LlamaRMSNorm.forward``):
``rstd = rsqrt(mean(x^2) + eps)`` in float32 over the last dimension, ``x * rstd`` rounded to
the input dtype, times the weight, rounded again (Liger-Kernel's ``"llama"`` casting). The
weight has the input's dtype: the product of two bf16 / fp16 values is exact in float32, so the
kernel's one rounding of it is eager's.

Backward (the same source, differentiated; ``m = dy * w``, ``n`` the row length)::

    dx = rstd * (m - x * rstd^2 * sum(m * x) / n)
    dw = sum over rows of dy * round(x * rstd)

in float32 and rounded once. Autograd keeps ``x`` and the float32 ``rstd`` per row.

``patch_model``'s fused norms run it with ``CP_ROPE_NORM_KERNEL=triton``
(:func:`cp_rope.hf.norms.norm_kernel`); Liger-Kernel's stays their default on CUDA until a
finetune_hf step has been timed with this one. Why replace Liger-Kernel's: its backward
launches one 4-warp program per SM (132 on an H100) that walks its share of the rows one row
(hidden rows) or 16 rows (head rows) at a time, and zero-fills ``dx`` first. This backward
tiles ``BLOCK_ROW x BLOCK_N`` (~2,048 elements, 8 warps) and runs up to 8 programs per SM;
each sums ``dy * x_hat`` over its tiles in a float32 tile and reduces it over rows once, into
its partial ``dw`` row (``[programs, n]``, summed after). On an H100 at 262,144 tokens (bf16,
docs/benchmarks.md round 15) it runs the ``[T, 1024]`` backward in 0.57 ms and the
``[T x 16, 128]`` q norm's in 1.11 ms (~2,900 GB/s, a copy's ~3,000), Liger's in 1.89 and 3.45
ms; the forwards run at copy bandwidth. (Reducing over rows at every tile, the first version,
took 4.9 ms at the q norm.)

Grids: forward ``cdiv(rows, BLOCK_ROW)`` programs, backward at most ``8 x SMs`` (rows only:
nothing scales with a document count or length); addressing is int64 (program ids widened
before they multiply).
"""

from __future__ import annotations

import math
import numbers

import torch

from cp_rope._triton_call import check_triton_device, eager_only, launch
from cp_rope.ops import resolve_backend

__all__ = ["rms_norm", "RMS_NORM_DTYPES", "MAX_KERNEL_COLS"]

RMS_NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Dtypes the Triton kernel runs; others (float64) take the PyTorch expression."""

MAX_KERNEL_COLS = 16384
"""Longest row the kernel runs (one row tile in registers); longer rows take PyTorch's."""

_TILE = 2048  # forward elements per row tile: BLOCK_ROW = _TILE // BLOCK_N rows (at least one)
_BWD_TILE = 2048  # backward elements per row tile
_PROGRAMS_PER_SM = 8  # backward programs per SM (each keeps one partial dw row)
_FWD_PER_WARP, _BWD_PER_WARP = 256, 256  # tile elements per warp (_blocks): 8 warps a tile
# (the backward's: the fastest at both 262,144-token rows of the 27 settings of
# scripts/bench_rms_norm.py --tune on an H100, docs/benchmarks.md round 15)


def _kernels():
    """The two Triton kernels, built on first use (Triton is only needed for this backend)."""
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_fwd(X, W, Y, RSTD, n_rows, n_cols, eps,
                      BLOCK_ROW: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROW + tl.arange(0, BLOCK_ROW)
        cols = tl.arange(0, BLOCK_N)
        row_ok = rows < n_rows
        col_ok = cols < n_cols
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        dt = Y.dtype.element_ty
        x_hat = (x * rstd[:, None]).to(dt).to(tl.float32)
        tl.store(Y + offs, (x_hat * w[None, :]).to(dt), mask=mask)
        tl.store(RSTD + rows, rstd, mask=row_ok)

    @triton.jit
    def _rms_norm_bwd(DY, X, W, RSTD, DX, DW_PART, n_rows, n_cols,
                      BLOCK_ROW: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DW: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        step = tl.num_programs(0).to(tl.int64) * BLOCK_ROW
        cols = tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        dt = DX.dtype.element_ty
        dw = tl.zeros((BLOCK_ROW, BLOCK_N), dtype=tl.float32)  # summed over rows once, at the end
        for start in range(pid * BLOCK_ROW, n_rows, step):
            rows = start + tl.arange(0, BLOCK_ROW)
            row_ok = rows < n_rows
            mask = row_ok[:, None] & col_ok[None, :]
            offs = rows[:, None] * n_cols + cols[None, :]
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            m = dy * w[None, :]
            c = tl.sum(m * x, axis=1) * rstd * rstd / n_cols
            dx = rstd[:, None] * (m - c[:, None] * x)
            tl.store(DX + offs, dx.to(dt), mask=mask)
            if HAS_DW:
                x_hat = (x * rstd[:, None]).to(dt).to(tl.float32)
                dw += dy * x_hat
        if HAS_DW:
            tl.store(DW_PART + pid * n_cols + cols, tl.sum(dw, axis=0), mask=col_ok)

    _KERNELS = (triton, _rms_norm_fwd, _rms_norm_bwd)
    return _KERNELS


_KERNELS = None


def _blocks(n_cols: int, per_warp: int, tile: int = _TILE) -> tuple[int, int, int]:
    """``(BLOCK_ROW, BLOCK_N, num_warps)`` for rows of ``n_cols`` elements, a warp per
    ``per_warp`` tile elements (4 to 32 warps). Compiled for sm_90 (``cuobjdump
    --dump-resource-usage``) at row lengths 128, 1024 and 8192: the forward at 8 warps a
    2,048-element tile takes 30-47 registers a thread; the backward as first written (16 warps,
    one ``dw`` row) 61-64, not spilling (at 16,384 it spilled 136 bytes a thread). The backward
    now (8 warps, a float32 ``dw`` tile) has not been recompiled for these counts; its 8 warps
    are the fastest of ``scripts/bench_rms_norm.py --tune``'s settings on an H100."""
    block_n = 1 << max(n_cols - 1, 0).bit_length()
    block_row = max(1, tile // block_n)
    return block_row, block_n, min(32, max(4, block_row * block_n // per_warp))


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter (CPU): a few programs, so the row loop runs more than once


def _forward(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: ``y`` like ``x`` (contiguous), ``rstd`` float32 ``[rows]``."""
    triton, fwd, _ = _kernels()
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        block_row, block_n, warps = _blocks(n_cols, _FWD_PER_WARP)
        launch(fwd, triton.cdiv(n_rows, block_row), x.device, x, w, y, rstd, n_rows, n_cols,
               eps, num_warps=warps, BLOCK_ROW=block_row, BLOCK_N=block_n)
    return y, rstd


def _backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor,
              with_dw: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dx, dw)``: ``dx`` like ``x``, ``dw`` like ``w`` (None unless ``with_dw``); ``dy``
    contiguous, ``x``'s shape."""
    triton, _, bwd = _kernels()
    n_cols = x.shape[-1]
    n_rows = rstd.numel()
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    if not n_rows:
        return dx, (torch.zeros_like(w) if with_dw else None)
    block_row, block_n, warps = _blocks(n_cols, _BWD_PER_WARP, _BWD_TILE)
    grid = min(triton.cdiv(n_rows, block_row), _PROGRAMS_PER_SM * _sm_count(x.device))
    dw_part = torch.empty(grid if with_dw else 0, n_cols, dtype=torch.float32, device=x.device)
    launch(bwd, grid, x.device, dy, x, w, rstd, dx, dw_part, n_rows, n_cols,
           num_warps=warps, BLOCK_ROW=block_row, BLOCK_N=block_n, HAS_DW=with_dw)
    return dx, (dw_part.sum(0).to(w.dtype) if with_dw else None)


def _torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel's function in PyTorch ops (transformers' ``LlamaRMSNorm.forward``)."""
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    """Autograd for the kernels: keeps ``x``, ``w`` and the float32 ``rstd`` per row."""

    @staticmethod
    def forward(ctx, x, w, eps):
        y, rstd = _forward(x, w, eps)
        ctx.save_for_backward(x, w, rstd)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the function again in PyTorch ops,
            wanted = [t for t, need in zip((x, w), ctx.needs_input_grad[:2], strict=True) if need]
            with torch.enable_grad():  # differentiated by autograd (so differentiable again)
                y = _torch_rms_norm(x, w, ctx.eps)
            grads = iter(torch.autograd.grad(y, wanted, dy, create_graph=True))
            return (*(next(grads) if need else None for need in ctx.needs_input_grad[:2]), None)
        dx, dw = _backward(dy.contiguous(), x, w, rstd, with_dw=ctx.needs_input_grad[1])
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             backend: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dimension, fused (the module docstring gives the formula, its
    source, the rounding and the backward).

    Args:
        x: ``[..., n]`` floating; float32 / float16 / bfloat16 for the kernel (float64 and
            other floating dtypes take the PyTorch expression).
        weight: ``[n]``, the same dtype and device as ``x``.
        eps: added to the mean square (finite, > 0, dimensionless).
        backend: ``"auto"`` (the Triton kernel on CUDA tensors, PyTorch on CPU; or
            ``$CP_ROPE_BACKEND``), ``"triton"`` or ``"torch"``. Rows longer than
            :data:`MAX_KERNEL_COLS`, ``torch.compile``, ``torch.func`` transforms and
            forward-mode dual tensors take the PyTorch expression.

    Returns: ``[..., n]`` in ``x``'s dtype (contiguous from the kernel); differentiable in
    ``x`` and ``weight`` (with ``create_graph=True`` the backward runs the PyTorch expression,
    so it is differentiable again).

    Raises: TypeError naming ``x`` / ``weight`` when one is not a floating tensor; ValueError
    naming ``x`` when it is 0-d, ``weight`` when its shape, dtype or device does not match
    ``x``, ``eps`` unless it is a finite real number > 0 (not a bool), ``backend`` for an
    unknown backend, or for ``"triton"`` with CPU tensors outside ``TRITON_INTERPRET=1``.
    """
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
    if x.dim() == 0:
        raise ValueError("x: must have at least one dimension (the normalised one), got a 0-d "
                         "tensor")
    if weight.shape != x.shape[-1:] or weight.dtype != x.dtype \
            or weight.device != x.device:
        raise ValueError(f"weight: must be [{x.shape[-1]}] of x's dtype and "
                         f"device ({x.dtype} {x.device}), got {tuple(weight.shape)} "
                         f"{weight.dtype} {weight.device}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 < eps < math.inf:
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    if (resolve_backend(backend, x.device) == "torch" or x.dtype not in RMS_NORM_DTYPES
            or x.shape[-1] > MAX_KERNEL_COLS or eager_only(x, weight)):
        return _torch_rms_norm(x, weight, float(eps))
    check_triton_device(x)
    x, weight = x.contiguous(), weight.contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, float(eps))
    return _forward(x, weight, float(eps))[0]
