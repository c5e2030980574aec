"""patch_model(fused_norm=True): the families' RMSNorms by torch's fused rms_norm in bf16/fp16,
transformers' own forward (bit for bit) otherwise; installed and removed with the patch."""

from __future__ import annotations

import importlib

import pytest
import torch
from utils import assert_close

transformers = pytest.importorskip("transformers")  # the hf extra; scripts/setup.sh installs it
H = importlib.import_module("cp_rope.hf")  # after the skip: it needs transformers
FAMILIES = importlib.import_module("cp_rope.hf._compat").FAMILIES
fuse_rms_norms = importlib.import_module("cp_rope.hf.norms").fuse_rms_norms


def _norm_class(family):
    module = FAMILIES[family][0]
    return module, next(getattr(module, n) for n in dir(module) if n.endswith("RMSNorm"))


FUSED = [f for f in FAMILIES if hasattr(_norm_class(f)[1](8), "variance_epsilon")]
"""Families whose RMSNorm is Llama's (``variance_epsilon``, ``x`` rounded before ``* w``)."""


def _reference(x, w, eps):
    x, w = x.double(), w.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("family", FUSED)
@pytest.mark.parametrize("shape", [(37, 64), (1, 29, 4, 32)])  # hidden states; Qwen3's q_norm
def test_bf16_fused_norm_matches_float64(family, shape):
    module, cls = _norm_class(family)
    norm = cls(shape[-1], eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]) * 0.3 + 1)
    x = (torch.randn(*shape) * 3).to(torch.bfloat16).requires_grad_()
    own = norm(x)  # transformers' forward: two roundings
    handles = fuse_rms_norms(norm, module)
    assert len(handles) == 1 and "forward" in norm.__dict__
    got = norm(torch.full_like(x, float("nan")))  # poisoned input gives NaN, not stale rows
    assert torch.isnan(got).all()
    got = norm(x)
    want = _reference(x.detach(), norm.weight.detach(), 1e-6)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert_close(got, want, dtype=torch.bfloat16, name=f"{family} fused rms_norm")
    err = float((got.detach().double() - want).norm() / want.norm())
    err_own = float((own.detach().double() - want).norm() / want.norm())
    assert err <= err_own * 1.01 + 1e-6, (err, err_own)  # one rounding: no worse than two
    g = torch.randn(shape).to(torch.bfloat16)
    dx, dw = torch.autograd.grad(got, (x, norm.weight), g)
    xr = x.detach().double().requires_grad_()
    wr = norm.weight.detach().double().requires_grad_()
    rx, rw = torch.autograd.grad(_reference(xr, wr, 1e-6), (xr, wr), g.double())
    for a, b, name in ((dx, rx, "dx"), (dw, rw, "dweight")):
        rel = float((a.double() - b).norm() / b.norm())
        assert rel <= 2 ** -7, (family, name, rel)  # normwise, a few bf16 roundings
    handles[0].remove()
    assert "forward" not in norm.__dict__


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_gemma_style_norms_keep_their_own_forward(family):
    """Gemma's RMSNorm (``eps``, ``x * (1 + w)`` in float32, one rounding) is left alone."""
    assert family in FAMILIES and family not in FUSED
    module, cls = _norm_class(family)
    norm = cls(24, eps=1e-6).to(torch.bfloat16)
    x = torch.randn(5, 24).to(torch.bfloat16)
    own = norm(x)
    assert fuse_rms_norms(norm, module) == [] and "forward" not in norm.__dict__
    assert torch.equal(norm(x), own)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_high_precision_runs_transformers_own_forward(dtype):
    module, cls = _norm_class("qwen3")
    norm = cls(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48) + 0.5)
    x = torch.randn(5, 48, dtype=dtype)
    own = norm(x)
    fuse_rms_norms(norm, module)
    assert torch.equal(norm(x), own)


def test_patch_model_installs_and_removes_fused_norms():
    cfg = transformers.Qwen3Config(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=61,
                                   head_dim=8, attention_dropout=0.0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    norms = [m for m in model.modules() if type(m).__name__ == "Qwen3RMSNorm"]
    assert len(norms) == 2 * 4 + 1  # per layer: input, post-attention, q, k; the final one
    H.patch_model(model)
    assert all("forward" in m.__dict__ for m in norms)
    H.unpatch_model(model)
    assert not any("forward" in m.__dict__ for m in norms)
    H.patch_model(model, fused_norm=False)
    assert not any("forward" in m.__dict__ for m in norms)
    H.unpatch_model(model)
    with pytest.raises(TypeError, match="fused_norm"):
        H.patch_model(model, fused_norm="yes")


def _tiny_qwen3(dtype=torch.bfloat16):
    cfg = transformers.Qwen3Config(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=61,
                                   head_dim=8, attention_dropout=0.0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def test_deepcopy_of_a_patched_model_uses_its_own_weights():
    """The fused norms and tiled MLPs are bound to their module: a deep copy (reference model,
    EMA) runs with the copy's weights, not the original's."""
    import copy

    from cp_rope.parallel import PackingCollator

    model = H.patch_model(_tiny_qwen3(), mlp_tile_tokens=4)
    batch = PackingCollator()([{"input_ids": torch.randint(0, 61, (11,))}])
    before = model(**H.model_inputs(batch)).logits
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.model.norm.weight.zero_()
        for layer in twin.model.layers:
            layer.mlp.down_proj.weight.mul_(2)
    assert torch.equal(twin(**H.model_inputs(batch)).logits, torch.zeros_like(before))
    assert torch.equal(model(**H.model_inputs(batch)).logits, before)  # the original unchanged
    assert twin.model.norm.forward.__self__ is twin.model.norm
    assert twin.model.layers[0].mlp.forward.__self__ is twin.model.layers[0].mlp


def test_a_foreign_forward_wrapper_is_refused_not_discarded():
    model = _tiny_qwen3()
    norm = model.model.norm
    norm.forward = lambda x: x  # e.g. an accelerate hook installed on the instance
    with pytest.raises(ValueError, match="fused_norm.*own forward"):
        H.patch_model(model)
    assert not hasattr(model, "cp_rope_patch")  # nothing half-patched
    assert not any(hasattr(m, "cp_rope_patch") for m in model.modules())
    assert not any("forward" in m.__dict__ for m in model.modules() if m is not norm)
    del norm.forward
    mlp = model.model.layers[1].mlp
    mlp.forward = lambda x: x
    with pytest.raises(ValueError, match="mlp_tile_tokens.*own forward"):
        H.patch_model(model, mlp_tile_tokens=4)
    assert not any("forward" in m.__dict__ for m in model.modules() if m is not mlp)


def test_fused_norm_takes_the_keyword_and_checks_its_module_argument():
    module, cls = _norm_class("llama")
    norm = cls(16).to(torch.bfloat16)
    fuse_rms_norms(norm, module)
    x = torch.randn(3, 16).to(torch.bfloat16)
    assert torch.equal(norm(hidden_states=x), norm(x))
    with pytest.raises(TypeError, match="family_module"):
        fuse_rms_norms(norm, "llama")


@pytest.mark.parametrize("flags, match", [
    (["--loss-impl", "liger", "--device", "cpu"], "parallel.loss_impl='liger'.*cpu"),
    (["--loss-impl", "liger", "--loss-chunk-size", "512"], "parallel.loss_impl='liger'.*chunk"),
    (["--loss-impl", "torch", "--no-fused-loss"], "parallel.loss_impl='torch'.*fused loss only"),
])
def test_finetune_refuses_loss_impl_combinations_up_front(tmp_path, flags, match):
    """Before any data or model is loaded (finetune_hf.resolve), naming the field."""
    from cp_rope.launch.config import ConfigError
    from cp_rope.launch.finetune_hf import _check_loss_impl, parse_args

    fc = parse_args(["--model", str(tmp_path), *flags])
    with pytest.raises(ConfigError, match=match):
        _check_loss_impl(fc)
    _check_loss_impl(parse_args(["--model", str(tmp_path)]))  # the defaults pass


def test_finetune_refuses_a_bad_norm_kernel_up_front(tmp_path, monkeypatch):
    """CP_ROPE_NORM_KERNEL is checked with the config (finetune_hf.resolve), before any data,
    model or output folder: a ConfigError naming it, not a traceback per rank after loading."""
    from cp_rope.launch.config import ConfigError
    from cp_rope.launch.finetune_hf import _check_norm_kernel, parse_args

    fc = parse_args(["--model", str(tmp_path), "--device", "cpu"])
    monkeypatch.setenv("CP_ROPE_NORM_KERNEL", "bogus")
    with pytest.raises(ConfigError, match="CP_ROPE_NORM_KERNEL must be one of"):
        _check_norm_kernel(fc)
    monkeypatch.setenv("CP_ROPE_NORM_KERNEL", "triton")
    _check_norm_kernel(fc)


def test_a_refused_repatch_leaves_the_previous_patch_in_place():
    """patch_model checks everything before it removes the model's current patch."""
    model = H.patch_model(_tiny_qwen3(), method="ring", mlp_tile_tokens=4)
    before = model.cp_rope_patch
    forwards = {n: m.__dict__["forward"] for n, m in model.named_modules() if "forward" in m.__dict__}
    mlp = model.model.layers[1].mlp
    with pytest.raises(ValueError, match="rope_kernel"):  # a rope dict cp_rope cannot reproduce
        model.config.rope_parameters = {**model.config.rope_parameters, "rope_type": "dynamic",
                                        "factor": 2.0}
        H.patch_model(model, method="allgather")
    model.config.rope_parameters = {k: v for k, v in model.config.rope_parameters.items()
                                    if k not in ("rope_type", "factor")} | {"rope_type": "default"}
    assert model.cp_rope_patch is before and model.config._attn_implementation == "cp_rope"
    assert {n: m.__dict__.get("forward") for n, m in model.named_modules()
            if n in forwards} == forwards
    del mlp.forward  # someone else's wrapper instead of the tiled forward
    mlp.forward = lambda x: x
    with pytest.raises(ValueError, match="mlp_tile_tokens.*own forward"):
        H.patch_model(model, mlp_tile_tokens=8)
    assert model.cp_rope_patch is before and model.config._attn_implementation == "cp_rope"
    assert model.model.norm.__dict__["forward"] is forwards["model.norm"]


def test_liger_rms_norm_on_cuda_only_when_installed(monkeypatch):
    """On CUDA tensors the fused forward runs Liger-Kernel's RMSNorm where it imports (its
    "llama" casting, dY not overwritten), PyTorch's rms_norm elsewhere and without it."""
    norms = importlib.import_module("cp_rope.hf.norms")
    calls = []

    class FakeLiger:
        @staticmethod
        def apply(x, w, eps, offset, casting, in_place):
            calls.append((offset, casting, in_place))
            return torch.zeros_like(x)

    monkeypatch.setattr(norms, "_LIGER_NORM", [FakeLiger])
    assert norms.liger_rms_norm("cpu") is None and norms.norm_kernel("cpu") == "torch"
    assert norms.liger_rms_norm("cuda") is FakeLiger and norms.norm_kernel("cuda") == "liger"
    monkeypatch.setattr(norms, "_LIGER_NORM", [None])  # missing or broken
    assert norms.norm_kernel("cuda") == "torch"
    # the forward asks by the input's device: a CPU tensor never reaches Liger
    monkeypatch.setattr(norms, "_LIGER_NORM", [FakeLiger])
    module, cls = _norm_class("qwen3")
    norm = cls(16).to(torch.bfloat16)
    fuse_rms_norms(norm, module)
    x = torch.randn(3, 16).to(torch.bfloat16)
    assert not torch.equal(norm(x), torch.zeros_like(x)) and calls == []
    monkeypatch.setattr(norms, "liger_rms_norm", lambda device_type: FakeLiger)
    monkeypatch.setattr(norms, "norm_kernel", lambda device_type: "liger")
    assert torch.equal(norm(x), torch.zeros_like(x))
    assert calls == [(0.0, "llama", False)]


def test_triton_rms_norm_by_cp_rope_norm_kernel(monkeypatch):
    """CP_ROPE_NORM_KERNEL=triton runs cp_rope's Triton RMSNorm on CUDA (here the interpreter
    stands in for it), torch off CUDA; auto is Liger where it imports, else torch; a bad value
    or liger without liger-kernel is refused naming the variable. Both kernels match float64
    (float16 here: the interpreter stores bf16 by truncation; bf16 runs on the GPU in
    test_rms_norm.py)."""
    norms = importlib.import_module("cp_rope.hf.norms")
    monkeypatch.delenv("CP_ROPE_NORM_KERNEL", raising=False)
    monkeypatch.setattr(norms, "_LIGER_NORM", [None])
    assert norms.norm_kernel("cpu") == "torch" and norms.norm_kernel("cuda") == "torch"
    monkeypatch.setattr(norms, "_LIGER_NORM", [object()])
    assert norms.norm_kernel("cuda") == "liger"
    monkeypatch.setenv("CP_ROPE_NORM_KERNEL", "triton")
    assert norms.norm_kernel("cuda") == "triton" and norms.norm_kernel("cpu") == "torch"
    monkeypatch.setenv("CP_ROPE_NORM_KERNEL", "torch")
    assert norms.norm_kernel("cuda") == "torch"
    monkeypatch.setenv("CP_ROPE_NORM_KERNEL", "cuda")
    with pytest.raises(ValueError, match="CP_ROPE_NORM_KERNEL"):
        norms.norm_kernel("cpu")
    monkeypatch.setenv("CP_ROPE_NORM_KERNEL", "liger")
    monkeypatch.setattr(norms, "_LIGER_NORM", [None])
    with pytest.raises(ValueError, match="CP_ROPE_NORM_KERNEL=liger: liger-kernel"):
        norms.norm_kernel("cuda")
    monkeypatch.delenv("CP_ROPE_NORM_KERNEL")
    module, cls = _norm_class("qwen3")
    norm = cls(40, eps=1e-6).to(torch.float16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(40) * 0.3 + 1)
    fuse_rms_norms(norm, module)
    x = (torch.randn(3, 7, 40) * 2).to(torch.float16)
    calls = []
    kernel = norms.rms_norm
    monkeypatch.setattr(norms, "rms_norm", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    torch_out = norm(x)  # CPU: PyTorch's
    assert calls == []
    monkeypatch.setattr(norms, "norm_kernel", lambda device_type: "triton")
    triton_out = norm(x)
    assert calls == [{"backend": "triton"}]
    want = _reference(x, norm.weight.detach(), 1e-6)
    for got, name in ((torch_out, "torch"), (triton_out, "triton")):
        assert_close(got, want, dtype=torch.float16, name=name)


def test_compiled_fused_norm_traces_torch_rms_norm(monkeypatch):
    """Under torch.compile the fused forward is PyTorch's rms_norm, whatever
    CP_ROPE_NORM_KERNEL says (no environment read or kernel choice inside the graph): one
    graph, the same values as eager's torch path."""
    monkeypatch.setenv("CP_ROPE_NORM_KERNEL", "triton")
    module, cls = _norm_class("qwen3")
    norm = cls(24, eps=1e-6).to(torch.float16)
    fuse_rms_norms(norm, module)
    x = torch.randn(5, 24).to(torch.float16)
    got = torch.compile(norm, backend="eager", fullgraph=True)(x)
    assert torch.equal(got, torch.nn.functional.rms_norm(x, (24,), norm.weight, 1e-6))
