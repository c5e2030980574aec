"""scripts/profile_trainer.py: the GPU idle time's attribution to host phases (fake events) and
the script's CPU plumbing (a tiny finetune_hf run under torch.profiler)."""

from __future__ import annotations

import pytest
from torch.autograd import DeviceType
from utils import script_module


def _script():
    return script_module("profile_trainer")


class _Event:
    def __init__(self, name, start_ms, end_ms, gpu=False):
        self._name, self._s, self._d = name, int(start_ms * 1e6), int((end_ms - start_ms) * 1e6)
        self._dev = DeviceType.CUDA if gpu else DeviceType.CPU

    def name(self):
        return self._name

    def start_ns(self):
        return self._s

    def duration_ns(self):
        return self._d

    def device_type(self):
        return self._dev


def test_idle_time_goes_to_the_innermost_host_phase():
    """Two 10 ms steps: the GPU runs 2-6 and 7-9 of each; its idle 0-2 falls in train_step
    (the forward), 6-7 in the backward nested in it, 9-10 in the plan; the host read's sync
    is counted where it ran."""
    ev = []
    for t in (0, 10):
        ev += [_Event("phase:train_step", t, t + 8), _Event("phase:backward", t + 5, t + 8),
               _Event("phase:plan", t + 8.5, t + 10), _Event("k", t + 2, t + 6, gpu=True),
               _Event("k", t + 7, t + 9, gpu=True),
               _Event("cudaStreamSynchronize", t + 9.2, t + 9.4)]
    ev.append(_Event("phase:train_step", 20, 20))  # the window's closing mark
    got = _script().analyse(ev, 2)
    assert got["wall_ms"] == 10 and got["gpu_busy_ms"] == 6 and got["gpu_idle_ms"] == 4
    assert got["gpu_idle_ms_by_host_phase"] == {"forward (train_step outside backward)": 2.0,
                                                 "backward": 1.0, "plan": 1.0}
    assert got["syncs_per_step"] == {"cudaStreamSynchronize in plan": {"count": 1, "ms": 0.2}}
    with pytest.raises(RuntimeError, match="recorded 2 train_step calls, need 3"):
        _script().analyse(ev[:-1], 2)


def test_tiny_run_reports_every_phase(tmp_path, monkeypatch, capsys):
    """--tiny (bench_memory's smoke shapes, CPU; 2,048 tokens a step unless --tokens): one JSON
    result whose host phases include the loop's own marks, --launchers saying that a CPU has no
    kernels, and the option checks."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    mod = _script()
    out = mod.main(["--tiny", "--steps", "3", "--first", "2", "--record", "1", "--launchers", "mm"])
    assert out["tokens"] == 2048
    assert out["device"] == "cpu" and out["wall_ms"] > 0 and out["gpu_busy_ms"] == 0
    assert "--launchers on a machine without a GPU" in capsys.readouterr().out
    phases = set(out["gpu_idle_ms_by_host_phase"])
    assert {"backward", "forward (train_step outside backward)", "plan", "next_batch",
            "clip_gradients", "log_step", "Optimizer.step"} <= phases, phases
    with pytest.raises(SystemExit):
        mod.main(["--tiny", "--steps", "3", "--first", "3", "--record", "1"])


class _Kernel:
    def __init__(self, name, us):
        self.name, self.duration = name, us


class _Op:
    def __init__(self, name, kernels=(), parent=None, shapes=()):
        self.name, self.kernels = name, list(kernels)
        self.cpu_parent, self.input_shapes = parent, list(shapes)


def test_launchers_group_matching_kernels_by_op_shape_and_origin():
    """--launchers: each matching kernel counted once at its op, grouped by op, shapes and
    origin (the enclosing non-ATen ops; in backward, the autograd node), per step."""
    import re

    node = _Op("autograd::engine::evaluate_function: TransposeBackward0")
    fwd = _Op("aten::contiguous", parent=_Op("cp_rope::attn", parent=_Op("phase:train_step")))
    ev = [_Op("aten::copy_", [_Kernel("elementwise_kernel<128, 4>", 1000)] * 2, parent=fwd,
              shapes=[[4, 8]]),
          _Op("aten::copy_", [_Kernel("elementwise_kernel<128, 4>", 3000)], parent=node,
              shapes=[[4, 8]]),
          _Op("aten::mm", [_Kernel("nvjet_gemm", 5000)], parent=node)]
    got = _script().launchers(ev, re.compile(r"^elementwise_kernel<128"), 2)
    assert got == [
        {"op": "aten::copy_", "shapes": "[[4, 8]]", "origin": "TransposeBackward0",
         "launches_per_step": 0.5, "gpu_ms_per_step": 1.5},
        {"op": "aten::copy_", "shapes": "[[4, 8]]", "origin": "cp_rope::attn < phase:train_step",
         "launches_per_step": 1.0, "gpu_ms_per_step": 1.0}]
    assert _script().launchers(ev, re.compile("nothing"), 2) == []
    with pytest.raises(SystemExit):  # a bad regex fails at parse time, before the run
        _script().main(["--tiny", "--launchers", "("])
