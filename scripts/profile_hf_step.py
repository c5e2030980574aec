#!/usr/bin/env python3
"""Where the time and memory of one training step of a patched transformers model go (one GPU).

    python scripts/profile_hf_step.py --tokens 32768 --profile
    python scripts/profile_hf_step.py --tokens 262144 --checkpointing selective --mlp-tile 16384

The model is bench_memory's Qwen3 shape (hidden 1024, 8 layers, 16/8 heads, head_dim 128,
SwiGLU 3072, vocabulary 151,936, tied), random init, bf16 parameters (no FSDP, no optimizer:
the activations and the step's kernels only), patched by :func:`cp_rope.hf.patch_model` (cp 1)
inside :class:`cp_rope.launch.finetune_hf.HFCausalLM`, on packed documents of 512-16,384
tokens (log-uniform, seed 0). Switches compare the pieces one at a time: ``--norm``
(``hf``: the model's own RMSNorm; ``fused``: what ``patch_model`` installs), ``--loss``
(``auto`` / ``torch`` / ``liger``: cp_linear_cross_entropy's implementations; ``unfused``:
the logits, then cp_cross_entropy), checkpointing and offload as the
trainers' flags (``--norm default`` is what ``patch_model`` does by default: fused). Prints
one JSON line per run: peak allocated GiB and that above the parameters (``null`` on CPU),
forward / backward milliseconds (wall clock with the GPU synchronised around each phase,
mean of ``--steps`` after one warm-up step), tokens/s; ``--profile`` adds torch.profiler's
table of one more step on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time

import torch

QWEN = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024,
            num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
            max_position_embeddings=1 << 21, rope_theta=1e6, rms_norm_eps=1e-6,
            hidden_act="silu")


def packed_batch(tokens: int, vocab: int, device, seed: int = 0):
    rng, lens, left = random.Random(seed), [], tokens
    while left > 0:
        n = min(left, int(math.exp(rng.uniform(math.log(512), math.log(16384)))))
        lens.append(n)
        left -= n
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    return ids, cu, max(lens), labels


def build(a, device):
    from transformers import AutoConfig, AutoModelForCausalLM

    from cp_rope.launch.finetune_hf import HFCausalLM
    from cp_rope.launch.parallelize import apply_activation_checkpointing

    cfg = AutoConfig.for_model(**QWEN)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(device)
    model = HFCausalLM(lm, fused_loss=a.loss != "unfused", mlp_tile_tokens=a.mlp_tile,
                       loss_impl="auto" if a.loss == "unfused" else a.loss)
    kw = {"fused_norm": a.norm == "fused"} if a.norm != "default" else {}
    from cp_rope.hf import patch_model
    patch_model(lm, group=None, method="ring", backend="auto",
                mlp_tile_tokens=a.mlp_tile or None, **kw)
    if a.checkpointing != "none" or a.offload:
        apply_activation_checkpointing(model, a.checkpointing, offload=a.offload)
    return model


def loss_of(model, a, ids, cu, max_len, labels):
    plan = model.attention_plan(cu, max_len, dtype=torch.bfloat16)  # once per step, as the trainer
    return model(ids, plan, labels=labels)


def run(a) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")  # cpu: a plumbing check (--tiny)
    model = build(a, device)
    ids, cu, max_len, labels = packed_batch(a.tokens, QWEN["vocab_size"], device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    base = torch.cuda.memory_allocated() if cuda else 0
    fwd_ms, bwd_ms = [], []
    for step in range(a.steps + 1):
        if step == 1 and cuda:
            sync()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = loss_of(model, a, ids, cu, max_len, labels)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        for p in model.parameters():
            p.grad = None
        if step:
            fwd_ms.append(1e3 * (t1 - t0))
            bwd_ms.append(1e3 * (t2 - t1))
    peak = torch.cuda.max_memory_allocated() if cuda else None
    f, b = sum(fwd_ms) / len(fwd_ms), sum(bwd_ms) / len(bwd_ms)
    out = {"tokens": a.tokens, "norm": a.norm, "loss": a.loss, "ckpt": a.checkpointing,
           "offload": a.offload, "mlp_tile": a.mlp_tile, "fwd_ms": round(f, 1),
           "bwd_ms": round(b, 1), "tok_s": round(a.tokens / (f + b) * 1e3),
           "peak_gib": None if peak is None else round(peak / 2**30, 2),
           "act_gib": None if peak is None else round((peak - base) / 2**30, 2),
           "loss_value": round(float(loss.detach()), 4)}
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            loss = loss_of(model, a, ids, cu, max_len, labels)
            loss.backward()
            sync()
        print(prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=a.profile_rows,
                                        max_name_column_width=70), file=sys.stderr)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    def positive(s):
        if not s.lstrip("-").isdigit() or int(s) < 1:
            raise argparse.ArgumentTypeError(f"{s!r}: an integer >= 1")
        return int(s)

    p.add_argument("--tokens", type=positive, default=32768, help="tokens of the packed batch")
    p.add_argument("--norm", choices=("default", "hf", "fused"), default="default",
                   help="RMSNorm: patch_model's default (fused), transformers' own, or fused")
    p.add_argument("--loss", choices=("auto", "torch", "liger", "unfused"), default="auto",
                   help="cp_linear_cross_entropy's impl, or the logits then cp_cross_entropy")
    p.add_argument("--checkpointing", choices=("none", "full", "selective"), default="none",
                   help="the trainers' --activation-checkpointing")
    p.add_argument("--offload", action="store_true", help="the trainers' --offload-activations")
    p.add_argument("--mlp-tile", type=int, default=0,
                   help="the trainers' --mlp-tile-tokens (0 = untiled)")
    p.add_argument("--steps", type=positive, default=2, help="timed steps after one warm-up")
    p.add_argument("--profile", action="store_true", help="torch.profiler table of one step")
    p.add_argument("--profile-rows", type=positive, default=30)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU check of the script)")
    a = p.parse_args()
    if a.tiny:
        QWEN.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=96, vocab_size=512, num_hidden_layers=2)
    t0 = time.time()
    try:
        out = run(a)
    except torch.OutOfMemoryError as exc:
        out = {"tokens": a.tokens, "norm": a.norm, "loss": a.loss, "ckpt": a.checkpointing,
               "offload": a.offload, "mlp_tile": a.mlp_tile, "result": "OOM " + str(exc)[:120]}
    out["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
