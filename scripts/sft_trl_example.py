"""TRL's SFTTrainer with packed context parallelism: cp_rope.hf.prepare in an ordinary script.

A local model directory (config.json, weights, tokenizer; never downloaded) and a local JSONL
file (one document per line in ``--text-field``, tokenized by TRL with the directory's
tokenizer), packed by TRL into rows of ``--seq-len`` tokens (``packing=True``, best-fit
decreasing); each row is split over ``--cp-size`` ranks by cp_rope. The one call that
matters is marked ``# cp_rope`` (``cp_rope.hf.prepare`` after the trainer is built);
``--no-cp`` runs the same script without it (the single-process reference, or DP only).

One process, CPU (float32, tiny model)::

    python scripts/sft_trl_example.py --model-dir DIR --data docs.jsonl --cp-size 1 \\
        --seq-len 256 --steps 5 --no-bf16

CPU, 2 processes (gloo), cp 2::

    torchrun --standalone --nproc-per-node 2 scripts/sft_trl_example.py \\
        --model-dir DIR --data docs.jsonl --cp-size 2 --seq-len 256 --steps 5 --no-bf16

One node, 8 GPUs, a Qwen3 checkpoint, 32,768-token rows over 8 ranks (bf16 autocast on
float32 master weights, as the Trainer's ``bf16=True``)::

    torchrun --standalone --nproc-per-node 8 scripts/sft_trl_example.py \\
        --model-dir /ckpt/Qwen3-0.6B --data long.jsonl --cp-size 8 --seq-len 32768 --steps 30

Two nodes x 8 GPUs (run on every node)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $MASTER_ADDR:29500 --rdzv-id sft1 scripts/sft_trl_example.py \\
        --model-dir /shared/Qwen3-8B --data long.jsonl --cp-size 8 --seq-len 131072

At the end rank 0 prints one JSON line: ``tokens_per_s`` (real tokens of the whole job per
second over the steps after ``--timing-warmup``; every CP group counts its packed rows
once), ``peak_mem_gib`` (CUDA: the largest ``max_memory_allocated`` of any rank; CPU: the
largest resident set), the logged losses and gradient norms.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import datasets
import torch
import torch.distributed as dist
import transformers
import trl

import cp_rope.hf
from cp_rope.parallel.choices import BACKEND_CHOICES, METHODS


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True,
                   help="local directory with config.json, weights and a tokenizer (never downloaded)")
    p.add_argument("--data", required=True, help="local JSONL file, one document per line")
    p.add_argument("--text-field", default="text", help="JSON field of the document (default: text)")
    p.add_argument("--seq-len", type=int, default=4096,
                   help="tokens per packed row = per micro-batch of one CP group (TRL max_length; default 4096)")
    p.add_argument("--cp-size", type=int, default=None,
                   help="ranks per packed row; must divide the world (default: the world size)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--lr", type=float, default=2e-5, help="peak learning rate (default 2e-5)")
    p.add_argument("--warmup-steps", type=int, default=2, help="linear LR warmup steps (default 2)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast on float32 weights (default: on with CUDA, off on CPU)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="transformers' gradient checkpointing of every decoder layer (default off)")
    p.add_argument("--method", default="ring", choices=METHODS,
                   help="CP attention method (cp_rope.parallel.METHODS; default ring)")
    p.add_argument("--backend", default="auto", choices=BACKEND_CHOICES,
                   help="CP attention block backend (default auto)")
    p.add_argument("--no-cp", action="store_true",
                   help="run without cp_rope (plain TRL: SDPA on padding-free rows, DP over all ranks)")
    p.add_argument("--timing-warmup", type=int, default=2,
                   help="steps left out of tokens/s (graph builds, allocator warm-up; default 2)")
    p.add_argument("--out-dir", default="runs/sft_trl_example", help="Trainer output_dir (default runs/sft_trl_example)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    args = p.parse_args(argv)
    if not os.path.isdir(args.model_dir):
        p.error(f"--model-dir {args.model_dir!r}: not a local directory")
    if not os.path.isfile(args.data):
        p.error(f"--data {args.data!r}: no such file")
    for name in ("seq_len", "steps", "grad_accum"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if args.cp_size is not None and (args.cp_size < 1 or world % args.cp_size):
        p.error(f"--cp-size {args.cp_size}: must be >= 1 and divide the world size {world}")
    if args.timing_warmup < 0 or args.timing_warmup >= args.steps:
        p.error(f"--timing-warmup must be in [0, --steps), got {args.timing_warmup}")
    return args


class Throughput(transformers.TrainerCallback):
    """Real tokens (counted by the wrapped collator) and wall time per optimizer step."""

    def __init__(self, counter: list, warmup: int, cuda: bool):
        self.counter, self.warmup, self.cuda = counter, warmup, cuda
        self.mark = None  # (time, tokens) at the end of step `warmup`
        self.end = None

    def _now(self) -> tuple[float, int]:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter(), self.counter[0]

    def on_train_begin(self, args, state, control, **kwargs):
        if self.warmup == 0:
            self.mark = self._now()

    def on_step_end(self, args, state, control, **kwargs):
        self.end = self._now()
        if state.global_step == self.warmup:
            self.mark = self.end


def counting(collate, counter: list):
    """The collator, counting the real tokens of every batch it builds (num_workers=0)."""

    def wrapped(examples):
        batch = collate(examples)
        counter[0] += int(batch["input_ids"].numel())
        return batch

    return wrapped


def main(argv=None) -> dict:
    a = parse_args(argv)
    cuda = torch.cuda.is_available()
    bf16 = cuda if a.bf16 is None else a.bf16
    transformers.logging.set_verbosity_warning()
    config = trl.SFTConfig(
        output_dir=a.out_dir, max_steps=a.steps, per_device_train_batch_size=1,
        gradient_accumulation_steps=a.grad_accum, learning_rate=a.lr, warmup_steps=a.warmup_steps,
        lr_scheduler_type="cosine", bf16=bf16, gradient_checkpointing=a.gradient_checkpointing,
        packing=True, max_length=a.seq_len, dataset_text_field=a.text_field, logging_steps=1,
        save_strategy="no", report_to=[], seed=a.seed, use_cpu=not cuda,
        dataloader_num_workers=0, disable_tqdm=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        a.model_dir, dtype=torch.float32, attn_implementation="sdpa", local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(a.model_dir, local_files_only=True)
    data = datasets.load_dataset("json", data_files=a.data, split="train")
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=data,
                             processing_class=tokenizer)
    world = trainer.args.world_size
    cp_size = 1 if a.no_cp else (a.cp_size or world)
    counter = [0]
    if not a.no_cp:
        trainer = cp_rope.hf.prepare(trainer, cp_size=cp_size, method=a.method,  # cp_rope
                                     backend=a.backend)
        trainer.cp_rope.collator.inner = counting(trainer.cp_rope.collator.inner, counter)
    else:
        trainer.data_collator = counting(trainer.data_collator, counter)
    clock = Throughput(counter, a.timing_warmup, cuda)
    trainer.add_callback(clock)
    trainer.train()
    return report(trainer, clock, cp_size, cuda)


def report(trainer, clock: Throughput, cp_size: int, cuda: bool) -> dict:
    """The run's numbers, reduced over the ranks (rank 0 prints them)."""
    tokens = torch.tensor([clock.end[1] - clock.mark[1]], dtype=torch.float64)
    seconds = clock.end[0] - clock.mark[0]
    peak = (torch.cuda.max_memory_allocated() if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    stats = torch.tensor([float(peak), seconds], dtype=torch.float64)
    if dist.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        tokens, stats = tokens.to(device), stats.to(device)
        dist.all_reduce(tokens)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    logs = [e for e in trainer.state.log_history if "loss" in e and "grad_norm" in e]
    out = {"tokens_per_s": round(float(tokens.item()) / cp_size / float(stats[1]), 1),
           "peak_mem_gib": round(float(stats[0]) / 2**30, 3), "cp_size": cp_size,
           "world_size": trainer.args.world_size, "steps": trainer.state.global_step,
           "loss": [e["loss"] for e in logs], "grad_norm": [e["grad_norm"] for e in logs],
           "trl": trl.__version__, "transformers": transformers.__version__}
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
