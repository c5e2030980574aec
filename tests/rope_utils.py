"""RoPE test helpers: the independent float64 reference and random THD batches."""

from __future__ import annotations

import pytest
import torch

from cp_rope import apply_rotary_emb, global_positions, rope_cache


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                   cp_size: int = 1, cp_rank: int = 0, interleaved: bool = False,
                   positions: torch.Tensor | None = None, conjugate: bool = False) -> torch.Tensor:
    """Float64 RoPE written independently of the package: positions from
    :func:`cp_rope.global_positions` (or ``positions``, one per row below
    ``cu_seqlens[-1]``), rotation as a complex product ``(x1 + i x2) * (cos + i sin)``
    (``cos - i sin`` when ``conjugate``). Differentiable (float64 autograd)."""
    x = x.to(torch.float64)
    n = int(cu_seqlens[-1])
    half = cos.shape[1]
    pos = global_positions(cu_seqlens.cpu(), cp_size, cp_rank) if positions is None else positions[:n]
    pos = pos.to(x.device, torch.int64)
    s = sin.to(x.device, torch.float64)[pos]
    rot = torch.complex(cos.to(x.device, torch.float64)[pos], -s if conjugate else s)
    xr = x[:n, :, :2 * half]
    if interleaved:
        pairs = xr.reshape(n, x.shape[1], half, 2)
        z = torch.complex(pairs[..., 0], pairs[..., 1]) * rot[:, None, :]
        yr = torch.stack((z.real, z.imag), dim=-1).reshape(n, x.shape[1], 2 * half)
    else:
        z = torch.complex(xr[..., :half], xr[..., half:]) * rot[:, None, :]
        yr = torch.cat((z.real, z.imag), dim=-1)
    y_valid = torch.cat((yr, x[:n, :, 2 * half:]), dim=-1)
    return torch.cat((y_valid, x[n:]), dim=0)


def random_cu_seqlens(gen: torch.Generator, n_seqs: int, cp_size: int, max_len: int = 24,
                      trailing_zeros: int = 3) -> torch.Tensor:
    """Local int32 cu_seqlens with zero-length and (cp_size 1) one-token sequences
    and ``trailing_zeros`` zero-length entries at the end. Local lengths are
    even when ``cp_size > 1`` (two CP chunks)."""
    lens = torch.randint(0, max_len + 1, (n_seqs,), generator=gen)
    lens[0] = 0
    if n_seqs > 1:
        lens[1] = 1
    if n_seqs > 2:
        lens[2] = max_len
    if cp_size > 1:
        lens = 2 * ((lens + 1) // 2)
    lens = torch.cat((lens, torch.zeros(trailing_zeros, dtype=lens.dtype)))
    return torch.cat((torch.zeros(1, dtype=torch.int64), lens.cumsum(0))).to(torch.int32)


def device_for(backend: str) -> torch.device:
    """Where a test of ``backend`` runs: the Triton backend on CUDA when there is
    a GPU (it cannot take CPU tensors there), on CPU under TRITON_INTERPRET=1
    otherwise; the PyTorch backend on CPU."""
    return torch.device("cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")


def thd(gen: torch.Generator, n_tokens: int, heads: int, head_dim: int, dtype: torch.dtype,
        strided: bool = False, device: torch.device | str = "cpu") -> torch.Tensor:
    """Fresh random ``[T, H, D]`` on ``device``; ``strided``: a non-contiguous view
    (a head slice of a wider fused buffer whose token stride is not H * D)."""
    if not strided:
        return torch.randn(n_tokens, heads, head_dim, generator=gen).to(device, dtype)
    buf = torch.randn(n_tokens, heads + 3, head_dim, generator=gen).to(device, dtype)
    return buf[:, 2:2 + heads]


def small_batch() -> dict:
    """Good arguments of :func:`cp_rope.apply_rotary_emb`: x ``[10, 2, 8]`` float32,
    ``rope_cache(32, 8)`` tables, cu_seqlens ``[0, 4, 10]``; the bad-input tables of
    the RoPE tests change one of them."""
    cos, sin = rope_cache(32, 8)
    return dict(x=torch.randn(10, 2, 8), cos=cos, sin=sin,
                cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32))


def assert_bad_input_raises(exc: type[Exception], match: str, change: dict) -> None:
    """:func:`cp_rope.apply_rotary_emb` on :func:`small_batch` updated by ``change``
    raises ``exc`` with a message matching ``match``."""
    args = small_batch()
    args.update(change)
    x, cos, sin, cu = args.pop("x"), args.pop("cos"), args.pop("sin"), args.pop("cu_seqlens")
    with pytest.raises(exc, match=match):
        apply_rotary_emb(x, cos, sin, cu, **args)
