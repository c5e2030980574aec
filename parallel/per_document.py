"""CP attention of per-document shards (:mod:`cp_rope.parallel.placement`).

A per-document shard holds, in this order, the zigzag shares of the *split*
documents (the same local lengths on every rank), the rank's *whole* documents,
then trailing padding. The door, :func:`~cp_rope.parallel.context_parallel_attention`,
given a :class:`PerDocumentPlan` (:func:`run_per_document`), runs the split prefix with
the plan's method over the CP group (ring,
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

from ._blocks import get_backend
from ._device import to_device
from ._dispatch import run_plan
from ._window import (
    check_call_sinks,
    check_sinks,
    check_windows,
    copy_plan,
    link_variants,
    plan_for_window,
)
from .choices import BACKEND_CHOICES, METHODS
from .placement import DocumentPlacement, check_group_size, check_local_cu_seqlens
from .plan import (
    CPAttentionPlan,
    FrozenPlan,
    check_across_ranks,
    check_device,
    check_softmax_scale,
    check_tensors,
)
from .ulysses import check_ulysses_args

__all__ = ["PerDocumentPlan", "run_per_document", "check_per_document_rows"]


class PerDocumentPlan(FrozenPlan):
    """The attention plan of a per-document shard (:mod:`cp_rope.parallel.placement`).

    The shard's first ``split_rows`` rows are the zigzag shares of the split documents
    (the same local lengths on every rank): ``split`` (a :class:`CPAttentionPlan` over
    the group; None when the batch has no split document) runs them by the CP method.
    The other rows (the rank's whole documents, then trailing padding) are plain local
    attention, ``whole`` (a one-rank plan: no communication). Build once per batch
    (:func:`cp_rope.parallel.attention_plan` or :meth:`build`) and pass as ``plan=`` to
    every layer's :func:`~cp_rope.parallel.context_parallel_attention`. Read-only
    attributes: ``placement``, ``split``, ``whole``, ``split_rows``, ``n_tokens``,
    ``group`` (the split plan's group; None without split documents or at cp_size 1),
    ``cp_rank``, ``method``, ``causal``, ``ulysses_size``, ``softmax_scale``, ``backend``,
    ``cu_seqlens`` / ``max_seqlen`` (this rank's local ones), ``window`` / ``windows`` /
    ``sinks`` (as :class:`CPAttentionPlan`'s: :meth:`for_window` gives the plan of another
    of its windows); ``kind`` = ``"per_document"``.
    """

    __slots__ = ("placement", "split", "whole", "split_rows", "n_tokens", "group", "cp_rank",
                 "method", "causal", "ulysses_size", "softmax_scale", "backend", "cu_seqlens",
                 "max_seqlen", "window", "windows", "sinks", "_variants", "_rope")

    kind = "per_document"

    @classmethod
    def build(cls, placement: DocumentPlacement, *, q_heads: int, kv_heads: int, head_dim: int,
              dtype: torch.dtype, device: torch.device | str, n_tokens: int | None = None,
              group: dist.ProcessGroup | None = None, causal: bool = True, method: str = "ring",
              seq_lens: torch.Tensor | None = None, ulysses_size: int | None = None,
              softmax_scale: float | None = None, backend: str | None = None,
              window: int | None | tuple = None, sinks: bool = False,
              _check=None, _extra_sig=None) -> PerDocumentPlan:
        """Build the plan of this rank's shard; collective over ``group`` (more than one rank):
        one ``all_gather_object`` of the ranks' argument checks, arguments and placement
        digest, and the split part's :meth:`CPAttentionPlan.build` when the batch has split
        documents.

        Args: as :meth:`CPAttentionPlan.build`, with the batch's ``placement`` instead of
        ``cu_seqlens`` / ``max_seqlen``; ``n_tokens`` defaults to ``placement.n_rows``;
        ``method`` / ``ulysses_size`` are the split documents' (whole ones attend locally);
        ``seq_lens`` (``causal=False``): true lengths ``[B_r]`` of the local sequences;
        ``window`` / ``sinks``: both parts' (whole documents get the window locally).

        Raises: TypeError if ``placement`` is not a DocumentPlacement; ValueError if the
        group size is not ``placement.cp_size`` or ``n_tokens`` is below this rank's rows;
        ValueError for a bad ``method`` / ``ulysses_size`` / head counts
        (:func:`~cp_rope.parallel.ulysses.check_ulysses_args`) even when the batch has no
        split document to run them; as :meth:`CPAttentionPlan.build` otherwise.
        RuntimeError on every rank (group of more than one rank) if one rank's arguments
        fail or the ranks' placements or arguments differ (another batch), before any
        exchange.
        """
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got "
                            f"{type(group).__name__}")
        if group is not None and dist.get_world_size(group) == 1:
            group = None
        size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0

        def split(cu, max_seqlen, **kw):
            return CPAttentionPlan.build(cu, max_seqlen, group=group, ulysses_size=ulysses_size,
                                         **kw)

        error, sig = None, None
        try:  # a rank whose arguments fail must not leave the others waiting
            if _check is not None:
                _check()
            _check_local(placement, size, rank, n_tokens, seq_lens)
            check_device(device)  # here, not only in _assemble: every rank must raise
            check_choice("method", method, METHODS)  # a batch without split documents too
            check_ulysses_args(method, ulysses_size, size, q_heads, kv_heads)
            check_bool("causal", causal)
            check_bool("sinks", sinks)
            windows = check_windows(window, causal)
            softmax_scale = check_softmax_scale(softmax_scale)
            if backend is not None:
                check_choice("backend", backend, BACKEND_CHOICES)
            # and the placement: a rank with split documents builds the split plan (a
            # collective) while one whose placement has none would not join it
            sig = {"layout": "per_document", "placement": _fingerprint(placement),
                   "shape": (q_heads, kv_heads, head_dim), "dtype": str(dtype),
                   "n_tokens": n_tokens, "causal": causal, "method": method,
                   "ulysses_size": ulysses_size, "softmax_scale": softmax_scale,
                   "backend": backend, "window": list(windows), "sinks": sinks,
                   **(_extra_sig or {})}
        except (TypeError, ValueError) as exc:
            error = exc
        if group is not None:
            check_across_ranks(group, sig, error)
        elif error is not None:
            raise error
        return cls._assemble(placement, size, rank, split, q_heads=q_heads, kv_heads=kv_heads,
                             head_dim=head_dim, dtype=dtype, device=device, n_tokens=n_tokens,
                             causal=causal, method=method, seq_lens=seq_lens,
                             ulysses_size=ulysses_size, softmax_scale=softmax_scale,
                             backend=backend, window=window, sinks=sinks)

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
                  device, n_tokens=None, causal=True, method="ring", seq_lens=None,
                  ulysses_size=None, softmax_scale=None, backend=None, window=None, sinks=False):
        cu, n_tokens = _check_local(placement, size, rank, n_tokens, seq_lens)
        device = check_device(device)
        windows = check_windows(window, causal)
        ns, rows = placement.num_split, placement.split_rows
        kw = dict(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device,
                  causal=causal, softmax_scale=softmax_scale, backend=backend,
                  window=list(windows), sinks=sinks)
        self = object.__new__(cls)
        self.placement, self.split_rows, self.n_tokens, self.cp_rank = placement, rows, n_tokens, rank
        self.method, self.causal, self.ulysses_size = method, causal, ulysses_size
        self.softmax_scale, self.backend = softmax_scale, backend
        self.split = None if ns == 0 else split_plan(
            cu[:ns + 1], placement.split_max_seqlen, n_tokens=rows, method=method,
            seq_lens=None if seq_lens is None else seq_lens[:ns], **kw)
        self.group = None if self.split is None else self.split.group
        self.whole = CPAttentionPlan.build(
            cu[ns:] - cu[ns], placement.whole_max_seqlen(rank), n_tokens=n_tokens - rows,
            method="ring", seq_lens=None if seq_lens is None else seq_lens[ns:], **kw)
        self.cu_seqlens = to_device(cu, device)
        self.max_seqlen = placement.max_seqlen(rank)
        self.window, self.windows, self.sinks = windows[0], windows, sinks
        self._rope = None
        self._freeze(seq_lens)
        link_variants({w: self if w == windows[0] else copy_plan(
            self, window=w, split=self.split and self.split.for_window(w),
            whole=self.whole.for_window(w)) for w in windows})
        return self

    @property
    def device(self) -> torch.device:
        """Where the plan's q/k/v and index tensors live."""
        return self.whole.device

    def for_window(self, window) -> PerDocumentPlan:
        """The plan of the same batch for ``window`` (one of :attr:`windows`; None: no
        window). Raises ValueError naming ``window`` for another."""
        return plan_for_window(self, window)

    def rope_args(self) -> dict:
        """Keyword arguments of :func:`cp_rope.apply_rotary_emb_qk` for this shard:
        ``cu_seqlens`` (local), ``position_ids`` (int32 ``[n_tokens]``: each row's position
        in its global sequence; 0 on trailing padding rows) and ``max_position_id``. Built
        on the host once per plan (no sync), then cached."""
        if self._rope is None:
            pos = self.placement.position_ids(self.cp_rank)
            full = torch.zeros(self.n_tokens, dtype=torch.int32)
            full[: pos.numel()] = pos
            object.__setattr__(self, "_rope", {
                "cu_seqlens": self.cu_seqlens, "position_ids": to_device(full, self.whole.device),
                "max_position_id": self.placement.max_position_id(self.cp_rank)})
            self._stamp(self._rope["position_ids"])
        return dict(self._rope)

    def check_call(self, q, k, cu_seqlens, max_seqlen, placement, group, causal, method,
                   seq_lens, ulysses_size, softmax_scale, backend, sinks=None) -> None:
        """Raise ValueError naming ``plan`` if a call's arguments are not this plan's batch
        (host checks, no sync; None: the plan's)."""
        want, dtype, device = self.whole.shape, self.whole.dtype, self.whole.device
        if (q.shape[1], k.shape[1], q.shape[2]) != want or q.dtype != dtype \
                or q.device != device:
            raise ValueError(f"plan: built for q [T, Hq={want[0]}, D={want[2]}], k/v "
                             f"Hkv={want[1]}, {dtype} on {device}; got q {tuple(q.shape)}, k "
                             f"{tuple(k.shape)}, {q.dtype} on {q.device}")
        if placement is not None and placement is not self.placement:
            raise ValueError("plan: built for another placement (build a plan per batch)")
        if seq_lens is not None:
            raise ValueError("plan: seq_lens goes to the plan's build (pass seq_lens=None "
                             "with a plan)")
        if group is not None and dist.get_world_size(group) > 1 and self.split is not None \
                and group is not self.group:
            raise ValueError("plan: built for another CP group (pass the plan's group or None)")
        for name, got, want in (("causal", causal, self.causal), ("method", method, self.method),
                                ("ulysses_size", ulysses_size, self.ulysses_size),
                                ("softmax_scale", softmax_scale, self.softmax_scale),
                                ("backend", backend, self.backend)):
            if got is not None and want is not None and got != want:
                raise ValueError(f"plan: built for {name}={want!r}, got {name}={got!r} (pass "
                                 f"None to use the plan's)")
        _check_rows(self.placement, self.cp_rank, q, cu_seqlens, max_seqlen, self.n_tokens)
        check_call_sinks(self.sinks, sinks)
        self.check_unchanged()
        for part in (self.split, self.whole):
            if part is not None:
                part.check_unchanged()

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


def _check_rows(placement, r, q, cu_seqlens, max_seqlen, n_tokens) -> None:
    """A per-document call's cu_seqlens / max_seqlen / T against the placement (host)."""
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, device=q.device)
        check_local_cu_seqlens(placement, cu_seqlens, r)
    if max_seqlen is not None and max_seqlen < placement.max_seqlen(r):
        raise ValueError(f"max_seqlen = {max_seqlen} is below rank {r}'s longest local sequence "
                         f"({placement.max_seqlen(r)})")
    if n_tokens is not None and q.shape[0] != n_tokens:
        raise ValueError(f"plan: built for T={n_tokens} rows, got q {tuple(q.shape)}")


def check_per_document_rows(q, k, v, placement, group, cu_seqlens, max_seqlen, sinks,
                            return_lse) -> None:
    """The rank-local checks of a plan-less per-document call (run inside the plan build's
    agreement, so a rank's bad argument raises on every rank). Raises TypeError / ValueError
    naming the argument."""
    check_tensors(q, k, v)
    check_bool("return_lse", return_lse)
    if not isinstance(placement, DocumentPlacement):
        raise TypeError(f"placement must be a DocumentPlacement, got {type(placement).__name__}")
    multi = group is not None and dist.get_world_size(group) > 1
    check_group_size(placement, dist.get_world_size(group) if multi else 1)
    _check_rows(placement, dist.get_rank(group) if multi else 0, q, cu_seqlens, max_seqlen, None)
    check_sinks(sinks, q)


def run_per_document(q, k, v, plan: PerDocumentPlan, scale: float, backend: str, sinks,
                     return_lse: bool):
    """The executor of a :class:`PerDocumentPlan` (the door,
    :func:`~cp_rope.parallel.context_parallel_attention`, checked the call): the split
    documents by the plan's method over the group, the whole ones locally, concatenated.
    Returns ``out`` or ``(out, lse)``."""
    ns, n_whole = plan.split_rows, plan.n_tokens - plan.split_rows
    if plan.split is not None and n_whole:  # both parts: views whose grads are concatenated
        (qs, qw), (ks, kw_), (vs, vw) = (_SplitRows.apply(t, ns) for t in (q, k, v))
    else:
        qs = qw = q
        ks = kw_ = k
        vs = vw = v
    parts = []
    if plan.split is not None:
        parts.append(run_plan(qs, ks, vs, plan.split, get_backend(
            backend, qs, plan.split.n_seqs, windowed=plan.split.windowed,
            calibration=plan.calibration), scale, sinks))
    if n_whole or plan.split is None:
        parts.append(run_plan(qw, kw_, vw, plan.whole, get_backend(
            backend, qw, plan.whole.n_seqs, windowed=plan.whole.windowed,
            calibration=plan.calibration), scale, sinks))
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
