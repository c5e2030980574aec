"""The model side of :func:`cp_rope.hf.prepare`: a forward that returns the CP loss.

The Trainer calls the model through its DDP / FSDP wrapper, which must see the forward (DDP
prepares its gradient reduction there; FSDP2 unshards the LM head's weight only inside it),
so the loss is computed inside the model's own forward: :func:`install_loss_forward` binds
a forward to the model instance (as TRL's fused LM head does) that, called with
``cp_rope_labels=``, runs the base model to the final hidden states ``[T_local, d]`` and
returns the loss over the whole world; without it, the forward it replaced runs unchanged.
"""

from __future__ import annotations

import dataclasses
import types

import torch

from cp_rope.parallel import cp_cross_entropy, cp_linear_cross_entropy

from ._compat import transformers

__all__ = ["install_loss_forward", "scale_grad", "LossSettings"]

_Output = transformers.modeling_outputs.CausalLMOutputWithPast


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """How the loss forward computes the loss (``model.cp_rope_loss``)."""

    fused: bool = True
    """cp_linear_cross_entropy on the hidden states (else the logits, then cp_cross_entropy)."""
    chunk_size: int | None = None
    """Tokens per chunk of the fused loss (None: automatic)."""
    impl: str = "auto"
    """The fused loss's kernel (cp_rope.parallel.choices.LOSS_IMPLS)."""


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``factor``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` unchanged, its gradient multiplied by ``factor`` (a float)."""
    return _ScaleGrad.apply(x, factor)


def _loss_forward(self, *args, cp_rope_labels=None, **kwargs):
    """``cp_rope_labels`` int64 ``[T_local]`` (already shifted) with :func:`model_inputs`
    keywords -> ``CausalLMOutputWithPast(loss=...)``, the world's token mean of the
    micro-batch (its gradient this rank's share: sum over the world); else the old forward."""
    if cp_rope_labels is None:
        return self.cp_rope_forward_before(*args, **kwargs)
    settings = self.cp_rope_loss
    hidden = self.base_model(*args, **kwargs).last_hidden_state[0]
    head = self.get_output_embeddings()
    softcap = getattr(self.config, "final_logit_softcapping", None)
    if settings.fused and getattr(head, "bias", None) is None:
        loss = cp_linear_cross_entropy(hidden, head.weight, cp_rope_labels, None,
                                       chunk_size=settings.chunk_size, softcap=softcap,
                                       impl=settings.impl)
    else:
        logits = head(hidden)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        loss = cp_cross_entropy(logits, cp_rope_labels, None)
    return _Output(loss=loss)


def install_loss_forward(model, *, fused: bool = True, chunk_size: int | None = None,
                         impl: str = "auto") -> None:
    """Bind :func:`_loss_forward` as ``model.forward`` (over the forward it had, kept as
    ``model.cp_rope_forward_before``: TRL's fused-head forward, or the class's own)."""
    before = model.__dict__.get("forward")
    if getattr(before, "__func__", None) is _loss_forward:
        before = model.cp_rope_forward_before
    model.cp_rope_forward_before = before if before is not None else types.MethodType(
        type(model).forward, model)
    model.cp_rope_loss = LossSettings(fused=fused, chunk_size=chunk_size, impl=impl)
    model.forward = types.MethodType(_loss_forward, model)
