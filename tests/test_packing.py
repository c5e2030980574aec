"""Packing: PackingCollator against a plain per-document reference, the token-budget
sampler's guarantees, the streaming packer, DataLoader integration, bad input."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import cp_rope
from cp_rope.parallel import (
    PackedBatch,
    PackedIterableDataset,
    PackingCollator,
    SpanDataset,
    TokenBudgetBatchSampler,
    cp_shard_indices,
    pack_iterable,
    shard_batch,
)

CP_SIZES = [1, 2, 3, 4, 8]
IGNORE = -100


def reference_pack(docs, labels=None, *, cp_size=1, pad_id=0, ignore_index=IGNORE,
                   max_seqlen=None, pad_to_multiple=None):
    """Per-document Python loop: the obvious definition the collator must match."""
    m = 2 * cp_size
    ids, labs, pos, cu, seq_lens = [], [], [], [0], []
    for k, doc in enumerate(docs):
        doc = [int(t) for t in doc]
        src = doc if labels is None or labels[k] is None else [int(t) for t in labels[k]]
        target = src[1:] + [ignore_index]
        step = max_seqlen or max(len(doc), 1)
        for s in range(0, len(doc), step):
            piece, tgt = doc[s:s + step], target[s:s + step]
            n = len(piece)
            padded = -(-n // m) * m
            ids += piece + [pad_id] * (padded - n)
            labs += tgt + [ignore_index] * (padded - n)
            pos += list(range(padded))
            cu.append(cu[-1] + padded)
            seq_lens.append(n)
    if pad_to_multiple and (cu[-1] % pad_to_multiple or not cu[-1]):
        extra = pad_to_multiple - cu[-1] % pad_to_multiple
        while extra:
            n = min(extra, max_seqlen or extra)
            ids += [pad_id] * n
            labs += [ignore_index] * n
            pos += list(range(n))
            cu.append(cu[-1] + n)
            seq_lens.append(0)
            extra -= n
    return ids, labs, pos, cu, seq_lens


def as_kind(doc, kind):
    return {"list": list, "tuple": tuple, "tensor": lambda d: torch.tensor(d, dtype=torch.int64),
            "numpy": lambda d: np.asarray(d, dtype=np.int32)}[kind](doc)


docs_st = st.lists(st.lists(st.integers(0, 999), min_size=0, max_size=40), min_size=0, max_size=10)


def random_docs(rng: np.random.Generator, n_docs: int, max_len: int) -> list[list[int]]:
    return [rng.integers(0, 1000, size=int(rng.integers(1, max_len + 1))).tolist()
            for _ in range(n_docs)]


# --------------------------------------------------------------------------------------
# Collator
# --------------------------------------------------------------------------------------


@given(docs=docs_st, cp_size=st.sampled_from(CP_SIZES), kind=st.sampled_from(
    ["list", "tuple", "tensor", "numpy"]), with_labels=st.booleans(),
    max_seqlen_chunks=st.sampled_from([None, 1, 3]), pad_chunks=st.sampled_from([None, 1, 5]),
    pad_id=st.integers(0, 5), ignore_index=st.sampled_from([IGNORE, -1]))
def test_collator_matches_reference(docs, cp_size, kind, with_labels, max_seqlen_chunks,
                                    pad_chunks, pad_id, ignore_index):
    m = 2 * cp_size
    max_seqlen = None if max_seqlen_chunks is None else max_seqlen_chunks * m
    pad_to = None if pad_chunks is None else pad_chunks * m
    rng = np.random.default_rng(len(docs))
    labels = [rng.choice([ignore_index, *range(50)], size=len(d)).tolist() if with_labels and k % 2 == 0
              else None for k, d in enumerate(docs)]
    examples = [{"input_ids": as_kind(d, kind)} | ({} if lab is None else {"labels": lab})
                for d, lab in zip(docs, labels, strict=True)]
    collate = PackingCollator(cp_size=cp_size, pad_id=pad_id, ignore_index=ignore_index,
                              pad_to_multiple=pad_to, max_seqlen=max_seqlen)
    b = collate(examples)
    ids, labs, pos, cu, seq_lens = reference_pack(docs, labels, cp_size=cp_size, pad_id=pad_id,
                                                  ignore_index=ignore_index, max_seqlen=max_seqlen,
                                                  pad_to_multiple=pad_to)
    assert b.input_ids.tolist() == ids
    assert b.labels.tolist() == labs
    assert b.position_ids.tolist() == pos
    assert b.cu_seqlens.tolist() == cu and b.cu_seqlens.dtype == torch.int32
    assert b.seq_lens.tolist() == seq_lens and b.seq_lens.dtype == torch.int32
    for t in (b.input_ids, b.labels, b.position_ids):
        assert t.dtype == torch.int64
    lens = np.diff(cu)
    assert b.max_seqlen == (int(lens.max()) if lens.size else 0)
    assert isinstance(b.max_seqlen, int)
    assert int(b.cu_seqlens[-1]) == b.num_tokens
    assert all(n % m == 0 for n in lens)
    if pad_to:
        assert b.num_tokens % pad_to == 0
    if max_seqlen:
        assert b.max_seqlen <= max_seqlen
    assert b.num_empty_dropped == sum(len(d) == 0 for d in docs)
    assert torch.equal(b.position_ids, cp_rope.global_positions(b.cu_seqlens))


@given(docs=docs_st, cp_size=st.sampled_from(CP_SIZES))
def test_labels_are_next_token_of_same_document(docs, cp_size):
    """Checked from the batch alone: every non-ignored label is the next token of the
    same document; padding rows never carry a label."""
    b = PackingCollator(cp_size=cp_size, pad_to_multiple=4 * cp_size)(
        [{"input_ids": d} for d in docs])
    seq = torch.repeat_interleave(torch.arange(b.num_sequences), torch.diff(b.cu_seqlens.long()))
    is_pad = b.position_ids >= b.seq_lens.long()[seq]
    assert bool((b.labels[is_pad] == IGNORE).all())
    assert bool((b.input_ids[is_pad] == 0).all())
    labelled = torch.nonzero(b.labels != IGNORE).flatten()
    assert bool((labelled + 1 < b.num_tokens).all())
    assert torch.equal(b.labels[labelled], b.input_ids[labelled + 1])
    assert torch.equal(seq[labelled], seq[labelled + 1])  # same sequence, no padding between
    # Every real token but each document's last is labelled.
    assert labelled.numel() == sum(max(len(d) - 1, 0) for d in docs)


@given(docs=docs_st, cp_size=st.sampled_from(CP_SIZES), data=st.data())
def test_collator_cp_rank_returns_shard_of_global_batch(docs, cp_size, data):
    cp_rank = data.draw(st.integers(0, cp_size - 1))
    kw = data.draw(st.sampled_from([{}, dict(pad_to_multiple=6 * cp_size),
                                    dict(pad_to_multiple=8 * cp_size, max_seqlen=4 * cp_size)]))
    examples = [{"input_ids": d} for d in docs]
    global_batch = PackingCollator(cp_size=cp_size, **kw)(examples)
    local = PackingCollator(cp_size=cp_size, cp_rank=cp_rank, **kw)(examples)
    via_shard_batch = shard_batch(global_batch, cp_size, cp_rank)
    for name in PackedBatch._TENSORS:
        assert torch.equal(getattr(local, name), getattr(via_shard_batch, name)), name
    assert local.max_seqlen == via_shard_batch.max_seqlen
    idx = cp_shard_indices(global_batch.cu_seqlens, cp_size, cp_rank)
    assert (local.cp_size, local.cp_rank) == (cp_size, cp_rank)
    assert torch.equal(local.input_ids, global_batch.input_ids[idx])
    assert torch.equal(local.labels, global_batch.labels[idx])  # labels from the global batch
    assert torch.equal(local.cu_seqlens, global_batch.cu_seqlens // cp_size)
    assert local.cu_seqlens.dtype == torch.int32
    assert torch.equal(local.position_ids,
                       cp_rope.global_positions(local.cu_seqlens, cp_size, cp_rank))
    assert local.max_seqlen == global_batch.max_seqlen // cp_size
    assert torch.equal(local.seq_lens, global_batch.seq_lens)
    assert torch.equal(local.global_cu_seqlens, global_batch.cu_seqlens)


def test_long_document_pieces_keep_document_labels():
    doc = list(range(10, 27))  # 17 tokens
    b = PackingCollator(max_seqlen=8)([{"input_ids": doc}])
    assert b.cu_seqlens.tolist() == [0, 8, 16, 18]
    assert b.seq_lens.tolist() == [8, 8, 1]
    assert b.position_ids.tolist() == [*range(8), *range(8), 0, 1]
    # A piece's last token is labelled with the document's next token.
    assert b.labels[7].item() == 18 and b.labels[15].item() == 26
    assert b.labels[16].item() == IGNORE


def test_empty_documents_dropped_and_counted():
    collate = PackingCollator(cp_size=2)
    b = collate([{"input_ids": []}, {"input_ids": [5, 6]}, {"input_ids": np.array([], np.int64)}])
    assert b.num_empty_dropped == 2 and collate.num_empty_dropped == 2
    assert b.seq_lens.tolist() == [2]
    b = collate([{"input_ids": []}])
    assert b.num_tokens == 0 and b.cu_seqlens.tolist() == [0] and b.max_seqlen == 0
    assert collate.num_empty_dropped == 3
    b = PackingCollator(cp_size=2, pad_to_multiple=8)([])
    assert b.cu_seqlens.tolist() == [0, 8] and b.seq_lens.tolist() == [0]
    assert bool((b.labels == IGNORE).all())


def test_max_tokens_exceeded_raises():
    collate = PackingCollator(cp_size=2, max_tokens=8)
    assert collate([[1, 2, 3], [4]]).num_tokens == 8
    with pytest.raises(ValueError, match="max_tokens=8"):
        collate([[1, 2, 3], [4], [5]])


def test_span_dataset_spans():
    doc = torch.arange(100, 120)
    ds = SpanDataset([{"input_ids": doc, "labels": doc + 1000}])
    assert ds[0]["input_ids"] is doc
    b = PackingCollator()([ds[(0, 4, 9)], ds[(0, 16, 20)]])
    assert b.input_ids.tolist() == [104, 105, 106, 107, 108, 0, 116, 117, 118, 119]
    # user labels are shifted: the span's last token gets the document's next label
    assert b.labels.tolist() == [1105, 1106, 1107, 1108, 1109, IGNORE, 1117, 1118, 1119, IGNORE]
    assert b.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert b.seq_lens.tolist() == [5, 4]
    # An example with its own span is a document of that span; offsets are relative to it.
    inner = SpanDataset([{"input_ids": doc, "span": (10, 18)}])
    b = PackingCollator()([inner[(0, 2, 8)]])
    assert b.input_ids.tolist() == [112, 113, 114, 115, 116, 117]
    assert b.labels.tolist() == [113, 114, 115, 116, 117, 118]


def test_packed_batch_pickle_and_to():
    b = PackingCollator(cp_size=2, cp_rank=1)([[1, 2, 3, 4, 5]])
    c = pickle.loads(pickle.dumps(b))
    for name in PackedBatch._TENSORS:
        assert torch.equal(getattr(b, name), getattr(c, name))
    assert (c.max_seqlen, c.cp_size, c.cp_rank) == (b.max_seqlen, 2, 1)
    d = b.to("cpu", non_blocking=False)
    assert torch.equal(d.input_ids, b.input_ids) and d.cu_seqlens.dtype == torch.int32
    assert callable(b.pin_memory)
    pickle.dumps(PackingCollator(cp_size=4, cp_rank=3, max_seqlen=64))


@pytest.mark.gpu
def test_packed_batch_pin_memory_and_to_cuda():
    b = PackingCollator(cp_size=2, cp_rank=0)([[1, 2, 3, 4, 5], [6]]).pin_memory()
    assert all(getattr(b, n).is_pinned() for n in PackedBatch._TENSORS)
    g = b.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert g.input_ids.is_cuda and torch.equal(g.labels.cpu(), b.labels)


# --------------------------------------------------------------------------------------
# Token-budget sampler
# --------------------------------------------------------------------------------------

lengths_st = st.lists(st.integers(0, 60), min_size=0, max_size=60)


def sampler_batches(lengths, max_tokens, **kw):
    dp_size = kw.pop("dp_size", 1)
    return [list(TokenBudgetBatchSampler(lengths, max_tokens, dp_size=dp_size, dp_rank=r, **kw))
            for r in range(dp_size)]


@given(lengths=lengths_st, cp_size=st.sampled_from(CP_SIZES), budget_chunks=st.integers(1, 12),
       dp_size=st.integers(1, 4), window=st.integers(1, 20), shuffle=st.booleans(),
       seed=st.integers(0, 3), epoch=st.integers(0, 2))
def test_sampler_budget_coverage_and_equal_batch_counts(lengths, cp_size, budget_chunks, dp_size,
                                                        window, shuffle, seed, epoch):
    m = 2 * cp_size
    max_tokens = budget_chunks * m + (cp_size - 1)  # not a multiple of 2C on purpose
    kw = dict(cp_size=cp_size, window=window, shuffle=shuffle, seed=seed, dp_size=dp_size)
    samplers = [TokenBudgetBatchSampler(lengths, max_tokens, dp_rank=r, **kw)
                for r in range(dp_size)]
    for s in samplers:
        s.set_epoch(epoch)
    per_rank = [list(s) for s in samplers]
    assert len({len(b) for b in per_rank}) == 1, "every DP rank gets the same number of batches"
    assert all(len(s) == len(per_rank[0]) for s in samplers)
    covered = [np.zeros(n, np.int64) for n in lengths]
    n_items = 0
    for batches in per_rank:
        for batch in batches:
            assert sum(-(-(e - s) // m) * m for _, s, e in batch) <= max_tokens
            for i, s, e in batch:
                covered[i][s:e] += 1
                n_items += 1
    assert all(bool((c == 1).all()) for c in covered), "every token exactly once per epoch"
    assert n_items >= sum(1 for n in lengths if n == 0)
    # deterministic for (seed, epoch)
    again = TokenBudgetBatchSampler(lengths, max_tokens, dp_rank=0, **kw)
    again.set_epoch(epoch)
    assert list(again) == per_rank[0]
    real = sum(lengths)
    assert samplers[0].efficiency == pytest.approx(
        real / max(1, dp_size * len(per_rank[0]) * max_tokens))


@given(lengths=st.lists(st.integers(1, 50), min_size=1, max_size=60), dp_size=st.integers(1, 3),
       data=st.data())
def test_sampler_resumes_exactly_mid_epoch(lengths, dp_size, data):
    kw = dict(cp_size=2, window=8, seed=7, dp_size=dp_size, dp_rank=dp_size - 1)
    s = TokenBudgetBatchSampler(lengths, 40, **kw)
    s.set_epoch(1)
    full = list(s)
    stop = data.draw(st.integers(0, len(full)))
    s.set_epoch(1)
    it = iter(s)
    head = [next(it) for _ in range(stop)]
    state = pickle.loads(pickle.dumps(s.state_dict()))
    assert state["epoch"] == 1 and state["batches_consumed"] == stop
    fresh = TokenBudgetBatchSampler(lengths, 40, **kw)
    fresh.load_state_dict(state)
    fresh.set_epoch(1)  # a training loop's set_epoch of the same epoch keeps the position
    assert head + list(fresh) == full
    assert list(fresh) == full  # the next pass starts the epoch afresh
    fresh.set_epoch(2)
    assert len(list(fresh)) == len(fresh)


class _Keys(torch.utils.data.Dataset):
    """``ds[key] == key``: what a DataLoader fetches is the sampler's own output."""

    def __getitem__(self, key):
        return key


def _spans(batch):
    return batch


def test_sampler_resume_survives_repeated_iter_and_worker_dataloader():
    """torch's multi-process DataLoader calls ``iter(batch_sampler)`` twice per
    ``iter(loader)`` (``__init__`` and ``_reset``): every ``iter()`` after a load must
    start at the loaded position until the epoch is finished or changed."""
    kw = dict(cp_size=2, window=8, seed=5)
    lengths = np.random.default_rng(1).integers(1, 50, size=80)
    s = TokenBudgetBatchSampler(lengths, 40, **kw)
    s.set_epoch(3)
    full = list(s)
    stop = len(full) // 2
    fresh = TokenBudgetBatchSampler(lengths, 40, **kw)
    fresh.load_state_dict({**s.state_dict(), "batches_consumed": stop})
    fresh.set_epoch(3)
    first, second = iter(fresh), iter(fresh)  # two iter() calls after a load agree
    assert list(second) == full[stop:]
    assert list(first) == full[stop:]
    fresh.load_state_dict({**s.state_dict(), "batches_consumed": stop})
    loader = DataLoader(_Keys(), batch_sampler=fresh, collate_fn=_spans, num_workers=2)
    got = list(loader)
    assert got == full[stop:]
    assert fresh.state_dict(batches_consumed=len(got) + stop)["batches_consumed"] == len(full)
    assert list(loader) == full  # the finished epoch starts afresh


def test_sampler_epochs_differ_and_order_is_seeded():
    lengths = list(range(1, 200))
    s = TokenBudgetBatchSampler(lengths, 256, seed=1)
    e0 = list(s)
    s.set_epoch(1)
    assert list(s) != e0
    assert list(TokenBudgetBatchSampler(lengths, 256, seed=2)) != e0


def test_sampler_efficiency_is_high_with_a_window():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2000, size=2000)
    s = TokenBudgetBatchSampler(lengths, 8192, cp_size=2, window=512)
    assert 0.9 < s.efficiency <= 1.0


def test_sampler_splits_long_document_and_drop_last():
    s = TokenBudgetBatchSampler([25], 8, cp_size=2, shuffle=False)
    assert [b for b in s] == [[(0, 0, 8)], [(0, 8, 16)], [(0, 16, 24)], [(0, 24, 25)]]
    s = TokenBudgetBatchSampler([4] * 5, 4, shuffle=False, dp_size=2, drop_last=True)
    assert len(s) == 2
    s = TokenBudgetBatchSampler([1], 4, shuffle=False, dp_size=2, dp_rank=1)
    assert list(s) == [[]]  # fewer items than ranks: an empty batch keeps the ranks in step


def test_sampler_state_from_other_settings_rejected():
    state = TokenBudgetBatchSampler([3, 4], 8).state_dict()
    with pytest.raises(ValueError, match="state"):
        TokenBudgetBatchSampler([3, 5], 8).load_state_dict(state)


# --------------------------------------------------------------------------------------
# Streaming
# --------------------------------------------------------------------------------------


@given(lengths=lengths_st, cp_size=st.sampled_from(CP_SIZES), budget_chunks=st.integers(1, 8),
       buffer_size=st.integers(1, 16))
def test_pack_iterable_budget_and_coverage(lengths, cp_size, budget_chunks, buffer_size):
    m = 2 * cp_size
    max_tokens = budget_chunks * m
    docs = [list(range(k * 1000, k * 1000 + n)) for k, n in enumerate(lengths)]
    collate = PackingCollator(cp_size=cp_size, max_tokens=max_tokens)
    seen = []
    for group in pack_iterable(iter(docs), max_tokens, cp_size=cp_size, buffer_size=buffer_size):
        b = collate(group)  # raises if over budget
        assert b.num_tokens <= max_tokens
        seen += b.input_ids[b.labels != IGNORE].tolist()
        # labels still follow the document across span boundaries
        lab = b.labels[b.labels != IGNORE]
        assert bool((lab == b.input_ids[b.labels != IGNORE] + 1).all())
    expected = [t for d in docs for t in d[:-1]]
    assert sorted(seen) == sorted(expected)


# --------------------------------------------------------------------------------------
# DataLoader integration (worker processes)
# --------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator")
def test_dataloader_workers_pin_memory_end_to_end():
    rng = np.random.default_rng(0)
    docs = random_docs(rng, 60, 50)
    dataset = [{"input_ids": torch.tensor(d)} for d in docs]
    sampler = TokenBudgetBatchSampler([len(d) for d in docs], 96, cp_size=2, window=16,
                                      dp_size=2, dp_rank=1, seed=3)
    collate = PackingCollator(cp_size=2, cp_rank=1, max_tokens=96)
    loader = DataLoader(SpanDataset(dataset), batch_sampler=sampler, collate_fn=collate,
                        num_workers=2, pin_memory=True, persistent_workers=False)
    got = list(loader)
    assert len(got) == len(sampler) > 0
    expected = [collate([SpanDataset(dataset)[k] for k in batch]) for batch in sampler]
    for g, e in zip(got, expected, strict=True):
        assert isinstance(g, PackedBatch)
        for name in PackedBatch._TENSORS:
            assert torch.equal(getattr(g, name), getattr(e, name)), name
        assert g.max_seqlen == e.max_seqlen

    # Streaming dataset, also through two workers: every labelled token seen once.
    stream = PackedIterableDataset(dataset, PackingCollator(cp_size=2), 96, buffer_size=8)
    batches = list(DataLoader(stream, batch_size=None, num_workers=2))
    seen = sorted(t for b in batches for t in b.input_ids[b.labels != IGNORE].tolist())
    assert seen == sorted(t for d in docs for t in d[:-1])
    assert all(b.num_tokens <= 96 for b in batches)


# --------------------------------------------------------------------------------------
# Bad input: one test each, the message names the field
# --------------------------------------------------------------------------------------


def test_bad_2d_ids():
    with pytest.raises(ValueError, match="input_ids of example 1 must be 1-D"):
        PackingCollator()([[1, 2], {"input_ids": torch.ones(2, 3, dtype=torch.int64)}])


@pytest.mark.parametrize("ids", [[1.0, 2.0], torch.tensor([1.0, 2.0]), np.array([0.5]),
                                 [True, False]])
def test_bad_float_ids(ids):
    with pytest.raises(TypeError, match="input_ids of example 0 must hold integers"):
        PackingCollator()([{"input_ids": ids}])


def test_bad_negative_ids():
    with pytest.raises(ValueError, match="input_ids of example 1 holds negative value -3 at index 2"):
        PackingCollator()([[1, 2], [4, 5, -3]])


def test_bad_ids_beyond_vocab_size():
    with pytest.raises(ValueError, match="input_ids of example 0 holds >= vocab_size=10 value 10"):
        PackingCollator(vocab_size=10)([[1, 10]])


def test_bad_labels_beyond_vocab_size():
    with pytest.raises(ValueError, match="labels of example 0 holds >= vocab_size=10"):
        PackingCollator(vocab_size=10)([{"input_ids": [1, 2], "labels": [IGNORE, 12]}])


@pytest.mark.parametrize("cp_rank", [-1, 4])
def test_bad_cp_rank(cp_rank):
    with pytest.raises(ValueError, match="cp_rank"):
        PackingCollator(cp_size=4, cp_rank=cp_rank)


def test_bad_budget_smaller_than_2_cp_size():
    with pytest.raises(ValueError, match="max_tokens=5 is smaller than 2 \\* cp_size = 6"):
        TokenBudgetBatchSampler([3], 5, cp_size=3)
    with pytest.raises(ValueError, match="max_tokens=5 is smaller than 2 \\* cp_size = 6"):
        PackingCollator(cp_size=3, max_tokens=5)
    with pytest.raises(ValueError, match="max_tokens=5 is smaller than 2 \\* cp_size = 6"):
        list(pack_iterable([[1]], 5, cp_size=3))


def test_bad_labels_length():
    with pytest.raises(ValueError, match="labels of example 0 has length 2, input_ids has 3"):
        PackingCollator()([{"input_ids": [1, 2, 3], "labels": [2, 3]}])


def test_bad_sampler_lengths():
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        TokenBudgetBatchSampler([3, -1], 8)
    with pytest.raises(TypeError, match="lengths must hold integers"):
        TokenBudgetBatchSampler([3.5], 8)
    with pytest.raises(ValueError, match="lengths must be 1-D"):
        TokenBudgetBatchSampler([[3]], 8)
    with pytest.raises(ValueError, match="dp_rank"):
        TokenBudgetBatchSampler([3], 8, dp_size=2, dp_rank=2)


@pytest.mark.parametrize("kw, match", [
    (dict(max_seqlen=6, cp_size=2), "max_seqlen=6 must be a multiple of 2 \\* cp_size = 4"),
    (dict(pad_to_multiple=6, cp_size=2), "pad_to_multiple=6 must be a multiple"),
])
def test_bad_collator_multiples(kw, match):
    with pytest.raises(ValueError, match=match):
        PackingCollator(**kw)


def test_bad_missing_input_ids_and_span():
    with pytest.raises(ValueError, match="example 0 has no 'input_ids'"):
        PackingCollator()([{"ids": [1]}])
    with pytest.raises(ValueError, match="span of example 0"):
        PackingCollator()([{"input_ids": [1, 2], "span": (1, 3)}])


def test_bad_shard_of_a_shard():
    b = PackingCollator(cp_size=2, cp_rank=0)([[1, 2, 3]])
    with pytest.raises(ValueError, match="already a shard"):
        shard_batch(b, 2, 1)


# --------------------------------------------------------------------------------------
# Found by a new-user review (each failed before its fix)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed, exc", [(-1, ValueError), (None, TypeError), (1.5, TypeError)])
def test_bad_sampler_seed_named_at_construction(seed, exc):
    with pytest.raises(exc, match="seed"):
        TokenBudgetBatchSampler([3, 4], 8, seed=seed)


@pytest.mark.parametrize("kw", [dict(shuffle="no"), dict(drop_last=1)])
def test_bad_sampler_flags_must_be_bool(kw):
    with pytest.raises(TypeError, match=next(iter(kw))):
        TokenBudgetBatchSampler([3, 4], 8, **kw)


def test_sampler_set_epoch_checks_and_state_holds_plain_ints():
    s = TokenBudgetBatchSampler([3, 4, 5], 8)
    with pytest.raises(TypeError, match="epoch"):
        s.set_epoch("1")
    with pytest.raises(ValueError, match="epoch"):
        s.set_epoch(-1)
    s.set_epoch(np.int64(2))
    next(iter(s))
    state = s.state_dict()
    assert all(type(v) is int for v in state.values()), state


def test_sampler_state_resumes_across_numpy_int_settings():
    """A sampler built with numpy ints (max_tokens from array arithmetic, say) takes
    the state of one built with Python ints: same settings, same fingerprint."""
    a = TokenBudgetBatchSampler([3, 4, 5, 9], 8, window=4, seed=3, dp_size=2)
    b = TokenBudgetBatchSampler([3, 4, 5, 9], np.int64(8), window=np.int64(4), seed=np.int64(3),
                                dp_size=np.int64(2), dp_rank=np.int64(1))
    b.load_state_dict(a.state_dict())
    twin = TokenBudgetBatchSampler([3, 4, 5, 9], 8, window=4, seed=3, dp_size=2, dp_rank=1)
    assert list(b) == list(twin) and len(list(b)) > 0


def test_bad_span_shape_and_type():
    with pytest.raises(ValueError, match="span of example 0"):
        PackingCollator()([{"input_ids": [1, 2, 3], "span": (1,)}])
    with pytest.raises(TypeError, match="span of example 0"):
        PackingCollator()([{"input_ids": [1, 2, 3], "span": (0.5, 2)}])


def test_bad_examples_as_one_columnar_mapping():
    """A Hugging Face style columnar batch ({"input_ids": [[...], ...]}) is not a list of examples."""
    with pytest.raises(TypeError, match="examples must be a sequence of examples"):
        PackingCollator()({"input_ids": [[1, 2], [3]]})


def test_bad_uint64_ids_beyond_int64():
    with pytest.raises(ValueError, match="input_ids of example 0 holds value 9223372036854775813"):
        PackingCollator()([np.array([1, 2**63 + 5], np.uint64)])
    with pytest.raises(ValueError, match="lengths hold value 9223372036854775809"):
        TokenBudgetBatchSampler(np.array([2**63 + 1], np.uint64), 8)


def test_packed_batch_to_keeps_dtypes():
    b = PackingCollator(cp_size=2)([[1, 2, 3]])
    with pytest.raises(TypeError, match="device"):
        b.to(torch.float32)


def test_bad_packed_iterable_dataset_args_at_construction():
    with pytest.raises(ValueError, match="buffer_size"):
        PackedIterableDataset([[1]], PackingCollator(), 8, buffer_size=0)
    with pytest.raises(TypeError, match="collator"):
        PackedIterableDataset([[1]], None, 8)


def test_ignore_index_at_or_beyond_vocab_size_is_not_a_bad_label():
    b = PackingCollator(vocab_size=10, ignore_index=10)(
        [{"input_ids": [1, 2, 3, 4], "labels": [5, 10, 3, 7]}])
    assert b.labels.tolist() == [10, 3, 7, 10]
    with pytest.raises(ValueError, match="labels of example 0 holds >= vocab_size=10 value 11"):
        PackingCollator(vocab_size=10, ignore_index=10)([{"input_ids": [1, 2], "labels": [10, 11]}])


def test_bad_ignore_index_inside_the_vocabulary():
    """Round 4 #1: before, ignore_index=5 with vocab_size=10 gave labels [0, 2, 7, 5]: the
    real label 5 read as ignored and silently dropped out of the loss."""
    with pytest.raises(ValueError, match=r"ignore_index=5 is a token id of the vocabulary "
                                         r"\[0, vocab_size=10\)"):
        PackingCollator(ignore_index=5, vocab_size=10)
    with pytest.raises(ValueError, match=r"ignore_index=0 is a token of input_ids of example 1 "
                                         r"\(index 2\)"):
        PackingCollator(ignore_index=0)([[3, 4], [0, 1, 0]])
    b = PackingCollator(ignore_index=0)([[0, 1, 2]])  # a first token is no one's label
    assert b.labels.tolist() == [1, 2, 0, 0]


def test_bad_meta_tensor_examples_named():
    """Round 4 #2: before, NotImplementedError 'Cannot copy out of meta tensor'."""
    with pytest.raises(ValueError, match="input_ids of example 0 is on the meta device"):
        PackingCollator()([torch.tensor([1, 2, 3]).to("meta")])
    with pytest.raises(ValueError, match="labels of example 0 is on the meta device"):
        PackingCollator()([{"input_ids": [1, 2], "labels": torch.tensor([1, 2], device="meta")}])


def test_bad_max_tokens_not_a_multiple_of_pad_to_multiple():
    """Otherwise a batch within the budget (70 tokens) pads past it (128 > 100) at run time."""
    with pytest.raises(ValueError, match="max_tokens=100 must be a multiple of pad_to_multiple=64"):
        PackingCollator(max_tokens=100, pad_to_multiple=64)


def test_bad_sampler_state():
    s = TokenBudgetBatchSampler([3, 4, 5], 8)
    good = s.state_dict()
    with pytest.raises(TypeError, match="state must be a mapping"):
        s.load_state_dict([1, 2])
    with pytest.raises(ValueError, match="state: missing key 'batches_consumed'"):
        s.load_state_dict({k: v for k, v in good.items() if k != "batches_consumed"})
    with pytest.raises(ValueError, match="batches_consumed must be >= 0"):
        s.state_dict(batches_consumed=-1)
    with pytest.raises(TypeError, match="batches_consumed must be an int"):
        s.state_dict(batches_consumed="2")


def test_bad_packed_iterable_dataset_one_shot_source():
    """A generator would be used up by the first epoch; later epochs would silently be empty."""
    with pytest.raises(TypeError, match="source must be re-iterable"):
        PackedIterableDataset((d for d in [[1, 2], [3]]), PackingCollator(), 8)


def test_collator_pad_id_and_ignore_index_accept_numpy_ints():
    b = PackingCollator(pad_id=np.int64(7), ignore_index=np.int32(-1))([[1, 2, 3]])
    assert b.input_ids.tolist() == [1, 2, 3, 7] and b.labels.tolist() == [2, 3, -1, -1]


# ------------------------------------------------------------------ the sampler's state (the issue-15 catalogue)

def _sampler():
    return TokenBudgetBatchSampler(np.arange(1, 40) * 3, 64, cp_size=2, seed=3)


def test_sampler_batches_consumed_float():
    s = _sampler()
    state = dict(s.state_dict(), batches_consumed=1.7)
    with pytest.raises(TypeError, match=r"batches_consumed"):
        s.load_state_dict(state)


def test_sampler_failed_load_leaves_it_unchanged():
    """A refused state (epoch=-1) leaves the sampler exactly as it was (its docstring's promise)."""
    def started():  # epoch 2, one batch taken
        sampler = _sampler()
        sampler.set_epoch(2)
        it = iter(sampler)
        next(it)
        return sampler, it

    (s, it), (twin, twin_it) = started(), started()
    before = s.state_dict()
    with pytest.raises(ValueError, match=r"epoch"):
        s.load_state_dict(dict(before, epoch=-1))
    assert s.state_dict() == before
    assert list(it) == list(twin_it)  # the running epoch goes on as the twin's
    assert list(iter(s)) == list(iter(twin))
