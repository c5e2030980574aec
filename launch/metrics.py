"""What the pretraining loop measures and where it goes.

* throughput and MFU arithmetic: :func:`flops_per_step`, :func:`peak_tflops`,
  :class:`Throughput` (tokens/s per log window and for the whole run);
* :func:`peak_memory_gib`;
* :class:`MetricsLogger`: rank-0 logging (tqdm, a JSONL metrics file, TensorBoard when installed).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import warnings

import torch
import torch.distributed as dist

from .config import ConfigError, ModelConfig

__all__ = ["MetricsLogger", "Throughput", "flops_per_step", "peak_tflops", "peak_memory_gib"]

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
    attn = 6.0 * sum_sq_seqlens * cfg.n_heads * (cfg.dim // cfg.n_heads) * cfg.n_layers
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
        sums = self._window.to(self.device)
        if self.world > 1:
            dist.all_reduce(sums)  # global tokens and attention work since the last log
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
        self.enabled = enabled
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

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        for obj in (self._bar, self._tb, self._file):
            if obj is not None:
                obj.close()
        self._file = self._tb = self._bar = None
