#!/usr/bin/env python3
"""Benchmark the cp_rope THD RoPE kernel on one GPU against the peers users would pick instead.

Setting (issue 13): local T = 65536 tokens, bf16, head_dim 128; (a) one tensor
with 32 heads, (b) q with 32 heads + k with 8 heads; n_seqs in ``--n-seqs``,
lengths equal or skewed (one document of T/4 tokens, the rest equal), in
random order; cp_size 1 and 4 (rank 1). For every point and implementation:

* kernel time: forward and forward+backward replayed from a CUDA graph
  (``triton.testing.do_bench_cudagraph``, median): no host overhead;
* eager time: the plain Python call (``triton.testing.do_bench``, median);

as % of a device-to-device copy of the same bytes measured in the same run
(bytes of q/k read + written, cos/sin excluded; fwd+bwd moves twice the bytes).
Then the per-call host time at a tiny shape (``--host-tokens``, 128: GPU time
negligible): back-to-back calls, one sync at the end, for forward and
forward+backward.

cp_rope is timed two ways: ``cp_rope`` (the standalone API: ``cu_seqlens`` and the CP
formula, a binary search per program) and ``cp_rope_plan`` (what a per-batch plan passes,
``plan.rope_args()``: int32 global ``position_ids`` built once per batch, cp_size 1; one
position load per row, no search).

Peers, on the same inputs (each checked against cp_rope before timing):

* ``flash_attn``: flash-attn's Triton rotary (``flash_attn.layers.rotary.apply_rotary_emb``
  over ``flash_attn/ops/triton/rotary.py``), varlen with ``cu_seqlens``; for
  cp_size > 1 every sequence is given as its two zigzag chunks with
  ``seqlen_offsets`` (chunk boundaries precomputed, as a user would per batch).
  q and k are two calls. Not vendored: put the two files from the flash-attn
  sdist under ``--peers`` (``flash_attn/{ops/triton,layers}/rotary.py`` with
  empty ``__init__.py`` files).
* ``liger``: Liger-Kernel's ``LigerRopeFunction`` on ``[1, H, T, D]`` views,
  cos/sin gathered by ``position_ids`` inside the timed region; in case (a) it
  also rotates a 1-head k (its API needs one; those bytes are counted).
  Importable from ``--peers``/liger (an unzipped wheel) or the environment.
* ``torch.compile``: of the Hugging Face formula (``x * cos + rotate_half(x) * sin``,
  bf16 cos/sin of width head_dim gathered by ``position_ids``).

Usage (after ``pip install --no-deps --no-build-isolation -e .``)::

    python scripts/bench_rope.py --out docs

writes ``bench_rope.md`` (the "## RoPE kernel (GPU)" section of
docs/benchmarks.md: command, hardware, tables, targets) and ``bench_rope.json``
under ``--out`` and prints the section.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time

import torch
import triton
from triton.testing import do_bench

import cp_rope
from cp_rope import apply_rotary_emb, apply_rotary_emb_qk, global_positions, rope_cache
from cp_rope.kernel import rotary_triton
from cp_rope.torch_backend import rotary_torch

HEAD_DIM = 128
CASES = {"a": (32, 0), "b": (32, 8)}  # (query heads, key heads; 0 = one tensor)
CP_RANK = 1  # the rank timed at cp_size > 1


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


# ----------------------------------------------------------------------------- implementations
class Point:
    """Inputs of one benchmark point (local view of rank CP_RANK)."""

    def __init__(self, case, n_tokens, n_seqs, dist, cp_size, caches, gen, device):
        hq, hk = CASES[case]
        self.case, self.n_tokens, self.n_seqs, self.dist, self.cp_size = case, n_tokens, n_seqs, dist, cp_size
        self.cp_rank = min(CP_RANK, cp_size - 1)
        lens = seq_lens(n_tokens, n_seqs, dist, gen)
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        self.cu_cpu, self.cu = cu, cu.to(device)
        self.max_seqlen = max(lens)
        self.position_ids = global_positions(cu, cp_size, self.cp_rank).to(device)
        # what plan.rope_args() hands over: int32 [T] (0 on padding rows) and a host bound
        self.plan_positions = self.position_ids.to(torch.int32)
        self.max_position_id = int(self.position_ids.max()) if self.position_ids.numel() else 0
        # the zigzag chunks as varlen sequences with offsets (what flash-attn can express)
        if cp_size == 1:
            self.chunk_cu, self.chunk_offsets, self.chunk_max = self.cu, 0, self.max_seqlen
        else:
            c = torch.tensor(lens) // 2
            chunk_lens = torch.stack((c, c), 1).flatten()
            self.chunk_cu = torch.cat((torch.zeros(1, dtype=torch.int64), chunk_lens.cumsum(0))).to(device, torch.int32)
            offs = torch.stack((self.cp_rank * c, (2 * cp_size - 1 - self.cp_rank) * c), 1).flatten()
            self.chunk_offsets = offs.to(device, torch.int32)
            self.chunk_max = int(c.max())
        self.q = torch.randn(n_tokens, hq, HEAD_DIM, device=device, dtype=torch.bfloat16)
        self.k = torch.randn(n_tokens, hk, HEAD_DIM, device=device, dtype=torch.bfloat16) if hk else None
        self.caches = caches

    def tensors(self, impl):
        """(q, k) that ``impl`` rotates (Liger needs a k: one head in case (a))."""
        if impl == "liger" and self.k is None:
            return self.q, torch.randn(self.n_tokens, 1, HEAD_DIM, device=self.q.device, dtype=self.q.dtype)
        return self.q, self.k

    def bytes_moved(self, q, k):
        return 2 * (q.numel() + (k.numel() if k is not None else 0)) * q.element_size()


def cp_rope_fn(p: Point):
    c = p.caches
    kw = dict(max_seqlen=p.max_seqlen, cp_size=p.cp_size, cp_rank=p.cp_rank)

    def apply(q, k):
        if k is None:
            return apply_rotary_emb(q, c["cos"], c["sin"], p.cu, **kw), None
        return apply_rotary_emb_qk(q, k, c["cos"], c["sin"], p.cu, **kw)

    return apply


def cp_rope_plan_fn(p: Point):
    c = p.caches
    kw = dict(position_ids=p.plan_positions, max_position_id=p.max_position_id)

    def apply(q, k):
        if k is None:
            return apply_rotary_emb(q, c["cos"], c["sin"], p.cu, **kw), None
        return apply_rotary_emb_qk(q, k, c["cos"], c["sin"], p.cu, **kw)

    return apply


def flash_attn_fn_maker():
    from flash_attn.layers.rotary import apply_rotary_emb as fa_rotary

    def make(p: Point):
        c = p.caches
        kw = dict(seqlen_offsets=p.chunk_offsets, cu_seqlens=p.chunk_cu, max_seqlen=p.chunk_max)

        def apply(q, k):
            qo = fa_rotary(q, c["cos"], c["sin"], **kw)
            return qo, (fa_rotary(k, c["cos"], c["sin"], **kw) if k is not None else None)

        return apply

    return make


def _import_liger_rope():
    """``LigerRopeFunction``: from the package, else from its ops/rope.py alone
    (it needs only torch and triton) when the package's other imports fail."""
    try:
        return importlib.import_module("liger_kernel.ops.rope").LigerRopeFunction
    except ImportError:
        raise
    except Exception as exc:  # noqa: BLE001 - a failing sibling module of the package
        spec = importlib.util.find_spec("liger_kernel")
        path = os.path.join(os.path.dirname(spec.origin), "ops", "rope.py")
        print(f"liger_kernel import failed ({type(exc).__name__}: {exc}); loading {path} alone")
        mod_spec = importlib.util.spec_from_file_location("_liger_rope", path)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
        return mod.LigerRopeFunction


def liger_fn_maker():
    LigerRopeFunction = _import_liger_rope()

    def make(p: Point):
        c = p.caches

        def apply(q, k):
            cs = c["cos_dup"][p.position_ids][None]
            sn = c["sin_dup"][p.position_ids][None]
            qo, ko = LigerRopeFunction.apply(q.permute(1, 0, 2)[None], k.permute(1, 0, 2)[None], cs, sn)
            return qo[0].permute(1, 0, 2), ko[0].permute(1, 0, 2)

        return apply

    return make


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(q, k, cos_dup, sin_dup, position_ids):
    """What a Hugging Face Llama user writes, on THD tensors."""
    c = cos_dup[position_ids][:, None, :]
    s = sin_dup[position_ids][:, None, :]
    q = q * c + rotate_half(q) * s
    return q, (k * c + rotate_half(k) * s if k is not None else None)


def compile_fn_maker():
    compiled = torch.compile(hf_rope, dynamic=False)

    def make(p: Point):
        c = p.caches
        return lambda q, k: compiled(q, k, c["cos_dup"], c["sin_dup"], p.position_ids)

    return make


def peers(peer_names):
    makers = {}
    for name, maker in (("flash_attn", flash_attn_fn_maker), ("liger", liger_fn_maker),
                        ("torch.compile", compile_fn_maker)):
        if name not in peer_names:
            continue
        try:
            makers[name] = maker()
        except Exception as exc:  # noqa: BLE001 - a missing peer is reported, not fatal
            print(f"{name} not available ({type(exc).__name__}: {exc}); skipped")
    return makers


# ----------------------------------------------------------------------------- timing
def _step(apply, q, k, gq, gk):
    def step():
        qo, ko = apply(q, k)
        outs, grads = [qo], [gq]
        if ko is not None:
            outs.append(ko)
            grads.append(gk)
        torch.autograd.backward(outs, grads)

    return step


def _graph(fn, leaves, rep):
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, grad_to_none=leaves, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - report, do not abort the run
        print(f"CUDA-graph timing failed: {type(exc).__name__}: {exc}")
        return float("nan")


def time_point(apply, q, k, warmup, rep):
    """Median ms: eager fwd, eager fwd+bwd, graph fwd, graph fwd+bwd."""
    qg = q.detach().clone().requires_grad_()
    kg = k.detach().clone().requires_grad_() if k is not None else None
    leaves = [t for t in (qg, kg) if t is not None]
    gq, gk = torch.randn_like(q), (torch.randn_like(k) if k is not None else None)
    step = _step(apply, qg, kg, gq, gk)

    def fwd():
        apply(q, k)

    out = [do_bench(fwd, warmup=warmup, rep=rep, return_mode="median"),
           do_bench(step, warmup=warmup, rep=rep, grad_to_none=leaves, return_mode="median"),
           _graph(fwd, None, rep), _graph(step, leaves, rep)]
    return out


def host_time_us(apply, q, k, iters):
    """Per-call wall time of back-to-back calls (one sync at the end), fwd and fwd+bwd, in us."""
    qg = q.detach().clone().requires_grad_()
    kg = k.detach().clone().requires_grad_() if k is not None else None
    gq, gk = torch.randn_like(q), (torch.randn_like(k) if k is not None else None)
    step = _step(apply, qg, kg, gq, gk)

    def fwd():
        apply(q, k)

    def fwdbwd():
        qg.grad = None
        if kg is not None:
            kg.grad = None
        step()

    res = []
    for fn in (fwd, fwdbwd):
        samples = []
        for _ in range(5):  # median of 5 batches of `iters` calls
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) / iters * 1e6)
        res.append(statistics.median(samples))
    return res


def copy_bandwidth(device, nbytes, warmup, rep):
    """TB/s of a device-to-device copy of ``nbytes`` (read + written), (graph, eager).

    The reference is the faster of the two: captured in a CUDA graph, ``copy_``
    becomes a memcpy node that the copy engines run (about 2.7 TB/s on an H200),
    not the SM copy kernel that eager ``copy_`` launches (about 4.1-4.3 TB/s)."""
    src = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    ms = _graph(lambda: dst.copy_(src), None, rep)
    ms_eager = do_bench(lambda: dst.copy_(src), warmup=warmup, rep=rep, return_mode="median")
    return 2 * nbytes / ms / 1e9, 2 * nbytes / ms_eager / 1e9


def check_correctness(caches, device, makers, n_tokens):
    """Poisoned-output check of the kernel (skewed 4096 seqs, cp 4) against the
    float64 PyTorch backend, and of each peer against cp_rope (a peer that
    disagrees is not timed)."""
    gen = torch.Generator().manual_seed(0)
    p = Point("b", n_tokens, min(4096, n_tokens // 16), "skewed", 4, caches, gen, device)
    out_q, out_k = torch.full_like(p.q, float("nan")), torch.full_like(p.k, float("nan"))
    rotary_triton(p.q, p.k, out_q, out_k, caches["cos"], caches["sin"], p.cu, 4, p.cp_rank, False, False)
    worst = 0.0
    for x, out in ((p.q, out_q), (p.k, out_k)):
        ref = rotary_torch(x.double(), caches["cos"].double(), caches["sin"].double(), p.cu, 4, p.cp_rank)
        err = (out.double() - ref).abs()
        if not bool((err <= 1e-2 + 8e-3 * ref.abs()).all()):  # bf16 storage (tests/utils.py TOL)
            raise SystemExit(f"cp_rope kernel mismatch: max |err| {err.max().item():.3g}")
        worst = max(worst, err.max().item())
        del ref, err
    print(f"correctness: cp_rope kernel vs float64 reference OK (max |err| {worst:.3g}, bf16)")
    ours = cp_rope_fn(p)(p.q, p.k)
    plan = cp_rope_plan_fn(p)(p.q, p.k)
    if not all(torch.equal(a, b) for a, b in zip(plan, ours, strict=True)):
        raise SystemExit("cp_rope_plan (position_ids) differs from the CP formula path")
    print("correctness: cp_rope_plan (position_ids) bit-equal to the CP formula path")
    for name, make in list(makers.items()):
        try:
            got = make(p)(p.q.clone(), p.k.clone())
            err = max((g.float() - o.float()).abs().max().item() for g, o in zip(got, ours, strict=True))
        except Exception as exc:  # noqa: BLE001
            print(f"correctness: {name} failed ({type(exc).__name__}: {exc}): not timed")
            del makers[name]
            continue
        ok = err <= 0.125  # bf16 math vs fp32 math at |x| < 8: a few bf16 ulps; a wrong angle is O(1)
        print(f"correctness: {name} vs cp_rope max |diff| {err:.3g} {'OK' if ok else 'MISMATCH: not timed'}")
        if not ok:
            del makers[name]


# ----------------------------------------------------------------------------- main
def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs", help="output folder for bench_rope.md/.json (default: docs)")
    p.add_argument("--tokens", type=int, default=65536, help="local tokens T (default: 65536)")
    p.add_argument("--n-seqs", default="1,8,128,1024,4096",
                   help="comma-separated sequence counts (default: 1,8,128,1024,4096)")
    p.add_argument("--warmup", type=int, default=10, help="do_bench warm-up, ms (default: 10)")
    p.add_argument("--rep", type=int, default=25, help="do_bench repetition time, ms (default: 25)")
    p.add_argument("--host-tokens", type=int, default=128, help="T of the host-time runs (default: 128)")
    p.add_argument("--host-iters", type=int, default=400, help="calls per host-time sample (default: 400)")
    p.add_argument("--peers", default=".peer_rope",
                   help="folder added to sys.path for flash_attn's rotary files and liger/ (default: .peer_rope)")
    p.add_argument("--peer-names", default="flash_attn,liger,torch.compile",
                   help="peers to time (default: flash_attn,liger,torch.compile)")
    p.add_argument("--from-json", default=None,
                   help="only re-render bench_rope.md from a run's bench_rope.json (no GPU needed)")
    p.add_argument("--device", default="cuda",
                   help="cuda (default); cpu only to smoke-test this script under TRITON_INTERPRET=1")
    args = p.parse_args()
    if args.from_json:
        return render(args.from_json, args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    for path in (args.peers, os.path.join(args.peers, "liger")):
        if os.path.isdir(path):
            sys.path.insert(0, os.path.abspath(path))
    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    T = args.tokens
    n_seqs_list = [int(x) for x in args.n_seqs.split(",")]
    cos, sin = rope_cache(4 * T, HEAD_DIM, device=device)
    caches = {"cos": cos, "sin": sin,
              "cos_dup": torch.cat((cos, cos), -1).to(torch.bfloat16),
              "sin_dup": torch.cat((sin, sin), -1).to(torch.bfloat16)}
    makers = peers(args.peer_names.split(","))
    check_correctness(caches, device, makers, T)
    copy_graph, copy_eager = copy_bandwidth(device, T * 32 * HEAD_DIM * 2, args.warmup, args.rep)
    print(f"device-to-device copy: {copy_graph:.3f} TB/s (graph), {copy_eager:.3f} TB/s (eager)")
    impls = {"cp_rope": cp_rope_fn, "cp_rope_plan": cp_rope_plan_fn, **makers}

    # host time at a tiny shape: case (b), 4 sequences, cp_size 1
    host = {}
    gen = torch.Generator().manual_seed(2)
    hp = Point("b", args.host_tokens, 4, "equal", 1, caches, gen, device)
    for name, make in impls.items():
        q, k = hp.tensors(name)
        try:
            host[name] = host_time_us(make(hp), q, k, args.host_iters)
        except Exception as exc:  # noqa: BLE001
            print(f"host time of {name} failed: {type(exc).__name__}: {exc}")
    print("host time (us):", {n: [round(v, 1) for v in h] for n, h in host.items()}, flush=True)

    rows = []
    gen = torch.Generator().manual_seed(1)
    for case in CASES:
        for cp_size in (1, 4):
            for n_seqs in n_seqs_list:
                for dist in (("equal",) if n_seqs == 1 else ("equal", "skewed")):
                    pt = Point(case, T, n_seqs, dist, cp_size, caches, gen, device)
                    for name, make in impls.items():
                        q, k = pt.tensors(name)
                        fwd, fb, fwd_g, fb_g = time_point(make(pt), q, k, args.warmup, args.rep)
                        nbytes = pt.bytes_moved(q, k)
                        rows.append(dict(case=case, cp_size=cp_size, n_seqs=n_seqs, dist=dist, impl=name,
                                         fwd_ms=fwd, fwdbwd_ms=fb, fwd_graph_ms=fwd_g, fwdbwd_graph_ms=fb_g,
                                         bytes=nbytes))
                    del pt
                    torch.cuda.empty_cache()
            print(f"case {case} cp_size {cp_size} done ({time.time() - t0:.0f} s)", flush=True)

    with open(os.path.join(args.out, "bench_rope.json"), "w") as f:
        json.dump(dict(copy_tbs_graph=copy_graph, copy_tbs_eager=copy_eager, host_us=host, rows=rows,
                       seconds=time.time() - t0, argv=sys.argv[1:],
                       hardware=hardware()), f, indent=1)
    render(os.path.join(args.out, "bench_rope.json"), args)


def hardware():
    props = torch.cuda.get_device_properties(0)
    return (f"{props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, "
            f"triton {triton.__version__}, Python {platform.python_version()}, cp_rope {cp_rope.__version__}")


def render(path, args):
    """Write bench_rope.md next to the JSON of a run and print it."""
    with open(path) as f:
        d = json.load(f)
    md = report(d, args)
    with open(os.path.join(os.path.dirname(path), "bench_rope.md"), "w") as f:
        f.write(md)
    print(md)


def _row_bytes(r, n_tokens):
    """q/k bytes read + written by one forward (runs before bytes were stored)."""
    hq, hk = CASES[r["case"]]
    if r["impl"] == "liger" and hk == 0:
        hk = 1
    return 2 * n_tokens * (hq + hk) * HEAD_DIM * 2


def report(d, args):
    rows, host = d["rows"], d["host_us"]
    copy_graph, copy_eager = d["copy_tbs_graph"], d["copy_tbs_eager"]
    copy_ref = max(copy_graph, copy_eager)
    argv = d.get("argv", sys.argv[1:])
    n_tokens = next((int(a.split("=")[1]) for a in argv if a.startswith("--tokens=")),
                    int(argv[argv.index("--tokens") + 1]) if "--tokens" in argv else 65536)
    host_tokens = int(argv[argv.index("--host-tokens") + 1]) if "--host-tokens" in argv else 128
    for r in rows:
        nbytes = r.get("bytes") or _row_bytes(r, n_tokens)
        for key in ("fwd", "fwdbwd", "fwd_graph", "fwdbwd_graph"):
            moved = nbytes * (2 if key.startswith("fwdbwd") else 1)
            r[f"{key}_pct"] = 100 * moved / r[f"{key}_ms"] / 1e9 / copy_ref
    names = list(dict.fromkeys(r["impl"] for r in rows))
    lines = [
        "## RoPE kernel (GPU, one H200)", "",
        f"Command: `python scripts/bench_rope.py {' '.join(argv)}`  ",
        f"Hardware: {d.get('hardware', '?')}  ",
        f"Local T = {n_tokens}, bf16, head_dim {HEAD_DIM}; case (a) one tensor of 32 heads, (b) q 32 "
        f"heads + k 8 heads; cp_size 4 runs rank {CP_RANK}; lengths `equal` or `skewed` (one document "
        "of T/4, the rest equal, shuffled). Peers: flash-attn 2.8.3's Triton rotary (files from the "
        "sdist, varlen; zigzag chunks + `seqlen_offsets` at cp 4; q and k two calls), Liger-Kernel "
        "0.8.5 (`LigerRopeFunction`, cos/sin gathered by position_ids in the timed region; in case (a) "
        "it also rotates a 1-head k, counted), `torch.compile` of the HF formula. % = bytes of q/k "
        "read + written / time / the device-to-device copy measured in the same run, "
        f"**{copy_ref:.3f} TB/s** (eager `copy_`, do_bench; the same copy captured in a CUDA graph "
        f"runs on the copy engines at {copy_graph:.3f} TB/s and is not the reference). "
        "graph = `do_bench_cudagraph` (kernel time, no host overhead); eager = `do_bench` of the "
        f"Python call (warmup {args.warmup} ms, rep {args.rep} ms); medians. Run time: "
        f"{d.get('seconds', float('nan')):.0f} s.", "",
        f"### Per-call host time (T = {host_tokens}, case (b), 4 sequences, cp 1)", "",
        "Back-to-back calls, one sync at the end (median of 5 batches): the GPU work is a few "
        "microseconds, so this is the host's time per call (fwd+bwd includes autograd's hand-off "
        "to its device thread).", "",
        "| impl | fwd us/call | fwd+bwd us/call |", "| --- | --- | --- |",
    ]
    for name, (f, fb) in host.items():
        lines.append(f"| {name} | {f:.1f} | {fb:.1f} |")
    lines += ["", "### Kernel (graph) time, % of copy bandwidth: fwd / fwd+bwd", "",
              "| case | cp | n_seqs | lengths | " + " | ".join(names) + " |",
              "| --- | --- | --- | --- | " + " | ".join("---" for _ in names) + " |"]
    keys = list(dict.fromkeys((r["case"], r["cp_size"], r["n_seqs"], r["dist"]) for r in rows))
    by = {(r["case"], r["cp_size"], r["n_seqs"], r["dist"], r["impl"]): r for r in rows}
    for key in keys:
        cells = []
        for n in names:
            r = by.get((*key, n))
            cells.append(f"{r['fwd_graph_pct']:.1f} / {r['fwdbwd_graph_pct']:.1f}" if r else "-")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")
    lines += ["", "### Eager time (plain Python call), % of copy bandwidth: fwd / fwd+bwd; "
              "cp_rope's eager fwd+bwd ms vs graph ms", "",
              "| case | cp | n_seqs | lengths | " + " | ".join(names) + " | cp_rope fwd+bwd eager / graph ms |",
              "| --- | --- | --- | --- | " + " | ".join("---" for _ in names) + " | --- |"]
    for key in keys:
        cells = []
        for n in names:
            r = by.get((*key, n))
            cells.append(f"{r['fwd_pct']:.1f} / {r['fwdbwd_pct']:.1f}" if r else "-")
        o = by[(*key, "cp_rope")]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells)
                     + f" | {o['fwdbwd_ms']:.4f} / {o['fwdbwd_graph_ms']:.4f} |")
    lines += ["", "### Targets (issue 20 item 4; issue 13)", ""]
    for ours_name in [n for n in ("cp_rope_plan", "cp_rope") if n in names]:
        lines += [f"{ours_name}:", ""]
        lines += _targets(rows, names, by, host, ours_name, n_tokens) + [""]
    return "\n".join(lines) + "\n"


def _targets(rows, names, by, host, ours_name, n_tokens):
    """Target lines of one cp_rope implementation (graph time, host time)."""
    lines = []
    ours = [r for r in rows if r["impl"] == ours_name]
    fmin = min(r["fwd_graph_pct"] for r in ours)
    bmin = min(r["fwdbwd_graph_pct"] for r in ours)
    lines.append(f"- graph time >= 97% of copy bandwidth at every point: fwd min {fmin:.1f}% (median "
                 f"{statistics.median(r['fwd_graph_pct'] for r in ours):.1f}), fwd+bwd min {bmin:.1f}% "
                 f"(median {statistics.median(r['fwdbwd_graph_pct'] for r in ours):.1f}): "
                 f"{'met' if min(fmin, bmin) >= 97 else 'NOT met'}")
    if "flash_attn" in names:
        slower = []
        for r in ours:
            if r["dist"] != "equal":
                continue
            fa = by[(r["case"], r["cp_size"], r["n_seqs"], r["dist"], "flash_attn")]
            for key in ("fwd_graph_ms", "fwdbwd_graph_ms"):
                if r[key] > fa[key]:
                    slower.append((100 * (r[key] / fa[key] - 1),
                                   f"{key[:-9]} ({r['case']}, cp {r['cp_size']}, n {r['n_seqs']}): "
                                   f"{r[key]:.4f} vs {fa[key]:.4f} ms"))
        slower.sort()
        lines.append("- not slower than flash-attn's rotary on equal lengths (graph): "
                     + ("met at every point" if not slower else
                        f"NOT met at {len(slower)} of {2 * sum(r['dist'] == 'equal' for r in ours)} "
                        f"(fwd and fwd+bwd): {ours_name} slower by {slower[0][0]:.1f}-{slower[-1][0]:.1f}% "
                        f"(median {statistics.median(x for x, _ in slower):.1f}%; worst {slower[-1][1]})"))
        skew = [r for r in rows if r["impl"] == "flash_attn" and r["dist"] == "skewed"]
        if skew:
            lines.append(f"- skewed lengths: flash-attn's rotary (grid n_seqs x max_seqlen) reaches "
                         f"{min(r['fwd_graph_pct'] for r in skew):.1f}-{max(r['fwd_graph_pct'] for r in skew):.1f}% "
                         f"of copy bandwidth, {ours_name} "
                         f"{min(r['fwd_graph_pct'] for r in ours if r['dist'] == 'skewed'):.1f}-"
                         f"{max(r['fwd_graph_pct'] for r in ours if r['dist'] == 'skewed'):.1f}% (fwd, graph)")
    beaten = []
    for r in ours:
        for n in names:
            o = by.get((r["case"], r["cp_size"], r["n_seqs"], r["dist"], n))
            if not n.startswith("cp_rope") and o is not None:
                beaten += [n for key in ("fwd_graph_ms", "fwdbwd_graph_ms") if o[key] < r[key]]
    lines.append("- faster than every peer at every point (graph): " + (
        "met" if not beaten else "NOT met: a peer is faster in " + ", ".join(
            f"{beaten.count(n)} {n}" for n in dict.fromkeys(beaten)) + " of "
        f"{2 * len(ours)} (point, direction) pairs"))
    ratios = [r["fwdbwd_ms"] / r["fwdbwd_graph_ms"] for r in ours]
    lines.append(f"- eager fwd+bwd within 10% of graph time at T = {n_tokens}: eager / graph = "
                 f"{min(ratios):.3f}..{max(ratios):.3f}: {'met' if max(ratios) <= 1.10 else 'NOT met'}")
    peers_h = {n: h for n, h in host.items() if not n.startswith("cp_rope")}
    if ours_name in host and peers_h:
        for i, what in enumerate(("fwd", "fwd+bwd")):
            best = min(peers_h, key=lambda n: peers_h[n][i])
            ok = host[ours_name][i] <= peers_h[best][i]
            lines.append(f"- host time per call, {what}: {ours_name} {host[ours_name][i]:.1f} us vs lowest "
                         f"peer {best} {peers_h[best][i]:.1f} us: {'met' if ok else 'NOT met'}")
    return lines


if __name__ == "__main__":
    main()
