"""What the pretraining loop measures and where it goes.

* throughput and MFU arithmetic: :func:`flops_per_step`, :func:`peak_tflops`,
  :class:`Throughput` (tokens/s per log window and for the whole run);
* :func:`peak_memory_gib`;
* bits per byte (:func:`bits_per_byte`) and the CP ranks' attention work (:func:`cp_rank_work`),
  counted per step on the host by :class:`StepStats`;
* :class:`MetricsLogger`: rank-0 logging (tqdm, a JSONL metrics file, TensorBoard when installed);
  :func:`log_step` writes one step's line.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

from .config import ConfigError, ModelConfig, head_dim_of

__all__ = ["MetricsLogger", "Throughput", "flops_per_step", "peak_tflops", "peak_memory_gib",
           "bits_per_byte", "cp_rank_work", "StepStats", "log_step", "RunDirError"]

# Dense bf16 tensor-core peak of one GPU, TFLOP/s (vendor datasheets, SXM parts).
_PEAK_BF16_TFLOPS = {"B200": 2250.0, "H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0,
                     "A800": 312.0, "L40S": 362.1}


def peak_tflops(device: torch.device, override: float = 0.0) -> float:
    """Peak dense bf16 TFLOP/s of ``device`` for MFU; 0 when unknown (CPU, other GPUs)."""
    if override > 0:
        return override
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_BF16_TFLOPS.items() if k in name), 0.0)


def flops_per_step(cfg: ModelConfig, n_params_no_embedding: int, n_tokens: int,
                   sum_sq_seqlens: float) -> float:
    """Training FLOPs of one step (forward + backward = 3x forward), the MFU numerator.

    ``6 * N * tokens`` for the matmuls (N without the embedding table, with the
    output head; Kaplan et al. 2020 / PaLM appendix B) plus causal attention:
    per layer, QK^T and PV cost ``2 * 2 * L^2 * head_dim`` per query head for a
    full L x L score matrix, halved by the causal mask, times 3 for training:
    ``6 * L^2 * n_heads * head_dim`` per layer per sequence, summed over the
    *global* sequences (varlen: ``sum_sq_seqlens = sum L_b^2``).
    """
    attn = 6.0 * sum_sq_seqlens * cfg.n_heads * head_dim_of(cfg) * cfg.n_layers
    return 6.0 * n_params_no_embedding * n_tokens + attn

class Throughput:
    """Tokens/s and MFU of the step loop, per log window and for the whole run.

    Every rank of a CP group reads its group's global batch, so each rank
    counts ``1 / cp_size`` of the batch's tokens and a SUM over all ranks
    gives the job's tokens (dp groups x their batches).

    Args:
        model_cfg, n_params_no_embedding: the :func:`flops_per_step` inputs.
        cp_size, world_size: the job's layout.
        peak_tflops: one device's peak, TFLOP/s (0 = unknown: no MFU).
        device: where the all-reduced counters live (the process group's device).
    """

    def __init__(self, model_cfg: ModelConfig, n_params_no_embedding: int, *, cp_size: int,
                 world_size: int, peak_tflops: float, device: torch.device):
        self.model_cfg, self.n_params = model_cfg, n_params_no_embedding
        self.cp, self.world, self.peak, self.device = cp_size, world_size, peak_tflops, device
        self.steps = 0
        self._window = torch.zeros(2, dtype=torch.float64)  # this rank's share of tokens, sum of L^2
        self._t_window = time.perf_counter()
        self._timed = [0.0, 0.0]  # tokens and seconds of every step after the first
        self._first = [0.0, 0.0]  # ... of the first (allocator, kernel set-up), used for a 1-step run

    def add_step(self, seq_lens: torch.Tensor, seconds: float) -> None:
        """Count one optimizer step: ``seq_lens`` float64 host ``[B]``, the global lengths of
        this rank's CP-group batch (tokens); ``seconds`` its wall time."""
        self._window += torch.stack([seq_lens.sum(), (seq_lens ** 2).sum()]) / self.cp
        tokens = float(seq_lens.sum()) / self.cp
        self.steps += 1
        if self.steps > 1:
            self._timed[0] += tokens
            self._timed[1] += seconds
        else:
            self._first = [tokens, seconds]

    def window(self) -> dict[str, float]:
        """The job's ``tokens_per_s``, ``tokens_per_s_per_gpu`` (and ``mfu`` when the peak is
        known) since the previous call (or construction); all ranks must call it together."""
        sums = self._window
        if self.world > 1:  # global tokens and attention work since the last log
            sums = self._window.to(self.device)
            dist.all_reduce(sums)
        tokens, sq = sums.tolist()
        dt = time.perf_counter() - self._t_window
        tps = tokens / dt
        out = {"tokens_per_s": tps, "tokens_per_s_per_gpu": tps / self.world}
        if self.peak > 0:
            flops = flops_per_step(self.model_cfg, self.n_params, int(tokens), sq)
            out["mfu"] = flops / dt / (self.peak * 1e12 * self.world)
        self._window.zero_()
        self._t_window = time.perf_counter()
        return out

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` spent outside the steps (a held-out evaluation) out of the window."""
        self._t_window += seconds

    def run_tokens_per_s(self) -> tuple[float, bool]:
        """``(tokens/s of the job, first_step_only)``: over every step but the first, whose set-up
        is not timed, unless it was the only one (then ``first_step_only`` is True); nan
        without steps. All ranks must call it together."""
        only_first = self.steps == 1
        counts = torch.tensor(self._first if only_first else self._timed, dtype=torch.float64,
                              device=self.device)
        if self.world > 1:
            dist.all_reduce(counts)
        tokens, seconds = counts.tolist()
        return (tokens / (seconds / self.world) if seconds > 0 else float("nan")), only_first


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process, GiB: CUDA allocated tensors on GPU, max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 2**20


def bits_per_byte(nll_nats: float, n_bytes: float) -> float:
    """Bits per byte of text: ``nll_nats / (ln 2 * n_bytes)``.

    ``nll_nats``: the SUM of the token negative log-likelihoods (nats) of the predicted
    tokens; ``n_bytes``: the bytes of text those tokens stand for (their UTF-8 bytes; special
    tokens 0). Tokenizer-independent, so runs with different vocabularies compare (Gao et
    al. 2020, The Pile, section 5). NaN when ``n_bytes`` is 0.
    """
    return nll_nats / (math.log(2) * n_bytes) if n_bytes > 0 else float("nan")


def cp_rank_work(batch) -> np.ndarray:
    """float64 ``[C]``: causal query-key pairs of attention each rank of the batch's CP group
    computes, from a host :class:`~cp_rope.parallel.PackedBatch` shard (no communication).

    A per-document shard: :meth:`~cp_rope.parallel.placement.DocumentPlacement.work`. Zigzag:
    every sequence of padded length ``L`` gives every rank ``L / (2 C) * (L + 1)`` pairs
    (:mod:`cp_rope.parallel.placement`'s balance note), so the ranks are equal.
    """
    c = batch.cp_size
    if batch.placement is not None:
        return np.array([batch.placement.work(r) for r in range(c)], np.float64)
    lens = np.diff(batch.global_cu_seqlens.numpy().astype(np.int64))
    return np.full(c, float((lens // (2 * c) * (lens + 1)).sum()))


class StepStats:
    """Host counts per step for bits per byte and the CP balance, reduced at log steps.

    Args:
        token_bytes: int64 ``[vocab]`` bytes of text per id, or None (no bits per byte).
        cp_size: the CP degree (the balance is logged for ``cp_size > 1``).
        group: the dp x cp group the loss averages over (counts are summed over it).
        device: where the reduced counts live (the process group's device).
    """

    def __init__(self, token_bytes: np.ndarray | None, *, cp_size: int, group, device):
        self.token_bytes, self.cp, self.group, self.device = token_bytes, cp_size, group, device
        self._counts: list[tuple[int, int]] = []  # per step since the last log: tokens, bytes
        self._work = np.zeros(cp_size)
        self.bpb: dict[int, tuple[float, int]] = {}
        """Bits per byte of each log window, by its last step: ``(value, steps in it)``."""
        self.held_out: dict[int, float] = {}
        """Held-out bits per byte of each evaluated step (rank 0 fills it)."""

    def add(self, batch) -> None:
        """Count one step's host batch shard (labels ``< 0`` are not predicted)."""
        labels = batch.labels.numpy()
        real = labels[labels >= 0]
        n_bytes = int(self.token_bytes[real].sum()) if self.token_bytes is not None else 0
        self._counts.append((real.size, n_bytes))
        if self.cp > 1:
            self._work += cp_rank_work(batch)

    def fields(self, step: int, losses: dict[int, float]) -> dict:
        """``bpb``: bits per byte of the steps since the previous log (``losses[s]``, the group
        mean of step ``s``, times the group's labelled tokens is its NLL sum; over the bytes of
        those tokens); for CP, ``cp_work`` (each rank's attention pairs in those steps, this
        rank's group) and ``cp_balance`` (max / mean of them). All ranks call it together."""
        out, k = {}, len(self._counts)
        if self.token_bytes is not None and k:
            counts = torch.tensor(self._counts, dtype=torch.float64, device=self.device)
            if dist.is_initialized() and dist.get_world_size(self.group) > 1:
                dist.all_reduce(counts, group=self.group)
            loss = torch.tensor([losses[s] for s in range(step - k + 1, step + 1)],
                                dtype=torch.float64, device=self.device)
            value = bits_per_byte(float((loss * counts[:, 0]).sum()), float(counts[:, 1].sum()))
            out["bpb"] = value
            self.bpb[step] = (value, k)
        self._counts = []
        if self.cp > 1:
            out["cp_work"] = self._work.tolist()
            mean = self._work.mean()
            out["cp_balance"] = float(self._work.max() / mean) if mean > 0 else 1.0
            self._work[:] = 0
        return out

    def done_text(self) -> str:
        """The ``done:`` line's bits per byte (the first and last log windows; the last
        held-out evaluation)."""
        parts = []
        if self.bpb:
            (first, k1), (last, k2) = self.bpb[min(self.bpb)], self.bpb[max(self.bpb)]
            parts.append(f"; bits/byte {first:.3f} (first {k1} step{'s' * (k1 > 1)}) -> "
                         f"{last:.3f} (last {k2})")
        if self.held_out:
            step = max(self.held_out)
            parts.append(f"; held-out {self.held_out[step]:.3f} bits/byte (step {step})")
        return "".join(parts)


class RunDirError(RuntimeError):
    """The run directory failed under a running run (metrics.jsonl not appendable, the
    directory deleted); raised on every rank, printed as one ``error:`` line."""


def log_step(tr, loss: float, lr: float, grad_norm: float) -> None:
    """One metrics.jsonl line and one console line for the trainer ``tr``
    (:class:`cp_rope.launch.pretrain.Trainer`); all ranks call it: the throughput and the
    bits per byte all-reduce, and a held-out evaluation (``tr.held_out``) runs when due."""
    window = tr.throughput.window()
    tps, world = window["tokens_per_s"], tr.dims.world_size
    stats = tr.stats.fields(tr.step, tr.losses) if tr.stats is not None else {}
    metrics = {"loss": loss, **stats, "lr": lr, "grad_norm": grad_norm,
               "tokens_per_s": tps, "tokens_per_s_per_gpu": window["tokens_per_s_per_gpu"],
               "peak_mem_gib": peak_memory_gib(tr.device)}
    if "mfu" in window:
        metrics["mfu"] = window["mfu"]
    own = getattr(tr.model, "log_metrics", None)  # the model's own (finetune_hf: aux_loss)
    metrics.update(own() if own is not None else {})
    if tr.held_out is not None and tr.held_out.due(tr.step):
        t0 = time.perf_counter()
        metrics.update(tr.held_out.evaluate(tr.model))
        tr.throughput.exclude(time.perf_counter() - t0)
        if tr.stats is not None and "eval_bpb" in metrics:
            tr.stats.held_out[tr.step] = metrics["eval_bpb"]
    failed = [tr.log.log(tr.step, metrics)]  # rank 0 writes; every rank hears why it failed
    if world > 1:
        dist.broadcast_object_list(failed, src=0, group=tr.loss_group)
    if failed[0] is not None:
        raise RunDirError(f"step {tr.step}: {failed[0]}; stopping (checkpoints already written "
                          "are kept)")
    k = tr.stats.bpb[tr.step][1] if "bpb" in metrics else 0
    bpb = f" | {metrics['bpb']:.3f} bits/byte ({k} step{'s' * (k > 1)})" if k else ""
    held = (f" | held-out loss {metrics['eval_loss']:.4f}"
            + (f" ({metrics['eval_bpb']:.3f} bits/byte)" if "eval_bpb" in metrics else "")
            if "eval_loss" in metrics else "")
    aux = f" | aux loss {metrics['aux_loss']:.4f}" if "aux_loss" in metrics else ""
    tr.log.write(f"step {tr.step:>6}/{tr.cfg.train.steps} | loss {loss:.4f}{aux}{bpb}{held} | "
                 f"lr {lr:.2e} | grad norm {grad_norm:.3f} | "
                 f"{tps:,.0f} tok/s | {tps / world:,.0f} tok/s/{tr.device.type} | "
                 + (f"mfu {100 * metrics['mfu']:.1f}% | " if "mfu" in metrics else "")
                 + (f"cp balance {metrics['cp_balance']:.2f} | " if "cp_balance" in metrics else "")
                 + f"peak mem {metrics['peak_mem_gib']:.2f} GiB")


def _lines_up_to(path: str, lines: list[str], step: int) -> list[str]:
    """The records of ``metrics.jsonl`` (``lines`` of ``path``) logged at or before ``step``.

    A last line that is not a record (the process died while writing it) is
    dropped with a UserWarning: the documented repair. Any other line that is
    not a JSON object with an integer ``"step"`` raises ConfigError naming the
    file and the line (the file was edited or damaged; nothing is dropped silently).
    """
    kept = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not (isinstance(record, dict) and isinstance(record.get("step"), int)):
            if i == len(lines):
                warnings.warn(f"{path}: line {i} is truncated (the run stopped while writing it); "
                              "dropped", UserWarning, stacklevel=3)
                continue
            raise ConfigError(f"{path}: line {i} is not a metrics record (a JSON object with an "
                              "integer 'step'); repair or delete the file, or start a new run")
        if record["step"] <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept


class MetricsLogger:
    """Writes ``metrics.jsonl`` (one object per log step) and TensorBoard scalars; rank 0 only.

    Args:
        out_dir: run directory.
        enabled: False on ranks other than 0 (every method is then a no-op).
        resume_step: ``None`` for a fresh run (the metrics file is created;
            the caller has checked there is none to lose), else the step a
            resumed run continues after: lines of later steps (logged after
            that checkpoint) are dropped and the file is appended to; a
            truncated last line (a crash mid-write) is dropped with a warning.
        tensorboard: write TensorBoard events when ``tensorboard`` is importable.
        total_steps, start_step, progress: the tqdm bar (stderr; shown only when
            stderr is a terminal, since its carriage returns garble a log file).
    """

    def __init__(self, out_dir: str, *, enabled: bool, resume_step: int | None, tensorboard: bool,
                 total_steps: int, start_step: int, progress: bool):
        self.enabled, self._dir = enabled, out_dir
        self._file = self._tb = self._bar = None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "metrics.jsonl")
        if resume_step is not None and os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.readlines()
            kept = _lines_up_to(path, lines, resume_step)
            if kept != lines:
                with open(path, "w", encoding="utf-8") as f:
                    f.writelines(kept)
        self._file = open(path, "a" if resume_step is not None else "w")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                pass
            else:
                self._tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))
        if progress and sys.stderr.isatty():  # piped to a file: the log lines only, no \r bar
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="pretrain", unit="step",
                             dynamic_ncols=True, file=sys.stderr)

    def write(self, text: str) -> None:
        if self.enabled:
            (self._bar.write if self._bar is not None else print)(text)

    def advance(self, loss: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self._bar.update(1)

    def log(self, step: int, metrics: dict) -> str | None:
        """Append one line (rank 0). Returns None, or why it could not: the file cannot be
        appended (full disk, size limit, ...) or was deleted with the run directory."""
        if not self.enabled:
            return None
        path = os.path.join(self._dir, "metrics.jsonl")
        try:
            if os.fstat(self._file.fileno()).st_nlink == 0 or not os.path.isdir(self._dir):
                return (f"{path} was deleted while the run ran (--out-dir {self._dir!r} "
                        "removed or replaced?)")
            self._file.write(json.dumps({"step": step, **metrics}) + "\n")
            self._file.flush()
        except OSError as exc:
            return f"{path} cannot be appended ({exc.strerror or exc})"
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        for obj in (self._bar, self._tb, self._file):
            if obj is not None:
                try:
                    obj.close()
                except OSError:  # what log() could not write, flushed again: it said why
                    pass
        self._file = self._tb = self._bar = None
