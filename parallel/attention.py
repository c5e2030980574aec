"""Context-parallel attention over varlen (THD) sequences in the zigzag layout.

:func:`context_parallel_attention` is attention over the *global* sequences
while each rank holds only its zigzag shard (rank ``r`` keeps chunks ``r`` and
``2C - 1 - r`` of every sequence, see :mod:`cp_rope.parallel.sharding`). Two
schedules, both exact (partials merged through their log-sum-exp):

``method="ring"`` (TransformerEngine's load-balanced ring / ring-flash-attention):
K/V (with their own head count, never repeated for GQA) travel around the
ring in ``C`` steps, the next exchange in flight while the current block
computes. At step ``i`` rank ``r`` holds the K/V of ``src = (r - i) mod C``:

* step 0: the local causal block (row ``j`` sees local keys ``<= j``, which in
  the zigzag layout is causal by global position);
* ``src < r``: every local query sees the first half (chunk ``src``) of every
  received sequence, unmasked;
* ``src > r``: the second half (chunk ``2C - 1 - r``) of the local queries sees
  all received keys, unmasked.

Every rank does the same work at every step. The backward runs the ring
again; the dK/dV of a received block travel with the K/V (``C - 1`` hops, the
owner's own step-0 dK/dV stay home) and reach their owner one exchange after
the last step, in the input dtype at ``C = 2`` and in fp32 beyond (see the
memory notes above ``_acc_dtype``).

``method="allgather"`` (TransformerEngine's all-gather CP / Llama 3): K/V are
all-gathered (overlapped with the local diagonal block) and put in global
order; each local query chunk attends its causal prefix; the backward
reduce-scatters dK/dV (all-reduce + slice on gloo). One collective of
``C x`` the K/V instead of ``C - 1`` ring steps: it can win with GQA (small
K/V) when the ring steps are too short to hide their communication; the ring
needs ``1 / C`` of the K/V memory and overlaps its exchanges with compute
(see "Choosing the method" in :func:`context_parallel_attention`).

The three parts stay apart: the *plan* (what each step computes,
:class:`~cp_rope.parallel.plan.CPAttentionPlan`, built once per batch), the
*exchange* (how data moves: :class:`~cp_rope.parallel._ring.RingExchange`,
:class:`_Gather`) and the *block backend* (how a block runs,
:mod:`cp_rope.parallel._blocks`). One forward and one backward function per
method, ``(group, q, k, v, plan, be, scale)``, dispatched by one autograd
Function.

Host syncs: none in a call given ``plan=`` (forward and backward). Without
it the call builds the plan: it reads ``cu_seqlens`` on the host (one sync for
a device tensor) and, with ``C > 1``, all-gathers the ranks' signatures.
"""

from __future__ import annotations

import math
import numbers
from functools import partial
from typing import Literal

import torch
import torch.distributed as dist

from cp_rope.validation import check_bool, check_choice, check_cu_seqlens

from . import _compat
from ._accumulate import OutAcc, Rows, acc_dtype, add_grads, mask_pad
from ._blocks import get_backend
from ._ring import ring_exchange
from .plan import METHODS, CPAttentionPlan
from .ulysses import A2A_METHODS, hybrid_backward, hybrid_forward

__all__ = ["context_parallel_attention", "CPAttentionPlan"]

Method = Literal["ring", "allgather", "ulysses", "hybrid"]
BackendName = Literal["auto", "cudnn", "flash_attn", "torch_flash", "torch_cudnn", "reference"]
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int | None,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    method: Method = "ring",
    backend: BackendName = "auto",
    seq_lens: torch.Tensor | None = None,
    plan: CPAttentionPlan | None = None,
    return_lse: bool = False,
    ulysses_size: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of sequences split across the CP group in the zigzag layout.

    Args:
        q: ``[T, Hq, D]`` float16/bfloat16/float32/float64, this rank's rows.
        k, v: ``[T, Hkv, D]``, same dtype and device, ``Hq % Hkv == 0`` (GQA).
        cu_seqlens: int32 ``[B + 1]`` *local* cumulative lengths (global / C),
            the same on every rank, on q's device; rows from ``cu_seqlens[-1]``
            on are trailing padding. With ``C > 1`` every local length is even.
            With ``plan``: None or the plan's own tensor.
        max_seqlen: host int >= the longest *local* sequence (with ``plan``:
            None or the plan's value).
        group: the CP process group; ``None`` or a group of one rank gives
            plain varlen attention (same block code).
        causal: causal by global position inside each sequence; ``False``:
            every query sees every (real) key of its sequence.
        softmax_scale: default ``1 / sqrt(D)``.
        method: ``"ring"``, ``"allgather"``, ``"ulysses"`` or ``"hybrid"`` (see
            "Choosing the method" below and :mod:`cp_rope.parallel.ulysses`).
        backend: ``"auto"``, ``"cudnn"``, ``"flash_attn"``, ``"torch_flash"``,
            ``"torch_cudnn"`` or ``"reference"``. Support (else ValueError with
            the reason): reference: any device and dtype (fp32 math, fp64 for
            fp64 input); cudnn: CUDA sm80+, fp16/bf16, D <= 128, D % 8 == 0,
            the ``nvidia-cudnn-frontend`` >= 1.32 package (the extra ``cudnn``;
            the error gives the install command); torch_flash / flash_attn:
            CUDA, fp16/bf16, D <= 256, D % 8 == 0; torch_cudnn: CUDA sm80+,
            cuDNN >= 9, fp16/bf16, D <= 128, one sequence per batch (B == 1).
            ``auto``: the first of cudnn, flash_attn, torch_cudnn, torch_flash,
            reference that runs the inputs.
        seq_lens: only with ``causal=False``: int ``[B]`` true (unpadded)
            *global* lengths; keys at global position ``>= seq_lens[b]`` are
            masked. Required when ``C > 1`` (zigzag pads every sequence to a
            multiple of ``2C``); pass the padded lengths if nothing is padded.
            With ``causal=True`` padding sits after the real tokens and never
            reaches them, so seq_lens is refused. With ``plan``: None or the
            plan's own tensor.
        plan: the batch's :class:`CPAttentionPlan` (``CPAttentionPlan.build``),
            built once per batch and passed to every layer: the call then does
            no device-to-host sync and no collective beyond the method's own
            data exchange. Its arguments (group, causal, method, shapes, dtype,
            device) must match the call's. Without it the call builds one.
        return_lse: also return the merged log-sum-exp (natural log of the sum
            of ``exp(scale * q.k)`` over every key a query sees).
        ulysses_size: ``method="hybrid"``: the all-to-all group size U, a divisor
            of C (consecutive ranks; C / U groups in a ring); ``"ulysses"``: None
            or C; other methods: None. Needs ``Hq % U == 0`` and ``Hkv % U == 0``
            or ``U % Hkv == 0`` (ValueError with the arithmetic).

    Choosing the method: ``"ring"`` (the default) holds one extra K/V block
    (``1 / C`` of the global K/V) and overlaps every exchange with a step of
    compute; its steps are balanced (zigzag), so it scales as long as one step's
    compute (``~ T^2 Hq D`` per rank) outlasts sending ``2 T Hkv D`` elements to
    the neighbour -- true for long local sequences (measured on 2 H200s, 131072
    tokens, Hq 32 / Hkv 8: ring 467 ms vs all-gather 475 ms fwd+bwd, 6.9 vs
    8.4 GiB; 64 documents of 2048: 35 vs 54 ms). ``"allgather"`` gathers the
    whole K/V (``C x`` the local K/V, plus an fp32 global dK/dV in the backward)
    in one collective overlapped only with the local diagonal block, and its
    dK/dV reduce-scatter is exposed; pick it when the per-step compute is too
    short to hide a ring exchange (many ranks with short local shards) and the
    gathered K/V are small (GQA with few KV heads), or to have a single
    collective per direction (e.g. a slow or latency-bound interconnect where
    ``C - 1`` serial steps cost more than one all-gather).

    Returns: ``[T, Hq, D]`` in q's dtype, differentiable w.r.t. q, k and v
    (with ``return_lse``: ``(out, lse)``, lse ``[Hq, T]`` float32 -- float64 for
    float64 inputs -- not differentiable, -inf where a query sees no key).
    Rows at or beyond ``cu_seqlens[-1]`` are 0 (LSE -inf) and get gradients 0;
    a query that sees no key (non-causal all-padding sequence) gets 0.

    Raises:
        TypeError / ValueError: naming the bad argument (shapes, dtypes,
            cu_seqlens content, unsupported backend / dtype / head dim
            combinations, a ``plan`` that does not match the call).
        RuntimeError: ranks of the group disagree on shapes, dtype, cu_seqlens
            (compared whole), seq_lens, max_seqlen, causal or method (the
            message shows every rank's values), checked when the plan is built,
            before any data moves; a peer that fails or disappears makes the
            collectives raise after the group's timeout.
    """
    _check_tensors(q, k, v)
    check_bool("causal", causal)
    check_bool("return_lse", return_lse)
    check_choice("method", method, METHODS)
    if softmax_scale is not None and (isinstance(softmax_scale, bool)
                                      or not isinstance(softmax_scale, numbers.Real)):
        raise TypeError(f"softmax_scale must be a float or None, got "
                        f"{type(softmax_scale).__name__}")
    if softmax_scale is not None and not 0 < softmax_scale < math.inf:
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale!r}")
    if plan is None:
        check_cu_seqlens(cu_seqlens, device=q.device)
        plan = CPAttentionPlan.build(
            cu_seqlens, max_seqlen, q_heads=q.shape[1], kv_heads=k.shape[1], head_dim=q.shape[2],
            dtype=q.dtype, device=q.device, n_tokens=q.shape[0], group=group, causal=causal,
            method=method, seq_lens=seq_lens, ulysses_size=ulysses_size)
    elif not isinstance(plan, CPAttentionPlan):
        raise TypeError(f"plan must be a CPAttentionPlan, got {type(plan).__name__}")
    else:
        plan.check_call(q, k, cu_seqlens, max_seqlen, group, causal, method, seq_lens,
                        ulysses_size)
    be = get_backend(backend, q, plan.n_seqs)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    out, lse = _CPAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), plan, be, scale)
    return (out, lse) if return_lse else out


def _check_tensors(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be [T, H, D], got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float16/bfloat16/float32/float64, got {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in T and D")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} "
                         f"on {q.device}/{k.device}/{v.device}")


# --------------------------------------------------------------------------- exchange

class _Gather:
    """All-gather of stacked K/V ``[2, T, Hkv, D]`` into global order (async start, wait)."""

    def __init__(self, kv, group, plan):
        self.group, self.plan, self.shape = group, plan, kv.shape
        C = plan.cp_size
        self.buf = kv.new_empty((C, *kv.shape))
        if group is None:  # a simulated rank: every rank's K/V are this rank's
            self.buf.copy_(kv.expand(C, *kv.shape))
            self.work = None
        elif dist.get_backend(group) == "gloo":
            self.work = dist.all_gather(list(self.buf.unbind(0)), kv, group=group, async_op=True)
        else:
            # concatenation form [C * 2, T, ...]: the one every backend accepts
            self.work = _compat.all_gather_single(self.buf.flatten(0, 1), kv, group=group,
                                                  async_op=True)

    def wait(self):
        if self.work is not None:
            self.work.wait()
            self.work = None  # release the gloo/NCCL work (and its tensors) now
        rest = self.shape[2:]  # one gather from the [C, 2, T] buffer into [2, C*T] global order
        flat = self.buf.view(-1, *rest).index_select(0, self.plan.indices["kv"])
        return flat.view(2, -1, *rest)


def _scatter_global_grads(dkv_glob, plan, group, n_rows):
    """Global-order dK/dV ``[2, C*n, Hkv, D]`` -> this rank's summed share ``[2, T, Hkv, D]``."""
    C, rest = plan.cp_size, dkv_glob.shape[2:]
    # straight into the rank-major [C, 2, T] layout of the reduce-scatter (no transposed copy):
    # gathered row p * T + i (global_index) is per_rank[p, 0 (k) / 1 (v), i]
    per_rank = dkv_glob.new_zeros((C, 2, n_rows, *rest))
    per_rank.view(C * 2 * n_rows, *rest).index_copy_(0, plan.indices["kv"], dkv_glob.reshape(-1, *rest))
    if group is None:  # a simulated rank: no other rank to sum with
        return per_rank[plan.cp_rank]
    if dist.get_backend(group) == "gloo":  # reduce_scatter is missing from gloo in older torch
        dist.all_reduce(per_rank, group=group)
        return per_rank[plan.cp_rank]
    out = per_rank.new_empty(per_rank.shape[1:])
    _compat.reduce_scatter_single(out, per_rank.flatten(0, 1), group=group)
    return out


# --------------------------------------------------------------------------- ring

def ring_forward(group, q, k, v, plan, be, scale):
    """Ring forward: ``C`` steps, the next K/V exchange in flight while a block computes.
    Returns (out, lse, per-step backend state)."""
    acc = OutAcc(q, acc_dtype(q.dtype, plan.terms, be))
    auxs = []
    C = plan.cp_size
    ring = ring_exchange(group) if C > 1 else None
    kv = (k, v)
    for i, blk in enumerate(plan.blocks["ring"]):
        if i + 1 < C:
            ring.start(kv)
        parts, aux = be.forward(q, kv[0], kv[1], blk, scale)
        auxs.append(aux)
        acc.add(parts, first=i == 0)
        del parts  # before the next block's kernel allocates its own
        if i + 1 < C:
            kv = ring.wait()
    return (*acc.result(plan, q.dtype), auxs)


def ring_backward(group, dout, q, k, v, out, lse, plan, be, scale, auxs):
    """Ring backward: the K/V travel again, with the dK/dV of the block in hand; they reach
    their owner one exchange after the last step. Returns (dq, dk, dv) accumulators."""
    C, dev = plan.cp_size, q.device
    dq = Rows(q.shape, acc_dtype(q.dtype, plan.terms, be), dev)
    home = acc_dtype(q.dtype, min(plan.terms, 2), be)  # own block + what comes back
    dk, dv = Rows(k.shape, home, dev), Rows(v.shape, home, dev)
    kv_ring = ring_exchange(group) if C > 1 else None
    dkv_ring = ring_exchange(group) if C > 1 else None
    # C - 1 steps' dK/dV, then added to the owner's: the input dtype at C = 2 (one term, or
    # the two query halves of a split torch_cudnn block summed and rounded once: then one
    # rounding more than fp32 accumulators; sending half the bytes of fp32 on the one
    # exchange the backward cannot overlap), fp32 beyond
    travel = acc_dtype(q.dtype, C, be)
    lse_b = be.prepare_lse(lse)
    kv = (k, v)
    for i, blk in enumerate(plan.blocks["ring"]):
        if i + 1 < C:
            kv_ring.start(kv)
        grads = be.backward(dout, q, kv[0], kv[1], out, lse_b, blk, scale, auxs[i])
        if i == 0:
            add_grads(dq, dk, dv, grads)
        else:  # dK/dV of the K/V in hand: summed by the ranks it visited, then here
            if i == 1:
                tk, tv = Rows(k.shape, travel, dev), Rows(v.shape, travel, dev)
            else:
                tk, tv = (Rows(k.shape, travel, dev, t) for t in dkv_ring.wait())
            add_grads(dq, tk, tv, grads)
            del grads
            dkv_ring.start((tk.value(), tv.value()))
            del tk, tv
        if i + 1 < C:
            kv = kv_ring.wait()
    del kv
    if C > 1:  # our own K/V's dK/dV, back from the last rank they visited
        back_k, back_v = dkv_ring.wait()
        dk.add(0, back_k)
        dv.add(0, back_v)
    return dq, dk, dv


# --------------------------------------------------------------------------- all-gather

def allgather_forward(group, q, k, v, plan, be, scale):
    """All-gather forward: the local block while K/V gather, then the global blocks."""
    acc = OutAcc(q, acc_dtype(q.dtype, plan.terms, be))
    auxs = []
    gather = _Gather(torch.stack([k, v]), group, plan)
    for blk in plan.blocks["local"]:
        parts, aux = be.forward(q, k, v, blk, scale)
        auxs.append(aux)
        acc.add(parts, first=len(auxs) == 1)
    kv = gather.wait()
    for blk in plan.blocks["global"]:
        parts, aux = be.forward(q, kv[0], kv[1], blk, scale)
        auxs.append(aux)
        acc.add(parts, first=len(auxs) == 1)
    return (*acc.result(plan, q.dtype), auxs)


def allgather_backward(group, dout, q, k, v, out, lse, plan, be, scale, auxs):
    """All-gather backward: K/V gathered again; dK/dV reduce-scattered to their owners."""
    C, dev = plan.cp_size, q.device
    dq = Rows(q.shape, acc_dtype(q.dtype, plan.terms, be), dev)
    home = acc_dtype(q.dtype, min(plan.terms, 2), be)
    dk, dv = Rows(k.shape, home, dev), Rows(v.shape, home, dev)
    lse_b = be.prepare_lse(lse)
    n_local = len(plan.blocks["local"])
    gather = _Gather(torch.stack([k, v]), group, plan)
    for blk, aux in zip(plan.blocks["local"], auxs[:n_local], strict=True):
        add_grads(dq, dk, dv, be.backward(dout, q, k, v, out, lse_b, blk, scale, aux))
    kv = gather.wait()
    # summed over the blocks here and over the ranks by the reduce-scatter: fp32
    dkv_glob = torch.zeros((2, *kv.shape[1:]), dtype=acc_dtype(q.dtype, 2 * C, be), device=dev)
    gk, gv = (Rows(kv.shape[1:], dkv_glob.dtype, dev, t) for t in dkv_glob)
    for blk, aux in zip(plan.blocks["global"], auxs[n_local:], strict=True):
        add_grads(dq, gk, gv, be.backward(dout, q, kv[0], kv[1], out, lse_b, blk, scale, aux))
    del kv
    share = _scatter_global_grads(dkv_glob, plan, group, q.shape[0])
    dk.add(0, share[0])
    dv.add(0, share[1])
    return dq, dk, dv


# --------------------------------------------------------------------------- dispatch

_ALGORITHMS = {
    "ring": (ring_forward, ring_backward),
    "allgather": (allgather_forward, allgather_backward),
    # the all-to-all methods run the ring code over their inner ring (cp_rope.parallel.ulysses);
    # Ulysses is hybrid with U = C (the plan's ulysses_size): one pair of functions
    "hybrid": (partial(hybrid_forward, ring_forward=ring_forward),
               partial(hybrid_backward, ring_backward=ring_backward)),
}
_ALGORITHMS["ulysses"] = _ALGORITHMS["hybrid"]


class _CPAttention(torch.autograd.Function):
    """(q, k, v) -> (out, lse) by the plan's method; lse is not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, plan, be, scale):
        forward, _ = _ALGORITHMS[plan.algorithm]
        out, lse, auxs = forward(plan.group, q, k, v, plan, be, scale)
        saved = (q, k, v, out, lse)
        if plan.algorithm in A2A_METHODS:  # their backward reads their head-sharded copies
            saved, auxs = auxs
        ctx.save_for_backward(*saved)
        ctx.plan, ctx.be, ctx.scale, ctx.auxs = plan, be, scale, auxs
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # the output was not used
            return None, None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        _, backward = _ALGORITHMS[plan.algorithm]
        accs = backward(plan.group, dout.contiguous(), q, k, v, out, lse, plan, ctx.be,
                        ctx.scale, ctx.auxs)
        grads = [mask_pad(acc.value(), plan, 0.0, 0).to(plan.dtype) for acc in accs]
        return (*grads, None, None, None)

