"""The bad-input catalogue: every kind of bad input a careful new user tried (issue 15), one case each.

Each test is named after its kind and asserts the *clear* outcome: an exception
of the documented type whose message names the argument, flag, field or file
(or, where an input is valid after all, the right result). A kind that is
silently wrong or fails with a raw error makes its test fail, so the count of
silent and raw kinds stays zero as the code changes.

:data:`CATALOGUE` maps every kind to its test; kinds about damaged checkpoints
are exercised end to end in ``tests/test_checkpoint_integrity.py`` (resume
falls back and reproduces the uninterrupted run bit for bit) and are listed
here under that module. ``test_catalogue_is_complete`` keeps the table and
the tests in step.
"""

from __future__ import annotations

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

import numpy as np
import pytest
import test_checkpoint_integrity
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from cp_rope import rope_cache
from cp_rope.launch import checkpoint as ckpt
from cp_rope.launch import data as data_mod
from cp_rope.launch.checkpoint import CheckpointError
from cp_rope.launch.config import ConfigError
from cp_rope.launch.pretrain import main
from cp_rope.parallel import (
    PackedBatch,
    TokenBudgetBatchSampler,
    context_parallel_attention,
    cp_cross_entropy,
    shard_batch,
    unshard,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = test_checkpoint_integrity.TINY

# kind -> (was, test): "silent" / "raw" as found in issue 15; every test asserts a clear outcome.
CATALOGUE = {
    # -- silently wrong in issue 15
    "checkpoint shard with flipped bytes": ("silent", "test_checkpoint_shard_with_flipped_bytes"),
    "--dtype bfloat16 with --device auto on cpu": ("silent", "test_dtype_bfloat16_with_device_auto_on_cpu"),
    "--resume with config.json missing": ("silent", "test_resume_with_config_json_missing"),
    "cross-rank cu_seqlens with equal weighted sums": (
        "silent", "test_cross_rank_checks (cp_attention_cu_seqlens_same_weighted_sum)"),
    "rope_cache base=inf": ("silent", "test_rope_cache_base_inf"),
    "rope_cache scaling factor=inf": ("silent", "test_rope_cache_scaling_factor_inf"),
    "softmax_scale=inf": ("silent", "test_softmax_scale_inf"),
    "causal='no'": ("silent", "test_causal_not_a_bool"),
    "1-process unshard with float cu_seqlens": ("silent", "test_unshard_float_cu_seqlens"),
    "1-process unshard with decreasing cu_seqlens": ("silent", "test_unshard_decreasing_cu_seqlens"),
    "shard_batch with a wrong batch.max_seqlen": ("silent", "test_shard_batch_wrong_max_seqlen"),
    "sampler load_state_dict batches_consumed=1.7": ("silent", "test_sampler_batches_consumed_float"),
    'config file "n_layers": true': ("silent", "test_config_file_n_layers_true"),
    # -- raw or misleading in issue 15
    "newest checkpoint: truncated .metadata": ("raw", "test_checkpoint_integrity: truncated_metadata"),
    "newest checkpoint: empty .metadata": ("raw", "test_checkpoint_integrity: empty_metadata"),
    "newest checkpoint: missing shard": ("raw", "test_checkpoint_integrity: missing_shard"),
    "newest checkpoint: truncated shard": ("raw", "test_checkpoint_integrity: truncated_shard"),
    "metrics.jsonl with a truncated last line": ("raw", "test_metrics_jsonl_truncated_last_line"),
    "corrupt config.json": ("raw", "test_resume_with_corrupt_config_json"),
    "sampler load_state_dict epoch=-1": ("raw", "test_sampler_failed_load_leaves_it_unchanged"),
    "unshard with different local lengths across ranks": (
        "raw", "test_cross_rank_checks (unshard_different_local_lengths)"),
    "read-only --out-dir": ("raw", "test_out_dir_read_only"),
    "--out-dir that is a file": ("raw", "test_out_dir_is_a_file"),
    "unreadable corpus": ("raw", "test_corpus_unreadable"),
    "disk too full for a checkpoint": ("raw", "test_disk_too_full_for_a_checkpoint"),
    "invalid UTF-8 in a JSONL corpus": ("raw", "test_jsonl_invalid_utf8"),
    "empty .bin corpus": ("raw", "test_bin_empty"),
    "--eos-id outside the vocabulary": ("raw", "test_eos_id_outside_vocab"),
    "--eos-id outside the bin dtype": ("raw", "test_eos_id_outside_bin_dtype"),
    "--seed -3": ("raw", "test_seed_negative"),
    "config file whose top level is not an object": ("raw", "test_config_file_top_level_not_an_object"),
    "--lr inf": ("raw", "test_lr_inf"),
    "cp_cross_entropy labels outside [0, V)": ("raw", "test_cross_entropy_labels_out_of_range"),
    "cp_cross_entropy logits of the wrong type": ("raw", "test_cross_entropy_logits_wrong_type"),
    "cp_cross_entropy labels on another device": ("raw", "test_cross_entropy_labels_on_another_device"),
    "rope_cache(np.int64(10), 8)": ("raw", "test_rope_cache_numpy_int_max_positions"),
    "rope_cache(base='10000')": ("raw", "test_rope_cache_base_str"),
    "shard_batch with labels shorter than input_ids": ("raw", "test_shard_batch_labels_shorter"),
    "SIGTERM while a rank is stuck in a collective": ("raw", "test_sigterm_while_stuck_in_a_collective"),
}


def test_catalogue_is_complete():
    """Every kind names a test that exists (here or in test_checkpoint_integrity)."""
    here = {n for n in globals() if n.startswith("test_")}
    damage = set(test_checkpoint_integrity.DAMAGE)
    for kind, (_, where) in CATALOGUE.items():
        name = where.split(" ")[0]
        if name == "test_checkpoint_integrity:":
            assert where.split(": ")[1] in damage, kind
        else:
            assert name in here, (kind, where)
    assert sum(was == "silent" for was, _ in CATALOGUE.values()) == 13


# ------------------------------------------------------------------ RoPE cache
def test_rope_cache_base_inf():
    with pytest.raises(ValueError, match=r"base must be finite"):
        rope_cache(16, 8, base=math.inf)


def test_rope_cache_scaling_factor_inf():
    with pytest.raises(ValueError, match=r"factor.*finite"):
        rope_cache(16, 8, scaling={"rope_type": "linear", "factor": math.inf})


def test_rope_cache_base_str():
    with pytest.raises(TypeError, match=r"base must be a real number"):
        rope_cache(16, 8, base="10000")


def test_rope_max_seqlen_below_longest_sequence():
    """(Found after issue 15, so not in CATALOGUE: it was silent.) max_seqlen is the host
    bound the cache check uses: one below the longest local sequence (CPU cu_seqlens, read
    anyway) is refused, naming max_seqlen."""
    from cp_rope import apply_rotary_emb, apply_rotary_emb_qk
    cos, sin = rope_cache(64, 8)
    q, k = torch.randn(20, 2, 8), torch.randn(20, 1, 8)
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"max_seqlen = 11 is below the longest local sequence \(12\)"):
        apply_rotary_emb_qk(q, k, cos, sin, cu, max_seqlen=11)
    with pytest.raises(ValueError, match=r"max_seqlen = 6 is below"):
        apply_rotary_emb(q, cos, sin, cu, max_seqlen=6, cp_size=2, cp_rank=1)
    out = apply_rotary_emb(q, cos, sin, cu, max_seqlen=12)  # exact bound: fine
    assert torch.equal(out, apply_rotary_emb(q, cos, sin, cu))


def test_rope_cache_numpy_int_max_positions():
    """numpy ints are ints here as everywhere (cp_size accepts them): same tables as int 10."""
    cos, sin = rope_cache(np.int64(10), 8)
    ref_cos, ref_sin = rope_cache(10, 8)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


# ------------------------------------------------------------------ CP attention
def _qkv(t=16, h=2, d=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(t, h, d, generator=g) for _ in range(3)]


def test_softmax_scale_inf():
    q, k, v = _qkv()
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"softmax_scale"):
        context_parallel_attention(q, k, v, cu, 16, softmax_scale=math.inf, backend="reference")


def test_softmax_scale_bool():
    """(Found after issue 15, so not in CATALOGUE: it was silent.) True is a bool, not a scale."""
    q, k, v = _qkv()
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"softmax_scale"):
        context_parallel_attention(q, k, v, cu, 16, softmax_scale=True, backend="reference")


def test_causal_not_a_bool():
    q, k, v = _qkv()
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"causal"):
        context_parallel_attention(q, k, v, cu, 16, causal="no", backend="reference")


# ------------------------------------------------------------------ sharding
def test_unshard_float_cu_seqlens():
    with pytest.raises(TypeError, match=r"cu_seqlens"):
        unshard(torch.randn(8, 2), torch.tensor([0.0, 4.0, 8.0]))


def test_unshard_decreasing_cu_seqlens():
    with pytest.raises(ValueError, match=r"cu_seqlens.*(decreas|non-decreasing)"):
        unshard(torch.randn(8, 2), torch.tensor([0, 6, 4, 8], dtype=torch.int32))


def _global_batch(lengths=(8, 12), max_seqlen=None):
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    t = int(cu[-1])
    return PackedBatch(input_ids=torch.randint(0, 100, (t,)), labels=torch.randint(0, 100, (t,)),
                       position_ids=torch.cat([torch.arange(n) for n in lengths]), cu_seqlens=cu,
                       max_seqlen=max(lengths) if max_seqlen is None else max_seqlen,
                       seq_lens=torch.tensor(lengths, dtype=torch.int32))


def test_shard_batch_wrong_max_seqlen():
    with pytest.raises(ValueError, match=r"max_seqlen"):
        shard_batch(_global_batch(max_seqlen=4), 2, 0)


def test_shard_batch_labels_shorter():
    batch = _global_batch()
    batch.labels = batch.labels[:-3]
    with pytest.raises(ValueError, match=r"labels"):
        shard_batch(batch, 2, 0)


# ------------------------------------------------------------------ sampler
def _sampler():
    return TokenBudgetBatchSampler(np.arange(1, 40) * 3, 64, cp_size=2, seed=3)


def test_sampler_batches_consumed_float():
    s = _sampler()
    state = dict(s.state_dict(), batches_consumed=1.7)
    with pytest.raises(TypeError, match=r"batches_consumed"):
        s.load_state_dict(state)


def test_sampler_failed_load_leaves_it_unchanged():
    """A refused state (epoch=-1) leaves the sampler exactly as it was (its docstring's promise)."""
    def started():  # epoch 2, one batch taken
        sampler = _sampler()
        sampler.set_epoch(2)
        it = iter(sampler)
        next(it)
        return sampler, it

    (s, it), (twin, twin_it) = started(), started()
    before = s.state_dict()
    with pytest.raises(ValueError, match=r"epoch"):
        s.load_state_dict(dict(before, epoch=-1))
    assert s.state_dict() == before
    assert list(it) == list(twin_it)  # the running epoch goes on as the twin's
    assert list(iter(s)) == list(iter(twin))


# ------------------------------------------------------------------ loss
def test_cross_entropy_labels_out_of_range():
    logits = torch.randn(6, 10)
    with pytest.raises(ValueError, match=r"labels.*\[0, 10\)"):
        cp_cross_entropy(logits, torch.tensor([1, 2, -100, 10, 3, 4]))


def test_cross_entropy_logits_wrong_type():
    with pytest.raises(TypeError, match=r"logits must be a torch.Tensor"):
        cp_cross_entropy(np.zeros((4, 10), np.float32), torch.zeros(4, dtype=torch.long))


def test_cross_entropy_labels_on_another_device():
    with pytest.raises(ValueError, match=r"labels.*device"):
        cp_cross_entropy(torch.randn(4, 10), torch.zeros(4, dtype=torch.long, device="meta"))


# ------------------------------------------------------------------ across ranks
def _cross_rank_body(rank: int, world: int) -> None:
    # cp_attention_cu_seqlens_same_weighted_sum: [0,2,8,10,16] vs [0,4,4,12,16] (equal weighted sums)
    cu = torch.tensor([[0, 2, 8, 10, 16], [0, 4, 4, 12, 16]][rank], dtype=torch.int32)
    q, k, v = _qkv(t=16)
    with pytest.raises(RuntimeError, match=r"differ across the ranks(.|\n)*rank 1: cu_seqlens=.*4, 4, 12"):
        context_parallel_attention(q, k, v, cu, 8, group=dist.group.WORLD, backend="reference")
    # unshard_different_local_lengths: rank 0 has 8 local rows, rank 1 has 12
    n = 8 + 4 * rank
    with pytest.raises(ValueError, match=r"cu_seqlens.*rank"):
        unshard(torch.randn(n, 2), torch.tensor([0, n], dtype=torch.int32))
    dist.barrier()  # both ranks raised; the group still works


def test_cross_rank_checks():
    """Inputs that differ across ranks raise on every rank (no wrong result, no gloo abort):
    CP attention a RuntimeError showing each rank's cu_seqlens, unshard a ValueError."""
    run_distributed(_cross_rank_body, 2, timeout_s=60)


# ------------------------------------------------------------------ corpora
def _data_argv(path, *extra):
    return TINY + ["--steps", "1", "--data", str(path), *extra]


def test_jsonl_invalid_utf8(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=r"c\.jsonl.*line 2 is not valid UTF-8"):
        main(_data_argv(f, "--out-dir", str(tmp_path / "out")))


def test_bin_empty(tmp_path):
    f = tmp_path / "c.bin"
    f.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"c\.bin.*--data.*empty"):
        main(_data_argv(f, "--eos-id", "1", "--vocab-size", "64", "--out-dir", str(tmp_path / "o")))


def test_eos_id_outside_vocab(tmp_path):
    f = tmp_path / "c.bin"
    np.arange(1, 200, dtype=np.uint16).tofile(f)
    with pytest.raises(ConfigError, match=r"--eos-id.*\[0, 256\)"):
        main(_data_argv(f, "--eos-id", "300", "--vocab-size", "256", "--out-dir", str(tmp_path / "o")))


def test_eos_id_outside_bin_dtype(tmp_path):
    f = tmp_path / "c.bin"
    np.arange(1, 200, dtype=np.uint16).tofile(f)
    with pytest.raises(ConfigError, match=r"--eos-id.*uint16"):
        main(_data_argv(f, "--eos-id", "70000", "--vocab-size", "100000", "--out-dir",
                        str(tmp_path / "o")))


def test_corpus_unreadable(tmp_path, monkeypatch):
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "a"}\n')
    f.chmod(0)
    if os.geteuid() == 0:  # root reads anything: make this file's open fail as it would
        real = open

        def deny(file, *a, **k):
            if str(file) == str(f):
                raise PermissionError(13, "Permission denied", str(file))
            return real(file, *a, **k)
        monkeypatch.setattr(data_mod, "open", deny, raising=False)
    with pytest.raises(ConfigError, match=r"c\.jsonl.*--data.*cannot be read: Permission denied"):
        main(_data_argv(f, "--out-dir", str(tmp_path / "out")))


# ------------------------------------------------------------------ config values and files
def test_dtype_bfloat16_with_device_auto_on_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"train\.dtype='bfloat16'.*cpu"):
        main(TINY + ["--steps", "1", "--dtype", "bfloat16", "--out-dir", str(tmp_path)])


def test_seed_negative(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.seed=-3"):
        main(TINY + ["--steps", "1", "--seed", "-3", "--out-dir", str(tmp_path)])


def test_lr_inf(tmp_path):
    with pytest.raises(ConfigError, match=r"optim\.lr=inf.*finite"):
        main(TINY + ["--steps", "1", "--lr", "inf", "--out-dir", str(tmp_path)])


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


# ------------------------------------------------------------------ run directories
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A one-step run with its checkpoint, config.json and metrics.jsonl."""
    out = tmp_path_factory.mktemp("finished")
    main(TINY + ["--steps", "1", "--out-dir", str(out)])
    return out


def _copy(run, tmp_path) -> str:
    return str(shutil.copytree(run, tmp_path / "run"))


def test_checkpoint_shard_with_flipped_bytes(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    (path,) = [os.path.join(run, "checkpoints", d) for d in os.listdir(os.path.join(run, "checkpoints"))]
    test_checkpoint_integrity._flip(test_checkpoint_integrity._shard(path))
    with pytest.raises(CheckpointError, match=r"step_00000001: __0_\d+\.distcp: SHA-256 differs"):
        main(TINY + ["--steps", "2", "--resume", "--out-dir", run])


def test_resume_with_config_json_missing(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    os.remove(os.path.join(run, "config.json"))
    with pytest.raises(ConfigError, match=r"config\.json.*missing"):
        main(TINY + ["--steps", "2", "--resume", "--lr", "0.1", "--out-dir", run])


def test_resume_with_corrupt_config_json(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    with open(os.path.join(run, "config.json"), "r+") as f:
        f.truncate(40)
    with pytest.raises(ConfigError, match=r"config\.json.*not valid JSON"):
        main(TINY + ["--steps", "2", "--resume", "--out-dir", run])


def test_metrics_jsonl_truncated_last_line(finished_run, tmp_path):
    """A last line cut by a crash mid-write is dropped on resume, with a warning (documented
    repair); the resumed run appends valid lines."""
    run = _copy(finished_run, tmp_path)
    metrics = os.path.join(run, "metrics.jsonl")
    with open(metrics, "a") as f:
        f.write('{"step": 2, "loss": 5.')
    with pytest.warns(UserWarning, match=r"metrics\.jsonl.*line 2.*truncated"):
        main(TINY + ["--steps", "2", "--resume", "--out-dir", run])
    with open(metrics) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]


def test_out_dir_is_a_file(tmp_path):
    f = tmp_path / "out"
    f.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"--out-dir.*out.*not a directory"):
        main(TINY + ["--steps", "1", "--out-dir", str(f)])


def test_out_dir_read_only(tmp_path):
    if os.geteuid() == 0:  # root writes through permission bits; sysfs refuses everyone
        out = "/sys/cp-rope-run"
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        out = str(tmp_path / "ro" / "run")
    with pytest.raises(ConfigError, match=rf"--out-dir.*{out}.*cannot"):
        main(TINY + ["--steps", "1", "--out-dir", out])


def test_disk_too_full_for_a_checkpoint(tmp_path, monkeypatch):
    """A file system without room for one checkpoint fails before step 1, not at the end."""
    class Usage:
        free = 1000
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: Usage)
    with pytest.raises(ConfigError, match=r"--out-dir.*a checkpoint needs about .* free"):
        main(TINY + ["--steps", "1", "--out-dir", str(tmp_path)])
    assert not os.path.exists(tmp_path / "metrics.jsonl") or not open(tmp_path / "metrics.jsonl").read()


# ------------------------------------------------------------------ signals
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
    argv = TINY + ["--steps", "50", "--cp-size", "2", "--stop-grace-s", "2",
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
