"""The run directory (``--out-dir``): the rules for a fresh, an overwritten and a resumed run.

A fresh run must not mix with an earlier run's checkpoints or ``metrics.jsonl``;
``--overwrite`` deletes them; ``--resume`` must keep the fields of
:data:`~cp_rope.launch.config.RESUME_FIXED` (checked against the earlier run's
``config.json``). Rank 0 decides, every rank raises the same ConfigError.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch.distributed as dist

from .checkpoint import has_checkpoints
from .config import SECTIONS, ConfigError, PretrainConfig, check_resume_config

__all__ = ["prepare_out_dir"]


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


def prepare_out_dir(cfg: PretrainConfig, rank: int) -> None:
    """A resumed run must keep the checkpoint's config (:func:`check_resume_config`
    against out_dir/config.json); a fresh run (no ``--resume``) must not mix with
    an earlier run's files in out_dir.

    Its checkpoints would be pruned and resumed from together with the new
    ones (by step) and its metrics.jsonl truncated. With ``--overwrite`` rank 0
    deletes them (and the TensorBoard events) first; otherwise ConfigError,
    decided on rank 0 (before this run writes anything) and raised on every
    rank, before any heavy work. With checkpoints to resume, ``config.json`` must
    be there and readable (else the check could not be made). The out-dir must
    be a writable directory (ConfigError naming ``--out-dir`` and the path).
    """
    out = cfg.train.out_dir
    ckpt_root, metrics = os.path.join(out, "checkpoints"), os.path.join(out, "metrics.jsonl")
    multi = dist.is_initialized() and dist.get_world_size() > 1
    # Rank 0 decides and every rank raises the same error: a rank that looks later
    # would otherwise see the files rank 0 has started writing for this very run.
    error: list[str | None] = [None]
    if rank == 0:
        try:
            _check_out_dir(out)
            if cfg.train.overwrite and not cfg.train.resume:
                shutil.rmtree(ckpt_root, ignore_errors=True)
                shutil.rmtree(os.path.join(out, "tensorboard"), ignore_errors=True)
                if os.path.isfile(metrics):
                    os.remove(metrics)
            elif cfg.train.resume:
                if has_checkpoints(ckpt_root):
                    check_resume_config(_saved_config(os.path.join(out, "config.json")), cfg)
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
    if multi:
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise ConfigError(error[0])
