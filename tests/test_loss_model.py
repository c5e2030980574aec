"""The fused loss and the sequence-tiled MLP inside the models, one process:
the SwiGLU FeedForward tiled == untiled in float64; launch.model.Transformer and
finetune_hf's HFCausalLM give the same loss and parameter gradients fused / unfused
and tiled / untiled (float32 there: cp_rope's RoPE kernel runs float32 at most, and
both sides compute the same terms in another order, so float32 tolerances); bad sizes
name their flag."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from utils import assert_close

from cp_rope.launch.config import ConfigError, ModelConfig, PretrainConfig, validate
from cp_rope.launch.model import Transformer
from cp_rope.parallel import PackingCollator, cp_cross_entropy

V = 61


def _batch(seed=1, lens=(5, 13, 1, 8, 3, 6, 20)):
    g = torch.Generator().manual_seed(seed)
    return PackingCollator()([{"input_ids": torch.randint(0, V, (n,), generator=g)}
                              for n in lens])


def _loss_and_grads(model, call):
    model.zero_grad(set_to_none=True)
    loss = call(model)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def _compare(a, b, what):
    assert_close(a[0].reshape(1), b[0].reshape(1), name=f"{what}: loss")
    assert a[1].keys() == b[1].keys() and len(a[1]) > 0
    for name in a[1]:
        assert_close(a[1][name], b[1][name], name=f"{what}: d{name}")


@pytest.mark.parametrize("tile", [1, 7, 64])
def test_tiled_feed_forward_equals_untiled_float64(tile):
    from cp_rope.launch.model import FeedForward

    torch.manual_seed(tile)
    plain = FeedForward(24, 40).double()
    tiled = FeedForward(24, 40, tile_tokens=tile).double()
    tiled.load_state_dict(plain.state_dict())
    x = torch.randn(53, 24, dtype=torch.float64)
    go = torch.randn(53, 24, dtype=torch.float64)
    results = []
    for m in (plain, tiled):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(go)
        results.append([y, xi.grad] + [p.grad for p in m.parameters()])
    for name, a, b in zip(["out", "dx", "dw1", "dw3", "dw2"], *results, strict=True):
        assert_close(b, a, name=f"tile {tile}: {name}")
    with torch.no_grad():  # no autograd node: plain tiles
        assert_close(tiled(x), plain(x), name="no_grad")


@pytest.mark.gpu
def test_tiled_feed_forward_cuda_bfloat16():
    """The CUDA bf16 path (fp32 sums of the tiles' parameter gradients) against float64, normwise
    (bf16 roundings of the intermediates differ elementwise): as close as the untiled bf16 MLP."""
    from cp_rope.launch.model import FeedForward

    torch.manual_seed(0)
    plain = FeedForward(256, 704).to("cuda", torch.bfloat16)
    tiled = FeedForward(256, 704, tile_tokens=512).to("cuda", torch.bfloat16)
    ref = FeedForward(256, 704).double()
    tiled.load_state_dict(plain.state_dict())
    ref.load_state_dict(plain.state_dict())  # the bf16 weights, exactly, in float64
    x = torch.randn(4000, 256, dtype=torch.bfloat16)
    go = torch.randn(4000, 256, dtype=torch.bfloat16)

    def run(m, dev, dt):
        xi = x.to(dev, dt).requires_grad_()
        y = m(xi)
        y.backward(go.to(dev, dt))
        return [t.double().cpu() for t in [y, xi.grad] + [p.grad for p in m.parameters()]]

    want, base, got = run(ref, "cpu", torch.float64), run(plain, "cuda", torch.bfloat16), \
        run(tiled, "cuda", torch.bfloat16)
    for name, g, b, w in zip(["out", "dx", "dw1", "dw3", "dw2"], got, base, want, strict=True):
        err, err_plain = float((g - w).norm() / w.norm()), float((b - w).norm() / w.norm())
        assert err <= max(2 * err_plain, 2 ** -8), (name, err, err_plain)


def _native(**over):
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=48,
                      vocab_size=V, max_seq_len=64, **over)
    torch.manual_seed(0)
    return Transformer(cfg, rope_backend="torch")


def test_native_fused_loss_and_tiled_mlp_equal_the_plain_model():
    b = _batch()

    def loss(m):
        return m(b.input_ids, m.attention_plan(b), labels=b.labels)

    def plain(m):  # logits, then the CP loss on them (the trainer before the fused loss)
        return cp_cross_entropy(m(b.input_ids, m.attention_plan(b)), b.labels)

    ref = _loss_and_grads(_native(fused_loss=False), plain)
    _compare(_loss_and_grads(_native(fused_loss=False), loss), ref, "unfused head")
    _compare(_loss_and_grads(_native(loss_chunk_size=7), loss), ref, "fused, chunk 7")
    _compare(_loss_and_grads(_native(mlp_tile_tokens=5), loss), ref, "tiled MLP 5, fused")
    _compare(_loss_and_grads(_native(mlp_tile_tokens=1, fused_loss=False), plain), ref,
             "tiled MLP 1")
    # no labels: the logits, as before
    m = _native(mlp_tile_tokens=4)
    logits = m(b.input_ids, m.attention_plan(b))
    assert logits.shape == (b.input_ids.numel(), V)


@pytest.mark.parametrize("field, value", [("loss_chunk_size", -1), ("mlp_tile_tokens", -2)])
def test_bad_sizes_name_the_field(field, value):
    cfg = PretrainConfig()
    setattr(cfg.model, field, value)
    with pytest.raises(ConfigError, match=f"model.{field}"):
        validate(cfg)
    cfg = PretrainConfig()
    cfg.model.fused_loss, cfg.model.loss_chunk_size = False, 64
    with pytest.raises(ConfigError, match="model.loss_chunk_size.*--no-fused-loss"):
        validate(cfg)


def _fsdp_body(rank, world):
    """The production wiring at cp 2 (parallelize: CP, FSDP2 fp32 on gloo; train_step: loss x
    world, reduce-scatter average): a tiled-MLP, fused-loss model's loss and full gradients
    equal the plain model's on the same shard."""
    import torch.distributed as dist

    from cp_rope.launch.config import ParallelConfig, TrainConfig
    from cp_rope.launch.parallelize import parallelize
    from cp_rope.launch.pretrain import train_step
    from cp_rope.parallel import shard_batch
    from cp_rope.parallel.mesh import ParallelDims

    dims = ParallelDims(dp=1, cp=world, world_size=world)
    mesh, flat = dims.build_mesh("cpu"), dims.build_flat_mesh("cpu")
    glob = PackingCollator(cp_size=world)([{"input_ids": torch.randint(0, V, (n,), generator=g)}
                                           for g in [torch.Generator().manual_seed(5)]
                                           for n in (37, 1, 64, 8, 23)])
    batch = shard_batch(glob, world, mesh.get_local_rank("cp"))
    out = []
    for over in ({"fused_loss": False}, {"mlp_tile_tokens": 8, "loss_chunk_size": 16}):
        model = _native(**over)
        parallelize(model, mesh, PretrainConfig(
            model=model.cfg, parallel=ParallelConfig(cp_size=world, fsdp="on"),
            train=TrainConfig(dtype="float32")))
        loss = train_step(model, batch, flat.get_group(), reduce_group=flat.get_group(),
                          grad_scale=float(world), reduce_grads=False)
        out.append((loss, {n: p.grad.full_tensor() for n, p in model.named_parameters()}))
    _compare(out[1], out[0], f"fsdp cp {world} rank {dist.get_rank()}")


def test_fsdp2_cp2_tiled_fused_equals_plain():
    run_distributed(_fsdp_body, 2)


# ------------------------------------------------------------------------- transformers
def _hf(family="qwen3", tie=False, softcap=None, **kw):
    H = pytest.importorskip("cp_rope.hf")
    from cp_rope.launch.finetune_hf import HFCausalLM

    name = {"qwen3": "Qwen3Config", "phi3": "Phi3Config", "llama": "LlamaConfig"}[family]
    H.transformers.logging.set_verbosity_error()
    extra = {"pad_token_id": 0} if family == "phi3" else {}
    cfg = getattr(H.transformers, name)(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=V, max_position_embeddings=128, attention_dropout=0.0,
        tie_word_embeddings=tie, **extra)
    if softcap is not None:
        cfg.final_logit_softcapping = softcap
    torch.manual_seed(0)
    lm = H.transformers.AutoModelForCausalLM.from_config(cfg)
    model = HFCausalLM(lm, **kw)
    model.configure_attention(cp_group=None, cp_method="ring", attn_backend="auto",
                              rope_backend="auto")
    return model


@pytest.mark.parametrize("family, tie, softcap", [("qwen3", False, None), ("llama", True, 3.0),
                                                  ("phi3", False, None)])
def test_hf_fused_loss_and_tiled_mlp_equal_the_logits_path(family, tie, softcap):
    b = _batch()

    def loss(m):
        return m(b.input_ids, m.attention_plan(b), labels=b.labels)

    def plain(m):  # the patched transformers model's own logits, then the CP loss
        logits = m.lm(input_ids=b.input_ids[None], position_ids=b.position_ids[None],
                      cu_seq_lens_q=b.cu_seqlens, cu_seq_lens_k=b.cu_seqlens,
                      max_length_q=b.max_seqlen, max_length_k=b.max_seqlen).logits[0]
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        return cp_cross_entropy(logits, b.labels)

    ref = _loss_and_grads(_hf(family, tie, softcap, fused_loss=False), plain)
    if tie:
        m = _hf(family, tie, softcap)
        assert m.lm.get_output_embeddings().weight is m.lm.get_input_embeddings().weight
    _compare(_loss_and_grads(_hf(family, tie, softcap, fused_loss=False), loss), ref, "unfused")
    _compare(_loss_and_grads(_hf(family, tie, softcap, loss_chunk_size=9), loss), ref, "fused")
    tiled = _hf(family, tie, softcap, mlp_tile_tokens=4)
    assert all("forward" in layer.mlp.__dict__ for layer in tiled.lm.base_model.layers)
    _compare(_loss_and_grads(tiled, loss), ref, "tiled MLP 4, fused")
    # logits: all rows, the last k (transformers' logits_to_keep), and the loss on kept rows
    m = _hf(family, tie, softcap, loss_chunk_size=9)
    with torch.no_grad():
        plan = m.attention_plan(b)
        full = m(b.input_ids, plan)
        last = m(b.input_ids, plan, logits_to_keep=10)
        assert_close(last, full[-10:], name="logits_to_keep=10")
        kept = m(b.input_ids, plan, labels=b.labels, logits_to_keep=10)
        assert_close(kept.reshape(1), cp_cross_entropy(full[-10:], b.labels[-10:]).reshape(1),
                     name="loss on the kept rows")


def test_hf_tiling_is_undone_and_bad_tile_names_the_argument():
    H = pytest.importorskip("cp_rope.hf")
    m = _hf("qwen3", mlp_tile_tokens=4)
    H.unpatch_model(m.lm)
    assert not any("forward" in layer.mlp.__dict__ for layer in m.lm.base_model.layers)
    with pytest.raises(ValueError, match="mlp_tile_tokens"):
        H.patch_model(m.lm, mlp_tile_tokens=0)
    assert getattr(m.lm, "cp_rope_patch", None) is None  # refused before patching anything


# ------------------------------------------------------------------ tiled_mlp's bad input (round 3)

def _tiled(fn, x, tile=3, params=(), **kw):
    from cp_rope.parallel import tiled_mlp
    return tiled_mlp(fn, x, tile, list(params), **kw)


@pytest.mark.parametrize("shape,dim", [((10, 8), 5), ((10,), -2), ((10, 8), 2)])
def test_tiled_mlp_dim_not_a_dimension(shape, dim):
    lin = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match=rf"dim={dim}: not a dimension of x"):
        _tiled(lin, torch.randn(shape, requires_grad=True), params=lin.parameters(), dim=dim)


def test_tiled_mlp_fn_not_position_wise():
    x = torch.randn(10, 8, requires_grad=True)
    with pytest.raises(ValueError, match=r"fn: not position-wise along dim=0"):
        _tiled(lambda t: t[:1] * 2, x)


@pytest.mark.parametrize("fn,params,match", [(None, (), r"fn must be callable"),
                                             (torch.tanh, (1.0,), r"params must be tensors")])
def test_tiled_mlp_fn_or_params_of_the_wrong_type(fn, params, match):
    with pytest.raises(TypeError, match=match):
        _tiled(fn, torch.randn(10, 8, requires_grad=True), params=params)


def test_numpy_integers_for_chunk_size_and_tile_tokens():
    """Integers of numpy (a config read with numpy, a sweep) are ints, as everywhere in cp_rope."""
    import numpy as np

    from cp_rope.parallel import cp_linear_cross_entropy
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(6, 8, dtype=torch.float64, generator=g), torch.randn(11, 8, dtype=torch.float64,
                                                                            generator=g)
    labels = torch.randint(0, 11, (6,), generator=g)
    ref = cp_linear_cross_entropy(h, w, labels, chunk_size=4)
    assert torch.equal(cp_linear_cross_entropy(h, w, labels, chunk_size=np.int64(4)), ref)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(10, 8, requires_grad=True)
    assert torch.equal(_tiled(lin, x, np.int64(3), lin.parameters()), _tiled(lin, x, 3, lin.parameters()))
