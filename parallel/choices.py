"""The one list of each CP choice: methods, block backends, placements, loss implementations.

Config (``launch/config.py``: ``Literal[...]`` of these), validation, the command
lines and the docs read these tuples; nothing else spells them out.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["METHODS", "A2A_METHODS", "BACKENDS", "BACKEND_CHOICES", "WINDOW_BACKENDS",
           "WINDOW_FALLBACK", "PLACEMENTS", "AUTO", "LOSS_IMPLS", "Method", "Backend",
           "PlacementName", "LossImpl"]

AUTO = "auto"
"""Chosen per batch by :func:`cp_rope.parallel._choose.choose_strategy` (method / placement)."""

A2A_METHODS = ("ulysses", "hybrid")
"""Methods that run an all-to-all (:mod:`cp_rope.parallel.ulysses`)."""

METHODS = ("ring", "allgather", *A2A_METHODS)
"""CP attention methods (:func:`cp_rope.parallel.context_parallel_attention`)."""

BACKENDS = ("cudnn", "fa4", "flash_attn", "torch_cudnn", "torch_flash", "reference")
"""Block backends, in the order ``"auto"`` tries them (:mod:`cp_rope.parallel._blocks`)."""

BACKEND_CHOICES = (AUTO, *BACKENDS)

WINDOW_BACKENDS = ("fa4", "flash_attn", "torch_flash", "reference")
"""Block backends that run sliding-window blocks (``window=`` of
:func:`cp_rope.parallel.attention_plan`), in the order ``"auto"`` tries them for a windowed
plan (sinks need nothing of a backend: they enter after the merge). ``cudnn`` runs a windowed
plan's blocks on the first of :data:`WINDOW_FALLBACK` that runs the inputs (its THD calls
take no window here: docs/parallel.md "Windows and sinks"); ``torch_cudnn`` refuses one."""

WINDOW_FALLBACK = ("fa4", "flash_attn", "torch_flash")
"""What ``backend="cudnn"`` runs a windowed plan on, the first that runs the inputs."""

PLACEMENTS = ("zigzag", "per_document")
"""Where documents go (:mod:`cp_rope.parallel.placement`)."""

LOSS_IMPLS = (AUTO, "torch", "liger")
"""Implementations of :func:`cp_rope.parallel.cp_linear_cross_entropy`: ``torch`` (its chunked
loop, any device and dtype, float64 included), ``liger`` (Liger-Kernel's fused linear
cross-entropy, CUDA), ``auto`` (``liger`` for bf16/fp16 CUDA tensors when liger-kernel is
installed, else ``torch``)."""

# Literal of a tuple is the Literal of its items (what tyro and type checkers read)
Method = Literal[METHODS]
Backend = Literal[BACKEND_CHOICES]
PlacementName = Literal[PLACEMENTS]
LossImpl = Literal[LOSS_IMPLS]
