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
from torch import nn

from cp_rope import RotaryEmbedding, apply_rotary_emb_qk
from cp_rope.parallel import (
    attention_plan,
    check_plan,
    context_parallel_attention,
    cp_cross_entropy,
    cp_linear_cross_entropy,
)
from cp_rope.parallel._tiled_mlp import tiled_mlp
from cp_rope.swiglu import swiglu
from cp_rope.validation import check_token_ids

from .config import ModelConfig, head_dim_of

__all__ = ["Transformer", "TransformerBlock", "count_params"]


class Attention(nn.Module):
    """GQA self-attention: ``x [T, dim] -> [T, dim]`` over packed, CP-sharded sequences."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = head_dim_of(cfg)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, ctx: _Ctx) -> torch.Tensor:
        t = x.shape[0]
        q = self.wq(x).view(t, self.n_heads, self.head_dim)
        k = self.wk(x).view(t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(t, self.n_kv_heads, self.head_dim)
        # the batch's plan (built once per step from the host batch): RoPE's positions and
        # the attention's schedule for its layout (zigzag or per-document) -- one path
        cos, sin = rope.tables(q.device)
        q, k = apply_rotary_emb_qk(q, k, cos, sin, **ctx.plan.rope_args(),
                                   interleaved=rope.interleaved, backend=ctx.rope_backend)
        o = context_parallel_attention(q, k, v, plan=ctx.plan)
        return self.wo(o.reshape(t, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU MLP (Shazeer 2020): ``w2(silu(w1 x) * w3 x)``, the product by
    :func:`cp_rope.swiglu.swiglu` (one fused kernel each way on CUDA; PyTorch on CPU);
    ``fused=False`` (``--no-fused-swiglu``): PyTorch's eager product on every device.

    ``tile_tokens`` > 0 (``--mlp-tile-tokens``): the sequence-tiled MLP of ALST
    (:func:`cp_rope.parallel.tiled_mlp`): forward and backward run over
    tiles of that many tokens inside one autograd node, so the ``[T, hidden]``
    intermediates exist one tile at a time (the MLP's forward runs again in
    backward); same result and gradients as untiled. 0 = untiled.
    """

    def __init__(self, dim: int, hidden: int, *, tile_tokens: int = 0, fused: bool = True):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.tile_tokens = tile_tokens
        self.swiglu_backend = "auto" if fused else "torch"  # --no-fused-swiglu: eager product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_tokens:
            return tiled_mlp(self._mlp, x, self.tile_tokens, list(self.parameters()))
        return self._mlp(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), backend=self.swiglu_backend))


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: ``x + attention(norm(x))``, then ``h + feed_forward(norm(h))``.

    Activation checkpointing and offload wrap a block from outside
    (:func:`cp_rope.launch.parallelize.apply_activation_checkpointing`); parameter names
    do not change.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim, tile_tokens=cfg.mlp_tile_tokens,
                                        fused=cfg.fused_swiglu)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, ctx: _Ctx) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, ctx)
        return h + self.feed_forward(self.ffn_norm(h))


class _Ctx:
    """Per-forward state passed to every block: the batch's attention plan (built once per
    step; the activation-checkpoint recompute gets the same object) and the RoPE backend."""

    __slots__ = ("plan", "rope_backend")

    def __init__(self, plan, rope_backend: str):
        self.plan, self.rope_backend = plan, rope_backend


class Transformer(nn.Module):
    """Llama-style decoder (see the module docstring).

    Args:
        cfg: shapes; ``cfg.vocab_size`` and ``cfg.max_seq_len`` must be resolved (> 0).
        cp_group, cp_method, attn_backend, rope_backend: as
            :meth:`configure_attention` (which
            :func:`cp_rope.launch.parallelize.parallelize` calls with the mesh's
            ``"cp"`` group); the defaults hold whole sequences in this process.
        loss_impl: the fused loss's kernel, one of
            :data:`~cp_rope.parallel.choices.LOSS_IMPLS` (``--loss-impl``; :meth:`head`).

    ``forward(input_ids, plan, *, labels=None, loss_group=None)``:
        input_ids: int64 ``[T]`` (this rank's shard under CP);
        plan: the batch's attention plan (:meth:`attention_plan`, built by the trainer
            from the host batch before the batch moves to the device); every layer and the
            activation-checkpoint recompute use it: RoPE from ``plan.rope_args()``,
            attention by its kind. A plan of another batch (other rows, rank or a
            changed cu_seqlens) raises ValueError naming ``plan``;
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
                 cp_method: str = "ring", attn_backend: str = "auto", rope_backend: str = "auto",
                 loss_impl: str = "auto"):
        super().__init__()
        if cfg.vocab_size < 1 or cfg.max_seq_len < 1:
            raise ValueError(f"cfg.vocab_size={cfg.vocab_size} and cfg.max_seq_len={cfg.max_seq_len} "
                             "must be resolved (>= 1) before building the model")
        self.cfg = cfg
        self.compute_dtype: torch.dtype | None = None  # parallelize sets it (the plan's dtype)
        self.loss_impl = loss_impl  # the fused loss's kernel (--loss-impl: LOSS_IMPLS)
        self.configure_attention(cp_group=cp_group, cp_method=cp_method, attn_backend=attn_backend,
                                 rope_backend=rope_backend)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(head_dim_of(cfg), cfg.max_seq_len, base=cfg.rope_base)
        self.init_weights()

    def configure_attention(self, *, cp_group: dist.ProcessGroup | None = None,
                            cp_method: str = "ring", attn_backend: str = "auto",
                            rope_backend: str = "auto", ulysses_size: int | None = None,
                            calibration=None) -> None:
        """How every attention layer runs (no parameters change).

        Args:
            cp_group: the context-parallel process group (the ``"cp"`` dim of the
                mesh); ``None`` = no CP (this process holds whole sequences).
            cp_method: ``"ring"``, ``"allgather"``, ``"ulysses"`` or ``"hybrid"`` (see
                context_parallel_attention).
            ulysses_size: ``"hybrid"`` only: ranks per all-to-all group (divides the CP size).
            attn_backend, rope_backend: kernel selection passed through.
            calibration: the CP cost model's constants
                (:class:`~cp_rope.parallel.calibrate.Calibration`, None: the shipped
                defaults), passed to every plan (:meth:`attention_plan`).
        """
        self.cp_group = cp_group
        self.cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
        self.cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
        self.cp_method, self.attn_backend, self.rope_backend = cp_method, attn_backend, rope_backend
        self.ulysses_size, self.calibration = ulysses_size, calibration

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

    def attention_plan(self, batch, max_seqlen: int | None = None, *,
                       dtype: torch.dtype | None = None, device=None,
                       n_tokens: int | None = None):
        """The attention plan of one batch for this model (collective over the CP group):
        :func:`cp_rope.parallel.attention_plan` with the model's heads, CP group, method,
        backend, ``ulysses_size`` and calibration (``plan.choice``: what auto picked). Call it
        on the *host* batch before moving it to the device: no device-to-host read.

        Args:
            batch: this rank's PackedBatch shard (or a DocumentPlacement, or local zigzag
                cu_seqlens with ``max_seqlen``).
            dtype: the compute dtype (default: :attr:`compute_dtype`, which
                :func:`~cp_rope.launch.parallelize.parallelize` sets, else the weights').
            device: where the forward runs (default: the weights' device).
            n_tokens: rows of ``input_ids`` (default: the batch's).

        Raises: as :func:`cp_rope.parallel.attention_plan`.
        """
        cfg, weight = self.cfg, self.tok_embeddings.weight
        return attention_plan(batch, max_seqlen, q_heads=cfg.n_heads, kv_heads=cfg.n_kv_heads,
                              head_dim=head_dim_of(cfg),
                              dtype=dtype or self.compute_dtype or weight.dtype,
                              device=weight.device if device is None else device,
                              group=self.cp_group, method=self.cp_method,
                              ulysses_size=self.ulysses_size, backend=self.attn_backend,
                              n_tokens=n_tokens, calibration=self.calibration)

    def forward(self, input_ids: torch.Tensor, plan, *, labels: torch.Tensor | None = None,
                loss_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        check_token_ids("input_ids", input_ids, self.tok_embeddings.num_embeddings)
        check_plan(plan, input_ids.shape[0], cp_rank=self.cp_rank)
        h = self.tok_embeddings(input_ids)
        ctx = _Ctx(plan, self.rope_backend)
        for layer in self.layers:
            h = layer(h, self.rope, ctx)
        return self.head(self.norm(h), labels=labels, loss_group=loss_group)

    def head(self, h: torch.Tensor, *, labels: torch.Tensor | None = None,
             loss_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Final hidden states ``[T, dim]`` -> logits ``[T, vocab_size]``, or with ``labels``
        the loss: :func:`~cp_rope.parallel.cp_linear_cross_entropy` over chunks of
        ``cfg.loss_chunk_size`` tokens by ``loss_impl`` (``cfg.fused_loss``; the logits
        never exist whole), else :func:`~cp_rope.parallel.cp_cross_entropy` on the logits;
        both the mean over every real label of ``loss_group`` (``None``: the world)."""
        if labels is None:
            return self.output(h)
        if self.cfg.fused_loss:
            return cp_linear_cross_entropy(h, self.output.weight, labels, loss_group,
                                           chunk_size=self.cfg.loss_chunk_size or None,
                                           impl=self.loss_impl)
        return cp_cross_entropy(self.output(h), labels, loss_group)


def count_params(model: nn.Module, *, exclude_embedding: bool = False) -> int:
    """Number of parameters (global, also for FSDP2-sharded DTensors)."""
    n = sum(p.numel() for p in model.parameters())
    if exclude_embedding:
        n -= sum(p.numel() for p in model.tok_embeddings.parameters())
    return n
