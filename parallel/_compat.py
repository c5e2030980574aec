"""The one place where cp_rope.parallel touches private PyTorch / flash_attn APIs.

Everything version-specific is resolved here, with a version check and an
error that says what is missing, so the rest of the package calls stable
names:

* :func:`torch_flash_varlen_fwd` / :func:`torch_flash_varlen_bwd`:
  ``torch.ops.aten._flash_attention_forward`` / ``_flash_attention_backward``
  (varlen: ``cum_seq_q`` / ``cum_seq_k``; LSE ``[H, total_q]`` float32). Only
  the positional arguments present since torch 2.2 and the ``scale`` keyword
  are used, so the call is the same on torch 2.6 ... 2.13.
* :func:`torch_cudnn_fwd` / :func:`torch_cudnn_bwd`:
  ``torch.ops.aten._scaled_dot_product_cudnn_attention`` and its backward
  (dense ``[B, H, S, D]``, LSE float32 ``[B, H, S]`` or ``[B, H, S, 1]``).
* :func:`flash_attn_varlen_fwd` / :func:`flash_attn_varlen_bwd`: the
  ``flash_attn`` package's ``_flash_attn_varlen_forward`` / ``_backward``
  (2.6 and 2.7+ signatures), when the package is importable.
* :func:`cudnn_thd_fwd` / :func:`cudnn_thd_bwd`: NVIDIA's cuDNN frontend
  (``nvidia-cudnn-frontend`` >= 1.32, the optional extra ``cudnn``) torch ops
  ``torch.ops.cudnn.sdpa_fwd`` / ``sdpa_bwd`` on THD ``[T, H, D]`` with
  ``cu_seqlens_q/kv``: the forward returns the LSE token-major ``[T, H, 1]``
  fp32, the backward takes it *padded* ``[B, H, max_seqlen_q, 1]`` fp32
  (cudnn/sdpa/fwd/torch_op.py: the backend rejects a ragged LSE in the THD
  backward). Its ``nvidia-cutlass-dsl`` dependency only speeds up the
  metadata / LSE re-padding helpers (the frontend falls back to torch when it
  is absent; we re-pad ourselves): install with ``pip install --no-deps``.
  Each call runs through :func:`_cudnn_call`, which frees at once the
  reference cycle a graph build leaves: frontend 1.32 keeps the exception of a declined
  heuristic mode in a local of the frame that caught it (``failure`` in
  ``cudnn/_pygraph.py``'s ``_create_backend_plans``), a reference cycle that
  holds every calling frame and its locals (q, k, v, out, dout, the backward's
  workspace) until the collector runs: 12 GiB at 262,144 tokens and 48 GiB at
  1,048,576 (Qwen3-shaped layer, bf16, one H200), kept for the rest of the
  backward (scripts/memory_timeline.py ``--gc-watch --gc-save``).
* :func:`fa4_varlen_fwd` / :func:`fa4_varlen_bwd`: FlashAttention-4 (``flash-attn-4`` >=
  4.0.0b36, the extra ``fa4``; CuTe DSL kernels JIT-compiled per variant), its private
  ``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd`` (the public
  ``flash_attn_varlen_func`` is an autograd Function whose backward reuses its own output and
  LSE; a ring's backward needs the merged ones). Varlen: LSE ``[Hq, T]`` float32, -inf for
  rows without a key. FA4 installs into the ``flash_attn`` namespace (``flash_attn/cute``, no
  ``flash_attn/__init__.py``); flash-attn 2 is told apart by its extension ``flash_attn_2_cuda``.
* :func:`all_gather_single` / :func:`reduce_scatter_single`: torch 2.13
  renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor``.
* :func:`group_timeout`: a process group's timeout (its backend's private
  ``options._timeout``), for the subgroups of hybrid CP.
"""

from __future__ import annotations

import datetime
import functools
import gc
import importlib.metadata
import importlib.util
import inspect
import re
import sys
import threading

import torch
import torch.distributed as dist

__all__ = [
    "TORCH_VERSION",
    "all_gather_single",
    "reduce_scatter_single",
    "flash_attn_available",
    "FA4_INSTALL",
    "fa4_unavailable",
    "fa4_version",
    "fa4_compiled",
    "fa4_varlen_fwd",
    "fa4_varlen_bwd",
    "flash_attn_varlen_fwd",
    "flash_attn_varlen_bwd",
    "torch_flash_varlen_fwd",
    "torch_flash_varlen_bwd",
    "torch_cudnn_available",
    "torch_cudnn_fwd",
    "torch_cudnn_bwd",
    "CUDNN_INSTALL",
    "cudnn_frontend_unavailable",
    "cudnn_thd_fwd",
    "cudnn_thd_bwd",
    "group_timeout",
]


def _version_tuple(v: str) -> tuple[int, int]:
    parts = v.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


TORCH_VERSION = _version_tuple(torch.__version__)
_MIN_TORCH = (2, 6)

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _require_op(name: str):
    op = getattr(torch.ops.aten, name, None)
    if op is None or TORCH_VERSION < _MIN_TORCH:
        raise RuntimeError(
            f"backend needs torch.ops.aten.{name} (torch >= {_MIN_TORCH[0]}.{_MIN_TORCH[1]}); "
            f"this is torch {torch.__version__}. Use backend='reference' or another backend.")
    return op


# ----------------------------------------------------------------- torch flash (varlen)

def _torch_flash_window(op, window) -> dict:
    """``window_size_left`` / ``window_size_right`` of aten's flash ops (flash-attn's
    ``window_size``, -1 unbounded) for a windowed block; {} without one. The keywords are in
    the op's schema since torch 2.5 (2.11 and 2.13 have them); an op without them raises."""
    if window is None:
        return {}
    names = {a.name for a in op.default._schema.arguments}
    if "window_size_left" not in names:
        raise RuntimeError(f"torch {torch.__version__}: aten.{op.default._schema.name} has no "
                           "window_size_left; windowed attention needs torch >= 2.5 or "
                           "backend='reference' / 'flash_attn'")
    return {"window_size_left": int(window[0]), "window_size_right": int(window[1])}


def torch_flash_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
    """Returns (out [Tq, Hq, D] q.dtype, lse [Hq, Tq] float32, rng_state, unused).

    Rows with no visible key get out 0 and lse +inf (flash-attn's convention);
    rows at or beyond ``cu_q[-1]`` are left unwritten. Callers fix both. ``window``:
    flash-attn's ``(left, right)`` (bottom-right aligned) or None.
    """
    op = _require_op("_flash_attention_forward")
    out, lse, rng_state, unused, _ = op(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
        **_torch_flash_window(op, window))
    if lse.shape != (q.shape[1], q.shape[0]):
        raise RuntimeError(
            f"torch {torch.__version__}: aten._flash_attention_forward returned an LSE of shape "
            f"{tuple(lse.shape)}, expected the unpadded varlen layout [H, total_q] = "
            f"{[q.shape[1], q.shape[0]]}; use backend='torch_cudnn' (one sequence) or 'reference'")
    return out, lse, rng_state, unused


def torch_flash_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale,
                           rng_state, unused, window=None):
    """Returns (dq, dk, dv) in the input dtype; GQA dk/dv have k's head count."""
    op = _require_op("_flash_attention_backward")
    return op(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused,
              scale=scale, **_torch_flash_window(op, window))


# ----------------------------------------------------------------- cuDNN (dense)

@functools.cache
def torch_cudnn_available() -> bool:
    """cuDNN SDPA ops exist, cuDNN >= 9 is loaded and the GPU is sm80+."""
    if TORCH_VERSION < _MIN_TORCH or not torch.cuda.is_available():
        return False
    if getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None) is None:
        return False
    if not torch.backends.cudnn.is_available() or (torch.backends.cudnn.version() or 0) < 90000:
        return False
    return torch.cuda.get_device_capability()[0] >= 8


def torch_cudnn_fwd(q, k, v, causal, scale):
    """q/k/v ``[B, H, S, D]`` (any strides with a unit last stride).

    Returns (out ``[B, Hq, Sq, D]``, lse ``[B, Hq, Sq]`` float32, aux) where aux
    holds what the backward needs (philox state, cum_seq, the LSE's own shape).
    """
    op = _require_op("_scaled_dot_product_cudnn_attention")
    (out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _) = op(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    aux = (cum_q, cum_k, max_q, max_k, seed, offset, tuple(lse.shape))
    return out, lse.reshape(lse.shape[0], lse.shape[1], lse.shape[2]), aux


def torch_cudnn_bwd(dout, q, k, v, out, lse, causal, scale, aux):
    """Gradients of :func:`torch_cudnn_fwd`; ``lse`` ``[B, Hq, Sq]`` float32."""
    op = _require_op("_scaled_dot_product_cudnn_attention_backward")
    cum_q, cum_k, max_q, max_k, seed, offset, lse_shape = aux
    return op(dout, q, k, v, out, lse.reshape(lse_shape).contiguous(), seed, offset, None,
              cum_q, cum_k, max_q, max_k, 0.0, causal, scale=scale)


# ----------------------------------------------------------------- cuDNN frontend (THD)

_CUDNN_FRONTEND_MIN = (1, 32)
CUDNN_INSTALL = 'pip install --no-deps "nvidia-cudnn-frontend>=1.32"  (or: pip install "cp-rope[cudnn]")'


@functools.cache
def _cudnn_frontend() -> tuple[object | None, str | None]:
    """``(torch.ops.cudnn, None)``, or ``(None, why it is unusable)``."""
    try:
        import cudnn
    except ImportError as exc:
        return None, f"needs the nvidia-cudnn-frontend package, which is not importable ({exc})"
    version = getattr(cudnn, "__version__", "0.0")
    if _version_tuple(version) < _CUDNN_FRONTEND_MIN:
        return None, (f"needs nvidia-cudnn-frontend >= {_CUDNN_FRONTEND_MIN[0]}."
                      f"{_CUDNN_FRONTEND_MIN[1]} (its THD torch ops); found {version}")
    try:
        import cudnn.sdpa.fwd.torch_op  # noqa: F401  (registers torch.ops.cudnn.sdpa_fwd/bwd)
    except ImportError as exc:
        return None, f"nvidia-cudnn-frontend {version} has no THD torch ops ({exc})"
    return torch.ops.cudnn, None


def cudnn_frontend_unavailable() -> str | None:
    """Why the cuDNN frontend THD ops cannot be used here (None: they can)."""
    return _cudnn_frontend()[1]


def _cudnn_ops():
    ops, why = _cudnn_frontend()
    if ops is None:
        raise RuntimeError(f"backend='cudnn' {why}; install it with {CUDNN_INSTALL}")
    return ops


_GC_PAUSE = threading.Lock()
_gc_pause = {"depth": 0, "was_enabled": False}  # calls inside the frontend now, the state before
_YOUNG_COLLECTION = getattr(sys, "_is_gil_enabled", lambda: True)()
"""False on a free-threaded build (3.13t+), where every collection is a full one (hundreds of
milliseconds on a large heap): the pause and collection are skipped there."""


def _cudnn_call(name: str, *args, **kwargs):
    """``torch.ops.cudnn.<name>(*args, **kwargs)`` with Python's automatic garbage collection
    paused during the call and a collection of the youngest generation after it.

    Why (the module docstring): a graph build leaves a reference cycle that holds the calling
    frames. A collection that runs while the frontend frame that caught the exception is still
    running (the build allocates enough objects to trigger some) finds the cycle alive and moves
    it to an older generation, where it waits, holding q, k, v and the workspace, for a rarer
    collection. With collection paused it stays young, and the young collection after the call
    frees it (microseconds between builds, when the youngest generation is near empty). This
    also collects when the caller had turned automatic collection off.

    Threads: the pause is counted under a lock; the first call in saves the collector's state,
    the last one out restores it (also on an error) and collects, so no collection runs while
    another thread is inside a build.
    """
    if not _YOUNG_COLLECTION:
        return getattr(_cudnn_ops(), name)(*args, **kwargs)
    with _GC_PAUSE:
        if _gc_pause["depth"] == 0:
            _gc_pause["was_enabled"] = gc.isenabled()
            gc.disable()
        _gc_pause["depth"] += 1
    try:
        return getattr(_cudnn_ops(), name)(*args, **kwargs)
    finally:
        with _GC_PAUSE:
            _gc_pause["depth"] -= 1
            if _gc_pause["depth"] == 0:
                if _gc_pause["was_enabled"]:
                    gc.enable()
                gc.collect(0)


def cudnn_thd_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """THD forward: q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]`` (GQA native), int32 cu_q / cu_k.

    Returns (out ``[Tq, Hq, D]`` q.dtype, lse ``[Hq, Tq]`` float32, a view of the kernel's
    token-major stats). Rows at or beyond ``cu_q[-1]`` are left unwritten; rows of a
    segment without keys hold NaN / garbage (callers fix both).
    """
    out, stats = _cudnn_call(
        "sdpa_fwd", q, k, v, scale, is_causal=causal, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k,
        max_seqlen_q=max_q, max_seqlen_kv=max_k, return_lse=True)
    return out, stats[:, :, 0].t()


def cudnn_thd_bwd(dout, q, k, v, out, lse_padded, cu_q, cu_k, max_q, max_k, causal, scale):
    """Gradients of :func:`cudnn_thd_fwd`; ``lse_padded`` float32 ``[B, Hq, max_q, 1]``
    (segment b's LSE in ``[b, :, :len_b]``; the rest is ignored). Returns (dq, dk, dv) in
    the input dtype; dk/dv with k's head count."""
    return _cudnn_call(
        "sdpa_bwd", dout, q, k, v, out, lse_padded, scale, is_causal=causal, cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_k, max_seqlen_q=max_q, max_seqlen_kv=max_k)


def cudnn_dense_fwd(q, k, v, causal, scale):
    """Dense forward of the same ops: q ``[B, Hq, S, D]``, k/v ``[B, Hkv, Sk, D]`` (any strides
    with a unit last one; the output adopts q's layout). Returns (out, stats
    ``[B, Hq, S, 1]`` float32 contiguous)."""
    return _cudnn_call("sdpa_fwd", q, k, v, scale, is_causal=causal, return_lse=True)


def cudnn_dense_bwd(dout, q, k, v, out, lse, causal, scale):
    """Gradients of :func:`cudnn_dense_fwd` (``lse`` ``[B, Hq, S, 1]`` float32), in q / k / v's
    layouts."""
    return _cudnn_call("sdpa_bwd", dout, q, k, v, out, lse, scale, is_causal=causal)


# ----------------------------------------------------------------- flash_attn package

@functools.cache
def _flash_attn_interface():
    # flash-attn 2's extension: a flash_attn namespace holding only flash_attn/cute is FA4
    if importlib.util.find_spec("flash_attn_2_cuda") is None:
        return None
    try:
        import flash_attn
        from flash_attn import flash_attn_interface as fai
    except ImportError:
        return None
    if _version_tuple(getattr(flash_attn, "__version__", "0.0")) < (2, 6):
        raise RuntimeError(f"flash_attn {flash_attn.__version__} is too old for cp_rope "
                           "(needs >= 2.6); upgrade it or pass backend='torch_flash'")
    try:  # 2.7+ takes window_size_left/right; 2.6 a window_size=(left, right) tuple
        split_window = "window_size_left" in inspect.signature(fai._flash_attn_varlen_forward).parameters
    except (TypeError, ValueError):  # wrapped as a torch custom op: 2.7+
        split_window = True
    return fai, split_window


def flash_attn_available() -> bool:
    return _flash_attn_interface() is not None


def _window_kwargs(split_window: bool, window=None) -> dict:
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    if split_window:
        return {"window_size_left": left, "window_size_right": right}
    return {"window_size": (left, right)}


def flash_attn_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
    """Returns (out, lse [Hq, Tq] float32, rng_state); same conventions as torch flash
    (``window``: its ``window_size``, or None)."""
    fai, split_window = _flash_attn_interface()
    res = fai._flash_attn_varlen_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=causal,
        softcap=0.0, alibi_slopes=None, return_softmax=False,
        **_window_kwargs(split_window, window))
    # 2.7+: (out, lse, S_dmask, rng_state); 2.6: (out, q, k, v, out_padded, lse, S_dmask, rng_state)
    out, lse, rng_state = (res[0], res[1], res[3]) if len(res) == 4 else (res[0], res[5], res[7])
    return out, lse, rng_state


def flash_attn_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale,
                          rng_state, window=None):
    fai, split_window = _flash_attn_interface()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fai._flash_attn_varlen_backward(
        dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p=0.0,
        softmax_scale=scale, causal=causal, softcap=0.0, alibi_slopes=None,
        deterministic=False, rng_state=rng_state, **_window_kwargs(split_window, window))
    return dq, dk, dv


# ----------------------------------------------------------------- FlashAttention-4

FA4_MIN = "4.0.0b36"
FA4_INSTALL = ('pip install "cp-rope[fa4]"  (flash-attn-4>=4.0.0b36, nvidia-cutlass-dsl>=4.6.2; '
               'docs/parallel.md "FlashAttention-4")')
_FA4_FWD_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale",
                 "causal", "window_size_left", "window_size_right", "learnable_sink", "return_lse")
_FA4_BWD_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                 "window_size_left", "window_size_right", "learnable_sink")


def _release(v: str) -> tuple:
    """``"4.0.0b36"`` -> ``(4, 0, 0, -2, 36)``: comparable, pre-releases (a < b < rc) before
    the release (``(.., 0, 0)``); an unparsable version compares lowest."""
    m = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?(?:(a|b|rc)(\d+))?", v)
    if m is None:
        return (-1,)
    pre = {"a": -3, "b": -2, "rc": -1}.get(m.group(4), 0)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0), pre, int(m.group(5) or 0))


def fa4_version() -> str | None:
    """The installed ``flash-attn-4`` distribution's version (None: not installed)."""
    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _fa4() -> tuple[object | None, str | None]:
    """``(flash_attn.cute.interface, None)``, or ``(None, why it is unusable)``."""
    version = fa4_version()
    if version is None and importlib.util.find_spec("flash_attn_2_cuda") is not None:
        return None, ("needs flash-attn-4; the flash_attn package here is flash-attn 2 "
                      "(backend='flash_attn')")
    try:
        from flash_attn.cute import interface
    except Exception as exc:  # a broken install raises more than ImportError (CUDA libs, DSL)
        return None, f"needs flash-attn-4, which is not importable ({type(exc).__name__}: {exc})"
    if version is not None and _release(version) < _release(FA4_MIN):
        return None, f"needs flash-attn-4 >= {FA4_MIN}; found {version}"
    for fn, args in (("_flash_attn_fwd", _FA4_FWD_ARGS), ("_flash_attn_bwd", _FA4_BWD_ARGS)):
        try:
            params = inspect.signature(getattr(interface, fn)).parameters
        except (AttributeError, TypeError, ValueError):
            return None, f"flash-attn-4 {version} has no flash_attn.cute.interface.{fn}"
        missing = [a for a in args if a not in params]
        if missing:
            return None, f"flash-attn-4 {version}: {fn} lacks {', '.join(missing)}"
    return interface, None


def fa4_unavailable() -> str | None:
    """Why FlashAttention-4 cannot be used in this process (None: it can). Host only; cached."""
    return _fa4()[1]


def _fa4_interface():
    fa4, why = _fa4()
    if fa4 is None:
        raise RuntimeError(f"backend='fa4' {why}; install it with {FA4_INSTALL}")
    return fa4


def fa4_compiled() -> int:
    """How many FA4 kernels this process has JIT-compiled (the in-memory caches of its forward,
    backward and backward pre/post-processing; 0 without FA4): a count that must not grow with
    the batches once every variant ran (tests, ``scripts/bench_cp_attention.py``)."""
    fa4, _ = _fa4()
    total = 0
    for fn in ("_flash_attn_fwd", "_flash_attn_bwd", "_bwd_preprocess", "_bwd_postprocess_convert"):
        cache = getattr(getattr(fa4, fn, None), "compile_cache", None)
        total += len(getattr(cache, "cache", ()))
    return total


def fa4_varlen_fwd(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float,
                   window=(None, None), sink=None):
    """FA4 varlen forward: q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]`` (GQA native), int32 cu_q /
    cu_k, host-int ``max_q`` / ``max_k`` (upper bounds: part of nothing the kernels compile
    for on SM90, but keep them bucketed). ``window``: (left, right) or (None, None);
    ``sink``: float32 ``[Hq]`` learnable sink logits or None.

    Returns (out ``[Tq, Hq, D]`` q.dtype, lse ``[Hq, Tq]`` float32 contiguous, -inf where a
    row sees no key). Rows at or beyond ``cu_q[-1]`` are left unwritten. Runs as the torch op
    ``cp_rope::fa4_varlen_fwd`` (FA4's own call is plain Python, which dispatch modes do not
    see), so that selective checkpointing keeps its outputs instead of recomputing it
    (:data:`cp_rope.launch.offload.ATTENTION_OPS`); the op has no autograd formula: call it
    with gradients off, as the block backends do inside ``_CPAttention``.
    """
    return torch.ops.cp_rope.fa4_varlen_fwd(q, k, v, cu_q, cu_k, int(max_q), int(max_k),
                                            bool(causal), float(scale), *window, sink)


def _fa4_kernel_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, sink):
    """FA4's varlen forward call itself: what the op runs (the CPU tests put a fake here)."""
    out, lse, *_ = _fa4_interface()._flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        softmax_scale=scale, causal=causal, window_size_left=left, window_size_right=right,
        learnable_sink=sink, return_lse=True)
    return out, lse


@torch.library.custom_op("cp_rope::fa4_varlen_fwd", mutates_args=(), schema=(
    "(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k, int max_q, int max_k, "
    "bool causal, float scale, int? left, int? right, Tensor? sink) -> (Tensor, Tensor)"))
def _fa4_fwd_op(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, sink):
    return _fa4_kernel_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, sink)


@_fa4_fwd_op.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, sink):
    lse = torch.float64 if q.dtype == torch.float64 else torch.float32  # float64: CPU tests
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=lse)  # contiguous


def fa4_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool,
                   scale: float, window=(None, None), sink=None):
    """Gradients of :func:`fa4_varlen_fwd` from any (out, lse) pair (the merged ones of a CP
    ring): ``lse`` float32 ``[Hq, Tq]`` contiguous. Returns (dq, dk, dv) in the input dtype
    (dk/dv with k's head count; zero for keys of segments without queries), plus dsink when
    ``sink`` is given."""
    return _fa4_interface()._flash_attn_bwd(
        q, k, v, out, dout, lse, scale, causal, window_size_left=window[0],
        window_size_right=window[1], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
        max_seqlen_k=max_k, learnable_sink=sink)


# ----------------------------------------------------------------- process groups

def group_timeout(group) -> datetime.timedelta | None:
    """The timeout of ``group``'s backend (``ProcessGroup._get_backend(dev).options._timeout``,
    private), so subgroups made from it fail as fast; None when it cannot be read (then
    ``new_group`` uses torch's default)."""
    group = group if group is not None else dist.group.WORLD
    for dev in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(dev)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None
