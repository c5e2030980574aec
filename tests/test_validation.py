"""cp_rope.validation: the one validation layer, and every public API answering alike.

The cross-API test feeds the same bad ``cu_seqlens`` to the RoPE ops, the zigzag
sharding, CP attention (cp_size 1, no group) and the loss: each must raise the
same exception type, with a message naming cu_seqlens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_rope import apply_rotary_emb, apply_rotary_emb_qk, global_positions, rope_cache
from cp_rope.parallel import (
    PackedBatch,
    PackingCollator,
    context_parallel_attention,
    cp_cross_entropy,
    cp_shard_indices,
    shard_batch,
    unshard,
)
from cp_rope.validation import (
    check_bool,
    check_choice,
    check_cp_args,
    check_cu_seqlens,
    check_cu_seqlens_content,
    check_int,
    check_max_seqlen,
    content_checks_enabled,
)

T = 8


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


# -------------------------------------------------------------------- the module itself

def test_check_int():
    assert check_int("n", 3) == 3 and type(check_int("n", np.int64(3))) is int
    assert check_int("n", 0, min_value=0) == 0
    for bad in (True, np.bool_(True), 3.0, "3", torch.tensor(3), None):
        with pytest.raises(TypeError, match="n must be an int"):
            check_int("n", bad)
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        check_int("n", 0, min_value=1)


def test_check_bool_and_choice():
    assert check_bool("flag", True) is True and check_bool("flag", np.bool_(False)) is False
    for bad in (0, 1, "no", None):
        with pytest.raises(TypeError, match="flag must be a bool"):
            check_bool("flag", bad)
    assert check_choice("method", "ring", ("ring", "allgather")) == "ring"
    for bad in ("Ring", "", None, 1):
        with pytest.raises(ValueError, match="method must be one of 'ring', 'allgather'"):
            check_choice("method", bad, ("ring", "allgather"))


def test_check_cp_args():
    assert check_cp_args(np.int32(4), np.int64(3)) == (4, 3)
    assert all(type(v) is int for v in check_cp_args(np.int32(4), np.int64(3)))
    with pytest.raises(TypeError, match="cp_size must be an int"):
        check_cp_args(2.0, 0)
    with pytest.raises(TypeError, match="cp_rank must be an int"):
        check_cp_args(2, True)
    with pytest.raises(ValueError, match="cp_size must be >= 1"):
        check_cp_args(0, 0)
    with pytest.raises(ValueError, match="cp_rank must satisfy 0 <= cp_rank < cp_size=2, got 2"):
        check_cp_args(2, 2)


def test_check_max_seqlen():
    assert check_max_seqlen(None) is None and check_max_seqlen(np.int64(7)) == 7
    with pytest.raises(TypeError, match="max_seqlen must be an int"):
        check_max_seqlen(None, allow_none=False)
    with pytest.raises(TypeError, match="max_seqlen must be an int"):
        check_max_seqlen(7.0)
    with pytest.raises(ValueError, match="max_seqlen must be >= 0, got -1"):
        check_max_seqlen(-1)


def test_check_cu_seqlens():
    check_cu_seqlens(_i32([0]))
    check_cu_seqlens(_i32([0, 4, 4, 8]), device="cpu")
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
        check_cu_seqlens([0, 4])
    with pytest.raises(TypeError, match="cu_seqlens must be int32, got torch.int64"):
        check_cu_seqlens(torch.tensor([0, 4]))
    with pytest.raises(TypeError, match="cu_q must be int32"):
        check_cu_seqlens(torch.tensor([0.0, 4.0]), name="cu_q")
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D"):
        check_cu_seqlens(_i32([[0, 4]]))
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D"):
        check_cu_seqlens(_i32([]))
    with pytest.raises(ValueError, match="cu_seqlens is on meta"):
        check_cu_seqlens(_i32([0, 4]).to("meta"), device="cpu")


def test_check_cu_seqlens_content():
    check_cu_seqlens_content(_i32([0, 2, 2, 6]), n_tokens=6, cp_size=2, max_seqlen=4,
                             n_positions=8)
    cases = [
        (dict(), [1, 4], r"cu_seqlens\[0\] must be 0, got 1"),
        (dict(), [0, 4, 2], r"non-decreasing; cu_seqlens\[2\] < cu_seqlens\[1\]"),
        (dict(n_tokens=5), [0, 6], r"cu_seqlens\[-1\] = 6 exceeds the number of tokens T = 5"),
        (dict(cp_size=2), [0, 2, 5], "every local sequence length must be even.*sequence 1 has 3"),
        (dict(max_seqlen=3), [0, 2, 6], "max_seqlen = 3 is below the longest local sequence"),
        (dict(cp_size=2, n_positions=7), [0, 4], "needs positions beyond the cos/sin cache"),
    ]
    for kwargs, cu, msg in cases:
        with pytest.raises(ValueError, match=msg):
            check_cu_seqlens_content(_i32(cu), **kwargs)
    with pytest.raises(ValueError, match=r"cu_k\[0\] must be 0"):
        check_cu_seqlens_content(_i32([1, 4]), name="cu_k")


def test_content_checks_enabled(monkeypatch):
    meta = torch.empty(2, dtype=torch.int32, device="meta")
    monkeypatch.delenv("CP_ROPE_DEBUG", raising=False)
    assert content_checks_enabled(_i32([0])) and not content_checks_enabled(meta)
    for value, on in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv("CP_ROPE_DEBUG", value)
        assert content_checks_enabled(meta) is on


# -------------------------------------------------------------------- every API alike

BAD_CU = {
    "float": (torch.tensor([0.0, 4.0, 8.0]), TypeError),
    "int64": (torch.tensor([0, 4, 8]), TypeError),
    "list": ([0, 4, 8], TypeError),
    "2-D": (_i32([[0, 4, 8]]), ValueError),
    "empty": (_i32([]), ValueError),
    "decreasing": (_i32([0, 8, 4, 8]), ValueError),
    "not starting at 0": (_i32([4, 8]), ValueError),
}


def _rope(cu):
    x = torch.randn(T, 2, 8)
    cos, sin = rope_cache(64, 8)
    return apply_rotary_emb(x, cos, sin, cu)


def _rope_qk(cu):
    q, k = torch.randn(T, 2, 8), torch.randn(T, 1, 8)
    cos, sin = rope_cache(64, 8)
    return apply_rotary_emb_qk(q, k, cos, sin, cu)


def _packed(cu):
    ids = torch.arange(T)
    return PackedBatch(input_ids=ids, labels=ids, position_ids=ids, cu_seqlens=cu, max_seqlen=T,
                       seq_lens=_i32([T]))


def _attention(cu):
    q, k, v = torch.randn(T, 2, 8), torch.randn(T, 1, 8), torch.randn(T, 1, 8)
    return context_parallel_attention(q, k, v, cu, T, backend="reference")


def _loss(cu):
    return cp_cross_entropy(torch.randn(T, 5), torch.randint(0, 5, (T,)), cu_seqlens=cu)


APIS = {
    "apply_rotary_emb": _rope,
    "apply_rotary_emb_qk": _rope_qk,
    "global_positions": lambda cu: global_positions(cu, 1, 0),
    "cp_shard_indices": lambda cu: cp_shard_indices(cu, 1, 0),
    "shard_batch": lambda cu: shard_batch(_packed(cu), 1, 0),
    "unshard": lambda cu: unshard(torch.zeros(T), cu),
    "context_parallel_attention": _attention,
    "cp_cross_entropy": _loss,
}


@pytest.mark.parametrize("api", list(APIS))
def test_every_api_accepts_a_good_cu_seqlens(api):
    """The control: the bad cases below fail because of cu_seqlens alone."""
    APIS[api](_i32([0, 4, 8]))


@pytest.mark.parametrize("case", list(BAD_CU))
@pytest.mark.parametrize("api", list(APIS))
def test_every_api_raises_the_same_for_a_bad_cu_seqlens(api, case):
    cu, exc = BAD_CU[case]
    with pytest.raises(exc, match="cu_seqlens") as info:
        APIS[api](cu)
    assert type(info.value) is exc, f"{api}: {type(info.value).__name__}: {info.value}"


CP_APIS = {
    "apply_rotary_emb": lambda s, r: apply_rotary_emb(torch.randn(T, 2, 8), *rope_cache(64, 8),
                                                      _i32([0, 8]), cp_size=s, cp_rank=r),
    "global_positions": lambda s, r: global_positions(_i32([0, 8]), s, r),
    "cp_shard_indices": lambda s, r: cp_shard_indices(_i32([0, 8]), s, r),
    "shard_batch": lambda s, r: shard_batch(_packed(_i32([0, 8])), s, r),
    "PackingCollator": lambda s, r: PackingCollator(cp_size=s, cp_rank=r),
}


@pytest.mark.parametrize("api", list(CP_APIS))
def test_every_api_checks_cp_size_and_rank_alike(api):
    CP_APIS[api](2, 1)
    for (size, rank), exc, msg in [((2.0, 0), TypeError, "cp_size must be an int"),
                                   ((2, True), TypeError, "cp_rank must be an int"),
                                   ((0, 0), ValueError, "cp_size must be >= 1"),
                                   ((2, 2), ValueError, "cp_rank must satisfy")]:
        with pytest.raises(exc, match=msg):
            CP_APIS[api](size, rank)


MAX_SEQLEN_APIS = {
    "apply_rotary_emb": lambda m: apply_rotary_emb(torch.randn(T, 2, 8), *rope_cache(64, 8),
                                                   _i32([0, 8]), max_seqlen=m),
    "context_parallel_attention": lambda m: context_parallel_attention(
        torch.randn(T, 2, 8), torch.randn(T, 1, 8), torch.randn(T, 1, 8), _i32([0, 8]), m),
}


@pytest.mark.parametrize("api", list(MAX_SEQLEN_APIS))
def test_every_api_checks_max_seqlen_alike(api):
    MAX_SEQLEN_APIS[api](np.int64(8))
    for bad, exc in ((8.0, TypeError), (True, TypeError), (torch.tensor(8), TypeError),
                     (-1, ValueError)):
        with pytest.raises(exc, match="max_seqlen"):
            MAX_SEQLEN_APIS[api](bad)
