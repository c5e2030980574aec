"""The batch's attention plan of a patched transformers model, built once per step.

:func:`attention_plan` builds it from this rank's *host* :class:`~cp_rope.parallel.PackedBatch`
(before the batch moves to the device: no device-to-host read) with the patch's heads,
group, method, backend, softmax scale and every layer's window and sinks; pass it to the
model with ``model(**model_inputs(batch, plan))`` (``cp_rope_plan``): the patched decoder
then uses it instead of building its own. Without one the decoder's pre-forward hook builds
it (:func:`build_plan`, the three-line recipe of :mod:`cp_rope.hf`).
"""

from __future__ import annotations

import torch

from cp_rope.parallel import attention_plan as _attention_plan
from cp_rope.parallel import check_plan
from cp_rope.validation import check_token_ids

__all__ = ["attention_plan", "build_plan", "check_rope_length", "check_passed_plan"]


def _patch_of(model):
    patch = getattr(model, "cp_rope_patch", None)
    if patch is None:
        raise ValueError("model: not patched by cp_rope.hf.patch_model (patch it first)")
    return patch


def build_plan(patch, source, max_seqlen: int | None = None, *, dtype: torch.dtype, device,
               n_tokens: int | None = None, calibration=None, _check=None):
    """:func:`cp_rope.parallel.attention_plan` for the layers of ``patch`` (a
    :class:`~cp_rope.hf.CPRopePatch`): its heads, group, method, backend, ``ulysses_size``,
    softmax scale, windows and sinks. ``source``: a PackedBatch, a DocumentPlacement or local
    zigzag cu_seqlens (with ``max_seqlen``); ``calibration``: as ``attention_plan``'s.
    Collective over the patch's group."""
    hq, hkv, d = patch.shape
    return _attention_plan(source, max_seqlen, q_heads=hq, kv_heads=hkv, head_dim=d,
                           dtype=dtype, device=device, group=patch.group, method=patch.method,
                           backend=patch.backend, ulysses_size=patch.ulysses_size,
                           softmax_scale=patch.scale, n_tokens=n_tokens,
                           window=list(patch.layers[0]), sinks=patch.layers[1],
                           calibration=calibration, _check=_check)


def attention_plan(model, batch, max_seqlen: int | None = None, *,
                   dtype: torch.dtype | None = None, device=None, n_tokens: int | None = None,
                   calibration=None):
    """The attention plan of this rank's host ``batch`` for the patched ``model`` (collective
    over the patch's group): pass it as ``model(**model_inputs(batch, plan))``.

    Args:
        model: a model :func:`~cp_rope.hf.patch_model` patched.
        batch: this rank's :class:`~cp_rope.parallel.PackedBatch` shard, on the host (or
            local zigzag cu_seqlens with ``max_seqlen``, or a DocumentPlacement).
        dtype: the compute dtype of q/k/v (default: the input embedding's weight dtype).
        device: where the forward runs (default: the input embedding's device).
        n_tokens: rows of ``input_ids`` (default: the batch's).
        calibration: the CP cost model's constants (a
            :class:`~cp_rope.parallel.calibrate.Calibration`; None: the shipped defaults), as
            :func:`cp_rope.parallel.attention_plan`'s.

    Raises: ValueError for an unpatched model; as :func:`cp_rope.parallel.attention_plan`
    (and ``input_ids`` outside the vocabulary, ``max_length_q`` past a length-dependent
    rope's static range), on every rank of the group.
    """
    patch = _patch_of(model)
    embed = model.get_input_embeddings()
    ids = getattr(batch, "input_ids", None)
    longest = getattr(batch, "max_seqlen", max_seqlen)

    def check():  # rank-local: inside the build's agreement
        if longest is not None:
            check_rope_length(patch, int(longest))
        if ids is not None:
            check_token_ids("input_ids", ids, embed.num_embeddings)

    return build_plan(patch, batch, max_seqlen, dtype=dtype or embed.weight.dtype,
                      device=embed.weight.device if device is None else device,
                      n_tokens=n_tokens, calibration=calibration, _check=check)


def check_rope_length(patch, max_len: int) -> None:
    """ValueError naming ``max_length_q`` when a global sequence of ``max_len * cp_size``
    tokens is past the static range of the model's length-dependent RoPE (rope_kernel=False
    with ``dynamic`` / ``longrope``)."""
    limit = patch._static_rope_len
    if limit is not None and max_len * patch.cp_size > limit:
        raise ValueError(
            f"max_length_q={max_len}: a global sequence of up to {max_len * patch.cp_size} "
            f"tokens is past {limit}, where the model's length-dependent RoPE "
            f"({patch.scaling['rope_type']}) would pick its frequencies from this rank's "
            "largest position (different on every rank, and across documents): not the "
            "per-document result; use a static rope type (e.g. 'ntk', 'yarn') or shorter "
            "documents")


def check_passed_plan(patch, plan, cu, max_len, n_rows, placement) -> None:
    """A ``cp_rope_plan`` handed to the patched decoder must be the plan of these rows, for
    this patch: TypeError / ValueError naming ``plan`` (host checks, no sync)."""
    check_plan(plan, plan.n_tokens if n_rows is None else n_rows, cp_rank=patch.cp_rank,
               cu_seqlens=cu)
    if int(max_len) != plan.max_seqlen:
        raise ValueError(f"plan: built for max_seqlen {plan.max_seqlen}, got max_length_q="
                         f"{int(max_len)} (a plan of another batch?)")
    if placement is not None and placement is not getattr(plan, "placement", None):
        raise ValueError("plan: built for another placement than cp_rope_placement (a plan of "
                         "another batch?)")
    if plan.group is not None and plan.group is not patch.group:
        raise ValueError("plan: built for another CP group than the model's patch")
    hq, hkv, d = patch.shape
    got = plan.shape if hasattr(plan, "shape") else plan.whole.shape
    if tuple(got) != (hq, hkv, d) or not set(patch.layers[0]) <= set(plan.windows) \
            or plan.sinks != patch.layers[1]:
        raise ValueError(f"plan: built for heads/head_dim {tuple(got)}, windows "
                         f"{list(plan.windows)}, sinks={plan.sinks}; this model's layers have "
                         f"{(hq, hkv, d)}, {list(dict.fromkeys(patch.layers[0]))}, "
                         f"sinks={patch.layers[1]} (build it with cp_rope.hf.attention_plan("
                         "model, batch))")
