"""The token-linear THD RoPE Triton kernel and its host launcher (no autograd here).

One kernel does forward and backward (``CONJUGATE`` rotates by ``-theta``)
for q and k in one launch. The grid is one-dimensional, ``cdiv(T, BLOCK_T) *
(head blocks of q + head blocks of k)`` programs, head block fastest, so the
programs that share a token block (and its cos/sin rows) run next to each
other and the rows are read from DRAM once. It depends only on the number of
local tokens and heads, never on the number of sequences, their lengths or
the cache length. Each program

1. gets the position of each of its ``BLOCK_T`` rows: with ``position_ids``
   (``HAS_POS_IDS``; what a per-batch plan passes, built once per batch) one
   load per row and one load of ``cu_seqlens[-1]``, no search; otherwise it
   finds each row's sequence by a vectorized binary search over ``cu_seqlens``
   (``ceil(log2(n_seqs + 1))`` steps, a runtime loop; zero-length sequences
   cost nothing),
2. on the formula path, applies the load-balanced CP position formula
   (DESIGN.md) in-kernel,
3. gathers the cos/sin rows once and reuses them for every head it handles,
4. loops over its heads: loads in the input dtype, rotates in float32, stores
   in the output dtype, and copies the pass-through dims ``>= rotary_dim``
   unless the operation is in place. Rows at or beyond ``cu_seqlens[-1]``
   are copied unchanged.

All addressing is int64: program ids are widened before they multiply a
stride, so tensors over 2**31 elements work.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["rotary_triton", "launch_config"]


@triton.jit
def _rotate_heads(
    # pointers
    X, OUT,
    # per-row state shared by every head of the program
    row_x, row_o, mask_t, cos, sin,
    # heads [h_start, h_end) of this tensor, int64
    h_start, h_end,
    # sizes and strides (elements)
    head_dim, stride_xh, stride_xd, stride_oh, stride_od,
    # meta
    ROT_HALF: tl.constexpr,  # rotary_dim // 2
    BLOCK_T: tl.constexpr,  # rows
    BLOCK_R: tl.constexpr,  # next_power_of_2(ROT_HALF)
    BLOCK_P: tl.constexpr,  # pass-through tile width
    INTERLEAVED: tl.constexpr,  # GPT-J pairs (2i, 2i+1) instead of (i, i + rotary_dim/2)
    COPY_PASS: tl.constexpr,  # copy dims >= rotary_dim (False when in place or none)
):
    # Contiguous tiles either way (16-byte vector loads): the two halves, or
    # all 2 * ROT_HALF interleaved dims split into pairs in registers.
    if INTERLEAVED:
        offs = tl.arange(0, 2 * BLOCK_R)
    else:
        offs = tl.arange(0, BLOCK_R)
    if BLOCK_R == ROT_HALF:
        mask = mask_t[:, None]
    elif INTERLEAVED:
        mask = mask_t[:, None] & (offs < 2 * ROT_HALF)[None, :]
    else:
        mask = mask_t[:, None] & (offs < ROT_HALF)[None, :]
    offs_p = 2 * ROT_HALF + tl.arange(0, BLOCK_P)
    mask_pass = mask_t[:, None] & (offs_p < head_dim)[None, :]
    # A runtime while loop, not `for h in range(h_start, h_end)`: triton 3.6's interpreter
    # cannot turn a tensor bound into a Python int (its `__index__` rejects the 1-element
    # array), while both compile to the same runtime loop (neither unrolls nor pipelines).
    h = h_start
    while h < h_end:
        px = X + row_x + h * stride_xh
        po = OUT + row_o + h * stride_oh
        if INTERLEAVED:
            x = tl.load(px + offs[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
            x1, x2 = tl.split(tl.reshape(x, [BLOCK_T, BLOCK_R, 2]))
        else:
            x1 = tl.load(px + offs[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(px + (offs + ROT_HALF)[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        if INTERLEAVED:
            y = tl.reshape(tl.join(y1, y2), [BLOCK_T, 2 * BLOCK_R])
            tl.store(po + offs[None, :] * stride_od, y.to(OUT.dtype.element_ty), mask=mask)
        else:
            tl.store(po + offs[None, :] * stride_od, y1.to(OUT.dtype.element_ty), mask=mask)
            tl.store(po + (offs + ROT_HALF)[None, :] * stride_od, y2.to(OUT.dtype.element_ty),
                     mask=mask)
        if COPY_PASS:
            xp = tl.load(px + offs_p[None, :] * stride_xd, mask=mask_pass)
            tl.store(po + offs_p[None, :] * stride_od, xp.to(OUT.dtype.element_ty), mask=mask_pass)
        h += 1


# Integer arguments that change from batch to batch or model to model: Triton would
# otherwise compile a variant for each value equal to 1 or divisible by 16
# (tests/test_rope_gpu.py counts compilations). Strides stay specialized: their
# divisibility by 16 is what proves 16-byte vector loads, and it does not vary for
# a given (dtype, head_dim).
_DO_NOT_SPECIALIZE = ("n_tokens", "n_seqs", "n_heads_q", "n_heads_k", "heads_per_prog", "cp_size",
                      "cp_rank", "start_offset")


@triton.jit(do_not_specialize=_DO_NOT_SPECIALIZE)
def _rope_kernel(
    # pointers
    Q, K, OUT_Q, OUT_K, COS, SIN, CU_SEQLENS,
    POS_IDS,  # int32/int64 [T] explicit positions (read when HAS_POS_IDS)
    START,  # int32/int64 [B] per-sequence offsets (read when HAS_START)
    # sizes: runtime values that change from batch to batch
    n_tokens, n_seqs, n_heads_q, n_heads_k, heads_per_prog, head_dim, cp_size, cp_rank,
    start_offset,  # one offset added to every formula position
    # strides (elements); cos and sin share theirs, with unit column stride
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_oqt, stride_oqh, stride_oqd,
    stride_okt, stride_okh, stride_okd,
    stride_cs,
    # meta: these shape the generated code
    ROT_HALF: tl.constexpr,  # rotary_dim // 2
    BLOCK_T: tl.constexpr,  # rows per program
    BLOCK_R: tl.constexpr,  # next_power_of_2(ROT_HALF): the half-width tile
    BLOCK_P: tl.constexpr,  # next_power_of_2(head_dim - rotary_dim): pass-through tile
    INTERLEAVED: tl.constexpr,
    CONJUGATE: tl.constexpr,  # rotate by -theta (the backward)
    COPY_PASS: tl.constexpr,  # out-of-place with head_dim > rotary_dim
    HAS_POS_IDS: tl.constexpr,  # positions from POS_IDS instead of the CP formula
    HAS_START: tl.constexpr,  # add START[sequence] to the formula's positions
):
    pid = tl.program_id(0).to(tl.int64)
    n_blocks_q = tl.cdiv(n_heads_q, heads_per_prog)
    n_blocks = n_blocks_q + tl.cdiv(n_heads_k, heads_per_prog)
    pid_t = pid // n_blocks
    pid_h = pid % n_blocks
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    mask_t = offs_t < n_tokens

    if HAS_POS_IDS:
        # One position load per row, no search. The two loads are independent (padding rows
        # read their in-bounds entry too), so their latencies overlap; rows from
        # cu_seqlens[-1] on are padding, copied unchanged (cos 1, sin 0 below).
        pos = tl.load(POS_IDS + offs_t, mask=mask_t, other=0).to(tl.int64)
        valid = mask_t & (offs_t < tl.load(CU_SEQLENS + n_seqs))
    else:
        # Sequence of each row: the largest b in [0, n_seqs] with cu[b] <= t
        # (binary lifting; b == n_seqs means trailing padding).
        seq = tl.zeros([BLOCK_T], dtype=tl.int32)
        step = 1
        while step * 2 <= n_seqs:
            step *= 2
        while step > 0:
            cand = seq + step
            ok = cand <= n_seqs
            bound = tl.load(CU_SEQLENS + cand, mask=ok & mask_t, other=0)
            seq = tl.where(ok & (bound <= offs_t), cand, seq)
            step = step // 2
        valid = mask_t & (seq < n_seqs)
        start = tl.load(CU_SEQLENS + seq, mask=valid, other=0).to(tl.int64)
        end = tl.load(CU_SEQLENS + seq + 1, mask=valid, other=0).to(tl.int64)
        # CP position formula: local row j of a local sequence of 2c rows on rank r.
        j = offs_t - start
        c = (end - start) // 2
        pos = tl.where(j < c, cp_rank * c + j, (2 * cp_size - 1 - cp_rank) * c + (j - c))
        pos += start_offset
        if HAS_START:
            pos += tl.load(START + seq, mask=valid, other=0).to(tl.int64)
        pos = tl.where(valid, pos, 0)

    offs_r = tl.arange(0, BLOCK_R)
    mask_cs = valid[:, None] & (offs_r < ROT_HALF)[None, :]
    cs_offs = pos[:, None] * stride_cs + offs_r[None, :]
    cos = tl.load(COS + cs_offs, mask=mask_cs, other=1.0).to(tl.float32)
    sin = tl.load(SIN + cs_offs, mask=mask_cs, other=0.0).to(tl.float32)
    if CONJUGATE:
        sin = -sin

    if pid_h < n_blocks_q:
        h_start = pid_h * heads_per_prog
        h_end = tl.minimum(h_start + heads_per_prog, n_heads_q)
        _rotate_heads(Q, OUT_Q, offs_t[:, None] * stride_qt, offs_t[:, None] * stride_oqt,
                      mask_t, cos, sin, h_start, h_end,
                      head_dim, stride_qh, stride_qd, stride_oqh, stride_oqd,
                      ROT_HALF, BLOCK_T, BLOCK_R, BLOCK_P, INTERLEAVED, COPY_PASS)
    else:
        h_start = (pid_h - n_blocks_q) * heads_per_prog
        h_end = tl.minimum(h_start + heads_per_prog, n_heads_k)
        _rotate_heads(K, OUT_K, offs_t[:, None] * stride_kt, offs_t[:, None] * stride_okt,
                      mask_t, cos, sin, h_start, h_end,
                      head_dim, stride_kh, stride_kd, stride_okh, stride_okd,
                      ROT_HALF, BLOCK_T, BLOCK_R, BLOCK_P, INTERLEAVED, COPY_PASS)


def launch_config(n_tokens: int, n_heads_q: int, n_heads_k: int, head_dim: int, rotary_dim: int,
                  elem_size: int, *, interleaved: bool = False, conjugate: bool = False,
                  inplace: bool = False, block_t: int | None = None,
                  heads_per_prog: int | None = None,
                  num_warps: int | None = None) -> tuple[tuple[int], int, dict]:
    """Grid, heads per program and constexpr meta of a launch.

    A small heuristic (no autotuning over dynamic shapes, which would add
    guards and recompiles): ``BLOCK_T`` rows x one half-width tile is about 1K
    elements per load (16 rows at head_dim 128), and each program handles up
    to 4 heads (about 16 KB read and 16 KB written with bf16 and head_dim
    128), fewer when that would leave the GPU with under ~1K programs. Chosen
    from ``scripts/sweep_rope.py`` on an H200 (docs/benchmarks.md): 91-94% of
    copy bandwidth over 1 and 4096 skewed sequences, q alone and q+k. Depends only on (T, heads, head_dim,
    rotary_dim, dtype size, flags): never on the number or lengths of
    sequences, nor on the cache.

    ``block_t``, ``heads_per_prog`` and ``num_warps`` override the
    heuristic (for ``scripts/sweep_rope.py``; the library never passes them).

    Returns:
        ``((cdiv(T, BLOCK_T) * (head_blocks_q + head_blocks_k),), heads_per_prog, meta)``.
    """
    half = rotary_dim // 2
    block_r = triton.next_power_of_2(half)
    if block_t is None:
        block_t = max(1, min(16, 1024 // block_r))
    pass_dim = head_dim - rotary_dim
    copy_pass = pass_dim > 0 and not inplace
    block_p = triton.next_power_of_2(pass_dim) if copy_pass else 1
    t_blocks = triton.cdiv(n_tokens, block_t)
    if heads_per_prog is None:
        heads_per_prog = max(1, min(4, max(n_heads_q, n_heads_k)))
        while heads_per_prog > 1 and t_blocks * triton.cdiv(n_heads_q, heads_per_prog) < 1024:
            heads_per_prog //= 2
    h_blocks = triton.cdiv(n_heads_q, heads_per_prog) + triton.cdiv(n_heads_k, heads_per_prog)
    if num_warps is None:
        num_warps = 4 if block_t * block_r * elem_size >= 2048 else 2
    meta = dict(ROT_HALF=half, BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_P=block_p,
                INTERLEAVED=bool(interleaved), CONJUGATE=bool(conjugate), COPY_PASS=copy_pass,
                num_warps=num_warps)
    return (t_blocks * h_blocks,), heads_per_prog, meta


@functools.lru_cache(maxsize=4096)
def _default_launch(n_tokens, n_heads_q, n_heads_k, head_dim, rotary_dim, elem_size, interleaved,
                    conjugate, inplace, has_pos_ids, has_start):
    """:func:`launch_config` plus the position flags, memoized: a training step reuses a few
    shapes, so the launcher's host work is a dictionary lookup."""
    grid, heads_per_prog, meta = launch_config(n_tokens, n_heads_q, n_heads_k, head_dim,
                                               rotary_dim, elem_size, interleaved=interleaved,
                                               conjugate=conjugate, inplace=inplace)
    return grid, heads_per_prog, dict(meta, HAS_POS_IDS=has_pos_ids, HAS_START=has_start)


def rotary_triton(q: torch.Tensor, k: torch.Tensor | None, out_q: torch.Tensor,
                  out_k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                  cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, interleaved: bool,
                  conjugate: bool, *, position_ids: torch.Tensor | None = None,
                  start_positions: torch.Tensor | None = None, start_offset: int = 0,
                  config: dict | None = None) -> None:
    """Launch the kernel: rotate q ``[T, Hq, D]`` into out_q and k ``[T, Hk, D]`` into out_k.

    Any strides; ``out_q is q and out_k is k`` (the same objects) for in place. ``k``
    (and ``out_k``) may be None or have 0 heads.
    cos/sin ``[P, rotary_dim // 2]`` (any float dtype, any strides),
    cu_seqlens int32 ``[B + 1]``. Positions: ``position_ids`` (int32/int64
    ``[T]``) when given, else the CP formula plus ``start_positions[b]``
    (int32/int64 ``[B]``, when given) plus ``start_offset``. Arguments are
    assumed checked by the caller. ``config``: :func:`launch_config` overrides
    (tuning scripts only).
    """
    n_tokens, n_heads_q, head_dim = q.shape
    n_heads_k = k.shape[1] if k is not None else 0
    if n_tokens == 0 or n_heads_q + n_heads_k == 0:
        return
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("backend='triton' got CPU tensors: use CUDA tensors, backend='torch', or "
                         "TRITON_INTERPRET=1 (set before cp_rope is imported) to interpret the kernel")
    rotary_dim = 2 * cos.shape[1]
    # identity, not data_ptr(): every empty tensor (say q with 0 heads) has pointer 0, and
    # treating out-of-place as in place would skip copying k's pass-through dims
    inplace = out_q is q and out_k is k
    if config:
        grid, heads_per_prog, meta = launch_config(
            n_tokens, n_heads_q, n_heads_k, head_dim, rotary_dim, q.element_size(),
            interleaved=interleaved, conjugate=conjugate, inplace=inplace, **config)
        meta.update(HAS_POS_IDS=position_ids is not None, HAS_START=start_positions is not None)
    else:
        grid, heads_per_prog, meta = _default_launch(
            n_tokens, n_heads_q, n_heads_k, head_dim, rotary_dim, q.element_size(),
            interleaved, conjugate, inplace, position_ids is not None, start_positions is not None)
    if n_heads_k == 0:  # any valid pointer: no program reads it
        k, out_k = q, out_q
    cs_stride = cos.stride()
    if cs_stride[1] != 1 or sin.stride() != cs_stride:  # the kernel takes one stride for both
        cos, sin = cos.contiguous(), sin.contiguous()
        cs_stride = cos.stride()
    if position_ids is not None:
        position_ids = position_ids.contiguous()
    if start_positions is not None:
        start_positions = start_positions.contiguous()
    args = (q, k, out_q, out_k, cos, sin, cu_seqlens,
            cu_seqlens if position_ids is None else position_ids,  # any valid pointer when unread
            cu_seqlens if start_positions is None else start_positions,
            n_tokens, cu_seqlens.shape[0] - 1, n_heads_q, n_heads_k, heads_per_prog, head_dim,
            cp_size, cp_rank, start_offset,
            *q.stride(), *k.stride(), *out_q.stride(), *out_k.stride(), cs_stride[0])
    if q.is_cuda and q.get_device() != torch.cuda.current_device():
        with torch.cuda.device(q.device):
            _rope_kernel[grid](*args, **meta)
    else:
        _rope_kernel[grid](*args, **meta)
