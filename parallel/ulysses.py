"""Ulysses (all-to-all) and hybrid Ulysses x ring (USP) CP attention over packed THD batches.

Both keep the input in the zigzag layout (packing, RoPE positions and the loss do
not change) and are exact: the same blocks, backends and LSE merge as the ring.

``method="ulysses"`` (DeepSpeed-Ulysses): one all-to-all turns this rank's
``[T, H, D]`` rows of *all* heads into *all* global rows of ``H / C`` heads; the
rows are put in global order (:func:`a2a_index`, computed once per batch in the
plan), every document is attended **whole** by the block backend (one call, no
document cut into ``2C`` slivers), and a second all-to-all returns the output (and
its LSE) to the zigzag rows. The backward mirrors it: ``dout`` goes out like q,
dq/dk/dv come back like the output.

``method="hybrid", ulysses_size=U`` (USP, Fang & Zhao 2024): ``C = U x R``;
consecutive ranks ``[g U, (g + 1) U)`` form an all-to-all group and the ``R``
groups run the ring between them (ranks ``u, U + u, 2U + u, ...`` form a ring).
With consecutive groups the union of group ``g``'s zigzag chunks -- chunks
``g U .. g U + U - 1`` and ``2C - (g + 1) U .. 2C - 1 - g U`` of every sequence --
is chunk ``g`` and chunk ``2R - 1 - g`` of a zigzag split into ``2R`` chunks ``U``
times longer: the zigzag layout of a ring of size ``R``. So after the all-to-all
(rows put in *that* ring's local order) the ring code runs as is, with ``H / U``
heads, over the ring group. ``U = C`` is Ulysses (a ring of one rank: one block of
whole documents); ``U = 1`` is the ring (no all-to-all).

GQA without sending repeated K/V: with ``Hkv % U == 0`` each rank of the
all-to-all group gets ``Hkv / U`` kv heads; with ``U % Hkv == 0`` kv head ``j``
goes only to the ``U / Hkv`` ranks whose q heads use it (their ``Hq / U`` q heads
all lie in its group, since ``Hq / Hkv = (Hq / U)(U / Hkv)``), and its dK/dV
contributions are summed by the owner (fp32, fp64 for fp64 input). Anything else
raises ValueError with the arithmetic (:func:`check_ulysses_args`).

Communication per layer and rank (elements; T local rows, D head dim, ``Hkv'``
= the kv heads each rank of an all-to-all group receives, times U:
``max(Hkv, U)``; :func:`comm_volume` computes the bytes):

* ring: ``C - 1`` steps of K/V, ``2 T Hkv D`` each, every one overlapped with a
  block's compute; the backward sends K/V and dK/dV (fp32 beyond ``C = 2``) again.
* Ulysses: q, k, v out and the output (and its fp32 LSE, ``T Hq``) back, once each:
  ``(C - 1)/C T (2 Hq + 2 Hkv') D`` forward, the same backward (dout out, dq/dk/dv
  back); not overlapped (the attention needs all of it first), but independent of
  the number of steps.
* hybrid: the all-to-all of Ulysses within the group (``(U - 1)/U`` of it, on
  the group's own, typically intra-node, links) and a ring of ``R - 1`` steps of
  ``2 T Hkv D`` between groups (inter-node), overlapped as in the ring.

When to pick which: the ring hides its traffic when one step's compute (``~ T^2
Hq D / C`` per rank and step) outlasts sending ``2 T Hkv D`` to the neighbour --
long local shards, and few kv heads make it cheap. Ulysses sends ``(Hq + Hkv') /
(C Hkv)`` of the ring's bytes (fewer for MHA beyond C = 2, for Hq = 4 Hkv beyond
C = 5), in two exposed all-to-alls; it wins when the ring's
steps are too short to hide their exchange (many ranks, short shards, many
documents), on fast all-to-all links (NVLink within a node), and it needs
``Hq % C == 0``. Hybrid puts the all-to-all on the fast links inside a node and
the overlapped ring across nodes, and caps the head-count requirement at U.
Measured at cp 2 on two H200s (Hq 32 / Hkv 8, ``docs/benchmarks.md``): Ulysses
474.7 vs ring 466.9 ms fwd+bwd on one 131072-token sequence, 19.5 vs 14.2 ms on 64
documents of 2048 -- at C = 2 with GQA it sends more than the ring, as the model
says; hybrid is not timed yet.

Memory: the autograd Function saves the head-sharded q, k, v, out and LSE of the
gathered rows *instead of* the local ones (the same number of elements: the ring's
memory; k and v ``U / Hkv`` times larger when kv heads are shared); the exchange
buffers live only during the calls.

Process groups: the all-to-all and ring subgroups of a CP group are created once
(:func:`a2a_groups`, ``new_group(use_local_synchronization=True)`` with the CP
group's timeout, when the batch's plan is built) and cached per (group, U). A peer
that fails or disappears makes every collective raise after that timeout.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.distributed as dist

from cp_rope.validation import check_int

from . import _compat
from ._accumulate import Rows
from ._device import to_device
from ._window import check_window, window_ring_rows
from .choices import A2A_METHODS, METHODS
from .ring import ring_backward, ring_forward, ring_schedule
from .sharding import cp_shard_indices, rank_major_index

__all__ = ["A2A_METHODS", "check_ulysses_args", "a2a_index", "a2a_inner_layout", "a2a_groups",
           "a2a_schedule", "hybrid_forward", "hybrid_backward", "comm_volume"]


# --------------------------------------------------------------------------- arguments

def check_ulysses_args(method: str, ulysses_size, cp_size: int, q_heads: int,
                       kv_heads: int) -> int:
    """The all-to-all group size ``U`` of ``method`` (1 for ``"ring"`` / ``"allgather"``).

    ``"ulysses"``: ``ulysses_size`` None or ``cp_size``. ``"hybrid"``: an int that
    divides ``cp_size``. Then ``q_heads % U == 0`` and (``kv_heads % U == 0`` or
    ``U % kv_heads == 0``).

    Raises:
        TypeError: ``ulysses_size`` not an int (``check_int``).
        ValueError: ``ulysses_size`` given to another method, missing for hybrid,
            not dividing ``cp_size``, or head counts that do not split (the message
            shows the arithmetic).
    """
    if method not in A2A_METHODS:
        if ulysses_size is not None:
            raise ValueError(f"ulysses_size is only used with method='ulysses' or 'hybrid'; got "
                             f"ulysses_size={ulysses_size!r} with method={method!r}")
        return 1
    if ulysses_size is None:
        if method == "hybrid":
            raise ValueError(f"ulysses_size: method='hybrid' needs ulysses_size=U, a divisor of "
                             f"cp_size = {cp_size} (U = cp_size is 'ulysses', U = 1 'ring')")
        ulysses_size = cp_size
    u = check_int("ulysses_size", ulysses_size, min_value=1)
    if method == "ulysses" and u != cp_size:
        raise ValueError(f"ulysses_size: method='ulysses' exchanges over the whole CP group, so "
                         f"ulysses_size must be None or cp_size = {cp_size}, got {u} (use "
                         f"method='hybrid' for all-to-all groups of {u} ranks)")
    if cp_size % u:
        raise ValueError(f"ulysses_size must divide cp_size: {cp_size} % {u} = {cp_size % u} "
                         f"(C = U x R: U ranks per all-to-all group, R = C / U in the ring)")
    if q_heads % u:
        raise ValueError(f"q heads: the all-to-all gives each of its {u} ranks Hq / U q heads, "
                         f"but Hq % U = {q_heads} % {u} = {q_heads % u} != 0")
    if kv_heads % u and u % kv_heads:
        raise ValueError(f"k/v heads: the all-to-all over U = {u} ranks needs Hkv % U == 0 "
                         f"(Hkv / U kv heads per rank) or U % Hkv == 0 (each kv head to U / Hkv "
                         f"ranks); Hkv = {kv_heads}: {kv_heads} % {u} = {kv_heads % u}, "
                         f"{u} % {kv_heads} = {u % kv_heads}")
    return u


# --------------------------------------------------------------------------- layout

def a2a_index(cu: torch.Tensor, cp_size: int, ulysses_size: int, cp_rank: int) -> torch.Tensor:
    """Where the rows of the inner ring come from, after the all-to-all.

    Args:
        cu: host int ``[B + 1]`` *local* cu_seqlens (global / ``cp_size``).
        cp_size, ulysses_size, cp_rank: ``C``, ``U`` (divides C), this rank.

    Returns: host int64 ``[U n]`` (``n = cu[-1]``): row ``j`` of the inner ring's
    local order (the zigzag layout of ``R = C / U`` ranks, rank ``cp_rank // U``;
    global order when ``U = C``) is row ``index[j]`` of the all-to-all's receive
    buffer ``[U, n]`` (rank-major: ``u n + i`` is local row ``i`` of group rank ``u``).
    """
    C, U = cp_size, ulysses_size
    g, n = cp_rank // U, int(cu[-1])
    global_cu = (cu.to(torch.int64) * C).to(torch.int32)
    where = rank_major_index(global_cu, C, range(g * U, (g + 1) * U), stride=n)
    index = where[cp_shard_indices(global_cu, C // U, g)]
    if bool((index < 0).any()):  # the union of the group's chunks is the ring's layout
        raise AssertionError("a2a_index: the group's zigzag rows are not the ring's layout")
    return index


def a2a_inner_layout(lay):
    """The plan layout of the inner ring (a dataclass like ``lay`` with ``cu``,
    ``max_seqlen``, ``n_rows``, ``cp_size``, ``cp_rank``, ``ulysses_size``): ``R = C / U``
    ranks, rank ``cp_rank // U``, cu_seqlens and max_seqlen ``U`` times the local ones,
    ``U n`` rows (the padding rows past ``cu[-1]`` stay out of the all-to-all)."""
    u = lay.ulysses_size
    return dataclasses.replace(lay, cu=lay.cu * u, max_seqlen=lay.max_seqlen * u,
                               n_rows=int(lay.cu[-1]) * u, cp_size=lay.cp_size // u,
                               cp_rank=lay.cp_rank // u, ulysses_size=1)


def a2a_schedule(lay):
    """Ulysses / hybrid: the ring schedule of the inner ring (``C / U`` ranks, chunks ``U``
    times longer; one block of whole documents when ``U = C``) over the rows the all-to-all
    gathers; ``indices["a2a"]`` (:func:`a2a_index`) puts them in order."""
    blocks, _, terms = ring_schedule(a2a_inner_layout(lay))
    index = a2a_index(lay.cu, lay.cp_size, lay.ulysses_size, lay.cp_rank)
    return blocks, {"a2a": to_device(index, lay.device)}, terms


# --------------------------------------------------------------------------- groups

# parent group -> {U: (a2a, ring)}; weak keys: a destroyed CP group takes its subgroups along
# (a process group alive at interpreter exit can abort the process from its worker thread)
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def a2a_groups(group: dist.ProcessGroup, ulysses_size: int):
    """``(a2a_group, ring_group)`` of ``group`` split as ``C = U x R`` (cached).

    The all-to-all group of rank ``r`` is ranks ``[g U, (g + 1) U)`` of ``group``
    (``g = r // U``), its ring group ranks ``u, U + u, ...`` (``u = r % U``); ``None``
    for a group of one rank, ``group`` itself when it is the whole group. New groups
    are made with ``new_group(use_local_synchronization=True)`` (only their members
    take part; all all-to-all groups first, then the rings, disjoint within each
    kind, so no creation order can deadlock) and ``group``'s timeout. Collective
    over ``group`` the first time a (group, U) is seen.
    """
    by_size = _GROUPS.setdefault(group, {})
    got = by_size.get(ulysses_size)
    if got is None:
        C, r, U = dist.get_world_size(group), dist.get_rank(group), ulysses_size
        R, g, u = C // U, r // U, r % U
        timeout = _compat.group_timeout(group)

        def make(size, members):
            if size == 1:
                return None
            if size == C:
                return group
            ranks = [dist.get_global_rank(group, p) for p in members]
            return dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)

        a2a = make(U, range(g * U, (g + 1) * U))
        ring = make(R, range(u, C, U))
        got = by_size[ulysses_size] = (a2a, ring)
    return got


# --------------------------------------------------------------------------- exchange

def _a2a(x: torch.Tensor, group, async_op: bool = False):
    """``all_to_all_single`` of ``x`` ``[U, ...]`` (slot ``u`` to group rank ``u``);
    returns ``(recv, work)`` (``work`` None when done or when there is no group)."""
    if group is None:
        return x, None
    recv = torch.empty_like(x)
    work = dist.all_to_all_single(recv, x, group=group, async_op=async_op)
    return recv, work


def _heads_to_send(x: torch.Tensor, n: int, u: int, dst: torch.Tensor) -> None:
    """``dst[p] <-`` the heads of ``x[:n]`` ``[n, H, D]`` that group rank ``p`` needs:
    ``dst`` ``[U, n, H / U, D]`` when ``H % U == 0``, else ``[U, n, 1, D]`` with head
    ``p // (U / H)`` (``U % H == 0``: each head to the ``U / H`` ranks that use it)."""
    h = x.shape[1]
    if h % u == 0:
        dst.copy_(x[:n].unflatten(1, (u, h // u)).transpose(0, 1))
    else:  # broadcast, not repeat: each copy is written straight into the send buffer
        dst.unflatten(0, (h, u // h)).copy_(x[:n].transpose(0, 1)[:, None, :, None])


def _heads_received(recv: torch.Tensor, h: int, u: int, n: int, out: torch.Tensor) -> None:
    """Inverse of :func:`_heads_to_send`: ``out[:n]`` ``[n, H, D]`` ``<-`` the ``[U, n, h_l, D]``
    pieces back from every group rank (summed over the ranks that shared a kv head)."""
    if h % u == 0:
        out[:n].unflatten(1, (u, h // u)).copy_(recv.transpose(0, 1))
    else:
        out[:n].copy_(recv.unflatten(0, (h, u // h)).sum(1).squeeze(2).transpose(0, 1))


@dataclasses.dataclass(frozen=True)
class _InnerPlan:
    """What the ring functions read of a plan, for the inner ring over the gathered rows."""

    cp_size: int
    cp_rank: int
    blocks: dict
    terms: int
    n_valid: int
    n_tokens: int


def _setup(plan):
    u = plan.ulysses_size
    # a simulated rank (CPAttentionPlan.simulated: no group): loopback exchanges, the same
    # shapes and blocks, every "rank" of the all-to-all holding this rank's own rows
    a2a, ring = a2a_groups(plan.group, u) if plan.group is not None else (None, None)
    n = plan.n_valid
    inner = _InnerPlan(plan.cp_size // u, plan.cp_rank // u, plan.blocks, plan.terms, u * n, u * n)
    return u, n, a2a, ring, inner


def _local_heads(h: int, u: int) -> int:
    return h // u if h % u == 0 else 1


# --------------------------------------------------------------------------- forward / backward

def _local_sinks(sinks, plan):
    """The sink logits of this rank's ``Hq / U`` heads after the all-to-all (or None)."""
    if sinks is None:
        return None
    u, hq_l = plan.ulysses_size, plan.shape[0] // plan.ulysses_size
    g = plan.cp_rank % u  # rank in the all-to-all group: it receives heads [g hq_l, (g + 1) hq_l)
    return sinks[g * hq_l:(g + 1) * hq_l]


def hybrid_forward(group, q, k, v, plan, be, scale, sinks=None):
    """Hybrid (and Ulysses, ``U = C``) forward: all-to-all of q/k/v to ``H / U`` heads of
    the group's rows in the inner ring's order, the ring over the ring group (one block
    of whole documents when ``R = 1``), all-to-all of out/LSE back. Returns (out ``[T, Hq,
    D]``, lse ``[Hq, T]``, state for the backward). ``group`` is the CP group (the plan's)."""
    u, n, a2a, ring, inner = _setup(plan)
    hq, hkv, d = plan.shape
    hq_l, hkv_l = hq // u, _local_heads(hkv, u)
    index = plan.indices["a2a"]
    # one exchange for q, k and v: [U, n, hq_l + 2 hkv_l, D]
    send = q.new_empty((u, n, hq_l + 2 * hkv_l, d))
    for x, lo, hi in ((q, 0, hq_l), (k, hq_l, hq_l + hkv_l), (v, hq_l + hkv_l, hq_l + 2 * hkv_l)):
        _heads_to_send(x, n, u, send[:, :, lo:hi])
    recv, _ = _a2a(send, a2a)
    del send
    flat = recv.view(u * n, hq_l + 2 * hkv_l, d)
    qg, kg, vg = (flat[:, lo:hi].index_select(0, index)
                  for lo, hi in ((0, hq_l), (hq_l, hq_l + hkv_l), (hq_l + hkv_l, None)))
    del recv, flat
    # the window (if any) is in the inner ring's schedule: applied to the whole sequences;
    # the sinks to this rank's heads, once, after the inner ring's merge
    out_g, lse_g, auxs = ring_forward(ring, qg, kg, vg, inner, be, scale, _local_sinks(sinks, plan))
    # back to the receive order (rank-major), then to the owners: out and LSE together
    back = out_g.new_empty(out_g.shape).index_copy_(0, index, out_g)
    lse_back = lse_g.new_empty(lse_g.shape).index_copy_(1, index, lse_g)
    lse_back = lse_back.view(hq_l, u, n).transpose(0, 1).contiguous()
    got, work = _a2a(back.view(u, n, hq_l, d), a2a, async_op=True)
    got_lse, work_lse = _a2a(lse_back, a2a, async_op=True)
    out = q.new_empty(q.shape)
    lse = torch.full((hq, q.shape[0]), float("-inf"), dtype=lse_g.dtype, device=q.device)
    for w in (work, work_lse):
        if w is not None:
            w.wait()
    _heads_received(got, hq, u, n, out)
    out[n:] = 0
    lse[:, :n] = got_lse.view(hq, n)
    # the state: what the autograd Function saves *instead of* the local (q, k, v, out, lse)
    # -- the same number of elements, so the memory of the ring -- and the ring's own state
    return out, lse, ((qg, kg, vg, out_g, lse_g), auxs)


def hybrid_backward(group, dout, qg, kg, vg, out_g, lse_g, plan, be, scale, auxs, sinks=None):
    """Hybrid (and Ulysses) backward: all-to-all of dout like q, the ring backward on
    the head-sharded ``qg, kg, vg, out_g, lse_g`` the forward kept (its state), all-to-all
    of dq/dk/dv back (in the input dtype; fp32 / fp64 when kv heads were shared by ``U /
    Hkv`` ranks, whose parts the owner sums). Returns (dq, dk, dv) accumulators of the
    local ``[T, H, D]`` rows and the sinks' gradient of this rank's heads and gathered rows
    (zero for the other heads; None without sinks)."""
    u, n, a2a, ring, inner = _setup(plan)
    hq, hkv, d = plan.shape
    hq_l, hkv_l = hq // u, _local_heads(hkv, u)
    index = plan.indices["a2a"]
    send = dout.new_empty((u, n, hq_l, d))
    _heads_to_send(dout, n, u, send)
    recv, _ = _a2a(send, a2a)
    del send
    dout_g = recv.view(u * n, hq_l, d).index_select(0, index)
    del recv
    *grads, ds_l = ring_backward(ring, dout_g, qg, kg, vg, out_g, lse_g, inner, be, scale, auxs,
                                 _local_sinks(sinks, plan))
    del dout_g
    ds = None
    if ds_l is not None:
        ds = ds_l.new_zeros(hq)
        g = plan.cp_rank % u
        ds[g * hq_l:(g + 1) * hq_l] = ds_l
    shared = hkv % u != 0
    gd = torch.promote_types(plan.dtype, torch.float32) if shared else plan.dtype
    back = torch.empty((u * n, hq_l + 2 * hkv_l, d), dtype=gd, device=dout.device)
    for acc, lo, hi in zip(grads, (0, hq_l, hq_l + hkv_l), (hq_l, hq_l + hkv_l, None),
                           strict=True):
        back[:, lo:hi].index_copy_(0, index, acc.value().to(gd))
    del grads
    got, _ = _a2a(back.view(u, n, hq_l + 2 * hkv_l, d), a2a)
    del back
    result = []
    for h, lo, hi in ((hq, 0, hq_l), (hkv, hq_l, hq_l + hkv_l),
                      (hkv, hq_l + hkv_l, hq_l + 2 * hkv_l)):
        shape = (plan.n_tokens, h, d)
        g = torch.zeros(shape, dtype=gd, device=dout.device)
        _heads_received(got[:, :, lo:hi], h, u, n, g)
        result.append(Rows(shape, gd, dout.device, g))
    return (*result, ds)


# --------------------------------------------------------------------------- volume

def comm_volume(method: str, *, n_tokens: int, q_heads: int, kv_heads: int, head_dim: int,
                cp_size: int, ulysses_size: int | None = None, elem_bytes: int = 2,
                acc_bytes: int = 4, window: int | None = None, cu_seqlens=None,
                cp_rank: int | None = None) -> dict:
    """Bytes one rank sends per attention layer, forward and backward:
    ``{"forward": ..., "backward": ..., "overlapped": ...}`` (a model of the code's
    exchanges; ``tests/test_ulysses.py`` checks it against the bytes counted on gloo for
    ring, ulysses and hybrid).

    Args:
        method: ``"ring"``, ``"allgather"``, ``"ulysses"`` or ``"hybrid"``.
        n_tokens: local rows T (global / C, no trailing padding); head counts and
            head_dim: the layer's.
        cp_size, ulysses_size: C and U (hybrid; ulysses uses C).
        elem_bytes: bytes per element of q/k/v (2 for bf16).
        acc_bytes: bytes per element of what travels as an accumulator or LSE (4: fp32;
            8 for fp64 inputs): ring dK/dV beyond C = 2, the all-gather's dK/dV
            reduce-scatter, dK/dV of kv heads shared by ``U / Hkv`` ranks, the LSE.
        window, cu_seqlens, cp_rank: a sliding window ``W`` (None: none) changes the ring's
            bytes (and hybrid's inner ring's): each step sends only the rows the receiver
            sees (:mod:`cp_rope.parallel._window`), which depends on the documents, so a
            window needs this rank's local ``cu_seqlens`` (host ints ``[B + 1]``) and
            ``cp_rank``. The windowed ring's forward sends those rows of K and V; its
            backward sends them again and the received rows' dK/dV back (``acc_bytes``).
            All-gather and Ulysses move the same bytes with or without a window.

    ``"overlapped"``: bytes that travel while blocks compute (the ring's steps, the
    all-gather's forward gather). At C = 2 the ring's dK/dV travel in the input dtype
    (GPU backends; the reference backend's travel in fp32).

    Raises: ValueError for an unknown ``method``; TypeError / ValueError naming an int
    argument that is not an int or below its minimum (``n_tokens`` >= 0, the rest >= 1);
    as :func:`check_ulysses_args` for ``ulysses_size`` and head counts that the method
    cannot run.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of 'ring', 'allgather', 'ulysses', 'hybrid'; "
                         f"got {method!r}")
    n_tokens = check_int("n_tokens", n_tokens, min_value=0)
    for name, value in (("q_heads", q_heads), ("kv_heads", kv_heads), ("head_dim", head_dim),
                        ("cp_size", cp_size), ("elem_bytes", elem_bytes),
                        ("acc_bytes", acc_bytes)):
        check_int(name, value, min_value=1)
    check_ulysses_args(method, ulysses_size, cp_size, q_heads, kv_heads)
    window = check_window(window)
    C, T, D = cp_size, n_tokens, head_dim
    kv = 2 * T * kv_heads * D
    if C == 1:
        return {"forward": 0, "backward": 0, "overlapped": 0}
    halo = None
    if window is not None and method in ("ring", "hybrid"):
        if cu_seqlens is None or cp_rank is None:
            raise ValueError("window: comm_volume of a windowed ring needs cu_seqlens (this "
                             "rank's local ones) and cp_rank")
        check_int("cp_rank", cp_rank, min_value=0)
        U = 1 if method == "ring" else ulysses_size
        inner = torch.as_tensor(cu_seqlens, dtype=torch.int64) * U
        halo = window_ring_rows(inner, C // U, cp_rank // U, window)
    if method == "ring" and halo is not None:
        sent, got = halo
        fwd = sent * 2 * kv_heads * D * elem_bytes
        bwd = fwd + got * 2 * kv_heads * D * acc_bytes
        return {"forward": fwd, "backward": bwd, "overlapped": fwd + bwd}
    if method == "ring":
        fwd = (C - 1) * kv * elem_bytes
        bwd = (C - 1) * kv * elem_bytes + (C - 1) * kv * (elem_bytes if C == 2 else acc_bytes)
        return {"forward": fwd, "backward": bwd, "overlapped": fwd + bwd}
    if method == "allgather":
        fwd = (C - 1) * kv * elem_bytes
        # backward: the gather again, then the reduce-scatter of the global dK/dV
        bwd = (C - 1) * kv * elem_bytes + (C - 1) * kv * acc_bytes
        return {"forward": fwd, "backward": bwd, "overlapped": fwd}
    U = C if method == "ulysses" else ulysses_size
    R = C // U
    # of each all-to-all buffer, (U - 1) / U leaves the rank; kv heads shared by U / Hkv
    # ranks travel once per rank that uses them: max(Hkv, U) kv heads' worth
    q_el, kv_el = T * q_heads * D, 2 * T * max(kv_heads, U) * D
    g_bytes = acc_bytes if kv_heads % U else elem_bytes
    a2a_fwd = (q_el + kv_el + q_el) * elem_bytes + T * q_heads * acc_bytes  # + the LSE
    a2a_bwd = q_el * elem_bytes + (q_el + kv_el) * g_bytes
    # the inner ring moves U T rows of Hkv / U (or 1) kv heads per step
    ring_kv = 2 * U * T * max(kv_heads // U, 1) * D
    ring_fwd = (R - 1) * ring_kv * elem_bytes
    ring_bwd = (R - 1) * ring_kv * (elem_bytes + (elem_bytes if R == 2 else acc_bytes))
    if halo is not None:  # the windowed inner ring: only the rows each rank sees
        row = 2 * max(kv_heads // U, 1) * D
        ring_fwd = halo[0] * row * elem_bytes
        ring_bwd = ring_fwd + halo[1] * row * acc_bytes
    return {"forward": a2a_fwd * (U - 1) // U + ring_fwd,
            "backward": a2a_bwd * (U - 1) // U + ring_bwd,
            "overlapped": ring_fwd + ring_bwd}
