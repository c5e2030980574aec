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
ELSEWHERE: dict[str, str] = {
    "1 softmax_scale outside the agreement": "test_plan_api.py::test_arguments_agree_across_ranks",
    "4a/4b rank-local argument errors wait for the timeout":
        "test_plan_api.py::test_arguments_agree_across_ranks",
    "4c plan= on one rank only": "test_plan_api.py::test_plan_on_one_rank_only_is_a_clear_error",
    "5 plan changed in place / attributes assigned":
        "test_plan_api.py::test_plans_are_read_only_and_refuse_in_place_changes",
    "7 another run's checkpoint": "test_checkpoint_integrity.py::test_load_refuses_another_run_before_reading",
    "7 another run's checkpoint, end to end":
        "test_checkpoint_integrity.py::test_resume_refuses_a_checkpoint_of_another_run",
    "8 a failed save": "test_checkpoint_integrity.py::test_failed_save_keeps_the_last_good_one_and_says_why",
    "8 a failed save's traceback": "test_checkpoint_integrity.py::test_failed_dcp_write_is_one_line_not_a_traceback",
    "8 keep + 1 checkpoints of space": "test_checkpoint_integrity.py::test_space_for_keep_plus_one",
    "12 checksums.json incomplete":
        "test_checkpoint_integrity.py::test_resume_skips_a_damaged_newest_checkpoint",
    "13 per-document plan's method": "test_plan_api.py::test_per_document_plan_method_is_the_plans",
    "14 CPAttentionPlan.build(device=3)": "test_plan_api.py::test_build_device_without_cuda_names_device",
    "14 patch_model group='world', cu_seq_lens_k":
        "test_plan_api.py::test_hf_plans_once_per_forward_and_runs_per_document",
}


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


# ================================================================== fresh pass (issue 22, bullet 2)
# Kinds found by a new-user pass over the round's new surfaces (/work/notes/round3_pass.md).

def _loss_disagreement_body(rank: int, world: int) -> None:
    import torch.distributed as dist

    from cp_rope.parallel import cp_cross_entropy, cp_linear_cross_entropy
    g = torch.Generator().manual_seed(7)
    h = torch.randn(6, 8, dtype=torch.float64, generator=g)
    w = torch.randn(11, 8, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 11, (6,), generator=g)

    def expect(fn, mine, other):
        with pytest.raises((ValueError, RuntimeError), match=mine if rank == 1 else other):
            fn()

    bad = labels.clone()
    if rank == 1:
        bad[0] = 11  # a label outside the vocabulary on one rank only
    # the refusing rank raises its own error, the other one names it (no wait, no gloo timeout)
    expect(lambda: cp_cross_entropy(h @ w.T, bad), r"labels must be in \[0, 11\)",
           r"cp_cross_entropy: rank 1 of the group refused its arguments")
    expect(lambda: cp_linear_cross_entropy(h, w, bad), r"labels must be in \[0, 11\)",
           r"cp_linear_cross_entropy: rank 1 of the group refused its arguments")
    expect(lambda: cp_linear_cross_entropy(h, w, labels, chunk_size=4 if rank == 0 else 0),
           r"chunk_size=0", r"rank 1 of the group refused")
    # arguments that must agree across the group: an error naming the field on every rank
    for kw, field in [({"ignore_index": -100 if rank == 0 else 0}, "ignore_index"),
                      ({"softcap": 30.0 if rank == 0 else None}, "softcap")]:
        with pytest.raises(RuntimeError, match=rf"disagree on {field}"):
            cp_linear_cross_entropy(h, w, labels, **kw)
    with pytest.raises(RuntimeError, match=r"disagree on V \(weight\.shape\[0\]\)"):
        cp_linear_cross_entropy(h, w[: 11 - rank], labels.clamp(max=9))
    with pytest.raises(RuntimeError, match=r"disagree on ignore_index"):
        cp_cross_entropy(h @ w.T, labels, ignore_index=-100 if rank == 0 else 0)
    # the group still works, and agrees with the unfused loss
    fused = cp_linear_cross_entropy(h, w, labels, group=dist.group.WORLD)
    assert torch.allclose(fused, cp_cross_entropy(h @ w.T, labels), rtol=1e-12, atol=0)


def test_loss_refused_on_one_rank_is_an_error_on_every_rank():
    from dist_utils import run_distributed
    run_distributed(_loss_disagreement_body, 2, timeout_s=30)


@pytest.mark.parametrize("which", ["cp_cross_entropy", "cp_linear_cross_entropy"])
def test_loss_group_not_a_process_group(which):
    import cp_rope.parallel as P
    h, w, labels = torch.randn(4, 8), torch.randn(5, 8), torch.randint(0, 5, (4,))
    args = (h @ w.T, labels) if which == "cp_cross_entropy" else (h, w, labels)
    with pytest.raises(TypeError, match=r"group must be a torch\.distributed ProcessGroup or "
                                        r"None, got str 'world'"):
        getattr(P, which)(*args, group="world")


def _tiled(fn, x, tile=3, params=(), **kw):
    from cp_rope.parallel import tiled_mlp
    return tiled_mlp(fn, x, tile, list(params), **kw)


@pytest.mark.parametrize("shape,dim", [((10, 8), 5), ((10,), -2), ((10, 8), 2)])
def test_tiled_mlp_dim_not_a_dimension(shape, dim):
    lin = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match=rf"dim={dim}: not a dimension of x"):
        _tiled(lin, torch.randn(shape, requires_grad=True), params=lin.parameters(), dim=dim)


def test_tiled_mlp_fn_not_position_wise():
    x = torch.randn(10, 8, requires_grad=True)
    with pytest.raises(ValueError, match=r"fn: not position-wise along dim=0"):
        _tiled(lambda t: t[:1] * 2, x)


@pytest.mark.parametrize("fn,params,match", [(None, (), r"fn must be callable"),
                                             (torch.tanh, (1.0,), r"params must be tensors")])
def test_tiled_mlp_fn_or_params_of_the_wrong_type(fn, params, match):
    with pytest.raises(TypeError, match=match):
        _tiled(fn, torch.randn(10, 8, requires_grad=True), params=params)


def test_config_file_duplicate_key(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('{"optim": {"lr": 0.1, "lr": 0.002}}')
    with pytest.raises(ConfigError, match=r"c\.json.*key 'lr' is given twice"):
        main(["--config", str(f), "--out-dir", str(tmp_path / "o")])


def test_eval_every_without_held_out_documents(tmp_path):
    # tiny_pretrain_argv holds out no documents (--eval-docs 0): --eval-every would be ignored
    with pytest.raises(ConfigError, match=r"train\.eval_every \(--eval-every\)=1: .*--eval-docs 0"):
        main(TINY + ["--steps", "1", "--eval-every", "1", "--out-dir", str(tmp_path)])


def test_eos_id_for_a_text_corpus(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "some text"}\n')
    with pytest.raises(ConfigError, match=r"data\.eos_id=999: is for a pre-tokenized \.bin"):
        main(TINY + ["--steps", "1", "--data", str(f), "--eos-id", "999",
                     "--out-dir", str(tmp_path / "o")])


def test_tokenizer_bpe_outside_pretrain_says_why():
    from cp_rope.launch.config import DataConfig
    from cp_rope.launch.data import load_tokenizer
    with pytest.raises(ConfigError, match=r"--tokenizer bpe.*pretrain only.*finetune_hf needs"):
        load_tokenizer(DataConfig(tokenizer="bpe"))


def test_resume_with_bpe_vocab_size_of_a_bytes_run(tmp_path):
    """--bpe-vocab-size is read only by a BPE run: a bytes run resumes whatever its value."""
    main(TINY + ["--steps", "1", "--out-dir", str(tmp_path)])
    summary = main(TINY + ["--steps", "2", "--resume", "--bpe-vocab-size", "8000",
                           "--out-dir", str(tmp_path)])
    assert (summary["start_step"], summary["steps_run"]) == (1, 1)


def test_auto_at_cp_1_runs_what_the_methods_run():
    """At cp 1 nothing is split: auto takes any lengths and either layout, as ring does."""
    from cp_rope.parallel import attention_plan, place_documents
    kw = dict(q_heads=4, kv_heads=2, head_dim=8, dtype=torch.float32)
    odd = torch.tensor([0, 5, 12], dtype=torch.int32)
    assert attention_plan(odd, 7, method="ring", **kw).method == "ring"
    assert attention_plan(odd, 7, method="auto", **kw).method == "ring"
    assert attention_plan(odd, 7, placement="auto", **kw).kind == "zigzag"
    placed = place_documents(torch.tensor([0, 6, 14, 22], dtype=torch.int32), 1, 6)
    assert attention_plan(placed, method="auto", **kw).kind == "per_document"


def _self_test_disagreement_body(rank: int, world: int) -> None:
    import torch.distributed as dist

    from cp_rope.parallel import SelfTestError, self_test
    g = dist.group.WORLD
    # a rank-local refusal before the CP run: every rank gets the error, none waits
    with pytest.raises(SelfTestError, match=r"rank 1: ValueError: head_dim=7"):
        self_test(g, head_dim=32 if rank == 0 else 7)
    # the test's own seed must agree (else each rank builds other data and CP is blamed)
    with pytest.raises(SelfTestError, match=r"seed differs across the ranks: \[0, 1\]"):
        self_test(g, seed=rank)
    assert self_test(g).errors  # still usable


def test_self_test_arguments_agree_across_ranks():
    from dist_utils import run_distributed
    run_distributed(_self_test_disagreement_body, 2, timeout_s=30)


@pytest.mark.parametrize("kw,match", [
    ({"device": "cuda"}, r"device='cuda': CUDA is not available"),
    ({"seed": "a"}, r"TypeError: seed must be an int, got str"),
    ({"dtype": torch.int32}, r"TypeError: dtype must be one of"),
    ({"head_dim": 0}, r"ValueError: head_dim=0: must be an even int >= 2"),
])
def test_self_test_own_arguments(kw, match):
    from cp_rope.parallel import SelfTestError, self_test
    if "device" in kw and torch.cuda.is_available():
        pytest.skip("the case of a build without CUDA")
    with pytest.raises(SelfTestError, match=match):
        self_test(**kw)


@pytest.mark.parametrize("flags,match", [
    (["--tokens", "0"], r"--tokens must be >= 2"),
    (["--iters", "0"], r"--iters must be >= 1"),
    (["--iters", "-1"], r"--iters must be >= 1"),
    (["--backend", "flsh"], r"--backend: 'flsh' is not one of"),
    (["--out", "/nonexistent/dir/c.json"], r"--out: cannot write .*/nonexistent/dir"),
])
def test_calibrate_flags(tmp_path, capsys, flags, match):
    from cp_rope.parallel.calibrate import main as calibrate
    with pytest.raises(SystemExit) as exc:
        calibrate(["--out", str(tmp_path / "c.json"), *flags])
    assert exc.value.code == 2
    assert __import__("re").search(match, capsys.readouterr().err)
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("flags,match", [
    (["--gpu-memory-gib", "nan"], r"--gpu-memory-gib must be a finite number > 0"),
    (["--gpu-memory-gib", "inf"], r"--gpu-memory-gib must be a finite number > 0"),
    (["--host-memory-gib", "-3"], r"--host-memory-gib must be a finite number >= 0"),
    (["--mlp-tile-tokens", "-1"], r"--mlp-tile-tokens must be >= 0"),
    (["--vocab-size", "-1"], r"--vocab-size must be >= 0"),
    (["--doc-len", "-2"], r"--doc-len must be >= 0"),
    (["--doc-len", "9000"], r"--doc-len must be <= --seq-len"),
    (["--preset", "huge"], r"preset='huge': expected one of"),
    (["--preset", None, "--model", "/nonexistent"], r"model='/nonexistent': no config\.json"),
])
def test_plan_memory_flags(capsys, flags, match):
    from cp_rope.launch.plan_memory import main as plan_memory
    argv = ["--preset", "tiny", "--seq-len", "4096", *flags]
    if None in argv:  # --model instead of --preset
        argv = ["--seq-len", "4096", *flags[2:]]
    with pytest.raises(SystemExit) as exc:
        plan_memory(argv)
    assert exc.value.code == 2
    assert __import__("re").search(match, capsys.readouterr().err)


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("logged")
    rec = {"step": 1, "loss": 5.0, "lr": 1e-3, "tokens_per_s_per_gpu": 10.0, "peak_mem_gib": 0.1}
    (d / "metrics.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps({**rec, "step": 2}) + "\n")
    return d


def test_plot_out_without_extension_names_the_file_written(logged_run, tmp_path):
    pytest.importorskip("matplotlib")
    from cp_rope.launch.plot import plot_runs
    target = tmp_path / "report"
    assert plot_runs([str(logged_run)], str(target)) == str(target) + ".png"
    assert os.path.isfile(str(target) + ".png")
    with pytest.raises(ValueError, match=r"out=.*is a directory"):
        plot_runs([str(logged_run)], str(tmp_path))


def test_plot_damaged_metrics_says_damaged(tmp_path):
    from cp_rope.launch.plot import load_metrics
    (tmp_path / "metrics.jsonl").write_text("{not json\n{nor this\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl: 2 lines are not JSON records"):
        load_metrics(str(tmp_path))


@pytest.mark.parametrize("kw,match", [({"scaling": "linear"}, r"scaling must be a mapping"),
                                      ({"interleaved": "no"}, r"interleaved must be a bool")])
def test_rotary_embedding_argument_types(kw, match):
    from cp_rope import RotaryEmbedding
    with pytest.raises(TypeError, match=match):
        RotaryEmbedding(8, 64, **kw)


def test_finetune_eval_every_without_held_out_documents():
    from cp_rope.launch.finetune_hf import parse_args
    with pytest.raises(ConfigError, match=r"train\.eval_every \(--eval-every\)=1: .*--eval-docs 0"):
        parse_args(["--model", "m", "--eval-every", "1", "--eval-docs", "0"])


def test_numpy_integers_for_chunk_size_and_tile_tokens():
    """Integers of numpy (a config read with numpy, a sweep) are ints, as everywhere in cp_rope."""
    import numpy as np

    from cp_rope.parallel import cp_linear_cross_entropy
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(6, 8, dtype=torch.float64, generator=g), torch.randn(11, 8, dtype=torch.float64,
                                                                            generator=g)
    labels = torch.randint(0, 11, (6,), generator=g)
    ref = cp_linear_cross_entropy(h, w, labels, chunk_size=4)
    assert torch.equal(cp_linear_cross_entropy(h, w, labels, chunk_size=np.int64(4)), ref)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(10, 8, requires_grad=True)
    assert torch.equal(_tiled(lin, x, np.int64(3), lin.parameters()), _tiled(lin, x, 3, lin.parameters()))


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


def test_rope_max_position_id_without_explicit_positions_names_them():
    """The positions come from cu_seqlens here: the error must not name start_positions."""
    from cp_rope import RotaryEmbedding
    rope = RotaryEmbedding(8, 64)
    q, k = torch.randn(12, 4, 8), torch.randn(12, 2, 8)
    with pytest.raises(ValueError, match=r"^positions \(from cu_seqlens\): position 6 exceeds "
                                         r"max_position_id \(3\)"):
        rope(q, k, torch.tensor([0, 5, 12], dtype=torch.int32), max_position_id=3)
