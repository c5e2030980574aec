"""One door (issue 30 item 3): ``context_parallel_attention`` without ``plan=`` builds its plan by
``attention_plan`` (so it takes what the builder takes, ``method="auto"`` included);
``per_document_attention`` is a deprecated alias; a plan of another batch, handed to the door
or to a model, is a clear error naming ``plan``."""

from __future__ import annotations

import pytest
import torch
from utils import assert_close

from cp_rope.parallel import (
    CPAttentionPlan,
    PackingCollator,
    attention_plan,
    context_parallel_attention,
    per_document_attention,
    place_documents,
)

KW = dict(q_heads=4, kv_heads=2, head_dim=8, dtype=torch.float64)


def _qkv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, h, 8, dtype=torch.float64, generator=g) for h in (4, 2, 2))


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def test_the_door_builds_by_attention_plan_with_method_auto():
    cu = _cu([9, 30, 1])
    q, k, v = _qkv(40)
    want = context_parallel_attention(q, k, v, cu, 30, backend="reference")
    calls = []
    import cp_rope.parallel.attention as A
    real = A.attention_plan

    def spy(*a, **kw):
        calls.append(kw["method"])
        return real(*a, **kw)

    A.attention_plan = spy
    try:
        got = context_parallel_attention(q, k, v, cu, 30, backend="reference", method="auto")
        placed = place_documents(cu, 1, 16)
        doc = context_parallel_attention(q, k, v, placement=placed, backend="reference",
                                         method="auto")
    finally:
        A.attention_plan = real
    assert calls == ["auto", "auto"]
    assert_close(got, want, dtype=torch.float64, name="auto vs ring, zigzag")
    ring = context_parallel_attention(q, k, v, placement=placed, backend="reference")
    assert_close(doc, ring, dtype=torch.float64, name="auto vs ring, per-document placement")


def test_per_document_attention_is_a_deprecated_alias():
    cu = _cu([6, 20, 14])
    q, k, v = _qkv(40, seed=1)
    placed = place_documents(cu, 1, 16)
    want = context_parallel_attention(q, k, v, placement=placed, backend="reference")
    with pytest.deprecated_call(match="per_document_attention is deprecated"):
        got = per_document_attention(q, k, v, placement=placed, backend="reference")
    assert_close(got, want, dtype=torch.float64, name="alias, placement")
    plan = attention_plan(placed, **KW, backend="reference")
    with pytest.deprecated_call():
        again = per_document_attention(q, k, v, plan=plan)
    assert_close(again, want, dtype=torch.float64, name="alias, plan")
    with pytest.deprecated_call(), pytest.raises(ValueError, match="placement: pass the batch"):
        per_document_attention(q, k, v)


def test_a_plan_of_another_batch_names_plan():
    from cp_rope.launch.config import ModelConfig
    from cp_rope.launch.model import Transformer

    q, k, v = _qkv(40)
    cu, other = _cu([10, 30]), _cu([20, 20])
    plan = attention_plan(cu, 30, **KW)
    # the door: another batch's rows, cu_seqlens, placement
    with pytest.raises(ValueError, match=r"plan: built for q \[T=40"):
        context_parallel_attention(q[:30], k[:30], v[:30], plan=plan)
    with pytest.raises(ValueError, match=r"plan: cu_seqlens is not the plan's"):
        context_parallel_attention(q, k, v, other, 20, plan=plan)
    doc = attention_plan(place_documents(other, 1, 16), **KW)
    with pytest.raises(ValueError, match=r"plan: built for another placement"):
        context_parallel_attention(q, k, v, placement=place_documents(cu, 1, 16), plan=doc)
    # a model: another batch's rows, cu_seqlens (host), another rank's plan
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                    ffn_hidden_dim=48, vocab_size=50, max_seq_len=64))
    batch = PackingCollator(cp_size=1)([{"input_ids": torch.randint(0, 50, (n,))}
                                        for n in (10, 30)])
    with pytest.raises(ValueError, match=r"plan: built for a batch of 40 rows, got 30"):
        model(batch.input_ids[:30], model.attention_plan(batch))
    from cp_rope.parallel import check_plan
    with pytest.raises(ValueError, match=r"plan: built for another batch \(its cu_seqlens"):
        check_plan(model.attention_plan(batch), 40, cu_seqlens=other)
    peer = CPAttentionPlan.simulated(_cu([6, 14]), 14, cp_size=2, cp_rank=1, q_heads=4,
                                     kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu",
                                     n_tokens=40)
    with pytest.raises(ValueError, match=r"plan: built for cp_rank 1, but the model is cp_rank 0"):
        model(batch.input_ids, peer)
