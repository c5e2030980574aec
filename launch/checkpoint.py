"""Save / resume with ``torch.distributed.checkpoint`` (DCP), checksummed and verified.

A checkpoint is a DCP directory ``<out_dir>/checkpoints/step_<N>`` holding:

* ``model``, ``optim``: ``get_state_dict(model, optimizer)`` (FQN-keyed; FSDP2
  DTensor shards or replicated plain tensors, deduplicated by DCP);
* ``train``: the step, the LR scheduler's state, the world size;
* ``rank<r>``: what differs per rank: the sampler position (data-parallel
  ranks read different batches) and the RNG states (CPU, CUDA, Python, NumPy);
* ``checksums.json`` (:data:`MANIFEST`), written last: the size and SHA-256 of
  every other file of the checkpoint (the ``.distcp`` shards that DCP's
  metadata names, and ``.metadata`` itself).

Integrity. A save writes into ``step_<N>.partial``; rank 0 lists the files DCP
wrote there (on disk, never from ``dcp.save``'s return value, whose fields vary
between torch versions) and checks them against the ones DCP's ``.metadata``
names; every rank hashes its share, rank 0 writes the manifest (fsynced,
atomic replace) and only then renames the directory to ``step_<N>``. So a
directory named ``step_<N>`` is a finished save, and a job killed at any
moment of a save leaves at most a ``*.partial`` directory, which no resume
looks at and the next save deletes. A save that fails (read-only or full file
system, a file-size limit) raises one :class:`CheckpointError` on every rank
naming the cause and the last good checkpoint, which stays. Loading verifies
every file against the manifest first (:func:`verify_checkpoint`; the ranks
split the hashing) and the manifest against ``.metadata`` (every file it
names must have an entry), so flipped bytes, a truncated or missing shard, a
truncated ``.metadata`` or a damaged or incomplete manifest raise
:class:`CheckpointError` naming the file instead of loading changed weights.
:func:`resume_checkpoint` picks the newest checkpoint that verifies and
reports each newer one it skipped, with the reason.

Identity. The manifest records the run that wrote it (:func:`~cp_rope.launch.run_identity.run_identity`:
model shapes, data order, seed, cp_size, world size) and the torch version;
:func:`load_checkpoint` compares them with this run before reading anything
(:func:`check_run`) and fails naming both values. Model and optimizer shards
are resharded by DCP, the per-rank data position is not, so the world size
must match. A checkpoint written by one supported torch loads under another
(DCP's format); if DCP cannot read it, the error names both torch versions.

Space: :mod:`cp_rope.launch.checkpoint_space`. Version-dependent DCP details:
:mod:`cp_rope.launch._compat`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import resource
import shutil

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ._compat import DCP_ERRORS, dcp_load_partial, dcp_named_files, failure_cause, torch_version
from .resume_config import HEAD_KEYS, saved_head_dim

__all__ = ["CheckpointError", "MANIFEST", "save_checkpoint", "load_checkpoint", "verify_checkpoint",
           "resume_checkpoint", "latest_checkpoint", "has_checkpoints", "check_run"]

MANIFEST = "checksums.json"
"""Name of the checksum manifest inside a checkpoint directory (written last)."""
_FORMAT = "cp-rope-checkpoint-checksums/1"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL = ".partial"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: it fails verification (the message names the
    directory, the file and what is wrong) or no checkpoint under a root verifies."""


# ------------------------------------------------------------------ helpers
def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj) -> list:
    """``obj`` of every rank (a one-element list without a process group)."""
    rank, world = _rank_world()
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj):
    """Rank 0's ``obj`` on every rank."""
    if _rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()  # (hashlib.file_digest needs Python 3.11; pyproject allows 3.10)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_dirs(root: str) -> list[tuple[int, str]]:
    """``(step, name)`` of every ``step_<N>`` directory under ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    return sorted(((int(m.group(1)), d) for d in os.listdir(root)
                   if (m := _STEP_DIR.match(d)) and os.path.isdir(os.path.join(root, d))),
                  reverse=True)


def has_checkpoints(root: str) -> bool:
    """Whether ``root`` holds any ``step_<N>`` directory (finished saves, verified or not)."""
    return bool(_step_dirs(root))


def latest_checkpoint(root: str) -> str | None:
    """Newest ``step_<N>`` directory under ``root`` that has a manifest (``None`` if none).

    Cheap (no hashing): a finished save, not a verified one; see :func:`resume_checkpoint`.
    """
    for _, d in _step_dirs(root):
        if os.path.isfile(os.path.join(root, d, MANIFEST)):
            return os.path.join(root, d)
    return None


# ------------------------------------------------------------------ verify
def _read_manifest(path: str) -> dict:
    """The manifest of checkpoint ``path``; CheckpointError if it is missing or malformed."""
    name = os.path.join(path, MANIFEST)
    if not os.path.isfile(name):
        raise CheckpointError(f"{path}: no {MANIFEST} (the save did not finish, or it was "
                              "written by a cp-rope without checksums)")
    try:
        with open(name, encoding="utf-8") as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: {MANIFEST} is damaged (not JSON: {exc})") from None
    ok = isinstance(manifest, dict) and manifest.get("format") == _FORMAT
    files = manifest.get("files") if ok else None
    if not (isinstance(files, dict) and ".metadata" in files
            and all(isinstance(v, dict) and isinstance(v.get("size"), int)
                    and isinstance(v.get("sha256"), str) for v in files.values())):
        raise CheckpointError(f"{path}: {MANIFEST} is damaged (not a {_FORMAT} manifest "
                              "listing .metadata and the shards)")
    return manifest


def _check_file(path: str, name: str, want: dict) -> str | None:
    full = os.path.join(path, name)
    if not os.path.isfile(full):
        return f"{name} is missing"
    size = os.path.getsize(full)
    if size != want["size"]:
        return f"{name} has {size} bytes, {want['size']} were written (truncated or replaced)"
    if _sha256(full) != want["sha256"]:
        return f"{name}: SHA-256 differs from the one written at save time (the file changed)"
    return None


def _check_complete(path: str, files: dict) -> list[str]:
    """Rank 0's part: ``.metadata`` against the manifest, then every file it names has an entry."""
    if (fault := _check_file(path, ".metadata", files[".metadata"])) is not None:
        return [fault]
    try:
        named = dcp_named_files(path)
    except (OSError, ValueError) as exc:
        return [f".metadata: {exc}"]
    return [f"{n} is named by .metadata but has no entry in {MANIFEST} (the manifest is "
            "incomplete)" for n in sorted(named - set(files))]


def verify_checkpoint(path: str) -> str | None:
    """Check every file of checkpoint ``path`` against its :data:`MANIFEST`.

    Collective when a process group is initialised (every rank calls it; the
    ranks split the files and share the verdict, so every rank returns the
    same answer); plain function otherwise. Reads every byte of the
    checkpoint once in total (SHA-256); rank 0 also reads ``.metadata``'s list
    of files (each must have a manifest entry).

    Returns: ``None`` if it verifies, else why not (the file and the fault:
    missing, wrong size, different SHA-256, damaged, missing or incomplete manifest).
    """
    rank, world = _rank_world()
    try:
        manifest = _read_manifest(path)
        files = manifest["files"]
        faults = [] if rank else _check_complete(path, files)
        names = sorted(n for n in files if n != ".metadata")
        faults += [f for n in names[rank::world] if (f := _check_file(path, n, files[n])) is not None]
        mine = "; ".join(faults) or None
    except CheckpointError as exc:
        mine = str(exc).removeprefix(f"{path}: ")
    except Exception as exc:  # unreadable, ...: every rank must still reach the gather
        mine = f"cannot be verified ({type(exc).__name__}: {exc})"
    verdicts = [v for v in _gather(mine) if v is not None]
    return "; ".join(dict.fromkeys(verdicts)) or None


def resume_checkpoint(root: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest checkpoint under ``root`` that verifies, and the newer ones skipped.

    Collective when a process group is initialised (rank 0's directory listing
    is used by all). Returns ``(path, skipped)`` with ``skipped`` a list of
    ``(path, reason)``, newest first; ``(None, [])`` when ``root`` holds no
    ``step_<N>`` directory (a fresh start).

    Raises: CheckpointError when there are checkpoints but none verifies
    (starting over silently would discard the run), listing each with its reason.
    """
    names = _broadcast([d for _, d in _step_dirs(root)])
    skipped = []
    for d in names:
        path = os.path.join(root, d)
        reason = verify_checkpoint(path)
        if reason is None:
            return path, skipped
        skipped.append((path, reason))
    if skipped:
        raise CheckpointError(
            f"no checkpoint under {root} verifies: "
            + "; ".join(f"{os.path.basename(p)}: {r}" for p, r in skipped)
            + ". Restore the files, delete the damaged step_* directories, or start over "
            "(--overwrite or another --out-dir)")
    return None, []


# ------------------------------------------------------------------ run identity
def check_run(path: str, manifest: dict, run: dict | None, world: int) -> None:
    """Raise CheckpointError (naming the checkpoint's and this run's values) when the
    checkpoint ``path`` was written by another world size or, with ``run``
    (:func:`cp_rope.launch.run_identity.run_identity`), another run. Keys an older manifest
    lacks are not compared; an older manifest's ``model.head_dim`` of 0 is dim / n_heads."""
    saved = dict(manifest.get("run") or {})
    saved.setdefault("world_size", manifest.get("world_size"))
    saved["model.head_dim"] = saved_head_dim(*(saved.get(f"model.{k}") for k in HEAD_KEYS))
    now = dict(run or {}) | {"world_size": world}
    diffs = [f"{k}: {saved[k]!r} (checkpoint) != {v!r} (this run)" for k, v in now.items()
             if saved.get(k) is not None and saved[k] != v]
    if diffs:
        raise CheckpointError(
            f"{path} was written by another run ({'; '.join(diffs)}; checkpoint written by torch "
            f"{manifest.get('torch', 'unknown')}, this is torch {torch_version()}); nothing was "
            "loaded. Resume with the checkpoint's settings (the world size: the data position is "
            "per rank), or start a new run (--overwrite or another --out-dir)")


# ------------------------------------------------------------------ save / load
def _agree(error: str | None) -> str | None:
    """The first rank's error (or None) on every rank: one verdict, no rank left waiting."""
    errors = [e for e in _gather(error) if e is not None]
    return errors[0] if errors else None


def _save_failed(root: str, name: str, step: int, cause: str) -> CheckpointError:
    """The one error of a failed save: the cause, what the file system says, the last good one."""
    notes = []
    try:
        notes.append(f"{shutil.disk_usage(root).free / 2**30:.2f} GiB free under {root}")
    except OSError:
        pass
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        notes.append(f"file-size limit (ulimit -f) {limit} bytes")
    done = [d for s, d in _step_dirs(root) if s != step
            and os.path.isfile(os.path.join(root, d, MANIFEST))]
    last = (f"the last good checkpoint, {os.path.join(root, done[0])}, is kept (--resume "
            "continues from it)" if done else "there is no earlier checkpoint")
    return CheckpointError(f"saving checkpoint {name} failed: {cause}"
                           + (f" ({'; '.join(notes)})" if notes else "") + f"; {last}")


def _plan_hashing(tmp: str, world: int) -> tuple[list[list[str]] | None, str | None]:
    """Rank 0, after DCP's save: the files on disk in ``tmp``, complete against the ones its
    ``.metadata`` names, split into ``world`` shares of similar byte counts (largest first,
    each to the least loaded rank; ``.metadata`` to rank 0)."""
    try:
        on_disk = {f: os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp)
                   if os.path.isfile(os.path.join(tmp, f)) and not f.startswith(MANIFEST)}
        if ".metadata" not in on_disk:
            return None, "DCP wrote no .metadata"
        missing = sorted(dcp_named_files(tmp) - set(on_disk))
        if missing:
            return None, f"files named by .metadata are not on disk: {', '.join(missing)}"
    except (OSError, ValueError) as exc:
        return None, f"cannot list the written files ({type(exc).__name__}: {exc})"
    shares, load = [[".metadata"]] + [[] for _ in range(world - 1)], [on_disk[".metadata"]] + [0] * (world - 1)
    for f in sorted((f for f in on_disk if f != ".metadata"), key=lambda f: (-on_disk[f], f)):
        r = load.index(min(load))
        shares[r].append(f)
        load[r] += on_disk[f]
    return shares, None


def _write_manifest(tmp: str, manifest: dict) -> None:
    with open(os.path.join(tmp, MANIFEST + ".tmp"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(tmp, MANIFEST + ".tmp"), os.path.join(tmp, MANIFEST))
    _fsync_dir(tmp)


def save_checkpoint(root: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler, sampler_state: dict, keep: int = 0, *, run: dict | None = None) -> str:
    """Collective: every rank calls it. Writes ``root/step_<step>`` and returns its path.

    The files go to ``step_<step>.partial`` first; after DCP has written them,
    rank 0 lists the files on disk (complete against the ones ``.metadata``
    names), the ranks hash them (each its share), rank 0 writes
    :data:`MANIFEST` (with ``run``, :func:`~cp_rope.launch.run_identity.run_identity`, and the torch
    version) and renames the directory (replacing an earlier save of the same
    step). A failure or a kill at any point leaves no ``step_<step>`` that
    looks complete. ``keep > 0`` then deletes all but ``keep`` checkpoints of
    steps up to ``step`` (rank 0): this one and the newest ``keep - 1`` older
    ones. Newer ones (left by a run this one resumed before, because they
    failed verification) are left for inspection until this run saves their step.

    Raises: CheckpointError on every rank if any step of the save fails on any
    rank (a read-only or full file system, a file-size limit, DCP's own
    errors): one line naming the cause and the last good checkpoint, which is
    kept; the ``.partial`` directory is removed.
    """
    rank, world = _rank_world()
    name = f"step_{step:08d}"
    path, tmp = os.path.join(root, name), os.path.join(root, name + _PARTIAL)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "train": {"step": step, "scheduler": scheduler.state_dict(), "world_size": world},
        f"rank{rank}": {"sampler": sampler_state, "rng": _rng_state()},
    }
    error = None
    if rank == 0:  # leftovers of interrupted saves are never valid (saves are collective)
        try:
            os.makedirs(root, exist_ok=True)
            for d in os.listdir(root):
                if d.endswith(_PARTIAL) and _STEP_DIR.match(d.removesuffix(_PARTIAL)):
                    shutil.rmtree(os.path.join(root, d))
        except OSError as exc:
            error = failure_cause(exc)
    if (error := _agree(error)) is None:
        try:
            dcp.save(state, checkpoint_id=tmp)
        except DCP_ERRORS as exc:
            error = failure_cause(exc)
        error = _agree(error)
    shares = None
    if error is None:
        shares, error = _broadcast(_plan_hashing(tmp, world) if rank == 0 else None)
    if error is None:
        try:
            mine = {f: {"size": os.path.getsize(os.path.join(tmp, f)),
                        "sha256": _sha256(os.path.join(tmp, f))} for f in shares[rank]}
            mine_error = None
        except Exception as exc:  # every rank must still reach the gather
            mine, mine_error = {}, f"hashing on rank {rank}: {failure_cause(exc)}"
        gathered = _gather((mine, mine_error))
        error = next((e for _, e in gathered if e is not None), None)
    if error is None and rank == 0:
        manifest = {"format": _FORMAT, "algorithm": "sha256", "step": step, "world_size": world,
                    "torch": torch_version(), "run": run or {},
                    "files": dict(sorted((k, v) for part, _ in gathered for k, v in part.items()))}
        try:
            _write_manifest(tmp, manifest)
            if os.path.isdir(path):  # an earlier save of this step (e.g. one that failed verification)
                shutil.rmtree(path)
            os.rename(tmp, path)
            _fsync_dir(root)
        except OSError as exc:
            error = failure_cause(exc)
    if world > 1:
        error = _broadcast(error)
    if error is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if world > 1:
            dist.barrier()
        raise _save_failed(root, name, step, error)
    if rank == 0 and keep > 0:
        older = [d for s, d in _step_dirs(root) if s < step
                 and os.path.isfile(os.path.join(root, d, MANIFEST))]  # newest first
        for d in older[keep - 1:]:
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    if world > 1:
        dist.barrier()
    return path


def _named(path: str, manifest: dict) -> dict:
    """``manifest``, or CheckpointError unless ``path`` is the save its name says: no symbolic
    link (a later save of its step replaces the directory), and a ``step_<N>`` name whose N is
    the step its manifest recorded (not a renamed or copied directory)."""
    path = path.rstrip(os.sep)
    m, saved = _STEP_DIR.match(os.path.basename(path)), manifest.get("step")
    if os.path.islink(path):
        why = (f"is a symbolic link (to {os.readlink(path)}): a checkpoint must be the save's "
               "own directory. Replace the link by the directory it names, or delete the link")
    elif m and isinstance(saved, int) and int(m.group(1)) != saved:
        why = (f"is named for step {int(m.group(1))} but its {MANIFEST} records step {saved} "
               f"(renamed or copied?). Rename it step_{saved:08d}, or delete it")
    else:
        return manifest
    raise CheckpointError(f"{path} {why}; nothing was loaded")


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler, sampler_state: dict, *, verify: bool = True,
                    run: dict | None = None) -> tuple[int, dict]:
    """Collective: restore model, optimizer, scheduler and RNG states in place.

    Args:
        sampler_state: this rank's current sampler state (the template of what is read back).
        verify: check every file against the manifest first (:func:`verify_checkpoint`);
            ``False`` only right after :func:`resume_checkpoint` has done so.
        run: this run's :func:`~cp_rope.launch.run_identity.run_identity`, compared with the one the
            checkpoint recorded before anything is read (:func:`check_run`).

    Returns: ``(step, sampler_state)``, the step the checkpoint was saved after
    and this rank's saved sampler state.

    Raises: CheckpointError if the checkpoint fails verification, is a symbolic link or
    has a ``step_<N>`` name whose N is not the step it recorded, was written by
    another world size or run (both values named; nothing is loaded), or DCP
    cannot load it (the message names the torch that wrote it and this one).
    """
    if verify and (reason := verify_checkpoint(path)) is not None:
        raise CheckpointError(f"{path}: {reason}; nothing was loaded")
    rank, world = _rank_world()
    try:
        manifest, error = (_named(path, _read_manifest(path)), None) if rank == 0 else (None, None)
    except CheckpointError as exc:
        manifest, error = None, str(exc)
    manifest, error = _broadcast((manifest, error))
    if error is not None:
        raise CheckpointError(error)
    check_run(path, manifest, run, world)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "train": {"step": 0, "world_size": 0}}
    sched = {"train": {"scheduler": scheduler.state_dict()}}
    own = {f"rank{rank}": {"sampler": dict(sampler_state), "rng": _rng_state()}}
    try:
        dcp.load(state, checkpoint_id=path)
        dcp_load_partial(sched, path)  # its keys differ between torch versions
        dcp.load(own, checkpoint_id=path)
        for group in state["optim"]["param_groups"]:  # how to step is this run's choice
            group.update({k: optimizer.defaults.get(k) for k in ("foreach", "fused")})
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    except DCP_ERRORS as exc:
        raise CheckpointError(
            f"{path}: loading failed ({failure_cause(exc)}); it was written by torch "
            f"{manifest.get('torch', 'unknown (an older cp-rope)')}, this is torch "
            f"{torch_version()}") from None
    scheduler.load_state_dict(sched["train"]["scheduler"])
    # The optimizer state holds the LR the saved run's schedule set for the next step; a
    # resume with another schedule (--steps to extend a run, --warmup-steps, --min-lr-ratio)
    # would take (and log) that step at the old LR. Redo the scheduler's last step with this
    # run's schedule: the same value when the schedule is unchanged.
    scheduler.last_epoch -= 1
    scheduler.step()
    _set_rng_state(own[f"rank{rank}"]["rng"])
    return int(state["train"]["step"]), own[f"rank{rank}"]["sampler"]
