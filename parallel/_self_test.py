"""A start-up parity check of the configured CP stack on the real group:
:func:`self_test` runs RoPE + CP attention + the CP loss, forward and backward, on a small
random packed batch with edge documents, and compares every result with the same
computation done unsharded (plain PyTorch attention per document) on every rank.

Misconfigured context parallelism trains silently wrong (a rank order that is not the
data's ``cp_rank``, shards cut for another ``cp_size``, a placement that differs between
the data and the attention, a block kernel that returns wrong blocks); cp-rope is exact,
so a few seconds at start-up prove the setting on the user's own group. The trainers run
it before the first step (``--cp-self-test on``, the default).

RNG: all random numbers come from the test's own ``torch.Generator``; the global RNG
states (CPU and CUDA) are not touched, so a run's losses are bit-for-bit the same with
the self-test on or off (``tests/test_self_test.py``).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_rope import apply_rotary_emb_qk, rope_cache

from .batch import PackedBatch
from .loss import cp_cross_entropy
from .placement import default_split_threshold
from .sharding import shard_batch

__all__ = ["SelfTestError", "SelfTestResult", "self_test"]

# largest |got - ref| / max |ref| accepted, per compute dtype (the CP run against float32 /
# float64 attention of the same dtype-rounded inputs; wrong blocks give O(1) errors)
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 2e-2,
             torch.bfloat16: 4e-2}
_VOCAB = 64


class SelfTestError(RuntimeError):
    """The CP self-test found a difference (raised on every rank of the group)."""


@dataclasses.dataclass(frozen=True)
class SelfTestResult:
    """``seconds`` the test took; ``errors``: largest relative difference per result
    (``loss``, ``output``, ``dq``, ``dk``, ``dv``, ``dW``); ``tolerance``; ``n_tokens``,
    ``lengths``: the test batch's global (padded) document lengths."""

    seconds: float
    errors: dict
    tolerance: float
    lengths: tuple


def _lengths(cp_size: int, threshold: int | None) -> tuple[list[int], list[int]]:
    """Edge documents: one token, empty, odd lengths, one longer than the split threshold
    (zigzag: a long one), padded up to multiples of 2 cp_size like the collator does."""
    long = (threshold if threshold is not None else 8 * cp_size) + 1
    raw = [1, 0, 7, long, 13, 2 * cp_size + 1, 3]
    return [-(-n // (2 * cp_size)) * (2 * cp_size) for n in raw], raw


def _global_batch(cp_size: int, threshold: int | None, gen: torch.Generator) -> PackedBatch:
    padded, raw = _lengths(cp_size, threshold)
    cu = torch.tensor([0, *np.cumsum(padded).tolist()], dtype=torch.int32)
    T = int(cu[-1])
    labels = torch.randint(0, _VOCAB, (T,), generator=gen)
    pos = torch.zeros(T, dtype=torch.int64)
    for b, (n, real) in enumerate(zip(padded, raw, strict=False)):
        a = int(cu[b])
        pos[a:a + n] = torch.arange(n)
        labels[a + max(real - 1, 0):a + n] = -100  # each document's last token and padding
    return PackedBatch(input_ids=torch.arange(T), labels=labels, position_ids=pos, cu_seqlens=cu,
                       max_seqlen=max(padded), seq_lens=torch.tensor(raw, dtype=torch.int32))


def _reference_attention(q, k, v, cu, window=None, sinks=None) -> torch.Tensor:
    """Causal attention per document, plain PyTorch (q's dtype; GQA by repeating k/v); a
    query at position p sees keys p - window + 1 .. p (``window`` None: all earlier ones);
    ``sinks`` ``[Hq]``: each row's softmax denominator gains ``exp(sinks[h])``."""
    rep = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    scale = q.shape[-1] ** -0.5
    for a, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=False):
        if e == a:
            continue
        qs, ks = q[a:e].transpose(0, 1), k[a:e].repeat_interleave(rep, 1).transpose(0, 1)
        vs = v[a:e].repeat_interleave(rep, 1).transpose(0, 1)
        s = (qs @ ks.transpose(1, 2)) * scale
        i = torch.arange(e - a, device=q.device)
        mask = i[:, None] >= i[None, :]
        if window is not None:
            mask &= i[:, None] - i[None, :] < window
        s = s.masked_fill(~mask, float("-inf"))
        if sinks is not None:  # one more column per row: the sink logit, no value
            col = sinks.to(s.dtype)[:, None, None].expand(-1, e - a, 1)
            p = torch.cat([s, col], -1).softmax(-1)[..., :-1]
        else:
            p = s.softmax(-1)
        out[a:e] = (p @ vs).transpose(0, 1)
    return out


def _rope(q, k, cos, sin, cu_seqlens, **kw):
    """RoPE (float64 through float32, the kernels' widest dtype: the same rounding in the
    sharded and the unsharded run, which rotate the same rows at the same positions)."""
    if q.dtype != torch.float64:
        return apply_rotary_emb_qk(q, k, cos, sin, cu_seqlens, **kw)
    qr, kr = _rope(q.float(), k.float(), cos, sin, cu_seqlens, **kw)
    return qr.double(), kr.double()


def _describe(setting: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in setting.items())


def self_test(group: dist.ProcessGroup | None = None, *, method: str = "ring",
              backend: str = "auto", placement: str = "zigzag", ulysses_size: int | None = None,
              split_threshold: int | None = None, q_heads: int = 4, kv_heads: int = 2,
              head_dim: int = 32, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", cp_rank: int | None = None,
              cp_size: int | None = None, data_placement: str | None = None,
              seed: int = 0, window: int | None | list = None,
              sinks: bool = False, calibration=None) -> SelfTestResult:
    """Check RoPE + CP attention + CP loss on ``group`` against the unsharded computation.

    Args:
        group: the CP process group (None or one rank: cp_size 1). Collective over it.
        method, backend, placement, ulysses_size, split_threshold: the configured CP
            attention (as :func:`~cp_rope.parallel.context_parallel_attention`, also with a
            per-document placement; ``split_threshold`` None with
            per_document: :func:`~cp_rope.parallel.default_split_threshold`).
        q_heads, kv_heads, head_dim, dtype, device: the model's attention shapes and compute
            dtype, and this rank's device.
        cp_rank, cp_size: the data's CP position (what the data loader shards with); default
            the group's rank and size.
        data_placement: how the data is placed (default ``placement``).
        seed: of the test's own generator (rank 0's numbers are broadcast).
        window: the model's attention windows (as :func:`~cp_rope.parallel.attention_plan`'s
            ``window``: an int W, None, or the list of the layers' windows, None for full
            layers): one attention layer per window, their outputs summed.
        sinks: the layers carry per-head sink logits (random ``[q_heads]``, their gradient
            compared as ``dsinks``).
        calibration: the run's cost-model constants (as ``attention_plan``'s: backend
            ``"auto"``'s FA4 / cuDNN crossover; None: the shipped defaults).

    The path is the trainers': the plan of this rank's host shard
    (:func:`~cp_rope.parallel.attention_plan`), RoPE from ``plan.rope_args()``, each layer
    ``context_parallel_attention(q, k, v, plan=plan, window=W, sinks=...)``.

    The batch: documents of 1, 0, 7, ``t + 1`` (zigzag: ``t = 8 cp_size``; per-document:
    ``t = min(split_threshold, 32 cp_size)``, the test's own threshold, so that the batch
    stays small while one document is split and the others stay whole), 13,
    ``2 cp_size + 1`` and 3 tokens, each padded to a multiple of ``2 cp_size``; random q, k,
    v, an output projection to 64 classes and labels. Compared: the loss, the attention
    output, dq, dk, dv (after RoPE's backward) and the projection's gradient, each as
    ``max |CP - unsharded| / max |unsharded|`` against :data:`TOLERANCE` of ``dtype``
    (the unsharded run: per-document causal attention, windowed and with sinks as asked).

    Returns: a :class:`SelfTestResult` (time, errors).

    Raises: SelfTestError on every rank naming the setting and the largest difference
    (which result, its document, row and head), or the exception the CP run raised.
    """
    t0 = time.perf_counter()
    local = None  # this rank's refusal of its own arguments: agreed below, an error everywhere
    try:
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r}: CUDA is not available (torch "
                             f"{torch.__version__})")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2
                or head_dim % 2):
            raise ValueError(f"head_dim={head_dim!r}: must be an even int >= 2 (RoPE rotates "
                             "pairs of dimensions)")
        if dtype not in TOLERANCE:
            raise TypeError(f"dtype must be one of {sorted(str(d) for d in TOLERANCE)}, got "
                            f"{dtype!r}")
        windows = tuple(dict.fromkeys(window if isinstance(window, (list, tuple))
                                      else [window]))
        for w in windows:
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
                raise ValueError(f"window={window!r}: each window must be an int >= 1 or None")
        if not isinstance(sinks, bool):
            raise TypeError(f"sinks must be a bool, got {type(sinks).__name__}")
    except (TypeError, ValueError, RuntimeError) as exc:
        local, device = f"{type(exc).__name__}: {exc}", torch.device("cpu")
        windows, sinks = (None,), False
    C = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    r = dist.get_rank(group) if C > 1 else 0
    if C == 1:
        group = None
    data_rank = r if cp_rank is None else cp_rank
    data_size = C if cp_size is None else cp_size
    data_place = placement if data_placement is None else data_placement
    setting = dict(method=method, backend=backend, placement=placement, ulysses_size=ulysses_size,
                   split_threshold=split_threshold, cp_size=C, dtype=str(dtype).removeprefix("torch."),
                   **({"window": list(windows)} if windows != (None,) else {}),
                   **({"sinks": True} if sinks else {}))
    if C == 1 and local is not None:
        raise SelfTestError(f"cp self-test ({_describe(setting)}): {local}")
    if C > 1:  # the data's CP position must be the group's, on every rank
        views: list = [None] * C
        shapes = dict(seed=seed, method=method, backend=backend, placement=placement,
                      ulysses_size=ulysses_size, split_threshold=split_threshold,
                      q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=str(dtype),
                      window=windows, sinks=sinks)
        dist.all_gather_object(views, (data_rank, data_size, data_place, shapes, local),
                               group=group)
        refused = [f"rank {i}: {v[4]}" for i, v in enumerate(views) if v[4] is not None]
        if refused:
            raise SelfTestError(f"cp self-test ({_describe(setting)}): " + "; ".join(refused))
        differ = [f"{k} differs across the ranks: {[v[3][k] for v in views]}" for k in shapes
                  if len({repr(v[3][k]) for v in views}) > 1]
        if differ:  # each rank would build other data or run another exchange: a gloo abort
            raise SelfTestError(f"cp self-test ({_describe(setting)}): " + "; ".join(differ)
                                + " (every rank must build the same test batch and attention)")
        bad = [f"group rank {i} holds data cp_rank {v[0]} of cp_size {v[1]} ({v[2]})"
               for i, v in enumerate(views) if v[:3] != (i, C, placement)]
        if bad:
            raise SelfTestError(f"cp self-test ({_describe(setting)}): the data is not sharded "
                                f"for this group: " + "; ".join(bad))
    thr = split_threshold
    if thr is None and "per_document" in (placement, data_place):
        thr = default_split_threshold(head_dim, max(data_size, 1))
    if thr is not None:  # the same code paths on a batch of seconds: at most 16 x 2C tokens
        thr = min(thr, 32 * max(data_size, 1))
    gen = torch.Generator().manual_seed(seed)
    glob = _global_batch(max(data_size, 1), thr, gen)
    T = glob.input_ids.numel()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    qkvw = [torch.randn(T, h, head_dim, generator=gen) for h in (q_heads, kv_heads, kv_heads)]
    qkvw.append(torch.randn(q_heads * head_dim, _VOCAB, generator=gen) / (q_heads * head_dim) ** 0.5)
    if sinks:  # per-head sink logits, in the kernels' float32 (float64 for float64)
        qkvw.append(torch.randn(q_heads, generator=gen))
    qkvw = [t.to(device, dtype if i < 3 else acc) for i, t in enumerate(qkvw)]
    if C > 1:  # rank 0's numbers everywhere
        for t in qkvw:
            dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
    cos, sin = rope_cache(glob.max_seqlen + 1, head_dim, device=device)

    error, got = None, None
    try:
        got = _cp_run(glob, qkvw[:4], cos, sin, group, C, r, data_size, data_rank, data_place,
                      thr, method, backend, placement, ulysses_size, device, windows,
                      qkvw[4] if sinks else None, calibration)
    except Exception as exc:  # a CP run that fails is a failed self-test, on every rank
        error = f"{type(exc).__name__}: {exc}"
    if C > 1:
        errs: list = [None] * C
        dist.all_gather_object(errs, error, group=group)
        error = next((f"rank {i}: {e}" for i, e in enumerate(errs) if e is not None), None)
    if error is not None:
        raise SelfTestError(f"cp self-test ({_describe(setting)}) failed: {error}")
    ref = _unsharded(glob, qkvw[:4], cos, sin, acc, windows, qkvw[4] if sinks else None)
    tol = TOLERANCE[dtype]
    errors, worst = {}, None
    cu = glob.cu_seqlens.long()
    for name in ("output", "dq", "dk", "dv", "loss", "dW", *(("dsinks",) if sinks else ())):
        g, e = got[name].to("cpu", torch.float64), ref[name].to("cpu", torch.float64)
        diff = (g - e).abs()
        scale = max(float(e.abs().max()), 1e-30) if e.numel() else 1.0
        rel = float(diff.max()) / scale if diff.numel() else 0.0
        rel = float("inf") if not np.isfinite(rel) or bool(g.isnan().any()) else rel
        errors[name] = rel
        if rel > tol and (worst is None or rel > worst[0]):
            where = ""
            if name in ("output", "dq", "dk", "dv"):
                flat = int(torch.nan_to_num(diff, nan=float("inf")).flatten().argmax())
                row, head = flat // (diff.shape[1] * diff.shape[2]), flat // diff.shape[2] % diff.shape[1]
                doc = int(torch.searchsorted(cu, torch.tensor(row), right=True)) - 1
                where = (f" at row {row} (document {doc} of length {int(glob.seq_lens[doc])}, "
                         f"position {row - int(cu[doc])}), head {head}")
            worst = (rel, f"{name} differs from the unsharded computation by {rel:.3g} of its "
                          f"largest value (tolerance {tol:g} for {setting['dtype']}){where}")
    if worst is not None:
        raise SelfTestError(f"cp self-test ({_describe(setting)}) failed: {worst[1]}; all errors: "
                            + ", ".join(f"{k} {v:.2g}" for k, v in errors.items()))
    return SelfTestResult(time.perf_counter() - t0, errors, tol,
                          tuple(int(x) for x in glob.seq_lens))


def _cp_run(glob, qkvw, cos, sin, group, C, r, data_size, data_rank, data_place, thr, method,
            backend, placement, ulysses_size, device, windows, sinks, calibration) -> dict:
    """This rank's sharded run by the trainers' path (the plan of the host shard, RoPE from
    ``plan.rope_args()``, one attention call per layer with ``plan=``: one layer per window
    of ``windows``, their outputs summed), gathered back into global rows: a dict."""
    from .attention import attention_plan, context_parallel_attention

    local = shard_batch(glob, max(data_size, 1), data_rank, placement=data_place,
                        split_threshold=thr if data_place == "per_document" else None, pad_id=-1)
    q_heads, kv_heads, head_dim = qkvw[0].shape[1], qkvw[1].shape[1], qkvw[0].shape[2]
    plan = attention_plan(local, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                          dtype=qkvw[0].dtype, device=device, group=group, method=method,
                          backend=backend, placement=placement, ulysses_size=ulysses_size,
                          window=list(windows), sinks=sinks is not None,
                          calibration=calibration)
    rows = local.input_ids  # global row of every local row (-1: padding)
    real = rows >= 0
    take = rows.clamp(min=0).to(device)
    q, k, v = (torch.where(real.to(device)[:, None, None], t[take], 0).detach().requires_grad_()
               for t in qkvw[:3])
    W = qkvw[3].detach().clone().requires_grad_()
    sk = None if sinks is None else sinks.detach().clone().requires_grad_()
    qr, kr = _rope(q, k, cos, sin, **plan.rope_args())
    # plan.for_window(w), as cp_rope.hf's layers call it (window=w is the same since window=None
    # given with a plan means the full layer; left out, the plan's first window)
    out = sum(context_parallel_attention(qr, kr, v, plan=plan.for_window(w), sinks=sk)
              for w in windows)
    logits = out.reshape(out.shape[0], -1).to(W.dtype) @ W
    loss = cp_cross_entropy(logits, local.labels.to(device), group)
    loss.backward()
    dW, extra = W.grad, {}
    if sk is not None:  # each rank's share of the sinks' gradient
        extra["dsinks"] = sk.grad
    for t in (dW, *extra.values()):
        if group is not None:
            dist.all_reduce(t, group=group)
    res = {"output": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    T = glob.input_ids.numel()
    full = {}
    for name, t in res.items():  # gather by the data's own row ids (independent of rank order)
        parts = [t.new_empty(t.shape) for _ in range(C)] if C > 1 else [t]
        ids = [rows.new_empty(rows.shape) for _ in range(C)] if C > 1 else [rows]
        if C > 1:
            dist.all_gather(parts, t.contiguous(), group=group)
            dist.all_gather(ids, rows.to(device), group=group)
        g = t.new_zeros((T, *t.shape[1:]))
        for p, i in zip(parts, ids, strict=False):
            i = i.to(device)
            g[i[i >= 0]] = p[i >= 0]
        full[name] = g
    full["loss"] = loss.detach().reshape(1)
    full["dW"] = dW
    return {**full, **extra}


def _unsharded(glob, qkvw, cos, sin, acc, windows, sinks) -> dict:
    """The same computation on the whole batch, one process, plain attention in ``acc``."""
    q, k, v = (t.detach().to(acc).requires_grad_() for t in qkvw[:3])
    W = qkvw[3].detach().clone().requires_grad_()
    sk = None if sinks is None else sinks.detach().to(acc).requires_grad_()
    cu = glob.cu_seqlens.to(q.device)
    qr, kr = _rope(q, k, cos, sin, cu, max_seqlen=glob.max_seqlen)
    out = sum(_reference_attention(qr, kr, v, glob.cu_seqlens, w, sk) for w in windows)
    logits = out.reshape(out.shape[0], -1) @ W
    loss = F.cross_entropy(logits.float() if acc != torch.float64 else logits,
                           glob.labels.to(q.device), ignore_index=-100)
    loss.backward()
    return {"output": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "loss": loss.detach().reshape(1), "dW": W.grad,
            **({} if sk is None else {"dsinks": sk.grad})}
