"""Fused RMSNorm for transformers models (``patch_model(..., fused_norm=True)``).

The supported families' RMSNorm (``LlamaRMSNorm``, ``Qwen3RMSNorm``, ...) computes in
float32 with separate operators: for a bf16 input ``[T, d]`` autograd keeps a float32
copy of it, the normalised float32 rows and a bf16 copy of them, 5 bytes per element
more than the input itself. Qwen3's per-head ``q_norm`` / ``k_norm`` run on the whole
``[T, H, head_dim]`` projections, so at 262,144 tokens these copies are ~10 GiB per layer
(what sets the peak of a checkpointed layer's recomputation). :func:`fuse_rms_norms`
replaces each norm's forward by :func:`torch.nn.functional.rms_norm`, PyTorch's fused
kernel on CUDA (one pass, float32 accumulation; autograd keeps the input and the
per-row ``rstd`` only).

Numerics: ``y = x * rsqrt(mean(x^2) + eps) * w`` computed in float32 and rounded once
to the input dtype; transformers rounds ``x * rsqrt(...)`` to the input dtype before
multiplying by ``w`` (a second rounding). The fused form is applied only where both
are bf16/fp16 (the training case); float32 / float64 inputs (and a weight of another
dtype than the input) run the model's own forward, bit for bit as unpatched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["fuse_rms_norms", "FusedNormHandle", "LOW_PRECISION"]

LOW_PRECISION = (torch.bfloat16, torch.float16)
"""Input dtypes the fused norm runs for; others keep the model's own forward."""


class FusedNormHandle:
    """Undoes one module's fused forward (``remove()``, as a hook handle)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


def _is_family_rms_norm(m: nn.Module, family_module) -> bool:
    cls = type(m)
    return (cls.__name__.endswith("RMSNorm") and cls.__module__ == family_module.__name__
            and isinstance(getattr(m, "weight", None), torch.Tensor)
            and hasattr(m, "variance_epsilon"))


def fuse_rms_norms(model: nn.Module, family_module) -> list[FusedNormHandle]:
    """Run every RMSNorm of ``model`` defined in ``family_module`` (the family's modeling
    module, e.g. ``transformers.models.qwen3.modeling_qwen3``) with the fused kernel.

    The module keeps its class, parameter and state-dict names; its ``forward`` becomes
    an instance attribute (removed by the handle) that reads ``weight`` at call time
    (FSDP2 registers its unsharded parameter per forward).

    Returns: one handle per norm (``handle.remove()`` restores it); an empty list when the
    model has none (nothing to fuse is not an error: the family may name it otherwise).
    """
    handles = []
    for m in model.modules():
        if not _is_family_rms_norm(m, family_module):
            continue
        FusedNormHandle(m).remove()  # fused once
        original = m.forward

        def forward(x, _m=m, _original=original):
            w = _m.weight
            if x.dtype not in LOW_PRECISION or w.dtype != x.dtype:
                return _original(x)
            return F.rms_norm(x, (x.shape[-1],), w, _m.variance_epsilon)

        m.forward = forward
        handles.append(FusedNormHandle(m))
    return handles
