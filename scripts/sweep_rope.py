"""Sweep the RoPE kernel's launch heuristic on one GPU (a tuning tool, not a test).

Times the forward kernel (``triton.testing.do_bench``, median, L2 flushed)
over block_t x heads_per_prog x num_warps for T = 65536 local
tokens, bf16, head_dim 128: (a) one tensor of 32 heads, (b) q 32 + k 8 heads,
each with 1 sequence and with 4096 skewed sequences, and prints the % of a
device-to-device copy measured in the same run, best first.

    python scripts/sweep_rope.py [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton

from cp_rope import rope_cache
from cp_rope.kernel import launch_config, rotary_triton


def skewed_cu(T: int, n: int, device) -> torch.Tensor:
    if n == 1:
        lens = [T]
    else:
        big = T // 4
        rest = T - big
        lens = [big] + [rest // (n - 1)] * (n - 1)
        lens[-1] += T - sum(lens)
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return cu.to(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="folder for sweep_rope.json (default: print only)")
    p.add_argument("--tokens", type=int, default=65536, help="local tokens T (default 65536)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_rope.py needs a CUDA GPU (it times the Triton kernel)")
    dev = torch.device("cuda")
    T, D = args.tokens, 128
    cos, sin = rope_cache(T, D, device=dev)
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    copy_ms = triton.testing.do_bench(lambda: big.clone(), rep=50, return_mode="median")
    copy_bw = 2 * big.numel() / copy_ms / 1e9
    print(f"copy bandwidth {copy_bw:.3f} TB/s")
    rows = []
    for case, (hq, hk) in {"a": (32, 0), "b": (32, 8)}.items():
        q = torch.randn(T, hq, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(T, hk, D, device=dev, dtype=torch.bfloat16)
        oq, ok = torch.empty_like(q), torch.empty_like(k)
        nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
        default = launch_config(T, hq, hk, D, D, 2)
        for n in (1, 4096):
            cu = skewed_cu(T, n, dev)
            for bt, hpp, nw in itertools.product((8, 16, 32, 64), (2, 4, 8), (2, 4, 8)):
                cfg = dict(block_t=bt, heads_per_prog=hpp, num_warps=nw)
                fn = lambda: rotary_triton(q, k, oq, ok, cos, sin, cu, 1, 0, False, False, config=cfg)  # noqa: B023
                ms = triton.testing.do_bench(fn, rep=25, return_mode="median")
                pct = 100 * nbytes / ms / 1e9 / copy_bw
                rows.append(dict(case=case, n_seqs=n, **cfg, ms=ms, pct=pct))
            fn = lambda: rotary_triton(q, k, oq, ok, cos, sin, cu, 1, 0, False, False)  # noqa: B023
            ms = triton.testing.do_bench(fn, rep=25, return_mode="median")
            rows.append(dict(case=case, n_seqs=n, block_t="heuristic", heads_per_prog=default[1],
                             num_warps=default[2]["num_warps"], ms=ms,
                             pct=100 * nbytes / ms / 1e9 / copy_bw))
    for case, n in itertools.product("ab", (1, 4096)):
        sel = sorted((r for r in rows if r["case"] == case and r["n_seqs"] == n), key=lambda r: r["ms"])
        print(f"\n## case {case}, n_seqs {n}")
        for r in sel[:6] + [r for r in sel if r["block_t"] == "heuristic"]:
            print(f"  block_t {r['block_t']!s:>9} hpp {r['heads_per_prog']} warps {r['num_warps']} "
                  f"{r['ms']:.4f} ms {r['pct']:.1f}%")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sweep_rope.json"), "w") as f:
            json.dump(dict(copy_tbps=copy_bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
