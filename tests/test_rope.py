"""cp_rope.apply_rotary_emb(_qk): forward and backward of both backends against an
independent float64 reference; CP positions; padding; layouts; accuracy; bad input.

The Triton backend runs the kernel itself (under TRITON_INTERPRET=1 on CPU),
so its shapes are kept small.
"""

from __future__ import annotations

import math
import zlib

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

import cp_rope
from cp_rope import apply_rotary_emb, apply_rotary_emb_qk, global_positions, rope_cache
from cp_rope.kernel import rotary_triton
from cp_rope.ops import resolve_backend
from cp_rope.parallel.sharding import cp_shard_indices, local_cu_seqlens
from cp_rope.torch_backend import rotary_torch, token_positions

BACKENDS = ["torch", "triton"]
CP = [(1, 0), (2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]
HEAD_DIM = {torch.float32: 24, torch.float16: 16, torch.bfloat16: 80}  # 80: non-power-of-2


def test_token_positions_match_global_positions():
    """The kernel-side formulation (binary search of each row) against the reference
    formula, on 300 random batches: zero-length, one-token, trailing padding."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        cp_size, cp_rank = CP[int(torch.randint(len(CP), (1,), generator=gen))]
        lens = torch.randint(0, 10, (int(torch.randint(0, 13, (1,), generator=gen)),), generator=gen)
        lens = lens * 2 if cp_size > 1 else lens
        cu = torch.cat((torch.zeros(1, dtype=torch.int64), lens.cumsum(0))).to(torch.int32)
        n, pad = int(cu[-1]), int(torch.randint(0, 6, (1,), generator=gen))
        pos, valid = token_positions(cu, n + pad, cp_size, cp_rank)
        assert valid.tolist() == [True] * n + [False] * pad
        assert torch.equal(pos[:n], global_positions(cu, cp_size, cp_rank))
        assert torch.equal(pos[n:], torch.zeros(pad, dtype=torch.int64))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cp", CP, ids=[f"cp{c}r{r}" for c, r in CP])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("rot_frac", [0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_forward_backward_grid(dtype, rot_frac, interleaved, cp, backend):
    """q (a strided view) and k (contiguous, fewer heads) in one call, fwd + bwd
    under two loss shapes, on random cu_seqlens with zero-length, one-token and
    trailing zero-length sequences and trailing padding rows."""
    cp_size, cp_rank = cp
    # crc32, not hash(): str hashes are salted per process (PYTHONHASHSEED), so a failure
    # would not reproduce on the next run
    gen = torch.Generator().manual_seed(zlib.crc32(repr((str(dtype), rot_frac, interleaved, cp)).encode()))
    head_dim = HEAD_DIM[dtype]
    rotary_dim = int(head_dim * rot_frac) // 2 * 2
    cu = random_cu_seqlens(gen, 9, cp_size)
    n_tokens = int(cu[-1]) + 5
    dev = device_for(backend)
    cos, sin = rope_cache(cp_size * 24 + 2, rotary_dim)
    q = thd(gen, n_tokens, 2, head_dim, dtype, strided=True, device=dev).requires_grad_()
    k = thd(gen, n_tokens, 1, head_dim, dtype, device=dev).requires_grad_()
    qo, ko = apply_rotary_emb_qk(q, k, cos.to(dev), sin.to(dev), cu.to(dev), max_seqlen=24,
                                 cp_size=cp_size, cp_rank=cp_rank, interleaved=interleaved,
                                 backend=backend)
    ref_in = [t.detach().to("cpu", torch.float64).requires_grad_() for t in (q, k)]
    refs = [rope_reference(t, cos, sin, cu, cp_size, cp_rank, interleaved) for t in ref_in]
    assert_close(qo, refs[0], name="q_out")
    assert_close(ko, refs[1], name="k_out")
    weights = {"sum": [torch.ones_like(qo), torch.ones_like(ko)],
               "weighted": [torch.randn(t.shape, generator=gen).to(dev, dtype) for t in (qo, ko)]}
    for loss_name, (wq, wk) in weights.items():
        loss = (qo * wq).sum() + (ko * wk).sum() if loss_name == "weighted" else qo.sum() + ko.sum()
        gq, gk = torch.autograd.grad(loss, (q, k), retain_graph=True)
        ref_loss = sum((r * w.to("cpu", torch.float64)).sum()
                       for r, w in zip(refs, (wq, wk), strict=True))
        rq, rk = torch.autograd.grad(ref_loss, ref_in, retain_graph=True)
        assert_close(gq, rq, name=f"dq ({loss_name})")
        assert_close(gk, rk, name=f"dk ({loss_name})")


TE_BOUNDARIES = [0, 400, 542, 711, 727, 752, 1270, 1426, 1450, 1954, 2044, 2048]


def _te_global_cu(cp_size: int) -> torch.Tensor:
    lens = torch.tensor(TE_BOUNDARIES).diff()
    lens = (lens + 2 * cp_size - 1) // (2 * cp_size) * (2 * cp_size)
    return torch.cat((torch.zeros(1, dtype=torch.int64), lens.cumsum(0))).to(torch.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])  # 3: a CP degree that is not a power of 2
def test_te_boundaries_sharded_equals_global(cp_size, backend):
    """TE-style boundaries padded to multiples of 2*cp_size: every rank's local
    result, placed at its zigzag rows (cp_shard_indices), rebuilds the
    single-process (cp_size=1) result on the global batch exactly."""
    gen = torch.Generator().manual_seed(cp_size)
    heads, head_dim = (4, 128) if backend == "torch" else (1, 16)
    cu = _te_global_cu(cp_size)
    total = int(cu[-1])
    dev = device_for(backend)
    cos, sin = rope_cache(total, head_dim)
    x = thd(gen, total, heads, head_dim, torch.float32)
    expected = rope_reference(x, cos, sin, cu)
    cos, sin, xd = cos.to(dev), sin.to(dev), x.to(dev)
    whole = apply_rotary_emb(xd, cos, sin, cu.to(dev), max_seqlen=total, backend=backend)
    assert_close(whole, expected, name="cp_size=1")
    rebuilt = torch.full_like(xd, float("nan"))
    local_cu = local_cu_seqlens(cu, cp_size).to(dev)
    for rank in range(cp_size):
        idx = cp_shard_indices(cu, cp_size, rank).to(dev)
        rebuilt[idx] = apply_rotary_emb(xd[idx], cos, sin, local_cu, cp_size=cp_size,
                                        cp_rank=rank, backend=backend)
    assert torch.equal(rebuilt, whole)


@pytest.mark.parametrize("cu_list", [[0, 3, 3, 7, 8, 8, 8], [0]], ids=["zero-length+padding", "no-sequences"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_row_and_dim_written(backend, cu_list):
    """Launcher level, into poisoned (NaN) outputs: trailing padding rows and the
    pass-through dims come out equal to the input; the rest is rotated."""
    gen = torch.Generator().manual_seed(1)
    dev = device_for(backend)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=dev)
    q = thd(gen, 13, 3, 20, torch.bfloat16, device=dev)
    k = thd(gen, 13, 2, 20, torch.bfloat16, device=dev)
    cos, sin = rope_cache(16, 12, device=dev)
    out_q, out_k = poison_(torch.empty_like(q)), poison_(torch.empty_like(k))
    if backend == "triton":
        rotary_triton(q, k, out_q, out_k, cos, sin, cu, 1, 0, False, False)
    else:
        rotary_torch(q, cos, sin, cu, out=out_q)
        rotary_torch(k, cos, sin, cu, out=out_k)
    n = cu_list[-1]
    for x, out in ((q, out_q), (k, out_k)):
        assert torch.equal(out[n:], x[n:])
        assert torch.equal(out[:, :, 12:], x[:, :, 12:])
        assert_close(out, rope_reference(x, cos, sin, cu), name="out")


def test_zero_q_heads_still_writes_k_pass_through_dims():
    """q with 0 heads (its storage pointer is 0, like any empty tensor's): k's
    pass-through dims are still copied into a poisoned out_k (the launcher once
    took out_q.data_ptr() == q.data_ptr() for in place and skipped the copy)."""
    gen = torch.Generator().manual_seed(11)
    dev = device_for("triton")
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=dev)
    q, k = thd(gen, 11, 0, 16, torch.float32, device=dev), thd(gen, 11, 2, 16, torch.float32, device=dev)
    cos, sin = rope_cache(16, 8, device=dev)
    out_q, out_k = torch.empty_like(q), poison_(torch.empty_like(k))
    rotary_triton(q, k, out_q, out_k, cos, sin, cu, 1, 0, False, False)
    assert torch.equal(out_k[:, :, 8:], k[:, :, 8:])
    assert_close(out_k, rope_reference(k, cos, sin, cu), name="k_out")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_one_launch_equals_two(backend):
    gen = torch.Generator().manual_seed(2)
    dev = device_for(backend)
    cu = random_cu_seqlens(gen, 6, 2)
    n = int(cu[-1]) + 3
    cu = cu.to(dev)
    cos, sin = rope_cache(64, 32, device=dev)
    q, k = (thd(gen, n, h, 32, torch.bfloat16, device=dev) for h in (5, 1))
    qo, ko = apply_rotary_emb_qk(q, k, cos, sin, cu, cp_size=2, cp_rank=1, backend=backend)
    assert torch.equal(qo, apply_rotary_emb(q, cos, sin, cu, cp_size=2, cp_rank=1, backend=backend))
    assert torch.equal(ko, apply_rotary_emb(k, cos, sin, cu, cp_size=2, cp_rank=1, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inplace", [False, True])
def test_fused_projection_views(backend, inplace):
    """q and k as views of one [T, Hq + 2 Hkv, D] projection (GQA 4:2, partial
    rotary): same result as on contiguous copies; in place, v is untouched and
    the returned tensors are the inputs."""
    gen = torch.Generator().manual_seed(3)
    dev = device_for(backend)
    cu = random_cu_seqlens(gen, 5, 1)
    n = int(cu[-1]) + 2
    cu = cu.to(dev)
    qkv = thd(gen, n, 8, 24, torch.float16, device=dev)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    v0, q0, k0 = v.clone(), q.contiguous(), k.contiguous()
    cos, sin = rope_cache(32, 16, device=dev)
    eq, ek = apply_rotary_emb_qk(q0, k0, cos, sin, cu, backend=backend)
    qo, ko = apply_rotary_emb_qk(q, k, cos, sin, cu, inplace=inplace, backend=backend)
    assert torch.equal(qo, eq) and torch.equal(ko, ek)
    assert torch.equal(v, v0)
    if inplace:
        assert qo is q and ko is k and torch.equal(qkv[:, :4], eq)


def test_inplace_single_tensor_and_not_differentiable():
    gen = torch.Generator().manual_seed(4)
    dev = device_for("triton")
    cu = torch.tensor([0, 5, 9], dtype=torch.int32, device=dev)
    x = thd(gen, 9, 2, 8, torch.float32, device=dev)
    cos, sin = rope_cache(16, 8, device=dev)
    expected = rope_reference(x, cos, sin, cu)
    out = apply_rotary_emb(x, cos, sin, cu, inplace=True, backend="triton")
    assert out is x
    assert_close(x, expected, name="in place")
    with pytest.raises(ValueError, match="inplace"):
        apply_rotary_emb(x.clone().requires_grad_(), cos, sin, cu, inplace=True)


def test_backward_saves_no_activations():
    """The autograd graph holds only cos/sin/cu_seqlens (inputs), not q/k or outputs."""
    gen = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    q = thd(gen, 6, 2, 8, torch.float32).requires_grad_()
    k = thd(gen, 6, 1, 8, torch.float32).requires_grad_()
    cos, sin = rope_cache(8, 8)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        qo, ko = apply_rotary_emb_qk(q, k, cos, sin, cu)
    assert {t.data_ptr() for t in saved} <= {cos.data_ptr(), sin.data_ptr(), cu.data_ptr()}
    (qo.sum() + ko.sum()).backward()
    assert q.grad is not None and k.grad is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_accuracy_at_2_pow_21_positions(backend):
    """fp32 input, positions up to 2**21 - 1: max abs error vs float64 angles <= 1e-5.

    A huge cp_size reaches the far positions with few local rows: local
    sequences of 2c rows on rank r hold positions (r*c .. r*c+c-1) and
    ((2C-1-r)*c ..), and C*2c = 2**21."""
    n_pos, rotary_dim = 2**21, 16
    dev = device_for(backend)
    cos, sin = rope_cache(n_pos, rotary_dim, device=dev)
    c = 4
    cp_size = n_pos // (2 * c)
    gen = torch.Generator().manual_seed(6)
    cu = torch.tensor([0, 2 * c, 4 * c, 6 * c], dtype=torch.int32)
    freq = 10000.0 ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    worst = 0.0
    for rank in (0, cp_size // 3, cp_size - 1):
        x = thd(gen, 6 * c, 2, rotary_dim, torch.float32)
        out = apply_rotary_emb(x.to(dev), cos, sin, cu.to(dev), cp_size=cp_size, cp_rank=rank,
                               backend=backend).cpu()
        ang = global_positions(cu, cp_size, rank).to(torch.float64)[:, None] * freq
        exact = rope_reference(x, torch.cos(ang), torch.sin(ang), torch.tensor([0, 6 * c], dtype=torch.int32))
        worst = max(worst, (out.double() - exact).abs().max().item())
        if rank == cp_size - 1:  # the test can fail: fp32 angles are far off here
            ang32 = (global_positions(cu, cp_size, rank).float()[:, None] * freq.float()).double()
            naive = rope_reference(x, torch.cos(ang32), torch.sin(ang32),
                                   torch.tensor([0, 6 * c], dtype=torch.int32))
            assert (naive - exact).abs().max().item() > 1e-3
    assert worst <= 1e-5, worst


def test_module_matches_functional():
    gen = torch.Generator().manual_seed(7)
    rope = cp_rope.RotaryEmbedding(16, 128, base=500000.0, interleaved=True)
    assert not rope.state_dict()  # cache is rebuilt, not checkpointed
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    q, k = thd(gen, 20, 3, 32, torch.float32), thd(gen, 20, 1, 32, torch.float32)
    cos, sin = rope_cache(128, 16, base=500000.0)
    got = rope(q, k, cu, cp_size=2, cp_rank=1)
    want = apply_rotary_emb_qk(q, k, cos, sin, cu, cp_size=2, cp_rank=1, interleaved=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_backend_selection(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("CP_ROPE_BACKEND", raising=False)
    assert resolve_backend("auto", cpu) == "torch"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_backend("triton", cpu) == "triton"
    monkeypatch.setenv("CP_ROPE_BACKEND", "triton")
    assert resolve_backend("auto", cpu) == "triton"
    assert resolve_backend("torch", cpu) == "torch"  # explicit beats the env
    monkeypatch.setenv("CP_ROPE_BACKEND", "cuda")
    with pytest.raises(ValueError, match="CP_ROPE_BACKEND"):
        resolve_backend("auto", cpu)
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("fast", cpu)


# ----------------------------------------------------------------- bad input
BAD = {
    "x_not_tensor": (TypeError, "x must be a torch.Tensor", dict(x=[1.0])),
    "x_wrong_rank": (ValueError, r"x must be \[T, H, D\]", dict(x=torch.randn(10, 8))),
    "x_wrong_dtype": (TypeError, "x must be float32", dict(x=torch.randn(10, 2, 8).double())),
    "cos_sin_disagree": (ValueError, "cos and sin shapes disagree", dict(sin=torch.randn(32, 3))),
    "cos_wrong_rank": (ValueError, r"cos must be \[max_positions", dict(cos=torch.randn(32, 4, 1))),
    "sin_int": (TypeError, "sin must be float32", dict(sin=torch.zeros(32, 4, dtype=torch.int32))),
    "rotary_dim_too_large": (ValueError, "rotary_dim = 2 \\* cos.shape\\[1\\] = 10 exceeds head_dim",
                             dict(cos=torch.randn(32, 5), sin=torch.randn(32, 5))),
    "rotary_dim_zero": (ValueError, "rotary_dim", dict(cos=torch.randn(32, 0), sin=torch.randn(32, 0))),
    "cu_seqlens_int64": (TypeError, "cu_seqlens must be int32", dict(cu_seqlens=torch.tensor([0, 10]))),
    "cu_seqlens_2d": (ValueError, "cu_seqlens must be 1-D",
                      dict(cu_seqlens=torch.zeros(2, 2, dtype=torch.int32))),
    "cu_seqlens_not_zero_start": (ValueError, r"cu_seqlens\[0\] must be 0",
                                  dict(cu_seqlens=torch.tensor([1, 4, 10], dtype=torch.int32))),
    "cu_seqlens_decreasing": (ValueError, "non-decreasing",
                              dict(cu_seqlens=torch.tensor([0, 6, 4, 10], dtype=torch.int32))),
    "cu_seqlens_beyond_T": (ValueError, r"cu_seqlens\[-1\] = 12 exceeds",
                            dict(cu_seqlens=torch.tensor([0, 4, 12], dtype=torch.int32))),
    "cu_seqlens_odd_with_cp": (ValueError, "must be even",
                               dict(cu_seqlens=torch.tensor([0, 3, 10], dtype=torch.int32), cp_size=2)),
    "cu_seqlens_beyond_cache": (ValueError, "beyond the cos/sin cache",
                                dict(cu_seqlens=torch.tensor([0, 10], dtype=torch.int32), cp_size=4)),
    "cp_rank_out_of_range": (ValueError, "cp_rank", dict(cp_size=2, cp_rank=2)),
    "cp_size_zero": (ValueError, "cp_size", dict(cp_size=0)),
    "cp_rank_float": (TypeError, "cp_rank", dict(cp_rank=0.0)),
    "max_seqlen_beyond_cache": (ValueError, "max_seqlen = 40", dict(max_seqlen=40)),
    "max_seqlen_float": (TypeError, "max_seqlen must be an int", dict(max_seqlen=6.0)),
    "interleaved_not_bool": (TypeError, "interleaved", dict(interleaved=1)),
    "backend_unknown": (ValueError, "backend must be one of", dict(backend="cuda")),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_raises(case):
    assert_bad_input_raises(*BAD[case])


@pytest.mark.parametrize("case", ["k_dtype", "k_shape", "k_none"])
def test_bad_k_raises(case):
    g = small_batch()
    q = g["x"]
    k = {"k_dtype": q.half(), "k_shape": torch.randn(10, 1, 6), "k_none": None}[case]
    exc = ValueError if case == "k_shape" else TypeError
    with pytest.raises(exc, match="k must"):
        apply_rotary_emb_qk(q, k, g["cos"], g["sin"], g["cu_seqlens"])


def test_rope_cache_bad_rotary_dim():
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        rope_cache(16, 7)
    with pytest.raises(ValueError, match="max_positions"):
        rope_cache(0, 8)


# ----------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_debug_checks_device_cu_seqlens(monkeypatch):
    """CUDA cu_seqlens: contents unchecked by default (no sync), checked with CP_ROPE_DEBUG=1."""
    x = torch.randn(10, 2, 8, device="cuda")
    cos, sin = rope_cache(32, 8, device="cuda")
    bad = torch.tensor([0, 6, 4, 10], dtype=torch.int32, device="cuda")
    monkeypatch.setenv("CP_ROPE_DEBUG", "0")
    apply_rotary_emb(x, cos, sin, bad)
    monkeypatch.setenv("CP_ROPE_DEBUG", "1")
    with pytest.raises(ValueError, match="non-decreasing"):
        apply_rotary_emb(x, cos, sin, bad)


@pytest.mark.gpu
@pytest.mark.parametrize("plan_positions", [False, True], ids=["formula", "plan_positions"])
def test_int64_addressing_over_2_pow_31_elements(plan_positions):
    """q with more than 2**31 elements (bf16, ~4.3 GB): the last token's rows
    match the reference (int32 offsets would wrap around there), with the CP
    formula and with a plan's int32 ``position_ids``."""
    if torch.cuda.get_device_properties(0).total_memory < 20 * 2**30:
        pytest.skip("needs a GPU with >= 20 GB")
    dev = torch.device("cuda")
    heads, head_dim = 32, 128
    n_tokens = 2**31 // (heads * head_dim) + 64
    q = torch.empty(n_tokens, heads, head_dim, device=dev, dtype=torch.bfloat16)
    q.normal_()
    k = torch.randn(n_tokens, 1, head_dim, device=dev, dtype=torch.bfloat16)
    cu = torch.tensor([0, n_tokens // 2, n_tokens - 10], dtype=torch.int32, device=dev)
    cos, sin = rope_cache(n_tokens, head_dim, device=dev)
    kw = {}
    if plan_positions:
        kw["position_ids"] = torch.zeros(n_tokens, dtype=torch.int32, device=dev)
        kw["position_ids"][: n_tokens - 10] = global_positions(cu).to(torch.int32)
    qo, ko = apply_rotary_emb_qk(q, k, cos, sin, cu, backend="triton", **kw)
    # the last 20 rows: 10 rows at the end of sequence 1, then 10 padding rows
    tail = slice(n_tokens - 20, n_tokens)
    pos = torch.arange(n_tokens - 20, n_tokens - 10, dtype=torch.float64) - n_tokens // 2
    ang = pos[:, None] * (10000.0 ** (-torch.arange(0, head_dim, 2).double() / head_dim))
    for x, out in ((q, qo), (k, ko)):
        xs = x[tail].cpu()
        ref = rope_reference(xs, torch.cos(ang), torch.sin(ang),
                             torch.tensor([0, 10], dtype=torch.int32))
        assert_close(out[tail].cpu(), ref, name="last rows")
        assert torch.equal(out[-10:].cpu(), xs[-10:])
    assert math.prod(q.shape) > 2**31


# --- inputs a fresh user tried (each must fail loudly, never silently) ------------------------


def test_half_precision_cos_sin_rejected():
    q = torch.randn(8, 2, 16)
    cos, sin = cp_rope.rope_cache(64, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="cos must be float32"):
        cp_rope.apply_rotary_emb(q, cos.bfloat16(), sin.bfloat16(), cu)
    with pytest.raises(TypeError, match="cos and sin dtypes disagree"):
        cp_rope.apply_rotary_emb(q, cos, sin.double(), cu)


def test_rope_cache_rejects_integer_dtype():
    with pytest.raises(TypeError, match="dtype must be a floating"):
        cp_rope.rope_cache(16, 8, dtype=torch.int32)


def test_inplace_with_k_aliasing_q_rejected():
    q = torch.randn(8, 2, 16)
    cos, sin = cp_rope.rope_cache(64, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    before = q.clone()
    with pytest.raises(ValueError, match="rotate it twice"):
        cp_rope.apply_rotary_emb_qk(q, q, cos, sin, cu, inplace=True)
    assert torch.equal(q, before)


def test_rotary_embedding_keeps_float32_tables_when_module_is_cast():
    rope = cp_rope.RotaryEmbedding(16, 4096, base=500000.0)
    expected_cos = rope.cos.clone()
    rope.to(torch.bfloat16)
    assert rope.cos.dtype == torch.float32 and rope.sin.dtype == torch.float32
    assert torch.equal(rope.cos, expected_cos)
    q = torch.randn(40, 2, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, 40], dtype=torch.int32)
    out, _ = rope(q, q.clone(), cu)  # works on the bf16 inputs with the float32 tables
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", BACKENDS)
def test_double_backward(backend):
    """The backward is itself differentiable (create_graph=True): for y = R x and
    g = R^T w, d(sum g)/dw = R 1, the forward rotation of ones."""
    gen = torch.Generator().manual_seed(12)
    dev = device_for(backend)
    cu = torch.tensor([0, 5, 9], dtype=torch.int32, device=dev)
    cos, sin = rope_cache(16, 8, device=dev)
    x = thd(gen, 11, 2, 8, torch.float32, device=dev).requires_grad_()
    w = thd(gen, 11, 2, 8, torch.float32, device=dev).requires_grad_()
    y = apply_rotary_emb(x, cos, sin, cu, backend=backend)
    (g,) = torch.autograd.grad(y, x, grad_outputs=w, create_graph=True)
    assert_close(g, rope_reference(w.detach(), cos, sin, cu, conjugate=True), name="R^T w")
    (gw,) = torch.autograd.grad(g.sum(), w)
    assert_close(gw, rope_reference(torch.ones_like(x), cos, sin, cu), name="R 1")


# ------------------------------------------------------------------ max_seqlen below the longest sequence (after issue 15)

def test_rope_max_seqlen_below_longest_sequence():
    """(Found after issue 15, so not in CATALOGUE: it was silent.) max_seqlen is the host
    bound the cache check uses: one below the longest local sequence (CPU cu_seqlens, read
    anyway) is refused, naming max_seqlen."""
    from cp_rope import apply_rotary_emb, apply_rotary_emb_qk
    cos, sin = rope_cache(64, 8)
    q, k = torch.randn(20, 2, 8), torch.randn(20, 1, 8)
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"max_seqlen = 11 is below the longest local sequence \(12\)"):
        apply_rotary_emb_qk(q, k, cos, sin, cu, max_seqlen=11)
    with pytest.raises(ValueError, match=r"max_seqlen = 6 is below"):
        apply_rotary_emb(q, cos, sin, cu, max_seqlen=6, cp_size=2, cp_rank=1)
    out = apply_rotary_emb(q, cos, sin, cu, max_seqlen=12)  # exact bound: fine
    assert torch.equal(out, apply_rotary_emb(q, cos, sin, cu))
