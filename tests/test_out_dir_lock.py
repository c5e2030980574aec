"""One run per ``--out-dir`` (issue 35, class 2): rank 0's flock on ``<out-dir>/run.lock``.

Before the lock, a second run on a directory (started together, ``--overwrite`` or
``--resume`` while one runs) went ahead: interleaved metrics.jsonl lines, one run's
checkpoints deleted by the other. Now it is refused with one ConfigError naming the
directory and the holder, on every rank, and nothing of the live run is touched; a killed
holder (SIGKILL) leaves nothing stuck.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist
from dist_utils import run_distributed
from utils import tiny_pretrain_argv

from cp_rope.launch import run_lock
from cp_rope.launch.config import ConfigError
from cp_rope.launch.pretrain import main
from cp_rope.launch.run_lock import LOCK_FILE, lock_out_dir

TINY = tiny_pretrain_argv()

_HOLDER = textwrap.dedent("""
    import fcntl, json, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": "node7", "started": "then",
                             "command": "the other run"}).encode())
    print("held", flush=True)
    time.sleep(600)
""")


def _files(out) -> dict[str, bytes]:
    found = {}
    for root, _, names in os.walk(out):
        for n in names:
            if n != LOCK_FILE:
                with open(os.path.join(root, n), "rb") as f:
                    found[os.path.relpath(os.path.join(root, n), out)] = f.read()
    return found


def test_a_live_run_holds_its_out_dir_and_a_killed_one_leaves_it_free(tmp_path):
    out = str(tmp_path / "run")
    main(TINY + ["--steps", "1", "--out-dir", out])  # an earlier run, finished: lock released
    before = _files(out)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, os.path.join(out, LOCK_FILE)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for flags in (["--steps", "2"], ["--steps", "2", "--overwrite"], ["--steps", "2", "--resume"],
                      ["--steps", "2", "--resume", "--overwrite"]):
            with pytest.raises(ConfigError, match=rf"--out-dir '{out}': another run is using it "
                               rf"\(pid {holder.pid} on host node7 since then: the other run\)"):
                main(TINY + flags + ["--out-dir", out])
        assert _files(out) == before, "a refused run touched the live run's files"
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up of its own: the OS drops the flock
        holder.wait(timeout=30)
    resumed = main(TINY + ["--steps", "2", "--resume", "--out-dir", out])
    assert resumed["start_step"] == 1 and sorted(resumed["losses"]) == [2]
    again = main(TINY + ["--steps", "3", "--resume", "--out-dir", out])  # same process, after
    assert sorted(again["losses"]) == [3]


def _every_rank_body(rank: int, world: int, out: str) -> None:
    fd = None
    if rank == 0:  # another run's rank 0 (a second open file: flock refuses this process too)
        os.makedirs(out, exist_ok=True)
        fd = os.open(os.path.join(out, LOCK_FILE), os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
    dist.barrier()
    try:
        with pytest.raises(ConfigError, match=r"another run is using it"):
            main(TINY + ["--cp-size", "2", "--steps", "1", "--out-dir", out])
    finally:
        if fd is not None:
            os.close(fd)
    dist.barrier()
    assert sorted(main(TINY + ["--steps", "1", "--out-dir", out,
                               "--overwrite"])["losses"]) == [1]


def test_the_refusal_reaches_every_rank(tmp_path):
    run_distributed(_every_rank_body, 2, str(tmp_path / "run"), timeout_s=300)


def test_a_file_system_without_locks_runs_with_a_warning(tmp_path, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    lock = lock_out_dir(str(tmp_path))
    assert not lock.held and "no locks (No locks available)" in lock.note
    lock.release()


def test_the_lock_records_its_holder_and_is_taken_once_per_process(tmp_path):
    lock = lock_out_dir(str(tmp_path))
    try:
        info = json.loads(open(tmp_path / LOCK_FILE).read())
        assert info["pid"] == os.getpid() and info["command"]
        assert lock_out_dir(str(tmp_path)) is lock  # a later run of this process
    finally:
        lock.release()
    lock_out_dir(str(tmp_path)).release()  # released: taken again
