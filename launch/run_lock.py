"""One run per ``--out-dir``: an advisory lock that rank 0 holds for the run's lifetime.

Two runs in one directory (started together, ``--overwrite`` or ``--resume`` while one
runs) would interleave their ``metrics.jsonl`` lines, delete or write each other's
checkpoints and overwrite each other's ``config.json``. Rank 0 takes an exclusive
``fcntl.flock`` on ``<out-dir>/run.lock`` before it looks at or deletes anything there
(:func:`cp_rope.launch.run_dir.prepare_out_dir`) and keeps it until the run ends. The
operating system drops the lock when the process exits, however it ends (killed with
SIGKILL included), so a dead run never leaves the directory locked; the file itself stays
(deleting it would let two runs lock two different files) and holds the holder's pid, host,
start time and command line, for the refusal message.

One node or many: only global rank 0 writes ``metrics.jsonl`` and ``config.json``, and the
checkpoints need ``--out-dir`` on a file system every rank shares, so rank 0's lock covers
the directory. On a file system without locks (some NFS mounts without a lock daemon) the
run goes on and logs that a second run would not be refused.

A second acquisition of a lock this process already holds (a run that follows another in
the same process, e.g. tests calling ``main`` twice) returns the held lock.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys

from .config import ConfigError

__all__ = ["LOCK_FILE", "OutDirLock", "lock_out_dir"]

LOCK_FILE = "run.lock"
"""The lock's file name inside ``--out-dir``."""
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_HELD: dict[str, OutDirLock] = {}
"""Locks this process holds, by the lock file's real path (an OS resource table: a flock
is per open file, so a second open in this process would refuse this process itself)."""


class OutDirLock:
    """An ``flock`` on ``<out-dir>/run.lock`` (or none, where the file system has no locks:
    ``held`` False and ``note`` says so). :meth:`release` (idempotent) closes it."""

    def __init__(self, path: str, fd: int | None, note: str | None = None):
        self.path, self._fd, self.note = path, fd, note

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        _HELD.pop(os.path.realpath(self.path), None)


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 65536, 0).split(b"\n")[0].decode("utf-8"))
        return (f"pid {info['pid']} on host {info['host']} since {info['started']}: "
                f"{info['command']}")
    except (OSError, ValueError, KeyError, TypeError):
        return "its holder did not record itself"


def lock_out_dir(out: str) -> OutDirLock:
    """Take ``out``'s run lock (``out`` exists and is writable; rank 0 only).

    Returns: the held lock; or, on a file system without locks, an unheld one whose ``note``
    says so. Raises: ConfigError naming ``--out-dir``, the lock file and the
    run holding it (another live run), or the error when the lock file cannot be opened.
    """
    path = os.path.join(out, LOCK_FILE)
    real = os.path.realpath(path)
    if real in _HELD:
        return _HELD[real]
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError(f"--out-dir {out!r}: its run lock {path} cannot be opened "
                          f"({exc.strerror or exc})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise ConfigError(
            f"--out-dir {out!r}: another run is using it ({holder}); two runs in one directory "
            "would mix their metrics.jsonl, checkpoints and config.json. Wait for it to end or "
            f"pass another --out-dir (its lock {path} is released when that process exits, "
            "killed included)") from None
    except OSError as exc:
        os.close(fd)
        if exc.errno not in _NO_LOCKS:
            raise ConfigError(f"--out-dir {out!r}: its run lock {path} cannot be taken "
                              f"({exc.strerror or exc})") from None
        return OutDirLock(path, None, note=(
            f"warning: --out-dir {out!r}: its file system has no locks ({exc.strerror}): a "
            "second run in this directory would not be refused"))
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started,
                       "command": " ".join([os.path.basename(sys.executable), *sys.argv])})
    os.ftruncate(fd, 0)
    os.pwrite(fd, info.encode("utf-8") + b"\n", 0)
    lock = _HELD[real] = OutDirLock(path, fd)
    return lock
