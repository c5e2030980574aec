"""The ``fa4`` block backend (FlashAttention-4) and ``auto``'s per-length dispatch between it
and cuDNN.

``fa4`` (:class:`Fa4`): one FA4 varlen call per block
(:func:`~cp_rope.parallel._compat.fa4_varlen_fwd` / ``_bwd``), windowed blocks with FA4's
``window_size_left`` / ``_right`` (:func:`fa4_window`). Sinks enter after the merge, as on
every backend (a per-block sink would be counted once per block), except where a plan has one
block in all (cp 1: :func:`~cp_rope.parallel._accumulate.kernel_sink_block`): there FA4's
``learnable_sink`` applies them in the kernel and its backward returns their gradient, so no
pass over the output is made for them (:meth:`Fa4.sinks_in_kernel`). FA4 keeps no padded
state (its LSE is ``[Hq, T]``, its grid ``(T + n_seg x tile) / tile x Hq`` tiles), so unlike
cuDNN a block of very unequal documents needs no splitting. Its backward takes any output/LSE pair: the
merged ones of a ring. Rows of a segment without keys are set to (0, -inf); keys of a segment
without queries get dK = dV = 0 from the kernel.

Compilation: FA4 JIT-compiles a kernel per *variant* (its ``compile_key``: dtype, head dims,
GQA ratio, causal, window flags, tile sizes, arch, ..., and in the backward whether the
problem has a single query / key tile, ``max_seqlen <= tile``). The values it reads on the
host are kept in a bounded set: ``max_seqlen_q`` / ``max_seqlen_k`` are passed as
:func:`bucket` (``64 x 2^k``, at least :data:`MIN_BUCKET` = 256, so never one tile), host
ints from the plan, never tensors (a tensor would be read back: a sync). Batches of any
composition then reuse the kernels compiled before: per (dtype, head_dim, GQA ratio, causal)
two variants, blocks of up to 256 segments and of more (FA4 adds a batch-lookup table to its
varlen scheduler above ``BIN_BATCH_SEARCH_THRESH`` = 256 segments, a compile-key flag),
each a forward, a backward and its pre/post-processing (tests/test_fa4_gpu.py counts them).
No call reads a device tensor on the host.

``auto`` on a GPU where both run (:class:`CudnnFa4`): each *segment* of a block goes to
FA4 when its query rows are at least the crossover length of the head dim
(:meth:`~cp_rope.parallel._calibration.Calibration.crossover_at`, measured by ``python -m
cp_rope.parallel.calibrate``), else to cuDNN, unless the block's shorter segments hold fewer
than :data:`SPLIT_MIN_ROWS` query rows in all: then they stay on FA4 too (what cuDNN saves on
so few rows is less than a second call costs). A block with both kinds runs as two sub-blocks
over the same q/k/v (:func:`split_block`, on the host once per block): FA4's sees the short
segments as a query segment without keys plus a key segment without queries (skipped), and
cuDNN's sees the long ones so; FA4's output is the block's, the rows of cuDNN's segments are
copied in (forward: out and LSE; backward: dq of its queries, dk/dv of its keys).
"""

from __future__ import annotations

import dataclasses

import torch

from . import _compat
from ._cudnn_thd import CudnnTHD, seq_bound
from ._device import to_device

__all__ = ["Fa4", "CudnnFa4", "SplitBlock", "split_block", "cudnn_segments", "bucket",
           "fa4_window", "MIN_BUCKET", "SPLIT_MIN_ROWS"]

NEG_INF = float("-inf")
MIN_BUCKET = 256
"""Smallest max_seqlen passed to FA4: above its largest tile (128 rows on SM90), so the
backward's single-tile specialisation never changes with the batch."""
SPLIT_MIN_ROWS = 8192
"""Fewest query rows of a block's short segments (below the crossover) that ``auto`` sends to
cuDNN; fewer stay on FA4. A floor because the split has fixed costs: a second kernel call per
layer (launches, the rows copied between the two results, cuDNN frontend host time) and a
cuDNN graph build (0.07-0.19 s) for each new call shape, while what cuDNN saves on short rows
is small: ~12 us per 1,024 rows and layer (forward + backward, head_dim 128: 512 x 256 tokens
took 9.5 ms on cuDNN and 11.2 ms on FA4 on an H100, docs/benchmarks.md). Where the
break-even lies depends on how much of that host time GPU work hides: the shipped
calibration's ``call_us`` (855 us) would put it near 65K rows. 8,192 is a low floor: whole
batches of short documents (512 x 256 tokens) stay on cuDNN, and batches with a few short
documents lose the split. Replaying bench_memory's 32,768-token finetune_hf batches (40
steps), cuDNN call shapes fell from 13 to 5; the H100's tokens/s did not change (122,668 with
a floor of 0, 122,740 with 8,192, docs/benchmarks.md Round 9)."""


def fa4_window(window) -> tuple[int | None, int | None]:
    """A block's ``window`` (flash-attn's ``(left, right)``, -1 unbounded; None: no window)
    as FA4's ``(window_size_left, window_size_right)``: None unbounded. FA4 must not see -1
    (``_resolve_causal_local_window``: 4.0.0b36 keeps a right bound of -1, which masks the
    diagonal too; later versions drop a window whose ``left + right < 0``, full attention),
    so the halo pieces' ``(0, -1)`` (key ``j >= i + lk - lq``) goes as ``(0, None)``. With
    ``causal=True`` FA4 sets the right bound to 0 itself; ``(W - 1, 0)`` is its causal local
    window (query ``i`` sees keys ``i - W + 1 .. i``, bottom-right aligned like flash-attn:
    ``flash_attn/cute/mask.py``), the window of cp_rope's convention."""
    if window is None:
        return None, None
    return tuple(None if int(w) < 0 else int(w) for w in window)


def _kernel_sink(sinks, q):
    """The sinks as FA4's ``learnable_sink`` takes them: a detached contiguous float32 copy
    (float64 for float64 inputs, which only the CPU tests' fake kernels run)."""
    return sinks.detach().to(torch.float64 if q.dtype == torch.float64 else torch.float32) \
        .contiguous()


def bucket(n: int) -> int:
    """The ``max_seqlen`` FA4 is called with for segments of up to ``n`` rows: ``64 x 2^k >=
    n``, at least :data:`MIN_BUCKET` (an upper bound: the kernels read the true lengths from
    ``cu_seqlens``)."""
    return max(MIN_BUCKET, seq_bound(n))


class Fa4:
    """FlashAttention-4 per block: one varlen call (see the module docstring)."""

    name = "fa4"
    partials_in_input_dtype = True

    @staticmethod
    def prepare_lse(lse):
        """The merged LSE ``[Hq, T]`` (float32: FA4 inputs are fp16/bf16) contiguous, as FA4's backward takes it."""
        return lse.contiguous()

    @staticmethod
    def sinks_in_kernel(blk) -> bool:
        """Whether :meth:`forward` / :meth:`backward_with_sinks` can take a plan's sinks for
        ``blk`` when it is the plan's only block: a block with queries and keys."""
        return blk.max_q > 0 and blk.max_k > 0

    def forward(self, q, k, v, blk, scale: float, sinks=None):
        """The block's (out, LSE); with ``sinks`` (``[Hq]``, only for a plan's one block:
        :func:`~cp_rope.parallel._accumulate.kernel_sink_block`) FA4's ``learnable_sink``
        in the softmax. Rows without keys stay (0, -inf) (at cp 1 only rows past the
        documents, which the plan clears)."""
        if blk.max_q == 0 or blk.max_k == 0:
            return [], None
        sink = None if sinks is None else _kernel_sink(sinks, q)
        out, lse = _compat.fa4_varlen_fwd(q, k, v, blk.cu_q, blk.cu_k, bucket(blk.max_q),
                                          bucket(blk.max_k), blk.causal, scale,
                                          window=fa4_window(blk.window), sink=sink)
        if blk.keyless_rows is not None:
            out.index_fill_(0, blk.keyless_rows, 0.0)
            lse.index_fill_(1, blk.keyless_rows, NEG_INF)
        return [(0, out, lse)], None

    def backward(self, dout, q, k, v, out, lse, blk, scale: float, aux):
        if blk.max_q == 0 or blk.max_k == 0:
            return []
        return self._backward(dout, q, k, v, out, lse, blk, scale, None)[0]

    def backward_with_sinks(self, dout, q, k, v, out, lse, blk, scale: float, aux, sinks):
        """:meth:`backward` of a :meth:`forward` that took ``sinks``: (grads, d sinks ``[Hq]``
        float32, this block's rows), ``lse`` that forward's (the sinks in it)."""
        return self._backward(dout, q, k, v, out, lse.contiguous(), blk, scale,
                              _kernel_sink(sinks, q))

    def _backward(self, dout, q, k, v, out, lse, blk, scale: float, sink):
        got = _compat.fa4_varlen_bwd(dout, q, k, v, out, lse, blk.cu_q, blk.cu_k,
                                     bucket(blk.max_q), bucket(blk.max_k), blk.causal, scale,
                                     window=fa4_window(blk.window), sink=sink)
        dq, dk, dv = got[:3]
        if blk.keyless_rows is not None:
            dq.index_fill_(0, blk.keyless_rows, 0.0)
        return [(0, dq, 0, dk, dv)], (got[3] if sink is not None else None)


@dataclasses.dataclass(frozen=True)
class SplitBlock:
    """A block's two sub-blocks under the crossover (:func:`split_block`); ``fa4`` / ``cudnn``
    None when no segment goes there. ``q_rows`` / ``k_rows``: int64 device rows of the cuDNN
    sub-block's segments (copied into FA4's results)."""

    fa4: object | None
    cudnn: object | None
    q_rows: torch.Tensor | None = None
    k_rows: torch.Tensor | None = None


def _rows(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """int64 rows ``starts[i] + [0, lens[i])`` concatenated (host)."""
    first = torch.repeat_interleave(starts - (lens.cumsum(0) - lens), lens)
    return first + torch.arange(int(lens.sum()))


def _sub_block(blk, cq, ck, keep):
    """``blk`` (host int64 bounds ``cq`` / ``ck``) with each segment ``i`` where ``keep[i]`` is
    False turned into a query segment without keys and a key segment without queries (both
    kernels skip those rows): segment ``i`` becomes ``(q_i, k_i if kept else none)`` and
    ``(no query, none if kept else k_i)``."""
    qa, qb, ka, kb = cq[:-1], cq[1:], ck[:-1], ck[1:]
    k_mid = torch.where(keep, kb, ka)
    cu_q = torch.cat([torch.stack([qa, qb], 1).flatten(), cq[-1:]]).to(torch.int32)
    cu_k = torch.cat([torch.stack([ka, k_mid], 1).flatten(), ck[-1:]]).to(torch.int32)
    lq, lk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    dev = blk.cu_q.device
    return dataclasses.replace(blk, cu_q=to_device(cu_q, dev), cu_k=to_device(cu_k, dev),
                               max_q=int(lq.max()), max_k=int(lk.max()), split_q=False,
                               cu_q_host=cu_q, cu_k_host=cu_k)


def cudnn_segments(lq, crossover: int, min_rows: int = SPLIT_MIN_ROWS):
    """The segments ``auto`` runs on cuDNN (the module docstring's rule, for :func:`split_block`
    and the cost model alike): ``lq`` the query rows of each segment (a torch or numpy array;
    0 for a segment without queries or keys). Returns a boolean mask of the same kind: the
    segments below the ``crossover`` when they hold at least ``min_rows`` query rows in all,
    else none."""
    short = (lq > 0) & (lq < crossover)
    return short if int(lq[short].sum()) >= max(min_rows, 1) else short & False


def split_block(blk, crossover: int, min_rows: int = SPLIT_MIN_ROWS) -> SplitBlock:
    """The block's segments by the rule of ``auto`` (the module docstring): a segment with
    queries and keys runs on FA4 when its query rows are ``>= crossover``, else on cuDNN,
    unless those shorter segments hold fewer than ``min_rows`` query rows in all (then all
    on FA4); segments without queries or keys go with FA4 (its kernels leave them (0, -inf) /
    dK = 0). Host work on the block's host bounds (read from the device only when it has
    none), kept on the block per rule and device."""
    key = ("fa4_split", crossover, min_rows, str(blk.cu_q.device))
    got = blk.backend_cache.get(key)
    if got is not None:
        return got
    cq = (blk.cu_q_host if blk.cu_q_host is not None else blk.cu_q.cpu()).to(torch.int64)
    ck = (blk.cu_k_host if blk.cu_k_host is not None else blk.cu_k.cpu()).to(torch.int64)
    lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    real = (lq > 0) & (lk > 0)
    short = cudnn_segments(torch.where(real, lq, 0), crossover, min_rows)
    if not bool(short.any()):
        got = SplitBlock(blk, None)
    elif bool((short == real).all()):
        got = SplitBlock(None, blk)
    else:
        dev = blk.cu_q.device
        got = SplitBlock(_sub_block(blk, cq, ck, ~short), _sub_block(blk, cq, ck, short),
                         to_device(_rows(cq[:-1][short], lq[short]), dev),
                         to_device(_rows(ck[:-1][short], lk[short]), dev))
    blk.backend_cache[key] = got
    return got


class CudnnFa4(CudnnTHD):
    """``auto`` with both kernels: each segment on FA4 or cuDNN by ``crossover`` (query rows)
    and ``min_rows`` (:func:`split_block`). A block whose segments all go one way runs as that
    backend alone (cuDNN's own length grouping and dense calls included)."""

    name = "cudnn+fa4"

    def __init__(self, crossover: int, min_rows: int = SPLIT_MIN_ROWS):
        self.crossover, self.min_rows = int(crossover), int(min_rows)
        self._fa4 = Fa4()

    def sinks_in_kernel(self, blk) -> bool:
        """A plan's one block takes its sinks in FA4's kernel when all its segments go to FA4
        (:meth:`Fa4.sinks_in_kernel`); cuDNN's SDPA has no sink."""
        return (split_block(blk, self.crossover, self.min_rows).cudnn is None
                and self._fa4.sinks_in_kernel(blk))

    def backward_with_sinks(self, dout, q, k, v, out, lse, blk, scale: float, aux, sinks):
        """:meth:`Fa4.backward_with_sinks` (a block :meth:`sinks_in_kernel` accepted)."""
        flat = lse.flat() if hasattr(lse, "flat") else lse
        return self._fa4.backward_with_sinks(dout, q, k, v, out, flat, blk, scale, aux, sinks)

    def forward(self, q, k, v, blk, scale: float, sinks=None):
        sp = split_block(blk, self.crossover, self.min_rows)
        if sp.cudnn is None:
            return self._fa4.forward(q, k, v, blk, scale, sinks=sinks)
        if sinks is not None:
            raise ValueError("cudnn+fa4: sinks in the kernel need a block all on FA4 "
                             "(sinks_in_kernel)")
        if sp.fa4 is None:
            return super().forward(q, k, v, blk, scale)
        [(_, out, lse)], _ = self._fa4.forward(q, k, v, sp.fa4, scale)
        [(_, o, st)], _ = super().forward(q, k, v, sp.cudnn, scale)
        out.index_copy_(0, sp.q_rows, o.index_select(0, sp.q_rows))
        lse.index_copy_(1, sp.q_rows, st.index_select(1, sp.q_rows))
        return [(0, out, lse)], None

    def backward(self, dout, q, k, v, out, lse, blk, scale: float, aux):
        sp = split_block(blk, self.crossover, self.min_rows)
        padded = lse if hasattr(lse, "flat") else CudnnTHD.prepare_lse(lse)
        if sp.fa4 is None:
            return super().backward(dout, q, k, v, out, padded, blk, scale, aux)
        flat = padded.flat()
        if sp.cudnn is None:
            return self._fa4.backward(dout, q, k, v, out, flat, blk, scale, aux)
        [(_, dq, _, dk, dv)] = self._fa4.backward(dout, q, k, v, out, flat, sp.fa4, scale, None)
        [(_, gq, _, gk, gv)] = super().backward(dout, q, k, v, out, padded, sp.cudnn, scale,
                                                None)
        dq.index_copy_(0, sp.q_rows, gq.index_select(0, sp.q_rows))
        dk.index_copy_(0, sp.k_rows, gk.index_select(0, sp.k_rows))
        dv.index_copy_(0, sp.k_rows, gv.index_select(0, sp.k_rows))
        return [(0, dq, 0, dk, dv)]
