"""Accumulators of CP attention: output/LSE merges and gradient sums, and their memory.

Shared by every CP method's forward and backward (:mod:`cp_rope.parallel.attention`):
:class:`OutAcc` merges a block's partial outputs through their LSE
(:func:`~cp_rope.parallel._blocks.merge_weights`), :class:`Rows` sums gradient
row-slices, :func:`acc_dtype` picks the accumulator dtype, :func:`mask_pad` clears
the trailing rows past ``cu_seqlens[-1]``.
"""

from __future__ import annotations

import torch

from ._blocks import NEG_INF, merge_weights

__all__ = ["MERGE_ROWS", "acc_dtype", "Rows", "OutAcc", "mask_pad", "add_grads", "apply_sinks",
           "kernel_sink_block", "forward_with_kernel_sinks", "backward_with_kernel_sinks",
           "sink_grad"]

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
# * merges: on CUDA one fused Triton pass (``_merge.merge_rows_``, no temporary); else over
#   8192-row slices: the fp32 temporaries stay at 8192 x Hq x D;
# * torch_cudnn: no dense call holds more query rows than one zigzag chunk except the causal
#   diagonal (``Block.split_q``), so the per-call backward memory (its dq output
#   and fp32 dq accumulator, both proportional to the query rows) stays at step 0's.
# * cudnn (THD): its backward takes the LSE padded, fp32 [B_seg, Hq, max_q] per distinct
#   block (at most 3 in a ring: the diagonal, the two half blocks), made once per backward
#   call and freed with it: B * Hq * max_seqlen * 4 bytes for the diagonal (e.g. 16 MiB for
#   64 x 2048 tokens, Hq 32); blocks of very unequal documents run as several calls
#   (parallel/_cudnn_thd.py), each padded to at most 16 (T + 32 B) rows of Hq floats.
# Per rank at cp_size C on one sequence (S tokens, Hq = 4 Hkv): persistent q, k, v, dout,
# out, dq, dk, dv = 5 S Hq D / C elements, plus the K/V receive buffer (S Hq D / (2 C)),
# plus one call's outputs and workspace; at cp_size 1: 5 S Hq D plus the one call's.

MERGE_ROWS = 8192


def acc_dtype(dtype, terms, be):
    """Accumulator dtype for a sum of ``terms`` partials from backend ``be`` (see above)."""
    if dtype == torch.float64:
        return torch.float64
    if terms <= 2 and be.partials_in_input_dtype:
        return dtype
    return torch.float32


class Rows:
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


class OutAcc:
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
            if self.out.is_cuda:  # one fused Triton pass; Triton is imported on CUDA only
                from ._merge import fused_merge_supported, merge_rows_
                if fused_merge_supported(self.out, self.lse, o, lse):
                    merge_rows_(self.out[rows], self.lse[:, rows], o, lse)
                    continue
            # weights on [H, n]; then per 8192-row slice three output-sized passes
            # (o * w2 in fp32, + out * w1, copy back rounded once) instead of merge_partials'
            # exact-case passes, which only padding rows (overwritten at the end) would need
            lse_new, w1, w2 = merge_weights(self.lse[:, rows], lse)
            w1, w2 = w1.contiguous(), w2.contiguous()  # [n, H, 1]: coalesced reads below
            self.lse[:, rows] = lse_new
            for s in range(0, n, MERGE_ROWS):
                e = min(n, s + MERGE_ROWS)
                acc_rows = self.out[row0 + s:row0 + e]
                tmp = o[s:e] * w2[s:e]
                tmp.addcmul_(acc_rows, w1[s:e])
                acc_rows.copy_(tmp)

    def _allocate(self):
        self.out = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self.lse = torch.full((self.shape[1], self.shape[0]), NEG_INF, dtype=self.lse_dtype,
                              device=self.device)

    def result(self, plan, dtype, sinks=None):
        """The merged (out in ``dtype``, LSE); with ``sinks`` (``[H]``) their correction
        (:func:`apply_sinks`) on the merged rows, once, before padding rows are cleared."""
        if self.out is None:
            self._allocate()
        if sinks is not None:
            apply_sinks(self.out, self.lse, sinks, plan.n_valid)
        out = mask_pad(self.out, plan, 0.0, 0).to(dtype)
        return out, mask_pad(self.lse, plan, NEG_INF, 1)


def mask_pad(t, plan, fill, dim):
    """Rows (along ``dim``) at or beyond ``cu_seqlens[-1]`` <- ``fill``, in place (a host
    count: only the padding rows are touched)."""
    if plan.n_valid < plan.n_tokens:
        t.narrow(dim, plan.n_valid, plan.n_tokens - plan.n_valid).fill_(fill)
    return t


def add_grads(dq, dk, dv, grads):
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


def kernel_sink_block(plan, blocks, be, sinks):
    """The block whose kernel takes ``sinks`` itself, or None (then :func:`apply_sinks` after
    the merge and :func:`sink_grad` in the backward).

    Only where the plan has one block in all (cp 1: every row's keys are in it, so a sink
    applied by the kernel is applied once per row, as after a merge) and the backend's
    ``sinks_in_kernel(block)`` says its kernel runs the whole block with a learnable sink
    (FlashAttention-4's ``learnable_sink``: the sink in the forward's softmax and its
    gradient from the backward's ``rowsum(dO . O)``, no pass of ours over the output).
    """
    if sinks is None or plan.cp_size != 1 or len(blocks) != 1:
        return None
    accepts = getattr(be, "sinks_in_kernel", None)
    return blocks[0] if accepts is not None and accepts(blocks[0]) else None


def forward_with_kernel_sinks(q, k, v, plan, blocks, be, scale, sinks, acc):
    """``(out, lse, aux)`` of the plan's one block with ``sinks`` in its kernel
    (:func:`kernel_sink_block`), merged into ``acc`` as a method's result; None where the
    method runs its blocks and applies the sinks after the merge."""
    blk = kernel_sink_block(plan, blocks, be, sinks)
    if blk is None:
        return None
    parts, aux = be.forward(q, k, v, blk, scale, sinks=sinks)
    acc.add(parts, first=True)
    return (*acc.result(plan, q.dtype), aux)


def backward_with_kernel_sinks(dout, q, k, v, out, lse, plan, blocks, be, scale, auxs, sinks,
                               dq, dk, dv):
    """The backward of :func:`forward_with_kernel_sinks` (``auxs[0]``: its aux): the block's
    gradients added to the ``dq`` / ``dk`` / ``dv`` accumulators, returned with the sinks'
    gradient; None where it did not run."""
    blk = kernel_sink_block(plan, blocks, be, sinks)
    if blk is None:
        return None
    grads, ds = be.backward_with_sinks(dout, q, k, v, out, lse, blk, scale, auxs[0], sinks)
    add_grads(dq, dk, dv, grads)
    return dq, dk, dv, ds


def apply_sinks(out, lse, sinks, n_rows: int) -> None:
    """Per-head sink logits into merged attention, in place on rows ``[:n_rows]``.

    GPT-OSS's sink: the softmax of a row of head ``h`` gains a term ``exp(sinks[h])`` in its
    denominator and no value, so with the merged ``lse`` (over every key the row sees)

        lse' = logaddexp(lse, sinks[h]),    out' = exp(lse - lse') out

    (a row that sees no key: out' = 0, lse' = sinks[h]). Applied once per row after every
    partial is merged, never per block (a per-block sink would be counted once per block).

    Args: ``out`` ``[T, H, D]`` (any float dtype, rounded once), ``lse`` ``[H, T]`` float32 /
    float64, ``sinks`` ``[H]`` (computed in ``lse``'s dtype).
    """
    if n_rows == 0:
        return
    s = sinks.detach().to(lse.dtype)[:, None]
    old = lse[:, :n_rows]
    new = torch.logaddexp(old, s)
    w = torch.exp(old - new)  # 0 where old is -inf
    for r0 in range(0, n_rows, MERGE_ROWS):
        r1 = min(n_rows, r0 + MERGE_ROWS)
        out[r0:r1].mul_(w[:, r0:r1].T.unsqueeze(-1).to(out.dtype))
    lse[:, :n_rows] = new


def sink_grad(dout, out, lse, sinks, n_rows: int) -> torch.Tensor:
    """Gradient of the sink logits from this rank's rows ``[:n_rows]``: ``[H]`` in fp32 (fp64
    for fp64 ``lse``).

    With the sink's probability ``p_h = exp(sinks[h] - lse')`` of a row and the sink's value
    0, the softmax backward gives ``d sinks[h] = -sum_rows p_h (dout . out')`` (``out'``,
    ``lse'``: the corrected output and LSE of :func:`apply_sinks`). Each rank returns its
    rows' share; the sum over the CP group (the gradient reduction of a replicated
    parameter, as for every weight) is the full gradient.
    """
    ct = lse.dtype
    total = torch.zeros(sinks.shape[0], dtype=ct, device=lse.device)
    s = sinks.detach().to(ct)[:, None]
    for r0 in range(0, n_rows, MERGE_ROWS):
        r1 = min(n_rows, r0 + MERGE_ROWS)
        # products in fp32 (``MERGE_ROWS`` rows at a time): the rows' terms cancel in the sum,
        # and bf16-rounded products (2^-8 each) did not hold the GPU test's tolerance at W = 1
        delta = (dout[r0:r1].to(ct) * out[r0:r1].to(ct)).sum(-1)  # [n, H]
        total -= (torch.exp(s - lse[:, r0:r1].to(ct)) * delta.T).sum(1)
    return total
