"""The ring method of CP attention (TransformerEngine's load-balanced ring /
ring-flash-attention): its schedule, forward and backward.

K/V (with their own head count, never repeated for GQA) travel around the ring in
``C`` steps, the next exchange in flight while the current block computes
(:func:`~cp_rope.parallel._ring.ring_exchange`). At step ``i`` rank ``r`` holds the
K/V of ``src = (r - i) mod C``:

* step 0: the local causal block (row ``j`` sees local keys ``<= j``, which in
  the zigzag layout is causal by global position);
* ``src < r``: every local query sees the first half (chunk ``src``) of every
  received sequence, unmasked;
* ``src > r``: the second half (chunk ``2C - 1 - r``) of the local queries sees
  all received keys, unmasked.

Every rank does the same work at every step. The backward runs the ring
again; the dK/dV of a received block travel with the K/V (``C - 1`` hops, the
owner's own step-0 dK/dV stay home) and reach their owner one exchange after
the last step, in the input dtype at ``C = 2`` and in fp32 beyond (see
:func:`~cp_rope.parallel._accumulate.acc_dtype`).
"""

from __future__ import annotations

import torch

from cp_rope.positions import global_positions

from . import _accumulate
from ._accumulate import (
    OutAcc,
    Rows,
    add_grads,
    backward_with_kernel_sinks,
    forward_with_kernel_sinks,
    sink_grad,
)
from ._ring import ring_exchange
from ._schedule import Layout, segments
from ._window import window_ring_schedule
from ._window_ring import window_backward, window_forward

__all__ = ["ring_schedule", "ring_forward", "ring_backward"]


def _real_key_counts(lay: Layout) -> torch.Tensor:
    """``[C, B]`` host: keys of rank p's local sequence b that are not padding (a prefix)."""
    cu, C = lay.cu, lay.cp_size
    lens = cu[1:] - cu[:-1]
    seq_id = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    counts = torch.zeros(C, lens.numel(), dtype=torch.int64)
    for p in range(C):
        real = global_positions(cu.to(torch.int32), C, p) < lay.seq_lens[seq_id]
        counts[p].index_add_(0, seq_id, real.to(torch.int64))
    return counts


def ring_schedule(lay: Layout):
    """Ring (TransformerEngine's load-balanced ring): step ``i`` holds the K/V of rank
    ``src = (r - i) mod C``; see :mod:`cp_rope.parallel.attention`."""
    if lay.window is not None:  # a window that masks: the windowed ring (cp_rope.parallel._window)
        return window_ring_schedule(lay)
    C, r, M, causal = lay.cp_size, lay.cp_rank, lay.max_seqlen, lay.causal
    a, e, end = lay.cu[:-1], lay.cu[1:], lay.cu[-1]
    h = (e - a) // 2
    seg = lambda *args, **kw: segments(lay, *args, **kw)
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


def ring_forward(group, q, k, v, plan, be, scale, sinks=None):
    """Ring forward: ``C`` steps, the next K/V exchange in flight while a block computes;
    ``sinks`` (``[Hq]`` or None) enter once after the merge. Returns (out, lse, per-step
    backend state)."""
    if "window" in plan.blocks:
        return window_forward(group, q, k, v, plan, be, scale, sinks)
    acc = OutAcc(q, _accumulate.acc_dtype(q.dtype, plan.terms, be))
    auxs = []
    C = plan.cp_size
    one = forward_with_kernel_sinks(q, k, v, plan, plan.blocks["ring"], be, scale, sinks, acc)
    if one is not None:  # cp 1 with the sinks in the kernel
        return (*one[:2], [one[2]])
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
    return (*acc.result(plan, q.dtype, sinks), auxs)


def ring_backward(group, dout, q, k, v, out, lse, plan, be, scale, auxs, sinks=None):
    """Ring backward: the K/V travel again, with the dK/dV of the block in hand; they reach
    their owner one exchange after the last step. Returns (dq, dk, dv) accumulators and
    the gradient of ``sinks`` from this rank's rows (None without sinks)."""
    if "window" in plan.blocks:
        return window_backward(group, dout, q, k, v, out, lse, plan, be, scale, auxs, sinks)
    C, dev = plan.cp_size, q.device
    dq = Rows(q.shape, _accumulate.acc_dtype(q.dtype, plan.terms, be), dev)
    home = _accumulate.acc_dtype(q.dtype, min(plan.terms, 2), be)  # own block + what comes back
    dk, dv = Rows(k.shape, home, dev), Rows(v.shape, home, dev)
    one = backward_with_kernel_sinks(dout, q, k, v, out, lse, plan, plan.blocks["ring"], be,
                                     scale, auxs, sinks, dq, dk, dv)
    if one is not None:  # cp 1 with the sinks in the kernel (as in ring_forward)
        return one
    kv_ring = ring_exchange(group) if C > 1 else None
    dkv_ring = ring_exchange(group) if C > 1 else None
    # C - 1 steps' dK/dV, then added to the owner's: the input dtype at C = 2 (one term, or
    # the two query halves of a split torch_cudnn block summed and rounded once: then one
    # rounding more than fp32 accumulators; sending half the bytes of fp32 on the one
    # exchange the backward cannot overlap), fp32 beyond
    travel = _accumulate.acc_dtype(q.dtype, C, be)
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
    return dq, dk, dv, None if sinks is None else sink_grad(dout, out, lse, sinks, plan.n_valid)
