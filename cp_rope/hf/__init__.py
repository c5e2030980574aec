"""Packed context parallelism for Hugging Face transformers models (extra ``hf``).

In a transformers ``Trainer`` / TRL ``SFTTrainer`` script, one call does it all
(:func:`cp_rope.hf.prepare`, :mod:`cp_rope.hf.trainer`; the ``trl`` extra)::

    trainer = SFTTrainer(model=model, args=SFTConfig(packing=True, ...), train_dataset=ds)
    trainer = cp_rope.hf.prepare(trainer, cp_size=C)
    trainer.train()

Without a Trainer, three calls turn a transformers causal LM (Llama, Mistral, Qwen2, Qwen3,
Phi3 with its partial rotary, and the mixtures of experts Qwen3-MoE and Mixtral, whose
router loss :mod:`cp_rope.hf.moe` computes over the CP group; GQA included) into a
packed, context-parallel one::

    from cp_rope.hf import model_inputs, patch_model
    from cp_rope.parallel import PackingCollator, cp_cross_entropy

    model = patch_model(model, group=cp_group, method="ring")       # once
    batch = PackingCollator(cp_size=C, cp_rank=r)(examples)          # this rank's zigzag shard
    logits = model(**model_inputs(batch)).logits[0]                  # [T_local, V]
    loss = cp_cross_entropy(logits, batch.labels, dp_cp_group)       # never labels=...
    loss.backward()                                                  # then SUM grads over dp x cp

* The attention implementation ``"cp_rope"`` (registered in transformers'
  ``AttentionInterface`` when this module is imported) runs
  :func:`cp_rope.parallel.context_parallel_attention` on the packed rows of
  the ``[1, T]`` batch: causal inside every document, exact across the CP
  ranks, with the group, method, backend and ``ulysses_size`` of the model's patch.
* ``rope_kernel=True`` swaps the family's ``apply_rotary_pos_emb`` for a
  dispatcher that runs cp_rope's THD kernel (q and k in one launch, the CP
  position formula in-kernel, float64-exact cos/sin tables from
  :func:`cp_rope.rope_cache` and the config's rope dict). It acts only on the
  calls of patched models (their rotary embedding hands it a
  :class:`PackedRope`); every other model of the family runs the original.
  Its result equals the model's own RoPE at the zigzag global positions (the
  patch checks the model's ``inv_freq`` and ``attention_scaling`` against
  cp_rope's tables and refuses what it cannot reproduce, e.g. ``dynamic``).
  With ``rope_kernel=False`` the model's own rotary embedding runs on the
  global ``position_ids``, which is right too.
* Labels: a :class:`~cp_rope.parallel.PackedBatch`'s labels are already the
  next token inside each document (shifted on the global batch, before
  sharding). transformers' loss would shift them again, and average per rank
  only: a patched model refuses ``labels=``; compute the loss with
  :func:`cp_rope.parallel.cp_cross_entropy` on the logits.

transformers is imported in :mod:`cp_rope.hf._compat` only (the one compat
door): ``import cp_rope.hf`` raises ImportError naming the fix when it is
missing or older than ``MIN_TRANSFORMERS``. :mod:`cp_rope.hf.patch` holds the
patch, the attention implementation, the RoPE dispatcher and ``model_inputs``;
:mod:`cp_rope.hf.loading` the local-only loading.
"""

from __future__ import annotations

import importlib

from ._compat import MIN_TRANSFORMERS, SUPPORTED_FAMILIES, transformers
from .loading import load_causal_lm, local_config
from .patch import (
    ATTN_IMPLEMENTATION,
    CPRopePatch,
    PackedRope,
    cp_rope_attention,
    model_inputs,
    patch_model,
    unpatch_model,
)
from .plan import attention_plan

_LAZY = {"prepare": "trainer"}  # transformers' Trainer and accelerate load on first use


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


__all__ = ["prepare", "attention_plan", "patch_model", "unpatch_model", "model_inputs", "local_config", "load_causal_lm",
           "cp_rope_attention", "PackedRope", "CPRopePatch", "SUPPORTED_FAMILIES",
           "ATTN_IMPLEMENTATION", "MIN_TRANSFORMERS", "transformers"]
