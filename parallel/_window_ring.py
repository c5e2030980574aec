"""The windowed ring of CP attention: each step sends only the K/V rows the next rank sees.

Step ``i`` of rank ``r`` computes its queries against the rows of rank ``src = (r - i)
mod C`` that its window reaches (:func:`~cp_rope.parallel._window.window_ring_schedule`):
rank ``src`` sends exactly those rows (a compact buffer; with ``W`` below the chunk
length the ``W - 1``-row halo before each of ``r``'s chunks, and for most ``(r, src)``
nothing), directly, not forwarded around the ring, the next step's exchange in flight
while a step computes (:class:`~cp_rope.parallel._ring.PeerExchange`). The backward
exchanges the rows again and sends their dK/dV (fp32; fp64 for fp64 input) straight back
to their owner, which adds them at the rows it sent. Steps in which a rank neither
sends nor receives post nothing.
"""

from __future__ import annotations

import torch

from . import _accumulate
from ._accumulate import (
    OutAcc,
    Rows,
    add_grads,
    backward_with_kernel_sinks,
    forward_with_kernel_sinks,
    sink_grad,
)
from ._ring import PeerExchange

__all__ = ["window_forward", "window_backward"]

_KV_TAG, _DKV_TAG = 0, 1  # tags: step * 2 + kind, so a pair's messages never cross


class _Steps:
    """The K/V exchanges of the plan's windowed steps over ``group`` (None: loopback)."""

    def __init__(self, group, steps, k, v):
        self.group, self.steps, self.k, self.v = group, steps, k, v

    def post(self, i: int):
        """Start step ``i``'s K/V exchange (None past the last step)."""
        if i >= len(self.steps):
            return None
        st, k, v = self.steps[i], self.k, self.v
        sends = () if st.n_send == 0 else (k.index_select(0, st.send), v.index_select(0, st.send))
        recvs = () if st.n_recv == 0 else (k.new_empty((st.n_recv, *k.shape[1:])),
                                           v.new_empty((st.n_recv, *v.shape[1:])))
        if self.group is None and recvs:  # simulated rank: its own rows stand for src's
            recvs = (k.index_select(0, st.recv), v.index_select(0, st.recv))
        ex = PeerExchange(self.group)
        ex.start(i, sends, recvs, 2 * i + _KV_TAG)
        return ex


def window_forward(group, q, k, v, plan, be, scale, sinks=None):
    """Windowed ring forward; returns (out, lse, per-step lists of backend state)."""
    steps = plan.blocks["window"]
    acc = OutAcc(q, _accumulate.acc_dtype(q.dtype, plan.terms, be))
    blocks = [b for st in steps for b in st.blocks]
    one = forward_with_kernel_sinks(q, k, v, plan, blocks, be, scale, sinks, acc)
    if one is not None:  # cp 1, whole documents in one block: the kernel applies the sinks
        return (*one[:2], [[one[2]]])
    ex = _Steps(group, steps, k, v)
    auxs, first = [], True
    nxt = ex.post(1)
    for i, st in enumerate(steps):
        if i == 0:
            kv = (k, v)
        else:
            kv = nxt.wait()
            nxt = ex.post(i + 1)
        step_auxs = []
        for blk in st.blocks:
            parts, aux = be.forward(q, kv[0], kv[1], blk, scale)
            acc.add(parts, first=first)
            first = False
            step_auxs.append(aux)
            del parts
        auxs.append(step_auxs)
        del kv
    return (*acc.result(plan, q.dtype, sinks), auxs)


def window_backward(group, dout, q, k, v, out, lse, plan, be, scale, auxs, sinks=None):
    """Windowed ring backward: the rows travel again, their dK/dV go straight home.
    Returns (dq, dk, dv) accumulators and the sinks' gradient (or None)."""
    steps, dev = plan.blocks["window"], q.device
    grad_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = Rows(q.shape, _accumulate.acc_dtype(q.dtype, plan.terms, be), dev)
    # one step (cp 1): nothing comes back, dK/dV are the blocks' sum as dq is
    home = _accumulate.acc_dtype(q.dtype, plan.terms, be) if len(steps) == 1 else grad_dtype
    dk, dv = Rows(k.shape, home, dev), Rows(v.shape, home, dev)
    one = backward_with_kernel_sinks(dout, q, k, v, out, lse, plan,
                                     [b for st in steps for b in st.blocks], be, scale, auxs[0],
                                     sinks, dq, dk, dv)
    if one is not None:  # as in window_forward
        return one
    lse_b = be.prepare_lse(lse)
    ex = _Steps(group, steps, k, v)
    home = None  # (exchange, step) of the dK/dV on their way back to us

    def land(pending):
        back, st = pending
        got = back.wait()
        if st.n_send:  # what the rank we sent rows to made of them
            dk.value().index_add_(0, st.send, got[0])
            dv.value().index_add_(0, st.send, got[1])

    nxt = ex.post(1)
    for i, st in enumerate(steps):
        if i == 0:
            for blk, aux in zip(st.blocks, auxs[0], strict=True):
                add_grads(dq, dk, dv, be.backward(dout, q, k, v, out, lse_b, blk, scale, aux))
            continue
        kv = nxt.wait()
        nxt = ex.post(i + 1)
        shape = (st.n_recv, *k.shape[1:])
        tk, tv = Rows(shape, grad_dtype, dev), Rows(shape, grad_dtype, dev)
        for blk, aux in zip(st.blocks, auxs[i], strict=True):
            add_grads(dq, tk, tv, be.backward(dout, q, kv[0], kv[1], out, lse_b, blk, scale, aux))
        del kv
        if home is not None:
            land(home)
        sends = () if st.n_recv == 0 else (tk.value(), tv.value())
        recvs = () if st.n_send == 0 else (torch.empty((st.n_send, *k.shape[1:]), dtype=grad_dtype,
                                                       device=dev),
                                           torch.empty((st.n_send, *v.shape[1:]), dtype=grad_dtype,
                                                       device=dev))
        if group is None:  # simulated rank: nothing comes back
            recvs = tuple(torch.zeros_like(x) for x in recvs)
        back = PeerExchange(group)
        back.start(i, sends, recvs, 2 * i + _DKV_TAG, offset=-1)
        home = (back, st)
        del tk, tv
    if home is not None:
        land(home)
    ds = None if sinks is None else sink_grad(dout, out, lse, sinks, plan.n_valid)
    return dq, dk, dv, ds
