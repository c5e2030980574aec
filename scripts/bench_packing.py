"""CPU benchmark of the packing collator and the zigzag CP split (one core).

Collates a 131072-token batch of about 1000 documents (random lengths, fixed
seed) and shards it for every CP rank. Targets: collate < 20 ms, shard < 5 ms.

    python scripts/bench_packing.py [--tokens 131072] [--docs 1000] \
        [--cp-size 8] [--repeats 50]

Prints one line per measurement: median and min over ``--repeats`` runs, in ms.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np
import torch

from cp_rope.parallel import PackingCollator, shard_batch


def _time_ms(fn, repeats: int) -> tuple[float, float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def _documents(n_tokens: int, n_docs: int, cp_size: int, seed: int) -> list[np.ndarray]:
    """``n_docs`` documents whose cp-padded lengths sum to at most ``n_tokens``."""
    rng = np.random.default_rng(seed)
    m = 2 * cp_size
    weights = rng.exponential(size=n_docs)
    budget = n_tokens - n_docs * m  # room for each document's padding
    lens = np.maximum(1, (weights / weights.sum() * budget).astype(np.int64))
    return [rng.integers(0, 128_256, size=int(n), dtype=np.int64) for n in lens]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=131072, help="token budget of the batch (default 131072)")
    p.add_argument("--docs", type=int, default=1000, help="documents per batch (default 1000)")
    p.add_argument("--cp-size", type=int, default=8, help="CP degree for padding and sharding (default 8)")
    p.add_argument("--repeats", type=int, default=50, help="timed runs per measurement (default 50)")
    args = p.parse_args()
    torch.set_num_threads(1)

    docs = _documents(args.tokens, args.docs, args.cp_size, seed=0)
    print(f"torch {torch.__version__}, numpy {np.__version__}, python {platform.python_version()}, "
          f"1 thread; {len(docs)} docs, {sum(d.size for d in docs)} real tokens, cp_size={args.cp_size}")
    inputs = {
        "numpy": [{"input_ids": d} for d in docs],
        "tensor": [{"input_ids": torch.from_numpy(d)} for d in docs],
        "list": [{"input_ids": d.tolist()} for d in docs],
    }
    collate = PackingCollator(cp_size=args.cp_size, pad_to_multiple=args.tokens, max_tokens=args.tokens)
    for kind, examples in inputs.items():
        med, best = _time_ms(lambda ex=examples: collate(ex), args.repeats)
        print(f"collate ({kind:6s} input_ids) T={args.tokens}: median {med:7.2f} ms  min {best:7.2f} ms")
    batch = collate(inputs["numpy"])
    med, best = _time_ms(lambda: shard_batch(batch, args.cp_size, 1), args.repeats)
    print(f"shard_batch cp_size={args.cp_size} rank=1: median {med:7.2f} ms  min {best:7.2f} ms")
    rank_collate = PackingCollator(cp_size=args.cp_size, cp_rank=1, pad_to_multiple=args.tokens,
                                   max_tokens=args.tokens)
    med, best = _time_ms(lambda: rank_collate(inputs["numpy"]), args.repeats)
    print(f"collate + shard (numpy, cp_rank=1):  median {med:7.2f} ms  min {best:7.2f} ms")


if __name__ == "__main__":
    main()
