"""GPU-only checks of the RoPE kernel: how many Triton kernels a sweep of batch
shapes compiles (Dynamo's graph counter cannot see Triton specializing integer
arguments inside the op; Triton's JIT cache hook can, as flash-attn's
``test_compilation_count`` does)."""

from __future__ import annotations

import pytest
import torch

from cp_rope import apply_rotary_emb, apply_rotary_emb_qk, global_positions, rope_cache

# (dtype, interleaved, rotary_dim, head_dim): one group of kernel variants each
GROUPS = [(torch.bfloat16, False, 128, 128), (torch.float16, True, 64, 128),
          (torch.float32, False, 32, 80), (torch.bfloat16, True, 96, 96)]


def _install_hook(record):
    """Point Triton's JIT cache hook (called before every compilation) at ``record``;
    return a function that restores the previous hook."""
    import triton

    def hook(*args, **kwargs):
        record.append(kwargs.get("repr") or kwargs.get("key") or args)
        return False  # compile as usual

    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if knobs is not None and hasattr(knobs, "jit_cache_hook"):  # triton >= 3.4
        old = knobs.jit_cache_hook
        knobs.jit_cache_hook = hook
        return lambda: setattr(knobs, "jit_cache_hook", old)
    from triton.runtime.jit import JITFunction

    old = JITFunction.cache_hook
    JITFunction.cache_hook = hook
    return lambda: setattr(JITFunction, "cache_hook", old)


def _sweep(dtype, interleaved, rotary_dim, head_dim, plan_positions=False):
    """Forward and backward over odd/even T (not multiples of 16), n_seqs 1..4096,
    cp_size 1..4 at every rank, q/k head counts 1, 3, 8, 32 (k also absent).
    ``plan_positions``: the positions as a plan passes them (int32 ``position_ids``,
    cp_size 1) instead of the CP formula."""
    dev = torch.device("cuda")
    cos, sin = rope_cache(1 << 16, rotary_dim, device=dev)
    torch.manual_seed(0)
    for n_tokens, n_seqs in [(1, 1), (17, 3), (16, 8), (255, 100), (8193, 4096), (4096, 1)]:
        for cp_size in (1, 2, 3, 4):
            if cp_size > 1 and n_tokens < 2 * n_seqs:
                continue
            lens = torch.full((n_seqs,), n_tokens // n_seqs // 2 * 2 if cp_size > 1 else n_tokens // n_seqs)
            cu = torch.cat((torch.zeros(1, dtype=torch.int64), lens.cumsum(0))).to(dev, torch.int32)
            for cp_rank in range(cp_size):
                for hq, hk in [(1, 1), (3, 1), (8, 3), (32, 8), (32, 0)]:
                    q = torch.randn(n_tokens, hq, head_dim, device=dev, dtype=dtype).requires_grad_()
                    kw = dict(cp_size=cp_size, cp_rank=cp_rank, interleaved=interleaved)
                    if plan_positions:
                        pos = torch.zeros(n_tokens, dtype=torch.int32, device=dev)
                        pos[: int(cu[-1])] = global_positions(cu, cp_size, cp_rank)
                        kw = dict(interleaved=interleaved, position_ids=pos)
                    if hk:
                        k = torch.randn(n_tokens, hk, head_dim, device=dev, dtype=dtype).requires_grad_()
                        outs = apply_rotary_emb_qk(q, k, cos, sin, cu, **kw)
                    else:
                        outs = (apply_rotary_emb(q, cos, sin, cu, **kw),)
                    torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("plan_positions", [False, True], ids=["formula", "plan_positions"])
@pytest.mark.parametrize("group", GROUPS, ids=lambda g: f"{str(g[0])[6:]}-{'il' if g[1] else 'half'}-r{g[2]}-d{g[3]}")
def test_kernel_compilations_per_group(group, plan_positions):
    """Exactly two kernels (forward and backward, i.e. CONJUGATE off and on) per
    (dtype, interleaved, rotary_dim, head_dim) and position source (the CP formula,
    or a plan's ``position_ids``: the ``HAS_POS_IDS`` flag) across the whole sweep:
    T, n_seqs, cp_size, cp_rank and head counts never specialize the kernel."""
    from cp_rope.kernel import _rope_kernel

    if hasattr(_rope_kernel, "device_caches"):
        _rope_kernel.device_caches.clear()  # forget kernels earlier tests compiled in this process
    compiled = []
    restore = _install_hook(compiled)
    try:
        _sweep(*group, plan_positions=plan_positions)
    finally:
        restore()
    assert len(compiled) == 2, f"{len(compiled)} compilations:\n" + "\n".join(map(str, compiled))
