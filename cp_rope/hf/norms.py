"""Fused RMSNorm for transformers models (``patch_model(..., fused_norm=True)``).

The supported families' RMSNorm (``LlamaRMSNorm``, ``Qwen3RMSNorm``, ...) computes in
float32 with separate operators: for a bf16 input ``[T, d]`` autograd keeps a float32
copy of it, the normalised float32 rows and a bf16 copy of them, 5 bytes per element
more than the input itself. Qwen3's per-head ``q_norm`` / ``k_norm`` run on the whole
``[T, H, head_dim]`` projections, so at 262,144 tokens these copies are ~10 GiB per layer
(what sets the peak of a checkpointed layer's recomputation). :func:`fuse_rms_norms`
replaces each norm's forward by a fused kernel (one pass, float32 accumulation; autograd
keeps the input and the per-row ``rstd`` only): on CUDA Liger-Kernel's RMSNorm
(``LigerRMSNormFunction``, its ``"llama"`` casting) where liger-kernel is installed, or
cp_rope's Triton RMSNorm (:func:`cp_rope.rms_norm.rms_norm`, same rounding) with
``CP_ROPE_NORM_KERNEL=triton`` (:func:`norm_kernel`); else
:func:`torch.nn.functional.rms_norm`, PyTorch's.

Numerics: ``y = x * rsqrt(mean(x^2) + eps) * w``, the sum of squares in float32.
PyTorch's kernel rounds once to the input dtype; Liger's ``"llama"`` mode and cp_rope's, like
transformers, round ``x * rsqrt(...)`` to the input dtype before multiplying by ``w``
(a second rounding). The fused form is applied only where both are bf16/fp16 (the
training case); float32 / float64 inputs (and a weight of another dtype than the input)
run the model's own forward, bit for bit as unpatched.

Gemma 2 / 3's RMSNorm (an ``eps`` attribute, ``x * (1 + w)`` in float32, rounded once) is
not replaced: its ``1 + w`` in bf16 would lose the weight's low bits.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from cp_rope.rms_norm import rms_norm
from cp_rope.validation import check_choice

from ._forward import ForwardHandle, install_forward

__all__ = ["fuse_rms_norms", "rms_norm_modules", "norm_kernel", "liger_rms_norm", "NORM_KERNELS",
           "LOW_PRECISION"]

LOW_PRECISION = (torch.bfloat16, torch.float16)
"""Input dtypes the fused norm runs for; others keep the model's own forward."""


def _is_family_rms_norm(m: nn.Module, family_module) -> bool:
    cls = type(m)
    return (cls.__name__.endswith("RMSNorm") and cls.__module__ == family_module.__name__
            and isinstance(getattr(m, "weight", None), torch.Tensor)
            and hasattr(m, "variance_epsilon"))


_LIGER_NORM: list = []  # [Liger's RMSNorm autograd function or None], once imported

NORM_KERNELS = ("auto", "liger", "triton", "torch")
"""``$CP_ROPE_NORM_KERNEL``'s values: which fused RMSNorm runs on CUDA."""


def liger_rms_norm(device_type: str):
    """Liger-Kernel's ``LigerRMSNormFunction`` for tensors on ``device_type`` ("cuda" only),
    or None: another device, liger-kernel missing, or an import that fails (then PyTorch's
    kernel runs: the norm is the same function either way)."""
    if device_type != "cuda":
        return None
    if not _LIGER_NORM:
        try:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
            _LIGER_NORM.append(LigerRMSNormFunction)
        except Exception:  # noqa: BLE001 - missing or broken: PyTorch's fused kernel instead
            _LIGER_NORM.append(None)
    return _LIGER_NORM[0]


def norm_kernel(device_type: str) -> str:
    """Which fused RMSNorm runs on ``device_type`` (the log line names it): ``"liger"``,
    ``"triton"`` (cp_rope's, :func:`cp_rope.rms_norm.rms_norm`) or ``"torch"``.

    Off CUDA always ``"torch"``. On CUDA ``$CP_ROPE_NORM_KERNEL`` (one of
    :data:`NORM_KERNELS`) chooses; ``auto`` (the default) is Liger-Kernel's where it imports,
    else PyTorch's. cp_rope's kernel is opt-in (``triton``) until a training step has been timed
    with it (its backward kernel alone ran ~3x faster than Liger's on an H100: docs/benchmarks.md,
    round 15).

    Raises: ValueError naming ``CP_ROPE_NORM_KERNEL`` for another value, or for ``liger``
    where liger-kernel does not import.
    """
    choice = check_choice("CP_ROPE_NORM_KERNEL", os.environ.get("CP_ROPE_NORM_KERNEL", "auto"),
                          NORM_KERNELS)
    if device_type != "cuda":
        return "torch"
    liger = liger_rms_norm(device_type) is not None
    if choice == "auto":
        return "liger" if liger else "torch"
    if choice == "liger" and not liger:
        raise ValueError("CP_ROPE_NORM_KERNEL=liger: liger-kernel does not import here "
                         "(pip install 'cp-rope[liger]'), or use auto / triton / torch")
    return choice


def _fused_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The fused forward, bound to each norm (a bound method: ``copy.deepcopy`` of the model
    rebinds it to the copy, and ``weight`` is read at call time, as FSDP2 swaps it per forward)."""
    w = self.weight
    if hidden_states.dtype not in LOW_PRECISION or w.dtype != hidden_states.dtype:
        return type(self).forward(self, hidden_states)
    kernel = "torch" if torch.compiler.is_compiling() else norm_kernel(hidden_states.device.type)
    if kernel == "triton":
        return rms_norm(hidden_states, w, self.variance_epsilon, backend="triton")
    if kernel == "liger":
        # "llama" casting; in_place=False: dY (the residual stream's gradient too) is not
        # overwritten with dX
        return liger_rms_norm("cuda").apply(hidden_states, w, self.variance_epsilon, 0.0,
                                            "llama", False)
    return F.rms_norm(hidden_states, (hidden_states.shape[-1],), w, self.variance_epsilon)


def fuse_rms_norms(model: nn.Module, family_module) -> list[ForwardHandle]:
    """Run every RMSNorm of ``model`` defined in ``family_module`` (the family's modeling
    module, e.g. ``transformers.models.qwen3.modeling_qwen3``) with the fused kernel.

    The module keeps its class, parameter and state-dict names; its ``forward`` becomes
    an instance attribute (removed by the handle; fusing again replaces it).

    Returns: one handle per norm (``handle.remove()`` restores it); an empty list when the
    model has none (nothing to fuse is not an error: the family may name it otherwise).

    Raises: TypeError naming ``family_module`` when it is not a module; ValueError naming
    ``fused_norm`` when a norm already has another instance-level ``forward`` (a wrapper
    installed by something else, e.g. accelerate's hooks), which fusing would discard.
    """
    return install_forward(rms_norm_modules(model, family_module), _fused_forward, "fused_norm")


def rms_norm_modules(model: nn.Module, family_module) -> list[nn.Module]:
    """The RMSNorms of ``model`` whose class ``family_module`` defines.

    Raises: TypeError naming ``family_module`` when it is not a module.
    """
    if not isinstance(getattr(family_module, "__name__", None), str):
        raise TypeError(f"family_module must be a transformers modeling module, got "
                        f"{type(family_module).__name__}")
    return [m for m in model.modules() if _is_family_rms_norm(m, family_module)]
