"""The zigzag CP split: cp_shard_indices / shard_tensor / shard_batch / unshard.

Property tests over random document lengths (1-token documents included),
cp_size in {1, 2, 3, 4, 8} and every rank; ``unshard`` over gloo at CP sizes 2
and 4 in one spawn of 4 processes (two CP groups of 2 and the world)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from hypothesis import given
from hypothesis import strategies as st

import cp_rope
from cp_rope.parallel import (
    PackedBatch,
    PackingCollator,
    cp_shard_indices,
    shard_batch,
    shard_tensor,
    unshard,
)
from cp_rope.parallel.sharding import local_cu_seqlens

CP_SIZES = [1, 2, 3, 4, 8]

doc_lengths = st.lists(st.integers(0, 40) | st.just(1), min_size=0, max_size=12)


def global_cu(lengths, cp_size):
    """Global cu_seqlens of documents padded to multiples of 2 * cp_size (int32)."""
    m = 2 * cp_size
    padded = [-(-n // m) * m for n in lengths]
    return torch.tensor(np.concatenate([[0], np.cumsum(padded, dtype=np.int64)]), dtype=torch.int32)


@given(lengths=doc_lengths, cp_size=st.sampled_from(CP_SIZES))
def test_shards_partition_rows_and_follow_the_cp_formula(lengths, cp_size):
    cu = global_cu(lengths, cp_size)
    total = int(cu[-1])
    local_cu = local_cu_seqlens(cu, cp_size)
    assert torch.equal(local_cu, cu // cp_size) and local_cu.dtype == torch.int32
    all_idx = []
    work = []
    for r in range(cp_size):
        idx = cp_shard_indices(cu, cp_size, r)
        assert idx.dtype == torch.int64 and idx.numel() == total // cp_size
        all_idx.append(idx)
        pos = cp_rope.global_positions(local_cu, cp_size, r)
        # Local row -> global row: same sequence, global position = CP formula.
        seq_of_global = torch.searchsorted(cu.long(), idx, right=True) - 1
        seq_of_local = torch.repeat_interleave(
            torch.arange(len(lengths)), torch.diff(local_cu.long()), output_size=idx.numel())
        assert torch.equal(seq_of_global, seq_of_local)
        assert torch.equal(idx - cu.long()[seq_of_global], pos)
        # Causal attention work on this rank: a query at global position p sees p + 1 keys.
        work.append(int((pos + 1).sum()))
    assert torch.equal(torch.sort(torch.cat(all_idx)).values, torch.arange(total)), \
        "the shards of all ranks together are a permutation of the global rows"
    assert len(set(work)) == 1, f"causal work differs across ranks: {work}"


@given(lengths=doc_lengths, cp_size=st.sampled_from(CP_SIZES), data=st.data())
def test_shard_tensor_any_dim_and_local_inverse(lengths, cp_size, data):
    cu = global_cu(lengths, cp_size)
    total = int(cu[-1])
    x = torch.randn(3, total + 5, 2, dtype=torch.float64)  # 5 trailing rows beyond cu[-1]
    rebuilt = torch.full_like(x[:, :total], float("nan"))
    for r in range(cp_size):
        local = shard_tensor(x, cu, cp_size, r, dim=1)
        assert local.shape == (3, total // cp_size, 2)
        rebuilt[:, cp_shard_indices(cu, cp_size, r)] = local
    assert torch.equal(rebuilt, x[:, :total])
    r = data.draw(st.integers(0, cp_size - 1))
    assert torch.equal(shard_tensor(x[0], cu, cp_size, r), x[0][cp_shard_indices(cu, cp_size, r)])


@given(lengths=doc_lengths, cp_size=st.sampled_from(CP_SIZES))
def test_shard_batch_every_rank(lengths, cp_size):
    rng = np.random.default_rng(sum(lengths) + cp_size)
    docs = [rng.integers(1, 1000, size=n) for n in lengths]
    g = PackingCollator(cp_size=cp_size, pad_to_multiple=4 * cp_size)(docs)
    gl = g.labels.clone()
    seen_labels = torch.full_like(g.labels, 12345)
    for r in range(cp_size):
        s = shard_batch(g, cp_size, r)
        idx = cp_shard_indices(g.cu_seqlens, cp_size, r)
        assert torch.equal(s.cu_seqlens, g.cu_seqlens // cp_size)
        assert s.cu_seqlens.dtype == torch.int32 and int(s.cu_seqlens[-1]) == s.num_tokens
        assert torch.equal(s.position_ids, cp_rope.global_positions(s.cu_seqlens, cp_size, r))
        assert torch.equal(s.input_ids, g.input_ids[idx])
        assert s.max_seqlen == int(torch.diff(s.cu_seqlens).max()) if s.num_sequences else True
        assert torch.equal(s.seq_lens, g.seq_lens)
        seen_labels[idx] = s.labels
    assert torch.equal(seen_labels, gl)
    assert torch.equal(g.labels, gl), "sharding must not modify the global batch"


def test_unshard_cp_size_1_without_process_group():
    assert not dist.is_initialized()
    x = torch.randn(10, 4)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    out = unshard(x, cu)
    assert torch.equal(out, x[:8]) and out.data_ptr() != x.data_ptr()
    with pytest.raises(ValueError, match="local: 7 rows but cu_seqlens\\[-1\\] = 8"):
        unshard(x[:7], cu)


def test_bad_cp_args_and_lengths():
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="cp_rank"):
        cp_shard_indices(cu, 2, 2)
    with pytest.raises(ValueError, match="sequence 1 has length 6, not divisible by 2 \\* cp_size = 4"):
        cp_shard_indices(cu, 2, 0)
    with pytest.raises(TypeError, match="cp_size"):
        cp_shard_indices(cu, 2.0, 0)


def _unshard_body(rank, world_size):
    """CP groups {0,1}, {2,3} (cp_size 2) and the world (cp_size 4), one spawn; then local
    lengths that differ across the ranks."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    world = dist.group.WORLD
    lengths = [1, 7, 16, 0, 3, 9, 1]
    for group, cp_size, cp_rank in ((pairs[rank // 2], 2, rank % 2), (world, 4, rank)):
        cu = global_cu(lengths, cp_size)
        gen = torch.Generator().manual_seed(1234 + cp_size)  # same global tensor on every rank
        x = torch.randn(int(cu[-1]), 3, 5, generator=gen, dtype=torch.float64)
        local = shard_tensor(x, cu, cp_size, cp_rank)
        local_cu = cu // cp_size
        padded_local = torch.cat([local, torch.full_like(local[:3], float("nan"))])  # trailing rows
        out = unshard(padded_local, local_cu, group)
        assert torch.equal(out, x), f"rank {rank} cp_size {cp_size}: unshard(shard(x)) != x"
        # A whole PackedBatch shard's labels gather back to the global labels.
        docs = [torch.randint(0, 100, (n,), generator=gen) for n in lengths]
        g = PackingCollator(cp_size=cp_size)(docs)
        s = PackingCollator(cp_size=cp_size, cp_rank=cp_rank)(docs)
        assert torch.equal(unshard(s.labels, s.cu_seqlens, group), g.labels)
        assert torch.equal(unshard(s.position_ids, s.cu_seqlens, group), g.position_ids)
    # different local lengths across the ranks (8, 12, 16, 20 rows): a ValueError naming the
    # ranks' cu_seqlens on every rank (issue 15: a raw gloo error), and the group still works
    n = 8 + 4 * rank
    with pytest.raises(ValueError, match=r"cu_seqlens.*rank"):
        unshard(torch.randn(n, 2), torch.tensor([0, n], dtype=torch.int32))
    dist.barrier()


def test_unshard_distributed_cp2_and_cp4():
    run_distributed(_unshard_body, 4, timeout_s=60)


def test_bad_cu_seqlens_type_and_dtype():
    """Float or list cu_seqlens were silently truncated (or failed with an AttributeError)."""
    for fn in (lambda cu: cp_shard_indices(cu, 2, 0), lambda cu: local_cu_seqlens(cu, 2),
               lambda cu: shard_tensor(torch.arange(8), cu, 2, 0)):
        with pytest.raises(TypeError, match="cu_seqlens must be int32"):
            fn(torch.tensor([0.0, 4.0, 8.0]))
        with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
            fn([0, 4, 8])
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D"):
        local_cu_seqlens(torch.tensor([[0, 4]], dtype=torch.int32), 2)


def test_bad_shard_tensor_rows():
    """Too few rows returned a wrong shard on some ranks and an IndexError on others."""
    cu = torch.tensor([0, 8], dtype=torch.int32)
    for rank in range(2):
        with pytest.raises(ValueError, match="x: 6 rows along dim 0 but cu_seqlens\\[-1\\] = 8"):
            shard_tensor(torch.arange(6), cu, 2, rank)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        shard_tensor([1, 2], cu, 2, 0)
    for dim in (1, -2, True, 0.0):  # round 4 #22: dim=1 of a 1-D x was an IndexError
        with pytest.raises(ValueError, match=rf"dim={dim!r}: not a dimension of x \(shape \(8,\)\)"):
            shard_tensor(torch.arange(8), cu, 2, 0, dim=dim)
    with pytest.raises(TypeError, match="local must be a torch.Tensor"):
        unshard([1, 2], torch.tensor([0, 2]))
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
        unshard(torch.arange(2), [0, 2])


def test_bad_shard_batch_argument_type():
    with pytest.raises(TypeError, match="batch must be a PackedBatch"):
        shard_batch({"input_ids": torch.arange(4)}, 2, 0)


# ------------------------------------------------------------------ bad input (the issue-15 catalogue)

def test_unshard_float_cu_seqlens():
    with pytest.raises(TypeError, match=r"cu_seqlens"):
        unshard(torch.randn(8, 2), torch.tensor([0.0, 4.0, 8.0]))


def test_unshard_decreasing_cu_seqlens():
    with pytest.raises(ValueError, match=r"cu_seqlens.*(decreas|non-decreasing)"):
        unshard(torch.randn(8, 2), torch.tensor([0, 6, 4, 8], dtype=torch.int32))


def _global_batch(lengths=(8, 12), max_seqlen=None):
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    t = int(cu[-1])
    return PackedBatch(input_ids=torch.randint(0, 100, (t,)), labels=torch.randint(0, 100, (t,)),
                       position_ids=torch.cat([torch.arange(n) for n in lengths]), cu_seqlens=cu,
                       max_seqlen=max(lengths) if max_seqlen is None else max_seqlen,
                       seq_lens=torch.tensor(lengths, dtype=torch.int32))


def test_shard_batch_wrong_max_seqlen():
    with pytest.raises(ValueError, match=r"max_seqlen"):
        shard_batch(_global_batch(max_seqlen=4), 2, 0)


def test_shard_batch_labels_shorter():
    batch = _global_batch()
    batch.labels = batch.labels[:-3]
    with pytest.raises(ValueError, match=r"labels"):
        shard_batch(batch, 2, 0)
