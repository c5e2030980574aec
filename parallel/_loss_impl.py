"""Which implementation :func:`cp_rope.parallel.cp_linear_cross_entropy` runs: its own chunked
torch loop, or Liger-Kernel's fused linear cross-entropy (``impl``, one of
:data:`~cp_rope.parallel.choices.LOSS_IMPLS`), and the one import of liger-kernel."""

from __future__ import annotations

import functools
import inspect

import torch

from .choices import LOSS_IMPLS

__all__ = ["loss_impl", "liger_function", "liger_missing", "liger_chunking", "liger_chunk_tokens",
           "LIGER_CHUNK_TOKENS"]

LIGER_CHUNK_TOKENS = 4096
"""Most tokens per chunk cp_rope asks of Liger's kernel where its own rule makes more chunks.
Liger's default bounds a chunk's logits to ``n_tokens x hidden`` elements, so a head of
``V / hidden`` = 148 (Qwen3: 151,936 x 1,024) takes ~128 chunks at any length (256 tokens
each at 32,768), and each chunk adds its dweight product into the float32 ``[V, hidden]``
accumulator: a 0.6 GB read and write per chunk, ~160 GB per step. The price is transient
memory: a chunk's bf16 logits, 78 MB at 256 tokens, take 1.2 GB at 4,096 (V = 151,936)."""

_LIGER: list = []  # [(the function or None, why it is unavailable)] once imported


def liger_function():
    """Liger-Kernel's ``liger_fused_linear_cross_entropy``, or None when it cannot be imported
    (missing, or an import that fails otherwise: then :func:`loss_impl` says why)."""
    if not _LIGER:
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
            _LIGER.append((liger_fused_linear_cross_entropy, ""))
        except ImportError:
            _LIGER.append((None, "liger-kernel is not installed: pip install 'cp-rope[liger]'"))
        except Exception as exc:  # noqa: BLE001 - a broken install must not fail one rank alone
            _LIGER.append((None, f"importing liger-kernel failed ({type(exc).__name__}: {exc})"))
    return _LIGER[0][0]


def liger_chunking(fn, n_tokens: int, vocab: int, hidden: int) -> dict:
    """Keyword arguments for Liger's ``fn`` (:func:`liger_function`) that make its chunks as
    large as possible up to :data:`LIGER_CHUNK_TOKENS` tokens where its default makes them
    smaller: its ``chunk_mem_const`` ``c``. Liger takes ``min(next_pow2(ceil(n / inc)), n)``
    tokens per chunk with ``inc = ceil(V / (c x hidden))``
    (``liger_kernel/ops/fused_linear_cross_entropy.py``, 0.8.5), at most ``L`` (the
    largest power of 2 <= ``LIGER_CHUNK_TOKENS``) exactly when ``n <= L`` or ``inc >= k =
    ceil(n / L)``: the largest such ``c`` is ``ceil(V / hidden)`` for ``k = 1`` (one chunk),
    else ``ceil(V / (hidden x (k - 1))) - 1``. No argument (Liger's default, ``c = 1``) where
    that is below 2 or ``fn`` has no such parameter (liger-kernel before it)."""
    c = _chunk_mem_const(n_tokens, vocab, hidden)
    return {"chunk_mem_const": c} if c >= 2 and _takes_chunk_mem_const(fn) else {}


def _chunk_mem_const(n_tokens: int, vocab: int, hidden: int) -> int:
    """:func:`liger_chunking`'s ``c`` (1, Liger's default, where no larger one helps)."""
    if n_tokens < 1 or hidden < 1 or vocab < 1 or LIGER_CHUNK_TOKENS < 1:
        return 1
    k = -(-n_tokens // (1 << (LIGER_CHUNK_TOKENS.bit_length() - 1)))  # a power of 2, <= L
    c = -(-vocab // hidden) if k == 1 else -(-vocab // (hidden * (k - 1))) - 1
    return max(1, int(c))


def liger_chunk_tokens(n_tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk of Liger's kernel for ``n_tokens`` rows of width ``hidden`` and a
    ``vocab``-row head, called with :func:`liger_chunking`'s arguments (a liger-kernel that
    takes ``chunk_mem_const``: 0.8.5 does): Liger's rule of :func:`liger_chunking`'s docstring
    with its ``c``. Each chunk holds ``[chunk, vocab]`` logits in the compute dtype (Liger writes
    their gradient in place); :mod:`cp_rope.launch.plan_memory` prices them.

    Raises: ValueError naming the argument that is not an int >= 1.
    """
    for name, v in (("n_tokens", n_tokens), ("vocab", vocab), ("hidden", hidden)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    per = -(-n_tokens // -(-vocab // (_chunk_mem_const(n_tokens, vocab, hidden) * hidden)))
    return min(1 << (per - 1).bit_length(), n_tokens)


@functools.lru_cache(maxsize=8)
def _takes_chunk_mem_const(fn) -> bool:
    """Whether Liger's ``fn`` has the parameter (read once per function, not once per step)."""
    try:
        return "chunk_mem_const" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: Liger's default
        return False


def liger_missing() -> str | None:
    """Why Liger's kernel cannot be used here (not installed, or its import failed), or None."""
    return None if liger_function() is not None else _LIGER[0][1]


def loss_impl(impl: str, hidden: torch.Tensor, chunk_size: int | None = None,
              weight: torch.Tensor | None = None) -> str:
    """The implementation :func:`cp_linear_cross_entropy` runs for ``impl`` (one of
    :data:`~cp_rope.parallel.choices.LOSS_IMPLS`), ``hidden``, ``chunk_size`` and ``weight``:
    ``"torch"`` or ``"liger"``. A ``chunk_size`` sets the torch loop's chunks: with
    ``"auto"`` it selects ``"torch"``; Liger picks its own chunks, so with ``"liger"`` it is
    refused. Cases Liger's kernel does not cover run the torch loop, whatever ``impl`` says
    (the same loss): no rows (``hidden`` ``[0, d]``), and a ``weight`` that needs a gradient
    while ``hidden`` does not (Liger computes ``dweight`` only with ``dhidden``).

    Raises: ValueError naming ``impl`` when it is not one of the choices, or is ``"liger"`` for
    a tensor Liger cannot take (not CUDA, float64), without a working liger-kernel, or with a
    ``chunk_size``; TypeError naming ``hidden`` when it is not a tensor.
    """
    if not isinstance(impl, str) or impl not in LOSS_IMPLS:
        shown = repr(impl) if isinstance(impl, str) else f"a {type(impl).__name__}"
        raise ValueError(f"impl={shown}: expected one of {list(LOSS_IMPLS)} (--loss-impl)")
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
    cuda = hidden.is_cuda
    if impl == "liger":
        if not cuda or hidden.dtype == torch.float64:
            raise ValueError(f"impl='liger' (--loss-impl): Liger-Kernel's Triton kernels run on "
                             f"CUDA in float32/bf16/fp16; hidden is {hidden.dtype} on "
                             f"{hidden.device}: use impl='torch' (or 'auto')")
        if liger_missing():
            raise ValueError(f"impl='liger' (--loss-impl): {liger_missing()} (or use "
                             "impl='torch' / 'auto')")
        if chunk_size is not None:
            raise ValueError(f"impl='liger' (--loss-impl) with chunk_size={chunk_size} "
                             "(--loss-chunk-size): Liger picks its own chunks; the chunk size "
                             "is the torch loop's (impl='torch' or 'auto')")
    elif impl == "auto":
        low = hidden.dtype in (torch.bfloat16, torch.float16)
        if not (cuda and low and chunk_size is None and liger_function() is not None):
            return "torch"
    else:
        return "torch"
    uncovered = hidden.numel() == 0 or (
        weight is not None and torch.is_grad_enabled() and weight.requires_grad
        and not hidden.requires_grad)
    return "torch" if uncovered else "liger"
