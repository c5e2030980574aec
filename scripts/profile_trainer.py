#!/usr/bin/env python3
"""Where a trainer step's wall time goes on one GPU: the GPU's busy and idle time, what the
host was doing while the GPU idled, and the host syncs.

    python scripts/profile_trainer.py --tokens 32768
    python scripts/profile_trainer.py --tokens 262144 --steps 5 --first 3 --record 2 \\
        --flags "--activation-checkpointing selective --offload-activations --mlp-tile-tokens 16384"

Runs :func:`cp_rope.launch.finetune_hf.main` with ``scripts/bench_memory.py``'s Qwen3 shape,
corpus and arguments (``--log-every 1``, attention backend auto) for ``--steps`` steps and
records steps ``--first`` .. ``--first + --record - 1`` with torch.profiler. The window opens and
closes at a ``train_step`` call, so it holds whole loop iterations: the step's forward and
backward, the loss and gradient-norm reads, the optimizer, the log line, the stop flag, the
next batch and its plan. This script marks those host phases with ``record_function`` by
wrapping the loop's functions (the trainer itself has no profiler hooks).

Prints one JSON line: per recorded step (ms), the wall time, the GPU's busy time (the union of
its kernels, copies and sets), its idle time split by the host phase it fell in (the innermost
marked phase running on the host at that moment), and the host syncs (count and ms) per phase.
``--table N`` adds torch.profiler's table of the N ops with the most host time (``--sort
device``: GPU time); ``--trace
PATH`` writes the Chrome trace (gzip). ``--tiny`` runs bench_memory's CPU smoke shapes (a check
of this script's plumbing; no GPU numbers).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import re
import shlex
import shutil
import tempfile
from collections import defaultdict
from contextlib import contextmanager
from itertools import pairwise

# the CUDA runtime calls that block the host (cudaMemcpyAsync does not: an .item() is one plus
# a cudaStreamSynchronize)
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _bench_memory():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_memory.py")
    spec = importlib.util.spec_from_file_location("bench_memory", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _wrap(owner, name: str, phase: str) -> None:
    """Mark every call of ``owner.name`` as the host phase ``phase``."""
    from torch.profiler import record_function

    inner = getattr(owner, name)

    def marked(*args, **kwargs):
        with record_function("phase:" + phase):
            return inner(*args, **kwargs)

    setattr(owner, name, marked)


@contextmanager
def _marked_loop():
    """The loop's functions wrapped in phases for the length of the run, then restored."""
    import torch

    from cp_rope.launch import hf_model, pretrain, stop_flag

    marked = [(pretrain.BatchStream, "__next__", "next_batch"),
              (pretrain.BatchStream, "peek", "next_batch"),
              (hf_model.HFCausalLM, "attention_plan", "plan"),
              (pretrain, "clip_gradients", "clip_gradients"), (pretrain, "log_step", "log_step"),
              (pretrain, "log_auto_choice", "log_auto_choice"),
              (stop_flag.StopFlag, "any_rank", "stop_flag"), (torch.Tensor, "backward", "backward")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in marked]
    for owner, name, phase in marked:
        _wrap(owner, name, phase)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def _phase_at(phases: list[tuple[int, int, str]], lo: int, hi: int) -> str:
    """The innermost phase running over all of [lo, hi]: the latest-started, then shortest."""
    return max(((s, -e, n) for s, e, n in phases if s <= lo and e >= hi),
               default=(0, 0, "other"))[2]


def _innermost(phases: list[tuple[int, int, str]], a: int, b: int) -> dict[str, int]:
    """ns of [a, b) in each innermost phase."""
    cuts = sorted({a, b, *(x for s, e, _ in phases for x in (s, e) if a < x < b)})
    out: dict[str, int] = defaultdict(int)
    for lo, hi in pairwise(cuts):
        out[_phase_at(phases, lo, hi)] += hi - lo
    return out


def _origin(event, depth: int = 3) -> str:
    """Where a profiled op came from: its nearest ``depth`` enclosing ops that are not ATen's
    (``record_function`` marks, custom ops, autograd Functions; in backward, the autograd node
    that ran it), innermost first. Stacks are not recorded: torch's Python tracer drops them
    under Kineto, and can fail to parse when code objects are freed in the window."""
    names, node = [], event.cpu_parent
    while node is not None and len(names) < depth:
        if not node.name.startswith("aten::"):
            names.append(node.name.removeprefix("autograd::engine::evaluate_function: "))
        node = node.cpu_parent
    return " < ".join(names) or "?"


def _regex(text: str) -> re.Pattern:
    try:
        return re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"not a regular expression: {exc}") from None


def launchers(events, pattern: re.Pattern, n_steps: int) -> list[dict]:
    """The ops that launched the kernels whose name matches ``pattern``, grouped by op name,
    input shapes and :func:`_origin`: per group the kernel launches and GPU ms per step, most
    GPU time first. ``events``: torch.profiler's ``FunctionEvent`` list (``prof.events()``,
    recorded with shapes); each kernel is counted once, at the op that launched it (the
    innermost: an op's ``kernels`` are the ones launched while it was the innermost)."""
    match = pattern.search
    groups: dict[tuple, list[float]] = {}
    for e in events:
        hits = [k for k in getattr(e, "kernels", ()) if match(k.name)]
        if hits:
            key = (e.name, str(e.input_shapes), _origin(e))
            g = groups.setdefault(key, [0, 0.0])
            g[0] += len(hits)
            g[1] += sum(k.duration for k in hits) / 1e3  # us -> ms
    rows = [{"op": k[0], "shapes": k[1], "origin": k[2], "launches_per_step": n / n_steps,
             "gpu_ms_per_step": round(ms / n_steps, 3)} for k, (n, ms) in groups.items()]
    return sorted(rows, key=lambda r: -r["gpu_ms_per_step"])


def analyse(events, n_steps: int) -> dict:
    """Per-step means (ms) from kineto events: wall, GPU busy, GPU idle by host phase, syncs."""
    from torch.autograd import DeviceType

    gpu, phases, syncs, steps = [], [], [], []
    for e in events:
        s, d, name = e.start_ns(), e.duration_ns(), e.name()
        if e.device_type() == DeviceType.CUDA:
            gpu.append((s, s + d))
        elif name == "phase:train_step":
            steps.append(s)
            phases.append((s, s + d, "forward (train_step outside backward)"))
        elif name.startswith("phase:"):
            phases.append((s, s + d, name[6:]))
        elif name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
            phases.append((s, s + d, name.split("#")[0]))
        elif name == "aten::_local_scalar_dense":
            phases.append((s, s + d, "host read of a device value (.item, float, tolist)"))
        elif name in SYNCS:
            syncs.append((s, s + d, name))
    steps.sort()
    if len(steps) < n_steps + 1:
        raise RuntimeError(f"recorded {len(steps)} train_step calls, need {n_steps + 1}")
    t0, t1 = steps[0], steps[n_steps]
    phases.append((t0, t1, "the loop's own code"))
    busy, idle = 0, defaultdict(int)
    cursor = t0
    kept = sorted((max(s, t0), min(e, t1)) for s, e in gpu if e > t0 and s < t1)
    for s, e in [*kept, (t1, t1)]:  # the last one closes the window
        if s > cursor:
            for k, v in _innermost(phases, cursor, s).items():
                idle[k] += v
        busy += max(0, e - max(s, cursor))
        cursor = max(cursor, e)
    by_phase: dict[str, list] = defaultdict(lambda: [0, 0])
    for s, e, name in syncs:
        if t0 <= s < t1:
            key = f"{name} in {_phase_at(phases, s, s)}"
            by_phase[key][0] += 1
            by_phase[key][1] += e - s
    ms = 1e-6 / n_steps
    return {"wall_ms": round((t1 - t0) * ms, 2), "gpu_busy_ms": round(busy * ms, 2),
            "gpu_idle_ms": round((t1 - t0 - busy) * ms, 2),
            "gpu_idle_ms_by_host_phase": {k: round(v * ms, 2) for k, v in
                                          sorted(idle.items(), key=lambda kv: -kv[1])},
            "syncs_per_step": {k: {"count": round(c / n_steps, 2), "ms": round(t * ms, 2)}
                               for k, (c, t) in sorted(by_phase.items())}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per step (default 32,768; 2,048 with --tiny)")
    p.add_argument("--flags", default="", help="more finetune_hf flags, one string")
    p.add_argument("--steps", type=int, default=12, help="steps to run (default 12)")
    p.add_argument("--first", type=int, default=9, help="first recorded step (default 9)")
    p.add_argument("--record", type=int, default=3, help="recorded steps (default 3)")
    p.add_argument("--table", type=int, default=0, help="rows of the op table (0: none)")
    p.add_argument("--sort", choices=("cpu", "device"), default="cpu",
                   help="the op table's order: self host time, or self GPU time (GPU-bound steps)")
    p.add_argument("--trace", default=None, help="write the Chrome trace here (.json.gz)")
    p.add_argument("--launchers", default=None, metavar="REGEX", type=_regex,
                   help="print the ops that launched kernels matching REGEX (op, input shapes, "
                        "the enclosing marks or autograd node, per step; records shapes)")
    p.add_argument("--tiny", action="store_true", help="bench_memory's smoke shapes (CPU)")
    a = p.parse_args(argv)
    for name in ("steps", "first", "record"):
        if getattr(a, name) < 1:
            p.error(f"--{name} {getattr(a, name)}: must be >= 1")
    if a.first + a.record > a.steps:
        p.error(f"--first {a.first} + --record {a.record} must be <= --steps {a.steps} "
                "(the window closes at the next step's train_step)")
    if a.tokens is None:
        a.tokens = 2048 if a.tiny else 32768
    if a.tiny:
        os.environ["BENCH_MEMORY_SMOKE"] = "1"
    bm = _bench_memory()
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from cp_rope.launch import finetune_hf, pretrain

    work = tempfile.mkdtemp(prefix="profile_trainer_")
    try:
        os.makedirs(f"{work}/qwen3")
        with open(f"{work}/qwen3/config.json", "w") as f:
            json.dump(bm.QWEN, f)
        bm._corpus(f"{work}/docs.jsonl", max(4 * a.tokens * a.steps // 3, 1 << 20))
        argv_ = bm._argv("hf", a.tokens, shlex.split(a.flags), a.steps, work)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        prof = profile(activities=acts, record_shapes=a.launchers is not None)
        inner, calls = pretrain.train_step, [0]

        def step(*args, **kwargs):
            calls[0] += 1
            if calls[0] == a.first:
                prof.start()
            if calls[0] == a.first + a.record:
                with record_function("phase:train_step"):
                    pass
                prof.stop()
            with record_function("phase:train_step"):
                return inner(*args, **kwargs)

        pretrain.train_step = step
        try:
            with _marked_loop():
                finetune_hf.main(argv_)
        finally:
            pretrain.train_step = inner
        if calls[0] < a.first + a.record:
            raise RuntimeError(f"the run made {calls[0]} steps; the window needs {a.first + a.record}")
        out = {"tokens": a.tokens, "flags": a.flags, "steps_recorded": a.record,
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               **analyse(prof.profiler.kineto_results.events(), a.record)}
        print(json.dumps(out), flush=True)
        if a.table:
            by_device = a.sort == "device" and torch.cuda.is_available()
            if a.sort == "device" and not by_device:
                print("profile_trainer: --sort device on a machine without a GPU: no device "
                      "times to order by; ordered by host time", flush=True)
            key = "self_device_time_total" if by_device else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=a.table,
                                            max_name_column_width=60), flush=True)
        if a.launchers is not None and not torch.cuda.is_available():
            print("profile_trainer: --launchers on a machine without a GPU: no kernels to "
                  "attribute", flush=True)
        elif a.launchers is not None:
            for row in launchers(prof.events(), a.launchers, a.record):
                print(json.dumps(row), flush=True)
        if a.trace:
            raw = os.path.join(work, "trace.json")
            prof.export_chrome_trace(raw)
            with open(raw, "rb") as src, gzip.open(a.trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
