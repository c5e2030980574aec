#!/usr/bin/env python3
"""Benchmark cp_rope's context-parallel attention (forward + backward) on 1-4 GPUs.

Setting (issue 4): a global batch of ``--tokens`` tokens (default 131072) as
(a) one sequence and (b) documents of ``--doc-len`` tokens (default 2048:
64 documents), 32 query heads, 8 KV heads (GQA), head_dim 128, bf16, causal.

One torchrun job of ``W`` processes (one per GPU) measures

* cp_size 1 on rank 0 alone (the others wait): every single-GPU backend that
  runs the layout (torch_cudnn for the one sequence, torch_flash for both,
  flash_attn if installed) -- the baseline is the fastest of them;
* cp_size W on all ranks: ``method`` ring and allgather x backend auto
  (cuDNN for the one sequence, the varlen flash kernel for documents) and
  torch_flash;
* what users would pick instead, at cp_size W on the one sequence: PyTorch's
  ``torch.distributed.tensor.experimental.context_parallel`` around
  ``F.scaled_dot_product_attention(is_causal=True)`` on ``[1, H, S, D]``
  buffers (its load-balanced ring), MHA (32 KV heads) and GQA
  (``enable_gqa=True``; reported as unsupported if it raises).

Per configuration: median over ``--iters`` timed iterations (CUDA events,
after ``--warmup``) of forward and of forward+backward; achieved TFLOP/s per
GPU with causal FLOPs counted once, as flash-attn's benchmarks do:
``fwd = 4 * sum_b(L_b^2) / 2 * Hq * D``, ``fwd+bwd = 3.5 * fwd`` (the
backward is 2.5 forwards), divided by ``cp_size`` GPUs; scaling efficiency
``t(cp=1, fastest backend) / (W * t(cp=W))``; peak memory per GPU
(``torch.cuda.max_memory_allocated`` over a forward+backward, inputs and
gradients included) and its ratio to the cp_size 1 run of the same backend
family.

Usage (after `bash scripts/setup.sh`, or `pip install --no-deps --no-build-isolation -e .`)::

    torchrun --nproc-per-node 2 scripts/bench_cp_attention.py --out bench_out
    torchrun --nproc-per-node 4 scripts/bench_cp_attention.py --tokens 262144 --out bench_out
    torchrun --nproc-per-node 1 scripts/bench_cp_attention.py   # cp_size 1 only

Rank 0 prints a markdown table and writes it to ``<out>/cp_attention_cp<W>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_rope.parallel import context_parallel_attention  # noqa: E402
from cp_rope.parallel._compat import flash_attn_available  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=131072, help="global tokens per batch (default 131072)")
    p.add_argument("--doc-len", type=int, default=2048, help="document length of layout (b) (default 2048)")
    p.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per config (default 2)")
    p.add_argument("--iters", type=int, default=8,
                   help="timed iterations per config (default 8: the cp-2 comparisons differ by ~1%%)")
    p.add_argument("--skip-torch-cp", action="store_true", help="do not run PyTorch's context_parallel")
    p.add_argument("--out", default=None, help="directory for cp_attention_cp<W>.md (default: print only)")
    return p.parse_args()


def causal_fwd_flops(lengths: list[int], heads: int, head_dim: int) -> float:
    return 4.0 * sum(n * n for n in lengths) / 2 * heads * head_dim


def cuda_time_ms(fn, warmup: int, iters: int) -> tuple[float, float]:
    """(median ms, spread = (max - min) / median) over ``iters`` timed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    med = statistics.median(times)
    return med, (max(times) - min(times)) / med


def bench_ours(args, lengths, cp_size, rank, group, method, backend, device):
    """(fwd ms, fwd+bwd ms, peak GiB) of context_parallel_attention on this rank's shard."""
    local = [n // cp_size for n in lengths]
    cu = torch.tensor([0, *torch.tensor(local).cumsum(0).tolist()], dtype=torch.int32, device=device)
    t = int(cu[-1])
    gen = torch.Generator(device=device).manual_seed(rank)
    mk = lambda h: torch.randn(t, h, args.head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    q, k, v, dout = mk(args.heads), mk(args.kv_heads), mk(args.kv_heads), mk(args.heads)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    run = lambda: context_parallel_attention(q, k, v, cu, max(local), group=group, causal=True,
                                             method=method, backend=backend)
    return measure(args, run, (q, k, v), dout)


def measure(args, run, leaves, dout):
    """(fwd ms, (fwd+bwd ms, spread), peak GiB of one fwd+bwd) of ``run()`` w.r.t. ``leaves``.

    Peak memory: ``max_memory_allocated`` after a reset, with the inputs (q, k, v, dout)
    allocated and the previous gradients released -- the same accounting at every cp_size.
    """

    def fwd():
        with torch.no_grad():
            run()

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        run().backward(dout)

    fwd_bwd()  # plan / cuDNN graph caches before the memory measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    return cuda_time_ms(fwd, args.warmup, args.iters)[0], cuda_time_ms(fwd_bwd, args.warmup, args.iters), peak


def bench_torch_cp(args, cp_size, kv_heads, device):
    """PyTorch's context_parallel + SDPA(is_causal) on one sequence of args.tokens."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cuda", (cp_size,))
    s, d = args.tokens, args.head_dim
    mk = lambda h: torch.randn(1, h, s, d, device=device, dtype=torch.bfloat16)
    q, k, v, dout = mk(args.heads), mk(kv_heads), mk(kv_heads), mk(args.heads)
    gqa = {"enable_gqa": True} if kv_heads != args.heads else {}
    with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2],
                          no_restore_buffers={q, k, v, dout}):
        ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
        run = lambda: F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, **gqa)
        return measure(args, run, (ql, kl, vl), dout)


def main() -> int:
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # the device only
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=600), device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.tokens % (2 * world) or args.tokens % args.doc_len or args.doc_len % (2 * world):
        raise SystemExit(f"--tokens {args.tokens} and --doc-len {args.doc_len} must be multiples "
                         f"of 2 * world size = {2 * world}, tokens a multiple of doc-len")
    layouts = {
        "(a) 1 seq": [args.tokens],
        f"(b) {args.tokens // args.doc_len} docs x {args.doc_len}": [args.doc_len] * (args.tokens // args.doc_len),
    }
    started = time.monotonic()
    rows = []  # (layout, cp, impl, backend, fwd, fwd_bwd, peak, note)

    def record(layout, cp, impl, backend, fn):
        try:
            f, (fb, spread), peak = fn()
            rows.append((layout, cp, impl, backend, f, fb, peak, f"spread {100 * spread:.1f}%"))
        except Exception as exc:  # unsupported combination: report it, keep going
            rows.append((layout, cp, impl, backend, None, None, None, f"{type(exc).__name__}: {str(exc)[:120]}"))
        torch.cuda.empty_cache()

    single_backends = (["flash_attn"] if flash_attn_available() else []) + ["torch_cudnn", "torch_flash"]
    if rank == 0:  # cp_size 1 baselines, one GPU
        for layout, lengths in layouts.items():
            for backend in single_backends:
                if backend == "torch_cudnn" and len(lengths) != 1:
                    continue
                record(layout, 1, "cp_rope", backend,
                       lambda lengths=lengths, backend=backend: bench_ours(
                           args, lengths, 1, 0, None, "ring", backend, device))
    dist.barrier()
    if world > 1:
        for layout, lengths in layouts.items():
            for method in ("ring", "allgather"):
                for backend in ("auto", "torch_flash"):
                    if backend == "torch_flash" and len(lengths) != 1:
                        continue  # auto is torch_flash there already
                    record(layout, world, f"cp_rope {method}", backend,
                           lambda lengths=lengths, method=method, backend=backend: bench_ours(
                               args, lengths, world, rank, dist.group.WORLD, method, backend, device))
        if not args.skip_torch_cp:
            for kv_heads in (args.heads, args.kv_heads):
                name = "torch context_parallel " + ("MHA" if kv_heads == args.heads else "GQA")
                record("(a) 1 seq", world, name, "SDPA",
                       lambda kv_heads=kv_heads: bench_torch_cp(args, world, kv_heads, device))
    # every rank measured its own peak; report the max over ranks of the cp_size W rows
    # (the same configurations in the same order on every rank; rank 0 also has cp 1 rows)
    n_single = sum(1 for r in rows if r[1] == 1)
    peaks = [r[6] if r[6] is not None else 0.0 for r in rows]
    if world > 1:
        shared = torch.tensor(peaks[n_single:] or [0.0], device=device)
        dist.all_reduce(shared, op=dist.ReduceOp.MAX)
        peaks[n_single:] = shared.tolist()[:len(rows) - n_single]
    if rank == 0:
        print(format_report(args, world, layouts, rows, peaks, time.monotonic() - started,
                            out_dir=args.out), flush=True)
    dist.destroy_process_group()
    return 0


def format_report(args, world, layouts, rows, peaks, elapsed, out_dir) -> str:
    flops = {lay: causal_fwd_flops(lens, args.heads, args.head_dim) for lay, lens in layouts.items()}
    best1 = {}
    mem1 = {}
    for (lay, cp, _impl, backend, _f, fb, _p, _n), peak in zip(rows, peaks, strict=False):
        if cp == 1 and fb is not None:
            best1[lay] = min(best1.get(lay, fb), fb)
            mem1[(lay, backend)] = peak
    lines = [
        f"### CP attention, {args.tokens} tokens, Hq {args.heads}, Hkv {args.kv_heads}, "
        f"head_dim {args.head_dim}, bf16, causal, {world} GPU(s)",
        "",
        f"Command: `torchrun --nproc-per-node {world} scripts/bench_cp_attention.py "
        f"--tokens {args.tokens} --doc-len {args.doc_len}`  ",
        f"Hardware: {world} x {torch.cuda.get_device_name()}; torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, Python {platform.python_version()}  ",
        f"Median of {args.iters} iterations after {args.warmup} warm-up (note: fwd+bwd spread "
        "= (max - min) / median); TFLOP/s per GPU with causal "
        "FLOPs counted once (fwd = 4 * sum L^2 / 2 * Hq * D, fwd+bwd = 3.5 fwd); scaling efficiency "
        "= t(cp=1, fastest backend) / (cp * t); memory = peak allocated per GPU (max over ranks). "
        f"Run time {elapsed:.0f} s.",
        "",
        "| layout | cp | implementation | backend | fwd ms | fwd+bwd ms | TFLOP/s/GPU (fwd+bwd) "
        "| scaling eff. | peak GiB/GPU | mem / cp1 | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (lay, cp, impl, backend, f, fb, _p, note), peak in zip(rows, peaks, strict=False):
        if fb is None:
            lines.append(f"| {lay} | {cp} | {impl} | {backend} | - | - | - | - | - | - | {note} |")
            continue
        tflops = 3.5 * flops[lay] / cp / (fb * 1e-3) / 1e12
        eff = best1[lay] / (cp * fb) if lay in best1 else float("nan")
        if backend == "auto":  # what auto resolves to without flash_attn
            backend_fam = "torch_cudnn" if len(layouts[lay]) == 1 else "torch_flash"
        else:
            backend_fam = backend
        ref_mem = mem1.get((lay, backend_fam))
        ratio = f"{peak / ref_mem:.2f}" if ref_mem else "-"
        lines.append(f"| {lay} | {cp} | {impl} | {backend} | {f:.1f} | {fb:.1f} | {tflops:.0f} | "
                     f"{eff:.3f} | {peak:.1f} | {ratio} | {note} |")
    text = "\n".join(lines) + "\n"
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"cp_attention_cp{world}.md"), "w") as fh:
            fh.write(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
