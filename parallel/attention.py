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

Sizes are host values (``max_seqlen``, tensor shapes). Host syncs per call:
with ``C > 1`` one, reading the all-gathered input signature that every rank
checks before any data moves; the ring with the varlen backends adds none;
torch_cudnn reads cu_seqlens (one sequence); the all-gather method builds its
global-order index with :func:`~cp_rope.parallel.cp_shard_indices` (a few
syncs), as does ``causal=False`` with ``seq_lens``. The backward adds none.
"""

from __future__ import annotations

import numbers
from typing import Literal

import torch
import torch.distributed as dist

from cp_rope.positions import check_cu_seqlens_content, content_checks_enabled, global_positions

from . import _compat
from ._blocks import NEG_INF, Block, get_backend, merge_weights
from ._ring import RingExchange
from .sharding import cp_shard_indices

__all__ = ["context_parallel_attention"]

Method = Literal["ring", "allgather"]
BackendName = Literal["auto", "flash_attn", "torch_flash", "torch_cudnn", "reference"]
_METHODS = ("ring", "allgather")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    method: Method = "ring",
    backend: BackendName = "auto",
    seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of sequences split across the CP group in the zigzag layout.

    Args:
        q: ``[T, Hq, D]`` float16/bfloat16/float32/float64, this rank's rows.
        k, v: ``[T, Hkv, D]``, same dtype and device, ``Hq % Hkv == 0`` (GQA).
        cu_seqlens: int32 ``[B + 1]`` *local* cumulative lengths (global / C),
            the same on every rank; rows from ``cu_seqlens[-1]`` on are
            trailing padding. With ``C > 1`` every local length is even.
        max_seqlen: host int >= the longest *local* sequence.
        group: the CP process group; ``None`` or a group of one rank gives
            plain varlen attention (same block code).
        causal: causal by global position inside each sequence; ``False``:
            every query sees every (real) key of its sequence.
        softmax_scale: default ``1 / sqrt(D)``.
        method: ``"ring"`` or ``"allgather"`` (see "Choosing the method" below).
        backend: ``"auto"``, ``"flash_attn"``, ``"torch_flash"``,
            ``"torch_cudnn"`` or ``"reference"``. Support (else ValueError):
            reference: any device and dtype (fp32 math, fp64 for fp64 input);
            torch_flash / flash_attn: CUDA, fp16/bf16, D <= 256, D % 8 == 0;
            torch_cudnn: CUDA sm80+, cuDNN >= 9, fp16/bf16, D <= 128, one
            sequence per batch (B == 1; it reads that length to the host once
            per call). ``auto``: flash_attn if importable, else torch_cudnn
            for B == 1, else torch_flash, else reference.
        seq_lens: only with ``causal=False``: int ``[B]`` true (unpadded)
            *global* lengths; keys at global position ``>= seq_lens[b]`` are
            masked. Required when ``C > 1`` (zigzag pads every sequence to a
            multiple of ``2C``); pass the padded lengths if nothing is padded.
            With ``causal=True`` padding sits after the real tokens and never
            reaches them, so seq_lens is refused.

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

    Returns: ``[T, Hq, D]`` in q's dtype, differentiable w.r.t. q, k and v.
    Rows at or beyond ``cu_seqlens[-1]`` are 0 and get gradients 0; a query
    that sees no key (non-causal all-padding sequence) gets 0.

    Raises:
        TypeError / ValueError: naming the bad argument (shapes, dtypes,
            cu_seqlens content for CPU tensors or with ``CP_ROPE_DEBUG=1``,
            unsupported backend / dtype / head dim combinations).
        RuntimeError: ranks of the group disagree on shapes, dtype, cu_seqlens,
            max_seqlen, causal or method (the message shows every rank's
            values), checked before any data moves; a peer that fails or
            disappears makes the collectives raise after the group's timeout.
    """
    _check_inputs(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, method, seq_lens)
    if group is not None and dist.get_world_size(group) > 1:
        cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    else:
        group, cp_size, cp_rank = None, 1, 0
    if content_checks_enabled(cu_seqlens):
        check_cu_seqlens_content(cu_seqlens, n_tokens=q.shape[0], cp_size=cp_size,
                                 max_seqlen=int(max_seqlen))
    if not causal and seq_lens is None and cp_size > 1:
        raise ValueError(
            "seq_lens: causal=False with cp_size > 1 needs the true global lengths to mask the "
            "zigzag padding keys (pass cu_seqlens.diff() * cp_size if nothing is padded)")
    be = get_backend(backend, q, cu_seqlens.numel() - 1)
    if cp_size > 1:
        _check_across_ranks(group, q, k, cu_seqlens, max_seqlen, causal, method, seq_lens)
    max_seqlen = int(max_seqlen)  # numpy integers -> the plan's Python int
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    plan = _Plan(cu_seqlens, max_seqlen, q.shape[0], cp_size, cp_rank, causal, seq_lens,
                 method if cp_size > 1 else "ring", be.needs_host_segments)
    return _CPAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), plan, be, group, scale)


# --------------------------------------------------------------------------- checks

def _check_inputs(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, method, seq_lens):
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
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
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 \
            or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor [B + 1], got {cu_seqlens.dtype} "
                         f"of shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q on {q.device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral):
        raise TypeError(f"max_seqlen must be an int (a host value), got {max_seqlen!r}")
    if max_seqlen < 0:
        raise ValueError(f"max_seqlen must be >= 0, got {max_seqlen}")
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale!r}")
    if seq_lens is not None:
        if causal:
            raise ValueError("seq_lens is only used with causal=False (causal attention never "
                             "lets padding keys reach real queries); pass seq_lens=None")
        if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype.is_floating_point \
                or seq_lens.shape != (cu_seqlens.numel() - 1,):
            raise ValueError(f"seq_lens must be an integer tensor [B] = [{cu_seqlens.numel() - 1}], "
                             f"got {getattr(seq_lens, 'shape', seq_lens)}")


def _check_across_ranks(group, q, k, cu, max_seqlen, causal, method, seq_lens):
    """All-gather a small signature; raise on every rank if any two ranks differ."""
    cu64 = cu.to(torch.int64)
    head = torch.tensor([*q.shape, *k.shape, _DTYPES.index(q.dtype), cu.numel(), max_seqlen,
                         int(causal), _METHODS.index(method), int(seq_lens is not None)],
                        dtype=torch.int64, device=q.device)
    sig = torch.cat([head, cu64[-1:], (cu64 * torch.arange(1, cu.numel() + 1, device=cu.device)).sum(0, keepdim=True)])
    if seq_lens is not None:
        sig = torch.cat([sig, seq_lens.to(q.device, torch.int64).sum(0, keepdim=True)])
    else:
        sig = torch.cat([sig, sig.new_zeros(1)])
    parts = [torch.empty_like(sig) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, sig, group=group)
    rows = [p.tolist() for p in parts]
    if any(r != rows[0] for r in rows):
        names = ("q", "k", "dtype", "len(cu_seqlens)", "max_seqlen", "causal", "method",
                 "seq_lens given", "cu_seqlens[-1]", "cu_seqlens checksum", "seq_lens sum")
        def show(r):
            vals = [tuple(r[0:3]), tuple(r[3:6]), str(_DTYPES[r[6]]), *r[7:]]
            return ", ".join(f"{n}={x}" for n, x in zip(names, vals, strict=True))
        detail = "\n".join(f"  rank {i}: {show(r)}" for i, r in enumerate(rows))
        raise RuntimeError("context_parallel_attention: inputs differ across the ranks of the CP "
                           f"group:\n{detail}")


# --------------------------------------------------------------------------- the plan

def _segments(q_starts, q_end, k_starts, k_end, max_q, max_k, causal, device, host,
              split_q=False):
    """A :class:`Block` from per-sequence segment starts (each a ``[B]`` tensor).

    ``split_q`` (unmasked blocks only): the host segments (one dense call each) are cut in
    two halves of their query rows, so no dense call holds more query rows than one zigzag
    chunk: the cuDNN backward's per-call memory (dq and its fp32 accumulator, proportional
    to the query rows) then stays at the causal diagonal's.
    """
    cu_q = torch.cat([torch.stack(q_starts, 1).flatten(), q_end.view(1)]).to(torch.int32)
    cu_k = torch.cat([torch.stack(k_starts, 1).flatten(), k_end.view(1)]).to(torch.int32)
    dense = None
    if host:
        bq, bk = cu_q.tolist(), cu_k.tolist()
        dense = tuple((bq[i], bq[i + 1] - bq[i], bk[i], bk[i + 1] - bk[i]) for i in range(len(bq) - 1)
                      if bq[i + 1] > bq[i] and bk[i + 1] > bk[i])
        if split_q and not causal:
            dense = tuple(piece for q0, nq, k0, nk in dense
                          for piece in ((q0, nq // 2, k0, nk), (q0 + nq // 2, nq - nq // 2, k0, nk))
                          if piece[1] > 0)
    return Block(cu_q.to(device), cu_k.to(device), max_q, max_k, causal, dense)


class _Plan:
    """Every block of one call, built once (vectorised over sequences) and reused by backward."""

    def __init__(self, cu_seqlens, max_seqlen, n_rows, cp_size, cp_rank, causal, seq_lens,
                 method, host):
        dev = cu_seqlens.device
        cu = cu_seqlens.to(torch.int64)
        if host:
            cu = cu.cpu()
        C, r, M = cp_size, cp_rank, max_seqlen
        self.cp_size, self.cp_rank, self.method, self.causal = C, r, method, causal
        # partials summed into one output / dq row: every ring step; the all-gather's local
        # block and one prefix block (causal) or the one global block
        self.terms = C if method == "ring" else (2 if causal else 1)
        self.n_rows = n_rows
        # rows past cu_seqlens[-1]: a host count when the segments are on the host anyway
        self.n_valid = int(cu[-1]) if host else None
        self.valid_rows = torch.arange(n_rows, device=dev) < cu_seqlens[-1].to(torch.int64)
        a, e, end = cu[:-1], cu[1:], cu[-1]
        h = (e - a) // 2
        seg = lambda qs, qe, ks, ke, mq, mk, c, split=False: _segments(
            qs, qe, ks, ke, mq, mk, c, dev, host, split)
        if seq_lens is not None:
            lens = cu_seqlens[1:].to(torch.int64) - cu_seqlens[:-1]
            seq_lens = seq_lens.to(device=cu_seqlens.device, dtype=torch.int64)
            if bool(((seq_lens < 0) | (seq_lens > lens * C)).any()):
                raise ValueError("seq_lens must satisfy 0 <= seq_lens <= global (padded) length")
        if method == "ring":
            real = None  # [C, B] real (non-padding) keys of every rank's local sequences
            if seq_lens is not None:
                real = self._real_key_counts(cu_seqlens, seq_lens, C).to(cu.device)
            self.ring = []
            for i in range(C):
                src = (r - i) % C
                if not causal:
                    ks = [a] if real is None else [a, a + real[src]]
                    qs = [a] if real is None else [a, e]
                    self.ring.append(seg(qs, end, ks, end, M, M, False))
                elif i == 0:
                    self.ring.append(seg([a], end, [a], end, M, M, True))
                elif src < r:  # all local queries x first half of the received keys
                    self.ring.append(seg([a, e], end, [a, a + h], end, M, M // 2, False, True))
                else:  # second half of the local queries x all received keys
                    self.ring.append(seg([a, a + h], end, [a, a], end, M // 2, M, False))
            return
        # all-gather: global order of the gathered K/V through the sharding helper
        n_local = int(cu_seqlens[-1])
        global_cu = cu_seqlens.to(torch.int64) * C
        self.global_index = torch.empty(C * n_local, dtype=torch.int64, device=dev)
        for p in range(C):
            self.global_index[cp_shard_indices(global_cu, C, p).to(dev)] = \
                p * n_rows + torch.arange(n_local, device=dev)
        # the same rows in a rank-major [C, 2 (k, v), T] buffer: k rows, then v rows
        base = (self.global_index // n_rows) * (2 * n_rows) + self.global_index % n_rows
        self.kv_index = torch.cat([base, base + n_rows])
        ga, gend = a * C, end * C
        if causal:
            # local: each half causally against itself; global: unmasked prefixes
            self.local = [seg([a, a + h], end, [a, a + h], end, M // 2, M // 2, True)]
            pre1, pre2 = r, 2 * C - 1 - r  # chunks before chunk r / before chunk 2C-1-r
            # max_k bounds every segment, the skipped tail ((2C - r) chunks) too: flash's
            # backward grid covers max_k keys and must write dK/dV = 0 there
            self.glob = [seg([a, a + h, e], end, [ga, ga + pre1 * h, ga + pre1 * h], gend,
                             M // 2, (2 * C - r) * (M // 2) if r > 0 else 0, False),
                         seg([a, a + h, e], end, [ga, ga, ga + pre2 * h], gend,
                             M // 2, pre2 * (M // 2), False)]
        else:
            n_real = (e - a) * C if seq_lens is None else seq_lens.to(cu.device, torch.int64)
            self.local = []
            self.glob = [seg([a, e], end, [ga, ga + n_real], gend, M, C * M, False)]

    @staticmethod
    def _real_key_counts(cu_seqlens, seq_lens, C):
        """``[C, B]``: keys of rank p's local sequence b that are not padding (a prefix)."""
        cu = cu_seqlens.to(torch.int64)
        lens = cu[1:] - cu[:-1]
        n = int(cu[-1])
        seq_id = torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens,
                                         output_size=n)
        counts = torch.zeros(C, lens.numel(), dtype=torch.int64, device=cu.device)
        for p in range(C):
            real = global_positions(cu_seqlens, C, p) < seq_lens[seq_id]
            counts[p].index_add_(0, seq_id, real.to(torch.int64))
        return counts


# --------------------------------------------------------------------------- forward / backward
#
# Memory (bytes per rank; T local rows, bf16 inputs, GPU kernels whose partials are bf16).
# Kept across the call: q, k, v, dout, out (the result, saved for backward), LSE (fp32
# [Hq, T]). Beyond those:
# * accumulators (out, dq, dk, dv) take the first kernel output that covers all their rows
#   (no zero-filled copy); a row that sums at most two partials accumulates in the input
#   dtype (one fp32 merge / add rounded once: the bits of an fp32 accumulator cast at the
#   end), more (ring with cp_size > 2) in fp32. At cp_size 1 the out / dq / dk / dv of the
#   one kernel call ARE the results: nothing is allocated beyond q..lse and the grads.
# * the ring sends K and V as they are (no stacked copy): one receive buffer of K/V
#   (2 T Hkv D elements) while a step computes;
# * dK/dV of a received block travel only for received blocks (cp_size - 1 hops back to
#   the owner; the owner's own step-0 dK/dV stay home): one travelling buffer, bf16 at
#   cp_size 2 (the kernel output itself, or the sum of a split cuDNN block's two halves);
# * merges run over 8192-row slices: the fp32 temporaries stay at 8192 x Hq x D;
# * cuDNN: no dense call holds more query rows than one zigzag chunk except the causal
#   diagonal (``_segments(split_q=True)``), so the per-call backward memory (its dq output
#   and fp32 dq accumulator, both proportional to the query rows) stays at step 0's.
# Per rank at cp_size C on one sequence (S tokens, Hq = 4 Hkv): persistent q, k, v, dout,
# out, dq, dk, dv = 5 S Hq D / C elements, plus the K/V receive buffer (S Hq D / (2 C)),
# plus one call's outputs and workspace; at cp_size 1: 5 S Hq D plus the one call's.

_MERGE_ROWS = 8192


def _acc_dtype(dtype, terms, be):
    """Accumulator dtype for a sum of ``terms`` partials from backend ``be`` (see above)."""
    if dtype == torch.float64:
        return torch.float64
    if terms <= 2 and be.partials_in_input_dtype:
        return dtype
    return torch.float32


class _Rows:
    """Sum of row-slice terms ``[row0 : row0 + n]``; adopts a first term that covers every row."""

    def __init__(self, shape, dtype, device, t=None):
        self.shape, self.dtype, self.device, self.t = tuple(shape), dtype, device, t

    def add(self, row0, g):
        if self.t is None:
            if row0 == 0 and tuple(g.shape) == self.shape and g.dtype == self.dtype \
                    and g.is_contiguous():
                self.t = g.detach()  # a kernel output of our own (detach: not a view)
                return
            self.t = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self.t[row0:row0 + g.shape[0]] += g

    def value(self):
        if self.t is None:
            self.t = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return self.t


class _OutAcc:
    """The output ``[T, Hq, D]`` and LSE ``[Hq, T]`` accumulators of the forward."""

    def __init__(self, q, dtype):
        self.shape, self.dtype, self.device = tuple(q.shape), dtype, q.device
        self.lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.out = self.lse = None

    def add(self, parts, first: bool):
        """Merge a block's partials (the first block's, disjoint, are copied)."""
        for row0, o, lse in parts:
            n = o.shape[0]
            if self.out is None:
                if first and row0 == 0 and n == self.shape[0] and o.dtype == self.dtype \
                        and o.is_contiguous():
                    self.out, self.lse = o.detach(), lse.to(self.lse_dtype).contiguous()
                    continue
                self._allocate()
            rows = slice(row0, row0 + n)
            if first:  # rows it leaves out stay (0, -inf)
                self.out[rows], self.lse[:, rows] = o, lse
                continue
            # weights on [H, n]; then per 8192-row slice three output-sized passes
            # (o * w2 in fp32, + out * w1, copy back rounded once) instead of merge_partials'
            # exact-case passes, which only padding rows (overwritten at the end) would need
            lse_new, w1, w2 = merge_weights(self.lse[:, rows], lse)
            self.lse[:, rows] = lse_new
            for s in range(0, n, _MERGE_ROWS):
                e = min(n, s + _MERGE_ROWS)
                acc_rows = self.out[row0 + s:row0 + e]
                tmp = o[s:e] * w2[s:e]
                tmp.addcmul_(acc_rows, w1[s:e])
                acc_rows.copy_(tmp)

    def _allocate(self):
        self.out = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self.lse = torch.full((self.shape[1], self.shape[0]), NEG_INF, dtype=self.lse_dtype,
                              device=self.device)

    def result(self, plan, dtype):
        if self.out is None:
            self._allocate()
        out = _mask_pad(self.out, plan, 0.0, 0).to(dtype)
        return out, _mask_pad(self.lse, plan, NEG_INF, 1)


def _mask_pad(t, plan, fill, dim):
    """Rows (along ``dim``) at or beyond ``cu_seqlens[-1]`` <- ``fill``, in place."""
    if plan.n_valid is not None:  # host count: touch the padding rows only
        if plan.n_valid < plan.n_rows:
            t.narrow(dim, plan.n_valid, plan.n_rows - plan.n_valid).fill_(fill)
        return t
    shape = [1] * t.dim()
    shape[dim] = -1
    return t.masked_fill_(~plan.valid_rows.view(shape), fill)


def _add_grads(dq, dk, dv, grads):
    """Add a block's grads (an iterable: one kernel call per item). dq goes in at once; the
    dK/dV pieces are added after the last call, so an accumulator that must be allocated
    (pieces covering part of the rows) does not coexist with a kernel's workspace."""
    kv_parts = []
    for q0, gq, k0, gk, gv in grads:
        dq.add(q0, gq)
        kv_parts.append((k0, gk, gv))
        del gq, gk, gv
    for k0, gk, gv in kv_parts:
        dk.add(k0, gk)
        dv.add(k0, gv)


class _Gather:
    """All-gather of stacked K/V ``[2, T, Hkv, D]`` into global order (async start, wait)."""

    def __init__(self, kv, group, plan):
        self.group, self.plan, self.shape = group, plan, kv.shape
        C = plan.cp_size
        self.buf = kv.new_empty((C, *kv.shape))
        if dist.get_backend(group) == "gloo":
            self.work = dist.all_gather(list(self.buf.unbind(0)), kv, group=group, async_op=True)
        else:
            # concatenation form [C * 2, T, ...]: the one every backend accepts
            self.work = _compat.all_gather_single(self.buf.flatten(0, 1), kv, group=group,
                                                  async_op=True)

    def wait(self):
        self.work.wait()
        rest = self.shape[2:]  # one gather from the [C, 2, T] buffer into [2, C*T] global order
        flat = self.buf.view(-1, *rest).index_select(0, self.plan.kv_index)
        return flat.view(2, -1, *rest)


def _scatter_global_grads(dkv_glob, plan, group, n_rows):
    """Global-order dK/dV ``[2, C*n, Hkv, D]`` -> this rank's summed share ``[2, T, Hkv, D]``."""
    C, rest = plan.cp_size, dkv_glob.shape[2:]
    # straight into the rank-major [C, 2, T] layout of the reduce-scatter (no transposed copy):
    # gathered row p * T + i (global_index) is per_rank[p, 0 (k) / 1 (v), i]
    per_rank = dkv_glob.new_zeros((C, 2, n_rows, *rest))
    per_rank.view(C * 2 * n_rows, *rest).index_copy_(0, plan.kv_index, dkv_glob.reshape(-1, *rest))
    if dist.get_backend(group) == "gloo":  # reduce_scatter is missing from gloo in older torch
        dist.all_reduce(per_rank, group=group)
        return per_rank[plan.cp_rank]
    out = per_rank.new_empty(per_rank.shape[1:])
    _compat.reduce_scatter_single(out, per_rank.flatten(0, 1), group=group)
    return out


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, be, group, scale):
        acc = _OutAcc(q, _acc_dtype(q.dtype, plan.terms, be))
        auxs = []
        if plan.method == "ring":
            C = plan.cp_size
            ring = RingExchange(group) if C > 1 else None
            kv = (k, v)
            for i, blk in enumerate(plan.ring):
                if i + 1 < C:
                    ring.start(kv)
                parts, aux = be.forward(q, kv[0], kv[1], blk, scale)
                auxs.append(aux)
                acc.add(parts, first=i == 0)
                del parts  # before the next block's kernel allocates its own
                if i + 1 < C:
                    kv = ring.wait()
            del kv
        else:
            gather = _Gather(torch.stack([k, v]), group, plan)
            for blk in plan.local:
                parts, aux = be.forward(q, k, v, blk, scale)
                auxs.append(aux)
                acc.add(parts, first=len(auxs) == 1)
            kv = gather.wait()
            for blk in plan.glob:
                parts, aux = be.forward(q, kv[0], kv[1], blk, scale)
                auxs.append(aux)
                acc.add(parts, first=len(auxs) == 1)
            del parts, kv
        out, lse = acc.result(plan, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.be, ctx.group, ctx.scale, ctx.auxs = plan, be, group, scale, auxs
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan, be, group, scale, auxs = ctx.plan, ctx.be, ctx.group, ctx.scale, ctx.auxs
        dout = dout.contiguous()
        C, dev = plan.cp_size, q.device
        dq = _Rows(q.shape, _acc_dtype(q.dtype, plan.terms, be), dev)
        home = _acc_dtype(q.dtype, min(plan.terms, 2), be)  # own block + what comes back
        dk, dv = _Rows(k.shape, home, dev), _Rows(v.shape, home, dev)
        if plan.method == "ring":
            kv_ring = RingExchange(group) if C > 1 else None
            dkv_ring = RingExchange(group) if C > 1 else None
            # C - 1 steps' dK/dV, then added to the owner's: the input dtype at C = 2 (one
            # term, or the two query halves of a split cuDNN block summed and rounded once:
            # then one rounding more than fp32 accumulators; sending half the bytes of fp32
            # on the one exchange the backward cannot overlap), fp32 beyond
            travel = _acc_dtype(q.dtype, C, be)
            kv = (k, v)
            for i, blk in enumerate(plan.ring):
                if i + 1 < C:
                    kv_ring.start(kv)
                grads = be.backward(dout, q, kv[0], kv[1], out, lse, blk, scale, auxs[i])
                if i == 0:
                    _add_grads(dq, dk, dv, grads)
                else:  # dK/dV of the K/V in hand: summed by the ranks it visited, then here
                    if i == 1:
                        tk, tv = _Rows(k.shape, travel, dev), _Rows(v.shape, travel, dev)
                    else:
                        tk, tv = (_Rows(k.shape, travel, dev, t) for t in dkv_ring.wait())
                    _add_grads(dq, tk, tv, grads)
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
        else:
            gather = _Gather(torch.stack([k, v]), group, plan)
            for blk, aux in zip(plan.local, auxs[:len(plan.local)], strict=True):
                _add_grads(dq, dk, dv, be.backward(dout, q, k, v, out, lse, blk, scale, aux))
            kv = gather.wait()
            # summed over the blocks here and over the ranks by the reduce-scatter: fp32
            dkv_glob = torch.zeros((2, *kv.shape[1:]), dtype=_acc_dtype(q.dtype, 2 * C, be),
                                   device=dev)
            gk, gv = (_Rows(kv.shape[1:], dkv_glob.dtype, dev, t) for t in dkv_glob)
            for blk, aux in zip(plan.glob, auxs[len(plan.local):], strict=True):
                _add_grads(dq, gk, gv, be.backward(dout, q, kv[0], kv[1], out, lse, blk, scale, aux))
            del kv
            share = _scatter_global_grads(dkv_glob, plan, group, q.shape[0])
            dk.add(0, share[0])
            dv.add(0, share[1])
        grads = [_mask_pad(acc.value(), plan, 0.0, 0).to(t.dtype)
                 for acc, t in ((dq, q), (dk, k), (dv, v))]
        return (*grads, None, None, None, None)
