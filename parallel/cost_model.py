"""A deterministic cost model of CP attention, and the ``method="auto"`` / ``placement="auto"``
chooser built on it.

:func:`predict` estimates the forward + backward time of one attention layer on every rank of
a CP group for one batch (its *global* document lengths, host data) under one setting
(placement, split threshold, method, all-to-all size U); :func:`choose` evaluates every
setting the batch and head counts allow and returns the fastest (:class:`Choice`). Both are
pure functions of host integers and a :class:`~cp_rope.parallel.calibrate.Calibration`:
no tensor is read from a device and nothing is communicated, so every rank that passes the
same agreed ``cu_seqlens`` gets the same choice (the plan's cross-rank agreement covers the
chosen method and placement like any other argument).

The model (times in seconds, one rank, one layer, forward + backward):

* **blocks** -- what each rank computes, the segments of the plan's blocks
  (:mod:`cp_rope.parallel.plan`'s schedules, re-derived from the lengths): a causal segment
  of ``l`` rows has ``l (l + 1) / 2`` query-key pairs, an unmasked one ``lq x lk``. A block
  call costs ``call_us`` plus, per segment, ``3.5 x 4 x pairs x H x D`` FLOPs at the
  calibrated throughput of its size ``s = pairs / lq`` (keys per query row;
  ``Calibration.tflops_at``): short segments run far below the kernel's peak.
* **merges** -- every ring step after the first merges a full set of partial outputs and
  accumulates dq (``merge_bytes_per_row x rows x H x D`` bytes at ``hbm_gbps``); the
  all-gather writes and reads the gathered K/V and its fp32 gradient; Ulysses reorders
  its all-to-all buffers.
* **communication** -- bytes from :func:`~cp_rope.parallel.ulysses.comm_volume` at the
  calibrated link bandwidths plus ``latency_us`` per exchange. The ring's K/V (and dK/dV)
  exchanges overlap the step computing meanwhile (a step costs ``max(compute, exchange)``);
  the all-gather's forward gather overlaps the local block; all-to-alls and the
  reduce-scatter are exposed. Exchanges among more than ``node_size`` ranks run at
  ``internode_gbps`` (hybrid keeps its all-to-all of U <= node_size ranks inside a node).
* **placement** -- per-document: :func:`~cp_rope.parallel.place_documents` gives each rank
  its whole documents (one local causal call) and the split documents run the method
  first (the per-document executor's order); the step time is the
  slowest rank's.

Validation against every measured row of ``docs/benchmarks.md``:
``scripts/validate_cost_model.py`` (the numbers and the picks are in that file's section
"Cost model and method / placement auto").
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from cp_rope.validation import check_cp_args, check_int

from . import _compat
from ._calibration import Calibration, calibration_or_default
from .choices import A2A_METHODS, BACKEND_CHOICES, METHODS
from .placement import default_split_threshold, place_documents
from .ulysses import check_ulysses_args, comm_volume

__all__ = ["AutoPlacement", "Choice", "Setting", "candidate_methods", "candidate_settings", "choose",
           "predict"]

_FWD_BWD = 3.5  # fwd + bwd FLOPs / fwd FLOPs (flash-attention's convention)
_ELEM = {torch.float64: 8, torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


@dataclasses.dataclass(frozen=True, order=True)
class Setting:
    """One (placement, split_threshold, method, ulysses_size) of a batch.

    ``split_threshold`` is None for zigzag; ``ulysses_size`` is None except for hybrid
    (ulysses uses cp_size).
    """

    placement: str
    split_threshold: int | None
    method: str
    ulysses_size: int | None = None

    def __str__(self) -> str:
        place = (self.placement if self.placement == "zigzag"
                 else f"per_document(split>{self.split_threshold})")
        u = f"(U={self.ulysses_size})" if self.ulysses_size else ""
        return f"{place}+{self.method}{u}"


@dataclasses.dataclass(frozen=True)
class Choice:
    """What :func:`choose` picked: ``setting`` (also as ``method`` / ``placement`` /
    ``split_threshold`` / ``ulysses_size``), its predicted time ``ms`` (slowest rank,
    forward + backward of one attention layer), ``ranking``: every setting evaluated,
    ``(ms, setting)`` sorted fastest first, and what the prediction assumed: ``backend`` (the
    block backend's throughput table) and ``source`` (the calibration's
    :attr:`~cp_rope.parallel.calibrate.Calibration.source`). Read-only; an auto plan carries
    it as ``plan.choice``, a batch placed by :class:`AutoPlacement` as ``batch.choice``."""

    setting: Setting
    ms: float
    ranking: tuple[tuple[float, Setting], ...]
    backend: str = ""
    source: str = ""

    method = property(lambda self: self.setting.method)
    placement = property(lambda self: self.setting.placement)
    split_threshold = property(lambda self: self.setting.split_threshold)
    ulysses_size = property(lambda self: self.setting.ulysses_size)

    def summary(self, top: int = 3) -> str:
        """One log line: the pick and the next ``top - 1`` settings with their times."""
        rest = ", ".join(f"{s} {ms:.3g} ms" for ms, s in self.ranking[1:top])
        return f"auto: {self.setting} {self.ms:.3g} ms" + (f" (next: {rest})" if rest else "")


# ------------------------------------------------------------------ compute of blocks

def _seg_time(cal: Calibration, backend: str, pairs: np.ndarray, lq: np.ndarray, heads: int,
              head_dim: int, lk: np.ndarray | None = None) -> float:
    """Seconds of one block call: ``call_us``, plus per segment (int64 arrays ``pairs``,
    ``lq`` query rows, ``lk`` key rows; ``lk=None``: causal, ``lk = lq``) and head
    ``seg_ns``, plus the FLOPs of the kernel's ``tile x tile`` tiles the segment touches
    (a partly masked or partly filled tile costs a full one) at the throughput of the
    segment's size (``pairs / lq`` keys per query row, ``Calibration.tflops_at``)."""
    keep = (pairs > 0) & (lq > 0)
    if not keep.any():
        return 0.0
    pairs, lq = pairs[keep].astype(np.float64), lq[keep].astype(np.float64)
    B = float(cal.tile)
    nq = np.ceil(lq / B)
    if lk is None:
        tiles = nq * (nq + 1) / 2
    else:
        tiles = nq * np.ceil(lk[keep].astype(np.float64) / B)
    calls = 1
    if backend == "auto":  # get_backend's per-segment rule: FA4 from the crossover up
        cross = _auto_crossover(cal, head_dim)
        if cross is None:
            tflops = cal.tflops_at("cudnn", pairs / lq)
        else:
            on_fa4 = lq >= cross
            tflops = np.where(on_fa4, cal.tflops_at("fa4", pairs / lq),
                              cal.tflops_at("cudnn", pairs / lq))
            calls = 1 + int(on_fa4.any() and not on_fa4.all())
    else:
        tflops = cal.tflops_at(backend, pairs / lq)
    flops = _FWD_BWD * 4.0 * np.maximum(tiles * B * B, pairs) * heads * head_dim
    return (float(np.sum(flops / (tflops * 1e12))) + calls * cal.call_us * 1e-6
            + pairs.size * heads * cal.seg_ns * 1e-9)


def _auto_crossover(cal: Calibration, head_dim: int) -> int | None:
    """The crossover ``backend="auto"`` runs with (:func:`~cp_rope.parallel._blocks.get_backend`):
    the calibration's for ``head_dim`` when it has an ``fa4`` table and FA4 is importable here
    (the same install on every rank), else None (cuDNN alone)."""
    if "fa4" not in cal.tflops or _compat.fa4_unavailable() is not None:
        return None
    return cal.crossover_at(head_dim)


def _causal(lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return lens * (lens + 1) // 2, lens


def _ring_steps(cal, backend, lens, C, r, heads, D) -> list[float]:
    """Compute seconds of ring steps ``0 .. C-1`` on rank ``r``: ``lens`` are the *global*
    lengths of the ring's documents (divisible by 2C), ``heads`` the q heads run."""
    loc = lens // C
    c = loc // 2
    steps = [_seg_time(cal, backend, *_causal(loc), heads, D)]
    first = _seg_time(cal, backend, loc * c, loc, heads, D, c)   # src < r: all q x chunk src
    second = _seg_time(cal, backend, c * loc, c, heads, D, loc)  # src > r: second half x all
    for i in range(1, C):
        steps.append(first if (r - i) % C < r else second)
    return steps


def _ring_time(cal, backend, lens, C, r, hq, hkv, D, elem, acc, link_gbps) -> float:
    """Ring of C ranks over documents ``lens`` (global), exchanges overlapped with steps."""
    if lens.size == 0 or not lens.any():
        return 0.0
    steps = _ring_steps(cal, backend, lens, C, r, hq, D)
    if C == 1:
        return steps[0]
    rows = int(lens.sum()) // C
    vol = comm_volume("ring", n_tokens=rows, q_heads=hq, kv_heads=hkv, head_dim=D,
                      cp_size=C, elem_bytes=elem, acc_bytes=acc)
    per_step = (vol["forward"] + vol["backward"]) / (C - 1) / (link_gbps * 1e9) \
        + 2 * cal.latency_us * 1e-6
    merge = (C - 1) * cal.merge_bytes_per_row * rows * hq * D / (cal.hbm_gbps * 1e9)
    # steps 0 .. C-2 hide the next exchange; the backward's dK/dV return hop is exposed
    hidden = sum(max(t, per_step) for t in steps[:-1]) + steps[-1]
    last_hop = 2 * rows * hkv * D * (elem if C == 2 else acc) / (link_gbps * 1e9)
    return hidden + merge + last_hop + cal.latency_us * 1e-6


def _allgather_time(cal, backend, lens, C, r, hq, hkv, D, elem, acc) -> float:
    """All-gather CP over documents ``lens`` (global lengths divisible by 2C) on rank r."""
    if lens.size == 0 or not lens.any():
        return 0.0
    c = lens // (2 * C)
    pc, _ = _causal(c)
    local = _seg_time(cal, backend, np.concatenate([pc, pc]), np.concatenate([c, c]), hq, D)
    glob = (_seg_time(cal, backend, c * (r * c), c, hq, D, r * c)
            + _seg_time(cal, backend, c * ((2 * C - 1 - r) * c), c, hq, D, (2 * C - 1 - r) * c))
    rows = int(lens.sum()) // C
    vol = comm_volume("allgather", n_tokens=rows, q_heads=hq, kv_heads=hkv, head_dim=D,
                      cp_size=C, elem_bytes=elem, acc_bytes=acc)
    bw = (cal.collective_gbps if C <= cal.node_size else cal.internode_gbps) * 1e9
    gather = vol["overlapped"] / bw + cal.latency_us * 1e-6
    exposed = (vol["forward"] + vol["backward"] - vol["overlapped"]) / bw \
        + 2 * cal.latency_us * 1e-6
    # the gathered K/V (input dtype) and their fp32 gradient, written and read once each
    mem = C * rows * 2 * hkv * D * (2 * elem + 2 * acc) + cal.merge_bytes_per_row * rows * hq * D
    return max(local, gather) + glob + exposed + mem / (cal.hbm_gbps * 1e9)


def _a2a_time(cal, backend, lens, C, r, U, hq, hkv, D, elem, acc) -> float:
    """Ulysses (U = C) / hybrid: all-to-all over U ranks, then a ring of C / U ranks with
    ``hq / U`` heads over chunks U times longer."""
    if lens.size == 0 or not lens.any():
        return 0.0
    R = C // U
    rows = int(lens.sum()) // C
    method = "ulysses" if U == C else "hybrid"
    vol = comm_volume(method, n_tokens=rows, q_heads=hq, kv_heads=hkv, head_dim=D, cp_size=C,
                      ulysses_size=None if U == C else U, elem_bytes=elem, acc_bytes=acc)
    a2a_bytes = vol["forward"] + vol["backward"] - vol["overlapped"]
    a2a_link = cal.a2a_gbps if U <= cal.node_size else cal.internode_gbps
    a2a = a2a_bytes / (a2a_link * 1e9) + 4 * cal.latency_us * 1e-6
    # pack / unpack of every all-to-all buffer (read + write on both sides)
    mem = 2 * a2a_bytes * U / max(U - 1, 1) / (cal.hbm_gbps * 1e9)
    # the ring joins ranks U apart: across nodes once the group spans more than one
    ring = _ring_time(cal, backend, lens, R, r // U, hq // U, max(hkv // U, 1), D, elem, acc,
                      cal.p2p_gbps if C <= cal.node_size else cal.internode_gbps)
    return a2a + mem + ring


def _method_time(cal, backend, s: Setting, lens, C, r, hq, hkv, D, elem, acc) -> float:
    if s.method == "ring":
        link = cal.p2p_gbps if C <= cal.node_size else cal.internode_gbps
        return _ring_time(cal, backend, lens, C, r, hq, hkv, D, elem, acc, link)
    if s.method == "allgather":
        return _allgather_time(cal, backend, lens, C, r, hq, hkv, D, elem, acc)
    U = C if s.method == "ulysses" else s.ulysses_size
    return _a2a_time(cal, backend, lens, C, r, U, hq, hkv, D, elem, acc)


# ------------------------------------------------------------------ public API

def _lengths(cu_seqlens) -> np.ndarray:
    cu = (cu_seqlens.detach().to("cpu", torch.int64).numpy() if isinstance(cu_seqlens, torch.Tensor)
          else np.asarray(cu_seqlens, dtype=np.int64))
    if cu.ndim != 1 or cu.size < 1 or cu[0] != 0 or (np.diff(cu) < 0).any():
        raise ValueError("cu_seqlens: a 1-D non-decreasing sequence of global cumulative "
                         "lengths starting at 0")
    return cu


def _check_model_args(backend, calibration, q_heads, kv_heads) -> Calibration:
    """The calibration to use; ValueError / TypeError naming ``backend`` (not one of
    :data:`~cp_rope.parallel.choices.BACKEND_CHOICES`), ``calibration`` (not a
    :class:`Calibration`: a dict is not read) or the heads (what the plan refuses)."""
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend={backend!r}: expected one of {list(BACKEND_CHOICES)}")
    calibration = calibration_or_default(calibration)
    hq = check_int("q_heads", q_heads, min_value=1)
    hkv = check_int("kv_heads", kv_heads, min_value=1)
    if hq % hkv:
        raise ValueError(f"q_heads={hq}: must be a multiple of kv_heads={hkv} (GQA; the "
                         "attention plan refuses it)")
    return calibration


def predict(cu_seqlens, setting: Setting, *, cp_size: int, q_heads: int, kv_heads: int,
            head_dim: int, dtype: torch.dtype = torch.bfloat16, backend: str = "cudnn",
            calibration: Calibration | None = None, per_rank: bool = False):
    """Predicted forward + backward time (ms) of one attention layer under ``setting``.

    Args:
        cu_seqlens: the *global* (padded) cumulative lengths ``[B + 1]`` (int tensor on the
            host, or a sequence of ints); the same on every rank.
        setting: a :class:`Setting`.
        cp_size, q_heads, kv_heads, head_dim, dtype: the layer's (dtype sets element bytes:
            2 for fp16/bf16; fp32 accumulators, fp64 for fp64 inputs).
        backend: the block backend's throughput table in the calibration (``"cudnn"``,
            ``"fa4"``, ``"torch_flash"``, ...; a table the calibration lacks uses ``"cudnn"``'s;
            a name outside :data:`~cp_rope.parallel.choices.BACKEND_CHOICES` is refused); ``"auto"``:
            per segment ``"fa4"``'s from the crossover of ``head_dim`` up, ``"cudnn"``'s below
            (``get_backend``'s rule; cuDNN's alone when FA4 is not importable or the
            calibration has no ``fa4`` table), one more call when a block uses both.
        calibration: constants (default :func:`~cp_rope.parallel.calibrate.default_calibration`).
        per_rank: also return the list of every rank's ms.

    Returns: the slowest rank's ms (and with ``per_rank`` a ``(ms, [ms per rank])`` tuple).

    Raises: ValueError / TypeError naming a bad argument (as ``comm_volume`` /
    ``check_ulysses_args`` for head counts the method cannot split; q_heads not a multiple
    of kv_heads; a misspelled ``backend``; a ``calibration`` that is not a
    :class:`Calibration`; a split document whose length is not divisible by ``2 * cp_size``).
    """
    cal = _check_model_args(backend, calibration, q_heads, kv_heads)
    cu = _lengths(cu_seqlens)
    C, _ = check_cp_args(cp_size, 0)
    hq, hkv = q_heads, kv_heads
    D = check_int("head_dim", head_dim, min_value=1)
    elem = _ELEM.get(dtype, 2)
    acc = 8 if dtype == torch.float64 else 4
    lens = np.diff(cu)
    if C == 1:
        t = _seg_time(cal, backend, *_causal(lens), hq, D) if lens.any() else 0.0
        return (t * 1e3, [t * 1e3]) if per_rank else t * 1e3
    if setting.method in ("ulysses", "hybrid"):
        check_ulysses_args(setting.method, setting.ulysses_size, C, hq, hkv)
    if setting.placement == "zigzag":
        if (lens % (2 * C)).any():
            raise ValueError(f"cu_seqlens: zigzag needs every length divisible by 2 * cp_size "
                             f"= {2 * C}")
        times = [_method_time(cal, backend, setting, lens, C, r, hq, hkv, D, elem, acc)
                 for r in range(C)]
    elif setting.placement == "per_document":
        placed = place_documents(torch.from_numpy(cu.astype(np.int32)), C,
                                 setting.split_threshold)
        split = lens[placed.owner < 0]
        times = []
        for r in range(C):
            whole = lens[placed.owner == r]
            t = _method_time(cal, backend, setting, split, C, r, hq, hkv, D, elem, acc)
            if whole.any():
                t += _seg_time(cal, backend, *_causal(whole), hq, D)
            times.append(t)
    else:
        raise ValueError(f"setting.placement must be 'zigzag' or 'per_document', got "
                         f"{setting.placement!r}")
    ms = [t * 1e3 for t in times]
    return (max(ms), ms) if per_rank else max(ms)


def candidate_methods(cp_size: int, q_heads: int, kv_heads: int,
                      ulysses_size: int | None = None) -> list[tuple[str, int | None]]:
    """Every ``(method, ulysses_size)`` that ``method="auto"`` compares, for each entry of
    :data:`~cp_rope.parallel.choices.METHODS`: ring and allgather; the all-to-all methods at
    every size U dividing ``cp_size`` and the heads (ulysses: U = cp_size; hybrid: each
    ``1 < U < cp_size``, or only ``ulysses_size`` if given), by increasing U. The one list of
    the chooser's methods: the trainers' self-test runs each of them (``launch/cp_startup``).

    Raises: ValueError (``check_ulysses_args``'s message) for a ``ulysses_size`` the heads
    or ``cp_size`` cannot run.
    """
    if ulysses_size is not None:
        check_ulysses_args("hybrid", ulysses_size, cp_size, q_heads, kv_heads)
    plain, a2a = [], []
    for method in METHODS:
        if method not in A2A_METHODS:
            plain.append((method, None))
            continue
        sizes = ([cp_size] if cp_size > 1 else []) if method == "ulysses" else range(2, cp_size)
        for u in sizes:
            if cp_size % u or (ulysses_size is not None and u != ulysses_size):
                continue
            try:
                check_ulysses_args("hybrid", u, cp_size, q_heads, kv_heads)
            except ValueError:
                continue
            a2a.append((u, method))
    return plain + [(m, None if m == "ulysses" else u) for u, m in sorted(a2a)]


def candidate_settings(cu_seqlens, *, cp_size: int, q_heads: int, kv_heads: int, head_dim: int,
                       method: str = "auto", placement: str = "auto",
                       split_threshold: int | None = None,
                       ulysses_size: int | None = None) -> list[Setting]:
    """The settings :func:`choose` compares, in a fixed order.

    ``method`` / ``placement``: a fixed value keeps it, ``"auto"`` tries every one that runs:
    ring, allgather, ulysses (when the heads split over cp_size ranks), hybrid with every
    ``1 < U < cp_size`` dividing cp_size and the heads (or only ``ulysses_size`` if given);
    zigzag (when every length divides by ``2 cp_size``) and per-document with the split
    thresholds ``split_threshold`` if given, else the library default and every distinct
    document length (at most 12, evenly spread) for which the split documents divide.

    Raises: ValueError when a fixed ``ulysses_size`` or the head counts cannot run a fixed
    method (the message from ``check_ulysses_args``); when nothing can run (e.g.
    ``placement="zigzag"`` and a length not divisible by ``2 cp_size``).
    """
    cu = _lengths(cu_seqlens)
    C, _ = check_cp_args(cp_size, 0)
    lens = np.diff(cu)
    if method == "auto":
        methods = candidate_methods(C, q_heads, kv_heads, ulysses_size)
    else:
        check_ulysses_args(method, ulysses_size, C, q_heads, kv_heads)
        methods = [(method, ulysses_size if method == "hybrid" else None)]
    if C == 1:  # one rank: nothing is split, any lengths and either layout run as ring
        fixed = "per_document" if placement == "per_document" else "zigzag"
        return [Setting(fixed, split_threshold if fixed == "per_document" else None, "ring",
                        None)]
    places: list[tuple[str, int | None]] = []
    if placement in ("auto", "zigzag") and not (lens % (2 * C)).any():
        places.append(("zigzag", None))
    if placement in ("auto", "per_document") and C > 1:
        if split_threshold is not None:
            thresholds = [split_threshold]
        else:
            uniq = np.unique(lens[lens > 0])
            if uniq.size > 12:
                uniq = uniq[np.linspace(0, uniq.size - 1, 12).round().astype(np.int64)]
            thresholds = sorted({default_split_threshold(head_dim, C), *map(int, uniq)})
        seen = set()
        default = default_split_threshold(head_dim, C)
        # one threshold per distinct set of split documents (the default where it is one)
        for t in sorted(thresholds, key=lambda t: (t != default, t)):
            split = lens > t
            if (lens[split] % (2 * C)).any() or split.tobytes() in seen:
                continue
            seen.add(split.tobytes())
            places.append(("per_document", t))
    if not places:
        raise ValueError(f"placement={placement!r}: no placement runs this batch (zigzag needs "
                         f"every length divisible by 2 * cp_size = {2 * C}; per_document needs "
                         f"it of the split documents)")
    return [Setting(p, t, m, u) for p, t in places for m, u in methods]


def choose(cu_seqlens, *, cp_size: int, q_heads: int, kv_heads: int, head_dim: int,
           dtype: torch.dtype = torch.bfloat16, backend: str = "cudnn", method: str = "auto",
           placement: str = "auto", split_threshold: int | None = None,
           ulysses_size: int | None = None,
           calibration: Calibration | None = None) -> Choice:
    """The fastest setting of one batch by :func:`predict` (deterministic: the same host
    arguments give the same choice on every rank; ties go to the earlier candidate of
    :func:`candidate_settings`, predictions compared at 1e-9 relative).

    Args: as :func:`predict` and :func:`candidate_settings` (``"auto"`` or a fixed value
    for ``method`` / ``placement``).

    Returns: a :class:`Choice` (``.method``, ``.placement``, ``.split_threshold``,
    ``.ulysses_size``, ``.ms``, ``.ranking``, ``.summary()`` for the step log).

    Raises: as :func:`candidate_settings` and :func:`predict`.
    """
    calibration = _check_model_args(backend, calibration, q_heads, kv_heads)  # before candidates
    cands = candidate_settings(cu_seqlens, cp_size=cp_size, q_heads=q_heads, kv_heads=kv_heads,
                               head_dim=head_dim, method=method, placement=placement,
                               split_threshold=split_threshold, ulysses_size=ulysses_size)
    scored = []
    for i, s in enumerate(cands):
        ms = predict(cu_seqlens, s, cp_size=cp_size, q_heads=q_heads, kv_heads=kv_heads,
                     head_dim=head_dim, dtype=dtype, backend=backend, calibration=calibration)
        scored.append((float(f"{ms:.9e}"), i, s))  # rounded: platform-independent ties
    scored.sort(key=lambda x: (x[0], x[1]))
    ranking = tuple((ms, s) for ms, _, s in scored)
    best = ranking[0]
    if not math.isfinite(best[0]):
        raise ValueError("cost model: no finite prediction (calibration values invalid?)")
    return Choice(best[1], best[0], ranking, backend=backend, source=calibration.source)


class AutoPlacement:
    """A DataLoader ``collate_fn`` for ``placement="auto"``: packs the global batch with
    ``collator`` (a :class:`~cp_rope.parallel.PackingCollator` with ``cp_rank`` set and
    placement zigzag), picks the batch's placement and split threshold with :func:`choose`
    (jointly with the method, ``method`` may be fixed), and returns this rank's shard cut
    that way, carrying the :class:`Choice` (``batch.choice``). Every rank of the CP group
    packs the same global batch, so every rank picks the same; the plan built from the shard
    (:func:`~cp_rope.parallel.attention_plan` with ``method="auto"`` or the chosen method)
    takes the method from ``batch.choice`` and carries it as ``plan.choice``: one decision
    per batch, made here.

    Args: ``collator``; the layer's ``q_heads``, ``kv_heads``, ``head_dim``, ``dtype``;
    ``backend`` (throughput table), ``method``, ``ulysses_size``, ``calibration`` (None: the
    shipped defaults): as :func:`choose`. Pass the plan's own (its dtype, its calibration).

    Raises: TypeError if ``collator`` is not a PackingCollator with ``cp_rank`` set, or
    ``calibration`` is not a Calibration; as :func:`choose` per batch.
    """

    def __init__(self, collator, *, q_heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, backend: str = "cudnn",
                 method: str = "auto", ulysses_size: int | None = None,
                 calibration: Calibration | None = None):
        from .collator import PackingCollator

        if not isinstance(collator, PackingCollator) or collator.cp_rank is None:
            raise TypeError("collator: a PackingCollator with cp_rank set (this rank's shard)")
        self.collator = collator
        self.kw = dict(cp_size=collator.cp_size, q_heads=q_heads, kv_heads=kv_heads,
                       head_dim=head_dim, dtype=dtype, backend=backend, method=method,
                       ulysses_size=ulysses_size,
                       calibration=calibration_or_default(calibration))

    def __call__(self, examples):
        from .sharding import shard_batch

        c = self.collator
        batch = c.pack(examples)
        choice = choose(batch.cu_seqlens, **self.kw)
        shard = shard_batch(batch, c.cp_size, c.cp_rank, placement=choice.placement,
                            split_threshold=choice.split_threshold, pad_id=c.pad_id,
                            ignore_index=c.ignore_index,
                            pad_to_multiple=(c.pad_to_multiple or c.cp_size) // c.cp_size)
        return dataclasses.replace(shard, choice=choice)
