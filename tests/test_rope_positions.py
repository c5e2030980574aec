"""Positions from anywhere: ``position_ids=``, ``start_positions=``, ``conjugate=``;
the partial head block of the kernel; their bad input.

Both backends against the float64 reference of ``tests/rope_utils.py`` (the
Triton one under TRITON_INTERPRET=1 on CPU), small shapes.
"""

from __future__ import annotations

import pytest
import torch
from rope_utils import (
    assert_bad_input_raises,
    device_for,
    random_cu_seqlens,
    rope_reference,
    small_batch,
    thd,
)
from utils import assert_close, poison_

from cp_rope import apply_rotary_emb, apply_rotary_emb_qk, global_positions, rope_cache
from cp_rope.kernel import rotary_triton
from cp_rope.parallel.sharding import cp_shard_indices, local_cu_seqlens
from cp_rope.torch_backend import rotary_torch_qk

BACKENDS = ["torch", "triton"]


def _seq_ids(cu: torch.Tensor) -> torch.Tensor:
    lens = (cu[1:] - cu[:-1]).long()
    return torch.repeat_interleave(torch.arange(lens.numel()), lens)


def _fwd_bwd(q, k, gen, dtype, refs, ref_in, **kwargs):
    """Forward of apply_rotary_emb_qk(q, k, **kwargs) and gradients of a weighted
    loss, against the float64 reference outputs ``refs`` of leaves ``ref_in``."""
    qo, ko = apply_rotary_emb_qk(q, k, **kwargs)
    assert_close(qo, refs[0], name="q_out")
    assert_close(ko, refs[1], name="k_out")
    wq, wk = (torch.randn(t.shape, generator=gen) for t in (qo, ko))
    gq, gk = torch.autograd.grad((qo * wq.to(qo.device, dtype)).sum() + (ko * wk.to(ko.device, dtype)).sum(),
                                 (q, k))
    rq, rk = torch.autograd.grad((refs[0] * wq.double()).sum() + (refs[1] * wk.double()).sum(), ref_in)
    assert_close(gq, rq, name="dq")
    assert_close(gk, rk, name="dk")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_position_ids_forward_backward(dtype, index_dtype, backend):
    """Random explicit positions (anywhere in the cache, repeats allowed), a
    strided q and a GQA k, trailing padding rows whose entries are out of range
    on purpose (they are not read: those rows pass through)."""
    gen = torch.Generator().manual_seed(int(dtype == torch.float32) + 2 * int(index_dtype == torch.int32))
    dev = device_for(backend)
    cu = random_cu_seqlens(gen, 6, 1)
    n = int(cu[-1])
    n_tokens = n + 4
    cos, sin = rope_cache(300, 16)
    pos = torch.randint(0, 300, (n_tokens,), generator=gen)
    pos[n:] = -7  # padding: never used (the kernel loads the entry, masks its cos/sin)
    q = thd(gen, n_tokens, 3, 24, dtype, strided=True, device=dev).requires_grad_()
    k = thd(gen, n_tokens, 1, 24, dtype, device=dev).requires_grad_()
    ref_in = [t.detach().to("cpu", torch.float64).requires_grad_() for t in (q, k)]
    refs = [rope_reference(t, cos, sin, cu, positions=pos) for t in ref_in]
    _fwd_bwd(q, k, gen, dtype, refs, ref_in, cos=cos.to(dev), sin=sin.to(dev), cu_seqlens=cu.to(dev),
             position_ids=pos.to(dev, index_dtype), backend=backend, max_position_id=299)


@pytest.mark.parametrize("backend", BACKENDS)
def test_position_ids_equal_to_the_formula_give_the_formula(backend):
    gen = torch.Generator().manual_seed(3)
    dev = device_for(backend)
    cu = random_cu_seqlens(gen, 5, 1)
    n_tokens = int(cu[-1]) + 3
    cos, sin = rope_cache(64, 32, device=dev)
    x = thd(gen, n_tokens, 2, 32, torch.bfloat16, device=dev)
    pos = torch.cat((global_positions(cu), torch.zeros(3, dtype=torch.int64))).to(dev)
    cu = cu.to(dev)
    assert torch.equal(apply_rotary_emb(x, cos, sin, cu, position_ids=pos, backend=backend),
                       apply_rotary_emb(x, cos, sin, cu, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cp", [(1, 0), (2, 1), (4, 3), (3, 0)], ids=lambda c: f"cp{c[0]}r{c[1]}")
def test_start_positions_compose_with_cp(cp, backend):
    """start_positions [B] (int32) shift each sequence's global positions; on every
    rank, forward and backward equal the reference at positions
    ``start[b] + global_positions(local_cu, cp_size, cp_rank)``."""
    cp_size, cp_rank = cp
    gen = torch.Generator().manual_seed(10 * cp_size + cp_rank)
    dev = device_for(backend)
    cu = random_cu_seqlens(gen, 5, cp_size, max_len=10)
    n_tokens = int(cu[-1]) + 2
    cos, sin = rope_cache(400, 16)
    start = torch.randint(0, 400 - cp_size * 10, (cu.numel() - 1,), generator=gen, dtype=torch.int32)
    pos = global_positions(cu, cp_size, cp_rank) + start.long()[_seq_ids(cu)]
    q = thd(gen, n_tokens, 2, 16, torch.float32, device=dev).requires_grad_()
    k = thd(gen, n_tokens, 1, 16, torch.float32, strided=True, device=dev).requires_grad_()
    ref_in = [t.detach().to("cpu", torch.float64).requires_grad_() for t in (q, k)]
    refs = [rope_reference(t, cos, sin, cu, positions=pos) for t in ref_in]
    _fwd_bwd(q, k, gen, torch.float32, refs, ref_in, cos=cos.to(dev), sin=sin.to(dev),
             cu_seqlens=cu.to(dev), start_positions=start.to(dev), cp_size=cp_size,
             cp_rank=cp_rank, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_start_positions_int_equals_tensor_and_sharded_equals_global(backend):
    """An int start equals a [B] tensor filled with it; with cp_size 2 the ranks'
    results, put back at their zigzag rows, equal the cp_size 1 result with the
    same start_positions (the offset is global)."""
    gen = torch.Generator().manual_seed(5)
    dev = device_for(backend)
    cu = torch.tensor([0, 8, 12, 24], dtype=torch.int32)
    start = torch.tensor([3, 50, 7], dtype=torch.int32)
    cos, sin = rope_cache(128, 16, device=dev)
    x = thd(gen, 24, 2, 16, torch.float32, device=dev)
    whole = apply_rotary_emb(x, cos, sin, cu.to(dev), start_positions=start.to(dev), backend=backend)
    rebuilt = poison_(torch.empty_like(x))
    local = local_cu_seqlens(cu, 2).to(dev)
    for rank in range(2):
        idx = cp_shard_indices(cu, 2, rank).to(dev)
        rebuilt[idx] = apply_rotary_emb(x[idx], cos, sin, local, cp_size=2, cp_rank=rank,
                                        start_positions=start.to(dev), backend=backend)
    assert torch.equal(rebuilt, whole)
    full = torch.full((3,), 9, dtype=torch.int32, device=dev)
    assert torch.equal(apply_rotary_emb(x, cos, sin, cu.to(dev), start_positions=9, max_seqlen=12,
                                        backend=backend),
                       apply_rotary_emb(x, cos, sin, cu.to(dev), start_positions=full, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_conjugate_is_the_inverse_rotation(backend):
    gen = torch.Generator().manual_seed(6)
    dev = device_for(backend)
    cu = random_cu_seqlens(gen, 4, 2)
    n_tokens = int(cu[-1]) + 2
    cos, sin = rope_cache(128, 12)
    x = thd(gen, n_tokens, 3, 20, torch.float32, device=dev)
    kw = dict(cp_size=2, cp_rank=1, interleaved=True, backend=backend)
    y = apply_rotary_emb(x, cos.to(dev), sin.to(dev), cu.to(dev), conjugate=True, **kw)
    assert_close(y, rope_reference(x, cos, sin, cu, 2, 1, True, conjugate=True), name="conjugate")
    back = apply_rotary_emb(y, cos.to(dev), sin.to(dev), cu.to(dev), **kw)
    assert_close(back, x.double(), name="rotate(conjugate(x))")


@pytest.mark.parametrize("inplace", [False, True])
def test_partial_head_block_is_clipped(inplace):
    """Hq = 6, Hk = 3 with 4 heads per program: the second q block and the k
    block are partial. Every head is written (poisoned outputs), none twice (in
    place: a second rotation would fail the comparison), and nothing past the
    last head of q or k is touched (guard heads around them stay as they were)."""
    gen = torch.Generator().manual_seed(7)
    dev = device_for("triton")
    cu = torch.tensor([0, 5, 11], dtype=torch.int32, device=dev)
    buf = thd(gen, 13, 1 + 6 + 1 + 3 + 1, 16, torch.float32, device=dev)
    before = buf.clone()
    q, k = buf[:, 1:7], buf[:, 8:11]
    cos, sin = rope_cache(16, 8, device=dev)
    refs = [rope_reference(t, cos, sin, cu) for t in (q, k)]
    if inplace:
        out_q, out_k = q, k
    else:
        out_buf = poison_(torch.empty_like(buf))
        out_q, out_k = out_buf[:, 1:7], out_buf[:, 8:11]
    rotary_triton(q, k, out_q, out_k, cos, sin, cu, 1, 0, False, False, config={"heads_per_prog": 4})
    assert_close(out_q, refs[0], name="q (6 heads, blocks of 4)")
    assert_close(out_k, refs[1], name="k (3 heads, a block of 4)")
    guards = [0, 7, 11]
    target = buf if inplace else out_buf
    expect = before if inplace else torch.full_like(buf, float("nan"))
    assert torch.equal(target[:, guards].isnan(), expect[:, guards].isnan())
    if inplace:
        assert torch.equal(target[:, guards], expect[:, guards])


# ----------------------------------------------------------------- bad input
_POS = torch.arange(10)
BAD = {
    "position_ids_float": (TypeError, "position_ids must be int32 or int64",
                           dict(position_ids=_POS.float())),
    "position_ids_list": (TypeError, "position_ids must be a torch.Tensor", dict(position_ids=[0] * 10)),
    "position_ids_length": (ValueError, r"position_ids must be 1-D \[T\] = \[10\]",
                            dict(position_ids=torch.arange(9))),
    "position_ids_2d": (ValueError, "position_ids must be 1-D", dict(position_ids=_POS[None])),
    "position_ids_device": (ValueError, "position_ids is on meta",
                            dict(position_ids=torch.empty(10, dtype=torch.int64, device="meta"))),
    "position_ids_beyond_cache": (ValueError, "position_ids: position 32 exceeds the cos/sin cache",
                                  dict(position_ids=torch.tensor([0] * 9 + [32]))),
    "position_ids_negative": (ValueError, "position_ids: negative position -1",
                              dict(position_ids=torch.tensor([0, -1] + [0] * 8, dtype=torch.int32))),
    "position_ids_beyond_max_position_id": (ValueError, "exceeds max_position_id",
                                            dict(position_ids=_POS, max_position_id=8)),
    "position_ids_with_cp": (ValueError, "position_ids with cp_size=2",
                             dict(position_ids=_POS, cp_size=2)),
    "position_ids_and_start_positions": (ValueError, "position_ids or start_positions, not both",
                                         dict(position_ids=_POS, start_positions=0)),
    "start_positions_length": (ValueError, r"start_positions must be 1-D \[B\] = \[2\]",
                               dict(start_positions=torch.zeros(3, dtype=torch.int32))),
    "start_positions_float": (TypeError, "start_positions must be int32 or int64",
                              dict(start_positions=torch.zeros(2))),
    "start_positions_bool": (TypeError, "start_positions must be an int", dict(start_positions=True)),
    "start_positions_negative_int": (ValueError, "start_positions must be >= 0", dict(start_positions=-1)),
    "start_positions_negative": (ValueError, r"start_positions\[1\] = -3 is negative",
                                 dict(start_positions=torch.tensor([0, -3], dtype=torch.int32))),
    "start_positions_beyond_cache": (ValueError, "start_positions: position 32 exceeds",
                                     dict(start_positions=torch.tensor([0, 27], dtype=torch.int32))),
    "start_positions_int_beyond_cache": (ValueError, "start_positions = 23",
                                         dict(start_positions=23, max_seqlen=10)),
    "start_positions_int_beyond_cache_content": (ValueError, "start_positions: position 32",
                                                 dict(start_positions=27)),
    "max_position_id_beyond_cache": (ValueError, "max_position_id = 32 is beyond the cos/sin cache",
                                     dict(max_position_id=32)),
    "max_position_id_float": (TypeError, "max_position_id must be an int", dict(max_position_id=3.0)),
    "conjugate_not_bool": (TypeError, "conjugate must be a bool", dict(conjugate=1)),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_positions_raise(case):
    assert_bad_input_raises(*BAD[case])


def test_good_positions_at_the_cache_edge_pass():
    """The bounds are tight: the last cache row is allowed."""
    g = small_batch()
    apply_rotary_emb(g["x"], g["cos"], g["sin"], g["cu_seqlens"], position_ids=torch.tensor([0] * 9 + [31]),
                     max_position_id=31)
    apply_rotary_emb(g["x"], g["cos"], g["sin"], g["cu_seqlens"],
                     start_positions=torch.tensor([0, 26], dtype=torch.int32))
    apply_rotary_emb(g["x"], g["cos"], g["sin"], g["cu_seqlens"], start_positions=22, max_seqlen=10)


@pytest.mark.gpu
def test_debug_checks_device_position_ids(monkeypatch):
    """CUDA position_ids beyond the cache: unchecked by default (no sync), a
    ValueError with CP_ROPE_DEBUG=1."""
    x = torch.randn(10, 2, 8, device="cuda")
    cos, sin = rope_cache(32, 8, device="cuda")
    cu = torch.tensor([0, 10], dtype=torch.int32, device="cuda")
    bad = torch.full((10,), 31, device="cuda")
    bad[3] = 40
    monkeypatch.setenv("CP_ROPE_DEBUG", "0")
    apply_rotary_emb(x, cos, sin, cu, position_ids=torch.full((10,), 31, device="cuda"))
    monkeypatch.setenv("CP_ROPE_DEBUG", "1")
    with pytest.raises(ValueError, match="position_ids: position 40 exceeds"):
        apply_rotary_emb(x, cos, sin, cu, position_ids=bad)
    with pytest.raises(ValueError, match="start_positions: position 40"):
        apply_rotary_emb(x, cos, sin, cu, start_positions=torch.tensor([31], device="cuda"))


# --- positions from a per-batch plan (issue 20 item 4): the search-free kernel path ----------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("cp", [(1, 0), (2, 1), (4, 3)], ids=lambda c: f"cp{c[0]}r{c[1]}")
def test_plan_positions_equal_the_formula_into_poisoned_outputs(cp, interleaved, backend):
    """What ``plan.rope_args()`` passes (int32 global positions ``[T]``, cp_size 1, the
    local cu_seqlens): launcher level, into NaN-poisoned outputs, q (strided) and a GQA
    k with pass-through dims and 5 trailing padding rows whose entries are garbage:
    bit-equal to the CP formula's result on the same rank, within tolerance of the
    float64 reference, padding rows and dims >= rotary_dim copied exactly."""
    cp_size, cp_rank = cp
    gen = torch.Generator().manual_seed(100 * cp_size + 10 * cp_rank + int(interleaved))
    dev = device_for(backend)
    cu = random_cu_seqlens(gen, 7, cp_size)
    n = int(cu[-1])
    n_tokens = n + 5
    cos, sin = rope_cache(cp_size * 30, 12, device=dev)
    pos = torch.cat((global_positions(cu, cp_size, cp_rank),
                     torch.randint(-10**6, 10**6, (5,), generator=gen))).to(dev, torch.int32)
    q = thd(gen, n_tokens, 3, 20, torch.bfloat16, strided=True, device=dev)
    k = thd(gen, n_tokens, 1, 20, torch.bfloat16, device=dev)
    launch = rotary_triton if backend == "triton" else rotary_torch_qk
    outs = []
    for kw in (dict(position_ids=pos), {}):
        out_q, out_k = poison_(torch.empty_like(q)), poison_(torch.empty_like(k))
        launch(q, k, out_q, out_k, cos, sin, cu.to(dev), *((1, 0) if kw else cp), interleaved,
               False, **kw)
        outs.append((out_q, out_k))
    for x, got, formula in zip((q, k), outs[0], outs[1], strict=True):
        assert torch.equal(got, formula)
        assert torch.equal(got[n:], x[n:])
        assert torch.equal(got[:, :, 12:], x[:, :, 12:])
        want = rope_reference(x.cpu(), cos.cpu(), sin.cpu(), cu, cp_size, cp_rank, interleaved)
        assert_close(got.cpu(), want, name="out")


def test_module_forward_takes_plan_positions():
    """``RotaryEmbedding.forward(..., position_ids=, max_position_id=)`` rotates by those
    positions (float64 reference, forward and gradients) and checks them against the bound."""
    from cp_rope import RotaryEmbedding

    gen = torch.Generator().manual_seed(21)
    cu = random_cu_seqlens(gen, 4, 1)
    n_tokens = int(cu[-1]) + 2
    rope = RotaryEmbedding(16, 200)
    pos = torch.randint(0, 200, (n_tokens,), generator=gen, dtype=torch.int32)
    q = thd(gen, n_tokens, 2, 16, torch.float32).requires_grad_()
    k = thd(gen, n_tokens, 1, 16, torch.float32).requires_grad_()
    ref_in = [t.detach().double().requires_grad_() for t in (q, k)]
    refs = [rope_reference(t, rope.cos, rope.sin, cu, positions=pos) for t in ref_in]
    qo, ko = rope(q, k, cu, position_ids=pos, max_position_id=199)
    assert_close(qo, refs[0], name="q_out")
    assert_close(ko, refs[1], name="k_out")
    wq, wk = torch.randn(qo.shape, generator=gen), torch.randn(ko.shape, generator=gen)
    got = torch.autograd.grad((qo * wq).sum() + (ko * wk).sum(), (q, k))
    want = torch.autograd.grad((refs[0] * wq.double()).sum() + (refs[1] * wk.double()).sum(), ref_in)
    assert_close(got[0], want[0], name="dq")
    assert_close(got[1], want[1], name="dk")
    with pytest.raises(ValueError, match="exceeds max_position_id"):
        rope(q.detach(), k.detach(), cu, position_ids=pos, max_position_id=int(pos[: int(cu[-1])].max()) - 1)
