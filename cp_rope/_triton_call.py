"""What cp_rope's element-wise Triton kernels (:mod:`cp_rope.swiglu`, :mod:`cp_rope.rms_norm`)
share around a launch: the device to launch on, when the PyTorch expression runs instead, and
the interpreter check for CPU tensors."""

from __future__ import annotations

import os

import torch
from torch.autograd import forward_ad

__all__ = ["launch", "eager_only", "check_triton_device"]


def launch(kernel, grid: int, device: torch.device, *args, **meta) -> None:
    """``kernel[(grid,)](*args, **meta)`` on ``device`` (Triton launches on the current CUDA
    device otherwise)."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            kernel[(grid,)](*args, **meta)
    else:
        kernel[(grid,)](*args, **meta)


def eager_only(*tensors: torch.Tensor) -> bool:
    """Whether the PyTorch expression must run instead of a kernel: under ``torch.compile``
    (Inductor fuses the expression itself), when a ``torch.func`` transform (vmap's batched or
    grad's tracking tensors) wraps one of ``tensors`` (a kernel reads raw storage), or when one
    carries a forward-mode tangent (``torch.autograd.forward_ad``: the kernels have no jvp; the
    expression propagates it)."""
    return torch.compiler.is_compiling() or any(
        torch._C._functorch.is_functorch_wrapped_tensor(t)
        or forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def check_triton_device(t: torch.Tensor) -> None:
    """ValueError naming ``backend`` when ``backend='triton'`` got CPU tensors outside the Triton
    interpreter (``TRITON_INTERPRET=1``)."""
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("backend='triton' got CPU tensors: use CUDA tensors, backend='torch', "
                         "or TRITON_INTERPRET=1 (set before cp_rope is imported)")
