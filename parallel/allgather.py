"""The all-gather method of CP attention (TransformerEngine's all-gather CP / Llama 3):
its schedule, exchange, forward and backward.

K/V are all-gathered (overlapped with the local diagonal block) and put in global
order (:func:`~cp_rope.parallel.sharding.rank_major_index`); each local query chunk
attends its causal prefix; the backward reduce-scatters dK/dV (all-reduce + slice on
gloo). One collective of ``C x`` the K/V instead of ``C - 1`` ring steps: it can win
with GQA (small K/V) when the ring steps are too short to hide their communication;
the ring needs ``1 / C`` of the K/V memory and overlaps its exchanges with compute.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _accumulate, _compat
from ._accumulate import OutAcc, Rows, add_grads, sink_grad
from ._device import to_device
from ._schedule import Layout, segments
from ._window import window_allgather_schedule
from .sharding import rank_major_index

__all__ = ["allgather_schedule", "allgather_forward", "allgather_backward"]


def allgather_schedule(lay: Layout):
    """All-gather (Llama 3 / TransformerEngine): the local block, then the gathered K/V in
    global order (``indices["kv"]``: rows of the rank-major ``[C, 2 (k, v), T]`` buffer)."""
    C, r, M, n_rows = lay.cp_size, lay.cp_rank, lay.max_seqlen, lay.n_rows
    cu = lay.cu
    a, e, end = cu[:-1], cu[1:], cu[-1]
    h = (e - a) // 2
    seg = lambda *args, **kw: segments(lay, *args, **kw)
    global_cu = (cu * C).to(torch.int32)
    global_index = rank_major_index(global_cu, C, stride=n_rows)
    base = (global_index // n_rows) * (2 * n_rows) + global_index % n_rows
    indices = {"kv": to_device(torch.cat([base, base + n_rows]), lay.device)}
    if lay.window is not None:  # each chunk's window: its own chunk and the keys before it
        return window_allgather_schedule(lay, indices["kv"])
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



# --------------------------------------------------------------------------- all-gather

def allgather_forward(group, q, k, v, plan, be, scale, sinks=None):
    """All-gather forward: the local block while K/V gather, then the global blocks;
    ``sinks`` enter once after the merge."""
    acc = OutAcc(q, _accumulate.acc_dtype(q.dtype, plan.terms, be))
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
    return (*acc.result(plan, q.dtype, sinks), auxs)


def allgather_backward(group, dout, q, k, v, out, lse, plan, be, scale, auxs, sinks=None):
    """All-gather backward: K/V gathered again; dK/dV reduce-scattered to their owners.
    Returns (dq, dk, dv) accumulators and the sinks' gradient of this rank's rows (or None)."""
    C, dev = plan.cp_size, q.device
    dq = Rows(q.shape, _accumulate.acc_dtype(q.dtype, plan.terms, be), dev)
    home = _accumulate.acc_dtype(q.dtype, min(plan.terms, 2), be)
    dk, dv = Rows(k.shape, home, dev), Rows(v.shape, home, dev)
    lse_b = be.prepare_lse(lse)
    n_local = len(plan.blocks["local"])
    gather = _Gather(torch.stack([k, v]), group, plan)
    for blk, aux in zip(plan.blocks["local"], auxs[:n_local], strict=True):
        add_grads(dq, dk, dv, be.backward(dout, q, k, v, out, lse_b, blk, scale, aux))
    kv = gather.wait()
    # summed over the blocks here and over the ranks by the reduce-scatter: fp32
    dkv_glob = torch.zeros((2, *kv.shape[1:]), dtype=_accumulate.acc_dtype(q.dtype, 2 * C, be), device=dev)
    gk, gv = (Rows(kv.shape[1:], dkv_glob.dtype, dev, t) for t in dkv_glob)
    for blk, aux in zip(plan.blocks["global"], auxs[n_local:], strict=True):
        add_grads(dq, gk, gv, be.backward(dout, q, kv[0], kv[1], out, lse_b, blk, scale, aux))
    del kv
    share = _scatter_global_grads(dkv_glob, plan, group, q.shape[0])
    dk.add(0, share[0])
    dv.add(0, share[1])
    return dq, dk, dv, None if sinks is None else sink_grad(dout, out, lse, sinks, plan.n_valid)

