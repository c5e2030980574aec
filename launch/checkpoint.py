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

Integrity. A save writes into ``step_<N>.partial``; every rank hashes its share
of the files DCP reports written, rank 0 writes the manifest (fsynced, atomic
replace) and only then renames the directory to ``step_<N>``. So a directory
named ``step_<N>`` is a finished save, and a job killed at any moment of a save
leaves at most a ``*.partial`` directory, which no resume looks at and the
next save deletes. Loading verifies every file against the manifest first
(:func:`verify_checkpoint`; the ranks split the hashing), so flipped bytes, a
truncated or missing shard, a truncated ``.metadata`` or a damaged manifest
raise :class:`CheckpointError` naming the file instead of loading changed
weights. :func:`resume_checkpoint` picks the newest checkpoint that verifies
and reports each newer one it skipped, with the reason.

Resuming needs the same world size (the per-rank entries are keyed by rank);
model and optimizer shards themselves are resharded by DCP, so only the data
position ties a checkpoint to its layout.

Space. :func:`check_checkpoint_space`, called before step 1, writes a small
probe file on every rank (a read-only or full file system fails there, not at
the end of the run) and compares the free space with
:func:`estimate_checkpoint_bytes` (model and optimizer state).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .config import ConfigError

__all__ = [
    "CheckpointError", "MANIFEST", "save_checkpoint", "load_checkpoint", "verify_checkpoint",
    "resume_checkpoint", "latest_checkpoint", "has_checkpoints", "estimate_checkpoint_bytes",
    "check_checkpoint_space",
]

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
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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


def verify_checkpoint(path: str) -> str | None:
    """Check every file of checkpoint ``path`` against its :data:`MANIFEST`.

    Collective when a process group is initialised (every rank calls it; the
    ranks split the files and share the verdict, so every rank returns the
    same answer); plain function otherwise. Reads every byte of the
    checkpoint once in total (SHA-256).

    Returns: ``None`` if it verifies, else why not (the file and the fault:
    missing, wrong size, different SHA-256, damaged or missing manifest).
    """
    rank, world = _rank_world()
    try:
        manifest = _read_manifest(path)
        names = sorted(manifest["files"])
        faults = [f for n in names[rank::world]
                  if (f := _check_file(path, n, manifest["files"][n])) is not None]
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


# ------------------------------------------------------------------ save / load
def save_checkpoint(root: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler, sampler_state: dict, keep: int = 0) -> str:
    """Collective: every rank calls it. Writes ``root/step_<step>`` and returns its path.

    The files go to ``step_<step>.partial`` first; after DCP has written them,
    the ranks hash them (each its share), rank 0 writes :data:`MANIFEST` and
    renames the directory (replacing an earlier save of the same step). A
    failure or a kill at any point leaves no ``step_<step>`` that looks
    complete. ``keep > 0`` then deletes all but ``keep`` checkpoints of steps
    up to ``step`` (rank 0): this one and the newest ``keep - 1`` older ones.
    Newer ones (left by a run this one resumed before, because they failed
    verification) are left for inspection until this run saves their step.

    Raises: CheckpointError (on every rank) if a rank cannot hash its files;
    DCP's CheckpointException if a write fails.
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
    if rank == 0:  # leftovers of interrupted saves are never valid (saves are collective)
        os.makedirs(root, exist_ok=True)
        for d in os.listdir(root):
            if d.endswith(_PARTIAL) and _STEP_DIR.match(d.removesuffix(_PARTIAL)):
                shutil.rmtree(os.path.join(root, d))
    if world > 1:
        dist.barrier()
    metadata = dcp.save(state, checkpoint_id=tmp)
    shards = sorted({info.relative_path for info in metadata.storage_data.values()})
    share = shards[rank::world] + ([".metadata"] if rank == 0 else [])
    try:
        mine = {f: {"size": os.path.getsize(os.path.join(tmp, f)), "sha256": _sha256(os.path.join(tmp, f))}
                for f in share}
        error = None
    except Exception as exc:  # every rank must still reach the gather
        mine, error = {}, f"rank {rank}: {type(exc).__name__}: {exc}"
    gathered = _gather((mine, error))
    errors = [e for _, e in gathered if e is not None]
    if errors:
        raise CheckpointError(f"{tmp}: hashing the written files failed ({'; '.join(errors)}); "
                              f"{name} was not created")
    if rank == 0:
        manifest = {"format": _FORMAT, "algorithm": "sha256", "step": step, "world_size": world,
                    "files": dict(sorted((k, v) for part, _ in gathered for k, v in part.items()))}
        with open(os.path.join(tmp, MANIFEST + ".tmp"), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(tmp, MANIFEST + ".tmp"), os.path.join(tmp, MANIFEST))
        _fsync_dir(tmp)
        if os.path.isdir(path):  # an earlier save of this step (e.g. one that failed verification)
            shutil.rmtree(path)
        os.rename(tmp, path)
        _fsync_dir(root)
        if keep > 0:
            older = [d for s, d in _step_dirs(root) if s < step
                     and os.path.isfile(os.path.join(root, d, MANIFEST))]  # newest first
            for d in older[keep - 1:]:
                shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    if world > 1:
        dist.barrier()
    return path


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler, sampler_state: dict, *, verify: bool = True) -> tuple[int, dict]:
    """Collective: restore model, optimizer, scheduler and RNG states in place.

    Args:
        sampler_state: this rank's current sampler state (the template of what
            is read back).
        verify: check every file against the manifest first
            (:func:`verify_checkpoint`); ``False`` only right after
            :func:`resume_checkpoint` has done so.

    Returns: ``(step, sampler_state)``, the step the checkpoint was saved after
    and this rank's saved sampler state.

    Raises: CheckpointError if the checkpoint fails verification (nothing is
    loaded); RuntimeError if it was written by another world size.
    """
    if verify and (reason := verify_checkpoint(path)) is not None:
        raise CheckpointError(f"{path}: {reason}; nothing was loaded")
    rank, world = _rank_world()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "train": {"step": 0, "scheduler": scheduler.state_dict(), "world_size": 0},
    }
    dcp.load(state, checkpoint_id=path)
    if state["train"]["world_size"] != world:
        raise RuntimeError(f"checkpoint {path!r} was saved by {state['train']['world_size']} ranks; "
                           f"this job has {world} (the data position is per rank)")
    own = {f"rank{rank}": {"sampler": dict(sampler_state), "rng": _rng_state()}}
    dcp.load(own, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["train"]["scheduler"])
    # The optimizer state holds the LR the saved run's schedule set for the next step; a
    # resume with another schedule (--steps to extend a run, --warmup-steps, --min-lr-ratio)
    # would take (and log) that step at the old LR. Redo the scheduler's last step with this
    # run's schedule: the same value when the schedule is unchanged.
    scheduler.last_epoch -= 1
    scheduler.step()
    _set_rng_state(own[f"rank{rank}"]["rng"])
    return int(state["train"]["step"]), own[f"rank{rank}"]["sampler"]


# ------------------------------------------------------------------ space
def estimate_checkpoint_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes one checkpoint of ``model`` and ``optimizer`` takes on disk, estimated.

    Model: every parameter and buffer once at its dtype (a DTensor counts its
    global size; DCP writes replicated tensors once). Optimizer: its state
    tensors when it has stepped; before the first step (the state is created
    lazily) two tensors per parameter at the parameter's size (Adam / AdamW's
    ``exp_avg`` and ``exp_avg_sq``; an upper bound for SGD-style optimizers).
    Plus 1 MiB for metadata, RNG and sampler states.
    """
    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()  # DTensor.numel() is the global size

    params = sum(nbytes(p) for p in model.parameters())
    total = params + sum(nbytes(b) for b in model.buffers())
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    total += sum(nbytes(v) for v in states) if states else 2 * params
    return total + 2**20


def check_checkpoint_space(root: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                           flag: str = "--out-dir") -> int:
    """Before step 1: prove that a checkpoint can be written under ``root``. Collective.

    Every rank creates ``root`` and writes, fsyncs and deletes a 1 MiB probe
    file (a read-only, unwritable or already full file system fails here, not
    at the first save after hours of training); rank 0 then compares the free
    space with :func:`estimate_checkpoint_bytes` (the new checkpoint is written
    before older ones are pruned, so one whole checkpoint must fit).

    Returns: the estimate, in bytes.

    Raises: ConfigError on every rank, naming ``flag`` and the path.
    """
    rank, _ = _rank_world()
    need = estimate_checkpoint_bytes(model, optimizer)
    probe = os.path.join(root, f".probe-rank{rank}")
    try:
        os.makedirs(root, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(os.urandom(2**20))
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
        error = None
        if rank == 0 and (free := shutil.disk_usage(root).free) < need:
            error = (f"a checkpoint needs about {need / 2**30:.2f} GiB (model and optimizer state), "
                     f"the file system has {free / 2**30:.2f} GiB free; free space or choose "
                     f"another {flag}")
    except OSError as exc:
        error = f"cannot write a checkpoint there ({exc.strerror or exc}) (rank {rank})"
        if os.path.exists(probe):
            try:
                os.remove(probe)
            except OSError:
                pass
    errors = [e for e in _gather(error) if e is not None]
    if errors:
        raise ConfigError(f"{flag} {root!r}: {errors[0]}")
    return need
