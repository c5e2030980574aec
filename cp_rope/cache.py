"""cos/sin caches for rotary position embeddings (RoPE), with the common
context-extension scalings.

Angles are computed in float64 and cast once, so the cache is exact (to the
float32 rounding of cos/sin) at millions of positions: in float32,
``p * theta`` loses ``log2(p)`` bits before cos/sin see it.

``scaling`` takes the same dict as Hugging Face ``config.rope_scaling``
(``{"rope_type": ..., "factor": ..., ...}``) so a model's config can be passed
through unchanged. The formulas follow their sources:

* ``"linear"`` (position interpolation, Chen et al. 2023, arXiv:2306.15595):
  ``theta_i / factor``.
* ``"ntk"`` (NTK-aware scaling, bloc97 2023; the static form of HF's
  ``dynamic``): ``base' = base * factor ** (rotary_dim / (rotary_dim - 2))``.
* ``"llama3"`` (Meta Llama 3.1; HF ``_compute_llama3_parameters``): long
  wavelengths divided by ``factor``, short ones kept, a linear blend between.
* ``"yarn"`` (Peng et al. 2023, arXiv:2309.00071; HF
  ``_compute_yarn_parameters``): NTK-by-parts ramp between interpolated and
  extrapolated frequencies, and cos/sin scaled by the attention factor
  ``0.1 * ln(factor) + 1`` (unless given).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["rope_cache", "inv_freq"]

_ROPE_TYPES = ("default", "linear", "ntk", "llama3", "yarn")


def _get(scaling: Mapping[str, Any], key: str, default: Any = None) -> Any:
    if key in scaling:
        return scaling[key]
    if default is None:
        raise ValueError(f"scaling[{key!r}] is required for rope_type {scaling.get('rope_type')!r}")
    return default


def inv_freq(rotary_dim: int, base: float = 10000.0, scaling: Mapping[str, Any] | None = None,
             ) -> tuple[torch.Tensor, float]:
    """Rotation frequencies ``theta_i`` (radians per position) and the cos/sin scale.

    Args:
        rotary_dim: number of rotated dims (even, >= 2).
        base: RoPE base (10000 in the RoFormer paper, 500000 in Llama 3).
        scaling: ``None`` or an HF-style ``rope_scaling`` dict with
            ``"rope_type"`` (or ``"type"``) in ``default | linear | ntk |
            llama3 | yarn`` and that variant's keys (see the module docstring).

    Returns:
        (float64 CPU ``[rotary_dim // 2]``, attention scale multiplying cos and sin;
        1.0 except for YaRN).

    Raises:
        TypeError / ValueError naming the argument.
    """
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise TypeError(f"rotary_dim must be an int, got {type(rotary_dim).__name__}")
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and >= 2, got {rotary_dim}")
    if not base > 1.0:
        raise ValueError(f"base must be > 1, got {base}")
    half = rotary_dim // 2
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    freq = base ** -exponents
    if scaling is None:
        return freq, 1.0
    if not isinstance(scaling, Mapping):
        raise TypeError(f"scaling must be a dict or None, got {type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise ValueError(f"scaling['rope_type'] must be one of {_ROPE_TYPES}, got {kind!r}")
    if kind == "default":
        return freq, 1.0
    factor = float(_get(scaling, "factor"))
    if not factor >= 1.0:
        raise ValueError(f"scaling['factor'] must be >= 1, got {factor}")
    if kind == "linear":
        return freq / factor, 1.0
    if kind == "ntk":
        ntk_base = base * factor ** (rotary_dim / (rotary_dim - 2))
        return ntk_base ** -exponents, 1.0
    old_ctx = float(_get(scaling, "original_max_position_embeddings"))
    if kind == "llama3":
        low = float(_get(scaling, "low_freq_factor"))
        high = float(_get(scaling, "high_freq_factor"))
        if not high > low:
            raise ValueError(f"scaling: high_freq_factor ({high}) must exceed low_freq_factor ({low})")
        wavelen = 2 * math.pi / freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * freq / factor + smooth * freq
        out = torch.where(wavelen > old_ctx / low, freq / factor, freq)
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, blended, out), 1.0
    # yarn
    beta_fast = float(scaling.get("beta_fast", 32.0))
    beta_slow = float(scaling.get("beta_slow", 1.0))
    attn = scaling.get("attention_factor")
    attn = 0.1 * math.log(factor) + 1.0 if attn is None else float(attn)

    def correction_dim(n_rot: float) -> float:  # dim whose wavelength fits n_rot times in old_ctx
        return rotary_dim * math.log(old_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(half, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    extrapolate = 1 - ramp
    return freq / factor * (1 - extrapolate) + freq * extrapolate, attn


def rope_cache(max_positions: int, rotary_dim: int, base: float = 10000.0,
               scaling: Mapping[str, Any] | None = None, device: torch.device | str | None = None,
               *, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for positions ``0 .. max_positions - 1``.

    ``cos[p, i] = scale * cos(p * theta_i)``, ``theta_i = base ** (-2 i / rotary_dim)``
    (RoFormer, Su et al. 2021), frequencies and scale from :func:`inv_freq`
    for the chosen ``scaling``. Angles are computed in float64 on the CPU,
    then cast to ``dtype`` and moved to ``device``.

    Args:
        max_positions: number of rows (global positions), >= 1.
        rotary_dim: rotated dims per head (even); the tables have
            ``rotary_dim // 2`` columns.
        base: RoPE base.
        scaling: HF-style ``rope_scaling`` dict or ``None`` (see :func:`inv_freq`).
        device: where the tables go (default CPU).
        dtype: float32 by default (what the kernels expect); float64 for references.

    Returns:
        ``(cos, sin)``, each ``dtype`` ``[max_positions, rotary_dim // 2]``.

    Raises:
        TypeError / ValueError naming the argument.
    """
    if isinstance(max_positions, bool) or not isinstance(max_positions, int):
        raise TypeError(f"max_positions must be an int, got {type(max_positions).__name__}")
    if max_positions < 1:
        raise ValueError(f"max_positions must be >= 1, got {max_positions}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype}")
    freq, scale = inv_freq(rotary_dim, base, scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), freq)
    cos, sin = torch.cos(angles), torch.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
