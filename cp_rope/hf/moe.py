"""The router load-balancing loss of mixture-of-experts families under context parallelism.

transformers' MoE causal LMs (Qwen3-MoE, Mixtral, GPT-OSS) add
``router_aux_loss_coef * load_balancing_loss_func(router_logits, ...)`` to the loss: the
Switch Transformer loss (Fedus et al., arXiv 2101.03961, eqs. 4-6) in transformers' form

    aux = E * sum_e f_e * P_e,   f_e = (top-k assignments to e) / N,   P_e = (sum of p_e) / N

over every row of every MoE layer (``p = softmax(router_logits)``, ``N`` = rows x layers;
transformers' ``load_balancing_loss_func``, the same function in the three families). Under
CP each rank holds a shard of the batch, so computing it per rank balances each shard:
:func:`load_balancing_loss` instead sums the statistics ``(sum f, sum p, N)`` of this rank's
rows, all-reduces them over the CP group (one all-reduce of ``2 E + 1`` numbers) and then
applies the formula: on every rank the value of the whole group's batch. The all-reduce's
backward is the identity, so each rank's gradient is the share of its own router logits
and the parameter gradients are **summed** over the group (as the CP cross-entropy's).

Packing pads are not tokens: :func:`router_token_mask` marks the real rows of a shard
(position inside its document below the document's true length), and only those count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cp_rope.parallel import DocumentPlacement

__all__ = ["MoESpec", "moe_spec", "router_loss_spec", "router_token_mask", "load_balancing_loss",
           "router_statistics", "with_extra_gradient"]


@dataclass(frozen=True, slots=True)
class MoESpec:
    """What the load-balancing loss of an MoE config needs (:func:`moe_spec`)."""

    num_experts: int
    """Experts per MoE layer (``config.num_experts`` / ``num_local_experts``)."""
    top_k: int
    """Experts per token (``config.num_experts_per_tok``)."""
    coef: float
    """``config.router_aux_loss_coef``: the loss's weight in the training objective."""
    output_router_logits: bool
    """``config.output_router_logits``: whether transformers records the router logits."""


def moe_spec(config) -> MoESpec | None:
    """The MoE fields of a transformers config, or None for a dense model (no experts).

    Raises: ValueError naming the field for an MoE config whose ``num_experts_per_tok`` is
    missing or not in ``[1, num_experts]``, or whose ``router_aux_loss_coef`` is negative.
    """
    n = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not n:
        return None
    k = getattr(config, "num_experts_per_tok", None)
    if not isinstance(k, int) or not 1 <= k <= int(n):
        raise ValueError(f"config.num_experts_per_tok={k!r}: must be an int in [1, "
                         f"num_experts={n}]")
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if coef < 0:
        raise ValueError(f"config.router_aux_loss_coef={coef}: must be >= 0")
    return MoESpec(num_experts=int(n), top_k=k, coef=coef,
                   output_router_logits=bool(getattr(config, "output_router_logits", False)))


def router_loss_spec(config, mode: str = "config") -> MoESpec | None:
    """The router load-balancing loss to train with, or None (a trainer's switch).

    Args:
        config: a transformers config.
        mode: ``"config"``: as the config says (``output_router_logits`` with
            ``router_aux_loss_coef``); ``"on"``: with the config's coefficient; ``"off"``: none.

    Raises: ValueError naming the field: ``router_aux_loss='on'`` for a dense model or with
    ``router_aux_loss_coef`` 0; ``'config'`` with ``router_aux_loss_coef`` > 0 while
    ``output_router_logits`` is false (the loss would be dropped silently); a bad MoE field
    (:func:`moe_spec`); an unknown mode.
    """
    if mode not in ("config", "on", "off"):
        raise ValueError(f"router_aux_loss={mode!r}: must be 'config', 'on' or 'off'")
    spec = moe_spec(config)
    if spec is None:
        if mode == "on":
            raise ValueError(f"router_aux_loss='on': model_type "
                             f"{getattr(config, 'model_type', None)!r} has no mixture-of-experts "
                             "layers (no num_experts), so no router loss")
        return None
    if mode == "off":
        return None
    if mode == "on":
        if spec.coef == 0:
            raise ValueError("router_aux_loss='on': config.router_aux_loss_coef is 0; set it "
                             "(transformers' default is 0.001)")
        return spec
    if spec.coef > 0 and not spec.output_router_logits:
        raise ValueError(f"router_aux_loss='config': config.router_aux_loss_coef={spec.coef} but "
                         "config.output_router_logits is False, so transformers would train "
                         "without the load-balancing loss: pass router_aux_loss 'on' (train "
                         "with it) or 'off' (without it), or set output_router_logits")
    return spec if spec.output_router_logits else None


def router_token_mask(cu_seqlens: torch.Tensor, position_ids: torch.Tensor,
                      seq_lens: torch.Tensor, n_rows: int, *,
                      placement: DocumentPlacement | None = None, cp_rank: int = 0,
                      ) -> torch.Tensor:
    """bool ``[n_rows]``: the rows of a packed shard that are real tokens (not padding).

    Args:
        cu_seqlens: this shard's local int32 ``[B + 1]`` (``PackedBatch.cu_seqlens``).
        position_ids: int64 ``[n_rows]``, each row's position in its global sequence.
        seq_lens: int32 ``[B_global]`` true (unpadded) lengths of the global sequences
            (``PackedBatch.seq_lens``; 0 for the padding sequence).
        n_rows: the shard's rows ``T``.
        placement: a per-document shard's placement (its local sequences are the global
            ones ``placement.seq_ids(cp_rank)``); None for zigzag / global batches.
        cp_rank: this rank's index in the CP group (with ``placement``).

    A row is real iff it lies inside a local sequence (``< cu_seqlens[-1]``) and its position
    is below that sequence's true length. No device sync.
    """
    lens = seq_lens.to(device=position_ids.device, dtype=torch.int64)
    if placement is not None:
        ids = torch.as_tensor(placement.seq_ids(cp_rank), dtype=torch.int64)
        lens = lens[ids.to(lens.device)]
    lens = torch.cat([lens, lens.new_zeros(1)])  # rows past cu_seqlens[-1]: length 0
    rows = torch.arange(n_rows, device=position_ids.device, dtype=cu_seqlens.dtype)
    seq = torch.searchsorted(cu_seqlens.to(position_ids.device)[1:], rows, right=True)
    return position_ids.reshape(-1)[:n_rows] < lens[seq]


def router_statistics(router_logits: Sequence[torch.Tensor], top_k: int, num_experts: int,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's load-balancing statistics: ``[2 E + 1]`` = (top-k assignments per expert,
    router probabilities summed per expert, rows counted), summed over the layers.

    Args:
        router_logits: one ``[T, E]`` float tensor per MoE layer (transformers'
            ``router_logits`` output), this rank's rows.
        mask: bool ``[T]``, the rows that count (None: all).

    Returns: float (``float32`` or wider: the logits' dtype promoted) ``[2 E + 1]``; the
    probability part carries the gradient. The per-layer arithmetic is transformers'
    ``load_balancing_loss_func``'s (softmax in the logits' dtype, top-k of it).
    """
    dtype = torch.promote_types(router_logits[0].dtype, torch.float32)
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=dtype, device=device)
    probs = torch.zeros(num_experts, dtype=dtype, device=device)
    rows = torch.zeros((), dtype=dtype, device=device)
    w = None if mask is None else mask.to(device=device, dtype=dtype)
    for logits in router_logits:
        p = torch.softmax(logits, dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
        ones = (torch.ones(logits.shape[0], dtype=dtype, device=device) if w is None else w)
        counts = counts.scatter_add(0, chosen, ones.repeat_interleave(top_k))
        probs = probs + (p.to(dtype) if w is None else p.to(dtype) * w[:, None]).sum(0)
        rows = rows + ones.sum()
    return torch.cat([counts, probs, rows[None]])


class _GroupSum(torch.autograd.Function):
    """Forward: the all-reduced sum over ``group``; backward: the identity (each rank's
    gradient is the share of its own statistics; gradients are summed over the group)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _agree_shapes(group, num_experts: int, n_layers: int, device) -> None:
    """One small all-reduce before the statistics move: every rank's ``(E, layers)`` equal
    (sum of x and of x^2: all equal iff n * sum(x^2) == sum(x)^2)."""
    n = _group_size(group)
    v = torch.tensor([num_experts, num_experts ** 2, n_layers, n_layers ** 2],
                     dtype=torch.float64).to(device)
    dist.all_reduce(v, op=dist.ReduceOp.SUM, group=group)
    e, e2, ly, ly2 = v.tolist()
    if n * e2 != e * e or n * ly2 != ly * ly:
        raise ValueError(f"router_logits: the ranks of the CP group disagree on the number of "
                         f"experts or MoE layers (this rank: {num_experts} experts, {n_layers} "
                         "layers): every rank must run the same model")


def load_balancing_loss(router_logits: Sequence[torch.Tensor] | None, *, num_experts: int,
                        top_k: int, mask: torch.Tensor | None = None,
                        group: dist.ProcessGroup | None = None,
                        agree: bool = True) -> torch.Tensor:
    """The load-balancing loss of the whole CP group's batch (module docstring's formula).

    Args:
        router_logits: one ``[T, E]`` tensor per MoE layer, this rank's rows (the base
            model's ``router_logits`` with ``output_router_logits=True``).
        num_experts, top_k: the config's ``num_experts`` / ``num_experts_per_tok``.
        mask: bool ``[T]``, the real rows (:func:`router_token_mask`); None: every row.
        group: the CP group (None: this process alone).
        agree: check first that every rank has the same ``(E, layers)`` (one 4-number
            all-reduce and a host read; callers that already did may skip it).

    Returns: 0-dim tensor (float32, or float64 for float64 logits), the same value on every
    rank: transformers' ``load_balancing_loss_func`` of the group's concatenated real rows.
    Its gradient is this rank's share (sum parameter gradients over the group).

    Raises: ValueError naming ``router_logits`` when it is None or empty (the model recorded
    no router logits: ``output_router_logits`` off, or no MoE layer), when a tensor is not
    ``[T, num_experts]`` or the tensors' rows differ, or when the ranks disagree on the
    experts or layers; ``mask`` when it is not a bool ``[T]``.
    """
    if not router_logits:
        raise ValueError(f"router_logits={router_logits!r}: the model recorded no router logits "
                         "(call it with output_router_logits=True / set "
                         "config.output_router_logits = True; a model without MoE layers has "
                         "no load-balancing loss)")
    t = router_logits[0].shape[0]
    for i, x in enumerate(router_logits):
        if not isinstance(x, torch.Tensor) or x.shape != (t, num_experts) \
                or not x.is_floating_point():
            raise ValueError(f"router_logits[{i}]: expected a float [T={t}, num_experts="
                             f"{num_experts}] tensor, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x)}")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool
                             or mask.shape != (t,)):
        raise ValueError(f"mask: expected a bool [{t}] tensor (the real rows), got "
                         f"{getattr(mask, 'dtype', type(mask))} "
                         f"{tuple(getattr(mask, 'shape', ()))}")
    stats = router_statistics(router_logits, top_k, num_experts, mask)
    if _group_size(group) > 1:
        if agree:
            _agree_shapes(group, num_experts, len(router_logits), stats.device)
        stats = _GroupSum.apply(stats, group)
    rows = stats[-1].clamp(min=1.0)
    f, p = stats[:num_experts] / rows, stats[num_experts:2 * num_experts] / rows
    return (f.detach() * p).sum() * num_experts


class _AddGradient(torch.autograd.Function):
    """Forward: ``loss`` (its value, unchanged); backward: the incoming gradient to both."""

    @staticmethod
    def forward(ctx, loss, extra):
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


def with_extra_gradient(loss: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """A 0-dim tensor equal to ``loss`` whose backward is that of ``loss + extra``.

    The value stays the cross-entropy (what bits per byte and held-out comparisons read)
    while the optimised objective gains ``extra`` (e.g. ``coef * aux``), which is logged on
    its own (Megatron-LM's ``MoEAuxLossAutoScaler`` keeps the auxiliary loss out of the
    reported loss the same way).

    Raises: ValueError naming ``extra`` when either is not a 0-dim tensor.
    """
    if not (isinstance(loss, torch.Tensor) and isinstance(extra, torch.Tensor)
            and loss.dim() == 0 and extra.dim() == 0):
        raise ValueError(f"extra: loss and extra must be 0-dim tensors, got "
                         f"{getattr(loss, 'shape', type(loss))} and "
                         f"{getattr(extra, 'shape', type(extra))}")
    return _AddGradient.apply(loss, extra.to(loss.dtype))
