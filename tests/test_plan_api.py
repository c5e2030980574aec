"""The per-batch plan as the one object (issue 20 items 1-2, issue 22 items 1, 4, 5, 13, 14).

* ``attention_plan`` builds zigzag and per-document plans; ``context_parallel_attention``
  is the one door; ``plan.rope_args()`` gives the batch's positions.
* Plans are read-only, and a plan whose tensors changed in place is refused.
* Ranks with different ``softmax_scale`` raise; a rank-local argument error (q shape,
  a per-document shard of another rank) reaches every rank at once, and ``plan=`` on
  one rank only ends in a clear error naming ``plan=`` on every rank within the timeout.
* The pretraining model and the transformers patch build one plan per forward: the
  collectives of a step (other than the attention's K/V exchange) do not grow with the
  number of layers.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from utils import assert_close

from cp_rope.parallel import (
    CPAttentionPlan,
    PackingCollator,
    PerDocumentPlan,
    attention_plan,
    context_parallel_attention,
    per_document_attention,
    place_documents,
)

KW = dict(q_heads=4, kv_heads=2, head_dim=8, dtype=torch.float64)


def _qkv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 4, 8, dtype=torch.float64, generator=g),
            torch.randn(n, 2, 8, dtype=torch.float64, generator=g),
            torch.randn(n, 2, 8, dtype=torch.float64, generator=g))


def _batch(lens, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    return PackingCollator(**kw)([{"input_ids": torch.randint(0, 50, (n,), generator=g)}
                                  for n in lens])


# --------------------------------------------------------------------------- one process

def test_builder_zigzag_and_per_document_one_door():
    """attention_plan from a batch / cu_seqlens / placement; the door runs each kind; the
    plan's RoPE positions are the batch's; results equal the plan-less calls."""
    batch = _batch([5, 13, 1, 8])
    q, k, v = _qkv(batch.num_tokens)
    plan = attention_plan(batch, **KW)
    assert plan.kind == "zigzag" and plan.softmax_scale == 8 ** -0.5 and plan.backend == "auto"
    rope = plan.rope_args()
    assert torch.equal(rope["position_ids"].long(), batch.position_ids)
    assert rope["cu_seqlens"] is batch.cu_seqlens and rope["max_position_id"] == 13
    want = context_parallel_attention(q, k, v, batch.cu_seqlens, batch.max_seqlen)
    assert torch.equal(context_parallel_attention(q, k, v, plan=plan), want)
    # per-document: the door dispatches on the plan's kind
    placed = place_documents(torch.tensor([0, 6, 20, 22, 30], dtype=torch.int32), 1, 8,
                             pad_to_multiple=4)
    pp = attention_plan(placed, **KW)
    assert pp.kind == "per_document" and isinstance(pp, PerDocumentPlan)
    q, k, v = _qkv(placed.n_rows, 1)
    a = context_parallel_attention(q, k, v, plan=pp)
    assert torch.equal(a, context_parallel_attention(q, k, v, placement=placed))
    assert torch.equal(pp.rope_args()["position_ids"][:30].long(), placed.position_ids(0))
    # a plan of another batch / layout names plan
    with pytest.raises(ValueError, match="plan: built for"):
        context_parallel_attention(q[:-1], k[:-1], v[:-1], plan=pp)
    with pytest.raises(ValueError, match="plan: built for softmax_scale"):
        context_parallel_attention(*_qkv(batch.num_tokens), plan=plan, softmax_scale=0.5)
    with pytest.raises(ValueError, match="placement='per_document', but the batch is laid out"):
        attention_plan(batch, placement="per_document", **KW)


def test_per_document_plan_method_is_the_plans():
    """Issue 22 item 13: a plan built for allgather, called without method=, runs (it said
    the method differs)."""
    placed = place_documents(torch.tensor([0, 6, 20], dtype=torch.int32), 1, 8)
    pp = PerDocumentPlan.build(placed, device="cpu", method="allgather", **KW)
    q, k, v = _qkv(placed.n_rows)
    out = per_document_attention(q, k, v, plan=pp, backend="reference")
    assert torch.equal(out, context_parallel_attention(q, k, v, placement=placed))
    with pytest.raises(ValueError, match="plan: built for method='allgather'"):
        per_document_attention(q, k, v, plan=pp, method="ring")


def test_plans_are_read_only_and_refuse_in_place_changes():
    """Issue 22 item 5: assigning an attribute raises naming plan; a cu_seqlens changed in
    place after the build is refused (it silently ran the old schedule)."""
    cu = torch.tensor([0, 6, 16], dtype=torch.int32)
    plan = CPAttentionPlan.build(cu, 10, device="cpu", **KW)
    for name, value in (("method", "allgather"), ("max_seqlen", 16), ("cu_seqlens", cu)):
        with pytest.raises(AttributeError, match=f"plan: CPAttentionPlan.{name} is read-only"):
            setattr(plan, name, value)
    with pytest.raises(TypeError):
        plan.blocks["ring"] = ()
    q, k, v = _qkv(16)
    context_parallel_attention(q, k, v, plan=plan)
    cu[1] = 4  # the batch's tensor, edited in place
    with pytest.raises(ValueError, match="plan: its cu_seqlens .* changed in place"):
        context_parallel_attention(q, k, v, plan=plan)
    plan2 = attention_plan(cu, 12, device="cpu", **KW)
    plan2.cu_seqlens_host[2] = 14  # the plan's own host copy
    with pytest.raises(ValueError, match="changed in place"):
        context_parallel_attention(q, k, v, plan=plan2)
    placed = place_documents(torch.tensor([0, 6, 20], dtype=torch.int32), 1, 8)
    pp = attention_plan(placed, **KW)
    with pytest.raises(AttributeError, match="plan: PerDocumentPlan.split is read-only"):
        pp.split = None


def test_build_device_without_cuda_names_device():
    """Issue 22 item 14: device=99 (or an accelerator index on a CPU-only build) is a
    ValueError naming device, not a raw accelerator error."""
    cu = torch.tensor([0, 8], dtype=torch.int32)
    for device in (99, "cuda:99"):
        with pytest.raises(ValueError, match="device="):
            CPAttentionPlan.build(cu, 8, device=device, **KW)
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup"):
        attention_plan(cu, 8, group="world", **KW)


# --------------------------------------------------------------------------- multi-rank

def _agreement_body(rank, world_size):
    group = dist.group.WORLD
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    q, k, v = _qkv(16, 3)
    # item 1: ranks passing different scales raise on every rank, naming softmax_scale
    with pytest.raises(RuntimeError, match="softmax_scale") as info:
        context_parallel_attention(q, k, v, cu, 8, group=group, softmax_scale=0.5 + rank)
    assert "softmax_scale=0.5" in str(info.value) and "softmax_scale=1.5" in str(info.value)
    with pytest.raises(RuntimeError, match="softmax_scale"):
        attention_plan(cu, 8, group=group, softmax_scale=0.5 + rank, **KW)
    # item 4a: one rank's q has a bad shape: its ValueError there, the others name it, at once
    start = time.monotonic()
    bad = q[:, :, :4] if rank == 1 else q
    expected = (ValueError, "must agree in T and D") if rank == 1 else (RuntimeError, "rank 1")
    with pytest.raises(expected[0], match=expected[1]):
        context_parallel_attention(bad, k, v, cu, 8, group=group)
    # item 4b: a per-document call given another rank's shard (its cu_seqlens)
    placed = place_documents(torch.tensor([0, 6, 10, 12, 28], dtype=torch.int32), 2, 8)
    mine = placed.local_cu_seqlens(0)  # rank 0's, on both ranks
    ql, kl, vl = _qkv(placed.n_rows, 4)
    expected = (ValueError, "not rank 1's local cu_seqlens") if rank == 1 else (
        RuntimeError, "rank 1")
    with pytest.raises(expected[0], match=expected[1]):
        per_document_attention(ql, kl, vl, mine, placement=placed, group=group)
    assert time.monotonic() - start < 20  # no wait for the 60 s group timeout
    # the plan's group must agree with the call's; a per-document plan checks its shapes too
    pp = attention_plan(placed, group=group, **KW)
    with pytest.raises(ValueError, match="plan: built for"):
        context_parallel_attention(ql[:, :2], kl, vl, plan=pp)


def test_arguments_agree_across_ranks():
    run_distributed(_agreement_body, 2, timeout_s=60)


def _plan_on_one_rank_body(rank, world_size):
    group = dist.group.WORLD
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    q, k, v = _qkv(16, 5)
    plan = attention_plan(cu, 8, group=group, **KW)
    with pytest.raises(RuntimeError, match="plan=") as info:
        if rank == 0:
            context_parallel_attention(q, k, v, plan=plan)
        else:
            context_parallel_attention(q, k, v, cu, 8, group=group)
    assert "passed on some ranks only" in str(info.value), str(info.value)


def test_plan_on_one_rank_only_is_a_clear_error():
    """Item 4c: plan= on rank 0 only: both ranks raise a RuntimeError naming plan= within
    the group timeout (a raw gloo error before)."""
    start = time.monotonic()
    run_distributed(_plan_on_one_rank_body, 2, timeout_s=4)
    assert time.monotonic() - start < 60


# --------------------------------------------------------------------------- one plan per forward

_COUNTED = ("all_gather_object", "all_gather", "all_reduce", "broadcast", "barrier",
            "all_to_all_single", "reduce_scatter_tensor", "broadcast_object_list", "new_group")


class _Count:
    """Counts the collectives other than the ring's K/V exchange (batch_isend_irecv) and the
    plan builds, while active."""

    def __enter__(self):
        self.calls, self.builds, self._real = 0, 0, {}
        for name in _COUNTED:
            real = self._real[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(real))
        self._build = CPAttentionPlan.build.__func__
        real_build = self._build

        def build(cls, *a, **kw):
            self.builds += 1
            return real_build(cls, *a, **kw)

        CPAttentionPlan.build = classmethod(build)
        return self

    def _wrap(self, real):
        def counted(*a, **kw):
            self.calls += 1
            return real(*a, **kw)
        return counted

    def __exit__(self, *exc):
        for name, real in self._real.items():
            setattr(dist, name, real)
        CPAttentionPlan.build = classmethod(self._build)


def _pretrain_counts_body(rank, world_size):
    from cp_rope.launch.config import ModelConfig
    from cp_rope.launch.model import Transformer
    from cp_rope.launch.parallelize import apply_activation_checkpointing

    group = dist.group.WORLD
    batch = _batch([40, 5, 9, 3, 12], seed=2, cp_size=2, cp_rank=rank, placement="per_document",
                   split_threshold=16)
    assert batch.placement.num_split == 1
    seen = {}
    for n_layers in (2, 4):
        torch.manual_seed(0)
        cfg = ModelConfig(dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_hidden_dim=48,
                          vocab_size=50, max_seq_len=64)
        model = Transformer(cfg, cp_group=group)
        apply_activation_checkpointing(model)  # the recompute reuses the forward's plan
        with _Count() as count:
            out = model(batch.input_ids, model.attention_plan(batch))
            out.square().mean().backward()
        seen[n_layers] = (count.calls, count.builds)
    # one per-document plan per forward: the split and whole parts' builds, 2 agreements
    assert seen[2] == seen[4] == (seen[2][0], 2), seen


def test_pretrain_model_per_document_plans_once_per_forward():
    run_distributed(_pretrain_counts_body, 2, timeout_s=120)


def _llama(n_layers):
    from cp_rope.hf import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=n_layers,
                                   vocab_size=50, max_position_embeddings=128,
                                   attention_dropout=0.0, attn_implementation="eager")
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _hf_body(rank, world_size):
    import cp_rope.hf as H
    from cp_rope.parallel import unshard

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for cp, group, r in ((2, pairs[rank // 2], rank % 2), (4, dist.group.WORLD, rank)):
        batch = _batch([21, 5, 13, 8], seed=3, cp_size=cp, cp_rank=r)
        seen = {}
        for n_layers in (2, 4):
            model = H.patch_model(_llama(n_layers), group=group)
            with _Count() as count:
                model(**H.model_inputs(batch)).logits.square().mean().backward()
            seen[n_layers] = (count.calls, count.builds)
        assert seen[2] == seen[4] and seen[2][1] == 1, (cp, seen)
    # per-document placement for a transformers model (cp 2): the logits of the zigzag run
    group, r = pairs[rank // 2], rank % 2
    model = H.patch_model(_llama(2), group=group)
    got = []
    for kw in ({}, {"placement": "per_document", "split_threshold": 16}):
        batch = _batch([21, 5, 13, 8], seed=3, cp_size=2, cp_rank=r, **kw)
        with torch.no_grad():
            logits = model(**H.model_inputs(batch)).logits[0]
        got.append(unshard(logits, batch.cu_seqlens, group, placement=batch.placement))
    assert_close(got[1], got[0], dtype=torch.float32, name="per-document vs zigzag logits")
    # bad input of the patch (issue 22 item 14): group="world", another cu_seq_lens_k
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup"):
        H.patch_model(_llama(2), group="world")
    inputs = H.model_inputs(batch)
    inputs["cu_seq_lens_k"] = inputs["cu_seq_lens_k"].flip(0)
    with pytest.raises(ValueError, match="cu_seq_lens_k"):
        model(**inputs)


def test_hf_plans_once_per_forward_and_runs_per_document():
    """The transformers path at cp 2 and 4 (gloo): one plan build per forward and no planning
    collective in the layers (2 and 4 layers: equal counts); per-document shards give the
    zigzag run's logits."""
    pytest.importorskip("transformers")
    run_distributed(_hf_body, 4, timeout_s=180)


def test_config_reads_the_one_list_of_each_choice():
    """Issue 20 item 2: the config's choices are the library's lists (it lacked "cudnn")."""
    import typing

    from cp_rope.launch.config import ConfigError, ParallelConfig, PretrainConfig, validate
    from cp_rope.parallel import BACKENDS, METHODS, PLACEMENTS

    hints = typing.get_type_hints(ParallelConfig)
    assert typing.get_args(hints["cp_method"]) == (*METHODS, "auto")
    assert typing.get_args(hints["attn_backend"]) == ("auto", *BACKENDS)
    assert typing.get_args(hints["cp_placement"]) == (*PLACEMENTS, "auto")
    cfg = PretrainConfig()
    cfg.parallel.attn_backend, cfg.train.device = "cudnn", "cpu"
    with pytest.raises(ConfigError, match="parallel.attn_backend='cudnn': needs CUDA"):
        validate(cfg, 1)


# ------------------------------------------------------------------ plans changed in place or copied (round 3)

def _zigzag_and_per_document_plans():
    from cp_rope.parallel import attention_plan, place_documents
    kw = dict(q_heads=4, kv_heads=2, head_dim=8, dtype=torch.float32)
    return [attention_plan(torch.tensor([0, 6, 12], dtype=torch.int32), 6, **kw),
            attention_plan(place_documents(torch.tensor([0, 6, 14, 22], dtype=torch.int32), 1, 6),
                           **kw)]


@pytest.mark.parametrize("which", [0, 1])
def test_plan_rope_positions_changed_in_place(which):
    """rope_args() hands out the plan's cached positions: changing them in place is refused at
    the next call like a changed cu_seqlens (RoPE of every later layer would use them)."""
    from cp_rope.parallel import context_parallel_attention
    plan = _zigzag_and_per_document_plans()[which]
    t = plan.n_tokens
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    context_parallel_attention(q, k, v, plan=plan)
    plan.rope_args()["position_ids"][1] += 5
    with pytest.raises(ValueError, match=r"plan: its cu_seqlens / seq_lens / positions were "
                                         r"changed in place"):
        context_parallel_attention(q, k, v, plan=plan)


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_plan_cannot_be_copied(how):
    import copy
    import pickle
    fn = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": pickle.dumps}[how]
    for plan in _zigzag_and_per_document_plans():
        with pytest.raises(TypeError, match=r"plan: a (CPAttentionPlan|PerDocumentPlan) cannot "
                                            r"be copied or pickled"):
            fn(plan)
