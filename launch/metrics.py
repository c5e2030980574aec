"""Rank-0 logging of the pretraining loop: tqdm, a JSONL metrics file, TensorBoard when installed."""

from __future__ import annotations

import json
import os
import resource
import sys

import torch

__all__ = ["MetricsLogger", "peak_tflops", "peak_memory_gib"]

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


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process, GiB: CUDA allocated tensors on GPU, max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 2**20


class MetricsLogger:
    """Writes ``metrics.jsonl`` (one object per log step) and TensorBoard scalars; rank 0 only.

    Args:
        out_dir: run directory.
        enabled: False on ranks other than 0 (every method is then a no-op).
        resume_step: ``None`` for a fresh run (the metrics file is created;
            the caller has checked there is none to lose), else the step a
            resumed run continues after: lines of later steps (logged after
            that checkpoint) are dropped and the file is appended to.
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
            with open(path) as f:
                lines = f.readlines()
            kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= resume_step]
            if len(kept) != len(lines):
                with open(path, "w") as f:
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
