"""Cross-entropy whose value and gradient match the single-process loss under CP x DP.

Normalisation (Megatron-core's "per-token loss" / torchtitan's global token
count): with ``S_r`` the sum of per-token CE over the non-ignored labels of
rank ``r`` and ``N = sum_r n_r`` the number of non-ignored labels of the whole
group,

    loss        = (sum_r S_r) / N                  (returned on every rank)
    d loss_r    = d S_r / N                        (what each rank back-propagates)

so that the gradient **SUM** over the same group (all-reduce SUM on CPU, or a
reduce-scatter AVG with the backward scaled by the group size, as FSDP2 does)
equals the gradient of the single-process mean over all N tokens. Dividing by
the *local* count instead would weight a rank holding one real token like a
rank holding thousands (the error Megatron-core fixed by moving to a global
token count). ``N`` comes from an all-reduce without gradient; ``N = 0`` (a
batch whose labels are all ignored) gives loss 0 and gradients exactly 0.

:func:`cp_linear_cross_entropy` is the same loss from hidden states and the
LM-head weight, computed over chunks of tokens so that the ``[T, V]`` logits
never exist; its design notes are in that
function's docstring.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_rope.validation import (
    check_cu_seqlens,
    check_cu_seqlens_content,
    check_int,
    content_checks_enabled,
)

from ._device import to_device
from ._loss_impl import liger_chunking, liger_function, liger_missing, loss_impl

__all__ = ["cp_cross_entropy", "cp_linear_cross_entropy", "liger_missing",  # these two:
           "loss_impl"]  # _loss_impl's


class _GroupMean(torch.autograd.Function):
    """Forward: ``global_sum / count``; backward: ``grad / count`` into the local sum only."""

    @staticmethod
    def forward(ctx, local_sum, global_sum, count):
        ctx.save_for_backward(count)
        return global_sum / count

    @staticmethod
    def backward(ctx, grad):
        (count,) = ctx.saved_tensors
        return grad / count, None, None


def _group_mean(local_sum: torch.Tensor, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``(sum_r S_r) / N`` with the gradient ``d S_r / N`` (module docstring): ``local_sum`` is
    this rank's differentiable ``S_r``; ``total`` and ``count`` are 0-dim, already summed over
    the group (float64); ``N = 0`` divides by 1 (loss and gradients 0)."""
    return _GroupMean.apply(local_sum, total.to(local_sum.dtype),
                            count.clamp(min=1.0).to(local_sum.dtype))


def _check_group(group) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got "
                        f"{type(group).__name__} {group!r}")


def _agree(name: str, group, error: BaseException | None, device, values: list,
           fields: dict[str, float]) -> torch.Tensor:
    """``values`` (0-dim tensors) summed over ``group`` in float64, in ONE all-reduce that also
    carries a flag for a rank whose arguments were refused (``error``) and, per entry of
    ``fields``, ``x`` and ``x**2`` (all ranks equal iff ``n * sum(x**2) == sum(x)**2``).

    The flag and the fields are read on the host where that costs no device sync (CPU, or
    ``CP_ROPE_DEBUG=1``; :func:`~cp_rope.validation.content_checks_enabled`): then a rank-local
    error is an error on every rank (its own exception there, a RuntimeError naming the rank
    elsewhere) instead of a wait in the next collective, and ranks that disagree on a field
    (e.g. the vocabulary, ``ignore_index``, ``softcap``) raise a RuntimeError naming it
    instead of mixing their losses. On a device without debug mode a refused rank contributes
    NaN, so the others' loss is NaN, not silently wrong.
    """
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    if n <= 1:  # no process group, one rank, or not a member (-1): this rank alone
        if error is not None:
            raise error
        return torch.stack([torch.as_tensor(v).detach().to(torch.float64).reshape(())
                            for v in values])
    rank = dist.get_rank(group)
    if error is None:
        head = [torch.as_tensor(v).detach().to(device=device, dtype=torch.float64).reshape(())
                for v in values]
    else:
        head = [torch.full((), math.nan, dtype=torch.float64, device=device)] * len(values)
    tail = [float(error is not None), float(rank + 1) if error is not None else 0.0]
    for x in fields.values():
        tail += [float(x), float(x) * float(x)]
    stats = torch.cat([torch.stack(head),
                       to_device(torch.tensor(tail, dtype=torch.float64), device)])
    dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    k = len(values)
    if error is not None:
        raise error
    if content_checks_enabled(stats):
        extra = stats[k:].tolist()
        if extra[0] > 0:
            who = (f"rank {int(extra[1]) - 1}" if extra[0] == 1
                   else f"{int(extra[0])} ranks")
            raise RuntimeError(f"{name}: {who} of the group refused its arguments (its own "
                               "error says why); no loss on any rank")
        bad = [f for i, f in enumerate(fields)
               if n * extra[3 + 2 * i] - extra[2 + 2 * i] ** 2
               > 1e-9 * max(1.0, extra[2 + 2 * i] ** 2)]
        if bad:
            mine = ", ".join(f"{f}={fields[f]!r}" for f in bad)
            raise RuntimeError(f"{name}: the ranks of the group disagree on {', '.join(bad)} "
                               f"(this rank: {mine}); every rank must pass the same")
    return stats[:k]


def cp_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                     group: dist.ProcessGroup | None = None, *,
                     ignore_index: int = -100, cu_seqlens: torch.Tensor | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy over every non-ignored label of ``group``.

    Args:
        logits: ``[T, V]`` float (any float dtype; the CE is computed in at
            least float32), this rank's rows (a CP shard of a packed batch).
        labels: ``[T]`` integer, the matching targets; ``ignore_index`` marks
            rows without a target (a document's last token, padding).
        group: the process group whose tokens form the mean: the flattened
            dp x cp group (default: the world when ``torch.distributed`` is
            initialised, else this process alone).
        ignore_index: label value to skip.
        cu_seqlens: optional, the batch's *local* int32 ``[B + 1]`` cu_seqlens
            (``PackedBatch.cu_seqlens``). The loss does not depend on it; when
            given it is validated like everywhere else (:mod:`cp_rope.validation`:
            dtype and shape always, content for CPU tensors or with
            ``CP_ROPE_DEBUG=1``) and must end at most at ``T``, which catches
            logits or labels of another batch.
        softcap: final logit soft-capping: the CE of ``softcap * tanh(logits / softcap)``
            (Gemma 2's ``final_logit_softcapping``, in the compute dtype), > 0, or None.

    Returns:
        0-dim tensor in the compute dtype: the same value on every rank of
        ``group``, equal to ``F.cross_entropy`` (mean) over the concatenated
        labels of all ranks. Its gradient is this rank's share (see the module
        docstring): gradients must be **summed** over ``group``.

    Raises:
        ValueError: shapes that do not match, labels on another device than
            logits, a label outside ``[0, V)`` that is not ``ignore_index``
            (checked for CPU tensors, and on devices with ``CP_ROPE_DEBUG=1``,
            as :func:`cp_rope.validation.content_checks_enabled`), or a bad
            ``cu_seqlens`` (not 1-D, not starting at 0, decreasing, ending
            beyond ``T``), naming the argument.
        TypeError: logits or labels not tensors, non-integer labels or
            ``ignore_index``, non-float logits, ``cu_seqlens`` not an int32 tensor.

    Cost: one all-reduce of two float64 scalars (the loss sum and the count).
    """
    _check_group(group)
    error = None
    try:
        ignore_index = check_inputs("logits", logits, labels, ignore_index, cu_seqlens)
        _check_softcap(softcap)
    except (TypeError, ValueError) as exc:  # every rank learns of it (_agree), none waits
        error = exc
    if error is not None:
        device = logits.device if isinstance(logits, torch.Tensor) else _device_of(group)
        _agree("cp_cross_entropy", group, error, device, [0.0, 0.0],
               {"V": 0, "ignore_index": 0, "softcap (0: none)": 0.0})
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    z = logits.to(compute_dtype)
    if softcap is not None:  # Gemma 2: logits = softcap * tanh(logits / softcap)
        z = softcap * torch.tanh(z / softcap)
    local_sum = F.cross_entropy(z, labels.long(), ignore_index=ignore_index, reduction="sum")
    count = (labels != ignore_index).sum()
    stats = _agree("cp_cross_entropy", group, None, logits.device, [local_sum, count],
                   {"V (logits.shape[1])": logits.shape[1], "ignore_index": ignore_index,
                    "softcap (0: none)": 0.0 if softcap is None else float(softcap)})
    return _group_mean(local_sum, stats[0], stats[1])


def _check_softcap(softcap) -> None:
    """ValueError naming ``softcap`` unless it is None or a finite number > 0."""
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"softcap={softcap!r}: must be a finite number > 0, or None")


def _device_of(group) -> torch.device:
    """Where a collective over ``group`` runs when no tensor argument says so."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_inputs(name: str, scores: torch.Tensor, labels: torch.Tensor, ignore_index,
                 cu_seqlens: torch.Tensor | None, n_classes: int | None = None) -> int:
    """The argument checks of the losses: ``scores`` (``logits`` [T, V] or ``hidden`` [T, d])
    and ``labels`` [T]; ``n_classes`` (default ``scores.shape[1]``) bounds the labels.
    Returns ``ignore_index`` as an int. Raises as :func:`cp_cross_entropy` documents."""
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(scores).__name__}")
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if scores.dim() != 2:
        raise ValueError(f"{name} must be 2-D [T, {'V' if name == 'logits' else 'd'}], got shape "
                         f"{tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {scores.dtype}")
    if scores.is_meta:
        raise ValueError(f"{name} is on the meta device (shapes without data): the loss cannot "
                         "be computed nor its labels checked; pass materialised tensors")
    if labels.dim() != 1 or labels.shape[0] != scores.shape[0]:
        raise ValueError(f"labels must be [T] with T = {name}.shape[0] = {scores.shape[0]}, "
                         f"got shape {tuple(labels.shape)}")
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if labels.device != scores.device:
        raise ValueError(f"labels must be on {name}' device {scores.device}, got {labels.device}")
    ignore_index = check_int("ignore_index", ignore_index)
    if content_checks_enabled(labels):  # reads labels on the host: CPU, or CP_ROPE_DEBUG=1
        n_classes = scores.shape[1] if n_classes is None else n_classes
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= n_classes))
        if bool(bad.any()):
            t = int(torch.nonzero(bad)[0])
            where = "logits.shape[1]" if name == "logits" else "weight.shape[0]"
            raise ValueError(f"labels must be in [0, {n_classes}) ({where}) or "
                             f"ignore_index={ignore_index}; labels[{t}] = {int(labels[t])}")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, device=labels.device)
        if content_checks_enabled(cu_seqlens):
            check_cu_seqlens_content(cu_seqlens, n_tokens=labels.shape[0])
    return ignore_index


# ----------------------------------------------------------------- fused linear + cross-entropy
AUTO_CHUNK_ELEMENTS = 1 << 27
"""``chunk_size=None`` picks ``AUTO_CHUNK_ELEMENTS // V`` tokens (rounded down to a multiple of
256, within [256, 65536]): one chunk's fp32 logits are then at most 512 MiB."""


def auto_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk of :func:`cp_linear_cross_entropy` with ``chunk_size=None``."""
    return min(65536, max(256, AUTO_CHUNK_ELEMENTS // max(int(vocab_size), 1) // 256 * 256))


_ADDMM_OUT_DTYPE = [True]  # CUDA addmm(..., out_dtype=float32) usable (torch >= 2.8); else False


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` in at least float32: one addmm when dtypes agree; for
    bf16/fp16 operands on CUDA, cuBLAS's bf16 x bf16 -> fp32 addmm (no ``[V, d]`` temporary;
    Liger-Kernel's path); elsewhere the product in the operands' dtype, added in float32."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
        return
    if acc.is_cuda and _ADDMM_OUT_DTYPE[0]:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except (TypeError, RuntimeError, NotImplementedError):  # older torch or device
            _ADDMM_OUT_DTYPE[0] = False
    acc += (a @ b).to(acc.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward: the group mean of the CE of ``hidden @ weight.T`` and, chunk by chunk, its
    gradients (already divided by the group's token count N); backward scales them by the
    incoming gradient. Liger-Kernel's fused linear cross-entropy schedule, in plain torch."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_size, softcap, group,
                need_hidden, need_weight, count):
        # count: N, already summed over the group (first: each chunk's gradient is then final)
        t, dtype = hidden.shape[0], torch.promote_types(hidden.dtype, torch.float32)
        distributed = dist.is_initialized() and dist.get_world_size(group) > 1
        inv_n = 1.0 / count.clamp(min=1.0).to(dtype)
        local = torch.zeros(1, dtype=torch.float64, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_hidden else None
        grad_w = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                             device=weight.device) if need_weight else None
        for s in range(0, t, chunk_size):
            h, y = hidden[s:s + chunk_size], labels[s:s + chunk_size]
            z = (h @ weight.t()).to(dtype)  # [c, V]: the only chunk x V buffers are here
            th = None
            if softcap is not None:  # Gemma 2: logits = softcap * tanh(logits / softcap)
                th = torch.tanh(z.div_(softcap))
                z = torch.mul(th, softcap, out=z)
            # log-softmax and softmax in place (no second [c, V] buffer): z - max, exp, / sum
            valid = y != ignore_index
            tgt = torch.where(valid, y, 0).long()[:, None]
            z.sub_(z.amax(dim=1, keepdim=True))
            z_tgt = z.gather(1, tgt).squeeze(1)
            total = z.exp_().sum(dim=1)
            per_token = torch.where(valid, total.log() - z_tgt, 0.0)
            local += per_token.sum().to(torch.float64)
            if grad_h is None and grad_w is None:
                continue
            # (softmax - onehot) * valid / N in one pass over the chunk, the onehot in fp32 too
            scale = valid.to(dtype) * inv_n
            g = z.mul_((scale / total)[:, None])
            g.scatter_add_(1, tgt, -scale[:, None])
            if th is not None:  # d softcap*tanh(z/softcap) / dz = 1 - tanh^2
                g.mul_(th.mul_(th).neg_().add_(1.0))
                del th
            g = g.to(hidden.dtype)
            if grad_h is not None:
                torch.mm(g, weight, out=grad_h[s:s + chunk_size])
            if grad_w is not None:
                _accumulate(grad_w, g.t(), h)
        if distributed:
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype, ctx.done = weight.dtype, False
        return (local * inv_n.to(torch.float64)).to(dtype).reshape(())

    @staticmethod
    def backward(ctx, grad):
        if ctx.done:
            raise RuntimeError("cp_linear_cross_entropy: a second backward through the same "
                               "loss (retain_graph=True) is not supported: its gradients are "
                               "scaled in place; compute the loss again")
        ctx.done = True
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h.mul_(grad)  # opmath (fp32) product, one rounding to hidden's dtype
        if grad_w is not None:
            grad_w = grad_w.mul_(grad).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None, None


def cp_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                            group: dist.ProcessGroup | None = None, *, ignore_index: int = -100,
                            chunk_size: int | None = None, softcap: float | None = None,
                            cu_seqlens: torch.Tensor | None = None,
                            impl: str = "auto") -> torch.Tensor:
    """``cp_cross_entropy(hidden @ weight.T, labels, group)`` without the ``[T, V]`` logits.

    The tokens are processed in chunks of ``chunk_size``: per chunk the logits
    ``[chunk, V]`` (in at least float32), their log-sum-exp, the loss and, when
    gradients are needed, ``dlogits = (softmax - onehot) / N`` right away (the
    schedule of Liger-Kernel's fused linear cross-entropy), folded into
    ``dhidden`` (rows of the chunk) and ``dweight`` (accumulated in at least
    float32 over the chunks); backward only scales them by the incoming gradient.
    So the extra memory is O(chunk x V) plus ``dhidden`` ``[T, d]`` and a float32
    ``[V, d]`` accumulator, never ``T x V``, and no logits matmul is recomputed.
    ``N``, the group's count of real labels, is all-reduced before the chunks, so
    the gradients are exactly those of the unfused loss (float64: to rounding).
    That loop (``impl="torch"``) is pure torch: any device, float64 on CPU (the exact
    reference), logits in float32. On CUDA in bf16/fp16, ``impl="auto"`` runs
    Liger-Kernel's fused linear cross-entropy instead (when installed: ``pip install
    'cp-rope[liger]'``), whose Triton kernel computes the loss and the gradient of a chunk
    of bf16 logits in one pass (the torch loop makes ~10 passes over float32 ones): measured
    on an H200 at 262,144 tokens of a 151,936-word vocabulary, 0.73 s vs 1.26 s for the
    whole forward (docs/benchmarks.md). Liger is called with ``reduction="sum"`` (each
    rank's ``S_r``) and the CP normalisation above is applied around it, so its gradients
    are those of the group mean; its chunks are its own (about ``T * d / V`` tokens of
    bf16 logits, the memory of one ``[T, d]`` activation) where those are at least
    ``LIGER_CHUNK_TOKENS`` (4,096) tokens, else as large as Liger's rule allows up to that
    (:func:`~cp_rope.parallel._loss_impl.liger_chunking`: fewer passes over the float32
    ``dweight`` it accumulates, for up to ``4,096 x V`` bf16 logits at a time: 1.2 GB at
    V = 151,936). It reads its token count on the host once per call.

    Args:
        hidden: ``[T, d]`` float, this rank's final hidden states (after the last norm).
        weight: ``[V, d]``, the LM head's weight (the embedding for tied
            embeddings), same dtype and device as ``hidden``.
        labels: ``[T]`` integer targets, ``ignore_index`` where there is none.
        group: the dp x cp group whose real tokens form the mean (see
            :func:`cp_cross_entropy`).
        ignore_index: label value to skip.
        chunk_size: tokens per chunk (>= 1); ``None`` = :func:`auto_chunk_size` of V.
        softcap: final logit soft-capping (``cap * tanh(logits / cap)``, Gemma 2's
            ``final_logit_softcapping``), > 0, or None.
        cu_seqlens: optional local cu_seqlens, validated as in :func:`cp_cross_entropy`.
        impl: one of :data:`~cp_rope.parallel.choices.LOSS_IMPLS` (:func:`loss_impl`); a
            ``chunk_size`` is the torch loop's (with ``"auto"`` it selects ``"torch"``).

    Returns:
        0-dim tensor in ``promote(hidden.dtype, float32)``, the same on every rank:
        the mean CE over every real label of ``group``. Its gradient is this rank's
        share (sum gradients over ``group``). Backward may run once per call.

    Raises:
        ValueError: shapes that do not match (naming ``hidden``, ``weight`` or
            ``labels``), labels outside ``[0, V)`` (CPU, or ``CP_ROPE_DEBUG=1``),
            ``chunk_size`` < 1 (the ``--loss-chunk-size`` flag of the trainers),
            ``softcap`` <= 0.
        TypeError: non-tensors, non-float ``hidden``, ``weight`` of another dtype,
            non-integer labels, ``chunk_size`` not an int.
        ValueError: ``impl`` as :func:`loss_impl` says.

    Cost: the three matmuls of the unfused loss; two all-reduces of one float64 scalar.
    """
    _check_group(group)
    error = None
    try:  # a rank-local refusal reaches every rank through _agree (no wait in a collective)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [V, d], got shape {tuple(weight.shape)}")
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 2 and (
                weight.shape[1] != hidden.shape[1]):  # before the labels, which it would bound
            flipped = " (transposed? the LM head's weight is [V, d])" if (
                weight.shape[0] == hidden.shape[1]) else ""
            raise ValueError(f"weight must be [V, d] with d = hidden.shape[1] = {hidden.shape[1]}, "
                             f"got shape {tuple(weight.shape)}{flipped}")
        ignore_index = check_inputs("hidden", hidden, labels, ignore_index, cu_seqlens,
                                    n_classes=weight.shape[0])
        if weight.dtype != hidden.dtype or weight.device != hidden.device:
            raise TypeError(f"weight must have hidden's dtype and device ({hidden.dtype}, "
                            f"{hidden.device}), got ({weight.dtype}, {weight.device})")
        given_chunk = chunk_size
        if chunk_size is None:
            chunk_size = auto_chunk_size(weight.shape[0])
        elif isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
            raise TypeError(f"chunk_size must be an int (tokens per chunk; --loss-chunk-size) or "
                            f"None, got {type(chunk_size).__name__}")
        elif int(chunk_size) < 1:
            raise ValueError(f"chunk_size={chunk_size}: must be >= 1 token per chunk "
                             "(--loss-chunk-size; 0 there = automatic)")
        _check_softcap(softcap)
        impl = loss_impl(impl, hidden, given_chunk, weight)
    except (TypeError, ValueError) as exc:
        error = exc
    fields = {"V (weight.shape[0])": 0, "ignore_index": 0, "softcap (0: none)": 0.0}
    if error is not None:
        device = hidden.device if isinstance(hidden, torch.Tensor) else _device_of(group)
        _agree("cp_linear_cross_entropy", group, error, device, [0.0], fields)
    fields = {"V (weight.shape[0])": weight.shape[0], "ignore_index": ignore_index,
              "softcap (0: none)": 0.0 if softcap is None else float(softcap)}
    count = _agree("cp_linear_cross_entropy", group, None, hidden.device,
                   [(labels != ignore_index).sum()], fields)
    if impl == "liger":
        # S_r from Liger's kernel, then the group mean around it (module docstring): the same
        # collectives as the torch loop (N first, the sum after), so ranks agree on both
        fn = liger_function()
        local_sum = fn(hidden, weight, labels, ignore_index=ignore_index, reduction="sum",
                       softcap=softcap, accum_dtype=torch.float32,
                       **liger_chunking(fn, hidden.shape[0], weight.shape[0], weight.shape[1]))
        total = local_sum.detach().to(torch.float64).reshape(1)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return _group_mean(local_sum, total[0], count[0])
    grad = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(
        hidden, weight, labels, ignore_index, int(chunk_size),
        None if softcap is None else float(softcap), group,
        grad and hidden.requires_grad, grad and weight.requires_grad, count)
