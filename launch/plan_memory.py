"""Per-GPU memory of a training step, by component, and the cheapest settings that fit.

Usage (no GPU needed; prints bytes per GPU by component and the choice)::

    python -m cp_rope.launch.plan_memory --preset 1b --seq-len 262144
    python -m cp_rope.launch.plan_memory --model /ckpt/Qwen3-0.6B --seq-len 1048576 --doc-len 16384
    python -m cp_rope.launch.plan_memory --preset 8b --vocab-size 128256 --seq-len 1048576 \\
        --cp-size 8 --gpu-memory-gib 131
    python -m cp_rope.launch.plan_memory --preset 1b --seq-len 262144 --no-fused-loss

The setting flags (the trainers' ``--activation-checkpointing``, ``--offload-activations``,
``--mlp-tile-tokens``, ``--fused-loss`` / ``--no-fused-loss``): with
``--activation-checkpointing`` the setting they give is estimated (the trainers' defaults for
the others); without it, those given are held while the others are chosen. A setting the
trainers refuse (a tiled MLP of a mixture of experts) is a usage error (exit status 2).

``--memory auto`` in ``cp_rope.launch.pretrain`` and ``finetune_hf`` calls
:func:`choose` with the run's shapes, the GPU's memory, the run's loss kernel and the memory
flags given with other than their defaults held (:func:`auto_settings`). ``--loss-impl``
(torch, the default install's; liger, what the trainers' ``auto`` runs on CUDA in bf16
with ``cp-rope[liger]``) says which fused loss to price.

The model, its arithmetic and its calibration: :mod:`cp_rope.launch.memory_model`.

``--model DIR`` reads the config with :func:`cp_rope.hf.local_config` (a supported family,
else one line naming them; its ``sliding_window`` / ``layer_types`` are reported); the
sequence (``--doc-len``, default ``--seq-len``) must pass the trainers' own check
(:func:`cp_rope.launch.config.check_seq_len`: a multiple of ``2 * cp_size``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math

from .config import MEMORY_KNOBS, PRESETS, ConfigError, check_seq_len
from .memory_model import GIB, Settings, estimate, step_seconds
from .memory_shapes import Shapes

__all__ = ["Shapes", "host_budget", "Settings", "estimate", "step_seconds", "candidates", "check_settings",
           "choose", "auto_settings", "main", "GIB"]

HOST_BYTES = 100 * GIB
"""Pinned host memory per GPU that offload may use where the caller gives none (plan_memory's
``--host-memory-gib`` default; the most :func:`host_budget` gives)."""

HEADROOM = 0.88
"""Share of a GPU's memory a chosen setting may fill: the model's largest error on the measured
peaks is 9.9 % under (:mod:`~cp_rope.launch.memory_model`), plus room for the allocator's fragmentation."""

def candidates(s: Shapes, *, tiled_mlp: bool = True, fused_loss: bool = True,
               tile_tokens: int = 8192, fixed: dict | None = None,
               given: dict | None = None) -> list[Settings]:
    """Every combination the planner considers: no tiled MLP for a mixture of experts (the
    trainers refuse it, :func:`check_settings`); ``fixed``: :class:`Settings` fields held at the
    given values (the setting flags given to :func:`main`), the others chosen; ``given``: the
    :class:`Settings` fields no search varies (``loss_impl``, ``loss_chunk_size``), as the run
    has them.

    Raises: ValueError naming ``fixed`` or ``given`` for a field that is not theirs."""
    opts = {"activation_checkpointing": ("none", "selective", "full"),
            "offload_activations": (False, True),
            "mlp_tile_tokens": (0, tile_tokens) if tiled_mlp and not s.n_moe else (0,),
            "fused_loss": (True, False) if fused_loss else (False,)}
    for name, value in (fixed or {}).items():
        if name not in opts:
            raise ValueError(f"fixed={fixed!r}: {name!r} is not one of {list(opts)}")
        opts[name] = (value,)
    given = dict(given or {})
    if not set(given) <= {"loss_impl", "loss_chunk_size"}:
        raise ValueError(f"given={given!r}: expected loss_impl and/or loss_chunk_size")
    return [Settings(**dict(zip(opts, values, strict=True)), **given)
            for values in itertools.product(*opts.values())]


def check_settings(s: Shapes, st: Settings, *, where: str = "mlp_tile_tokens") -> None:
    """ConfigError naming ``where`` for a setting the trainers refuse for ``s``: a tiled MLP
    of a mixture-of-experts model (finetune_hf: ``hf.mlp_tile_tokens``; cp_rope.hf.patch_model
    refuses to tile an MoE block, whose router logits the load-balancing loss differentiates)."""
    if st.mlp_tile_tokens and s.n_moe:
        raise ConfigError(f"{where}={st.mlp_tile_tokens}: a mixture-of-experts model "
                          f"({s.n_experts} experts on {s.n_moe} of {s.n_layers} layers): the "
                          "trainers refuse a tiled MLP there (its router logits are recorded "
                          "inside the MoE blocks, whose tiles run without autograd); leave it "
                          "off (0)")


def choose(s: Shapes, *, tokens: int, gpu_bytes: int, cp: int = 1, dp: int = 1,
           doc_len: int | None = None, headroom: float = HEADROOM, host_bytes: int = HOST_BYTES,
           more_host: str = "allow more host memory (plan_memory's --host-memory-gib)",
           **kw) -> tuple[Settings, dict]:
    """The fastest :func:`candidates` setting whose estimate fits ``headroom * gpu_bytes`` (and,
    offloading, whose pinned host memory fits ``host_bytes`` per GPU; ``more_host``: how the
    caller's user gets more, for the error).

    Returns: ``(settings, estimate)``.

    Raises: ConfigError when none fits, saying what the leanest setting would need (GiB per
    GPU), or, where settings fit the GPU but offload more than ``host_bytes``, what the
    leanest of those offloads; ValueError naming ``gpu_bytes`` (not > 0) or ``host_bytes``
    (< 0).
    """
    if not gpu_bytes > 0:
        raise ValueError(f"gpu_bytes must be > 0, got {gpu_bytes!r}")
    if not host_bytes >= 0:
        raise ValueError(f"host_bytes must be >= 0, got {host_bytes!r}")
    budget = headroom * gpu_bytes
    scored = []
    for st in candidates(s, **kw):
        est = estimate(s, st, tokens=tokens, cp=cp, dp=dp, doc_len=doc_len)
        scored.append((step_seconds(s, st, tokens=tokens, cp=cp, dp=dp, doc_len=doc_len),
                       est["total"], st, est))
    on_gpu = [x for x in scored if x[1] <= budget]
    fits = [x for x in on_gpu if x[3]["host (pinned)"] <= host_bytes]
    where = (f"memory=auto: nothing fits {tokens:,} tokens per step at cp {cp} x dp {dp} in "
             f"{gpu_bytes / GIB:.1f} GiB per GPU ({headroom:.0%} usable)")
    fewer = ("use a larger --cp-size (memory per GPU falls about as 1/cp) or fewer tokens per "
             "step (the trainers' --tokens-per-batch, plan_memory's --seq-len)")
    if on_gpu and not fits:  # each one that fits the GPU offloads more than the host has
        lean = min(on_gpu, key=lambda x: x[3]["host (pinned)"])
        raise ConfigError(
            f"{where} and {host_bytes / GIB:.1f} GiB of pinned host memory per GPU: the settings "
            f"that fit the GPU offload, the leanest ({lean[2].flags()}) "
            f"{lean[3]['host (pinned)'] / GIB:.1f} GiB per GPU to the host; {more_host} or "
            f"{fewer}")
    if not fits:
        lean = min(scored, key=lambda x: x[1])
        raise ConfigError(f"{where}: the leanest setting ({lean[2].flags()}) needs "
                          f"{lean[1] / GIB:.1f} GiB per GPU; {fewer}")
    best = min(fits, key=lambda x: (x[0], x[1]))
    return best[2], best[3]


HOST_SHARE = 0.5
"""Share of the machine's physical memory that ``--memory auto`` lets offload pin, split over
the processes of the node (the rest: the OS, data loading, checkpoint staging)."""


def host_budget(processes: int | None = None, ram: int | None = None) -> int:
    """Pinned host bytes per process (GPU) that ``--memory auto`` may offload: :data:`HOST_SHARE`
    of ``ram`` (default: the machine's physical memory, ``sysconf``) over ``processes`` (default:
    torchrun's ``LOCAL_WORLD_SIZE``, else the visible GPUs, at least 1), at most
    :data:`HOST_BYTES` (also what it gives without a readable ``ram``)."""
    import os

    if processes is None:
        processes = int(os.environ.get("LOCAL_WORLD_SIZE") or 0)
        if processes < 1:
            import torch

            processes = torch.cuda.device_count() if torch.cuda.is_available() else 1
    if ram is None:
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            ram = 0
    return HOST_BYTES if ram <= 0 else min(HOST_BYTES, int(HOST_SHARE * ram / max(1, processes)))


def auto_settings(cfg, device, *, dp: int, cp: int, shapes: Shapes | None = None,
                  gpu_bytes: int | None = None, loss_kernel: str | None = None,
                  host_bytes: int | None = None):
    """``--memory auto``: ``cfg`` (a PretrainConfig, vocab resolved) with the memory flags that
    :func:`choose` picks for ``cfg.data.tokens_per_batch`` tokens per step on ``device``.

    A memory flag given a value other than its default (``--activation-checkpointing``,
    ``--offload-activations``, ``--mlp-tile-tokens``, ``--no-fused-loss``) is held, as
    ``plan_memory``'s own setting flags are: the search chooses the others (a preset's own
    memory settings are not held: :func:`cp_rope.launch.cli.parse_args` resets those no flag
    or ``--config`` file gives). A ``--loss-impl`` other than auto or a ``--loss-chunk-size``
    holds the fused loss (the only one they are for). Knobs the model config does not have (``mlp_tile_tokens``,
    ``fused_loss``) are left out of the search, and so is a tiled MLP for a mixture of experts
    (:func:`candidates`). The fused loss is priced
    for the kernel the run will use (``--loss-impl`` resolved for ``device`` and the compute
    dtype, with ``--loss-chunk-size``; ``loss_kernel``, ``"torch"`` or ``"liger"``, says it
    instead). ``gpu_bytes``: the GPU's memory (default: ``device``'s); ``host_bytes``: the
    pinned host memory per GPU offload may use (default: :func:`host_budget`, this machine's
    share, so that offloading never pins more than the node has). On a CPU run without
    ``gpu_bytes`` nothing changes, and the message says which flags run. Returns
    ``(cfg, message)``; the message names the held flags.

    Raises: ConfigError (from :func:`choose`) saying what the leanest setting would need, or
    naming ``mlp_tile_tokens`` for a held tiled MLP of a mixture of experts.
    """
    m = cfg.model
    knobs = [k for k in MEMORY_KNOBS if hasattr(m, k)]
    if device.type != "cuda" and gpu_bytes is None:  # what runs, said (a preset's were reset)
        return cfg, ("memory=auto: a cpu run, nothing planned: "
                     f"{Settings(**{k: getattr(m, k) for k in knobs}).flags()} (the flags given, "
                     "else the defaults: a preset's memory settings are not kept under auto)")
    import torch

    from cp_rope.parallel._loss_impl import loss_impl

    from .parallelize import compute_dtype

    if gpu_bytes is None:
        gpu_bytes = torch.cuda.get_device_properties(device).total_memory
    s = shapes or Shapes.from_model_config(m)
    defaults = type(m)()
    fixed = {k: getattr(m, k) for k in knobs if getattr(m, k) != getattr(defaults, k)}
    check_settings(s, Settings(**fixed))
    chunk = getattr(m, "loss_chunk_size", 0)
    # --loss-impl torch|liger and --loss-chunk-size are for the fused loss only (validate)
    required = {"fused_loss": True} if ((cfg.parallel.loss_impl != "auto" or chunk) and
                                        "fused_loss" in knobs and "fused_loss" not in fixed) else {}
    if loss_kernel is None:  # the library's own rule, on a one-row stand-in (as the run's log)
        loss_kernel = loss_impl(cfg.parallel.loss_impl, torch.empty(
            1, 1, dtype=compute_dtype(cfg, device.type), device=device), chunk or None)
    host_bytes = host_budget() if host_bytes is None else host_bytes
    st, est = choose(s, tokens=cfg.data.tokens_per_batch, gpu_bytes=gpu_bytes, cp=cp, dp=dp,
                     host_bytes=host_bytes, doc_len=cfg.data.seq_len,
                     more_host=(f"run on nodes with more memory per GPU (--memory auto pins at "
                                f"most {HOST_SHARE:.0%} of the node's memory over its processes) "
                                "or give --offload-activations and the other memory flags "
                                "yourself (--memory manual)"), tiled_mlp="mlp_tile_tokens" in knobs,
                     fused_loss="fused_loss" in knobs, fixed=fixed | required,
                     given={"loss_impl": loss_kernel, "loss_chunk_size": chunk})
    new = {k: getattr(st, k) for k in knobs}
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(m, memory="manual", **new))
    held = f", held: {' '.join(_held_flags(fixed))}" if fixed else ""
    pinned = (f", {est['host (pinned)'] / GIB:.1f} of {host_bytes / GIB:.1f} GiB pinned host "
              "memory" if st.offload_activations else "")
    return cfg, (f"memory=auto: {st.flags()} (predicted peak {est['total'] / GIB:.1f} of "
                 f"{gpu_bytes / GIB:.1f} GiB per GPU{pinned}{held})")


def report(s: Shapes, st: Settings, est: dict, *, title: str) -> str:
    """A table of ``est`` (bytes per GPU by component) in GiB."""
    parts = sum(v for k, v in est.items() if k not in ("total", "host (pinned)"))
    phase = ("the optimizer step (16 bytes per parameter shard)" if est["total"] > parts
             else "the loss" if est["loss"] else "the first backward layer")
    kernel = f"; the fused loss by {st.loss_impl}" if st.fused_loss else ""
    lines = [title, f"  settings: {st.flags()}  (peak: {phase}{kernel})"]
    for k, v in est.items():
        lines.append(f"  {k:<20} {v / GIB:9.2f} GiB")
    return "\n".join(lines)


def _shapes(args) -> Shapes:
    if args.model:
        s = Shapes.from_hf_dir(args.model)
    else:
        if args.preset not in PRESETS:
            raise ConfigError(f"preset={args.preset!r}: expected one of {sorted(PRESETS)}")
        s = Shapes.from_model_config(PRESETS[args.preset]().model)
    if args.vocab_size:
        s = dataclasses.replace(s, vocab=args.vocab_size)
    if not args.fused_swiglu:
        s = dataclasses.replace(s, fused_swiglu=False)
    return s


def _held_flags(fixed: dict) -> list[str]:
    """The setting flags ``fixed`` holds, as they are written on the command line."""
    out = []
    for name, value in fixed.items():
        flag = "--" + name.replace("_", "-")
        out.append(f"{flag} {value}" if not isinstance(value, bool)
                   else flag if value else flag.replace("--", "--no-", 1))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m cp_rope.launch.plan_memory",
                                description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="1b", help=f"one of {sorted(PRESETS)} (default 1b)")
    src.add_argument("--model", help="a transformers model directory (its config.json)")
    p.add_argument("--vocab-size", type=int, default=0,
                   help="override the vocabulary (presets: 0 = the byte tokenizer's 320)")
    p.add_argument("--seq-len", type=int, required=True,
                   help="tokens per step of one CP group (the global batch of a dp rank)")
    p.add_argument("--doc-len", type=int, default=0,
                   help="document length, tokens (default 0: --seq-len, one sequence)")
    p.add_argument("--cp-size", type=int, default=1, help="context-parallel ranks (default 1)")
    p.add_argument("--dp-size", type=int, default=1, help="data-parallel ranks (default 1)")
    p.add_argument("--gpu-memory-gib", type=float, default=141e9 / GIB,
                   help="memory of one GPU, GiB (default 131.3 = an H200's 141 GB)")
    p.add_argument("--host-memory-gib", type=float, default=HOST_BYTES / GIB,
                   help=f"pinned host memory one GPU's offload may use, GiB (default "
                        f"{HOST_BYTES / GIB:.0f})")
    p.add_argument("--activation-checkpointing", choices=("none", "full", "selective"),
                   nargs="?", const="full",
                   help="estimate this setting, with the other setting flags (the trainers' "
                   "defaults where not given), instead of choosing, and say whether it fits "
                   "(a bare flag: full, as the trainers)")
    p.add_argument("--offload-activations", action=argparse.BooleanOptionalAction,
                   help="offload what each layer saves (default: chosen; with "
                   "--activation-checkpointing: off)")
    p.add_argument("--mlp-tile-tokens", type=int, default=None,
                   help="tokens per MLP tile, 0 = untiled (default: chosen, 0 or 8192; with "
                   "--activation-checkpointing: 0)")
    p.add_argument("--fused-swiglu", action=argparse.BooleanOptionalAction, default=True,
                   help="the MLPs run cp_rope's fused SwiGLU, one [T, ffn] tensor less kept "
                   "per untiled layer (default: on, as the trainers on CUDA; finetune_hf "
                   "--no-fused-swiglu turns it off)")
    p.add_argument("--loss-impl", choices=("torch", "liger"),
                   help="the fused loss's kernel, as the run's log names it: torch (cp_rope's "
                   "loop, float32 chunks; the default install; default) or liger (what "
                   "--loss-impl auto runs on CUDA in bf16 with cp-rope[liger]: larger bf16 "
                   "chunks); with --no-fused-loss, refused as by the trainers")
    p.add_argument("--fused-loss", action=argparse.BooleanOptionalAction,
                   help="the chunked fused loss (default: chosen; with "
                   "--activation-checkpointing: on)")
    args = p.parse_args(argv)
    # the setting flags given: held while the others are chosen, or the setting to estimate
    fixed = {k: getattr(args, k) for k in MEMORY_KNOBS if getattr(args, k) is not None}
    for name in ("seq_len", "cp_size", "dp_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not (math.isfinite(args.gpu_memory_gib) and args.gpu_memory_gib > 0):
        p.error(f"--gpu-memory-gib must be a finite number > 0, got {args.gpu_memory_gib}")
    if not (math.isfinite(args.host_memory_gib) and args.host_memory_gib >= 0):
        p.error(f"--host-memory-gib must be a finite number >= 0, got {args.host_memory_gib}")
    for name in ("mlp_tile_tokens", "vocab_size", "doc_len"):
        if (getattr(args, name) or 0) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.doc_len > args.seq_len:
        p.error(f"--doc-len must be <= --seq-len ({args.seq_len}), got {args.doc_len}")
    try:  # the trainers' rule for the sequence (data.seq_len) at this cp size
        check_seq_len(args.doc_len or args.seq_len, args.cp_size)
    except ConfigError as exc:
        p.error(f"--{'doc' if args.doc_len else 'seq'}-len at --cp-size {args.cp_size}: the "
                f"trainers refuse it: {exc}")
    try:
        s = _shapes(args)
    except ConfigError as exc:
        p.error(str(exc))
    kw = dict(tokens=args.seq_len, cp=args.cp_size, dp=args.dp_size, doc_len=args.doc_len or None)
    where = (f"{args.model or '--preset ' + args.preset}: {s.params / 1e9:.2f}B params, "
             f"{args.seq_len:,} tokens/step, cp {args.cp_size} x dp {args.dp_size}, per GPU")
    if s.window_note():
        where += f"\n  {s.window_note()}"
    try:  # what the trainers refuse for this model (a tiled MLP of a mixture of experts)
        check_settings(s, Settings(**fixed), where="--mlp-tile-tokens")
    except ConfigError as exc:
        p.error(str(exc))
    if args.loss_impl and args.fused_loss is False:
        p.error(f"--loss-impl {args.loss_impl} is for the fused loss only; the trainers refuse "
                "it with --no-fused-loss")
    given = {"loss_impl": args.loss_impl or "torch"}
    if args.activation_checkpointing:
        st = Settings(**fixed, **given)
        est = estimate(s, st, **kw)
        budget, host = HEADROOM * args.gpu_memory_gib * GIB, args.host_memory_gib * GIB
        misses = ([f"{est['total'] / GIB:.1f} GiB per GPU over the {budget / GIB:.1f} usable "
                   f"({HEADROOM:.0%} of --gpu-memory-gib {args.gpu_memory_gib:.1f})"]
                  if est["total"] > budget else [])
        if est["host (pinned)"] > host:
            misses.append(f"{est['host (pinned)'] / GIB:.1f} GiB per GPU offloaded, over "
                          f"--host-memory-gib {args.host_memory_gib:.1f}")
        fits = not misses
        verdict = (f"fits {args.gpu_memory_gib:.1f} GiB per GPU ({HEADROOM:.0%} usable)"
                   if fits else "does NOT fit: " + "; ".join(misses))
        print(report(s, st, est, title=where) + f"\n  {verdict}")
        return {"settings": dataclasses.asdict(st), "estimate": est, "fits": fits}
    held = f"\n  held: {' '.join(_held_flags(fixed))}" if fixed else ""
    try:
        st, est = choose(s, gpu_bytes=int(args.gpu_memory_gib * GIB),
                         host_bytes=int(args.host_memory_gib * GIB), fixed=fixed,
                         given=given, **kw)
    except ConfigError as exc:
        print(f"{where}{held}\n  error: {exc}")
        return {"settings": None, "error": str(exc)}
    print(report(s, st, est, title=where + f", fits {args.gpu_memory_gib:.1f} GiB{held}"))
    return {"settings": dataclasses.asdict(st), "estimate": est}


if __name__ == "__main__":
    raise SystemExit(2 if "error" in main() else 0)  # "nothing fits" is an answer, and a failure
