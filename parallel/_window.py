"""Sliding-window attention under CP: the convention, its checks, and the windowed schedules.

**Convention** (one for every part of cp_rope): a *left window* ``W`` (an int >= 1) lets
the query at position ``p`` of a document (its global position, by the CP formula) see
the keys at positions ``p - W + 1 .. p`` of the same document: ``W`` keys, itself
included. ``W = 1``: each token sees only itself. Mapping of the other conventions:

* transformers' ``config.sliding_window = S`` (``masking_utils.sliding_window_overlay``:
  ``kv_idx > q_idx - S``, on top of the causal mask): ``W = S``;
* flash-attn's ``window_size=(left, 0)`` with ``causal=True`` (query ``i`` sees keys
  ``i - left .. i``): ``W = left + 1``, i.e. flash-attn's ``window_size=(W - 1, 0)``.

A window is only defined with ``causal=True`` (a non-causal window is refused).

**Schedules.** Every causal block of the plain schedules pairs a query chunk with a key
chunk; with a window a pair splits into at most two *pieces* by the positions involved
(:func:`offdiag_pieces`): keys every query of the chunk sees (``"full"``: no mask) and
the keys only the earlier queries see (``"halo"``: query ``i`` sees key ``j >= i + lk -
lq``, flash-attn's ``window_size=(0, -1)`` without causal, bottom-right aligned), plus
the chunk against itself (``"diag"``: causal with ``window_size=(W - 1, 0)``; plain
causal when the window covers the chunk). Pieces of one kind are packed into blocks
whose query rows and key rows both increase (:func:`pack_blocks`), so each block is one
varlen call of a backend that takes ``window_size``; pairs no query sees give no piece,
so they are neither computed nor sent.

The windowed ring (:mod:`cp_rope.parallel._window_ring`) sends at step ``i`` to rank
``r + i`` exactly the rows of its K/V that rank needs (:func:`needed_rows`: a suffix of
each chunk, the halo ``W - 1`` rows when ``W`` is below the chunk length), instead of
forwarding the whole K/V around the ring.
"""

from __future__ import annotations

import dataclasses

import torch

from cp_rope.validation import check_int

from ._device import to_device
from ._schedule import Layout, pieces_block

__all__ = ["check_window", "check_windows", "check_sinks", "check_call_sinks", "copy_plan",
           "link_variants", "plan_for_window", "has_window_blocks", "effective_window", "offdiag_pieces",
           "pair_pieces", "needed_rows", "pack_blocks", "window_ring_schedule",
           "window_allgather_schedule", "WindowStep", "window_ring_rows"]


def check_window(window, causal: bool = True) -> int | None:
    """``window`` as a Python int >= 1, or None (no window).

    Raises: TypeError naming ``window`` if it is not an int (a bool or float is refused);
    ValueError if it is < 1, or given with ``causal=False``.
    """
    if window is None:
        return None
    window = check_int("window", window, min_value=1)
    if not causal:
        raise ValueError(f"window={window} needs causal=True (a left window of non-causal "
                         "attention is not defined by cp_rope)")
    return window


def check_sinks(sinks, q: torch.Tensor) -> torch.Tensor | None:
    """``sinks`` (or None) checked against q ``[T, Hq, D]``: a floating tensor ``[Hq]`` of
    q's dtype or float32, on q's device (GPT-OSS's per-head sink logits, a learnable
    parameter). Raises TypeError / ValueError naming ``sinks``."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor [Hq] or None, got {type(sinks).__name__}")
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks must have shape [Hq] = [{q.shape[1]}] (one logit per q head), "
                         f"got {tuple(sinks.shape)}")
    if sinks.dtype not in (q.dtype, torch.float32):
        raise TypeError(f"sinks must be q's dtype ({q.dtype}) or float32, got {sinks.dtype}")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device ({q.device}), got {sinks.device}")
    return sinks


def check_call_sinks(planned: bool, sinks) -> None:
    """A call's ``sinks`` against its plan's ``sinks`` flag (ValueError naming sinks)."""
    if planned and sinks is None:
        raise ValueError("sinks: the plan was built with sinks=True; pass the layer's sink "
                         "logits [Hq]")
    if not planned and sinks is not None:
        raise ValueError("sinks: the plan was built without sinks (attention_plan(..., "
                         "sinks=True) for layers with sink logits)")


def copy_plan(plan, **changes):
    """A read-only plan's copy (every slot of its class and bases) with ``changes``: the
    plan of the same batch for another window."""
    other = object.__new__(type(plan))
    for cls in type(plan).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(plan, name):
                object.__setattr__(other, name, getattr(plan, name))
    for name, value in changes.items():
        object.__setattr__(other, name, value)
    return other


def link_variants(variants: dict) -> None:
    """Give each plan of ``{window: plan}`` (one batch) the mapping of all of them."""
    for plan in variants.values():
        object.__setattr__(plan, "_variants", variants)


def plan_for_window(plan, window):
    """``plan``'s variant for ``window`` (one of ``plan.windows``, agreed at the build;
    None: no window). Raises TypeError / ValueError naming ``window`` for another."""
    window = check_window(window, plan.causal)
    if window not in plan._variants:
        raise ValueError(f"window={window}: the plan was built for windows "
                         f"{list(plan.windows)} (pass every layer's window to "
                         "attention_plan(window=[...]))")
    return plan._variants[window]


def has_window_blocks(blocks) -> bool:
    """Whether a schedule (``{phase: blocks or windowed ring steps}``) has windowed blocks."""
    return any(b.window is not None for phase in blocks.values() for item in phase
               for b in getattr(item, "blocks", (item,)))


def check_windows(window, causal: bool = True) -> tuple[int | None, ...]:
    """The windows a plan serves: ``window`` (an int, None) or a list / tuple of them (the
    per-layer windows of a model; the first is the plan's own). Raises as
    :func:`check_window`, and ValueError for an empty list."""
    if isinstance(window, (list, tuple)):
        if not window:
            raise ValueError("window: an empty list (pass None for no window)")
        got = tuple(check_window(w, causal) for w in window)
        return tuple(dict.fromkeys(got))  # distinct, first one first
    return (check_window(window, causal),)


def effective_window(window: int | None, max_global_len: int) -> int | None:
    """None when ``window`` covers every document (``W >= `` the longest global length: the
    window masks nothing, the plain causal schedule runs), else ``window``."""
    return None if window is None or window >= max_global_len else window


# kind -> (causal, flash-attn window_size); "diag" gets (W - 1, 0)
_KINDS = {"causal": (True, None), "full": (False, None), "halo": (False, (0, -1))}


def _kind(kind: str, window: int) -> tuple[bool, tuple[int, int] | None]:
    return (True, (window - 1, 0)) if kind == "diag" else _KINDS[kind]


def offdiag_pieces(qa: int, qb: int, ka: int, kb: int, window: int | None):
    """Pieces of queries at positions ``[qa, qb)`` against keys ``[ka, kb)`` before them
    (``kb <= qa``) under a left window: ``[(kind, q0, q1, k0, k1)]`` in positions.

    Keys ``>= split = qb - W`` are seen by every query (``"full"``); keys in ``[qa - W + 1,
    split)`` only by the queries before ``split + W - 1`` (``"halo"``: with the query range
    ending there, key ``j`` of the piece is visible from query ``i`` iff ``j >= i + lk -
    lq``, flash-attn's bottom-right ``window_size=(0, -1)``).
    """
    if qa >= qb or ka >= kb:
        return []
    if window is None:
        return [("full", qa, qb, ka, kb)]
    lo = max(ka, qa - window + 1)  # the lowest key any query sees
    if lo >= kb:
        return []
    split = min(kb, max(lo, qb - window))  # keys >= split are seen by every query
    pieces = [("full", qa, qb, split, kb)] if split < kb else []
    if lo < split:  # queries past split + W - 2 see none of [lo, split)
        pieces.append(("halo", qa, min(qb, split + window - 1), lo, split))
    return pieces


def _docs(lay: Layout):
    """``(first local row, chunk length c)`` of every non-empty local document (``C = 1``:
    one chunk of the whole document)."""
    cu = lay.cu.tolist()
    for a, e in zip(cu[:-1], cu[1:], strict=True):
        if e > a:
            yield a, (e - a if lay.cp_size == 1 else (e - a) // 2)


def _rank_chunks(C: int, p: int, a: int, c: int):
    """``[(chunk index, first local row)]`` of rank ``p``'s share of a document."""
    return ((0, a),) if C == 1 else ((p, a), (2 * C - 1 - p, a + c))


def pair_pieces(lay: Layout, r: int, p: int, window: int | None):
    """Pieces of rank ``r``'s queries against rank ``p``'s keys (both local rows, every rank
    holding the zigzag shares of the same local ``cu``): ``[(kind, q0, q1, k0, k1)]``."""
    C, out = lay.cp_size, []
    for a, c in _docs(lay):
        for qi, qrow in _rank_chunks(C, r, a, c):
            for ki, krow in _rank_chunks(C, p, a, c):
                if ki == qi:
                    kind = "causal" if window is None or window >= c else "diag"
                    out.append((kind, qrow, qrow + c, krow, krow + c))
                elif ki < qi:
                    for kind, q0, q1, k0, k1 in offdiag_pieces(qi * c, (qi + 1) * c, ki * c,
                                                               (ki + 1) * c, window):
                        out.append((kind, qrow + q0 - qi * c, qrow + q1 - qi * c,
                                    krow + k0 - ki * c, krow + k1 - ki * c))
    return out


def needed_rows(pieces) -> list[tuple[int, int]]:
    """The key rows the pieces read, as sorted disjoint ``[(k0, k1)]`` intervals."""
    spans = sorted((k0, k1) for _, _, _, k0, k1 in pieces if k1 > k0)
    merged: list[list[int]] = []
    for k0, k1 in spans:
        if merged and k0 <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], k1)
        else:
            merged.append([k0, k1])
    return [tuple(m) for m in merged]


def _to_buffer(pieces, spans):
    """Key rows of ``pieces`` renumbered into the compact buffer of ``spans`` (concatenated)."""
    base, off = [], 0
    for k0, k1 in spans:
        base.append((k0, k1, off))
        off += k1 - k0
    out = []
    for kind, q0, q1, k0, k1 in pieces:
        s0, _, o = next(b for b in base if b[0] <= k0 and k1 <= b[1])
        out.append((kind, q0, q1, k0 - s0 + o, k1 - s0 + o))
    return out


def pack_blocks(lay: Layout, pieces, n_q: int, n_k: int, window: int | None):
    """Blocks of ``pieces`` (``(kind, q0, q1, k0, k1)`` rows): one kind per block, query and
    key rows increasing in each (first fit over the pieces sorted by rows); ``"full"``
    pieces of the same queries over adjacent keys become one segment. Every block covers
    query rows ``[0, n_q)`` and key rows ``[0, n_k)`` (rows of no piece: segments without
    keys, or without queries)."""
    by_kind: dict[str, list] = {}
    for kind, q0, q1, k0, k1 in sorted(pieces, key=lambda x: (x[1], x[3], x[0])):
        if q1 <= q0:
            continue
        chains = by_kind.setdefault(kind, [])
        for chain in chains:
            last = chain[-1]
            if kind == "full" and (last[0], last[1], last[3]) == (q0, q1, k0):
                chain[-1] = (q0, q1, last[2], k1)
                break
            if last[1] <= q0 and last[3] <= k0:
                chain.append((q0, q1, k0, k1))
                break
        else:
            chains.append([(q0, q1, k0, k1)])
    blocks = []
    for kind in ("causal", "diag", "full", "halo"):
        for chain in by_kind.get(kind, ()):
            causal, win = _kind(kind, window)
            blocks.append(pieces_block(lay, chain, n_q, n_k, causal, win))
    return tuple(blocks)


@dataclasses.dataclass(frozen=True)
class WindowStep:
    """Step ``i`` of the windowed ring on one rank: its blocks (keys: the compact buffer of
    rows received from rank ``r - i``; step 0: the local K/V), the local rows to send to
    rank ``r + i`` (``send``: device int64 index, ``n_send`` rows) and the rows received
    from ``r - i`` (``n_recv``; ``recv``: their index in the sender's rows, used by a
    simulated rank's loopback)."""

    blocks: tuple
    send: torch.Tensor | None
    n_send: int
    recv: torch.Tensor | None
    n_recv: int


def _index(spans, device) -> torch.Tensor | None:
    if not spans:
        return None
    return to_device(torch.cat([torch.arange(a, b) for a, b in spans]), device)


def window_ring_schedule(lay: Layout):
    """The windowed ring of ``lay.window`` (an effective window, not None): ``{"window":
    (WindowStep, ...)}`` of ``C`` steps, step ``i`` against rank ``(r - i) mod C``'s rows
    (``C = 1``: one step, whole documents, causal with ``window_size=(W - 1, 0)``)."""
    C, r, W, n_q = lay.cp_size, lay.cp_rank, lay.window, int(lay.cu[-1])
    own = pair_pieces(lay, r, r, W)
    if C == 1:  # whole documents: the shorter ones in the windowed call too (W masks nothing
        # there), so the step is one block (one kernel call, no merge; sinks in the kernel)
        own = [("diag", *p[1:]) for p in own]
    steps = [WindowStep(pack_blocks(lay, own, n_q, n_q, W), None, 0, None, 0)]
    for i in range(1, C):
        src, dst = (r - i) % C, (r + i) % C
        pieces = pair_pieces(lay, r, src, W)
        spans = needed_rows(pieces)
        sends = needed_rows(pair_pieces(lay, dst, r, W))
        n_recv = sum(b - a for a, b in spans)
        blocks = pack_blocks(lay, _to_buffer(pieces, spans), n_q, n_recv, W)
        steps.append(WindowStep(blocks, _index(sends, lay.device), sum(b - a for a, b in sends),
                                _index(spans, lay.device), n_recv))
    terms = sum(len(s.blocks) for s in steps)
    # one block (cp 1: whole documents): its output is the result, in the input dtype, as
    # the plain ring's at cp 1; otherwise fp32 accumulators
    return {"window": tuple(steps)}, {}, 1 if C == 1 and terms == 1 else max(terms, 3)


def window_ring_rows(cu, cp_size: int, cp_rank: int, window: int) -> tuple[int, int] | None:
    """``(sent, received)``: K/V rows rank ``cp_rank`` sends and receives in one windowed ring
    pass over local ``cu`` (host ints ``[B + 1]``) -- what :func:`window_ring_schedule`
    exchanges; None when the window covers every document (the plain ring runs)."""
    cu = torch.as_tensor(cu, dtype=torch.int64)
    lens = cu[1:] - cu[:-1]
    longest = int(lens.max()) * cp_size if lens.numel() else 0
    W = effective_window(window, longest)
    if W is None:
        return None
    lay = Layout(cu, 0, int(cu[-1]), cp_size, cp_rank, True, None, torch.device("cpu"), 1, W)
    C, r = cp_size, cp_rank

    def rows(q_rank, k_rank):
        return sum(b - a for a, b in needed_rows(pair_pieces(lay, q_rank, k_rank, W)))

    return (sum(rows((r + i) % C, r) for i in range(1, C)),
            sum(rows(r, (r - i) % C) for i in range(1, C)))


def window_allgather_schedule(lay: Layout, kv_index):
    """All-gather with ``lay.window``: each local chunk against itself (``"local"``, causal
    with the window) and against the gathered keys before it in global order (``"global"``:
    the window's full and halo pieces)."""
    C, r, W = lay.cp_size, lay.cp_rank, lay.window
    n_q = int(lay.cu[-1])
    local, glob = [], []
    cu = lay.cu.tolist()
    for a, e in zip(cu[:-1], cu[1:], strict=True):
        if e == a:
            continue
        c, ga = (e - a) // 2, a * C
        for qi, qrow in ((r, a), (2 * C - 1 - r, a + c)):
            local.append(("causal" if W >= c else "diag", qrow, qrow + c, qrow, qrow + c))
            for kind, q0, q1, k0, k1 in offdiag_pieces(qi * c, (qi + 1) * c, 0, qi * c, W):
                glob.append((kind, qrow + q0 - qi * c, qrow + q1 - qi * c, ga + k0, ga + k1))
    lb, gb = pack_blocks(lay, local, n_q, n_q, W), pack_blocks(lay, glob, n_q, n_q * C, W)
    return {"local": lb, "global": gb}, {"kv": kv_index}, max(len(lb) + len(gb), 3)
