"""Constants of the CP cost model (:mod:`cp_rope.parallel.cost_model`): shipped H200 defaults,
a JSON file format, and a measurement of the local GPU and links.

    python -m cp_rope.parallel.calibrate --out cal.json                 # one GPU: kernels, HBM
    torchrun --nproc-per-node 2 -m cp_rope.parallel.calibrate --out cal.json   # + links

The trainers read the file with ``--cp-calibration PATH`` and pass it to every plan they build
(``attention_plan(..., calibration=load_calibration(PATH))``; ``plan.calibration``): the
constants of ``method="auto"`` / ``placement="auto"`` and of backend ``"auto"``'s FA4 / cuDNN
crossover. Nothing keeps a calibration for the process. A file records the device name
and the torch version it was measured with; :func:`load_calibration` refuses a file from
another device or torch version, or one it cannot read, with its path in the message.

Units: ``tflops``: TFLOP/s of forward + backward causal attention with FLOPs counted as
flash-attention's benchmarks do (``3.5 x 4 x pairs x H x D``), per backend, at each
``block_keys`` (keys per query row of a segment, ``pairs / rows``); ``call_us``:
microseconds per block call (forward + backward); bandwidths in GB/s (1e9 bytes/s);
``merge_bytes_per_row``: bytes moved per output element per extra ring step (merge +
dq accumulation); ``latency_us`` per exchange; ``seg_ns`` per segment and head of a block
call; ``tile``: the kernels' tile rows; ``node_size``: GPUs joined by ``p2p_gbps`` /
``a2a_gbps`` / ``collective_gbps`` links (one node); exchanges that span more ranks run
at ``internode_gbps`` (per GPU).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from . import _compat
from ._blocks import backend_unavailable
from ._calibration import (
    FORMAT,
    Calibration,
    CalibrationError,
    _device_name,
    calibration_or_default,
    default_calibration,
    load_calibration,
    save_calibration,
)
from .attention import attention_plan, context_parallel_attention
from .choices import BACKENDS

__all__ = ["FORMAT", "LINKS_NOT_MEASURED", "NEVER", "Calibration", "CalibrationError",
           "calibration_or_default", "crossover_from", "default_calibration", "load_calibration",
           "measure", "save_calibration"]


# ------------------------------------------------------------------ measurement

def _time(fn, sync, iters: int) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


CROSSOVER_ROWS = 131072
"""Rows per timed call of the crossover measurement (documents of 256 .. 131072 rows, 32 query
and 8 KV heads): every call compute-bound. At 32768 rows and 8 heads the short documents' calls
are host-bound (1.3 ms per call on an H200) and the two kernels tie there by noise: measured
{64: 64, 128: 128}, against cuDNN 1.26-1.29x faster at 256 rows in the benchmark."""
NEVER = 2 ** 31 - 1
"""A crossover no document reaches: FA4 was slower at every measured length."""


def _kernels(device: torch.device, backend: str, head_dim: int) -> list[str]:
    """The block backends whose tables :func:`measure` times: ``auto`` on a GPU where cudnn
    and fa4 both run: both (and the crossover table); else the one ``auto`` picks."""
    if backend != "auto":
        return [backend]
    runs = [b for b in BACKENDS if backend_unavailable(
        b, device=device, dtype=torch.bfloat16, head_dim=head_dim) is None]
    return ["cudnn", "fa4"] if {"cudnn", "fa4"} <= set(runs) else runs[:1]


def _timer(device, dtype, heads, kv_heads, head_dim, sync, iters, gen):
    """``time(L, T, backend)``: seconds of forward + backward causal attention over documents
    of ``L`` rows packed into ``T`` (a prebuilt plan: kernels and glue, no plan building)."""
    def time_it(L: int, T: int, backend: str) -> float:
        cu = torch.arange(0, T + 1, L, dtype=torch.int32)
        q = torch.randn(T, heads, head_dim, device=device, dtype=dtype, generator=gen)
        k = torch.randn(T, kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
        v = torch.randn_like(k)
        q.requires_grad_(True)
        plan = attention_plan(cu.to(device), L, q_heads=heads, kv_heads=kv_heads,
                              head_dim=head_dim, dtype=dtype, device=device, backend=backend)
        dout = torch.randn_like(q)

        def step():
            out = context_parallel_attention(q, k, v, plan=plan)
            out.backward(dout)
        return _time(step, sync, iters)
    return time_it


def crossover_from(lengths, t_cudnn, t_fa4) -> int:
    """The crossover (query rows) from timings at increasing document ``lengths``: the
    shortest length from which FA4 is at least as fast at every longer measured length
    (:data:`NEVER` when it is slower at the longest). Pure: unit-tested on the CPU."""
    cross = NEVER
    for L, tc, tf in sorted(zip(lengths, t_cudnn, t_fa4, strict=True), reverse=True):
        if tf > tc:
            break
        cross = int(L)
    return cross


def measure(device: torch.device | str | None = None, *, backend: str = "auto",
            tokens: int = 32768, heads: int = 8, kv_heads: int = 2, head_dim: int = 128,
            iters: int = 3, group=None, crossover_dims=(64, 128)) -> Calibration:
    """Measure the local device (and, with ``group`` of more than one rank, its links).

    Kernel tables: forward + backward of causal attention over documents of length ``L``
    packed into ``tokens`` rows (``L`` = 2 .. tokens by 4x), through the library's block
    backend with a prebuilt plan, giving TFLOP/s at ``(L + 1) / 2`` keys per row. With
    ``backend="auto"`` on a GPU where cudnn and fa4 both run, both are timed, and the
    crossover table (:attr:`Calibration.crossover`) is measured at each of
    ``crossover_dims``: both kernels on documents of ``L`` = 256, 512, ... rows packed into
    :data:`CROSSOVER_ROWS` (32 / 8 heads), the crossover by :func:`crossover_from`. ``call_us`` from a one-row call; ``hbm_gbps`` from a large copy;
    links: all-to-all, all-gather and a ring ``send/recv`` of 64 MiB over ``group``.
    Without a group the link constants stay the shipped defaults. On a CPU (for testing)
    tokens are capped at 1024 with the reference backend in float32.

    Returns: a :class:`Calibration` recording this device's name, torch's and flash-attn-4's
    versions.
    """
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
        else torch.device("cpu"))
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        tokens, backend = min(tokens, 1024), "reference"
    base = default_calibration(_device_name(device))
    gen = torch.Generator(device=device).manual_seed(0)
    kernels = _kernels(device, backend, head_dim)
    time_it = _timer(device, dtype, heads, kv_heads, head_dim, sync, iters, gen)
    keys, tables = [], {b: [] for b in kernels}
    L = 2
    while L <= tokens:
        pairs = (tokens // L) * L * (L + 1) / 2
        keys.append((L + 1) / 2)
        for b in kernels:
            t = time_it(L, tokens, b)
            tables[b].append(3.5 * 4 * pairs * heads * head_dim / t / 1e12)
        L *= 4
    crossover = {}
    if kernels == ["cudnn", "fa4"]:  # compute-bound sizes: 32 / 8 heads, >= 131072 rows
        rows = max(tokens, CROSSOVER_ROWS)
        for d in crossover_dims:
            timer = _timer(device, dtype, 32, 8, d, sync, iters, gen)
            lengths = [n for n in (256 << i for i in range(10)) if n <= rows]
            tc = [timer(n, rows, "cudnn") for n in lengths]
            tf = [timer(n, rows, "fa4") for n in lengths]
            crossover[int(d)] = crossover_from(lengths, tc, tf)
    call_us = time_it(1, 1, kernels[0]) * 1e6 / 2
    x = torch.empty(64 << 20 if cuda else 1 << 20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    hbm = 2 * x.numel() / _time(lambda: y.copy_(x), sync, iters) / 1e9
    links = {k: getattr(base, k) for k in ("p2p_gbps", "a2a_gbps", "collective_gbps",
                                           "latency_us")}
    source = f"measured ({'+'.join(kernels)})"
    if group is not None and dist.get_world_size(group) > 1:
        links = _measure_links(group, device, sync, iters)
    else:
        source += f"; {LINKS_NOT_MEASURED}: {base.source}"
    named = {b: tuple(t) for b, t in tables.items()}
    return Calibration(device_name=_device_name(device), torch_version=torch.__version__,
                       block_keys=tuple(keys), tflops=named, call_us=call_us,
                       merge_bytes_per_row=base.merge_bytes_per_row, hbm_gbps=hbm,
                       crossover=crossover, fa4_version=_compat.fa4_version() or "",
                       source=source, **links)


LINKS_NOT_MEASURED = ("links not measured (one process: run under torchrun --nproc-per-node N "
                      "to measure them), defaults")
"""What ``source`` and the summary line say of the link constants of a one-process run."""


def _measure_links(group, device, sync, iters) -> dict:
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    nbytes = 64 << 20
    buf = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(buf)
    gath = torch.empty(n * buf.numel(), dtype=buf.dtype, device=device)
    nxt, prv = dist.get_global_rank(group, (rank + 1) % n), dist.get_global_rank(group, (rank - 1) % n)

    def ring():
        ops = [dist.P2POp(dist.isend, buf, nxt, group), dist.P2POp(dist.irecv, out, prv, group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    tiny = torch.ones(1, device=device)
    lat = _time(lambda: dist.all_reduce(tiny, group=group), sync, iters)
    p2p = nbytes / _time(ring, sync, iters)
    a2a = nbytes * (n - 1) / n / _time(lambda: dist.all_to_all_single(out, buf, group=group),
                                      sync, iters)
    coll = nbytes * (n - 1) / _time(lambda: dist.all_gather_into_tensor(gath, buf, group=group),
                                    sync, iters)
    vals = torch.tensor([p2p, a2a, coll, lat], dtype=torch.float64, device=device)
    dist.all_reduce(vals, op=dist.ReduceOp.MIN, group=group)  # the slowest rank's link
    p2p, a2a, coll, lat = vals.tolist()
    return {"p2p_gbps": p2p / 1e9, "a2a_gbps": a2a / 1e9, "collective_gbps": coll / 1e9,
            "latency_us": lat * 1e6}


def _num(x: float) -> str:
    """Three significant digits, whole numbers from 100 on (a small rate is not printed as 0)."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Measure the CP cost model's constants on this "
                                            "machine and write them as JSON.")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--backend", default="auto", help="block backend to time (default auto)")
    p.add_argument("--tokens", type=int, default=32768, help="rows per timed call")
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args(argv)
    from .choices import BACKEND_CHOICES
    if args.tokens < 2:
        p.error(f"--tokens must be >= 2 (rows per timed call; documents of 2 .. tokens), "
                f"got {args.tokens}")
    if args.iters < 1:
        p.error(f"--iters must be >= 1, got {args.iters}")
    if args.backend not in BACKEND_CHOICES:
        p.error(f"--backend: {args.backend!r} is not one of {', '.join(BACKEND_CHOICES)}")
    folder = os.path.dirname(os.path.abspath(args.out))
    if os.path.isdir(args.out) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        p.error(f"--out: cannot write {args.out!r} (a directory, or its folder {folder!r} is "
                "missing or read-only); checked before measuring")
    group = None
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        group = dist.group.WORLD
    cal = measure(backend=args.backend, tokens=args.tokens, iters=args.iters, group=group)
    if group is None or dist.get_rank() == 0:
        save_calibration(cal, args.out)
        links = (f"p2p {_num(cal.p2p_gbps)} GB/s, all-to-all {_num(cal.a2a_gbps)} GB/s"
                 + (f" -- {LINKS_NOT_MEASURED}" if LINKS_NOT_MEASURED in cal.source else ""))
        print(f"wrote {args.out}: {cal.device_name}, torch {cal.torch_version}; "
              f"peak {_num(max(next(iter(cal.tflops.values()))))} TFLOP/s, "
              f"call {_num(cal.call_us)} us, HBM {_num(cal.hbm_gbps)} GB/s; {links}"
              + (f"; FA4 {cal.fa4_version} from (query rows per head_dim) {cal.crossover}"
                 if cal.crossover else ""))
    if group is not None:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
