"""The trainers' configuration (cp_rope.launch.config / cli): config files (JSON, TOML) and flag
values the trainers refuse, each with a ConfigError naming the field, the value and the reason.

The bad-input kinds of issue 15 and round 3 (docs/bad_input_round3.md) about configuration live
here; tests/test_bad_input_catalogue.py lists every catalogued kind with its test. The flags'
wiring, presets and precedence are tested with the trainer in tests/test_pretrain.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from utils import tiny_pretrain_argv

from cp_rope.launch.config import ConfigError
from cp_rope.launch.pretrain import main

SMALL = tiny_pretrain_argv(seq_len=64, tokens_per_batch=256, max_docs=16)


# ------------------------------------------------------------------ config files
def _config_file(tmp_path, mapping) -> str:
    f = tmp_path / "c.json"
    f.write_text(json.dumps(mapping))
    return str(f)


@pytest.mark.parametrize("section,name", [("optim", "lr"), ("train", "stop_grace_s"),
                                          ("optim", "grad_clip")])
def test_config_file_boolean_for_a_float_field(tmp_path, section, name):
    f = _config_file(tmp_path, {section: {name: True}})
    with pytest.raises(ConfigError, match=rf"{section}\.{name}=True: expected float, got a boolean"):
        main(["--config", f, "--out-dir", str(tmp_path / "o")])


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


def test_config_file_duplicate_key(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('{"optim": {"lr": 0.1, "lr": 0.002}}')
    with pytest.raises(ConfigError, match=r"c\.json.*key 'lr' is given twice"):
        main(["--config", str(f), "--out-dir", str(tmp_path / "o")])


def test_config_file_top_level_not_an_object(tmp_path):
    f = tmp_path / "c.json"
    f.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"c\.json.*object"):
        main(["--config", str(f), "--out-dir", str(tmp_path)])


def test_config_file_n_layers_true(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"model": {"n_layers": True}}))
    with pytest.raises(ConfigError, match=r"model\.n_layers=True"):
        main(["--config", str(f), "--out-dir", str(tmp_path)])


# ------------------------------------------------------------------ flag values
def test_dtype_bfloat16_with_device_auto_on_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"train\.dtype='bfloat16'.*cpu"):
        main(SMALL + ["--steps", "1", "--dtype", "bfloat16", "--out-dir", str(tmp_path)])


def test_seed_negative(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.seed=-3"):
        main(SMALL + ["--steps", "1", "--seed", "-3", "--out-dir", str(tmp_path)])


def test_lr_inf(tmp_path):
    with pytest.raises(ConfigError, match=r"optim\.lr=inf.*finite"):
        main(SMALL + ["--steps", "1", "--lr", "inf", "--out-dir", str(tmp_path)])


def test_timeout_s_too_large(tmp_path):
    with pytest.raises(ConfigError, match=r"parallel\.timeout_s=100000000000000.*\[1, 604800\]"):
        main(SMALL + ["--steps", "1", "--timeout-s", "100000000000000", "--out-dir", str(tmp_path)])


def test_stop_at_step_above_steps(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.stop_at_step=9: must be <= train\.steps=3"):
        main(SMALL + ["--steps", "3", "--stop-at-step", "9", "--out-dir", str(tmp_path)])


def test_eval_every_without_held_out_documents(tmp_path):
    # tiny_pretrain_argv holds out no documents (--eval-docs 0): --eval-every would be ignored
    with pytest.raises(ConfigError, match=r"train\.eval_every \(--eval-every\)=1: .*--eval-docs 0"):
        main(SMALL + ["--steps", "1", "--eval-every", "1", "--out-dir", str(tmp_path)])


def test_finetune_eval_every_without_held_out_documents():
    from cp_rope.launch.finetune_hf import parse_args
    with pytest.raises(ConfigError, match=r"train\.eval_every \(--eval-every\)=1: .*--eval-docs 0"):
        parse_args(["--model", "m", "--eval-every", "1", "--eval-docs", "0"])


# ------------------------------------------------------------------ issue 35, class 5
@pytest.mark.parametrize("seed", [2**63, 2**64, 2**80])
def test_seed_too_large_for_a_64_bit_generator(tmp_path, seed):
    """Before: 2**64 passed the check and overflowed raw in torch.manual_seed."""
    with pytest.raises(ConfigError, match=rf"train\.seed={seed}: must be in \[0, 2\*\*63\)"):
        main(SMALL + ["--steps", "1", "--seed", str(seed), "--out-dir", str(tmp_path)])


@pytest.mark.parametrize("mapping,match", [
    # an empty string from a file was None: the default corpus trained instead of an error
    ({"data": {"data": ""}}, r"data\.data='': no such file or directory"),
    # the file's eval_every with no held-out documents was ignored (the flag was refused)
    ({"data": {"eval_docs": 0}, "train": {"eval_every": 5}},
     r"train\.eval_every \(--eval-every\)=5: there is nothing to evaluate with --eval-docs 0"),
])
def test_config_file_values_get_the_command_lines_checks(tmp_path, mapping, match):
    f = _config_file(tmp_path, mapping)
    with pytest.raises(ConfigError, match=match):
        main(["--config", f, "--steps", "1", "--out-dir", str(tmp_path / "o")])


def test_config_file_eval_every_with_held_out_documents_from_the_command_line(tmp_path):
    """The valid counterpart: the file's eval_every with --eval-docs given on the command line."""
    from cp_rope.launch.cli import parse_args
    f = _config_file(tmp_path, {"data": {"eval_docs": 0}, "train": {"eval_every": 5}})
    cfg = parse_args(["--config", f, "--eval-docs", "3"])
    assert (cfg.train.eval_every, cfg.data.eval_docs) == (5, 3)


def test_allow_fresh_start_is_for_resume(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.allow_fresh_start=True: is for --resume"):
        main(SMALL + ["--steps", "1", "--allow-fresh-start", "--out-dir", str(tmp_path)])


def test_head_dim_other_than_dim_over_heads(tmp_path):
    """--head-dim (Qwen3 / GPT-OSS style: heads of their own width) in the native model: a
    model of dim 32 with 2 heads of 8 trains; an odd head_dim, a negative one, and dim not
    divisible by the heads without --head-dim are refused naming the field."""
    import math

    from cp_rope.launch.config import ModelConfig
    from cp_rope.launch.model import Transformer

    out = main([*SMALL, "--head-dim", "8", "--steps", "2", "--out-dir", str(tmp_path / "o")])
    assert out["steps_run"] == 2 and all(math.isfinite(x) for x in out["losses"].values())
    saved = json.loads((tmp_path / "o" / "config.json").read_text())
    assert saved["model"]["head_dim"] == 8
    model = Transformer(ModelConfig(dim=32, n_heads=2, n_kv_heads=1, head_dim=8, vocab_size=64,
                                    max_seq_len=16))
    assert model.layers[0].attention.wq.weight.shape == (2 * 8, 32)
    for flags, match in ((["--head-dim", "7"], r"model\.head_dim=7: must be even for RoPE"),
                         (["--head-dim", "-2"], r"model\.head_dim=-2: must be >= 0"),
                         (["--dim", "30", "--n-heads", "4"],
                          r"model\.dim=30: must be divisible by model\.n_heads=4 \(or set "
                          r"model\.head_dim\)")):
        with pytest.raises(ConfigError, match=match):
            main([*SMALL, *flags, "--steps", "1", "--out-dir", str(tmp_path / "x")])
