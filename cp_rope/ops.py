"""The RoPE operators: ``torch.library`` registration, autograd and the functional API.

One implementation (:func:`_rotary_impl`: the Triton kernel or the PyTorch
backend) is reached two ways:

* Eager, on plain tensors (the hot path of a training step): a
  ``torch.autograd.Function`` whose forward and backward each call the
  launcher once (no dispatcher round trip, no custom-op wrapper); under
  ``torch.no_grad()`` or without inputs that require grad, the launcher is
  called directly. Backward is the same rotation with ``conjugate`` flipped
  (the rotation by ``-theta``); it saves no activations, only cos/sin and the
  integer position inputs.
* Traced (``torch.compile``, ``torch.export``, tensor subclasses such as
  FakeTensor / FunctionalTensor): the ``torch.library`` custom ops
  ``cp_rope::rotary`` (functional, with the same autograd) and
  ``cp_rope::rotary_`` (in place, ``mutates_args=("q", "k")``), which have fake
  kernels, so ``torch.compile(fullgraph=True)`` traces them with dynamic T and B.

Argument checks read shapes, dtypes, devices and Python values only (no
device sync); content checks of ``cu_seqlens``, ``position_ids`` and
``start_positions`` run for CPU tensors, and for device tensors only with
``CP_ROPE_DEBUG=1`` (:func:`cp_rope.validation.content_checks_enabled`).
``max_seqlen`` and ``max_position_id`` never reach an op: they are host-side
bounds, so a changing value does not specialize a compiled graph on them.
"""

import os

import torch

from cp_rope.torch_backend import rotary_torch_qk
from cp_rope.validation import (
    check_bool,
    check_choice,
    check_cp_args,
    check_cu_seqlens,
    check_cu_seqlens_content,
    check_int,
    check_max_seqlen,
    content_checks_enabled,
)

__all__ = ["apply_rotary_emb", "apply_rotary_emb_qk", "resolve_backend"]

_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TABLE_DTYPES = (torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)
_BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"triton"`` or ``"torch"`` for ``backend`` in ``auto | triton | torch``.

    ``auto``: ``$CP_ROPE_BACKEND`` when set, else Triton on CUDA tensors and
    PyTorch on CPU. Raises ValueError naming ``backend`` / ``CP_ROPE_BACKEND``.
    """
    if backend == "auto":
        env = os.environ.get("CP_ROPE_BACKEND")
        if env is not None and env != "auto":
            return check_choice("CP_ROPE_BACKEND", env, _BACKENDS)
        return "triton" if device.type == "cuda" else "torch"
    return check_choice("backend", backend, _BACKENDS)


# --------------------------------------------------------------------------- implementation
def _rotary_impl(q, k, out_q, out_k, cos, sin, cu_seqlens, position_ids, start_positions,
                 start_offset, cp_size, cp_rank, interleaved, conjugate, backend):
    """Rotate q into out_q and k into out_k (k and out_k may be None)."""
    if backend == "triton":
        from cp_rope.kernel import rotary_triton  # Triton is only needed for this backend

        rotary_triton(q, k, out_q, out_k, cos, sin, cu_seqlens, cp_size, cp_rank, interleaved,
                      conjugate, position_ids=position_ids, start_positions=start_positions,
                      start_offset=start_offset)
    else:
        rotary_torch_qk(q, k, out_q, out_k, cos, sin, cu_seqlens, cp_size, cp_rank, interleaved,
                        conjugate, position_ids=position_ids, start_positions=start_positions,
                        start_offset=start_offset)


def _traced_content_checks(q, cos, cu_seqlens, position_ids, start_positions, start_offset,
                           cp_size):
    """Content checks inside the custom ops (the traced path), on the real tensors; the eager
    path runs them in :func:`_check_args`, where ``max_position_id`` is known."""
    if content_checks_enabled(cu_seqlens):
        _check_contents(q.shape[0], cu_seqlens, cp_size, cos.shape[0], position_ids,
                        start_positions, start_offset, None)


def _rotary_out(q, k, *args):
    out_q = torch.empty_like(q)
    out_k = torch.empty_like(k) if k is not None else None
    _rotary_impl(q, k, out_q, out_k, *args)
    return out_q, out_k


class _Rotary(torch.autograd.Function):
    """The eager path: forward and backward are one launcher call each. ``params`` is
    ``(start_offset, cp_size, cp_rank, interleaved, conjugate, backend)``, packed into one
    argument (``apply`` costs time per argument); ``k`` may be None."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, cu_seqlens, position_ids, start_positions, params):
        ctx.save_for_backward(cos, sin, cu_seqlens, position_ids, start_positions)  # inputs only
        ctx.params = params
        return _rotary_out(q, k, cos, sin, cu_seqlens, position_ids, start_positions, *params)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        start_offset, cp_size, cp_rank, interleaved, conjugate, backend = ctx.params
        # through apply again, so that double backward (create_graph=True) works
        dq, dk = _Rotary.apply(grad_q, grad_k, *ctx.saved_tensors,
                               (start_offset, cp_size, cp_rank, interleaved, not conjugate, backend))
        return dq, dk, None, None, None, None, None, None


@torch.library.custom_op("cp_rope::rotary", mutates_args=())
def _rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            cu_seqlens: torch.Tensor, position_ids: torch.Tensor | None,
            start_positions: torch.Tensor | None, start_offset: int, cp_size: int,
            cp_rank: int, interleaved: bool, conjugate: bool,
            backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    _traced_content_checks(q, cos, cu_seqlens, position_ids, start_positions, start_offset, cp_size)
    return _rotary_out(q, k, cos, sin, cu_seqlens, position_ids, start_positions, start_offset,
                       cp_size, cp_rank, interleaved, conjugate, backend)


@_rotary.register_fake
def _(q, k, *args):
    return torch.empty_like(q), torch.empty_like(k)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[2:7])  # cos, sin, cu_seqlens, position_ids, start_positions
    ctx.args = inputs[7:]


def _backward(ctx, grad_q, grad_k):
    dq, dk = _rotary(grad_q, grad_k, *ctx.saved_tensors, *ctx.args[:-2], not ctx.args[-2],
                     ctx.args[-1])
    return dq, dk, *(None,) * 11


_rotary.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("cp_rope::rotary_", mutates_args=("q", "k"))
def _rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             cu_seqlens: torch.Tensor, position_ids: torch.Tensor | None,
             start_positions: torch.Tensor | None, start_offset: int, cp_size: int,
             cp_rank: int, interleaved: bool, conjugate: bool, backend: str) -> None:
    _traced_content_checks(q, cos, cu_seqlens, position_ids, start_positions, start_offset, cp_size)
    _rotary_impl(q, k, q, k, cos, sin, cu_seqlens, position_ids, start_positions, start_offset,
                 cp_size, cp_rank, interleaved, conjugate, backend)


@_rotary_.register_fake
def _(*args):
    return None


# --------------------------------------------------------------------------- checks
def _check_x(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must be [T, H, D] (3-D THD), got shape {tuple(x.shape)}")
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")


def _check_table(name: str, t, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _TABLE_DTYPES:
        raise TypeError(f"{name} must be float32 (rope_cache's tables; float64 also "
                        f"accepted), got {t.dtype}: half-precision angle tables lose "
                        f"whole radians at long positions")
    if t.dim() != 2:
        raise ValueError(f"{name} must be [max_positions, rotary_dim // 2], got shape "
                         f"{tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the input on {device}")


def _check_index(name: str, t, length: int, what: str, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name} must be 1-D [{what}] = [{length}], got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the input on {device}")


def _check_args(q, k, cos, sin, cu_seqlens, max_seqlen, cp_size, cp_rank, interleaved,
                position_ids, start_positions, max_position_id):
    """Host-side checks from shapes, dtypes and Python values only (no device sync).

    Returns ``(cp_size, cp_rank, start_offset, start_positions)`` normalized (an int
    ``start_positions`` becomes ``start_offset``)."""
    _check_x("q" if k is not None else "x", q)
    device = q.device
    if k is not None:
        _check_x("k", k)
        if k.dtype != q.dtype:
            raise TypeError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
        if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
            raise ValueError(f"k must be [T, Hk, D] with q's T and D; q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}")
        if k.device != device:
            raise ValueError(f"k is on {k.device}, q on {device}")
    _check_table("cos", cos, device)
    _check_table("sin", sin, device)
    if cos.dtype != sin.dtype:
        raise TypeError(f"cos and sin dtypes disagree: cos {cos.dtype}, sin {sin.dtype}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin shapes disagree: cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    n_positions, half = cos.shape
    if half == 0:
        raise ValueError("cos/sin have no columns: rotary_dim = 2 * cos.shape[1] must be >= 2")
    if 2 * half > q.shape[2]:
        raise ValueError(f"rotary_dim = 2 * cos.shape[1] = {2 * half} exceeds head_dim "
                         f"D = {q.shape[2]}")
    check_cu_seqlens(cu_seqlens, device=device)
    cp_size, cp_rank = check_cp_args(cp_size, cp_rank)
    check_bool("interleaved", interleaved)
    max_seqlen = check_max_seqlen(max_seqlen)
    if max_seqlen is not None and cp_size * max_seqlen > n_positions:
        raise ValueError(
            f"max_seqlen = {max_seqlen} (global length up to cp_size * max_seqlen = "
            f"{cp_size * max_seqlen}) needs positions beyond the cos/sin cache "
            f"({n_positions} rows)")
    if max_position_id is not None:
        max_position_id = check_int("max_position_id", max_position_id, min_value=0)
        if max_position_id >= n_positions:
            raise ValueError(f"max_position_id = {max_position_id} is beyond the cos/sin cache "
                             f"({n_positions} rows, positions 0..{n_positions - 1})")
    start_offset = 0
    if position_ids is not None:
        if start_positions is not None:
            raise ValueError("pass position_ids or start_positions, not both (position_ids are "
                             "the final positions; add any offset to them)")
        if cp_size > 1:
            raise ValueError(f"position_ids with cp_size={cp_size}: explicit positions replace "
                             f"the CP formula, so pass them with cp_size=1 (the local rows' "
                             f"global positions already say where each row is)")
        _check_index("position_ids", position_ids, q.shape[0], "T", device)
    elif start_positions is not None:
        if isinstance(start_positions, torch.Tensor):
            _check_index("start_positions", start_positions, cu_seqlens.shape[0] - 1, "B", device)
        else:
            start_offset = check_int("start_positions", start_positions, min_value=0)
            start_positions = None
            top = start_offset + cp_size * (max_seqlen or 0)
            if top > n_positions:
                raise ValueError(f"start_positions = {start_offset} (+ cp_size * max_seqlen = "
                                 f"{top}) needs positions beyond the cos/sin cache "
                                 f"({n_positions} rows)")
            if max_position_id is not None and start_offset > max_position_id:
                raise ValueError(f"start_positions = {start_offset} exceeds max_position_id = "
                                 f"{max_position_id}")
    if (type(cu_seqlens) is torch.Tensor and content_checks_enabled(cu_seqlens)
            and not torch.compiler.is_compiling()):  # traced: the ops check the real tensors
        _check_contents(q.shape[0], cu_seqlens, cp_size, n_positions, position_ids,
                        start_positions, start_offset, max_position_id, max_seqlen)
    return cp_size, cp_rank, start_offset, start_positions


def _check_contents(n_tokens, cu_seqlens, cp_size, n_positions, position_ids, start_positions,
                    start_offset, max_position_id, max_seqlen=None):
    """Value checks that read tensors on the host (CPU inputs, or CP_ROPE_DEBUG=1)."""
    explicit = position_ids is not None or start_positions is not None or start_offset
    # With explicit or offset positions the cache bound is checked below, per row.
    check_cu_seqlens_content(cu_seqlens, n_tokens=n_tokens, cp_size=cp_size,
                             max_seqlen=max_seqlen,  # a host bound the cache check relied on
                             n_positions=None if explicit else n_positions)
    if not explicit and max_position_id is None:
        return
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    limit = n_positions - 1 if max_position_id is None else max_position_id
    bound = "the cos/sin cache's last row" if max_position_id is None else "max_position_id"
    if position_ids is not None:
        pos = position_ids.detach()[:int(cu[-1])].to("cpu", torch.int64)
        name = "position_ids"
    else:
        lens = cu[1:] - cu[:-1]
        starts = (start_positions.detach().to("cpu", torch.int64) if start_positions is not None
                  else torch.zeros_like(lens))
        if bool((starts < 0).any()):
            b = int(torch.nonzero(starts < 0)[0])
            raise ValueError(f"start_positions[{b}] = {int(starts[b])} is negative")
        # the last position of sequence b is start + cp_size * len_b - 1
        pos = (starts + start_offset + cp_size * lens - 1)[lens > 0]
        name = ("start_positions" if start_positions is not None or start_offset
                else "positions (from cu_seqlens)")
    if pos.numel() == 0:
        return
    if bool((pos < 0).any()):
        i = int(torch.nonzero(pos < 0)[0])
        raise ValueError(f"{name}: negative position {int(pos[i])} (row {i})")
    top = int(pos.max())
    if top > limit:
        raise ValueError(f"{name}: position {top} exceeds {bound} ({limit}); the cos/sin cache "
                         f"has {n_positions} rows")


# --------------------------------------------------------------------------- API
def _apply(q, k, cos, sin, cu_seqlens, max_seqlen, cp_size, cp_rank, interleaved, inplace,
           backend, position_ids, start_positions, max_position_id, conjugate):
    cp_size, cp_rank, start_offset, start_positions = _check_args(
        q, k, cos, sin, cu_seqlens, max_seqlen, cp_size, cp_rank, interleaved, position_ids,
        start_positions, max_position_id)
    if inplace is not False:
        check_bool("inplace", inplace)
    if conjugate is not False:
        check_bool("conjugate", conjugate)
    impl = resolve_backend(backend, q.device)
    params = (start_offset, cp_size, cp_rank, bool(interleaved), bool(conjugate), impl)
    grad = torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))
    eager = (type(q) is torch.Tensor and (k is None or type(k) is torch.Tensor)
             and not torch.compiler.is_compiling())
    if inplace:
        if k is q:
            raise ValueError("inplace=True with k the same tensor as q would rotate it twice; "
                             "pass distinct q and k (views of one fused projection are fine)")
        if grad:
            raise ValueError("inplace=True is not differentiable: call with inplace=False when "
                             "q/k require grad (or under torch.no_grad())")
        if eager:
            _rotary_impl(q, k, q, k, cos, sin, cu_seqlens, position_ids, start_positions, *params)
        else:
            k_ = k if k is not None else q.new_empty((q.shape[0], 0, q.shape[2]))
            _rotary_(q, k_, cos, sin, cu_seqlens, position_ids, start_positions, *params)
        return q, k
    if eager:
        if grad:
            return _Rotary.apply(q, k, cos, sin, cu_seqlens, position_ids, start_positions, params)
        return _rotary_out(q, k, cos, sin, cu_seqlens, position_ids, start_positions, *params)
    k_ = k if k is not None else q.new_empty((q.shape[0], 0, q.shape[2]))
    out_q, out_k = _rotary(q, k_, cos, sin, cu_seqlens, position_ids, start_positions, *params)
    return out_q, (out_k if k is not None else None)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     cu_seqlens: torch.Tensor, *, max_seqlen: int | None = None,
                     cp_size: int = 1, cp_rank: int = 0, interleaved: bool = False,
                     inplace: bool = False, backend: str = "auto",
                     position_ids: torch.Tensor | None = None,
                     start_positions: torch.Tensor | int | None = None,
                     max_position_id: int | None = None,
                     conjugate: bool = False) -> torch.Tensor:
    """Apply RoPE to a packed THD tensor, with the load-balanced CP positions.

    Row ``t`` of sequence ``b`` (``cu_seqlens[b] <= t < cu_seqlens[b+1]``) is
    rotated by angle ``p * theta_i``, ``p`` the CP position of its local row
    (DESIGN.md; TransformerEngine / Megatron-core zigzag layout, but given the
    rank's *local* cu_seqlens), plus ``start_positions[b]`` when given, or
    ``position_ids[t]`` when given. Per pair: ``y1 = x1 cos - x2 sin``,
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
            used to check that ``cp_size * max_seqlen`` (plus an int
            ``start_positions``) ``<= max_positions``.
        cp_size, cp_rank: CP degree and this rank.
        interleaved: GPT-J pairing.
        inplace: write into ``x`` and return it (not differentiable).
        backend: ``"auto"`` (``$CP_ROPE_BACKEND``, else Triton on CUDA and
            PyTorch on CPU), ``"triton"`` or ``"torch"``.
        position_ids: int32/int64 ``[T]``, explicit global position of every
            row, replacing the CP formula (transformers' ``position_ids``,
            documents continued across packs, per-document CP placement).
            Rows from ``cu_seqlens[-1]`` on stay unchanged whatever their
            entry. Only with ``cp_size == 1``.
        start_positions: int32/int64 ``[B]`` per-sequence offsets added to the
            formula's positions (so with ``cp_size > 1`` sequence ``b``'s global
            positions start at ``start_positions[b]``), or one Python int for
            every sequence. TransformerEngine's ``start_positions``,
            flash-attn's ``seqlen_offsets``.
        max_position_id: optional Python int, a host bound on the largest
            position used (``position_ids`` entries or formula +
            ``start_positions``); must be ``< max_positions``. Content checks
            (CPU tensors, or ``CP_ROPE_DEBUG=1``) verify it.
        conjugate: rotate by ``-theta`` (the inverse rotation).

    Returns:
        ``[T, H, D]``, x's dtype; ``x`` itself when ``inplace``. Differentiable
        w.r.t. ``x`` (backward: the rotation by ``-theta``; no saved activations).

    Raises:
        TypeError / ValueError naming the argument: wrong rank or dtype, cos/sin
        shapes that disagree, ``rotary_dim`` above D, ``cp_rank`` out of
        range, ``max_seqlen`` / ``max_position_id`` / an int
        ``start_positions`` beyond the cache, ``position_ids`` or
        ``start_positions`` of the wrong dtype, length or device, both given,
        ``position_ids`` with ``cp_size > 1``; and (CPU tensors, or
        ``CP_ROPE_DEBUG=1``) bad cu_seqlens contents, positions below 0 or
        beyond the cache / ``max_position_id``. No check syncs the device
        unless ``CP_ROPE_DEBUG=1``.
    """
    out, _ = _apply(x, None, cos, sin, cu_seqlens, max_seqlen, cp_size, cp_rank, interleaved,
                    inplace, backend, position_ids, start_positions, max_position_id, conjugate)
    return out


def apply_rotary_emb_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        cu_seqlens: torch.Tensor, *, max_seqlen: int | None = None,
                        cp_size: int = 1, cp_rank: int = 0, interleaved: bool = False,
                        inplace: bool = False, backend: str = "auto",
                        position_ids: torch.Tensor | None = None,
                        start_positions: torch.Tensor | int | None = None,
                        max_position_id: int | None = None, conjugate: bool = False,
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
                  backend, position_ids, start_positions, max_position_id, conjugate)
