"""The ranks of a job agree on their run before step 1 (issue 35, class 1).

Two gloo ranks started with one flag (or input file, or environment variable) different:
every rank raises one RunIdentityError naming the field and each rank's value, at set-up,
before the out-dir is touched (before this check: silently wrong training, a wait for the
process-group timeout or a raw gloo abort). Many cases per spawned world.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from dist_utils import run_distributed
from utils import tiny_pretrain_argv

from cp_rope.launch import run_identity
from cp_rope.launch.config import ConfigError, PretrainConfig
from cp_rope.launch.pretrain import main
from cp_rope.launch.run_identity import (
    RunIdentityError,
    agree_run_identity,
    describe_differences,
    file_digest,
)

TINY = tiny_pretrain_argv()

# (flags of rank 0, flags of rank 1, what the message must say)
DIFFERENT_FLAGS = [
    (["--lr", "1e-3"], ["--lr", "2e-3"], r"optim\.lr: 0\.001 \(rank 0\) vs 0\.002 \(rank 1\)"),
    (["--grad-clip", "1"], ["--grad-clip", "0.5"], r"optim\.grad_clip: 1\.0 \(rank 0\) vs 0\.5"),
    (["--warmup-steps", "2"], ["--warmup-steps", "3"], r"optim\.warmup_steps: 2 \(rank 0\) vs 3"),
    (["--steps", "4"], ["--steps", "5"], r"train\.steps: 4 \(rank 0\) vs 5 \(rank 1\)"),
    (["--checkpoint-every", "2"], [], r"train\.checkpoint_every: 2 \(rank 0\) vs 0 \(rank 1\)"),
    (["--n-layers", "2"], ["--n-layers", "3"], r"model\.n_layers: 2 \(rank 0\) vs 3"),
    (["--tokenizer", "bytes"], ["--tokenizer", "bpe"], r"data\.tokenizer: 'bytes' \(rank 0\) vs 'bpe'"),
    (["--eval-docs", "2", "--eval-every", "1"], ["--eval-docs", "2", "--eval-every", "2"],
     r"train\.eval_every: 1 \(rank 0\) vs 2"),
    (["--log-every", "1"], ["--log-every", "3"], r"train\.log_every: 1 \(rank 0\) vs 3"),
    (["--cp-self-test", "on"], ["--cp-self-test", "off"], r"parallel\.cp_self_test: 'on' \(rank 0\) vs 'off'"),
    ([], ["--activation-checkpointing"], r"model\.activation_checkpointing: 'none' \(rank 0\) vs 'full'"),
    (["--fused-loss"], ["--no-fused-loss"], r"model\.fused_loss: True \(rank 0\) vs False"),
    (["--seed", "0"], ["--seed", "1"], r"train\.seed: 0 \(rank 0\) vs 1 \(rank 1\)"),
    (["--timeout-s", "60"], ["--timeout-s", "90"], r"parallel\.timeout_s: 60 \(rank 0\) vs 90"),
    # two fields at once: both named, the count given
    (["--lr", "1e-3", "--seed", "3"], ["--lr", "1e-2", "--seed", "4"],
     r"disagree on their run \(2 fields\): optim\.lr: .*; train\.seed: 3 \(rank 0\) vs 4"),
]


def _refused(fn, pattern: str, *args, exc: type[Exception] = RunIdentityError, **kw) -> str:
    t0 = time.monotonic()
    try:
        fn(*args, **kw)
    except exc as e:
        assert re.search(pattern, str(e)), f"message {str(e)!r} does not match {pattern!r}"
        assert time.monotonic() - t0 < 20, "the refusal took the timeout, not one collective"
        return str(e)
    raise AssertionError(f"no {exc.__name__} (expected {pattern!r})")


def _jsonl(path: str, texts: list[str]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return path


def _disagreement_body(rank: int, world: int, tmp: str) -> None:
    for i, (zero, one, pattern) in enumerate(DIFFERENT_FLAGS):
        out = os.path.join(tmp, f"case{i}")
        argv = TINY + (zero if rank == 0 else one) + ["--out-dir", out]
        _refused(main, pattern, argv)
        assert not os.path.exists(out), f"case {i}: the out-dir was touched before the agreement"

    # a corpus with the same document lengths but other text on rank 1 (a per-node copy):
    # the same path on both ranks, rank 1 reading its own copy
    texts = ["def f(x):\n    return x\n" * 3, "class A:\n    pass\n" * 4]
    same = _jsonl(os.path.join(tmp, "corpus.jsonl"), texts)
    other = _jsonl(os.path.join(tmp, f"copy{rank}.jsonl"),
                   [t.upper() if rank == 1 else t for t in texts])
    real = run_identity.corpus_files
    run_identity.corpus_files = lambda d: [other] if d.data == same else real(d)
    try:
        argv = TINY + ["--data", same, "--out-dir", os.path.join(tmp, "corpus")]
        _refused(main, r"contents\.data\.data: 'sha256:\w+' \(rank 0\) vs "
                                     r"'sha256:\w+' \(rank 1\)", argv)
    finally:
        run_identity.corpus_files = real

    # an environment variable that changes what a rank computes
    if rank == 1:
        os.environ["CP_ROPE_DEBUG"] = "1"
    try:
        _refused(main, r"env\.CP_ROPE_DEBUG: None \(rank 0\) vs '1' \(rank 1\)",
                 TINY + ["--out-dir", os.path.join(tmp, "env")])
    finally:
        os.environ.pop("CP_ROPE_DEBUG", None)

    # a --cp-calibration file at the same (relative) path with other contents on rank 1: auto's
    # choices would differ between the ranks (refused before the out-dir is touched)
    here = os.getcwd()
    os.makedirs(cal_dir := os.path.join(tmp, f"cal{rank}"))
    with open(os.path.join(cal_dir, "cal.json"), "w") as f:
        json.dump({"format": 1, "measured_on": f"node {rank}"}, f)
    os.chdir(cal_dir)
    try:
        _refused(main, r"contents\.parallel\.cp_calibration: 'sha256:\w+' \(rank 0\) vs "
                       r"'sha256:\w+' \(rank 1\)",
                 TINY + ["--cp-calibration", "cal.json", "--out-dir", os.path.join(tmp, "cal")])
    finally:
        os.chdir(here)

    # one rank's own check fails (cp_size does not divide this world): its own ConfigError
    # there, one RunIdentityError naming it on the other rank, nobody waits
    argv = TINY + ["--cp-size", "4" if rank == 1 else "2", "--out-dir", os.path.join(tmp, "cp")]
    if rank == 1:
        _refused(main, r"parallel\.cp_size=4: must divide the world size 2", argv,
                 exc=ConfigError)
    else:
        _refused(main, r"another rank refused its configuration: rank 1: parallel\.cp_size=4",
                 argv)

    # ranks that agree train (cp 2: the CP forward joins both ranks' shards)
    summary = main(TINY + ["--cp-size", "2", "--steps", "1", "--no-save-final",
                           "--out-dir", os.path.join(tmp, "agree")])
    assert sorted(summary["losses"]) == [1]

    # a peer that never comes: a named error after the timeout, not the group's 600 s
    if rank == 0:
        cfg = PretrainConfig()
        cfg.data.max_docs, cfg.data.tokenizer = 2, "bytes"
        _refused(agree_run_identity, r"rank 0: a peer did not reach the run-identity check "
                 r"within 2 s", cfg, timeout_s=2)
    else:
        time.sleep(5)


def test_ranks_that_disagree_on_their_run_are_refused_on_every_rank(tmp_path):
    run_distributed(_disagreement_body, 2, str(tmp_path), timeout_s=300)


def test_describe_differences_groups_ranks_by_value():
    views = [{"a": 1, "b": 2}, {"a": 1, "b": 3}, {"a": 1, "b": 2}, {"a": 1}]
    assert describe_differences(views) == ["b: 2 (ranks 0,2) vs 3 (rank 1) vs '<absent>' (rank 3)"]
    assert describe_differences(views[:1] * 3) == []


def test_file_digest_sees_an_edit_of_equal_length(tmp_path, monkeypatch):
    p = tmp_path / "f.bin"
    p.write_bytes(b"a" * 5000)
    whole = file_digest(str(p))
    p.write_bytes(b"a" * 4999 + b"b")
    assert whole.startswith("sha256:") and file_digest(str(p)) != whole
    # a large file: sampled blocks (here a block of 100 of a 5000-byte "large" file)
    monkeypatch.setattr(run_identity, "WHOLE_FILE_BYTES", 1000)
    monkeypatch.setattr(run_identity, "SAMPLE_BYTES", 100)
    sampled = file_digest(str(p))
    p.write_bytes(b"b" + b"a" * 4998 + b"b")  # the first block changed
    assert sampled.startswith("sha256-sampled:") and file_digest(str(p)) != sampled
    p.write_bytes(b"a" * 5001)  # the size changed
    assert file_digest(str(p)) != sampled


def test_one_rank_alone_checks_its_inputs(tmp_path):
    """World 1: no collective; an unreadable corpus file is named."""
    d = tmp_path / "docs"
    d.mkdir()
    (d / "a.txt").write_text("hello")
    (d / "b.txt").write_text("world")
    cfg = PretrainConfig()
    cfg.data.data, cfg.data.tokenizer = str(d), "bytes"
    first = run_identity.content_digests(cfg)
    assert first["data.data"].endswith("(2 files)")
    (d / "b.txt").write_text("World")
    assert run_identity.content_digests(cfg) != first
    (d / "b.txt").unlink()
    (d / "b.txt").symlink_to(d / "gone")  # listed, then unreadable (as root too)
    with pytest.raises(ConfigError, match=r"data\.data \(file '.*b\.txt'\): cannot be read"):
        run_identity.content_digests(cfg)
