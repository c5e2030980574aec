"""Save / resume with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a DCP directory ``<out_dir>/checkpoints/step_<N>`` holding:

* ``model``, ``optim``: ``get_state_dict(model, optimizer)`` (FQN-keyed; FSDP2
  DTensor shards or replicated plain tensors, deduplicated by DCP);
* ``train``: the step, the LR scheduler's state, the world size;
* ``rank<r>``: what differs per rank: the sampler position (data-parallel
  ranks read different batches) and the RNG states (CPU, CUDA, Python, NumPy).

DCP writes ``.metadata`` last, so only directories that have it are complete;
:func:`latest_checkpoint` ignores the rest (a job killed mid-save resumes from
the previous one). Resuming needs the same world size (the per-rank entries
are keyed by rank); model and optimizer shards themselves are resharded by
DCP, so only the data position ties a checkpoint to its layout.
"""

from __future__ import annotations

import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "has_checkpoints"]

_STEP_DIR = re.compile(r"^step_(\d+)$")


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


def has_checkpoints(root: str) -> bool:
    """Whether ``root`` holds any ``step_<N>`` directory (complete or not)."""
    return os.path.isdir(root) and any(_STEP_DIR.match(d) for d in os.listdir(root))


def latest_checkpoint(root: str) -> str | None:
    """Newest complete checkpoint directory under ``root`` (``None`` if there is none)."""
    if not os.path.isdir(root):
        return None
    steps = [(int(m.group(1)), d) for d in os.listdir(root) if (m := _STEP_DIR.match(d))
             and os.path.isfile(os.path.join(root, d, ".metadata"))]
    return os.path.join(root, max(steps)[1]) if steps else None


def save_checkpoint(root: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler, sampler_state: dict, keep: int = 0) -> str:
    """Collective: every rank calls it. Writes ``root/step_<step>`` and returns its path.

    ``keep > 0`` deletes all but ``keep`` complete checkpoints (rank 0): this one and
    the newest ``keep - 1`` others.
    """
    rank = dist.get_rank()
    path = os.path.join(root, f"step_{step:08d}")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "train": {"step": step, "scheduler": scheduler.state_dict(),
                  "world_size": dist.get_world_size()},
        f"rank{rank}": {"sampler": sampler_state, "rng": _rng_state()},
    }
    if rank == 0 and os.path.isdir(path):  # a stale save of the same step (e.g. interrupted)
        shutil.rmtree(path)
    dist.barrier()
    dcp.save(state, checkpoint_id=path)
    dist.barrier()
    if keep > 0 and rank == 0:  # the one just written is always kept
        complete = sorted(d for d in os.listdir(root) if _STEP_DIR.match(d)
                          and os.path.isfile(os.path.join(root, d, ".metadata"))
                          and d != os.path.basename(path))
        for d in complete[:max(0, len(complete) - (keep - 1))]:
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    return path


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler, sampler_state: dict) -> tuple[int, dict]:
    """Collective: restore model, optimizer, scheduler and RNG states in place.

    Args:
        sampler_state: this rank's current sampler state (the template of what
            is read back).

    Returns: ``(step, sampler_state)``, the step the checkpoint was saved after
    and this rank's saved sampler state.

    Raises: RuntimeError if the checkpoint was written by another world size.
    """
    rank = dist.get_rank()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "train": {"step": 0, "scheduler": scheduler.state_dict(), "world_size": 0},
    }
    dcp.load(state, checkpoint_id=path)
    if state["train"]["world_size"] != dist.get_world_size():
        raise RuntimeError(f"checkpoint {path!r} was saved by {state['train']['world_size']} ranks; "
                           f"this job has {dist.get_world_size()} (the data position is per rank)")
    own = {f"rank{rank}": {"sampler": dict(sampler_state), "rng": _rng_state()}}
    dcp.load(own, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["train"]["scheduler"])
    _set_rng_state(own[f"rank{rank}"]["rng"])
    return int(state["train"]["step"]), own[f"rank{rank}"]["sampler"]
