"""Sequence-tiled MLPs for transformers models (``patch_model(..., mlp_tile_tokens=N)``).

Every decoder layer's ``mlp`` (Llama, Mistral, Qwen2, Qwen3: ``gate_proj`` /
``up_proj`` / ``down_proj``; Phi3: the fused ``gate_up_proj``) is position-wise,
so it can run over tiles of tokens inside one autograd node:
:func:`cp_rope.parallel.tiled_mlp` (ALST's TiledMLP, arXiv 2506.13996).
The module keeps its class, parameters and state-dict names; only its
``forward`` is wrapped (an instance attribute, removed by the handle).
"""

from __future__ import annotations

from torch import nn

from cp_rope.parallel._tiled_mlp import check_tile_tokens, tiled_mlp

from ._forward import ForwardHandle, install_forward

__all__ = ["tile_mlps", "mlp_modules", "check_tile_tokens"]


def _tiled_forward(self: nn.Module, x):
    """The tiled forward, bound to each MLP (a bound method: ``copy.deepcopy`` of the model
    rebinds it to the copy); the parameters are read per call (FSDP2 swaps in its unsharded
    ones per forward)."""
    return tiled_mlp(lambda t: type(self).forward(self, t), x, self.cp_rope_tile_tokens,
                     list(self.parameters()), dim=-2)


def tile_mlps(model: nn.Module, tile_tokens: int) -> list[ForwardHandle]:
    """Run the ``mlp`` of every decoder layer of ``model`` over tiles of ``tile_tokens`` tokens.

    Args:
        model: a transformers causal LM (or its base model) whose ``base_model.layers``
            are decoder layers with an ``mlp`` sub-module of input ``[B, T, hidden]``.
        tile_tokens: tokens per tile along ``T`` (>= 1).

    Returns: one handle per wrapped MLP (``handle.remove()`` restores it; tiling again
    replaces the tile size, never a tile of a tile).

    Raises: TypeError/ValueError naming ``mlp_tile_tokens``; ValueError when the model has
    no decoder layer with an ``mlp``, or when an ``mlp`` already has another instance-level
    ``forward`` (a wrapper installed by something else), which tiling would discard.
    """
    tile = check_tile_tokens(tile_tokens, "mlp_tile_tokens")
    return install_forward(mlp_modules(model), _tiled_forward, "mlp_tile_tokens",
                           cp_rope_tile_tokens=tile)


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
