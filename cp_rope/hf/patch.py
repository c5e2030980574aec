"""patch_model / unpatch_model, the attention implementation ``"cp_rope"``, the RoPE
dispatcher and model_inputs (see :mod:`cp_rope.hf`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from cp_rope.cache import rope_cache
from cp_rope.parallel import PackedBatch, context_parallel_attention
from cp_rope.parallel.choices import AUTO, BACKEND_CHOICES, METHODS
from cp_rope.parallel.plan import group_position
from cp_rope.positions import global_positions
from cp_rope.validation import (
    check_bool,
    check_choice,
    check_token_ids,
    content_checks_enabled,
)

from ._compat import FAMILIES, SUPPORTED_FAMILIES, AttentionInterface, PreTrainedModel
from ._forward import check_forward
from .families import check_family
from .norms import _fused_forward, fuse_rms_norms, rms_norm_modules
from .plan import build_plan, check_passed_plan, check_rope_length
from .rope import PackedRope, check_rope, check_rope_dtype, install_rope_dispatcher, packed_rope
from .tiled_mlp import (
    _swiglu_forward,
    _tiled_forward,
    check_tile_tokens,
    fuse_mlps,
    mlp_modules,
    swiglu_mlps,
    tile_mlps,
)
from .window import layer_windows

__all__ = ["patch_model", "unpatch_model", "model_inputs", "cp_rope_attention", "PackedRope",
           "CPRopePatch", "ATTN_IMPLEMENTATION"]

ATTN_IMPLEMENTATION = "cp_rope"
_USE_LOSS = ("compute the loss as cp_rope.parallel.cp_cross_entropy(model(**model_inputs(batch))"
             ".logits[0], batch.labels, group)")


# --------------------------------------------------------------------------- the patch
@dataclass(eq=False)
class CPRopePatch:
    """What :func:`patch_model` attached to a model (``model.cp_rope_patch``)."""

    group: dist.ProcessGroup | None
    cp_size: int
    cp_rank: int
    method: str
    backend: str
    rope_kernel: bool
    ulysses_size: int | None = None
    scaling: dict | None = None  # the config's flat rope dict (rope_kernel=False: dynamic)
    scalings: dict = field(default_factory=dict)  # rope_kernel: key -> dict (cp_rope.hf.rope)
    rotary_dim: int = 0
    _tables: dict = field(default_factory=dict)  # (device, key) -> (cos, sin), float32
    _current: object | None = None  # the attention plan of the forward in flight
    shape: tuple = (0, 0, 0)  # (q heads, kv heads, head_dim) of the attention layers
    scale: float = 1.0  # their softmax scale (the layers' ``scaling``)
    _handles: list = field(default_factory=list)
    _modules: list = field(default_factory=list)
    _attn_before: str | None = None
    layers: tuple = ((None,), False)  # (windows, sinks) of the layers: cp_rope.hf.window
    # rope_kernel=False with a length-dependent rope type (dynamic, longrope): the longest
    # global sequence for which the model's own rotary embedding is still the default one
    _static_rope_len: int | None = None

    def tables(self, device: torch.device, n_positions: int,
               key: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos/sin ``[P, rotary_dim // 2]`` on ``device``, ``P >= n_positions``, of the
        rope dict ``key`` (None: the flat one; Gemma 3: the layer type)."""
        cached = self._tables.get((device, key))
        if cached is None or cached[0].shape[0] < n_positions:
            size = 1 << max(n_positions - 1, 1).bit_length()  # grow by powers of two
            self._tables[(device, key)] = rope_cache(size, self.rotary_dim,
                                                     scaling=self.scalings[key], device=device)
        return self._tables[(device, key)]


# --------------------------------------------------------------------------- attention
def cp_rope_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None, *,
                      scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, softcap: float | None = None,
                      **kwargs):
    """transformers attention function ``"cp_rope"``.

    Args (transformers' interface): query ``[1, Hq, T, D]``, key/value
    ``[1, Hkv, T, D]`` (this rank's packed rows), ``cu_seq_lens_q`` (local
    int32 ``[B + 1]``) and ``max_length_q`` in ``kwargs`` (from
    :func:`model_inputs`), ``scaling`` the softmax scale; ``cp_rope_plan``, the
    batch's attention plan, which the patched decoder builds once per forward and
    hands to every layer through ``kwargs`` (so no layer plans or agrees).

    Returns: ``([1, T, Hq, D], None)``.

    Raises: RuntimeError on a model :func:`patch_model` did not patch;
    ValueError without ``cu_seq_lens_q``, with a batch dim other than 1, a 4-D
    attention mask, dropout, or an attention-logit ``softcap`` (Gemma 2's; refused at
    patch_model, checked again here) (``sliding_window``, the layer's W, picks
    ``plan.for_window``; ``s_aux``, GPT-OSS's sinks, goes to the attention as ``sinks``).
    """
    patch = getattr(module, "cp_rope_patch", None)
    if patch is None:
        raise RuntimeError("attn_implementation 'cp_rope' on a model that cp_rope.hf.patch_model "
                           "did not patch: call patch_model(model, group=...) (models built from "
                           "one config object share it: give the other one a copy.deepcopy)")
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None or max_len is None:
        raise ValueError("cu_seq_lens_q / max_length_q missing: call model(**cp_rope.hf."
                         "model_inputs(batch)) with a PackedBatch")
    if query.shape[0] != 1:
        raise ValueError(f"query: packed rows have batch size 1, got {tuple(query.shape)}")
    if attention_mask is not None:
        raise ValueError("attention_mask: packed rows carry no mask (documents come from "
                         "cu_seq_lens_q)")
    if dropout:
        raise ValueError(f"dropout={dropout}: CP attention has no attention dropout; set "
                         "config.attention_dropout = 0")
    if softcap is not None:
        raise ValueError(f"softcap={softcap}: CP attention has no attention-logit soft-capping "
                         "(config.attn_logit_softcapping: patch_model refuses it)")
    plan = kwargs.get("cp_rope_plan")
    if plan is None:
        raise ValueError("cp_rope_plan missing: the patched decoder builds it once per forward; "
                         "call the model (or its base model), not its layers alone")
    plan = plan.for_window(sliding_window)  # the layer's: transformers' sliding_window is W
    dtype = _autocast_dtype(query.device)
    if dtype is not None:  # as SDPA under autocast: q/k/v in the autocast dtype (Qwen3's q/k
        query, key, value = (x.to(dtype) for x in (query, key, value))  # norms return fp32)
    out = context_parallel_attention(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), plan=plan,
        softmax_scale=scaling, sinks=kwargs.get("s_aux"))  # GPT-OSS passes its sinks as s_aux
    return out.unsqueeze(0), None


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype on ``device``'s type when autocast is on there (transformers'
    Trainer with ``bf16=True`` / ``fp16=True`` runs the forward under it), else None."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, cp_rope_attention)


# --------------------------------------------------------------------------- patch_model
def _family(model) -> tuple:
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    model_type = getattr(model.config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"model: model_type {model_type!r} is not supported by cp_rope.hf "
                         f"(supported: {', '.join(SUPPORTED_FAMILIES)}); its attention and RoPE "
                         "code would need checking before CP can run it")
    return FAMILIES[model_type]


def patch_model(model: PreTrainedModel, *, group: dist.ProcessGroup | None = None,
                method: str = "ring", backend: str = "auto", rope_kernel: bool = True,
                ulysses_size: int | None = None,
                mlp_tile_tokens: int | None = None, fused_norm: bool = True,
                fused_swiglu: bool = True) -> PreTrainedModel:
    """Make ``model`` run packed rows with context parallelism over ``group`` (in place).

    Sets the attention implementation to ``"cp_rope"``, and with
    ``rope_kernel`` replaces the rotation by cp_rope's kernel (see the module
    docstring). The patched model's forward takes :func:`model_inputs` and
    returns logits ``[1, T_local, V]``; it refuses ``labels=``,
    ``attention_mask=`` and ``use_cache=True`` (it sets ``use_cache=False``),
    and checks (CPU tensors, or ``CP_ROPE_DEBUG=1``) that ``position_ids`` are
    this rank's zigzag positions. Calling it again with the same group updates
    method, backend and rope_kernel.

    Args:
        model: a transformers ``PreTrainedModel`` of a supported family
            (:data:`SUPPORTED_FAMILIES`), e.g. ``LlamaForCausalLM``.
        group: the CP process group; ``None``: no CP (one rank).
        method, backend, ulysses_size: passed to
            :func:`cp_rope.parallel.context_parallel_attention` (``ulysses_size``
            for ``method="hybrid"``; Ulysses needs the head counts divisible by
            the all-to-all size, checked there).
        rope_kernel: use cp_rope's RoPE kernel instead of the model's rotation.
        mlp_tile_tokens: run every decoder layer's MLP over tiles of this many tokens
            (:func:`cp_rope.hf.tiled_mlp.tile_mlps`, ALST's TiledMLP); None = untiled.
        fused_norm: run the family's RMSNorms with PyTorch's fused ``rms_norm`` on bf16/fp16
            inputs (:mod:`cp_rope.hf.norms`: no float32 copies kept for backward; one
            rounding instead of transformers' two); float32/float64 run unchanged.
        fused_swiglu: run the product ``silu(gate_proj(x)) * up_proj(x)`` of the MLPs of that
            form (:func:`cp_rope.hf.tiled_mlp.swiglu_mlps`: Llama, Mistral, Qwen2, Qwen3)
            through :func:`cp_rope.swiglu.swiglu` (one fused kernel each way on CUDA; the
            PyTorch expression on CPU and in float64), tiled or not.

    Returns: ``model`` itself (``model.cp_rope_patch`` holds the settings).

    Raises:
        TypeError: ``model`` not a ``PreTrainedModel``; ``rope_kernel`` not a bool.
        ValueError: unsupported family; a model already patched for another group
            (:func:`unpatch_model` first); a ``group`` this process is not in; unknown
            method/backend; a rope dict that cp_rope cannot reproduce with
            ``rope_kernel=True`` (``dynamic``, ``longrope``: pass ``rope_kernel=False``);
            ``rope_kernel=True`` on a float64 model (the kernel runs float32/16/bf16: pass
            ``rope_kernel=False``).
    """
    module, attn_name, rotary_name = _family(model)
    rope_kernel = check_bool("rope_kernel", rope_kernel)
    fused_norm = check_bool("fused_norm", fused_norm)
    fused_swiglu = check_bool("fused_swiglu", fused_swiglu)
    if mlp_tile_tokens is not None:
        check_tile_tokens(mlp_tile_tokens, "mlp_tile_tokens")
    method = check_choice("method", method, (*METHODS, AUTO))
    backend = check_choice("backend", backend, BACKEND_CHOICES)
    _, cp_size, cp_rank = group_position(group)  # the plan's own checks of `group`
    old = getattr(model, "cp_rope_patch", None)
    if old is not None and old.group is not group:
        raise ValueError("model: already patched by cp_rope.hf.patch_model for another "
                         "process group; call cp_rope.hf.unpatch_model(model) first (or "
                         "patch a fresh copy)")
    # every check first: a refused patch (or re-patch) leaves the model as it was
    patch = CPRopePatch(group=group, cp_size=cp_size, cp_rank=cp_rank, method=method,
                        backend=backend, rope_kernel=rope_kernel, ulysses_size=ulysses_size,
                        _attn_before=old._attn_before if old is not None
                        else model.config._attn_implementation)
    attn_cls, rotary_cls = getattr(module, attn_name), getattr(module, rotary_name)
    rotaries = [m for m in model.modules() if isinstance(m, rotary_cls)]
    attns = [m for m in model.modules() if isinstance(m, attn_cls)]
    if len(rotaries) != 1 or not attns:
        raise ValueError(f"model: expected one {rotary_name} and some {attn_name} modules, "
                         f"found {len(rotaries)} and {len(attns)}")
    decoder = next(m for m in model.modules() if getattr(m, "rotary_emb", None) is rotaries[0])
    cfg = model.config
    head_dim = int(getattr(attns[0], "head_dim", cfg.hidden_size // cfg.num_attention_heads))
    patch.shape = (cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None)
                   or cfg.num_attention_heads, head_dim)
    patch.scale = float(getattr(attns[0], "scaling", head_dim ** -0.5))
    check_family(model, attns)
    patch.layers = layer_windows(attns, cfg)
    rope = getattr(model.config, "rope_parameters", None) or {}
    if not rope_kernel and rope.get("rope_type") in ("dynamic", "longrope"):
        patch.scaling = dict(rope)
        patch._static_rope_len = int(rope.get("original_max_position_embeddings")
                                     or model.config.max_position_embeddings)
    if rope_kernel:
        patch.scalings, patch.rotary_dim = check_rope(rotaries[0], model.config)
    # a re-patch replaces the old patch's MLP forward (tiled or fused), whichever it was
    ours = (_tiled_forward, _swiglu_forward) if old is not None else ()
    if mlp_tile_tokens is not None:
        check_forward(mlp_modules(model), (_tiled_forward, *ours), "mlp_tile_tokens")
    elif fused_swiglu:
        check_forward(swiglu_mlps(model), (_swiglu_forward, *ours), "fused_swiglu")
    if fused_norm:
        check_forward(rms_norm_modules(model, module), _fused_forward, "fused_norm")
    if rope_kernel:  # last: a family's own refusals above name what it cannot run at all
        check_rope_dtype(model.dtype)
    # nothing below refuses
    if old is not None:
        unpatch_model(model)
    if mlp_tile_tokens is not None:
        patch._handles.extend(tile_mlps(model, mlp_tile_tokens, swiglu=fused_swiglu))
    elif fused_swiglu:
        patch._handles.extend(fuse_mlps(model))
    if fused_norm:
        patch._handles.extend(fuse_rms_norms(model, module))
    if rope_kernel:
        install_rope_dispatcher(module)
        patch._handles.append(rotaries[0].register_forward_hook(
            lambda mod, args, kwargs, out: packed_rope(patch, args, kwargs, out),
            with_kwargs=True))
    embed = model.get_input_embeddings()
    for m in attns:
        m.cp_rope_patch = patch
    patch._modules = attns
    patch._handles.append(decoder.register_forward_pre_hook(
        lambda mod, args, kwargs: _before_forward(patch, embed, args, kwargs), with_kwargs=True))
    patch._handles.append(decoder.register_forward_hook(
        lambda *_: setattr(patch, "_current", None), always_call=True))
    if decoder is not model:
        patch._handles.append(model.register_forward_pre_hook(_refuse_labels, with_kwargs=True))
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    model.cp_rope_patch = patch
    return model


def unpatch_model(model: PreTrainedModel) -> PreTrainedModel:
    """Undo :func:`patch_model` (the attention implementation it replaced comes back)."""
    patch = getattr(model, "cp_rope_patch", None)
    if patch is None:
        raise ValueError("model: not patched by cp_rope.hf.patch_model")
    for h in patch._handles:
        h.remove()
    for m in patch._modules:
        del m.cp_rope_patch
    model.set_attn_implementation(patch._attn_before)
    del model.cp_rope_patch
    return model


def _refuse_labels(module, args, kwargs):
    if len(args) > 1:
        raise TypeError("a patched model takes its inputs as keywords: "
                        "model(**cp_rope.hf.model_inputs(batch))")
    if kwargs.get("labels") is not None:
        raise ValueError("labels: a PackedBatch's labels are already shifted inside each "
                         "document and transformers' loss would shift them again and average "
                         f"per rank; call the model without labels and {_USE_LOSS}")


def _before_forward(patch: CPRopePatch, embed: nn.Module, args, kwargs):
    """The decoder's pre-forward hook: checks the packed inputs and builds the batch's
    attention plan once (collective over the patch's group; rank-local errors join its
    agreement), handed to every layer as ``kwargs["cp_rope_plan"]``."""
    _refuse_labels(None, args, kwargs)
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    pos = kwargs.get("position_ids")
    placement = kwargs.pop("cp_rope_placement", None)
    if cu is None or max_len is None or pos is None:
        raise ValueError("cu_seq_lens_q / max_length_q / position_ids missing: a patched model "
                         "runs packed rows: call model(**cp_rope.hf.model_inputs(batch))")
    if kwargs.get("attention_mask") is not None:
        raise ValueError("attention_mask: packed rows carry no mask (documents come from "
                         "cu_seq_lens_q); leave it out")
    if kwargs.get("use_cache"):
        raise ValueError("use_cache=True: a patched model trains on packed CP rows and keeps "
                         "no KV cache")
    kwargs["use_cache"] = False

    def check():  # rank-local: inside the plan build's agreement, so every rank raises
        _check_keys(kwargs, cu, max_len)
        if n_rows == 0:  # transformers' attention reshapes [1, T, -1, D]: no T = 0
            raise ValueError("batch: no tokens (T = 0 rows, e.g. PackingCollator()([])): a "
                             "transformers model cannot run an empty sequence; skip the batch, "
                             "or collate with PackingCollator(pad_to_multiple=...), which pads "
                             "an empty batch to one padding sequence")
        check_rope_length(patch, int(max_len))
        if content_checks_enabled(pos) and content_checks_enabled(cu):
            _check_positions(patch, pos, cu, placement)
        if kwargs.get("input_ids") is not None:
            check_token_ids("input_ids", kwargs["input_ids"], embed.num_embeddings)

    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    n_rows = (embeds if embeds is not None else ids).shape[1] if (
        embeds is not None or ids is not None) else None
    plan = kwargs.get("cp_rope_plan")
    if plan is not None:  # the step's plan, built from the host batch (cp_rope.hf.attention_plan)
        check_passed_plan(patch, plan, cu, max_len, n_rows, placement)
        check()
    else:  # the three-line recipe: the batch's plan, built here once per forward
        weight = embed.weight  # the compute dtype (FSDP2 has cast the unsharded copy by now)
        dtype = _autocast_dtype(pos.device) or (embeds.dtype if embeds is not None
                                                else weight.dtype)
        plan = build_plan(patch, cu if placement is None else placement,
                          None if placement is not None else int(max_len), dtype=dtype,
                          device=pos.device, n_tokens=n_rows, _check=check)
    kwargs["cp_rope_plan"] = plan
    patch._current = plan
    return args, kwargs


def _check_keys(kwargs, cu, max_len) -> None:
    """cu_seq_lens_k / max_length_k, when given, must describe the same rows as the q ones
    (self-attention over packed rows; a different one would be ignored)."""
    cu_k, max_k = kwargs.get("cu_seq_lens_k"), kwargs.get("max_length_k")
    if cu_k is not None and cu_k is not cu and (
            not isinstance(cu_k, torch.Tensor) or cu_k.shape != cu.shape
            or (content_checks_enabled(cu_k) and content_checks_enabled(cu)
                and not torch.equal(cu_k.to(cu.device), cu))):
        raise ValueError("cu_seq_lens_k: packed self-attention needs cu_seq_lens_k equal to "
                         "cu_seq_lens_q (model_inputs passes the same tensor); got another")
    if max_k is not None and int(max_k) != int(max_len):
        raise ValueError(f"max_length_k={int(max_k)}: must equal max_length_q={int(max_len)}")


def _check_positions(patch: CPRopePatch, pos: torch.Tensor, cu: torch.Tensor,
                     placement=None) -> None:
    C = patch.cp_size
    if pos.dim() != 2 or pos.shape[0] != 1:
        raise ValueError(f"position_ids must be [1, T], got {tuple(pos.shape)}")
    if placement is not None:  # a per-document shard: its positions in the global sequences
        if not 0 <= patch.cp_rank < placement.cp_size:
            return  # the plan's build names the group-size mismatch
        want = placement.position_ids(patch.cp_rank).to(pos.device)
        n = want.numel()
        if pos.shape[1] < n or not torch.equal(pos[0, :n], want):
            raise ValueError(f"batch: position_ids are not cp_rank {patch.cp_rank}'s positions "
                             "under its placement (another rank's shard?): use "
                             "model_inputs(batch) of this rank's PackedBatch")
        return
    want = global_positions(cu, C, patch.cp_rank).to(pos.device)
    n = want.numel()
    if pos.shape[1] >= n and torch.equal(pos[0, :n], want):
        return
    for r in range(C):
        if pos.shape[1] >= n and torch.equal(pos[0, :n], global_positions(cu, C, r)):
            raise ValueError(f"batch: position_ids are cp_rank {r}'s zigzag positions but this "
                             f"rank is cp_rank {patch.cp_rank} of the patch's group: build each "
                             f"rank's shard with PackingCollator(cp_size={C}, cp_rank=<rank in "
                             "the CP group>)")
    raise ValueError(f"batch: position_ids are not the zigzag positions of cu_seq_lens_q for "
                     f"cp_size={C}, cp_rank={patch.cp_rank} (a batch sharded for another CP "
                     "size or rank?): use model_inputs(batch) of this rank's PackedBatch")


# --------------------------------------------------------------------------- inputs
def model_inputs(batch: PackedBatch, plan=None) -> dict:
    """Keyword arguments for ``model(**...)`` from this rank's :class:`PackedBatch`.

    Returns: ``input_ids`` int64 ``[1, T]``, ``position_ids`` int64 ``[1, T]``
    (global positions: right for transformers' own rotary embedding too),
    ``cu_seq_lens_q``/``cu_seq_lens_k`` (the local int32 ``cu_seqlens [B + 1]``)
    and ``max_length_q``/``max_length_k`` (host int, the longest local
    sequence): the packed-sequence keys of transformers'
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``. No labels:
    compute the loss with :func:`cp_rope.parallel.cp_cross_entropy`.

    A per-document shard (``batch.placement`` set) also passes ``cp_rope_placement``
    (the patch builds the per-document plan from it; its ``position_ids`` are the
    positions in the global sequences). ``plan``: the batch's plan
    (:func:`cp_rope.hf.attention_plan` of the host batch), passed as ``cp_rope_plan``; the
    model then builds none (and refuses, naming ``plan``, one of another batch).

    Raises: TypeError if ``batch`` is not a ``PackedBatch``.
    """
    if not isinstance(batch, PackedBatch):
        raise TypeError(f"batch must be a cp_rope.parallel.PackedBatch, got {type(batch).__name__}")
    extra = {} if batch.placement is None else {"cp_rope_placement": batch.placement}
    cu = batch.cu_seqlens
    if plan is not None:
        extra["cp_rope_plan"] = plan
    return {**extra,
        "input_ids": batch.input_ids.unsqueeze(0),
        "position_ids": batch.position_ids.unsqueeze(0),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": int(batch.max_seqlen),
        "max_length_k": int(batch.max_seqlen),
    }
