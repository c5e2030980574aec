"""The RoPE operators: ``torch.library`` registration, autograd and the functional API.

Two custom ops wrap one implementation (Triton kernel or the PyTorch path):

* ``cp_rope::rotary(q, k, cos, sin, cu_seqlens, ...) -> (q_out, k_out)``:
  functional, differentiable (backward = the same op with ``conjugate``
  flipped, i.e. the rotation by ``-theta``; it saves no activations, only
  references to cos/sin/cu_seqlens and the scalars).
* ``cp_rope::rotary_(q, k, ...) -> ()``: in place, declares
  ``mutates_args=("q", "k")`` so ``torch.compile`` functionalizes it.

Both have fake kernels, so ``torch.compile(fullgraph=True)`` traces them with
dynamic T and B. ``max_seqlen`` never reaches an op: it is only a host-side
bound check, so a changing value does not specialize a compiled graph on it.
"""

import numbers
import os

import torch

from cp_rope.positions import check_cp_args, check_cu_seqlens_content, content_checks_enabled
from cp_rope.reference import rotary_torch

__all__ = ["apply_rotary_emb", "apply_rotary_emb_qk", "resolve_backend"]

_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"triton"`` or ``"torch"`` for ``backend`` in ``auto | triton | torch``.

    ``auto``: ``$CP_ROPE_BACKEND`` when set, else Triton on CUDA tensors and
    PyTorch on CPU. Raises ValueError naming ``backend`` / ``CP_ROPE_BACKEND``.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        env = os.environ.get("CP_ROPE_BACKEND", "auto")
        if env not in _BACKENDS:
            raise ValueError(f"CP_ROPE_BACKEND must be one of {_BACKENDS}, got {env!r}")
        backend = env
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    return backend


def _rotary_impl(q, k, out_q, out_k, cos, sin, cu_seqlens, cp_size, cp_rank, interleaved,
                 conjugate, backend):
    if content_checks_enabled(cu_seqlens):
        check_cu_seqlens_content(cu_seqlens, n_tokens=q.shape[0], cp_size=cp_size,
                                 n_positions=cos.shape[0])
    if backend == "triton":
        from cp_rope.kernel import rotary_triton  # Triton is only needed for this backend

        rotary_triton(q, k, out_q, out_k, cos, sin, cu_seqlens, cp_size, cp_rank, interleaved,
                      conjugate)
    else:
        for x, out in ((q, out_q), (k, out_k)):
            if x.shape[1]:
                rotary_torch(x, cos, sin, cu_seqlens, cp_size, cp_rank, interleaved, conjugate,
                             out=out)


@torch.library.custom_op("cp_rope::rotary", mutates_args=())
def _rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, interleaved: bool,
            conjugate: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    out_q, out_k = torch.empty_like(q), torch.empty_like(k)
    _rotary_impl(q, k, out_q, out_k, cos, sin, cu_seqlens, cp_size, cp_rank, interleaved,
                 conjugate, backend)
    return out_q, out_k


@_rotary.register_fake
def _(q, k, cos, sin, cu_seqlens, cp_size, cp_rank, interleaved, conjugate, backend):
    return torch.empty_like(q), torch.empty_like(k)


def _setup_context(ctx, inputs, output):
    _, _, cos, sin, cu_seqlens, cp_size, cp_rank, interleaved, conjugate, backend = inputs
    ctx.save_for_backward(cos, sin, cu_seqlens)  # inputs (buffers), not activations
    ctx.args = (cp_size, cp_rank, interleaved, conjugate, backend)


def _backward(ctx, grad_q, grad_k):
    cos, sin, cu_seqlens = ctx.saved_tensors
    cp_size, cp_rank, interleaved, conjugate, backend = ctx.args
    dq, dk = _rotary(grad_q, grad_k, cos, sin, cu_seqlens, cp_size, cp_rank, interleaved,
                     not conjugate, backend)
    return dq, dk, None, None, None, None, None, None, None, None


_rotary.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("cp_rope::rotary_", mutates_args=("q", "k"))
def _rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, interleaved: bool,
             conjugate: bool, backend: str) -> None:
    _rotary_impl(q, k, q, k, cos, sin, cu_seqlens, cp_size, cp_rank, interleaved, conjugate,
                 backend)


@_rotary_.register_fake
def _(q, k, cos, sin, cu_seqlens, cp_size, cp_rank, interleaved, conjugate, backend):
    return None


def _check_x(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must be [T, H, D] (3-D THD), got shape {tuple(x.shape)}")
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")


def _check_args(q, k, cos, sin, cu_seqlens, max_seqlen, cp_size, cp_rank, interleaved) -> None:
    """Host-side checks from shapes, dtypes and Python values only (no device sync)."""
    _check_x("q" if k is not None else "x", q)
    if k is not None:
        _check_x("k", k)
        if k.dtype != q.dtype:
            raise TypeError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
        if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
            raise ValueError(f"k must be [T, Hk, D] with q's T and D; q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}")
        if k.device != q.device:
            raise ValueError(f"k is on {k.device}, q on {q.device}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{name} must be float32 (rope_cache's tables; float64 also "
                            f"accepted), got {t.dtype}: half-precision angle tables lose "
                            f"whole radians at long positions")
        if t.dim() != 2:
            raise ValueError(f"{name} must be [max_positions, rotary_dim // 2], got shape "
                             f"{tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, the input on {q.device}")
    if cos.dtype != sin.dtype:
        raise TypeError(f"cos and sin dtypes disagree: cos {cos.dtype}, sin {sin.dtype}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin shapes disagree: cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim == 0:
        raise ValueError("cos/sin have no columns: rotary_dim = 2 * cos.shape[1] must be >= 2")
    if rotary_dim > q.shape[2]:
        raise ValueError(f"rotary_dim = 2 * cos.shape[1] = {rotary_dim} exceeds head_dim "
                         f"D = {q.shape[2]}")
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be 1-D [B + 1] with B >= 0, got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, the input on {q.device}")
    check_cp_args(cp_size, cp_rank)
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
    if max_seqlen is not None:
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral):
            raise TypeError(f"max_seqlen must be an int or None, got {type(max_seqlen).__name__}")
        if max_seqlen < 0:
            raise ValueError(f"max_seqlen must be >= 0, got {max_seqlen}")
        if cp_size * max_seqlen > cos.shape[0]:
            raise ValueError(
                f"max_seqlen = {max_seqlen} (global length up to cp_size * max_seqlen = "
                f"{cp_size * max_seqlen}) needs positions beyond the cos/sin cache "
                f"({cos.shape[0]} rows)")


def _apply(q, k, cos, sin, cu_seqlens, max_seqlen, cp_size, cp_rank, interleaved, inplace,
           backend):
    _check_args(q, k, cos, sin, cu_seqlens, max_seqlen, cp_size, cp_rank, interleaved)
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {type(inplace).__name__}")
    impl = resolve_backend(backend, q.device)
    cp_size, cp_rank = int(cp_size), int(cp_rank)  # numpy integers -> the ops' int
    k_ = k if k is not None else q.new_empty((q.shape[0], 0, q.shape[2]))
    if inplace:
        if k is q:
            raise ValueError("inplace=True with k the same tensor as q would rotate it twice; "
                             "pass distinct q and k (views of one fused projection are fine)")
        if torch.is_grad_enabled() and (q.requires_grad or k_.requires_grad):
            raise ValueError("inplace=True is not differentiable: call with inplace=False when "
                             "q/k require grad (or under torch.no_grad())")
        _rotary_(q, k_, cos, sin, cu_seqlens, cp_size, cp_rank, interleaved, False, impl)
        return q, k
    out_q, out_k = _rotary(q, k_, cos, sin, cu_seqlens, cp_size, cp_rank, interleaved, False, impl)
    return out_q, (out_k if k is not None else None)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     cu_seqlens: torch.Tensor, *, max_seqlen: int | None = None,
                     cp_size: int = 1, cp_rank: int = 0, interleaved: bool = False,
                     inplace: bool = False, backend: str = "auto") -> torch.Tensor:
    """Apply RoPE to a packed THD tensor, with the load-balanced CP positions.

    Row ``t`` of sequence ``b`` (``cu_seqlens[b] <= t < cu_seqlens[b+1]``) is
    rotated by angle ``p * theta_i``, ``p`` the CP position of its local row
    (DESIGN.md; TransformerEngine / Megatron-core zigzag layout, but given the
    rank's *local* cu_seqlens). Per pair: ``y1 = x1 cos - x2 sin``,
    ``y2 = x2 cos + x1 sin`` in float32, stored in ``x``'s dtype.
    Non-interleaved (GPT-NeoX / Llama) pairs ``x[i]`` with
    ``x[i + rotary_dim/2]``; interleaved (GPT-J) ``x[2i]`` with ``x[2i+1]``.
    Dims from ``rotary_dim`` on, and rows from ``cu_seqlens[-1]`` on
    (trailing padding), are copied unchanged.

    Args:
        x: ``[T, H, D]`` float32/float16/bfloat16, any strides.
        cos, sin: ``[max_positions, rotary_dim // 2]`` (from :func:`rope_cache`,
            float32), indexed by global position. They are buffers: they get
            no gradient.
        cu_seqlens: int32 ``[B + 1]``, the rank's *local* cumulative lengths
            (starts at 0, non-decreasing, ``cu_seqlens[-1] <= T``; even local
            lengths when ``cp_size > 1``). Zero-length sequences are fine.
        max_seqlen: optional Python int >= the longest local sequence; only
            used to check that ``cp_size * max_seqlen <= max_positions``.
        cp_size, cp_rank: CP degree and this rank.
        interleaved: GPT-J pairing.
        inplace: write into ``x`` and return it (not differentiable).
        backend: ``"auto"`` (``$CP_ROPE_BACKEND``, else Triton on CUDA and
            PyTorch on CPU), ``"triton"`` or ``"torch"``.

    Returns:
        ``[T, H, D]``, x's dtype; ``x`` itself when ``inplace``. Differentiable
        w.r.t. ``x`` (backward: the rotation by ``-theta``; no saved activations).

    Raises:
        TypeError / ValueError naming the argument: wrong rank or dtype, cos/sin
        shapes that disagree, ``rotary_dim`` above D, ``cp_rank`` out of
        range, ``max_seqlen`` beyond the cache, and (CPU cu_seqlens, or
        ``CP_ROPE_DEBUG=1``) bad cu_seqlens contents. No check syncs the
        device unless ``CP_ROPE_DEBUG=1``.
    """
    out, _ = _apply(x, None, cos, sin, cu_seqlens, max_seqlen, cp_size, cp_rank, interleaved,
                    inplace, backend)
    return out


def apply_rotary_emb_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        cu_seqlens: torch.Tensor, *, max_seqlen: int | None = None,
                        cp_size: int = 1, cp_rank: int = 0, interleaved: bool = False,
                        inplace: bool = False, backend: str = "auto",
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rotary_emb` on q ``[T, Hq, D]`` and k ``[T, Hk, D]`` in one kernel launch.

    ``Hq`` and ``Hk`` may differ (GQA); q and k may be strided views (for
    example slices of one fused ``[T, Hq + 2 Hkv, D]`` projection). Same dtype,
    T and D. Returns ``(q_rot, k_rot)`` (``(q, k)`` when ``inplace``). Same
    arguments, errors and gradients (for q and k only) as :func:`apply_rotary_emb`.
    """
    if k is None:
        raise TypeError("k must be a torch.Tensor, got NoneType (use apply_rotary_emb for one tensor)")
    return _apply(q, k, cos, sin, cu_seqlens, max_seqlen, cp_size, cp_rank, interleaved, inplace,
                  backend)
