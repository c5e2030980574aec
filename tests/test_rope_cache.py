"""rope_cache / inv_freq against the published formulas, written here per
frequency in plain Python floats (an independent restatement of RoFormer,
position interpolation, NTK-aware scaling, Llama 3.1 and YaRN as Hugging Face
transformers implements them)."""

from __future__ import annotations

import math

import pytest
import torch

from cp_rope import rope_cache
from cp_rope.cache import inv_freq

DIM, BASE = 64, 10000.0


def _plain(i: int, dim: int = DIM, base: float = BASE) -> float:
    return base ** (-2 * i / dim)


def _llama3(i, factor, low, high, old):
    f = _plain(i)
    wavelen = 2 * math.pi / f
    if wavelen < old / high:
        return f
    if wavelen > old / low:
        return f / factor
    s = (old / wavelen - low) / (high - low)
    return (1 - s) * f / factor + s * f


def _yarn(i, factor, old, beta_fast=32.0, beta_slow=1.0):
    def corr(rot):
        return DIM * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(BASE))
    lo = max(math.floor(corr(beta_fast)), 0)
    hi = min(math.ceil(corr(beta_slow)), DIM - 1)
    ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0: extrapolate (keep), 1: interpolate
    return _plain(i) * (1 - ramp) + _plain(i) / factor * ramp


CASES = {
    "none": (None, lambda i: _plain(i), 1.0),
    "linear": ({"rope_type": "linear", "factor": 4.0}, lambda i: _plain(i) / 4.0, 1.0),
    "ntk": ({"rope_type": "ntk", "factor": 8.0},
            lambda i: _plain(i, base=BASE * 8.0 ** (DIM / (DIM - 2))), 1.0),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
               lambda i: _llama3(i, 8.0, 1.0, 4.0, 8192), 1.0),
    "yarn": ({"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096},
             lambda i: _yarn(i, 16.0, 4096), 0.1 * math.log(16.0) + 1.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_inv_freq_matches_formula(name):
    scaling, formula, scale = CASES[name]
    freq, got_scale = inv_freq(DIM, BASE, scaling)
    expected = torch.tensor([formula(i) for i in range(DIM // 2)], dtype=torch.float64)
    torch.testing.assert_close(freq, expected, rtol=1e-12, atol=0.0)
    assert got_scale == pytest.approx(scale, rel=1e-12)


def test_scalings_really_differ():
    """Each variant changes something (so the checks above are not vacuous)."""
    plain = inv_freq(DIM, BASE)[0]
    for name in ("linear", "ntk", "llama3", "yarn"):
        freq = inv_freq(DIM, BASE, CASES[name][0])[0]
        assert not torch.allclose(freq, plain), name
    llama = inv_freq(DIM, BASE, CASES["llama3"][0])[0]
    assert llama[0] == plain[0] and llama[-1] == plain[-1] / 8.0  # high kept, low scaled


def test_cache_values_float64_angles_and_scale():
    n = 2**20 + 5
    cos, sin = rope_cache(n, 8, scaling=CASES["yarn"][0] | {"attention_factor": 0.5})
    assert cos.shape == (n, 4) and cos.dtype == torch.float32
    rows = [0, 1, 12345, n - 1]
    freq, _ = inv_freq(8, BASE, CASES["yarn"][0])
    for p in rows:
        for i in range(4):
            angle = p * float(freq[i])
            assert float(cos[p, i]) == pytest.approx(0.5 * math.cos(angle), abs=6e-8)
            assert float(sin[p, i]) == pytest.approx(0.5 * math.sin(angle), abs=6e-8)


def test_cache_dtype_and_device_arguments():
    cos, sin = rope_cache(10, 4, dtype=torch.float64, device="cpu")
    assert cos.dtype == sin.dtype == torch.float64
    assert float(cos[3, 1]) == math.cos(3 * BASE ** (-2 / 4))


@pytest.mark.parametrize("scaling, match", [
    ({"rope_type": "dynamo", "factor": 2.0}, "rope_type"),
    ({"rope_type": "linear"}, "factor"),
    ({"rope_type": "linear", "factor": 0.5}, "factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 8192}, "high_freq_factor"),
    ({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings"),
])
def test_bad_scaling_raises(scaling, match):
    with pytest.raises(ValueError, match=match):
        rope_cache(16, 8, scaling=scaling)
