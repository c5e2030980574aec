"""The ``cudnn`` block backend: cuDNN frontend THD calls, documents grouped by length.

cuDNN's THD (varlen) attention keeps per-segment state *padded*: its backward
takes the LSE as ``[B, Hq, S_q, 1]`` (the frontend rejects a ragged LSE there,
``cudnn/sdpa/fwd/torch_op.py``), its softmax-sum workspace has the same shape,
and its kernels launch ``B x H x S / 128`` tiles. One call over a block whose
segments have very different lengths (one long document among thousands of
short ones) therefore costs memory and time ~ ``n_segments x max_length``
instead of ~ T. This module splits a block into a few calls whose padding is
bounded, planned once per block on the host (:func:`plan_calls`) and cached on
the :class:`~cp_rope.parallel._blocks.Block` (so once per plan, no sync in the
layers).

The rule (every constant below; ``w(seg) = max(query rows, 32)``,
``rows(call) = round_count(#segments) x seq_bound(longest query span)``):

1. **One call for the block** when ``rows <= PAD_LIMIT x sum w`` over all its
   segments (equal or similar lengths: today's single call).
2. Otherwise the segments with queries and keys are put in *length classes*
   (``seq_bound`` of their query rows: 64, 128, 256, ...), and classes are
   merged from the longest down while the merged group still satisfies the
   bound. A class alone always does (``rows <= 3 sum w``), so there are at most
   ``log2(longest / 64) + 1`` groups.
3. A group whose segments lie in at most :data:`MAX_RUNS` runs of consecutive
   segments (other groups' documents not in between) runs as one call per run
   on *views* of q/k/v; the run with the most rows uses the whole tensors, so
   its output is the block's output, and the other calls' rows are copied in.
   Other groups are *gathered*: their rows copied into compact buffers, one
   call, the results scattered back.

Memory per call: padded LSE and workspace ``<= PAD_LIMIT x (T + 32 x n_seg)``
rows of ``Hq`` floats (no tensor is ``n_seqs x max_seqlen``); compact buffers
and windows ``<= 1.5x`` their rows. Graph shapes are rounded (segment counts
and row counts by :func:`round_count`, lengths to ``64 x 2^k``), so batches of
varying composition reuse a bounded set of cuDNN graphs.
"""

from __future__ import annotations

import dataclasses

import torch

from . import _compat
from ._device import to_device

__all__ = ["CudnnCall", "CallLayout", "plan_calls", "round_count", "seq_bound", "CudnnTHD",
           "PAD_LIMIT", "MAX_RUNS"]

NEG_INF = float("-inf")
MIN_S = 64
"""Smallest graph max_seqlen (cuDNN's backward refuses s = 1; its forward LSE was wrong)."""
PAD_LIMIT = 16
"""A call's padded rows are at most PAD_LIMIT x the sum of max(query rows, 32) of its segments
(the padded LSE <= 1/4 of q's bytes at head_dim 128)."""
MAX_RUNS = 2
"""A length group in at most this many runs of consecutive segments runs on views; more runs:
gathered into compact buffers (one call)."""


def round_count(n: int) -> int:
    """The smallest ``2^k`` or ``3 x 2^(k-1)`` that is >= ``n`` (1, 2, 3, 4, 6, 8, 12, ...):
    counts rounded up by at most 1.5x, so that a bounded set of cuDNN graphs serves any batch."""
    n = max(int(n), 1)
    if n <= 2:
        return n
    p = 1 << (n - 1).bit_length()
    return 3 * p // 4 if 3 * p // 4 >= n else p


def seq_bound(n: int) -> int:
    """Graph ``max_seqlen`` for segments of up to ``n`` rows: ``64 x 2^k >= n``, at least 64."""
    return MIN_S << max(0, -(-int(n) // MIN_S) - 1).bit_length()


def _rows_bound(n: int, total: int) -> int:
    """Rows of a window / compact buffer holding ``n`` rows: ``64 x round_count(n / 64)``,
    at most ``total`` (and at least ``n``)."""
    return max(n, min(total, MIN_S * round_count(-(-n // MIN_S))))


@dataclasses.dataclass(frozen=True)
class CudnnCall:
    """One cuDNN THD call of a block (host tensors from :func:`plan_calls`; device ones from
    :meth:`to`).

    A *view* call reads q rows ``q_window`` (``k_window`` of k/v) as slices and defines the
    result rows ``q_span`` / ``k_span``; a *gathered* call reads the rows ``q_index`` /
    ``k_index`` into compact buffers of ``q_rows`` / ``k_rows`` rows and defines exactly those.
    """

    cu_q: torch.Tensor
    """int32 ``[B_pad + 1]`` segment bounds in the call's q rows (window or compact buffer);
    the last ``B_pad - n_seg`` segments are empty (graph-shape padding)."""
    cu_k: torch.Tensor
    seg_q0: torch.Tensor
    """int64 ``[B_pad]``: the block row of each segment's first query (the LSE re-padding)."""
    s_q: int
    """Graph max_seqlen_q: :func:`seq_bound` of the longest query span."""
    s_k: int
    n_seg: int
    """Segments of the block in the call (before padding)."""
    q_window: tuple[int, int] | None = None
    k_window: tuple[int, int] | None = None
    q_span: tuple[int, int] | None = None
    k_span: tuple[int, int] | None = None
    q_index: torch.Tensor | None = None
    """int64 block rows of q gathered, in buffer order (gathered calls)."""
    k_index: torch.Tensor | None = None
    q_rows: int = 0
    k_rows: int = 0

    @property
    def gathered(self) -> bool:
        return self.q_index is not None

    @property
    def padded_rows(self) -> int:
        """``B_pad x s_q``: rows of the padded LSE and of cuDNN's softmax-sum workspace."""
        return (self.cu_q.numel() - 1) * self.s_q

    def to(self, device) -> CudnnCall:
        return dataclasses.replace(self, **{
            f.name: to_device(getattr(self, f.name), device)
            for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), torch.Tensor)})

    def take_q(self, x: torch.Tensor) -> torch.Tensor:
        return _take(x, self.q_window, self.q_index, self.q_rows)

    def take_k(self, x: torch.Tensor) -> torch.Tensor:
        return _take(x, self.k_window, self.k_index, self.k_rows)


@dataclasses.dataclass(frozen=True)
class CallLayout:
    """How a block runs: ``calls`` (a view call on the whole tensors first, when there is one:
    ``base``), and the rows no call defines: ``clear_q`` (queries without keys: output 0,
    LSE -inf, dq 0) and ``clear_k`` (keys without queries: dk = dv = 0), int64 or None."""

    calls: tuple[CudnnCall, ...]
    base: bool
    clear_q: torch.Tensor | None
    clear_k: torch.Tensor | None

    def to(self, device) -> CallLayout:
        return CallLayout(tuple(c.to(device) for c in self.calls), self.base,
                          to_device(self.clear_q, device), to_device(self.clear_k, device))


def _take(x, window, index, rows):
    if index is None:
        return x[window[0]:window[1]]
    buf = x.new_empty((rows, *x.shape[1:]))
    torch.index_select(x, 0, index, out=buf[:index.numel()])
    return buf


def _ranges(starts, ends) -> torch.Tensor | None:
    """int64 rows of the ranges ``[starts[i], ends[i])`` (None: no row)."""
    rows = [torch.arange(a, b) for a, b in zip(starts, ends, strict=True) if b > a]
    return torch.cat(rows) if rows else None


def plan_calls(cu_q: torch.Tensor, cu_k: torch.Tensor, n_q: int, n_k: int) -> CallLayout:
    """The cuDNN calls of a block with host segment bounds ``cu_q`` / ``cu_k`` (``[n + 1]``,
    q / k / v of ``n_q`` / ``n_k`` rows); the rule and bounds are in the module docstring.

    Pure host code (CPU tensors in, CPU tensors out): unit-tested without a GPU.
    """
    cq, ck = cu_q.to(torch.int64).tolist(), cu_k.to(torch.int64).tolist()
    n = len(cq) - 1
    lq = [cq[i + 1] - cq[i] for i in range(n)]
    lk = [ck[i + 1] - ck[i] for i in range(n)]
    clear_q = _ranges([0] + [cq[i] for i in range(n) if lq[i] and not lk[i]],
                      [cq[0]] + [cq[i + 1] for i in range(n) if lq[i] and not lk[i]])
    clear_k = _ranges([0] + [ck[i] for i in range(n) if lk[i] and not lq[i]],
                      [ck[0]] + [ck[i + 1] for i in range(n) if lk[i] and not lq[i]])
    real = [i for i in range(n) if lq[i] and lk[i]]
    if not real:
        return CallLayout((), False, clear_q, clear_k)

    def fits(segs, s):
        return round_count(len(segs)) * s <= PAD_LIMIT * sum(max(lq[i], MIN_S // 2) for i in segs)

    def view(i0, i1, whole):  # segments i0..i1 (inclusive) on slices / the whole tensors
        qs, ks = (cq[i0], cq[i1 + 1]), (ck[i0], ck[i1 + 1])
        qw = (0, n_q) if whole else _window(qs, n_q)
        kw = (0, n_k) if whole else _window(ks, n_k)
        segs = range(i0, i1 + 1)
        return _call([cq[i] - qw[0] for i in segs] + [qs[1] - qw[0]],
                     [ck[i] - kw[0] for i in segs] + [ks[1] - kw[0]], [cq[i] for i in segs],
                     q_window=qw, k_window=kw, q_span=qs, k_span=ks)

    if fits(range(n), seq_bound(max(lq))):  # rule 1: today's single call
        return CallLayout((view(0, n - 1, True),), True, clear_q, clear_k)
    groups = _length_groups(real, lq, fits)
    pos = {i: p for p, i in enumerate(real)}
    runs, gathered = [], []
    for members in groups:
        spans, start = [], members[0]
        for a, b in zip(members, members[1:], strict=False):
            if pos[b] - pos[a] > 1:  # another group's segment in between: a new run
                spans.append((start, a))
                start = b
        spans.append((start, members[-1]))
        ok = len(spans) <= MAX_RUNS and all(
            fits(range(i0, i1 + 1), seq_bound(max(lq[i0:i1 + 1]))) for i0, i1 in spans)
        if ok:
            runs += spans
        else:
            gathered.append(members)
    calls = []
    if runs:  # the run with the most query rows on the whole tensors: the block's output
        runs.sort(key=lambda r: cq[r[0]] - cq[r[1] + 1])
        calls = [view(*runs[0], True)] + [view(i0, i1, False) for i0, i1 in runs[1:]]
    for members in gathered:
        q_index = _ranges([cq[i] for i in members], [cq[i + 1] for i in members])
        k_index = _ranges([ck[i] for i in members], [ck[i + 1] for i in members])
        calls.append(_call([0, *torch.tensor([lq[i] for i in members]).cumsum(0).tolist()],
                           [0, *torch.tensor([lk[i] for i in members]).cumsum(0).tolist()],
                           [cq[i] for i in members], q_index=q_index, k_index=k_index,
                           q_rows=_rows_bound(q_index.numel(), n_q),
                           k_rows=_rows_bound(k_index.numel(), n_k)))
    return CallLayout(tuple(calls), bool(runs), clear_q, clear_k)


def _window(span, total):
    """A slice ``[w0, w1)`` of ``total`` rows holding ``span``, of :func:`_rows_bound` rows."""
    rows = _rows_bound(span[1] - span[0], total)
    w0 = min(span[0], total - rows)
    return w0, w0 + rows


def _call(cu_q, cu_k, seg_q0, **kw) -> CudnnCall:
    """A call from its (unpadded) relative bounds, padded to :func:`round_count` segments."""
    n_seg = len(seg_q0)
    pad = round_count(n_seg) - n_seg
    lq = [b - a for a, b in zip(cu_q, cu_q[1:], strict=False)]
    lk = [b - a for a, b in zip(cu_k, cu_k[1:], strict=False)]
    return CudnnCall(
        torch.tensor(cu_q + [cu_q[-1]] * pad, dtype=torch.int32),
        torch.tensor(cu_k + [cu_k[-1]] * pad, dtype=torch.int32),
        torch.tensor(seg_q0 + [0] * pad, dtype=torch.int64),
        seq_bound(max(lq)), seq_bound(max(lk)), n_seg, **kw)


def _length_groups(real, lq, fits) -> list[list[int]]:
    """Rule 2: ``real`` segments by length class (longest first), classes merged while the
    merged group fits; members in segment order."""
    classes: dict[int, list[int]] = {}
    for i in real:
        classes.setdefault(seq_bound(lq[i]), []).append(i)
    groups = []
    for s in sorted(classes, reverse=True):
        if groups and fits(groups[-1][1] + classes[s], groups[-1][0]):
            groups[-1][1].extend(classes[s])
        else:
            groups.append((s, list(classes[s])))
    return [sorted(members) for _, members in groups]


class _PaddedLSE:
    """The merged LSE ``[Hq, T]`` and its padded ``[B, Hq, S, 1]`` copies for the cuDNN
    backward, one per call, made once per backward (the ring's steps share Block objects)."""

    def __init__(self, lse):
        self.lse, self._made = lse, {}

    def flat(self) -> torch.Tensor:
        """The merged LSE ``[Hq, T]`` contiguous (FA4's backward in ``auto``), once."""
        got = self._made.get("flat")
        if got is None:
            got = self._made["flat"] = self.lse.contiguous()
        return got

    def padded(self, key, starts: torch.Tensor, s: int) -> torch.Tensor:
        """Segment b's LSE rows ``starts[b] + [0, s)`` (past the segment: filler) as one
        contiguous ``[B, Hq, s, 1]`` tensor (a single gather, no ``[Hq, B s]`` temporary)."""
        got = self._made.get(key)
        if got is None:
            h, n = self.lse.shape
            b = starts.numel()
            src = (starts[:, None] + torch.arange(s, device=starts.device)).clamp_(max=max(n - 1, 0))
            got = torch.gather(self.lse.unsqueeze(0).expand(b, h, n), 2,
                               src.unsqueeze(1).expand(b, h, s)).unsqueeze(-1)
            self._made[key] = got
        return got


class CudnnTHD:
    """cuDNN frontend attention per block: the calls of :func:`plan_calls`, or one dense
    ``[n, H, S, D]`` call on views when the block's segments are equal (:attr:`Block.uniform`:
    equal-length documents; measured faster on an H200)."""

    name = "cudnn"
    partials_in_input_dtype = True

    @staticmethod
    def prepare_lse(lse):
        return _PaddedLSE(lse)

    @staticmethod
    def _dense(blk):
        """``(n, s_q, s_k)`` of a block run as one dense call (equal segments of >= 64 rows:
        the kernels refuse s = 1 and the THD ones serve short documents as well), or None."""
        u = blk.uniform
        return u if u is not None and min(u[1], u[2]) >= MIN_S else None

    @staticmethod
    def _bhsd(x, n, s):
        """Rows ``[0, n s)`` of ``[T, H, D]`` as an ``[n, H, s, D]`` view."""
        return x[:n * s].view(n, s, *x.shape[1:]).transpose(1, 2)

    @staticmethod
    def layout(blk, n_q: int, n_k: int, device) -> CallLayout:
        """The block's :class:`CallLayout` for q / k of ``n_q`` / ``n_k`` rows on ``device``,
        planned on first use and kept on the block (reads the device only when the block
        has no host bounds)."""
        key = ("cudnn_calls", n_q, n_k, str(device))
        got = blk.backend_cache.get(key)
        if got is None:
            cq = blk.cu_q_host if blk.cu_q_host is not None else blk.cu_q.cpu()
            ck = blk.cu_k_host if blk.cu_k_host is not None else blk.cu_k.cpu()
            got = blk.backend_cache[key] = plan_calls(cq, ck, n_q, n_k).to(device)
        return got

    def forward(self, q, k, v, blk, scale: float):
        if blk.max_q == 0 or blk.max_k == 0:
            return [], None
        if self._dense(blk) is not None:
            n, sq, sk = self._dense(blk)
            o, stats = _compat.cudnn_dense_fwd(self._bhsd(q, n, sq), self._bhsd(k, n, sk),
                                               self._bhsd(v, n, sk), blk.causal, scale)
            lse = stats[..., 0].transpose(0, 1).reshape(q.shape[1], n * sq)
            return [(0, o.transpose(1, 2).reshape(n * sq, *q.shape[1:]), lse)], None
        lay = self.layout(blk, q.shape[0], k.shape[0], q.device)
        if not lay.calls:
            return [], None
        out = lse = None
        if not lay.base:  # every call gathered: the block's output assembled here
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
            lse = torch.empty(q.shape[0], q.shape[1], device=q.device,
                              dtype=torch.float64 if q.dtype == torch.float64 else torch.float32).t()
        for c in lay.calls:
            o, st = _compat.cudnn_thd_fwd(c.take_q(q), c.take_k(k), c.take_k(v), c.cu_q, c.cu_k,
                                          c.s_q, c.s_k, blk.causal, scale)
            if out is None:  # the base call: whole-tensor rows, its span defined
                out, lse = o, st
            elif c.gathered:
                out.index_copy_(0, c.q_index, o[:c.q_index.numel()])
                lse.index_copy_(1, c.q_index, st[:, :c.q_index.numel()])
            else:
                a, b = c.q_span[0] - c.q_window[0], c.q_span[1] - c.q_window[0]
                out[c.q_span[0]:c.q_span[1]] = o[a:b]
                lse[:, c.q_span[0]:c.q_span[1]] = st[:, a:b]
            del o, st
        if lay.clear_q is not None:  # no key (NaN there): no contribution
            out.index_fill_(0, lay.clear_q, 0.0)
            lse.index_fill_(1, lay.clear_q, NEG_INF)
        return [(0, out, lse)], None

    def backward(self, dout, q, k, v, out, lse, blk, scale: float, aux):
        if blk.max_q == 0 or blk.max_k == 0:
            return []
        if not isinstance(lse, _PaddedLSE):
            lse = _PaddedLSE(lse)
        if self._dense(blk) is not None:
            n, sq, sk = self._dense(blk)
            bq, bk = (lambda x: self._bhsd(x, n, sq)), (lambda x: self._bhsd(x, n, sk))
            starts = blk.cu_q[:-1].to(torch.int64)
            g = _compat.cudnn_dense_bwd(bq(dout), bq(q), bk(k), bk(v), bq(out),
                                        lse.padded(id(blk), starts, sq), blk.causal, scale)
            dq, dk, dv = (t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in g)
            return [(0, dq, 0, dk, dv)]
        lay = self.layout(blk, q.shape[0], k.shape[0], q.device)
        if not lay.calls:
            return []
        grads = None
        if not lay.base:
            grads = tuple(torch.empty_like(x, memory_format=torch.contiguous_format)
                          for x in (q, k, v))
        for c in lay.calls:
            g = _compat.cudnn_thd_bwd(c.take_q(dout), c.take_q(q), c.take_k(k), c.take_k(v),
                                      c.take_q(out), lse.padded(id(c), c.seg_q0, c.s_q),
                                      c.cu_q, c.cu_k, c.s_q, c.s_k, blk.causal, scale)
            if grads is None:
                grads = g
            elif c.gathered:
                nq, nk = c.q_index.numel(), c.k_index.numel()
                grads[0].index_copy_(0, c.q_index, g[0][:nq])
                grads[1].index_copy_(0, c.k_index, g[1][:nk])
                grads[2].index_copy_(0, c.k_index, g[2][:nk])
            else:
                for t, x, span, w in ((grads[0], g[0], c.q_span, c.q_window),
                                      (grads[1], g[1], c.k_span, c.k_window),
                                      (grads[2], g[2], c.k_span, c.k_window)):
                    t[span[0]:span[1]] = x[span[0] - w[0]:span[1] - w[0]]
            del g
        dq, dk, dv = grads
        if lay.clear_q is not None:
            dq.index_fill_(0, lay.clear_q, 0.0)
        if lay.clear_k is not None:  # keys no query sees in this block: no gradient
            dk.index_fill_(0, lay.clear_k, 0.0)
            dv.index_fill_(0, lay.clear_k, 0.0)
        return [(0, dq, 0, dk, dv)]
