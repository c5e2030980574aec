"""The run directory (``--out-dir``): the rules for a fresh, an overwritten and a resumed run.

A fresh run must not mix with an earlier run's checkpoints or ``metrics.jsonl``;
``--overwrite`` deletes them; ``--resume`` must keep the fields of
:data:`~cp_rope.launch.resume_config.RESUME_FIXED` (checked against the earlier run's
``config.json``) and the contents of its corpus and tokenizer files; one run at a time
(:mod:`cp_rope.launch.run_lock`). Rank 0 decides, every rank raises the same ConfigError.

:func:`start_run` is the trainers' set-up of all that, in order: the ranks' agreement on
the run (:func:`cp_rope.launch.run_identity.agree_run_identity`), the lock, these rules.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field

import torch.distributed as dist

from .checkpoint import has_checkpoints
from .config import SECTIONS, ConfigError, PretrainConfig, to_dict
from .resume_config import check_resume_config
from .run_identity import agree_run_identity, file_digest, run_identity
from .run_lock import OutDirLock, lock_out_dir

__all__ = ["prepare_out_dir", "start_run", "RunStart"]


def _check_out_dir(out: str) -> None:
    """ConfigError naming ``--out-dir`` unless ``out`` is (or can be made) a writable directory."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out-dir {out!r}: exists and is not a directory")
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise ConfigError(f"--out-dir {out!r}: cannot be created or written "
                          f"({exc.strerror or exc})") from None


def _saved_config(path: str) -> dict:
    """The earlier run's ``config.json`` for :func:`check_resume_config`; ConfigError naming the
    file when it is missing, not JSON or not a config (the resume check cannot be skipped)."""
    fix = "restore it, or start a new run (--overwrite or another --out-dir)"
    if not os.path.isfile(path):
        raise ConfigError(f"--resume: {path} is missing, so the fields a resume must keep "
                          f"cannot be checked against the checkpoints' run; {fix}")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--resume: {path} is not valid JSON ({exc}); {fix}") from None
    if not isinstance(saved, dict) or not all(isinstance(saved.get(s, {}), dict) for s in SECTIONS):
        raise ConfigError(f"--resume: {path} is not a config this trainer wrote (an object of "
                          f"sections {list(SECTIONS)}); {fix}")
    return saved


def _check_contents(saved: dict, contents: dict[str, str], path: str) -> None:
    """ConfigError naming each input file whose contents differ from the ones ``saved`` (the
    earlier run's ``config.json``) records; names it lacks (older runs) are not compared."""
    old = saved.get("contents") if isinstance(saved.get("contents"), dict) else {}
    diffs = [f"{name}={saved.get(name.split('.')[0], {}).get(name.partition('.')[2])!r}: "
             f"{old[name]} (then) != {digest} (now)"
             for name, digest in contents.items() if name in old and old[name] != digest]
    if diffs:
        raise ConfigError(f"--resume: the contents of the run's input files changed since the "
                          f"checkpoints were written ({path}): " + "; ".join(diffs) + ". Restore "
                          "them, or start a new run (--overwrite or another --out-dir)")


def prepare_out_dir(cfg: PretrainConfig, rank: int,
                    contents: dict[str, str] | None = None) -> OutDirLock | None:
    """A resumed run must keep the checkpoint's config (:func:`check_resume_config`
    against out_dir/config.json); a fresh run (no ``--resume``) must not mix with
    an earlier run's files in out_dir.

    Its checkpoints would be pruned and resumed from together with the new
    ones (by step) and its metrics.jsonl truncated. With ``--overwrite`` rank 0
    deletes them (and the TensorBoard events) first; otherwise ConfigError,
    decided on rank 0 (before this run writes anything) and raised on every
    rank, before any heavy work. With checkpoints to resume, ``config.json`` must
    be there and readable (else the check could not be made). The out-dir must
    be a writable directory (ConfigError naming ``--out-dir`` and the path). Rank 0 first
    takes the directory's run lock (:func:`~cp_rope.launch.run_lock.lock_out_dir`; another
    live run there: ConfigError). ``contents`` (:func:`~cp_rope.launch.run_identity.content_digests`)
    are compared with the ones ``config.json`` records on a resume.

    Returns: the lock on rank 0 (None elsewhere).
    """
    out = cfg.train.out_dir
    ckpt_root, metrics = os.path.join(out, "checkpoints"), os.path.join(out, "metrics.jsonl")
    multi = dist.is_initialized() and dist.get_world_size() > 1
    # Rank 0 decides and every rank raises the same error: a rank that looks later
    # would otherwise see the files rank 0 has started writing for this very run.
    error: list[str | None] = [None]
    lock = None
    if rank == 0:
        try:
            _check_out_dir(out)
            lock = lock_out_dir(out)
            if cfg.train.overwrite and not cfg.train.resume:
                shutil.rmtree(ckpt_root, ignore_errors=True)
                shutil.rmtree(os.path.join(out, "tensorboard"), ignore_errors=True)
                if os.path.isfile(metrics):
                    os.remove(metrics)
            elif cfg.train.resume:
                if has_checkpoints(ckpt_root):
                    saved = _saved_config(path := os.path.join(out, "config.json"))
                    check_resume_config(saved, cfg)
                    _check_contents(saved, contents or {}, path)
                elif not cfg.train.allow_fresh_start:
                    raise ConfigError(
                        f"--resume: {ckpt_root} holds no checkpoint to resume; pass "
                        "--allow-fresh-start to start a fresh run there (the first submission "
                        "of a job always submitted with --resume), or drop --resume")
            else:
                found = [name for name, there in (("checkpoints", has_checkpoints(ckpt_root)),
                                                  ("metrics.jsonl", os.path.isfile(metrics))) if there]
                if found:
                    raise ConfigError(
                        f"train.out_dir={out!r} holds {' and '.join(found)} of an earlier run: "
                        "pass --resume to continue it, --overwrite to delete them first, "
                        "or --out-dir for a new directory")
        except ConfigError as exc:
            error[0] = str(exc)
            if lock is not None:
                lock.release()
    if multi:
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise ConfigError(error[0])
    return lock


@dataclass(slots=True)
class RunStart:
    """What :func:`start_run` settled: the inputs' content digests, a trainer's own config
    sections, the out-dir lock (rank 0)."""

    contents: dict[str, str]
    """``{name: digest}`` of the run's input files (:func:`~cp_rope.launch.run_identity.content_digests`),
    the same on every rank; :meth:`record_tokenizer` adds the BPE the run trained."""
    extra: dict[str, dict] = field(default_factory=dict)
    """A trainer's own config sections (finetune_hf: ``"hf"``), written to ``config.json``."""
    lock: OutDirLock | None = None

    def record_tokenizer(self, path: str | None) -> None:
        """Add the content digest of the tokenizer file the run trained (``out_dir/tokenizer.json``)."""
        if path is not None:
            self.contents.setdefault("out_dir/tokenizer.json", file_digest(path))

    def checkpoint_run(self, cfg: PretrainConfig, world: int) -> dict:
        """The checkpoint manifest's ``run``: :func:`~cp_rope.launch.run_identity.run_identity`
        and ``"contents.NAME"`` digests (compared before a resume loads anything)."""
        return run_identity(cfg, world) | {f"contents.{k}": v for k, v in self.contents.items()}

    def write_config(self, cfg: PretrainConfig) -> None:
        """Rank 0: ``out_dir/config.json`` = the resolved ``cfg``, the extra sections and the
        contents (what a ``--resume`` is checked against)."""
        if dist.get_rank() == 0:
            with open(os.path.join(cfg.train.out_dir, "config.json"), "w") as f:
                json.dump(to_dict(cfg) | self.extra | {"contents": self.contents}, f, indent=2)

    def close(self) -> None:
        """Release the out-dir lock (idempotent; the OS releases it at exit anyway)."""
        if self.lock is not None:
            self.lock.release()


def start_run(cfg: PretrainConfig, *, extra: dict[str, dict] | None = None,
              files: dict[str, list[str]] | None = None) -> RunStart:
    """Collective, the first of a run's set-up (inside an initialised process group):
    :func:`~cp_rope.launch.run_identity.agree_run_identity` (validate ``cfg`` for this world,
    hash the inputs, agree with every rank), the warm-up warning, then :func:`prepare_out_dir`
    under the out-dir lock.

    Args:
        extra: a trainer's own config sections (compared, written to ``config.json``).
        files: a trainer's own input files by name (hashed, compared, checked on resume).

    Raises: ConfigError (a RunIdentityError when the ranks disagree) naming the field.
    """
    contents = agree_run_identity(cfg, extra=extra, files=files)
    rank = dist.get_rank()
    o, t = cfg.optim, cfg.train
    if rank == 0 and o.warmup_steps > 0 and t.steps <= o.warmup_steps:
        warnings.warn(f"train.steps={t.steps} <= optim.warmup_steps={o.warmup_steps}: "
                      "the LR warms up for the whole run (the peak optim.lr is reached at most at "
                      "the last step; no cosine decay); lower --warmup-steps", UserWarning, stacklevel=4)
    lock = prepare_out_dir(cfg, rank, contents)
    if lock is not None and lock.note:
        warnings.warn(lock.note, UserWarning, stacklevel=2)
    return RunStart(contents=contents, extra=dict(extra or {}), lock=lock)
