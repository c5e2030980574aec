"""The shapes :mod:`cp_rope.launch.plan_memory` models: :class:`Shapes` of a decoder-only
model, from a preset (:meth:`Shapes.from_model_config`) or a transformers directory
(:meth:`Shapes.from_hf_dir`: dense or mixture-of-experts layers, per-layer sliding windows)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .config import ConfigError, ModelConfig, head_dim_of

__all__ = ["Shapes", "SWIGLU_FAMILIES"]

SWIGLU_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
"""model_types whose dense MLP has Linear ``gate_proj`` / ``up_proj`` / ``down_proj`` around
``act_fn`` (Phi3 fuses ``gate_up_proj``); :func:`cp_rope.hf.tiled_mlp.swiglu_mlps` fuses
those whose activation is SiLU (Gemma's default is GELU)."""


@dataclass(frozen=True, kw_only=True)
class Shapes:
    """What the memory model needs of a decoder-only model."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False
    qk_norm: bool = False
    """Per-head q/k RMSNorm (Qwen3): two more saved tensors per layer."""
    n_experts: int = 0
    """Experts of each mixture-of-experts layer (0: dense SwiGLU layers; Mixtral's and GPT-OSS's
    ``num_local_experts``, Qwen3-MoE's ``num_experts``): weights, gradients and optimizer
    states count every expert and the router."""
    experts_per_tok: int = 0
    """Experts each token runs (``num_experts_per_tok``): the activations and FLOPs count these."""
    expert_ffn: int = 0
    """Hidden width of one expert (Qwen3-MoE's ``moe_intermediate_size``; 0: ``ffn``)."""
    moe_layers: int | None = None
    """Layers with experts (None: all of them when ``n_experts``; Qwen3-MoE's ``mlp_only_layers``
    and ``decoder_sparse_step`` leave the others dense, of width ``ffn``)."""
    expert_bias: bool = False
    """Biases on the experts' projections and the router (GPT-OSS)."""
    windows: tuple[int | None, ...] = ()
    """Each layer's sliding window W (a query sees W keys; None: a full layer); empty: every
    layer full. The windowed ring receives only the keys a window reaches."""
    fused_swiglu: bool = False
    """The dense MLPs' ``silu(gate) * up`` runs cp_rope's fused SwiGLU (:mod:`cp_rope.swiglu`,
    on CUDA), which keeps ``gate`` and ``up`` but no ``silu(gate)``: one ``[T, ffn]`` tensor
    per layer less than PyTorch's eager product. True for cp_rope's Transformer and the
    dense families whose MLPs :func:`cp_rope.hf.tiled_mlp.swiglu_mlps` fuses; False for a
    mixture of experts (its dense layers are fused too, but the model counts every layer at
    the widest kind, so it keeps the eager count: an estimate over, not under)."""

    @property
    def n_moe(self) -> int:
        """Layers with experts."""
        if not self.n_experts:
            return 0
        return self.n_layers if self.moe_layers is None else self.moe_layers

    def _mlp_params(self, moe: bool, active: bool = False) -> int:
        """One layer's MLP (dense SwiGLU, or experts + router; ``active``: the token's share)."""
        if not moe:
            return 3 * self.dim * self.ffn
        f, e = self.expert_ffn or self.ffn, self.n_experts
        one = 3 * self.dim * f + ((2 * f + self.dim) if self.expert_bias else 0)
        router = e * self.dim + (e if self.expert_bias else 0)
        return (self.experts_per_tok if active else e) * one + router

    @property
    def _attn_params(self) -> int:
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return self.dim * (2 * q + 2 * kv) + 2 * self.dim

    @property
    def layer_params(self) -> int:
        """The largest layer's parameters (what FSDP2 gathers; a MoE layer: every expert)."""
        return self._attn_params + self._mlp_params(self.n_moe > 0)

    @property
    def active_layer_params(self) -> float:
        """Parameters one token runs through per layer, averaged over the layers (FLOPs)."""
        moe, dense = self.n_moe, self.n_layers - self.n_moe
        mlp = moe * self._mlp_params(True, active=True) + dense * self._mlp_params(False)
        return self._attn_params + mlp / self.n_layers

    @property
    def act_ffn(self) -> int:
        """SwiGLU width whose activations a token keeps per layer (MoE: its experts' together;
        the wider kind where dense and MoE layers mix)."""
        moe = self.experts_per_tok * (self.expert_ffn or self.ffn) if self.n_moe else 0
        return max(moe, self.ffn if self.n_moe < self.n_layers else 0)

    @property
    def root_params(self) -> int:
        return self.vocab * self.dim * (1 if self.tied else 2) + self.dim

    @property
    def params(self) -> int:
        moe = self.n_moe
        return (self.n_layers * self._attn_params + moe * self._mlp_params(True)
                + (self.n_layers - moe) * self._mlp_params(False) + self.root_params)

    def window_note(self) -> str:
        """The windows in words, for the report ("" when every layer is full)."""
        w = [x for x in self.windows if x is not None]
        if not w:
            return ""
        return (f"sliding window {'/'.join(map(str, sorted(set(w))))} on {len(w)} of "
                f"{len(self.windows)} layers")

    @classmethod
    def from_model_config(cls, m: ModelConfig) -> Shapes:
        """cp_rope's Transformer (vocab_size 0: the byte tokenizer's 320)."""
        return cls(dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
                   head_dim=head_dim_of(m), ffn=m.ffn_hidden_dim, vocab=m.vocab_size or 320,
                   fused_swiglu=m.fused_swiglu)

    @classmethod
    def from_hf_dir(cls, path: str, *, fused_swiglu: bool = True) -> Shapes:
        """A transformers ``config.json``, read by :func:`cp_rope.hf.local_config` (a family
        ``cp_rope.hf`` supports; never downloads): the shapes, the experts, the windows.
        ``fused_swiglu`` (finetune_hf's ``--fused-swiglu``) holds where the family's dense
        MLPs are ``down_proj(silu(gate_proj(x)) * up_proj(x))`` (:data:`SWIGLU_FAMILIES`,
        ``hidden_act`` / Gemma's ``hidden_activation`` silu, no experts).

        Raises: ConfigError naming ``model`` (no config.json; an unsupported model_type, with
        the supported families; transformers not installed).
        """
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"model={path!r}: no config.json there")
        try:
            from cp_rope.hf import local_config  # the [hf] extra: only --model needs it
        except ImportError as exc:
            raise ConfigError(f"model={path!r}: reading a transformers config needs "
                              f"cp_rope.hf: {exc}") from exc
        try:
            c = local_config(path)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        _check_hf_config(path, c)
        heads, n = c.num_attention_heads, c.num_hidden_layers
        experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or 0
        step, dense = getattr(c, "decoder_sparse_step", 1), getattr(c, "mlp_only_layers", ())
        sw, types = getattr(c, "sliding_window", None), getattr(c, "layer_types", None)
        windows = (tuple(sw if t == "sliding_attention" else None for t in types) if types
                   else (sw,) * n if sw else ())
        return cls(dim=c.hidden_size, n_layers=n, n_heads=heads,
                   n_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                   ffn=c.intermediate_size, vocab=c.vocab_size,
                   tied=bool(getattr(c, "tie_word_embeddings", False)),
                   qk_norm=c.model_type in ("qwen3", "qwen3_moe"), n_experts=experts,
                   experts_per_tok=getattr(c, "num_experts_per_tok", 0) or 0 if experts else 0,
                   expert_ffn=getattr(c, "moe_intermediate_size", None) or 0 if experts else 0,
                   moe_layers=sum(1 for i in range(n) if i not in (dense or ())
                                  and (i + 1) % step == 0) if experts else None,
                   expert_bias=bool(experts) and c.model_type == "gpt_oss", windows=windows,
                   fused_swiglu=fused_swiglu and not experts
                   and c.model_type in SWIGLU_FAMILIES
                   and (getattr(c, "hidden_activation", None)
                        or getattr(c, "hidden_act", None)) in ("silu", "swish"))


def _check_hf_config(path: str, c) -> None:
    """ConfigError naming ``config.<field>`` of ``path``'s config.json for shapes no model has:
    a size < 1, query heads not a multiple of the KV heads, more experts per token than
    experts, a ``decoder_sparse_step`` < 1, and what cp_rope.hf refuses of a config
    (:func:`cp_rope.hf.families.check_config`: a layer type it does not run, attention-logit
    soft-capping, ...), as the trainers do."""
    from cp_rope.hf.families import check_config

    def bad(field, value, why):
        raise ConfigError(f"model={path!r}: config.{field}={value!r}: {why}")

    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "vocab_size", "num_key_value_heads", "head_dim", "num_local_experts",
                  "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "decoder_sparse_step"):
        value = getattr(c, field, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1) and not (field == "num_experts" and value == 0):
            bad(field, value, "must be an int >= 1")
    heads, kv = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    if heads % kv:
        bad("num_attention_heads", heads, f"must be a multiple of num_key_value_heads={kv} (GQA)")
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or 0
    per_tok = getattr(c, "num_experts_per_tok", None) or 0
    if experts and per_tok > experts:
        bad("num_experts_per_tok", per_tok, f"more than the {experts} experts")
    try:
        check_config(c)
    except ValueError as exc:
        raise ConfigError(f"model={path!r}: {exc}") from None
