"""``cp_rope.parallel.tiled_mlp`` recomputes the function its forward computed (issue 35, item 4).

From DeepSpeed / ArcticTraining's TiledMLP tests: under ``torch.autocast`` the backward
recomputed in float32 (the autograd engine runs backward without autocast), a dropout in
``fn`` drew new masks in backward, and a parameter listed twice got its gradient twice.
``torch.utils.checkpoint`` gets the first two right: the reference here is a tile-by-tile
checkpoint of the same function.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from utils import assert_close

from cp_rope.parallel import tiled_mlp

TILE = 5


def _mlp(d: int = 12, h: int = 20, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(h, d, generator=g) / d**0.5, torch.randn(d, h, generator=g) / h**0.5
    return [w1.requires_grad_(), w2.requires_grad_()]


def _grads(run, x, params, grad_out, autocast: bool = False):
    """Forward (under bf16 autocast when asked), then backward outside it, as trainers do."""
    x = x.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = run(x)
    y.backward(grad_out)
    out = [y.detach(), x.grad, *(p.grad for p in params)]
    for p in params:
        p.grad = None
    return out


def _per_tile_checkpoint(fn):
    return lambda x: torch.cat([checkpoint(fn, t, use_reentrant=False, preserve_rng_state=True)
                                for t in x.split(TILE, dim=-2)], dim=-2)


def test_backward_recomputes_under_the_forwards_autocast():
    params = _mlp()
    seen = []

    def fn(t):
        seen.append(torch.is_autocast_enabled("cpu"))
        return F.linear(F.silu(F.linear(t, params[0])), params[1])

    x, grad_out = torch.randn(2, 13, 12), torch.randn(2, 13, 12)
    got = _grads(lambda t: tiled_mlp(fn, t, TILE, params), x, params, grad_out, autocast=True)
    ref = _grads(_per_tile_checkpoint(fn), x, params, grad_out, autocast=True)
    assert seen[:6] == [True] * 6, f"tiled_mlp's backward recomputed without autocast: {seen[:6]}"
    assert got[0].dtype == torch.bfloat16
    for name, a, b in zip(("out", "grad x"), got[:2], ref[:2], strict=True):
        assert torch.equal(a, b), f"{name}: tiled_mlp != tile-wise checkpoint under autocast"
    # The reference above sums the tiles' bf16 weight gradients into autocast's one cached bf16
    # copy of each weight, rounding to bf16 at every tile; tiled_mlp sums them in float32. So
    # the parameter gradients are compared with each tile's own gradient (one tile per run:
    # one bf16 rounding, no accumulation) summed in float32, in the tiles' order.
    per_tile = [_grads(fn, xt, params, gt, autocast=True)[2:]
                for xt, gt in zip(x.split(TILE, dim=-2), grad_out.split(TILE, dim=-2), strict=True)]
    for i, a in enumerate(got[2:]):
        want = torch.zeros_like(a)
        for grads in per_tile:
            want += grads[i]
        assert_close(a, want, dtype=torch.float32, name=f"param {i} grad")


def test_dropout_draws_the_forwards_masks_again_and_leaves_the_rng_as_it_was():
    params = _mlp(seed=1)

    def fn(t):
        return F.linear(F.dropout(F.silu(F.linear(t, params[0])), p=0.5), params[1])

    x, grad_out = torch.randn(13, 12, dtype=torch.float32), torch.randn(13, 12)
    torch.manual_seed(7)
    got = _grads(lambda t: tiled_mlp(fn, t, TILE, params), x, params, grad_out)
    after_tiled = torch.rand(3)
    torch.manual_seed(7)
    ref = _grads(_per_tile_checkpoint(fn), x, params, grad_out)
    after_ref = torch.rand(3)
    assert torch.equal(got[0], ref[0])  # the same masks in forward
    assert torch.equal(got[1], ref[1]), "grad x: backward drew other dropout masks"
    for a, b in zip(got[2:], ref[2:], strict=True):
        assert_close(a, b, dtype=torch.float32, name="param grad")
    assert torch.equal(after_tiled, after_ref), "the caller's RNG stream moved on differently"


def test_a_parameter_listed_twice_is_refused():
    params = _mlp()
    fn = lambda t: F.linear(F.silu(F.linear(t, params[0])), params[1])
    x = torch.randn(13, 12, requires_grad=True)
    with pytest.raises(ValueError, match=r"params: the tensor at index 2 is listed twice "
                                         r"\(shape \(20, 12\)\)"):
        tiled_mlp(fn, x, TILE, [*params, params[0]])


def test_a_module_parameter_left_out_of_params_is_refused():
    """Before: the left-out bias silently got no gradient (found by the round-4 fresh pass)."""
    mlp = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.SiLU(), torch.nn.Linear(20, 12))
    x = torch.randn(13, 12, requires_grad=True)
    for fn in (mlp, mlp.forward):
        with pytest.raises(ValueError, match=r"params: fn's module parameter '0\.bias' is not "
                                             r"listed \(3 left out\); it would get no gradient"):
            tiled_mlp(fn, x, TILE, [mlp[0].weight])
    mlp[0].bias.requires_grad_(False)  # a frozen parameter needs no listing
    y = tiled_mlp(mlp, x, TILE, [mlp[0].weight, mlp[2].weight, mlp[2].bias])
    y.sum().backward()
    assert mlp[2].bias.grad is not None and mlp[0].bias.grad is None
