"""Checkpoints that prove themselves: checksums written last, verified on load, fallback on resume.

Every damage a disk, a copy or a kill can do to the newest checkpoint (flipped
bytes, a truncated or missing shard, a truncated or empty ``.metadata``, a
damaged or missing manifest, kill -9 at several moments of a save) must never
be loaded: ``--resume`` skips it, says so, resumes from the last checkpoint
that verifies, and the losses after the resume equal the uninterrupted run's
bit for bit. One process on CPU, the tiny model, a few steps.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from utils import tiny_pretrain_argv

from cp_rope.launch import checkpoint as ckpt
from cp_rope.launch import checkpoint_space as space
from cp_rope.launch.checkpoint import (
    MANIFEST,
    CheckpointError,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from cp_rope.launch.pretrain import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = tiny_pretrain_argv(seq_len=64, tokens_per_batch=256, max_docs=16)
# Checkpoints after steps 1, 2 and 3; a resume that falls back to step 2 re-runs step 3 and
# saves it again: its loss and the saved weights and optimizer state must equal the
# uninterrupted run's bit for bit (the optimizer state of the checkpoint drives that update).
RUN = TINY + ["--steps", "3", "--checkpoint-every", "1", "--keep-checkpoints", "0"]
STEP1, STEP2, STEP3 = "step_00000001", "step_00000002", "step_00000003"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: its directory (checkpoints after steps 1, 2, 3) and its losses."""
    out = tmp_path_factory.mktemp("reference")
    summary = main(RUN + ["--out-dir", str(out)])
    assert sorted(summary["losses"]) == [1, 2, 3]
    assert sorted(os.listdir(out / "checkpoints")) == [STEP1, STEP2, STEP3]
    return out, summary["losses"]


def _shard(path) -> str:
    shards = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    assert shards, os.listdir(path)
    return os.path.join(path, max(shards, key=lambda f: os.path.getsize(os.path.join(path, f))))


def _flip(file: str) -> None:
    """Invert 8 bytes in the middle of ``file`` (its size stays the same)."""
    with open(file, "r+b") as f:
        f.seek(os.path.getsize(file) // 2)
        data = f.read(8)
        f.seek(-len(data), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))


def _truncate(file: str, fraction: float) -> None:
    with open(file, "r+b") as f:
        f.truncate(int(os.path.getsize(file) * fraction))


# damage -> (how, the file the reason must name)
DAMAGE = {
    "flipped_bytes_in_shard": (lambda p: _flip(_shard(p)), ".distcp"),
    "truncated_shard": (lambda p: _truncate(_shard(p), 0.5), ".distcp"),
    "missing_shard": (lambda p: os.remove(_shard(p)), ".distcp"),
    "flipped_bytes_in_metadata": (lambda p: _flip(os.path.join(p, ".metadata")), ".metadata"),
    "truncated_metadata": (lambda p: _truncate(os.path.join(p, ".metadata"), 0.5), ".metadata"),
    "empty_metadata": (lambda p: _truncate(os.path.join(p, ".metadata"), 0.0), ".metadata"),
    "damaged_manifest": (lambda p: _truncate(os.path.join(p, MANIFEST), 0.5), MANIFEST),
    "missing_manifest": (lambda p: os.remove(os.path.join(p, MANIFEST)), MANIFEST),
    "shard_entry_dropped_and_shard_damaged": (lambda p: _drop_entry_and_flip(p), ".distcp"),
}


def _drop_entry_and_flip(path: str) -> None:
    """Remove the largest shard's entry from the manifest (still valid JSON), then damage the
    shard: the manifest no longer covers every file .metadata names (issue 22 item 12)."""
    shard = _shard(path)
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    del manifest["files"][os.path.basename(shard)]
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f)
    _flip(shard)


def _copy_run(src, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _trained_state(run_dir) -> dict:
    """Model and optimizer tensors of ``run_dir``'s step-3 checkpoint."""
    out = os.path.join(run_dir, "step3.pt")
    dcp_to_torch_save(os.path.join(run_dir, "checkpoints", STEP3), out)
    state = torch.load(out, weights_only=False)
    return {k: v for section in ("model", "optim") for k, v in _flat(state[section], section)}


def _flat(obj, prefix):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flat(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _flat(v, f"{prefix}[{i}]")
    else:
        yield prefix, obj


def _assert_same_run(resumed: dict, run_dir, reference) -> None:
    """Resumed after step 2; step 3's loss and the weights and AdamW moments saved after it
    equal the uninterrupted run's bit for bit."""
    ref_dir, ref_losses = reference
    assert resumed["start_step"] == 2 and sorted(resumed["losses"]) == [3], resumed
    assert resumed["losses"][3] == ref_losses[3], (resumed["losses"][3], ref_losses[3])
    got, want = _trained_state(run_dir), _trained_state(ref_dir)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        same = torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value
        assert same, f"{key} differs from the uninterrupted run's"


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_resume_skips_a_damaged_newest_checkpoint(kind, reference, tmp_path, capsys):
    """The newest checkpoint damaged: --resume says it skipped it (and why, naming the file),
    resumes from the older one, reproduces the losses bit for bit and replaces the damaged one."""
    run = _copy_run(reference[0], tmp_path / "run")
    damage, names = DAMAGE[kind]
    damage(os.path.join(run, "checkpoints", STEP3))
    capsys.readouterr()
    resumed = main(RUN + ["--out-dir", run, "--resume"])
    out = capsys.readouterr()
    log = out.out + out.err
    assert f"skipped {os.path.join(run, 'checkpoints', STEP3)}" in log and names in log, log
    assert f"resumed from {os.path.join(run, 'checkpoints', STEP2)}" in log, log
    # the re-run's step-3 checkpoint replaced the damaged one, verifies and holds the same bits
    assert verify_checkpoint(os.path.join(run, "checkpoints", STEP3)) is None
    _assert_same_run(resumed, run, reference)


def test_resume_refuses_a_checkpoint_of_another_run(reference, tmp_path):
    """Checkpoints copied from another run (here: seed 0) into a run dir whose config.json says
    seed 1 pass the config.json check and verify, but their manifest names the run that wrote
    them: --resume --seed 1 stops before loading, naming both seeds (issue 22 item 7)."""
    run = _copy_run(reference[0], tmp_path / "run")
    with open(os.path.join(run, "config.json")) as f:
        config = json.load(f)
    config["train"]["seed"] = 1
    with open(os.path.join(run, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match=r"step_00000003 was written by another run "
                                              r"\(train\.seed: 0 \(checkpoint\) != 1 \(this run\).*"
                                              r"nothing was loaded"):
        main(RUN + ["--out-dir", run, "--resume", "--seed", "1"])
    assert not dist.is_initialized()


@pytest.mark.parametrize("kind", ["symlink", "renamed"])
def test_resume_refuses_a_checkpoint_that_is_not_the_save_its_name_says(kind, reference, tmp_path):
    """Round 4 #7: step_3 a symlink to step_1 (or step_2 renamed step_3) was resumed 'at step
    1', trained steps 2-3, then failed at the save (rmtree of a symlink) after the work. Now
    the load stops before training, naming the path."""
    run = _copy_run(reference[0], tmp_path / "run")
    root = os.path.join(run, "checkpoints")
    shutil.rmtree(os.path.join(root, STEP3))
    if kind == "symlink":
        os.symlink(STEP1, os.path.join(root, STEP3))
        match = rf"{root}/{STEP3} is a symbolic link \(to {STEP1}\).*nothing was loaded"
    else:
        os.rename(os.path.join(root, STEP2), os.path.join(root, STEP3))
        match = (rf"{root}/{STEP3} is named for step 3 but its {MANIFEST} records step 2 "
                 r"\(renamed or copied\?\).*nothing was loaded")
    with pytest.raises(CheckpointError, match=match):
        main(RUN + ["--out-dir", run, "--resume", "--steps", "4"])
    assert not dist.is_initialized()
    assert not os.path.exists(os.path.join(root, "step_00000004"))


def test_resume_refuses_when_no_checkpoint_verifies(reference, tmp_path):
    """Every checkpoint damaged: a clear error listing each (starting over would discard the run)."""
    run = _copy_run(reference[0], tmp_path / "run")
    _flip(_shard(os.path.join(run, "checkpoints", STEP3)))
    os.remove(os.path.join(run, "checkpoints", STEP2, ".metadata"))
    shutil.rmtree(os.path.join(run, "checkpoints", STEP1))
    with pytest.raises(CheckpointError, match=rf"no checkpoint .* verifies: {STEP3}: .*\.distcp.*; "
                                              rf"{STEP2}: \.metadata is missing"):
        main(RUN + ["--out-dir", run, "--resume"])
    assert not dist.is_initialized()


# kill -9 of the trainer while it saves step 3, at three moments (see the driver below)
_KILL_DRIVER = r"""
import os, signal, sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from cp_rope.launch import checkpoint as ckpt
from cp_rope.launch import checkpoint_space as space
from cp_rope.launch.pretrain import main

moment, target = sys.argv[1], "step_00000003.partial"
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
if moment == "shard_written_not_synced":  # DCP has written the shard's bytes, not .metadata
    fsync = os.fsync
    def _fsync(fd):
        where = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        if target in where and where.endswith(".distcp"):
            die()
        fsync(fd)
    os.fsync = _fsync
elif moment == "dcp_done_manifest_not_written":  # every DCP file there, no checksums yet
    sha = ckpt._sha256
    ckpt._sha256 = lambda p: die() if target in p else sha(p)
elif moment == "manifest_written_not_renamed":  # complete but still step_<N>.partial
    rename = os.rename
    os.rename = lambda a, b: die() if str(a).endswith(target) else rename(a, b)
main(sys.argv[2:])
"""
KILL_MOMENTS = ("shard_written_not_synced", "dcp_done_manifest_not_written",
                "manifest_written_not_renamed")


@pytest.mark.slow
def test_kill_9_during_a_save_never_leaves_a_checkpoint_that_loads_damaged(reference, tmp_path):
    """kill -9 at three moments of the step-3 save (the processes run side by side): no
    step_3 appears, the leftover .partial is never read, --resume continues from step 2 with
    the uninterrupted run's loss and weights bit for bit, and the next save removes the leftover."""
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    procs = {m: subprocess.Popen([sys.executable, "-c", _KILL_DRIVER, m, *RUN, "--out-dir",
                                  str(tmp_path / m)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for m in KILL_MOMENTS}
    for moment, proc in procs.items():
        out = proc.communicate(timeout=180)[0]
        assert proc.returncode == -signal.SIGKILL, f"{moment}: exit {proc.returncode}\n{out}"
        root = tmp_path / moment / "checkpoints"
        assert sorted(os.listdir(root)) == [STEP1, STEP2, STEP3 + ".partial"], (moment, os.listdir(root))
    for moment in KILL_MOMENTS:
        resumed = main(RUN + ["--out-dir", str(tmp_path / moment), "--resume"])
        root = tmp_path / moment / "checkpoints"
        assert sorted(os.listdir(root)) == [STEP1, STEP2, STEP3], (moment, os.listdir(root))
        _assert_same_run(resumed, tmp_path / moment, reference)


# ------------------------------------------------------------------ library level
@pytest.fixture
def group():
    """A one-process gloo group for the collective checkpoint functions."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _state(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).square().sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched


def test_load_refuses_a_damaged_checkpoint_and_changes_nothing(group, tmp_path):
    """load_checkpoint verifies first: flipped bytes in a shard raise CheckpointError naming the
    directory and the file, and the model and optimizer are untouched (nothing partially loaded)."""
    model, opt, sched = _state(0)
    path = save_checkpoint(str(tmp_path), 7, model, opt, sched, {"epoch": 0})
    assert sorted(os.listdir(tmp_path)) == ["step_00000007"]
    assert MANIFEST in os.listdir(path) and verify_checkpoint(path) is None
    _flip(_shard(path))
    other, other_opt, other_sched = _state(1)
    before = [p.detach().clone() for p in other.parameters()]
    opt_before = [s["exp_avg"].clone() for s in other_opt.state.values()]
    with pytest.raises(CheckpointError, match=r"step_00000007: __0_\d+\.distcp: SHA-256 differs.*nothing "
                                              r"was loaded"):
        load_checkpoint(path, other, other_opt, other_sched, {"epoch": 0})
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(opt_before, other_opt.state.values(), strict=True))


def test_failed_save_keeps_the_last_good_one_and_says_why(group, tmp_path, monkeypatch):
    """A save that fails after writing some files (a full disk) raises ONE CheckpointError naming
    the cause and the last good checkpoint, which stays; the half-written .partial is removed;
    the next save works and prunes as usual."""
    model, opt, sched = _state(0)
    save_checkpoint(str(tmp_path), 2, model, opt, sched, {})

    def failing_save(state, checkpoint_id):
        os.makedirs(checkpoint_id, exist_ok=True)
        with open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb") as f:
            f.write(b"half a shard")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "dcp", types.SimpleNamespace(save=failing_save, load=ckpt.dcp.load))
    last = re.escape(str(tmp_path / "step_00000002"))
    with pytest.raises(CheckpointError, match=rf"saving checkpoint step_00000004 failed: OSError: "
                                              rf"\[Errno 28\] No space left on device \(.*GiB free.*"
                                              rf"the last good checkpoint, {last}, is kept"):
        save_checkpoint(str(tmp_path), 4, model, opt, sched, {})
    assert sorted(os.listdir(tmp_path)) == ["step_00000002"]
    assert resume_checkpoint(str(tmp_path)) == (str(tmp_path / "step_00000002"), [])
    monkeypatch.undo()
    save_checkpoint(str(tmp_path), 3, model, opt, sched, {}, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["step_00000003"]  # the older one pruned


def test_failed_dcp_write_is_one_line_not_a_traceback(group, tmp_path, monkeypatch):
    """DCP's own failure (a CheckpointException, a BaseException whose text is every rank's
    traceback) becomes one line: the failing rank and its exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    model, opt, sched = _state(0)
    real = ckpt.dcp.save

    def failing_write(state, checkpoint_id):
        try:
            raise OSError(30, "Read-only file system", os.path.join(checkpoint_id, "__0_0.distcp"))
        except OSError as exc:
            raise CheckpointException("save failed", {0: (exc, None)}) from None

    monkeypatch.setattr(ckpt, "dcp", types.SimpleNamespace(save=failing_write, load=ckpt.dcp.load))
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(str(tmp_path), 1, model, opt, sched, {})
    msg = str(info.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    assert "rank 0: OSError: [Errno 30] Read-only file system" in msg, msg
    assert "there is no earlier checkpoint" in msg and os.listdir(tmp_path) == [], msg
    monkeypatch.setattr(ckpt, "dcp", types.SimpleNamespace(save=real, load=ckpt.dcp.load))


def test_file_size_limit_during_a_save(group, tmp_path):
    """A real write failure: ulimit -f below the shard's size (Python ignores SIGXFSZ, so the
    write fails with EFBIG inside DCP); one CheckpointError naming the limit, nothing left."""
    import resource

    model, opt, sched = _state(0)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(CheckpointError, match=r"saving checkpoint step_00000001 failed: .*"
                                                  r"file-size limit \(ulimit -f\) 4096 bytes"):
            save_checkpoint(str(tmp_path), 1, model, opt, sched, {})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert os.listdir(tmp_path) == []


def test_keep_prunes_only_older_steps(group, tmp_path):
    """keep=2 after a fallback: the damaged newer step_4 stays (for inspection) until this run
    saves step 4 again; older verified ones beyond keep are deleted."""
    model, opt, sched = _state(0)
    for step in (1, 2, 4):
        save_checkpoint(str(tmp_path), step, model, opt, sched, {}, keep=0)
    _flip(_shard(tmp_path / "step_00000004"))
    path, skipped = resume_checkpoint(str(tmp_path))
    assert path == str(tmp_path / "step_00000002")
    assert [p for p, _ in skipped] == [str(tmp_path / "step_00000004")]
    save_checkpoint(str(tmp_path), 3, model, opt, sched, {}, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000002", "step_00000003", "step_00000004"]
    save_checkpoint(str(tmp_path), 4, model, opt, sched, {}, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000004"]
    assert verify_checkpoint(str(tmp_path / "step_00000004")) is None


def test_checkpoint_size_estimate_and_full_disk(group, tmp_path, monkeypatch):
    """The estimate covers what a save writes (model + AdamW state), within 2x, and a file
    system with less free space fails before training, naming --out-dir."""
    model, opt, sched = _state(0)
    need = space.check_checkpoint_space(str(tmp_path / "ck"), model, opt)
    path = save_checkpoint(str(tmp_path / "ck"), 1, model, opt, sched, {})
    written = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert written <= need <= 2 * written + 2**20, (written, need)
    assert os.listdir(tmp_path / "ck") == ["step_00000001"]  # the probe is gone
    monkeypatch.setattr(space.shutil, "disk_usage", lambda p: types.SimpleNamespace(free=need - 1))
    with pytest.raises(ValueError, match=r"--out-dir .*ck.*: a checkpoint needs about .* MiB .* free"):
        space.check_checkpoint_space(str(tmp_path / "ck2"), model, opt)


@pytest.mark.parametrize(("keep", "saves", "existing", "copies"), [
    (2, 10, 0, 3), (2, 10, 2, 1), (2, 10, 5, 1), (2, 1, 0, 1), (1, 5, 0, 2),
    (0, 4, 0, 4), (0, 4, 3, 4), (5, 2, 1, 2)])
def test_copies_needed(keep, saves, existing, copies):
    """keep + 1 at once (the next save lands before pruning), never more than the run's saves;
    keep 0 keeps every save; checkpoints already on disk already hold their space."""
    assert space.copies_needed(keep, saves, existing) == copies


def test_space_for_keep_plus_one(group, tmp_path, monkeypatch):
    """Room for one checkpoint but not the --keep-checkpoints 2 the run needs (3 at once):
    refused at start-up, naming the copies and --keep-checkpoints (issue 22 item 8)."""
    model, opt, _ = _state(0)
    one = space.estimate_checkpoint_bytes(model, opt)
    monkeypatch.setattr(space.shutil, "disk_usage", lambda p: types.SimpleNamespace(free=2 * one))
    assert space.check_checkpoint_space(str(tmp_path), model, opt, keep=1, saves=5) == 2 * one
    with pytest.raises(ValueError, match=r"--out-dir .*: .*\(3 checkpoints at once: "
                                         r"--keep-checkpoints 2 and the next one"):
        space.check_checkpoint_space(str(tmp_path), model, opt, keep=2, saves=5)


def test_load_refuses_another_run_before_reading(group, tmp_path, monkeypatch):
    """A checkpoint that verifies but was written by another run (model shape, seed, cp_size or
    world size): CheckpointError naming both values, before DCP reads anything (issue 22 item 7)."""
    model, opt, sched = _state(0)
    written = {"model.dim": 128, "train.seed": 0, "parallel.cp_size": 2, "world_size": 1}
    path = save_checkpoint(str(tmp_path), 1, model, opt, sched, {}, run=written)
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    assert manifest["run"] == written and manifest["torch"] == torch.__version__
    monkeypatch.setattr(ckpt, "dcp", types.SimpleNamespace(save=None, load=None))  # must not be used
    for key, value in (("model.dim", 256), ("train.seed", 1), ("parallel.cp_size", 1)):
        with pytest.raises(CheckpointError, match=rf"written by another run \({re.escape(key)}: "
                                                  rf"{written[key]} \(checkpoint\) != {value} "
                                                  rf"\(this run\).*nothing was loaded"):
            load_checkpoint(path, model, opt, sched, {}, run=written | {key: value})
    manifest["world_size"] = manifest["run"]["world_size"] = 2
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CheckpointError, match=r"world_size: 2 \(checkpoint\) != 1 \(this run\)"):
        load_checkpoint(path, model, opt, sched, {}, verify=False)


def test_load_failure_names_both_torch_versions(group, tmp_path, monkeypatch):
    """DCP cannot read a checkpoint (here: a load that fails): the error names the torch that
    wrote it (from the manifest) and this one."""
    model, opt, sched = _state(0)
    path = save_checkpoint(str(tmp_path), 1, model, opt, sched, {})
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    manifest["torch"] = "2.99.0"
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f)

    def failing_load(state, checkpoint_id):
        raise RuntimeError("Unexpected key")

    monkeypatch.setattr(ckpt, "dcp", types.SimpleNamespace(save=None, load=failing_load))
    with pytest.raises(CheckpointError, match=rf"loading failed \(RuntimeError: Unexpected key\); "
                                              rf"it was written by torch 2\.99\.0, this is torch "
                                              rf"{re.escape(torch.__version__)}"):
        load_checkpoint(path, model, opt, sched, {}, verify=False)


def _two_rank_body(rank: int, world: int, root: str) -> None:
    model, opt, sched = _state(0)
    for step in (1, 2):
        save_checkpoint(root, step, model, opt, sched, {"rank": rank})
    newest = os.path.join(root, "step_00000002")
    with open(os.path.join(newest, MANIFEST)) as f:
        names = sorted(json.load(f)["files"])
    assert len(names) >= 3 and all(os.path.isfile(os.path.join(newest, n)) for n in names), names
    victim = [n for n in names if n != ".metadata"][1::world][0]  # a file rank 1 hashes, not rank 0
    dist.barrier()
    if rank == 0:
        _flip(os.path.join(newest, victim))
    dist.barrier()
    path, skipped = resume_checkpoint(root)  # the same verdict on both ranks
    assert path == os.path.join(root, "step_00000001"), path
    assert [p for p, _ in skipped] == [newest] and victim in skipped[0][1], skipped
    with pytest.raises(CheckpointError, match=rf"{re.escape(victim)}: SHA-256 differs"):
        load_checkpoint(newest, model, opt, sched, {"rank": -1})
    step, sampler = load_checkpoint(path, model, opt, sched, {"rank": -1})
    assert (step, sampler) == (1, {"rank": rank})
    # a save failing on rank 1 alone (its hashing: an I/O error): the same one error on both
    real = ckpt._sha256

    def broken(p):
        raise OSError(5, "Input/output error", p)

    ckpt._sha256 = broken if rank == 1 else real
    try:
        with pytest.raises(CheckpointError, match=r"saving checkpoint step_00000003 failed: hashing "
                                                  r"on rank 1: OSError: \[Errno 5\] Input/output "
                                                  r"error.*the last good checkpoint, .*step_00000002, "
                                                  r"is kept"):
            save_checkpoint(root, 3, model, opt, sched, {"rank": rank})
    finally:
        ckpt._sha256 = real
    dist.barrier()
    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000002"]


def test_two_ranks_share_the_hashing_and_the_verdict(tmp_path):
    """World 2: each rank hashes its share of the files; damage seen by rank 1 alone makes both
    ranks skip the checkpoint (and load_checkpoint raise on both), no hang; a save failing on
    rank 1 alone raises the same CheckpointError on both ranks and keeps the last good one."""
    run_distributed(_two_rank_body, 2, str(tmp_path), timeout_s=60)


# ------------------------------------------------------------------ a flipped byte in a run's only checkpoint (the issue-15 catalogue)

def test_checkpoint_shard_with_flipped_bytes(finished_run, tmp_path):
    run = str(shutil.copytree(finished_run, tmp_path / "run"))
    (path,) = [os.path.join(run, "checkpoints", d) for d in os.listdir(os.path.join(run, "checkpoints"))]
    _flip(_shard(path))
    with pytest.raises(CheckpointError, match=r"step_00000001: __0_\d+\.distcp: SHA-256 differs"):
        main(TINY + ["--steps", "2", "--resume", "--out-dir", run])
