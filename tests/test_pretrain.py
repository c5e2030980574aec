"""The pretraining entry point end to end: resume bit-for-bit, faults, bad configs, LR schedule."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from utils import tiny_pretrain_argv

from cp_rope.launch import checkpoint as ckpt
from cp_rope.launch import pretrain
from cp_rope.launch.cli import parse_args
from cp_rope.launch.config import (
    SECTIONS,
    ConfigError,
    ModelConfig,
    OptimConfig,
    PretrainConfig,
    to_dict,
    validate,
)
from cp_rope.launch.model import Transformer
from cp_rope.launch.optim import lr_lambda
from cp_rope.launch.parallelize import apply_activation_checkpointing
from cp_rope.launch.pretrain import main
from cp_rope.launch.resume_config import check_resume_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = tiny_pretrain_argv()


def _resume_body(rank: int, world: int, tmp: str) -> None:
    # world 2: dp 1 x cp 2; dp 2 x cp 1 (per-rank sampler states); cp 2 with FSDP2 (DTensor
    # parameters and optimizer state through DCP, the GPU code path, here on gloo)
    # (with --seq-mode concat: 128-token windows of the document stream)
    # (the first with 2 DataLoader workers, whose loader calls iter(batch_sampler) twice)
    for cp, fsdp, mode, workers in ((2, "off", "docs", 2), (1, "off", "docs", 0),
                                    (2, "on", "concat", 0)):
        common = TINY + ["--cp-size", str(cp), "--steps", "6", "--fsdp", fsdp, "--seq-mode", mode,
                         "--num-workers", str(workers)]
        cp = f"{cp}{fsdp}"
        full = main(common + ["--out-dir", f"{tmp}/full{cp}"])
        first = main(common + ["--out-dir", f"{tmp}/split{cp}", "--stop-at-step", "3"])
        second = main(common + ["--out-dir", f"{tmp}/split{cp}", "--resume"])
        assert sorted(full["losses"]) == [1, 2, 3, 4, 5, 6]
        assert sorted(first["losses"]) == [1, 2, 3] and second["start_step"] == 3
        assert sorted(second["losses"]) == [4, 5, 6]
        joined = {**first["losses"], **second["losses"]}
        for step, loss in full["losses"].items():  # bit-for-bit, not approximately
            assert joined[step] == loss, (f"cp={cp} step {step}: resumed run loss {joined[step]!r} "
                                          f"!= uninterrupted {loss!r}")
        assert full["last_loss"] < full["first_loss"]
        if rank == 0:
            with open(f"{tmp}/split{cp}/metrics.jsonl") as f:
                steps = [json.loads(line)["step"] for line in f]
            assert steps == [1, 2, 3, 4, 5, 6], steps  # the resumed run appended
    assert dist.is_initialized()  # main leaves a caller's process group alone


@pytest.mark.slow
def test_resume_bit_for_bit(tmp_path):
    """Steps 1..6 at once == steps 1..3, checkpoint, resume, 4..6 (world 2: cp 2, dp 2, FSDP2)."""
    run_distributed(_resume_body, 2, str(tmp_path), timeout_s=300)


def test_nan_loss_names_the_step(tmp_path):
    # An absurd learning rate blows the weights up after the first update.
    with pytest.raises(FloatingPointError, match=r"non-finite (loss|gradient norm) .* at step [2-9]"):
        main(TINY + ["--steps", "5", "--lr", "1e30", "--grad-clip", "0", "--warmup-steps", "0",
                     "--out-dir", str(tmp_path)])
    assert not dist.is_initialized()  # the process group main created is destroyed


def _metric_steps(out_dir) -> list[int]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


def test_out_dir_of_another_run_needs_resume_or_overwrite(tmp_path):
    """A fresh run into an out-dir holding another run's checkpoints fails fast (naming
    --resume / --overwrite / --out-dir); --overwrite deletes them, so the new run's
    checkpoint is the one kept and resumed from; metrics.jsonl is never silently truncated."""
    out = ["--out-dir", str(tmp_path), "--keep-checkpoints", "1"]
    main(TINY + ["--steps", "5"] + out)
    metrics = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"train\.out_dir=.*--resume.*--overwrite.*--out-dir"):
        main(TINY + ["--steps", "2"] + out)
    assert (tmp_path / "metrics.jsonl").read_text() == metrics  # untouched
    assert os.listdir(tmp_path / "checkpoints") == ["step_00000005"]
    assert not dist.is_initialized()
    main(TINY + ["--steps", "2", "--overwrite"] + out)
    assert os.listdir(tmp_path / "checkpoints") == ["step_00000002"]
    assert _metric_steps(tmp_path) == [1, 2]
    resumed = main(TINY + ["--steps", "3", "--resume"] + out)
    assert resumed["start_step"] == 2 and sorted(resumed["losses"]) == [3]


def test_resume_drops_metrics_logged_after_the_checkpoint(tmp_path):
    """Steps logged after the newest checkpoint (a crash before the next save) are
    dropped from metrics.jsonl on resume, not duplicated."""
    out = ["--out-dir", str(tmp_path), "--keep-checkpoints", "0", "--checkpoint-every", "2"]
    main(TINY + ["--steps", "4", "--no-save-final"] + out)
    assert _metric_steps(tmp_path) == [1, 2, 3, 4]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000002"]
    main(TINY + ["--steps", "4", "--resume"] + out)
    assert _metric_steps(tmp_path) == [1, 2, 3, 4]


def test_resume_with_a_changed_config_names_the_fields(tmp_path, capsys):
    """--resume with other model shapes / data / layout fails before loading, naming every
    field that differs; steps and logging may change (and the step count takes effect)."""
    out = ["--out-dir", str(tmp_path)]
    main(TINY + ["--steps", "2"] + out)
    with pytest.raises(ConfigError, match=r"model\.dim: 32 .* 64.*data\.seq_len: 128 .* 256") as err:
        main(TINY + ["--steps", "3", "--resume", "--dim", "64", "--seq-len", "256"] + out)
    assert "n_layers" not in str(err.value) and "train.steps" not in str(err.value)
    saved = to_dict(parse_args(TINY))
    with pytest.raises(ConfigError, match=r"parallel\.cp_size: 1 .* 2.*train\.seed: 0 .* 1"):
        check_resume_config(saved, parse_args(TINY + ["--cp-size", "2", "--seed", "1"]))
    check_resume_config(saved, parse_args(TINY + ["--steps", "9", "--cp-method", "allgather"]))
    # head_dim 0 is dim / n_heads: the same model either way round, another size refused
    per_head = str(saved["model"]["dim"] // saved["model"]["n_heads"])
    check_resume_config(saved, parse_args(TINY + ["--head-dim", per_head]))
    check_resume_config(to_dict(parse_args(TINY + ["--head-dim", per_head])), parse_args(TINY))
    with pytest.raises(ConfigError, match=rf"model\.head_dim: {per_head} .* {2 * int(per_head)}"):
        check_resume_config(saved, parse_args(TINY + ["--head-dim", str(2 * int(per_head))]))
    with pytest.raises(ConfigError, match=r"optim\.lr"):  # the optimizer state would override it
        main(TINY + ["--steps", "3", "--resume", "--lr", "1e-4"] + out)
    resumed = main(TINY + ["--steps", "3", "--resume", "--log-every", "2", "--num-workers", "1"] + out)
    assert resumed["start_step"] == 2 and sorted(resumed["losses"]) == [3]
    # a fresh user's try: the checkpoint's own run check still compared the raw head_dim
    capsys.readouterr()
    again = main(TINY + ["--steps", "4", "--resume", "--head-dim", per_head] + out)
    assert again["start_step"] == 3 and sorted(again["losses"]) == [4]
    # the schedule a larger --steps recomputes is said (a fresh user's try: the LR rose unsaid)
    cfg = parse_args(TINY)
    lr = cfg.optim.lr * lr_lambda(cfg.optim, 4)(3)
    assert f"learning rate: the cosine over --steps 4, {lr:.3g} at step 4" in capsys.readouterr().out
    from cp_rope.launch.checkpoint import CheckpointError, check_run

    old = {"run": {"model.head_dim": 0, "model.dim": 32, "model.n_heads": 4}, "world_size": 1}
    check_run("ckpt", old, {"model.head_dim": 8, "model.dim": 32, "model.n_heads": 4}, 1)
    with pytest.raises(CheckpointError, match=r"model\.head_dim: 8 \(checkpoint\) != 16"):
        check_run("ckpt", old, {"model.head_dim": 16, "model.dim": 32, "model.n_heads": 4}, 1)


def test_console_log(tmp_path, capsys):
    """What a user reads: every log line has the gradient norm; output piped to a file
    (stderr not a TTY) gets no carriage-return progress bar."""
    tiny = [a for a in TINY if a != "--no-progress"]
    main(tiny + ["--steps", "2", "--out-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert "\r" not in out + err, err
    lines = [line for line in out.splitlines() if line.startswith("step")]
    assert len(lines) == 2 and all(re.search(r"grad norm \d+\.\d+", line) for line in lines), out
    # A 1-step run has no step after the (untimed) first one: still a number, labelled.
    with pytest.warns(UserWarning, match=r"train\.steps=1 <= optim\.warmup_steps=2") as caught:
        one = main(TINY + ["--steps", "1", "--out-dir", str(tmp_path / "one")])
    assert len([w for w in caught if "warmup" in str(w.message)]) == 1  # once
    out = capsys.readouterr().out
    assert one["tokens_per_s"] > 0 and "nan" not in out, out
    assert re.search(r"done: steps 1\.\.1: .*[\d,]+ tokens/s \(1 step, set-up included", out), out


@pytest.mark.parametrize("argv, field", [
    (["--n-heads", "3"], "model.dim"),
    (["--n-kv-heads", "3"], "model.n_kv_heads"),
    (["--lr", "-1"], "optim.lr"),
    (["--cp-method", "allgather", "--ulysses-size", "2"], "parallel.ulysses_size"),
    (["--cp-method", "hybrid", "--cp-size", "4", "--ulysses-size", "3"], "parallel.ulysses_size"),
    (["--cp-method", "hybrid", "--cp-size", "4"], "parallel.ulysses_size=1"),  # flag forgotten
    (["--cp-method", "ulysses", "--cp-size", "8"], "model.n_heads"),  # 4 heads over 8 ranks
    (["--cp-split-threshold", "64"], "parallel.cp_split_threshold"),
    (["--seq-len", "130", "--cp-size", "4"], "data.seq_len"),
    (["--tokens-per-batch", "100", "--seq-len", "128"], "data.tokens_per_batch"),
    (["--data", "/nonexistent/corpus.jsonl"], "data.data"),
    (["--data", __file__.replace(".py", ".bin")], "data.data"),
    (["--steps", "0"], "train.steps"),
])
def test_bad_config_names_the_field(argv, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        main(argv)
    assert not dist.is_initialized()  # failed before any process group or data


def test_the_message_names_field_value_and_reason():
    with pytest.raises(ConfigError, match=r"^model\.dim=128: must be divisible by "
                                          r"model\.n_heads=3 \(or set model\.head_dim\)$"):
        validate(parse_args(["--n-heads", "3"]))


def test_ulysses_and_hybrid_are_wired():
    for argv in (["--cp-method", "ulysses", "--cp-size", "4"],
                 ["--cp-method", "hybrid", "--cp-size", "4", "--ulysses-size", "2"]):
        cfg = parse_args(argv)
        validate(cfg)
        assert cfg.parallel.cp_method == argv[1]


def test_per_document_placement_is_wired():
    """--cp-placement per_document validates (the run itself: tests/test_placement.py); a
    threshold without it is refused, naming the field."""
    for argv in (["--cp-placement", "per_document"],
                 ["--cp-placement", "per_document", "--cp-split-threshold", "256"]):
        validate(parse_args(argv + ["--cp-size", "2"]))
    with pytest.raises(ConfigError, match=r"parallel\.cp_split_threshold=256: is for"):
        validate(parse_args(["--cp-split-threshold", "256", "--cp-size", "2"]))


def test_malformed_flag_value_is_a_usage_error_naming_the_flag(capsys):
    """A value tyro cannot read as the field's type: exit status 2, the flag named (on stderr)."""
    with pytest.raises(SystemExit) as exc:
        main(["--lr", "fast"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--lr" in err and "fast" in err, err
    assert not dist.is_initialized()


def test_backend_the_device_cannot_run_fails_at_config_time(monkeypatch, tmp_path):
    """Kernels that need CUDA are refused on CPU before any process group or data; the
    Triton RoPE kernel runs on CPU only under TRITON_INTERPRET=1."""
    for backend in ("torch_flash", "torch_cudnn", "flash_attn"):
        with pytest.raises(ConfigError, match=rf"parallel\.attn_backend='{backend}'.*CUDA"):
            main(TINY + ["--device", "cpu", "--attn-backend", backend, "--out-dir", str(tmp_path)])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match=r"parallel\.rope_backend='triton'.*TRITON_INTERPRET=1"):
        main(TINY + ["--device", "cpu", "--rope-backend", "triton", "--out-dir", str(tmp_path)])
    assert not dist.is_initialized()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    validate(parse_args(["--device", "cpu", "--rope-backend", "triton", "--attn-backend", "reference"]))


def test_cp_size_must_divide_world():
    cfg = parse_args(["--cp-size", "3"])
    with pytest.raises(ConfigError, match=r"parallel.cp_size=3.*world size 4.*4 / 3"):
        validate(cfg, world_size=4)


def test_unknown_choice_and_flag_exit():
    with pytest.raises(SystemExit):
        parse_args(["--seq-mode", "windows"])
    with pytest.raises(SystemExit):
        parse_args(["--no-such-flag", "1"])


def test_config_file_toml_json_and_precedence(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\ndim = 96\nn_heads = 6\n[optim]\nlr = 1e-3\n[train]\nresume = true\n')
    cfg = parse_args(["--preset", "125m", "--config", str(toml), "--lr", "2e-3"])
    assert cfg.model.dim == 96 and cfg.model.n_heads == 6 and cfg.model.n_layers == 12  # preset kept
    assert cfg.optim.lr == 2e-3 and cfg.train.resume is True  # flag beats file
    js = tmp_path / "run.json"
    js.write_text(json.dumps({"data": {"seq_mode": "concat", "seq_len": 256}}))
    cfg = parse_args(["--config", str(js)])
    assert cfg.data.seq_mode == "concat" and cfg.data.seq_len == 256
    js.write_text(json.dumps({"model": {"heads": 3}}))
    with pytest.raises(ConfigError, match=r"unknown field model.heads"):
        parse_args(["--config", str(js)])
    js.write_text(json.dumps({"data": {"seq_mode": "windows"}}))
    with pytest.raises(ConfigError, match=r"data.seq_mode='windows'"):
        parse_args(["--config", str(js)])


def test_presets_are_valid_and_8b_is_llama3():
    for name in ("tiny", "125m", "1b", "8b"):
        validate(parse_args(["--preset", name]))
    m = parse_args(["--preset", "8b"]).model
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_hidden_dim, m.rope_base) == \
        (4096, 32, 32, 8, 14336, 500000.0)


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv + ["--help"], description=pretrain.__doc__)
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_help_gives_units(capsys):
    text = _help([], capsys)
    assert "--cp-size" in text and "--tokens-per-batch" in text and "in tokens" in text
    assert "--rdzv-endpoint" in text  # the multi-node command line
    assert "`" not in text and not re.search(r":(mod|func|class|meth|data):", text)  # no raw RST
    assert "::" not in text  # nor literal-block markers
    assert "see cp_rope.launch.model" in text and "cp_rope.parallel.cp_cross_entropy" in text


def test_one_kebab_case_flag_per_field_and_defaults_after_preset_and_file(tmp_path, capsys):
    """Every field has its flag without a section prefix (the names scripts and docs use); the
    defaults --help shows are the preset's, overridden by the config file."""
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", _help(["--preset", "8b"], capsys)))
    for section in SECTIONS:
        for f in dataclasses.fields(getattr(PretrainConfig(), section)):
            assert "--" + f.name.replace("_", "-") in flags, f"{section}.{f.name}"
    assert {"--preset", "--config", "--no-progress", "--no-tensorboard", "--resume"} <= flags
    js = tmp_path / "run.json"
    js.write_text(json.dumps({"model": {"n_layers": 7}}))
    text = _help(["--preset", "8b", "--config", str(js)], capsys)
    assert re.search(r"--dim INT\s.*?\(default:\s+4096\)", text, re.S), text
    assert re.search(r"--n-layers INT\s.*?\(default:\s+7\)", text, re.S), text


def test_activation_checkpointing_recomputes_each_block_with_the_same_gradients():
    """parallelize's second step: each block's forward runs again in backward; the gradients
    are those without checkpointing (same fp32 ops in the same order: bit-equal)."""
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden_dim=64,
                      vocab_size=64, max_seq_len=64)
    ids = torch.randint(0, 64, (40,))
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    grads, calls = [], []
    for ac in (False, True):
        torch.manual_seed(3)
        model = Transformer(cfg)
        if ac:
            apply_activation_checkpointing(model)
        calls.append(0)
        for block in model.layers:
            # a pre-hook: recomputation stops early, once the tensors backward needs exist
            block.feed_forward.register_forward_pre_hook(lambda *_: calls.__setitem__(-1, calls[-1] + 1))
        model(ids, model.attention_plan(cu, 23)).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert calls == [2, 4], calls  # n_layers forwards, then n_layers recomputations
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name


def test_lr_schedule_warmup_then_cosine():
    fn = lr_lambda(OptimConfig(warmup_steps=4, min_lr_ratio=0.1), total_steps=14)
    assert [fn(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert fn(4) == 1.0 and abs(fn(9) - 0.55) < 1e-12 and abs(fn(14) - 0.1) < 1e-12
    assert all(fn(s) >= fn(s + 1) for s in range(4, 20))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_a_checkpoint_and_exits(tmp_path, sig):
    """SIGTERM (scheduler) or SIGINT (Ctrl-C) mid-run: the loop stops between steps, saves a
    checkpoint, destroys the process group and exits 130."""
    env = dict(os.environ, OMP_NUM_THREADS="1")  # cp_rope from its (editable) install
    proc = subprocess.Popen(
        [sys.executable, "-m", "cp_rope.launch.pretrain", *TINY, "--steps", "100000",
         "--out-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step"):
            proc.send_signal(sig)
            break
    out = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out
    assert f"signal {sig.name}" in out and "checkpoint:" in out, out
    ckpts = os.listdir(tmp_path / "checkpoints")
    assert len(ckpts) == 1 and os.path.isfile(tmp_path / "checkpoints" / ckpts[0] / ".metadata")


def test_torchrun_main_job(tmp_path):
    """The README's main command (torchrun, env:// rendezvous, 2 ranks, cp 2), a few steps."""
    env = dict(os.environ, OMP_NUM_THREADS="1")  # cp_rope from its (editable) install
    cmd = [sys.executable, "-m", "torch.distributed.run",  # = torchrun
           "--standalone", "--nproc-per-node", "2", "-m", "cp_rope.launch.pretrain",
           "--cp-size", "2", *TINY, "--steps", "3", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "world 2 = dp 1 x cp 2" in out and re.search(r"done: steps 1\.\.3: loss .* tokens/s", out), out
    assert f"cp_rope from {REPO}" in out, out  # round 4 #9: which checkout the workers run
    steps = [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")]
    assert steps == [1, 2, 3]


def test_resume_with_more_steps_follows_the_new_schedule(tmp_path, capsys):
    """Extending a run (--resume --steps 6 after --steps 3): the first resumed step takes
    the new schedule's LR, not the one the old schedule left in the optimizer state. A
    resume with --steps at or below the checkpoint's step says there is nothing to train."""
    main(TINY + ["--steps", "3", "--out-dir", str(tmp_path / "ext")])
    main(TINY + ["--steps", "6", "--resume", "--out-dir", str(tmp_path / "ext")])
    main(TINY + ["--steps", "6", "--out-dir", str(tmp_path / "full")])

    def lrs(d):
        with open(tmp_path / d / "metrics.jsonl") as f:
            return {r["step"]: r["lr"] for r in map(json.loads, f)}

    ext, full = lrs("ext"), lrs("full")
    assert sorted(ext) == [1, 2, 3, 4, 5, 6]
    assert [ext[s] for s in (4, 5, 6)] == [full[s] for s in (4, 5, 6)], (ext, full)
    capsys.readouterr()
    done = main(TINY + ["--steps", "5", "--resume", "--out-dir", str(tmp_path / "ext")])
    assert done["steps_run"] == 0 and done["start_step"] == 6
    assert "nothing to train: resumed at step 6, train.steps=5" in capsys.readouterr().out


# ------------------------------------------------------------------ run directories, resume of damaged run files, signals (issue-15 and round-3 catalogues)
SMALL = tiny_pretrain_argv(seq_len=64, tokens_per_batch=256, max_docs=16)  # the bad-input runs' size


def _copy(run, tmp_path) -> str:
    return str(shutil.copytree(run, tmp_path / "run"))


def test_resume_with_config_json_missing(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    os.remove(os.path.join(run, "config.json"))
    with pytest.raises(ConfigError, match=r"config\.json.*missing"):
        main(SMALL + ["--steps", "2", "--resume", "--lr", "0.1", "--out-dir", run])


def test_resume_with_corrupt_config_json(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    with open(os.path.join(run, "config.json"), "r+") as f:
        f.truncate(40)
    with pytest.raises(ConfigError, match=r"config\.json.*not valid JSON"):
        main(SMALL + ["--steps", "2", "--resume", "--out-dir", run])


def test_metrics_jsonl_truncated_last_line(finished_run, tmp_path):
    """A last line cut by a crash mid-write is dropped on resume, with a warning (documented
    repair); the resumed run appends valid lines."""
    run = _copy(finished_run, tmp_path)
    metrics = os.path.join(run, "metrics.jsonl")
    with open(metrics, "a") as f:
        f.write('{"step": 2, "loss": 5.')
    with pytest.warns(UserWarning, match=r"metrics\.jsonl.*line 2.*truncated"):
        main(SMALL + ["--steps", "2", "--resume", "--out-dir", run])
    with open(metrics) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]


def test_out_dir_is_a_file(tmp_path):
    f = tmp_path / "out"
    f.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"--out-dir.*out.*not a directory"):
        main(SMALL + ["--steps", "1", "--out-dir", str(f)])


def test_out_dir_read_only(tmp_path):
    if os.geteuid() == 0:  # root writes through permission bits; sysfs refuses everyone
        out = "/sys/cp-rope-run"
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        out = str(tmp_path / "ro" / "run")
    with pytest.raises(ConfigError, match=rf"--out-dir.*{out}.*cannot"):
        main(SMALL + ["--steps", "1", "--out-dir", out])


def test_disk_too_full_for_a_checkpoint(tmp_path, monkeypatch):
    """A file system without room for one checkpoint fails before step 1, not at the end."""
    class Usage:
        free = 1000
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: Usage)
    with pytest.raises(ConfigError, match=r"--out-dir.*a checkpoint needs about .* free"):
        main(SMALL + ["--steps", "1", "--out-dir", str(tmp_path)])
    assert not os.path.exists(tmp_path / "metrics.jsonl") or not open(tmp_path / "metrics.jsonl").read()


def test_resume_with_bpe_vocab_size_of_a_bytes_run(tmp_path):
    """--bpe-vocab-size is read only by a BPE run: a bytes run resumes whatever its value."""
    main(SMALL + ["--steps", "1", "--out-dir", str(tmp_path)])
    summary = main(SMALL + ["--steps", "2", "--resume", "--bpe-vocab-size", "8000",
                           "--out-dir", str(tmp_path)])
    assert (summary["start_step"], summary["steps_run"]) == (1, 1)


_STUCK_DRIVER = r"""
import os, sys, time, datetime
import torch.distributed as dist
from cp_rope.launch import pretrain

rank = int(os.environ["RANK"])
if rank == 1:  # never reaches the loss all-reduce of step 2: rank 0 waits in the collective
    step = pretrain.train_step
    calls = []
    def stuck(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            time.sleep(600)
        return step(*a, **k)
    pretrain.train_step = stuck
pretrain.main(sys.argv[1:])
"""


def test_sigterm_while_stuck_in_a_collective(tmp_path):
    """Rank 0 waits in a collective for a stuck rank 1; SIGTERM makes it exit after the grace
    period (not at the process-group timeout or torchrun's SIGKILL), saying why."""
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    argv = SMALL + ["--steps", "50", "--cp-size", "2", "--stop-grace-s", "2",
                   "--out-dir", str(tmp_path)]
    procs = [subprocess.Popen([sys.executable, "-c", _STUCK_DRIVER, *argv], cwd=REPO,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        lines = []
        for line in procs[0].stdout:  # step 1 done on both ranks; rank 1 hangs in step 2
            lines.append(line)
            if line.startswith("step"):
                break
        time.sleep(1.0)
        t0 = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        out = "".join(lines) + procs[0].communicate(timeout=60)[0]
        waited = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert procs[0].returncode != 0 and waited < 20, (procs[0].returncode, waited, out)
    assert re.search(r"SIGTERM.*did not finish within 2", out), out


# ------------------------------------------------------------------ issue 35, class 5
def test_resume_without_a_checkpoint_is_refused_unless_a_fresh_start_is_allowed(tmp_path):
    """Before: --resume on an empty --out-dir started a fresh run silently (a typo in the
    path restarted a long job from step 0)."""
    out = ["--out-dir", str(tmp_path / "run")]
    with pytest.raises(ConfigError, match=r"--resume: .*checkpoints holds no checkpoint to "
                       r"resume; pass --allow-fresh-start"):
        main(TINY + ["--steps", "1", "--resume"] + out)
    first = main(TINY + ["--steps", "1", "--resume", "--allow-fresh-start"] + out)
    assert first["start_step"] == 0 and sorted(first["losses"]) == [1]
    again = main(TINY + ["--steps", "2", "--resume", "--allow-fresh-start"] + out)
    assert again["start_step"] == 1  # with a checkpoint there, the flag changes nothing


def test_stop_at_step_saves_under_no_save_final(tmp_path):
    """The README's promise: --stop-at-step ends with a checkpoint to resume from (before:
    none under --no-save-final, and the resume restarted)."""
    out = ["--out-dir", str(tmp_path)]
    stopped = main(TINY + ["--steps", "3", "--stop-at-step", "1", "--no-save-final"] + out)
    assert sorted(stopped["losses"]) == [1]
    assert os.listdir(tmp_path / "checkpoints") == ["step_00000001"]
    resumed = main(TINY + ["--steps", "3", "--resume", "--no-save-final"] + out)
    assert resumed["start_step"] == 1 and sorted(resumed["losses"]) == [2, 3]
    assert os.listdir(tmp_path / "checkpoints") == ["step_00000001"]  # the end: not saved


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_a_corpus_of_empty_documents_is_refused(tmp_path, tokenizer):
    """Before: trained with nan bits/byte (no text)."""
    corpus = tmp_path / "empty.jsonl"
    corpus.write_text("".join(json.dumps({"text": ""}) + "\n" for _ in range(12)))
    with pytest.raises(ConfigError, match=rf"data\.data='{corpus}': all 12 documents are empty"):
        main(TINY + ["--steps", "1", "--data", str(corpus), "--tokenizer", tokenizer,
                     "--out-dir", str(tmp_path / "run")])


@pytest.mark.parametrize("fault", ["deleted", "unwritable"])
def test_a_run_directory_that_fails_mid_run_ends_with_one_error_line(tmp_path, monkeypatch,
                                                                      capsys, fault):
    """Before: a deleted --out-dir ended with rc 0 (metrics written to an unlinked file), a
    metrics.jsonl that could not be appended killed rank 0 with a traceback (its peers then
    waited for the process-group timeout)."""
    import shutil

    from cp_rope.launch.cli import run_cli
    from cp_rope.launch.metrics import MetricsLogger
    out = tmp_path / "run"
    real = MetricsLogger.log

    def log(self, step, metrics):
        if step == 2 and fault == "deleted":
            shutil.rmtree(out)
        elif step == 2:
            self._file.close()
            self._file = open(out / "metrics.jsonl")  # read-only: the write fails
        return real(self, step, metrics)

    monkeypatch.setattr(MetricsLogger, "log", log)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: main(TINY + ["--steps", "3", "--out-dir", str(out)]))
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    why = "was deleted while the run ran" if fault == "deleted" else "cannot be appended"
    assert len(errors) == 1 and re.match(rf"error: step 2: {out}/metrics\.jsonl {why}", errors[0]), errors


_PER_RANK_WRAPPER = """import os, runpy, sys
sys.argv += os.environ.get("EXTRA" + os.environ["RANK"], "").split()
runpy.run_module("cp_rope.launch.pretrain", run_name="__main__")
"""


@pytest.mark.parametrize("extra, expect", [
    ({"1": "--lr -1"}, ["error: rank 1: optim.lr=-1.0: must be > 0"]),
    ({"1": "--bogus-flag"}, ["error: rank 1:", "Unrecognized options: --bogus-flag"]),
    ({"1": "--help"}, ["error: rank 1: exited with status 0 before the process group (--help?)"]),
    ({"0": "--lr -1", "1": "--lr -1"}, ["error: optim.lr=-1.0: must be > 0"]),
])
def test_torchrun_a_refusal_on_one_rank_is_printed_and_every_rank_stops_at_once(tmp_path, extra,
                                                                                 expect):
    """Before: a config or usage error on rank 1 only was never printed (only rank 0 printed,
    and it had none); rank 1 exiting early (--help) left rank 0 in init_process_group for
    the whole --timeout-s, then a raw DistStoreError. Now the ranks agree on their start
    (launch/start_gate.py): rank 0 prints rank 1's reason and every rank stops in seconds;
    an error every rank has is printed once."""
    wrapper = tmp_path / "wrap.py"
    wrapper.write_text(_PER_RANK_WRAPPER)
    env = dict(os.environ, OMP_NUM_THREADS="1", **{f"EXTRA{r}": e for r, e in extra.items()})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(wrapper), *TINY, "--cp-size", "2", "--steps", "1", "--timeout-s", "200",
           "--out-dir", str(tmp_path / "run")]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and time.monotonic() - start < 100, out
    for text in expect:
        assert text in out, out
    assert "DistStoreError" not in out and not (tmp_path / "run").exists(), out
    assert sum(line.startswith("error:") for line in out.splitlines()) == (
        1 if len(extra) == 2 else 2), out  # rank 1's reason, then "rank 1 did not start"


def test_an_error_building_the_next_batch_ends_the_run_after_this_step(tmp_path, monkeypatch):
    """One process builds step k+1's batch and plan while step k runs; a failure there (a
    collate error, a dead loader worker) is raised at step k+1, as before that lookahead:
    step k's optimizer step, metrics line and checkpoint all happen first."""
    from cp_rope.launch import data as data_mod

    inner, calls = data_mod.PackingCollator.__call__, [0]

    def collate(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("batch 3 cannot be built")
        return inner(self, *args, **kwargs)

    monkeypatch.setattr(data_mod.PackingCollator, "__call__", collate)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="batch 3 cannot be built"):
        main(tiny_pretrain_argv() + ["--steps", "6", "--checkpoint-every", "2",
                                     "--num-workers", "0", "--out-dir", str(out)])
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000002"]
    steps = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
    assert steps == [1, 2]


@pytest.mark.parametrize("saved_fused", [None, True])
def test_resume_keeps_this_runs_adamw_implementation(tmp_path, monkeypatch, saved_fused):
    """The optimizer state of a checkpoint carries the saved run's ``fused`` / ``foreach``
    flags; a resume keeps the ones build_optimizer chose for this run (fused AdamW on CUDA
    parameters, foreach elsewhere): a checkpoint written before fused AdamW, or on CPU,
    must not turn it off. CPU fused AdamW stands in for the CUDA one."""
    built = []

    def build(model, cfg, fused):
        from cp_rope.launch.optim import build_optimizer

        opt = build_optimizer(model, cfg)
        for group in opt.param_groups:
            group["fused"], group["foreach"] = fused, None
        opt.defaults.update(fused=fused, foreach=None)
        built.append(opt)
        return opt

    argv = tiny_pretrain_argv() + ["--out-dir", str(tmp_path / "run")]
    monkeypatch.setattr(pretrain, "build_optimizer", lambda m, c: build(m, c, saved_fused))
    main(argv + ["--steps", "2"])
    resumed = None if saved_fused else True
    monkeypatch.setattr(pretrain, "build_optimizer", lambda m, c: build(m, c, resumed))
    summary = main(argv + ["--steps", "4", "--resume"])
    assert summary["steps_run"] == 2 and all(map(math.isfinite, summary["losses"].values()))
    assert [g["fused"] for g in built[-1].param_groups] == [resumed] * len(built[-1].param_groups)
