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
                       *, what: str, describe: Callable[[list], str],
                       exc: type[Exception] = ValueError) -> None:
    """All-gather this rank's ``(error, sig)`` over ``group`` and raise on every rank if any
    rank failed or the signatures differ.

    Args:
        group: the process group (``None``: the default group); ``dist`` must be initialized.
        error: this rank's exception from its local checks, or None.
        sig: this rank's signature (compared for equality; ignored where ``error`` is set).
        what: the API's name, first word of the messages (e.g. ``"unshard"``).
        describe: maps the list of every rank's signature to the text shown on a mismatch.
        exc: the exception type raised on the ranks whose own input passed.

    Raises: RuntimeError naming the likely causes when the all-gather itself fails (a
    peer that never joins it: after the group's timeout); ``error`` itself on the rank
    that failed; ``exc`` naming every failing rank, its
    exception type and message on the others; ``exc`` with ``describe(sigs)`` when the
    signatures differ.
    """
    mine = None if error is None else f"{type(error).__name__}: {error}"
    views: list = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(views, (mine, sig), group=group)
    except RuntimeError as exc:  # a peer that never joins: the group's timeout, then this
        raise RuntimeError(
            f"{what}: the ranks' agreement (all_gather_object over the group) failed: {exc}. "
            "Likely causes: a peer did not join it -- plan= passed on some ranks only (a rank "
            "given a plan builds none and goes straight to its exchange), or a peer failed, "
            "left, is stopped or runs another step") from exc
    if error is not None:
        raise error
    failed = [(r, e) for r, (e, _) in enumerate(views) if e is not None]
    if failed:
        detail = "; ".join(f"rank {r}: {e} (rank {r} of the group refused its input)" for r, e in failed)
        raise exc(f"{what}: bad arguments on another rank: {detail}")
    if any(v[1] != sig for v in views):
        raise exc(f"{what}: {describe([v[1] for v in views])}")
