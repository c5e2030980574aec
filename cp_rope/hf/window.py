"""The per-layer attention arguments of sliding-window and sink models under ``cp_rope.hf``.

A model's attention modules say what each layer needs; :func:`layer_windows` collects it
once at :func:`~cp_rope.hf.patch_model`, the batch's plan is built for every window
(``attention_plan(..., window=[...], sinks=...)``), and each layer's call picks its own
(``plan.for_window(sliding_window)``, ``sinks=s_aux``) in
:func:`~cp_rope.hf.patch.cp_rope_attention`. Sources, as transformers 5 passes them to an
attention function:

* the window: ``sliding_window=`` (transformers' ``W``: ``kv_idx > q_idx - W``), from the
  module's ``sliding_window`` (Qwen2: ``config.sliding_window`` on the
  ``"sliding_attention"`` layers of ``config.layer_types``, None on the others, so
  ``use_sliding_window`` / ``max_window_layers`` are honoured; Gemma 2/3 likewise) or the
  config's (Mistral: every layer);
* the sinks: ``s_aux=`` (GPT-OSS: the module's ``sinks`` parameter ``[Hq]``).
"""

from __future__ import annotations

import torch

__all__ = ["layer_windows", "CONFIG_WINDOW_FAMILIES"]

CONFIG_WINDOW_FAMILIES = ("mistral", "phi3", "mixtral")
"""Families whose attention reads ``config.sliding_window`` itself (no module attribute)."""


def layer_windows(attns, config) -> tuple[tuple[int | None, ...], bool]:
    """``(windows, sinks)`` of the attention modules ``attns``: every layer's sliding window
    in order (None: a full-attention layer; the plan serves the distinct ones, ``method=
    "auto"`` weighs them by their layers), and whether the layers carry sink logits (a
    tensor attribute ``sinks``)."""
    # config.sliding_window reaches the attention of the families that read it there
    # (Mistral, Phi-3, Mixtral: ``getattr(self.config, "sliding_window", None)``); the others
    # keep their own on the module (None on full layers), and Llama has none: a Llama
    # config.json with the key runs full attention in transformers, so here too
    reads_config = getattr(config, "model_type", None) in CONFIG_WINDOW_FAMILIES
    default = getattr(config, "sliding_window", None) if reads_config else None
    windows = tuple(getattr(m, "sliding_window", default) for m in attns)
    return windows, any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in attns)
