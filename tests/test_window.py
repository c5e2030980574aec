"""Sliding-window attention and attention sinks under CP (cp_rope.parallel._window).

* Unit tests: the window convention against transformers' mask and flash-attn's
  ``window_size`` definition; the window pieces cover exactly the visible pairs (brute
  force over positions); the reference block's bottom-right window; bad windows / sinks
  named; cp 1 against the float64 oracle of ``tests/window_utils.py``.
* One spawned gloo world per CP size (2, 3, 4), looping over every case: methods ring,
  allgather, ulysses (and hybrid at cp 4), placements zigzag and per-document, windows
  ``W`` in {1, 2, 7, c - 1, c, c + 1, 2c + 3, longer than every document} (c: the longest
  document's chunk), with and without sinks, causal, float64 on the reference backend:
  output, LSE and the gradients of q, k, v and sinks (summed over the ranks) within 1e-10
  of the unsharded oracle. Documents shorter than a chunk, zero-length and one-token
  ones, odd lengths (whole documents under per-document placement), a trailing
  zero-length sentinel and trailing padding rows. The same worlds count the K/V bytes the
  windowed ring sends (forward: at most ``2 (W - 1) Hkv D`` elements per document chunk
  when ``W`` is below the chunk, and equal to ``comm_volume``), and check that ranks
  disagreeing on the window or the sinks raise on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from attention_utils import fake_flash_bwd, fake_flash_fwd
from dist_utils import run_distributed
from utils import assert_close
from window_utils import window_attention, window_mask

from cp_rope.parallel import attention_plan, context_parallel_attention, cp_shard_indices
from cp_rope.parallel._blocks import Block, _Reference, _Varlen
from cp_rope.parallel._dispatch import run_plan
from cp_rope.parallel._schedule import Layout
from cp_rope.parallel._window import check_window, offdiag_pieces, pair_pieces
from cp_rope.parallel.placement import place_documents
from cp_rope.parallel.ulysses import comm_volume

EXACT = {"atol": 1e-10, "rtol": 0.0}


# --------------------------------------------------------------------------- convention

def test_window_is_transformers_sliding_window():
    """W = config.sliding_window: transformers' causal mask and sliding-window overlay."""
    mu = pytest.importorskip("transformers.masking_utils")
    and_masks, causal, overlay = mu.and_masks, mu.causal_mask_function, mu.sliding_window_overlay
    for sw in (1, 2, 5, 9):
        fn = and_masks(causal, overlay(sw))
        n = 12
        t = torch.tensor
        theirs = torch.tensor([[bool(fn(t(0), t(0), t(i), t(j))) for j in range(n)]
                               for i in range(n)])
        assert torch.equal(theirs, window_mask(n, sw)), sw


def test_window_is_flash_attn_window_size():
    """W = left + 1 for flash-attn's window_size=(left, 0), causal: its documented rule
    (query i sees keys i + sk - sq - left .. i + sk - sq + right)."""
    n = 11
    for left in (0, 1, 4, 20):
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        flash = (j >= i - left) & (j <= i)
        assert torch.equal(flash, window_mask(n, left + 1))
        # and the reference block with Block.window=(left, 0) computes that mask
        blk = Block(torch.tensor([0, n]), torch.tensor([0, n]), n, n, True, window=(left, 0))
        lo, hi = _Reference()._row_windows(blk, n, "cpu")
        ours = (j >= lo[:, None]) & (j < hi[:, None])
        assert torch.equal(ours, flash), left


def test_reference_block_bottom_right_halo():
    """window=(0, -1) without causal, lq != lk: key j visible iff j >= i + lk - lq."""
    for lq, lk in ((5, 5), (6, 3), (2, 4)):
        blk = Block(torch.tensor([0, lq]), torch.tensor([0, lk]), lq, lk, False, window=(0, -1))
        lo, hi = _Reference()._row_windows(blk, lq, "cpu")
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        assert torch.equal((j >= lo[:, None]) & (j < hi[:, None]), j >= i + lk - lq), (lq, lk)


def _visible_by_pieces(pieces, qa, qb, ka, kb):
    """The (query, key) position pairs the pieces make visible, from each kind's mask."""
    seen = torch.zeros(qb - qa, kb - ka, dtype=torch.int64)
    for kind, q0, q1, k0, k1 in pieces:
        lq, lk = q1 - q0, k1 - k0
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        m = torch.ones(lq, lk, dtype=torch.bool) if kind == "full" else j >= i + lk - lq
        seen[q0 - qa:q1 - qa, k0 - ka:k1 - ka] += m.long()
    return seen


@pytest.mark.parametrize("W", [1, 2, 3, 5, 6, 7, 9, 12, 30])
def test_offdiag_pieces_cover_exactly_the_window(W):
    for qa, qb, ka, kb in ((10, 15, 5, 10), (10, 15, 0, 5), (20, 24, 0, 20), (8, 9, 7, 8)):
        seen = _visible_by_pieces(offdiag_pieces(qa, qb, ka, kb, W), qa, qb, ka, kb)
        p, k = torch.arange(qa, qb)[:, None], torch.arange(ka, kb)[None, :]
        want = (p - k < W).long()
        assert torch.equal(seen, want), (W, qa, qb, ka, kb, seen, want)


def test_pair_pieces_skip_invisible_ranks():
    """cp 4, chunk 6, W = 3: rank 2's queries need rank 1 (chunk 1 before chunk 2) and rank 3
    (chunk 4 before chunk 5) and nothing of rank 0: no piece, nothing sent."""
    lay = Layout(torch.tensor([0, 12]), 12, 12, 4, 2, True, None, torch.device("cpu"), 1, 3)
    assert pair_pieces(lay, 2, 0, 3) == []
    assert {p[0] for p in pair_pieces(lay, 2, 1, 3)} == {"halo"}
    assert sum(p[4] - p[3] for p in pair_pieces(lay, 2, 3, 3)) == 2  # the W - 1 halo rows


def test_bad_window_and_sinks_named():
    q = torch.randn(8, 2, 4, dtype=torch.float64)
    k = v = torch.randn(8, 1, 4, dtype=torch.float64)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    for bad, exc in ((0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError),
                     ("4", TypeError)):
        with pytest.raises(exc, match="window"):
            context_parallel_attention(q, k, v, cu, 8, window=bad)
    for bad in ([None, 3], [2, 3], (3,)):  # round 4 #3: the list's first window ran, silently
        with pytest.raises(TypeError, match=r"window must be an int or None here, got .*"
                                            r"attention_plan\(window=\[\.\.\.\]\)"):
            context_parallel_attention(q, k, v, cu, 8, window=bad)
    with pytest.raises(ValueError, match="window=4 needs causal=True"):
        check_window(4, causal=False)
    with pytest.raises(ValueError, match="window"):
        context_parallel_attention(q, k, v, cu, 8, window=4, causal=False,
                                   seq_lens=torch.tensor([8]))
    for bad, exc, what in ((torch.zeros(3, dtype=torch.float64), ValueError, "shape"),
                           (torch.zeros(2, 1, dtype=torch.float64), ValueError, "shape"),
                           (torch.zeros(2, dtype=torch.int64), TypeError, "dtype"),
                           (torch.zeros(2, dtype=torch.float16), TypeError, "dtype"),
                           ([0.0, 0.0], TypeError, "Tensor"),
                           (torch.zeros(2, dtype=torch.float64, device="meta"), ValueError,
                            "device")):
        with pytest.raises(exc, match=f"sinks.*{what}"):
            context_parallel_attention(q, k, v, cu, 8, sinks=bad)
    plan = attention_plan(cu, 8, q_heads=2, kv_heads=1, head_dim=4, dtype=torch.float64,
                          window=[3, None])
    with pytest.raises(ValueError, match="sinks: the plan was built without sinks"):
        context_parallel_attention(q, k, v, plan=plan, sinks=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"window=5: the plan was built for windows \[3, None\]"):
        context_parallel_attention(q, k, v, plan=plan, window=5)
    splan = attention_plan(cu, 8, q_heads=2, kv_heads=1, head_dim=4, dtype=torch.float64,
                           sinks=True)
    with pytest.raises(ValueError, match="sinks: the plan was built with sinks=True"):
        context_parallel_attention(q, k, v, plan=splan)
    with pytest.raises(ValueError, match="does not run sliding-window blocks"):
        context_parallel_attention(q, k, v, cu, 8, window=3, backend="torch_cudnn")
    # cudnn falls back to fa4 / flash_attn / torch_flash; on a CPU none runs: all named
    with pytest.raises(ValueError, match=r"backend='cudnn' runs sliding-window.*fa4 .*"
                                         r"flash_attn .*torch_flash "):
        context_parallel_attention(q, k, v, cu, 8, window=3, backend="cudnn")


def test_cp1_matches_the_oracle_and_per_layer_windows():
    gen = torch.Generator().manual_seed(3)
    cu = [0, 7, 7, 8, 21, 21]
    T = cu[-1] + 3  # trailing padding rows
    q, k, v, do = (torch.randn(T, h, 5, generator=gen, dtype=torch.float64) for h in (6, 2, 2, 6))
    sinks = torch.randn(6, generator=gen, dtype=torch.float64)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    plan = attention_plan(cu_t, 13, q_heads=6, kv_heads=2, head_dim=5, dtype=torch.float64,
                          n_tokens=T, window=[None, 1, 4, 13], sinks=True)
    assert plan.window is None and plan.for_window(4).window == 4
    for W in (None, 1, 4, 13):
        for S in (None, sinks):
            ins = [t.clone().requires_grad_() for t in (q, k, v)] + (
                [S.clone().requires_grad_()] if S is not None else [])
            if S is None:  # without a plan: the call builds one
                out, lse = context_parallel_attention(*ins[:3], cu_t, 13, window=W,
                                                      return_lse=True)
            else:
                out, lse = context_parallel_attention(*ins[:3], plan=plan, window=W,
                                                      sinks=ins[3], return_lse=True)
            ref_ins = [t.clone().requires_grad_() for t in ins]
            rout, rlse = window_attention(*ref_ins[:3], cu, W, ref_ins[3] if S is not None
                                          else None, 5 ** -0.5)
            grads = torch.autograd.grad((out * do).sum(), ins)
            rgrads = torch.autograd.grad((rout * do).sum(), ref_ins)
            assert_close(out, rout, name=f"out W={W}", **EXACT)
            n = cu[-1]
            assert_close(lse[:, :n], rlse[:, :n], name="lse", **EXACT)
            assert bool((lse[:, n:] == float("-inf")).all())
            for name, g, rg in zip("q k v sinks".split()[:len(grads)], grads, rgrads,
                                   strict=True):
                assert_close(g, rg, name=f"d{name} W={W}", **EXACT)


def test_window_none_given_with_a_plan_is_the_full_layer():
    """Round 5 #1: with a plan of windows [3, None], window=None ran the plan's first window
    (max error 2.3 against causal attention): a model passing each layer's sliding_window
    (None on its full layers) ran every full layer windowed. Now window=None given is the
    full layer, left out the plan's own window; a plan without a full variant refuses it."""
    gen = torch.Generator().manual_seed(11)
    cu = [0, 9, 10, 16]
    q, k, v = (torch.randn(cu[-1], h, 4, generator=gen, dtype=torch.float64) for h in (2, 1, 1))
    cu_t = torch.tensor(cu, dtype=torch.int32)
    plan = attention_plan(cu_t, 9, q_heads=2, kv_heads=1, head_dim=4, dtype=torch.float64,
                          window=[3, None])
    for given, W in (({"window": None}, None), ({}, 3), ({"window": 3}, 3)):
        out = context_parallel_attention(q, k, v, plan=plan, **given)
        ref, _ = window_attention(q, k, v, cu, W, None, 0.5)
        assert_close(out, ref, name=f"window {given or 'left out'}", **EXACT)
    only = attention_plan(cu_t, 9, q_heads=2, kv_heads=1, head_dim=4, dtype=torch.float64,
                          window=3)
    with pytest.raises(ValueError, match=r"window=None: the plan was built for windows \[3\]"):
        context_parallel_attention(q, k, v, plan=only, window=None)


# --------------------------------------------------------------------------- CP parity

_CHUNK = 5  # the longest document's chunk length c (its global length 2 C c)


def _case_docs(C: int, placement: str) -> list[int]:
    """Global (padded) lengths: a long document, shorter than a chunk, zero-length, one-token
    (padded to 2C under zigzag), a boundary-on-edge one, and a trailing zero-length
    sentinel; odd lengths for the documents that stay whole under per-document placement."""
    long = 2 * C * _CHUNK
    if placement == "zigzag":
        return [long, 2 * C, 0, 2 * C, 2 * C * 3, long, 0]
    return [long, 3, 0, 1, 7, 2 * C * 3, long, 0]


def _windows(C: int) -> list[int]:
    c = _CHUNK
    return sorted({1, 2, 7, c - 1, c, c + 1, 2 * c + 3, 2 * C * c + 5})


def _methods(C: int):
    yield "ring", None
    yield "allgather", None
    yield "ulysses", None
    if C == 4:
        yield "hybrid", 2


def _heads(C: int) -> tuple[int, int]:
    return (6, 3) if C == 3 else (4, 2)


def _one_case(rank, C, group, placement, method, u, W, with_sinks, seed, pad=2, be=None):
    """One parity case; ``be``: a backend object run through the plan directly (the fake
    flash kernels: the GPU varlen glue, window_size plumbing and flash's conventions)."""
    hq, hkv = _heads(C)
    D = 3
    lens = _case_docs(C, placement)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    gen = torch.Generator().manual_seed(seed)
    T = cu[-1]
    q, k, v, do = (torch.randn(T, h, D, generator=gen, dtype=torch.float64)
                   for h in (hq, hkv, hkv, hq))
    sinks = torch.randn(hq, generator=gen, dtype=torch.float64) if with_sinks else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + (
        [sinks.clone().requires_grad_()] if with_sinks else [])
    rout, rlse = window_attention(*leaves[:3], cu, W, leaves[3] if with_sinks else None,
                                  D ** -0.5)
    rgrads = torch.autograd.grad((rout * do).sum(), leaves)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    if placement == "zigzag":
        idx = cp_shard_indices(cu_t, C, rank)
        n_rows = idx.numel() + pad
        source = cu_t // C
        kw = {"max_seqlen": max(lens) // C, "n_tokens": n_rows}
    else:
        placed = place_documents(cu_t, C, 2 * C * 3 - 1)  # the long documents split
        idx, n_rows, source, kw = placed.indices(rank), placed.n_rows, placed, {}
    n = idx.numel()

    def local(t):
        x = t.new_zeros(n_rows, *t.shape[1:])
        x[:n] = t[idx]
        return x

    ins = [local(t).requires_grad_() for t in (q, k, v)]
    if with_sinks:
        ins.append(sinks.clone().requires_grad_())
    plan = attention_plan(source, q_heads=hq, kv_heads=hkv, head_dim=D, dtype=torch.float64,
                          device="cpu", group=group, method=method, ulysses_size=u,
                          backend="reference", window=[W, None], sinks=with_sinks, **kw)
    if be is None:
        out, lse = context_parallel_attention(*ins[:3], plan=plan, sinks=ins[3] if with_sinks
                                              else None, return_lse=True)
    else:
        if placement != "zigzag":
            plan = plan.split
        out, lse = run_plan(*ins[:3], plan.for_window(W), be, D ** -0.5,
                            ins[3] if with_sinks else None)
    grads = torch.autograd.grad((out * local(do)).sum(), ins)
    what = f"cp{C} {placement} {method} W={W} sinks={with_sinks}"
    assert_close(out[:n], rout[idx], name=f"out {what}", **EXACT)
    assert bool((out[n:] == 0).all()) and bool((lse[:, n:] == float("-inf")).all()), what
    assert_close(lse[:, :n], rlse[:, idx], name=f"lse {what}", **EXACT)
    for name, g, rg in zip("qkv", grads[:3], rgrads[:3], strict=True):
        assert_close(g[:n], rg[idx], name=f"d{name} {what}", **EXACT)
        assert bool((g[n:] == 0).all()), what
    if with_sinks:  # each rank's rows' share; the sum over the group is the gradient
        ds = grads[3].clone()
        dist.all_reduce(ds, group=group)
        assert_close(ds, rgrads[3], name=f"dsinks {what}", **EXACT)


def _halo_bytes(rank, C, group):
    """The windowed ring's forward K/V bytes, counted at batch_isend_irecv, against the halo
    bound and comm_volume; W below the chunk length."""
    hq, hkv, D = 4, 2, 8
    c = 6
    lens = [2 * C * c, 2 * C * c, 2 * C * 2]  # the short one: chunk 2, W above it
    cu_t = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    W = 4
    idx = cp_shard_indices(cu_t, C, rank)
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(cu_t[-1].item(), h, D, generator=gen, dtype=torch.bfloat16)[idx]
               for h in (hq, hkv, hkv))
    plan = attention_plan(cu_t // C, max(lens) // C, q_heads=hq, kv_heads=hkv, head_dim=D,
                          dtype=torch.bfloat16, device="cpu", group=group, backend="reference",
                          window=W)
    sent = []
    real = dist.batch_isend_irecv

    def counting(ops):
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops
                    if op.op is dist.isend)
        return real(ops)

    dist.batch_isend_irecv = counting
    try:
        context_parallel_attention(q, k, v, plan=plan)
    finally:
        dist.batch_isend_irecv = real
    n_chunks = 2 * len(lens)  # chunks of this rank
    bound = 2 * (W - 1) * hkv * D * 2 * n_chunks
    assert sum(sent) <= bound, (sum(sent), bound)
    full_ring = (C - 1) * 2 * idx.numel() * hkv * D * 2
    assert sum(sent) < full_ring / 3, (sum(sent), full_ring)
    vol = comm_volume("ring", n_tokens=idx.numel(), q_heads=hq, kv_heads=hkv, head_dim=D,
                      cp_size=C, window=W, cu_seqlens=cu_t // C, cp_rank=rank)
    assert vol["forward"] == sum(sent), (vol, sum(sent))


def _disagreement(rank, C, group):
    cu = torch.tensor([0, 4 * C], dtype=torch.int32) // C
    kw = dict(q_heads=2, kv_heads=1, head_dim=4, dtype=torch.float64, device="cpu", group=group)
    with pytest.raises(RuntimeError, match="window"):
        attention_plan(cu, 4, window=3 if rank == 0 else 4, **kw)
    with pytest.raises(RuntimeError, match="sinks"):
        attention_plan(cu, 4, sinks=rank == 0, **kw)
    q = torch.randn(4, 2, 4, dtype=torch.float64)
    k = v = torch.randn(4, 1, 4, dtype=torch.float64)
    bad = torch.zeros(2 if rank else 3, dtype=torch.float64)  # rank 0: a wrong shape
    with pytest.raises((ValueError, RuntimeError), match="sinks"):
        context_parallel_attention(q, k, v, cu, 4, group=group, sinks=bad)
    with pytest.raises((TypeError, RuntimeError), match="window"):
        context_parallel_attention(q, k, v, cu, 4, group=group, window=2.5 if rank else 2)
    # round 4 #17: sink values that differ across ranks ran, each rank's rows with its own
    own = torch.full((2,), float(rank), dtype=torch.float64)
    with pytest.raises(RuntimeError, match="sinks_sha256"):
        context_parallel_attention(q, k, v, cu, 4, group=group, sinks=own)
    placed = place_documents(torch.arange(0, 4 * C + 1, 4, dtype=torch.int32), C, 4)  # whole docs
    assert placed.n_rows == 4
    with pytest.raises(RuntimeError, match="sinks_sha256"):
        context_parallel_attention(q, k, v, placement=placed, group=group, sinks=own)
    same = torch.full((2,), 0.5, dtype=torch.float64)
    context_parallel_attention(q, k, v, cu, 4, group=group, sinks=same)
    context_parallel_attention(q, k, v, placement=placed, group=group, sinks=same)


def _parity_body(rank, world_size):
    group = dist.group.WORLD
    C = world_size
    seed = 0
    for placement in ("zigzag", "per_document"):
        for method, u in _methods(C):
            for W in _windows(C):
                for with_sinks in (False, True):
                    seed += 1
                    _one_case(rank, C, group, placement, method, u, W, with_sinks, seed)
    flash = _Varlen("torch_flash", fake_flash_fwd, fake_flash_bwd)
    for method, u in _methods(C):
        for W in (2, _CHUNK + 1):
            seed += 1
            _one_case(rank, C, group, "zigzag", method, u, W, True, seed, pad=0, be=flash)
    _halo_bytes(rank, C, group)
    _disagreement(rank, C, group)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.slow
def test_window_cp_parity(world_size):
    run_distributed(_parity_body, world_size, timeout_s=600)
