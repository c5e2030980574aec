"""The per-batch plan of CP attention: every block of every CP method, built once.

A :class:`CPAttentionPlan` is built once per batch from the batch's *host*
``cu_seqlens`` and the CP group, then handed to every layer's
:func:`~cp_rope.parallel.context_parallel_attention` call. It holds

* the cross-rank agreement: at build, the ranks of the group all-gather
  their whole ``cu_seqlens`` (and ``seq_lens``, shapes, dtype, flags) and every
  rank raises if any two differ -- so no layer needs a collective to check;
* the block schedule of the CP method (:class:`~cp_rope.parallel._blocks.Block`
  objects: segment boundaries on the device *and* on the host, their host
  max lengths, the query rows a block gives no key);
* the index tensors a method needs (the all-gather's global order of K/V);
* host counts (``n_valid``: rows before ``cu_seqlens[-1]``).

With a plan a call reads nothing from the device: no device-to-host sync.
Building one reads ``cu_seqlens`` on the host (one sync if it is a device
tensor) and, with ``cp_size > 1``, runs one ``all_gather_object``.

Methods hang their schedules here: ``_SCHEDULES[method](layout)`` returns
``(blocks, indices, terms)``, a dict of block tuples by phase, a dict of
index tensors by name, and how many partials one output row sums. A new CP
method adds its builder to ``_SCHEDULES`` (its forward/backward functions
read ``plan.blocks[...]`` / ``plan.indices[...]``).
"""

from __future__ import annotations

import dataclasses

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
from ._blocks import Block
from .sharding import cp_shard_indices
from .ulysses import A2A_METHODS, a2a_groups, a2a_index, a2a_inner_layout, check_ulysses_args

__all__ = ["CPAttentionPlan", "METHODS"]

METHODS = ("ring", "allgather", *A2A_METHODS)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What a schedule builder sees: host int64 ``cu`` [B + 1], sizes, CP position."""

    cu: torch.Tensor
    max_seqlen: int
    n_rows: int
    cp_size: int
    cp_rank: int
    causal: bool
    seq_lens: torch.Tensor | None  # host int64 [B] true global lengths (causal=False only)
    device: torch.device
    ulysses_size: int = 1  # all-to-all group size U (ulysses / hybrid)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> ``device`` without a sync (pinned, non-blocking: the host tensor is
    kept by the plan, so its memory outlives the copy)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _segments(lay: _Layout, q_starts, q_end, k_starts, k_end, max_q, max_k, causal,
              split_q=False) -> Block:
    """A :class:`Block` from per-sequence segment starts (each a host ``[B]`` tensor).

    ``split_q``: see :attr:`Block.split_q`.
    """
    cu_q = torch.cat([torch.stack(q_starts, 1).flatten(), q_end.view(1)])
    cu_k = torch.cat([torch.stack(k_starts, 1).flatten(), k_end.view(1)])
    lq, lk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    keyless = (lq > 0) & (lk == 0)  # query rows of these segments see no key in this block
    rows = None
    if bool(keyless.any()):
        starts, lens = cu_q[:-1][keyless], lq[keyless]
        first = torch.repeat_interleave(starts - (lens.cumsum(0) - lens), lens)
        rows = _to_device(first + torch.arange(int(lens.sum())), lay.device)
    cu_q32, cu_k32 = cu_q.to(torch.int32), cu_k.to(torch.int32)
    return Block(_to_device(cu_q32, lay.device), _to_device(cu_k32, lay.device), max_q, max_k,
                 causal, split_q=split_q, keyless_rows=rows, cu_q_host=cu_q32, cu_k_host=cu_k32)


def _real_key_counts(lay: _Layout) -> torch.Tensor:
    """``[C, B]`` host: keys of rank p's local sequence b that are not padding (a prefix)."""
    cu, C = lay.cu, lay.cp_size
    lens = cu[1:] - cu[:-1]
    seq_id = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    counts = torch.zeros(C, lens.numel(), dtype=torch.int64)
    for p in range(C):
        real = global_positions(cu.to(torch.int32), C, p) < lay.seq_lens[seq_id]
        counts[p].index_add_(0, seq_id, real.to(torch.int64))
    return counts


def _ring_schedule(lay: _Layout):
    """Ring (TransformerEngine's load-balanced ring): step ``i`` holds the K/V of rank
    ``src = (r - i) mod C``; see :mod:`cp_rope.parallel.attention`."""
    C, r, M, causal = lay.cp_size, lay.cp_rank, lay.max_seqlen, lay.causal
    a, e, end = lay.cu[:-1], lay.cu[1:], lay.cu[-1]
    h = (e - a) // 2
    seg = lambda *args, **kw: _segments(lay, *args, **kw)
    steps = []
    if not causal:
        real = None if lay.seq_lens is None else _real_key_counts(lay)
        for i in range(C):
            src = (r - i) % C
            ks = [a] if real is None else [a, a + real[src]]
            qs = [a] if real is None else [a, e]
            steps.append(seg(qs, end, ks, end, M, M, False))
        return {"ring": tuple(steps)}, {}, C
    diagonal = seg([a], end, [a], end, M, M, True)
    # the same Block object for every step of a kind: backends may cache per block
    first_half = seg([a, e], end, [a, a + h], end, M, M // 2, False, split_q=True) if r > 0 else None
    second_half = seg([a, a + h], end, [a, a], end, M // 2, M, False) if r < C - 1 else None
    for i in range(C):
        src = (r - i) % C
        steps.append(diagonal if i == 0 else first_half if src < r else second_half)
    return {"ring": tuple(steps)}, {}, C


def _allgather_schedule(lay: _Layout):
    """All-gather (Llama 3 / TransformerEngine): the local block, then the gathered K/V in
    global order (``indices["kv"]``: rows of the rank-major ``[C, 2 (k, v), T]`` buffer)."""
    C, r, M, n_rows = lay.cp_size, lay.cp_rank, lay.max_seqlen, lay.n_rows
    cu = lay.cu
    a, e, end = cu[:-1], cu[1:], cu[-1]
    h = (e - a) // 2
    seg = lambda *args, **kw: _segments(lay, *args, **kw)
    n_local = int(end)
    global_cu = (cu * C).to(torch.int32)
    global_index = torch.empty(C * n_local, dtype=torch.int64)
    for p in range(C):
        global_index[cp_shard_indices(global_cu, C, p)] = p * n_rows + torch.arange(n_local)
    base = (global_index // n_rows) * (2 * n_rows) + global_index % n_rows
    indices = {"kv": _to_device(torch.cat([base, base + n_rows]), lay.device)}
    ga, gend = a * C, end * C
    if lay.causal:
        # local: each half causally against itself; global: unmasked prefixes
        local = (seg([a, a + h], end, [a, a + h], end, M // 2, M // 2, True),)
        pre1, pre2 = r, 2 * C - 1 - r  # chunks before chunk r / before chunk 2C-1-r
        # max_k bounds every segment, the skipped tail ((2C - r) chunks) too: flash's
        # backward grid covers max_k keys and must write dK/dV = 0 there
        glob = (seg([a, a + h, e], end, [ga, ga + pre1 * h, ga + pre1 * h], gend,
                    M // 2, (2 * C - r) * (M // 2) if r > 0 else 0, False),
                seg([a, a + h, e], end, [ga, ga, ga + pre2 * h], gend,
                    M // 2, pre2 * (M // 2), False))
        return {"local": local, "global": glob}, indices, 2
    n_real = (e - a) * C if lay.seq_lens is None else lay.seq_lens
    glob = (seg([a, e], end, [ga, ga + n_real], gend, M, C * M, False),)
    return {"local": (), "global": glob}, indices, 1


def _a2a_schedule(lay: _Layout):
    """Ulysses / hybrid (:mod:`cp_rope.parallel.ulysses`): the ring schedule of the inner
    ring (``C / U`` ranks, chunks ``U`` times longer; one block of whole documents when
    ``U = C``) over the rows the all-to-all gathers; ``indices["a2a"]`` puts them in order."""
    blocks, _, terms = _ring_schedule(a2a_inner_layout(lay))
    index = a2a_index(lay.cu, lay.cp_size, lay.ulysses_size, lay.cp_rank)
    return blocks, {"a2a": _to_device(index, lay.device)}, terms


_SCHEDULES = {"ring": _ring_schedule, "allgather": _allgather_schedule,
              "ulysses": _a2a_schedule, "hybrid": _a2a_schedule}


class CPAttentionPlan:
    """Everything :func:`~cp_rope.parallel.context_parallel_attention` derives from one
    batch's layout, built once per batch with :meth:`build` and reused by every layer
    (forward and backward): a call with ``plan=`` does no device-to-host sync.

    Attributes (read-only): ``cu_seqlens`` (int32 ``[B + 1]`` on the device),
    ``cu_seqlens_host`` (the same on the CPU), ``max_seqlen``, ``n_tokens`` (rows T of
    q/k/v), ``n_valid`` (``cu_seqlens[-1]``), ``n_seqs`` (B), ``group``, ``cp_size``,
    ``cp_rank``, ``method``, ``causal``, ``seq_lens``, ``ulysses_size`` (all-to-all group
    size U of ulysses / hybrid, else 1), ``shape`` (``(Hq, Hkv, D)``),
    ``dtype``, ``device``; the schedule ``blocks`` (dict of block tuples by phase),
    ``indices`` (dict of device index tensors) and ``terms``.
    """

    __slots__ = ("cu_seqlens", "cu_seqlens_host", "max_seqlen", "n_tokens", "n_valid", "n_seqs",
                 "group", "cp_size", "cp_rank", "method", "causal", "seq_lens", "shape", "dtype",
                 "device", "blocks", "indices", "terms", "ulysses_size")

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, max_seqlen: int, *, q_heads: int, kv_heads: int,
              head_dim: int, dtype: torch.dtype, device: torch.device | str,
              n_tokens: int | None = None, group: dist.ProcessGroup | None = None,
              causal: bool = True, method: str = "ring",
              seq_lens: torch.Tensor | None = None,
              ulysses_size: int | None = None) -> CPAttentionPlan:
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

        Raises:
            TypeError / ValueError: a bad argument, named (cu_seqlens content included).
            RuntimeError: the ranks of the group disagree (every rank raises; the message
                shows each rank's values), or a rank's own arguments were bad (the other
                ranks raise naming it).
        """
        check_cu_seqlens(cu_seqlens)
        max_seqlen = check_max_seqlen(max_seqlen, allow_none=False)
        q_heads = check_int("q_heads", q_heads, min_value=1)
        kv_heads = check_int("kv_heads", kv_heads, min_value=1)
        head_dim = check_int("head_dim", head_dim, min_value=1)
        if dtype not in _DTYPES:
            raise TypeError(f"dtype must be float16/bfloat16/float32/float64, got {dtype}")
        if q_heads % kv_heads:
            raise ValueError(f"q heads ({q_heads}) must be a multiple of k/v heads ({kv_heads})")
        check_bool("causal", causal)
        check_choice("method", method, METHODS)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        group, cp_size, cp_rank = _position(group)
        cu_host = cu_seqlens.detach().to("cpu")  # the one read of a device cu_seqlens
        n_valid = int(cu_host[-1])
        if n_tokens is None:
            n_tokens = n_valid
        n_tokens = check_int("n_tokens", n_tokens, min_value=0)
        seq_host = None
        error = None
        ulysses = 1
        try:
            check_cu_seqlens_content(cu_host, n_tokens=n_tokens, cp_size=cp_size,
                                     max_seqlen=max_seqlen)
            seq_host = _check_seq_lens(seq_lens, cu_host, causal, cp_size)
            ulysses = check_ulysses_args(method, ulysses_size, cp_size, q_heads, kv_heads)
        except (TypeError, ValueError) as exc:
            error = exc
        if group is not None:  # cp_size > 1
            sig = {"q": (n_tokens, q_heads, head_dim), "k": (n_tokens, kv_heads, head_dim),
                   "dtype": str(dtype), "max_seqlen": max_seqlen, "causal": causal,
                   "method": method, "ulysses_size": ulysses_size, "cu_seqlens": cu_host.tolist(),
                   "seq_lens": None if seq_host is None else seq_host.tolist()}
            _check_across_ranks(group, sig, error)
        elif error is not None:
            raise error
        self = object.__new__(cls)
        self.cu_seqlens = (cu_seqlens if cu_seqlens.device == device
                           else _to_device(cu_host, device))
        self.cu_seqlens_host, self.max_seqlen, self.n_tokens = cu_host, max_seqlen, n_tokens
        self.n_valid, self.n_seqs = n_valid, cu_host.numel() - 1
        self.group, self.cp_size, self.cp_rank = group, cp_size, cp_rank
        self.method, self.causal, self.seq_lens = method, causal, seq_lens
        self.shape, self.dtype, self.device = (q_heads, kv_heads, head_dim), dtype, device
        self.ulysses_size = ulysses
        layout = _Layout(cu_host.to(torch.int64), max_seqlen, n_tokens, cp_size, cp_rank, causal,
                         seq_host, device, ulysses)
        schedule = _SCHEDULES[method if cp_size > 1 else "ring"]
        self.blocks, self.indices, self.terms = schedule(layout)
        if self.algorithm in A2A_METHODS and group is not None:  # subgroups now (collective), cached
            a2a_groups(group, ulysses)
        return self

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

    def check_call(self, q, k, cu_seqlens, max_seqlen, group, causal, method, seq_lens,
                   ulysses_size=None) -> None:
        """Raise ValueError naming ``plan`` if a call's arguments are not the plan's batch.

        Host checks only (no sync): shapes, dtype, device, the group object, the flags,
        and ``cu_seqlens`` / ``seq_lens`` are the plan's own tensors (or None).
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
        if group is not self.group:
            raise ValueError("plan: built for another CP group (pass the group the plan was "
                             "built with)")
        if cu_seqlens is not None and cu_seqlens is not self.cu_seqlens \
                and cu_seqlens is not self.cu_seqlens_host:
            raise ValueError("plan: cu_seqlens is not the plan's (plan.cu_seqlens); the batch "
                             "changed? Build a plan per batch, or pass cu_seqlens=None")
        if max_seqlen is not None and max_seqlen != self.max_seqlen:
            raise ValueError(f"plan: built for max_seqlen {self.max_seqlen}, got {max_seqlen}")
        if causal != self.causal or method != self.method:
            raise ValueError(f"plan: built for causal={self.causal}, method={self.method!r}; got "
                             f"causal={causal}, method={method!r}")
        if ulysses_size is not None and ulysses_size != self.ulysses_size:
            raise ValueError(f"plan: built for ulysses_size={self.ulysses_size}, got {ulysses_size}")
        if seq_lens is not None and seq_lens is not self.seq_lens:
            raise ValueError("plan: seq_lens is not the plan's (pass seq_lens=None with a plan)")

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


def _position(group) -> tuple[dist.ProcessGroup | None, int, int]:
    """``(group, cp_size, cp_rank)``: group None at cp_size 1 and for a simulated rank."""
    if isinstance(group, _SimulatedGroup):
        return None, group.size, group.rank
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


def _check_across_ranks(group, sig: dict, error: Exception | None) -> None:
    """:func:`agree_across_ranks` for plan builds: RuntimeError on the ranks whose own
    arguments passed, naming the keys of ``sig`` that differ and every rank's values."""

    def describe(sigs: list) -> str:
        def show(v):
            text = str(v)
            return text if len(text) <= 120 else text[:117] + "..."

        diff = [key for key in sigs[0] if any(s[key] != sigs[0][key] for s in sigs)]
        return "inputs differ across the ranks of the CP group:\n" + "\n".join(
            f"  rank {i}: " + ", ".join(f"{key}={show(s[key])}" for key in diff)
            for i, s in enumerate(sigs))

    agree_across_ranks(group, error, sig, what="context_parallel_attention", describe=describe,
                       exc=RuntimeError)
