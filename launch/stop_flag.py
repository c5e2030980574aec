"""The training loop's stop flag: SIGTERM / SIGINT between steps, agreed by every rank, with a
watchdog for a rank stuck in a collective (:class:`StopFlag`, used by
:func:`cp_rope.launch.pretrain.train_loop`)."""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

__all__ = ["StopFlag"]


class StopFlag:
    """SIGTERM / SIGINT set a flag that the loop checks (agreed on by all ranks) between steps.

    A rank waiting in a collective for a dead or hung peer never gets back to
    the Python loop (nor runs a Python signal handler), so the flag alone would
    wait for the process-group timeout or the scheduler's SIGKILL. With
    ``grace_s > 0`` the signal also wakes a watchdog thread (through
    :func:`signal.set_wakeup_fd`, written by the C-level handler): unless the
    loop has taken the stop (:meth:`take`) within ``grace_s`` seconds, it
    prints why and exits the process with status 128 + signal, without a
    checkpoint (the previous one stays valid).
    """

    _SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, grace_s: float = 0.0):
        self.signum = 0
        self.grace_s = grace_s
        self._old = {}
        self._taken = threading.Event()
        self._wakeup = None  # (read fd, write fd, previous wakeup fd)

    def __enter__(self):
        for sig in self._SIGNALS:
            self._old[sig] = signal.signal(sig, self._handle)
        if self.grace_s > 0:
            r, w = os.pipe()
            os.set_blocking(w, False)
            self._wakeup = (r, w, signal.set_wakeup_fd(w, warn_on_full_buffer=False))
            threading.Thread(target=self._watch, args=(r,), daemon=True, name="stop-watchdog").start()
        return self

    def _handle(self, signum, frame):
        self.signum = signum
        signal.signal(signum, self._old.get(signum, signal.SIG_DFL))  # a second signal: default

    def _watch(self, fd: int) -> None:
        try:
            while data := os.read(fd, 64):  # b"" once __exit__ closes the write end
                sig = next((b for b in data if b in self._SIGNALS), None)
                if sig is None or self._taken.wait(self.grace_s):
                    continue
                os.write(2, (f"rank {dist.get_rank() if dist.is_initialized() else 0}: "
                             f"{signal.Signals(sig).name}: the current step did not finish within "
                             f"{self.grace_s:g} s (--stop-grace-s; a rank stuck in a collective?): "
                             "exiting without a checkpoint\n").encode())
                os._exit(128 + sig)
        finally:
            os.close(fd)

    def take(self) -> None:
        """The loop has seen the stop: the watchdog stands down (the save may take its time)."""
        self._taken.set()

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if self._wakeup is not None:
            r, w, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(w)

    def any_rank(self, device: torch.device) -> int:
        """The signal number any rank caught (0: none); a collective when the world has more
        than one rank, a host read alone (no device sync) when it has one."""
        if dist.get_world_size() == 1:
            return self.signum
        flag = torch.tensor([self.signum], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
