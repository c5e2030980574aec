"""rope_cache / inv_freq against the published formulas, written here per
frequency in plain Python floats (an independent restatement of RoFormer,
position interpolation, NTK-aware scaling, Llama 3.1 and YaRN as Hugging Face
transformers implements them)."""

from __future__ import annotations

import math

import numpy as np
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


# --------------------------------------------------------------------------- transformers
# Every rope type rope_cache supports, on the configs of the families cp_rope.hf patches,
# against transformers' own ROPE_INIT_FUNCTIONS (and the families' default function).
# transformers computes in float32: base ** (2i / d) with a float32 exponent is off by up to
# eps32 * ln(base) relative, so rtol = 4 * eps32 * (1 + ln(base)); ours is float64.

HF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")  # phi3: partial rotary 0.5
HF_ROPE = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                    "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
    "yarn_mscale_differ": {"rope_type": "yarn", "factor": 16.0, "mscale": 1.0,
                           "mscale_all_dim": 0.5, "original_max_position_embeddings": 4096},
    "yarn_beta_none": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048,
                       "beta_fast": None, "beta_slow": None, "attention_factor": None},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 8.0, "attention_factor": 0.9,
                              "original_max_position_embeddings": 2048, "beta_fast": 16.0,
                              "beta_slow": 2.0, "truncate": False},
}


@pytest.fixture(scope="module")
def hf():
    import transformers  # the hf extra; scripts/setup.sh installs it for CI
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    configs = {
        "llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
        "phi3": transformers.Phi3Config,
    }
    return transformers, ROPE_INIT_FUNCTIONS, configs


def _hf_config(hf, family, rope, theta, head_dim):
    transformers, _, configs = hf
    max_pos = rope.get("original_max_position_embeddings", 1024) * rope.get("factor", 1.0)
    rope = dict(rope, rope_theta=theta)
    if family == "phi3":  # rotary_dim = head_dim * partial_rotary_factor
        rope["partial_rotary_factor"] = 0.5
    kwargs = dict(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=int(max_pos), rope_parameters=rope)
    if family not in ("qwen2", "phi3"):  # these derive head_dim from hidden_size / heads
        kwargs["head_dim"] = head_dim
    transformers.logging.set_verbosity_error()  # the yarn factor / max-position ratio warning
    return configs[family](**kwargs)


@pytest.mark.parametrize("family, name", [  # Phi3's config takes default and longrope only
    (f, n) for f in HF_FAMILIES for n in HF_ROPE if f != "phi3" or n == "default"])
@pytest.mark.parametrize("theta, head_dim", [(10000.0, 64), (500000.0, 128), (1e6, 16)])
def test_inv_freq_matches_transformers(hf, family, name, theta, head_dim):
    transformers, init_fns, _ = hf
    config = _hf_config(hf, family, HF_ROPE[name], theta, head_dim)
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        module = {"llama": transformers.models.llama.modeling_llama.LlamaRotaryEmbedding,
                  "mistral": transformers.models.mistral.modeling_mistral.MistralRotaryEmbedding,
                  "qwen2": transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding,
                  "qwen3": transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding,
                  "phi3": transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding}[family]
        want, want_scale = module.compute_default_rope_parameters(config)
    else:
        want, want_scale = init_fns[kind](config)
    # The dict passed through unchanged: rope_theta inside it is the base.
    rotary_dim = int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
    got, scale = inv_freq(rotary_dim, scaling=config.rope_parameters)
    rtol = 4 * torch.finfo(torch.float32).eps * (1 + math.log(theta))
    torch.testing.assert_close(got, want.double(), rtol=rtol, atol=0.0)
    assert scale == pytest.approx(want_scale, rel=1e-12)
    # The same through rope_cache: cos/sin at a few positions, the scale applied.
    cos, sin = rope_cache(4, rotary_dim, scaling=config.rope_parameters, dtype=torch.float64)
    torch.testing.assert_close(cos[3], torch.cos(3 * got) * scale, rtol=0, atol=1e-15)
    torch.testing.assert_close(sin[3], torch.sin(3 * got) * scale, rtol=0, atol=1e-15)


def test_yarn_mscale_changes_the_scale():
    """Not vacuous: with mscale == mscale_all_dim the attention factor is 1 (DeepSeek), not the
    0.1 ln(factor) + 1 that ignoring them gives (1.3689 at factor 40)."""
    base = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}
    assert inv_freq(64, scaling=base)[1] == pytest.approx(0.1 * math.log(40.0) + 1.0)
    assert inv_freq(64, scaling=base | {"mscale": 0.707, "mscale_all_dim": 0.707})[1] == 1.0
    assert inv_freq(64, scaling=base | {"mscale": 1.0, "mscale_all_dim": 0.0})[1] == \
        pytest.approx(0.1 * math.log(40.0) + 1.0)  # transformers: both must be set


def test_rope_theta_in_dict_is_the_base():
    """transformers 5.x keeps rope_theta inside config.rope_parameters: rope_cache must use it
    (it kept 10000 before: cos off by up to 2.0 for llama3 at theta 5e5)."""
    llama3 = dict(CASES["llama3"][0], rope_theta=500000.0)
    got = rope_cache(4096, 64, scaling=llama3)[0]
    want = rope_cache(4096, 64, base=500000.0, scaling=CASES["llama3"][0])[0]
    assert torch.equal(got, want)
    assert (got - rope_cache(4096, 64, scaling=CASES["llama3"][0])[0]).abs().max() > 0.5
    # an explicit base that agrees is fine; one that disagrees raises
    assert torch.equal(rope_cache(64, 8, base=500000.0, scaling=llama3)[0],
                       rope_cache(64, 8, scaling=llama3)[0])
    with pytest.raises(ValueError, match="base=10000.0 conflicts with scaling\\['rope_theta'\\]"):
        rope_cache(64, 8, base=10000.0, scaling=llama3)


def test_beta_none_means_defaults():
    yarn = CASES["yarn"][0]
    want = inv_freq(DIM, BASE, yarn)
    got = inv_freq(DIM, BASE, yarn | {"beta_fast": None, "beta_slow": None})
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    assert torch.equal(inv_freq(DIM, BASE, yarn | {"beta_fast": 32, "beta_slow": 1})[0], want[0])


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(base=float("inf")), ValueError, "base must be finite"),
    (dict(base=float("nan")), ValueError, "base must be finite"),
    (dict(base="10000"), TypeError, "base must be a real number"),
    (dict(base=True), TypeError, "base must be a real number"),
    (dict(base=1.0), ValueError, "base must be > 1"),
    (dict(scaling={"rope_theta": float("inf")}), ValueError, "rope_theta'\\] must be finite"),
    (dict(scaling={"rope_theta": "5e5"}), TypeError, "rope_theta'\\] must be a real number"),
    (dict(scaling={"rope_type": "linear", "factor": float("inf")}), ValueError,
     "factor'\\] must be finite"),
    (dict(scaling={"rope_type": "linear", "factor": "2"}), TypeError, "factor'\\] must be a real"),
    (dict(scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                   "beta_fast": 0.0}), ValueError, "beta_fast"),
    (dict(scaling={"rope_type": "dynamic", "factor": 2.0}), ValueError, "'ntk'"),
    (dict(scaling={"rope_type": "longrope", "factor": 2.0}), ValueError, "longrope"),
    (dict(scaling=[("rope_type", "linear")]), TypeError, "scaling must be a dict"),
])
def test_bad_base_and_dict_values_raise(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        rope_cache(16, 8, **kwargs)


def test_numpy_ints_accepted():
    cos, _ = rope_cache(np.int64(12), np.int32(8))
    assert cos.shape == (12, 4) and torch.equal(cos, rope_cache(12, 8)[0])
    with pytest.raises(TypeError, match="max_positions must be an int"):
        rope_cache(12.0, 8)


# ------------------------------------------------------------------ bad input (the issue-15 catalogue)

def test_rope_cache_base_inf():
    with pytest.raises(ValueError, match=r"base must be finite"):
        rope_cache(16, 8, base=math.inf)


def test_rope_cache_scaling_factor_inf():
    with pytest.raises(ValueError, match=r"factor.*finite"):
        rope_cache(16, 8, scaling={"rope_type": "linear", "factor": math.inf})


def test_rope_cache_base_str():
    with pytest.raises(TypeError, match=r"base must be a real number"):
        rope_cache(16, 8, base="10000")


def test_rope_cache_numpy_int_max_positions():
    """numpy ints are ints here as everywhere (cp_size accepts them): same tables as int 10."""
    cos, sin = rope_cache(np.int64(10), 8)
    ref_cos, ref_sin = rope_cache(10, 8)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
