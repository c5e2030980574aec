"""cp_rope.hf's doors refusing what they cannot run, each naming the argument or file:
``load_causal_lm`` / ``finetune_hf --model`` on damaged model directories, ``patch_model`` after
a cast that rounded the rotary frequencies, token ids outside the vocabulary.

(Round 3 of the bad-input catalogue, docs/bad_input_round3.md; the parity of the patched model
is tests/test_hf.py.) Tiny random Llama models built from configs, no downloads.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from cp_rope.launch.config import ConfigError

transformers = pytest.importorskip("transformers")  # the hf extra; scripts/setup.sh installs it


# ------------------------------------------------------------------ patch_model
def _llama(**kw):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=1,
                                   **{"vocab_size": 100, **kw})
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("cast", ["bfloat16", "half"])
def test_patch_model_after_cast_says_why(cast):
    from cp_rope.hf import patch_model
    model = getattr(_llama(), cast)()
    with pytest.raises(ValueError, match=r"inv_freq is torch\.(bfloat16|float16), its config's "
                                         r"frequencies rounded.*was cast.*from_pretrained"):
        patch_model(model)


def test_patch_model_before_cast_runs():
    """The remedy the message gives works: patch first, then cast."""
    from cp_rope.hf import patch_model
    model = patch_model(_llama())
    model.bfloat16()
    assert model.cp_rope_patch.rope_kernel


def test_patched_model_input_id_outside_vocab():
    from cp_rope.hf import model_inputs, patch_model
    from cp_rope.parallel import PackingCollator
    model = patch_model(_llama())
    batch = PackingCollator()([{"input_ids": torch.tensor([1, 2, 100, 3])}])
    with pytest.raises(ValueError, match=r"input_ids holds token id 100.*vocab_size=100"):
        model(**model_inputs(batch))


def test_patch_model_float64_with_the_rope_kernel_says_rope_kernel_false():
    """Round 4 #19: before, the patch was accepted and the forward failed in cp_rope/ops.py
    naming a q the user never passed. Refused at patch_model (and at the forward of a model
    cast after the patch); rope_kernel=False runs float64."""
    from cp_rope.hf import model_inputs, patch_model
    from cp_rope.parallel import PackingCollator
    with pytest.raises(ValueError, match=r"rope_kernel=True: cp_rope's RoPE kernel runs float32, "
                                         r"float16 and bfloat16; this model is torch\.float64: "
                                         r"pass rope_kernel=False"):
        patch_model(_llama().double())
    inputs = model_inputs(PackingCollator()([[1, 2, 3, 4]]))
    assert patch_model(_llama().double(), rope_kernel=False)(**inputs).logits.dtype == torch.float64
    cast_after = patch_model(_llama()).double()
    with pytest.raises(ValueError, match=r"this model is torch\.float64: pass rope_kernel=False"):
        cast_after(**inputs)


def test_patched_model_empty_batch_named():
    """Round 4 #20: before, transformers' 'cannot reshape tensor of 0 elements'."""
    from cp_rope.hf import model_inputs, patch_model
    from cp_rope.parallel import PackingCollator
    model = patch_model(_llama())
    with pytest.raises(ValueError, match=r"batch: no tokens \(T = 0 rows.*pad_to_multiple"):
        model(**model_inputs(PackingCollator()([])))
    assert model(**model_inputs(PackingCollator(pad_to_multiple=4)([]))).logits.shape == (1, 4, 100)


# ------------------------------------------------------------------ damaged --model directories
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "small"
    _llama(max_position_embeddings=256, vocab_size=320).save_pretrained(d)
    return d


def _finetune(path, tmp_path):
    from cp_rope.launch.finetune_hf import main as finetune
    return finetune(["--model", str(path), "--device", "cpu", "--out-dir", str(tmp_path / "o")])


def _damaged(model_dir, tmp_path, damage) -> str:
    d = tmp_path / "damaged"
    shutil.copytree(model_dir, d)
    damage(d)
    return str(d)


def test_model_dir_corrupt_config_json(model_dir, tmp_path):
    d = _damaged(model_dir, tmp_path, lambda d: (d / "config.json").write_text("{not json"))
    with pytest.raises(ConfigError, match=r"hf\.model=.*damaged.*config\.json cannot be read"):
        _finetune(d, tmp_path)


def test_model_dir_truncated_safetensors(model_dir, tmp_path):
    def truncate(d):
        f = d / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    d = _damaged(model_dir, tmp_path, truncate)
    with pytest.raises(ConfigError, match=r"hf\.model=.*damaged.*weights cannot be loaded"):
        _finetune(d, tmp_path)


@pytest.mark.parametrize("field,value", [("intermediate_size", 96), ("num_hidden_layers", 2)])
def test_model_dir_config_disagrees_with_weights(model_dir, tmp_path, field, value):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg[field] = value
        (d / "config.json").write_text(json.dumps(cfg))
    d = _damaged(model_dir, tmp_path, edit)
    with pytest.raises(ConfigError, match=r"hf\.model=.*damaged.*(weights cannot be loaded|"
                                          r"do not match config\.json)"):
        _finetune(d, tmp_path)


@pytest.mark.parametrize("window", [0, -4])
def test_model_dir_sliding_window_below_one_named(tmp_path, window):
    """Round 4 #13: before, a [rank0] traceback at the first forward ('window must be >= 1')
    naming neither config.json nor sliding_window."""
    from cp_rope.hf import patch_model
    cfg = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                     num_key_value_heads=2, num_hidden_layers=1, vocab_size=320,
                                     sliding_window=16)
    d = tmp_path / "mistral"
    cfg.save_pretrained(d)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "sliding_window": window}))
    with pytest.raises(ConfigError, match=rf"hf\.model=.*mistral.*: config\.sliding_window="
                                          rf"{window}: must be an int >= 1"):
        _finetune(d, tmp_path)
    model = transformers.MistralForCausalLM(cfg)
    model.config.sliding_window = window
    with pytest.raises(ValueError, match=rf"config\.sliding_window={window}: must be an int >= 1"):
        patch_model(model)


def test_load_causal_lm_intact_dir_loads(model_dir):
    """The valid counterpart: the same directory undamaged loads with its weights."""
    from cp_rope.hf import load_causal_lm
    model, loaded = load_causal_lm(str(model_dir))
    assert loaded
    ref = transformers.LlamaForCausalLM.from_pretrained(model_dir)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_head_dim_of_the_config_not_hidden_over_heads(tmp_path):
    """GPT-OSS's shapes (hidden 2,880 over 64 heads of 64: hidden / heads = 45, odd): before,
    finetune_hf refused them ('head_dim = dim / n_heads = 45 must be even for RoPE') and used
    hidden / heads for the MFU and the backend checks. The trainer's model section takes
    config.head_dim (here hidden 36 over 4 heads = 9, head_dim 8)."""
    from cp_rope.launch.config import head_dim_of, validate
    from cp_rope.launch.finetune_hf import parse_args, resolve
    from cp_rope.launch.metrics import flops_per_step

    cfg = transformers.Qwen3Config(hidden_size=36, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, num_hidden_layers=1,
                                   vocab_size=320)
    cfg.save_pretrained(tmp_path / "m")
    run = resolve(parse_args(["--model", str(tmp_path / "m"), "--device", "cpu"]))
    validate(run)
    assert (run.model.head_dim, head_dim_of(run.model)) == (8, 8)
    # attention FLOPs: 6 L^2 n_heads head_dim per layer (L = 10: one sequence)
    assert flops_per_step(run.model, 0, 10, 100) == 6.0 * 100 * 4 * 8
