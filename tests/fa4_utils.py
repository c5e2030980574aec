"""Fake FlashAttention-4 kernels for the CPU tests of the ``fa4`` backend and ``auto``'s
per-length dispatch (tests/test_fa4.py).

They keep FA4's conventions, strictly: ``max_seqlen`` host ints that are bounds of every
segment and bucketed (FA4 compiles per variant; a tensor or an unbucketed bound would mean
a sync or recompilation), LSE ``[Hq, T]`` contiguous (float32, float64 for float64 inputs so
the glue can be checked exactly), NaN in every row FA4 need not write: rows past
``cu_q[-1]`` / ``cu_k[-1]`` and the rows of segments without keys (the backend sets those to
(0, -inf)). Keys of segments without queries get dK = dV = 0 (flash_bwd_sm90.py writes
zeros for a key tile without query tiles). The math is the float64 reference backend.

Windows as FA4 reads them (:func:`fa4_mask`, from ``_resolve_causal_local_window`` of
``flash_attn/cute/interface.py``): ``window_size_left`` / ``_right`` None is unbounded,
``causal`` forces the right bound to 0, ``(None, 0)`` is plain causal, anything else a local
window; bottom-right aligned. A negative bound is not "unbounded" to FA4 (4.0.0b36 keeps a
right bound of -1, which excludes the diagonal; later versions drop a window whose ``left +
right < 0``): the fakes refuse one. ``learnable_sink`` (float32 ``[Hq]``; float64 for float64 inputs) as FA4 applies it:
the forward's softmax gains ``exp(sink[h])`` (a row's LSE includes it) and the backward
returns its gradient ``-sum_rows exp(sink - lse) rowsum(dO . O)`` over the rows of ``cu_q``
(FA4's ``_bwd_dsink_reduce`` of the preprocess's ``dpsum``); every call with one is recorded
in :data:`SINK_CALLS` (cp_rope passes one only for a plan's single block, at cp 1).
"""

from __future__ import annotations

import torch

from cp_rope.parallel._blocks import Block, _Reference
from cp_rope.parallel._fa4 import MIN_BUCKET


def zero_outside(x, cu):
    """x with its rows outside [cu[0], cu[-1]) zeroed: buffers (the cuDNN glue's compact ones)
    may hold garbage there, which a kernel never reads but the fakes' dense float64 math would
    mix into other rows (0 x NaN)."""
    x = x.clone()
    x[:int(cu[0])], x[int(cu[-1]):] = 0.0, 0.0
    return x


CALLS: list[tuple[str, int, int]] = []
"""(``fwd`` / ``bwd``, max_q, max_k) of every fake call since the last clear."""


def _check(q, cu_q, cu_k, max_q, max_k):
    assert type(max_q) is int and type(max_k) is int, (type(max_q), type(max_k))
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    assert cu_q.device == q.device and cu_q.numel() == cu_k.numel()
    lq, lk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    assert bool((lq >= 0).all()) and bool((lk >= 0).all())
    assert int(lq.max()) <= max_q and int(lk.max()) <= max_k, (max_q, max_k)
    for m in (max_q, max_k):  # bucketed: 64 x 2^k, at least MIN_BUCKET
        assert m >= MIN_BUCKET and m % 64 == 0 and (m // 64) & (m // 64 - 1) == 0, m


def fa4_mask(causal: bool, window) -> tuple[bool, tuple[int, int] | None]:
    """FA4's ``(causal, window_size_left, window_size_right)`` as the reference block's
    ``(causal, window)`` (flash-attn's ``(left, right)``, -1 unbounded): FA4's own resolution
    (module docstring), then None -> -1."""
    left, right = window
    if causal:
        right = 0
    if left is None and right is None:
        return causal, None
    if left is None and right == 0:
        return True, None
    return False, (-1 if left is None else left, -1 if right is None else right)


WINDOWS: list[tuple] = []
"""The FA4 windows (left, right) of every fake call since the last clear."""

SINK_CALLS: list[str] = []
"""``fwd`` / ``bwd`` of every fake call given a ``learnable_sink`` since the last clear."""


def _check_sink(sink, q):
    # float32 as FA4 takes it (float64 for the float64 inputs of these tests, so the glue is
    # checked exactly)
    assert sink.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32), sink.dtype
    assert sink.shape == (q.shape[1],) and sink.is_contiguous()
    assert not sink.requires_grad, "the kernel's sink is a detached copy"
    return sink.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def _block(cu_q, cu_k, max_q, max_k, causal, window):
    assert all(w is None or (type(w) is int and w >= 0) for w in window), (
        f"FA4 window {window}: None is unbounded; a negative bound makes FA4 drop the window")
    causal, win = fa4_mask(causal, window)
    WINDOWS.append(tuple(window))
    return Block(cu_q, cu_k, max_q, max_k, causal, window=win)


def fake_fa4_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=(None, None),
                 sink=None):
    _check(q, cu_q, cu_k, max_q, max_k)
    CALLS.append(("fwd", max_q, max_k))
    q, k, v = zero_outside(q, cu_q), zero_outside(k, cu_k), zero_outside(v, cu_k)
    blk = _block(cu_q, cu_k, max_q, max_k, causal, window)
    [(_, out, lse)], _ = _Reference().forward(q, k, v, blk, scale)
    lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32).contiguous()
    if sink is not None:  # in the softmax: lse' = logaddexp(lse, sink), out' = exp(lse - lse') out
        SINK_CALLS.append("fwd")
        s = _check_sink(sink, q)[:, None].expand_as(lse)
        new = torch.logaddexp(lse, s)
        out = out * torch.exp(lse - new).T.unsqueeze(-1).to(out.dtype)
        lse = new.contiguous()
    lq, lk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    for i in torch.nonzero((lq > 0) & (lk == 0)).flatten().tolist():
        out[int(cu_q[i]):int(cu_q[i + 1])] = float("nan")
        lse[:, int(cu_q[i]):int(cu_q[i + 1])] = float("nan")
    out[int(cu_q[-1]):], lse[:, int(cu_q[-1]):] = float("nan"), float("nan")
    return out.to(q.dtype), lse


def fake_fa4_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale,
                 window=(None, None), sink=None):
    _check(q, cu_q, cu_k, max_q, max_k)
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous(), lse.shape
    dsink = None
    if sink is not None:
        SINK_CALLS.append("bwd")
        s, rows = _check_sink(sink, q), slice(int(cu_q[0]), int(cu_q[-1]))
        delta = (dout[rows].to(s.dtype) * out[rows].to(s.dtype)).sum(-1)  # [n, H]
        dsink = -(torch.exp(s[:, None] - lse[:, rows].to(s.dtype)) * delta.T).sum(1)
        dsink = dsink.to(sink.dtype)
    assert out.dtype == q.dtype and dout.shape == q.shape
    CALLS.append(("bwd", max_q, max_k))
    dout, q, out = (zero_outside(x, cu_q) for x in (dout, q, out))
    k, v = zero_outside(k, cu_k), zero_outside(v, cu_k)
    lse = zero_outside(lse.t(), cu_q).t()
    blk = _block(cu_q, cu_k, max_q, max_k, causal, window)
    [(_, dq, _, dk, dv)] = _Reference().backward(dout, q, k, v, out, lse, blk, scale, None)
    dq[int(cu_q[-1]):], dk[int(cu_k[-1]):], dv[int(cu_k[-1]):] = (float("nan"),) * 3
    lq, lk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    for i in torch.nonzero((lq > 0) & (lk == 0)).flatten().tolist():
        dq[int(cu_q[i]):int(cu_q[i + 1])] = float("nan")
    grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    return grads if sink is None else (*grads, dsink)
