"""Per-block attention of CP attention: the block description, the backends, the LSE merge.

A *block* is one attention call of the CP schedule: queries of this rank
against one set of keys (local, received from another rank, or gathered).
It is described as varlen *segments*: segment ``i`` is query rows
``cu_q[i]:cu_q[i+1]`` against key rows ``cu_k[i]:cu_k[i+1]``. A segment with
no query rows makes the kernel skip key rows (so "the first half of every
sequence" is expressed without gathering rows), and a segment with no key
rows leaves its queries untouched (output 0, LSE -inf). ``causal`` blocks
only pair segments of equal query and key length, so top-left and
bottom-right causal alignment agree and every backend means the same mask.

Every backend returns, per block, partial outputs with their log-sum-exp
(natural log of the sum of ``exp(scale * q.k)`` over the visible keys, fp32
or fp64); :func:`merge_partials` combines partials exactly (the online
softmax of FlashAttention, as in TransformerEngine's and
ring-flash-attention's CP). The backward of a block takes the *final*
(merged) output and LSE, so each block yields its exact share of
dq / dk / dv.

Backends (``name``: device, dtypes, head dims):

* ``cudnn``: NVIDIA's cuDNN frontend THD ops (``nvidia-cudnn-frontend`` >=
  1.32, the extra ``cudnn``), CUDA sm80+, fp16/bf16, head dim <= 128 and a
  multiple of 8, GQA native (:mod:`cp_rope.parallel._cudnn_thd`). Its backward
  takes the LSE padded ``[B, H, max_q, 1]``, so a block runs as one varlen call
  when its segments' lengths are alike and otherwise as a few calls of
  segments grouped by length (views, or gathered rows): padded LSE and
  workspace stay O(T x H). Rows of a segment without keys come back undefined
  and are set to (0, -inf).

* ``fa4``: FlashAttention-4 (``flash-attn-4`` >= 4.0.0b36 with ``nvidia-cutlass-dsl`` >=
  4.6.2, the extra ``fa4``), CUDA sm90+ (its backward has no sm80 kernels), fp16/bf16, head
  dim a multiple of 8 in 8-256 on sm90 (8-128 or 256 on sm100+), GQA native; one varlen call
  per block, no padded state (:mod:`cp_rope.parallel._fa4`). JIT-compiles one kernel per
  (dtype, head_dim, GQA ratio, causal) on first use (``max_seqlen`` passed bucketed).

* ``reference``: pure PyTorch, any device, any floating dtype (computes in
  float64 for float64 input, else float32), any head dim; chunked over query
  rows (128 at a time) and over the key span those rows can see, so a few
  thousand tokens fit in memory. The CPU path and the test oracle.
* ``torch_flash``: ``aten._flash_attention_forward/_backward`` varlen, CUDA,
  fp16/bf16, head dim <= 256 and a multiple of 8, GQA native.
* ``torch_cudnn``: ``aten._scaled_dot_product_cudnn_attention`` dense
  ``[1, H, S, D]`` per segment (views, no copies), CUDA sm80+, cuDNN >= 9,
  fp16/bf16, head dim <= 128 and a multiple of 8. Only for batches holding
  one sequence (the long-context case): it needs the segments on the host.
* ``flash_attn``: the flash_attn package's varlen kernels when importable,
  CUDA, fp16/bf16, head dim <= 256.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from cp_rope.validation import check_choice

from . import _compat
from ._calibration import calibration_or_default
from ._cudnn_thd import CudnnTHD as _CudnnTHD
from ._fa4 import CudnnFa4 as _CudnnFa4
from ._fa4 import Fa4 as _Fa4
from .choices import BACKENDS, WINDOW_BACKENDS, WINDOW_FALLBACK

__all__ = ["Block", "merge_partials", "merge_weights", "get_backend", "backend_unavailable",
           "BACKENDS"]

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Block:
    """One attention call of the CP schedule (see the module docstring)."""

    cu_q: torch.Tensor
    """int32 ``[n + 1]`` segment boundaries in the query rows (device of q)."""
    cu_k: torch.Tensor
    """int32 ``[n + 1]`` segment boundaries in the key rows."""
    max_q: int
    """Host upper bound of every segment's query length."""
    max_k: int
    """Host upper bound of every segment's key length, segments without queries included
    (flash's backward grid spans max_k keys; 0: the block sees no key)."""
    causal: bool
    """Causal inside segments (query and key lengths equal wherever both are non-empty)."""
    split_q: bool = False
    """torch_cudnn, unmasked blocks: :attr:`dense` cuts each segment into two halves of its
    query rows, so no dense call holds more query rows than one zigzag chunk (the cuDNN
    backward's per-call memory, dq and its fp32 accumulator, stays at the diagonal's)."""
    keyless_rows: torch.Tensor | None = None
    """int64 device indices of the query rows whose segment has no key (None: there are
    none); backends whose kernels leave such rows undefined (cuDNN) set them to (0, -inf)."""
    cu_q_host: torch.Tensor | None = None
    """``cu_q`` on the host, when the plan knows it (then :attr:`dense` reads no device)."""
    cu_k_host: torch.Tensor | None = None
    window: tuple[int, int] | None = None
    """flash-attn's ``window_size = (left, right)`` inside every segment (None: no window;
    -1: unbounded on that side), aligned bottom-right as flash-attn aligns it: query row
    ``i`` of a segment of ``lq`` queries and ``lk`` keys sees key rows ``j`` with
    ``i + lk - lq - left <= j <= i + lk - lq + right`` (and ``j <= i + lk - lq`` if
    ``causal``). The windowed schedules (:mod:`cp_rope.parallel._window`) use
    ``(W - 1, 0)`` on causal diagonal pieces and ``(0, -1)`` on the "halo" pieces of keys
    before their queries."""

    @functools.cached_property
    def backend_cache(self) -> dict:
        """What a backend derives from the block once (e.g. the cuDNN calls of
        :func:`~cp_rope.parallel._cudnn_thd.plan_calls` with their device tensors): built on
        first use, kept as long as the block (the plan) lives."""
        return {}

    @functools.cached_property
    def dense(self) -> tuple[tuple[int, int, int, int], ...]:
        """Host ``(q_row0, n_q, k_row0, n_k)`` of the segments with queries and keys (one
        dense call each; reads cu_q / cu_k from the device when the host copies are absent)."""
        cq = self.cu_q_host if self.cu_q_host is not None else self.cu_q.cpu()
        ck = self.cu_k_host if self.cu_k_host is not None else self.cu_k.cpu()
        bq, bk = cq.tolist(), ck.tolist()
        segs = tuple((bq[i], bq[i + 1] - bq[i], bk[i], bk[i + 1] - bk[i])
                     for i in range(len(bq) - 1) if bq[i + 1] > bq[i] and bk[i + 1] > bk[i])
        if self.split_q and not self.causal:
            segs = tuple(piece for q0, nq, k0, nk in segs
                         for piece in ((q0, nq // 2, k0, nk), (q0 + nq // 2, nq - nq // 2, k0, nk))
                         if piece[1] > 0)
        return segs

    @functools.cached_property
    def uniform(self) -> tuple[int, int, int] | None:
        """``(n, n_q, n_k)`` when the segments are ``n`` equal ones tiling query rows
        ``[0, n n_q)`` and key rows ``[0, n n_k)`` (equal-length documents: one dense
        ``[n, H, S, D]`` call); None otherwise or when the host segments are unknown."""
        if self.cu_q_host is None or self.cu_k_host is None or self.cu_q_host.numel() < 2:
            return None
        lq = self.cu_q_host[1:] - self.cu_q_host[:-1]
        lk = self.cu_k_host[1:] - self.cu_k_host[:-1]
        nq, nk = int(lq[0]), int(lk[0])
        if nq == 0 or nk == 0 or bool((lq != nq).any()) or bool((lk != nk).any()) \
                or int(self.cu_q_host[0]) != 0 or int(self.cu_k_host[0]) != 0:
            return None
        return lq.numel(), nq, nk


def merge_partials(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor,
                   lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two attention partials over disjoint key sets.

    Args:
        out1, out2: ``[n, H, D]`` partial outputs (each normalised over its own keys).
        lse1, lse2: ``[H, n]`` their log-sum-exp (float32/float64).

    Returns: ``(out [n, H, D], lse [H, n])`` in the promoted dtype:
    ``lse = logaddexp(lse1, lse2)``, ``out = exp(lse1 - lse) out1 + exp(lse2 - lse) out2``.
    A partial whose LSE is -inf (no visible key) leaves the other unchanged
    bit for bit (whatever its output holds); if both are -inf the row is 0
    with LSE -inf. Never produces NaN from -inf.
    """
    lse, w1, w2 = merge_weights(lse1, lse2)
    none1, none2 = _rows(lse1 == NEG_INF), _rows(lse2 == NEG_INF)
    # one output-sized temporary: out = out2 * w2 + out1 * w1, then the exact cases in place
    out = out2 * w2
    out.addcmul_(out1, w1)
    torch.where(none2, out1, out, out=out)
    torch.where(none1, out2, out, out=out)
    out.masked_fill_(none1 & none2, 0.0)
    return out, lse


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.T.unsqueeze(-1)  # [H, n] -> [n, H, 1]


def merge_weights(lse1: torch.Tensor, lse2: torch.Tensor):
    """``(lse [H, n], w1 [n, H, 1], w2 [n, H, 1])`` of the merge ``out = w1 out1 + w2 out2``.

    Only ``[H, n]``-sized work. A -inf partial gets weight 0 and the other weight exactly 1
    (``exp(0)``); both -inf: weights 0, LSE -inf. Then ``w1 out1 + w2 out2`` is exact
    wherever the -inf partials hold finite values (the kernels write 0 there; only padding
    rows past ``cu_seqlens[-1]`` may hold garbage, and those are overwritten at the end);
    :func:`merge_partials` adds the exact cases for arbitrary contents.
    """
    none1, none2 = lse1 == NEG_INF, lse2 == NEG_INF
    lse = torch.where(none2, lse1, torch.where(none1, lse2, torch.logaddexp(lse1, lse2)))
    safe = lse.masked_fill(none1 & none2, 0.0)
    return lse, _rows(torch.exp(lse1 - safe)), _rows(torch.exp(lse2 - safe))


# Partials: forward gives [(q_row0, out [n, Hq, D], lse [Hq, n])]; backward gives an
# iterable of (q_row0, dq, k_row0, dk, dv). Varlen backends cover all rows at once (row0 = 0).


class _Reference:
    name = "reference"
    partials_in_input_dtype = False  # fp32 (fp64) math and partials for any input
    rows_per_chunk = 128

    @staticmethod
    def prepare_lse(lse):
        """The merged LSE ``[Hq, T]`` as this backend's backward takes it (once per call)."""
        return lse

    def _row_windows(self, blk: Block, n_rows: int, device):
        """Per query row, the visible key rows ``[lo, hi)`` (lo == hi: none)."""
        cu_q = blk.cu_q.to(device=device, dtype=torch.int64)
        cu_k = blk.cu_k.to(device=device, dtype=torch.int64)
        rows = torch.arange(n_rows, device=device)
        seg = (torch.searchsorted(cu_q, rows, right=True) - 1).clamp(0, cu_q.numel() - 2)
        inside = (rows >= cu_q[0]) & (rows < cu_q[-1])
        lo, hi = cu_k[seg], cu_k[seg + 1]
        # bottom-right alignment: query i of the segment sits at key index i + lk - lq
        diag = lo + (rows - cu_q[seg]) + (hi - lo) - (cu_q[seg + 1] - cu_q[seg])
        lo0, hi0 = lo, hi
        if blk.causal:
            hi = torch.minimum(hi, diag + 1)
        if blk.window is not None:
            left, right = blk.window
            if left >= 0:
                lo = torch.maximum(lo, diag - left)
            if right >= 0:
                hi = torch.minimum(hi, diag + right + 1)
        lo, hi = lo.clamp(lo0, hi0), hi.clamp(lo0, hi0)
        hi = torch.where(inside & (hi > lo), hi, lo)
        return lo, hi

    def _chunks(self, q, k, v, blk: Block, scale: float):
        """Yield (r0, r1, k0, qc, kc, vc, s, mask) with s ``[Hkv, G, n, m]`` masked scores."""
        n_rows, hq, d = q.shape
        hkv = k.shape[1]
        ct = torch.float64 if q.dtype == torch.float64 else torch.float32
        lo, hi = self._row_windows(blk, n_rows, q.device)
        for r0 in range(0, n_rows, self.rows_per_chunk):
            r1 = min(n_rows, r0 + self.rows_per_chunk)
            clo, chi = lo[r0:r1], hi[r0:r1]
            has = chi > clo
            if not bool(has.any()):
                continue
            k0 = int(clo[has].min())
            k1 = int(chi[has].max())
            qc = q[r0:r1].to(ct).view(r1 - r0, hkv, hq // hkv, d)
            kc, vc = k[k0:k1].to(ct), v[k0:k1].to(ct)
            kidx = torch.arange(k0, k1, device=q.device)
            mask = (kidx >= clo[:, None]) & (kidx < chi[:, None])
            s = torch.einsum("qhgd,khd->hgqk", qc, kc) * scale
            yield r0, r1, k0, qc, kc, vc, s.masked_fill(~mask, NEG_INF), mask

    def forward(self, q, k, v, blk: Block, scale: float):
        n_rows, hq, d = q.shape
        ct = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros(n_rows, hq, d, dtype=ct, device=q.device)
        lse = torch.full((hq, n_rows), NEG_INF, dtype=ct, device=q.device)
        for r0, r1, _, _, _, vc, s, _ in self._chunks(q, k, v, blk, scale):
            m = s.amax(-1, keepdim=True)
            m = m.masked_fill(m == NEG_INF, 0.0)
            p = torch.exp(s - m)
            den = p.sum(-1, keepdim=True)
            o = torch.einsum("hgqk,khd->qhgd", p, vc) / den.masked_fill(den == 0, 1.0).permute(2, 0, 1, 3)
            out[r0:r1] = o.reshape(r1 - r0, hq, d)
            lse[:, r0:r1] = (m + torch.log(den)).reshape(hq, r1 - r0)
        return [(0, out, lse)], None

    def backward(self, dout, q, k, v, out, lse, blk: Block, scale: float, aux):
        n_rows, hq, d = q.shape
        hkv = k.shape[1]
        ct = torch.float64 if q.dtype == torch.float64 else torch.float32
        dq = torch.zeros(n_rows, hq, d, dtype=ct, device=q.device)
        dk = torch.zeros(k.shape, dtype=ct, device=q.device)
        dv = torch.zeros(v.shape, dtype=ct, device=q.device)
        for r0, r1, k0, qc, kc, vc, s, mask in self._chunks(q, k, v, blk, scale):
            n = r1 - r0
            shape = (n, hkv, hq // hkv, d)
            do = dout[r0:r1].to(ct).view(shape)
            o = out[r0:r1].to(ct).view(shape)
            row_lse = lse[:, r0:r1].to(ct).reshape(hkv, hq // hkv, n, 1)
            p = torch.where(mask, torch.exp(s - row_lse), 0.0)
            delta = (do * o).sum(-1).permute(1, 2, 0).unsqueeze(-1)  # [Hkv, G, n, 1]
            ds = p * (torch.einsum("qhgd,khd->hgqk", do, vc) - delta)
            k1 = k0 + kc.shape[0]
            dv[k0:k1] += torch.einsum("hgqk,qhgd->khd", p, do)
            dk[k0:k1] += torch.einsum("hgqk,qhgd->khd", ds, qc) * scale
            dq[r0:r1] = (torch.einsum("hgqk,khd->qhgd", ds, kc) * scale).reshape(n, hq, d)
        return [(0, dq, 0, dk, dv)]


def _window_kw(blk: Block) -> dict:
    """``window=(left, right)`` for a windowed block's kernel call (nothing otherwise, so
    the unwindowed calls stay what they were)."""
    return {} if blk.window is None else {"window": blk.window}


class _Varlen:
    """Flash-style varlen kernels (torch's own or the flash_attn package)."""

    partials_in_input_dtype = True
    prepare_lse = staticmethod(_Reference.prepare_lse)

    def __init__(self, name, fwd, bwd):
        self.name, self._fwd, self._bwd = name, fwd, bwd

    def forward(self, q, k, v, blk: Block, scale: float):
        if blk.max_q == 0 or blk.max_k == 0:
            return [], None
        out, lse, *state = self._fwd(q, k, v, blk.cu_q, blk.cu_k, blk.max_q, blk.max_k,
                                     blk.causal, scale, **_window_kw(blk))
        # flash-attn writes LSE +inf for rows without a visible key; ours is -inf
        lse = lse.masked_fill(lse == float("inf"), NEG_INF)
        return [(0, out, lse)], state

    def backward(self, dout, q, k, v, out, lse, blk: Block, scale: float, aux):
        if blk.max_q == 0 or blk.max_k == 0:
            return []
        dq, dk, dv = self._bwd(dout, q, k, v, out, lse, blk.cu_q, blk.cu_k, blk.max_q, blk.max_k,
                               blk.causal, scale, *aux, **_window_kw(blk))
        return [(0, dq, 0, dk, dv)]


class _Cudnn:
    """cuDNN dense attention, one ``[1, H, S, D]`` call per host-known segment."""

    name = "torch_cudnn"
    partials_in_input_dtype = True
    prepare_lse = staticmethod(_Reference.prepare_lse)

    @staticmethod
    def _bhsd(x, row0, n):
        return x[row0:row0 + n].unsqueeze(0).transpose(1, 2)

    def forward(self, q, k, v, blk: Block, scale: float):
        parts, auxs = [], []
        for q0, nq, k0, nk in blk.dense:
            o, lse, aux = _compat.torch_cudnn_fwd(self._bhsd(q, q0, nq), self._bhsd(k, k0, nk),
                                                  self._bhsd(v, k0, nk), blk.causal, scale)
            parts.append((q0, o.transpose(1, 2)[0], lse[0]))
            auxs.append(aux)
        return parts, auxs

    def backward(self, dout, q, k, v, out, lse, blk: Block, scale: float, aux):
        """A generator: one call per segment, its grads yielded (and released by the caller)
        before the next call allocates its own."""
        for (q0, nq, k0, nk), seg_aux in zip(blk.dense, aux, strict=True):
            g = _compat.torch_cudnn_bwd(
                self._bhsd(dout, q0, nq), self._bhsd(q, q0, nq), self._bhsd(k, k0, nk),
                self._bhsd(v, k0, nk), self._bhsd(out, q0, nq), lse[:, q0:q0 + nq].unsqueeze(0),
                blk.causal, scale, seg_aux)
            yield q0, g[0].transpose(1, 2)[0], k0, g[1].transpose(1, 2)[0], g[2].transpose(1, 2)[0]
            del g


def _fa4_head_dim(major: int, d: int) -> str | None:
    """Why FA4 refuses head_dim ``d`` on an sm``major``x GPU (flash_attn/cute/interface.py's
    ``_validate_head_dims``, 4.0.0b36), None if it runs it."""
    if d % 8 == 0 and (8 <= d <= 256 if major == 9 else (8 <= d <= 128 or d == 256)):
        return None
    rule = "8-256" if major == 9 else "8-128 or 256"
    return f"supports head_dim {rule} (a multiple of 8) on sm{major}x, got {d}"


def backend_unavailable(backend: str, *, device, dtype: torch.dtype, head_dim: int,
                        n_seqs: int = 1) -> str | None:
    """Why block backend ``backend`` (a name of :data:`BACKENDS`) cannot run attention of
    ``dtype`` / ``head_dim`` on ``device`` (None: it can). Host checks only (package
    importable, device kind and compute capability, dtype, head dim; ``n_seqs`` for
    torch_cudnn), so the trainers refuse a setting before their first step. The reason
    names what is missing and, for a missing package, the command that installs it.

    Raises: ValueError for a name that is not a backend.
    """
    device = torch.device(device)
    d = int(head_dim)
    if backend == "reference":
        return None
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    if device.type != "cuda":
        return f"needs CUDA tensors, got device {device}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"supports float16/bfloat16, got {dtype}"
    if backend == "fa4":
        why = _compat.fa4_unavailable()
        if why is not None:
            return f"{why}; install it with {_compat.FA4_INSTALL}"
        major = torch.cuda.get_device_capability(device)[0]
        if major < 9:
            return (f"needs a Hopper (sm90) or newer GPU (FA4 has no sm{major}x backward); "
                    "use backend='cudnn'")
        return _fa4_head_dim(major, d)
    if backend == "flash_attn":
        if not _compat.flash_attn_available():
            return "the flash_attn (flash-attn 2) package is not importable"
        return None if d <= 256 and d % 8 == 0 else f"supports head_dim <= 256 (multiple of 8), got {d}"
    if backend == "torch_flash":
        return None if d <= 256 and d % 8 == 0 else f"supports head_dim <= 256 (multiple of 8), got {d}"
    if backend == "cudnn":
        why = _compat.cudnn_frontend_unavailable()
        if why is not None:
            return f"{why}; install it with {_compat.CUDNN_INSTALL}"
        if torch.cuda.get_device_capability(device)[0] < 8:
            return "needs an sm80+ GPU"
        return None if d <= 128 and d % 8 == 0 else f"supports head_dim <= 128 (multiple of 8), got {d}"
    # torch_cudnn
    if not _compat.torch_cudnn_available():
        return "needs cuDNN >= 9 on an sm80+ GPU with torch >= 2.6"
    if n_seqs != 1:
        return f"runs batches of one sequence (cu_seqlens of 2 entries), got {n_seqs} sequences"
    return None if d <= 128 and d % 8 == 0 else f"supports head_dim <= 128 (multiple of 8), got {d}"


def _window_refusal(backend: str, windowed: bool) -> str | None:
    """Why ``backend`` cannot run a plan with sliding-window blocks (None: it can, or the
    plan has none): only :data:`~cp_rope.parallel.choices.WINDOW_BACKENDS` take a window."""
    if windowed and backend in BACKENDS and backend not in WINDOW_BACKENDS:
        return (f"does not run sliding-window blocks (window=); the backends that do: "
                f"{WINDOW_BACKENDS}")
    return None


def _cudnn_window_fallback(q: torch.Tensor, n_seqs: int) -> str:
    """What ``backend="cudnn"`` runs a windowed plan on: the first of
    :data:`~cp_rope.parallel.choices.WINDOW_FALLBACK` that runs these inputs (cp_rope's
    cuDNN THD calls take no window: docs/parallel.md "Windows and sinks"). Raises ValueError
    naming ``backend='cudnn'`` and why each fallback cannot run."""
    whys = []
    for name in WINDOW_FALLBACK:
        why = _unsupported(name, q, n_seqs)
        if why is None:
            return name
        whys.append(f"{name} {why}")
    raise ValueError("backend='cudnn' runs sliding-window blocks (window=) on the first of "
                     f"{WINDOW_FALLBACK} that runs these inputs; none does: {'; '.join(whys)}")


def _unsupported(backend: str, q: torch.Tensor, n_seqs: int) -> str | None:
    """Why ``backend`` cannot run these inputs (None: it can)."""
    return backend_unavailable(backend, device=q.device, dtype=q.dtype, head_dim=q.shape[-1],
                               n_seqs=n_seqs)


def get_backend(backend: str, q: torch.Tensor, n_seqs: int, windowed: bool = False, *,
                calibration=None):
    """Resolve ``backend`` ("auto" or a name of :data:`BACKENDS`) for these inputs
    (``windowed``: for a plan with a sliding window, whose blocks only the backends of
    :data:`~cp_rope.parallel.choices.WINDOW_BACKENDS` run; ``auto`` picks the first of those
    that runs the inputs: fa4 on an H200 with FA4 installed; ``cudnn`` falls back to the first
    of :data:`~cp_rope.parallel.choices.WINDOW_FALLBACK` that runs them: fa4, flash_attn,
    torch_flash; ``torch_cudnn`` refuses).

    ``auto``'s rule, by measured speed on an H200 (``docs/benchmarks.md``):

    * cudnn and fa4 both run these inputs (CUDA sm90+, fp16/bf16, head_dim <= 128, both
      packages importable): **per segment** (one document's share of a block), FA4 when its
      query rows are at least the crossover length ``c(head_dim)`` of ``calibration`` (the
      plan's, ``plan.calibration``; :meth:`~cp_rope.parallel._calibration.Calibration.crossover_at`:
      the measured table of ``python -m cp_rope.parallel.calibrate``, None: the shipped H200
      one), cuDNN below it, unless a block's shorter segments hold fewer than
      :data:`~cp_rope.parallel._fa4.SPLIT_MIN_ROWS` (8,192) query rows in all: those stay on
      FA4 (cuDNN would save less than its second call costs: launches, copies, host time and
      a graph build per new shape)
      (:class:`~cp_rope.parallel._fa4.CudnnFa4`; a block whose segments all fall on one side
      runs as that backend alone). FA4 is faster on long documents (its TFLOP/s at head_dim
      64: 530 against cuDNN's 432), cuDNN on short ones (512 x 256 tokens: FA4 1.3x slower).
      The cost model (``cost_model.predict(backend="auto")``) times each segment by the same
      rule.
    * otherwise the first of :data:`BACKENDS` that runs them: cudnn (CUDA sm80+, head_dim <=
      128), fa4 (head_dim up to 256 on sm90), flash_attn (flash-attn 2, if importable),
      torch_cudnn (a batch of one sequence), torch_flash, reference.

    Raises: ValueError naming the backend and the unsupported property (for fa4 without the
    package: the install command).
    """
    check_choice("backend", backend, ("auto", *BACKENDS))
    if backend == "auto":
        runs = [b for b in BACKENDS if _window_refusal(b, windowed) is None
                and _unsupported(b, q, n_seqs) is None]
        if "cudnn" in runs and "fa4" in runs:
            crossover = calibration_or_default(calibration).crossover_at(q.shape[-1])
            if crossover is not None:
                return _CudnnFa4(crossover)
        backend = runs[0]
    if backend == "cudnn" and windowed:
        backend = _cudnn_window_fallback(q, n_seqs)
    why = _window_refusal(backend, windowed) or _unsupported(backend, q, n_seqs)
    if why is not None:
        raise ValueError(f"backend={backend!r} {why}")
    if backend == "reference":
        return _Reference()
    if backend == "cudnn":
        return _CudnnTHD()
    if backend == "fa4":
        return _Fa4()
    if backend == "torch_cudnn":
        return _Cudnn()
    if backend == "torch_flash":
        return _Varlen("torch_flash", _compat.torch_flash_varlen_fwd, _compat.torch_flash_varlen_bwd)
    return _Varlen("flash_attn", _compat.flash_attn_varlen_fwd, _compat.flash_attn_varlen_bwd)
