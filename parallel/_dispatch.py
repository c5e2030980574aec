"""One autograd Function for every CP method: the plan's method picks the forward/backward pair.

Each method lives in its own module (:mod:`.ring`, :mod:`.allgather`,
:mod:`.ulysses` for Ulysses and hybrid) as a forward and a backward function
``(group, q, k, v, plan, be, scale)``; :func:`run_plan` runs one plan's attention
on checked inputs (the doors, :func:`~cp_rope.parallel.context_parallel_attention`,
check them once).

A collective that fails inside a method (a peer that died, timed out, or runs
another collective: e.g. ``plan=`` passed on some ranks only, so the others run
the plan build's agreement) raises a RuntimeError naming these likely causes on
this rank, instead of the backend's bare message.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._accumulate import mask_pad
from .allgather import allgather_backward, allgather_forward
from .choices import A2A_METHODS
from .ring import ring_backward, ring_forward
from .ulysses import hybrid_backward, hybrid_forward

__all__ = ["run_plan"]

# Ulysses is hybrid with U = C (the plan's ulysses_size): one pair of functions
_ALGORITHMS = {
    "ring": (ring_forward, ring_backward),
    "allgather": (allgather_forward, allgather_backward),
    "ulysses": (hybrid_forward, hybrid_backward),
    "hybrid": (hybrid_forward, hybrid_backward),
}


def run_plan(q, k, v, plan, be, scale: float, sinks=None):
    """``(out, lse)`` of one :class:`~cp_rope.parallel.CPAttentionPlan` on checked inputs,
    with the block backend object ``be`` (:func:`~cp_rope.parallel._blocks.get_backend`) and
    the checked per-head sink logits ``sinks`` ``[Hq]`` (or None; differentiable)."""
    return _CPAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), sinks, plan, be,
                              scale)


def _is_comm_error(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return any(s in text for s in ("gloo", "Gloo", "NCCL", "Timed out", "timed out",
                                   "Connection closed", "Socket"))


def _exchange_failed(exc: BaseException, plan) -> RuntimeError:
    return RuntimeError(
        f"context_parallel_attention: a collective of the {plan.algorithm!r} exchange failed "
        f"on cp_rank {plan.cp_rank} of {plan.cp_size}: {exc}. Likely causes: a peer rank failed, "
        "left or is stopped; the ranks disagree on plan= (passed on some ranks only: those "
        "without a plan run the plan build's agreement, another collective), or use plans of "
        "different batches / layouts; a peer runs another step or layer")


class _CPAttention(torch.autograd.Function):
    """(q, k, v, sinks) -> (out, lse) by the plan's method; lse is not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan, be, scale):
        forward, _ = _ALGORITHMS[plan.algorithm]
        try:
            out, lse, auxs = forward(plan.group, q, k, v, plan, be, scale, sinks)
        except RuntimeError as exc:
            if plan.group is not None and _is_comm_error(exc):
                raise _exchange_failed(exc, plan) from exc
            raise
        saved = (q, k, v, out, lse)
        if plan.algorithm in A2A_METHODS:  # their backward reads their head-sharded copies
            saved, auxs = auxs
        ctx.save_for_backward(*saved)
        ctx.plan, ctx.be, ctx.scale, ctx.auxs = plan, be, scale, auxs
        ctx.sinks = None if sinks is None else sinks.detach()
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # the output was not used
            return None, None, None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        _, backward = _ALGORITHMS[plan.algorithm]
        try:
            *accs, dsinks = backward(plan.group, dout.contiguous(), q, k, v, out, lse, plan,
                                     ctx.be, ctx.scale, ctx.auxs, ctx.sinks)
        except RuntimeError as exc:
            if plan.group is not None and _is_comm_error(exc):
                raise _exchange_failed(exc, plan) from exc
            raise
        grads = [mask_pad(acc.value(), plan, 0.0, 0).to(plan.dtype) for acc in accs]
        if dsinks is not None:
            dsinks = dsinks.to(ctx.sinks.dtype)
        return (*grads, dsinks, None, None, None)
