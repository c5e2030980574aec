"""Activation checkpointing modes and activation offload (cp_rope.launch.offload): the gradients
of every mode equal those without checkpointing (float64, bit for bit on CPU), selective keeps
the attention kernels' outputs instead of recomputing them, offloaded tensors come back exactly,
the resume guarantee holds with offload on, and the old boolean flag still parses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from utils import tiny_pretrain_argv

from cp_rope.launch.config import ModelConfig
from cp_rope.launch.model import Transformer
from cp_rope.launch.offload import (
    ActivationOffloader,
    checkpoint_flag_argv,
    is_attention_op,
    selective_context,
    wrap_layer,
)
from cp_rope.launch.parallelize import apply_activation_checkpointing, checkpoint_mode
from cp_rope.parallel import tiled_mlp

MODES = [("none", True), ("full", False), ("full", True), ("selective", False), ("selective", True)]


def _grads(model: nn.Module, loss_fn) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_fn(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tile", [0, 16])
@pytest.mark.parametrize("mode,offload", MODES)
def test_native_model_modes_give_the_same_gradients(mode, offload, tile):
    """cp_rope's Transformer (float32: its RoPE kernel's widest dtype; reference attention, two
    documents), untiled and tiled MLP: gradients of every mode == no checkpointing, bit for bit;
    offload moved tensors to host copies."""
    cfg = ModelConfig(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden_dim=48,
                      vocab_size=50, max_seq_len=64, mlp_tile_tokens=tile)
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (41,))
    cu = torch.tensor([0, 19, 41], dtype=torch.int32)

    def loss(m):
        return m(ids, m.attention_plan(cu, 22)).log_softmax(-1).square().mean()

    torch.manual_seed(1)
    ref = Transformer(cfg)
    torch.manual_seed(1)
    model = Transformer(cfg)
    offloader = apply_activation_checkpointing(model, mode, offload=offload)
    assert [b.checkpoint_mode for b in model.layers] == [mode] * 3
    if offload:  # the last layer's tensors stay on the device
        assert offloader.keep_from == 2
    if offload:
        offloader.min_bytes = 0
    expected, got = _grads(ref, loss), _grads(model, loss)
    assert expected.keys() == got.keys()
    for name, g in expected.items():
        assert torch.equal(got[name], g), f"{mode} offload={offload}: {name}"
    if offload:
        assert offloader.bytes_offloaded > 0 and not offloader._pending


class _SDPABlock(nn.Module):
    """A pre-norm attention + MLP block over torch's SDPA (CPU flash kernel in float32)."""

    def __init__(self, d=16, h=2):
        super().__init__()
        self.h, self.norm = h, nn.RMSNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))

    def forward(self, x):
        t, d = x.shape[-2:]
        q, k, v = self.qkv(self.norm(x)).view(1, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.o(a.transpose(1, 2).reshape(1, t, d))
        return h + self.mlp(h)


class _CountAttention(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += is_attention_op(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("offload", [False, True])
def test_selective_replays_the_attention_kernels(offload):
    """selective: each layer's attention kernel runs once (forward), not again in the
    recomputation; full: twice; the gradients equal those without checkpointing."""
    torch.manual_seed(0)
    layers = [nn.ModuleList(_SDPABlock() for _ in range(2)) for _ in range(3)]
    layers[1].load_state_dict(layers[0].state_dict())
    layers[2].load_state_dict(layers[0].state_dict())
    x = torch.randn(1, 24, 16)
    calls, grads = {}, {}
    for mode, stack in zip(("none", "full", "selective"), layers, strict=True):
        off = ActivationOffloader(min_bytes=0) if offload else None
        for i, block in enumerate(stack):
            wrap_layer(block, i, mode, off)
        with _CountAttention() as count:
            h = x
            for block in stack:
                h = block(h)
            h.square().mean().backward()
        calls[mode] = count.calls
        grads[mode] = [p.grad for p in stack.parameters()]
    assert calls == {"none": 2, "full": 4, "selective": 2}, calls
    for mode in ("full", "selective"):
        for a, b in zip(grads["none"], grads[mode], strict=True):
            assert torch.equal(a, b), mode


class _CountingMLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.net, self.calls = nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d)), 0

    def forward(self, h):
        self.calls += 1
        return self.net(h)


class _TiledBlock(_SDPABlock):
    """_SDPABlock with its MLP over tiles of 8 tokens, counting the tile forwards."""

    def __init__(self, d=16):
        super().__init__(d)
        self.mlp = _CountingMLP(d)

    def forward(self, x):
        t, d = x.shape[-2:]
        q, k, v = self.qkv(self.norm(x)).view(1, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.o(a.transpose(1, 2).reshape(1, t, d))
        return h + tiled_mlp(self.mlp, h, 8, list(self.mlp.parameters()))


@pytest.mark.parametrize("offload", [False, True])
def test_selective_keeps_the_tiled_mlps_output(offload):
    """A tiled MLP (3 tiles) runs its tiles twice per step without checkpointing (forward, its
    backward), three times under full (the recomputation too) and under selective without
    offload, twice under selective with offload, which keeps its output; the gradients equal
    those without checkpointing, in float64."""
    torch.manual_seed(0)
    stacks = [nn.ModuleList(_TiledBlock().double() for _ in range(2)) for _ in range(3)]
    for stack in stacks[1:]:
        stack.load_state_dict(stacks[0].state_dict())
    x = torch.randn(1, 24, 16, dtype=torch.float64)
    calls, grads = {}, {}
    for mode, stack in zip(("none", "full", "selective"), stacks, strict=True):
        off = ActivationOffloader(min_bytes=0) if offload else None
        for i, block in enumerate(stack):
            wrap_layer(block, i, mode, off)
        h = x
        for block in stack:
            h = block(h)
        h.square().mean().backward()
        calls[mode] = sum(b.mlp.calls for b in stack)
        grads[mode] = [p.grad for p in stack.parameters()]
    assert calls == {"none": 12, "full": 18, "selective": 12 if offload else 18}, calls
    for mode in ("full", "selective"):
        for a, b in zip(grads["none"], grads[mode], strict=True):
            assert torch.equal(a, b), mode


class _AttentionMLP(nn.Module):
    """A position-wise fn with a dropout and an attention op over each row alone (a tile's fn may
    call an attention op: the replay, which does not run the tiles, must not expect it)."""

    def __init__(self, d=16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Dropout(0.3), nn.Linear(2 * d, d))

    def forward(self, h):
        r = h.float()[..., None]  # [1, T heads, d positions, 1]: attention within a row;
        # float32, 4-D: SDPA's CPU flash kernel, one of ATTENTION_OPS (float64: the math path)
        return self.net(h + F.scaled_dot_product_attention(r, r, r)[..., 0].to(h.dtype))


class _DropoutBlock(nn.Module):
    """A tiled _AttentionMLP, then a residual dropout."""

    def __init__(self, d=16):
        super().__init__()
        self.norm, self.mlp = nn.RMSNorm(d), _AttentionMLP(d)

    def forward(self, x):
        y = tiled_mlp(self.mlp, self.norm(x), 8, list(self.mlp.parameters()))
        return x + F.dropout(y, 0.3, training=True)


def test_selective_with_offload_replays_the_tiles_rng_draws():
    """Selective + offload skips the tiles in the recomputation: the residual dropout after
    them must still draw the forward's mask (the kept RNG state), and the attention op inside
    a tile is not kept (the replay does not run the tiles); gradients == no checkpointing."""
    grads = {}
    for mode, offload in (("none", False), ("selective", True), ("full", True)):
        torch.manual_seed(0)
        blocks = nn.ModuleList(_DropoutBlock().double() for _ in range(2))
        off = ActivationOffloader(min_bytes=0) if offload else None
        for i, b in enumerate(blocks):
            wrap_layer(b, i, mode, off)
        x = torch.randn(1, 24, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        torch.manual_seed(123)
        h = x
        for b in blocks:
            h = b(h)
        h.square().mean().backward()
        grads[mode] = [p.grad for p in blocks.parameters()]
    for mode in ("selective", "full"):
        for a, b in zip(grads["none"], grads[mode], strict=True):
            assert torch.equal(a, b), mode


def test_selective_refuses_a_recomputation_that_diverges():
    fwd, rec = selective_context()
    q = torch.randn(1, 2, 8, 4)
    with fwd:
        F.scaled_dot_product_attention(q, q, q)
    fwd.kept.clear()  # as if the forward had made no attention call
    with pytest.raises(RuntimeError, match="recomputation called"), rec:
        F.scaled_dot_product_attention(q, q, q)


def test_offloader_brings_back_views_and_shared_storage_once():
    """Two views of one storage are copied once; both come back with their own shapes; the
    gradients are those of the plain graph; small tensors stay put."""
    off = ActivationOffloader(min_bytes=64)
    w = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    x = torch.randn(6, 6, dtype=torch.float64)

    def f():
        y = x @ w  # saves x (288 bytes) ...
        return (y.t() * y.t()).sum() + (y[:2] ** 3).sum()  # ... and views of y

    expected = torch.autograd.grad(f(), w)[0]
    with off.layer(0):
        z = f()
    z.backward()
    assert torch.equal(w.grad, expected)
    assert off.bytes_offloaded == 2 * 36 * 8  # x and y's storage, once each
    with pytest.raises(ValueError, match="min_bytes"):
        ActivationOffloader(min_bytes=-1)


def test_bad_mode_names_the_field():
    with pytest.raises(ValueError, match="model.activation_checkpointing='some'"):
        checkpoint_mode("some")
    assert checkpoint_mode(True) == "full" and checkpoint_mode(False) == "none"
    with pytest.raises(ValueError, match="mode must be one of"):
        wrap_layer(nn.Linear(2, 2), 0, "partial")


def test_the_former_boolean_flag_still_parses():
    from cp_rope.launch.cli import parse_args

    assert checkpoint_flag_argv(["--activation-checkpointing"]) == ["--activation-checkpointing",
                                                                    "full"]
    for argv, mode in ((["--activation-checkpointing", "--dim", "64"], "full"),
                       (["--activation-checkpointing", "selective"], "selective"),
                       (["--no-activation-checkpointing"], "none"), ([], "none"),
                       (["--preset", "8b"], "full")):
        cfg = parse_args(argv)
        assert cfg.model.activation_checkpointing == mode, argv
    cfg = parse_args(["--offload-activations", "--memory", "auto"])
    assert cfg.model.offload_activations and cfg.model.memory == "auto"


def test_resume_bit_for_bit_with_offload_and_selective(tmp_path):
    """Steps 1..4 at once == steps 1..2, checkpoint, resume, 3..4 with --offload-activations
    --activation-checkpointing selective (one process, CPU)."""
    from cp_rope.launch.pretrain import main

    flags = tiny_pretrain_argv(max_docs=20) + ["--activation-checkpointing", "selective",
                                               "--offload-activations", "--steps", "4",
                                               "--cp-self-test", "off"]
    full = main(flags + ["--out-dir", str(tmp_path / "full")])
    main(flags + ["--out-dir", str(tmp_path / "split"), "--stop-at-step", "2"])
    second = main(flags + ["--out-dir", str(tmp_path / "split"), "--resume"])
    assert second["start_step"] == 2
    for step in (3, 4):
        assert second["losses"][step] == full["losses"][step], step
    assert all(math.isfinite(v) for v in full["losses"].values())


@pytest.mark.parametrize("mode,offload", [("full", True), ("selective", False)])
def test_transformers_decoder_layers_give_the_same_gradients(mode, offload):
    """wrap_layer on a transformers Qwen3 model's decoder layers (keyword arguments, position
    embeddings, float64): gradients == no checkpointing, bit for bit."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.Qwen3Config(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
                                   vocab_size=61, attn_implementation="eager")
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).double()
    model = transformers.AutoModelForCausalLM.from_config(cfg).double()
    model.load_state_dict(ref.state_dict())
    off = ActivationOffloader(min_bytes=0) if offload else None
    for i, layer in enumerate(model.model.layers):
        wrap_layer(layer, i, mode, off)
    ids = torch.randint(0, 61, (1, 23))

    def loss(m):
        return m(input_ids=ids).logits.log_softmax(-1).square().mean()

    expected, got = _grads(ref, loss), _grads(model, loss)
    for name, g in expected.items():
        assert torch.equal(got[name], g), f"{mode}: {name}"


def _cp2_body(rank, world_size):
    """cp 2 over gloo (ring): each rank's gradients of every mode with offload == no
    checkpointing, bit for bit (the recomputation runs the ring's exchanges again)."""
    import torch.distributed as dist

    from cp_rope.parallel import PackingCollator, shard_batch

    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=48,
                      vocab_size=50, max_seq_len=64)
    g = torch.Generator().manual_seed(5)
    docs = [{"input_ids": torch.randint(0, 50, (n,), generator=g)} for n in (13, 22, 7)]
    batch = shard_batch(PackingCollator(cp_size=2)(docs), 2, rank)
    grads = {}
    for mode, offload in [("none", False), ("full", True), ("selective", True)]:
        torch.manual_seed(1)
        model = Transformer(cfg)
        model.configure_attention(cp_group=dist.group.WORLD)
        off = apply_activation_checkpointing(model, mode, offload=offload)
        if off is not None:
            off.min_bytes = 0
        out = model(batch.input_ids, model.attention_plan(batch))
        out.log_softmax(-1).square().mean().backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
    for mode in ("full", "selective"):
        for name, ref in grads["none"].items():
            assert torch.equal(grads[mode][name], ref), f"rank {rank} {mode}: {name}"


def test_cp2_ring_modes_with_offload_give_the_same_gradients():
    from dist_utils import run_distributed

    run_distributed(_cp2_body, 2, timeout_s=120)


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_offloader_keeps_the_last_layers_on_the_device(mode):
    """keep_from=2 of 3 layers: the last layer's tensors are not copied out (fewer bytes than
    keeping none), the gradients are those without offload, bit for bit, and the first unpack
    of the kept layer brings the layer before back (nothing of it is pending after backward)."""
    torch.manual_seed(0)
    stacks = [nn.ModuleList(_SDPABlock() for _ in range(3)) for _ in range(3)]
    for s in stacks[1:]:
        s.load_state_dict(stacks[0].state_dict())
    x = torch.randn(1, 24, 16, dtype=torch.float64)
    grads, sent = [], []
    for stack, off in zip(stacks, (None, ActivationOffloader(min_bytes=0),
                                   ActivationOffloader(min_bytes=0, keep_from=2)), strict=True):
        stack.double()
        for i, block in enumerate(stack):
            wrap_layer(block, i, mode, off)
        brought = []
        if off is not None:
            inner = off._bring_back
            off._bring_back = lambda g, inner=inner, log=brought: (log.append(g), inner(g))[1]
        h = x
        for block in stack:
            h = block(h)
        h.square().mean().backward()
        grads.append([p.grad for p in stack.parameters()])
        sent.append(None if off is None else off.bytes_offloaded)
        if off is not None:
            assert not any(off._pending.values()), "a layer was never brought back"
            # backward's first unpack is of the last layer: kept, it prefetches layer 1
            assert brought[0] == (1 if off.keep_from == 2 else 2), brought
    for got in grads[1:]:
        for a, b in zip(grads[0], got, strict=True):
            assert torch.equal(a, b)
    assert 0 < sent[2] < sent[1]
    with pytest.raises(ValueError, match="keep_from"):
        ActivationOffloader(keep_from=-1)


class _SideOutput(nn.Module):
    """A layer that keeps a softmax of its pre-activation as a side output (e.g. router
    probabilities for a log), which the loss does not use."""

    def __init__(self):
        super().__init__()
        self.w, self.aux = nn.Linear(16, 16).double(), None

    def forward(self, x):
        h = self.w(x)
        self.aux = torch.softmax(h, -1)
        return h.tanh()


@pytest.mark.parametrize("backward", [True, False])
def test_a_kept_layer_frees_what_it_saved(backward):
    """keep_from: the kept layer's saved tensors are freed with the graph, after backward or
    when the graph is dropped without one (a tensor saved live would close a reference cycle
    through its own grad_fn that the garbage collector cannot break)."""
    import gc
    import weakref

    layers = nn.ModuleList([_SideOutput(), _SideOutput()])
    off = ActivationOffloader(min_bytes=0, keep_from=1)
    for i, layer in enumerate(layers):
        wrap_layer(layer, i, "none", off)
    refs = []
    for _ in range(2):
        h = torch.randn(8, 16, dtype=torch.float64)
        for layer in layers:
            h = layer(h)
        refs.append(weakref.ref(layers[1].aux))
        if backward:
            h.square().mean().backward()
        del h
        layers[0].aux = layers[1].aux = None
        gc.collect()
    assert all(r() is None for r in refs)


def test_a_kept_layer_refuses_an_inplace_change_of_what_it_saved():
    """keep_from: an in-place write to a saved tensor of the kept layer raises as autograd does
    without the hooks (never silently wrong gradients)."""

    class InPlace(nn.Module):
        def forward(self, x):
            y = x.exp()
            z = y * 1.0
            y.mul_(2)  # exp's backward needs y
            return z

    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        InPlace()(x).sum().backward()  # autograd's own check
    layer = InPlace()
    wrap_layer(layer, 0, "none", ActivationOffloader(min_bytes=0, keep_from=0))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        layer(x).sum().backward()
