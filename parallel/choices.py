"""The one list of each CP choice: methods, block backends, placements.

Config (``launch/config.py``: ``Literal[...]`` of these), validation, the command
lines and the docs read these tuples; nothing else spells them out.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["METHODS", "A2A_METHODS", "BACKENDS", "BACKEND_CHOICES", "PLACEMENTS", "AUTO",
           "Method", "Backend", "PlacementName"]

AUTO = "auto"
"""Chosen per batch by :func:`cp_rope.parallel._choose.choose_strategy` (method / placement)."""

A2A_METHODS = ("ulysses", "hybrid")
"""Methods that run an all-to-all (:mod:`cp_rope.parallel.ulysses`)."""

METHODS = ("ring", "allgather", *A2A_METHODS)
"""CP attention methods (:func:`cp_rope.parallel.context_parallel_attention`)."""

BACKENDS = ("cudnn", "flash_attn", "torch_cudnn", "torch_flash", "reference")
"""Block backends, in the order ``"auto"`` tries them (:mod:`cp_rope.parallel._blocks`)."""

BACKEND_CHOICES = (AUTO, *BACKENDS)

PLACEMENTS = ("zigzag", "per_document")
"""Where documents go (:mod:`cp_rope.parallel.placement`)."""

# Literal of a tuple is the Literal of its items (what tyro and type checkers read)
Method = Literal[METHODS]
Backend = Literal[BACKEND_CHOICES]
PlacementName = Literal[PLACEMENTS]
