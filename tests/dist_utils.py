"""Run one test body on ``world_size`` CPU processes over gloo.

The body is a top-level function ``fn(rank, world_size, *args)`` of a test
module; it runs after ``torch.distributed`` is initialised (file:// rendezvous
in a fresh temp dir, so tests never fight over ports) with a short process
group timeout, so a hang fails loudly. Any exception on any rank fails the
test with that rank's traceback.

The processes are kept for the session, one set per world size (starting one costs an
interpreter, torch and the test module's imports: ~3 s unloaded, ~15 s on 2 busy cores): each
call makes a new default process group (its own rendezvous file and ``timeout_s``), runs the
body and destroys the group, so every body sees a fresh world as before. Between bodies each
rank gets back its environment variables, working directory, default dtype and torch's
default seed. A failing rank (or a dead one) fails the test at once and its world is killed
(a peer may still wait in a collective); the next call starts a new one.
``CP_ROPE_TEST_FRESH_WORLDS=1`` spawns fresh processes per call instead.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import pickle
import tempfile
import traceback
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 120


def _init(rank, world_size, init_file, timeout_s):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s))


def _entry(rank, world_size, init_file, timeout_s, fn, args, err_dir):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    try:
        _init(rank, world_size, init_file, timeout_s)
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


def _run_fresh(fn, world_size: int, args, timeout_s: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        try:
            mp.start_processes(_entry, args=(world_size, init_file, timeout_s, fn, args, tmp),
                               nprocs=world_size, join=True, start_method="spawn")
        except Exception as exc:  # surface every rank's traceback
            errs = sorted(f for f in os.listdir(tmp) if f.endswith(".err"))
            detail = "\n".join(open(os.path.join(tmp, f)).read() for f in errs)
            raise AssertionError(f"distributed test failed on {errs}:\n{detail}") from exc


def _serve(rank: int, world_size: int, conn) -> None:
    """A kept rank: runs one pickled ``(init_file, timeout_s, fn, args)`` after another, each in
    a new default process group; answers None (passed) or the traceback (then it exits)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    env, cwd = dict(os.environ), os.getcwd()
    seed, dtype = torch.initial_seed(), torch.get_default_dtype()
    # Every finished world's default group stays referenced, so a cache keyed by id(group)
    # (cp_rope.launch.run_identity) never meets a new group at a reused address.
    finished = []
    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:
            return
        if not payload:
            return
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        torch.set_num_threads(1)
        try:
            init_file, timeout_s, fn, args = pickle.loads(payload)
            _init(rank, world_size, init_file, timeout_s)
            finished.append(dist.distributed_c10d._get_default_group())
            fn(rank, world_size, *args)
            dist.destroy_process_group()
            gc.collect()  # joins the gloo worker threads of the groups the body dropped
        except BaseException:
            conn.send(traceback.format_exc())
            return  # its peers may wait in a collective: the caller kills this world
        conn.send(None)


class _World:
    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(world_size):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world_size, theirs),
                               name=f"world{world_size}-rank{rank}")
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)

    def run(self, fn, args, timeout_s: float) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            # plain pickle: tensors travel by value (a copy per rank; one payload for all ranks)
            payload = pickle.dumps((os.path.join(tmp, "rendezvous"), timeout_s, fn, args))
            for conn in self.conns:
                conn.send_bytes(payload)
            pending, errors = set(range(len(self.conns))), {}
            while pending and not errors:
                ready = wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending])
                for rank in sorted(pending):  # answers first, deaths after (an answer precedes exit)
                    conn = self.conns[rank]
                    if conn in ready or conn.poll():
                        try:
                            answer = conn.recv()
                        except EOFError:
                            answer = f"rank {rank} died (exit code {self.procs[rank].exitcode})\n"
                    elif self.procs[rank].sentinel in ready:
                        self.procs[rank].join(5)
                        answer = f"rank {rank} died (exit code {self.procs[rank].exitcode})\n"
                    else:
                        continue
                    pending.discard(rank)
                    if answer is not None:
                        errors[rank] = answer
        if errors:
            names = [f"rank{r}.err" for r in sorted(errors)]
            detail = "\n".join(errors[r] for r in sorted(errors))
            raise AssertionError(f"distributed test failed on {names}:\n{detail}")

    def close(self, kill: bool) -> None:
        if not kill:
            for conn in self.conns:
                try:
                    conn.send_bytes(b"")
                except OSError:
                    pass
            for proc in self.procs:
                proc.join(10)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


_WORLDS: dict[int, _World] = {}


@atexit.register
def _close_worlds() -> None:
    while _WORLDS:
        _WORLDS.popitem()[1].close(kill=False)


def run_distributed(fn, world_size: int, *args, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (the session's kept processes
    of that size, or fresh ones with ``CP_ROPE_TEST_FRESH_WORLDS=1``); the default process
    group's timeout is ``timeout_s``. Raises AssertionError with every failed rank's traceback."""
    if os.environ.get("CP_ROPE_TEST_FRESH_WORLDS") == "1":
        return _run_fresh(fn, world_size, args, timeout_s)
    world = _WORLDS.pop(world_size, None)
    if world is not None and not all(proc.is_alive() for proc in world.procs):
        world.close(kill=True)
        world = None
    world = world or _World(world_size)
    try:
        world.run(fn, args, timeout_s)
    except BaseException:  # a failed rank, or pytest-timeout / ^C in the middle of a body
        world.close(kill=True)
        raise
    _WORLDS[world_size] = world
