"""cos/sin caches for rotary position embeddings (RoPE), with the common
context-extension scalings.

Angles are computed in float64 and cast once, so the cache is exact (to the
float32 rounding of cos/sin) at millions of positions: in float32,
``p * theta`` loses ``log2(p)`` bits before cos/sin see it.

``scaling`` takes the rope dict of Hugging Face transformers as it is:
``config.rope_parameters`` (transformers 5.x, ``rope_theta`` inside it) or the
older ``config.rope_scaling`` (``{"rope_type" | "type": ..., "factor": ...}``).
A ``rope_theta`` in the dict is the base; an explicit ``base=`` that disagrees
with it raises. ``partial_rotary_factor`` in the dict is not read: pass
``rotary_dim = int(head_dim * partial_rotary_factor)`` yourself. The formulas
follow their sources, checked against transformers' ``ROPE_INIT_FUNCTIONS`` in
``tests/test_rope_cache.py``:

* ``"default"``: ``theta_i = base ** (-2 i / rotary_dim)`` (RoFormer, Su et
  al. 2021).
* ``"linear"`` (position interpolation, Chen et al. 2023, arXiv:2306.15595;
  HF ``_compute_linear_scaling_rope_parameters``): ``theta_i / factor``.
* ``"ntk"`` (NTK-aware scaling, bloc97 2023; the static form of HF's
  ``dynamic``, which HF itself does not offer): ``base' = base * factor **
  (rotary_dim / (rotary_dim - 2))``.
* ``"llama3"`` (Meta Llama 3.1; HF ``_compute_llama3_parameters``): long
  wavelengths divided by ``factor``, short ones kept, a linear blend between.
* ``"yarn"`` (Peng et al. 2023, arXiv:2309.00071; HF
  ``_compute_yarn_parameters``): NTK-by-parts ramp between interpolated and
  extrapolated frequencies (``beta_fast`` 32 and ``beta_slow`` 1 when absent or
  ``None``), and cos/sin scaled by the attention factor: ``attention_factor``
  if given, else ``m(factor, mscale) / m(factor, mscale_all_dim)`` when both
  ``mscale`` and ``mscale_all_dim`` are set (DeepSeek), else ``m(factor, 1)``,
  with ``m(s, k) = 0.1 k ln(s) + 1`` (1 for ``s <= 1``).

Refused with a ValueError that says why: HF's ``"dynamic"`` (it recomputes the
frequencies from each batch's length at run time, which a fixed table cannot
reproduce; ``"ntk"`` is its static form), ``"longrope"`` and
``"proportional"``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from cp_rope.validation import check_int

__all__ = ["rope_cache", "inv_freq"]

_ROPE_TYPES = ("default", "linear", "ntk", "llama3", "yarn")
_REFUSED = {
    "dynamic": "it recomputes the frequencies from each batch's length at run time, which a fixed "
               "cos/sin table cannot reproduce; use rope_type 'ntk' (static NTK-aware scaling)",
    "longrope": "it is not implemented here",
    "proportional": "it is not implemented here",
}


def _real(name: str, value: Any, *, finite: bool = True) -> float:
    """``value`` as a float if it is a real number (Python/numpy, not bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r})")
    value = float(value)
    if finite and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _get(scaling: Mapping[str, Any], key: str, kind: str, default: float | None = None) -> float:
    """``scaling[key]`` as a finite float; ``default`` when absent or ``None``."""
    value = scaling.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"scaling[{key!r}] is required for rope_type {kind!r}")
        return default
    return _real(f"scaling[{key!r}]", value)


def _resolve_base(base: Any, scaling: Mapping[str, Any] | None) -> float:
    theta = None if scaling is None else scaling.get("rope_theta")
    if theta is not None:
        theta = _real("scaling['rope_theta']", theta)
    if base is not None:
        base = _real("base", base)
        if theta is not None and theta != base:
            raise ValueError(
                f"base={base} conflicts with scaling['rope_theta']={theta}: pass one of them "
                f"(base=None takes the dict's rope_theta)")
    base = base if base is not None else theta if theta is not None else 10000.0
    if not base > 1.0:
        raise ValueError(f"base must be > 1, got {base}")
    return base


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq(rotary_dim: int, base: float | None = None,
             scaling: Mapping[str, Any] | None = None) -> tuple[torch.Tensor, float]:
    """Rotation frequencies ``theta_i`` (radians per position) and the cos/sin scale.

    Args:
        rotary_dim: number of rotated dims (even, >= 2; Python or numpy int).
        base: RoPE base (10000 in the RoFormer paper, 500000 in Llama 3).
            ``None`` (default): ``scaling['rope_theta']`` when the dict has one,
            else 10000.
        scaling: ``None`` or an HF rope dict (``config.rope_parameters`` or
            ``config.rope_scaling``) with ``"rope_type"`` (or ``"type"``) in
            ``default | linear | ntk | llama3 | yarn`` and that variant's keys
            (see the module docstring). Keys it does not use are ignored.

    Returns:
        (float64 CPU ``[rotary_dim // 2]``, attention scale multiplying cos and sin;
        1.0 except for YaRN).

    Raises:
        TypeError: a non-integer ``rotary_dim``, a non-numeric ``base`` or
            dict value, a ``scaling`` that is not a mapping.
        ValueError: odd or small ``rotary_dim``; ``base`` not finite or ``<= 1``;
            ``base`` and ``scaling['rope_theta']`` disagreeing; an unknown or
            refused ``rope_type``; a missing, non-finite or out-of-range key
            (``factor >= 1``, ``high_freq_factor > low_freq_factor``,
            ``beta_fast``/``beta_slow``/``original_max_position_embeddings > 0``).
    """
    rotary_dim = check_int("rotary_dim", rotary_dim)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and >= 2, got {rotary_dim}")
    if scaling is not None and not isinstance(scaling, Mapping):
        raise TypeError(f"scaling must be a dict or None, got {type(scaling).__name__}")
    base = _resolve_base(base, scaling)
    half = rotary_dim // 2
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    freq = base ** -exponents
    if scaling is None:
        return freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in _REFUSED:
        raise ValueError(f"scaling['rope_type']={kind!r} is not supported: {_REFUSED[kind]}")
    if kind not in _ROPE_TYPES:
        raise ValueError(f"scaling['rope_type'] must be one of {_ROPE_TYPES}, got {kind!r}")
    if kind == "default":
        return freq, 1.0
    factor = _get(scaling, "factor", kind)
    if not factor >= 1.0:
        raise ValueError(f"scaling['factor'] must be >= 1, got {factor}")
    if kind == "linear":
        return freq / factor, 1.0
    if kind == "ntk":
        ntk_base = base * factor ** (rotary_dim / (rotary_dim - 2))
        return ntk_base ** -exponents, 1.0
    old_ctx = _get(scaling, "original_max_position_embeddings", kind)
    if not old_ctx > 0:
        raise ValueError(f"scaling['original_max_position_embeddings'] must be > 0, got {old_ctx}")
    if kind == "llama3":
        low = _get(scaling, "low_freq_factor", kind)
        high = _get(scaling, "high_freq_factor", kind)
        if not high > low:
            raise ValueError(f"scaling: high_freq_factor ({high}) must exceed low_freq_factor ({low})")
        wavelen = 2 * math.pi / freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * freq / factor + smooth * freq
        out = torch.where(wavelen > old_ctx / low, freq / factor, freq)
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, blended, out), 1.0
    # yarn
    beta_fast = _get(scaling, "beta_fast", kind, 32.0)
    beta_slow = _get(scaling, "beta_slow", kind, 1.0)
    for name, beta in (("beta_fast", beta_fast), ("beta_slow", beta_slow)):
        if not beta > 0:
            raise ValueError(f"scaling[{name!r}] must be > 0, got {beta}")
    if scaling.get("attention_factor") is not None:
        attn = _get(scaling, "attention_factor", kind)
    else:
        mscale = scaling.get("mscale")
        mscale_all_dim = scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:  # transformers: both set and non-zero
            attn = (_yarn_mscale(factor, _real("scaling['mscale']", mscale))
                    / _yarn_mscale(factor, _real("scaling['mscale_all_dim']", mscale_all_dim)))
        else:
            attn = _yarn_mscale(factor)

    def correction_dim(n_rot: float) -> float:  # dim whose wavelength fits n_rot times in old_ctx
        return rotary_dim * math.log(old_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    truncate = scaling.get("truncate")
    if truncate is None or truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(half, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    extrapolate = 1 - ramp
    return freq / factor * (1 - extrapolate) + freq * extrapolate, attn


def rope_cache(max_positions: int, rotary_dim: int, base: float | None = None,
               scaling: Mapping[str, Any] | None = None, device: torch.device | str | None = None,
               *, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for positions ``0 .. max_positions - 1``.

    ``cos[p, i] = scale * cos(p * theta_i)``, ``theta_i = base ** (-2 i / rotary_dim)``
    (RoFormer, Su et al. 2021), frequencies and scale from :func:`inv_freq`
    for the chosen ``scaling``. Angles are computed in float64 on the CPU,
    then cast to ``dtype`` and moved to ``device``.

    Args:
        max_positions: number of rows (global positions), >= 1; Python or numpy int.
        rotary_dim: rotated dims per head (even); the tables have
            ``rotary_dim // 2`` columns.
        base: RoPE base; ``None`` (default): ``scaling['rope_theta']`` if
            present, else 10000.
        scaling: HF rope dict (``config.rope_parameters`` /
            ``config.rope_scaling``) or ``None`` (see :func:`inv_freq`).
        device: where the tables go (default CPU).
        dtype: float32 by default (what the kernels expect); float64 for references.

    Returns:
        ``(cos, sin)``, each ``dtype`` ``[max_positions, rotary_dim // 2]``.

    Raises:
        TypeError / ValueError naming the argument (see :func:`inv_freq`).
    """
    max_positions = check_int("max_positions", max_positions, min_value=1)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype}")
    freq, scale = inv_freq(rotary_dim, base, scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), freq)
    cos, sin = torch.cos(angles), torch.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
