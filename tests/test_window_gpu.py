"""GPU: the windowed and sink paths of the GPU block backends against a float32 reference.

* Every block of the windowed schedules (ring steps of cp 2 and 4, all-gather, ranks
  0 .. C-1; the causal-window diagonal, the unmasked and the bottom-right ``(0, -1)``
  "halo" pieces, with the keyless and queryless filler segments) run by ``torch_flash``
  (aten's flash with ``window_size_left/right``) and, when importable, ``flash_attn``, in
  bf16, forward (out, LSE) and backward (dq, dk, dv with the block's own out / LSE)
  against the reference backend in float32 on the same bf16 inputs.
* cp 1 end to end: ``context_parallel_attention(window=W, sinks=...)`` on torch_flash
  against ``tests/window_utils.py``'s oracle in float32 (edge layouts: one-token and
  zero-length documents, W = 1, W above every document), sinks' gradient included.
* A windowed plan refuses torch_cudnn by name; cudnn runs it on torch_flash / flash_attn /
  fa4 (choices.WINDOW_FALLBACK). fa4's windowed blocks: tests/test_window_fa4_gpu.py.

Run by ``scripts/gpu_smoke.sh`` (``-m gpu``); skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from utils import assert_close
from window_utils import layout_blocks, window_attention

from cp_rope.parallel import _compat, attention_plan, context_parallel_attention
from cp_rope.parallel._blocks import _Reference, get_backend

pytestmark = pytest.mark.gpu

BF16 = {"atol": 2e-2, "rtol": 2e-2}  # bf16 inputs, kernels' bf16 outputs vs fp32 math
# Gradients: the kernels round P and dS to bf16 (unit roundoff 2^-8) before the backward's
# matmuls, so dq / dk / dv carry that error summed over the block's keys / queries: the same
# bf16 gradient tolerance as tests/test_attention_gpu.py's cuDNN checks.
BF16_GRAD = {"atol": 3.5e-2, "rtol": 3.5e-2}


def _backends():
    names = ["torch_flash"] + (["flash_attn"] if _compat.flash_attn_available() else [])
    return names


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("C,W", [(2, 5), (2, 17), (4, 2), (4, 9)])
def test_windowed_blocks_match_reference(backend, C, W):
    gen = torch.Generator(device="cuda").manual_seed(C * 100 + W)
    be, ref = get_backend(backend, torch.zeros(1, 1, 64, dtype=torch.bfloat16, device="cuda"), 2,
                          windowed=True), _Reference()
    for r in range(C):
        n_q, blocks = layout_blocks(C, r, W, "cuda")
        for blk, n_k in blocks:
            q = torch.randn(n_q, 8, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(n_k, 2, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
            do = torch.randn_like(q)
            [(_, out, lse)], aux = be.forward(q, k, v, blk, 0.125)
            [(_, rout, rlse)], _ = ref.forward(q, k, v, blk, 0.125)
            seen = rlse > float("-inf")
            what = f"{backend} cp{C} r{r} W={W} {blk.causal} {blk.window}"
            assert_close(out.float()[seen.T.any(1)], rout[seen.T.any(1)], name=what, **BF16)
            assert bool(((lse == float("-inf")) == ~seen).all()), what
            assert_close(lse[seen], rlse[seen], name=what, atol=1e-3, rtol=1e-3)
            o16 = rout.to(torch.bfloat16)
            [(_, dq, _, dk, dv)] = be.backward(do, q, k, v, o16, rlse.float(), blk, 0.125, aux)
            [(_, rdq, _, rdk, rdv)] = ref.backward(do, q, k, v, o16, rlse, blk, 0.125, None)
            for name, g, rg in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
                rows = slice(0, int(blk.cu_q_host[-1])) if name == "dq" else slice(
                    0, int(blk.cu_k_host[-1]))
                assert_close(g[rows].float(), rg[rows], name=f"{name} {what}", **BF16_GRAD)


@pytest.mark.parametrize("W", [1, 3, 16, 1000])
def test_cp1_window_and_sinks_torch_flash(W):
    gen = torch.Generator(device="cuda").manual_seed(W)
    cu = [0, 1, 1, 40, 41, 100]
    q, k, v, do = (torch.randn(cu[-1], h, 64, generator=gen, device="cuda") for h in (8, 2, 2, 8))
    sinks = torch.randn(8, generator=gen, device="cuda")
    ins = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    plan = attention_plan(cu_t, 59, q_heads=8, kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                          backend="torch_flash", window=W, sinks=True)
    out, lse = context_parallel_attention(*ins[:3], plan=plan, sinks=ins[3], return_lse=True)
    grads = torch.autograd.grad((out.float() * do).sum(), ins)
    ref_ins = [t.detach().float().requires_grad_() for t in ins]
    rout, rlse = window_attention(*ref_ins[:3], cu, W, ref_ins[3], 0.125)
    rgrads = torch.autograd.grad((rout * do).sum(), ref_ins)
    assert_close(out.float(), rout, name="out", **BF16)
    assert_close(lse, rlse, name="lse", atol=1e-3, rtol=1e-3)
    for name, g, rg in zip(("dq", "dk", "dv", "dsinks"), grads, rgrads, strict=True):
        assert_close(g.float(), rg, name=name, atol=5e-2, rtol=5e-2)


def test_windowed_plan_refuses_torch_cudnn_and_cudnn_falls_back():
    q = torch.zeros(8, 2, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="does not run sliding-window blocks"):
        get_backend("torch_cudnn", q, 1, windowed=True)
    assert get_backend("cudnn", q, 1, windowed=True).name in ("fa4", "flash_attn", "torch_flash")
    assert get_backend("auto", q, 1, windowed=True).name in ("fa4", "flash_attn", "torch_flash")
