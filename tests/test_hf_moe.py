"""cp_rope.hf on the mixture-of-experts families (Qwen3-MoE, Mixtral) and the router
load-balancing loss under CP (cp_rope.hf.moe), against the unpatched model run document by
document (transformers' SDPA attention, float64 weights) in float64.

At 1e-10 with ``rope_kernel=False`` (the model's own rotary embedding on the global
positions): transformers computes cos/sin in float32, which cp_rope's float64-exact tables
do not reproduce below ~1e-7, and its kernel runs float32 / bf16 / fp16: ``rope_kernel=True``
is checked on a float32 twin at float32 tolerance.
"""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from hf_family_utils import (
    MOE_FAMILIES,
    docs,
    family_config,
    family_model,
    load_balancing_oracle,
    per_document_reference,
    transformers,
)
from utils import assert_close

import cp_rope.hf as H
from cp_rope.hf.moe import (
    load_balancing_loss,
    moe_spec,
    router_loss_spec,
    router_token_mask,
    with_extra_gradient,
)
from cp_rope.parallel import PackingCollator, cp_cross_entropy, shard_batch, unshard

COEF = 0.5
SPLIT = 12  # per-document: documents longer than this are split over the ranks


def _shard(glob, cp, rank, placement):
    return shard_batch(glob, cp, rank, placement=placement,
                       split_threshold=SPLIT if placement == "per_document" else None)


@functools.cache
def _expected(family):
    model = family_model(family)
    return (model.state_dict(),) + per_document_reference(model, docs(), COEF)


def _check_case(family, group, cp, rank, *, placement="zigzag", method="ring",
                rope_kernel=False):
    weights, want_logits, want_aux, want_grads = _expected(family)
    dtype = torch.float64 if not rope_kernel else torch.float32  # the kernel: float32 and below
    model = family_model(family, dtype=dtype)
    model.load_state_dict(weights)
    H.patch_model(model, group=group, method=method, rope_kernel=rope_kernel)
    examples = [{"input_ids": d} for d in docs()]
    glob = PackingCollator(cp_size=cp)(examples)
    batch = glob if cp == 1 else _shard(glob, cp, rank, placement)
    out = model.model(**H.model_inputs(batch), output_router_logits=True)
    logits = model.lm_head(out.last_hidden_state)[0]
    mask = router_token_mask(batch.cu_seqlens, batch.position_ids, batch.seq_lens,
                             batch.num_tokens, placement=batch.placement, cp_rank=rank)
    spec = moe_spec(model.config)
    aux = load_balancing_loss(out.router_logits, num_experts=spec.num_experts, top_k=spec.top_k,
                              mask=mask, group=group)
    loss = with_extra_gradient(cp_cross_entropy(logits, batch.labels, group), COEF * aux)
    loss.backward()
    what = f"{family} cp={cp} {placement} {method} rope_kernel={rope_kernel}"
    gathered = unshard(logits.detach(), batch.cu_seqlens, group, placement=batch.placement)
    cu = glob.cu_seqlens.tolist()
    real = torch.cat([gathered[cu[i]:cu[i] + len(d)] for i, d in enumerate(docs())])
    assert_close(real, want_logits, dtype=dtype, name=f"{what}: logits")
    assert_close(aux.detach(), want_aux, dtype=dtype, name=f"{what}: router loss")
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        if group is not None:
            dist.all_reduce(grad, group=group)
        assert_close(grad, want_grads[name], dtype=dtype, name=f"{what}: grad {name}")


# --------------------------------------------------------------------------- cp 1 (in process)
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_cp1_equals_unpatched_per_document(family):
    _check_case(family, None, 1, 0)
    _check_case(family, None, 1, 0, rope_kernel=True)


def test_oracle_is_transformers_load_balancing_loss():
    """The float64 oracle equals transformers' own function (which sums in float32), and the
    CP loss of one rank equals both; pads masked out equal the rows left out."""
    family = "qwen3_moe"
    module = H._compat.FAMILIES[family][0]
    g = torch.Generator().manual_seed(3)
    logits = [torch.randn(29, 5, generator=g, dtype=torch.float64) for _ in range(3)]
    theirs = module.load_balancing_loss_func(tuple(logits), 5, 2)
    ours = load_balancing_oracle(logits, 5, 2)
    assert_close(ours, theirs.double(), dtype=torch.float32, name="oracle vs transformers")
    assert_close(load_balancing_loss(logits, num_experts=5, top_k=2), ours, name="cp_rope")
    mask = torch.rand(29, generator=g) < 0.6
    assert_close(load_balancing_loss(logits, num_experts=5, top_k=2, mask=mask),
                 load_balancing_oracle([x[mask] for x in logits], 5, 2), name="masked")


def test_router_token_mask_marks_real_rows():
    examples = [{"input_ids": d} for d in docs()]
    for cp in (1, 2, 4):
        glob = PackingCollator(cp_size=cp)(examples)
        for placement in ("zigzag", "per_document"):
            n_real = 0
            for r in range(cp):
                s = glob if cp == 1 else _shard(glob, cp, r, placement)
                m = router_token_mask(s.cu_seqlens, s.position_ids, s.seq_lens, s.num_tokens,
                                      placement=s.placement, cp_rank=r)
                n_real += int(m.sum())
                # a real row holds its document's token (labels: next token or the last one)
                assert m.dtype == torch.bool and m.shape == (s.num_tokens,)
            assert n_real == sum(len(d) for d in docs()), (cp, placement, n_real)
            if cp == 1:
                break


def test_bad_input():
    cfg = family_config("qwen3_moe", output_router_logits=False)
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.5 but config.output_router_logits"):
        router_loss_spec(cfg, "config")
    assert router_loss_spec(cfg, "off") is None and router_loss_spec(cfg, "on").coef == 0.5
    with pytest.raises(ValueError, match="router_aux_loss='on'.*router_aux_loss_coef is 0"):
        router_loss_spec(family_config("mixtral", router_aux_loss_coef=0.0), "on")
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        router_loss_spec(transformers.LlamaConfig(), "on")
    assert router_loss_spec(transformers.LlamaConfig(), "config") is None
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        moe_spec(family_config("mixtral", num_experts_per_tok=9))
    with pytest.raises(ValueError, match="router_logits=.*recorded no router logits"):
        load_balancing_loss((), num_experts=4, top_k=2)
    with pytest.raises(ValueError, match=r"router_logits\[1\]"):
        load_balancing_loss((torch.randn(3, 4), torch.randn(2, 4)), num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="mask"):
        load_balancing_loss((torch.randn(3, 4),), num_experts=4, top_k=2, mask=torch.ones(3))
    with pytest.raises(ValueError, match="mlp_tile_tokens: Qwen3MoeSparseMoeBlock is a mixture"):
        H.patch_model(family_model("qwen3_moe"), mlp_tile_tokens=4)
    # the MoE model's forward without router logits: nothing to compute the loss from
    model = H.patch_model(family_model("mixtral", output_router_logits=False), rope_kernel=False)
    batch = PackingCollator()([{"input_ids": d} for d in docs()])
    out = model.model(**H.model_inputs(batch))
    with pytest.raises(ValueError, match="recorded no router logits"):
        load_balancing_loss(out.router_logits, num_experts=4, top_k=2)


# --------------------------------------------------------------------------- cp 2 and 4
def _cp_body(rank: int, world: int) -> None:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair, r2 = pairs[rank // 2], rank % 2
    families = list(MOE_FAMILIES)
    # cp 2: each pair checks one family, zigzag and per-document, ring and all-gather
    family = families[rank // 2]
    for placement in ("zigzag", "per_document"):
        for method in ("ring", "allgather"):
            _check_case(family, pair, 2, r2, placement=placement, method=method)
    # cp 4: every family, zigzag and per-document; the RoPE kernel once (float32 tolerance)
    for family in families:
        for placement in ("zigzag", "per_document"):
            _check_case(family, dist.group.WORLD, 4, rank, placement=placement)
        _check_case(family, dist.group.WORLD, 4, rank, rope_kernel=True)


def test_cp2_cp4_equal_unpatched():
    run_distributed(_cp_body, 4, timeout_s=300)


# --------------------------------------------------------------------------- finetune_hf
def _finetune_body(rank: int, world: int, tmp: str) -> None:
    from cp_rope.launch.finetune_hf import main

    for family in MOE_FAMILIES:
        common = ["--model", f"{tmp}/{family}", "--data", f"{tmp}/corpus.jsonl", "--cp-size",
                  "2", "--steps", "3", "--lr", "1e-2", "--warmup-steps", "0", "--seq-len", "64",
                  "--tokens-per-batch", "256", "--log-every", "1", "--device", "cpu",
                  "--no-progress", "--checkpoint-every", "2"]
        full = main(common + ["--out-dir", f"{tmp}/{family}-full"])
        main(common + ["--out-dir", f"{tmp}/{family}-split", "--stop-at-step", "2"])
        second = main(common + ["--out-dir", f"{tmp}/{family}-split", "--resume"])
        assert second["start_step"] == 2 and second["losses"] == {3: full["losses"][3]}
        records = [json.loads(x) for x in open(f"{tmp}/{family}-full/metrics.jsonl")]
        aux = [r["aux_loss"] for r in records if "aux_loss" in r]
        assert len(aux) == 3 and all(a >= 1.0 - 1e-6 for a in aux), aux  # E * sum f P >= 1
        if rank == 0:  # save_pretrained reloads with transformers, the same logits
            a, loaded = H.load_causal_lm(full["hf_model"])
            b = transformers.AutoModelForCausalLM.from_pretrained(full["hf_model"])
            assert loaded and isinstance(b, type(a))
            ids = torch.arange(20)[None] % 60 + 3
            with torch.no_grad():
                assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


def test_finetune_hf_moe_trains_resumes_and_saves(tmp_path):
    for family in MOE_FAMILIES:
        family_config(family, vocab_size=320, router_aux_loss_coef=0.01).save_pretrained(
            tmp_path / family)
    here = os.path.dirname(H.__file__)
    texts = [open(os.path.join(here, f)).read()[i:i + 300] for f in sorted(os.listdir(here))
             if f.endswith(".py") for i in (0, 400, 800)]
    with open(tmp_path / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    run_distributed(_finetune_body, 2, str(tmp_path), timeout_s=600)


def test_finetune_hf_router_flags(tmp_path):
    from cp_rope.launch.config import ConfigError
    from cp_rope.launch.finetune_hf import main

    family_config("qwen3_moe", vocab_size=320, output_router_logits=False).save_pretrained(
        tmp_path / "m")
    with pytest.raises(ConfigError, match="hf.router_aux_loss='config'.*output_router_logits"):
        main(["--model", str(tmp_path / "m"), "--device", "cpu"])
    for aux in ("on", "off"):  # off: a traceback from patch_model after the data loaded
        with pytest.raises(ConfigError, match="hf.mlp_tile_tokens=8: a mixture-of-experts"):
            main(["--model", str(tmp_path / "m"), "--device", "cpu", "--router-aux-loss", aux,
                  "--mlp-tile-tokens", "8"])
