"""The cost model and method="auto": predictions against measured rows, deterministic picks,
bad input (auto with settings it cannot honour, foreign / unreadable calibration files), and
float64 parity (gloo, cp 1/2/3/4) of batches on which auto picks each method."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from attention_utils import naive_attention
from dist_utils import run_distributed

from cp_rope.parallel import calibrate as calib
from cp_rope.parallel import context_parallel_attention, shard_tensor, unshard
from cp_rope.parallel._choose import last_choice
from cp_rope.parallel.attention import attention_plan
from cp_rope.parallel.cost_model import Setting, choose, predict

H = dict(q_heads=32, kv_heads=8, head_dim=128)


def test_cp2_predictions_within_15_percent_of_two_h200_rows():
    # docs/benchmarks.md, "Multi-GPU: CP scaling on packed layouts at cp 2 (issue 16)"
    one, short = [0, 131072], [0, *range(2048, 131073, 2048)]
    for cu, setting, ms in ((one, Setting("zigzag", None, "ring"), 466.86),
                            (one, Setting("zigzag", None, "ulysses"), 474.72),
                            (short, Setting("zigzag", None, "allgather"), 24.69),
                            (short, Setting("per_document", 16384, "ring"), 9.41)):
        got = predict(cu, setting, cp_size=2, **H)
        assert abs(got / ms - 1) <= 0.15, (setting, got, ms)


def test_choose_is_deterministic_and_follows_the_layout():
    short = [0, *range(256, 131073, 256)]
    a = choose(short, cp_size=4, **H)
    assert a == choose(short, cp_size=4, **H)
    assert a.placement == "per_document"  # 512 x 256: documents whole (bound 0.10 zigzag)
    assert [ms for ms, _ in a.ranking] == sorted(ms for ms, _ in a.ranking)
    long = choose([0, 131072], cp_size=8, **H)
    assert long.placement == "zigzag" and long.method in ("ring", "ulysses", "hybrid")
    assert "auto:" in a.summary()


def test_auto_refuses_settings_it_cannot_honour():
    with pytest.raises(ValueError, match="q heads"):  # U = 3 does not divide 32 heads
        choose([0, 1536], cp_size=6, method="auto", ulysses_size=3, **H)
    with pytest.raises(ValueError, match="placement='zigzag'"):
        choose([0, 6], cp_size=2, placement="zigzag", **H)  # 6 % 4 != 0


def test_calibration_files(tmp_path):
    cal = calib.default_calibration("cpu")
    path = str(tmp_path / "cal.json")
    calib.save_calibration(cal, path)
    got = calib.load_calibration(path, "cpu")
    assert got.tflops == cal.tflops and got.p2p_gbps == cal.p2p_gbps
    other = dict(json.load(open(path)), device_name="NVIDIA B200")
    json.dump(other, open(path, "w"))
    with pytest.raises(calib.CalibrationError, match=r"cal\.json.*'NVIDIA B200'"):
        calib.load_calibration(path, "cpu")
    json.dump(dict(other, device_name="cpu", torch_version="1.0"), open(path, "w"))
    with pytest.raises(calib.CalibrationError, match="torch 1.0"):
        calib.load_calibration(path, "cpu")
    open(path, "w").write("{not json")
    with pytest.raises(calib.CalibrationError, match=r"cal\.json.*cannot read"):
        calib.load_calibration(path, "cpu")
    with pytest.raises(calib.CalibrationError, match="missing.json"):
        calib.load_calibration(str(tmp_path / "missing.json"))
    json.dump(dict(cal.to_dict(), p2p_gbps=-1), open(path, "w"))
    with pytest.raises(calib.CalibrationError, match="invalid p2p_gbps"):
        calib.load_calibration(path, "cpu")


@pytest.mark.parametrize("key,value,match", [
    ("p2p_gbps", True, r"p2p_gbps must be a number, got bool True"),
    ("call_us", "3.5", r"call_us must be a number, got str '3\.5'"),
    ("tile", True, r"missing tile \(an int >= 1\)"),
    ("block_keys", [1.0, False], r"block_keys\[\] must be a number, got bool False"),
    ("crossover", {"64": True}, r"crossover\[64\] must be an int, got bool True"),
    ("crossover", {"64": 8.5}, r"crossover\[64\] must be an int, got float 8\.5"),
])
def test_calibration_json_booleans_and_strings_are_not_numbers(tmp_path, key, value, match):
    """Issue 35: JSON's true was read as 1 (float(True)), "3.5" as 3.5."""
    path = str(tmp_path / "cal.json")
    raw = calib.default_calibration("cpu").to_dict()
    if key == "block_keys":
        value = [*raw["block_keys"][:-1], False]
    json.dump(dict(raw, **{key: value}), open(path, "w"))
    with pytest.raises(calib.CalibrationError, match=match):
        calib.load_calibration(path, "cpu")


@pytest.mark.parametrize("kw,exc,match", [
    ({"backend": "cuddn"}, ValueError, r"backend='cuddn': expected one of \['auto', 'cudnn'"),
    ({"calibration": {"p2p_gbps": 1.0}}, TypeError, r"calibration must be a Calibration .*got dict"),
    ({"q_heads": 6, "kv_heads": 4}, ValueError, r"q_heads=6: must be a multiple of kv_heads=4"),
])
def test_choose_and_predict_refuse_what_the_plan_would(kw, exc, match):
    """Issue 35: a misspelled backend priced as cuDNN, a dict calibration ignored (the defaults
    used), heads the plan refuses given a choice."""
    args = dict(cp_size=2, **{**H, **{k: v for k, v in kw.items() if k in H}})
    other = {k: v for k, v in kw.items() if k not in H}
    with pytest.raises(exc, match=match):
        choose([0, 64, 128], **args, **other)
    with pytest.raises(exc, match=match):
        predict([0, 64, 128], Setting("zigzag", None, "ring"), **args, **other)


def test_measure_on_cpu_writes_a_loadable_file(tmp_path):
    cal = calib.measure("cpu", tokens=64, heads=2, kv_heads=1, head_dim=16, iters=1)
    path = str(tmp_path / "m.json")
    calib.save_calibration(cal, path)
    assert calib.load_calibration(path, "cpu").device_name == "cpu"


# calibrations that steer auto to each method (the batch decides among what the links allow)
_SLOW = 1e-3


def _steer(method):
    base = calib.default_calibration()
    if method == "ring":
        return dataclasses.replace(base, a2a_gbps=_SLOW, collective_gbps=_SLOW)
    if method == "allgather":
        return dataclasses.replace(base, a2a_gbps=_SLOW, p2p_gbps=_SLOW)
    if method == "ulysses":
        return dataclasses.replace(base, p2p_gbps=_SLOW, collective_gbps=_SLOW)
    # hybrid: nodes of 2 GPUs with fast all-to-all inside, slow links between them
    return dataclasses.replace(base, node_size=2, internode_gbps=0.01, a2a_gbps=100.0)


def _parity_body(rank, world):
    group = dist.group.WORLD if world > 1 else None
    lens = [2 * world * n for n in (1, 5, 3, 8)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    methods = ["ring", "allgather"] + (["ulysses"] if world > 1 else []) + \
        (["hybrid"] if world == 4 else [])
    for method in methods:
        # MHA (heads split over 2, 3, 4 ranks); GQA for hybrid, whose ring then moves fewer
        # bytes across the slow links than Ulysses' all-to-all
        hq, hkv, d = (12, 2, 8) if method == "hybrid" else (12, 12, 8)
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(int(cu[-1]), h, d, generator=gen, dtype=torch.float64)
                   for h in (hq, hkv, hkv))
        ref = naive_attention(q, k, v, cu, True, d ** -0.5)
        calib.use_calibration(_steer(method))
        try:
            local_cu = cu // world
            plan = attention_plan(local_cu, int(max(lens)) // world, q_heads=hq, kv_heads=hkv,
                                  head_dim=d, dtype=torch.float64, device="cpu", group=group,
                                  method="auto", backend="reference")
        finally:
            calib.use_calibration(None)
        want = method if world > 1 else "ring"
        assert plan.method == want, (world, method, plan.method, last_choice().summary())
        ql, kl, vl = (shard_tensor(t, cu, world, rank) for t in (q, k, v))
        out = context_parallel_attention(ql, kl, vl, plan=plan)
        got = unshard(out, local_cu, group) if world > 1 else out
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_auto_float64_parity_for_each_method(world):
    if world == 1:
        _parity_body(0, 1)
    else:
        run_distributed(_parity_body, world)


def test_trainer_refuses_a_foreign_calibration_file_naming_it(tmp_path):
    from cp_rope.launch.cli import parse_args
    from cp_rope.launch.config import ConfigError
    from cp_rope.launch.cp_startup import cp_start_up

    path = str(tmp_path / "h100.json")
    calib.save_calibration(calib.default_calibration("NVIDIA H100"), path)
    cfg = parse_args(["--cp-calibration", path, "--cp-self-test", "off"])
    assert cfg.parallel.cp_calibration == path and cfg.parallel.cp_self_test == "off"
    with pytest.raises(ConfigError, match=r"parallel\.cp_calibration.*h100\.json.*NVIDIA H100"):
        cp_start_up(cfg, None, 1, torch.device("cpu"), torch.float32, print)


def _auto_placement_body(rank, world):
    from cp_rope.parallel import PackingCollator, attention_plan
    from cp_rope.parallel.cost_model import AutoPlacement

    group = dist.group.WORLD
    fast = dataclasses.replace(calib.default_calibration(), call_us=0.0, seg_ns=0.0,
                               merge_bytes_per_row=0.0, p2p_gbps=1e6)
    gen = torch.Generator().manual_seed(1)
    table = [torch.randn(4200, h, 16, generator=gen, dtype=torch.float64) for h in (4, 2, 2)]
    for docs, cal, want in (([9, 1, 30, 7, 12, 5, 64], None, "per_document"),
                            ([1000], fast, "zigzag")):
        examples = [{"input_ids": torch.arange(1, n + 1) + 100 * i} for i, n in enumerate(docs)]
        calib.use_calibration(cal)
        try:
            auto = AutoPlacement(PackingCollator(cp_size=world, cp_rank=rank), q_heads=4,
                                 kv_heads=2, head_dim=16, dtype=torch.float64, backend="reference")
            local = auto(examples)
            assert auto.last_choice.placement == want, auto.last_choice.summary()
            plan = attention_plan(local, q_heads=4, kv_heads=2, head_dim=16, dtype=torch.float64,
                                  group=group, method="auto", backend="reference")
        finally:
            calib.use_calibration(None)
        q, k, v = (t[local.input_ids] for t in table)
        out = context_parallel_attention(q, k, v, plan=plan)
        got = unshard(out, local.cu_seqlens, group, placement=local.placement)
        glob = auto.collator.pack(examples)
        q, k, v = (t[glob.input_ids] for t in table)
        ref = naive_attention(q, k, v, glob.cu_seqlens, True, q.shape[-1] ** -0.5)
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)


def test_auto_placement_per_batch_float64_parity():
    run_distributed(_auto_placement_body, 2)


# ------------------------------------------------------------------ auto at cp 1 and the calibrate command line (round 3)

def test_auto_at_cp_1_runs_what_the_methods_run():
    """At cp 1 nothing is split: auto takes any lengths and either layout, as ring does."""
    from cp_rope.parallel import attention_plan, place_documents
    kw = dict(q_heads=4, kv_heads=2, head_dim=8, dtype=torch.float32)
    odd = torch.tensor([0, 5, 12], dtype=torch.int32)
    assert attention_plan(odd, 7, method="ring", **kw).method == "ring"
    assert attention_plan(odd, 7, method="auto", **kw).method == "ring"
    assert attention_plan(odd, 7, placement="auto", **kw).kind == "zigzag"
    placed = place_documents(torch.tensor([0, 6, 14, 22], dtype=torch.int32), 1, 6)
    assert attention_plan(placed, method="auto", **kw).kind == "per_document"


def test_calibrate_in_one_process_marks_the_links_not_measured(tmp_path, capsys):
    """Round 4 #21: before, one process printed the shipped link bandwidths beside the measured
    numbers, the file said source 'measured (reference)', and small rates read '0 TFLOP/s'."""
    from cp_rope.parallel.calibrate import LINKS_NOT_MEASURED
    from cp_rope.parallel.calibrate import main as calibrate
    out = tmp_path / "c.json"
    assert calibrate(["--out", str(out), "--tokens", "64", "--iters", "1"]) == 0
    line = capsys.readouterr().out
    assert f"all-to-all 154 GB/s -- {LINKS_NOT_MEASURED}" in line, line
    assert " 0 TFLOP/s" not in line and " HBM 0 GB/s" not in line, line
    cal = calib.load_calibration(str(out))
    assert json.load(open(out))["source"].startswith(f"measured (reference); {LINKS_NOT_MEASURED}")
    assert cal.p2p_gbps == calib.default_calibration().p2p_gbps


@pytest.mark.parametrize("flags,match", [
    (["--tokens", "0"], r"--tokens must be >= 2"),
    (["--iters", "0"], r"--iters must be >= 1"),
    (["--iters", "-1"], r"--iters must be >= 1"),
    (["--backend", "flsh"], r"--backend: 'flsh' is not one of"),
    (["--out", "/nonexistent/dir/c.json"], r"--out: cannot write .*/nonexistent/dir"),
])
def test_calibrate_flags(tmp_path, capsys, flags, match):
    from cp_rope.parallel.calibrate import main as calibrate
    with pytest.raises(SystemExit) as exc:
        calibrate(["--out", str(tmp_path / "c.json"), *flags])
    assert exc.value.code == 2
    assert __import__("re").search(match, capsys.readouterr().err)
    assert not (tmp_path / "c.json").exists()
