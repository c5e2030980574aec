"""The per-batch plan of CP attention in the zigzag layout: every block, built once.

A :class:`CPAttentionPlan` is built once per batch from the batch's *host*
``cu_seqlens`` and the CP group (by :func:`cp_rope.parallel.attention_plan`, or
:meth:`CPAttentionPlan.build`), then handed to every layer's
:func:`~cp_rope.parallel.context_parallel_attention` call. It holds

* the cross-rank agreement: at build, the ranks of the group all-gather their
  whole ``cu_seqlens`` (and ``seq_lens``, shapes, dtype, scale, backend, flags) and
  every rank raises if any two differ, or if one rank's own arguments failed --
  so no layer needs a collective to check;
* the block schedule of the CP method (built by the method's module:
  :func:`~cp_rope.parallel.ring.ring_schedule`,
  :func:`~cp_rope.parallel.allgather.allgather_schedule`,
  :func:`~cp_rope.parallel.ulysses.a2a_schedule`), the index tensors it needs and
  host counts (``n_valid``: rows before ``cu_seqlens[-1]``);
* RoPE's arguments for the layout (:meth:`CPAttentionPlan.rope_args`: per-token
  positions built once per batch).

A plan is immutable: its attributes cannot be assigned, and a call refuses a plan
whose ``cu_seqlens`` (or ``seq_lens`` / positions) were changed in place after the
build (the tensors' version counters: a host check, no sync).

With a plan a call reads nothing from the device: no device-to-host sync.
Building one reads ``cu_seqlens`` on the host (one sync if it is a device
tensor) and, with ``cp_size > 1``, runs one ``all_gather_object``.
"""

from __future__ import annotations

import dataclasses
import types

import torch
import torch.distributed as dist

from cp_rope.positions import global_positions
from cp_rope.validation import (
    check_bool,
    check_choice,
    check_cp_args,
    check_cu_seqlens,
    check_cu_seqlens_content,
    check_int,
    check_max_seqlen,
)

from ._agree import agree_across_ranks
from ._device import to_device
from ._schedule import Layout
from ._window import (
    check_call_sinks,
    check_windows,
    copy_plan,
    effective_window,
    has_window_blocks,
    link_variants,
    plan_for_window,
)
from .allgather import allgather_schedule
from .choices import A2A_METHODS, BACKEND_CHOICES, METHODS
from .plan_checks import (
    DTYPES,
    FrozenPlan,
    check_device,
    check_softmax_scale,
    check_tensors,
)
from .ring import ring_schedule
from .ulysses import a2a_groups, a2a_schedule, check_ulysses_args

__all__ = ["CPAttentionPlan", "METHODS", "FrozenPlan", "check_device", "check_softmax_scale",
           "check_tensors", "check_across_ranks"]

_SCHEDULES = {"ring": ring_schedule, "allgather": allgather_schedule,
              "ulysses": a2a_schedule, "hybrid": a2a_schedule}


class CPAttentionPlan(FrozenPlan):
    """Everything :func:`~cp_rope.parallel.context_parallel_attention` derives from one
    batch's zigzag layout, built once per batch (:func:`cp_rope.parallel.attention_plan` or
    :meth:`build`) and reused by every layer (forward and backward): a call with
    ``plan=`` does no device-to-host sync.

    Attributes (read-only): ``cu_seqlens`` (int32 ``[B + 1]`` on the device),
    ``cu_seqlens_host`` (the same on the CPU), ``max_seqlen``, ``n_tokens`` (rows T of
    q/k/v), ``n_valid`` (``cu_seqlens[-1]``), ``n_seqs`` (B), ``group``, ``cp_size``,
    ``cp_rank``, ``method``, ``causal``, ``seq_lens``, ``ulysses_size`` (all-to-all group
    size U of ulysses / hybrid, else 1), ``shape`` (``(Hq, Hkv, D)``), ``dtype``,
    ``device``, ``softmax_scale`` (None: each call's), ``backend`` (None: each call's),
    ``window`` (the left window W of this plan, None: none; :mod:`cp_rope.parallel._window`
    states the convention), ``windows`` (every window the batch's plan serves:
    :meth:`for_window`), ``sinks`` (whether calls pass per-head sink logits);
    the schedule ``blocks`` (read-only mapping of block tuples by phase), ``indices``
    (mapping of device index tensors) and ``terms``; ``kind`` = ``"zigzag"``.
    """

    __slots__ = ("cu_seqlens", "cu_seqlens_host", "max_seqlen", "n_tokens", "n_valid", "n_seqs",
                 "group", "cp_size", "cp_rank", "method", "causal", "seq_lens", "shape", "dtype",
                 "device", "blocks", "indices", "terms", "ulysses_size", "softmax_scale",
                 "backend", "window", "windows", "sinks", "_variants", "_rope")

    kind = "zigzag"

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, max_seqlen: int, *, q_heads: int, kv_heads: int,
              head_dim: int, dtype: torch.dtype, device: torch.device | str | int,
              n_tokens: int | None = None, group: dist.ProcessGroup | None = None,
              causal: bool = True, method: str = "ring",
              seq_lens: torch.Tensor | None = None, ulysses_size: int | None = None,
              softmax_scale: float | None = None, backend: str | None = None,
              window: int | None | tuple = None, sinks: bool = False,
              _check=None, _extra_sig=None) -> CPAttentionPlan:
        """Build the plan of one batch (collective over ``group`` when it has > 1 rank).

        Args:
            cu_seqlens: int32 ``[B + 1]`` *local* cumulative lengths (global / C), on the
                host (no sync) or any device (read once). Same on every rank.
            max_seqlen: host int >= the longest local sequence.
            q_heads, kv_heads, head_dim, dtype: the shapes ``[T, q_heads, head_dim]`` /
                ``[T, kv_heads, head_dim]`` and dtype of the q/k/v the plan will serve.
            device: where q/k/v live (the plan's index tensors go there).
            n_tokens: rows T of q/k/v (default ``cu_seqlens[-1]``); rows from
                ``cu_seqlens[-1]`` on are trailing padding.
            group, causal, method, seq_lens, ulysses_size: as in
                ``context_parallel_attention``.
            softmax_scale, backend: fixed in the plan and agreed across the ranks; None
                leaves them to each call (not agreed; :func:`attention_plan` fixes both).
            window: the left window ``W`` (an int >= 1: a query at position p sees keys
                p - W + 1 .. p; needs ``causal``), None for none, or a list of them (a
                model's per-layer windows; the first is this plan's, the others are
                :meth:`for_window`'s): every schedule is built now and agreed.
            sinks: the calls pass per-head sink logits ``[Hq]`` (agreed; a call that
                passes them or not against the plan raises).

        Raises:
            TypeError / ValueError: a bad argument, named (cu_seqlens content included;
                ``device`` the meta device, or a CUDA device without CUDA).
            RuntimeError: the ranks of the group disagree (every rank raises; the message
                shows each rank's values), or a rank's own arguments were bad (the other
                ranks raise naming it).
        """
        group, cp_size, cp_rank = group_position(group)
        error, sig, lay = None, None, None
        try:
            if _check is not None:  # the caller's own rank-local checks join the agreement
                _check()
            check_cu_seqlens(cu_seqlens)
            max_seqlen = check_max_seqlen(max_seqlen, allow_none=False)
            q_heads = check_int("q_heads", q_heads, min_value=1)
            kv_heads = check_int("kv_heads", kv_heads, min_value=1)
            head_dim = check_int("head_dim", head_dim, min_value=1)
            if dtype not in DTYPES:
                raise TypeError(f"dtype must be float16/bfloat16/float32/float64, got {dtype}")
            if q_heads % kv_heads:
                raise ValueError(f"q heads ({q_heads}) must be a multiple of k/v heads "
                                 f"({kv_heads})")
            check_bool("causal", causal)
            check_bool("sinks", sinks)
            windows = check_windows(window, causal)
            check_choice("method", method, METHODS)
            device = check_device(device)
            softmax_scale = check_softmax_scale(softmax_scale)
            if backend is not None:
                check_choice("backend", backend, BACKEND_CHOICES)
            # the one read of a device cu_seqlens; a private copy of a host one
            cu_host = cu_seqlens.detach().to("cpu", copy=True)
            n_valid = int(cu_host[-1])
            n_tokens = n_valid if n_tokens is None else check_int("n_tokens", n_tokens,
                                                                   min_value=0)
            check_cu_seqlens_content(cu_host, n_tokens=n_tokens, cp_size=cp_size,
                                     max_seqlen=max_seqlen)
            seq_host = _check_seq_lens(seq_lens, cu_host, causal, cp_size)
            ulysses = check_ulysses_args(method, ulysses_size, cp_size, q_heads, kv_heads)
            lay = Layout(cu_host.to(torch.int64), max_seqlen, n_tokens, cp_size, cp_rank, causal,
                         seq_host, device, ulysses)
            lens = cu_host[1:] - cu_host[:-1]
            longest = int(lens.max()) * cp_size if lens.numel() else 0
            sig = {"layout": "zigzag", "q": (n_tokens, q_heads, head_dim),
                   "k": (n_tokens, kv_heads, head_dim), "dtype": str(dtype),
                   "max_seqlen": max_seqlen, "causal": causal, "method": method,
                   "ulysses_size": ulysses_size, "softmax_scale": softmax_scale,
                   "backend": backend, "cu_seqlens": cu_host.tolist(),
                   "seq_lens": None if seq_host is None else seq_host.tolist(),
                   "window": list(windows), "sinks": sinks, **(_extra_sig or {})}
        except (TypeError, ValueError) as exc:
            error = exc
        if group is not None:  # cp_size > 1
            check_across_ranks(group, sig, error)
        elif error is not None:
            raise error
        self = object.__new__(cls)
        self.cu_seqlens = cu_seqlens if cu_seqlens.device == device else to_device(cu_host, device)
        self.cu_seqlens_host, self.max_seqlen, self.n_tokens = cu_host, max_seqlen, n_tokens
        self.n_valid, self.n_seqs = n_valid, cu_host.numel() - 1
        self.group, self.cp_size, self.cp_rank = group, cp_size, cp_rank
        self.method, self.causal, self.seq_lens = method, causal, seq_lens
        self.shape, self.dtype, self.device = (q_heads, kv_heads, head_dim), dtype, device
        self.ulysses_size, self.softmax_scale, self.backend = ulysses, softmax_scale, backend
        self.window, self.windows, self.sinks = windows[0], windows, sinks
        self._schedule(lay, longest)
        self._rope = None
        if self.algorithm in A2A_METHODS and group is not None:  # subgroups now (collective), cached
            a2a_groups(group, ulysses)
        self._freeze(cu_seqlens, cu_host, seq_lens)
        variants = {w: copy_plan(self, window=w) for w in windows[1:]}  # the same batch
        for other in variants.values():
            other._schedule(lay, longest)
        link_variants({windows[0]: self, **variants})
        return self

    def _schedule(self, lay: Layout, longest: int) -> None:
        """Blocks, indices and terms of ``self.window`` (set while building)."""
        lay = dataclasses.replace(lay, window=effective_window(self.window, longest))
        blocks, indices, terms = _SCHEDULES[self.method if self.cp_size > 1 else "ring"](lay)
        object.__setattr__(self, "blocks", types.MappingProxyType(blocks))
        object.__setattr__(self, "indices", types.MappingProxyType(indices))
        object.__setattr__(self, "terms", terms)

    def for_window(self, window) -> CPAttentionPlan:
        """The plan of the same batch for ``window`` (one of :attr:`windows`, which the build
        agreed; None: no window). Raises ValueError naming ``window`` for another."""
        return plan_for_window(self, window)

    @property
    def windowed(self) -> bool:
        """Whether the schedule has windowed blocks (a window shorter than some document)."""
        return has_window_blocks(self.blocks)

    @classmethod
    def simulated(cls, cu_seqlens: torch.Tensor, max_seqlen: int, *, cp_size: int, cp_rank: int,
                  **kwargs) -> CPAttentionPlan:
        """The plan rank ``cp_rank`` of a ``cp_size`` CP group would build, without a group:
        for one-GPU scaling studies (``scripts/bench_cp_attention.py --simulate-cp``). A call
        with it runs this rank's blocks of its method with loopback exchanges (every step
        computes against this rank's own K/V; ulysses / hybrid: the all-to-all hands back
        this rank's own buffer: the same shapes, blocks and kernels, no communication; the
        numbers are not attention of any input).
        ``kwargs``: as :meth:`build` (``group`` excluded).

        Raises: as :meth:`build`.
        """
        if "group" in kwargs:
            raise TypeError("simulated() takes cp_size / cp_rank, not group")
        check_cp_args(cp_size, cp_rank)
        return cls.build(cu_seqlens, max_seqlen, group=_SimulatedGroup(cp_size, cp_rank),
                         **kwargs)

    @property
    def algorithm(self) -> str:
        """The method that runs: ``method``, or ``"ring"`` (one local block) at cp_size 1."""
        return self.method if self.cp_size > 1 else "ring"

    def rope_args(self) -> dict:
        """Keyword arguments of :func:`cp_rope.apply_rotary_emb_qk` for this layout:
        ``cu_seqlens``, ``position_ids`` (int32 ``[n_tokens]`` on the plan's device: each
        row's position in its global sequence, by the CP formula; 0 on trailing padding rows)
        and ``max_position_id``. Built on the host once per plan (no sync), then cached."""
        if self._rope is None:
            pos = global_positions(self.cu_seqlens_host, self.cp_size, self.cp_rank)
            full = torch.zeros(self.n_tokens, dtype=torch.int32)
            full[: pos.numel()] = pos
            object.__setattr__(self, "_rope", {
                "cu_seqlens": self.cu_seqlens, "position_ids": to_device(full, self.device),
                "max_position_id": int(pos.max()) if pos.numel() else 0})
            self._stamp(self._rope["position_ids"])
        return dict(self._rope)

    def check_call(self, q, k, cu_seqlens, max_seqlen, group, causal, method, seq_lens,
                   ulysses_size=None, softmax_scale=None, backend=None, sinks=None) -> None:
        """Raise ValueError naming ``plan`` if a call's arguments are not the plan's batch.

        Host checks only (no sync): shapes, dtype, device, the group object, the flags
        (None: the plan's), ``cu_seqlens`` / ``seq_lens`` are the plan's own tensors (or
        None), unchanged since the build.
        """
        got = (q.shape[0], q.shape[1], k.shape[1], q.shape[2])
        want = (self.n_tokens, *self.shape)
        if got != want or q.dtype != self.dtype or q.device != self.device:
            raise ValueError(
                f"plan: built for q [T={want[0]}, Hq={want[1]}, D={want[3]}], k/v Hkv={want[2]}, "
                f"{self.dtype} on {self.device}; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                f"{q.dtype} on {q.device} (build a plan per batch)")
        if group is not None and dist.get_world_size(group) == 1:
            group = None
        if group is not None and group is not self.group:
            raise ValueError("plan: built for another CP group (pass the group the plan was "
                             "built with, or None)")
        if cu_seqlens is not None and cu_seqlens is not self.cu_seqlens \
                and cu_seqlens is not self.cu_seqlens_host:
            raise ValueError("plan: cu_seqlens is not the plan's (plan.cu_seqlens); the batch "
                             "changed? Build a plan per batch, or pass cu_seqlens=None")
        if max_seqlen is not None and max_seqlen != self.max_seqlen:
            raise ValueError(f"plan: built for max_seqlen {self.max_seqlen}, got {max_seqlen}")
        if (causal is not None and causal != self.causal) or (method is not None
                                                              and method != self.method):
            raise ValueError(f"plan: built for causal={self.causal}, method={self.method!r}; got "
                             f"causal={causal}, method={method!r}")
        if ulysses_size is not None and ulysses_size != self.ulysses_size:
            raise ValueError(f"plan: built for ulysses_size={self.ulysses_size}, got {ulysses_size}")
        if seq_lens is not None and seq_lens is not self.seq_lens:
            raise ValueError("plan: seq_lens is not the plan's (pass seq_lens=None with a plan)")
        if softmax_scale is not None and self.softmax_scale is not None \
                and softmax_scale != self.softmax_scale:
            raise ValueError(f"plan: built for softmax_scale={self.softmax_scale}, got "
                             f"{softmax_scale} (pass None to use the plan's)")
        if backend is not None and self.backend is not None and backend != self.backend:
            raise ValueError(f"plan: built for backend={self.backend!r}, got {backend!r}")
        check_call_sinks(self.sinks, sinks)
        self.check_unchanged()

    def __repr__(self) -> str:
        return (f"CPAttentionPlan(n_seqs={self.n_seqs}, n_tokens={self.n_tokens}, "
                f"max_seqlen={self.max_seqlen}, cp={self.cp_rank}/{self.cp_size}, "
                f"method={self.method!r}, causal={self.causal}, shape={self.shape}, "
                f"dtype={self.dtype}, device={self.device})")


@dataclasses.dataclass(frozen=True)
class _SimulatedGroup:
    """Stands for a rank of a CP group in :meth:`CPAttentionPlan.simulated`."""

    size: int
    rank: int


def group_position(group) -> tuple[dist.ProcessGroup | None, int, int]:
    """``(group, cp_size, cp_rank)``: group None at cp_size 1 and for a simulated rank.

    Raises: TypeError if ``group`` is not a ProcessGroup (or None); ValueError if
    ``torch.distributed`` is not initialized or this process is not in ``group``.
    """
    if isinstance(group, _SimulatedGroup):
        return None, group.size, group.rank
    if isinstance(group, int) and group == getattr(dist.GroupMember, "NON_GROUP_MEMBER", None):
        raise ValueError("group: this process is not a member of the CP group (new_group "
                         "returns a placeholder on the ranks outside it)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got "
                        f"{type(group).__name__} {group!r}")
    if group is not None and not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized (init_process_group first)")
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError("group: this process is not a member of the CP group")
    if group is not None and dist.get_world_size(group) > 1:
        return group, dist.get_world_size(group), dist.get_rank(group)
    return None, 1, 0


def _check_seq_lens(seq_lens, cu_host, causal, cp_size):
    """Host int64 ``[B]`` of ``seq_lens`` (or None), checked against the padded lengths."""
    if seq_lens is None:
        if not causal and cp_size > 1:
            raise ValueError(
                "seq_lens: causal=False with cp_size > 1 needs the true global lengths to mask "
                "the zigzag padding keys (pass cu_seqlens.diff() * cp_size if nothing is padded)")
        return None
    if causal:
        raise ValueError("seq_lens is only used with causal=False (causal attention never "
                         "lets padding keys reach real queries); pass seq_lens=None")
    n = cu_host.numel() - 1
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype.is_floating_point \
            or seq_lens.dtype == torch.bool or tuple(seq_lens.shape) != (n,):
        got = (f"{seq_lens.dtype} of shape {tuple(seq_lens.shape)}"
               if isinstance(seq_lens, torch.Tensor) else type(seq_lens).__name__)
        raise ValueError(f"seq_lens must be an integer tensor [B] = [{n}], got {got}")
    host = seq_lens.detach().to("cpu", torch.int64)
    lens = (cu_host[1:] - cu_host[:-1]).to(torch.int64) * cp_size
    if bool(((host < 0) | (host > lens)).any()):
        raise ValueError("seq_lens must satisfy 0 <= seq_lens <= global (padded) length")
    return host


def check_across_ranks(group, sig: dict | None, error: Exception | None) -> None:
    """:func:`agree_across_ranks` for plan builds: RuntimeError on the ranks whose own
    arguments passed, naming the keys of ``sig`` that differ and every rank's values."""

    def describe(sigs: list) -> str:
        def show(v):
            text = str(v)
            return text if len(text) <= 120 else text[:117] + "..."

        keys = list(dict.fromkeys(key for s in sigs for key in s))
        diff = [key for key in keys if any(s.get(key) != sigs[0].get(key) for s in sigs)]
        return "inputs differ across the ranks of the CP group:\n" + "\n".join(
            f"  rank {i}: " + ", ".join(f"{key}={show(s.get(key))}" for key in diff)
            for i, s in enumerate(sigs))

    agree_across_ranks(group, error, sig, what="plan (context_parallel_attention)", describe=describe,
                       exc=RuntimeError)
