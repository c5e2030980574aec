#!/usr/bin/env python3
"""cp_rope's fused RMSNorm (``cp_rope.rms_norm``) against Liger-Kernel's and PyTorch's, on one GPU.

    python scripts/bench_rms_norm.py                 # the 262,144-token finetune_hf rows
    python scripts/bench_rms_norm.py --tokens 65536
    python scripts/bench_rms_norm.py --tune          # the backward's launch settings

Rows are those of ``scripts/bench_memory.py``'s Qwen3 shape at ``--tokens``: a hidden-state
norm ``[T, 1024]``, the q norm ``[T x 16, 128]`` and the k norm ``[T x 8, 128]``, bf16. Per
implementation and row: forward and backward time (``triton.testing.do_bench``, median ms; the
backward alone, replayed on a kept graph) and the bandwidth that implies (forward: ``x`` read,
``y`` written; backward: ``x`` and ``dy`` read, ``dx`` written; the weight and the per-row
statistics not counted), next to a device-to-device copy of the same bytes. Each
implementation's output and gradients are checked against float64 first (bf16 tolerance).

Implementations: ``cp_rope`` (the Triton kernels), ``liger`` (``LigerRMSNormFunction``,
``"llama"`` casting, not in place: what finetune_hf ran before; skipped when liger-kernel does
not import), ``torch`` (``torch.nn.functional.rms_norm``: one rounding, autograd's backward).
Prints one markdown table and one JSON line.

``--tune``: the backward kernel alone (``cp_rope/rms_norm.py``'s ``_backward``) at the hidden
and q-norm rows under 27 launch settings (``_BWD_TILE`` x ``_BWD_PER_WARP`` x
``_PROGRAMS_PER_SM``), each checked against the default setting's ``dx`` / ``dw`` first, next to
Liger's backward through autograd: one line per setting (median ms, GB/s of ``x``, ``dy`` read
and ``dx`` written) and one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F


def _impls():
    from cp_rope.rms_norm import rms_norm

    out = {"cp_rope": lambda x, w, eps: rms_norm(x, w, eps, backend="triton")}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        out["liger"] = lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)
    except Exception:  # noqa: BLE001 - not installed: that column is left out
        pass
    out["torch"] = lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps)
    return out


def _check(fn, x, w, dy, eps) -> None:
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    yr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + eps) * wr
    want = (yr, *torch.autograd.grad(yr, (xr, wr), dy.double()))
    xg = x.detach().requires_grad_()
    wg = w.detach().requires_grad_()
    y = fn(xg, wg, eps)
    got = (y, *torch.autograd.grad(y, (xg, wg), dy))
    for name, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        rel = float((a.double() - b).norm() / b.norm())
        if not rel <= 2 ** -7:  # normwise, a few bf16 roundings
            raise AssertionError(f"{name}: relative error {rel:.2e} against float64")


def _row(impls: dict, shape: tuple[int, int], eps: float) -> dict:
    """Times and bandwidths of every implementation at one ``[rows, n]`` bf16 shape."""
    import triton.testing as tt

    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(shape, device=dev).to(bf)
    w = (torch.randn(shape[-1], device=dev) * 0.3 + 1).to(bf)
    dy = torch.randn(shape, device=dev).to(bf)
    nbytes = x.numel() * x.element_size()
    buf = torch.empty_like(x)
    r = {"copy_gbps": 2 * nbytes / tt.do_bench(lambda: buf.copy_(x), return_mode="median") / 1e6}
    for name, fn in impls.items():
        _check(fn, x[:4096], w, dy[:4096], eps)
        xg = x.detach().requires_grad_()
        wg = w.detach().requires_grad_()
        with torch.no_grad():
            fwd = tt.do_bench(lambda fn=fn, wg=wg: fn(x, wg, eps), return_mode="median")
        y = fn(xg, wg, eps)
        bwd = tt.do_bench(lambda y=y, xg=xg, wg=wg: torch.autograd.grad(
            y, (xg, wg), dy, retain_graph=True), return_mode="median")
        r[name] = {"fwd_ms": fwd, "bwd_ms": bwd, "fwd_gbps": 2 * nbytes / fwd / 1e6,
                   "bwd_gbps": 3 * nbytes / bwd / 1e6}
        del y
    return r


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=262144, help="tokens T (default 262,144)")
    p.add_argument("--tune", action="store_true", help="time the backward's launch settings")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if a.tune:
        return _tune(a.tokens)
    eps = 1e-6
    rows = {"hidden [T, 1024]": (a.tokens, 1024), "q norm [T x 16, 128]": (a.tokens * 16, 128),
            "k norm [T x 8, 128]": (a.tokens * 8, 128)}
    impls = _impls()
    result = {"device": torch.cuda.get_device_name(), "tokens": a.tokens, "rows": {}}
    for label, shape in rows.items():
        result["rows"][label] = _row(impls, shape, eps)
        torch.cuda.empty_cache()
    names = list(impls)
    print(f"RMSNorm, bf16, {result['device']}, T = {a.tokens:,}: fwd / bwd ms (GB/s)")
    print("| rows | " + " | ".join(names) + " | copy GB/s |")
    print("| --- |" + " --- |" * (len(names) + 1))
    for label, r in result["rows"].items():
        cells = [f"{r[n]['fwd_ms']:.3f} / {r[n]['bwd_ms']:.3f} ({r[n]['fwd_gbps']:.0f} / "
                 f"{r[n]['bwd_gbps']:.0f})" for n in names]
        print(f"| {label} | " + " | ".join(cells) + f" | {r['copy_gbps']:.0f} |")
    print(json.dumps(result))
    return result


def _tune(tokens: int) -> dict:
    """``--tune``: the backward's launch settings at the hidden and q-norm rows."""
    import triton.testing as tt

    import cp_rope.rms_norm as R

    rows = {"hidden [T, 1024]": (tokens, 1024), "q norm [T x 16, 128]": (tokens * 16, 128)}
    grid = list(itertools.product((2048, 4096, 8192), (64, 128, 256), (2, 4, 8)))
    default = (R._BWD_TILE, R._BWD_PER_WARP, R._PROGRAMS_PER_SM)
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception:  # noqa: BLE001 - not installed: no Liger row
        LigerRMSNormFunction = None
    out = {"device": torch.cuda.get_device_name(), "tokens": tokens, "default": default,
           "rows": {}}
    for label, shape in rows.items():
        out["rows"][label] = _tune_row(R, tt, label, shape, grid, LigerRMSNormFunction)
        torch.cuda.empty_cache()
    print(json.dumps(out))
    return out

def _tune_row(R, tt, label: str, shape: tuple[int, int], grid: list, liger) -> dict:
    """Backward times (ms) of every setting in ``grid`` and of Liger's at one bf16 shape."""
    x = torch.randn(shape, device="cuda").bfloat16()
    w = (torch.randn(shape[-1], device="cuda") * 0.3 + 1).bfloat16()
    dy = torch.randn(shape, device="cuda").bfloat16()
    nbytes = 3 * x.numel() * x.element_size()
    buf = torch.empty_like(x)
    copy_ms = tt.do_bench(lambda: buf.copy_(x), return_mode="median")
    res = {"copy_gbps": 2 * x.numel() * 2 / copy_ms / 1e6}
    _, rstd = R._forward(x, w, 1e-6)
    want = R._backward(dy, x, w, rstd)
    default = (R._BWD_TILE, R._BWD_PER_WARP, R._PROGRAMS_PER_SM)
    for tile, per_warp, per_sm in grid:
        R._BWD_TILE, R._BWD_PER_WARP, R._PROGRAMS_PER_SM = tile, per_warp, per_sm
        try:
            got = R._backward(dy, x, w, rstd)
            torch.testing.assert_close(got[0], want[0])  # bf16 tolerance: row sums may differ
            torch.testing.assert_close(got[1].float(), want[1].float(), rtol=1e-2, atol=1e-2)
            ms = tt.do_bench(lambda: R._backward(dy, x, w, rstd), return_mode="median")
        except Exception as exc:  # noqa: BLE001 - a setting that fails to compile or differs
            print(f"{label} tile {tile} per_warp {per_warp} per_sm {per_sm}: {exc!r}"[:300])
            continue
        finally:
            R._BWD_TILE, R._BWD_PER_WARP, R._PROGRAMS_PER_SM = default
        res[f"{tile}/{per_warp}/{per_sm}"] = ms
        print(f"{label:22s} tile {tile:5d} warps {R._blocks(shape[-1], per_warp, tile)[2]:2d}"
              f" per_sm {per_sm}: {ms:.3f} ms ({nbytes / ms / 1e6:.0f} GB/s)", flush=True)
    if liger is not None:
        xg = x.detach().requires_grad_()
        wg = w.detach().requires_grad_()
        y = liger.apply(xg, wg, 1e-6, 0.0, "llama", False)
        ms = tt.do_bench(lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True),
                         return_mode="median")
        res["liger"] = ms
        print(f"{label:22s} liger: {ms:.3f} ms ({nbytes / ms / 1e6:.0f} GB/s)", flush=True)
    return res


if __name__ == "__main__":
    main()
