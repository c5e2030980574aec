"""Issue 22 (reliability, round 3): one case per kind a careful user found silent, raw or misleading.

Each test asserts the clear outcome (an exception of the documented type whose message
names the argument, flag, field or file). Kinds guarded beside the code they concern
(the plan's agreement, checkpoints) are listed in :data:`ELSEWHERE` with the test that
covers them; ``test_round3_catalogue_is_complete`` keeps that table honest.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import transformers
from utils import tiny_pretrain_argv

from cp_rope.launch.config import ConfigError
from cp_rope.launch.pretrain import main

TINY = tiny_pretrain_argv(seq_len=64, tokens_per_batch=256, max_docs=16)
HERE = os.path.dirname(os.path.abspath(__file__))

# kind (issue 22 item) -> where its regression test lives, for kinds fixed outside this file
ELSEWHERE: dict[str, str] = {}


def _config_file(tmp_path, mapping) -> str:
    f = tmp_path / "c.json"
    f.write_text(json.dumps(mapping))
    return str(f)


# ------------------------------------------------------------------ item 2: booleans for numbers
@pytest.mark.parametrize("section,name", [("optim", "lr"), ("train", "stop_grace_s"),
                                          ("optim", "grad_clip")])
def test_config_file_boolean_for_a_float_field(tmp_path, section, name):
    f = _config_file(tmp_path, {section: {name: True}})
    with pytest.raises(ConfigError, match=rf"{section}\.{name}=True: expected float, got a boolean"):
        main(["--config", f, "--out-dir", str(tmp_path / "o")])


# ------------------------------------------------------------------ item 3: null / false for strings
def test_config_file_null_for_a_string_field(tmp_path):
    f = _config_file(tmp_path, {"train": {"out_dir": None}})
    with pytest.raises(ConfigError, match=r"train\.out_dir=null: expected str"):
        main(["--config", f])
    assert not os.path.exists("None")


def test_config_file_false_for_an_optional_string_field(tmp_path):
    f = _config_file(tmp_path, {"data": {"tokenizer": False}})
    with pytest.raises(ConfigError, match=r"data\.tokenizer=False: expected str, got a boolean"):
        main(["--config", f, "--out-dir", str(tmp_path / "o")])


def test_config_file_number_for_a_string_field(tmp_path):
    f = _config_file(tmp_path, {"train": {"out_dir": 5}})
    with pytest.raises(ConfigError, match=r"train\.out_dir=5: expected a string"):
        main(["--config", f])


def test_config_file_null_for_an_optional_field_is_none(tmp_path):
    """The valid counterpart: null of an Optional field is None (a run, not an error)."""
    from cp_rope.launch.cli import apply_mapping
    from cp_rope.launch.config import preset
    cfg = apply_mapping(preset("tiny"), {"train": {"stop_at_step": None}}, "file")
    assert cfg.train.stop_at_step is None


# ------------------------------------------------------------------ item 10: huge timeout
def test_timeout_s_too_large(tmp_path):
    with pytest.raises(ConfigError, match=r"parallel\.timeout_s=100000000000000.*\[1, 604800\]"):
        main(TINY + ["--steps", "1", "--timeout-s", "100000000000000", "--out-dir", str(tmp_path)])


# ------------------------------------------------------------------ item 11: lone surrogate
def test_jsonl_lone_surrogate_names_file_and_line(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "fine"}\n{"text": "bad \\ud800 text"}\n')
    with pytest.raises(ConfigError, match=r"c\.jsonl.*line 2.*'\\ud800'.*surrogate"):
        main(TINY + ["--steps", "1", "--data", str(f), "--out-dir", str(tmp_path / "o")])


# ------------------------------------------------------------------ item 14: --stop-at-step > --steps
def test_stop_at_step_above_steps(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.stop_at_step=9: must be <= train\.steps=3"):
        main(TINY + ["--steps", "3", "--stop-at-step", "9", "--out-dir", str(tmp_path)])


# ------------------------------------------------------------------ item 6: patch_model after a cast
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


# ------------------------------------------------------------------ item 9: damaged --model dirs
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


def test_load_causal_lm_intact_dir_loads(model_dir):
    """The valid counterpart: the same directory undamaged loads with its weights."""
    from cp_rope.hf import load_causal_lm
    model, loaded = load_causal_lm(str(model_dir))
    assert loaded
    ref = transformers.LlamaForCausalLM.from_pretrained(model_dir)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_round3_catalogue_is_complete():
    """Every kind fixed elsewhere names a test that exists."""
    import ast
    for kind, where in ELSEWHERE.items():
        module, name = where.split("::")
        tree = ast.parse(open(os.path.join(HERE, module)).read())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in names, (kind, where)


# ------------------------------------------------------------------ item 14: an id == vocab_size
def test_native_model_input_id_outside_vocab():
    from cp_rope.launch.config import ModelConfig
    from cp_rope.launch.model import Transformer
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                    ffn_hidden_dim=64, vocab_size=50, max_seq_len=64))
    ids = torch.randint(0, 50, (8,))
    ids[5] = 50
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"input_ids holds token id 50.*\[0, 50\)"):
        model(ids, cu, 8)


def test_patched_model_input_id_outside_vocab():
    from cp_rope.hf import model_inputs, patch_model
    from cp_rope.parallel import PackingCollator
    model = patch_model(_llama())
    batch = PackingCollator()([{"input_ids": torch.tensor([1, 2, 100, 3])}])
    with pytest.raises(ValueError, match=r"input_ids holds token id 100.*vocab_size=100"):
        model(**model_inputs(batch))
