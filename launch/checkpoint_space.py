"""Before step 1: can the run's checkpoints be written? (probe file, free space for keep + 1).

:func:`check_checkpoint_space` fails a run whose out-dir is read-only, unwritable
or too full for the checkpoints it will hold at once, before any training
(instead of at the first save, hours in). :func:`estimate_checkpoint_bytes`
estimates one checkpoint from the model and optimizer; :func:`copies_needed`
says how many must fit at once: a save writes the new checkpoint before the
older ones beyond ``--keep-checkpoints`` are pruned, so ``keep + 1`` (or, with
``keep == 0``, every save of the run), less those already on disk.
"""

from __future__ import annotations

import os
import shutil

import torch

from .checkpoint import MANIFEST, _gather, _rank_world, _step_dirs
from .config import ConfigError

__all__ = ["estimate_checkpoint_bytes", "copies_needed", "check_checkpoint_space"]


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


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def copies_needed(keep: int, saves: int, existing: int = 0) -> int:
    """How many more checkpoints must fit in the free space, at least 1.

    Args:
        keep: ``--keep-checkpoints`` (0 = keep all).
        saves: the saves this run makes at most (periodic ones and the final one).
        existing: finished checkpoints already under the root (they hold their space).

    At most ``keep + 1`` exist at once (the new one is written before pruning),
    never more than ``existing + saves``; with ``keep == 0`` every save stays.
    """
    peak = existing + saves if keep == 0 else min(keep + 1, existing + saves)
    return max(1, peak - existing)


def check_checkpoint_space(root: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                           keep: int = 0, saves: int = 1, flag: str = "--out-dir") -> int:
    """Before step 1: prove that the run's checkpoints can be written under ``root``. Collective.

    Every rank creates ``root`` and writes, fsyncs and deletes a 1 MiB probe
    file (a read-only, unwritable or already full file system fails here, not
    at the first save after hours of training); rank 0 then compares the free
    space with :func:`copies_needed` ``(keep, saves, existing)`` times
    :func:`estimate_checkpoint_bytes`.

    Returns: the bytes needed (the estimate times the copies).

    Raises: ConfigError on every rank, naming ``flag``, the path, the copies and sizes.
    """
    rank, _ = _rank_world()
    one = estimate_checkpoint_bytes(model, optimizer)
    existing = sum(os.path.isfile(os.path.join(root, d, MANIFEST)) for _, d in _step_dirs(root))
    copies = copies_needed(keep, saves, existing)
    need = one * copies
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
            why = ("" if copies == 1 else
                   f" ({copies} checkpoints at once: --keep-checkpoints {keep} and the next one, "
                   "written before older ones are pruned" if keep else
                   f" ({copies} checkpoints: --keep-checkpoints 0 keeps every save")
            why += f", {existing} already there)" if copies > 1 and existing else (")" if copies > 1 else "")
            error = (f"a checkpoint needs about {_size(one)} (model and optimizer state), "
                     f"this run about {_size(need)}{why}; the file system has {_size(free)} "
                     f"free; free space, lower --keep-checkpoints or choose another {flag}")
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
