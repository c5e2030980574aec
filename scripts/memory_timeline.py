#!/usr/bin/env python3
"""Per-layer memory of finetune_hf's training steps, on the host's timeline, without adding a
sync (one GPU; issue 21: where a step's peak comes from).

    python scripts/memory_timeline.py --tokens 262144 --steps 3
    python scripts/memory_timeline.py --tokens 262144 --steps 3 --gc-probe
    python scripts/memory_timeline.py [options] -- TRAINER_FLAGS   # e.g.:
    python scripts/memory_timeline.py --tokens 1048576 --steps 2 -- --activation-checkpointing full \\
        --offload-activations --mlp-tile-tokens 16384

Runs ``cp_rope.launch.finetune_hf.main`` on bench_memory's Qwen3 shape and corpus
(``scripts/bench_memory.py``; the flags after ``--`` replace its default memory flags,
``--activation-checkpointing selective --offload-activations --mlp-tile-tokens 16384``)
and records, at each mark, ``torch.cuda.memory_allocated`` and the peak since the previous
mark (GiB): every layer's forward entry / exit (``f3<`` / ``f3>``) and first use of its
offloaded tensors in backward (``b3``; the per-layer marks come from the activation offloader,
so they need ``--offload-activations``, and the backward ones tensors of at least its 1 MiB;
the last layer's, which stay on the device, are marked as they are unpacked too),
after the forward with the loss (``fwd+loss``), the backward (``bwd``), the gradient clip
(``clip``) and the optimizer step (``opt``). One line per step. Each mark resets the peak
statistic, so the trainer's own ``peak mem`` lines in between are peaks since the last mark.

``--gc-probe``: at every backward mark and after the clip, run Python's cyclic garbage
collector with ``gc.DEBUG_SAVEALL`` and report what it found: CUDA tensors held only by
reference cycles (count, GiB of distinct storages) and the code of any frames among the
garbage (a traceback kept alive in a cycle holds its frames' local tensors); then free it
(a plain collection) and report ``memory_allocated`` before and after. The first probe also
finds the set-up's cyclic garbage.
``--gc-watch``: report every collection of Python's garbage collector (automatic, or explicit
such as cp_rope's young-generation one after each cuDNN frontend call) that frees at least
64 MiB of CUDA memory (``gc.callbacks``: where in the step it ran, its generation).
``--gc-save`` (with ``--gc-watch``): ``gc.DEBUG_SAVEALL`` from the first step's start to the
last step's optimizer step, and for every collection in between that found garbage the tensors
among it (shapes, dtypes; CPU ones too, the first 12) and the 25 most common types / function
names (how the 262K retention, cuDNN frontend 1.32's kept exception, was found); what a
collection saved is freed at the next mark. This script's own collections (freeing that, and
``--gc-probe``'s) are not reported.
``--no-checkpoint-early-stop``: :func:`torch.utils.checkpoint.set_checkpoint_early_stop`
(False) for the run (the recomputation then runs each layer to its end instead of stopping
with an exception once the last saved tensor is rebuilt).

``--tiny``: bench_memory's CPU plumbing shapes (memory numbers 0 on CPU; the marks and the
probe still run).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import shutil
import sys
import tempfile

GIB = 2 ** 30
WATCH_BYTES = 64 << 20  # memory a collection must free to be reported
DEFAULT_FLAGS = ["--activation-checkpointing", "selective", "--offload-activations",
                 "--mlp-tile-tokens", "16384"]


def main(argv: list[str] | None = None) -> None:
    """Run the steps and print the timeline (module docstring); ``argv`` as on the command line."""
    argv = sys.argv[1:] if argv is None else argv
    extra = None
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="%(prog)s [options] [-- TRAINER_FLAGS]")
    p.add_argument("--tokens", type=int, default=262144, help="tokens per step")
    p.add_argument("--steps", type=int, default=3, help="training steps (one line each)")
    p.add_argument("--gc-probe", action="store_true",
                   help="report and free what reference cycles hold at each backward mark")
    p.add_argument("--gc-watch", action="store_true",
                   help="report every garbage collection that frees CUDA memory")
    p.add_argument("--gc-save", action="store_true",
                   help="with --gc-watch: what each collection in the steps found (tensors, types)")
    p.add_argument("--no-checkpoint-early-stop", action="store_true",
                   help="recompute each checkpointed layer to its end (torch's early stop off)")
    p.add_argument("--tiny", action="store_true", help="bench_memory's CPU plumbing shapes")
    a = p.parse_args(argv)
    if a.tokens < 1:
        p.error(f"--tokens {a.tokens}: must be >= 1 token per step")
    if a.steps < 1:
        p.error(f"--steps {a.steps}: must be >= 1")
    if a.gc_save and not a.gc_watch:
        p.error("--gc-save reports what --gc-watch's collections find: give both")
    if a.gc_save and a.gc_probe:
        p.error("--gc-save and --gc-probe both set the collector's debug flags: one at a time")
    if extra is not None and not extra:
        p.error("'--' without trainer flags after it (leave it out for the default flags)")
    if a.tiny:
        os.environ["BENCH_MEMORY_SMOKE"] = "1"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_memory as B  # noqa: E402  (after BENCH_MEMORY_SMOKE: it sets the shapes)
    import torch

    from cp_rope.launch import finetune_hf, pretrain
    from cp_rope.launch import offload as O

    flags = extra or [f.replace("16384", "512") if a.tiny else f for f in DEFAULT_FLAGS]
    work = tempfile.mkdtemp(prefix="memory_timeline_")
    os.makedirs(f"{work}/qwen3")
    with open(f"{work}/qwen3/config.json", "w") as f:
        json.dump(B.QWEN, f)
    B._corpus(f"{work}/docs.jsonl", (a.steps + 4) * a.tokens)
    run_argv = B._argv("hf", a.tokens, flags, a.steps, work)
    cuda = torch.cuda.is_available()
    steps: list[list[str]] = []
    probes: list[str] = []

    def mark(tag: str) -> None:
        if pending:  # --gc-save: free what the collections since the last mark saved
            pending.clear()
            gc.set_debug(0)
            own_collection(gc.collect)
            gc.set_debug(gc.DEBUG_SAVEALL if saving else debug_before)
        alloc = torch.cuda.memory_allocated() / GIB if cuda else 0.0
        peak = torch.cuda.max_memory_allocated() / GIB if cuda else 0.0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        steps[-1].append(f"{tag}:{alloc:.1f}/{peak:.1f}")
        if a.gc_probe and tag.startswith(("b", "clip")):
            probe(f"step {len(steps)} {tag}")

    def probe(where: str) -> None:
        gc.set_debug(gc.DEBUG_SAVEALL)  # the cycles' objects into gc.garbage instead of freed
        try:
            n = own_collection(gc.collect)
        finally:
            gc.set_debug(debug_before)
        garbage = list(gc.garbage)
        storages = {o.untyped_storage().data_ptr(): o.untyped_storage().nbytes()
                    for o in garbage if isinstance(o, torch.Tensor)
                    and o.device.type == "cuda" and o.layout == torch.strided}
        frames = sorted({f"{o.f_code.co_name}@{os.path.basename(o.f_code.co_filename)}"
                         for o in garbage if type(o).__name__ == "frame"})
        types = collections.Counter(type(o).__name__ for o in garbage).most_common(8)
        before = torch.cuda.memory_allocated() if cuda else 0
        gc.garbage.clear()
        del garbage
        own_collection(gc.collect)  # now free them (unreachable again once gc.garbage lets go)
        after = torch.cuda.memory_allocated() if cuda else 0
        if storages or frames or before - after >= WATCH_BYTES:
            probes.append(f"{where}: {n} objects in cycles, {len(storages)} CUDA storages "
                          f"({sum(storages.values()) / GIB:.2f} GiB), frames {frames[:8]}, "
                          f"types {types}; allocated {before / GIB:.2f} -> {after / GIB:.2f} GiB "
                          "after freeing")

    watched: list[str] = []
    pending: list[list] = []  # --gc-save: what collections found, freed at the next mark
    collecting: list[int] = []
    own: list[bool] = []  # inside this script's own collections (not reported by --gc-watch)
    debug_before = gc.get_debug()
    saving = False  # --gc-save: DEBUG_SAVEALL on, from the first step's start to the last opt

    def own_collection(collect):
        own.append(True)
        try:
            return collect()
        finally:
            own.pop()

    def watch(phase: str, info: dict) -> None:
        """gc.callbacks: memory freed by each collection (a host counter, no sync); with --gc-save,
        what it found."""
        if own:
            return
        if phase == "start":
            collecting[:] = [torch.cuda.memory_allocated() if cuda else 0]
            return
        where = (f"step {len(steps)} after "
                 f"{steps[-1][-1].split(':')[0] if steps and steps[-1] else 'set-up'}: "
                 f"generation {info['generation']}")
        if a.gc_save and gc.garbage:
            garbage = list(gc.garbage)
            pending.append(garbage)  # freed at the next mark
            gc.garbage.clear()
            if not saving:  # outside the steps
                return
            t = [o for o in garbage if isinstance(o, torch.Tensor)]
            names = collections.Counter(
                getattr(o, "__qualname__", None) or type(o).__qualname__ for o in garbage
                if not isinstance(o, (dict, tuple, list, torch.Tensor))).most_common(25)
            watched.append(f"{where}: {len(garbage)} objects, tensors "
                           f"{[(tuple(x.shape), str(x.dtype)[6:]) for x in t][:12]} "
                           f"(+{max(len(t) - 12, 0)}), names {names}")
        elif collecting:
            freed = collecting.pop() - (torch.cuda.memory_allocated() if cuda else 0)
            if freed >= WATCH_BYTES:
                watched.append(f"{where} collected {info['collected']} objects, "
                               f"freed {freed / GIB:.2f} GiB")

    inner_layer, inner_unpack = O.ActivationOffloader.layer, O.ActivationOffloader.unpack
    seen: set[int] = set()

    @contextlib.contextmanager
    def layer(self, index):
        mark(f"f{index}<")
        with inner_layer(self, index) as x:
            yield x
        mark(f"f{index}>")

    def unpack(self, h):
        # an offloaded tensor (_Handle) or one of the last layer, kept on the device (_Kept)
        if isinstance(h, O._Handle | O._Kept) and h.group not in seen:
            seen.add(h.group)
            mark(f"b{h.group}")
        return inner_unpack(self, h)

    inner_step, inner_clip = pretrain.train_step, pretrain.clip_gradients
    inner_opt = torch.optim.AdamW.step

    hooked: set[int] = set()

    def step(model, *args, **kwargs):
        nonlocal saving
        if a.gc_save and not saving:
            saving = True
            gc.set_debug(gc.DEBUG_SAVEALL)
        if id(model) not in hooked:  # the model's forward returns the loss: mark it there
            hooked.add(id(model))
            model.register_forward_hook(lambda *_: mark("fwd+loss"))
        steps.append([])
        seen.clear()
        mark("start")
        loss = inner_step(model, *args, **kwargs)
        mark("bwd")
        return loss

    def clip(*args, **kwargs):
        out = inner_clip(*args, **kwargs)
        mark("clip")
        return out

    def opt_step(self, *args, **kwargs):
        nonlocal saving
        out = inner_opt(self, *args, **kwargs)
        mark("opt")
        if saving and len(steps) == a.steps:  # the last step: stop saving
            saving = False
            gc.set_debug(debug_before)
        return out

    O.ActivationOffloader.layer, O.ActivationOffloader.unpack = layer, unpack
    pretrain.train_step, pretrain.clip_gradients = step, clip
    torch.optim.AdamW.step = opt_step
    early = (torch.utils.checkpoint.set_checkpoint_early_stop(False) if a.no_checkpoint_early_stop
             else contextlib.nullcontext())
    if a.gc_watch:
        gc.callbacks.append(watch)
    try:
        with early:
            finetune_hf.main(run_argv)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        O.ActivationOffloader.layer, O.ActivationOffloader.unpack = inner_layer, inner_unpack
        pretrain.train_step, pretrain.clip_gradients = inner_step, inner_clip
        torch.optim.AdamW.step = inner_opt
        if watch in gc.callbacks:
            gc.callbacks.remove(watch)
        gc.set_debug(debug_before)
        pending.clear()
        gc.garbage.clear()
    print(f"memory timeline: {a.tokens:,} tokens/step, flags {' '.join(flags)}"
          f"{', gc probe' if a.gc_probe else ''}{', gc watch' if a.gc_watch else ''}"
          f"{' (saving)' if a.gc_save else ''}"
          f"{', no checkpoint early stop' if a.no_checkpoint_early_stop else ''} "
          "(GiB: tag:allocated/peak since the previous mark)")
    for i, marks in enumerate(steps, 1):
        print(f"step {i}: " + " ".join(marks))
    if a.gc_watch:
        print("gc watch: " + ("no collection freed CUDA memory" if not watched
                              else "collections that freed CUDA memory" +
                              (" and what collections found:" if a.gc_save else ":")))
        for line in watched:
            print("  " + line)
    if a.gc_probe:
        print("gc probe: " + ("no CUDA tensor or frame held by reference cycles" if not probes
                              else "what reference cycles held (then freed):"))
        for line in probes:
            print("  " + line)


if __name__ == "__main__":
    main()
