"""The one place where :mod:`cp_rope.launch` touches version-dependent PyTorch internals.

The checkpoint code (:mod:`cp_rope.launch.checkpoint`) calls these stable names
and behaves the same on every supported torch (:data:`SUPPORTED_TORCH`):

* :func:`dcp_named_files`: the data files a DCP checkpoint's ``.metadata``
  names (``Metadata.storage_data``'s ``relative_path`` entries, read back from
  disk with the public ``FileSystemReader.read_metadata``). Never read from
  ``dcp.save``'s return value: torch 2.11's returns ``storage_data=None``.
* :data:`DCP_ERRORS` and :func:`failure_cause`: DCP raises
  ``CheckpointException``, a ``BaseException`` (not an ``Exception``) whose
  text is every rank's traceback; ``failure_cause`` turns it (or any other
  exception) into one line: the first failing rank, the exception type and
  message (e.g. ``OSError [Errno 30] Read-only file system: '.../__0_0.distcp'``).
* :func:`dcp_load_partial`: the LR scheduler's state (its keys differ between torch
  versions) loaded without requiring every key of this torch's template.
* :func:`torch_version`: the running torch's version string (recorded in
  every checkpoint, compared at resume).
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed.checkpoint as dcp

try:  # public in torch.distributed.checkpoint.api since torch 2.2
    from torch.distributed.checkpoint.api import CheckpointException
except ImportError:  # pragma: no cover - kept for a torch that moves it
    CheckpointException = getattr(dcp, "CheckpointException", Exception)

__all__ = ["SUPPORTED_TORCH", "DCP_ERRORS", "dcp_named_files", "dcp_load_partial", "failure_cause",
           "torch_version"]

SUPPORTED_TORCH = ">=2.7"
"""The torch versions cp-rope supports (pyproject.toml's ``dependencies``; README)."""

DCP_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)
"""What a failing ``dcp.save`` / ``dcp.load`` can raise (``CheckpointException`` is a
``BaseException``)."""


def torch_version() -> str:
    """``torch.__version__`` as a plain string (e.g. ``"2.11.0+cu130"``)."""
    return str(torch.__version__)


def dcp_named_files(path: str) -> set[str]:
    """The data files (relative paths, e.g. ``"__0_0.distcp"``) that the ``.metadata`` of the
    DCP checkpoint directory ``path`` names, read from disk.

    Raises: OSError if ``.metadata`` cannot be read; ValueError if it is not a DCP metadata
    file this torch understands (damaged, or written by an incompatible torch; the message
    names the file and this torch's version).
    """
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except OSError:
        raise
    except Exception as exc:  # unpickling garbage raises anything (EOFError, UnpicklingError, ...)
        raise ValueError(f".metadata cannot be read by torch {torch_version()} "
                         f"({type(exc).__name__}: {exc})") from None
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise ValueError(f".metadata names no files (storage_data is {type(storage).__name__}; "
                         f"torch {torch_version()})")
    names = set()
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in rel.split("/"):
            raise ValueError(f".metadata names a file as {rel!r} (torch {torch_version()})")
        names.add(rel)
    return names


def dcp_load_partial(state: dict, path: str) -> None:
    """``dcp.load`` of ``state`` from ``path`` that keeps the template's value for keys the
    checkpoint lacks (``DefaultLoadPlanner(allow_partial_load=True)``; keys the checkpoint has
    and ``state`` lacks are ignored by every load). For the LR scheduler's state dict only,
    whose keys change between torch versions (torch 2.13's has ``_is_initial``, 2.7's not):
    never for model or optimizer tensors, which must all be there."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))


def _one_line(exc: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
    last = text[-1] if text else type(exc).__name__
    return last if last.startswith(type(exc).__name__) else f"{type(exc).__name__}: {last}"


def failure_cause(exc: BaseException) -> str:
    """One line saying why a DCP call (or anything else) failed.

    For DCP's ``CheckpointException`` (``failures``: rank -> ``(exception, stack)``) the
    first failing rank's exception, e.g. ``rank 0: OSError: [Errno 30] Read-only file
    system: 'x/__0_0.distcp'`` (and ``(+N more ranks)``); otherwise the exception's own
    ``Type: message``.
    """
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and isinstance(failures, dict) and failures:
        causes = {}
        for rank in sorted(failures):
            inner = failures[rank]
            inner = inner[0] if isinstance(inner, tuple) and inner else inner
            if isinstance(inner, BaseException):
                causes.setdefault(_one_line(inner), rank)
        if causes:
            (line, rank), more = next(iter(causes.items())), len(failures) - 1
            return f"rank {rank}: {line}" + (f" (+{more} more rank(s))" if more else "")
    return _one_line(exc)
