"""scripts/bench_memory.py: how a run's metrics.jsonl becomes its row (tokens over time of the
later half, time-weighted MFU, the peaks)."""
import json
import random

import pytest
from utils import script_module


def _write(tmp_path, rows):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_throughput_is_tokens_over_time(tmp_path):
    """Equal tokens per step: the later half's tokens/s is tokens over the summed step times
    (not the mean of the steps' rates) and its MFU each step's weighted by its time."""
    rng = random.Random()
    tokens = 262144
    secs = [rng.uniform(0.5, 3.0) for _ in range(6)]
    flops = [rng.uniform(1e14, 5e14) for _ in secs]
    peak = 1e15
    rows = [{"step": i + 1, "tokens_per_s": tokens / t, "mfu": f / t / peak,
             "peak_mem_gib": rng.uniform(10, 20)} for i, (t, f) in enumerate(zip(secs, flops, strict=True))]
    _write(tmp_path, rows)
    out = script_module("bench_memory")._read_metrics(str(tmp_path))
    timed = range(3, 6)  # steps 4-6: after half of the 6
    assert out["tokens_per_s"] == pytest.approx(3 * tokens / sum(secs[i] for i in timed), rel=1e-12)
    assert out["mfu"] == pytest.approx(sum(flops[i] for i in timed) / sum(secs[i] for i in timed)
                                       / peak, rel=1e-12)
    assert out["steps"] == 6
    assert out["peak_gib"] == max(r["peak_mem_gib"] for r in rows)
    assert out["later_peak_gib"] == max(r["peak_mem_gib"] for r in rows[1:])


def test_one_step_run(tmp_path):
    """A 1-step run: that step's rate, and no peak of later steps."""
    _write(tmp_path, [{"step": 1, "tokens_per_s": 1000.0, "peak_mem_gib": 3.0}])
    out = script_module("bench_memory")._read_metrics(str(tmp_path))
    assert out["tokens_per_s"] == pytest.approx(1000.0)
    assert "later_peak_gib" not in out and "mfu" not in out


def test_rates_without_a_time_are_left_out(tmp_path):
    """A timed step with a rate of 0 (or inf) has no time to add: left out, not a crash; with
    none left, the row has no tokens/s; a null MFU leaves MFU out."""
    rows = [{"step": 1, "tokens_per_s": 100.0, "peak_mem_gib": 1.0},
            {"step": 2, "tokens_per_s": 0.0, "peak_mem_gib": 1.0, "mfu": 0.1},
            {"step": 3, "tokens_per_s": 300.0, "peak_mem_gib": 1.0, "mfu": None}]
    _write(tmp_path, rows)
    out = script_module("bench_memory")._read_metrics(str(tmp_path))
    assert out["tokens_per_s"] == pytest.approx(300.0) and "mfu" not in out
    _write(tmp_path, rows[:2])
    out = script_module("bench_memory")._read_metrics(str(tmp_path))
    assert "tokens_per_s" not in out and out["steps"] == 2


def test_predictions_price_the_runs_loss_kernel(monkeypatch):
    """The planner's prediction for a row prices the loss the trainer ran: --loss-chunk-size
    for the torch loop, and the kernel --loss-impl resolves to here (liger where the trainer
    would pick it: a stand-in resolver says liger)."""
    bench = script_module("bench_memory")
    st = bench._settings(["--activation-checkpointing", "selective", "--loss-chunk-size", "512"])
    assert (st.activation_checkpointing, st.loss_chunk_size, st.loss_impl) == ("selective", 512,
                                                                               "torch")
    import cp_rope.parallel._loss_impl as impl

    monkeypatch.setattr(impl, "loss_impl", lambda name, hidden, chunk: "liger" if
                        name == "auto" and chunk is None else "torch")
    assert bench._settings([]).loss_impl == "liger"
    assert bench._settings(["--loss-impl", "torch"]).loss_impl == "torch"


def test_flags_replace_a_configs_value_or_are_added():
    """--flags: a flag the config has gets the new value (the A/B runs one setting changed),
    others are appended; something that is no flag is refused naming --flags."""
    merge = script_module("bench_memory").merge_flags
    base = ["--activation-checkpointing", "selective", "--offload-activations",
            "--mlp-tile-tokens", "16384"]
    assert merge(base, ["--mlp-tile-tokens", "32768"]) == [
        "--activation-checkpointing", "selective", "--offload-activations",
        "--mlp-tile-tokens", "32768"]
    assert merge(base, ["--no-fused-norm", "--loss-impl", "torch"]) == [
        *base, "--no-fused-norm", "--loss-impl", "torch"]
    assert merge([], ["--lr", "-1e-4"]) == ["--lr", "-1e-4"]
    assert merge(base, []) == base
    # one setting, given once: --no-x replaces --x, --x=value is --x value, a bare flag stays bare
    assert merge(base, ["--no-offload-activations", "--mlp-tile-tokens=32768"]) == [
        "--activation-checkpointing", "selective", "--mlp-tile-tokens", "32768",
        "--no-offload-activations"]
    assert merge(["--no-fused-norm"], ["--fused-norm"]) == ["--fused-norm"]
    bare = merge(base, ["--activation-checkpointing"])
    assert bare[:2] == ["--activation-checkpointing", "--offload-activations"]
    bench = script_module("bench_memory")
    st = bench._settings(bare)  # read as the trainer reads it: a bare flag is full
    assert (st.activation_checkpointing, st.offload_activations) == ("full", True)
    st = bench._settings(merge(base, ["--no-offload-activations", "--mlp-tile-tokens=32768"]))
    assert (st.offload_activations, st.mlp_tile_tokens) == (False, 32768)
    with pytest.raises(ValueError, match="--flags: '32768'"):
        merge(base, ["32768"])
