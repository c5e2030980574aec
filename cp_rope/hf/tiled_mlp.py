"""Sequence-tiled and fused-SwiGLU MLPs for transformers models (``patch_model(...,
mlp_tile_tokens=N, fused_swiglu=True)``).

Every decoder layer's ``mlp`` (Llama, Mistral, Qwen2, Qwen3: ``gate_proj`` /
``up_proj`` / ``down_proj``; Phi3: the fused ``gate_up_proj``) is position-wise,
so it can run over tiles of tokens inside one autograd node:
:func:`cp_rope.parallel.tiled_mlp` (ALST's TiledMLP, arXiv 2506.13996).
An MLP of the form ``down_proj(silu(gate_proj(x)) * up_proj(x))`` (:func:`swiglu_mlps`)
can also run its product through :func:`cp_rope.swiglu.swiglu` (one fused kernel each
way, ``gate`` and ``up`` kept instead of three tensors), tiled or not.
The module keeps its class, parameters and state-dict names; only its
``forward`` is wrapped (an instance attribute, removed by the handle).
"""

from __future__ import annotations

from torch import nn

from cp_rope.parallel._tiled_mlp import check_tile_tokens, tiled_mlp
from cp_rope.swiglu import swiglu

from ._forward import ForwardHandle, install_forward

__all__ = ["tile_mlps", "fuse_mlps", "mlp_modules", "swiglu_mlps", "check_tile_tokens"]


def _swiglu_forward(self: nn.Module, x):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the fused product, bound to each
    MLP :func:`swiglu_mlps` accepts (the family's own forward computes the same)."""
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _tiled_forward(self: nn.Module, x):
    """The tiled forward, bound to each MLP (a bound method: ``copy.deepcopy`` of the model
    rebinds it to the copy); the parameters are read per call (FSDP2 swaps in its unsharded
    ones per forward). Each tile runs the fused SwiGLU forward where it was asked for and the
    MLP has that form (``cp_rope_swiglu``), else the family's own."""
    body = _swiglu_forward if self.cp_rope_swiglu else type(self).forward
    return tiled_mlp(lambda t: body(self, t), x, self.cp_rope_tile_tokens,
                     list(self.parameters()), dim=-2)


def tile_mlps(model: nn.Module, tile_tokens: int, *, swiglu: bool = False
              ) -> list[ForwardHandle]:
    """Run the ``mlp`` of every decoder layer of ``model`` over tiles of ``tile_tokens`` tokens.

    Args:
        model: a transformers causal LM (or its base model) whose ``base_model.layers``
            are decoder layers with an ``mlp`` sub-module of input ``[B, T, hidden]``.
        tile_tokens: tokens per tile along ``T`` (>= 1).
        swiglu: the tiles of the MLPs that :func:`swiglu_mlps` accepts run the fused
            SwiGLU product (the others their own forward).

    Returns: one handle per wrapped MLP (``handle.remove()`` restores it; tiling again
    replaces the tile size, never a tile of a tile).

    Raises: TypeError/ValueError naming ``mlp_tile_tokens``; ValueError when the model has
    no decoder layer with an ``mlp``, or when an ``mlp`` already has another instance-level
    ``forward`` (a wrapper installed by something else), which tiling would discard.
    """
    tile = check_tile_tokens(tile_tokens, "mlp_tile_tokens")
    handles = install_forward(mlp_modules(model), _tiled_forward, "mlp_tile_tokens",
                              cp_rope_tile_tokens=tile, cp_rope_swiglu=False)
    for m in swiglu_mlps(model) if swiglu else ():
        m.cp_rope_swiglu = True
    return handles


def fuse_mlps(model: nn.Module) -> list[ForwardHandle]:
    """Run the SwiGLU product of every MLP :func:`swiglu_mlps` accepts through the fused
    kernel (:func:`cp_rope.swiglu.swiglu`), untiled.

    Returns: one handle per MLP (an empty list when none has that form: not an error).

    Raises: ValueError naming ``fused_swiglu`` when one already has another instance-level
    ``forward`` (e.g. the tiled one: :func:`tile_mlps` takes ``swiglu=True`` instead).
    """
    return install_forward(swiglu_mlps(model), _swiglu_forward, "fused_swiglu")


def _silu_classes() -> tuple[type, ...]:
    """The activation modules that are SiLU itself: ``nn.SiLU`` and transformers'
    ``SiLUActivation`` (what ``ACT2FN["silu"]`` gives, by version)."""
    from transformers import activations

    own = getattr(activations, "SiLUActivation", None)
    return (nn.SiLU,) if own is None else (nn.SiLU, own)


def _is_swiglu(m: nn.Module) -> bool:
    """Whether ``m`` has Linear ``gate_proj`` / ``up_proj`` / ``down_proj`` and an ``act_fn``
    that is SiLU itself (by class, parameter-free: a learnable or clamped look-alike keeps its
    own forward) and is no mixture-of-experts block."""
    if not all(isinstance(getattr(m, n, None), nn.Linear) for n in ("gate_proj", "up_proj",
                                                                      "down_proj")):
        return False
    act = getattr(m, "act_fn", None)
    return (type(act) in _silu_classes() and not any(True for _ in act.parameters())
            and not isinstance(getattr(m, "experts", None), nn.Module))


def swiglu_mlps(model: nn.Module) -> list[nn.Module]:
    """The decoder layers' MLPs of the form ``down_proj(silu(gate_proj(x)) * up_proj(x))``:
    Linear ``gate_proj`` / ``up_proj`` / ``down_proj`` and a SiLU ``act_fn`` (Llama, Mistral,
    Qwen2, Qwen3 with ``hidden_act`` silu). Gemma's GELU, Phi3's fused ``gate_up_proj`` and
    mixture-of-experts blocks keep their own forward."""
    layers = getattr(getattr(model, "base_model", model), "layers", None) or []
    return [layer.mlp for layer in layers
            if isinstance(getattr(layer, "mlp", None), nn.Module) and _is_swiglu(layer.mlp)]


def mlp_modules(model: nn.Module) -> list[nn.Module]:
    """The ``mlp`` of every decoder layer (``base_model.layers[i].mlp``) of ``model``.

    Raises: ValueError naming ``mlp_tile_tokens`` when there is none, or when one is a
    mixture-of-experts block (it has ``experts``; refused, see below).

    A mixture-of-experts block is position-wise too, but its router's logits are recorded
    by transformers inside the block for the load-balancing loss, which differentiates
    them: the tiles' forward runs without autograd, so that loss would lose its gradient
    (and the experts' token sets, which the tile splits, are decided by the router anyway).
    """
    layers = getattr(getattr(model, "base_model", model), "layers", None) or []
    mlps = [layer.mlp for layer in layers if isinstance(getattr(layer, "mlp", None), nn.Module)]
    if not mlps:
        raise ValueError("mlp_tile_tokens: the model has no decoder layers with an mlp "
                         "(base_model.layers[i].mlp) to tile")
    moe = [type(m).__name__ for m in mlps if isinstance(getattr(m, "experts", None), nn.Module)]
    if moe:
        raise ValueError(f"mlp_tile_tokens: {moe[0]} is a mixture-of-experts block: its router "
                         "logits (which the load-balancing loss differentiates) are recorded "
                         "inside the block, and a tile's forward runs without autograd, so "
                         "tiling would drop that loss's gradient; leave mlp_tile_tokens off "
                         "for mixture-of-experts models")
    return mlps
