"""Run one test body on ``world_size`` CPU processes over gloo.

The body is a top-level function ``fn(rank, world_size, *args)`` of a test
module; it runs after ``torch.distributed`` is initialised (file:// rendezvous
in a fresh temp dir, so tests never fight over ports) with a short process
group timeout, so a hang fails loudly. Any exception on any rank fails the
test with that rank's traceback.
"""

from __future__ import annotations

import datetime
import gc
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 120


def _entry(rank, world_size, init_file, timeout_s, fn, args, err_dir):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s))
        fn(rank, world_size, *args)
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Free the process groups (joining their gloo worker threads) while Python still runs:
        # a worker that drops the last reference to a finished work during interpreter
        # shutdown needs the GIL and aborts the process ("terminate called without an active
        # exception"; seen under load as a SIGABRT of a rank whose test body had passed).
        gc.collect()


def run_distributed(fn, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)``."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        try:
            mp.start_processes(_entry, args=(world_size, init_file, timeout_s, fn, args, tmp),
                               nprocs=world_size, join=True, start_method="spawn")
        except Exception as exc:  # surface every rank's traceback
            errs = sorted(f for f in os.listdir(tmp) if f.endswith(".err"))
            detail = "\n".join(open(os.path.join(tmp, f)).read() for f in errs)
            raise AssertionError(f"distributed test failed on {errs}:\n{detail}") from exc
