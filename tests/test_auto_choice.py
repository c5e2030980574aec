"""Issue 30: the auto decision travels with the data (one list of methods for the start-up
self-test; the choice and the calibration on the plan, no module-level state)."""

from __future__ import annotations

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
