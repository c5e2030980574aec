#!/usr/bin/env python3
"""The RMSNorm backward kernel's launch settings (``cp_rope/rms_norm.py``: ``_BWD_TILE``,
``_BWD_PER_WARP``, ``_PROGRAMS_PER_SM``) timed on one GPU at the 262,144-token finetune_hf rows,
next to Liger-Kernel's backward (when it imports) and a device copy of the same bytes.

    python scripts/tune_rms_norm.py                  # T = 262,144
    python scripts/tune_rms_norm.py --tokens 65536

Each setting's ``dx`` and ``dw`` are checked against the default setting's first (the same
function: equal up to the order of the float32 ``dw`` sums). Prints one line per setting
(median ms of ``triton.testing.do_bench``, GB/s counting ``x`` and ``dy`` read and ``dx``
written) and one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=262144, help="tokens T (default 262,144)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    import triton.testing as tt

    import cp_rope.rms_norm as R

    rows = {"hidden [T, 1024]": (a.tokens, 1024), "q norm [T x 16, 128]": (a.tokens * 16, 128)}
    grid = list(itertools.product((2048, 4096, 8192), (64, 128, 256), (2, 4, 8)))
    default = (R._BWD_TILE, R._BWD_PER_WARP, R._PROGRAMS_PER_SM)
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception:  # noqa: BLE001 - not installed: no Liger row
        LigerRMSNormFunction = None
    out = {"device": torch.cuda.get_device_name(), "tokens": a.tokens, "default": default,
           "rows": {}}
    for label, shape in rows.items():
        out["rows"][label] = _row(R, tt, label, shape, grid, LigerRMSNormFunction)
        torch.cuda.empty_cache()
    print(json.dumps(out))
    return out


def _row(R, tt, label: str, shape: tuple[int, int], grid: list, liger) -> dict:
    """Backward times (ms) of every setting in ``grid`` and of Liger's at one bf16 shape."""
    x = torch.randn(shape, device="cuda").bfloat16()
    w = (torch.randn(shape[-1], device="cuda") * 0.3 + 1).bfloat16()
    dy = torch.randn(shape, device="cuda").bfloat16()
    nbytes = 3 * x.numel() * x.element_size()
    buf = torch.empty_like(x)
    res = {"copy_gbps": 2 * x.numel() * 2 / tt.do_bench(lambda: buf.copy_(x)) / 1e6}
    _, rstd = R._forward(x, w, 1e-6)
    want = R._backward(dy, x, w, rstd)
    default = (R._BWD_TILE, R._BWD_PER_WARP, R._PROGRAMS_PER_SM)
    for tile, per_warp, per_sm in grid:
        R._BWD_TILE, R._BWD_PER_WARP, R._PROGRAMS_PER_SM = tile, per_warp, per_sm
        try:
            got = R._backward(dy, x, w, rstd)
            torch.testing.assert_close(got[0], want[0])  # bf16 tolerance: row sums may differ
            torch.testing.assert_close(got[1].float(), want[1].float(), rtol=1e-2, atol=1e-2)
            ms = tt.do_bench(lambda: R._backward(dy, x, w, rstd))
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
        ms = tt.do_bench(lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True))
        res["liger"] = ms
        print(f"{label:22s} liger: {ms:.3f} ms ({nbytes / ms / 1e6:.0f} GB/s)", flush=True)
    return res


if __name__ == "__main__":
    main()
