"""Sequence-tiled MLPs for transformers models (``patch_model(..., mlp_tile_tokens=N)``).

Every decoder layer's ``mlp`` (Llama, Mistral, Qwen2, Qwen3: ``gate_proj`` /
``up_proj`` / ``down_proj``; Phi3: the fused ``gate_up_proj``) is position-wise,
so it can run over tiles of tokens inside one autograd node:
:func:`cp_rope.parallel.tiled_mlp` (ALST's TiledMLP, arXiv 2506.13996).
The module keeps its class, parameters and state-dict names; only its
``forward`` is wrapped (an instance attribute, removed by the handle).
"""

from __future__ import annotations

import types

from torch import nn

from cp_rope.parallel._tiled_mlp import check_tile_tokens, tiled_mlp

__all__ = ["tile_mlps", "TiledMLPHandle", "check_tile_tokens"]


class TiledMLPHandle:
    """Undoes one module's tiling (``remove()``, as a hook handle)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def remove(self) -> None:
        forward = self.module.__dict__.get("forward")
        if getattr(forward, "__func__", None) is _tiled_forward:
            del self.module.__dict__["forward"]
            self.module.__dict__.pop("cp_rope_tile_tokens", None)


def _tiled_forward(self: nn.Module, x):
    """The tiled forward, bound to each MLP (a bound method: ``copy.deepcopy`` of the model
    rebinds it to the copy); the parameters are read per call (FSDP2 swaps in its unsharded
    ones per forward)."""
    return tiled_mlp(lambda t: type(self).forward(self, t), x, self.cp_rope_tile_tokens,
                     list(self.parameters()), dim=-2)


def tile_mlps(model: nn.Module, tile_tokens: int) -> list[TiledMLPHandle]:
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
    layers = getattr(getattr(model, "base_model", model), "layers", None) or []
    mlps = [layer.mlp for layer in layers if isinstance(getattr(layer, "mlp", None), nn.Module)]
    if not mlps:
        raise ValueError("mlp_tile_tokens: the model has no decoder layers with an mlp "
                         "(base_model.layers[i].mlp) to tile")
    for mlp in mlps:
        own = mlp.__dict__.get("forward")
        if own is not None and getattr(own, "__func__", None) is not _tiled_forward:
            raise ValueError(f"mlp_tile_tokens: {type(mlp).__name__} already has its own "
                             f"forward wrapper ({own!r}); tiling would discard it")
    for mlp in mlps:
        mlp.cp_rope_tile_tokens = tile
        mlp.forward = types.MethodType(_tiled_forward, mlp)
    return [TiledMLPHandle(mlp) for mlp in mlps]
