"""The cudnn backend's calls (parallel/_cudnn_thd.py): documents grouped by length.

Host planning (:func:`plan_calls`) is checked by arithmetic: every query / key row
of a segment with queries and keys is in exactly one call, the others are the
cleared rows; each call's padded LSE (``B_pad x s_q``) is within its bound, so no
tensor is ``n_seqs x max_seqlen``; bounded call and graph-shape counts. The glue
(views, gathers, LSE re-padding and scatter, cleared rows) runs on the CPU through
fake cuDNN kernels (tests/attention_utils.py's, made stricter: every row a kernel
need not write is NaN) against the float64 oracle, at cp 1 and on simulated
ranks of cp 2 / 4 (ring and all-gather blocks: skipped keys, keyless queries)
against the reference backend.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from attention_utils import (
    F64_EXACT,
    fake_cudnn_dense_bwd,
    fake_cudnn_dense_fwd,
    fake_cudnn_thd_bwd,
    fake_cudnn_thd_fwd,
    naive_attention,
    naive_lse,
)
from utils import assert_close

from cp_rope.parallel import CPAttentionPlan, context_parallel_attention
from cp_rope.parallel._cudnn_thd import (
    MAX_RUNS,
    MIN_S,
    PAD_LIMIT,
    CudnnTHD,
    plan_calls,
    round_count,
    seq_bound,
)

GRID = {m << k for k in range(40) for m in (1, 2, 3)}  # values round_count may return


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()],
                        dtype=torch.int32)


def test_rounding():
    for n in range(1, 5000):
        r = round_count(n)
        assert n <= r <= max(2, math.ceil(1.5 * n)) and r in GRID, n
        s = seq_bound(n)
        assert s >= max(n, MIN_S) and (s == MIN_S or s < 2 * n) and s // MIN_S in {1 << k for k in range(30)}


def _check_layout(cu_q, cu_k, n_q, n_k):
    """Every invariant of plan_calls' result; returns it."""
    lay = plan_calls(cu_q, cu_k, n_q, n_k)
    cq, ck = cu_q.long(), cu_k.long()
    lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    real = (lq > 0) & (lk > 0)
    n_seg = lq.numel()
    seen_q, seen_k = torch.zeros(n_q, dtype=torch.int64), torch.zeros(n_k, dtype=torch.int64)
    for rows, seen in ((lay.clear_q, seen_q), (lay.clear_k, seen_k)):
        if rows is not None:
            seen.index_add_(0, rows, torch.ones_like(rows))
    total_pad = 0
    for i, c in enumerate(lay.calls):
        b_pad = c.cu_q.numel() - 1
        assert b_pad == round_count(c.n_seg) and c.cu_k.numel() == b_pad + 1
        rq, rk = c.cu_q.long(), c.cu_k.long()
        cl_q, cl_k = rq[1:] - rq[:-1], rk[1:] - rk[:-1]
        assert (cl_q >= 0).all() and (cl_k >= 0).all() and (cl_q[c.n_seg:] == 0).all()
        assert (cl_k[c.n_seg:] == 0).all()
        assert c.s_q == seq_bound(int(cl_q.max())) and c.s_k == seq_bound(int(cl_k.max()))
        weight = int(cl_q[:c.n_seg].clamp(min=MIN_S // 2).sum())
        assert c.padded_rows <= PAD_LIMIT * weight, (c.padded_rows, weight)
        total_pad += c.padded_rows
        if c.gathered:
            assert c.q_window is None and int(rq[-1]) == c.q_index.numel() <= c.q_rows
            assert int(rk[-1]) == c.k_index.numel() <= c.k_rows
            assert c.q_rows in (c.q_index.numel(), n_q) or c.q_rows // MIN_S in GRID
            assert c.q_rows <= max(c.q_index.numel(), 1.5 * MIN_S * math.ceil(c.q_index.numel() / MIN_S))
            assert (lq[_seg_of(cq, c.seg_q0[:c.n_seg])] == cl_q[:c.n_seg]).all()
            q_rows, k_rows = c.q_index, c.k_index
        else:
            (w0, w1), (v0, v1) = c.q_window, c.k_window
            assert i > 0 or (lay.base and (w0, w1, v0, v1) == (0, n_q, 0, n_k))
            assert 0 <= w0 <= c.q_span[0] <= c.q_span[1] <= w1 <= n_q and int(rq[-1]) <= w1 - w0
            assert 0 <= v0 <= c.k_span[0] <= c.k_span[1] <= v1 <= n_k and int(rk[-1]) <= v1 - v0
            if i > 0:  # windows: rounded (few graphs), at most 1.5x their span
                for (a, b), (s0, s1), n in (((w0, w1), c.q_span, n_q), ((v0, v1), c.k_span, n_k)):
                    assert b - a in (s1 - s0, n) or (b - a) // MIN_S in GRID
                    assert b - a <= max(s1 - s0, 1.5 * MIN_S * math.ceil((s1 - s0) / MIN_S))
            segs = next(torch.arange(i0, i0 + c.n_seg) for i0 in range(n_seg - c.n_seg + 1)
                        if torch.equal(cq[i0:i0 + c.n_seg + 1], rq[:c.n_seg + 1] + w0)
                        and torch.equal(ck[i0:i0 + c.n_seg + 1], rk[:c.n_seg + 1] + v0))
            assert (c.seg_q0[:c.n_seg] == cq[segs]).all()
            inside = segs[real[segs]]
            q_rows = torch.cat([torch.arange(int(cq[j]), int(cq[j + 1])) for j in inside])
            k_rows = torch.cat([torch.arange(int(ck[j]), int(ck[j + 1])) for j in inside])
        seen_q.index_add_(0, q_rows, torch.ones_like(q_rows))
        seen_k.index_add_(0, k_rows, torch.ones_like(k_rows))
    if bool(real.any()):  # each row of [0, cu[-1]) once: in one call, or cleared
        assert (seen_q[:int(cq[-1])] == 1).all() and (seen_k[:int(ck[-1])] == 1).all()
    assert total_pad <= PAD_LIMIT * (n_q + MIN_S // 2 * n_seg)
    if len(lay.calls) > 1:  # bounded: at most MAX_RUNS calls per length class
        longest = int(lq[real].max())
        assert len(lay.calls) <= MAX_RUNS * (int(math.log2(seq_bound(longest) // MIN_S)) + 1)
    return lay


def _seg_of(cu, rows):
    """Segment index of each start row (the last segment starting there: empty ones skipped)."""
    return torch.searchsorted(cu[:-1].contiguous(), rows.long().contiguous(), right=True) - 1


def test_skewed_layout_of_issue_20():
    """1 document of 16384 tokens and 4096 of 16: two calls on views (no copy), padded LSE
    rows 3.4 T instead of n_seqs x max_seqlen = 819 T."""
    lens = [16384] + [16] * 4096
    cu = _cu(lens)
    n = int(cu[-1])
    lay = _check_layout(cu, cu, n, n)
    assert lay.base and len(lay.calls) == 2 and not any(c.gathered for c in lay.calls)
    padded = sum(c.padded_rows for c in lay.calls)
    assert padded == 16384 + 4096 * 64 and padded < len(lens) * max(lens) / 200
    # the long document in the middle: the short ones in two runs, still views
    lay = _check_layout(_cu([16] * 2000 + [16384] + [16] * 2096), cu, n, n)
    assert len(lay.calls) == 3 and not any(c.gathered for c in lay.calls)


def test_alike_lengths_stay_one_call():
    """Lengths within PAD_LIMIT's budget (the bench's random layout, one sequence, equal
    documents with trailing rows): today's single call on the whole tensors."""
    rng = random.Random(0)
    for lens in ([rng.randrange(2048, 16385, 128) for _ in range(12)], [131072], [2048] * 64,
                 [256] * 512, [0, 1, 700, 4, 2048, 0, 333, 1500]):
        cu = _cu(lens)
        lay = _check_layout(cu, cu, int(cu[-1]) + 3, int(cu[-1]) + 3)
        assert len(lay.calls) == 1 and lay.base and lay.calls[0].n_seg == len(lens)


def test_scattered_groups_are_gathered():
    lens = [2] * 30 + [1000] + [2] * 30 + [800] + [2] * 30
    cu = _cu(lens)
    lay = _check_layout(cu, cu, int(cu[-1]), int(cu[-1]))
    kinds = sorted((c.gathered, c.n_seg) for c in lay.calls)
    assert kinds == [(False, 1), (False, 1), (True, 90)], kinds
    lens = [600] + [2] * 40 + [700] + [2] * 40 + [500] + [2] * 40  # both groups in 3 runs
    cu = _cu(lens)
    lay = _check_layout(cu, cu, int(cu[-1]), int(cu[-1]))
    assert not lay.base and all(c.gathered for c in lay.calls) and len(lay.calls) == 2


def _random_lengths(rng, n):
    kind = rng.random()
    out = []
    for _ in range(n):
        if kind < 0.3:  # heavy tail
            out.append(min(int(rng.lognormvariate(3, 2)), 20000))
        elif kind < 0.6:  # a few long among many short
            out.append(rng.choice([0, 1, 3, 17]) if rng.random() < 0.95 else rng.randrange(100, 9000))
        else:
            out.append(rng.randrange(0, 3000))
    return out


def test_random_layouts_invariants():
    rng = random.Random(1)
    for _ in range(60):
        lens = _random_lengths(rng, rng.randrange(1, 300))
        cu = _cu(lens)
        extra = rng.choice([0, 5])
        _check_layout(cu, cu, int(cu[-1]) + extra, int(cu[-1]) + extra)


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_cp_blocks_invariants(cp_size, method):
    """The blocks of every rank at cp_size 2 / 4 (skipped keys, keyless queries, gathered
    K/V): the same invariants."""
    rng = random.Random(cp_size)
    for _ in range(6):
        lens = [-(-n // (2 * cp_size)) * 2 * cp_size for n in _random_lengths(rng, rng.randrange(1, 80))]
        local = _cu([n // cp_size for n in lens])
        for r in range(cp_size):
            plan = _plan(local, cp_size, r, method)
            for blk in {id(b): b for blocks in plan.blocks.values() for b in blocks}.values():
                n_k = int(local[-1]) * (cp_size if method == "allgather" and blk is not
                                        plan.blocks.get("local", (None,))[0] else 1)
                _check_layout(blk.cu_q_host, blk.cu_k_host, int(local[-1]), n_k)


def _plan(local_cu, cp_size, rank, method, hq=4, hkv=2, d=16, dtype=torch.float64, **kw):
    max_local = max(int((local_cu[1:] - local_cu[:-1]).max()), 1)
    return CPAttentionPlan.simulated(local_cu, max_local, cp_size=cp_size, cp_rank=rank,
                                     q_heads=hq, kv_heads=hkv, head_dim=d, dtype=dtype,
                                     device="cpu", method=method, **kw)


# --------------------------------------------------------------------------- the glue, on CPU

def _outside(x, cu):
    """x with its rows outside [cu[0], cu[-1]) zeroed: buffers may hold garbage there, which a
    kernel never reads (the fakes' dense math would mix it into other rows)."""
    x = x.clone()
    x[:int(cu[0])], x[int(cu[-1]):] = 0.0, 0.0
    return x


def _strict_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """fake_cudnn_thd_fwd, plus NaN in rows before cu_q[0] (rows no segment covers)."""
    assert int(cu_q[-1]) <= q.shape[0] and int(cu_k[-1]) <= k.shape[0]
    q, k, v = _outside(q, cu_q), _outside(k, cu_k), _outside(v, cu_k)
    out, lse = fake_cudnn_thd_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    out[:int(cu_q[0])], lse[:, :int(cu_q[0])] = float("nan"), float("nan")
    return out, lse


def _strict_bwd(dout, q, k, v, out, lse_padded, cu_q, cu_k, max_q, max_k, causal, scale):
    """fake_cudnn_thd_bwd, plus NaN in every row a kernel need not write: before cu[0], and
    the keys of segments without queries."""
    dout, q, out = (_outside(x, cu_q) for x in (dout, q, out))
    k, v = _outside(k, cu_k), _outside(v, cu_k)
    dq, dk, dv = fake_cudnn_thd_bwd(dout, q, k, v, out, lse_padded, cu_q, cu_k, max_q, max_k,
                                    causal, scale)
    dq[:int(cu_q[0])], dk[:int(cu_k[0])], dv[:int(cu_k[0])] = (float("nan"),) * 3
    for i in range(cu_q.numel() - 1):
        if cu_q[i + 1] == cu_q[i]:
            dk[int(cu_k[i]):int(cu_k[i + 1])] = float("nan")
            dv[int(cu_k[i]):int(cu_k[i + 1])] = float("nan")
    return dq, dk, dv


@pytest.fixture
def fake_cudnn(monkeypatch):
    """backend="cudnn" on the CPU: the real glue (CudnnTHD) over the strict fake kernels."""
    from cp_rope.parallel import _blocks, _compat
    from cp_rope.parallel import attention as att

    monkeypatch.setattr(_compat, "cudnn_thd_fwd", _strict_fwd)
    monkeypatch.setattr(_compat, "cudnn_thd_bwd", _strict_bwd)
    monkeypatch.setattr(_compat, "cudnn_dense_fwd", fake_cudnn_dense_fwd)
    monkeypatch.setattr(_compat, "cudnn_dense_bwd", fake_cudnn_dense_bwd)
    real = _blocks.get_backend
    monkeypatch.setattr(att, "get_backend",
                        lambda name, q, n, **kw: CudnnTHD() if name == "cudnn" else real(name, q, n,
                                                                                          **kw))


SKEWED = {
    "long first": [700] + [3] * 90,
    "long in the middle": [2] * 30 + [1000] + [2] * 30 + [0] + [800] + [1] * 30,
    "three runs each": [600] + [2] * 40 + [700] + [2] * 40 + [500] + [2] * 40,
}


def _run(q, k, v, dout, **kw):
    qx, kx, vx = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = context_parallel_attention(qx, kx, vx, return_lse=True, **kw)
    out.backward(dout)
    return out.detach(), lse, qx.grad, kx.grad, vx.grad


@pytest.mark.parametrize("name", list(SKEWED))
def test_cp1_skewed_matches_oracle(fake_cudnn, name):
    lens = SKEWED[name]
    gen = torch.Generator().manual_seed(len(lens))
    cu = _cu(lens)
    n = int(cu[-1]) + 3  # trailing rows
    q, k, v, dout = (torch.randn(n, h, 8, generator=gen, dtype=torch.float64) for h in (2, 1, 1, 2))
    got = _run(q, k, v, dout, cu_seqlens=cu, max_seqlen=max(lens), backend="cudnn")
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = naive_attention(*ref_in, cu, True, 8 ** -0.5)
    grads = torch.autograd.grad(ref, ref_in, dout)
    exp = (ref.detach(), naive_lse(q, k, cu, True, 8 ** -0.5), *grads)
    for nm, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, exp, strict=True):
        assert_close(a, b, **F64_EXACT, name=f"{name} {nm}")


@pytest.mark.parametrize("cp_size,method,causal", [(2, "ring", True), (2, "allgather", True),
                                                   (2, "ring", False)])
def test_simulated_ranks_skewed_match_reference(fake_cudnn, cp_size, method, causal):
    """Each rank's blocks of a skewed batch (split into several calls, views and gathers;
    rank 0 has the half block with keyless queries, rank 1 the one with skipped keys):
    the cudnn glue equals the reference backend on the same plan and inputs."""
    lens = [8] * 80 + [520 * cp_size] + [8] * 80 + [0] + [300 * cp_size] + [16] * 40
    local = _cu([n // cp_size for n in lens])
    kw = {} if causal else {"causal": False, "seq_lens": torch.tensor(lens)}
    multi = 0
    for r in range(cp_size):
        gen = torch.Generator().manual_seed(r)
        n = int(local[-1])
        q, k, v, dout = (torch.randn(n, h, 8, generator=gen, dtype=torch.float64)
                         for h in (2, 1, 1, 2))
        res = {}
        for backend in ("cudnn", "reference"):
            plan = _plan(local, cp_size, r, method, hq=2, hkv=1, d=8, backend=backend, **kw)
            res[backend] = _run(q, k, v, dout, plan=plan)
            if backend == "cudnn":
                lays = [lay for b in {id(b): b for bs in plan.blocks.values() for b in bs}.values()
                        for lay in b.backend_cache.values()]
                multi += sum(len(lay.calls) > 1 for lay in lays)
        for nm, a, b in zip(("out", "lse", "dq", "dk", "dv"), res["cudnn"], res["reference"],
                            strict=True):
            assert_close(a, b, **F64_EXACT, name=f"cp{cp_size} {method} rank {r} {nm}")
    assert multi > 0, "no block was split into several calls: the test checks nothing new"
