#!/usr/bin/env python3
"""Peak memory and tokens/s of real training steps per memory setting and length (one GPU),
against the planner's prediction (issue 21).

    python scripts/bench_memory.py --out /tmp/mem.json            # every config, ~6 min on an H200
    python scripts/bench_memory.py --only hf --budget-s 200
    python scripts/bench_memory.py --only hf --tokens 262144 --top 1 --flags="--mlp-tile-tokens 32768"

Two models, each in its own child process (one CUDA context, the configs in turn,
each one a fresh trainer: ``cp_rope.launch.finetune_hf.main`` /
``cp_rope.launch.pretrain.main`` with ``--stop-at-step``, no checkpoint):

* ``hf``: a transformers Qwen3-shaped model (hidden 1024, 8 layers, 16/8 heads,
  head_dim 128, SwiGLU 3072, vocabulary 151,936, tied embeddings; random init
  from a config written here), on packed documents of 512-16,384 bytes (stdlib
  text, log-uniform lengths, seed 0) at 32K ... 1M tokens per step;
* ``1b``: ``--preset 1b`` (byte vocabulary), one sequence per step (``--seq-mode concat``).

A config that runs out of memory (or past its share of ``--budget-s``) is a
result ("OOM" / "timeout"), not a failure. Each result: peak allocated GiB
(``torch.cuda.max_memory_allocated``) of every step (the peak statistic is reset at
the start of each step, so each step's logged ``peak_mem_gib``, and the trainer's
final "peak mem", are that step's own), their maximum (the run's peak) and the maximum
over the steps after the first (which also compiles kernels and builds cuDNN graphs;
which step peaks depends on its batch, see docs/benchmarks.md, Memory round 3),
tokens/s and MFU of the later half of the steps (the first ones build cuDNN graphs for
new batch shapes; the 32K throughput config runs 40 steps so that its later half is
past most of them): tokens over seconds, not a mean of the steps' rates, which overstates
a run whose step times vary. Then the planner's predicted peak
(:func:`cp_rope.launch.plan_memory.estimate`) and its ratio to the peak of the steps
after the first (none for a 1-step run). ``--flags`` changes every config run: a flag it
names replaces that flag's value in a config, any other is added (an A/B of one setting on
the same batches; the row's settings show the result). ``--print-plans``
adds the planner's answers for 1,048,576 tokens (cp 1 and per rank at cp 8) for
the 1b preset and a Llama-3-8B shape on 141 GB GPUs. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import random
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time

TILE = 16384
QWEN = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024,
            num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
            max_position_embeddings=1 << 21, rope_theta=1e6, rms_norm_eps=1e-6,
            hidden_act="silu", torch_dtype="bfloat16")

# (group, tokens per step, memory flags, steps, what it is for, seconds it needs on an H200)
CONFIGS = [  # in order of importance: a config that no longer fits the budget is skipped
    ("hf", 32768, [], 40, "throughput without checkpointing (H200 target >= 135K tok/s)", 35),
    ("hf", 262144, ["--activation-checkpointing", "selective", "--offload-activations",
                    "--mlp-tile-tokens", str(TILE)], 6, "H200 target <= 21 GiB at >= 155K tok/s",
     40),
    ("hf", 1048576, ["--activation-checkpointing", "full", "--offload-activations",
                     "--mlp-tile-tokens", str(TILE)], 2, "target: a step at 1M tokens", 60),
    ("hf", 131072, ["--activation-checkpointing", "selective", "--offload-activations",
                    "--mlp-tile-tokens", str(TILE)], 3, "planner check", 20),
    ("hf", 262144, ["--activation-checkpointing", "selective", "--mlp-tile-tokens", str(TILE)], 3,
     "no offload", 25),
    ("hf", 262144, ["--activation-checkpointing", "selective", "--offload-activations",
                    "--mlp-tile-tokens", str(TILE), "--loss-impl", "torch", "--no-fused-norm"], 3,
     "without Liger's loss and the fused norm", 30),
    ("1b", 65536, [], 3, "defaults (target MFU >= 41%)", 20),
    ("1b", 262144, ["--activation-checkpointing", "selective", "--offload-activations",
                    "--mlp-tile-tokens", str(TILE)], 2, "target <= 40 GiB at MFU >= 36%", 100),
    ("1b", 32768, ["--activation-checkpointing", "selective", "--offload-activations",
                   "--mlp-tile-tokens", str(TILE)], 2, "planner check", 20),
    ("1b", 524288, ["--activation-checkpointing", "selective", "--offload-activations",
                    "--mlp-tile-tokens", str(TILE)], 2, "target: >= 2 steps", 340),
]

if os.environ.get("BENCH_MEMORY_SMOKE") == "1":  # a CPU check of the plumbing: tiny shapes
    QWEN.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=96, vocab_size=512)
    CONFIGS = [(g, 8192 if g == "hf" else 2048, [x.replace(str(TILE), "512") for x in f], 2, w, 1)
               for g, _, f, _, w, _ in CONFIGS[:2] + CONFIGS[5:8]]  # noqa: F821


def _settings(flags: list[str]):
    import torch

    from cp_rope.launch.plan_memory import Settings
    from cp_rope.parallel._loss_impl import loss_impl

    def val(name, default, bare=None):  # bare: the value of the flag given without one
        if name not in flags:
            return default
        j = flags.index(name) + 1
        return flags[j] if j < len(flags) and not flags[j].startswith("--") else bare

    chunk = int(val("--loss-chunk-size", 0))
    # the fused loss's kernel as the trainer resolves it here (the run's log names the same)
    kernel = loss_impl(val("--loss-impl", "auto"), torch.empty(
        1, 1, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu"),
        chunk or None)
    return Settings(activation_checkpointing=val("--activation-checkpointing", "none", "full"),
                    offload_activations="--offload-activations" in flags,
                    mlp_tile_tokens=int(val("--mlp-tile-tokens", 0)),
                    fused_loss="--no-fused-loss" not in flags, loss_chunk_size=chunk,
                    loss_impl=kernel)


def _optional_flags() -> list[str]:
    """Switch off start-up work this bench does not measure, where the trainer has the flag."""
    from cp_rope.launch import config as C

    fields = {f.name: f for sec in (C.DataConfig, C.TrainConfig, C.ParallelConfig)
              for f in dataclasses.fields(sec)}
    names = set(fields)
    out = []
    if "bpe_vocab_size" in names:
        out += ["--tokenizer", "bytes"]
    if "eval_docs" in names:
        out += ["--eval-docs", "0"]
    if "cp_self_test" in names:
        bool_flag = isinstance(fields["cp_self_test"].default, bool)
        out += ["--no-cp-self-test"] if bool_flag else ["--cp-self-test", "off"]
    return out


def _corpus(path: str, n_tokens: int) -> None:
    """JSONL of stdlib text cut into documents of 512-16,384 bytes (log-uniform, seed 0)."""
    rng, text, docs, total = random.Random(0), [], [], 0
    lib = sysconfig.get_paths()["stdlib"]
    for root, _, files in sorted(os.walk(lib)):
        for f in sorted(files):
            if f.endswith(".py") and total < n_tokens * 1.3:
                try:
                    s = open(os.path.join(root, f), encoding="utf-8").read()
                except (UnicodeDecodeError, OSError):
                    continue
                text.append(s)
                total += len(s.encode())
    blob, i = "".join(text), 0
    while i < len(blob):
        n = int(math.exp(rng.uniform(math.log(512), math.log(16384)))) - 2
        docs.append(blob[i:i + n])
        i += n
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)


def merge_flags(flags: list[str], extra: list[str]) -> list[str]:
    """``flags`` with ``extra`` applied, so that each setting is given once (the trainer and the
    prediction, :func:`_settings`, then read the same): a flag of ``extra`` that ``flags`` has
    replaces its value there (or, without a value in ``extra``, stays bare), any other is
    appended; ``--no-x`` drops ``--x`` (and ``--x`` drops ``--no-x``); ``--name=value`` is
    read as ``--name value``.

    Raises: ValueError naming ``--flags`` for an item of ``extra`` that is no ``--flag``.
    """
    items = [y for x in extra for y in (x.split("=", 1) if x.startswith("--") else [x])]
    out = list(flags)

    def drop(name):
        if name in out:
            j = out.index(name)
            del out[j:j + 1 + (j + 1 < len(out) and not out[j + 1].startswith("--"))]

    i = 0
    while i < len(items):
        name = items[i]
        if not name.startswith("--"):
            raise ValueError(f"--flags: {name!r} is not a flag (expected --name [value])")
        value = [items[i + 1]] if i + 1 < len(items) and not items[i + 1].startswith("--") else []
        drop("--" + name[5:] if name.startswith("--no-") else "--no-" + name[2:])
        if name in out:
            j = out.index(name)
            has = j + 1 < len(out) and not out[j + 1].startswith("--")
            out[j:j + 1 + has] = [name, *value]
        else:
            out += [name, *value]
        i += 1 + len(value)
    return out


def _argv(group: str, tokens: int, flags: list[str], steps: int, work: str) -> list[str]:
    common = ["--steps", "100", "--stop-at-step", str(steps), "--log-every", "1",
              "--no-save-final", "--no-save-on-signal", "--no-progress", "--no-tensorboard",
              "--warmup-steps", "10", "--tokens-per-batch", str(tokens),
              "--out-dir", f"{work}/run_{group}_{tokens}_{abs(hash(tuple(flags))) % 10**6}",
              "--overwrite"] + _optional_flags()
    if group == "hf":
        return ["--model", f"{work}/qwen3", "--data", f"{work}/docs.jsonl",
                "--seq-len", str(min(16384, tokens)),
                *common, *flags]
    model = ["--preset", "1b"] if os.environ.get("BENCH_MEMORY_SMOKE") != "1" else \
        ["--dim", "64", "--n-layers", "2", "--max-docs", "200"]
    return [*model, "--seq-mode", "concat", "--seq-len", str(tokens), *common, *flags]


def _read_metrics(out_dir: str) -> dict:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if "tokens_per_s" in r]
    if not rows:
        return {"steps": 0}
    last = max(r["step"] for r in rows)  # the later half (cuDNN graphs of new shapes built)
    timed = [r for r in rows if r["step"] > max(1, last // 2)] or rows
    timed = [r for r in timed if 0 < r["tokens_per_s"] < math.inf]  # a rate to time
    later = [r["peak_mem_gib"] for r in rows if r["step"] > 1]
    out = {"steps": len(rows), "peak_gib": max(r["peak_mem_gib"] for r in rows),
           "step_peaks_gib": [round(r["peak_mem_gib"], 2) for r in rows]}
    if later:
        out["later_peak_gib"] = max(later)
    if not timed:
        return out
    # The steps hold (nearly) the same tokens: one sequence of the length (1b, --seq-mode
    # concat), or documents packed to within 0.1% of the budget (hf, but an epoch's last
    # batch); so tokens over time is the harmonic mean of the steps' rates, and MFU is the
    # steps' MFU weighted by their time (~ 1 / rate).
    secs = [1.0 / r["tokens_per_s"] for r in timed]
    out["tokens_per_s"] = len(timed) / sum(secs)
    if all(isinstance(r.get("mfu"), float | int) for r in timed):
        out["mfu"] = sum(r["mfu"] * t for r, t in zip(timed, secs, strict=True)) / sum(secs)
    return out


class _Timeout(Exception):
    pass


def _child(group: str, work: str, results: str, deadline: float) -> None:
    import torch

    from cp_rope.launch import finetune_hf, pretrain

    def alarm(*_):
        raise _Timeout

    signal.signal(signal.SIGALRM, alarm)
    inner_step = pretrain.train_step

    def step(*args, **kwargs):  # each step's logged peak_mem_gib is its own (module docstring)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        return inner_step(*args, **kwargs)

    pretrain.train_step = step
    only = {int(x) for x in os.environ.get("BENCH_MEMORY_TOKENS", "").split(",") if x}
    top = int(os.environ.get("BENCH_MEMORY_TOP") or len(CONFIGS))
    for g, tokens, flags, steps, why, need_s in CONFIGS:
        if g != group or (only and tokens not in only):
            continue
        top -= 1
        if top < 0:
            break
        left = deadline - time.time()
        steps = int(os.environ.get("BENCH_MEMORY_STEPS") or steps)
        flags = merge_flags(flags, os.environ.get("BENCH_MEMORY_FLAGS", "").split())
        row = {"group": g, "tokens": tokens, "flags": " ".join(flags) or "(defaults)", "why": why}
        if left < need_s:
            row["result"] = f"skipped (budget: {left:.0f} s left, needs ~{need_s} s)"
        else:
            argv = _argv(g, tokens, flags, steps, work)
            out_dir = argv[argv.index("--out-dir") + 1]
            gc.collect()
            torch.cuda.empty_cache()
            t0 = time.time()
            signal.alarm(int(left))
            try:
                (finetune_hf.main if g == "hf" else pretrain.main)(argv)
                row.update(_read_metrics(out_dir), result="ok")
            except torch.OutOfMemoryError as exc:
                row["result"] = "OOM: " + str(exc).split("\n")[0][:160]
            except _Timeout:
                row["result"] = f"timeout after {time.time() - t0:.0f} s"
                if os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
                    try:  # what it logged before the timeout; a bad file must not end the run
                        row.update(_read_metrics(out_dir))
                    except (OSError, ValueError, KeyError, ZeroDivisionError) as exc:
                        row["result"] += f" (metrics unreadable: {type(exc).__name__})"
            except (Exception, SystemExit) as exc:  # a result too: the next config runs
                row["result"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            finally:
                signal.alarm(0)
            row["wall_s"] = round(time.time() - t0, 1)
        with open(results, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


def _predict(rows: list[dict], work: str) -> None:
    from cp_rope.launch.config import preset
    from cp_rope.launch.plan_memory import GIB, Shapes, estimate

    for r in rows:
        flags = [] if r["flags"] == "(defaults)" else r["flags"].split()
        shapes = (Shapes.from_hf_dir(f"{work}/qwen3",
                                     fused_swiglu="--no-fused-swiglu" not in flags)
                  if r["group"] == "hf" else Shapes.from_model_config(preset("1b").model))
        est = estimate(shapes, _settings(flags), tokens=r["tokens"],
                       doc_len=16384 if r["group"] == "hf" else r["tokens"])
        r["predicted_gib"] = est["total"] / GIB
        if "later_peak_gib" in r:
            r["predicted_over_measured"] = r["predicted_gib"] / r["later_peak_gib"]


def _fmt(r: dict, k: str, fmt: str) -> str:
    return format(r[k], fmt) if k in r else "-"


def _table(rows: list[dict]) -> str:
    lines = ["| model | tokens/step | settings | result | peak GiB (run) | peak GiB (steps >= 2) "
             "| predicted GiB | pred/meas (steps >= 2) | tokens/s | MFU |", "|" + " --- |" * 10]
    for r in rows:
        def f(k, fmt, r=r):
            return _fmt(r, k, fmt)
        lines.append(f"| {r['group']} | {r['tokens']:,} | {r['flags']} | {r['result']} | "
                     f"{f('peak_gib', '.1f')} | {f('later_peak_gib', '.1f')} | "
                     f"{f('predicted_gib', '.1f')} | "
                     f"{f('predicted_over_measured', '.3f')} | {f('tokens_per_s', ',.0f')} | "
                     + (f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-") + " |")
    return "\n".join(lines)


def _plans() -> None:
    from cp_rope.launch import plan_memory

    for args in (["--preset", "1b"], ["--preset", "8b", "--vocab-size", "128256"]):
        for cp in ("1", "8"):
            plan_memory.main([*args, "--seq-len", "1048576", "--cp-size", cp,
                              "--gpu-memory-gib", str(141e9 / 2**30)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("hf", "1b"), help="one model only")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="wall seconds for all configs (default 420); the rest are skipped")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--print-plans", action="store_true")
    p.add_argument("--steps", type=int, default=0,
                   help="steps per config (default: each config's own); tokens/s is tokens "
                        "over time of the later half")
    p.add_argument("--tokens", default="",
                   help="comma-separated tokens/step: run only the configs of these lengths")
    p.add_argument("--top", type=int, default=0,
                   help="only the first N configs of each model (the list is in order of "
                        "importance; with --only hf --top 2: issue 31's two finetune_hf targets)")
    p.add_argument("--flags", default="",
                   help="finetune_hf / pretrain flags for every config run, one string: a flag a "
                        "config has gets this value, others are added; --no-x replaces --x "
                        "(e.g. --flags=\"--mlp-tile-tokens 32768\"; write --flags=... for a "
                        "value that starts with --)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    a = p.parse_args()
    try:
        wanted = {int(x.replace("_", "")) for x in a.tokens.split(",") if x.strip()}
    except ValueError:
        p.error(f"--tokens {a.tokens!r}: comma-separated integers (e.g. 32768,262144)")
    known = {c[1] for c in CONFIGS if a.only in (None, c[0])}
    if wanted - known:
        p.error(f"--tokens: no config of {sorted(wanted - known)} tokens/step"
                f"{' for --only ' + a.only if a.only else ''}; the configs have {sorted(known)}")
    if a.top < 0:
        p.error(f"--top {a.top}: must be >= 1 (0 = every config)")
    if a.steps < 0:
        p.error(f"--steps {a.steps}: must be >= 1 (0 = each config's own)")
    try:
        merge_flags([], a.flags.split())
    except ValueError as exc:
        p.error(str(exc))
    a.tokens = ",".join(map(str, sorted(wanted)))
    if a.child:
        _child(a.child, a.work, a.results, a.deadline)
        return
    t0 = time.time()
    work = tempfile.mkdtemp(prefix="bench_memory_")
    os.makedirs(f"{work}/qwen3")
    with open(f"{work}/qwen3/config.json", "w") as f:
        json.dump(QWEN, f)
    groups = [a.only] if a.only else ["hf", "1b"]
    if "hf" in groups:
        _corpus(f"{work}/docs.jsonl", 4 * 1048576)
    results = f"{work}/results.jsonl"
    weight = {"hf": 0.4, "1b": 0.6} if len(groups) == 2 else {groups[0]: 1.0}
    for g in groups:
        left = a.budget_s - (time.time() - t0)
        share = left if g == groups[-1] else weight[g] * a.budget_s
        deadline = time.time() + share
        cmd = [sys.executable, __file__, "--child", g, "--work", work, "--results", results,
               "--deadline", str(deadline)]
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
                   PYTHONUNBUFFERED="1", BENCH_MEMORY_TOKENS=a.tokens,
                   BENCH_MEMORY_STEPS=str(a.steps or ""), BENCH_MEMORY_TOP=str(a.top or ""),
                   BENCH_MEMORY_FLAGS=a.flags)
        try:
            subprocess.run(cmd, env=env, timeout=share + 30, check=False)
        except subprocess.TimeoutExpired:
            print(f"{g}: child killed after {share + 30:.0f} s", flush=True)
    rows = []
    if os.path.exists(results):
        with open(results) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    _predict(rows, work)
    print(_table(rows))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    if a.print_plans:
        _plans()


if __name__ == "__main__":
    main()
