"""CP attention of per-document shards (:mod:`cp_rope.parallel.placement`).

A per-document shard holds, in this order, the zigzag shares of the *split*
documents (the same local lengths on every rank), the rank's *whole* documents,
then trailing padding. :func:`per_document_attention` runs the split prefix with
:func:`~cp_rope.parallel.context_parallel_attention` over the CP group (ring,
all-gather, ...: any method) and the rest as plain local attention with the same
block backend (a one-rank plan: no communication), then concatenates the two
results. Both parts are exact, so the result equals single-process attention
over the global sequences (``tests/test_placement.py``). A
:class:`PerDocumentPlan` (two :class:`~cp_rope.parallel.CPAttentionPlan`) is
built once per batch; its build is collective over a group of more than one
rank (the ranks agree on their arguments and placement; the split part's own
build too when the batch has split documents); the attention calls then run
collectives only for the split documents.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from cp_rope.validation import check_bool, check_choice, check_cu_seqlens

from .attention import context_parallel_attention
from .placement import DocumentPlacement, check_group_size, check_local_cu_seqlens
from .plan import METHODS, CPAttentionPlan, _check_across_ranks
from .ulysses import check_ulysses_args

__all__ = ["PerDocumentPlan", "per_document_attention"]


class PerDocumentPlan:
    """The attention plan of a per-document shard (:mod:`cp_rope.parallel.placement`).

    The shard's first ``split_rows`` rows are the zigzag shares of the split documents
    (the same local lengths on every rank): ``split`` (a :class:`CPAttentionPlan` over
    the group; None when the batch has no split document) runs them by the CP method.
    The other rows (the rank's whole documents, then trailing padding) are plain local
    attention, ``whole`` (a one-rank plan: no communication). Build once per batch with
    :meth:`build` and pass as ``plan=`` to every layer; attributes: ``placement``,
    ``split``, ``whole``, ``split_rows``, ``n_tokens``, ``group`` (the split plan's
    group; None without split documents or at cp_size 1), ``cp_rank``.
    """

    __slots__ = ("placement", "split", "whole", "split_rows", "n_tokens", "group", "cp_rank")

    @classmethod
    def build(cls, placement: DocumentPlacement, *, q_heads: int, kv_heads: int, head_dim: int,
              dtype: torch.dtype, device: torch.device | str, n_tokens: int | None = None,
              group: dist.ProcessGroup | None = None, causal: bool = True, method: str = "ring",
              seq_lens: torch.Tensor | None = None,
              ulysses_size: int | None = None) -> PerDocumentPlan:
        """Build the plan of this rank's shard; collective over ``group`` (more than one rank):
        one ``all_gather_object`` of the ranks' argument checks and placement digest, and
        the split part's :meth:`CPAttentionPlan.build` when the batch has split documents.

        Args: as :meth:`CPAttentionPlan.build`, with the batch's ``placement`` instead of
        ``cu_seqlens`` / ``max_seqlen``; ``n_tokens`` defaults to ``placement.n_rows``;
        ``method`` / ``ulysses_size`` are the split documents' (whole ones attend locally);
        ``seq_lens`` (``causal=False``): true lengths ``[B_r]`` of the local sequences.

        Raises: TypeError if ``placement`` is not a DocumentPlacement; ValueError if the
        group size is not ``placement.cp_size`` or ``n_tokens`` is below this rank's rows;
        ValueError for a bad ``method`` / ``ulysses_size`` / head counts
        (:func:`~cp_rope.parallel.ulysses.check_ulysses_args`) even when the batch has no
        split document to run them; as :meth:`CPAttentionPlan.build` otherwise.
        RuntimeError on every rank (group of more than one rank) if one rank's arguments
        fail or the ranks' placements differ (another batch), before any exchange.
        """
        if group is not None and dist.get_world_size(group) == 1:
            group = None
        size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0

        def split(cu, max_seqlen, **kw):
            return CPAttentionPlan.build(cu, max_seqlen, group=group, ulysses_size=ulysses_size,
                                         **kw)

        def check():  # the method too: a batch without split documents never runs it
            _check_local(placement, size, rank, n_tokens, seq_lens)
            check_choice("method", method, METHODS)
            check_ulysses_args(method, ulysses_size, size, q_heads, kv_heads)

        if group is not None:  # a rank whose arguments fail must not leave the others waiting
            error = None
            try:
                check()
            except (TypeError, ValueError) as exc:
                error = exc
            # and on the placement: a rank with split documents builds the split plan (a
            # collective) while one whose placement has none would not join it
            same = None if error is not None else _fingerprint(placement)
            _check_across_ranks(group, {"placement": same}, error)
        else:
            check()
        return cls._assemble(placement, size, rank, split, q_heads=q_heads, kv_heads=kv_heads,
                             head_dim=head_dim, dtype=dtype, device=device, n_tokens=n_tokens,
                             causal=causal, method=method, seq_lens=seq_lens)

    @classmethod
    def simulated(cls, placement: DocumentPlacement, cp_rank: int, **kwargs) -> PerDocumentPlan:
        """The plan rank ``cp_rank`` would build, without a group, for one-GPU scaling studies
        (``scripts/bench_cp_attention.py --simulate-cp --placement per_document``): the split
        part is :meth:`CPAttentionPlan.simulated` (loopback exchanges: the right shapes,
        blocks and kernels, not attention of any input), the whole part the real local one.
        ``kwargs``: as :meth:`build` without ``group`` (method ring or allgather).
        """
        if "group" in kwargs or "ulysses_size" in kwargs:
            raise TypeError("simulated() takes cp_rank, not group / ulysses_size")
        if not isinstance(placement, DocumentPlacement):
            raise TypeError(f"placement must be a DocumentPlacement, got {type(placement).__name__}")
        rank = placement._rank(cp_rank)

        def split(cu, max_seqlen, **kw):
            return CPAttentionPlan.simulated(cu, max_seqlen, cp_size=placement.cp_size,
                                             cp_rank=rank, **kw)

        return cls._assemble(placement, placement.cp_size, rank, split, **kwargs)

    @classmethod
    def _assemble(cls, placement, size, rank, split_plan, *, q_heads, kv_heads, head_dim, dtype,
                  device, n_tokens=None, causal=True, method="ring", seq_lens=None):
        cu, n_tokens = _check_local(placement, size, rank, n_tokens, seq_lens)
        ns, rows = placement.num_split, placement.split_rows
        kw = dict(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device,
                  causal=causal)
        self = object.__new__(cls)
        self.placement, self.split_rows, self.n_tokens, self.cp_rank = placement, rows, n_tokens, rank
        self.split = None if ns == 0 else split_plan(
            cu[:ns + 1], placement.split_max_seqlen, n_tokens=rows, method=method,
            seq_lens=None if seq_lens is None else seq_lens[:ns], **kw)
        self.group = None if self.split is None else self.split.group
        self.whole = CPAttentionPlan.build(
            cu[ns:] - cu[ns], placement.whole_max_seqlen(rank), n_tokens=n_tokens - rows,
            method="ring", seq_lens=None if seq_lens is None else seq_lens[ns:], **kw)
        return self

    def __repr__(self) -> str:
        return (f"PerDocumentPlan(cp={self.cp_rank}/{self.placement.cp_size}, "
                f"split_rows={self.split_rows}, n_tokens={self.n_tokens}, split={self.split}, "
                f"whole={self.whole})")


def _fingerprint(placement: DocumentPlacement) -> str:
    """A short digest of a placement (equal on every rank of one batch)."""
    h = hashlib.sha1(placement.cu_seqlens.tobytes(), usedforsecurity=False)
    h.update(placement.owner.tobytes())
    return f"{placement!r} sha1={h.hexdigest()[:10]}"


def _check_local(placement, size, rank, n_tokens, seq_lens):
    """This rank's checks of a plan's arguments: (local cu_seqlens, n_tokens) or raise."""
    if not isinstance(placement, DocumentPlacement):
        raise TypeError(f"placement must be a DocumentPlacement, got {type(placement).__name__}")
    check_group_size(placement, size)
    cu = placement.local_cu_seqlens(rank)
    n_tokens = placement.n_rows if n_tokens is None else n_tokens
    if n_tokens < int(cu[-1]):
        raise ValueError(f"n_tokens={n_tokens} is below rank {rank}'s {int(cu[-1])} rows "
                         "under placement")
    if seq_lens is not None and (not isinstance(seq_lens, torch.Tensor)
                                 or tuple(seq_lens.shape) != (cu.numel() - 1,)):
        raise ValueError(f"seq_lens: with placement, the true lengths of the {cu.numel() - 1} "
                         f"local sequences [B_r], got {getattr(seq_lens, 'shape', seq_lens)}")
    return cu, n_tokens


def per_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    *,
    placement: DocumentPlacement | None = None,
    plan: PerDocumentPlan | None = None,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    method: str = "ring",
    backend: str = "auto",
    seq_lens: torch.Tensor | None = None,
    ulysses_size: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a per-document shard: equals attention over the global sequences.

    Args:
        q: ``[T, Hq, D]``, k, v: ``[T, Hkv, D]``: this rank's shard (``T = placement.n_rows``
            unless the plan says otherwise), as :func:`context_parallel_attention` takes them.
        cu_seqlens: None, or this rank's local cu_seqlens (``batch.cu_seqlens``; compared
            with the placement's for CPU tensors).
        max_seqlen: None, or a host int >= this rank's longest local sequence.
        placement: the batch's :class:`~cp_rope.parallel.placement.DocumentPlacement`
            (``batch.placement``); or
        plan: a :class:`PerDocumentPlan` of the batch (built once, reused by every layer).
        group: the CP group (size ``placement.cp_size``); with ``plan``: None or the plan's.
        causal, softmax_scale, method, backend, ulysses_size, return_lse: as
            :func:`context_parallel_attention`; the method (and ``ulysses_size``) runs
            the split documents; with ``plan``: the plan's.
        seq_lens: ``causal=False`` only, without ``plan``: int ``[B_r]`` true lengths of
            the *local* sequences (``batch.seq_lens[placement.seq_ids(r)]``).

    Returns: ``[T, Hq, D]`` (and with ``return_lse`` the LSE ``[Hq, T]``), differentiable;
    padding rows (from ``placement.n_valid(r)``) are 0 and get gradient 0. A rank holding
    no document returns zeros.

    Raises: TypeError / ValueError naming the argument (no placement or plan, a plan of
    another placement, cu_seqlens / max_seqlen / T that do not match it); as
    :func:`context_parallel_attention` for the rest.
    """
    check_bool("return_lse", return_lse)  # only read here: the parts always return the LSE
    if plan is None:
        if placement is None:
            raise ValueError("placement: pass the batch's placement (batch.placement) or a plan")
        if not isinstance(placement, DocumentPlacement):
            raise TypeError(f"placement must be a DocumentPlacement, got {type(placement).__name__}")
        plan = PerDocumentPlan.build(
            placement, q_heads=q.shape[1], kv_heads=k.shape[1], head_dim=q.shape[2],
            dtype=q.dtype, device=q.device, n_tokens=q.shape[0], group=group, causal=causal,
            method=method, seq_lens=seq_lens, ulysses_size=ulysses_size)
    elif not isinstance(plan, PerDocumentPlan):
        raise TypeError(f"plan: a per-document shard needs a PerDocumentPlan, got "
                        f"{type(plan).__name__}")
    else:
        if placement is not None and placement is not plan.placement:
            raise ValueError("plan: built for another placement (build a plan per batch)")
        if seq_lens is not None:
            raise ValueError("plan: seq_lens goes to PerDocumentPlan.build (pass seq_lens=None "
                             "with a plan)")
        if group is not None and dist.get_world_size(group) > 1 and plan.split is not None \
                and group is not plan.group:
            raise ValueError("plan: built for another CP group (pass the plan's group or None)")
    placement, r = plan.placement, plan.cp_rank
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, device=q.device)
        check_local_cu_seqlens(placement, cu_seqlens, r)
    if max_seqlen is not None and max_seqlen < placement.max_seqlen(r):
        raise ValueError(f"max_seqlen = {max_seqlen} is below rank {r}'s longest local sequence "
                         f"({placement.max_seqlen(r)})")
    if q.shape[0] != plan.n_tokens:
        raise ValueError(f"plan: built for T={plan.n_tokens} rows, got q {tuple(q.shape)}")
    ns, n_whole = plan.split_rows, plan.n_tokens - plan.split_rows
    kw = dict(causal=causal, softmax_scale=softmax_scale, backend=backend, return_lse=True)
    if plan.split is not None and n_whole:  # both parts: views whose grads are concatenated
        (qs, qw), (ks, kw_), (vs, vw) = (_SplitRows.apply(t, ns) for t in (q, k, v))
    else:
        qs = qw = q
        ks = kw_ = k
        vs = vw = v
    parts = []
    if plan.split is not None:
        parts.append(context_parallel_attention(qs, ks, vs, None, None, group=plan.group,
                                                plan=plan.split, method=method,
                                                ulysses_size=ulysses_size, **kw))
    if n_whole or plan.split is None:
        parts.append(context_parallel_attention(qw, kw_, vw, None, None, plan=plan.whole,
                                                method="ring", **kw))
    out = torch.cat([o for o, _ in parts]) if len(parts) > 1 else parts[0][0]
    if not return_lse:
        return out
    return out, torch.cat([lse for _, lse in parts], 1) if len(parts) > 1 else parts[0][1]


class _SplitRows(torch.autograd.Function):
    """``x -> (x[:n], x[n:])`` (views) whose backward concatenates the two gradients: one
    copy, where slicing would give each part a zero-filled full-size gradient to sum."""

    @staticmethod
    def forward(ctx, x, n):
        return x[:n], x[n:]

    @staticmethod
    def backward(ctx, g1, g2):
        return torch.cat([g1, g2]), None
