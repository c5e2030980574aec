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
* **window** -- a left window ``W`` (one per layer, or the list of a model's layers: the
  average layer) leaves each block the (query, key) pairs it reaches (a causal document of
  ``n`` tokens has :func:`causal_pairs` ``= sum_p min(p + 1, W)``; :mod:`._window_cost`),
  and the windowed ring sends only the rows its peers see (``comm_volume(..., window=W)``:
  a halo of ``W - 1`` rows per chunk when W is below the chunk length); steps that meet no
  key cost nothing. All-gather and Ulysses move the same bytes with a window.
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

from ._calibration import Calibration, calibration_or_default
from ._cost_terms import method_time, whole_time
from ._window import check_window, effective_window
from ._window_cost import causal_pairs
from .choices import A2A_METHODS, BACKEND_CHOICES, METHODS, PLACEMENTS
from .placement import default_split_threshold, place_documents
from .ulysses import check_ulysses_args

__all__ = ["AutoPlacement", "Choice", "Setting", "candidate_methods", "candidate_settings",
           "causal_pairs", "choose", "predict"]

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


# ------------------------------------------------------------------ public API

def _lengths(cu_seqlens) -> np.ndarray:
    cu = (cu_seqlens.detach().to("cpu", torch.int64).numpy() if isinstance(cu_seqlens, torch.Tensor)
          else np.asarray(cu_seqlens, dtype=np.int64))
    if cu.ndim != 1 or cu.size < 1 or cu[0] != 0 or (np.diff(cu) < 0).any():
        raise ValueError("cu_seqlens: a 1-D non-decreasing sequence of global cumulative "
                         "lengths starting at 0")
    return cu


def _check_model_args(backend, calibration, q_heads, kv_heads, method="auto", placement="auto",
                      dtype=torch.bfloat16) -> Calibration:
    """The calibration to use; ValueError / TypeError naming ``backend`` (not one of
    :data:`~cp_rope.parallel.choices.BACKEND_CHOICES`), ``method`` / ``placement`` (not
    ``"auto"`` or one of the lists), ``dtype`` (not a float dtype), ``calibration`` (not a
    :class:`Calibration`: a dict is not read) or the heads (what the plan refuses)."""
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend={backend!r}: expected one of {list(BACKEND_CHOICES)}")
    if method not in ("auto", *METHODS):
        raise ValueError(f"method={method!r}: expected one of {['auto', *METHODS]}")
    if placement not in ("auto", *PLACEMENTS):
        raise ValueError(f"placement={placement!r}: expected one of {['auto', *PLACEMENTS]}")
    if dtype not in _ELEM:
        raise TypeError(f"dtype={dtype!r}: expected one of {list(_ELEM)} (the layer's q/k/v dtype)")
    calibration = calibration_or_default(calibration)
    hq = check_int("q_heads", q_heads, min_value=1)
    hkv = check_int("kv_heads", kv_heads, min_value=1)
    if hq % hkv:
        raise ValueError(f"q_heads={hq}: must be a multiple of kv_heads={hkv} (GQA; the "
                         "attention plan refuses it)")
    return calibration


def _layer_windows(window) -> list[int | None]:
    """Every layer's window (duplicates kept: they weigh the average), checked as the plan's."""
    if isinstance(window, (list, tuple)):
        if not window:
            raise ValueError("window: an empty list (pass None for no window)")
        return [check_window(w) for w in window]
    return [check_window(window)]


def _check_setting(setting, C: int, hq: int, hkv: int) -> None:
    """TypeError / ValueError naming ``setting.<field>`` for a setting no plan runs: not a
    :class:`Setting`; a method or placement not in the lists; a split threshold that is not
    an int >= 0, given to zigzag or missing for per_document at ``C > 1``; a ``ulysses_size``
    the method cannot use (``check_ulysses_args``)."""
    if not isinstance(setting, Setting):
        raise TypeError(f"setting={setting!r}: expected a cost_model.Setting(placement, "
                        "split_threshold, method, ulysses_size)")
    if setting.method not in METHODS:
        raise ValueError(f"setting.method={setting.method!r}: expected one of {list(METHODS)}")
    if setting.placement not in PLACEMENTS:
        raise ValueError(f"setting.placement={setting.placement!r}: expected one of "
                         f"{list(PLACEMENTS)}")
    t = setting.split_threshold
    if t is not None:
        check_int("setting.split_threshold", t, min_value=0)
        if setting.placement == "zigzag":
            raise ValueError(f"setting.split_threshold={t!r}: is for placement "
                             "'per_document' only (None with 'zigzag')")
    elif setting.placement == "per_document" and C > 1:
        raise ValueError("setting.split_threshold=None: placement 'per_document' needs a "
                         "split threshold (an int >= 0, e.g. placement.default_split_threshold)")
    if C > 1:
        check_ulysses_args(setting.method, setting.ulysses_size, C, hq, hkv)
    elif setting.ulysses_size is not None:
        check_int("setting.ulysses_size", setting.ulysses_size, min_value=1)


def predict(cu_seqlens, setting: Setting, *, cp_size: int, q_heads: int, kv_heads: int,
            head_dim: int, dtype: torch.dtype = torch.bfloat16, backend: str = "cudnn",
            calibration: Calibration | None = None, per_rank: bool = False,
            window: int | None | list = None):
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
            unless a block's shorter segments hold fewer than ``SPLIT_MIN_ROWS`` query rows
            (then ``"fa4"``'s for all; ``get_backend``'s rule; cuDNN's alone when FA4 is not
            importable or the calibration has no ``fa4`` table), one more call when a block
            uses both; under a window (below) ``"fa4"``'s for every segment where FA4 runs,
            as windowed blocks never run on cuDNN.
        calibration: constants (default :func:`~cp_rope.parallel.calibrate.default_calibration`).
        per_rank: also return the list of every rank's ms.
        window: the layer's left window ``W`` (:mod:`cp_rope.parallel._window`'s convention:
            the query at position p sees keys p - W + 1 .. p; None: none), or a list of the
            model's per-layer windows (then the average layer: the mean of each layer's
            slowest rank). A window shorter than some
            document leaves each block the pairs it reaches (:func:`causal_pairs` per
            document) and the ring the halo it sends (``comm_volume(..., window=W)``).

    Returns: the slowest rank's ms (and with ``per_rank`` a ``(ms, [ms per rank])`` tuple; a
    list of windows: the layers' mean of both).

    Raises: ValueError / TypeError naming a bad argument (``setting.method`` /
    ``setting.placement`` / ``setting.split_threshold`` / ``setting.ulysses_size`` no plan
    runs; as ``comm_volume`` /
    ``check_ulysses_args`` for head counts the method cannot split; q_heads not a multiple
    of kv_heads; a misspelled ``backend``; a ``calibration`` that is not a
    :class:`Calibration`; a split document whose length is not divisible by ``2 * cp_size``).
    """
    cal = _check_model_args(backend, calibration, q_heads, kv_heads, dtype=dtype)
    cu = _lengths(cu_seqlens)
    C, _ = check_cp_args(cp_size, 0)
    hq, hkv = q_heads, kv_heads
    D = check_int("head_dim", head_dim, min_value=1)
    elem = _ELEM.get(dtype, 2)
    acc = 8 if dtype == torch.float64 else 4
    lens = np.diff(cu)
    windows = _layer_windows(window)
    _check_setting(setting, C, hq, hkv)
    longest = int(lens.max()) if lens.size else 0
    weights: dict[int | None, int] = {}  # effective window (as the plan's) -> layers
    for w in windows:
        w = effective_window(w, longest)
        weights[w] = weights.get(w, 0) + 1
    # every layer waits for its slowest rank: the average layer's time is the mean of the
    # layers' maxima (per_rank: each rank's mean)
    per = {w: np.asarray(_rank_times(cal, backend, setting, cu, lens, C, hq, hkv, D, elem, acc,
                                     w), dtype=np.float64) for w in weights}
    slowest = sum(n * per[w].max() for w, n in weights.items()) / len(windows) * 1e3
    if not per_rank:
        return float(slowest)
    return float(slowest), [float(t) * 1e3 for t in
                            sum(n * per[w] for w, n in weights.items()) / len(windows)]


def _rank_times(cal, backend, setting, cu, lens, C, hq, hkv, D, elem, acc, W) -> list[float]:
    """Seconds of one layer with the effective window ``W`` on every rank."""
    if C == 1:
        return [whole_time(cal, backend, lens, hq, D, W) if lens.any() else 0.0]
    if setting.placement == "zigzag":
        if (lens % (2 * C)).any():
            raise ValueError(f"cu_seqlens: zigzag needs every length divisible by 2 * cp_size "
                             f"= {2 * C}")
        times = [method_time(cal, backend, setting, lens, C, r, hq, hkv, D, elem, acc, W)
                 for r in range(C)]
    elif setting.placement == "per_document":
        placed = place_documents(torch.from_numpy(cu.astype(np.int32)), C,
                                 setting.split_threshold)
        split = lens[placed.owner < 0]
        times = []
        for r in range(C):
            whole = lens[placed.owner == r]
            t = method_time(cal, backend, setting, split, C, r, hq, hkv, D, elem, acc, W)
            if whole.any():
                t += whole_time(cal, backend, whole, hq, D, W)
            times.append(t)
    else:
        raise ValueError(f"setting.placement must be 'zigzag' or 'per_document', got "
                         f"{setting.placement!r}")
    return times


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
           ulysses_size: int | None = None, calibration: Calibration | None = None,
           window: int | None | list = None) -> Choice:
    """The fastest setting of one batch by :func:`predict` (deterministic: the same host
    arguments give the same choice on every rank; ties go to the earlier candidate of
    :func:`candidate_settings`, predictions compared at 1e-9 relative).

    Args: as :func:`predict` and :func:`candidate_settings` (``"auto"`` or a fixed value
    for ``method`` / ``placement``; ``window``: the layer's or every layer's, as
    :func:`predict`: one method serves every layer of the plan, so a list scores the
    average layer).

    Returns: a :class:`Choice` (``.method``, ``.placement``, ``.split_threshold``,
    ``.ulysses_size``, ``.ms``, ``.ranking``, ``.summary()`` for the step log).

    Raises: as :func:`candidate_settings` and :func:`predict`.
    """
    calibration = _check_model_args(backend, calibration, q_heads, kv_heads, method, placement,
                                    dtype)  # before the candidates
    cands = candidate_settings(cu_seqlens, cp_size=cp_size, q_heads=q_heads, kv_heads=kv_heads,
                               head_dim=head_dim, method=method, placement=placement,
                               split_threshold=split_threshold, ulysses_size=ulysses_size)
    scored = []
    for i, s in enumerate(cands):
        ms = predict(cu_seqlens, s, cp_size=cp_size, q_heads=q_heads, kv_heads=kv_heads,
                     head_dim=head_dim, dtype=dtype, backend=backend, calibration=calibration,
                     window=window)
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
    ``backend`` (throughput table), ``method``, ``ulysses_size``, ``window``, ``calibration``
    (None: the shipped defaults): as :func:`choose`. Pass the plan's own (its dtype, its
    calibration, the model's windows).

    Raises: TypeError if ``collator`` is not a PackingCollator with ``cp_rank`` set, or
    ``calibration`` is not a Calibration; as :func:`choose` per batch.
    """

    def __init__(self, collator, *, q_heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, backend: str = "cudnn",
                 method: str = "auto", ulysses_size: int | None = None,
                 window: int | None | list = None, calibration: Calibration | None = None):
        from .collator import PackingCollator

        if not isinstance(collator, PackingCollator) or collator.cp_rank is None:
            raise TypeError("collator: a PackingCollator with cp_rank set (this rank's shard)")
        self.collator = collator
        self.kw = dict(cp_size=collator.cp_size, q_heads=q_heads, kv_heads=kv_heads,
                       head_dim=head_dim, dtype=dtype, backend=backend, method=method,
                       ulysses_size=ulysses_size, window=window,
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
