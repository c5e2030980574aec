"""cp_rope.hf on GPT-OSS, Gemma 2 and Gemma 3 (text): windows per layer type (documents longer
than the window), GPT-OSS's sinks, YaRN and router loss, Gemma's query pre-scaling, sandwich
norms, scaled embedding, final-logit soft-cap and Gemma 3's RoPE base per layer type, against
the unpatched model run document by document in float64 (hf_family_utils: SDPA for Gemma 3,
transformers' float64-softmax eager for GPT-OSS, its float64 transcription for Gemma 2).

At 1e-10 with ``rope_kernel=False`` (the model's own rotary embedding on the global positions);
``rope_kernel=True`` runs on a float32 twin at float32 tolerance (the kernel runs float32 and
below), as in test_hf_moe.
"""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_distributed
from hf_family_utils import (
    NEW_FAMILIES,
    docs,
    eager64_attention,
    family_config,
    family_model,
    per_document_reference,
    transformers,
)
from utils import assert_close

import cp_rope.hf as H
from cp_rope.hf.moe import load_balancing_loss, moe_spec, router_token_mask, with_extra_gradient
from cp_rope.parallel import (
    PackingCollator,
    cp_cross_entropy,
    cp_linear_cross_entropy,
    shard_batch,
    unshard,
)

COEF = 0.5
SPLIT = 12  # per-document: documents longer than this are split over the ranks
LENS = (5, 13, 1, 9, 3, 11)  # most longer than the window (4); odd: zigzag padding


def _docs():
    return docs(lens=LENS)


@functools.cache
def _expected(family):
    model = family_model(family)
    coef = COEF if moe_spec(model.config) is not None else None
    return (model.state_dict(),) + per_document_reference(model, _docs(), coef)


def _check_case(family, group, cp, rank, *, placement="zigzag", method="ring",
                rope_kernel=False):
    weights, want_logits, want_aux, want_grads = _expected(family)
    dtype = torch.float64 if not rope_kernel else torch.float32  # the kernel: float32 and below
    model = family_model(family, dtype=dtype)
    model.load_state_dict(weights)
    H.patch_model(model, group=group, method=method, backend="reference",
                  rope_kernel=rope_kernel)
    examples = [{"input_ids": d} for d in _docs()]
    glob = PackingCollator(cp_size=cp)(examples)
    batch = glob if cp == 1 else shard_batch(
        glob, cp, rank, placement=placement,
        split_threshold=SPLIT if placement == "per_document" else None)
    moe = want_aux is not None
    out = model(**H.model_inputs(batch), **({"output_router_logits": True} if moe else {}))
    logits = out.logits[0]  # Gemma 2: soft-capped by the model
    loss = cp_cross_entropy(logits, batch.labels, group)
    if moe:
        mask = router_token_mask(batch.cu_seqlens, batch.position_ids, batch.seq_lens,
                                 batch.num_tokens, placement=batch.placement, cp_rank=rank)
        spec = moe_spec(model.config)
        aux = load_balancing_loss(out.router_logits, num_experts=spec.num_experts,
                                  top_k=spec.top_k, mask=mask, group=group)
        loss = with_extra_gradient(loss, COEF * aux)
    loss.backward()
    what = f"{family} cp={cp} {placement} {method} rope_kernel={rope_kernel}"
    gathered = unshard(logits.detach(), batch.cu_seqlens, group, placement=batch.placement)
    cu = glob.cu_seqlens.tolist()
    real = torch.cat([gathered[cu[i]:cu[i] + len(d)] for i, d in enumerate(_docs())])
    assert_close(real, want_logits, dtype=dtype, name=f"{what}: logits")
    if moe:
        assert_close(aux.detach(), want_aux, dtype=dtype, name=f"{what}: router loss")
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        if group is not None:
            dist.all_reduce(grad, group=group)
        assert_close(grad, want_grads[name], dtype=dtype, name=f"{what}: grad {name}")


# --------------------------------------------------------------------------- cp 1 (in process)
@pytest.mark.parametrize("family", list(NEW_FAMILIES))
def test_cp1_equals_unpatched_per_document(family):
    _check_case(family, None, 1, 0)
    _check_case(family, None, 1, 0, rope_kernel=True)


@pytest.mark.parametrize("family", list(NEW_FAMILIES))
def test_windows_and_features_matter(family):
    """The reference is not blind to them: the same weights with the window widened past the
    documents (and, per family, the sinks zeroed or the per-type RoPE made one) differ."""
    weights, want = _expected(family)[:2]
    changes = [{"sliding_window": 64}]
    if family == "gemma3_text":
        changes.append({"rope_parameters": {t: {"rope_type": "default", "rope_theta": 1e4}
                                            for t in ("sliding_attention", "full_attention")}})
    if family == "gemma2":
        changes.append({"final_logit_softcapping": None, "query_pre_attn_scalar": 8})
    for over in changes:
        other = family_model(family, **over)
        other.load_state_dict(weights)
        with torch.no_grad():
            got = torch.cat([other(input_ids=d[None]).logits[0] for d in _docs()])
        assert (got - want).abs().max() > 1e-3, (family, over)
    if family == "gpt_oss":  # sinks at -inf: no sink
        other = family_model(family)
        other.load_state_dict({**weights, **{k: torch.full_like(v, -1e4) for k, v in
                                             weights.items() if k.endswith("sinks")}})
        with torch.no_grad():
            got = torch.cat([other(input_ids=d[None]).logits[0] for d in _docs()])
        assert (got - want).abs().max() > 1e-3


def test_eager64_oracle_is_transformers_eager():
    """Gemma 2's float64 reference attention equals transformers' eager one (its softmax in
    float32) at float32 tolerance, with and without an attention soft-cap."""
    module = H._compat.FAMILIES["gemma2"][0]
    model = family_model("gemma2")
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 7, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 7, 8, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.triu(torch.full((7, 7), float("-inf"), dtype=torch.float64), 1)[None, None]
    for cap in (None, 2.0):
        theirs = module.eager_attention_forward(attn, q, k, v, mask, scaling=0.3, softcap=cap)[0]
        ours = eager64_attention(attn, q, k, v, mask, scaling=0.3, softcap=cap)[0]
        assert_close(ours, theirs, dtype=torch.float32, name=f"eager64 softcap={cap}")


def test_final_logit_softcap_in_the_losses():
    """cp_cross_entropy / cp_linear_cross_entropy with softcap= equal Gemma 2's soft-capped
    logits' cross-entropy in float64, gradients included."""
    model = family_model("gemma2")
    cap = model.config.final_logit_softcapping
    batch = PackingCollator()([{"input_ids": d} for d in _docs()])
    hidden = model.model(**{k: v for k, v in H.model_inputs(batch).items()
                            if k in ("input_ids", "position_ids")}).last_hidden_state[0]
    hidden = hidden.detach().requires_grad_()
    w = model.lm_head.weight.detach().clone().requires_grad_()
    keep = batch.labels != -100

    def grads(fn):
        loss = fn()
        gh, gw = torch.autograd.grad(loss, (hidden, w))
        return loss.detach(), gh, gw

    want = grads(lambda: F.cross_entropy((cap * torch.tanh(hidden @ w.T / cap))[keep],
                                         batch.labels[keep]))
    for name, fn in (("cp_cross_entropy", lambda: cp_cross_entropy(
                         hidden @ w.T, batch.labels, softcap=cap)),
                     ("cp_linear_cross_entropy", lambda: cp_linear_cross_entropy(
                         hidden, w, batch.labels, softcap=cap, chunk_size=7))):
        for got, ref, what in zip(grads(fn), want, ("loss", "grad hidden", "grad weight"),
                                  strict=True):
            assert_close(got, ref, name=f"{name} {what}")
    with pytest.raises(ValueError, match="softcap=0"):
        cp_cross_entropy(hidden @ w.T, batch.labels, softcap=0)


def test_refusals_name_the_field():
    with pytest.raises(ValueError, match=r"config.attn_logit_softcapping=50.0: cp_rope's CP"):
        H.patch_model(family_model("gemma2", attn_logit_softcapping=50.0))
    with pytest.raises(ValueError, match="config.use_bidirectional_attention=True"):
        H.patch_model(family_model("gemma3_text", use_bidirectional_attention=True))
    model = family_model("gpt_oss")
    model.config.layer_types = ["sliding_attention"]
    with pytest.raises(ValueError, match="config.layer_types has 1 entries for num_hidden_layers=2"):
        H.patch_model(model)
    model.config.layer_types = ["sliding_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="'chunked_attention' is not a layer type"):
        H.patch_model(model)
    model = family_model("gemma2")
    model.config.sliding_window = None
    with pytest.raises(ValueError, match="config.sliding_window=None: config.layer_types has"):
        H.patch_model(model)
    model = family_model("gpt_oss")
    del model.model.layers[1].self_attn.sinks
    model.model.layers[1].self_attn.sinks = None
    with pytest.raises(ValueError, match="sinks: 1 of 2 attention layers"):
        H.patch_model(model)
    model = family_model("gemma3_text")
    model.config.rope_parameters["full_attention"] = {"rope_type": "dynamic", "factor": 2.0,
                                                      "rope_theta": 1e6}
    with pytest.raises(ValueError, match=r"rope_parameters\['full_attention'\]: rope_type 'dynamic'"):
        H.patch_model(model, rope_kernel=False)
    # the attention function itself refuses a soft-cap handed to it (config changed after the patch)
    model = H.patch_model(family_model("gemma2"), rope_kernel=False)
    model.model.layers[0].self_attn.attn_logit_softcapping = 20.0
    batch = PackingCollator()([{"input_ids": d} for d in _docs()])
    with pytest.raises(ValueError, match="softcap=20.0: CP attention has no attention-logit"):
        model(**H.model_inputs(batch))
    # the multimodal Gemma 3 is another model_type
    with pytest.raises(ValueError, match="model_type 'gemma3' is not supported"):
        H.patch_model(transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
            text_config=dict(family_config("gemma3_text").to_dict()),
            vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                               num_attention_heads=2, image_size=8, patch_size=4))))


# --------------------------------------------------------------------------- cp 2 and 4
def _cp_body(rank: int, world: int) -> None:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair, r2 = pairs[rank // 2], rank % 2
    families = list(NEW_FAMILIES)
    # cp 2: pair 0 zigzag, pair 1 per-document; every family, ring and all-gather
    placement = ("zigzag", "per_document")[rank // 2]
    for family in families:
        for method in ("ring", "allgather"):
            _check_case(family, pair, 2, r2, placement=placement, method=method)
    # cp 4: every family, zigzag and per-document; Ulysses and the RoPE kernel once each
    for family in families:
        for placement in ("zigzag", "per_document"):
            _check_case(family, dist.group.WORLD, 4, rank, placement=placement)
    _check_case("gemma3_text", dist.group.WORLD, 4, rank, rope_kernel=True)
    _check_case("gpt_oss", dist.group.WORLD, 4, rank, method="ulysses", rope_kernel=True)


def test_cp2_cp4_equal_unpatched():
    run_distributed(_cp_body, 4, timeout_s=300)


def test_config_refusals_come_before_the_model_loads(tmp_path, capsys):
    """A fresh user's try: finetune_hf on a Gemma 2 config with its attention soft-cap loaded
    the data, then failed in patch_model with a traceback on every rank, and plan_memory
    --model priced the model. Both now refuse the config first, naming the field."""
    from cp_rope.launch.config import ConfigError
    from cp_rope.launch.finetune_hf import main
    from cp_rope.launch.plan_memory import main as plan_memory

    family_config("gemma2", vocab_size=320, attn_logit_softcapping=50.0).save_pretrained(
        tmp_path / "g")
    with pytest.raises(ConfigError, match=r"hf.model=.*config.attn_logit_softcapping=50.0"):
        main(["--model", str(tmp_path / "g"), "--device", "cpu"])
    with pytest.raises(SystemExit):
        plan_memory(["--model", str(tmp_path / "g"), "--seq-len", "4096"])
    assert "config.attn_logit_softcapping=50.0: cp_rope's CP" in capsys.readouterr().err


# --------------------------------------------------------------------------- finetune_hf
def _finetune_body(rank: int, world: int, tmp: str, families) -> None:
    from cp_rope.launch.finetune_hf import main

    for family in families:
        common = ["--model", f"{tmp}/{family}", "--data", f"{tmp}/corpus.jsonl", "--cp-size",
                  "2", "--steps", "3", "--lr", "1e-2", "--warmup-steps", "0", "--seq-len", "64",
                  "--tokens-per-batch", "256", "--log-every", "1", "--device", "cpu",
                  "--no-progress", "--checkpoint-every", "2"]
        full = main(common + ["--out-dir", f"{tmp}/{family}-full"])
        main(common + ["--out-dir", f"{tmp}/{family}-split", "--stop-at-step", "2"])
        second = main(common + ["--out-dir", f"{tmp}/{family}-split", "--resume"])
        assert second["start_step"] == 2 and second["losses"] == {3: full["losses"][3]}, family
        assert full["losses"][3] != full["losses"][1], family
        if rank == 0:  # save_pretrained reloads with transformers, the same logits
            a, loaded = H.load_causal_lm(full["hf_model"])
            b = transformers.AutoModelForCausalLM.from_pretrained(full["hf_model"])
            assert loaded and isinstance(b, type(a))
            ids = torch.arange(20)[None] % 60 + 3
            with torch.no_grad():
                assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


def test_finetune_hf_trains_resumes_and_saves(tmp_path):
    """gemma2 (the soft-capped fused loss) and gemma3_text (per-type RoPE) at cp 2."""
    families = ("gemma2", "gemma3_text")
    for family in families:
        family_config(family, vocab_size=320, sliding_window=16,
                      attn_implementation="sdpa" if family == "gemma3_text" else "eager",
                      ).save_pretrained(tmp_path / family)
    here = os.path.dirname(H.__file__)
    texts = [open(os.path.join(here, f)).read()[i:i + 300] for f in sorted(os.listdir(here))
             if f.endswith(".py") for i in (0, 400, 800)]
    with open(tmp_path / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    run_distributed(_finetune_body, 2, str(tmp_path), families, timeout_s=600)


def test_start_up_self_test_with_mixed_windows():
    """The trainers' start-up self-test with these families' layers (a window and full ones):
    each layer's call takes plan.for_window(W) (window=None with a plan is the plan's window, so
    the full layers ran windowed and the test failed every windowed family's start)."""
    from cp_rope.parallel._self_test import self_test

    for window in ([4, None], [None, 4]):
        self_test(None, method="ring", window=window, sinks=True)
