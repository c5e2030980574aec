"""torch.compile(fullgraph=True) through the cp_rope custom ops: equal to eager,
no recompile per batch shape or per max_seqlen value, in-place mutation
declared. Runs on CPU with both backends (the Triton one under the
interpreter) and on CUDA (marked gpu)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from rope_utils import random_cu_seqlens
from torch._dynamo.utils import counters

from cp_rope import apply_rotary_emb_qk, rope_cache

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
HQ, HK, D, ROT = 4, 2, 32, 16


def _step(q, k, wq, wk, cos, sin, cu, max_seqlen, backend):
    qo, ko = apply_rotary_emb_qk(q, k, cos, sin, cu, max_seqlen=max_seqlen, cp_size=2, cp_rank=1,
                                 backend=backend)
    return qo, ko, (qo * wq).sum() + (ko * wk).sum()


def _fwd_bwd(fn, q, k, *args):
    """Forward (compiled or eager), then the backward through the compiled graph."""
    q.grad = k.grad = None
    qo, ko, loss = fn(q, k, *args)
    loss.backward()
    return qo, ko, q.grad, k.grad


def _batch(seed, n_tokens, n_seqs, device, dynamic):
    gen = torch.Generator().manual_seed(seed)
    cu = random_cu_seqlens(gen, n_seqs, cp_size=2, max_len=(n_tokens - 8) // n_seqs, trailing_zeros=1)
    assert int(cu[-1]) <= n_tokens
    t = [torch.randn(n_tokens, h, D, generator=gen, dtype=torch.float32).to(device)
         for h in (HQ, HK, HQ, HK)]
    q, k = t[0].requires_grad_(), t[1].requires_grad_()
    cu = cu.to(device)
    if dynamic:
        for x in (*t, cu):
            torch._dynamo.mark_dynamic(x, 0)
    return q, k, t[2], t[3], cu


def _skip_interpreter_on_gpu_machine(device, backend):
    if device == "cpu" and backend == "triton" and torch.cuda.is_available():
        pytest.skip("the Triton backend takes CPU tensors only under TRITON_INTERPRET (CPU CI); "
                    "the cuda variant runs it here")


def _run(batches, device, backend):
    _skip_interpreter_on_gpu_machine(device, backend)
    cos, sin = rope_cache(1200, ROT, device=device)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_step, fullgraph=True)
    for seed, (n_tokens, n_seqs, max_seqlen, dynamic) in enumerate(batches):
        q, k, wq, wk, cu = _batch(seed, n_tokens, n_seqs, device, dynamic)
        # max_seqlen is a bound (>= the longest local sequence; a smaller one is refused)
        max_seqlen = max(max_seqlen, int((cu[1:] - cu[:-1]).max()))
        got = _fwd_bwd(compiled, q, k, wq, wk, cos, sin, cu, max_seqlen, backend)
        want = _fwd_bwd(_step, q, k, wq, wk, cos, sin, cu, max_seqlen, backend)
        for name, g, w in zip(("q", "k", "dq", "dk"), got, want, strict=True):
            assert torch.equal(g, w), f"{name} differs from eager at T={n_tokens}, n_seqs={n_seqs}"
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_compile_varying_shapes_and_max_seqlen(device, backend):
    """T, n_seqs and max_seqlen change every batch (5 batches): at most 2 compilations."""
    batches = [(128, 3, 50, False), (160, 5, 30, False), (192, 8, 20, False),
               (224, 2, 110, False), (144, 4, 35, False)]
    assert 1 <= _run(batches, device, backend) <= 2


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_compile_mark_dynamic_and_max_seqlen_values(device, backend):
    """mark_dynamic on T (and B): max_seqlen 75, 124, 160 at the same T, then new
    (T, n_seqs): at most 2 compilations (max_seqlen is only a host-side check)."""
    batches = [(160, 4, 75, True), (160, 4, 124, True), (160, 4, 160, True),
               (192, 6, 75, True), (128, 9, 160, True)]
    assert 1 <= _run(batches, device, backend) <= 2


def _inplace_step(qkv, cos, sin, cu, backend):
    q, k = qkv[:, :HQ], qkv[:, HQ:HQ + HK]
    apply_rotary_emb_qk(q, k, cos, sin, cu, inplace=True, backend=backend)
    return qkv * 2.0


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("device", DEVICES)
def test_compile_inplace_matches_eager(device, backend):
    """inplace=True on views of a fused qkv buffer, compiled, repeated calls: the
    declared mutation is applied exactly once per call, as in eager."""
    _skip_interpreter_on_gpu_machine(device, backend)
    cos, sin = rope_cache(512, ROT, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(_inplace_step, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    cu = random_cu_seqlens(gen, 4, 1, max_len=60).to(device)
    qkv = torch.randn(256, HQ + 2 * HK, D, generator=gen).to(device)
    a, b = qkv.clone(), qkv.clone()
    for _ in range(3):
        ra = compiled(a, cos, sin, cu, backend)
        rb = _inplace_step(b, cos, sin, cu, backend)
        assert torch.equal(a, b) and torch.equal(ra, rb)
    assert not torch.equal(a, qkv)
    assert torch.equal(a[:, HQ + HK:], qkv[:, HQ + HK:])  # v untouched


def _positions_step(q, k, cos, sin, cu, pos, start, backend):
    if pos is not None:
        qo, ko = apply_rotary_emb_qk(q, k, cos, sin, cu, position_ids=pos, backend=backend)
    else:
        qo, ko = apply_rotary_emb_qk(q, k, cos, sin, cu, start_positions=start, cp_size=2,
                                     cp_rank=1, conjugate=True, backend=backend)
    return qo, ko, qo.sum() + 2 * ko.sum()


@pytest.mark.parametrize("mode", ["position_ids", "start_positions"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_compile_positions(device, backend, mode):
    """position_ids (int64 [T]) or start_positions (int32 [B]) with conjugate, through
    torch.compile(fullgraph=True) with T and B marked dynamic: forward and backward equal
    eager on 3 batch shapes, at most 2 compilations."""
    _skip_interpreter_on_gpu_machine(device, backend)
    cos, sin = rope_cache(1200, ROT, device=device)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_positions_step, fullgraph=True)
    for seed, (n_tokens, n_seqs) in enumerate([(256, 3), (320, 5), (200, 7)]):
        q, k, _, _, cu = _batch(seed, n_tokens, n_seqs, device, dynamic=True)
        gen = torch.Generator().manual_seed(100 + seed)
        pos = start = None
        if mode == "position_ids":
            pos = torch.randint(0, 1200, (n_tokens,), generator=gen).to(device)
            torch._dynamo.mark_dynamic(pos, 0)
        else:
            start = torch.randint(0, 500, (cu.numel() - 1,), generator=gen, dtype=torch.int32).to(device)
            torch._dynamo.mark_dynamic(start, 0)
        got = _fwd_bwd(compiled, q, k, cos, sin, cu, pos, start, backend)
        want = _fwd_bwd(_positions_step, q, k, cos, sin, cu, pos, start, backend)
        for name, g, w in zip(("q", "k", "dq", "dk"), got, want, strict=True):
            assert torch.equal(g, w), f"{name} differs from eager at T={n_tokens}"
    assert 1 <= counters["stats"]["unique_graphs"] <= 2
