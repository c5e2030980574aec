"""Per-document CP placement (cp_rope.parallel.placement).

* Properties (hypothesis, pure host code): every global row is placed exactly
  once; each rank's local cu_seqlens / position_ids / indices agree; the balance
  bound of the module docstring holds, and LPT is within 4/3 - 1/(3C) of the
  brute-force optimum on small cases; the result is deterministic; threshold 0
  is the zigzag layout; equal-length documents balance tokens within one
  document; shards restore the global batch.
* Bad thresholds, placements and batches raise as documented; a rank without
  documents gets a padding-only shard.
* One spawned world of 4 gloo ranks runs subgroups of cp 2, 3 and 4: CP
  attention with ``placement=`` (ring and all-gather, causal, GQA) forward and
  gradients equal single-process float64 attention within 1e-10 on mixed,
  all-short, all-long, zero-length and one-document batches, and ``unshard``
  restores the global order.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.distributed as dist
from attention_utils import naive_attention
from dist_utils import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st
from utils import assert_close

from cp_rope import global_positions
from cp_rope.parallel import PackingCollator, cp_shard_indices, shard_batch
from cp_rope.parallel.placement import (
    check_placement,
    default_split_threshold,
    place_documents,
)


def _cu(lengths) -> torch.Tensor:
    cu = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=cu[1:])
    return torch.from_numpy(cu.astype(np.int32))


def _w(L):
    return L * (L + 1) // 2


@st.composite
def batches(draw, max_docs=24):
    """(lengths, cp_size, split_threshold): lengths are multiples of 2 * cp_size (as the
    collator pads them), zero-length documents included."""
    cp = draw(st.integers(1, 5))
    units = draw(st.lists(st.integers(0, 12), min_size=0, max_size=max_docs))
    lengths = [2 * cp * u for u in units]
    threshold = draw(st.integers(0, 2 * cp * 13))
    return lengths, cp, threshold


def _check_layout(lengths, cp, threshold, pad_to_multiple=1):
    cu = _cu(lengths)
    p = place_documents(cu, cp, threshold, pad_to_multiple=pad_to_multiple)
    total = int(cu[-1])
    lens = np.asarray(lengths, np.int64)
    split = lens > threshold
    seen = torch.zeros(total, dtype=torch.int64)
    n_valid = []
    for r in range(cp):
        idx, pos, lcu = p.indices(r), p.position_ids(r), p.local_cu_seqlens(r)
        ids = p.seq_ids(r)
        assert lcu.dtype == torch.int32 and int(lcu[0]) == 0
        assert idx.numel() == pos.numel() == int(lcu[-1]) == p.n_valid(r) <= p.n_rows
        n_valid.append(idx.numel())
        seen.index_add_(0, idx, torch.ones_like(idx))
        # split shares first, in global order; then this rank's whole documents
        ns = p.num_split
        assert list(ids[:ns]) == list(np.flatnonzero(split))
        assert list(ids[ns:]) == sorted(ids[ns:]) and all(not split[b] for b in ids[ns:])
        local_lens = np.diff(lcu.numpy())
        assert np.array_equal(local_lens[:ns], lens[ids[:ns]] // cp)
        assert np.array_equal(local_lens[ns:], lens[ids[ns:]])
        assert int(lcu[ns]) == p.split_rows
        assert p.max_seqlen(r) == (int(local_lens.max()) if local_lens.size else 0)
        bound = p.max_position_id(r)
        assert bound >= (int(pos.max()) if pos.numel() else 0)
        assert bound == max([int(lens[b]) - 1 for b in ids] + [0])
        # rows = global start of the sequence + position; positions: zigzag for split
        # shares (the one formula), 0..L-1 for whole documents
        seq = np.repeat(ids, local_lens)
        assert torch.equal(idx, torch.from_numpy(cu.numpy()[seq].astype(np.int64)) + pos)
        split_cu = lcu[: ns + 1]
        assert torch.equal(pos[: p.split_rows], global_positions(split_cu, cp, r))
        whole_cu = lcu[ns:] - lcu[ns]
        assert torch.equal(pos[p.split_rows:], global_positions(whole_cu, 1, 0))
    assert torch.equal(seen, torch.ones(total, dtype=torch.int64)), "a row placed twice or never"
    need = max(n_valid) if n_valid else 0
    assert p.n_rows == -(-need // pad_to_multiple) * pad_to_multiple
    return p


@settings(max_examples=60, deadline=None)
@given(batches(), st.integers(1, 8))
def test_every_token_placed_once(case, pad_to_multiple):
    _check_layout(*case, pad_to_multiple=pad_to_multiple)


@settings(max_examples=150, deadline=None)
@given(batches())
def test_balance_bound(case):
    lengths, cp, threshold = case
    p = place_documents(_cu(lengths), cp, threshold)
    work = [p.work(r) for r in range(cp)]
    lens = np.asarray(lengths, np.int64)
    assert sum(work) == sum(_w(int(L)) for L in lens)  # split shares sum to the whole
    whole = [_w(int(L)) for L in lens if L <= threshold]
    w_max = max(whole, default=0)
    # max <= mean + (1 - 1/C) w_max, in integers: C max <= sum + (C - 1) w_max
    assert cp * max(work) <= sum(work) + (cp - 1) * w_max
    # the split share is the same on every rank
    split = [int(L) for L in lens if L > threshold]
    share = sum(L // (2 * cp) * (L + 1) for L in split)
    for r in range(cp):
        mine = [int(L) for L, o in zip(lens, p.owner, strict=True) if o == r]
        assert work[r] == share + sum(_w(L) for L in mine)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 3), st.lists(st.integers(0, 9), min_size=1, max_size=7))
def test_lpt_within_graham_bound_of_optimum(cp, units):
    """Whole documents only: LPT's busiest rank <= (4/3 - 1/(3C)) x the brute-force optimum."""
    lengths = [2 * cp * u for u in units]
    p = place_documents(_cu(lengths), cp, 10**9)
    got = max(p.work(r) for r in range(cp))
    w = [_w(L) for L in lengths]
    opt = min(max(sum(x for x, a in zip(w, assign, strict=True) if a == r) for r in range(cp))
              for assign in itertools.product(range(cp), repeat=len(w)))
    assert 3 * cp * got <= (4 * cp - 1) * opt


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40), st.integers(0, 10))
def test_equal_documents_balance_tokens(cp, n_docs, unit):
    L = 2 * cp * unit
    p = place_documents(_cu([L] * n_docs), cp, L)
    tokens = [p.n_valid(r) for r in range(cp)]
    assert max(tokens) - min(tokens) <= L
    if unit:
        counts = np.bincount(p.owner, minlength=cp)
        assert counts.max() - counts.min() <= 1


@settings(max_examples=30, deadline=None)
@given(batches())
def test_deterministic(case):
    lengths, cp, threshold = case
    a = place_documents(_cu(lengths), cp, threshold)
    b = place_documents(_cu(lengths).clone(), np.int64(cp), np.int32(threshold))
    assert np.array_equal(a.owner, b.owner) and a.n_rows == b.n_rows
    for r in range(cp):
        assert torch.equal(a.indices(r), b.indices(r))
        assert torch.equal(a.local_cu_seqlens(r), b.local_cu_seqlens(r))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5), st.lists(st.integers(1, 6), max_size=10))
def test_threshold_zero_is_zigzag(cp, units):
    """No zero-length documents: threshold 0 splits every document, i.e. the zigzag layout."""
    cu = _cu([2 * cp * u for u in units])
    p = place_documents(cu, cp, 0)
    for r in range(cp):
        assert torch.equal(p.indices(r), cp_shard_indices(cu, cp, r))
        assert torch.equal(p.local_cu_seqlens(r), torch.div(cu, cp, rounding_mode="floor"))
    assert p.n_rows == int(cu[-1]) // cp


def test_example_placement():
    """Documents 48 (split at threshold 16), 16, 8, 8, 0, 16 at cp 2: LPT puts the two 16s
    on ranks 0 and 1, then the 8s on 0 and 1 (ties by tokens, then rank), the 0 on rank 0."""
    p = place_documents(_cu([48, 16, 8, 8, 0, 16]), 2, 16)
    assert list(p.owner) == [-1, 0, 0, 1, 0, 1]
    assert p.num_split == 1 and p.split_rows == 24 and p.split_max_seqlen == 24
    assert p.local_cu_seqlens(0).tolist() == [0, 24, 40, 48, 48]
    assert p.local_cu_seqlens(1).tolist() == [0, 24, 32, 48]
    assert p.n_rows == 48


def _examples(gen, lengths, vocab=50):
    return [{"input_ids": torch.randint(0, vocab, (n,), generator=gen)} for n in lengths]


@pytest.mark.parametrize("cp", [2, 3])
def test_shards_restore_the_global_batch(cp):
    gen = torch.Generator().manual_seed(cp)
    ex = _examples(gen, [3, 70, 0, 12, 1, 33, 9])
    glob = PackingCollator(cp_size=cp, pad_id=7)(ex)
    T = glob.num_tokens
    shards = [PackingCollator(cp_size=cp, cp_rank=r, placement="per_document", split_threshold=24,
                              pad_id=7)(ex) for r in range(cp)]
    rebuilt = {k: torch.full((T,), -1, dtype=torch.int64) for k in ("input_ids", "labels")}
    for r, s in enumerate(shards):
        p = s.placement
        assert s.cp_size == cp and s.cp_rank == r and s.num_tokens == p.n_rows
        assert torch.equal(s.global_cu_seqlens, glob.cu_seqlens)
        assert s.seq_lens is glob.seq_lens or torch.equal(s.seq_lens, glob.seq_lens)
        n = p.n_valid(r)
        idx = p.indices(r)
        for k in rebuilt:
            rebuilt[k][idx] = getattr(s, k)[:n]
        assert torch.equal(s.position_ids[:n], p.position_ids(r))
        assert (s.input_ids[n:] == 7).all() and (s.labels[n:] == -100).all()
        assert (s.position_ids[n:] == 0).all()
        assert s.max_seqlen == p.max_seqlen(r)
        # the same placement as shard_batch on the global batch
        s2 = shard_batch(glob, cp, r, placement="per_document", split_threshold=24, pad_id=7)
        assert torch.equal(s2.input_ids, s.input_ids) and torch.equal(s2.cu_seqlens, s.cu_seqlens)
    assert torch.equal(rebuilt["input_ids"], glob.input_ids)
    assert torch.equal(rebuilt["labels"], glob.labels)


def test_rank_without_documents_gets_padding_only():
    gen = torch.Generator().manual_seed(0)
    ex = _examples(gen, [5])
    shards = [PackingCollator(cp_size=4, cp_rank=r, placement="per_document",
                              split_threshold=8)(ex) for r in range(4)]
    assert shards[0].cu_seqlens.tolist() == [0, 8]
    for s in shards[1:]:
        assert s.cu_seqlens.tolist() == [0] and s.max_seqlen == 0
        assert s.num_tokens == 8 and (s.labels == -100).all()
    # an empty global batch: no rows anywhere
    empty = PackingCollator(cp_size=2, cp_rank=1, placement="per_document", split_threshold=8)([])
    assert empty.num_tokens == 0 and empty.cu_seqlens.tolist() == [0]


def test_default_split_threshold():
    assert default_split_threshold(128, 2) == 2048
    assert default_split_threshold(128, 8) == 8192
    assert default_split_threshold(64, 4) == 8 * 1024
    assert default_split_threshold(256, 1) == 2 * 512
    with pytest.raises(ValueError, match="head_dim"):
        default_split_threshold(0, 2)
    with pytest.raises(TypeError, match="cp_size"):
        default_split_threshold(64, 2.0)


def test_bad_arguments():
    cu = _cu([8, 8])
    for bad, exc, match in [(-1, ValueError, "split_threshold must be >= 0"),
                            (2.5, TypeError, "split_threshold must be an int"),
                            (True, TypeError, "split_threshold must be an int"),
                            (None, TypeError, "split_threshold must be an int")]:
        with pytest.raises(exc, match=match):
            place_documents(cu, 2, bad)
    with pytest.raises(ValueError, match="pad_to_multiple"):
        place_documents(cu, 2, 4, pad_to_multiple=0)
    with pytest.raises(TypeError, match="cu_seqlens must be int32"):
        place_documents(cu.long(), 2, 4)
    with pytest.raises(ValueError, match="non-decreasing"):
        place_documents(torch.tensor([0, 8, 4], dtype=torch.int32), 2, 4)
    # a document to split must have a length divisible by 2 * cp_size; whole ones need not
    with pytest.raises(ValueError, match="document 1 has length 6 > split_threshold=5"):
        place_documents(_cu([3, 6]), 2, 5)
    place_documents(_cu([3, 6]), 2, 6)
    with pytest.raises(ValueError, match="needs a threshold"):
        check_placement("per_document", None, 2)
    with pytest.raises(ValueError, match="only used with placement='per_document'"):
        check_placement("zigzag", 64, 2)
    with pytest.raises(ValueError, match="placement must be one of"):
        check_placement("round_robin", None, 2)
    with pytest.raises(ValueError, match="split_threshold must be >= 0"):
        PackingCollator(cp_size=2, cp_rank=0, placement="per_document", split_threshold=-8)
    with pytest.raises(ValueError, match="needs a threshold"):
        PackingCollator(cp_size=2, placement="per_document")
    glob = PackingCollator(cp_size=2)([[1, 2, 3]])
    with pytest.raises(ValueError, match="only used with"):
        shard_batch(glob, 2, 0, split_threshold=4)
    p = place_documents(_cu([8]), 2, 4)
    with pytest.raises(ValueError, match="cp_rank"):
        p.indices(2)
    from cp_rope.parallel import per_document_attention

    x = torch.randn(8, 2, 4)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        per_document_attention(x, x, x, placement=place_documents(_cu([8]), 1, 8),
                               backend="reference", return_lse=1)


# --------------------------------------------------------------------------- multi-rank

def _padded(lengths, cp):
    return [-(-n // (2 * cp)) * (2 * cp) for n in lengths]


def _cases(cp):
    """(name, true lengths, split_threshold, causal): padded to multiples of 2 * cp."""
    m = 2 * cp
    return [
        ("mixed", [37, 1, 130, 8, 23, 64, 0, 5], 3 * m, True),
        ("mixed-noncausal", [37, 1, 130, 8, 23, 64, 0, 5], 3 * m, False),
        ("all-short", [5, 9, 3, 12, 7], 64, True),
        ("all-long", [40, 70, 33], m, True),
        ("zero-length", [0, 20, 0, 0, 44, 0], 3 * m, True),
        ("one-short", [9], 32, True),  # ranks > 0 hold padding only
        ("one-long", [90], 32, True),
    ]


def _attention_case(rank, group, cp, lengths, threshold, causal, method, seed, reuse_plan):
    from cp_rope.parallel import PerDocumentPlan, per_document_attention, unshard

    gen = torch.Generator().manual_seed(seed)
    true = torch.tensor(lengths, dtype=torch.int64)
    cu = _cu(_padded(lengths, cp))
    T, hq, hkv, d = int(cu[-1]), 4, 2, 8
    q, k, v = (torch.randn(T, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
    dout = torch.randn(T, hq, d, generator=gen, dtype=torch.float64)
    scale = 0.37
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = naive_attention(*ref_in, cu, causal, scale, seq_lens=None if causal else true)
    ref.backward(dout)

    p = place_documents(cu, cp, threshold)
    idx, n = p.indices(rank), p.n_valid(rank)
    pad = p.n_rows - n

    def local(t):  # this rank's rows, then random trailing padding rows
        return torch.cat([t[idx], torch.randn(pad, *t.shape[1:], generator=gen, dtype=t.dtype)])

    lq, lk, lv = (local(t).requires_grad_() for t in (q, k, v))
    lcu = p.local_cu_seqlens(rank)
    seq_lens = None if causal else true[torch.from_numpy(p.seq_ids(rank))]
    kw = dict(group=group, causal=causal, softmax_scale=scale, method=method, backend="reference")
    if reuse_plan:
        plan = PerDocumentPlan.build(p, q_heads=hq, kv_heads=hkv, head_dim=d, dtype=q.dtype,
                                     device="cpu", group=group, causal=causal, method=method,
                                     seq_lens=seq_lens)
        for _ in range(2):  # the plan serves several layers
            out = per_document_attention(lq, lk, lv, lcu, p.max_seqlen(rank), plan=plan, **kw)
    else:
        out = per_document_attention(lq, lk, lv, lcu, p.max_seqlen(rank), placement=p,
                                     seq_lens=seq_lens, **kw)
    out.backward(local(dout))
    assert out.shape == lq.shape
    for name, t in (("out", out), ("dq", lq.grad), ("dk", lk.grad), ("dv", lv.grad)):
        assert torch.equal(t[n:], torch.zeros_like(t[n:])), f"{name}: padding rows not 0"
    for name, got, want in (("out", out, ref), ("dq", lq.grad, ref_in[0].grad),
                            ("dk", lk.grad, ref_in[1].grad), ("dv", lv.grad, ref_in[2].grad)):
        gathered = unshard(got.detach(), lcu, group, placement=p)
        assert_close(gathered, want.detach(), atol=1e-10, rtol=0.0, name=name)


def _attention_body(rank, world_size):
    groups = {cp: dist.new_group(list(range(cp))) for cp in (2, 3, 4)}
    for cp, group in groups.items():
        if rank >= cp:
            continue
        for i, (name, lengths, threshold, causal) in enumerate(_cases(cp)):
            # ulysses needs Hq (4) divisible by cp: the mixed batch at cp 2 and 4
            ulysses = ("ulysses",) if name == "mixed" and 4 % cp == 0 else ()
            for method in ("ring", "allgather", *ulysses):
                try:
                    _attention_case(rank, group, cp, lengths, threshold, causal, method,
                                    seed=100 * cp + i, reuse_plan=name == "mixed")
                except AssertionError as exc:
                    raise AssertionError(f"cp={cp} {name} {method}: {exc}") from exc


def test_attention_matches_single_process():
    """cp 2, 3, 4 (subgroups of one 4-rank world), ring and all-gather, float64: forward and
    gradients of CP attention on per-document shards == single-process attention (1e-10)."""
    run_distributed(_attention_body, 4)


def test_simulated_plan_runs_whole_documents_exactly():
    """PerDocumentPlan.simulated (for one-GPU scaling studies) needs no process group; its
    whole-document rows are real local attention, so they equal single-process attention."""
    from cp_rope.parallel import PerDocumentPlan, per_document_attention

    gen = torch.Generator().manual_seed(5)
    cp, lengths = 4, [8, 64, 16, 24, 8, 0, 96]
    cu = _cu(lengths)
    T = int(cu[-1])
    q, k, v = (torch.randn(T, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    ref = naive_attention(q, k, v, cu, True, 0.5)
    p = place_documents(cu, cp, 24)
    for r in range(cp):
        plan = PerDocumentPlan.simulated(p, r, q_heads=4, kv_heads=2, head_dim=8,
                                         dtype=torch.float64, device="cpu")
        idx, n = p.indices(r), p.n_valid(r)
        pad = torch.zeros(p.n_rows - n, *q.shape[1:], dtype=q.dtype)
        lq, lk, lv = (torch.cat([t[idx], pad[:, :t.shape[1]]]) for t in (q, k, v))
        out = per_document_attention(lq, lk, lv, plan=plan, softmax_scale=0.5,
                                     backend="reference")
        whole = slice(p.split_rows, n)
        assert_close(out[whole], ref[idx[whole]], atol=1e-10, rtol=0.0, name=f"rank {r}")
        assert out.shape == lq.shape and (out[n:] == 0).all()


def _pretrain_body(rank, world_size, out_dir):
    from cp_rope.launch.pretrain import main

    args = ["--dim", "32", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1",
            "--ffn-hidden-dim", "64", "--seq-len", "128", "--tokens-per-batch", "512",
            "--max-docs", "40", "--warmup-steps", "1", "--log-every", "1", "--no-progress",
            "--no-tensorboard", "--cp-size", "2", "--steps", "3"]
    import cp_rope.launch.pretrain as pretrain

    seen, step = [], pretrain.train_step

    def spy(model, batch, *a, **kw):  # the shards the trainer steps on
        seen.append(batch.placement)
        return step(model, batch, *a, **kw)

    pretrain.train_step = spy
    try:
        doc = main(args + ["--cp-placement", "per_document", "--cp-split-threshold", "64",
                           "--out-dir", f"{out_dir}/doc"])["losses"]
    finally:
        pretrain.train_step = step
    assert len(seen) == 3 and all(p is not None and p.split_threshold == 64 for p in seen)
    zig = main(args + ["--out-dir", f"{out_dir}/zigzag"])["losses"]
    assert sorted(doc) == [1, 2, 3]
    # the same global batches and model: the same losses up to float32 rounding
    for step, loss in zig.items():
        assert abs(doc[step] - loss) <= 1e-4 * abs(loss), (step, doc[step], loss)


def test_pretrain_cli_runs_per_document(tmp_path):
    """`--cp-placement per_document --cp-split-threshold 64` through the trainer (loader ->
    collator -> model -> loss) at cp 2: three steps whose losses equal the zigzag run's
    (gradient parity: tests/test_pretrain_parity.py)."""
    run_distributed(_pretrain_body, 2, str(tmp_path), timeout_s=300)


def _one_rank_fails_body(rank, world):
    # rank 0 passes too few rows for its shard, rank 1 the right count: both must raise
    # (rank 1 must not go on into the split documents' plan exchange and wait there).
    from cp_rope.parallel import PerDocumentPlan

    cu = torch.tensor([0, 8, 16, 24, 64], dtype=torch.int32)  # three whole, one split
    placement = place_documents(cu, world, split_threshold=8)
    n_tokens = placement.n_rows - 1 if rank == 0 else placement.n_rows
    with pytest.raises((ValueError, RuntimeError), match=r"n_tokens"):
        PerDocumentPlan.build(placement, q_heads=2, kv_heads=2, head_dim=8, dtype=torch.float64,
                              device="cpu", n_tokens=n_tokens, group=dist.group.WORLD)
    _unshard_refusals(rank, placement)
    _method_checked_without_split_documents(world)


def _method_checked_without_split_documents(world):
    """A batch without split documents never runs the CP method, but its plan still checks
    it (else a bad method / head count passes until a batch with a long document)."""
    from cp_rope.parallel import PerDocumentPlan

    placement = place_documents(torch.tensor([0, 8, 16], dtype=torch.int32), world, 8)
    assert placement.num_split == 0
    kw = dict(head_dim=8, dtype=torch.float64, device="cpu", group=dist.group.WORLD)
    with pytest.raises(ValueError, match=r"Hq % U = 3 % 2 = 1"):
        PerDocumentPlan.build(placement, q_heads=3, kv_heads=1, method="ulysses", **kw)
    with pytest.raises(ValueError, match="method must be one of"):
        PerDocumentPlan.build(placement, q_heads=2, kv_heads=1, method="zigzag", **kw)
    PerDocumentPlan.build(placement, q_heads=2, kv_heads=1, method="ulysses", **kw)
    # ranks with different placements (rank 1 another threshold: no split document there,
    # so it would skip the split plan's exchange that rank 0 enters): every rank raises
    mine = place_documents(torch.tensor([0, 8, 64], dtype=torch.int32), world,
                           8 if dist.get_rank() == 0 else 100)
    with pytest.raises(RuntimeError, match="differ across the ranks"):
        PerDocumentPlan.build(mine, q_heads=2, kv_heads=1, **kw)


def _unshard_refusals(rank, placement):
    """unshard(..., placement=) refuses a string placement on every rank (TypeError naming
    it), and a bad shard on one rank (or another batch's placement) raises on every rank
    before the gather, where the others used to wait in the all_gather."""
    from cp_rope.parallel import unshard

    lcu = placement.local_cu_seqlens(rank)
    x = torch.randn(placement.n_rows, 3)
    with pytest.raises(TypeError, match="placement must be a DocumentPlacement"):
        unshard(x, lcu, placement="per_document")
    bad = torch.randn(placement.n_rows + 1, 3) if rank == 1 else x
    with pytest.raises(ValueError, match="local: .* rows" if rank == 1 else "rank 1 .* refused"):
        unshard(bad, lcu, placement=placement)
    other = place_documents(torch.tensor([0, 8, 64], dtype=torch.int32), 2, 8)
    mine = other if rank == 1 else placement
    with pytest.raises(ValueError, match="the same on every rank"):
        unshard(torch.randn(mine.n_rows, 3), mine.local_cu_seqlens(rank), placement=mine)
    got = unshard(x, lcu, placement=placement)  # the group still works, and agrees
    assert got.shape == (int(placement.cu_seqlens[-1]), 3)


def test_plan_arguments_failing_on_one_rank_raise_on_every_rank():
    """PerDocumentPlan.build and unshard(placement=) with bad input on one rank: every rank
    raises, none waits in a collective."""
    run_distributed(_one_rank_fails_body, 2, timeout_s=60)
