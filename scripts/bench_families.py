#!/usr/bin/env python3
"""Issue 33's H200 benchmark: a Gemma-3-shaped and a GPT-OSS-shaped model at 131,072 tokens per
step through ``finetune_hf`` (cp 1: the whole packed row on one GPU), next to the unpatched
transformers model on the longest row it can run.

    python scripts/bench_families.py --out /tmp/fam            # ~6 min on an H200
    python scripts/bench_families.py --tiny --out /tmp/fam     # CPU dry run of the plumbing

Models (random weights from a config written here, never downloaded; bf16 autocast on fp32
master weights, AdamW):

* ``gemma3``: Gemma-3-1B's shapes: hidden 1,152, 26 layers (5 local : 1 global; window 512),
  4 query / 1 KV heads of 256, MLP 6,912, vocabulary 262,144, local RoPE 1e4, global 1e6
  (linear x8), ``query_pre_attn_scalar`` 256;
* ``gpt_oss``: GPT-OSS-20B's layer shapes at reduced depth and experts: hidden 2,880, 4 layers
  (alternating window 128 and full), 64 query / 8 KV heads of 64, per-head sinks, 8 experts of
  2,880 (top 4), vocabulary 201,088, YaRN RoPE.

Patched (``cp_rope.launch.finetune_hf``, each its own torchrun): 131,072 tokens per step packed
from documents of 4K-64K random byte ids, ``--activation-checkpointing selective`` (Gemma 3 also
``--mlp-tile-tokens 16384``; an MoE block's MLP is not tiled: cp_rope refuses it), the fused
loss, attention backend ``auto``; 6 steps, tokens/s = the median of steps 3-6, peak GiB = the
largest step peak (``torch.cuda.max_memory_allocated``).

Unpatched (one child process): ``AutoModelForCausalLM`` with transformers' own attention (SDPA
for Gemma 3; eager for GPT-OSS, which has no SDPA path because of its sinks), its own loss,
``gradient_checkpointing_enable()``, one document per row (no packing: transformers' SDPA /
eager attention has no document mask without a 4-D mask), rows of 131,072 / 2**k tokens until
3 steps fit; tokens/s over steps 2-3.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

SEQ = 131072
MODELS = {
    "gemma3": dict(
        model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=1152,
        num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        intermediate_size=6912, vocab_size=262144, sliding_window=512,
        query_pre_attn_scalar=256, max_position_embeddings=SEQ, tie_word_embeddings=True,
        layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention")
                     for i in range(26)],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1e6}}),
    "gpt_oss": dict(
        model_type="gpt_oss", architectures=["GptOssForCausalLM"], hidden_size=2880,
        num_hidden_layers=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        intermediate_size=2880, num_local_experts=8, num_experts_per_tok=4,
        vocab_size=201088, sliding_window=128, max_position_embeddings=SEQ,
        layer_types=["sliding_attention", "full_attention"] * 2, output_router_logits=True,
        router_aux_loss_coef=0.9, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0}),
}
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=64, vocab_size=300, sliding_window=16)


def _config(name: str, tiny: bool):
    import transformers

    kw = dict(MODELS[name])
    model_type = kw.pop("model_type")
    if tiny:
        kw.update(TINY, layer_types=kw["layer_types"][: TINY["num_hidden_layers"]])
        if name == "gemma3":
            kw["layer_types"] = ["sliding_attention", "full_attention"]
    kw.pop("architectures")
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    cfg.torch_dtype = "float32"
    return cfg


def _data(path: str, seq: int, n_docs: int) -> None:
    """Documents of seq/32 .. seq/2 random printable bytes (byte-level ids in finetune_hf)."""
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 "
    with open(path, "w") as f:
        for _ in range(n_docs):
            n = rng.randint(seq // 32, seq // 2)
            f.write(json.dumps({"text": "".join(rng.choices(alphabet, k=n))}) + "\n")


def _patched(name: str, model_dir: str, data: str, work: str, seq: int, steps: int,
             log: str) -> dict:
    flags = ["--activation-checkpointing", "selective"]
    if name == "gemma3":
        flags += ["--mlp-tile-tokens", str(min(16384, seq))]
    out_dir = f"{work}/ft_{name}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "1", "-m", "cp_rope.launch.finetune_hf", "--model", model_dir, "--data", data,
           "--tokenizer", "bytes", "--cp-size", "1", "--seq-len", str(seq),
           "--tokens-per-batch", str(seq), "--steps", str(steps), "--warmup-steps", "2",
           "--eval-docs", "0", "--log-every", "1", "--no-progress", "--no-tensorboard",
           "--no-save-final", "--no-save-on-signal", "--out-dir", out_dir, "--overwrite", *flags]
    t = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=420).returncode
    res = {"run": f"{name} finetune_hf (cp_rope)", "rc": rc, "tokens": seq,
           "flags": " ".join(flags), "wall_s": round(time.time() - t)}
    try:
        rows = [json.loads(x) for x in open(f"{out_dir}/metrics.jsonl") if x.strip()]
    except OSError:
        return res
    rows = [r for r in rows if "tokens_per_s" in r]
    late = [r for r in rows if r.get("step", 0) > 2] or rows
    if late:
        res["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in late)
        res["peak_gib"] = max(r.get("peak_mem_gib", float("nan")) for r in rows)
        res["losses"] = [round(r["loss"], 4) for r in rows if "loss" in r]
        res["aux_loss"] = [round(r["aux_loss"], 4) for r in rows if "aux_loss" in r]
    return res


def _unpatched_child(name: str, model_dir: str, seq: int, min_seq: int) -> None:
    import torch
    import transformers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    impl = "eager" if name == "gpt_oss" else "sdpa"
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32, attn_implementation=impl).to(dev)
    model.config.use_cache = False
    model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    length = seq
    while length >= min_seq:
        try:
            times = []
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
            for _ in range(3):
                ids = torch.randint(3, model.config.vocab_size, (1, length), generator=gen)
                ids = ids.to(dev)
                t = time.perf_counter()
                with torch.autocast(dev, dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if dev == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else float("nan")
            print(json.dumps({"run": f"{name} transformers ({impl}, unpatched)", "rc": 0,
                              "tokens": length, "tokens_per_s": length / statistics.mean(times[1:]),
                              "peak_gib": peak, "losses": [round(float(loss), 4)],
                              "flags": "gradient_checkpointing, one document per row"}))
            return
        except torch.OutOfMemoryError:
            loss = ids = None
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            print(f"unpatched {name}: {length} tokens: out of memory", file=sys.stderr)
            length //= 2
    print(json.dumps({"run": f"{name} transformers ({impl}, unpatched)", "rc": 1,
                      "tokens": f"< {min_seq}", "flags": "out of memory at every length"}))


def _unpatched(name: str, model_dir: str, seq: int, min_seq: int, log: str) -> dict:
    t = time.time()
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, __file__, "--child", name, model_dir, str(seq),
                            str(min_seq)], stdout=subprocess.PIPE, stderr=f, text=True,
                           timeout=300)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    res = json.loads(lines[-1]) if lines else {"run": f"{name} transformers", "rc": p.returncode}
    res["wall_s"] = round(time.time() - t)
    return res


def _fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else str(x if x is not None else "-")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _unpatched_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/cp_rope_bench_families")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tiny", action="store_true", help="tiny shapes, 1,024 tokens (CPU dry run)")
    p.add_argument("--skip-unpatched", action="store_true")
    a = p.parse_args()
    seq = 1024 if a.tiny else SEQ
    os.makedirs(a.out, exist_ok=True)
    data = f"{a.out}/docs.jsonl"
    _data(data, seq, 64)
    results = []
    for name in a.models:
        model_dir = f"{a.out}/model_{name}"
        _config(name, a.tiny).save_pretrained(model_dir)
        results.append(_patched(name, model_dir, data, a.out, seq, a.steps,
                                f"{a.out}/ft_{name}.log"))
        print(json.dumps(results[-1]), flush=True)
        if not a.skip_unpatched:
            results.append(_unpatched(name, model_dir, seq, 256 if a.tiny else 1024,
                                      f"{a.out}/hf_{name}.log"))
            print(json.dumps(results[-1]), flush=True)
    print("| run | rc | tokens per row | tokens/s | peak GiB | settings | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['run']} | {r['rc']} | {_fmt(r.get('tokens'), ',')} | "
              f"{_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(r.get('peak_gib'), '.2f')} | "
              f"{r.get('flags', '')} | {r.get('wall_s', '-')} |")
    with open(f"{a.out}/results.json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
