"""Issue 30: the auto decision travels with the data (one list of methods for the start-up
self-test; the choice and the calibration on the plan, no module-level state)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from cp_rope.parallel.choices import METHODS
from cp_rope.parallel.cost_model import candidate_methods, candidate_settings


def test_candidate_methods_cover_the_one_list_in_the_chooser_s_order():
    got = candidate_methods(4, 8, 4)
    assert {m for m, _ in got} == set(METHODS)
    assert got == [("ring", None), ("allgather", None), ("hybrid", 2), ("ulysses", None)]
    cands = candidate_settings([0, 64], cp_size=4, q_heads=8, kv_heads=4, head_dim=8,
                               placement="zigzag")
    assert [(s.method, s.ulysses_size) for s in cands] == got
    assert candidate_methods(4, 8, 4, ulysses_size=2) == got[:3]
    assert candidate_methods(1, 8, 4) == [("ring", None), ("allgather", None)]
    with pytest.raises(ValueError, match="q heads"):
        candidate_methods(6, 32, 8, ulysses_size=3)


def test_start_up_self_test_runs_every_method_auto_may_pick(monkeypatch):
    from cp_rope.launch import cp_startup
    from cp_rope.launch.cli import parse_args

    ran, lines = [], []

    def fake_self_test(group, **kw):
        ran.append((kw["method"], kw["ulysses_size"], kw["placement"]))
        return types.SimpleNamespace(errors={"out": 0.0})

    monkeypatch.setattr(cp_startup, "self_test", fake_self_test)
    cfg = parse_args(["--cp-method", "auto", "--cp-size", "4", "--dim", "128", "--n-heads", "8",
                      "--n-kv-heads", "4"])
    cp_startup.cp_start_up(cfg, object(), 4, torch.device("cpu"), torch.float32, lines.append)
    assert {m for m, _, _ in ran} == set(METHODS)  # hybrid included
    assert ("hybrid", 2, "zigzag") in ran and ("ulysses", None, "zigzag") in ran
    assert "hybrid(U=2)" in lines[-1]


# ------------------------------------------------------------------ the decision on the plan

def test_no_module_keeps_the_decision_or_the_calibration():
    from cp_rope.parallel import _calibration, _choose, calibrate, cost_model

    for module, names in ((_choose, ("_last", "last_choice")),
                          (_calibration, ("_ACTIVE", "use_calibration", "active_calibration")),
                          (calibrate, ("use_calibration", "active_calibration"))):
        assert not [n for n in names if hasattr(module, n)], module.__name__
    for module in (_choose, _calibration, cost_model):  # no mutable module-level state
        state = [n for n, v in vars(module).items() if isinstance(v, (dict, list, set))
                 and not n.startswith("__") and n not in ("_H200", "_ELEM")]
        assert not state, (module.__name__, state)


def _steer_allgather():
    import dataclasses

    from cp_rope.parallel.calibrate import default_calibration

    return dataclasses.replace(default_calibration(), a2a_gbps=1e-3, p2p_gbps=1e-3)


def test_plan_carries_the_choice_of_a_batch_placed_by_auto(monkeypatch):
    from cp_rope.parallel import PackingCollator, attention, attention_plan
    from cp_rope.parallel.cost_model import AutoPlacement, choose

    cal = _steer_allgather()
    auto = AutoPlacement(PackingCollator(cp_size=1, cp_rank=0), q_heads=4, kv_heads=2,
                         head_dim=8, dtype=torch.float32, backend="reference", calibration=cal)
    examples = [{"input_ids": torch.arange(1, n + 1)} for n in (5, 9, 2)]
    local = auto(examples)
    assert local.choice == choose(auto.collator.pack(examples).cu_seqlens, cp_size=1, q_heads=4,
                                  kv_heads=2, head_dim=8, dtype=torch.float32,
                                  backend="reference", calibration=cal)
    assert local.choice.source == cal.source and local.choice.backend == "reference"
    assert local.to("cpu").choice is local.choice  # it travels with the batch

    def second_decision(info):
        raise AssertionError("the plan chose again: the batch carries its choice")

    monkeypatch.setattr(attention, "choose_strategy", second_decision)
    kw = dict(q_heads=4, kv_heads=2, head_dim=8, dtype=torch.float32, backend="reference")
    plan = attention_plan(local, method="auto", calibration=cal, **kw)
    assert plan.choice is local.choice and plan.calibration is cal
    assert plan.method == local.choice.method
    with pytest.raises(AttributeError, match="read-only"):
        plan.choice = None
    ring = attention_plan(local, method="ring", **kw)  # the batch's own method: its choice too
    assert ring.choice is local.choice and ring.calibration.source.startswith("shipped")


def test_plan_choice_is_none_without_auto_and_the_chooser_s_answer_with_it():
    from cp_rope.parallel import CPAttentionPlan, attention_plan
    from cp_rope.parallel.cost_model import choose

    cu = torch.tensor([0, 6, 14], dtype=torch.int32)
    kw = dict(q_heads=4, kv_heads=2, head_dim=8, dtype=torch.float32)
    fixed = attention_plan(cu, 8, method="ring", window=[None, 4], **kw)
    assert fixed.choice is None and fixed.for_window(4).choice is None
    assert CPAttentionPlan.build(cu, 8, **kw, device="cpu").choice is None
    cal = _steer_allgather()
    plan = attention_plan(cu, 8, method="auto", calibration=cal, window=[None, 4], **kw)
    assert plan.choice == choose(cu.long(), cp_size=1, backend="reference", calibration=cal,
                                 **kw)
    assert plan.for_window(4).choice is plan.choice  # every variant of the batch's plan
    assert plan.for_window(4).calibration is cal
    with pytest.raises(TypeError, match="calibration must be a Calibration"):
        attention_plan(cu, 8, method="auto", calibration={"p2p_gbps": 1.0}, **kw)


def _compute_bound_allgather():
    """Constants under which a 1024 + 512 token batch at cp 2 runs best zigzag + allgather
    (slow point-to-point and all-to-all links, slow kernels); the shipped ones pick ulysses for
    its zigzag rows."""
    import dataclasses

    base = _steer_allgather()
    return dataclasses.replace(base, call_us=0.0, seg_ns=0.0, tflops={
        k: tuple(x * 1e-6 for x in v) for k, v in base.tflops.items()})


def _two_decisions_body(rank, world):
    import torch.distributed as dist

    from cp_rope.parallel import PackingCollator, attention_plan
    from cp_rope.parallel.cost_model import AutoPlacement

    group = dist.group.WORLD
    kw = dict(q_heads=4, kv_heads=2, head_dim=8, dtype=torch.float64, backend="reference")
    lens, cal = [1024, 512], _compute_bound_allgather()
    cu = torch.tensor([0, 1024, 1536], dtype=torch.int32) // world
    default = attention_plan(cu, 512, group=group, method="auto", **kw)
    steered = attention_plan(cu, 512, group=group, method="auto", calibration=cal, **kw)
    assert steered.method == steered.choice.method == "allgather", steered.choice.summary()
    assert default.method == default.choice.method == "ulysses", default.choice.summary()
    # the collator decides with the run's constants; a plan built with others keeps its pick
    auto = AutoPlacement(PackingCollator(cp_size=world, cp_rank=rank), method="auto",
                         calibration=cal, **kw)
    local = auto([{"input_ids": torch.arange(1, n + 1)} for n in lens])
    assert local.choice.placement == "zigzag", local.choice.summary()
    plan = attention_plan(local, group=group, method="auto", **kw)
    assert plan.choice is local.choice and plan.method == "allgather"


def test_the_batch_s_decision_is_the_plan_s_at_cp_2():
    from dist_utils import run_distributed

    run_distributed(_two_decisions_body, 2)


def test_step_log_reads_the_plan_s_choice():
    from cp_rope.launch.cli import parse_args
    from cp_rope.launch.cp_startup import log_auto_choice
    from cp_rope.parallel import attention_plan

    cu = torch.tensor([0, 6, 14], dtype=torch.int32)
    plan = attention_plan(cu, 8, method="auto", q_heads=4, kv_heads=2, head_dim=8,
                          dtype=torch.float32)
    lines = []
    log_auto_choice(lines.append, parse_args(["--cp-method", "auto"]), 3, plan)
    assert lines == [f"step 3 cp {plan.choice.summary()}"]
    log_auto_choice(lines.append, parse_args([]), 4, plan)  # not auto: nothing
    assert len(lines) == 1


def test_calibrate_builds_each_plan_outside_the_timed_calls(monkeypatch):
    from cp_rope.parallel import calibrate

    builds, timed = [], []
    real_plan, real_time = calibrate.attention_plan, calibrate._time
    monkeypatch.setattr(calibrate, "attention_plan",
                        lambda *a, **k: builds.append(1) or real_plan(*a, **k))
    monkeypatch.setattr(calibrate, "_time",
                        lambda fn, sync, iters: timed.append(len(builds)) or real_time(fn, sync,
                                                                                       iters))
    calibrate.measure("cpu", tokens=64, heads=2, kv_heads=1, head_dim=16, iters=3)
    # one build before each kernel timing (documents of 2, 8, 32 rows, the one-row call), none
    # inside one (the HBM copy is timed last)
    assert len(builds) == 4 and timed == [1, 2, 3, 4, 4]


def _trainer_auto_body(rank, world, tmp):
    import contextlib
    import io

    from utils import tiny_pretrain_argv

    from cp_rope.launch.pretrain import main
    from cp_rope.parallel import calibrate

    path = f"{tmp}/cal.json"
    if rank == 0:
        calibrate.save_calibration(calibrate.default_calibration("cpu"), path)
    torch.distributed.barrier()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(tiny_pretrain_argv() + ["--cp-size", "2", "--cp-method", "auto", "--cp-placement",
                                     "auto", "--steps", "2", "--cp-calibration", path,
                                     "--out-dir", f"{tmp}/run"])
    if rank == 0:
        text = out.getvalue()
        assert f"cp cost model: file {path}" in text, text
        assert "step 1 cp auto: " in text and "step 2 cp auto: " in text, text
        assert "ulysses" in text.split("cp self-test: passed")[1].split("\n")[0], text


def test_trainer_under_auto_logs_each_step_s_plan_choice(tmp_path):
    from dist_utils import run_distributed

    run_distributed(_trainer_auto_body, 2, str(tmp_path), timeout_s=300)


def test_trainers_auto_placement_prices_the_model_s_own_head_dim_and_windows():
    """finetune_hf's transformers model: AutoPlacement gets its head_dim (Gemma 3 / Qwen3 set
    one other than hidden / heads) and every layer's window, not the dense ModelConfig's."""
    from cp_rope.launch.config import ModelConfig, ParallelConfig
    from cp_rope.launch.data import placement_args
    from cp_rope.launch.memory_shapes import Shapes

    model = ModelConfig(dim=1152, n_layers=6, n_heads=4, n_kv_heads=1, ffn_hidden_dim=64)
    shapes = Shapes(dim=1152, n_layers=6, n_heads=4, n_kv_heads=1, head_dim=256, ffn=64,
                    vocab=320, windows=(512,) * 5 + (None,))
    par = ParallelConfig(cp_size=2, cp_placement="auto")
    auto = placement_args(par, model, shapes=shapes)["auto_args"]
    assert (auto["q_heads"], auto["kv_heads"], auto["head_dim"]) == (4, 1, 256)
    assert auto["window"] == [512] * 5 + [None]
    dense = placement_args(par, model)["auto_args"]
    assert (dense["head_dim"], dense["window"]) == (288, None)
    full = dataclasses.replace(shapes, windows=(None,) * 6)
    assert placement_args(par, model, shapes=full)["auto_args"]["window"] is None
    per_doc = dataclasses.replace(par, cp_placement="per_document")
    from cp_rope.parallel import default_split_threshold

    assert placement_args(per_doc, model, shapes=shapes)["split_threshold"] == \
        default_split_threshold(256, 2)
