"""The finetune_hf trainer's model: :class:`HFCausalLM`, a transformers causal LM behind the
trainer's model interface (the batch's plan from the host batch, then ``model(input_ids,
plan, labels=...)``), as :class:`cp_rope.launch.model.Transformer` has it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cp_rope.hf import attention_plan as hf_attention_plan
from cp_rope.hf import patch_model
from cp_rope.hf.moe import MoESpec, load_balancing_loss, router_token_mask, with_extra_gradient
from cp_rope.parallel import check_plan, cp_cross_entropy, cp_linear_cross_entropy

from .config import ConfigError

__all__ = ["HFCausalLM"]


class HFCausalLM(nn.Module):
    """The trainer's model interface over a transformers causal LM.

    ``attention_plan(batch, *, dtype=None, device=None)``: the batch's plan from this rank's
    *host* PackedBatch (:func:`cp_rope.hf.attention_plan` with the model's compute dtype,
    which :func:`~cp_rope.launch.parallelize.parallelize` sets): the trainer builds it once
    per step, then moves the batch to the device.

    ``forward(input_ids [T], plan, *, labels=None, loss_group=None, logits_to_keep=0,
    seq_lens=None)`` for this rank's shard runs the base model (``lm.base_model``) on the
    plan's rows (``cu_seqlens``, ``max_seqlen``, global positions from
    ``plan.rope_args()``, handed to the patch as ``cp_rope_plan``: no plan is built in the
    forward) to the final hidden states ``[T, d]``, then:
    without ``labels`` the logits ``[T, V]`` (``lm_head``, and the config's
    ``final_logit_softcapping`` when the family has one); with ``labels`` (``[T]``,
    already shifted) the group-mean loss over ``loss_group``:
    :func:`cp_rope.parallel.cp_linear_cross_entropy` on the hidden states and the
    ``lm_head`` weight (the input embedding when tied), so ``[T, V]`` never exists
    (``fused_loss=False`` or an ``lm_head`` with a bias: the logits, then
    :func:`cp_rope.parallel.cp_cross_entropy`). ``logits_to_keep`` as transformers'
    (an int k > 0: the last k rows; a 1-D index tensor: those rows; 0: all) selects
    the rows of the logits, and of the loss with their labels. A plan of another batch
    raises ValueError naming ``plan``.
    :meth:`configure_attention` (what :func:`~cp_rope.launch.parallelize.apply_cp`
    calls) is :func:`cp_rope.hf.patch_model` (with ``mlp_tile_tokens``: the
    sequence-tiled MLP); :attr:`layers` are the decoder layers that
    :func:`~cp_rope.launch.parallelize.apply_fsdp` shards one by one.
    """

    def __init__(self, lm: nn.Module, *, rope_kernel: bool = True, fused_loss: bool = True,
                 loss_chunk_size: int = 0, mlp_tile_tokens: int = 0, loss_impl: str = "auto",
                 fused_norm: bool = True, fused_swiglu: bool = True,
                 router_aux: MoESpec | None = None):
        super().__init__()
        self.lm, self.rope_kernel = lm, rope_kernel
        self.router_aux = router_aux  # None: no load-balancing loss
        self._aux_agreed, self._aux_log = False, None
        self.fused_loss, self.loss_chunk_size = fused_loss, loss_chunk_size
        self.mlp_tile_tokens, self.loss_impl, self.fused_norm = mlp_tile_tokens, loss_impl, fused_norm
        self.fused_swiglu = fused_swiglu
        self.calibration = None  # configure_attention sets the CP cost model's constants
        self.cp_size, self.cp_rank = 1, 0
        self.compute_dtype: torch.dtype | None = None  # parallelize sets it (the plan's dtype)

    @property
    def layers(self) -> nn.ModuleList:
        return self.lm.base_model.layers

    @property
    def attention_layers(self) -> tuple:
        """``(windows, sinks)`` of the patched attention layers (the CP self-test runs them)."""
        patch = getattr(self.lm, "cp_rope_patch", None)
        return ((None,), False) if patch is None else patch.layers

    @property
    def tok_embeddings(self) -> nn.Module:  # what launch.model.count_params excludes
        return self.lm.get_input_embeddings()

    def configure_attention(self, *, cp_group, cp_method: str, attn_backend: str,
                            rope_backend: str, ulysses_size: int | None = None,
                            calibration=None) -> None:
        if rope_backend != "auto":
            raise ConfigError(f"parallel.rope_backend={rope_backend!r}: finetune_hf uses auto "
                              "(set CP_ROPE_BACKEND=torch|triton to force one)")
        patch_model(self.lm, group=cp_group, method=cp_method, backend=attn_backend,
                    rope_kernel=self.rope_kernel, ulysses_size=ulysses_size,
                    mlp_tile_tokens=self.mlp_tile_tokens or None, fused_norm=self.fused_norm,
                    fused_swiglu=self.fused_swiglu)
        self.cp_size, self.cp_rank = self.lm.cp_rope_patch.cp_size, self.lm.cp_rope_patch.cp_rank
        self.calibration = calibration  # the CP cost model's constants, for every plan

    # the trainer's train_step passes the batch's seq_lens (the router loss's real tokens)
    uses_seq_lens = True

    def attention_plan(self, batch, max_seqlen: int | None = None, *,
                       dtype: torch.dtype | None = None, device=None,
                       n_tokens: int | None = None):
        """The plan of this rank's host ``batch`` (collective over the CP group): see the
        class docstring. Raises: as :func:`cp_rope.hf.attention_plan`."""
        return hf_attention_plan(self.lm, batch, max_seqlen, dtype=dtype or self.compute_dtype,
                                 device=device, n_tokens=n_tokens,
                                 calibration=self.calibration)

    def forward(self, input_ids: torch.Tensor, plan, *,
                labels: torch.Tensor | None = None,
                loss_group: dist.ProcessGroup | None = None,
                logits_to_keep: int | torch.Tensor = 0,
                seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        check_plan(plan, input_ids.shape[0], cp_rank=self.cp_rank)
        position_ids = plan.rope_args()["position_ids"].long()  # on the device already
        placement = getattr(plan, "placement", None)
        aux = self.router_aux is not None and self.training and labels is not None
        out = self.lm.base_model(input_ids=input_ids[None], position_ids=position_ids[None],
                                 cu_seq_lens_q=plan.cu_seqlens, cu_seq_lens_k=plan.cu_seqlens,
                                 max_length_q=plan.max_seqlen, max_length_k=plan.max_seqlen,
                                 cp_rope_plan=plan,
                                 **({} if placement is None else {"cp_rope_placement": placement}),
                                 **({"output_router_logits": True} if aux else {}))
        loss = self._head(out.last_hidden_state[0], labels, loss_group, logits_to_keep)
        if not aux:
            return loss
        return with_extra_gradient(loss, self._router_loss(out, plan.cu_seqlens, position_ids,
                                                           seq_lens, placement, loss_group))

    def _router_loss(self, out, cu_seqlens, position_ids, seq_lens, placement, loss_group):
        """``coef * aux / dp`` of this CP group's batch (its gradient: the replica's share of
        the data-parallel mean); keeps the dp x cp mean of ``aux`` for :meth:`log_metrics`."""
        if seq_lens is None:
            raise ValueError("seq_lens: the router load-balancing loss needs the batch's true "
                             "sequence lengths (packing pads are not tokens): pass "
                             "seq_lens=batch.seq_lens")
        spec, patch = self.router_aux, self.lm.cp_rope_patch
        mask = router_token_mask(cu_seqlens, position_ids, seq_lens, position_ids.shape[0],
                                 placement=placement, cp_rank=self.cp_rank)
        aux = load_balancing_loss(out.router_logits, num_experts=spec.num_experts,
                                  top_k=spec.top_k, mask=mask, group=patch.group,
                                  agree=not self._aux_agreed)
        self._aux_agreed = True
        world = dist.get_world_size(loss_group) if dist.is_initialized() else 1
        dp = max(world // self.cp_size, 1)
        logged = aux.detach() / world  # summed over dp x cp: the mean over the replicas
        if world > 1:
            dist.all_reduce(logged, group=loss_group)
        self._aux_log = logged
        return spec.coef * aux / dp

    def log_metrics(self) -> dict:
        """``{"aux_loss": float}`` of the last training forward (the router load-balancing loss,
        unweighted, mean over the data-parallel replicas); ``{}`` without one."""
        return {} if self._aux_log is None else {"aux_loss": float(self._aux_log)}

    def _head(self, hidden, labels, loss_group, logits_to_keep):
        if not isinstance(logits_to_keep, int) or logits_to_keep:  # transformers' semantics
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) \
                else logits_to_keep
            hidden = hidden[keep]
            labels = None if labels is None else labels[keep]
        head = self.lm.get_output_embeddings()
        softcap = getattr(self.lm.config, "final_logit_softcapping", None)
        if labels is not None and self.fused_loss and getattr(head, "bias", None) is None:
            return cp_linear_cross_entropy(hidden, head.weight, labels, loss_group,
                                           chunk_size=self.loss_chunk_size or None,
                                           softcap=softcap, impl=self.loss_impl)
        logits = head(hidden)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        return logits if labels is None else cp_cross_entropy(logits, labels, loss_group)
