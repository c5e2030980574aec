"""The one door of context-parallel attention, and the builder of its per-batch plan.

:func:`attention_plan` builds the plan of one batch (zigzag or per-document
placement; any method), once per step; :func:`context_parallel_attention` runs
attention with it in every layer, dispatching on the plan's kind:

* :class:`~cp_rope.parallel.plan.CPAttentionPlan` (zigzag layout: rank ``r`` keeps
  chunks ``r`` and ``2C - 1 - r`` of every sequence, :mod:`cp_rope.parallel.sharding`);
* :class:`~cp_rope.parallel.per_document.PerDocumentPlan` (short documents whole on
  one rank, long ones zigzag; :mod:`cp_rope.parallel.placement`).

The methods each have a room: :mod:`.ring` (K/V around the ring, overlapped with
compute), :mod:`.allgather` (one gather of K/V, a reduce-scatter of dK/dV),
:mod:`.ulysses` (all-to-all to head-sharded whole sequences, and the hybrid
all-to-all x ring); all exact (partials merged through their log-sum-exp), over
the block backends of :mod:`._blocks`, dispatched by one autograd Function
(:mod:`._dispatch`). The plan (what each step computes), the exchange (how data
moves: :mod:`._ring`, the all-gather, the all-to-all) and the block backend (how a
block runs) stay apart.

Host syncs: none in a call given ``plan=`` (forward and backward). Without it the
call builds the plan: it reads ``cu_seqlens`` on the host (one sync for a device
tensor) and, with ``C > 1``, all-gathers the ranks' signatures.
"""

from __future__ import annotations

import hashlib
import warnings

import torch
import torch.distributed as dist

from cp_rope.validation import check_bool, check_choice, check_cu_seqlens, content_checks_enabled

from ._blocks import get_backend
from ._calibration import Calibration, calibration_or_default, calibration_signature
from ._choose import LayoutInfo, choose_strategy
from ._dispatch import run_plan
from ._window import check_sinks, check_windows
from .batch import PackedBatch
from .choices import AUTO, PLACEMENTS, Backend, Method
from .per_document import PerDocumentPlan, check_per_document_rows, run_per_document
from .placement import DocumentPlacement, check_group_size
from .plan import CPAttentionPlan, check_across_ranks, check_softmax_scale, check_tensors

__all__ = ["context_parallel_attention", "attention_plan", "per_document_attention",
           "CPAttentionPlan", "PerDocumentPlan"]


def attention_plan(
    source: PackedBatch | DocumentPlacement | torch.Tensor,
    max_seqlen: int | None = None,
    *,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str | int | None = None,
    group: dist.ProcessGroup | None = None,
    method: str = "ring",
    placement: str | None = None,
    split_threshold: int | None = None,
    ulysses_size: int | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: Backend = "auto",
    n_tokens: int | None = None,
    seq_lens: torch.Tensor | None = None,
    window: int | None | list = None,
    sinks: bool = False,
    calibration: Calibration | None = None,
    _check=None,
    _extra_sig=None,
) -> CPAttentionPlan | PerDocumentPlan:
    """The attention plan of one batch, for every layer of a step (collective over ``group``).

    Args:
        source: this rank's :class:`~cp_rope.parallel.PackedBatch` shard (its
            ``placement`` says the layout; ``cu_seqlens``, ``max_seqlen``, rows and, with
            ``causal=False``, ``seq_lens`` come from it); or a per-document
            :class:`~cp_rope.parallel.DocumentPlacement`; or int32 ``[B + 1]`` local
            zigzag ``cu_seqlens`` (with ``max_seqlen``).
        max_seqlen: host int, with a ``cu_seqlens`` source (else None or the batch's).
        q_heads, kv_heads, head_dim, dtype: of the layer's q ``[T, Hq, D]`` and k/v
            ``[T, Hkv, D]`` (the compute dtype).
        device: where q/k/v live (default: the source's device; CPU for a placement).
        group: the CP process group (None or one rank: no CP).
        method: one of :data:`~cp_rope.parallel.choices.METHODS`, or ``"auto"``: the method
            of the batch's ``choice`` (a shard of
            :class:`~cp_rope.parallel.cost_model.AutoPlacement`), else
            :func:`~cp_rope.parallel._choose.choose_strategy` decides. A batch's choice is
            also taken with its own method named here (the plan then carries it).
        placement: None (the source's), ``"zigzag"`` / ``"per_document"`` (must be the
            source's layout), or ``"auto"`` (the chooser decides; it must keep the
            layout of rows already sharded).
        split_threshold: per-document only: None or the placement's own.
        ulysses_size, causal: as :func:`context_parallel_attention`.
        softmax_scale: fixed in the plan (default ``1 / sqrt(head_dim)``).
        backend: fixed in the plan (``"auto"`` picks per call from the inputs).
        n_tokens: rows T of q/k/v (default: the batch's rows, ``placement.n_rows``, or
            ``cu_seqlens[-1]``).
        seq_lens: ``causal=False``: true lengths (default: the batch's).
        window: the left window ``W`` of sliding-window attention (an int >= 1, causal
            only: the query at global position p of a document sees keys p - W + 1 .. p,
            W keys; transformers' ``config.sliding_window`` is W, flash-attn's
            ``window_size=(W - 1, 0)`` is W), None for none, or a list of windows (a
            model's per-layer windows, None for its full layers: ``plan.for_window(W)``
            gives each layer's plan; the first is the returned plan's own).
        sinks: the layers pass per-head sink logits ``[Hq]`` (GPT-OSS) to every call.
        calibration: the cost model's constants
            (:func:`cp_rope.parallel.calibrate.load_calibration` of ``python -m
            cp_rope.parallel.calibrate``'s file; None: the shipped defaults) for ``"auto"``
            and for backend ``"auto"``'s FA4 / cuDNN crossover in every call with this plan
            (``plan.calibration``). Explicit: nothing keeps one for the process.

    Returns: a :class:`CPAttentionPlan` (zigzag) or :class:`PerDocumentPlan`, read-only;
    ``plan.rope_args()`` gives RoPE's keyword arguments for its layout (positions built
    once, on ``device``); ``plan.choice`` the auto decision (a
    :class:`~cp_rope.parallel.cost_model.Choice`: method, placement, split threshold,
    ``ulysses_size``, predicted times and runners-up, ``summary()``; None when neither
    ``method`` nor ``placement`` was auto and the batch carries none); ``plan.calibration``
    the constants it runs with.

    Raises: TypeError / ValueError naming the argument on the rank whose argument is bad,
    and RuntimeError naming that rank on the others (group of more than one rank); a
    RuntimeError on every rank when the ranks' batches or arguments differ;
    NotImplementedError from the chooser for ``"auto"`` while it has no rule.
    """
    size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    rank = dist.get_rank(group) if size > 1 else 0
    error, kw, choice = None, {}, None
    try:
        if _check is not None:  # the caller's rank-local checks (cp_rope.hf) join the agreement
            _check()
        calibration = calibration_or_default(calibration)
        kw = _resolve_source(source, max_seqlen, size, rank, causal, seq_lens, n_tokens,
                             device, placement, split_threshold)
        laid = kw.pop("laid")
        layout = kw.pop("layout")  # host cu_seqlens, read only for the chooser
        choice = _batch_choice(source, method, ulysses_size, laid)
        if choice is not None:  # the batch's one decision (AutoPlacement), not a second one
            method, ulysses_size = choice.method, choice.ulysses_size
        elif AUTO in (method, placement):
            check_windows(window, causal)  # named as the build names it, before it is priced
            global_cu, local_cu = layout()
            info = LayoutInfo(
                global_cu_seqlens=global_cu, local_cu_seqlens=local_cu,
                placement_fixed=laid, cp_size=size, q_heads=q_heads, kv_heads=kv_heads,
                head_dim=head_dim, dtype=dtype, device=torch.device(kw["device"]),
                causal=causal, method=method, placement=placement,
                split_threshold=(kw["placement"].split_threshold if laid == "per_document"
                                 else split_threshold), ulysses_size=ulysses_size,
                calibration=calibration, window=window)
            choice = choose_strategy(info)
            # the ranks priced it with their own constants: agree them (named on a mismatch)
            _extra_sig = {**(_extra_sig or {}), "calibration": calibration_signature(calibration)}
            if choice.placement != laid:
                raise ValueError(f"placement: the chooser picked {choice.placement!r} but the "
                                 f"rows in hand are laid out {laid!r} (placement is chosen "
                                 "before sharding, by the collator)")
            method, ulysses_size = choice.method, choice.ulysses_size
    except (TypeError, ValueError) as exc:
        error = exc
    if error is not None:
        if size > 1:  # the other ranks are in their build's agreement: join it, then raise
            check_across_ranks(group, None, error)
        raise error
    common = dict(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                  group=group, causal=causal, method=method, ulysses_size=ulysses_size,
                  softmax_scale=head_dim ** -0.5 if softmax_scale is None else softmax_scale,
                  backend=backend, window=window, sinks=sinks)
    if laid == "per_document":
        plan = PerDocumentPlan.build(kw.pop("placement"), **kw, **common, _extra_sig=_extra_sig)
    else:
        plan = CPAttentionPlan.build(kw.pop("cu_seqlens"), kw.pop("max_seqlen"), **kw, **common,
                                     _extra_sig=_extra_sig)
    plan._record(choice, calibration)  # what auto decided, and the constants calls run with
    plan.rope_args()  # the positions, once per batch
    return plan


def _batch_choice(source, method, ulysses_size, laid):
    """The :class:`~cp_rope.parallel.cost_model.Choice` a batch carries (``batch.choice``),
    when the plan takes it: ``method`` is ``"auto"`` or the choice's own (with its
    ``ulysses_size`` or None); None otherwise (no choice, or an explicit other method, which
    wins). ValueError when the choice is not of the rows' layout (a batch changed after)."""
    choice = getattr(source, "choice", None) if isinstance(source, PackedBatch) else None
    if choice is None or (method != AUTO and (method != choice.method or ulysses_size not in (
            None, choice.ulysses_size))):
        return None
    if choice.placement != laid:
        raise ValueError(f"source: the batch's choice is {choice.placement!r} placement but its "
                         f"rows are laid out {laid!r} (batch.choice is AutoPlacement's, of the "
                         "shard it returned)")
    return choice


def _resolve_source(source, max_seqlen, size, rank, causal, seq_lens, n_tokens, device,
                    placement, split_threshold) -> dict:
    """The layout of ``source`` as build arguments (rank-local checks; raise naming them)."""
    if placement is not None:
        check_choice("placement", placement, (*PLACEMENTS, AUTO))
    batch = source if isinstance(source, PackedBatch) else None
    if batch is not None:
        placed = batch.placement
        if placed is None and batch.cp_size != size:
            raise ValueError(f"plan: the batch is a zigzag shard for cp_size={batch.cp_size}, "
                             f"the group has {size} rank(s)")
        if size > 1 and batch.cp_rank != rank:  # a peer's shard would get this rank's positions
            raise ValueError(f"source: the batch is the shard of cp_rank={batch.cp_rank}, but "
                             f"this is rank {rank} of the group: shard with cp_rank = "
                             "dist.get_rank(group)")
        if max_seqlen is not None and max_seqlen != batch.max_seqlen:
            raise ValueError(f"max_seqlen={max_seqlen}: pass None with a batch (its own is "
                             f"{batch.max_seqlen})")
        device = batch.input_ids.device if device is None else device
        n_tokens = batch.num_tokens if n_tokens is None else n_tokens
        cu, max_seqlen = batch.cu_seqlens, batch.max_seqlen
        if not causal and seq_lens is None:
            seq_lens = batch.seq_lens if placed is None else batch.seq_lens[
                torch.from_numpy(placed.seq_ids(rank)).to(batch.seq_lens.device)]
    elif isinstance(source, DocumentPlacement):
        placed, cu = source, None
        device = "cpu" if device is None else device
    elif isinstance(source, torch.Tensor):
        placed, cu = None, source
        check_cu_seqlens(cu)
        device = cu.device if device is None else device
    else:
        raise TypeError(f"source must be a PackedBatch, a DocumentPlacement or a cu_seqlens "
                        f"tensor, got {type(source).__name__}")
    laid = "zigzag" if placed is None else "per_document"
    if placement not in (None, AUTO, laid):
        raise ValueError(f"placement={placement!r}, but the batch is laid out {laid!r}: shard "
                         "it with that placement (PackingCollator / shard_batch)")
    if placed is not None:
        check_group_size(placed, size)
        if split_threshold is not None and split_threshold != placed.split_threshold:
            raise ValueError(f"split_threshold={split_threshold}: the batch was placed with "
                             f"{placed.split_threshold}")
        return {"laid": laid, "placement": placed, "n_tokens": n_tokens, "device": device,
                "seq_lens": seq_lens,
                "layout": lambda: (torch.from_numpy(placed.cu_seqlens),
                                   placed.local_cu_seqlens(rank))}
    if split_threshold is not None:
        raise ValueError(f"split_threshold={split_threshold} is only used with per-document "
                         "placement; this batch is zigzag")
    return {"laid": laid, "cu_seqlens": cu, "max_seqlen": max_seqlen, "n_tokens": n_tokens,
            "device": device, "seq_lens": seq_lens,
            "layout": lambda: (cu.detach().to("cpu", torch.int64) * size, cu.detach().cpu())}


class _PlanWindow:
    """The default of :func:`context_parallel_attention`'s ``window``: the plan's own window
    (without a plan: no window). A sentinel, so that ``window=None`` given with a plan means
    the full-attention layer (``plan.for_window(None)``), not the plan's first window."""

    def __repr__(self) -> str:
        return "<the plan's window>"


PLAN_WINDOW = _PlanWindow()


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool | None = None,
    softmax_scale: float | None = None,
    method: Method | None = None,
    backend: Backend | None = None,
    seq_lens: torch.Tensor | None = None,
    plan: CPAttentionPlan | PerDocumentPlan | None = None,
    return_lse: bool = False,
    ulysses_size: int | None = None,
    placement: DocumentPlacement | None = None,
    window: int | None | _PlanWindow = PLAN_WINDOW,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of sequences split across the CP group: the one public attention entry.

    Dispatches on the plan's kind: a :class:`CPAttentionPlan` (zigzag layout) or a
    :class:`~cp_rope.parallel.PerDocumentPlan` (per-document placement); without a plan,
    ``placement=`` (a DocumentPlacement) selects the per-document path, else zigzag with
    ``cu_seqlens`` / ``max_seqlen``, and the call builds the plan itself by
    :func:`attention_plan` (collective; every argument it takes, ``method="auto"`` too).
    With ``plan``, every argument left None is the plan's; one given must equal it.

    Args:
        q: ``[T, Hq, D]`` float16/bfloat16/float32/float64, this rank's rows.
        k, v: ``[T, Hkv, D]``, same dtype and device, ``Hq % Hkv == 0`` (GQA).
        cu_seqlens: int32 ``[B + 1]`` *local* cumulative lengths (global / C),
            the same on every rank, on q's device; rows from ``cu_seqlens[-1]``
            on are trailing padding. With ``C > 1`` every local length is even.
            With ``plan``: None or the plan's own tensor.
        max_seqlen: host int >= the longest *local* sequence (with ``plan``:
            None or the plan's value).
        group: the CP process group; ``None`` or a group of one rank gives
            plain varlen attention (same block code).
        causal: causal by global position inside each sequence; ``False``:
            every query sees every (real) key of its sequence (None: the plan's, or True).
        softmax_scale: default the plan's, or ``1 / sqrt(D)``; part of the ranks'
            agreement (ranks passing different scales raise).
        method: None (the plan's, or ``"ring"``), ``"ring"``, ``"allgather"``, ``"ulysses"``,
            ``"hybrid"`` or, without ``plan``, ``"auto"`` (:func:`attention_plan` decides; see
            "Choosing the method" below and :mod:`cp_rope.parallel.ulysses`).
        backend: None (the plan's, or ``"auto"``), ``"auto"``, ``"cudnn"``, ``"flash_attn"``, ``"torch_flash"``,
            ``"torch_cudnn"`` or ``"reference"``. Support (else ValueError with
            the reason): reference: any device and dtype (fp32 math, fp64 for
            fp64 input); cudnn: CUDA sm80+, fp16/bf16, D <= 128, D % 8 == 0,
            the ``nvidia-cudnn-frontend`` >= 1.32 package (the extra ``cudnn``;
            the error gives the install command); torch_flash / flash_attn:
            CUDA, fp16/bf16, D <= 256, D % 8 == 0; torch_cudnn: CUDA sm80+,
            cuDNN >= 9, fp16/bf16, D <= 128, one sequence per batch (B == 1).
            ``auto``: the first of cudnn, flash_attn, torch_cudnn, torch_flash,
            reference that runs the inputs.
        seq_lens: only with ``causal=False``: int ``[B]`` true (unpadded)
            *global* lengths; keys at global position ``>= seq_lens[b]`` are
            masked. Required when ``C > 1`` (zigzag pads every sequence to a
            multiple of ``2C``); pass the padded lengths if nothing is padded.
            With ``causal=True`` padding sits after the real tokens and never
            reaches them, so seq_lens is refused. With ``plan``: None or the
            plan's own tensor.
        plan: the batch's plan (:func:`attention_plan`), built once per batch and
            passed to every layer: the call then does no device-to-host sync and no
            collective beyond the method's own data exchange. Its arguments (group,
            causal, method, scale, backend, shapes, dtype, device) must match the
            call's (ValueError naming ``plan``), and its tensors must not have been
            changed in place. Without it the call builds one.
        placement: without ``plan``: the batch's DocumentPlacement
            (``batch.placement``) for a per-document shard.
        return_lse: also return the merged log-sum-exp (natural log of the sum
            of ``exp(scale * q.k)`` over every key a query sees).
        ulysses_size: ``method="hybrid"``: the all-to-all group size U, a divisor
            of C (consecutive ranks; C / U groups in a ring); ``"ulysses"``: None
            or C; other methods: None. Needs ``Hq % U == 0`` and ``Hkv % U == 0``
            or ``U % Hkv == 0`` (ValueError with the arithmetic).
        window: sliding-window attention with a left window ``W`` (an int >= 1; needs
            causal): the query at global position ``p`` of a document sees the keys at
            ``p - W + 1 .. p``. transformers' ``config.sliding_window = S`` is ``W = S``
            (its mask: ``kv_idx > q_idx - S``); flash-attn's ``window_size=(left, 0)`` is
            ``W = left + 1``. With ``plan``: left out, the plan's own window (the first of
            its windows); given, one of the plan's ``windows`` (``plan.for_window(W)``;
            ``window=None``: the plan's full-attention variant, a ValueError naming
            ``window`` when the plan has none). Without ``plan``: None (the default) or an
            int, part of the ranks' agreement.
            Blocks no query sees are skipped and, with the ring, the K/V rows nobody sees
            are never sent (a ``W - 1`` row halo per chunk when W is below the chunk).
            Backends: reference, torch_flash, flash_attn (others raise ValueError).
        sinks: per-head sink logits ``[Hq]`` (q's dtype or float32, on q's device;
            GPT-OSS's ``sinks``): every row's softmax denominator gains ``exp(sinks[h])``,
            with no value, once per row after all partials are merged (the LSE returned
            includes it); differentiable. Each rank's gradient of ``sinks`` holds its rows'
            share (summed over the CP group by the usual gradient reduction of replicated
            parameters). Without ``plan``: agreed across ranks (shape, dtype); with one,
            needs ``plan.sinks``.

    Choosing the method: ``"ring"`` (the default) holds one extra K/V block
    (``1 / C`` of the global K/V) and overlaps every exchange with a step of
    compute; its steps are balanced (zigzag), so it scales as long as one step's
    compute (``~ T^2 Hq D`` per rank) outlasts sending ``2 T Hkv D`` elements to
    the neighbour -- true for long local sequences (measured on 2 H200s, 131072
    tokens, Hq 32 / Hkv 8: ring 467 ms vs all-gather 475 ms fwd+bwd, 6.9 vs
    8.4 GiB; 64 documents of 2048: 35 vs 54 ms). ``"allgather"`` gathers the
    whole K/V (``C x`` the local K/V, plus an fp32 global dK/dV in the backward)
    in one collective overlapped only with the local diagonal block, and its
    dK/dV reduce-scatter is exposed; pick it when the per-step compute is too
    short to hide a ring exchange (many ranks with short local shards) and the
    gathered K/V are small (GQA with few KV heads), or to have a single
    collective per direction (e.g. a slow or latency-bound interconnect where
    ``C - 1`` serial steps cost more than one all-gather).

    Returns: ``[T, Hq, D]`` in q's dtype, differentiable w.r.t. q, k and v
    (with ``return_lse``: ``(out, lse)``, lse ``[Hq, T]`` float32 -- float64 for
    float64 inputs -- not differentiable, -inf where a query sees no key).
    Rows at or beyond ``cu_seqlens[-1]`` are 0 (LSE -inf) and get gradients 0;
    a query that sees no key (non-causal all-padding sequence) gets 0.

    Raises:
        TypeError / ValueError: naming the bad argument (shapes, dtypes,
            cu_seqlens content, unsupported backend / dtype / head dim
            combinations, a ``plan`` that does not match the call).
        RuntimeError: without ``plan``, ranks of the group disagree on shapes, dtype,
            cu_seqlens (compared whole), seq_lens, max_seqlen, causal, method,
            softmax_scale or backend (the message shows every rank's values), or one
            rank's argument is bad (its own error there, a RuntimeError naming it on
            the others): checked when the plan is built, before any data moves. A peer
            that fails, disappears or runs another collective (``plan=`` on some ranks
            only) makes the exchange raise a RuntimeError naming these causes after
            the group's timeout.
    """
    if plan is None:  # the one place a plan is born: attention_plan, with the call's checks
        window = None if window is PLAN_WINDOW else window

        def check():  # inside the build's agreement: one rank's error reaches every rank
            if isinstance(window, (list, tuple)):  # a plan's windows; this call runs one
                raise TypeError(f"window must be an int or None here, got {window!r}: a list of "
                                "per-layer windows goes to attention_plan(window=[...]), then "
                                "pass plan= and window=W")
            if placement is not None:
                check_per_document_rows(q, k, v, placement, group, cu_seqlens, max_seqlen,
                                        sinks, return_lse)
                check_softmax_scale(softmax_scale)
                return
            check_tensors(q, k, v)
            check_bool("return_lse", return_lse)
            check_cu_seqlens(cu_seqlens, device=q.device)
            check_softmax_scale(softmax_scale)
            check_sinks(sinks, q)
            # its errors inside the agreement (the plan then resolves it for its schedule)
            get_backend(backend or "auto", q, cu_seqlens.numel() - 1,
                        windowed=window is not None)

        ok = check_tensors(q, k, v, raise_=False)
        plan = attention_plan(
            cu_seqlens if placement is None else placement,
            max_seqlen if placement is None else None, q_heads=q.shape[1] if ok else 1,
            kv_heads=k.shape[1] if ok else 1, head_dim=q.shape[2] if ok else 1,
            dtype=q.dtype if ok else torch.float32, device=q.device if ok else "cpu",
            n_tokens=q.shape[0] if ok else None, group=group, method=method or "ring",
            causal=True if causal is None else causal, seq_lens=seq_lens,
            ulysses_size=ulysses_size, softmax_scale=softmax_scale,
            # zigzag: the call's backend is agreed, resolved per call (registered test
            # backends too); per-document: fixed in the plan, as the placement path always did
            backend=backend if placement is not None else None,
            _extra_sig=_sinks_sig(sinks) if placement is not None else {
                "backend": backend or "auto", **_sinks_sig(sinks)},
            window=window, sinks=sinks is not None, _check=check)
    elif not isinstance(plan, (CPAttentionPlan, PerDocumentPlan)):
        raise TypeError(f"plan must be a CPAttentionPlan or PerDocumentPlan, got "
                        f"{type(plan).__name__}")
    else:
        check_tensors(q, k, v)
        check_bool("return_lse", return_lse)
        softmax_scale = check_softmax_scale(softmax_scale)
        if window is not PLAN_WINDOW:  # given, None included: that layer's variant
            plan = plan.for_window(window)
        check_sinks(sinks, q)
        if isinstance(plan, PerDocumentPlan):
            plan.check_call(q, k, cu_seqlens, max_seqlen, placement, group, causal, method,
                            seq_lens, ulysses_size, softmax_scale, backend, sinks)
        elif placement is not None:
            raise ValueError("plan: a zigzag CPAttentionPlan with placement= (pass one or the "
                             "other)")
        else:
            plan.check_call(q, k, cu_seqlens, max_seqlen, group, causal, method, seq_lens,
                            ulysses_size, softmax_scale, backend, sinks)
    scale = softmax_scale or plan.softmax_scale or q.shape[-1] ** -0.5
    backend = backend or plan.backend or "auto"
    if isinstance(plan, PerDocumentPlan):
        return run_per_document(q, k, v, plan, scale, backend, sinks, return_lse)
    be = get_backend(backend, q, plan.n_seqs, windowed=plan.windowed,
                     calibration=plan.calibration)
    out, lse = run_plan(q, k, v, plan, be, scale, sinks)
    return (out, lse) if return_lse else out


def per_document_attention(q, k, v, cu_seqlens=None, max_seqlen=None, *, placement=None,
                           plan=None, **kwargs):
    """Deprecated alias of :func:`context_parallel_attention` for per-document shards
    (``placement=batch.placement`` or ``plan=`` a PerDocumentPlan): the same arguments,
    result and errors; warns DeprecationWarning. Without either raises ValueError naming
    ``placement``."""
    warnings.warn("per_document_attention is deprecated: call context_parallel_attention(q, k, "
                  "v, placement=batch.placement) or (q, k, v, plan=plan): the one door",
                  DeprecationWarning, stacklevel=2)
    if plan is None and placement is None:
        raise ValueError("placement: pass the batch's placement (batch.placement) or a plan")
    if plan is not None and not isinstance(plan, PerDocumentPlan):
        raise TypeError(f"plan: a per-document shard needs a PerDocumentPlan, got "
                        f"{type(plan).__name__}")
    return context_parallel_attention(q, k, v, cu_seqlens, max_seqlen, placement=placement,
                                      plan=plan, **kwargs)


def _sinks_sig(sinks) -> dict:
    """What the ranks must agree on about a call's sinks: shape and dtype, and where the host
    can read them (CPU, or ``CP_ROPE_DEBUG=1``: :func:`~cp_rope.validation.content_checks_enabled`)
    a SHA-256 of their bytes: a model's sink logits are one parameter, the same on every rank
    of the group (the sum of the ranks' gradients keeps them so), and rows that each use
    their own rank's sinks would be the attention of no single model."""
    if not isinstance(sinks, torch.Tensor):
        return {}
    sig = {"sinks_shape": tuple(sinks.shape), "sinks_dtype": str(sinks.dtype)}
    if not sinks.is_meta and content_checks_enabled(sinks):  # [Hq] values: a few bytes
        data = sinks.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        sig["sinks_sha256 (their values)"] = hashlib.sha256(data).hexdigest()[:16]
    return sig
