"""Sequence-tiled MLP: a position-wise module run over tiles of tokens inside one autograd node.

Arctic Long Sequence Training's ``TiledMLP`` (ALST, arXiv 2506.13996, Sec. 3.2):
a SwiGLU MLP's ``[T, ffn_hidden]`` intermediates (the gate, the up projection,
their product, and what autograd saves of them) are the largest activations of
a long-context layer. The MLP acts on every token alone, so it can run over
tiles of ``tile_tokens`` tokens: forward runs each tile without autograd and
writes its rows of the output; backward recomputes each tile with autograd and
back-propagates that tile's rows of the incoming gradient, summing the
parameter gradients over the tiles. Only one tile's intermediates exist at any
time, and autograd saves only the input ``[T, d]``. Cost: the MLP's forward
runs twice (once more in backward), as under activation checkpointing.

Unlike ALST's version (which accumulates into ``param.grad`` itself), the
parameter gradients leave through the autograd node's own outputs, so FSDP2's
reduce-scatter hooks, gradient accumulation and tied weights behave as with an
untiled module.

Under activation checkpointing the layer's recomputation would run the tiles a third time
for an output nothing in backward reads (the node recomputes its tiles itself):
:func:`tiled_output_hook` lets the checkpointing keep the forward's output and hand it back in
the recomputation instead (``selective`` in :mod:`cp_rope.launch.offload`).

Like ``torch.utils.checkpoint`` (its ``preserve_rng_state`` and autocast handling), the
backward recomputes under the autocast state of the forward (the autograd engine runs
backward without it) and from the RNG state the forward started from (a dropout in ``fn``
draws the same masks again), restoring the caller's RNG state afterwards.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import numbers
from collections.abc import Callable, Sequence

import torch

__all__ = ["tiled_mlp", "check_tile_tokens", "tiled_output_hook"]

_OUTPUT_HOOK: contextvars.ContextVar = contextvars.ContextVar("cp_rope_tiled_output", default=None)


@contextlib.contextmanager
def tiled_output_hook(hook: Callable[[Callable[[], torch.Tensor]], torch.Tensor]):
    """Within the ``with`` block (this thread), every tiled MLP node (:func:`tiled_mlp` with
    autograd) produces its output as ``hook(compute)``, where ``compute()`` runs the tiles and
    returns the output: a checkpointed layer's forward keeps what ``compute()`` returns, and its
    recomputation returns that instead of calling ``compute`` (the node's backward recomputes the
    tiles from its saved input either way, so the values are the same)."""
    token = _OUTPUT_HOOK.set(hook)
    try:
        yield
    finally:
        _OUTPUT_HOOK.reset(token)


def check_tile_tokens(tile_tokens, name: str = "tile_tokens") -> int:
    """``tile_tokens`` as an int >= 1; TypeError/ValueError naming ``name`` otherwise."""
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, numbers.Integral):
        raise TypeError(f"{name} must be an int (tokens per MLP tile), got "
                        f"{type(tile_tokens).__name__}")
    tile_tokens = int(tile_tokens)  # numpy / torch integers too, like the rest of cp_rope
    if tile_tokens < 1:
        raise ValueError(f"{name}={tile_tokens}: must be >= 1 token per MLP tile")
    return tile_tokens


def _autocast_state(device_type: str) -> list[tuple[str, bool, torch.dtype, bool]]:
    """The autocast settings now in force for ``device_type`` and the CPU (what checkpoint
    records): ``(device_type, enabled, dtype, cache_enabled)`` each."""
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d),
             torch.is_autocast_cache_enabled()) for d in dict.fromkeys((device_type, "cpu"))]


def _replay_rng(ctx) -> contextlib.ExitStack:
    """The RNG state the forward started from, the caller's restored on exit."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.random.fork_rng(devices=ctx.rng_devices, device_type=ctx.device_type))
    torch.set_rng_state(ctx.cpu_rng)
    if ctx.device_rng is not None:
        getattr(torch, ctx.device_type).set_rng_state(ctx.device_rng, ctx.rng_devices[0])
    return stack


def _autocast(ctx) -> contextlib.ExitStack:
    """The forward's autocast state (backward runs without it)."""
    stack = contextlib.ExitStack()
    for d, enabled, dtype, cache in ctx.autocast:
        stack.enter_context(torch.autocast(d, dtype=dtype, enabled=enabled, cache_enabled=cache))
    return stack


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tile, dim, x, *params):
        ctx.fn, ctx.tile, ctx.dim = fn, tile, dim
        ctx.params = params  # the tensors themselves: fn reads them again in backward
        ctx.save_for_backward(x)
        ctx.device_type = x.device.type
        ctx.autocast = _autocast_state(x.device.type)
        ctx.cpu_rng = torch.get_rng_state()
        device = x.device.type != "cpu" and getattr(torch, x.device.type, None)
        ctx.rng_devices = [x.device] if device else []
        ctx.device_rng = device.get_rng_state(x.device) if device else None
        hook = _OUTPUT_HOOK.get()
        compute = functools.partial(_tiles, fn, tile, dim, x)
        return compute() if hook is None else hook(compute)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        fn, tile, dim = ctx.fn, ctx.tile, ctx.dim
        need_x, need_p = ctx.needs_input_grad[3], ctx.needs_input_grad[4:]
        params = [p for p, need in zip(ctx.params, need_p, strict=True) if need]
        grad_x = torch.empty_like(x) if need_x else None
        acc: list = [None] * len(params)  # per parameter: the sum over tiles, >= float32
        n = x.shape[dim]
        with _replay_rng(ctx):  # the tiles draw in forward's order: the same masks again
            for s in range(0, n, tile):
                acc, grad_x = _tile_backward(ctx, fn, x, grad_out, dim, s, min(tile, n - s),
                                             need_x, params, acc, grad_x)
        it = iter([torch.zeros_like(p) if a is None else a.to(p.dtype)
                   for a, p in zip(acc, params, strict=True)])
        return (None, None, None, grad_x, *[next(it) if need else None for need in need_p])


def _tile_backward(ctx, fn, x, grad_out, dim, s, m, need_x, params, acc, grad_x):
    """One tile of backward: recompute ``fn`` on rows ``[s, s + m)`` under the forward's
    autocast, back-propagate their rows of ``grad_out``, add to the parameter sums."""
    xt = x.narrow(dim, s, m).detach().requires_grad_(need_x)
    with torch.enable_grad(), _autocast(ctx):
        y = fn(xt)
    grads = torch.autograd.grad(y, ([xt] if need_x else []) + params,
                                grad_out.narrow(dim, s, m), allow_unused=True)
    if need_x:
        grad_x.narrow(dim, s, m).copy_(grads[0])
        grads = grads[1:]
    for i, g in enumerate(grads):
        if g is None:
            continue
        if acc[i] is None:  # the first tile's gradient (a fresh tensor) starts the sum
            acc[i] = g.to(torch.promote_types(g.dtype, torch.float32))
        else:
            acc[i] += g
    return acc, grad_x


def _tiles(fn, tile, dim, x):
    n = x.shape[dim]
    outs = []
    for s in range(0, n, tile):
        m = min(tile, n - s)
        y = fn(x.narrow(dim, s, m))
        if not isinstance(y, torch.Tensor) or y.dim() != x.dim() or y.shape[dim] != m:
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(f"fn: not position-wise along dim={dim}: a tile of shape "
                             f"{tuple(x.narrow(dim, s, m).shape)} gave {got} (tiled_mlp needs "
                             "one output row per input row)")
        outs.append(y)
    return torch.cat(outs, dim=dim) if len(outs) != 1 else outs[0]


def tiled_mlp(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile_tokens: int,
              params: Sequence[torch.Tensor], *, dim: int = -2) -> torch.Tensor:
    """``fn(x)`` computed over tiles of ``tile_tokens`` tokens along ``dim`` (module docstring).

    Args:
        fn: a position-wise function of ``x`` (e.g. a SwiGLU MLP's forward): row ``i``
            of its output along ``dim`` depends on row ``i`` of its input only, and on
            ``params``. Called once per tile in forward (without autograd) and again
            in backward (with autograd).
        x: ``[..., T, d]`` (``dim=-2``: the token dimension), any float dtype.
        tile_tokens: tokens per tile, >= 1; ``T <= tile_tokens`` runs ``fn`` untiled.
        params: every tensor ``fn`` reads that may need a gradient (the module's
            parameters, in the order autograd should return them).
        dim: the token dimension of ``x``.

    Returns: ``fn(x)``, differentiable in ``x`` and ``params``; parameter gradients are
    summed over tiles in at least float32, then cast to each parameter's dtype.

    Backward recomputes each tile under the forward's autocast state and RNG state (as
    ``torch.utils.checkpoint`` with ``preserve_rng_state``), so a dropout in ``fn`` draws
    the forward's masks again.

    Raises: TypeError/ValueError naming ``tile_tokens`` when it is not an int >= 1,
    ``fn`` (not callable; an output without one row per input row), ``x``, ``dim`` (not a
    dimension of ``x``) or ``params`` (not tensors; a tensor listed twice; a trainable
    parameter of ``fn``'s module, when ``fn`` is an ``nn.Module`` or its bound method,
    left out: it would get no gradient).
    """
    tile = check_tile_tokens(tile_tokens)
    if not callable(fn):
        raise TypeError(f"fn must be callable (the MLP's forward), got {type(fn).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim!r}: not a dimension of x (shape {tuple(x.shape)}); the "
                         "token dimension is meant (default -2 of [..., T, d])")
    dim = dim % x.dim()
    params = list(params)
    bad = [type(p).__name__ for p in params if not isinstance(p, torch.Tensor)]
    if bad:
        raise TypeError(f"params must be tensors (the parameters fn reads), got {bad[0]}")
    twice = [i for i, p in enumerate(params) if any(p is q for q in params[:i])]
    if twice:  # autograd would return its gradient once per listing: counted twice
        raise ValueError(f"params: the tensor at index {twice[0]} is listed twice (shape "
                         f"{tuple(params[twice[0]].shape)}); list each parameter once")
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):  # a parameter left out would get no gradient
        left_out = [n for n, p in owner.named_parameters()
                    if p.requires_grad and not any(p is q for q in params)]
        if left_out:
            raise ValueError(f"params: fn's module parameter {left_out[0]!r} is not listed "
                             f"({len(left_out)} left out); it would get no gradient: pass "
                             "list(module.parameters())")
    if x.shape[dim] <= tile:
        return fn(x)
    if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in params)):
        return _tiles(fn, tile, dim, x)  # nothing to differentiate: tiles without the node
    return _TiledMLP.apply(fn, tile, dim, x, *params)
