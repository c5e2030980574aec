"""The one validation layer of cp-rope: argument checks every public API uses.

The RoPE ops, the zigzag sharding, CP attention, the loss and the packing
code validate ``cu_seqlens``, ``max_seqlen``, ``cp_size`` / ``cp_rank`` and
named choices (backends, methods) through these functions, so that the same
bad value raises the same exception type with the same message everywhere.

One answer per question (``docs/DESIGN.md``, "Validation"):

* Wrong *type* (not a tensor, a float where an int belongs, ``bool`` where an
  int belongs, a cu_seqlens of any dtype but int32): ``TypeError``.
* Right type, wrong *value* (out of range, wrong rank / shape, wrong device,
  bad content, unknown choice): ``ValueError``.
* Integers are Python or numpy integers (:class:`numbers.Integral`), never
  ``bool``; they are returned as Python ``int``.
* ``cu_seqlens`` is int32 ``[B + 1]`` only (as flash-attn, TransformerEngine
  and cuDNN take it); int64 is refused, not silently converted.
* Content checks of ``cu_seqlens`` read the tensor on the host: they run for
  CPU tensors always and for device tensors only when ``CP_ROPE_DEBUG=1``
  (:func:`content_checks_enabled`), so that a training step never syncs.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable

import numpy as np
import torch

__all__ = [
    "check_int",
    "check_bool",
    "check_choice",
    "check_cp_args",
    "check_size_rank",
    "check_cu_seqlens",
    "check_max_seqlen",
    "content_checks_enabled",
    "check_cu_seqlens_content",
]


def check_int(name: str, value, *, min_value: int | None = None) -> int:
    """``value`` as a Python int.

    Raises:
        TypeError: ``value`` is not a Python or numpy integer, or is a bool.
        ValueError: ``value < min_value``.
    """
    if type(value) is not int:  # fast path: a plain int skips the slow Integral ABC check
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        value = int(value)
    if min_value is not None and value < min_value:
        raise ValueError(f"{name} must be >= {min_value}, got {value}")
    return value


def check_bool(name: str, value) -> bool:
    """``value`` as a Python ``bool`` if it is a ``bool`` (or a numpy bool); ``TypeError``
    otherwise (``0``/``1``/``'no'`` are refused: a truthy string must not switch a
    feature on)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_choice(name: str, value, choices: Iterable[str]) -> str:
    """``value`` if it is one of ``choices``.

    Raises: ValueError listing the valid choices (for any value not among them,
    including non-strings).
    """
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_size_rank(size, rank, *, names: tuple[str, str] = ("cp_size", "cp_rank")
                    ) -> tuple[int, int]:
    """``(size, rank)`` of a parallel dimension as Python ints, named ``names`` in errors.

    Raises:
        TypeError: either is not an int (bools and tensors refused).
        ValueError: ``size < 1`` or ``rank`` outside ``[0, size)``.
    """
    size_name, rank_name = names
    size = check_int(size_name, size, min_value=1)
    rank = check_int(rank_name, rank)
    if not 0 <= rank < size:
        raise ValueError(f"{rank_name} must satisfy 0 <= {rank_name} < {size_name}={size}, "
                         f"got {rank}")
    return size, rank


def check_cp_args(cp_size, cp_rank) -> tuple[int, int]:
    """``(cp_size, cp_rank)`` as Python ints (:func:`check_size_rank`)."""
    return check_size_rank(cp_size, cp_rank)


def check_cu_seqlens(cu_seqlens, *, name: str = "cu_seqlens",
                     device: torch.device | str | None = None) -> None:
    """Host-side checks of a ``cu_seqlens`` tensor (no device sync).

    Args:
        cu_seqlens: expected int32 ``[B + 1]``, ``B >= 0``.
        name: the argument name used in messages.
        device: when given, the device the tensor must be on (the input's).

    Raises:
        TypeError: not a ``torch.Tensor``, or dtype other than int32.
        ValueError: not 1-D with at least one entry, or on another device.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must be 1-D [B + 1] with at least one entry, got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if device is not None and cu_seqlens.device != device and cu_seqlens.device != torch.device(device):
        raise ValueError(f"{name} is on {cu_seqlens.device}, the input on {torch.device(device)}")


def check_max_seqlen(max_seqlen, *, allow_none: bool = True) -> int | None:
    """``max_seqlen`` as a Python int (a host value), or None when allowed.

    Raises:
        TypeError: not an int (or None where ``allow_none``).
        ValueError: negative.
    """
    if max_seqlen is None and allow_none:
        return None
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral):
        what = "an int or None" if allow_none else "an int (a host value)"
        raise TypeError(f"max_seqlen must be {what}, got {type(max_seqlen).__name__}")
    if max_seqlen < 0:
        raise ValueError(f"max_seqlen must be >= 0, got {max_seqlen}")
    return int(max_seqlen)


def content_checks_enabled(t: torch.Tensor) -> bool:
    """Whether :func:`check_cu_seqlens_content` should run for ``t``: always for CPU
    tensors, and for device tensors when ``CP_ROPE_DEBUG=1`` (reading them syncs
    the device)."""
    return t.device.type == "cpu" or os.environ.get("CP_ROPE_DEBUG", "0") not in ("", "0")


def check_token_ids(name: str, ids: torch.Tensor, vocab_size: int) -> None:
    """Token ids must index the embedding: every value in ``[0, vocab_size)``.

    Reads the values (so it runs when :func:`content_checks_enabled`: CPU tensors, or
    ``CP_ROPE_DEBUG=1``), otherwise it only checks the dtype.

    Raises: TypeError naming ``name`` for a non-integer tensor; ValueError naming ``name``,
    the offending id and ``vocab_size`` for an id outside the vocabulary (the embedding's
    own error is a bare ``IndexError: index out of range in self``, or a device assert).
    """
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of token ids, got "
                        f"{getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.numel() and content_checks_enabled(ids):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name} holds token id {bad}, outside the model's vocabulary "
                             f"[0, {vocab_size}) (vocab_size={vocab_size})")


def check_cu_seqlens_content(cu_seqlens: torch.Tensor, *, n_tokens: int | None = None,
                             cp_size: int = 1, max_seqlen: int | None = None,
                             n_positions: int | None = None, name: str = "cu_seqlens") -> None:
    """Value checks of a local ``cu_seqlens`` ``[B + 1]`` (the one copy every API uses).

    Reads the tensor on the host (a device sync for device tensors: callers gate it
    with :func:`content_checks_enabled`). Checks: starts at 0, non-decreasing, ends
    at most at ``n_tokens``, every local length even when ``cp_size > 1`` (two
    zigzag chunks), the longest length at most ``max_seqlen``, and global
    positions (``cp_size`` x longest local length) within ``n_positions`` rows of
    a cos/sin cache. Each bound is skipped when its argument is None.

    Raises: ValueError naming ``name`` (or max_seqlen) and the offending entry.
    """
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if cu.numel() < 1:
        raise ValueError(f"{name} must have at least one entry")
    if int(cu[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(cu[0])}")
    lens = cu[1:] - cu[:-1]
    if bool((lens < 0).any()):
        b = int(torch.nonzero(lens < 0)[0])
        raise ValueError(f"{name} must be non-decreasing; {name}[{b + 1}] < {name}[{b}]")
    if n_tokens is not None and int(cu[-1]) > n_tokens:
        raise ValueError(f"{name}[-1] = {int(cu[-1])} exceeds the number of tokens T = {n_tokens}")
    if cp_size > 1 and bool((lens % 2 != 0).any()):
        b = int(torch.nonzero(lens % 2 != 0)[0])
        raise ValueError(f"{name}: with cp_size={cp_size} every local sequence length must be "
                         f"even (two CP chunks); sequence {b} has {int(lens[b])}")
    longest = int(lens.max()) if lens.numel() else 0
    if max_seqlen is not None and longest > max_seqlen:
        raise ValueError(f"max_seqlen = {max_seqlen} is below the longest local sequence ({longest})")
    if n_positions is not None and cp_size * longest > n_positions:
        raise ValueError(f"{name}: the longest local sequence ({longest} rows, global length "
                         f"{cp_size * longest} with cp_size={cp_size}) needs positions beyond the "
                         f"cos/sin cache ({n_positions} rows)")
