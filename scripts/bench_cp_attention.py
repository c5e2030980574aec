#!/usr/bin/env python3
"""Benchmark cp_rope's context-parallel attention (forward and forward + backward).

Setting: Hq 32, Hkv 8 (GQA), head_dim 128, bf16, causal, documents packed THD.

**One GPU** (``--nproc-per-node 1`` or plain ``python``): every layout of
``--layouts`` (default all)

* ``1x131072``, ``1x65536``: one sequence of 131072 / 65536 tokens;
* ``64x2048``, ``512x256``: 64 / 512 documents of 2048 / 256 tokens;
* ``32768+64x1536``: one 32768-token document and 64 of 1536;
* ``random``: 12 documents of 2048-16384 tokens (uniform, multiples of 128, seed 0);
* ``16384+4096x16``: one 16384-token document, then 4096 of 16 (T = 81920; issue 20's
  skewed layout); ``shuffled-skew``: the same documents shuffled (seed 0)

times ``context_parallel_attention`` at cp_size 1 with a plan built once per
batch (outside the timed region, as the trainer does) for every block backend
that runs the layout (``cudnn``, ``fa4`` / ``flash_attn`` if installed, ``torch_flash``,
``torch_cudnn`` for one sequence) and ``auto``, plus dense cuDNN SDPA
(``F.scaled_dot_product_attention`` under the cuDNN backend, ``enable_gqa``) on
``[B, Hq, S, D]`` for the layouts of equal-length documents.

``stdlib``: the lengths of the Python standard library's ``*.py`` files (pretrain's
default corpus: bytes + 2), shuffled (seed 0), capped at 32768, rounded up to multiples
of 128, the last one cut to fill 131072 tokens (the machine's Python decides the files).

``--simulate-cp C [C ...]``: on the one GPU, run each rank's share of a cp_size-C
step in turn -- the rank's own plan (:meth:`CPAttentionPlan.simulated`: the same blocks
and kernels, loopback exchanges) on its ``T / C`` local rows -- and report the slowest
rank's compute time and the compute-only scaling bound ``t(cp=1) / (C * max_rank_time)``
(the multi-GPU ring with its communication hidden). ``--simulate-methods``: the zigzag
methods (default ring; ulysses, hybrid with ``--ulysses-size``, allgather); the note
gives the MiB one rank sends per layer, fwd + bwd, bf16 (:func:`~cp_rope.parallel.
ulysses.comm_volume`) and the part overlapping compute. ``--placement zigzag
per_document``: per_document (:func:`~cp_rope.parallel.place_documents`,
``--split-threshold``) runs :meth:`PerDocumentPlan.simulated` per rank.

**Several GPUs** (``torchrun --nproc-per-node W``, W > 1): every layout of
``--layouts`` whose lengths divide by 2W, at cp_size W on all ranks, methods of
``--methods`` (ring, allgather, ulysses, hybrid with ``--ulysses-size`` ranks per
all-to-all group when ``1 < U < W``: backend auto, the MiB each rank sends per layer
in the note; ring on one sequence also torch_flash; per_document: documents up to ``--split-threshold`` tokens whole on
one rank, the rest ring-split), and PyTorch's
``torch.distributed.tensor.experimental.context_parallel`` around SDPA on the
one sequence (MHA and GQA) unless ``--skip-torch-cp``.

Per configuration: median over ``--iters`` timed iterations (CUDA events,
after ``--warmup``); TFLOP/s per GPU with causal FLOPs counted once, as
flash-attn's benchmarks do: ``fwd = 4 * sum_b(L_b^2) / 2 * Hq * D``,
``fwd+bwd = 3.5 * fwd``, divided by the GPUs; peak memory
(``torch.cuda.max_memory_allocated`` over one forward + backward, inputs and
gradients included) and the part above the inputs (q, k, v, dout allocated before).

Usage (repository root; tables printed and written to ``<out>/cp_attention_cp<W>.md``)::

    python scripts/bench_cp_attention.py --simulate-cp 2 4 8 --out bench_out
    torchrun --nproc-per-node 2 scripts/bench_cp_attention.py --out bench_out
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_rope.parallel import (
    CPAttentionPlan,
    PerDocumentPlan,
    context_parallel_attention,
    default_split_threshold,
    place_documents,
)
from cp_rope.parallel._blocks import backend_unavailable, get_backend
from cp_rope.parallel._compat import cudnn_frontend_unavailable, fa4_version
from cp_rope.parallel.ulysses import comm_volume

LAYOUT_NAMES = ("1x131072", "1x65536", "64x2048", "512x256", "32768+64x1536", "random",
                "stdlib", "16384+4096x16", "shuffled-skew")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUT_NAMES), choices=LAYOUT_NAMES,
                   help="one-GPU layouts to run (default: all)")
    p.add_argument("--backends", nargs="+", default=None,
                   help="one-GPU backends (default: every one that is installed, and auto)")
    p.add_argument("--simulate-cp", nargs="*", type=int, default=[], metavar="C",
                   help="one GPU: time each rank's share of a cp_size-C ring step (default: none)")
    p.add_argument("--placement", nargs="+", default=["zigzag"], choices=("zigzag", "per_document"),
                   help="--simulate-cp: document placements to simulate (default: zigzag)")
    p.add_argument("--simulate-methods", nargs="+", default=["ring"],
                   choices=["ring", "allgather", "ulysses", "hybrid"],
                   help="--simulate-cp, zigzag placement: CP methods to simulate (default: ring)")
    p.add_argument("--methods", nargs="+",
                   default=["ring", "allgather", "ulysses", "hybrid", "per_document"],
                   choices=["ring", "allgather", "ulysses", "hybrid", "per_document"],
                   help="several-GPU mode: CP methods to time (default: all)")
    p.add_argument("--ulysses-size", type=int, default=2,
                   help="hybrid: ranks per all-to-all group; runs when 1 < U < cp_size and U "
                        "divides it (default 2)")
    p.add_argument("--split-threshold", type=int, default=16384,
                   help="per_document: documents up to this many tokens stay whole (default "
                        "16384, as measured in docs/benchmarks.md; 0: the library default "
                        "default_split_threshold(head_dim, cp_size))")
    p.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per config (default 2)")
    p.add_argument("--iters", type=int, default=8, help="timed iterations per config (default 8)")
    p.add_argument("--skip-torch-cp", action="store_true",
                   help="several GPUs: do not run PyTorch's context_parallel")
    p.add_argument("--out", default=None, help="directory for cp_attention_cp<W>.md (default: print only)")
    return p.parse_args()


def layout_lengths(name: str) -> list[int]:
    """Document lengths of a named layout (every length a multiple of 128)."""
    if name == "random":
        rng = random.Random(0)
        return [rng.randrange(2048, 16384 + 1, 128) for _ in range(12)]
    if name == "stdlib":
        from cp_rope.launch.data import stdlib_files

        sizes = [min(os.path.getsize(f) + 2, 32768) for f in stdlib_files()]
        random.Random(0).shuffle(sizes)
        out = []
        for n in sizes:  # in order; the last one cut to fill 131072
            n = min(-(-n // 128) * 128, 131072 - sum(out))
            if n <= 0:
                break
            out.append(n)
        return out
    if name == "32768+64x1536":
        return [32768] + [1536] * 64
    if name in ("16384+4096x16", "shuffled-skew"):
        lengths = [16384] + [16] * 4096
        if name == "shuffled-skew":
            random.Random(0).shuffle(lengths)
        return lengths
    n, length = name.split("x")
    return [int(length)] * int(n)


def causal_fwd_flops(lengths: list[int], heads: int, head_dim: int) -> float:
    return 4.0 * sum(n * n for n in lengths) / 2 * heads * head_dim


def cuda_time_ms(fn, warmup: int, iters: int) -> float:
    """Median ms over ``iters`` timed calls."""
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
    return statistics.median(times)


def measure(args, run, leaves, dout) -> tuple[float, float, tuple[float, float]]:
    """(fwd ms, fwd+bwd ms, (peak GiB, GiB above the inputs) of one fwd+bwd) of ``run()``."""

    def fwd():
        with torch.no_grad():
            run()

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        run().backward(dout)

    fwd_bwd()  # graph / kernel caches before the memory measurement
    for t in leaves:
        t.grad = None
    gc.collect()  # tensors of earlier calls that reference cycles may still hold
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    inputs = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return (cuda_time_ms(fwd, args.warmup, args.iters),
            cuda_time_ms(fwd_bwd, args.warmup, args.iters), (peak / 2**30, (peak - inputs) / 2**30))


def make_qkv(args, n_rows, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    mk = lambda h: torch.randn(n_rows, h, args.head_dim, device=device, dtype=torch.bfloat16,
                               generator=gen)
    q, k, v, dout = mk(args.heads), mk(args.kv_heads), mk(args.kv_heads), mk(args.heads)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def bench_ours(args, plan, backend, device, seed=0):
    """(fwd, fwd+bwd, peak) of context_parallel_attention with a prebuilt plan."""
    q, k, v, dout = make_qkv(args, plan.n_tokens, device, seed)
    run = lambda: context_parallel_attention(q, k, v, plan.cu_seqlens, plan.max_seqlen,
                                             group=plan.group, method=plan.method,
                                             backend=backend, plan=plan)
    return measure(args, run, (q, k, v), dout)


def bench_per_document(args, plan, device, seed=0):
    """(fwd, fwd+bwd, peak) of the door with a prebuilt PerDocumentPlan."""
    q, k, v, dout = make_qkv(args, plan.n_tokens, device, seed)
    run = lambda: context_parallel_attention(q, k, v, plan=plan, group=plan.group)
    return measure(args, run, (q, k, v), dout)


def bench_dense_cudnn(args, lengths, device):
    """Dense cuDNN SDPA on [B, Hq, S, D] (equal lengths only)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, s = len(lengths), lengths[0]
    gen = torch.Generator(device=device).manual_seed(0)
    mk = lambda h: torch.randn(b, h, s, args.head_dim, device=device, dtype=torch.bfloat16,
                               generator=gen)
    q, k, v, dout = (mk(h) for h in (args.heads, args.kv_heads, args.kv_heads, args.heads))
    for t in (q, k, v):
        t.requires_grad_()

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return measure(args, run, (q, k, v), dout)


def cu_of(lengths: list[int]) -> torch.Tensor:
    """int32 host cu_seqlens ``[B + 1]`` of ``lengths``."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def placed(args, lengths, cp_size):
    """``(place_documents(...), threshold)`` of ``lengths`` at ``cp_size``."""
    thr = args.split_threshold or default_split_threshold(args.head_dim, cp_size)
    return place_documents(cu_of(lengths), cp_size, thr), thr


def runs_at(args, method, cp_size) -> bool:
    """hybrid only with all-to-all groups of 1 < U < cp_size ranks (U = cp_size is ulysses)."""
    u = args.ulysses_size
    return method != "hybrid" or (1 < u < cp_size and cp_size % u == 0)


def method_note(args, lengths, cp_size, method) -> str:
    """The method (U for hybrid) and the MiB one rank sends per layer, fwd + bwd, bf16."""
    u = args.ulysses_size if method == "hybrid" else None
    v = comm_volume(method, n_tokens=sum(lengths) // cp_size, q_heads=args.heads,
                    kv_heads=args.kv_heads, head_dim=args.head_dim, cp_size=cp_size,
                    ulysses_size=u)
    return (f"{method}{f' U={u}' if u else ''}: sends {(v['forward'] + v['backward']) / 2**20:.0f}"
            f" MiB/layer ({v['overlapped'] / 2**20:.0f} overlapped)")


def plan_for(args, lengths, device, cp_size=1, cp_rank=None, group=None, method="ring"):
    local = [n // cp_size for n in lengths]
    cu = cu_of(local)
    kw = dict(q_heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
              dtype=torch.bfloat16, device=device, method=method,
              ulysses_size=args.ulysses_size if method == "hybrid" else None)
    if cp_rank is not None:  # one rank of a simulated group
        return CPAttentionPlan.simulated(cu, max(local), cp_size=cp_size, cp_rank=cp_rank, **kw)
    return CPAttentionPlan.build(cu, max(local), group=group, **kw)


def one_gpu_backends(args, device) -> list[str]:
    if args.backends:
        return args.backends
    names = ["auto"]
    names += ["cudnn"] if cudnn_frontend_unavailable() is None else []
    names += [b for b in ("fa4", "flash_attn") if backend_unavailable(  # installed and runs
        b, device=device, dtype=torch.bfloat16, head_dim=args.head_dim) is None]
    return names + ["torch_flash", "torch_cudnn"]


def recorder(rows):
    """``record(layout, cp, impl, backend, fn)``: a row (layout, cp, impl, backend, fwd,
    fwd_bwd, (peak, above inputs), note) of ``fn()``'s measure; a failure becomes a note."""
    def record(layout, cp, impl, backend, fn):
        try:
            rows.append((layout, cp, impl, backend, *fn(), ""))
        except Exception as exc:  # unsupported combination: report it, keep going
            rows.append((layout, cp, impl, backend, None, None, None,
                         f"{type(exc).__name__}: {str(exc)[:100]}"))
        torch.cuda.empty_cache()
    return record


def run_one_gpu(args, device):
    """rows (see :func:`recorder`); sim: simulation rows."""
    rows, sim = [], []
    record = recorder(rows)
    probe = torch.empty(1, args.heads, args.head_dim, device=device, dtype=torch.bfloat16)

    for layout in args.layouts:
        lengths = layout_lengths(layout)
        plan = plan_for(args, lengths, device)
        for backend in one_gpu_backends(args, device):
            if backend == "torch_cudnn" and len(lengths) != 1:
                continue
            name = backend
            if backend == "auto":
                name = f"auto ({get_backend('auto', probe, plan.n_seqs).name})"
            record(layout, 1, "cp_rope", name,
                   lambda plan=plan, backend=backend: bench_ours(args, plan, backend, device))
        if len(set(lengths)) == 1:
            record(layout, 1, "dense SDPA", "cuDNN",
                   lambda lengths=lengths: bench_dense_cudnn(args, lengths, device))
        best = {r[3]: r[5] for r in rows if r[0] == layout and r[1] == 1 and r[5] is not None}
        for C in args.simulate_cp:
            if any(n % (2 * C) for n in lengths):
                sim.append((layout, C, "-", None, None, None, "lengths not divisible by 2C"))
                continue
            backend = "cudnn" if "cudnn" in best else "torch_flash"
            variants = [(pl, m) for pl in args.placement
                        for m in (args.simulate_methods if pl == "zigzag" else ("ring",))
                        if runs_at(args, m, C)]
            for placement, method in variants:
                times, note = [], f"zigzag {method_note(args, lengths, C, method)}"
                if placement == "per_document":
                    doc, thr = placed(args, lengths, C)
                    work = [doc.work(r) for r in range(C)]
                    note = (f"per_document (split > {thr}: {doc.num_split}/{len(lengths)}; work "
                            f"max/mean {max(work) * C / max(sum(work), 1):.3f}, {doc.n_rows} rows)")
                for r in range(C):
                    if placement == "zigzag":
                        plan_r = plan_for(args, lengths, device, cp_size=C, cp_rank=r,
                                          method=method)
                        times.append(bench_ours(args, plan_r, backend, device, seed=r)[:2])
                    else:
                        plan_r = PerDocumentPlan.simulated(
                            doc, r, q_heads=args.heads, kv_heads=args.kv_heads,
                            head_dim=args.head_dim, dtype=torch.bfloat16, device=device)
                        q, k, v, dout = make_qkv(args, plan_r.n_tokens, device, seed=r)
                        run = lambda p=plan_r, q=q, k=k, v=v, be=backend: context_parallel_attention(
                            q, k, v, plan=p, backend=be)
                        times.append(measure(args, run, (q, k, v), dout)[:2])
                    torch.cuda.empty_cache()
                slow_f = max(t[0] for t in times)
                slow_fb = max(t[1] for t in times)
                fast_fb = min(t[1] for t in times)
                sim.append((layout, C, backend, slow_f, slow_fb, best.get(backend) / (C * slow_fb),
                            f"{note}; fastest rank {fast_fb:.2f} ms"))
    return rows, sim


def run_several_gpus(args, rank, world, device):
    rows = []
    record = lambda layout, impl, backend, fn: recorder(rows)(layout, world, impl, backend, fn)

    for layout in args.layouts:
        lengths = layout_lengths(layout)
        if any(n % (2 * world) for n in lengths):
            continue
        for method in args.methods:
            if method == "per_document":
                placement, thr = placed(args, lengths, world)
                plan = PerDocumentPlan.build(placement, q_heads=args.heads, kv_heads=args.kv_heads,
                                             head_dim=args.head_dim, dtype=torch.bfloat16,
                                             device=device, group=dist.group.WORLD)
                record(layout, f"cp_rope per_document (split > {thr})", "auto",
                       lambda plan=plan: bench_per_document(args, plan, device, seed=rank))
                continue
            if not runs_at(args, method, world):
                continue
            impl = f"cp_rope {method}" + (f" U={args.ulysses_size}" if method == "hybrid" else "")
            for backend in (("auto", "torch_flash") if layout == "1x131072" and method == "ring"
                            else ("auto",)):
                plan = plan_for(args, lengths, device, cp_size=world, group=dist.group.WORLD,
                                method=method)
                record(layout, impl, backend,
                       lambda plan=plan, backend=backend: bench_ours(args, plan, backend, device,
                                                                     seed=rank))
                mib = method_note(args, lengths, world, method).split(": ", 1)[1]
                rows[-1] = (*rows[-1][:7], f"{mib}; {rows[-1][7]}" if rows[-1][7] else mib)
    if not args.skip_torch_cp:
        for kv_heads in (args.heads, args.kv_heads):
            name = "torch context_parallel " + ("MHA" if kv_heads == args.heads else "GQA")
            record("1x131072", name, "SDPA",
                   lambda kv_heads=kv_heads: bench_torch_cp(args, world, kv_heads, device))
    peaks = torch.tensor([r[6] or (0.0, 0.0) for r in rows], device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # report the max over ranks
    return [(*r[:6], tuple(p), r[7]) for r, p in zip(rows, peaks.tolist(), strict=True)]


def bench_torch_cp(args, cp_size, kv_heads, device):
    """PyTorch's context_parallel + SDPA(is_causal) on one sequence of 131072 tokens."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cuda", (cp_size,))
    s, d = 131072, args.head_dim
    mk = lambda h: torch.randn(1, h, s, d, device=device, dtype=torch.bfloat16)
    q, k, v, dout = mk(args.heads), mk(kv_heads), mk(kv_heads), mk(args.heads)
    gqa = {"enable_gqa": True} if kv_heads != args.heads else {}
    with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2],
                          no_restore_buffers={q, k, v, dout}):
        ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
        run = lambda: F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, **gqa)
        return measure(args, run, (ql, kl, vl), dout)


def format_report(args, world, rows, sim, elapsed) -> str:
    cmd = ("python scripts/bench_cp_attention.py" if world == 1 else
           f"torchrun --nproc-per-node {world} scripts/bench_cp_attention.py")
    if world == 1 and args.simulate_cp:
        cmd += " --simulate-cp " + " ".join(map(str, args.simulate_cp))
        cmd += " --placement " + " ".join(args.placement)
    if args.split_threshold != 16384:
        cmd += f" --split-threshold {args.split_threshold}"
    try:
        import cudnn
        fe = f"cudnn-frontend {cudnn.__version__}"
    except ImportError:
        fe = "cudnn-frontend not installed"
    fe += f", flash-attn-4 {fa4_version() or 'not installed'}"
    lines = [
        f"Command: `{cmd}`  ",
        f"Hardware: {world} x {torch.cuda.get_device_name()}; torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, {fe}, "
        f"Python {platform.python_version()}  ",
        f"Hq {args.heads}, Hkv {args.kv_heads}, head_dim {args.head_dim}, bf16, causal. Median of "
        f"{args.iters} iterations after {args.warmup} warm-up; plan built once outside the "
        "timing; TFLOP/s per GPU with causal FLOPs counted once (fwd = 4 * sum L^2 / 2 * Hq * D, "
        f"fwd+bwd = 3.5 fwd). Run time {elapsed:.0f} s.",
        "",
        "| layout | cp | implementation | backend | fwd ms | fwd TFLOP/s | fwd+bwd ms "
        "| fwd+bwd TFLOP/s | peak GiB | GiB above inputs | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for lay, cp, impl, backend, f, fb, mem, note in rows:
        if fb is None:
            lines.append(f"| {lay} | {cp} | {impl} | {backend} | - | - | - | - | - | - | {note} |")
            continue
        fl = causal_fwd_flops(layout_lengths(lay), args.heads, args.head_dim) / cp
        lines.append(f"| {lay} | {cp} | {impl} | {backend} | {f:.2f} | {fl / f / 1e9:.0f} | "
                     f"{fb:.2f} | {3.5 * fl / fb / 1e9:.0f} | {mem[0]:.2f} | {mem[1]:.2f} | {note} |")
    if sim:
        lines += ["", "Simulated CP on one GPU (`--simulate-cp`): each rank's share of a "
                  "cp_size-C step, run in turn with its own plan and loopback exchanges; slowest "
                  "rank's time; bound = t(cp=1, same backend) / (C * slowest rank's fwd+bwd). "
                  "MiB sent per rank and layer, fwd+bwd, bf16: comm_volume (checked against the "
                  "bytes counted on gloo in tests/test_ulysses.py).", "",
                  "| layout | C | backend | slowest rank fwd ms | slowest rank fwd+bwd ms "
                  "| compute-only scaling bound | note |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for lay, C, backend, f, fb, bound, note in sim:
            if fb is None:
                lines.append(f"| {lay} | {C} | {backend} | - | - | - | {note} |")
            else:
                lines.append(f"| {lay} | {C} | {backend} | {f:.2f} | {fb:.2f} | {bound:.3f} | "
                             f"{note} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cp_attention.py needs CUDA GPUs (it times the GPU backends)")
    torchrun = "LOCAL_RANK" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # the device only
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    if torchrun:
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=600), device_id=device)
    rank, world = (dist.get_rank(), dist.get_world_size()) if torchrun else (0, 1)
    started = time.monotonic()
    if world == 1:
        rows, sim = run_one_gpu(args, device)
    else:
        rows, sim = run_several_gpus(args, rank, world, device), []
    if rank == 0:
        text = format_report(args, world, rows, sim, time.monotonic() - started)
        print(text, flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"cp_attention_cp{world}.md"), "w") as fh:
                fh.write(text)
    if torchrun:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
