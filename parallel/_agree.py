"""Cross-rank agreement before data moves (one helper for every collective entry point).

A rank whose input fails its local checks must not leave the other ranks waiting in
a collective, and ranks whose inputs disagree must not exchange mismatched data:
every rank all-gathers ``(its error or None, its signature)`` and then raises the
same verdict.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

__all__ = ["agree_across_ranks"]


def agree_across_ranks(group: dist.ProcessGroup | None, error: Exception | None, sig: object,
                       *, what: str, describe: Callable[[list], str]) -> None:
    """All-gather this rank's ``(error, sig)`` over ``group`` and raise on every rank if any
    rank failed or the signatures differ.

    Args:
        group: the process group (``None``: the default group); ``dist`` must be initialized.
        error: this rank's exception from its local checks, or None.
        sig: this rank's signature (compared for equality; ignored where ``error`` is set).
        what: the API's name, first word of the messages (e.g. ``"unshard"``).
        describe: maps the list of every rank's signature to the text shown on a mismatch.

    Raises: ``error`` itself on the rank that failed; ValueError naming the failing rank and
    its message on the others; ValueError with ``describe(sigs)`` when signatures differ.
    """
    views: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(views, (None if error is None else str(error), sig), group=group)
    if error is not None:
        raise error
    failed = [r for r, (e, _) in enumerate(views) if e is not None]
    if failed:
        raise ValueError(f"{what}: rank {failed[0]} of the group refused its input: "
                         f"{views[failed[0]][0]}")
    if any(v[1] != sig for v in views):
        raise ValueError(f"{what}: {describe([v[1] for v in views])}")
