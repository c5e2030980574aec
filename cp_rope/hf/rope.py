"""cp_rope's RoPE kernel inside a patched transformers model (``patch_model(rope_kernel=True)``).

The family's ``apply_rotary_pos_emb`` is swapped for a dispatcher (:func:`install_rope_dispatcher`)
that runs :func:`cp_rope.ops.apply_rotary_emb_qk` when it is handed a :class:`PackedRope` (what a
patched model's rotary embedding returns, :func:`packed_rope`), and the original otherwise.
:func:`check_rope` checks that cp_rope's tables reproduce the model's own RoPE first.

Rope dicts: one flat dict (``config.rope_parameters = {"rope_type": ..., "rope_theta": ...}``,
every family but Gemma 3), or one per layer type (Gemma 3:
``{"sliding_attention": {...}, "full_attention": {...}}``, its local and global bases; the rotary
embedding is called once per layer type with ``layer_type`` and keeps
``{layer_type}_inv_freq`` / ``{layer_type}_attention_scaling``). The patch keeps the dicts by key
(``None`` for the flat one) and builds one float32 table pair per key.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cp_rope.cache import inv_freq as _cp_inv_freq
from cp_rope.ops import apply_rotary_emb_qk

__all__ = ["PackedRope", "check_rope", "check_rope_dtype", "install_rope_dispatcher", "packed_rope",
           "rope_dicts"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""What cp_rope's RoPE kernel rotates (:func:`cp_rope.ops.apply_rotary_emb_qk`)."""


def check_rope_dtype(dtype: torch.dtype) -> None:
    """ValueError naming ``rope_kernel`` unless the kernel runs ``dtype`` (the model's)."""
    if dtype not in _KERNEL_DTYPES:
        raise ValueError(f"rope_kernel=True: cp_rope's RoPE kernel runs float32, float16 and "
                         f"bfloat16; this model is {dtype}: pass rope_kernel=False (the model's "
                         "own rotation runs any dtype)")

_HINT = "; pass rope_kernel=False to keep the model's own rotary embedding"


class PackedRope:
    """Stands in for ``(cos, sin)`` inside a patched model: the family's swapped
    ``apply_rotary_pos_emb`` applies cp_rope's kernel with it.

    Fields: float32 tables ``[P, rotary_dim // 2]`` and ``rope_args``, the batch's plan's
    :meth:`~cp_rope.parallel.CPAttentionPlan.rope_args` (local ``cu_seqlens``, per-token
    global ``position_ids``, ``max_position_id``: built once per batch).
    Deliberately not a dataclass: FSDP2's mixed precision casts the floating
    tensors inside dataclass arguments to bf16, and the tables must stay float32.
    """

    __slots__ = ("cos", "sin", "rope_args")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, rope_args: dict) -> None:
        self.cos, self.sin, self.rope_args = cos, sin, rope_args

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[1, Hq, T, D]``, k ``[1, Hkv, T, D]`` (transformers' layout) -> the same, rotated."""
        if q.dim() != 4 or q.shape[0] != 1:
            raise ValueError(f"q: a patched model runs packed rows [1, H, T, D]; got {tuple(q.shape)}")
        out_q, out_k = apply_rotary_emb_qk(
            q[0].transpose(0, 1), k[0].transpose(0, 1), self.cos, self.sin, **self.rope_args)
        return out_q.transpose(0, 1).unsqueeze(0), out_k.transpose(0, 1).unsqueeze(0)


def _rope_dispatcher(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, *args, **kwargs):
        if isinstance(cos, PackedRope):
            if unsqueeze_dim != 1 or args or kwargs:
                raise ValueError("cp_rope.hf's RoPE kernel expects transformers' [B, H, T, D] "
                                 f"q/k (unsqueeze_dim=1); got unsqueeze_dim={unsqueeze_dim}")
            return cos.apply(q, k)
        return original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)

    apply_rotary_pos_emb.cp_rope_original = original
    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


def install_rope_dispatcher(module) -> None:
    """Swap ``module.apply_rotary_pos_emb`` (a family's modeling module) for the dispatcher, once."""
    if not hasattr(module.apply_rotary_pos_emb, "cp_rope_original"):
        module.apply_rotary_pos_emb = _rope_dispatcher(module.apply_rotary_pos_emb)


def rope_dicts(config) -> dict[str | None, dict]:
    """The config's rope dicts by key: ``{None: dict}`` for a flat ``rope_parameters``,
    ``{layer_type: dict}`` for one per layer type (Gemma 3); ``{}`` when it has neither."""
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict):
        return {}
    if "rope_theta" in rope or "rope_type" in rope:
        return {None: rope}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return dict(rope)
    return {}


def _their_rope(rotary: nn.Module, key: str | None) -> tuple[torch.Tensor, float, str]:
    prefix = "" if key is None else f"{key}_"
    inv = getattr(rotary, f"{prefix}inv_freq", None)
    if not isinstance(inv, torch.Tensor):
        raise ValueError(f"rope_kernel=True: {type(rotary).__name__} has no {prefix}inv_freq "
                         f"buffer for the rope dict {key!r}{_HINT}")
    return inv, float(getattr(rotary, f"{prefix}attention_scaling", 1.0)), f"{prefix}inv_freq"


def check_rope(rotary: nn.Module, config) -> tuple[dict, int]:
    """The rope dicts by key (:func:`rope_dicts`) and ``rotary_dim``, once it is checked that
    cp_rope's tables reproduce the model's RoPE for every one of them.

    Raises: ValueError naming ``config.rope_parameters`` when it is neither one flat rope dict
    nor one per layer type, when cp_rope cannot build a dict (``dynamic``, ``longrope``) or does
    not reproduce the model's ``inv_freq`` / ``attention_scaling``; naming the model's
    ``inv_freq`` when it was cast to a low dtype after it was built.
    """
    dicts = rope_dicts(config)
    if not dicts or not all("rope_theta" in d for d in dicts.values()):
        raise ValueError(f"rope_kernel=True: config.rope_parameters "
                         f"{getattr(config, 'rope_parameters', None)!r} is neither one flat rope "
                         f"dict nor one per layer type, each with its rope_theta{_HINT}")
    rotary_dim = None
    for key, scaling in dicts.items():
        theirs, their_scale, what = _their_rope(rotary, key)
        dim = 2 * theirs.numel()
        if rotary_dim not in (None, dim):
            raise ValueError(f"rope_kernel=True: {type(rotary).__name__}.{what} rotates {dim} "
                             f"dims, another layer type {rotary_dim}{_HINT}")
        rotary_dim = dim
        _check_one(rotary, theirs, their_scale, what, dict(scaling), dim)
    return {k: dict(v) for k, v in dicts.items()}, rotary_dim


def _check_one(rotary, theirs, their_scale, what, scaling, rotary_dim) -> None:
    try:
        ours, scale = _cp_inv_freq(rotary_dim, scaling=scaling)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"rope_kernel=True: {exc}{_HINT}") from exc
    if theirs.is_meta:  # not materialised yet (meta-device init): nothing to compare
        return
    if theirs.dtype not in (torch.float32, torch.float64):
        # model.to(torch.bfloat16) / .half() casts the inv_freq buffer too: the model's own
        # RoPE then rotates by frequencies rounded to that dtype, which cp_rope's exact
        # tables do not reproduce (nor should: the rounding grows with the position).
        rounded = torch.equal(ours.to(theirs.dtype), theirs.detach().cpu())
        raise ValueError(
            f"rope_kernel=True: the model's {type(rotary).__name__}.{what} is {theirs.dtype}"
            + (", its config's frequencies rounded to that dtype" if rounded else "")
            + ": the model was cast (model.to(dtype) / .half() / .bfloat16()) after it was "
            "built, so its own RoPE rotates by rounded frequencies (relative error up to "
            f"{torch.finfo(theirs.dtype).eps / 2:.1e}, i.e. angles off by that times the "
            "position) and cp_rope's exact float64-derived tables would not reproduce it. "
            "Load the model in the low dtype instead (from_pretrained(..., dtype=...) and "
            "from_config keep inv_freq in float32), or call patch_model before casting"
            f"{_HINT}")
    # transformers' inv_freq is float32: off by up to eps32 * ln(base) relative (pow)
    rtol = 4 * torch.finfo(torch.float32).eps * (1 + math.log(float(scaling["rope_theta"])))
    if (not torch.allclose(ours, theirs.detach().double().cpu(), rtol=rtol, atol=0.0)
            or abs(scale - their_scale) > 1e-6 * abs(their_scale)):
        raise ValueError(f"rope_kernel=True: cp_rope.rope_cache does not reproduce this model's "
                         f"RoPE (rope dict {scaling}){_HINT}")


def packed_rope(patch, args, kwargs, out):
    """The patched rotary embedding's forward hook (``with_kwargs=True``): ``(rope, rope)``,
    a :class:`PackedRope` of the batch's plan and the tables of the call's rope dict (Gemma 3
    passes ``layer_type`` as the third argument); ``out`` unchanged outside a patched forward."""
    plan = patch._current
    if plan is None:  # called outside the model's forward: leave it alone
        return out
    check_rope_dtype(out[0].dtype)  # the model's dtype (cast after patch_model)
    key = args[2] if len(args) > 2 else kwargs.get("layer_type")
    rope_args = plan.rope_args()
    cos, sin = patch.tables(out[0].device, rope_args["max_position_id"] + 1, key)
    rope = PackedRope(cos, sin, rope_args)
    return rope, rope
