"""CP attention (cp_rope.parallel.context_parallel_attention) on the CPU.

* Unit tests: the LSE merge rules, the reference block against a naive
  softmax, padding rows, argument errors.
* Multi-rank parity over gloo at world sizes 1, 2, 4 (one spawn each): a
  random global varlen batch (lengths 0, 1, 2C, random; GQA and MHA; causal
  and not) in float64, naive single-process attention and its autograd
  backward as the oracle, the zigzag shard from the production helper, both
  CP methods, gathered back and compared with max abs error <= 1e-10.
* A failing rank makes the others fail within the timeout instead of hanging.
"""

from __future__ import annotations

import math
import re
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from attention_utils import (
    F64_EXACT,
    fake_cudnn_bwd,
    fake_cudnn_fwd,
    fake_flash_bwd,
    fake_flash_fwd,
    install_fake_kernels,
    make_case,
    naive_attention,
    naive_lse,
    rand64,
)
from dist_utils import run_distributed
from utils import assert_close

from cp_rope.parallel import CPAttentionPlan, context_parallel_attention, shard_tensor, unshard
from cp_rope.parallel._blocks import Block, get_backend, merge_partials
from cp_rope.parallel.sharding import local_cu_seqlens

# --------------------------------------------------------------------------- unit tests

def _partial(gen, n, h, d, lse_vals):
    out = rand64(gen, n, h, d)
    lse = torch.tensor(lse_vals, dtype=torch.float64).view(1, n).expand(h, n).clone()
    return out, lse


def test_merge_rules():
    gen = torch.Generator().manual_seed(0)
    ninf = float("-inf")
    o1, l1 = _partial(gen, 4, 3, 5, [0.3, ninf, 1.5, ninf])
    o2, l2 = _partial(gen, 4, 3, 5, [ninf, 2.0, -0.7, ninf])
    o1[0, 0, 0] = -0.0  # the sign of a zero survives too
    o2[0] = float("nan")  # garbage behind a -inf LSE never leaks
    o1[3], o2[3] = float("nan"), float("inf")
    out, lse = merge_partials(o1, l1, o2, l2)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    # one -inf partial: the other unchanged bit for bit
    assert torch.equal(out[0].view(torch.int64), o1[0].view(torch.int64))
    assert torch.equal(lse[:, 0].view(torch.int64), l1[:, 0].view(torch.int64))
    assert torch.equal(out[1].view(torch.int64), o2[1].view(torch.int64))
    assert torch.equal(lse[:, 1], l2[:, 1])
    # both -inf: zero row, -inf LSE
    assert torch.equal(out[3], torch.zeros_like(out[3])) and bool((lse[:, 3] == ninf).all())
    # both finite: the softmax-weighted mix
    w1 = torch.exp(l1[:, 2] - torch.logaddexp(l1[:, 2], l2[:, 2]))[:, None]
    assert_close(out[2], w1 * o1[2] + (1 - w1) * o2[2], **F64_EXACT, name="mixed row")
    assert_close(lse[:, 2], torch.logaddexp(l1[:, 2], l2[:, 2]), **F64_EXACT, name="mixed lse")


@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.bfloat16])
def test_fused_merge_kernel(acc_dtype):
    """The Triton merge (the GPU path of every LSE merge; here under TRITON_INTERPRET on the
    CPU) against the float64 merge rounded once: -inf partials on either side and both,
    strided LSE views like cuDNN's, head_dim 80 (masked tile)."""
    from cp_rope.parallel._merge import merge_rows_

    gen = torch.Generator().manual_seed(11)
    n, h, d = 37, 3, 80
    ninf = float("-inf")
    acc, o = rand64(gen, n, h, d), rand64(gen, n, h, d)
    l1, l2 = rand64(gen, h, n) * 3, rand64(gen, h, n) * 3
    l1[:, :5], l2[:, 3:8], l1[1, 20], l2[2, 20] = ninf, ninf, ninf, ninf
    exp_out, exp_lse = merge_partials(acc, l1, o, l2)
    got = acc.to(acc_dtype)
    got_lse = l1.float().clone()
    stats = l2.float().t().contiguous()  # token-major [n, h], used as an [h, n] view
    merge_rows_(got, got_lse, o.to(torch.bfloat16), stats.t())
    exp_out = merge_partials(acc.to(acc_dtype).double(), l1, o.to(torch.bfloat16).double(),
                             l2)[0]
    assert_close(got, exp_out.to(acc_dtype), dtype=acc_dtype, name="out")
    assert_close(got_lse, exp_lse.float(), dtype=torch.float32, name="lse")
    assert bool((got_lse[:, 3:5] == ninf).all()) and bool((got[3:5] == 0).all())


def _block(cu_q, cu_k, causal):
    cu_q, cu_k = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    d = lambda c: int((c[1:] - c[:-1]).max())
    return Block(cu_q, cu_k, d(cu_q), d(cu_k), causal)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_block_matches_naive_softmax(causal):
    """Segments incl. empty q / empty k ones; GQA; forward (out, lse) and backward."""
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d, scale = 6, 2, 80, 0.11
    if causal:  # equal q/k lengths per segment
        cu_q, cu_k = [0, 3, 3, 140, 141], [0, 3, 3, 140, 141]
    else:
        cu_q, cu_k = [0, 5, 5, 9, 150], [0, 7, 19, 19, 150]
    blk = _block(cu_q, cu_k, causal)
    n_q, n_k = cu_q[-1] + 2, cu_k[-1] + 1  # trailing rows belong to no segment
    q, k, v = rand64(gen, n_q, hq, d), rand64(gen, n_k, hkv, d), rand64(gen, n_k, hkv, d)
    be = get_backend("reference", q, len(cu_q) - 1)
    [(row0, out, lse)], _ = be.forward(q, k, v, blk, scale)
    # oracle: explicit dense mask over all rows
    qi, ki = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    seg = torch.searchsorted(torch.tensor(cu_q), torch.arange(n_q), right=True) - 1
    seg = seg.clamp(max=len(cu_q) - 2)
    lo, hi = torch.tensor(cu_k)[seg][:, None], torch.tensor(cu_k)[seg + 1][:, None]
    mask = (ki >= lo) & (ki < hi) & (qi < cu_q[-1])
    if causal:
        mask &= ki - lo <= qi - torch.tensor(cu_q)[seg][:, None]
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    s = torch.einsum("qhd,khd->hqk", qr, kr.repeat_interleave(hq // hkv, 1)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    has = mask.any(-1)
    p = torch.where(has[:, None], torch.exp(s - ref_lse.masked_fill(~has, 0)[..., None]), 0.0)
    ref = torch.einsum("hqk,khd->qhd", p, vr.repeat_interleave(hq // hkv, 1))
    assert row0 == 0
    assert_close(out, ref, **F64_EXACT, name="out")
    assert_close(lse, ref_lse, **F64_EXACT, name="lse")
    assert bool((lse[:, ~has] == float("-inf")).all())
    dout = rand64(gen, n_q, hq, d)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), dout)
    [(q0, dq, k0, dk, dv)] = be.backward(dout, q, k, v, out, lse, blk, scale, None)
    for name, got, exp in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, strict=True):
        assert_close(got, exp, **F64_EXACT, name=name)


def test_single_process_padding_rows_and_float32():
    """group=None: plain varlen attention; trailing rows give 0 and gradient 0."""
    gen = torch.Generator().manual_seed(2)
    lens = [5, 0, 1, 17]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    n = int(cu[-1]) + 3
    q, k, v = rand64(gen, n, 4, 16), rand64(gen, n, 2, 16), rand64(gen, n, 2, 16)
    dout = rand64(gen, n, 4, 16)
    for dtype in (torch.float64, torch.float32):
        qx, kx, vx = (t.to(dtype, copy=True).requires_grad_() for t in (q, k, v))
        out = context_parallel_attention(qx, kx, vx, cu, max(lens), backend="reference")
        out.backward(dout.to(dtype))
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = naive_attention(*ref_in, cu, True, 16 ** -0.5)
        ref_grads = torch.autograd.grad(ref, ref_in, dout)
        tol = F64_EXACT if dtype == torch.float64 else {}
        assert out.dtype == dtype
        assert_close(out, ref, dtype=dtype, **tol, name=f"out {dtype}")
        for name, got, exp in zip(("dq", "dk", "dv"), (qx.grad, kx.grad, vx.grad), ref_grads, strict=True):
            assert_close(got, exp, dtype=dtype, **tol, name=f"{name} {dtype}")
            assert torch.equal(got[int(cu[-1]):], torch.zeros_like(got[int(cu[-1]):]))
        assert torch.equal(out[int(cu[-1]):], torch.zeros_like(out[int(cu[-1]):]))


def test_bad_inputs():
    q, k = torch.randn(8, 4, 16), torch.randn(8, 2, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    cpa = context_parallel_attention
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        cpa(q, torch.randn(8, 3, 16), torch.randn(8, 3, 16), cu, 8)
    with pytest.raises(ValueError, match="same shape"):
        cpa(q, k, torch.randn(8, 1, 16), cu, 8)
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        cpa(q[0], k, k, cu, 8)
    with pytest.raises(TypeError, match="cu_seqlens must be int32"):
        cpa(q, k, k, cu.float(), 8)
    with pytest.raises(TypeError, match="cu_seqlens must be int32"):
        cpa(q, k, k, cu.long(), 8)
    with pytest.raises(ValueError, match="cu_seqlens\\[-1\\]"):
        cpa(q, k, k, torch.tensor([0, 9], dtype=torch.int32), 9)
    with pytest.raises(ValueError, match="max_seqlen"):
        cpa(q, k, k, cu, 4)
    with pytest.raises(TypeError, match="max_seqlen"):
        cpa(q, k, k, cu, 8.0)
    with pytest.raises(ValueError, match="max_seqlen must be >= 0"):
        cpa(q, k, k, cu, -1)
    # numpy integers are ints, as for cp_rope.apply_rotary_emb's max_seqlen
    assert torch.equal(cpa(q, k, k, cu, np.int64(8)), cpa(q, k, k, cu, 8))
    with pytest.raises(ValueError, match="method"):
        cpa(q, k, k, cu, 8, method="tree")
    for scale in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softmax_scale must be finite and > 0"):
            cpa(q, k, k, cu, 8, softmax_scale=scale)
    with pytest.raises(ValueError, match="backend='torch_flash' needs CUDA"):
        cpa(q, k, k, cu, 8, backend="torch_flash")
    with pytest.raises(ValueError, match="backend"):
        cpa(q, k, k, cu, 8, backend="xformers")
    with pytest.raises(ValueError, match="seq_lens is only used with causal=False"):
        cpa(q, k, k, cu, 8, seq_lens=torch.tensor([8]))
    with pytest.raises(ValueError, match="0 <= seq_lens"):
        cpa(q, k, k, cu, 8, causal=False, seq_lens=torch.tensor([9]))
    with pytest.raises(ValueError, match="seq_lens must be an integer tensor"):
        cpa(q, k, k, cu, 8, causal=False, seq_lens=torch.tensor([8, 0]))
    with pytest.raises(ValueError, match=r"integer tensor \[B\] = \[1\], got torch.float32 of"):
        cpa(q, k, k, cu, 8, causal=False, seq_lens=torch.tensor([8.0]))  # names the dtype
    with pytest.raises(TypeError, match="dtype|float16"):
        cpa(q.int(), k.int(), k.int(), cu, 8)


def test_cp1_results_are_the_kernel_outputs(monkeypatch):
    """cp_size 1 allocates nothing beyond the kernel's outputs: out, dq, dk, dv ARE the
    (fake) GPU kernel's tensors (the memory design: no accumulator, no copy)."""
    from cp_rope.parallel import _blocks, _compat
    from cp_rope.parallel import attention as att

    made = []

    def record(fn):
        def wrapped(*args):
            res = fn(*args)
            made.extend(t.data_ptr() for t in res if isinstance(t, torch.Tensor))
            return res
        return wrapped

    monkeypatch.setattr(_compat, "torch_cudnn_fwd", record(fake_cudnn_fwd))
    monkeypatch.setattr(_compat, "torch_cudnn_bwd", record(fake_cudnn_bwd))
    flash = _blocks._Varlen("torch_flash", record(fake_flash_fwd), record(fake_flash_bwd))
    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = (rand64(gen, 19, h, 8) for h in (4, 2, 2, 4))
    for be, lens in ((flash, [6, 0, 13]), (_blocks._Cudnn(), [19])):
        made.clear()
        monkeypatch.setattr(att, "get_backend", lambda name, q, n, be=be, **kw: be)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        qx, kx, vx = (t.clone().requires_grad_() for t in (q, k, v))
        out = context_parallel_attention(qx, kx, vx, cu, max(lens))
        out.backward(dout)
        for name, t in (("out", out), ("dq", qx.grad), ("dk", kx.grad), ("dv", vx.grad)):
            assert t.data_ptr() in made, f"{be.name}: {name} is a copy, not the kernel's output"


# --------------------------------------------------------------------------- multi-rank

def _parity_body(rank, world_size):
    install_fake_kernels()
    group = dist.group.WORLD
    cases = [  # (hq, hkv, d, causal, backend, one sequence)
        (4, 4, 16, True, "reference", False),  # 0: + trailing rows
        (6, 2, 8, True, "reference", False),  # 1: softmax_scale
        (4, 4, 16, False, "reference", False),
        (6, 2, 24, False, "reference", False),
        (1, 1, 8, True, "reference", False),  # 4: group=None at world size 1
        (3, 1, 80, True, "reference", False),  # 5: non-contiguous q/k/v views
        (6, 2, 16, True, "fake_flash", False),  # 6: + trailing rows
        (4, 2, 16, False, "fake_flash", False),
        (4, 2, 16, True, "fake_cudnn", True),  # 8: + trailing rows
        (4, 4, 16, True, "fake_flash", True),
        (6, 2, 16, True, "fake_cudnn_thd", False),  # 10: + trailing rows
        (4, 2, 16, False, "fake_cudnn_thd", False),
        (4, 4, 16, True, "fake_cudnn_thd", True),  # 12: one dense call per block
        (4, 2, 16, True, "fake_cudnn_thd", "equal"),  # 13: equal documents: dense diagonal
    ]
    for ci, (hq, hkv, d, causal, backend, one_seq) in enumerate(cases):
        lens, cu, (q, k, v, dout) = make_case(100 + ci, world_size, hq, hkv, d, one_seq)
        seq_lens = None if causal else torch.tensor(lens)
        scale = 0.3 if ci == 1 else None
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = naive_attention(*ref_in, cu, causal, scale or d ** -0.5, seq_lens)
        ref_grads = torch.autograd.grad(ref, ref_in, dout)
        local_cu = local_cu_seqlens(cu, world_size)
        max_local = int((local_cu[1:] - local_cu[:-1]).max())
        n_local = int(local_cu[-1])
        extra = 2 if ci in (0, 6, 8, 10) else 0  # trailing rows that belong to no sequence
        sc = scale or d ** -0.5
        ref_lse = naive_lse(q, k, cu, causal, sc, seq_lens)
        for method in ("ring", "allgather"):
            loc = [shard_tensor(t, cu, world_size, rank) for t in (q, k, v, dout)]
            loc = [torch.cat([t, torch.randn(extra, *t.shape[1:], dtype=t.dtype)]) for t in loc]
            if ci == 5:
                loc[:3] = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in loc[:3]]
                assert not loc[0].is_contiguous()
            ql, kl, vl = (t.requires_grad_() for t in loc[:3])
            out = context_parallel_attention(
                ql, kl, vl, local_cu, max_local, group=group if ci != 4 or world_size > 1 else None,
                causal=causal, softmax_scale=scale, method=method, backend=backend,
                seq_lens=seq_lens)
            out.backward(loc[3])
            tag = f"ws{world_size} case{ci} {backend} {method} rank{rank}"
            for got in (out, ql.grad, kl.grad, vl.grad):
                assert torch.equal(got[n_local:], torch.zeros_like(got[n_local:])), tag
            for name, got, exp in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad),
                                      (ref, *ref_grads), strict=True):
                assert_close(unshard(got.detach(), local_cu, group), exp, **F64_EXACT,
                             name=f"{tag} {name}")
            # the same call with a plan built once (the arguments left to the plan):
            # bit-identical results, and the merged LSE
            plan = CPAttentionPlan.build(
                local_cu, max_local, q_heads=hq, kv_heads=hkv, head_dim=d, dtype=q.dtype,
                device="cpu", n_tokens=n_local + extra,
                group=group if ci != 4 or world_size > 1 else None, causal=causal,
                method=method, seq_lens=seq_lens)
            grads = (ql.grad, kl.grad, vl.grad)
            ql, kl, vl = (t.detach().clone().requires_grad_() for t in loc[:3])
            out2, lse = context_parallel_attention(
                ql, kl, vl, None, None, group=plan.group, causal=causal, softmax_scale=scale,
                method=method, backend=backend, plan=plan, return_lse=True)
            out2.backward(loc[3])
            for name, a, b in zip(("out", "dq", "dk", "dv"), (out2, ql.grad, kl.grad, vl.grad),
                                  (out, *grads), strict=True):
                assert torch.equal(a, b), f"{tag} {name}: plan= changed the result"
            assert lse.shape == (hq, n_local + extra) and not lse.requires_grad
            assert bool((lse[:, n_local:] == float("-inf")).all()), tag
            assert_close(unshard(lse.t().contiguous(), local_cu, group).t(), ref_lse, **F64_EXACT,
                         name=f"{tag} lse")
    if world_size > 1:
        _plan_is_built_once(rank, world_size, group)
    if world_size == 2:
        _half_accumulators_match_fp32(rank, world_size, group)
    if world_size > 1:
        _errors_across_ranks(rank, world_size, group)


def _half_accumulators_match_fp32(rank, world_size, group):
    """bf16 at cp_size 2: accumulating (at most two terms) in bf16 gives the very bits of fp32
    accumulators cast at the end -- the claim that lets out / dq / dk / dv live in bf16. The
    one exception: the split cuDNN block's dK/dV travel as one bf16 sum of its two halves,
    one rounding more (within one bf16 ulp plus a half-ulp of the largest value)."""
    from cp_rope.parallel import _accumulate as att  # the methods read acc_dtype there

    natural = att.acc_dtype
    for ci, (backend, one_seq, method) in enumerate([("fake_flash", False, "ring"),
                                                     ("fake_cudnn", True, "ring"),
                                                     ("fake_cudnn_thd", False, "ring"),
                                                     ("fake_flash", False, "allgather")]):
        lens, cu, tensors = make_case(300 + ci, world_size, 4, 2, 16, one_seq)
        local_cu = local_cu_seqlens(cu, world_size)
        max_local = int((local_cu[1:] - local_cu[:-1]).max())
        loc = [shard_tensor(t, cu, world_size, rank).bfloat16() for t in tensors]
        results = []
        for acc_dtype in (natural, lambda dtype, terms, be: torch.float32):
            att.acc_dtype = acc_dtype
            try:
                ql, kl, vl = (t.clone().requires_grad_() for t in loc[:3])
                out = context_parallel_attention(ql, kl, vl, local_cu, max_local, group=group,
                                                 method=method, backend=backend)
                out.backward(loc[3])
            finally:
                att.acc_dtype = natural
            results.append([t.view(torch.int16) for t in (out, ql.grad, kl.grad, vl.grad)])
        for name, a, b in zip(("out", "dq", "dk", "dv"), *results, strict=True):
            tag = f"{backend} {method} rank{rank} {name}"
            if backend == "fake_cudnn" and name in ("dk", "dv"):
                a, b = a.view(torch.bfloat16).double(), b.view(torch.bfloat16).double()
                assert not torch.equal(a, torch.zeros_like(a)), tag
                assert_close(a, b, atol=2.0 ** -8 * float(b.abs().max()), rtol=2.0 ** -7, name=tag)
            else:
                assert torch.equal(a, b), f"{tag}: bf16 != fp32 accumulation"


def _plan_is_built_once(rank, world_size, group):
    """A step of 4 attention layers (forward + backward) with a prebuilt plan: no plan is
    built and no signature gathered in the layers (structural: the GPU test counts syncs)."""
    from cp_rope.parallel import plan as plan_mod

    lens, cu, (q, k, v, dout) = make_case(400, world_size, 4, 2, 8, False)
    local_cu = local_cu_seqlens(cu, world_size)
    max_local = int((local_cu[1:] - local_cu[:-1]).max())
    loc = [shard_tensor(t, cu, world_size, rank) for t in (q, k, v, dout)]
    counts = {"build": 0, "gather": 0}
    real_build, real_gather = plan_mod.CPAttentionPlan.build.__func__, dist.all_gather_object

    def build(cls, *args, **kw):
        counts["build"] += 1
        return real_build(cls, *args, **kw)

    def gather(*args, **kw):
        counts["gather"] += 1
        return real_gather(*args, **kw)

    plan_mod.CPAttentionPlan.build = classmethod(build)
    dist.all_gather_object = gather
    try:
        for method in ("ring", "allgather"):
            counts.update(build=0, gather=0)
            plan = CPAttentionPlan.build(local_cu, max_local, q_heads=4, kv_heads=2, head_dim=8,
                                         dtype=q.dtype, device="cpu", group=group, method=method)
            assert counts == {"build": 1, "gather": 1}, counts
            h = loc[0].clone().requires_grad_()
            x = h
            for _ in range(4):
                x = x + context_parallel_attention(x, loc[1], loc[2], plan.cu_seqlens, max_local,
                                                   group=group, method=method, plan=plan)
            x.backward(loc[3])
            assert counts == {"build": 1, "gather": 1}, f"{method}: {counts}"
    finally:
        plan_mod.CPAttentionPlan.build = classmethod(real_build)
        dist.all_gather_object = real_gather


def _errors_across_ranks(rank, world_size, group):
    cu = torch.tensor([0, 4 * world_size], dtype=torch.int32)
    n = 4 * world_size + (rank == 1)  # rank 1 holds one row more
    q, k = torch.randn(n, 2, 8, dtype=torch.float64), torch.randn(n, 1, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"differ across the ranks") as info:
        context_parallel_attention(q, k, k, cu, 4 * world_size, group=group, backend="reference")
    msg = str(info.value)
    assert f"q=({4 * world_size}, 2, 8)" in msg and f"q=({4 * world_size + 1}, 2, 8)" in msg, msg
    with pytest.raises(ValueError, match="seq_lens: causal=False with cp_size > 1"):
        context_parallel_attention(q, k, k, cu, 4 * world_size, group=group, causal=False)
    # the whole cu_seqlens is compared: equal totals, equal weighted sums, different layouts
    cu = torch.tensor([0, 2, 8, 10, 16] if rank % 2 == 0 else [0, 4, 4, 12, 16], dtype=torch.int32)
    q, k = torch.randn(16, 2, 8, dtype=torch.float64), torch.randn(16, 1, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"differ across the ranks") as info:
        context_parallel_attention(q, k, k, cu, 8, group=group, backend="reference")
    assert "cu_seqlens=[0, 2, 8, 10, 16]" in str(info.value), str(info.value)
    assert "cu_seqlens=[0, 4, 4, 12, 16]" in str(info.value), str(info.value)
    # (issue 15: equal weighted sums passed the old check) the message names the rank's layout
    assert re.search(r"rank 1: cu_seqlens=.*4, 4, 12", str(info.value)), str(info.value)
    # bad content on one rank: that rank raises its ValueError, every other rank names it
    bad = torch.tensor([0, 4, 3, 16] if rank == 1 else [0, 4, 8, 16], dtype=torch.int32)
    expected = (ValueError, "non-decreasing") if rank == 1 else (RuntimeError, "rank 1: ValueError")
    with pytest.raises(expected[0], match=expected[1]):
        context_parallel_attention(q, k, k, bad, 8, group=group, backend="reference")


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.slow
def test_cp_attention_matches_single_process(world_size):
    run_distributed(_parity_body, world_size, timeout_s=120)


def _one_rank_fails_body(rank, world_size):
    cu = torch.tensor([0, 8], dtype=torch.int32)
    q = torch.randn(8, 2, 8)
    if rank == 1:  # fails before the exchange; the error is handled and the rank leaves
        try:
            raise RuntimeError("rank 1 fails before the exchange")
        except RuntimeError:
            return
    context_parallel_attention(q, q, q, cu, 8, group=dist.group.WORLD, backend="reference")


def test_failing_rank_does_not_hang():
    """Rank 0 waits on a partner that never comes: it must raise within the timeout."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"failed on \['rank0.err'\]"):
        run_distributed(_one_rank_fails_body, 2, timeout_s=5)
    assert time.monotonic() - start < 90  # timeout 5 s + process start-up on a loaded machine


def test_unknown_backend_lists_the_choices():
    q = torch.randn(8, 2, 16)
    k = v = torch.randn(8, 1, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'cudnn'"):
        context_parallel_attention(q, k, v, cu, 8, backend="xformers")


# ------------------------------------------------------------------ scale and causal of the wrong kind (the issue-15 catalogue)

def _qkv(t=16, h=2, d=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(t, h, d, generator=g) for _ in range(3)]


def test_softmax_scale_inf():
    q, k, v = _qkv()
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"softmax_scale"):
        context_parallel_attention(q, k, v, cu, 16, softmax_scale=math.inf, backend="reference")


def test_softmax_scale_bool():
    """(Found after issue 15, so not in CATALOGUE: it was silent.) True is a bool, not a scale."""
    q, k, v = _qkv()
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"softmax_scale"):
        context_parallel_attention(q, k, v, cu, 16, softmax_scale=True, backend="reference")


def test_causal_not_a_bool():
    q, k, v = _qkv()
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"causal"):
        context_parallel_attention(q, k, v, cu, 16, causal="no", backend="reference")
