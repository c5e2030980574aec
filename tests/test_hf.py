"""cp_rope.hf: packed context parallelism for transformers models, against the unpatched model.

Tiny random models built from configs (no downloads) of every supported
family, with GQA and a different rope type each (llama3, default + sliding
window, linear, yarn with its attention factor, partial rotary for Phi3);
methods ring, allgather, ulysses (cp 2) and hybrid (cp 4, Ulysses pairs). The
reference is the unpatched model (eager attention, float64 weights) run on each document
alone; the patched model runs float32 on the packed batch (zigzag shards at
cp > 1), its logits are gathered and its CP loss's gradients summed over the
group. float32 tolerances (tests/utils.py TOL): transformers computes RMSNorm,
softmax and the rotary angles in float32 even for float64 weights, so the
reference is float32-exact, not float64.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_distributed
from utils import assert_close

from cp_rope.parallel import PackingCollator, cp_cross_entropy, unshard

transformers = pytest.importorskip("transformers")  # the hf extra; scripts/setup.sh installs it
H = importlib.import_module("cp_rope.hf")  # after the skip: it needs transformers
V = 61
DOC_LENS = (5, 13, 1, 8, 3, 6)  # odd lengths: zigzag padding at every cp size

FAMILIES = {
    "llama": ("LlamaConfig", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "mistral": ("MistralConfig", {"rope_type": "default"}),  # sliding_window 4096 (default)
    "qwen2": ("Qwen2Config", {"rope_type": "linear", "factor": 2.0}),
    "qwen3": ("Qwen3Config", {"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 32}),
    "phi3": ("Phi3Config", {"rope_type": "default", "partial_rotary_factor": 0.5}),
}


def _config(family: str, **over):
    name, rope = FAMILIES[family]
    transformers.logging.set_verbosity_error()
    kwargs = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, vocab_size=V,
                  max_position_embeddings=128, attention_dropout=0.0, attn_implementation="eager",
                  rope_parameters=dict(rope, rope_theta=500000.0))
    if family == "phi3":
        kwargs["pad_token_id"] = 0  # its default (32000) is outside the tiny vocabulary
    kwargs.update(over)
    return getattr(transformers, name)(**kwargs)


def _models(family: str, seed: int = 0, **over):
    """(reference float64 eager, float32 twin with the same weights); separate configs."""
    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(_config(family, **over)).double()
    model = transformers.AutoModelForCausalLM.from_config(_config(family, **over))
    model.load_state_dict(ref.state_dict())
    return ref, model


def _docs(seed: int = 1, lens=DOC_LENS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g) for n in lens]


def _reference(ref, docs):
    """Per-document logits (concatenated) and the mean next-token CE's parameter gradients."""
    ref.zero_grad(set_to_none=True)
    outs = [ref(input_ids=d[None]).logits[0] for d in docs]
    n = sum(len(d) - 1 for d in docs)
    loss = sum(F.cross_entropy(o[:-1], d[1:], reduction="sum") for o, d in zip(outs, docs, strict=True)) / n
    loss.backward()
    return torch.cat(outs).detach(), {k: p.grad for k, p in ref.named_parameters()}


def _real_rows(global_logits, global_cu, docs):
    cu = global_cu.tolist()
    return torch.cat([global_logits[cu[i]:cu[i] + len(d)] for i, d in enumerate(docs)])


@functools.cache
def _expected(family):
    """(weights, per-document logits, gradients) of the unpatched reference, once per process."""
    ref, _ = _models(family)
    return (ref.state_dict(),) + _reference(ref, _docs())


def _check_case(family, group, method, rope_kernel, cp_size, cp_rank, ulysses_size=None):
    docs = _docs()
    weights, want_logits, want_grads = _expected(family)
    model = transformers.AutoModelForCausalLM.from_config(_config(family))
    model.load_state_dict(weights)
    H.patch_model(model, group=group, method=method, rope_kernel=rope_kernel,
                  ulysses_size=ulysses_size)
    examples = [{"input_ids": d} for d in docs]
    batch = PackingCollator(cp_size=cp_size, cp_rank=cp_rank)(examples)
    logits = model(**H.model_inputs(batch)).logits[0]
    loss = cp_cross_entropy(logits, batch.labels, group)
    loss.backward()
    what = f"{family} cp={cp_size} {method} rope_kernel={rope_kernel}"
    gathered = unshard(logits.detach(), batch.cu_seqlens, group)
    glob = PackingCollator(cp_size=cp_size)(examples)
    assert_close(_real_rows(gathered, glob.cu_seqlens, docs), want_logits, dtype=torch.float32,
                 name=f"{what}: logits")
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        if group is not None:
            dist.all_reduce(grad, group=group)
        assert_close(grad, want_grads[name], dtype=torch.float32, name=f"{what}: grad {name}")


# --------------------------------------------------------------------------- cp 1 (in process)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cp1_equals_unpatched_per_document(family):
    for rope_kernel in (True, False):
        _check_case(family, None, "ring", rope_kernel, 1, 0)


def test_rope_kernel_is_used_and_equals_model_rope(monkeypatch):
    calls = []
    apply = H.PackedRope.apply
    monkeypatch.setattr(H.PackedRope, "apply", lambda self, q, k: calls.append(1) or apply(self, q, k))
    _, model = _models("llama")
    batch = PackingCollator()([{"input_ids": d} for d in _docs()])
    with torch.no_grad():
        H.patch_model(model, rope_kernel=False)
        own = model(**H.model_inputs(batch)).logits
        assert calls == []
        H.patch_model(model, rope_kernel=True)  # same group (None): re-patch
        kernel = model(**H.model_inputs(batch)).logits
    assert len(calls) == model.config.num_hidden_layers
    assert_close(kernel, own, dtype=torch.float32, name="kernel vs model RoPE")
    # an unpatched model of the same family keeps the original rotation
    ref, _ = _models("llama")
    with torch.no_grad():
        ref(input_ids=_docs()[0][None])
    assert len(calls) == model.config.num_hidden_layers


def test_model_inputs_equals_data_collator_with_flattening():
    docs = _docs(lens=(4, 10, 2, 6))  # even: PackingCollator pads to a multiple of 2 at cp 1
    examples = [{"input_ids": d.tolist()} for d in docs]
    got = H.model_inputs(PackingCollator()(examples))
    want = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True,
                                                   return_position_ids=True)(examples)
    assert set(got) == set(want) - {"labels"}
    for key, value in got.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == want[key].dtype and torch.equal(value, want[key]), key
        else:
            assert value == want[key], key


def test_bad_input():
    _, model = _models("llama")
    batch = PackingCollator()([{"input_ids": d} for d in _docs()])
    inputs = H.model_inputs(batch)
    H.patch_model(model)
    with pytest.raises(ValueError, match="labels: .*cp_cross_entropy"):
        model(**inputs, labels=inputs["input_ids"])
    with pytest.raises(TypeError, match="keywords"):
        model(inputs["input_ids"], None, inputs["position_ids"])
    with pytest.raises(ValueError, match="attention_mask"):
        model(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]))
    with pytest.raises(ValueError, match="use_cache"):
        model(**inputs, use_cache=True)
    with pytest.raises(ValueError, match="model_inputs"):
        model(input_ids=inputs["input_ids"])
    with pytest.raises(ValueError, match="position_ids are not the zigzag positions"):
        model(**dict(inputs, position_ids=inputs["position_ids"] + 1))
    with pytest.raises(TypeError, match="PackedBatch"):
        H.model_inputs({"input_ids": inputs["input_ids"]})
    with pytest.raises(ValueError, match="method"):
        H.patch_model(model, method="tree")
    with pytest.raises(TypeError, match="rope_kernel"):
        H.patch_model(model, rope_kernel=1)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        H.patch_model(torch.nn.Linear(2, 2))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported.*llama, mistral, phi3"):
        H.patch_model(gpt2)
    # a rope type cp_rope cannot reproduce: refused with rope_kernel=True, the model's own
    # rotary embedding with rope_kernel=False
    _, dyn = _models("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                               "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="rope_kernel=False"):
        H.patch_model(dyn)
    H.patch_model(dyn, rope_kernel=False)  # right while no sequence is past max_positions
    with torch.no_grad():
        want = dyn(**inputs).logits
    long = H.model_inputs(PackingCollator()([{"input_ids": torch.randint(0, V, (130,))}]))
    with pytest.raises(ValueError, match="length-dependent RoPE \\(dynamic\\)"):
        dyn(**long)
    H.unpatch_model(dyn)
    with torch.no_grad():
        alone = torch.cat([dyn(input_ids=d[None]).logits[0] for d in _docs()])
    assert_close(_real_rows(want[0], batch.cu_seqlens, _docs()), alone, dtype=torch.float32,
                 name="dynamic rope, the model's own rotary embedding")
    # a layer whose window its plan was not built for (patched, then the config changed)
    _, mistral = _models("mistral", sliding_window=8)
    H.patch_model(mistral)
    mistral.config.sliding_window = 5
    with pytest.raises(ValueError, match=r"window=5: the plan was built for windows \[8\]"):
        mistral(**inputs)
    # unpatch restores the attention implementation
    H.unpatch_model(model)
    assert model.config._attn_implementation == "eager" and not hasattr(model, "cp_rope_patch")
    with pytest.raises(ValueError, match="not patched"):
        H.unpatch_model(model)


def test_transformers_missing_or_too_old(monkeypatch):
    with pytest.raises(ImportError, match="transformers>=5.0.*found 4.57.1"):
        H._compat._check_transformers_version("4.57.1")
    H._compat._check_transformers_version("5.0.0.dev0")
    for name in [m for m in sys.modules if m == "cp_rope.hf" or m.startswith("cp_rope.hf.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.46.0")
    with pytest.raises(ImportError, match="cp-rope\\[hf\\]"):
        importlib.import_module("cp_rope.hf")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="transformers, which is not installed.*cp-rope\\[hf\\]"):
        importlib.import_module("cp_rope.hf")


# --------------------------------------------------------------------------- cp 2 and 4 (gloo)
def _cp_body(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair, r2 = pairs[rank // 2], rank % 2
    # cp 2: ranks 0-1 and 2-3 are two CP groups, each checking some of the families
    for family in (("llama", "mistral", "phi3") if rank < 2 else ("qwen2", "qwen3")):
        for method in ("ring", "allgather", "ulysses"):
            _check_case(family, pair, method, method != "allgather", 2, r2)
    # cp 4: every family, every method (hybrid: 2 Ulysses pairs in a ring), the RoPE kernel
    for family in FAMILIES:
        for method in ("ring", "allgather", "hybrid"):
            _check_case(family, dist.group.WORLD, method, True, 4, rank,
                        ulysses_size=2 if method == "hybrid" else None)

    # document isolation (cp 4): changing one document leaves the others' logits unchanged
    _, model = _models("qwen3")
    H.patch_model(model, group=dist.group.WORLD)
    docs = _docs()
    changed = list(docs)
    changed[3] = (docs[3] + 7) % V
    out = []
    for ds in (docs, changed):
        batch = PackingCollator(cp_size=4, cp_rank=rank)([{"input_ids": d} for d in ds])
        with torch.no_grad():
            logits = model(**H.model_inputs(batch)).logits[0]
        glob = PackingCollator(cp_size=4)([{"input_ids": d} for d in ds])
        g = unshard(logits, batch.cu_seqlens, dist.group.WORLD)
        cu = glob.cu_seqlens.tolist()
        out.append([g[cu[i]:cu[i] + len(d)] for i, d in enumerate(ds)])
    for i in range(len(docs)):
        if i == 3:
            assert (out[0][i] - out[1][i]).abs().max() > 1e-3
        else:
            assert_close(out[1][i], out[0][i], atol=0.0, rtol=1e-6, name=f"document {i}")

    # bad input across ranks: another rank's shard, a second group
    _, model = _models("llama")
    H.patch_model(model, group=pair)
    other = PackingCollator(cp_size=2, cp_rank=1 - r2)([{"input_ids": d} for d in docs])
    try:
        model(**H.model_inputs(other))
    except ValueError as exc:
        assert f"cp_rank {1 - r2}'s zigzag positions but this rank is cp_rank {r2}" in str(exc)
    else:
        raise AssertionError("a batch of another cp_rank was accepted")
    try:
        H.patch_model(model, group=dist.group.WORLD)
    except ValueError as exc:
        assert "already patched" in str(exc) and "unpatch_model" in str(exc)
    else:
        raise AssertionError("re-patching for another group was accepted")
    try:  # the other pair's group
        H.patch_model(_models("llama")[1], group=pairs[1 - rank // 2])
    except ValueError as exc:
        assert "not a member of the CP group" in str(exc)
    else:
        raise AssertionError("a group without this rank was accepted")


@pytest.mark.slow
def test_cp2_cp4_equal_unpatched():
    run_distributed(_cp_body, 4)



# --------------------------------------------------------------------------- finetune_hf
def _finetune_body(rank: int, world: int, tmp: str) -> None:
    from cp_rope.launch.finetune_hf import main

    common = ["--model", f"{tmp}/model", "--data", f"{tmp}/corpus.jsonl", "--cp-size", "2",
              "--steps", "3", "--lr", "1e-2", "--warmup-steps", "0", "--seq-len", "64",
              "--tokens-per-batch", "256", "--log-every", "1", "--device", "cpu",
              "--no-progress"]
    full = main(common + ["--out-dir", f"{tmp}/full"])
    first = main(common + ["--out-dir", f"{tmp}/split", "--stop-at-step", "2"])
    second = main(common + ["--out-dir", f"{tmp}/split", "--resume"])
    losses = full["losses"]
    assert losses[3] < losses[1], losses  # it learns
    # --cp-placement per_document (short documents whole on one rank): the same first loss
    placed = main(common + ["--out-dir", f"{tmp}/placed", "--cp-placement", "per_document",
                            "--cp-split-threshold", "16", "--steps", "1"])
    assert abs(placed["losses"][1] - losses[1]) <= 1e-5 * abs(losses[1]), (placed, losses)
    assert first["hf_model"] is None and first["losses"] == {1: losses[1], 2: losses[2]}
    assert second["start_step"] == 2 and second["losses"] == {3: losses[3]}  # bit-for-bit
    if rank == 0:  # save_pretrained: loadable, trained, and the resumed run's weights equal
        init, _ = H.load_causal_lm(f"{tmp}/model")
        a, loaded_a = H.load_causal_lm(full["hf_model"])
        b, loaded_b = H.load_causal_lm(second["hf_model"])
        assert loaded_a and loaded_b
        for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            assert torch.equal(p, q), name
        assert not torch.equal(a.lm_head.weight, init.lm_head.weight)


def test_finetune_hf_cp2_loss_falls_and_resumes(tmp_path):
    """torchrun -m cp_rope.launch.finetune_hf's main on 2 gloo ranks at cp 2, from a tiny local
    Llama config (random init from --seed), on a JSONL corpus of byte-level documents."""
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=2, vocab_size=320,
                             max_position_embeddings=256).save_pretrained(tmp_path / "model")
    sources = sorted((os.path.dirname(H.__file__) + "/" + f) for f in os.listdir(os.path.dirname(H.__file__)))
    texts = [open(f).read()[i:i + 300] for f in sources if f.endswith(".py") for i in (0, 400, 800)]
    with open(tmp_path / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    run_distributed(_finetune_body, 2, str(tmp_path), timeout_s=300)


def test_finetune_hf_bad_model_dir_names_the_flag(tmp_path):
    from cp_rope.launch.config import ConfigError
    from cp_rope.launch.finetune_hf import main

    with pytest.raises(ConfigError, match="--model DIR"):
        main(["--device", "cpu"])
    with pytest.raises(ConfigError, match="hf.model=.*not a local directory with config.json.*"
                                          "never downloads"):
        main(["--model", "meta-llama/Llama-3.2-1B", "--device", "cpu"])
    transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        main(["--model", str(tmp_path / "gpt2"), "--device", "cpu"])
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=1, vocab_size=100,
                             ).save_pretrained(tmp_path / "small")
    with pytest.raises(ConfigError, match="259 ids .* vocab_size is 100"):
        main(["--model", str(tmp_path / "small"), "--device", "cpu"])
