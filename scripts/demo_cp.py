"""A 50-line tour of the library on CPU: self-test, pack, shard, RoPE, CP attention, gather.

    torchrun --standalone --nproc-per-node 2 scripts/demo_cp.py

Every rank packs the same documents, keeps its zigzag shard (PackingCollator
with cp_rank), applies RoPE at its CP positions, runs ring CP attention over
the process group, and the gathered result is compared with single-process
attention of the whole batch (float32: they agree to rounding, ~1e-6). First,
``cp_rope.parallel.self_test`` checks the configured setting (RoPE + ring attention + the
CP loss, forward and backward, on edge documents) against the unsharded computation in a
fraction of a second, as the trainers do at start-up (``--cp-self-test``).
"""

import datetime
import os

import torch
import torch.distributed as dist

import cp_rope
from cp_rope.parallel import PackingCollator, context_parallel_attention, self_test, unshard

if "RANK" not in os.environ:
    raise SystemExit("run it under torchrun: torchrun --standalone --nproc-per-node 2 scripts/demo_cp.py")
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
C, r = dist.get_world_size(), dist.get_rank()
torch.manual_seed(0)  # the same documents and weights on every rank
docs = [{"input_ids": torch.randint(0, 100, (n,))} for n in (37, 1, 120, 64)]
Hq, Hkv, D = 4, 2, 32
wq, wk, wv = torch.randn(3, 100, Hq * D, ).unbind(0)
cos, sin = cp_rope.rope_cache(1024, D)
check = self_test(dist.group.WORLD, method="ring", placement="zigzag", q_heads=Hq, kv_heads=Hkv,
                  head_dim=D, dtype=torch.float32)  # raises on every rank if anything differs
if r == 0:
    print(f"self-test passed in {check.seconds:.2f} s (documents {list(check.lengths)}, largest "
          f"relative difference {max(check.errors.values()):.1e})")


def attention(batch, cp_size, cp_rank, group):
    x = batch.input_ids
    q = wq[x].view(-1, Hq, D)
    k, v = wk[x].view(-1, Hq, D)[:, :Hkv], wv[x].view(-1, Hq, D)[:, :Hkv]
    q, k = cp_rope.apply_rotary_emb_qk(q, k, cos, sin, batch.cu_seqlens, max_seqlen=batch.max_seqlen,
                                       cp_size=cp_size, cp_rank=cp_rank)
    return context_parallel_attention(q, k, v, batch.cu_seqlens, batch.max_seqlen, group=group)


local = PackingCollator(cp_size=C, cp_rank=r)(docs)          # this rank's zigzag shard
out = unshard(attention(local, C, r, dist.group.WORLD), local.cu_seqlens)
full = PackingCollator(cp_size=C)(docs)                       # the global batch, one process
ref = attention(full, 1, 0, None)
if r == 0:
    print(f"cp_size {C}: {full.input_ids.numel()} global tokens in {full.cu_seqlens.numel() - 1} "
          f"sequences, {local.input_ids.numel()} per rank; max |CP - single| = "
          f"{(out - ref).abs().max().item():.2e}")
# float32 both ways, different summation orders: the fp32 bounds of tests/utils.TOL
torch.testing.assert_close(out, ref, atol=1e-5, rtol=1.3e-6)
dist.destroy_process_group()
