#!/usr/bin/env python3
"""Benchmark sliding-window attention with and without sinks (issue 32's H200 target).

Setting: Hq 32, Hkv 8, head_dim 128, bf16, causal, one document of ``--tokens`` (default
131072) tokens packed THD, forward + backward. For every window ``W`` of ``--windows``
(default 4096 1024 128) and sinks off / on (``--sinks off on``):

* ``FA4 own``: ``flash_attn.cute.flash_attn_varlen_func(..., causal=True,
  window_size=(W - 1, 0), learnable_sink=sinks)`` (FlashAttention-4's windowed varlen call,
  sinks float32 ``[Hq]`` with a gradient), the baseline;
* ``cp_rope <backend>`` for each of ``--backends`` (default auto fa4): a plan built once
  (``attention_plan(..., window=W, sinks=...)``, outside the timed region, as the trainer
  does), then ``context_parallel_attention(q, k, v, plan=plan, sinks=...)``;
* ``cp C sim`` for each ``C`` of ``--simulate-cp`` (default 2 4): each rank's share in turn
  (:meth:`CPAttentionPlan.simulated`: its windowed ring blocks and kernels on its ``T / C``
  rows, loopback exchanges) on backend ``--sim-backend`` (default auto); the table gives the
  slowest rank and the compute-only scaling ``t(cp 1) / (C x slowest rank)``, and the note
  the K/V bytes one rank sends per layer (``comm_volume``: the halo; the full ring's in
  brackets) and the device time of copying them (the loopback's share of the exchange,
  ``--halo-gbps`` gives the NVLink estimate too).

A full-causal FA4 row per sinks setting gives the reference of the window's FLOP share.
FLOPs: ``4 x pairs x Hq x D`` forward (pairs: the (query, key) pairs the window lets
through), x 3.5 for forward + backward. Every variant runs in its own try: one that fails
prints its error in the table and the others run. The markdown table is printed (and
written to ``--out``/bench_window.md with ``--out``).

Usage (repository root, one H200 with FlashAttention-4 installed: docs/parallel.md)::

    python scripts/bench_window.py
    python scripts/bench_window.py --windows 4096 --sinks on --simulate-cp 4 --iters 5
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import traceback

import torch

from cp_rope.parallel import CPAttentionPlan, attention_plan, context_parallel_attention
from cp_rope.parallel.ulysses import comm_volume


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=131072, help="document length (tokens)")
    p.add_argument("--windows", type=int, nargs="+", default=[4096, 1024, 128],
                   help="left windows W (query p sees keys p-W+1..p)")
    p.add_argument("--sinks", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--backends", nargs="+", default=["auto", "fa4"],
                   help="cp_rope backends at cp 1")
    p.add_argument("--simulate-cp", type=int, nargs="*", default=[2, 4],
                   help="cp sizes simulated on the one GPU (none: skip)")
    p.add_argument("--sim-backend", default="auto", help="backend of the simulated ranks")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations (after JIT)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations (median)")
    p.add_argument("--halo-gbps", type=float, default=400.0,
                   help="link GB/s for the halo time estimate (H200 NVLink ~400 per direction)")
    p.add_argument("--no-full", action="store_true", help="skip the full-causal FA4 rows")
    p.add_argument("--out", default=None, help="folder for bench_window.md")
    return p.parse_args()


def window_pairs(n: int, window: int | None) -> int:
    """(query, key) pairs a causal window ``W`` lets through in a document of ``n`` tokens."""
    w = n if window is None else min(window, n)
    return w * (w + 1) // 2 + (n - w) * w


def cuda_ms(fn, warmup: int, iters: int) -> float:
    """Median ms of ``fn`` over ``iters`` (CUDA events), after ``warmup`` calls."""
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


def leaves(args, n: int, sinks: bool, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(n, h, args.head_dim, generator=gen, device="cuda",
                           dtype=torch.bfloat16).requires_grad_()
               for h in (args.q_heads, args.kv_heads, args.kv_heads))
    s = (torch.randn(args.q_heads, generator=gen, device="cuda").requires_grad_()
         if sinks else None)
    dout = torch.randn(n, args.q_heads, args.head_dim, generator=gen, device="cuda",
                       dtype=torch.bfloat16)
    return q, k, v, s, dout


def fwd_bwd(run, ins, dout):
    """A callable: one forward (``run(*ins)``) and backward into every leaf's .grad."""
    live = [t for t in ins if t is not None]

    def step():
        for t in live:
            t.grad = None
        out = run(*ins)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dout)
    return step


def fa4_own(args, W, sinks):
    from flash_attn.cute import flash_attn_varlen_func

    T = args.tokens
    q, k, v, s, dout = leaves(args, T, sinks, 0)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    win = (None, None) if W is None else (W - 1, 0)

    def run(q, k, v, s):
        kw = {} if s is None else {"learnable_sink": s}
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                      max_seqlen_q=T, max_seqlen_k=T, causal=True,
                                      window_size=win, **kw)
    return cuda_ms(fwd_bwd(run, (q, k, v, s), dout), args.warmup, args.iters), ""


def cp_rope_cp1(args, W, sinks, backend):
    T = args.tokens
    q, k, v, s, dout = leaves(args, T, sinks, 0)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    plan = attention_plan(cu, T, q_heads=args.q_heads, kv_heads=args.kv_heads,
                          head_dim=args.head_dim, dtype=torch.bfloat16, backend=backend,
                          window=W, sinks=sinks)

    def run(q, k, v, s):
        return context_parallel_attention(q, k, v, plan=plan, sinks=s)
    ms = cuda_ms(fwd_bwd(run, (q, k, v, s), dout), args.warmup, args.iters)
    from cp_rope.parallel._blocks import get_backend
    be = get_backend(backend, q, 1, windowed=plan.windowed)
    return ms, f"blocks on {be.name}"


def cp_sim(args, W, sinks, C):
    """(slowest rank ms, note) of cp ``C`` simulated rank by rank."""
    T = args.tokens
    if T % (2 * C):
        raise ValueError(f"--tokens {T} must divide by 2 x cp = {2 * C}")
    n = T // C
    local = torch.tensor([0, n], dtype=torch.int32)
    times = []
    for r in range(C):
        q, k, v, s, dout = leaves(args, n, sinks, r)
        plan = CPAttentionPlan.simulated(local, n, cp_size=C, cp_rank=r, q_heads=args.q_heads,
                                         kv_heads=args.kv_heads, head_dim=args.head_dim,
                                         dtype=torch.bfloat16, device="cuda",
                                         backend=args.sim_backend, window=W, sinks=sinks)

        def run(q, k, v, s, plan=plan):
            return context_parallel_attention(q, k, v, plan=plan, sinks=s)
        times.append(cuda_ms(fwd_bwd(run, (q, k, v, s), dout), args.warmup, args.iters))
        del q, k, v, s, dout, plan
    vol = [comm_volume("ring", n_tokens=n, q_heads=args.q_heads, kv_heads=args.kv_heads,
                       head_dim=args.head_dim, cp_size=C, window=W, cu_seqlens=torch.tensor([0, n]),
                       cp_rank=r) for r in range(C)]
    full = comm_volume("ring", n_tokens=n, q_heads=args.q_heads, kv_heads=args.kv_heads,
                       head_dim=args.head_dim, cp_size=C)
    sent = max(v_["forward"] + v_["backward"] for v_ in vol)
    copy_ms = _copy_ms(max(v_["forward"] for v_ in vol), args)
    note = (f"ranks {', '.join(f'{t:.1f}' for t in times)} ms; K/V sent per rank fwd+bwd "
            f"{sent / 2**20:.2f} MiB (full ring {(full['forward'] + full['backward']) / 2**20:.0f}"
            f" MiB); fwd halo device copy {copy_ms:.3f} ms, at {args.halo_gbps:.0f} GB/s "
            f"{sent / args.halo_gbps / 1e6:.3f} ms")
    return max(times), note


def _copy_ms(n_bytes: int, args) -> float:
    """Device time of copying ``n_bytes`` once (the halo's bytes, one buffer to another)."""
    if n_bytes == 0:
        return 0.0
    src = torch.empty(max(n_bytes // 2, 1), dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return cuda_ms(lambda: dst.copy_(src), args.warmup, args.iters)


def attempt(fn, *a):
    """``(ms, note)`` of one variant, or ``(None, "FAIL ...")``; frees the GPU after."""
    try:
        return fn(*a)
    except Exception as exc:  # noqa: BLE001  (one variant's failure must not stop the rest)
        traceback.print_exc(file=sys.stderr)
        return None, f"FAIL {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_window: needs a CUDA GPU")
    T, hq, d = args.tokens, args.q_heads, args.head_dim
    rows = []

    def add(W, sinks, variant, ms, note, base, flops):
        tf = f"{flops / ms / 1e9:.0f}" if ms else "-"
        ratio = f"{ms / base:.3f}" if ms and base else "-"
        rows.append(f"| {W or 'full'} | {'on' if sinks else 'off'} | {variant} | "
                    f"{f'{ms:.2f}' if ms else '-'} | {tf} | {ratio} | {note} |")
        print(rows[-1], flush=True)

    windows = ([None] if not args.no_full else []) + list(args.windows)
    for sinks in (x == "on" for x in args.sinks):
        for W in windows:
            flops = 3.5 * 4 * window_pairs(T, W) * hq * d
            base, note = attempt(fa4_own, args, W, sinks)
            add(W, sinks, "FA4 own", base, note or "baseline", base, flops)
            if W is None:
                continue
            t1 = None
            for b in args.backends:
                ms, note = attempt(cp_rope_cp1, args, W, sinks, b)
                t1 = ms if t1 is None else t1
                add(W, sinks, f"cp_rope {b}", ms, note, base, flops)
            for C in args.simulate_cp:
                ms, note = attempt(cp_sim, args, W, sinks, C)
                scale = f"; scaling {t1 / (C * ms):.2f}" if ms and t1 else ""
                add(W, sinks, f"cp {C} sim ({args.sim_backend}, slowest rank)", ms,
                    note + scale, base, flops / C)
    p = torch.cuda.get_device_properties(0)
    try:
        from cp_rope.parallel._compat import fa4_version
        fa4 = fa4_version()
    except Exception:  # noqa: BLE001
        fa4 = None
    head = (f"Sliding-window attention, fwd+bwd, 1 x {T} tokens, Hq {hq} / Hkv {args.kv_heads}, "
            f"head_dim {d}, bf16; {p.name}, torch {torch.__version__}, flash-attn-4 {fa4}, "
            f"Python {platform.python_version()}; median of {args.iters} after {args.warmup} "
            f"warm-up.\n'x FA4' = time / FA4's own windowed call (same W, sinks); TFLOP/s of "
            f"the window's pairs (cp C sim: one rank's share).\n\n"
            "| W | sinks | variant | fwd+bwd ms | TFLOP/s | x FA4 | note |\n"
            "| --- | --- | --- | --- | --- | --- | --- |\n")
    table = head + "\n".join(rows) + "\n"
    print("\n" + table)
    if args.out:
        import os
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_window.md"), "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
