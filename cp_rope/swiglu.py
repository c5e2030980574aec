"""Fused SwiGLU product ``silu(gate) * up``: one Triton kernel forward, one backward.

A SwiGLU MLP (Shazeer 2020, "GLU Variants Improve Transformer", Eq. 6:
``FFN(x) = (silu(x W) * x V) W2``) spends its element-wise work on ``[T, F]``
tensors (``F`` the intermediate size): unfused, PyTorch's forward reads ``gate``,
writes ``silu(gate)``, reads it and ``up`` and writes the product (5 passes), and
autograd keeps ``gate``, ``silu(gate)`` and ``up``; its backward makes 9 passes.
:func:`swiglu` makes 3 passes forward (read ``gate``, ``up``; write the product) and
5 backward (read the gradient, ``gate``, ``up``; write both input gradients),
keeps ``gate`` and ``up`` only, and recomputes ``silu`` in backward. Under a tiled
MLP (:func:`cp_rope.parallel.tiled_mlp`) each tile runs its forward once in the
forward and once more in the tiled node's backward (a third time where checkpointing
recomputes the layer: full, or selective without offload), and its backward once.

Numerics follow PyTorch's eager ``F.silu(gate) * up`` in the input dtype, rounding where it
rounds: ``silu`` computed in float32 and rounded to the dtype (within an ulp of eager's: the
kernel's ``a * sigmoid(a)`` and eager's ``a / (1 + exp(-a))`` differ in float32's last bit,
which moves the rounding of a silu near a midpoint), then the product rounded (equal to
eager's wherever the silus are, else up to two ulps from it); in
backward ``d_up = round(d_out * round(silu(gate)))`` and
``d_gate = round(round(d_out * up) * s * (1 + gate * (1 - s)))`` with
``s = sigmoid(gate)`` in float32 (the derivative of ``x * sigmoid(x)``).

The kernel is element-wise over the flattened tensors: its grid is
``cdiv(numel, BLOCK)`` programs (it depends on the number of elements only) and its
addressing is int64 (program ids widened before they multiply the block size).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cp_rope._triton_call import check_triton_device, eager_only, launch
from cp_rope.ops import resolve_backend

__all__ = ["swiglu", "SWIGLU_DTYPES"]

SWIGLU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Dtypes the Triton kernel runs; others (float64) take the PyTorch expression."""

_BLOCK = 2048  # elements per program: 16 bytes per thread at bf16 with 4 warps x 2 vectors


def _kernels():
    """The two Triton kernels, built on first use (Triton is only needed for this backend)."""
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def _swiglu_fwd(GATE, UP, OUT, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        a = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(UP + offs, mask=mask, other=0.0)
        act = (a * tl.sigmoid(a)).to(b.dtype).to(tl.float32)  # F.silu's result, rounded
        tl.store(OUT + offs, (act * b.to(tl.float32)).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd(DOUT, GATE, UP, DGATE, DUP, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dy = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(UP + offs, mask=mask, other=0.0)
        dt = b.dtype
        s = tl.sigmoid(a)
        act = (a * s).to(dt).to(tl.float32)
        d_act = (dy * b.to(tl.float32)).to(dt).to(tl.float32)  # mul's gradient, rounded
        tl.store(DUP + offs, (dy * act).to(dt), mask=mask)
        tl.store(DGATE + offs, (d_act * s * (1.0 + a * (1.0 - s))).to(dt), mask=mask)

    _KERNELS = (triton, _swiglu_fwd, _swiglu_bwd)
    return _KERNELS


_KERNELS = None


def _forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    triton, fwd, _ = _kernels()
    out = torch.empty_like(up, memory_format=torch.contiguous_format)
    n = out.numel()
    if n:
        launch(fwd, triton.cdiv(n, _BLOCK), gate.device, gate, up, out, n, BLOCK=_BLOCK)
    return out


class _SwiGLU(torch.autograd.Function):
    """Autograd for the kernel: keeps ``gate`` and ``up``, recomputes ``silu`` in backward."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _forward(gate, up)

    @staticmethod
    def backward(ctx, d_out):
        gate, up = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the same formula in PyTorch ops, which
            g = gate.float()         # autograd differentiates again (a double backward)
            s = torch.sigmoid(g)
            d_up = d_out * (g * s).to(up.dtype)
            return ((d_out * up).float() * s * (1.0 + g * (1.0 - s))).to(gate.dtype), d_up
        triton, _, bwd = _kernels()
        d_out = d_out.contiguous()
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            launch(bwd, triton.cdiv(n, _BLOCK), gate.device, d_out, gate, up, d_gate, d_up, n,
                   BLOCK=_BLOCK)
        return d_gate, d_up


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up``, fused (the module docstring gives the passes and the numerics).

    Args:
        gate: ``[..., F]``, float32 / float16 / bfloat16 for the kernel (float64 and other
            floating dtypes take the PyTorch expression); the gate projection ``x W``.
        up: the up projection ``x V``, same shape, dtype and device as ``gate``.
        backend: ``"auto"`` (the Triton kernel on CUDA tensors, PyTorch on CPU; or
            ``$CP_ROPE_BACKEND``), ``"triton"`` or ``"torch"``. Under ``torch.compile``,
            ``torch.func`` transforms (``vmap``, ``grad``) and for forward-mode dual tensors
            (``torch.autograd.forward_ad``) the PyTorch expression runs (Inductor fuses it
            itself).

    Returns: ``[..., F]`` in the input dtype (contiguous from the kernel); differentiable in
    both inputs (with ``create_graph=True`` the backward runs the same formula in PyTorch
    ops, so it is differentiable again).

    Raises: TypeError naming ``gate`` / ``up`` when one is not a floating tensor;
    ValueError naming ``up`` when its shape, dtype or device differs from ``gate``'s, naming
    ``backend`` for an unknown backend, or for ``"triton"`` with CPU tensors outside
    ``TRITON_INTERPRET=1``.
    """
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
    if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(f"up: must match gate's shape, dtype and device, got {tuple(up.shape)} "
                         f"{up.dtype} {up.device} against {tuple(gate.shape)} {gate.dtype} "
                         f"{gate.device}")
    if (resolve_backend(backend, gate.device) == "torch" or gate.dtype not in SWIGLU_DTYPES
            or eager_only(gate, up)):
        return F.silu(gate) * up
    check_triton_device(gate)
    gate, up = gate.contiguous(), up.contiguous()
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SwiGLU.apply(gate, up)
    return _forward(gate, up)
