"""The CP cost model's constants (:class:`Calibration`): shipped H200 defaults and the JSON file
format. A calibration travels explicitly (``attention_plan(..., calibration=)``, stored on the
plan as ``plan.calibration``; ``cost_model.choose(calibration=)``; ``AutoPlacement(calibration=)``):
no module keeps one for the process. Measured by ``python -m
cp_rope.parallel.calibrate`` (:mod:`cp_rope.parallel.calibrate`, which re-exports this API);
see that module for the units."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import numpy as np
import torch

from . import _compat
from .choices import BACKENDS

__all__ = ["Calibration", "CalibrationError", "CalibrationSig", "calibration_or_default",
           "calibration_signature", "default_calibration", "load_calibration",
           "save_calibration"]

FORMAT = 1
_OPTIONAL = ("source", "crossover", "fa4_version")
"""Fields a file may lack (files written before FA4: no crossover, auto keeps to cuDNN)."""


class CalibrationError(ValueError):
    """A calibration file that cannot be used (unreadable, malformed, another machine)."""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The cost model's constants (see the module docstring for units)."""

    device_name: str
    torch_version: str
    block_keys: tuple[float, ...]
    tflops: dict  # backend -> tuple of TFLOP/s at block_keys
    call_us: float
    merge_bytes_per_row: float
    hbm_gbps: float
    p2p_gbps: float
    a2a_gbps: float
    collective_gbps: float
    latency_us: float
    seg_ns: float = 0.0
    tile: int = 128
    node_size: int = 8
    internode_gbps: float = 50.0
    source: str = ""
    crossover: dict = dataclasses.field(default_factory=dict)
    """head_dim -> query rows: under ``backend="auto"`` a segment with at least this many query
    rows runs on FA4, a shorter one on cuDNN (:meth:`crossover_at`; measured by ``python -m
    cp_rope.parallel.calibrate`` for each head_dim it times; empty: auto never uses FA4)."""
    fa4_version: str = ""
    """flash-attn-4's version when the kernel tables were measured ("" if it was absent); a file
    measured with another version than this process's is refused."""

    def crossover_at(self, head_dim: int) -> int | None:
        """The crossover (query rows, see :attr:`crossover`) for ``head_dim``: the entry of the
        nearest calibrated head_dim (by ratio; a tie goes to the smaller), None when the table
        is empty."""
        if not self.crossover:
            return None
        near = min(self.crossover, key=lambda d: (abs(math.log(int(d) / head_dim)), int(d)))
        return int(self.crossover[near])

    def tflops_at(self, backend: str, keys: np.ndarray) -> np.ndarray:
        """TFLOP/s of ``backend`` at ``keys`` per query row (log-linear interpolation, clamped
        at the table's ends; an unknown backend uses ``cudnn``'s table, else the first)."""
        table = (self.tflops.get(backend) or self.tflops.get("cudnn")
                 or next(iter(self.tflops.values())))
        x = np.log(np.asarray(self.block_keys, dtype=np.float64))
        return np.interp(np.log(np.maximum(keys, 1e-9)), x, np.asarray(table, dtype=np.float64))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["format"] = FORMAT
        d["block_keys"] = list(self.block_keys)
        d["tflops"] = {k: list(v) for k, v in self.tflops.items()}
        d["crossover"] = {str(k): int(v) for k, v in self.crossover.items()}
        return d


def _table(peak: float, half: float, keys) -> tuple[float, ...]:
    """``peak x s / (s + half)`` at each ``s`` (TFLOP/s), rounded to 0.1."""
    return tuple(round(peak * s / (s + half), 1) for s in keys)


# H200 constants, fitted by scripts/validate_cost_model.py --fit to the one-H200 rows (cp 1
# and --simulate-cp) and the two-H200 cp 2 rows of docs/benchmarks.md (torch 2.11, cuDNN
# frontend 1.32): TFLOP/s at 16 / 128 / 1024 / 8192 / 65536 keys per query row.
# fa4: cuDNN's table times cuDNN / FA4 time, fwd + bwd, measured side by side on one H200
# (scripts/bench_cp_attention.py, 32 / 8 heads, flash-attn-4 4.0.0b36, nvidia-cutlass-dsl
# 4.8.1, cuDNN 9.19, docs/benchmarks.md "FlashAttention-4"), d 64 and 128 averaged: 0.78 at
# 128 keys per row (512 x 256 tokens), 1.06 at 1024 (64 x 2048), 1.19 from 8192 (long
# documents). The crossover: FA4 from 1024 query rows (cuDNN faster at 256 rows by 1.26x /
# 1.29x at d 64 / 128; FA4 faster at 1536 and 2048).
_H200 = dict(
    block_keys=(16.0, 128.0, 1024.0, 8192.0, 65536.0),
    tflops={"cudnn": (243.7, 203.4, 503.6, 503.6, 546.3),
            "fa4": (190.1, 158.7, 533.8, 599.3, 650.1),
            "torch_flash": (31.3, 150.1, 285.2, 321.4, 326.6)},
    crossover={64: 1024, 128: 1024}, fa4_version="4.0.0b36",
    call_us=855.3, merge_bytes_per_row=41.27, hbm_gbps=4000.0, p2p_gbps=221.9, a2a_gbps=154.5,
    collective_gbps=88.1, latency_us=0.0, seg_ns=3.21, tile=128)


def default_calibration(device_name: str | None = None) -> Calibration:
    """The shipped constants: H200 numbers from ``docs/benchmarks.md`` (used for any device
    without a calibration file; ``source`` says so)."""
    name = device_name or "NVIDIA H200"
    src = "shipped H200 defaults (docs/benchmarks.md)"
    if "H200" not in name:
        src += f"; not calibrated for {name!r}: run python -m cp_rope.parallel.calibrate"
    return Calibration(device_name=name, torch_version=torch.__version__, source=src, **_H200)


def calibration_or_default(cal: Calibration | None) -> Calibration:
    """``cal``, or :func:`default_calibration` for None: the constants a plan, a chooser or a
    block backend runs with. There is no process-wide calibration: whoever builds the plan
    passes it (``attention_plan(..., calibration=)``; the trainers load ``--cp-calibration``).

    Raises: TypeError for anything but a :class:`Calibration` or None (a dict is not read:
    :func:`load_calibration` reads a JSON file).
    """
    if cal is None:
        return default_calibration()
    if not isinstance(cal, Calibration):
        raise TypeError(f"calibration must be a Calibration (cp_rope.parallel.calibrate."
                        f"load_calibration(path) reads a JSON file) or None, got "
                        f"{type(cal).__name__}")
    return cal


@dataclasses.dataclass(frozen=True)
class CalibrationSig:
    """What identifies a calibration in the ranks' agreement (:func:`calibration_signature`):
    equal when the constants are (``digest``); ``source`` only names it in a message (the
    same file at another path per node is the same calibration)."""

    digest: str
    source: str = dataclasses.field(default="", compare=False)

    def __str__(self) -> str:
        return f"#{self.digest} ({self.source or 'no source'})"


_NOT_CONSTANTS = ("source", "device_name", "torch_version", "fa4_version")
"""Fields a prediction does not read: left out of :func:`calibration_signature`'s digest."""


def calibration_signature(cal: Calibration) -> CalibrationSig:
    """``cal``'s signature for the ranks' agreement: a short SHA-256 of the constants the
    cost model reads (every field but :data:`_NOT_CONSTANTS`) and its ``source``. Ranks whose
    auto choice ran on different constants show ``calibration=#digest (source)`` each."""
    d = {k: v for k, v in cal.to_dict().items() if k not in _NOT_CONSTANTS}
    text = json.dumps(d, sort_keys=True, default=repr)
    return CalibrationSig(hashlib.sha256(text.encode()).hexdigest()[:12], cal.source)


def _device_name(device: torch.device | str | None) -> str:
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def save_calibration(cal: Calibration, path: str) -> None:
    """Write ``cal`` as JSON to ``path``."""
    with open(path, "w") as f:
        json.dump(cal.to_dict(), f, indent=1)


def _number(value, where: str, kind: type = float):
    """A JSON number as ``kind``; TypeError naming ``where`` for a boolean (JSON's true is
    no 1), a string or anything else (``int`` also refuses a fraction)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            kind is int and not isinstance(value, int)):
        raise TypeError(f"{where} must be {'an int' if kind is int else 'a number'}, got "
                        f"{type(value).__name__} {value!r}")
    return kind(value)


def load_calibration(path: str, device: torch.device | str | None = None, *,
                     check_machine: bool = True) -> Calibration:
    """Read a calibration JSON written by :func:`save_calibration` / ``python -m
    cp_rope.parallel.calibrate``.

    Args:
        path: the file.
        device: the device the run uses (default: the current CUDA device, else cpu); its
            name must be the file's ``device_name``.
        check_machine: also require the file's torch version to be this process's.

    Raises: CalibrationError (a ValueError) naming ``path``: unreadable, not JSON, another
    format, missing or invalid fields (non-finite or negative numbers, a gbps of 0, a number
    <= 0 in a table: ``block_keys``, ``tflops``, ``crossover``; tables of the wrong length,
    keys not increasing), or measured on another device / torch version.
    """
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"calibration file {path!r}: cannot read it ({exc})") from exc
    fmt = raw.get("format") if isinstance(raw, dict) else None
    if isinstance(fmt, bool) or fmt != FORMAT:  # true == 1 in Python: refused as every number
        raise CalibrationError(f"calibration file {path!r}: not a cp_rope calibration (format "
                               f"{FORMAT}); write one with python -m cp_rope.parallel.calibrate")
    fields = [f.name for f in dataclasses.fields(Calibration)]
    missing = [k for k in fields if k not in raw and k not in _OPTIONAL]
    for key in ("tile", "node_size"):
        if key not in missing and not (isinstance(raw[key], int) and raw[key] >= 1
                                       and not isinstance(raw[key], bool)):
            missing.append(f"{key} (an int >= 1)")
    if missing:
        raise CalibrationError(f"calibration file {path!r}: missing {', '.join(missing)}")
    try:
        keys = tuple(_number(x, "block_keys[]") for x in raw["block_keys"])
        tflops = {str(k): tuple(_number(x, f"tflops[{k}][]") for x in v)
                  for k, v in raw["tflops"].items()}
        nums = {k: _number(raw[k], k) for k in ("call_us", "merge_bytes_per_row", "hbm_gbps",
                                                 "p2p_gbps", "a2a_gbps", "collective_gbps",
                                                 "latency_us", "seg_ns", "internode_gbps")}
        tile, node_size = int(raw["tile"]), int(raw["node_size"])
        crossover = {int(k): _number(v, f"crossover[{k}]", int)
                     for k, v in raw.get("crossover", {}).items()}
        fa4_version = str(raw.get("fa4_version", ""))
    except (TypeError, ValueError, AttributeError) as exc:
        raise CalibrationError(f"calibration file {path!r}: malformed ({exc})") from exc
    bad = [k for k, v in nums.items() if not math.isfinite(v) or v < 0
           or (v == 0 and k.endswith("gbps"))]
    # every number of a table > 0 and finite: a key <= 0 is log(0) = -inf or NaN in tflops_at
    bad += [f"tflops[{k}] (a number > 0 at each of the {len(keys)} block_keys)"
            for k, v in tflops.items()
            if len(v) != len(keys) or not all(math.isfinite(x) and x > 0 for x in v)]
    if not tflops:
        bad.append("tflops (no table)")
    # a misspelled name would leave every backend on the fallback table (tflops_at)
    bad += [f"tflops[{k}] (a table of a backend: one of {', '.join(BACKENDS)})"
            for k in tflops if k not in BACKENDS]
    if not keys or not all(math.isfinite(x) and x > 0 for x in keys) or any(
            b <= a for a, b in zip(keys, keys[1:], strict=False)):
        bad.append(f"block_keys={list(keys)} (finite numbers > 0, increasing)")
    bad += [f"crossover[{k}]={v} (an int >= 1 per head_dim >= 1)"
            for k, v in crossover.items() if k < 1 or v < 1]
    if bad:
        raise CalibrationError(f"calibration file {path!r}: invalid {', '.join(bad)}")
    if check_machine:
        here = _device_name(device)
        if raw["device_name"] != here or raw["torch_version"] != torch.__version__:
            raise CalibrationError(
                f"calibration file {path!r}: measured on {raw['device_name']!r} with torch "
                f"{raw['torch_version']}, this run uses {here!r} with torch {torch.__version__}; "
                f"calibrate here (python -m cp_rope.parallel.calibrate --out {path})")
        here_fa4 = _compat.fa4_version()
        if crossover and here_fa4 is not None and fa4_version != here_fa4:
            raise CalibrationError(
                f"calibration file {path!r}: its FA4 / cuDNN crossover table was measured with "
                f"flash-attn-4 {fa4_version or '(none)'}, this process has {here_fa4}; "
                f"calibrate here (python -m cp_rope.parallel.calibrate --out {path})")
    return Calibration(device_name=str(raw["device_name"]), torch_version=str(raw["torch_version"]),
                       block_keys=keys, tflops=tflops, tile=tile, node_size=node_size,
                       crossover=crossover, fa4_version=fa4_version,
                       source=f"file {path}", **nums)
