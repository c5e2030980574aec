"""CP attention test helpers: the float64 oracle (naive per-document softmax attention and its
log-sum-exp), random varlen cases, and fake GPU kernels (the reference math behind the CUDA
kernels' conventions) so CPU tests drive the GPU backends' glue code.

Used by test_attention.py, test_attention_plan.py, test_attention_gpu.py, test_cudnn_calls.py,
test_placement.py, test_ulysses.py and test_cost_model.py: one oracle for every attention test.
(The package's ``parallel/_self_test.py`` keeps its own small reference: it is library code, the
start-up self-test, and runs without the tests folder.)
"""

from __future__ import annotations

import torch

from cp_rope.parallel._blocks import Block, _Reference

# float64 parity: the CP paths and the oracle agree to rounding
F64_EXACT = {"atol": 1e-10, "rtol": 0.0}


def naive_attention(q, k, v, cu, causal, scale, seq_lens=None):
    """Per-sequence masked softmax attention in q's dtype and device (autograd); rows past
    cu[-1] -> 0. The oracle of the CPU (float64) and GPU (float32) parity tests."""
    g = q.shape[1] // k.shape[1]
    pieces = []
    cu = cu.tolist()
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        n = e - s
        kb, vb = k[s:e].repeat_interleave(g, 1), v[s:e].repeat_interleave(g, 1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e], kb) * scale
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device)
        if causal:
            mask = torch.tril(mask)
        if seq_lens is not None:
            mask = mask & (torch.arange(n, device=q.device) < int(seq_lens[b]))[None, :]
        has = mask.any(-1)[:, None]
        scores = torch.where(has, scores.masked_fill(~mask, float("-inf")), 0.0)
        p = torch.softmax(scores, -1) * has
        pieces.append(torch.einsum("hqk,khd->qhd", p, vb))
    pieces.append(q.new_zeros(q.shape[0] - cu[-1], *q.shape[1:]))
    return torch.cat(pieces)


def naive_lse(q, k, cu, causal, scale, seq_lens=None):
    """``[Hq, T]`` log-sum-exp of each query's visible scores (-inf: no key, trailing rows)."""
    g = q.shape[1] // k.shape[1]
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=q.dtype, device=q.device)
    cu = cu.tolist()
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        n = e - s
        scores = torch.einsum("qhd,khd->hqk", q[s:e], k[s:e].repeat_interleave(g, 1)) * scale
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device)
        if causal:
            mask = torch.tril(mask)
        if seq_lens is not None:
            mask = mask & (torch.arange(n, device=q.device) < int(seq_lens[b]))[None, :]
        lse[:, s:e] = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1)
    return lse


def rand64(gen, *shape):
    """Fresh float64 normal values of ``shape`` from ``gen``."""
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def make_case(seed, cp_size, hq, hkv, d, one_seq):
    """A random global varlen batch for the CP parity tests: ``(lens, cu, [q, k, v, dout])``
    float64; lengths drawn from 0, 1, 2C, 2C+1, 3, 9, 23 (padded up to multiples of 2C in
    ``cu``); ``one_seq``: one document of 37 (True) or three of 128 C ("equal")."""
    gen = torch.Generator().manual_seed(seed)
    pool = [0, 1, 2 * cp_size, 2 * cp_size + 1, 3, 9, 23]
    lens = [pool[int(i)] for i in torch.randint(0, len(pool), (6,), generator=gen)] + [0, 1, 2 * cp_size]
    lens = [lens[int(i)] for i in torch.randperm(len(lens), generator=gen)]
    if one_seq == "equal":
        lens = [128 * cp_size] * 3
    elif one_seq:
        lens = [37]
    padded = [-(-n // (2 * cp_size)) * 2 * cp_size for n in lens]
    cu = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    n = int(cu[-1])
    tensors = [rand64(gen, n, h, d) for h in (hq, hkv, hkv, hq)]  # q, k, v, dout
    return lens, cu, tensors


# Fake GPU kernels: the reference math behind the exact conventions of the CUDA kernels
# (flash: LSE +inf for rows without keys, rows past cu_q[-1] / cu_k[-1] left unwritten;
# cuDNN: dense [1, H, S, D] views), so the CPU tests drive the GPU backends' glue code:
# segment building, max_q / max_k bounds, partial rows, aux plumbing.

def _check_bounds(cu_q, cu_k, max_q, max_k):
    lq, lk = (cu_q[1:] - cu_q[:-1]), (cu_k[1:] - cu_k[:-1])
    assert int(lq.max()) <= max_q and int(lk.max()) <= max_k, (lq.tolist(), max_q, lk.tolist(), max_k)


def fake_flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
    _check_bounds(cu_q, cu_k, max_q, max_k)
    blk = Block(cu_q, cu_k, max_q, max_k, causal, window=window)  # window: flash's window_size
    [(_, out, lse)], _ = _Reference().forward(q, k, v, blk, scale)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    out[int(cu_q[-1]):], lse[:, int(cu_q[-1]):] = float("nan"), float("nan")
    return out.to(q.dtype), lse, "rng", "unused"  # like the kernels: out in q's dtype


def fake_flash_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, rng, unused,
                   window=None):
    assert (rng, unused) == ("rng", "unused")
    _check_bounds(cu_q, cu_k, max_q, max_k)
    blk = Block(cu_q, cu_k, max_q, max_k, causal, window=window)
    [(_, dq, _, dk, dv)] = _Reference().backward(dout, q, k, v, out, lse, blk, scale, None)
    dq[int(cu_q[-1]):], dk[int(cu_k[-1]):], dv[int(cu_k[-1]):] = (float("nan"),) * 3
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _dense(fn, *bhsd):
    """Run a [S, H, D] function on [1, H, S, D] views."""
    return fn(*(t[0].transpose(0, 1) for t in bhsd))


def fake_cudnn_fwd(q, k, v, causal, scale):
    sq, sk = q.shape[2], k.shape[2]
    blk = Block(torch.tensor([0, sq]), torch.tensor([0, sk]), sq, sk, causal)
    [(_, out, lse)], _ = _dense(lambda q, k, v: _Reference().forward(q, k, v, blk, scale), q, k, v)
    return out.to(q.dtype).transpose(0, 1).unsqueeze(0), lse.unsqueeze(0), ("aux", blk)


def fake_cudnn_bwd(dout, q, k, v, out, lse, causal, scale, aux):
    tag, blk = aux
    assert tag == "aux" and blk.causal == causal
    [(_, *grads)] = _dense(lambda do, q, k, v, o: _Reference().backward(
        do, q, k, v, o, lse[0], blk, scale, None), dout, q, k, v, out)
    dq, _, dk, dv = grads
    return tuple(g.to(q.dtype).transpose(0, 1).unsqueeze(0) for g in (dq, dk, dv))


def fake_cudnn_thd_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """The cuDNN frontend's THD conventions: bounds multiples of 64; LSE a [H, T] view of
    token-major stats; rows past cu_q[-1] unwritten and rows of a segment without keys
    NaN / denormal garbage (as measured on an H200 with cuDNN 9.19)."""
    _check_bounds(cu_q, cu_k, max_q, max_k)
    assert max_q % 64 == 0 and max_k % 64 == 0 and max_q >= 64, (max_q, max_k)
    [(_, out, lse)], _ = _Reference().forward(q, k, v, Block(cu_q, cu_k, max_q, max_k, causal), scale)
    stats = lse.t().unsqueeze(-1).to(torch.float32 if q.dtype != torch.float64 else q.dtype)
    stats = stats.contiguous()  # [T, H, 1] token-major, as the kernel writes it
    lq, lk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    for i in torch.nonzero((lq > 0) & (lk == 0)).flatten().tolist():
        out[int(cu_q[i]):int(cu_q[i + 1])] = float("nan")
        stats[int(cu_q[i]):int(cu_q[i + 1])] = 2.4e-38
    out[int(cu_q[-1]):], stats[int(cu_q[-1]):] = float("nan"), float("nan")
    return out.to(q.dtype), stats[:, :, 0].t()


def fake_cudnn_thd_bwd(dout, q, k, v, out, lse_padded, cu_q, cu_k, max_q, max_k, causal, scale):
    """Takes the LSE padded [B, H, max_q, 1] (rows past a segment's length ignored): the fake
    un-pads it, so a wrong layout gives wrong (or NaN) gradients."""
    _check_bounds(cu_q, cu_k, max_q, max_k)
    n_seg, hq = cu_q.numel() - 1, q.shape[1]
    assert lse_padded.shape == (n_seg, hq, max_q, 1) and lse_padded.is_contiguous(), lse_padded.shape
    lse = torch.full((hq, q.shape[0]), float("nan"), dtype=lse_padded.dtype)
    for b in range(n_seg):
        q0, n = int(cu_q[b]), int(cu_q[b + 1] - cu_q[b])
        lse[:, q0:q0 + n] = lse_padded[b, :, :n, 0]
    blk = Block(cu_q, cu_k, max_q, max_k, causal)
    [(_, dq, _, dk, dv)] = _Reference().backward(dout, q, k, v, out, lse, blk, scale, None)
    dq[int(cu_q[-1]):], dk[int(cu_k[-1]):], dv[int(cu_k[-1]):] = (float("nan"),) * 3
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def fake_cudnn_dense_fwd(q, k, v, causal, scale):
    """Dense [n, H, S, D] views (token-major memory); output in q's layout, stats
    [n, H, S, 1] contiguous."""
    n, hq, sq, d = q.shape
    out = torch.empty(n, sq, hq, d, dtype=q.dtype).transpose(1, 2)  # q's layout
    stats = torch.empty(n, hq, sq, 1, dtype=torch.float64 if q.dtype == torch.float64
                        else torch.float32)
    for b in range(n):
        blk = Block(torch.tensor([0, sq]), torch.tensor([0, k.shape[2]]), sq, k.shape[2], causal)
        [(_, o, lse)], _ = _Reference().forward(q[b].transpose(0, 1), k[b].transpose(0, 1),
                                                v[b].transpose(0, 1), blk, scale)
        out[b], stats[b, :, :, 0] = o.transpose(0, 1), lse
    return out, stats


def fake_cudnn_dense_bwd(dout, q, k, v, out, lse, causal, scale):
    assert lse.shape == (*q.shape[:3], 1) and lse.is_contiguous(), lse.shape
    grads = [torch.empty(t.shape[0], t.shape[2], t.shape[1], t.shape[3], dtype=t.dtype)
             .transpose(1, 2) for t in (q, k, v)]  # in q / k / v's layouts
    t = lambda x, b: x[b].transpose(0, 1)
    for b in range(q.shape[0]):
        blk = Block(torch.tensor([0, q.shape[2]]), torch.tensor([0, k.shape[2]]), q.shape[2],
                    k.shape[2], causal)
        [(_, dq, _, dk, dv)] = _Reference().backward(
            t(dout, b), t(q, b), t(k, b), t(v, b), t(out, b), lse[b, :, :, 0], blk, scale, None)
        for g, x in zip(grads, (dq, dk, dv), strict=True):
            g[b] = x.transpose(0, 1)
    return tuple(grads)


def install_fake_kernels():
    """Route the GPU backends' kernels (cudnn, cudnn THD, cudnn dense) to the fakes above and
    add the backends ``fake_flash`` / ``fake_cudnn`` / ``fake_cudnn_thd`` to ``get_backend``
    (for the spawned ranks of a test; in-process tests use monkeypatch instead)."""
    from cp_rope.parallel import _blocks, _compat
    from cp_rope.parallel import attention as att

    _compat.torch_cudnn_fwd, _compat.torch_cudnn_bwd = fake_cudnn_fwd, fake_cudnn_bwd
    _compat.cudnn_thd_fwd, _compat.cudnn_thd_bwd = fake_cudnn_thd_fwd, fake_cudnn_thd_bwd
    _compat.cudnn_dense_fwd, _compat.cudnn_dense_bwd = fake_cudnn_dense_fwd, fake_cudnn_dense_bwd
    real = att.get_backend
    fakes = {"fake_flash": lambda: _blocks._Varlen("torch_flash", fake_flash_fwd, fake_flash_bwd),
             "fake_cudnn": _blocks._Cudnn, "fake_cudnn_thd": _blocks._CudnnTHD}
    att.get_backend = lambda name, q, n, **kw: fakes[name]() if name in fakes else real(name, q, n,
                                                                                         **kw)
