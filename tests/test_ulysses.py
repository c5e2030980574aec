"""Ulysses and hybrid Ulysses x ring CP attention (cp_rope.parallel.ulysses) on the CPU.

* Unit tests (no processes): argument checks with their arithmetic, the
  all-to-all row index (a permutation that yields the inner ring's zigzag
  layout), the communication-volume model.
* One spawned world of 4 gloo ranks, float64, reference backend, against
  single-process attention on the global batch and its autograd backward
  (forward and dq/dk/dv within 1e-10): Ulysses at C = 4 and at C = 2 (two
  groups of 2 inside the world), hybrid at C = 4 with U = 2, U = 4 (bit-equal to
  Ulysses) and U = 1 (bit-equal to the ring); GQA with Hkv = C, C / 2 (kv heads
  shared by the ranks that use them), 2C and 1; causal and non-causal
  (``seq_lens``); zero-length, one-token and one-token-per-chunk documents,
  trailing padding rows; random batches from ``PackingCollator``; the GPU block
  backends' glue (flash varlen, cuDNN THD, torch cuDNN) through the fake kernels
  of ``tests/attention_utils.py``; a reused
  plan; float32 inputs within the float32 tolerances; the LSE equals the ring's; ``comm_volume`` equals the bytes counted at the
  exchanges (ring, ulysses, hybrid; bf16). The same world checks that a bad
  ``ulysses_size``, heads that do not split and inputs that differ between
  ranks raise on every rank.
* A rank that stalls after the plan is built makes the others raise within the
  CP group's timeout instead of hanging (one more spawn).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from attention_utils import install_fake_kernels, make_case, naive_attention
from dist_utils import run_distributed
from utils import assert_close

from cp_rope.parallel import (
    CPAttentionPlan,
    PackingCollator,
    context_parallel_attention,
    cp_shard_indices,
    shard_tensor,
    unshard,
)
from cp_rope.parallel.sharding import local_cu_seqlens
from cp_rope.parallel.ulysses import a2a_index, check_ulysses_args, comm_volume

F64_EXACT = {"atol": 1e-10, "rtol": 0.0}


# --------------------------------------------------------------------------- unit tests

def test_check_ulysses_args_shows_the_arithmetic():
    assert check_ulysses_args("ring", None, 4, 8, 2) == 1
    assert check_ulysses_args("ulysses", None, 4, 8, 2) == 4
    assert check_ulysses_args("hybrid", 2, 8, 4, 1) == 2
    with pytest.raises(ValueError, match=r"must divide cp_size: 4 % 3 = 1"):
        check_ulysses_args("hybrid", 3, 4, 6, 3)
    with pytest.raises(ValueError, match=r"Hq % U = 6 % 4 = 2"):
        check_ulysses_args("ulysses", None, 4, 6, 2)
    with pytest.raises(ValueError, match=r"Hkv = 6: 6 % 4 = 2, 4 % 6 = 4"):
        check_ulysses_args("hybrid", 4, 8, 12, 6)
    with pytest.raises(ValueError, match="needs ulysses_size=U"):
        check_ulysses_args("hybrid", None, 4, 8, 2)
    with pytest.raises(ValueError, match="must be None or cp_size = 4"):
        check_ulysses_args("ulysses", 2, 4, 8, 2)
    with pytest.raises(ValueError, match="only used with method='ulysses' or 'hybrid'"):
        check_ulysses_args("ring", 2, 4, 8, 2)
    with pytest.raises(TypeError, match="ulysses_size must be an int"):
        check_ulysses_args("hybrid", 2.0, 4, 8, 2)
    with pytest.raises(ValueError, match="ulysses_size must be >= 1"):
        check_ulysses_args("hybrid", 0, 4, 8, 2)


@pytest.mark.parametrize("cp_size,ulysses_size", [(4, 4), (4, 2), (6, 3), (6, 2), (4, 1)])
def test_a2a_index_gives_the_inner_ring_layout(cp_size, ulysses_size):
    """Receive rows (group rank u's local row i at u n + i) reordered by the index are
    exactly the zigzag rows of the ring of R = C / U ranks with U-times longer chunks."""
    C, U = cp_size, ulysses_size
    lens = [0, 2 * C, 6 * C, 4 * C, 0, 2 * C * 5]
    global_cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    cu = local_cu_seqlens(global_cu, C)
    for r in range(C):
        g = r // U
        recv = torch.cat([cp_shard_indices(global_cu, C, g * U + u) for u in range(U)])
        index = a2a_index(cu, C, U, r)
        assert sorted(index.tolist()) == list(range(recv.numel()))
        assert torch.equal(recv[index], cp_shard_indices(global_cu, C // U, g))


def test_comm_volume_model():
    kw = dict(n_tokens=4096, q_heads=32, kv_heads=8, head_dim=128, elem_bytes=2)
    t, d = 4096, 128
    ring = comm_volume("ring", cp_size=8, **kw)
    assert ring["forward"] == 7 * 2 * t * 8 * d * 2 and ring["overlapped"] == ring["forward"] + ring["backward"]
    uly = comm_volume("ulysses", cp_size=8, **kw)  # q, k, v out, out and its fp32 LSE back
    assert uly["forward"] == (t * (32 + 16 + 32) * d * 2 + t * 32 * 4) * 7 // 8
    assert uly["overlapped"] == 0
    # hybrid U = C is Ulysses, U = 1 is the ring
    assert comm_volume("hybrid", cp_size=8, ulysses_size=8, **kw) == uly
    assert comm_volume("hybrid", cp_size=8, ulysses_size=1, **kw) == ring
    mid = comm_volume("hybrid", cp_size=8, ulysses_size=2, **kw)
    assert uly["forward"] < mid["forward"] < ring["forward"]
    # impossible layouts raise, naming the argument, instead of returning bytes
    for method, extra, match in (("bogus", dict(cp_size=8), "method must be one of"),
                                 ("ring", dict(cp_size=0), "cp_size must be >= 1"),
                                 ("ulysses", dict(cp_size=3), r"Hq % U = 32 % 3"),
                                 ("hybrid", dict(cp_size=8, ulysses_size=3), "must divide")):
        with pytest.raises(ValueError, match=match):
            comm_volume(method, **extra, **kw)


# --------------------------------------------------------------------------- multi-rank parity

def _collator_case(seed, cp_size, hq, hkv, d):
    """A random packed global batch from PackingCollator (padding to 2C, a padding
    sequence from pad_to_multiple) and fresh q/k/v/dout for it."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 40, (5,), generator=gen).tolist()
    docs = [torch.randint(0, 50, (n,), generator=gen) for n in lens]
    batch = PackingCollator(cp_size=cp_size, pad_to_multiple=32 * cp_size)(docs)
    cu, n = batch.cu_seqlens, batch.num_tokens
    tensors = [torch.randn(n, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]
    return batch.seq_lens.tolist(), cu, tensors


def _run(group, rank, cp_size, tensors, cu, causal, seq_lens, extra, backend="reference", **kw):
    """Shard, add ``extra`` trailing rows, run CP attention forward and backward; returns
    (out, dq, dk, dv) gathered in global order, the local results and the local LSE."""
    local_cu = local_cu_seqlens(cu, cp_size)
    max_local = int((local_cu[1:] - local_cu[:-1]).max())
    loc = [shard_tensor(t, cu, cp_size, rank) for t in tensors]
    loc = [torch.cat([t, torch.randn(extra, *t.shape[1:], dtype=t.dtype)]) for t in loc]
    ql, kl, vl = (t.requires_grad_() for t in loc[:3])
    out, lse = context_parallel_attention(ql, kl, vl, local_cu, max_local, group=group,
                                          causal=causal, seq_lens=seq_lens, backend=backend,
                                          return_lse=True, **kw)
    out.backward(loc[3])
    local = (out.detach(), ql.grad, kl.grad, vl.grad)
    n = int(local_cu[-1])
    for t in local:
        assert torch.equal(t[n:], torch.zeros_like(t[n:])), f"{kw}: trailing rows not 0"
    return [unshard(t[:n], local_cu, group) for t in local], local, lse


def _parity_body(rank, world_size):
    install_fake_kernels()  # the GPU backends' glue on CPU (see tests/attention_utils.py)
    world = dist.group.WORLD
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
    pair = pairs[rank // 2]
    # (C, group, method, U, hq, hkv, d, causal, batch source, backend)
    cases = [
        (4, world, "ulysses", None, 8, 4, 8, True, "pool", "reference"),  # Hkv = C
        (4, world, "ulysses", None, 8, 2, 16, True, "pool", "reference"),  # Hkv = C / 2: shared
        (4, world, "ulysses", None, 16, 8, 8, False, "pool", "reference"),  # Hkv = 2C
        (4, world, "ulysses", None, 4, 1, 8, False, "collator", "reference"),  # one kv head
        (4, world, "hybrid", 2, 8, 2, 8, True, "pool", "reference"),  # Hkv = U
        (4, world, "hybrid", 2, 4, 1, 16, False, "pool", "reference"),  # Hkv = U / 2: shared
        (4, world, "hybrid", 2, 8, 4, 8, True, "collator", "reference"),  # Hkv = 2U
        (4, world, "hybrid", 2, 12, 4, 8, False, "collator", "reference"),
        (2, pair, "ulysses", None, 4, 2, 8, True, "pool", "reference"),  # C = 2, Hkv = C
        (2, pair, "ulysses", None, 2, 1, 8, False, "collator", "reference"),  # Hkv = C / 2
        (2, pair, "hybrid", 2, 8, 4, 8, True, "collator", "reference"),  # U = C = 2, Hkv = 2C
        # the GPU backends' conventions (fake kernels: reference math, CUDA layouts)
        (4, world, "ulysses", None, 8, 2, 16, True, "pool", "fake_flash"),
        (4, world, "hybrid", 2, 8, 4, 16, False, "pool", "fake_cudnn_thd"),
        (4, world, "hybrid", 2, 4, 2, 16, True, "one", "fake_cudnn"),  # one sequence
    ]
    for ci, (C, group, method, U, hq, hkv, d, causal, source, backend) in enumerate(cases):
        r = dist.get_rank(group)
        seed = 500 + ci + (100 * (rank // 2) if C == 2 else 0)  # the two pairs differ
        if source in ("pool", "one"):
            lens, cu, tensors = make_case(seed, C, hq, hkv, d, one_seq=source == "one")
        else:
            lens, cu, tensors = _collator_case(seed, C, hq, hkv, d)
        seq_lens = None if causal else torch.tensor(lens)
        q, k, v, dout = tensors
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = naive_attention(*ref_in, cu, causal, d ** -0.5, seq_lens)
        ref_grads = torch.autograd.grad(ref, ref_in, dout)
        extra = ci % 3  # trailing rows that belong to no sequence
        got, local, lse = _run(group, r, C, tensors, cu, causal, seq_lens, extra, backend,
                               method=method, ulysses_size=U)
        tag = (f"case{ci} C={C} {method} U={U} Hq={hq} Hkv={hkv} causal={causal} {backend} "
               f"rank{rank}")
        for name, g, e in zip(("out", "dq", "dk", "dv"), got, (ref, *ref_grads), strict=True):
            assert_close(g, e, **F64_EXACT, name=f"{tag} {name}")
        # the LSE equals the ring's; U = 1 is the ring and U = C is Ulysses, bit for bit
        _, ring_local, ring_lse = _run(group, r, C, tensors, cu, causal, seq_lens, extra)
        assert_close(lse, ring_lse, **F64_EXACT, name=f"{tag} lse")
        if extra == 0 and ci in (0, 6, 9):  # (trailing rows change the reference's blocking)
            twins = [("hybrid", 1, ring_local, ring_lse)]  # U = 1 is the ring
            if method == "ulysses":
                twins.append(("hybrid", C, local, lse))  # U = C is Ulysses
            for m, u, want, want_lse in twins:
                _, other, other_lse = _run(group, r, C, tensors, cu, causal, seq_lens, extra,
                                           method=m, ulysses_size=u)
                for a, b in zip((*other, other_lse), (*want, want_lse), strict=True):
                    assert torch.equal(a, b), f"{tag}: {m} U={u} differs"
    _plan_reuse(rank, world)
    _float32(rank, world)
    _bytes_match_the_model(rank, world)
    _empty_batches(world)
    _errors_on_every_rank(rank, world)


def _float32(rank, group):
    """float32 inputs (fp32 math in the reference backend) against the float64 oracle, with
    the float32 tolerances of tests/utils.TOL."""
    C = dist.get_world_size(group)
    for ci, (method, u, hq, hkv) in enumerate((("ulysses", None, 8, 2), ("hybrid", 2, 4, 4))):
        lens, cu, tensors = _collator_case(970 + ci, C, hq, hkv, 16)
        ref_in = [t.clone().requires_grad_() for t in tensors[:3]]
        ref = naive_attention(*ref_in, cu, True, 16 ** -0.5)
        ref_grads = torch.autograd.grad(ref, ref_in, tensors[3])
        got, local, _ = _run(group, rank, C, [t.float() for t in tensors], cu, True, None, 1,
                             method=method, ulysses_size=u)
        assert local[0].dtype == torch.float32
        for name, g, e in zip(("out", "dq", "dk", "dv"), got, (ref, *ref_grads), strict=True):
            assert_close(g, e, dtype=torch.float32, name=f"float32 {method} {name} rank{rank}")


class _SentBytes:
    """Counts the bytes this rank hands to the exchanges: ``all_to_all_single`` (all slots
    but its own) and the isends of ``batch_isend_irecv`` (the ring)."""

    def __enter__(self):
        self.n = 0
        self._a2a, self._p2p = dist.all_to_all_single, dist.batch_isend_irecv

        def a2a(output, input, *args, group=None, **kw):
            size = dist.get_world_size(group)
            self.n += input.numel() * input.element_size() * (size - 1) // size
            return self._a2a(output, input, *args, group=group, **kw)

        def p2p(ops):
            self.n += sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                          if op.op is dist.isend)
            return self._p2p(ops)

        dist.all_to_all_single, dist.batch_isend_irecv = a2a, p2p
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single, dist.batch_isend_irecv = self._a2a, self._p2p


def _bytes_match_the_model(rank, group):
    """comm_volume (what bench_cp_attention.py reports) equals the bytes each rank hands to
    the exchanges, forward and backward: bf16 through the fake flash kernels, whose partials
    are in the input dtype as on the GPU (fp32 travels: LSE, ring dK/dV beyond 2 ranks,
    shared kv heads' dK/dV)."""
    C, d = dist.get_world_size(group), 8
    for hq, hkv in ((8, 2), (8, 8)):
        lens, cu, tensors = make_case(950 + hkv, C, hq, hkv, d, one_seq=False)
        local_cu = local_cu_seqlens(cu, C)
        n = int(local_cu[-1])
        max_local = int((local_cu[1:] - local_cu[:-1]).max())
        q, k, v, dout = (shard_tensor(t, cu, C, rank).bfloat16() for t in tensors)
        for method, u in (("ring", None), ("ulysses", None), ("hybrid", 2)):
            plan = CPAttentionPlan.build(local_cu, max_local, q_heads=hq, kv_heads=hkv,
                                         head_dim=d, dtype=torch.bfloat16, device="cpu",
                                         group=group, method=method, ulysses_size=u)
            ql = q.clone().requires_grad_()
            with _SentBytes() as fwd:
                out = context_parallel_attention(ql, k, v, None, None, group=group, plan=plan,
                                                 method=method, backend="fake_flash")
            with _SentBytes() as bwd:
                out.backward(dout)
            want = comm_volume(method, n_tokens=n, q_heads=hq, kv_heads=hkv, head_dim=d,
                               cp_size=C, ulysses_size=u, elem_bytes=2, acc_bytes=4)
            got = (fwd.n, bwd.n)
            assert got == (want["forward"], want["backward"]), (method, hq, hkv, got, want)


def _empty_batches(group):
    """No real row at all (only trailing padding rows): output and gradients exactly 0."""
    for cu in ([0], [0, 0]):
        cu = torch.tensor(cu, dtype=torch.int32)
        for method, u in (("ulysses", None), ("hybrid", 2)):
            q = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True)
            out = context_parallel_attention(q, q, q, cu, 0, group=group, method=method,
                                             ulysses_size=u, backend="reference")
            out.backward(torch.randn_like(out))
            assert torch.equal(out, torch.zeros_like(out)), (method, cu)
            assert torch.equal(q.grad, torch.zeros_like(q)), (method, cu)


def _plan_reuse(rank, group):
    """A plan built once serves several calls (forward and backward) without collectives
    beyond the exchange; a call with another ulysses_size than the plan's is refused."""
    C = dist.get_world_size(group)
    lens, cu, (q, k, v, dout) = make_case(900, C, 8, 2, 8, one_seq=False)
    local_cu = local_cu_seqlens(cu, C)
    max_local = int((local_cu[1:] - local_cu[:-1]).max())
    loc = [shard_tensor(t, cu, C, rank) for t in (q, k, v, dout)]
    plan = CPAttentionPlan.build(local_cu, max_local, q_heads=8, kv_heads=2, head_dim=8,
                                 dtype=torch.float64, device="cpu", group=group, method="hybrid",
                                 ulysses_size=2)
    assert plan.ulysses_size == 2
    outs = []
    for _ in range(2):
        ql = loc[0].clone().requires_grad_()
        out = context_parallel_attention(ql, loc[1], loc[2], None, None, group=group,
                                         method="hybrid", plan=plan, backend="reference")
        out.backward(loc[3])
        outs.append((out.detach(), ql.grad))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    with pytest.raises(ValueError, match="plan: built for ulysses_size=2, got 4"):
        context_parallel_attention(loc[0], loc[1], loc[2], None, None, group=group,
                                   method="hybrid", plan=plan, ulysses_size=4)


def _errors_on_every_rank(rank, group):
    C = dist.get_world_size(group)
    cu = torch.tensor([0, 4], dtype=torch.int32)  # local: one sequence of 4 rows
    q, k = torch.randn(4, 8, 8, dtype=torch.float64), torch.randn(4, 2, 8, dtype=torch.float64)
    cpa = context_parallel_attention
    # the same bad argument on every rank: each raises ValueError
    with pytest.raises(ValueError, match=r"ulysses_size must divide cp_size: 4 % 3 = 1"):
        cpa(q, k, k, cu, 4, group=group, method="hybrid", ulysses_size=3)
    with pytest.raises(ValueError, match=r"Hq % U = 6 % 4 = 2"):
        cpa(q[:, :6], k, k, cu, 4, group=group, method="ulysses")
    with pytest.raises(ValueError, match=r"Hkv = 3: 3 % 2 = 1, 2 % 3 = 2"):
        cpa(q[:, :6], q[:, :3], q[:, :3], cu, 4, group=group, method="hybrid", ulysses_size=2)
    # ranks disagree (ulysses_size, then cu_seqlens): RuntimeError on every rank
    with pytest.raises(RuntimeError, match=r"differ across the ranks") as info:
        cpa(q, k, k, cu, 4, group=group, method="hybrid", ulysses_size=2 if rank < 2 else 4)
    assert "ulysses_size=2" in str(info.value) and "ulysses_size=4" in str(info.value)
    other = torch.tensor([0, 2, 4], dtype=torch.int32) if rank == 3 else cu
    with pytest.raises(RuntimeError, match=r"differ across the ranks"):
        cpa(q, k, k, other, 4, group=group, method="ulysses")
    # a bad argument on one rank only: that rank raises it, the others name it
    bad = 3 if rank == 1 else 2
    err = ValueError if rank == 1 else RuntimeError
    with pytest.raises(err, match=r"4 % 3 = 1" if rank == 1 else r"another rank: rank 1"):
        cpa(q, k, k, cu, 4, group=group, method="hybrid", ulysses_size=bad)
    assert C == 4


def test_ulysses_and_hybrid_match_single_process():
    run_distributed(_parity_body, 4, timeout_s=120)


def _rank_stalls_body(rank, world_size, method, ulysses_size):
    """Rank 3 builds the plan (the agreement passes), then stalls (alive, connections open)
    instead of joining the exchange: the others must raise from the all-to-all / ring after
    the 5 s timeout, which the subgroups inherit from the CP group (torch's default would
    wait until rank 3 leaves at 12 s)."""
    cu = torch.tensor([0, 8], dtype=torch.int32)
    q = torch.randn(8, 4, 8, dtype=torch.float64)
    plan = CPAttentionPlan.build(cu, 8, q_heads=4, kv_heads=4, head_dim=8, dtype=q.dtype,
                                 device="cpu", group=dist.group.WORLD, method=method,
                                 ulysses_size=ulysses_size)
    if rank == 3:
        time.sleep(12)
        return
    start = time.monotonic()
    with pytest.raises(RuntimeError):  # DistBackendError / gloo timeout are RuntimeErrors
        out = context_parallel_attention(q, q, q, None, None, group=dist.group.WORLD,
                                         method=method, plan=plan, backend="reference")
        out.sum().backward()
    assert time.monotonic() - start < 10


@pytest.mark.slow
def test_stalled_rank_does_not_hang():
    run_distributed(_rank_stalls_body, 4, "hybrid", 2, timeout_s=5)
