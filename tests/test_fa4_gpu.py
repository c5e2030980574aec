"""GPU checks of the ``fa4`` backend and ``auto``'s FA4 / cuDNN dispatch (parallel/_fa4.py).

* fa4, and cuDNN + FA4 split per document (crossover 256, min_rows 0: both kernels in one
  block), against the reference backend in float32 on the same bf16 inputs and plan: edge layouts
  (zero-length, one-token, odd-length documents), GQA 4:1, head_dim 64 and 128, causal and not;
  the CUDA allocator is filled with NaN first, so an unwritten row cannot pass.
* a ring of cp 2 simulated on one GPU: each rank's blocks run in turn against the K/V of the
  rank that step holds, the partials merged (merge_partials) and the backward run from the
  merged output and LSE, dK/dV summed at their owner; against the unsharded float32 result.
* no device-to-host sync with a prebuilt plan (sync debug mode "error"), fa4 and auto;
* FA4 compiles nothing new once a variant ran (``_compat.fa4_compiled``), whatever the batch;
  the first call's compile time per variant is printed (pytest -s).

    python -m pytest -m gpu tests/test_fa4_gpu.py -q -s
"""

from __future__ import annotations

import time

import pytest
import torch
from attention_utils import naive_attention, naive_lse
from utils import assert_close

from cp_rope.parallel import CPAttentionPlan, context_parallel_attention
from cp_rope.parallel._blocks import backend_unavailable, get_backend, merge_partials
from cp_rope.parallel._compat import fa4_compiled
from cp_rope.parallel._dispatch import run_plan
from cp_rope.parallel._fa4 import CudnnFa4, Fa4
from cp_rope.parallel.sharding import cp_shard_indices, local_cu_seqlens

pytestmark = pytest.mark.gpu


def _skip_without_fa4():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    why = backend_unavailable("fa4", device="cuda", dtype=torch.bfloat16, head_dim=128)
    if why is not None:
        pytest.skip(f"fa4: {why}")


def _poison(device, gib: float = 4.0):
    torch.cuda.empty_cache()
    junk = torch.empty(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    junk.fill_(float("nan"))
    del junk


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def test_no_recompilation_across_batches():
    """FA4 compiles two variants per (dtype, head_dim, GQA ratio, causal): blocks of up to 256
    segments and of more (its varlen scheduler's batch lookup, ``BIN_BATCH_SEARCH_THRESH``).
    After one batch of each, batches of other compositions (max_seqlen 1 .. 32768, 1 .. 512
    documents) compile nothing; prints the first call's time per variant. First in the file,
    so that the variants are not compiled yet."""
    _skip_without_fa4()
    device = torch.device("cuda", torch.cuda.current_device())
    hq, hkv = 16, 4
    warm = [[8192] * 2, [256] * 512]
    layouts = [[32768], [1] * 7, [5, 4000, 77, 12000, 0, 3], [2048] * 16, [64] * 300 + [4096]]

    def run(lens, d, causal):
        cu = _cu(lens)
        kw = {} if causal else {"causal": False, "seq_lens": torch.tensor(lens)}
        n = int(cu[-1])
        q, k, v = (torch.randn(n, h, d, device=device, dtype=torch.bfloat16).requires_grad_()
                   for h in (hq, hkv, hkv))
        out = context_parallel_attention(q, k, v, cu.to(device), max(lens), backend="fa4", **kw)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()

    for d in (64, 128):
        for causal in (True, False):
            for lens in warm:
                before, t0 = fa4_compiled(), time.perf_counter()
                run(lens, d, causal)
                first = time.perf_counter() - t0
                t0 = time.perf_counter()
                run(lens, d, causal)
                again = time.perf_counter() - t0
                print(f"FA4 variant d={d} causal={causal} bf16 GQA 4:1 {len(lens)} segments: "
                      f"first call {first:.1f} s (again {again * 1e3:.0f} ms), "
                      f"{fa4_compiled() - before} kernels compiled")
            compiled = fa4_compiled()
            for lens in layouts:
                run(lens, d, causal)
            assert fa4_compiled() == compiled, (d, causal, fa4_compiled(), compiled)


EDGES = [0, 1, 7, 300, 0, 33, 129, 2, 1, 2048, 5001, 64]
TOL = 3.5e-2  # TransformerEngine's CP tests (GQA, bf16); the LSE within 1e-3


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_fa4_and_mixed_match_float32_reference(d, causal):
    _skip_without_fa4()
    device = torch.device("cuda", torch.cuda.current_device())
    hq, hkv = 8, 2
    cu = _cu(EDGES)
    n = int(cu[-1]) + 3  # trailing rows
    kw = {} if causal else {"causal": False, "seq_lens": torch.tensor(EDGES)}
    gen = torch.Generator().manual_seed(d + causal)
    x = [torch.randn(n, h, d, generator=gen).to(device, torch.bfloat16) for h in (hq, hkv, hkv, hq)]
    res, failed = {}, []
    for name, be, dtype in (("fa4", Fa4(), torch.bfloat16),
                            ("cudnn+fa4", CudnnFa4(256, min_rows=0), torch.bfloat16),
                            ("reference", None, torch.float32)):
        plan = CPAttentionPlan.build(cu, max(EDGES), q_heads=hq, kv_heads=hkv, head_dim=d,
                                     dtype=dtype, device=device, n_tokens=n, **kw)
        leaves = [t.detach().to(dtype).requires_grad_() for t in x[:3]]
        if be is None:
            be = get_backend("reference", leaves[0], plan.n_seqs)
        else:
            _poison(device)
        out, lse = run_plan(*leaves, plan, be, d ** -0.5)
        out.backward(x[3].to(dtype))
        res[name] = (out.detach(), lse, *(t.grad for t in leaves))
    for name in ("fa4", "cudnn+fa4"):
        for nm, got, exp in zip(("out", "lse", "dq", "dk", "dv"), res[name], res["reference"],
                                strict=True):
            try:
                tol = 1e-3 if nm == "lse" else TOL
                assert_close(got, exp, atol=tol, rtol=tol, name=f"{name} d{d} causal={causal} {nm}")
            except AssertionError as exc:
                failed.append(str(exc))
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("be_name", ["fa4", "cudnn+fa4"])
def test_ring_cp2_simulated_on_one_gpu(be_name):
    """Ring at cp 2: rank r's step i runs its plan's block against the K/V of rank (r - i) mod
    2; the partials merged exactly; the backward from the merged out / LSE; dK/dV to their
    owner. Unsharded: equal to full attention in float32 (naive_attention)."""
    _skip_without_fa4()
    device = torch.device("cuda", torch.cuda.current_device())
    C, hq, hkv, d = 2, 8, 2, 128
    lens = [-(-n // (2 * C)) * 2 * C for n in (4, 1000, 8, 2048, 4, 300, 5004)]
    cu = _cu(lens).to(device)
    local = local_cu_seqlens(cu, C)
    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(int(cu[-1]), h, d, generator=gen).to(device, torch.bfloat16)
                     for h in (hq, hkv, hkv, hq))
    idx = [cp_shard_indices(cu, C, r) for r in range(C)]
    be = Fa4() if be_name == "fa4" else CudnnFa4(256, min_rows=0)
    plans = [CPAttentionPlan.simulated(local, max(lens) // C, cp_size=C, cp_rank=r, q_heads=hq,
                                       kv_heads=hkv, head_dim=d, dtype=torch.bfloat16,
                                       device=device) for r in range(C)]
    scale = d ** -0.5
    shard = lambda t: [t[i] for i in idx]
    qs, ks, vs, ds = shard(q), shard(k), shard(v), shard(dout)
    outs, lses = [], []
    for r in range(C):
        o = lse = None
        for i, blk in enumerate(plans[r].blocks["ring"]):
            src = (r - i) % C
            for _, po, pl in be.forward(qs[r], ks[src], vs[src], blk, scale)[0]:
                po, pl = po.float(), pl.float()
                o, lse = (po, pl) if o is None else merge_partials(o, lse, po, pl)
        outs.append(o.to(torch.bfloat16))
        lses.append(lse)
    dq = [torch.zeros(t.shape, device=device) for t in qs]
    dk = [torch.zeros(t.shape, device=device) for t in ks]
    dv = [torch.zeros(t.shape, device=device) for t in vs]
    for r in range(C):
        lse_b = be.prepare_lse(lses[r])
        for i, blk in enumerate(plans[r].blocks["ring"]):
            src = (r - i) % C
            for _, gq, _, gk, gv in be.backward(ds[r], qs[r], ks[src], vs[src], outs[r], lse_b,
                                                blk, scale, None):
                dq[r] += gq.float()
                dk[src] += gk.float()
                dv[src] += gv.float()

    def unshard(parts, like):
        full = torch.empty(like.shape, device=device, dtype=parts[0].dtype)
        for r in range(C):
            full[idx[r]] = parts[r]
        return full
    ref_in = [t.float().requires_grad_() for t in (q, k, v)]
    ref = naive_attention(*ref_in, cu.cpu(), True, scale)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.float())
    with torch.no_grad():
        ref_lse = naive_lse(*ref_in[:2], cu.cpu(), True, scale)
    got_lse = unshard([t.t() for t in lses], q[:, :, 0]).t()
    assert_close(got_lse, ref_lse, atol=1e-3, rtol=1e-3, name=f"{be_name} cp2 lse")
    for nm, parts, like, exp in (("out", outs, q, ref), ("dq", dq, q, ref_grads[0]),
                                 ("dk", dk, k, ref_grads[1]), ("dv", dv, v, ref_grads[2])):
        assert_close(unshard(parts, like), exp, atol=TOL, rtol=TOL, name=f"{be_name} cp2 {nm}")


@pytest.mark.parametrize("backend", ["fa4", "auto"])
def test_no_sync_with_plan(backend):
    """8 layers forward + backward with a prebuilt plan: no device-to-host sync."""
    _skip_without_fa4()
    device = torch.device("cuda", torch.cuda.current_device())
    lens = [0, 3000, 1, 4096, 2048, 7000] + [64] * 40
    hq, hkv, d, layers = 16, 4, 128, 8
    cu = _cu(lens)
    n = int(cu[-1]) + 5
    plan = CPAttentionPlan.build(cu, max(lens), q_heads=hq, kv_heads=hkv, head_dim=d,
                                 dtype=torch.bfloat16, device=device, n_tokens=n, backend=backend)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, hq, d, device=device, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(layers, 3, hq, d, device=device, dtype=torch.bfloat16, generator=gen)
    w.requires_grad_()
    g = hq // hkv

    def step():
        h = x
        for layer in range(layers):
            q = h * w[layer, 0]
            k, v = (h[:, ::g] * w[layer, j, ::g] for j in (1, 2))
            h = h + context_parallel_attention(q, k, v, plan=plan)
        h.float().square().mean().backward()

    if backend == "auto":
        assert isinstance(get_backend("auto", x, plan.n_seqs), CudnnFa4)
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(w.grad).all()
