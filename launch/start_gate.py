"""Under torchrun, every rank's command line is read and checked before the process group.

Each rank parses its own ``argv`` and validates its own config; a flag or a config file
that differs between ranks (a per-node file, a wrapper that adds a flag to one rank) can
make one rank refuse while the others go on. Without a word between them the refusing
rank's message is lost (only rank 0 prints) and the others wait in
``init_process_group`` for the whole ``parallel.timeout_s``.

:func:`agreed_start` runs the parse on every rank, then each rank posts its outcome (``ok``,
its error text, or the status it exited with, e.g. ``--help``) on torchrun's rendezvous
store under ``cp_rope/start/<rank>`` -- the store ``init_process_group`` would open next,
which it then reuses (so nothing else is opened). A rank that refused waits only for rank
0 to have printed (torchrun stops the others once one rank exits); a rank that parsed
waits for every rank's outcome; rank 0 prints each error no other rank
printed (``error: rank 1: ...``, identical ones once), and every rank exits with status 2
when any rank refused. A rank that never posts (it crashed before) is named after the
timeout instead of a raw store traceback.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import sys
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from .config import ConfigError

__all__ = ["StartError", "agreed_start", "under_torchrun"]

T = TypeVar("T")

_PREFIX = "cp_rope/start"
_OK = "ok"
_PRINTED = "printed"
_FAILED_WAIT_S = 60
"""How long rank 0, having refused itself, waits for the others' outcomes to print them."""


class StartError(RuntimeError):
    """The ranks did not all start: another rank refused its command line or config, exited
    early (``--help``), or did not reach the start (the message says which)."""


def under_torchrun() -> bool:
    """True in a torchrun worker of a world of two or more ranks."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


class _Tee(io.TextIOBase):
    """A stream that writes to ``real`` (None: nowhere) and keeps a copy (``text``)."""

    def __init__(self, real):
        self.real, self._copy = real, io.StringIO()

    def write(self, s: str) -> int:
        self._copy.write(s)
        return self.real.write(s) if self.real is not None else len(s)

    def flush(self) -> None:
        if self.real is not None:
            self.real.flush()

    def isatty(self) -> bool:
        return self.real is not None and self.real.isatty()

    @property
    def text(self) -> str:
        return self._copy.getvalue()


def _outcome(exc: BaseException, err: _Tee) -> str:
    if isinstance(exc, SystemExit):
        if exc.code in (0, None):
            return "exited with status 0 before the process group (--help?)"
        return err.text.strip() or f"exited with status {exc.code} before the process group"
    return f"error: {exc}"


def agreed_start(parse: Callable[[], T], timeout_s: Callable[[T], int]) -> tuple[T, dist.Store | None]:
    """``parse()`` (read and validate the command line) on every rank, agreed before the process group.

    Args:
        parse: returns the config; raises ConfigError or SystemExit (tyro: ``--help``, a
            malformed flag).
        timeout_s: the config's ``parallel.timeout_s``: how long a rank that parsed waits for the others.

    Returns: ``(config, store)``; ``store`` is the rendezvous store for
    ``init_process_group(store=...)``, ``None`` outside a torchrun world of 2+ ranks or when
    a process group is already initialised (then ``parse`` alone runs).

    Raises: ``parse``'s own error on a rank that refused (rank 0's is printed by
    :func:`~cp_rope.launch.cli.run_cli`, the others' by rank 0 here); StartError on a rank
    that parsed when another did not.
    """
    rank = int(os.environ.get("RANK", "0"))
    # rank 0 prints tyro's help and usage errors; the others keep them for the store
    out, err = _Tee(sys.stdout if rank == 0 else None), _Tee(sys.stderr if rank == 0 else None)
    failure = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cfg = parse()
        except (ConfigError, SystemExit) as exc:
            failure = exc
    if not under_torchrun() or dist.is_initialized():
        if failure is not None:
            raise failure
        return cfg, None
    world = int(os.environ["WORLD_SIZE"])
    wait_s = _FAILED_WAIT_S if failure is not None else timeout_s(cfg)
    timeout = datetime.timedelta(seconds=wait_s)
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    gate = dist.PrefixStore(_PREFIX, store)
    gate.set(str(rank), _OK if failure is None else _outcome(failure, err))
    if failure is not None and rank != 0:
        with contextlib.suppress(dist.DistStoreError):  # exiting first, torchrun would stop rank 0
            gate.wait([_PRINTED], timeout)
        raise failure  # rank 0 printed it
    outcomes = _outcomes(gate, world, timeout)
    refused = {r: o for r, o in outcomes.items() if o != _OK}
    if not refused:
        store.set_timeout(datetime.timedelta(seconds=timeout_s(cfg)))
        return cfg, store
    if rank == 0:
        _print_others(refused, outcomes[0])
        gate.set(_PRINTED, _OK)
    if failure is not None:
        raise failure
    ranks = ", ".join(str(r) for r in sorted(refused))
    raise StartError(f"rank {ranks} did not start (the reason is printed above): "
                     "every rank stops before the process group")


def _outcomes(gate: dist.Store, world: int, timeout: datetime.timedelta) -> dict[int, str]:
    """Every rank's posted outcome; a rank silent for ``timeout`` reads as not started."""
    keys = [str(r) for r in range(world)]
    try:
        gate.wait(keys, timeout)
    except dist.DistStoreError:
        pass
    secs = int(timeout.total_seconds())
    return {r: gate.get(k).decode() if gate.check([k]) else
            f"did not reach the start within {secs} s (did it exit early or crash?)"
            for r, k in enumerate(keys)}


def _print_others(refused: dict[int, str], own: str) -> None:
    """Rank 0: each other rank's outcome that differs from its own, identical ones once."""
    by_text: dict[str, list[int]] = {}
    for r, text in refused.items():
        if r != 0 and text != own:
            by_text.setdefault(text, []).append(r)
    for text, ranks in by_text.items():
        who = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
        text = text.removeprefix("error: ")
        sep = "\n" if "\n" in text else " "
        print(f"error: {who}:{sep}{text}", file=sys.stderr)
