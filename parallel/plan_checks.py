"""Call checks of the plan kinds, and their read-only base: :func:`check_device`,
:func:`check_softmax_scale`, :func:`check_tensors` (q/k/v), and :class:`FrozenPlan`
(read-only attributes, in-place change guard, and :meth:`FrozenPlan.check_batch`: the
plan handed to a model or the door is the plan of the rows in hand).

Host checks only: nothing here reads the device.
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["FrozenPlan", "check_plan", "check_device", "check_softmax_scale", "check_tensors",
           "DTYPES"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_device(device) -> torch.device:
    """``device`` as a ``torch.device`` this process can use (``cuda`` gets its index).

    Raises: TypeError if not a torch.device / str / int; ValueError naming ``device`` if it
    is not a device name, the meta device (it holds no data: a call would fail inside torch
    reading the plan's tensors), or a CUDA device on a machine or build without one (or
    beyond ``torch.cuda.device_count()``).
    """
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"device must be a torch.device, str or int, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:  # e.g. an int on a build without accelerator
        raise ValueError(f"device={device!r} is not usable here: {exc}") from None
    if dev.type == "meta":
        raise ValueError(f"device={str(dev)!r}: the meta device holds no data (a plan's index "
                         "tensors and every call read it); pass the device q/k/v live on")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: CUDA is not available (torch "
                             f"{torch.__version__}, CUDA build {torch.version.cuda})")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}: this process sees "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return dev


def check_softmax_scale(softmax_scale) -> float | None:
    """``softmax_scale`` as a float > 0 (or None). Raises TypeError / ValueError naming it."""
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not 0 < softmax_scale < math.inf:
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale!r}")
    return float(softmax_scale)


def check_tensors(q, k, v, *, raise_: bool = True) -> bool:
    """q ``[T, Hq, D]``, k / v ``[T, Hkv, D]`` of one float dtype and device, ``Hq % Hkv == 0``.

    Returns True if they pass; with ``raise_`` (default) raises TypeError / ValueError
    naming the tensor instead of returning False.
    """
    try:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3:
                raise ValueError(f"{name} must be [T, H, D], got shape {tuple(t.shape)}")
            if t.dtype not in DTYPES:
                raise TypeError(f"{name} must be float16/bfloat16/float32/float64, got {t.dtype}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
            raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in T and D")
        if q.shape[1] % k.shape[1] != 0:
            raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads "
                             f"({k.shape[1]})")
        if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
            raise ValueError(f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/"
                             f"{v.dtype} on {q.device}/{k.device}/{v.device}")
    except (TypeError, ValueError):
        if raise_:
            raise
        return False
    return True


def _version(t) -> int | None:
    """A tensor's in-place version counter (None for inference tensors, which have none)."""
    try:
        return t._version
    except RuntimeError:
        return None


class FrozenPlan:
    """Base of the plan kinds: read-only attributes (set only while building) and a check
    that the tensors a plan was built from were not changed in place since.

    Every kind carries ``choice`` (what ``method="auto"`` / ``placement="auto"`` picked for
    this batch: a :class:`~cp_rope.parallel.cost_model.Choice` with the predicted times and
    the runners-up, ``choice.summary()`` for a log line; None when nothing was auto) and
    ``calibration`` (the :class:`~cp_rope.parallel.calibrate.Calibration` the plan runs
    with: the chooser's constants and backend ``"auto"``'s FA4 / cuDNN crossover; None for a
    plan built without :func:`~cp_rope.parallel.attention_plan`: the shipped defaults)."""

    __slots__ = ("_frozen", "_stamps", "choice", "calibration")

    def __setattr__(self, name, value):
        if getattr(self, "_frozen", False):
            raise AttributeError(f"plan: {type(self).__name__}.{name} is read-only; build a new "
                                 "plan (cp_rope.parallel.attention_plan) for another batch")
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        raise AttributeError(f"plan: {type(self).__name__}.{name} is read-only")

    def _freeze(self, *tensors) -> None:
        for name in ("choice", "calibration"):  # attention_plan records them (_record)
            if not hasattr(self, name):
                object.__setattr__(self, name, None)
        self._stamps = tuple((t, _version(t)) for t in tensors if isinstance(t, torch.Tensor))
        self._frozen = True

    def __reduce_ex__(self, protocol):  # copy.copy / deepcopy / pickle
        raise TypeError(f"plan: a {type(self).__name__} cannot be copied or pickled (it holds "
                        "the process group and the batch's tensors); build one per batch with "
                        "cp_rope.parallel.attention_plan where it is used")

    def _record(self, choice, calibration) -> None:
        """Set :attr:`choice` (the auto decision of this batch, a
        :class:`~cp_rope.parallel.cost_model.Choice`, or None) and :attr:`calibration` (the
        constants of the cost model and of backend ``"auto"``'s crossover) on this plan and
        every plan it holds (window variants, per-document parts): once, by
        :func:`~cp_rope.parallel.attention_plan` right after the build."""
        todo, seen = [self], set()
        while todo:
            plan = todo.pop()
            if plan is None or id(plan) in seen:
                continue
            seen.add(id(plan))
            object.__setattr__(plan, "choice", choice)
            object.__setattr__(plan, "calibration", calibration)
            todo.extend(getattr(plan, "_variants", {}).values())
            todo.extend((getattr(plan, "split", None), getattr(plan, "whole", None)))

    def _stamp(self, t: torch.Tensor) -> None:
        """Guard a tensor the plan hands out (rope_args' positions) like its own inputs."""
        object.__setattr__(self, "_stamps", self._stamps + ((t, _version(t)),))

    def check_unchanged(self) -> None:
        """Raise ValueError naming ``plan`` if a tensor it was built from was changed in place
        (``plan.cu_seqlens[...] = ...``: its schedule is of the old values). Host only."""
        for t, v in self._stamps:
            if v is not None and _version(t) != v:
                raise ValueError("plan: its cu_seqlens / seq_lens / positions were changed in "
                                 "place after the plan was built (the plan holds the schedule "
                                 "of the old values); build a new plan for the new batch")

    def check_batch(self, n_tokens: int, *, cp_rank: int | None = None,
                    cu_seqlens: torch.Tensor | None = None) -> None:
        """Raise TypeError / ValueError naming ``plan`` unless this is the plan of the rows in
        hand: ``n_tokens`` rows (``input_ids.shape[0]``), built on ``cp_rank`` (the model's
        rank in its CP group; None: not checked), for ``cu_seqlens`` (the batch's, host or
        device; None: not checked) and unchanged since. Host only (compares tensor
        identity, shapes and host copies: no sync)."""
        if n_tokens != self.n_tokens:
            raise ValueError(f"plan: built for a batch of {self.n_tokens} rows, got {n_tokens} "
                             "(input_ids): a plan of another batch? Build the plan of each "
                             "batch (model.attention_plan(batch)) and pass it with its rows")
        if cp_rank is not None and cp_rank != self.cp_rank:
            raise ValueError(f"plan: built for cp_rank {self.cp_rank}, but the model is cp_rank "
                             f"{cp_rank} of its CP group (another rank's plan or shard?)")
        if cu_seqlens is not None and cu_seqlens is not self.cu_seqlens:
            mine = getattr(self, "cu_seqlens_host", None)
            same = tuple(cu_seqlens.shape) == tuple(self.cu_seqlens.shape)
            if same and mine is not None and cu_seqlens.device.type == "cpu":
                same = torch.equal(cu_seqlens.to(mine.dtype), mine)  # host: the values
            if not same:
                raise ValueError("plan: built for another batch (its cu_seqlens are not this "
                                 "batch's); build the plan of each batch")
        self.check_unchanged()


def check_plan(plan, n_tokens: int, *, cp_rank: int | None = None,
               cu_seqlens: torch.Tensor | None = None) -> None:
    """What a model checks of the ``plan`` it is handed with ``n_tokens`` rows:
    :meth:`FrozenPlan.check_batch`. Raises TypeError naming ``plan`` for anything but a
    plan (``cp_rope.parallel.attention_plan``'s result), ValueError as check_batch."""
    if not isinstance(plan, FrozenPlan):
        raise TypeError(f"plan must be the batch's attention plan (model.attention_plan(batch) "
                        f"on the host batch), got {type(plan).__name__}")
    plan.check_batch(n_tokens, cp_rank=cp_rank, cu_seqlens=cu_seqlens)
