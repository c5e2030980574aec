"""GPU: the ``fa4`` backend's windowed blocks and sinks against a float32 reference.

* Every block of the windowed schedules (ring steps and all-gather of cp 2 and 4, every
  rank: the causal local diagonal FA4 gets as ``window_size=(W - 1, 0)``, the unmasked pieces
  and the bottom-right halo pieces as ``(0, None)``; keyless and queryless filler segments) on
  fa4 in bf16, forward (out, LSE) and backward (dq, dk, dv from the block's own out / LSE)
  against the reference backend in float32 on the same inputs; windows W = 1, chunk - 1,
  chunk, chunk + 1 and longer than every document (chunk: the longest document's, 16 rows).
* cp 1 end to end on fa4 and on auto (which takes fa4 for a windowed plan where it runs):
  ``context_parallel_attention(window=W, sinks=...)`` against tests/window_utils.py's oracle in
  float32 (one-token and zero-length documents, W = 1 and W above every document), the
  sinks' gradient included (cp_rope's, from the merged LSE: FA4's learnable_sink is unused).
* a ring of cp 2 simulated on one GPU with a window and sinks: fa4 against the reference
  backend on the same plans (float32 math on the same bf16 inputs).

Run by ``scripts/gpu_smoke.sh`` (its fa4 part); skipped without CUDA or FA4.

    python -m pytest -m gpu tests/test_window_fa4_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch
from utils import assert_close
from window_utils import layout_blocks, window_attention

from cp_rope.parallel import CPAttentionPlan, attention_plan, context_parallel_attention
from cp_rope.parallel._blocks import _Reference, backend_unavailable, get_backend

pytestmark = pytest.mark.gpu

BF16 = {"atol": 2e-2, "rtol": 2e-2}  # bf16 inputs, kernels' bf16 outputs vs fp32 math
BF16_GRAD = {"atol": 3.5e-2, "rtol": 3.5e-2}  # as tests/test_window_gpu.py: bf16 P and dS


@pytest.fixture(autouse=True)
def _needs_fa4():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    why = backend_unavailable("fa4", device="cuda", dtype=torch.bfloat16, head_dim=64)
    if why is not None:
        pytest.skip(f"fa4: {why}")


@pytest.mark.parametrize("C,W", [(2, 1), (2, 15), (2, 16), (2, 17), (4, 9), (4, 1000)])
def test_fa4_windowed_blocks_match_reference(C, W):
    gen = torch.Generator(device="cuda").manual_seed(C * 100 + W)
    be = get_backend("fa4", torch.zeros(1, 1, 64, dtype=torch.bfloat16, device="cuda"), 2,
                     windowed=True)
    ref = _Reference()
    assert be.name == "fa4"
    for r in range(C):
        n_q, blocks = layout_blocks(C, r, W, "cuda")
        for blk, n_k in blocks:
            q = torch.randn(n_q, 8, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(n_k, 2, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
            do = torch.randn_like(q)
            parts, aux = be.forward(q, k, v, blk, 0.125)
            [(_, rout, rlse)], _ = ref.forward(q, k, v, blk, 0.125)
            seen = rlse > float("-inf")
            what = f"fa4 cp{C} r{r} W={W} causal={blk.causal} window={blk.window}"
            rows = seen.T.any(1)
            if not parts:  # no query or no key in the block: nothing seen
                assert not bool(rows.any()), what
                continue
            [(_, out, lse)] = parts
            assert_close(out.float()[rows], rout[rows], name=what, **BF16)
            n_valid = int(blk.cu_q_host[-1])
            assert bool(((lse[:, :n_valid] == float("-inf")) == ~seen[:, :n_valid]).all()), what
            assert_close(lse[seen], rlse[seen], name=what, atol=1e-3, rtol=1e-3)
            o16 = rout.to(torch.bfloat16)
            [(_, dq, _, dk, dv)] = be.backward(do, q, k, v, o16, rlse.float().contiguous(), blk,
                                               0.125, aux)
            [(_, rdq, _, rdk, rdv)] = ref.backward(do, q, k, v, o16, rlse, blk, 0.125, None)
            for name, g, rg in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
                n = n_valid if name == "dq" else int(blk.cu_k_host[-1])
                assert_close(g[:n].float(), rg[:n], name=f"{name} {what}", **BF16_GRAD)


@pytest.mark.parametrize("backend", ["fa4", "auto"])
@pytest.mark.parametrize("W", [1, 3, 16, 1000])
def test_cp1_window_and_sinks_fa4(backend, W):
    gen = torch.Generator(device="cuda").manual_seed(W)
    cu = [0, 1, 1, 40, 41, 100, 357]
    q, k, v, do = (torch.randn(cu[-1], h, 64, generator=gen, device="cuda") for h in (8, 2, 2, 8))
    sinks = torch.randn(8, generator=gen, device="cuda")
    ins = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    plan = attention_plan(cu_t, 257, q_heads=8, kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                          backend=backend, window=W, sinks=True)
    out, lse = context_parallel_attention(*ins[:3], plan=plan, sinks=ins[3], return_lse=True)
    grads = torch.autograd.grad((out.float() * do).sum(), ins)
    ref_ins = [t.detach().float().requires_grad_() for t in ins]
    rout, rlse = window_attention(*ref_ins[:3], cu, W, ref_ins[3], 0.125)
    rgrads = torch.autograd.grad((rout * do).sum(), ref_ins)
    what = f"{backend} W={W}"
    assert_close(out.float(), rout, name=f"out {what}", **BF16)
    assert_close(lse, rlse, name=f"lse {what}", atol=1e-3, rtol=1e-3)
    for name, g, rg in zip(("dq", "dk", "dv", "dsinks"), grads, rgrads, strict=True):
        assert_close(g.float(), rg, name=f"{name} {what}", atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_ring_cp2_window_simulated_fa4_equals_reference(method):
    """Each rank of cp 2 (loopback exchanges: the rank's blocks against its own K/V), W
    below and above the chunk, sinks: fa4 against the reference backend on the same plan."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    local = torch.tensor([0, 300, 302, 302, 340, 600], dtype=torch.int32)  # even: 2 chunks
    n = int(local[-1])
    for W in (5, 100, 400):
        for r in range(2):
            q, k, v, do = (torch.randn(n, h, 64, generator=gen, device="cuda")
                           for h in (8, 2, 2, 8))
            sinks = torch.randn(8, generator=gen, device="cuda")
            res = {}
            for b in ("fa4", "reference"):
                plan = CPAttentionPlan.simulated(local, 300, cp_size=2, cp_rank=r, q_heads=8,
                                                 kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                                                 device="cuda", method=method, backend=b,
                                                 window=W, sinks=True)
                ins = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)] + [
                    sinks.clone().requires_grad_()]
                out, lse = context_parallel_attention(*ins[:3], plan=plan, sinks=ins[3],
                                                      return_lse=True)
                res[b] = (out.float(), lse.float(),
                          *torch.autograd.grad((out.float() * do).sum(), ins))
            for nm, x, y in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), res["fa4"],
                                res["reference"], strict=True):
                tol = {"atol": 1e-3, "rtol": 1e-3} if nm == "lse" else (
                    {"atol": 5e-2, "rtol": 5e-2} if nm == "dsinks" else
                    BF16 if nm == "out" else BF16_GRAD)
                assert_close(x.float(), y.float(), name=f"{method} W={W} r{r} {nm}", **tol)
