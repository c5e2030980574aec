#!/usr/bin/env python3
"""Benchmark the cp_rope THD RoPE kernel on one GPU against what users would pick instead.

Setting (issue 2): local T = 65536 tokens, bf16, head_dim 128; (a) one tensor
with 32 heads, (b) q with 32 heads + k with 8 heads in one call; n_seqs in
{1, 8, 32, 128, 512, 1024, 2401, 4096}, lengths equal or skewed (one document
of T/4 tokens, the rest equal), in random order; cp_size 1 and 4 (rank 1).
Forward and forward+backward, median of ``triton.testing.do_bench``;
bandwidth counts the bytes of x read and written (cos/sin reads excluded)
and is compared with a device-to-device copy measured in the same run.

Alternatives, timed on the same inputs (cos/sin gathered by position_ids
inside the timed region, as a training step would):
* eager PyTorch (Hugging Face Llama style: bf16 cos/sin cache of width
  head_dim, ``x * cos + rotate_half(x) * sin``),
* ``torch.compile`` of that function,
* Liger-Kernel's ``LigerRopeFunction`` (if importable) on ``[1, H, T, D]``
  views (in place); for (a) it gets a 1-head k as well (its API needs one;
  those bytes are counted).

Before timing, every implementation is checked against the PyTorch reference
(outputs poisoned with NaN first for cp_rope).

Usage (after `bash scripts/setup.sh`, or `pip install --no-deps --no-build-isolation -e .`)::

    python scripts/bench_rope.py --out docs

writes ``bench_rope.md`` (a "## RoPE kernel (GPU)" section for
docs/benchmarks.md: command, hardware, table, targets), ``bench_rope.png`` and
``bench_rope.json`` under ``--out`` and prints the section.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import cp_rope  # noqa: E402
from cp_rope import apply_rotary_emb, apply_rotary_emb_qk, global_positions, rope_cache  # noqa: E402
from cp_rope.kernel import rotary_triton  # noqa: E402
from cp_rope.torch_backend import rotary_torch  # noqa: E402

N_SEQS = [1, 8, 32, 128, 512, 1024, 2401, 4096]
HEAD_DIM = 128
CASES = {"a": (32, 0), "b": (32, 8)}  # (query heads, key heads; 0 = one tensor)


def even_split(total: int, parts: int) -> list[int]:
    """``parts`` even lengths summing to ``total`` (even), as equal as possible."""
    base = total // parts // 2 * 2
    lens = [base] * parts
    for i in range((total - base * parts) // 2):
        lens[i] += 2
    return lens


def seq_lens(n_tokens: int, n_seqs: int, dist: str, gen: torch.Generator) -> list[int]:
    if n_seqs == 1:
        return [n_tokens]
    if dist == "equal":
        lens = even_split(n_tokens, n_seqs)
    else:  # one document of T/4 tokens, the rest equal
        lens = [n_tokens // 4] + even_split(n_tokens - n_tokens // 4, n_seqs - 1)
    order = torch.randperm(n_seqs, generator=gen).tolist()
    return [lens[i] for i in order]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def eager_rope(q, k, cos_dup, sin_dup, position_ids):
    """What a Hugging Face Llama user writes, on THD tensors."""
    c = cos_dup[position_ids][:, None, :]
    s = sin_dup[position_ids][:, None, :]
    q = q * c + rotate_half(q) * s
    if k is None:
        return q, None
    return q, k * c + rotate_half(k) * s


def _import_liger_rope():
    """``LigerRopeFunction``: from the package, else from its ops/rope.py alone
    (it needs only torch and triton) when the package's other imports fail."""
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
        return LigerRopeFunction
    except ImportError:
        raise
    except Exception as exc:  # noqa: BLE001 - a failing sibling module of the package
        import importlib.util

        spec = importlib.util.find_spec("liger_kernel")
        path = os.path.join(os.path.dirname(spec.origin), "ops", "rope.py")
        print(f"liger_kernel import failed ({type(exc).__name__}: {exc}); loading {path} alone")
        mod_spec = importlib.util.spec_from_file_location("_liger_rope", path)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
        return mod.LigerRopeFunction


def liger_fn():
    try:
        LigerRopeFunction = _import_liger_rope()
    except Exception as exc:  # noqa: BLE001 - any failure means "not available"
        print(f"Liger-Kernel not importable ({type(exc).__name__}: {exc}); skipped")
        return None

    def liger_rope(q, k, cos_dup, sin_dup, position_ids):
        c = cos_dup[position_ids][None]
        s = sin_dup[position_ids][None]
        qo, ko = LigerRopeFunction.apply(q.permute(1, 0, 2)[None], k.permute(1, 0, 2)[None], c, s)
        return qo[0].permute(1, 0, 2), ko[0].permute(1, 0, 2)

    return liger_rope


class Setup:
    """Inputs of one benchmark point."""

    def __init__(self, case, n_seqs, dist, cp_size, caches, gen, device):
        hq, hk = CASES[case]
        self.n_tokens = T = caches["T"]
        lens = seq_lens(T, n_seqs, dist, gen)
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        self.cp_size, self.cp_rank = cp_size, min(1, cp_size - 1)
        self.cu = cu.to(device)
        self.max_seqlen = max(lens)
        self.position_ids = global_positions(cu, cp_size, self.cp_rank).to(device)
        self.q = torch.randn(T, hq, HEAD_DIM, device=device, dtype=torch.bfloat16)
        self.k = torch.randn(T, hk, HEAD_DIM, device=device, dtype=torch.bfloat16) if hk else None
        # Liger needs a k: for case (a), one head
        self.k_liger = self.k if hk else torch.randn(T, 1, HEAD_DIM, device=device, dtype=torch.bfloat16)
        self.gq, self.gk = torch.randn_like(self.q), (torch.randn_like(self.k) if hk else None)
        self.gk_liger = torch.randn_like(self.k_liger)
        self.caches = caches

    def ours(self, q, k):
        c = self.caches
        kw = dict(max_seqlen=self.max_seqlen, cp_size=self.cp_size, cp_rank=self.cp_rank)
        if k is None:
            return apply_rotary_emb(q, c["cos"], c["sin"], self.cu, **kw), None
        return apply_rotary_emb_qk(q, k, c["cos"], c["sin"], self.cu, **kw)

    def bytes_moved(self, with_liger_k=False):
        k = self.k_liger if with_liger_k else self.k
        n = self.q.numel() + (k.numel() if k is not None else 0)
        return 2 * n * self.q.element_size()  # read + write


def bench(fn, grad_to_none, warmup, rep):
    return do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def bench_graph(fn, grad_to_none, rep):
    """Median ms of fn replayed from a CUDA graph: the GPU time without host overhead."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, grad_to_none=grad_to_none,
                                                 return_mode="median")
    except Exception as exc:  # noqa: BLE001 - report, do not abort the run
        print(f"CUDA-graph timing failed: {type(exc).__name__}: {exc}")
        return float("nan")


def fwd_and_fwdbwd(apply, q, k, gq, gk, warmup, rep, graph=False):
    """Median ms of apply(q, k) and of apply + backward with gradients (gq, gk);
    with ``graph``, also both replayed from a CUDA graph (else NaN)."""
    fwd = bench(lambda: apply(q, k), None, warmup, rep)
    qg = q.detach().clone().requires_grad_()
    kg = k.detach().clone().requires_grad_() if k is not None else None
    leaves = [t for t in (qg, kg) if t is not None]

    def step():
        qo, ko = apply(qg, kg)
        outs, grads = [qo], [gq]
        if ko is not None:
            outs.append(ko)
            grads.append(gk)
        torch.autograd.backward(outs, grads)

    fwdbwd = bench(step, leaves, warmup, rep)
    if not graph or q.device.type != "cuda":
        return fwd, fwdbwd, float("nan"), float("nan")
    return fwd, fwdbwd, bench_graph(lambda: apply(q, k), None, rep), bench_graph(step, leaves, rep)


def check_correctness(caches, device, alternatives):
    """Poisoned-output check of the kernel (skewed 4096 seqs, cp 4) against the
    float64 PyTorch path, and of each alternative against the kernel."""
    gen = torch.Generator().manual_seed(0)
    s = Setup("b", 4096, "skewed", 4, caches, gen, device)
    out_q = torch.full_like(s.q, float("nan"))
    out_k = torch.full_like(s.k, float("nan"))
    rotary_triton(s.q, s.k, out_q, out_k, caches["cos"], caches["sin"], s.cu, 4, s.cp_rank, False, False)
    worst = 0.0
    for x, out in ((s.q, out_q), (s.k, out_k)):
        ref = rotary_torch(x.double(), caches["cos"].double(), caches["sin"].double(), s.cu, 4, s.cp_rank)
        err = (out.double() - ref).abs()
        bound = 1e-2 + 8e-3 * ref.abs()  # bf16 storage (tests/utils.py TOL)
        if not bool((err <= bound).all()):
            raise SystemExit(f"cp_rope kernel mismatch: max |err| {err.max().item():.3g}")
        worst = max(worst, err.max().item())
        del ref, err, bound
    print(f"correctness: cp_rope kernel vs float64 reference OK (max |err| {worst:.3g}, bf16)")
    ours_q, ours_k = s.ours(s.q, s.k)
    for name, fn in list(alternatives.items()):
        q, k = s.q.clone(), s.k.clone()
        aq, ak = fn(q, k, caches["cos_dup"], caches["sin_dup"], s.position_ids)
        err = max((aq.float() - ours_q.float()).abs().max().item(),
                  (ak.float() - ours_k.float()).abs().max().item())
        ok = err <= 0.125  # bf16 math vs fp32 math at |x| < 8: a few bf16 ulps; a wrong angle is O(1)
        print(f"correctness: {name} vs cp_rope max |diff| {err:.3g} "
              f"{'OK' if ok else 'MISMATCH: not timed'}")
        if not ok:
            del alternatives[name]


def copy_bandwidth(device, nbytes, warmup, rep):
    src = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), None, warmup, rep)
    return 2 * nbytes / ms / 1e9  # TB/s


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9), sharex=True)
    impls = sorted({r["impl"] for r in rows})
    for (case, cp), ax in zip([(c, p) for c in CASES for p in (1, 4)], axes.flat, strict=True):
        for impl in impls:
            for dist, style in (("equal", "-"), ("skewed", "--")):
                pts = sorted((r["n_seqs"], r["fwd_ms"]) for r in rows
                             if r["case"] == case and r["cp_size"] == cp and r["impl"] == impl
                             and (r["dist"] == dist or r["n_seqs"] == 1))
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, marker="o", ms=3, label=f"{impl} {dist}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"case ({case}) {'32 heads' if case == 'a' else 'q 32 + k 8 heads'}, cp_size {cp}: forward")
        ax.set_xlabel("n_seqs")
        ax.set_ylabel("ms (median)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs", help="output folder for bench_rope.md/.png/.json (default: docs)")
    p.add_argument("--tokens", type=int, default=65536, help="local tokens T (default: 65536)")
    p.add_argument("--warmup", type=int, default=10, help="do_bench warm-up, ms (default: 10)")
    p.add_argument("--rep", type=int, default=40, help="do_bench repetition time, ms (default: 40)")
    p.add_argument("--no-alternatives", action="store_true", help="time cp_rope only")
    p.add_argument("--device", default="cuda",
                   help="cuda (default); cpu only to smoke-test this script (with TRITON_INTERPRET=1, tiny --tokens)")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    T = args.tokens
    cos, sin = rope_cache(4 * T, HEAD_DIM, device=device)
    caches = {"T": T, "cos": cos, "sin": sin,
              "cos_dup": torch.cat((cos, cos), -1).to(torch.bfloat16),
              "sin_dup": torch.cat((sin, sin), -1).to(torch.bfloat16)}
    alternatives = {}
    if not args.no_alternatives:
        alternatives["eager"] = eager_rope
        alternatives["torch.compile"] = torch.compile(eager_rope, dynamic=False)
        liger = liger_fn()
        if liger is not None:
            alternatives["liger"] = liger
    check_correctness(caches, device, alternatives)
    copy_tbs = copy_bandwidth(device, T * 32 * HEAD_DIM * 2, args.warmup, args.rep)
    print(f"device-to-device copy: {copy_tbs:.3f} TB/s")

    rows = []
    gen = torch.Generator().manual_seed(1)
    for case in CASES:
        for cp_size in (1, 4):
            for n_seqs in N_SEQS:
                for dist in (("equal",) if n_seqs == 1 else ("equal", "skewed")):
                    s = Setup(case, n_seqs, dist, cp_size, caches, gen, device)
                    impls = {"cp_rope": (s.ours, s.k, s.gk, False)}
                    for name, fn in alternatives.items():
                        is_liger = name == "liger"
                        k = s.k_liger if is_liger else s.k
                        impls[name] = (
                            (lambda q, k, fn=fn, s=s: fn(q, k, caches["cos_dup"], caches["sin_dup"],
                                                          s.position_ids)),
                            k, s.gk_liger if is_liger else s.gk, is_liger)
                    for name, (apply, k, gk, liger_k) in impls.items():
                        fwd, fb, fwd_g, fb_g = fwd_and_fwdbwd(apply, s.q, k, s.gq, gk, args.warmup,
                                                              args.rep, graph=name == "cp_rope")
                        nbytes = s.bytes_moved(liger_k)
                        row = dict(case=case, cp_size=cp_size, n_seqs=n_seqs, dist=dist, impl=name,
                                   fwd_ms=fwd, fwdbwd_ms=fb, fwd_graph_ms=fwd_g, fwdbwd_graph_ms=fb_g,
                                   fwd_tbs=nbytes / fwd / 1e9, fwdbwd_tbs=2 * nbytes / fb / 1e9)
                        row["fwd_pct"] = 100 * row["fwd_tbs"] / copy_tbs
                        row["fwdbwd_pct"] = 100 * row["fwdbwd_tbs"] / copy_tbs
                        rows.append(row)
                    del s
                    torch.cuda.empty_cache()
            print(f"case {case} cp_size {cp_size} done ({time.time() - t0:.0f} s)", flush=True)

    md = report(rows, copy_tbs, args, time.time() - t0)
    with open(os.path.join(args.out, "bench_rope.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "bench_rope.json"), "w") as f:
        json.dump(dict(copy_tbs=copy_tbs, rows=rows), f, indent=1)
    try:
        plot(rows, os.path.join(args.out, "bench_rope.png"))
    except Exception as exc:  # noqa: BLE001 - the table matters more than the plot
        print(f"no plot: {type(exc).__name__}: {exc}")
    print(md)


def report(rows, copy_tbs, args, seconds):
    if args.device == "cpu":
        hw = f"CPU smoke test ({platform.processor() or platform.machine()})"
    else:
        props = torch.cuda.get_device_properties(0)
        hw = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    lines = [
        "## RoPE kernel (GPU)", "",
        f"Command: `python scripts/bench_rope.py {' '.join(sys.argv[1:])}`  ",
        f"Hardware: {hw}, torch {torch.__version__}, "
        f"triton {triton.__version__}, Python {platform.python_version()}, cp_rope {cp_rope.__version__}  ",
        f"Local T = {args.tokens}, bf16, head_dim {HEAD_DIM}; case (a) one tensor of 32 heads, "
        "(b) q 32 heads + k 8 heads in one call; cp_size 4 runs rank 1. Time: median of "
        f"`triton.testing.do_bench` (warmup {args.warmup} ms, rep {args.rep} ms). "
        "Bandwidth: bytes of q/k read + written (cos/sin excluded) / time; % of the "
        f"device-to-device copy measured in the same run: **{copy_tbs:.3f} TB/s**. "
        "fwd+bwd moves twice the bytes. Alternatives gather cos/sin by position_ids "
        "inside the timed region. Liger in case (a) also rotates a 1-head k (counted).  ",
        f"Run time: {seconds:.0f} s.", "",
        "Columns `graph`: the same step replayed from a CUDA graph (`do_bench_cudagraph`, "
        "no host overhead, no L2 flush; cp_rope only).", "",
        "| case | cp | n_seqs | lengths | impl | fwd ms | fwd TB/s | fwd % copy | fwd+bwd ms | fwd+bwd TB/s | fwd+bwd % copy | fwd ms graph | fwd+bwd ms graph |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['cp_size']} | {r['n_seqs']} | {r['dist']} | {r['impl']} | "
            f"{r['fwd_ms']:.4f} | {r['fwd_tbs']:.2f} | {r['fwd_pct']:.1f} | {r['fwdbwd_ms']:.4f} | "
            f"{r['fwdbwd_tbs']:.2f} | {r['fwdbwd_pct']:.1f} | {r['fwd_graph_ms']:.4f} | "
            f"{r['fwdbwd_graph_ms']:.4f} |")
    lines += ["", "![RoPE forward time](bench_rope.png)", "", "### Targets", ""]
    ours = [r for r in rows if r["impl"] == "cp_rope"]
    lines.append(f"- min % of copy bandwidth, forward: {min(r['fwd_pct'] for r in ours):.1f} "
                 f"(median {statistics.median(r['fwd_pct'] for r in ours):.1f}); forward+backward: "
                 f"{min(r['fwdbwd_pct'] for r in ours):.1f} (target >= 90, aim 95)")
    for case in CASES:
        for cp in (1, 4):
            def t(n, d, key, case=case, cp=cp):
                return next(r[key] for r in ours if r["case"] == case and r["cp_size"] == cp
                            and r["n_seqs"] == n and r["dist"] == d)
            n = max(N_SEQS)
            lines.append(f"- ({case}, cp {cp}) n_seqs {n} skewed / n_seqs 1: fwd "
                         f"{t(n, 'skewed', 'fwd_ms') / t(1, 'equal', 'fwd_ms'):.3f}, fwd+bwd "
                         f"{t(n, 'skewed', 'fwdbwd_ms') / t(1, 'equal', 'fwdbwd_ms'):.3f} (target <= 1.05)")
    slower = []
    for r in ours:
        for o in rows:
            same = all(o[key] == r[key] for key in ("case", "cp_size", "n_seqs", "dist"))
            if same and o["impl"] != "cp_rope":
                for key in ("fwd_ms", "fwdbwd_ms"):
                    if o[key] <= r[key]:
                        slower.append(f"{o['impl']} {key} at ({r['case']}, cp {r['cp_size']}, "
                                      f"{r['n_seqs']} {r['dist']}): {o[key]:.4f} <= {r[key]:.4f}")
    lines.append("- faster than every alternative at every point: "
                 + ("yes" if not slower else f"NO, {len(slower)} cases, e.g. " + "; ".join(slower[:6])))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
