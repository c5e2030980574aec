"""What :func:`~cp_rope.hf.patch_model` checks of a family's features before it patches.

The families and what cp_rope does with each feature (docs/hf.md has the table):

* GPT-OSS (``gpt_oss``): sliding (``config.sliding_window``, 128) and full layers from
  ``config.layer_types``, per-head learned sinks (the attention's ``sinks`` ``[Hq]``, passed as
  ``s_aux``), YaRN RoPE (``truncate`` honoured), a mixture of experts whose router loss
  :mod:`cp_rope.hf.moe` computes over the CP group. All run.
* Gemma 2 (``gemma2``): local / global layers, the query pre-scaling
  (``scaling = query_pre_attn_scalar ** -0.5``, handed to the CP attention as its softmax
  scale), sandwich norms and the scaled embedding (inside the model: unchanged), the
  final-logit soft-cap (``final_logit_softcapping``: the model applies it to its logits;
  :func:`cp_rope.parallel.cp_linear_cross_entropy` / ``cp_cross_entropy`` take ``softcap=``).
  The attention-logit soft-cap (``attn_logit_softcapping``, ``cap * tanh(s / cap)`` on the
  scores before the softmax) is **refused**: cp_rope's CP attention (every method, every
  backend: the fused flash / cuDNN / FA4 kernels it calls have no such term) computes
  ``softmax(s)``, and running without it would be another model.
* Gemma 3 text (``gemma3_text``): as Gemma 2 without the soft-caps by default, plus q/k norms
  (inside the model) and one RoPE base per layer type (``rope_parameters`` keyed by layer
  type: :mod:`cp_rope.hf.rope` keeps one table per type). ``use_bidirectional_attention``
  (EmbeddingGemma-style) is refused: CP attention is causal. The multimodal ``gemma3`` model
  is not patched (its text tower sits inside a vision-language wrapper).
"""

from __future__ import annotations

from .rope import rope_dicts

__all__ = ["check_family", "check_config", "check_sliding_window", "LAYER_TYPES"]

LAYER_TYPES = ("full_attention", "sliding_attention")
"""The ``config.layer_types`` values cp_rope runs (the others' attention it has not checked)."""


def check_sliding_window(cfg) -> None:
    """ValueError naming ``config.sliding_window`` unless it is null or an int >= 1 (tokens:
    transformers' W; a family that does not use it stores null, e.g. Qwen2 without
    ``use_sliding_window``)."""
    window = getattr(cfg, "sliding_window", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"config.sliding_window={window!r}: must be an int >= 1 (the window "
                         "in tokens) or null (no sliding window)")


def check_family(model, attns) -> None:
    """ValueError naming the config field of a feature of ``model`` that cp_rope cannot
    honour, or whose per-layer lists are inconsistent; ``attns`` its attention modules:
    :func:`check_config`'s refusals, and sinks on some layers only."""
    check_config(model.config)
    has_sinks = [getattr(m, "sinks", None) is not None for m in attns]
    if any(has_sinks) and not all(has_sinks):
        raise ValueError(f"sinks: {sum(has_sinks)} of {len(attns)} attention layers carry sink "
                         "logits; cp_rope plans one sinks setting for every layer")


def check_config(cfg) -> None:
    """ValueError naming the field of a transformers config ``cfg`` that cp_rope cannot
    honour, before any model is built (the trainers' and the planner's ``--model`` check).

    Refused: a ``sliding_window`` that is not null or an int >= 1 (:func:`check_sliding_window`),
    ``attn_logit_softcapping`` (not None), ``use_bidirectional_attention``, a
    ``layer_types`` of another length than ``num_hidden_layers`` or with a type other than
    :data:`LAYER_TYPES`, a ``"sliding_attention"`` layer without a positive
    ``sliding_window``, a length-dependent RoPE
    (``dynamic`` / ``longrope``) in a per-layer-type ``rope_parameters``.
    """
    check_sliding_window(cfg)
    cap = getattr(cfg, "attn_logit_softcapping", None)
    if cap is not None:
        raise ValueError(
            f"config.attn_logit_softcapping={cap}: cp_rope's CP attention has no attention-logit "
            "soft-capping (cap * tanh(scores / cap) before the softmax; the fused flash / cuDNN "
            "/ FA4 kernels it runs cannot apply it), and running without it would be another "
            "model: set config.attn_logit_softcapping = None only if that is what you mean to "
            "train (Gemma 2 checkpoints were trained with it), or leave the model unpatched")
    if getattr(cfg, "use_bidirectional_attention", None):
        raise ValueError("config.use_bidirectional_attention=True: cp_rope's CP attention is "
                         "causal inside each document; a bidirectional model is not supported")
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        n = getattr(cfg, "num_hidden_layers", None)
        if n is not None and len(types) != n:
            raise ValueError(f"config.layer_types has {len(types)} entries for "
                             f"num_hidden_layers={n}: one per layer")
        odd = sorted(set(types) - set(LAYER_TYPES))
        if odd:
            raise ValueError(f"config.layer_types: {odd[0]!r} is not a layer type cp_rope runs "
                             f"({', '.join(LAYER_TYPES)})")
        window = getattr(cfg, "sliding_window", None)
        if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
            raise ValueError(f"config.sliding_window={window!r}: config.layer_types has "
                             "'sliding_attention' layers, which need a window of >= 1 tokens")
    dicts = rope_dicts(cfg)
    if None not in dicts:
        for key, d in dicts.items():
            if d.get("rope_type") in ("dynamic", "longrope"):
                raise ValueError(
                    f"config.rope_parameters[{key!r}]: rope_type {d['rope_type']!r} picks its "
                    "frequencies from the largest position of each rank's shard, not from each "
                    "document: use a static rope type (default, linear, yarn, llama3)")
