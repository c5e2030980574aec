"""The terms of the cost model (:mod:`cp_rope.parallel.cost_model`, whose docstring states
them): seconds of the block calls, merges and exchanges of one setting on one rank, for one
layer (forward + backward). A window ``W`` (an effective one: shorter than some document;
None: none) takes each block's pairs from :mod:`._window_cost` and the windowed ring's bytes
from :func:`~cp_rope.parallel.ulysses.comm_volume`.
"""

from __future__ import annotations

import numpy as np

from . import _compat
from ._calibration import Calibration
from ._fa4 import cudnn_segments
from ._window_cost import allgather_segments, ring_segments, whole_segments
from .ulysses import comm_volume

__all__ = ["method_time", "whole_time"]

_FWD_BWD = 3.5  # fwd + bwd FLOPs / fwd FLOPs (flash-attention's convention)


def _seg_time(cal: Calibration, backend: str, pairs: np.ndarray, lq: np.ndarray, heads: int,
              head_dim: int, lk: np.ndarray | None = None, tiles: np.ndarray | None = None) -> float:
    """Seconds of one block call: ``call_us``, plus per segment (int64 arrays ``pairs``,
    ``lq`` query rows, ``lk`` key rows; ``lk=None``: causal, ``lk = lq``) and head
    ``seg_ns``, plus the FLOPs of the kernel's ``tile x tile`` tiles the segment touches
    (a partly masked or partly filled tile costs a full one) at the throughput of the
    segment's size (``pairs / lq`` keys per query row, ``Calibration.tflops_at``); ``tiles``:
    the tiles of each segment when given (a windowed one: :mod:`._window_cost`)."""
    keep = (pairs > 0) & (lq > 0)
    if not keep.any():
        return 0.0
    pairs, lq = pairs[keep].astype(np.float64), lq[keep].astype(np.float64)
    B = float(cal.tile)
    nq = np.ceil(lq / B)
    if tiles is not None:
        tiles = tiles[keep].astype(np.float64)
    elif lk is None:
        tiles = nq * (nq + 1) / 2
    else:
        tiles = nq * np.ceil(lk[keep].astype(np.float64) / B)
    calls = 1
    if backend == "auto":  # get_backend's per-segment rule: FA4 from the crossover up
        cross = _auto_crossover(cal, head_dim)
        if cross is None:
            tflops = cal.tflops_at("cudnn", pairs / lq)
        else:
            on_fa4 = ~cudnn_segments(lq, cross)  # split_block's rule
            tflops = np.where(on_fa4, cal.tflops_at("fa4", pairs / lq),
                              cal.tflops_at("cudnn", pairs / lq))
            calls = 1 + int(on_fa4.any() and not on_fa4.all())
    else:
        tflops = cal.tflops_at(backend, pairs / lq)
    flops = _FWD_BWD * 4.0 * np.maximum(tiles * B * B, pairs) * heads * head_dim
    return (float(np.sum(flops / (tflops * 1e12))) + calls * cal.call_us * 1e-6
            + pairs.size * heads * cal.seg_ns * 1e-9)


def _auto_crossover(cal: Calibration, head_dim: int) -> int | None:
    """The crossover ``backend="auto"`` runs with (:func:`~cp_rope.parallel._blocks.get_backend`):
    the calibration's for ``head_dim`` when it has an ``fa4`` table and FA4 is importable here
    (the same install on every rank), else None (cuDNN alone)."""
    if "fa4" not in cal.tflops or _compat.fa4_unavailable() is not None:
        return None
    return cal.crossover_at(head_dim)


def _causal(lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return lens * (lens + 1) // 2, lens


def _segs(cal, backend, seg, heads, D) -> float:
    """Seconds of one call over the windowed segments ``(pairs, lq, lk, tiles)`` of
    :mod:`._window_cost`. Backend ``"auto"`` is priced as FA4 where it runs: windowed blocks
    run on :data:`~cp_rope.parallel.choices.WINDOW_BACKENDS` (FA4 first, never cuDNN), so the
    crossover split does not apply to them."""
    if backend == "auto" and _auto_crossover(cal, D) is not None:
        backend = "fa4"
    return _seg_time(cal, backend, seg[0], seg[1], heads, D, seg[2], tiles=seg[3])


def whole_time(cal, backend, lens, heads, D, W) -> float:
    """Whole causal documents ``lens`` on one rank, under the window ``W`` (None: none)."""
    if W is None:
        return _seg_time(cal, backend, *_causal(lens), heads, D)
    return _segs(cal, backend, whole_segments(lens, W, cal.tile), heads, D)


def _ring_steps(cal, backend, lens, C, r, heads, D, W=None) -> list[float]:
    """Compute seconds of ring steps ``0 .. C-1`` on rank ``r``: ``lens`` are the *global*
    lengths of the ring's documents (divisible by 2C), ``heads`` the q heads run; a window
    ``W`` leaves each step the pairs it reaches (a step with none costs nothing)."""
    if W is not None:
        if C == 1:
            return [whole_time(cal, backend, lens, heads, D, W)]
        return [_segs(cal, backend, ring_segments(lens, C, r, i, W, cal.tile), heads, D)
                for i in range(C)]
    loc = lens // C
    c = loc // 2
    steps = [_seg_time(cal, backend, *_causal(loc), heads, D)]
    first = _seg_time(cal, backend, loc * c, loc, heads, D, c)   # src < r: all q x chunk src
    second = _seg_time(cal, backend, c * loc, c, heads, D, loc)  # src > r: second half x all
    for i in range(1, C):
        steps.append(first if (r - i) % C < r else second)
    return steps


def _ring_time(cal, backend, lens, C, r, hq, hkv, D, elem, acc, link_gbps, W=None) -> float:
    """Ring of C ranks over documents ``lens`` (global), exchanges overlapped with steps; a
    window ``W``: the windowed ring's bytes (``comm_volume``'s halo), only its busy steps
    exchange and merge."""
    if lens.size == 0 or not lens.any():
        return 0.0
    steps = _ring_steps(cal, backend, lens, C, r, hq, D, W)
    if C == 1:
        return steps[0]
    rows = int(lens.sum()) // C
    win = {} if W is None else dict(window=W, cp_rank=r,
                                    cu_seqlens=[0, *np.cumsum(lens // C).tolist()])
    vol = comm_volume("ring", n_tokens=rows, q_heads=hq, kv_heads=hkv, head_dim=D,
                      cp_size=C, elem_bytes=elem, acc_bytes=acc, **win)
    busy = [t > 0 for t in steps]  # steps with pairs: the others send and merge nothing
    n_ex = max(sum(busy[1:]), 1)
    per_step = (vol["forward"] + vol["backward"]) / n_ex / (link_gbps * 1e9) \
        + 2 * cal.latency_us * 1e-6
    merge = sum(busy[1:]) * cal.merge_bytes_per_row * rows * hq * D / (cal.hbm_gbps * 1e9)
    # steps 0 .. C-2 hide the next exchange; the backward's dK/dV return hop is exposed
    hidden = sum(max(t, per_step if nxt else 0.0)
                 for t, nxt in zip(steps[:-1], busy[1:], strict=True)) + steps[-1]
    if W is None:
        last_hop = 2 * rows * hkv * D * (elem if C == 2 else acc) / (link_gbps * 1e9)
    else:  # one busy step's dK/dV of the rows it received
        last_hop = (vol["backward"] - vol["forward"]) / n_ex / (link_gbps * 1e9)
    return hidden + merge + last_hop + cal.latency_us * 1e-6


def _allgather_time(cal, backend, lens, C, r, hq, hkv, D, elem, acc, W=None) -> float:
    """All-gather CP over documents ``lens`` (global lengths divisible by 2C) on rank r (a
    window ``W`` leaves fewer pairs; the gather moves the same bytes)."""
    if lens.size == 0 or not lens.any():
        return 0.0
    c = lens // (2 * C)
    pc, _ = _causal(c)
    if W is not None:
        loc_seg, glob_seg = allgather_segments(lens, C, r, W, cal.tile)
        local, glob = _segs(cal, backend, loc_seg, hq, D), _segs(cal, backend, glob_seg, hq, D)
    else:
        local = _seg_time(cal, backend, np.concatenate([pc, pc]), np.concatenate([c, c]), hq, D)
        glob = (_seg_time(cal, backend, c * (r * c), c, hq, D, r * c)
                + _seg_time(cal, backend, c * ((2 * C - 1 - r) * c), c, hq, D,
                            (2 * C - 1 - r) * c))
    rows = int(lens.sum()) // C
    vol = comm_volume("allgather", n_tokens=rows, q_heads=hq, kv_heads=hkv, head_dim=D,
                      cp_size=C, elem_bytes=elem, acc_bytes=acc)
    bw = (cal.collective_gbps if C <= cal.node_size else cal.internode_gbps) * 1e9
    gather = vol["overlapped"] / bw + cal.latency_us * 1e-6
    exposed = (vol["forward"] + vol["backward"] - vol["overlapped"]) / bw \
        + 2 * cal.latency_us * 1e-6
    # the gathered K/V (input dtype) and their fp32 gradient, written and read once each
    mem = C * rows * 2 * hkv * D * (2 * elem + 2 * acc) + cal.merge_bytes_per_row * rows * hq * D
    return max(local, gather) + glob + exposed + mem / (cal.hbm_gbps * 1e9)


def _a2a_time(cal, backend, lens, C, r, U, hq, hkv, D, elem, acc, W=None) -> float:
    """Ulysses (U = C) / hybrid: all-to-all over U ranks, then a ring of C / U ranks with
    ``hq / U`` heads over chunks U times longer."""
    if lens.size == 0 or not lens.any():
        return 0.0
    R = C // U
    rows = int(lens.sum()) // C
    method = "ulysses" if U == C else "hybrid"
    vol = comm_volume(method, n_tokens=rows, q_heads=hq, kv_heads=hkv, head_dim=D, cp_size=C,
                      ulysses_size=None if U == C else U, elem_bytes=elem, acc_bytes=acc)
    a2a_bytes = vol["forward"] + vol["backward"] - vol["overlapped"]
    a2a_link = cal.a2a_gbps if U <= cal.node_size else cal.internode_gbps
    a2a = a2a_bytes / (a2a_link * 1e9) + 4 * cal.latency_us * 1e-6
    # pack / unpack of every all-to-all buffer (read + write on both sides)
    mem = 2 * a2a_bytes * U / max(U - 1, 1) / (cal.hbm_gbps * 1e9)
    # the ring joins ranks U apart: across nodes once the group spans more than one
    ring = _ring_time(cal, backend, lens, R, r // U, hq // U, max(hkv // U, 1), D, elem, acc,
                      cal.p2p_gbps if C <= cal.node_size else cal.internode_gbps, W)
    return a2a + mem + ring


def method_time(cal, backend, s, lens, C, r, hq, hkv, D, elem, acc, W) -> float:
    if s.method == "ring":
        link = cal.p2p_gbps if C <= cal.node_size else cal.internode_gbps
        return _ring_time(cal, backend, lens, C, r, hq, hkv, D, elem, acc, link, W)
    if s.method == "allgather":
        return _allgather_time(cal, backend, lens, C, r, hq, hkv, D, elem, acc, W)
    U = C if s.method == "ulysses" else s.ulysses_size
    return _a2a_time(cal, backend, lens, C, r, U, hq, hkv, D, elem, acc, W)
