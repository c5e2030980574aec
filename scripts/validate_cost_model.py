#!/usr/bin/env python3
"""Check the CP cost model (cp_rope.parallel.cost_model) against the measured rows of
docs/benchmarks.md, CPU only (the numbers are copied below with their section).

    python scripts/validate_cost_model.py           # predicted vs measured, auto's picks
    python scripts/validate_cost_model.py --fit     # refit the shipped H200 constants

Rows (Hq 32, Hkv 8, head_dim 128, bf16, causal, fwd+bwd ms of one attention layer):

* ``cp1``: one H200, cp 1 (section "CP attention on packed documents ... (issue 10)");
* ``sim``: ``--simulate-cp`` on one H200: the slowest rank's compute, no communication
  (the issue-10 run, zigzag ring; the issue-14 run, zigzag vs per-document at the
  default split threshold); predicted with the links made free;
* ``cp2``: two H200s, cp 2, real NCCL (section "Multi-GPU: CP scaling ... (issue 16)").

``--fit`` fits the compute constants (``cudnn`` / ``torch_flash`` throughput curve
``peak x s / (s + s0)``, ``call_us``, ``merge_bytes_per_row``) to the cp1 and sim rows,
then the link constants to the cp2 rows, minimising the squared log error (Nelder-Mead),
and prints them for ``parallel/calibrate.py``'s ``_H200``. The ``stdlib`` rows are left
out: their lengths depend on the Python that ran them (3.12 there).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys

import numpy as np
import torch

from cp_rope.parallel import _calibration as calib
from cp_rope.parallel.cost_model import Setting, choose, predict
from cp_rope.parallel.placement import default_split_threshold

HQ, HKV, D = 32, 8, 128


def lengths(name: str) -> list[int]:
    if name == "random":  # scripts/bench_cp_attention.py's layout
        rng = random.Random(0)
        return [rng.randrange(2048, 16384 + 1, 128) for _ in range(12)]
    if name == "32768+64x1536":
        return [32768] + [1536] * 64
    n, length = name.split("x")
    return [int(length)] * int(n)


def cu(name: str) -> list[int]:
    return [0, *np.cumsum(lengths(name)).tolist()]


LAYOUTS = ("1x131072", "64x2048", "512x256", "32768+64x1536", "random")
Z, RING = "zigzag", "ring"

# (kind, layout, C, setting, backend, measured ms)
ROWS: list[tuple] = []
for lay, ms, flash in zip(LAYOUTS, (917.48, 19.21, 7.13, 74.12, 82.57),
                          (1505.93, 29.72, 10.49, 114.83, 130.52), strict=False):
    ROWS.append(("cp1", lay, 1, Setting(Z, None, RING), "cudnn", ms))
    ROWS.append(("cp1", lay, 1, Setting(Z, None, RING), "torch_flash", flash))
for lay, times in zip(LAYOUTS, ((458.37, 238.64, 126.04), (12.84, 14.11, 15.78),
                                (9.47, 17.43, 27.41), (43.82, 33.79, 27.73),
                                (44.37, 32.42, 20.41)), strict=False):
    for C, ms in zip((2, 4, 8), times, strict=False):
        ROWS.append(("sim", lay, C, Setting(Z, None, RING), "cudnn", ms))
for lay, pairs in (("64x2048", ((12.60, 9.61), (14.28, 4.90), (15.59, 2.91))),
                   ("512x256", ((9.39, 4.42), (17.20, 2.28), (27.61, 2.35))),
                   ("32768+64x1536", ((43.95, 36.13), (33.63, 20.22), (29.60, 14.92)))):
    for C, (zz, pd) in zip((2, 4, 8), pairs, strict=False):
        ROWS.append(("sim14", lay, C, Setting(Z, None, RING), "cudnn", zz))
        ROWS.append(("sim14", lay, C, Setting("per_document", default_split_threshold(D, C), RING),
                     "cudnn", pd))
_CP2 = {"1x131072": (466.86, 478.72, 474.72, 465.62), "64x2048": (14.16, 24.69, 19.47, 9.41),
        "512x256": (11.07, 24.35, 14.22, 4.19), "32768+64x1536": (45.77, 57.33, 46.67, 37.50),
        "random": (46.66, 54.96, 50.86, 41.69)}
for lay, (ring, ag, uly, pd) in _CP2.items():
    for s, ms in ((Setting(Z, None, RING), ring), (Setting(Z, None, "allgather"), ag),
                  (Setting(Z, None, "ulysses"), uly),
                  (Setting("per_document", 16384, RING), pd)):
        ROWS.append(("cp2", lay, 2, s, "cudnn", ms))
ROWS.append(("cp2", "1x131072", 2, Setting(Z, None, RING), "torch_flash", 752.55))


def free_links(cal: calib.Calibration) -> calib.Calibration:
    """The simulation's view: exchanges cost nothing (loopback)."""
    return dataclasses.replace(cal, p2p_gbps=1e12, a2a_gbps=1e12, collective_gbps=1e12,
                               latency_us=0.0)


def predicted(row, cal) -> float:
    kind, lay, C, s, backend, _ = row
    c = cal if kind == "cp2" else free_links(cal)
    return predict(cu(lay), s, cp_size=C, q_heads=HQ, kv_heads=HKV, head_dim=D, backend=backend,
                   calibration=c)


def with_params(base: calib.Calibration, p: dict) -> calib.Calibration:
    keys = base.block_keys
    tf = dict(base.tflops)
    if "t16" in p:  # free anchors at 16, 128, 1024, 8192, 65536 keys per row
        ax = np.log([16, 128, 1024, 8192, 65536])
        ay = [p[f"t{a}"] for a in (16, 128, 1024, 8192, 65536)]
        tf["cudnn"] = tuple(round(float(np.interp(np.log(k), ax, ay)), 1) for k in keys)
    if "fpeak" in p:
        tf["torch_flash"] = calib._table(p["fpeak"], p["fs0"], keys)
    rest = {k: v for k, v in p.items() if k not in ("fpeak", "fs0") and not k.startswith("t")}
    return dataclasses.replace(base, tflops=tf, **rest)


def fit() -> dict:
    from scipy.optimize import minimize

    base = calib.default_calibration()

    def loss(names, x, rows):
        p = dict(zip(names, np.exp(x), strict=False))
        cal = with_params(base, p)
        return sum(math.log(predicted(r, cal) / r[5]) ** 2 for r in rows)

    out = {}
    stages = (
        (("t16", "t128", "t1024", "t8192", "t65536", "call_us", "merge_bytes_per_row", "seg_ns"), [r for r in ROWS if r[0] != "cp2"
                                                           and r[4] == "cudnn"]),
        (("fpeak", "fs0"), [r for r in ROWS if r[4] == "torch_flash" and r[0] == "cp1"]),
        (("p2p_gbps", "a2a_gbps", "collective_gbps", "latency_us"),
         [r for r in ROWS if r[0] == "cp2" and r[4] == "cudnn"]),
    )
    for names, rows in stages:
        x0 = np.log([max(out.get(n, 0), 0) or {"t16": 400, "t128": 450, "t1024": 500, "t8192": 540, "t65536": 550, "call_us": 50,
                     "merge_bytes_per_row": 10, "fpeak": 330, "fs0": 300, "p2p_gbps": 150,
                     "a2a_gbps": 150, "collective_gbps": 100, "latency_us": 20, "seg_ns": 100}[n] for n in names])
        res = minimize(lambda x, n=names, rw=rows: loss(n, x, rw), x0, method="Nelder-Mead",
                       options={"maxiter": 4000, "xatol": 1e-4, "fatol": 1e-8})
        out.update(dict(zip(names, np.exp(res.x).tolist(), strict=False)))
        base = with_params(base, {n: out[n] for n in names})
    return out


def report(cal) -> tuple[str, dict]:
    lines = ["| rows | layout | C | setting | backend | measured ms | predicted ms | error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    errs: dict[str, list[float]] = {}
    for row in ROWS:
        kind, lay, C, s, backend, ms = row
        p = predicted(row, cal)
        e = p / ms - 1
        errs.setdefault(kind, []).append(e)
        lines.append(f"| {kind} | {lay} | {C} | {s} | {backend} | {ms:.2f} | {p:.2f} | "
                     f"{100 * e:+.1f}% |")
    summary = {k: (max(abs(x) for x in v), float(np.mean(np.abs(v)))) for k, v in errs.items()}
    return "\n".join(lines), summary


def picks(cal) -> str:
    """What auto picks per layout and C (real links, and free links = the simulation), and
    how the pick compares with the best fixed setting *as predicted*; where the simulated
    times were measured (sim14 rows) also as measured."""
    measured = {(r[1], r[2], r[3]): r[5] for r in ROWS if r[0] in ("sim14", "sim")}
    lines = ["| layout | C | auto (H200 links) | pred. ms | auto (free links, = --simulate-cp) | "
             "pred. ms | best fixed measured (sim) | auto measured (sim) | auto / best |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for lay in LAYOUTS:
        for C in (2, 4, 8):
            a = choose(cu(lay), cp_size=C, q_heads=HQ, kv_heads=HKV, head_dim=D, calibration=cal)
            f = choose(cu(lay), cp_size=C, q_heads=HQ, kv_heads=HKV, head_dim=D,
                       calibration=free_links(cal))
            meas = {s: ms for (ly, c, s), ms in measured.items() if ly == lay and c == C}
            best = min(meas.items(), key=lambda kv: kv[1]) if meas else None
            got = next((ms for st, ms in meas.items() if _same(lay, f.setting, st)), None)
            ratio = f"{got / best[1]:.3f}" if (best and got) else "not measured"
            lines.append(f"| {lay} | {C} | {a.setting} | {a.ms:.2f} | {f.setting} | {f.ms:.2f} | "
                         + (f"{best[0]} {best[1]:.2f}" if best else "-") + " | "
                         + (f"{got:.2f}" if got else "-") + f" | {ratio} |")
    return "\n".join(lines)


def _same(lay, a: Setting, b: Setting) -> bool:
    """Equal settings, per-document thresholds compared by the documents they split."""
    if (a.placement, a.method, a.ulysses_size) != (b.placement, b.method, b.ulysses_size):
        return False
    if a.placement == "zigzag":
        return True
    lens = np.array(lengths(lay))
    return bool(((lens > a.split_threshold) == (lens > b.split_threshold)).all())


def cp2_picks(cal) -> str:
    """Auto's pick at cp 2 (H200 links) against the four measured two-H200 settings."""
    lines = ["| layout | auto picks | pred. ms | measured: auto's pick | best measured | "
             "auto / best |", "| --- | --- | --- | --- | --- | --- |"]
    for lay in LAYOUTS:
        a = choose(cu(lay), cp_size=2, q_heads=HQ, kv_heads=HKV, head_dim=D, calibration=cal)
        meas = [(r[3], r[5]) for r in ROWS if r[0] == "cp2" and r[1] == lay and r[4] == "cudnn"]
        best = min(meas, key=lambda x: x[1])
        got = next((ms for s, ms in meas if _same(lay, a.setting, s)), None)
        lines.append(f"| {lay} | {a.setting} | {a.ms:.2f} | "
                     + (f"{got:.2f}" if got else "not measured") + f" | {best[0]} {best[1]:.2f} | "
                     + (f"{got / best[1]:.3f}" if got else "-") + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", action="store_true", help="refit the H200 constants first")
    args = ap.parse_args()
    cal = calib.default_calibration()
    if args.fit:
        params = fit()
        print("fitted:", {k: round(v, 3) for k, v in params.items()})
        cal = with_params(cal, params)
    table, summary = report(cal)
    print(table)
    print()
    for kind, (mx, mean) in summary.items():
        print(f"{kind}: max |error| {100 * mx:.1f}%, mean {100 * mean:.1f}%")
    print()
    print(picks(cal))
    print()
    print(cp2_picks(cal))
    if args.fit:
        print("cudnn table:", cal.tflops["cudnn"])
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
