"""GPU parity of CP attention: bf16 with the cudnn, torch_flash and torch_cudnn backends.

CP attention (ring and allgather; at cp_size > 1 also ulysses, and hybrid with
U = 2 at even cp_size > 2) on the zigzag shards of a global batch is compared
with full attention over the same global batch on one GPU (float32 math on
the same bf16 inputs), forward, merged LSE and backward. Tolerances are
TransformerEngine's CP tests': atol = rtol = 2.5e-2 (MHA), 3.5e-2 (GQA); the
LSE (fp32 from the same bf16 inputs) within 1e-3. Before every run the CUDA
caching allocator is filled with NaN, so a kernel output the code leaves
unwritten (rows without keys, skipped key rows) cannot pass.

A second test runs a 16-layer attention-only forward + backward at cp_size 1
with a prebuilt :class:`~cp_rope.parallel.CPAttentionPlan` under
``torch.cuda.set_sync_debug_mode("error")``, for each GPU backend: any
device-to-host sync raises.

* cp_size 1 (one GPU), under pytest::

      python -m pytest tests/test_attention_gpu.py -m gpu -q

* cp_size N over NCCL (one process per GPU)::

      torchrun --nproc-per-node 2 tests/test_attention_gpu.py

  prints one line per case (PASS/FAIL with the worst error) from rank 0 and
  exits non-zero if any case failed on any rank.
"""

from __future__ import annotations

import datetime
import os
import random
import sys

import pytest
import torch
import torch.distributed as dist
from attention_utils import naive_attention, naive_lse, rand64
from utils import assert_close

from cp_rope.parallel import (
    CPAttentionPlan,
    context_parallel_attention,
    shard_tensor,
    unshard,
)
from cp_rope.parallel._compat import fa4_unavailable, flash_attn_available
from cp_rope.parallel.sharding import local_cu_seqlens

ONE_SEQ = ("cudnn", "torch_flash", "torch_cudnn")
VARLEN = ("cudnn", "torch_flash")
# (name, real lengths, hq, hkv, head_dim, causal, backends)
CASES = [
    ("one seq MHA", [8192], 8, 8, 128, True, ONE_SEQ),
    ("one seq GQA", [8192], 16, 4, 128, True, ONE_SEQ),
    ("one seq GQA d64 ragged", [6001], 8, 2, 64, True, ONE_SEQ),
    ("varlen GQA", [0, 1, 700, 4, 2048, 0, 333, 1500], 16, 4, 128, True, VARLEN),
    ("varlen MHA", [1024, 1, 2047, 0, 64], 8, 8, 64, True, VARLEN),
    ("varlen GQA non-causal", [0, 1, 700, 5, 1500], 8, 2, 128, False, VARLEN),
    ("one-token docs", [1, 1, 0, 1, 1, 1], 8, 2, 128, True, VARLEN),
    ("equal docs GQA (cudnn: dense calls)", [2048] * 4, 16, 4, 128, True, VARLEN),
]


def _poison_allocator(device: torch.device, gib: float = 4.0) -> None:
    """Fill free memory of the caching allocator with NaN (reused by the next allocations)."""
    torch.cuda.empty_cache()
    junk = torch.empty(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    junk.fill_(float("nan"))
    del junk


def _methods(cp_size: int) -> list[tuple[str, int | None]]:
    """(method, ulysses_size) runs at this cp_size (Ulysses at 1 would be the ring)."""
    extra = [("ulysses", None)] if cp_size > 1 else []
    if cp_size > 2 and cp_size % 2 == 0:
        extra.append(("hybrid", 2))
    return [("ring", None), ("allgather", None), *extra]


def _run_cases(rank: int, cp_size: int, group, device: torch.device, cases=CASES,
               ) -> list[tuple[str, str]]:
    """Every case x backend x method; returns (label, "" or the failure) per run."""
    results = []
    for ci, (name, lens, hq, hkv, d, causal, backends) in enumerate(cases):
        gen = torch.Generator().manual_seed(1234 + ci)
        padded = [-(-n // (2 * cp_size)) * 2 * cp_size for n in lens]
        cu = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
        n = int(cu[-1])
        q, k, v, dout = (torch.randn(n, h, d, generator=gen).to(device, torch.bfloat16)
                         for h in (hq, hkv, hkv, hq))
        seq_lens = None if causal else torch.tensor(lens, device=device)
        ref_in = [t.float().requires_grad_() for t in (q, k, v)]
        ref = naive_attention(*ref_in, cu, causal, d ** -0.5, seq_lens)
        ref_grads = torch.autograd.grad(ref, ref_in, dout.float())
        with torch.no_grad():
            ref_lse = naive_lse(*ref_in[:2], cu, causal, d ** -0.5, seq_lens)
        del ref_in
        tol = 2.5e-2 if hq == hkv else 3.5e-2
        cu_dev = cu.to(device)
        local_cu = local_cu_seqlens(cu_dev, cp_size)
        max_local = max(padded) // cp_size
        extra = 3 if ci in (0, 3) else 0  # trailing rows that belong to no sequence
        for backend in backends:
            for method, u in _methods(cp_size):
                label = f"cp{cp_size} {name} {backend} {method}" + (f" U={u}" if u else "")
                loc = [shard_tensor(t, cu_dev, cp_size, rank) for t in (q, k, v, dout)]
                loc = [torch.cat([t, torch.randn_like(t[:extra])]) for t in loc]
                ql, kl, vl = (t.requires_grad_() for t in loc[:3])
                _poison_allocator(device)
                try:
                    out, lse = context_parallel_attention(
                        ql, kl, vl, local_cu, max_local, group=group, causal=causal,
                        method=method, backend=backend, seq_lens=seq_lens, return_lse=True,
                        ulysses_size=u)
                    out.backward(loc[3])
                except Exception as exc:  # same inputs on every rank: all fail alike
                    results.append((label, f"raised {type(exc).__name__}: {exc}"))
                    continue
                n_local = int(local_cu[-1])
                got_all = (out, ql.grad, kl.grad, vl.grad)
                gathered = [unshard(g.detach(), local_cu, group) for g in got_all]
                msg = ""
                try:
                    for g in got_all:
                        assert int(torch.count_nonzero(g[n_local:])) == 0, "trailing rows not 0"
                    for nm, got, exp in zip(("out", "dq", "dk", "dv"), gathered,
                                            (ref, *ref_grads), strict=True):
                        assert_close(got, exp, atol=tol, rtol=tol, name=f"{label} {nm}")
                    assert bool((lse[:, n_local:] == float("-inf")).all()), "trailing LSE not -inf"
                    got_lse = unshard(lse.t().contiguous(), local_cu, group).t()
                    assert_close(got_lse, ref_lse, atol=1e-3, rtol=1e-3, name=f"{label} lse")
                except AssertionError as exc:
                    msg = str(exc)
                results.append((label, msg))
    return results


@pytest.mark.gpu
def test_cp_attention_gpu_cp1():
    results = _run_cases(0, 1, None, torch.device("cuda", torch.cuda.current_device()))
    failed = [f"{label}: {msg}" for label, msg in results if msg]
    assert not failed, "\n".join(failed)


@pytest.mark.gpu
@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.bfloat16])
def test_fused_merge_gpu(acc_dtype):
    """The Triton LSE merge (every merge of CP attention on CUDA at cp_size > 1) against the
    float64 merge of the same (rounded) inputs; -inf partials; cuDNN-style strided LSE."""
    from cp_rope.parallel._blocks import merge_partials
    from cp_rope.parallel._merge import merge_rows_

    gen = torch.Generator().manual_seed(5)
    n, h, d = 20000, 8, 128
    acc, o = rand64(gen, n, h, d), rand64(gen, n, h, d)
    l1, l2 = rand64(gen, h, n) * 3, rand64(gen, h, n) * 3
    l1[:, :50], l2[:, 30:80] = float("-inf"), float("-inf")
    got = acc.to("cuda", acc_dtype)
    got_lse = l1.to("cuda", torch.float32)
    o_in = o.to("cuda", torch.bfloat16)
    merge_rows_(got, got_lse, o_in, l2.float().t().contiguous().cuda().t())
    exp_out, exp_lse = merge_partials(acc.to(acc_dtype).double(), l1.float().double(),
                                      o_in.double().cpu(), l2.float().double())
    assert_close(got, exp_out.to(acc_dtype), dtype=acc_dtype, name="out")
    assert_close(got_lse, exp_lse.float(), dtype=torch.float32, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudnn", "torch_flash", "torch_cudnn", "flash_attn"])
def test_no_sync_with_plan_16_layers(backend):
    """A 16-layer attention-only step (forward + backward) at cp_size 1 with a prebuilt plan
    does no device-to-host sync (torch raises on any under sync debug mode "error")."""
    if backend == "flash_attn" and not flash_attn_available():
        pytest.skip("flash_attn is not installed")
    device = torch.device("cuda", torch.cuda.current_device())
    lens = [16384] if backend == "torch_cudnn" else [0, 3000, 1, 4096, 2048, 7000]
    hq, hkv, d, layers = 16, 4, 128, 16
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    n = int(cu[-1]) + 5  # trailing rows too
    plan = CPAttentionPlan.build(cu, max(lens), q_heads=hq, kv_heads=hkv, head_dim=d,
                                 dtype=torch.bfloat16, device=device, n_tokens=n)
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
            h = h + context_parallel_attention(q, k, v, plan.cu_seqlens, plan.max_seqlen,
                                               plan=plan, backend=backend)
        h.float().square().mean().backward()

    step()  # warm-up outside the check: cuDNN graphs, kernel caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(w.grad).all()


def _skewed_layouts() -> dict[str, list[int]]:
    """Layouts whose cudnn blocks split into several calls (parallel/_cudnn_thd.py)."""
    rng = random.Random(0)
    heavy = [min(int(rng.lognormvariate(4.5, 1.6)), 6000) for _ in range(400)]
    return {"8192 then 2048x16 (views)": [8192] + [16] * 2048,
            "8192 amid 2048x16 (three views)": [16] * 1000 + [8192] + [16] * 1048,
            "heavy tail, shuffled (gathered)": heavy}


@pytest.mark.gpu
@pytest.mark.parametrize("cp_size", [1, 2])
def test_cudnn_skewed_layouts_gpu(cp_size):
    """backend="cudnn" on skewed layouts (blocks split into calls by document length: views,
    gathered rows, padded segment counts) against the reference backend in float32 on the
    same bf16 inputs and plan layout; cp_size 2: each rank of a simulated ring (blocks with
    skipped keys and keyless queries). Allocator poisoned with NaN before each cudnn run."""
    from cp_rope.parallel._blocks import get_backend

    device = torch.device("cuda", torch.cuda.current_device())
    hq, hkv, d, tol = 8, 2, 128, 3.5e-2
    failed, split = [], 0
    layouts = _skewed_layouts()
    if cp_size > 1:
        layouts.pop("8192 then 2048x16 (views)")
    for name, lens in layouts.items():
        local = [-(-n // (2 * cp_size)) * 2 for n in lens]
        cu = torch.tensor([0, *torch.tensor(local).cumsum(0).tolist()], dtype=torch.int32)
        n = int(cu[-1]) + 3  # trailing rows
        for r in range(cp_size):
            gen = torch.Generator().manual_seed(r)
            x = [torch.randn(n, h, d, generator=gen).to(device, torch.bfloat16)
                 for h in (hq, hkv, hkv, hq)]
            res = {}
            for backend, dtype in (("cudnn", torch.bfloat16), ("reference", torch.float32)):
                kw = dict(q_heads=hq, kv_heads=hkv, head_dim=d, dtype=dtype, device=device,
                          n_tokens=n, backend=backend)
                plan = (CPAttentionPlan.build(cu, max(local), **kw) if cp_size == 1 else
                        CPAttentionPlan.simulated(cu, max(local), cp_size=cp_size, cp_rank=r, **kw))
                leaves = [t.detach().to(dtype).requires_grad_() for t in x[:3]]
                if backend == "cudnn":
                    # auto on an H200: cuDNN, split with FA4 by length where flash-attn-4 is installed
                    auto = "cudnn" if fa4_unavailable() else "cudnn+fa4"
                    assert get_backend("auto", leaves[0], plan.n_seqs).name == auto
                    _poison_allocator(device)
                out, lse = context_parallel_attention(*leaves, plan=plan, return_lse=True)
                out.backward(x[3].to(dtype))
                res[backend] = (out.detach(), lse, *(t.grad for t in leaves))
                if backend == "cudnn":
                    blocks = {id(b): b for bs in plan.blocks.values() for b in bs}.values()
                    split += sum(len(lay.calls) > 1 for b in blocks for lay in b.backend_cache.values())
            label = f"cp{cp_size} rank {r} {name}"
            try:
                for nm, got, exp in zip(("out", "lse", "dq", "dk", "dv"), res["cudnn"],
                                        res["reference"], strict=True):
                    assert_close(got, exp, atol=1e-3 if nm == "lse" else tol,
                                 rtol=1e-3 if nm == "lse" else tol, name=f"{label} {nm}")
            except AssertionError as exc:
                failed.append(str(exc))
    assert not failed, "\n".join(failed)
    assert split > 0, "no block was split into several cuDNN calls"


@pytest.mark.gpu
def test_cudnn_skewed_no_sync():
    """The split cudnn blocks (views, gathers, the LSE re-padding) do no device-to-host sync
    with a prebuilt plan: 4 layers forward + backward under sync debug mode "error"."""
    device = torch.device("cuda", torch.cuda.current_device())
    lens = _skewed_layouts()["heavy tail, shuffled (gathered)"] + [8192] + [16] * 512
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    n, hq, hkv, d = int(cu[-1]), 16, 4, 128
    plan = CPAttentionPlan.build(cu, max(lens), q_heads=hq, kv_heads=hkv, head_dim=d,
                                 dtype=torch.bfloat16, device=device, backend="cudnn")
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, hq, d, device=device, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(4, 3, hq, d, device=device, dtype=torch.bfloat16, generator=gen)
    w.requires_grad_()

    def step():
        h = x
        for layer in range(4):
            q, k, v = (h[:, ::hq // hkv] * w[layer, j, ::hq // hkv] if j else h * w[layer, 0]
                       for j in range(3))
            h = h + context_parallel_attention(q, k, v, plan=plan)
        h.float().square().mean().backward()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(w.grad).all()


def main() -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # the device only
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300),
                            device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        results = _run_cases(rank, world, dist.group.WORLD, torch.device("cuda", local_rank))
        n_failed = torch.tensor([sum(bool(m) for _, m in results)], device="cuda")
        dist.all_reduce(n_failed)
        if rank == 0:
            for label, msg in results:
                print(f"{'FAIL' if msg else 'PASS'} {label}" + (f"\n    {msg}" if msg else ""),
                      flush=True)
            print(f"{len(results)} runs per rank, {int(n_failed)} failures over {world} ranks",
                  flush=True)
        return 1 if int(n_failed) else 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
