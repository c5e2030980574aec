"""A Llama-style decoder over packed THD batches with context parallelism.

Token embedding -> ``n_layers`` x [RMSNorm -> GQA attention (cp_rope RoPE with
the zigzag CP position formula, :func:`cp_rope.parallel.context_parallel_attention`
over the CP group) -> residual, RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm ->
output head (Llama 2/3 architecture; torchtitan's ``llama3`` model is the
closest reference). Inputs carry no batch dimension: ``[T]`` token ids of
several documents concatenated, described by int32 ``cu_seqlens``; under CP
each rank holds its zigzag shard and its *local* ``cu_seqlens``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cp_rope import RotaryEmbedding, apply_rotary_emb_qk
from cp_rope.parallel import (
    CPAttentionPlan,
    PerDocumentPlan,
    context_parallel_attention,
    cp_cross_entropy,
    cp_linear_cross_entropy,
    per_document_attention,
)
from cp_rope.parallel.tiled_mlp import tiled_mlp

from .config import ModelConfig

__all__ = ["Transformer", "TransformerBlock", "count_params"]


class Attention(nn.Module):
    """GQA self-attention: ``x [T, dim] -> [T, dim]`` over packed, CP-sharded sequences."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, ctx: _Ctx) -> torch.Tensor:
        t = x.shape[0]
        q = self.wq(x).view(t, self.n_heads, self.head_dim)
        k = self.wk(x).view(t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(t, self.n_kv_heads, self.head_dim)
        if ctx.placement is not None:  # a per-document shard: RoPE from its positions
            cos, sin = rope.tables(q.device)
            q, k = apply_rotary_emb_qk(q, k, cos, sin, ctx.cu_seqlens, position_ids=ctx.position_ids,
                                       max_position_id=ctx.max_position_id,
                                       interleaved=rope.interleaved, backend=ctx.rope_backend)
            if ctx.plan is None:  # once per forward, as below
                ctx.plan = PerDocumentPlan.build(
                    ctx.placement, q_heads=q.shape[1], kv_heads=k.shape[1], head_dim=q.shape[2],
                    dtype=q.dtype, device=q.device, n_tokens=t, group=ctx.cp_group,
                    method=ctx.cp_method, ulysses_size=ctx.ulysses_size)
            o = per_document_attention(q, k, v, plan=ctx.plan, method=ctx.cp_method,
                                       backend=ctx.attn_backend, ulysses_size=ctx.ulysses_size)
            return self.wo(o.reshape(t, self.n_heads * self.head_dim))
        q, k = rope(q, k, ctx.cu_seqlens, max_seqlen=ctx.max_seqlen,
                    cp_size=ctx.cp_size, cp_rank=ctx.cp_rank, backend=ctx.rope_backend)
        if ctx.plan is None:  # once per forward (batch); every layer and recompute reuse it
            ctx.plan = CPAttentionPlan.build(
                ctx.cu_seqlens, ctx.max_seqlen, q_heads=q.shape[1], kv_heads=k.shape[1],
                head_dim=q.shape[2], dtype=q.dtype, device=q.device, n_tokens=t,
                group=ctx.cp_group, method=ctx.cp_method, ulysses_size=ctx.ulysses_size)
        o = context_parallel_attention(q, k, v, ctx.cu_seqlens, ctx.max_seqlen, group=ctx.cp_group,
                                       causal=True, method=ctx.cp_method, backend=ctx.attn_backend,
                                       ulysses_size=ctx.ulysses_size, plan=ctx.plan)
        return self.wo(o.reshape(t, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU MLP (Shazeer 2020): ``w2(silu(w1 x) * w3 x)``.

    ``tile_tokens`` > 0 (``--mlp-tile-tokens``): the sequence-tiled MLP of ALST
    (:func:`cp_rope.parallel.tiled_mlp.tiled_mlp`): forward and backward run over
    tiles of that many tokens inside one autograd node, so the ``[T, hidden]``
    intermediates exist one tile at a time (the MLP's forward runs again in
    backward); same result and gradients as untiled. 0 = untiled.
    """

    def __init__(self, dim: int, hidden: int, *, tile_tokens: int = 0):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.tile_tokens = tile_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_tokens:
            return tiled_mlp(self._mlp, x, self.tile_tokens, list(self.parameters()))
        return self._mlp(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: ``x + attention(norm(x))``, then ``h + feed_forward(norm(h))``.

    ``checkpoint_activations`` (set by
    :func:`cp_rope.launch.parallelize.apply_activation_checkpointing`) recomputes the
    block's activations in backward (:func:`torch.utils.checkpoint.checkpoint`,
    non-reentrant) instead of keeping them; parameter names do not change.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim, tile_tokens=cfg.mlp_tile_tokens)
        self.checkpoint_activations = False

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, ctx: _Ctx) -> torch.Tensor:
        if self.checkpoint_activations and torch.is_grad_enabled():
            return checkpoint(self._forward, x, rope, ctx, use_reentrant=False)
        return self._forward(x, rope, ctx)

    def _forward(self, x: torch.Tensor, rope: RotaryEmbedding, ctx: _Ctx) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, ctx)
        return h + self.feed_forward(self.ffn_norm(h))


class _Ctx:
    """Per-forward batch layout and CP settings passed to every block."""

    __slots__ = ("cu_seqlens", "max_seqlen", "cp_group", "cp_size", "cp_rank", "cp_method",
                 "attn_backend", "rope_backend", "ulysses_size", "plan", "placement",
                 "position_ids", "max_position_id")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


class Transformer(nn.Module):
    """Llama-style decoder (see the module docstring).

    Args:
        cfg: shapes; ``cfg.vocab_size`` and ``cfg.max_seq_len`` must be resolved (> 0).
        cp_group, cp_method, attn_backend, rope_backend: as
            :meth:`configure_attention` (which
            :func:`cp_rope.launch.parallelize.parallelize` calls with the mesh's
            ``"cp"`` group); the defaults hold whole sequences in this process.

    ``forward(input_ids, cu_seqlens, max_seqlen, *, placement=None, position_ids=None)``:
        input_ids: int64 ``[T]`` (this rank's zigzag shard under CP);
        cu_seqlens: int32 ``[B + 1]``, the rank's local cu_seqlens;
        max_seqlen: host int, longest local sequence;
        placement, position_ids: of a per-document shard (``batch.placement``,
            ``batch.position_ids``; :mod:`cp_rope.parallel.placement`), both or
            neither: RoPE takes the positions and attention runs through a
            :class:`~cp_rope.parallel.PerDocumentPlan` (whole documents locally,
            split ones over the CP group);
        labels, loss_group: with ``labels`` (``[T]``, the shard's) the forward
            returns the loss instead of the logits (:meth:`head`: fused with the
            output projection by default, so ``[T, vocab_size]`` never exists);
        returns ``[T, vocab_size]`` logits in the compute dtype, or the 0-dim loss.

    Weights start from :meth:`init_weights` (normal ``init_std``; the output
    projection of every residual branch scaled by ``1 / sqrt(2 n_layers)``,
    GPT-2 / Megatron), which draws from the default torch generator: seed it
    identically on every rank.
    """

    def __init__(self, cfg: ModelConfig, *, cp_group: dist.ProcessGroup | None = None,
                 cp_method: str = "ring", attn_backend: str = "auto", rope_backend: str = "auto"):
        super().__init__()
        if cfg.vocab_size < 1 or cfg.max_seq_len < 1:
            raise ValueError(f"cfg.vocab_size={cfg.vocab_size} and cfg.max_seq_len={cfg.max_seq_len} "
                             "must be resolved (>= 1) before building the model")
        self.cfg = cfg
        self.configure_attention(cp_group=cp_group, cp_method=cp_method, attn_backend=attn_backend,
                                 rope_backend=rope_backend)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.dim // cfg.n_heads, cfg.max_seq_len, base=cfg.rope_base)
        self.init_weights()

    def configure_attention(self, *, cp_group: dist.ProcessGroup | None = None,
                            cp_method: str = "ring", attn_backend: str = "auto",
                            rope_backend: str = "auto", ulysses_size: int | None = None) -> None:
        """How every attention layer runs (no parameters change).

        Args:
            cp_group: the context-parallel process group (the ``"cp"`` dim of the
                mesh); ``None`` = no CP (this process holds whole sequences).
            cp_method: ``"ring"``, ``"allgather"``, ``"ulysses"`` or ``"hybrid"`` (see
                context_parallel_attention).
            ulysses_size: ``"hybrid"`` only: ranks per all-to-all group (divides the CP size).
            attn_backend, rope_backend: kernel selection passed through.
        """
        self.cp_group = cp_group
        self.cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
        self.cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
        self.cp_method, self.attn_backend, self.rope_backend = cp_method, attn_backend, rope_backend
        self.ulysses_size = ulysses_size

    @torch.no_grad()
    def init_weights(self) -> None:
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:  # RMSNorm scales
                nn.init.ones_(p)
            elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                nn.init.normal_(p, std=out_std)
            else:
                nn.init.normal_(p, std=std)

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, *,
                placement=None, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None,
                loss_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        if (placement is None) != (position_ids is None):
            raise ValueError("placement and position_ids: a per-document shard passes both "
                             "(batch.placement, batch.position_ids), a zigzag shard neither")
        ctx = _Ctx(cu_seqlens=cu_seqlens, max_seqlen=int(max_seqlen), cp_group=self.cp_group,
                   cp_size=self.cp_size, cp_rank=self.cp_rank, cp_method=self.cp_method,
                   attn_backend=self.attn_backend, rope_backend=self.rope_backend,
                   ulysses_size=self.ulysses_size, plan=None, placement=placement,
                   position_ids=position_ids, max_position_id=None if placement is None
                   else placement.max_position_id(self.cp_rank))
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, self.rope, ctx)
        return self.head(self.norm(h), labels=labels, loss_group=loss_group)

    def head(self, h: torch.Tensor, *, labels: torch.Tensor | None = None,
             loss_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Final hidden states ``[T, dim]`` -> logits ``[T, vocab_size]``, or with ``labels``
        the loss: :func:`~cp_rope.parallel.cp_linear_cross_entropy` over chunks of
        ``cfg.loss_chunk_size`` tokens (``cfg.fused_loss``; the logits never exist whole),
        else :func:`~cp_rope.parallel.cp_cross_entropy` on the logits; both the mean over
        every real label of ``loss_group`` (``None``: the world)."""
        if labels is None:
            return self.output(h)
        if self.cfg.fused_loss:
            return cp_linear_cross_entropy(h, self.output.weight, labels, loss_group,
                                           chunk_size=self.cfg.loss_chunk_size or None)
        return cp_cross_entropy(self.output(h), labels, loss_group)


def count_params(model: nn.Module, *, exclude_embedding: bool = False) -> int:
    """Number of parameters (global, also for FSDP2-sharded DTensors)."""
    n = sum(p.numel() for p in model.parameters())
    if exclude_embedding:
        n -= sum(p.numel() for p in model.tok_embeddings.parameters())
    return n
