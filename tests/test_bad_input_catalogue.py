"""The bad-input catalogues: every kind of bad input a careful new user tried, and the test that
guards it in its room (issue 15; issue 22 with its round-3 pass, docs/bad_input_round3.md).

Each named test asserts the *clear* outcome: an exception of the documented type whose message
names the argument, flag, field or file (or, where an input is valid after all, the right
result). A kind that turns silent or raw again makes its test fail. The tests once lived in two
per-round files (test_bad_input.py, test_bad_input_round3.py); they now live beside the code they
concern, and the tests below keep these tables, the docs table and the tests in step (a test
renamed or moved without its entry fails here).
"""

from __future__ import annotations

import ast
import functools
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(os.path.dirname(HERE), "docs", "bad_input_round3.md")

# issue 15: kind -> (was, "file::test" or "file::test[param id]"); every test asserts a clear outcome
ISSUE_15: dict[str, tuple[str, str]] = {
    # -- silently wrong in issue 15
    "checkpoint shard with flipped bytes": (
        "silent", "test_checkpoint_integrity.py::test_checkpoint_shard_with_flipped_bytes"),
    "--dtype bfloat16 with --device auto on cpu": (
        "silent", "test_config.py::test_dtype_bfloat16_with_device_auto_on_cpu"),
    "--resume with config.json missing": ("silent", "test_pretrain.py::test_resume_with_config_json_missing"),
    "cross-rank cu_seqlens with equal weighted sums": (
        "silent", "test_attention.py::test_cp_attention_matches_single_process"),  # _errors_across_ranks
    "rope_cache base=inf": ("silent", "test_rope_cache.py::test_rope_cache_base_inf"),
    "rope_cache scaling factor=inf": ("silent", "test_rope_cache.py::test_rope_cache_scaling_factor_inf"),
    "softmax_scale=inf": ("silent", "test_attention.py::test_softmax_scale_inf"),
    "causal='no'": ("silent", "test_attention.py::test_causal_not_a_bool"),
    "1-process unshard with float cu_seqlens": ("silent", "test_sharding.py::test_unshard_float_cu_seqlens"),
    "1-process unshard with decreasing cu_seqlens": (
        "silent", "test_sharding.py::test_unshard_decreasing_cu_seqlens"),
    "shard_batch with a wrong batch.max_seqlen": ("silent", "test_sharding.py::test_shard_batch_wrong_max_seqlen"),
    "sampler load_state_dict batches_consumed=1.7": (
        "silent", "test_packing.py::test_sampler_batches_consumed_float"),
    'config file "n_layers": true': ("silent", "test_config.py::test_config_file_n_layers_true"),
    # -- raw or misleading in issue 15
    "newest checkpoint: truncated .metadata": (
        "raw", "test_checkpoint_integrity.py::test_resume_skips_a_damaged_newest_checkpoint[truncated_metadata]"),
    "newest checkpoint: empty .metadata": (
        "raw", "test_checkpoint_integrity.py::test_resume_skips_a_damaged_newest_checkpoint[empty_metadata]"),
    "newest checkpoint: missing shard": (
        "raw", "test_checkpoint_integrity.py::test_resume_skips_a_damaged_newest_checkpoint[missing_shard]"),
    "newest checkpoint: truncated shard": (
        "raw", "test_checkpoint_integrity.py::test_resume_skips_a_damaged_newest_checkpoint[truncated_shard]"),
    "metrics.jsonl with a truncated last line": ("raw", "test_pretrain.py::test_metrics_jsonl_truncated_last_line"),
    "corrupt config.json": ("raw", "test_pretrain.py::test_resume_with_corrupt_config_json"),
    "sampler load_state_dict epoch=-1": ("raw", "test_packing.py::test_sampler_failed_load_leaves_it_unchanged"),
    "unshard with different local lengths across ranks": (
        "raw", "test_sharding.py::test_unshard_distributed_cp2_and_cp4"),  # _unshard_body
    "read-only --out-dir": ("raw", "test_pretrain.py::test_out_dir_read_only"),
    "--out-dir that is a file": ("raw", "test_pretrain.py::test_out_dir_is_a_file"),
    "unreadable corpus": ("raw", "test_data.py::test_corpus_unreadable"),
    "disk too full for a checkpoint": ("raw", "test_pretrain.py::test_disk_too_full_for_a_checkpoint"),
    "invalid UTF-8 in a JSONL corpus": ("raw", "test_data.py::test_jsonl_invalid_utf8"),
    "empty .bin corpus": ("raw", "test_data.py::test_bin_empty"),
    "--eos-id outside the vocabulary": ("raw", "test_data.py::test_eos_id_outside_vocab"),
    "--eos-id outside the bin dtype": ("raw", "test_data.py::test_eos_id_outside_bin_dtype"),
    "--seed -3": ("raw", "test_config.py::test_seed_negative"),
    "config file whose top level is not an object": (
        "raw", "test_config.py::test_config_file_top_level_not_an_object"),
    "--lr inf": ("raw", "test_config.py::test_lr_inf"),
    "cp_cross_entropy labels outside [0, V)": ("raw", "test_loss.py::test_cross_entropy_labels_out_of_range"),
    "cp_cross_entropy logits of the wrong type": ("raw", "test_loss.py::test_cross_entropy_logits_wrong_type"),
    "cp_cross_entropy labels on another device": (
        "raw", "test_loss.py::test_cross_entropy_labels_on_another_device"),
    "rope_cache(np.int64(10), 8)": ("raw", "test_rope_cache.py::test_rope_cache_numpy_int_max_positions"),
    "rope_cache(base='10000')": ("raw", "test_rope_cache.py::test_rope_cache_base_str"),
    "shard_batch with labels shorter than input_ids": ("raw", "test_sharding.py::test_shard_batch_labels_shorter"),
    "SIGTERM while a rank is stuck in a collective": (
        "raw", "test_pretrain.py::test_sigterm_while_stuck_in_a_collective"),
}

# issue 22 (round 3): item -> "file::test". The kinds of the fresh pass are the table of
# docs/bad_input_round3.md, whose fixed-by column names its tests the same way.
ISSUE_22: dict[str, str] = {
    "1 softmax_scale outside the agreement": "test_plan_api.py::test_arguments_agree_across_ranks",
    "2 a boolean for a number in a config file": "test_config.py::test_config_file_boolean_for_a_float_field",
    "3 null / false / a number for a string in a config file": (
        "test_config.py::test_config_file_null_for_a_string_field"),
    "3 false for an optional string": "test_config.py::test_config_file_false_for_an_optional_string_field",
    "3 a number for a string": "test_config.py::test_config_file_number_for_a_string_field",
    "3 null for an optional field is None": "test_config.py::test_config_file_null_for_an_optional_field_is_none",
    "4a/4b rank-local argument errors wait for the timeout":
        "test_plan_api.py::test_arguments_agree_across_ranks",
    "4c plan= on one rank only": "test_plan_api.py::test_plan_on_one_rank_only_is_a_clear_error",
    "5 plan changed in place / attributes assigned":
        "test_plan_api.py::test_plans_are_read_only_and_refuse_in_place_changes",
    "6 patch_model after a cast": "test_hf_loading.py::test_patch_model_after_cast_says_why",
    "6 patch_model before a cast runs": "test_hf_loading.py::test_patch_model_before_cast_runs",
    "7 another run's checkpoint": "test_checkpoint_integrity.py::test_load_refuses_another_run_before_reading",
    "7 another run's checkpoint, end to end":
        "test_checkpoint_integrity.py::test_resume_refuses_a_checkpoint_of_another_run",
    "8 a failed save": "test_checkpoint_integrity.py::test_failed_save_keeps_the_last_good_one_and_says_why",
    "8 a failed save's traceback": "test_checkpoint_integrity.py::test_failed_dcp_write_is_one_line_not_a_traceback",
    "8 keep + 1 checkpoints of space": "test_checkpoint_integrity.py::test_space_for_keep_plus_one",
    "9 --model dir: corrupt config.json": "test_hf_loading.py::test_model_dir_corrupt_config_json",
    "9 --model dir: truncated weights": "test_hf_loading.py::test_model_dir_truncated_safetensors",
    "9 --model dir: config disagrees with the weights":
        "test_hf_loading.py::test_model_dir_config_disagrees_with_weights",
    "9 an intact dir loads its weights": "test_hf_loading.py::test_load_causal_lm_intact_dir_loads",
    "10 a huge --timeout-s": "test_config.py::test_timeout_s_too_large",
    "11 a lone surrogate in a JSONL corpus": "test_data.py::test_jsonl_lone_surrogate_names_file_and_line",
    "12 checksums.json incomplete":
        "test_checkpoint_integrity.py::test_resume_skips_a_damaged_newest_checkpoint",
    "13 per-document plan's method": "test_plan_api.py::test_per_document_plan_method_is_the_plans",
    "14 CPAttentionPlan.build(device=3)": "test_plan_api.py::test_build_device_without_cuda_names_device",
    "14 patch_model group='world', cu_seq_lens_k":
        "test_plan_api.py::test_hf_plans_once_per_forward_and_runs_per_document",
    "14 --stop-at-step above --steps": "test_config.py::test_stop_at_step_above_steps",
    "14 a native model's token id == vocab_size": "test_model.py::test_native_model_input_id_outside_vocab",
    "14 a patched model's token id == vocab_size": "test_hf_loading.py::test_patched_model_input_id_outside_vocab",
}


@functools.cache
def _tree(module: str) -> ast.Module:
    with open(os.path.join(HERE, module)) as f:
        return ast.parse(f.read())


def _param_ids(module: str, dict_name: str) -> set[str]:
    """The string keys of a module-level dict literal (the ids of a parametrize over it)."""
    for node in _tree(module).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == dict_name:
            return {k.value for k in node.value.keys}
    raise AssertionError(f"{module} defines no {dict_name}")


def _missing(where: str) -> str | None:
    """None when ``where`` ("file::test" or "file::test[id]") names a test that exists."""
    m = re.fullmatch(r"(test_\w+\.py)::(test_\w+)(?:\[(\w+)\])?", where)
    if m is None:
        return f"{where!r} is not 'test_file.py::test_name'"
    module, name, param = m.groups()
    if not os.path.isfile(os.path.join(HERE, module)):
        return f"{module} does not exist"
    if name not in {n.name for n in ast.walk(_tree(module)) if isinstance(n, ast.FunctionDef)}:
        return f"{module} has no {name}"
    if param is not None and param not in _param_ids(module, "DAMAGE"):
        return f"{module}::{name} has no case {param}"
    return None


def test_issue15_catalogue_is_complete():
    """Every kind of issue 15 names a test that exists; 13 kinds were silently wrong."""
    bad = {kind: _missing(where) for kind, (_, where) in ISSUE_15.items() if _missing(where)}
    assert not bad, bad
    assert sum(was == "silent" for was, _ in ISSUE_15.values()) == 13


def test_round3_catalogue_is_complete():
    """Every item of issue 22 and every fixed-by test of docs/bad_input_round3.md exists."""
    bad = {kind: _missing(where) for kind, where in ISSUE_22.items() if _missing(where)}
    assert not bad, bad
    with open(DOCS) as f:
        doc = f.read()
    fixed = re.findall(r"\| FIXED (\S+)[ |]", doc)
    assert len(fixed) == doc.count("FIXED") == 47, (len(fixed), doc.count("FIXED"))
    bad = {where: _missing(where) for where in fixed if _missing(where)}
    assert not bad, bad
    assert "test_bad_input_round3.py::" not in doc
