"""Long-context pretraining with context parallelism over a ``("dp", "cp")`` DeviceMesh.

One node, CPU (gloo), the default tiny model on the Python stdlib corpus::

    torchrun --standalone --nproc-per-node 2 -m cp_rope.launch.pretrain --cp-size 2

One node, 8 GPUs (NCCL), 1B model, 128K-token sequences split over 4 ranks, 2 DP groups::

    torchrun --standalone --nproc-per-node 8 -m cp_rope.launch.pretrain \\
        --preset 1b --cp-size 4 --seq-mode concat --seq-len 131072 --tokens-per-batch 131072

Two nodes x 8 GPUs (run on every node; the rendezvous endpoint is node 0)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $MASTER_ADDR:29500 --rdzv-id job42 \\
        -m cp_rope.launch.pretrain --preset 8b --cp-size 8 --out-dir /shared/runs/8b

(``launch/slurm_pretrain.sh`` does the same under SLURM.) World size = dp x
cp; every rank of a CP group reads the same global batch and keeps its zigzag
shard; the loss is the mean over every real token of the job
(:func:`cp_rope.parallel.cp_cross_entropy` of the logits, computed in the model's forward
without materialising them by :func:`cp_rope.parallel.cp_linear_cross_entropy`) and
gradients are summed over all ranks: FSDP2 ``fully_shard`` over the flattened dp-cp mesh
on GPU (bf16 params, fp32 reduction), one all-reduce of the flat gradient on CPU
(``--fsdp on`` uses FSDP2 on CPU too).
``python -m cp_rope.launch.pretrain --help`` lists every flag.

The trainer in four named steps: :func:`set_up` (process group, mesh, data,
model, :func:`cp_rope.launch.parallelize.parallelize`, optimizer, resume),
:func:`train_loop` (:func:`train_step` per batch, logging, checkpoints,
signals), :func:`summarize` (the run's loss and throughput), and :func:`run`,
which calls them; :func:`main` adds the command line (:mod:`cp_rope.launch.cli`).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import cp_rope
from cp_rope.parallel.loss import auto_chunk_size, loss_impl
from cp_rope.parallel.mesh import ParallelDims

from .batches import BatchStream
from .checkpoint import load_checkpoint, resume_checkpoint, save_checkpoint
from .checkpoint_space import check_checkpoint_space
from .cli import parse_args, run_cli
from .config import ConfigError, PretrainConfig, runs_on_cpu, validate
from .cp_startup import cp_calibration, cp_start_up, log_auto_choice
from .data import TokenDataset, build_loader, padded_vocab_size, placement_args
from .evaluate import HeldOut
from .metrics import MetricsLogger, StepStats, Throughput, log_step, peak_memory_gib, peak_tflops
from .model import Transformer, count_params
from .optim import all_reduce_gradients, build_optimizer, clip_gradients, lr_lambda
from .parallelize import compute_dtype, flat_mesh, parallelize, uses_fsdp
from .plan_memory import auto_settings
from .plot import write_report
from .run_dir import RunStart, start_run
from .start_gate import StartError, agreed_start
from .stop_flag import StopFlag
from .tokenizer import prepare_corpora

__all__ = ["main", "run", "set_up", "train_loop", "summarize", "Trainer", "build_model",
           "train_step", "all_reduce_gradients", "lr_lambda", "setup_distributed", "loss_summary"]


# ------------------------------------------------------------------ pieces
def build_model(cfg: PretrainConfig, device: torch.device) -> Transformer:
    """The unparallelized model on ``device`` with weights from ``cfg.train.seed`` (identical on
    every rank); :func:`~cp_rope.launch.parallelize.parallelize` comes next."""
    torch.manual_seed(cfg.train.seed)
    with torch.device(device):
        return Transformer(cfg.model, loss_impl=cfg.parallel.loss_impl)


def loss_summary(cfg: PretrainConfig, device: torch.device, dtype: torch.dtype) -> str:
    """What the run's loss runs, for its log at start: ``"fused (liger)"``, ``"fused (torch,
    chunks of N tokens)"`` or ``"unfused"`` (``--loss-impl`` resolved for this device and
    compute dtype by the library's own rule, :func:`cp_rope.parallel.loss.loss_impl`)."""
    m = cfg.model
    if not m.fused_loss:
        return "unfused"
    chunk = m.loss_chunk_size or None
    # a one-row stand-in for the hidden states (no rows would pick the torch loop)
    impl = loss_impl(cfg.parallel.loss_impl, torch.empty(1, 1, dtype=dtype, device=device), chunk)
    if impl == "liger":
        return "fused (liger)"
    return f"fused (torch, chunks of {chunk or auto_chunk_size(m.vocab_size)} tokens)"


def train_step(model: Transformer, batch, loss_group: dist.ProcessGroup | None, *,
               device: torch.device | None = None, grad_scale: float = 1.0,
               reduce_group: dist.ProcessGroup | None = None,
               reduce_grads: bool = True, plan=None) -> torch.Tensor:
    """The batch's plan, forward, CP loss, backward and (CPU path) the gradient SUM.

    Args:
        batch: this rank's :class:`~cp_rope.parallel.PackedBatch` shard on the *host*: the
            plan is built from it (``model.attention_plan``, once: no device-to-host read),
            then it moves to ``device`` (default: the model's).
        loss_group: the dp x cp group the loss averages over (``None``: world).
        grad_scale: backward of ``loss * grad_scale``: the world size under FSDP2,
            whose reduce-scatter averages, so that the result is a SUM.
        reduce_grads: all-reduce gradients over ``reduce_group`` here (no FSDP).
        plan: the batch's plan when the caller built it (:func:`train_loop`, which logs its
            ``plan.choice``); None: built here.

    Returns: the detached loss (the mean over every real token of ``loss_group``).
    """
    if plan is None:  # the step's one plan, from host data
        plan = model.attention_plan(batch, device=device)
    batch = batch.to(plan.device, non_blocking=True)
    # the loss comes from the model's forward (fused head; FSDP2's root weights unsharded there);
    extra = {"seq_lens": batch.seq_lens} if getattr(model, "uses_seq_lens", False) else {}  # MoE
    loss = model(batch.input_ids, plan, labels=batch.labels, loss_group=loss_group, **extra)
    (loss * grad_scale if grad_scale != 1.0 else loss).backward()
    if reduce_grads:
        all_reduce_gradients(model, reduce_group)
    return loss.detach()


def setup_distributed(cfg: PretrainConfig, store: dist.Store | None = None) -> tuple[bool, torch.device]:
    """Initialise the process group (unless the caller did) and pick this rank's device.

    The CUDA device comes from LOCAL_RANK and is set before NCCL starts; every
    global rank question is asked of ``dist.get_rank()``. ``store``: the rendezvous store
    :func:`~cp_rope.launch.start_gate.agreed_start` opened (torchrun, 2+ ranks), reused.

    Raises: StartError when a rank does not join within ``parallel.timeout_s``.
    """
    want_cuda = not runs_on_cpu(cfg.train.device)
    if want_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return False, device
    timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
    backend = "nccl" if want_cuda else "gloo"
    if store is not None:  # torchrun, every rank's start agreed
        try:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        except dist.DistStoreError as exc:
            raise StartError(f"parallel.timeout_s={cfg.parallel.timeout_s}: the process group did "
                             f"not form in time (did a rank exit or crash?): {exc}") from None
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group(backend, timeout=timeout)
    else:  # plain `python -m`: a one-process job
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return True, device


def _resolve(cfg: PretrainConfig, vocab_size: int) -> PretrainConfig:
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model))
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = padded_vocab_size(vocab_size)
    elif cfg.model.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size}: the tokenizer has {vocab_size} ids")
    if cfg.model.max_seq_len == 0:
        cfg.model.max_seq_len = cfg.data.seq_len
    return cfg


# ------------------------------------------------------------------ the trainer
@dataclass(kw_only=True)
class Trainer:
    """What :func:`set_up` builds and :func:`train_loop` / :func:`summarize` use."""

    cfg: PretrainConfig
    """The resolved config (vocab_size and max_seq_len filled in)."""
    dims: ParallelDims
    device: torch.device
    fsdp: bool
    """Parameters sharded with FSDP2 (else gradients all-reduced by :func:`train_step`)."""
    model: Transformer
    loss_group: dist.ProcessGroup
    """All dp x cp ranks: the loss averages and the gradients sum over them."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batches: BatchStream
    log: MetricsLogger
    throughput: Throughput
    step: int
    """Optimizer steps done (the resumed step at first)."""
    start_step: int
    losses: dict[int, float] = field(default_factory=dict)
    """Loss of each step of this invocation (1-based step numbers)."""
    interrupted: int = 0
    """The signal that stopped the loop, 0 if none."""
    stats: StepStats | None = None
    """Per-step bits-per-byte and CP-balance counts; ``held_out``: the evaluation, or None."""
    held_out: HeldOut | None = None
    start: RunStart | None = None  # the agreed run (inputs' contents), rank 0's out-dir lock

    @property
    def ckpt_root(self) -> str:
        return os.path.join(self.cfg.train.out_dir, "checkpoints")


def set_up(cfg: PretrainConfig, *, build=None, memory_shapes=None, program: str = "pretrain",
           extra: dict | None = None, files: dict | None = None) -> Trainer:
    """Everything before the first step, inside an initialised process group.

    ``build(cfg, device) -> nn.Module`` replaces :func:`build_model` (e.g.
    :mod:`cp_rope.launch.finetune_hf`'s transformers model): a module with
    ``attention_plan(batch, *, dtype=None, device=None)`` and
    ``forward(input_ids, plan, *, labels=None, loss_group=None)``
    (logits, or with ``labels`` the group-mean loss), ``layers``,
    ``tok_embeddings`` and ``configure_attention`` (what :func:`parallelize` uses).
    ``--memory auto`` picks the memory flags (:func:`cp_rope.launch.plan_memory.auto_settings`)
    for ``memory_shapes`` (a :class:`~cp_rope.launch.plan_memory.Shapes`; default: ``cfg.model``'s).
    ``program`` names the entry point in the first log line (``cp-rope <program>: world ...``).
    ``extra`` / ``files``: a trainer's own config sections and input files, agreed on by the
    ranks with the rest of the run (:func:`cp_rope.launch.run_dir.start_run`).

    Agrees on the run with every rank (``cfg`` validated against the world size, the
    inputs' contents; :func:`~cp_rope.launch.run_dir.start_run`), locks and checks the
    out-dir, builds the
    ``("dp", "cp")`` mesh, the data (corpus, dataset, this rank's loader), the
    model (:func:`build_model`, then :func:`~cp_rope.launch.parallelize.parallelize`),
    the optimizer and LR schedule; resumes from the newest checkpoint with
    ``--resume``; opens the metrics log and writes ``config.json``.

    Raises: ConfigError naming the field.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    start = start_run(cfg, extra=extra, files=files)  # agreement, out-dir lock and rules
    dims = ParallelDims.from_world(cfg.parallel.cp_size, world)
    device = torch.device("cuda", torch.cuda.current_device()) if (
        cfg.train.device != "cpu" and dist.get_backend() == "nccl") else torch.device("cpu")
    mesh = dims.build_mesh(device.type)
    dp_rank, cp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")

    calibration = cp_calibration(cfg, device)  # the cost model's constants, for every plan
    corpus = (run_data := prepare_corpora(cfg, rank)).train  # tokenizer (BPE), held-out split
    start.record_tokenizer(run_data.trained_tokenizer)
    cfg = _resolve(cfg, corpus.vocab_size)
    memory_note = None
    if cfg.model.memory == "auto":  # before the model exists: the choice shapes it
        cfg, memory_note = auto_settings(cfg, device, dp=dims.dp, cp=dims.cp, shapes=memory_shapes)
        validate(cfg, world)  # the flags it chose, with the run's others (every rank the same)
    dataset = TokenDataset(corpus, cfg.data.seq_mode, cfg.data.seq_len)
    fsdp, dtype = uses_fsdp(cfg, device.type), compute_dtype(cfg, device.type)
    placement = placement_args(cfg.parallel, cfg.model, dtype=dtype, calibration=calibration,
                               shapes=memory_shapes)
    loader, sampler = build_loader(cfg.data, dataset, cp_size=dims.cp, cp_rank=cp_rank,
                                   dp_size=dims.dp, dp_rank=dp_rank, seed=cfg.train.seed,
                                   pin_memory=device.type == "cuda", **placement)
    batches = BatchStream(loader, sampler)

    model = (build or build_model)(cfg, device)
    n_params = count_params(model)
    n_params_no_emb = count_params(model, exclude_embedding=True)
    parallelize(model, mesh, cfg, calibration=calibration)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.optim, cfg.train.steps))

    ckpt_root = os.path.join(cfg.train.out_dir, "checkpoints")
    t = cfg.train
    if t.save_final or t.checkpoint_every or t.save_on_signal:  # fail now, not at the first save
        saves = (t.steps // t.checkpoint_every if t.checkpoint_every else 0) + int(t.save_final)
        check_checkpoint_space(ckpt_root, model, optimizer, keep=t.keep_checkpoints,
                               saves=max(1, saves))
    step = 0
    # the newest checkpoint that verifies; newer damaged ones are reported, then replaced
    resume_from, skipped = resume_checkpoint(ckpt_root) if cfg.train.resume else (None, [])
    if resume_from is not None:
        step, sampler_state = load_checkpoint(resume_from, model, optimizer, scheduler,
                                              batches.state_dict(), verify=False,  # just verified
                                              run=start.checkpoint_run(cfg, world))
        batches.load_state_dict(sampler_state)
    else:
        sampler.set_epoch(0)

    log = MetricsLogger(cfg.train.out_dir, enabled=rank == 0,
                        resume_step=step if cfg.train.resume else None,
                        tensorboard=cfg.train.tensorboard, total_steps=cfg.train.steps,
                        start_step=step, progress=cfg.train.progress)
    start.write_config(cfg)
    for line in run_data.notes + [f"skipped {path}: {reason}" for path, reason in skipped]:
        log.write(line)
    if memory_note:
        log.write(memory_note)
    log.write(f"cp-rope {program}: world {world} = dp {dims.dp} x cp {dims.cp}, {device.type} "
              f"{str(dtype).removeprefix('torch.')}{' FSDP2' if fsdp else ''}, "
              f"{n_params / 1e6:.2f}M params, {corpus.num_docs} docs / {int(corpus.offsets[-1]):,} "
              f"tokens ({cfg.data.data or 'python stdlib'}; {run_data.tokenizer}), {len(dataset)} "
              f"examples, {run_data.eval.num_docs if run_data.eval else 0} held-out docs, "
              f"{cfg.data.tokens_per_batch * dims.dp:,} tokens/step max; cp_rope from "
              f"{os.path.dirname(os.path.dirname(cp_rope.__file__))}"  # which checkout runs
              + (f"; resumed from {resume_from} at step {step}" if resume_from else ""))
    if resume_from and step < cfg.train.steps:  # a --steps other than the first run's moves it
        lr = cfg.optim.lr * lr_lambda(cfg.optim, cfg.train.steps)(step)
        log.write(f"learning rate: the cosine over --steps {cfg.train.steps}, {lr:.3g} at step "
                  f"{step + 1} (recomputed for the --steps given, whatever the first run's)")
    log.write(f"loss: {loss_summary(cfg, device, dtype)} (--loss-impl {cfg.parallel.loss_impl})")
    cp_start_up(cfg, mesh["cp"].get_group(), dims.cp, device, dtype, log.write,  # own RNG
                layers=getattr(model, "attention_layers", ((None,), False)),
                calibration=calibration)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    throughput = Throughput(cfg.model, n_params_no_emb, cp_size=dims.cp, world_size=world,
                            peak_tflops=peak_tflops(device, cfg.train.peak_tflops), device=device)
    group = flat_mesh(mesh).get_group()
    return Trainer(cfg=cfg, dims=dims, device=device, fsdp=fsdp, model=model, start=start,
                   loss_group=group, optimizer=optimizer, scheduler=scheduler,
                   batches=batches, log=log, throughput=throughput, step=step, start_step=step,
                   stats=StepStats(run_data.token_bytes, cp_size=dims.cp, group=group, device=device),
                   held_out=HeldOut.build(cfg, run_data, mesh, group, device, placement))


def train_loop(tr: Trainer) -> None:
    """Optimizer steps until ``train.steps`` (or ``train.stop_at_step``), a signal on any rank,
    or an error; logs every ``log_every`` steps, checkpoints every ``checkpoint_every``.

    Updates ``tr.step``, ``tr.losses`` and ``tr.interrupted``.

    Raises: FloatingPointError naming the step (non-finite loss or gradient norm).
    """
    cfg, world, device = tr.cfg, tr.dims.world_size, tr.device
    last = cfg.train.steps if cfg.train.stop_at_step is None else min(cfg.train.steps,
                                                                       cfg.train.stop_at_step)
    tr.model.train()
    # One process: the next step's batch and plan are built on the host while the GPU runs
    # this step; an error there is raised where the old order raised it, at the next step
    # (after this step's optimizer step, log line and checkpoint). Several ranks keep the old
    # order: a rank-local data error must not put one rank's collectives out of step.
    ahead = world == 1
    ahead_plan = ahead_error = None
    with StopFlag(cfg.train.stop_grace_s) as stop:
        while tr.step < last:
            tr.interrupted = stop.any_rank(device)
            if tr.interrupted:
                stop.take()
                tr.log.write(f"signal {signal.Signals(tr.interrupted).name} at step {tr.step}: stopping")
                break
            t0 = time.perf_counter()
            if ahead_error is not None:
                raise ahead_error
            host_batch = next(tr.batches)  # the one peeked at (and planned) last step, if any
            seq_lens = host_batch.seq_lens.double()  # read on the host: no device sync
            tr.stats.add(host_batch)  # labelled tokens, their bytes, the CP ranks' work
            tr.optimizer.zero_grad(set_to_none=True)
            plan, ahead_plan = ahead_plan, None  # carries the auto choice
            if plan is None:
                plan = tr.model.attention_plan(host_batch, device=device)
            loss = train_step(tr.model, host_batch, tr.loss_group, device=device,
                              grad_scale=float(world) if tr.fsdp else 1.0,
                              reduce_group=tr.loss_group, reduce_grads=not tr.fsdp, plan=plan)
            norm = clip_gradients(tr.model, cfg.optim.grad_clip)  # (non-finite: raised below)
            if ahead and tr.step + 1 < last:  # host work the GPU's backward hides
                try:
                    ahead_plan = tr.model.attention_plan(tr.batches.peek(), device=device)
                except Exception as exc:  # noqa: BLE001 -- raised at the next step
                    ahead_error = exc
            loss_val, grad_norm = torch.stack([loss.float(), norm.float()]).tolist()  # one host read
            if not math.isfinite(loss_val):
                raise FloatingPointError(f"non-finite loss {loss_val} at step {tr.step + 1}")
            if not math.isfinite(grad_norm):
                raise FloatingPointError(f"non-finite gradient norm {grad_norm} at step {tr.step + 1}")
            lr = tr.scheduler.get_last_lr()[0]
            tr.optimizer.step()
            tr.scheduler.step()
            tr.step += 1
            tr.losses[tr.step] = loss_val
            tr.throughput.add_step(seq_lens, time.perf_counter() - t0)
            tr.log.advance(loss_val)
            if tr.step % cfg.train.log_every == 0 or tr.step == last or (
                    tr.held_out is not None and tr.held_out.due(tr.step)):
                log_step(tr, loss_val, lr, grad_norm)  # and the held-out evaluation when due
                log_auto_choice(tr.log.write, cfg, tr.step, plan)  # the plan's auto pick, if any
            if cfg.train.checkpoint_every and tr.step % cfg.train.checkpoint_every == 0 \
                    and tr.step < last:
                save_checkpoint(tr.ckpt_root, tr.step, tr.model, tr.optimizer, tr.scheduler,
                                tr.batches.state_dict(), cfg.train.keep_checkpoints,
                                run=tr.start.checkpoint_run(cfg, world))


def summarize(tr: Trainer) -> dict:
    """After the loop: the final (on-signal, --stop-at-step) checkpoint, the "done:" line, the log closed.

    Returns (on every rank) ``{"losses": {step: loss}, "first_loss", "last_loss",
    "tokens_per_s", "steps_run", "start_step", "interrupted"}`` for this invocation.
    """
    cfg, step, start, losses, t = tr.cfg, tr.step, tr.start_step, tr.losses, tr.cfg.train
    if (tr.interrupted and t.save_on_signal) or (not tr.interrupted and (t.save_final or step < t.steps)):
        if step > start or tr.interrupted:
            path = save_checkpoint(tr.ckpt_root, step, tr.model, tr.optimizer, tr.scheduler,
                                   tr.batches.state_dict(), cfg.train.keep_checkpoints,
                                   run=tr.start.checkpoint_run(cfg, tr.dims.world_size))
            tr.log.write(f"checkpoint: {path}")
    tokens_per_s, only_first = tr.throughput.run_tokens_per_s()
    summary = {"losses": losses, "start_step": start, "steps_run": step - start,
               "interrupted": bool(tr.interrupted), "first_loss": losses.get(start + 1),
               "last_loss": losses.get(step), "tokens_per_s": tokens_per_s}
    if losses:
        tail = list(losses.values())[-10:]
        tr.log.write(f"done: steps {start + 1}..{step}: loss {summary['first_loss']:.4f} (first) -> "
                     f"{summary['last_loss']:.4f} (last; mean of the last {len(tail)}: "
                     f"{sum(tail) / len(tail):.4f}); {tokens_per_s:,.0f} tokens/s "
                     f"({'1 step, set-up included; ' if only_first else ''}"
                     f"{tokens_per_s / tr.dims.world_size:,.0f} per rank), peak mem "
                     f"{peak_memory_gib(tr.device):.2f} GiB" + (tr.stats.done_text() if tr.stats else ""))
    elif not tr.interrupted and start >= cfg.train.steps:
        tr.log.write(f"done: nothing to train: resumed at step {start}, train.steps={cfg.train.steps} "
                     f"(pass a larger --steps to continue)")
    if tr.log.enabled and (losses or start):  # rank 0: RUN_DIR/report.png (needs matplotlib)
        write_report(cfg.train.out_dir, tr.log.write)
    tr.log.close()
    return summary


def run(cfg: PretrainConfig) -> dict:
    """Train with ``cfg`` inside an initialised process group (see :func:`main`):
    :func:`set_up`, :func:`train_loop`, :func:`summarize`.

    Returns: :func:`summarize`'s dict; ``step`` counts optimizer steps from 1.

    Raises: ConfigError (bad field), FloatingPointError (non-finite loss or
    gradient norm; the message names the step).
    """
    tr = set_up(cfg)
    try:
        try:
            train_loop(tr)
        except BaseException:
            tr.log.close()
            raise
        return summarize(tr)
    finally:
        tr.start.close()


def _parsed(argv: list[str] | None) -> PretrainConfig:
    cfg = parse_args(argv, description=__doc__)
    validate(cfg, int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None)
    return cfg


def main(argv: list[str] | None = None) -> dict:
    """Entry point: parse ``argv``, validate, set up the process group, :func:`run`, clean up.

    Works under torchrun (env:// rendezvous), as a plain one-process
    ``python -m cp_rope.launch.pretrain``, and when called inside an already
    initialised process group (tests), which it then leaves initialised.
    """
    cfg, store = agreed_start(lambda: _parsed(argv), lambda c: c.parallel.timeout_s)
    created, _ = setup_distributed(cfg, store)
    try:
        return run(cfg)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)
